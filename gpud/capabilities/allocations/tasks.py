"""Each task's parties in one place: its contact record (``gpud.core.contacts``: holder, waiter, what
gpud signalled, since when it is unclaimed), its uid and owner process (``TaskOwners``, the one reader
of /proc), and the ledger's ``reachable`` fact that follows from them."""

from __future__ import annotations

from collections.abc import Callable

from gpud.core.contacts import Contacts, Waiter
from gpud.core.ledger import Allocation, Ledger
from gpud.host.owners import Kind, TaskOwners
from gpud.kit.state import ClientLink


class TaskBook:
    def __init__(self, ledger: Ledger, owners: TaskOwners, wake: Callable[[], None]) -> None:
        self.ledger = ledger
        self.owners = owners
        self.contacts: Contacts[ClientLink] = Contacts()
        self.wake = wake

    @property
    def uids(self) -> dict[str, int]:
        """Task id -> the uid that allocated it (or waits for it)."""
        return self.owners.uids

    def held(self, task_id: str) -> Allocation | None:
        """``task_id``'s allocation, running or suspended."""
        return self.ledger.get(task_id) or self.ledger.suspended_of(task_id)

    def waits(self, task_id: str) -> bool:
        """Whether ``task_id`` waits: for a connection's answer, or as a wait restored from the store."""
        return self.contacts.waiter(task_id) is not None or any(r.task_id == task_id for r in self.ledger.waiting())

    def waiter(self, task_id: str) -> Waiter[ClientLink] | None:
        return self.contacts.waiter(task_id)

    def holder(self, task_id: str) -> ClientLink | None:
        return self.contacts.holder(task_id)

    def hold(self, task_id: str, conn: ClientLink, listens: bool = True) -> None:
        """``conn`` is told of this task's preemption from now on (if it listens)."""
        self.contacts.hold(task_id, conn, listens)
        self.reach(task_id)

    def reach(self, task_id: str) -> None:
        """Whether someone can be told about ``task_id``: the core's ``reachable`` fact."""
        told = self.contacts.reachable(task_id, self.owners.alive, self.held(task_id) is not None)
        if told and task_id not in self.ledger.reachable:
            self.wake()  # someone to tell now: a drain's (or a waiter's) notice may be due at once
        if told:
            self.ledger.reachable.add(task_id)
        else:
            self.ledger.reachable.discard(task_id)

    def unheld(self, held: set[str]) -> None:
        """Tasks whose holder left: unreachable until looked at again, never preempted with nobody told."""
        for task_id in held:
            self.ledger.reachable.discard(task_id)

    def forget(self, task_id: str) -> None:
        """``task_id`` holds nothing any more."""
        self.contacts.forget(task_id)
        self.ledger.reachable.discard(task_id)
        self.settle(task_id)

    def settle(self, task_id: str) -> None:
        """A task that holds nothing and waits for nothing any more lets its owner process go."""
        if self.holds_or_waits(task_id):
            return
        self.owners.detach(task_id)
        self.owners.forget_uid(task_id)

    def holds_or_waits(self, task_id: str) -> bool:
        """Whether ``task_id`` holds devices, is suspended, or waits (for a connection or in the store)."""
        return (
            self.contacts.waiter(task_id) is not None
            or self.ledger.get(task_id) is not None
            or self.owners.kind(task_id) in (Kind.ALLOCATION, Kind.WAIT)
        )
