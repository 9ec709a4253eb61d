"""Who owns each allocation: its uid, and its owner process held by pidfd; what one uid holds.

An owner pid a client sends is a claim: ``claim`` reads the process from /proc, has
``gpud.core.owners`` judge it, and holds it (``gpud.host.procs``) so that what gpud later
signals or reaps is that very process, never a reuse of its pid. A process is held once,
however many tasks it owns (20 000 fractional allocations of one owner are one pidfd).

It also counts, per uid, the allocations, the waits and the records the store keeps, changed
only as the store's records change (``recorded``), so that a cap is checked without a walk.
Nothing here decides placement or preemption; it never signals a process it does not hold.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from enum import Enum

import structlog

from gpud.core.errors import Refused
from gpud.core.ledger import TaskRecord
from gpud.core.owners import check_owner
from gpud.host.procs import KERNEL, Held, Procs, Signals
from gpud_client.protocol import ErrorCode

log = structlog.get_logger(__name__)


class Kind(Enum):
    ALLOCATION = "allocation"  # devices held now, or suspended (held again when they come back)
    WAIT = "wait"
    RECORD = "record"  # only the task's history (its preemptions, whether it resumes)


def kind_of(rec: TaskRecord) -> Kind:
    if rec.allocation is not None or rec.suspended is not None:
        return Kind.ALLOCATION
    return Kind.WAIT if rec.waiting is not None else Kind.RECORD


class TaskOwners:
    def __init__(self, signals: Signals, host: Procs = KERNEL) -> None:
        self.signals = signals
        self.host = host  # the kernel's word (a simulation passes its own process table)
        self.daemon_pid = os.getpid()
        self.uids: dict[str, int] = {}  # task id -> the uid whose record it is (the store's); read only
        self._by_uid: dict[int, set[str]] = {}
        self._kinds: dict[str, Kind] = {}
        self._counts: Counter[tuple[int, Kind]] = Counter()
        self._held: dict[str, Held] = {}  # task id -> its owner process
        self._tasks: dict[Held, set[str]] = {}  # a held process -> the tasks it owns
        self._by_pid: dict[int, Held] = {}
        self._starts: dict[str, int] = {}  # task id -> its owner's start time, held or not (the store's)
        self._orphans: set[str] = set()  # restored tasks whose owner was gone: for the next reap

    # --- uids and counts ------------------------------------------------------

    def recorded(self, task_id: str, rec: TaskRecord | None, uid: int | None) -> None:
        """The store now holds ``rec`` for ``task_id`` (None: nothing), recorded for ``uid``."""
        old_kind, old_uid = self._kinds.pop(task_id, None), self.uids.get(task_id)
        if old_kind is not None and old_uid is not None:
            self._counts[(old_uid, old_kind)] -= 1
        if rec is None or uid is None:
            return
        kind = kind_of(rec)
        self._kinds[task_id] = kind
        self.set_uid(task_id, uid)
        self._counts[(uid, kind)] += 1

    def set_uid(self, task_id: str, uid: int) -> None:
        """``task_id`` is ``uid``'s (recorded, or waiting)."""
        old = self.uids.get(task_id)
        if old is not None and old != uid:
            self._by_uid[old].discard(task_id)
        self.uids[task_id] = uid
        self._by_uid.setdefault(uid, set()).add(task_id)

    def forget_uid(self, task_id: str) -> None:
        if task_id not in self._kinds and (uid := self.uids.pop(task_id, None)) is not None:
            self._by_uid[uid].discard(task_id)

    def tasks_of(self, uid: int) -> set[str]:
        """The task ids of ``uid`` (at most its caps' worth: no walk over everybody's)."""
        return self._by_uid.get(uid, set())

    def kind(self, task_id: str) -> Kind | None:
        """What the store holds of ``task_id`` (None: nothing)."""
        return self._kinds.get(task_id)

    def count(self, uid: int, kind: Kind | None = None) -> int:
        """How many of ``uid``'s records are of ``kind`` (None: all its records)."""
        if kind is not None:
            return self._counts[(uid, kind)]
        return sum(self._counts[(uid, k)] for k in Kind)

    # --- owner processes ---------------------------------------------------------

    def claim(self, conn_pid: int, conn_uid: int, pid: int, *, any_uid: bool = False) -> Held:
        """The process ``pid`` held for a caller that names it as an owner; refused (``Refused``,
        nothing held) unless the kernel says the caller may name it."""
        existing = self._by_pid.get(pid)
        facts = self.host.read_facts(pid)
        check_owner(
            pid,
            facts,
            self.host.ancestry(pid) if facts is not None else [pid],
            self.host.caller(conn_pid, conn_uid),
            daemon_pid=self.daemon_pid,
            any_uid=any_uid,
        )
        if existing is not None and existing.alive() and (facts is None or existing.start == facts.start):
            return existing
        held = self.host.hold(pid, facts)
        if held is None:
            raise Refused(ErrorCode.PERMISSION_DENIED, f"owner pid {pid} exited before gpud could hold it")
        if held.uid is None:
            held.uid = conn_uid  # the connecting process itself (see check_owner): SO_PEERCRED's word
        return held

    def restore(self, task_id: str, pid: int, uid: int, start: int | None) -> None:
        """Hold again, after a restart, the owner a stored record names: only the process that
        has its stored start time, or (no start time stored) one of the record's uid. An owner that
        is gone, or whose pid another process has now, is an orphan: the next reap takes the task
        back. One that exists but cannot be told apart (/proc hidden from gpud) is not held: it is
        never signalled, and held again when it asks for its allocation again (``claim``)."""
        if start is not None:
            self._starts[task_id] = start
        held = self._by_pid.get(pid)
        if held is None or not held.alive():
            facts = self.host.read_facts(pid)
            if facts is None:
                probe = self.host.hold(pid, None) if pid > 1 and pid != self.daemon_pid else None
                if probe is None:
                    self._orphans.add(task_id)  # no such process
                else:
                    probe.close()
                return
            if facts.kthread or pid <= 1 or pid == self.daemon_pid:
                self._orphans.add(task_id)
                return
            held = self.host.hold(pid, facts)
            if held is None:
                self._orphans.add(task_id)
                return
            held.uid = facts.ruid if uid not in (facts.ruid, facts.suid) else uid
        if (held.start != start) if start is not None else (held.uid != uid):
            if held not in self._tasks:
                held.close()
            self._orphans.add(task_id)  # its pid was reused (a later start), or another uid's process has it
            return
        self.attach(task_id, held)

    def attach(self, task_id: str, held: Held) -> None:
        if self._held.get(task_id) is held:
            return
        self.detach(task_id)
        self._held[task_id] = held
        self._tasks.setdefault(held, set()).add(task_id)
        self._by_pid[held.pid] = held
        if held.start is not None:
            self._starts[task_id] = held.start
        self._orphans.discard(task_id)

    def detach(self, task_id: str) -> None:
        self._starts.pop(task_id, None)
        self._orphans.discard(task_id)
        held = self._held.pop(task_id, None)
        if held is None:
            return
        tasks = self._tasks[held]
        tasks.discard(task_id)
        if not tasks:
            del self._tasks[held]
            if self._by_pid.get(held.pid) is held:
                del self._by_pid[held.pid]
            held.close()

    def unused(self, held: Held) -> None:
        """A process claimed for a request that was refused: let it go unless it owns a task."""
        if held not in self._tasks:
            held.close()

    def owner(self, task_id: str) -> Held | None:
        return self._held.get(task_id)

    def start_of(self, task_id: str) -> int | None:
        """The owner's start time the store keeps for ``task_id`` (also while it is not held)."""
        return self._starts.get(task_id)

    def owned_by(self, pids: list[int]) -> list[set[str]]:
        """For each of ``pids`` (a session's process and its ancestors), the tasks it owns alive."""
        out = []
        for pid in pids:
            held = self._by_pid.get(pid)
            out.append(set(self._tasks.get(held, ())) if held is not None and held.alive() else set())
        return out

    def alive(self, task_id: str) -> bool:
        held = self._held.get(task_id)
        return held is not None and held.alive()

    def orphaned(self) -> list[str]:
        """Tasks whose owner process has exited (one poll over every held process), and restored
        ones whose owner was gone."""
        dead = [t for h in self.host.dead(self._tasks) for t in sorted(self._tasks.get(h, ()))]
        return sorted(self._orphans) + dead  # (an orphan stays one until its task lets go: ``detach``)

    def signal(self, task_id: str, sig: signal.Signals, why: str) -> bool:
        """Signal ``task_id``'s owner, if gpud holds it; logged and counted."""
        held = self._held.get(task_id)
        return held is not None and self.signals.send(held, sig, task_id=task_id, why=why)
