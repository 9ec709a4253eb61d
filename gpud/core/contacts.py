"""Whom gpud tells about a task, and how: one record per task, and the rules of telling.

A task id has, besides its allocation (the ledger's) and its owner process (held by the host's
``TaskOwners``), the parties gpud may speak to about it:

- its **holder**: the connection that allocated it (or asked for it again) and listens, told of
  a notice, its withdrawal, a take-back, a shrink, a growth or a resume by a message;
- its **waiter**: the connection waiting for the ALLOCATED answer (request id, since when, and
  whether it will listen once served);
- whether gpud **signalled** its owner process to leave (SIGTERM) because no one held it: then
  the end of the grace is a SIGKILL, as Kubernetes ends a pod;
- a wait restored from the store and served while its client was away is **unclaimed** from
  then: released after the crash grace unless its client or its owner comes back.

The rules (``Contacts``' methods and ``tell_of_notice``) decide whom to tell and whom to signal,
and when; the shell sends the messages and the signals. Generic in the connection type, so the
rules are tested with plain tokens. No clock: ``now`` is given.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

H = TypeVar("H", bound=Hashable)  # a connection, as the shell knows it


class Tell(Enum):
    """Who hears of a notice to give GPUs back."""

    HOLDER = "holder"  # its holder, by a PREEMPT message
    OWNER = "owner"  # no one holds it and it must leave: its owner process, by SIGTERM
    NOBODY = "nobody"  # a partial notice with no one listening: the take-back at its deadline says it


@dataclass(slots=True)
class Waiter(Generic[H]):
    conn: H
    rid: int  # the ALLOCATE request's id, answered when the wait ends
    since: int
    listens: bool  # its client listens for PREEMPT once served (ALLOCATE's ``notify``)


@dataclass(slots=True)
class Contact(Generic[H]):
    holder: H | None = None
    waiter: Waiter[H] | None = None
    signalled: bool = False
    unclaimed_since: int | None = None

    def empty(self) -> bool:
        return self.holder is None and self.waiter is None and not self.signalled and self.unclaimed_since is None


@dataclass(frozen=True, slots=True)
class TakeBackSaid(Generic[H]):
    """What the shell does when an allocation was taken back whole (not shrunk)."""

    holder: H | None  # told by ALLOC_REVOKED
    kill: bool  # its owner was sent SIGTERM at the notice and the grace is over: SIGKILL


def tell_of_notice(holder: object | None, whole: bool) -> Tell:
    """A notice goes to the holder; with none, a notice to leave altogether goes to the owner
    process (gpud signals only a process it holds: the shell's ``TaskOwners`` says whether it did)."""
    if holder is not None:
        return Tell.HOLDER
    return Tell.OWNER if whole else Tell.NOBODY


class Contacts(Generic[H]):
    """The contact records of every task with one, and which tasks each connection holds or waits for."""

    def __init__(self) -> None:
        self._tasks: dict[str, Contact[H]] = {}
        self._held_by: dict[H, set[str]] = {}
        self._waits_of: dict[H, set[str]] = {}
        self._unclaimed: set[str] = set()

    def _entry(self, task_id: str) -> Contact[H]:
        entry = self._tasks.get(task_id)
        if entry is None:
            entry = self._tasks[task_id] = Contact()
        return entry

    def _tidy(self, task_id: str, entry: Contact[H]) -> None:
        if entry.empty():
            del self._tasks[task_id]

    # --- reading ---------------------------------------------------------------

    def get(self, task_id: str) -> Contact[H] | None:
        return self._tasks.get(task_id)

    def holder(self, task_id: str) -> H | None:
        entry = self._tasks.get(task_id)
        return None if entry is None else entry.holder

    def waiter(self, task_id: str) -> Waiter[H] | None:
        entry = self._tasks.get(task_id)
        return None if entry is None else entry.waiter

    def signalled(self, task_id: str) -> bool:
        entry = self._tasks.get(task_id)
        return entry is not None and entry.signalled

    def waiters(self) -> Iterator[tuple[str, Waiter[H]]]:
        """Every task that waits for an answer, with its waiter (a walk: for checks and caps)."""
        for conn_tasks in self._waits_of.values():
            for task_id in conn_tasks:
                entry = self._tasks[task_id]
                assert entry.waiter is not None
                yield task_id, entry.waiter

    def holders(self) -> Iterator[tuple[str, H]]:
        """Every task that has a holder, with it (a walk: for checks)."""
        for conn, tasks in self._held_by.items():
            for task_id in tasks:
                yield task_id, conn

    def holds(self, conn: H) -> set[str]:
        return self._held_by.get(conn, set())

    # --- waits -----------------------------------------------------------------

    def wait(self, task_id: str, conn: H, rid: int, since: int, listens: bool) -> None:
        """``conn`` waits for ``task_id``'s answer (its request ``rid``)."""
        self.take_waiter(task_id)
        entry = self._entry(task_id)
        entry.waiter = Waiter(conn, rid, since, listens)
        self._waits_of.setdefault(conn, set()).add(task_id)
        self._claimed(task_id, entry)

    def take_waiter(self, task_id: str) -> Waiter[H] | None:
        """The wait of ``task_id`` ends (answered or withdrawn): its waiter, if a connection waits."""
        entry = self._tasks.get(task_id)
        if entry is None or entry.waiter is None:
            return None
        waiter, entry.waiter = entry.waiter, None
        tasks = self._waits_of[waiter.conn]
        tasks.discard(task_id)
        if not tasks:
            del self._waits_of[waiter.conn]
        self._tidy(task_id, entry)
        return waiter

    def served(self, task_id: str, now: int) -> Waiter[H] | None:
        """The ledger served ``task_id``'s wait: its waiter, who holds it from now on (if it listens);
        with none (a wait restored from the store), it is unclaimed from ``now`` (see ``unclaimed``)."""
        waiter = self.take_waiter(task_id)
        if waiter is None:
            entry = self._entry(task_id)
            entry.unclaimed_since = now
            self._unclaimed.add(task_id)
            return None
        self.hold(task_id, waiter.conn, waiter.listens)
        return waiter

    # --- holders ---------------------------------------------------------------

    def hold(self, task_id: str, conn: H, listens: bool = True) -> None:
        """``conn`` has ``task_id`` (allocated it, or asked for it again): told of what happens to it
        from now on if it listens, instead of whoever held it before."""
        entry = self._entry(task_id)
        before = entry.holder
        if before is not None and (before is not conn or not listens):
            entry.holder = None
            self._held_by[before].discard(task_id)
        if listens:
            entry.holder = conn
            self._held_by.setdefault(conn, set()).add(task_id)
        self._claimed(task_id, entry)
        self._tidy(task_id, entry)

    def closed(self, conn: H) -> tuple[list[str], set[str]]:
        """``conn`` is gone: the tasks it waited for (their waits end) and those it held (no one to
        tell of them until someone holds them again)."""
        waits = sorted(self._waits_of.get(conn, ()))
        for task_id in waits:
            self.take_waiter(task_id)
        held = self._held_by.pop(conn, set())
        for task_id in held:
            entry = self._tasks[task_id]
            entry.holder = None
            self._tidy(task_id, entry)
        return waits, held

    def forget(self, task_id: str) -> None:
        """``task_id`` holds nothing any more: no holder, nothing signalled, nothing unclaimed (a wait
        it has, being asked for again, stays)."""
        entry = self._tasks.get(task_id)
        if entry is None:
            return
        if entry.holder is not None:
            self._held_by[entry.holder].discard(task_id)
            entry.holder = None
        entry.signalled = False
        self._claimed(task_id, entry)
        self._tidy(task_id, entry)

    def _claimed(self, task_id: str, entry: Contact[H]) -> None:
        entry.unclaimed_since = None
        self._unclaimed.discard(task_id)

    # --- telling and signalling --------------------------------------------------

    def reachable(self, task_id: str, owner_alive: Callable[[str], bool], holds: bool) -> bool:
        """Whether someone can be told about ``task_id`` (the ledger's ``reachable``): its holder, or,
        while it holds devices, its owner process alive (which gpud may signal)."""
        return self.holder(task_id) is not None or (holds and owner_alive(task_id))

    def notice(self, task_id: str, whole: bool) -> tuple[Tell, H | None]:
        """A notice for ``task_id``: whom to tell (and the holder, when it is the holder)."""
        holder = self.holder(task_id)
        return tell_of_notice(holder, whole), holder

    def owner_signalled(self, task_id: str) -> None:
        """gpud sent its owner SIGTERM (no one held it): its grace ends in SIGKILL unless withdrawn."""
        self._entry(task_id).signalled = True

    def withdrawn(self, task_id: str) -> H | None:
        """The notice for ``task_id`` was withdrawn: its owner, if signalled, may stay; its holder to tell."""
        entry = self._tasks.get(task_id)
        if entry is None:
            return None
        entry.signalled = False
        holder = entry.holder
        self._tidy(task_id, entry)
        return holder

    def taken_back(self, task_id: str, gone: bool) -> TakeBackSaid[H]:
        """``task_id``'s devices were taken back whole: suspended (``gone`` False: it comes back) or ended.
        An ended one is forgotten; its owner is killed if gpud told it to leave and it has not."""
        said = TakeBackSaid(self.holder(task_id), gone and self.signalled(task_id))
        if gone:
            self.forget(task_id)
        return said

    def unclaimed(self, now: int, grace_us: int, alive: Callable[[str], bool]) -> list[str]:
        """Restored waits served while their client was away, unclaimed for ``grace_us`` with no holder
        and no live owner: to release."""
        due = []
        for task_id in sorted(self._unclaimed):
            entry = self._tasks[task_id]
            assert entry.unclaimed_since is not None
            if now - entry.unclaimed_since >= grace_us and entry.holder is None and not alive(task_id):
                due.append(task_id)
        return due
