"""The ledger's changes made durable: each stored before anything of it is answered or carried out, or
rolled back; and what the store holds put back at start."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gpud.capabilities.allocations.tasks import TaskBook
from gpud.core.errors import Refused
from gpud.core.ledger import Checkpoint, Ledger, TaskRecord
from gpud.host.metrics import Metrics
from gpud.host.procs import Held
from gpud.host.store import Store, StoreError
from gpud.kit.faults import Faults
from gpud.kit.state import GpuSlot
from gpud_client import protocol as p

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class Durable:
    ledger: Ledger
    store: Store
    book: TaskBook
    metrics: Metrics
    faults: Faults
    clock: Callable[[], int]
    wake: Callable[[], None]
    retry_at: int | None = None  # the store failed a tick's change: when to try it again

    def sync(
        self,
        cp: Checkpoint,
        refusal: str,
        uids: dict[str, int] | None = None,
        owner: Held | None = None,
        *,
        draining: bool = False,
    ) -> None:
        """Store what one ledger change changed (every task whose record differs, the allocations
        it served included: a new task's uid is in ``uids``, its owner process ``owner``); when the
        store cannot, roll the ledger back to ``cp`` and refuse with ``store_failed``."""
        uids = uids or {}
        put, delete = self.ledger.changed_records()
        if not put and not delete and not draining:
            return
        owners = self.book.owners
        rows = [(r, uids.get(t, owners.uids.get(t, 0))) for t, r in put.items()]
        starts = {t: owner.start for t in uids} if owner is not None else {}
        starts.update({t: owners.start_of(t) for t in put if t not in starts})
        try:
            self.store.write(
                put=rows, delete=delete, draining=self.ledger.draining() if draining else None, starts=starts
            )
        except StoreError as exc:
            self.ledger.rollback(cp)
            self.metrics.node.store_failures.inc()
            self.faults.often("store_failed", refused=refusal, error=str(exc))
            raise Refused(p.ErrorCode.STORE_FAILED, f"{refusal}: the store could not record it ({exc})") from None
        self._stored(put, delete, rows, owner, uids)
        if (due := self.ledger.next_deadline()) is not None and due <= self.clock():
            self.wake()  # the change left work for later turns (notices in batches): the timer goes on at once

    def _stored(
        self,
        put: dict[str, TaskRecord],
        delete: set[str],
        rows: list[tuple[TaskRecord, int]],
        owner: Held | None,
        uids: dict[str, int],
    ) -> None:
        """The store took a change: what it holds, whose it is, and who owns what follow it."""
        self.ledger.mark_stored()
        book, owners = self.book, self.book.owners
        for rec, uid in rows:
            owners.recorded(rec.task_id, rec, uid)
        for t in delete:
            owners.recorded(t, None, None)
        for t in uids:
            if owner is not None and (t in put or book.waiter(t) is not None):
                owners.attach(t, owner)
        for t in [*put, *delete]:
            if not book.holds_or_waits(t) and not book.contacts.signalled(t):  # (SIGKILLed at its grace's end)
                owners.detach(t)  # nothing of it holds devices or waits any more
                owners.forget_uid(t)

    # --- at start -------------------------------------------------------------------

    def restore(self, slots: list[GpuSlot]) -> None:
        """Put back what the store holds; a record that cannot be used any more is set aside
        (kept in the store's set_aside table with the reason), never a reason to stop."""
        loaded = self.store.load()
        now = self.clock()
        owners = self.book.owners
        for task_id, reason in loaded.unreadable:
            self.set_aside(task_id, f"unreadable record: {reason}")
        restored: Counter[str] = Counter()
        for rec, uid in loaded.records:
            try:
                self.ledger.restore_record(rec, now)
            except (ValueError, Refused) as exc:  # the node shrank, or the record contradicts another
                self.set_aside(rec.task_id, str(exc))
                continue
            restored[_restored_as(rec)] += 1
            owners.recorded(rec.task_id, rec, uid)
            owner = rec.allocation or rec.suspended or rec.waiting
            if owner is not None and owner.owner_pid is not None:
                owners.restore(rec.task_id, owner.owner_pid, uid, loaded.starts.get(rec.task_id))
        for gpu in loaded.draining:
            if gpu < len(slots):
                self.ledger.drain(gpu, True, now)
                slots[gpu].draining = True
        self.ledger.mark_stored()  # as restored (times brought within reach: no need to write them)
        for task_id in owners.uids:
            self.book.reach(task_id)
        if restored:  # history alone is no allocation: named apart
            log.info(
                "allocations_restored",
                count=restored["allocation"],
                suspended=restored["suspended"],
                waits=restored["wait"],
                history=restored["history"],
                path=self.store.path,
            )

    def set_aside(self, task_id: str, reason: str) -> None:
        log.error(
            "allocation_set_aside",
            task_id=task_id,
            reason=reason,
            path=self.store.path,
            hint="kept in the set_aside table of the store; gpud runs without it",
        )
        self.metrics.node.store_records_set_aside.inc()
        try:
            self.store.set_aside(task_id, reason)
        except StoreError as exc:
            log.error("store_failed", task_id=task_id, error=str(exc))


def _restored_as(rec: TaskRecord) -> str:
    """What a stored record puts back: an allocation, a suspended one, a wait, or only the preemption
    history of a task that ended (its next allocation hears of it)."""
    if rec.allocation is not None:
        return "allocation"
    if rec.suspended is not None:
        return "suspended"
    return "wait" if rec.waiting is not None else "history"
