"""Allocations whose owner process died taken back, and restored waits nobody claimed released: in
batches, one store write a batch, so that no loop turn grows with how many there are."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from gpud.capabilities.allocations.durable import Durable
from gpud.capabilities.allocations.tasks import TaskBook
from gpud.capabilities.allocations.telling import Telling
from gpud.core.errors import Refused
from gpud.core.ledger import Allocation, Ledger
from gpud.kit.effects import Effects
from gpud.kit.faults import Faults
from gpud_client import protocol as p

log = structlog.get_logger(__name__)
REAP_BATCH = 64  # dead owners' allocations released per store write and loop turn (see reap)
REACH_BATCH = 1024  # tasks whose holder left looked at per loop turn (see unheld)


@dataclass(eq=False)
class Reaper:
    ledger: Ledger
    book: TaskBook
    durable: Durable
    telling: Telling
    effects: Effects
    faults: Faults
    withdraw_wait: Callable[[str, int], None]
    wake: Callable[[], None]
    crash_grace_us: int  # (replaced on reconfigure)
    # dead owners' tasks still to release, and tasks whose holder left (reachable still?): a batch a turn
    _reaping: deque[str] = field(default_factory=deque, init=False)
    _unreached: deque[str] = field(default_factory=deque, init=False)

    @property
    def busy(self) -> bool:
        """Dead owners' allocations are still being released (or tasks whose holder left looked
        at again), a batch a turn."""
        return bool(self._reaping or self._unreached)

    def unheld(self, held: set[str]) -> None:
        """A connection that held ``held`` closed: whether each task's owner can be told instead, at
        once for a few, else a batch a turn (a client may hold thousands)."""
        self.book.unheld(held)
        if len(held) <= REACH_BATCH:
            for task_id in held:
                self.book.reach(task_id)
        else:
            self._unreached.extend(sorted(held))
            self.wake()

    def reap(self, now: int) -> None:
        """Reclaim allocations whose owner process is gone (and restored waits served while their
        client was away that nobody claimed within ``crash_grace_s``): at most REAP_BATCH a call,
        in one ledger change and one store write; the timer calls again at once while some are
        left. A batch the store cannot record is tried again at the next call; one record's fault
        skips only it."""
        if not self._reaping:
            owners = self.book.owners
            self._reaping.extend(owners.orphaned())
            self._reaping.extend(self.book.contacts.unclaimed(now, self.crash_grace_us, owners.alive))
        self.reap_more(now)

    def reap_more(self, now: int) -> None:
        """The next batch of what ``reap`` found, and of tasks whose holder left."""
        book = self.book
        for _ in range(min(REACH_BATCH, len(self._unreached))):
            book.reach(self._unreached.popleft())
        batch = [self._reaping.popleft() for _ in range(min(REAP_BATCH, len(self._reaping)))]
        held = []
        for task_id in batch:  # a wait (rare) is withdrawn on its own, with its own store write
            if book.owners.alive(task_id):
                continue  # its owner asked for it again meanwhile (see Allocations' claim_again)
            if book.held(task_id):
                held.append(task_id)
            elif book.waits(task_id):
                self.telling.answer_error(task_id, p.ErrorCode.INSUFFICIENT, "its owner process exited while it waited")
                self.withdraw_wait(task_id, now)
            else:
                book.settle(task_id)
        cp = self.ledger.checkpoint()
        effects, released = [], []
        for task_id in held:
            try:
                alloc = book.held(task_id)
                assert alloc is not None
                effects += self.ledger.release(task_id, now)[1]
                released.append(alloc)
            except Exception as exc:
                self.faults.record("reaper", exc, task_id=task_id)
        if not released:
            return
        try:
            self.durable.sync(cp, f"{len(released)} allocations of dead owners were not reclaimed")
        except Refused:  # logged by sync; the next reap tries them again
            self._reaping.extendleft(reversed([a.task_id for a in released]))
            return
        for alloc in released:
            book.forget(alloc.task_id)
        by_owner: dict[int | None, list[Allocation]] = {}
        for alloc in released:
            by_owner.setdefault(alloc.owner_pid, []).append(alloc)
        for pid, allocs in by_owner.items():
            tasks = [a.task_id for a in allocs]
            log.warning("allocations_reaped", owner_pid=pid, count=len(tasks), task_ids=tasks[:8])
        self.effects.carry_out(effects, now)
