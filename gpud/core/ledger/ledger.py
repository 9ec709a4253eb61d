"""The allocation ledger: whole and fractional GPUs and CPU cores per task id, taken back by notice.

How: ``Ledger`` is the one object the shell calls. Its state is one ``LedgerState``
(``gpud.core.ledger.state``); each call sequences the rules, which are functions over that state,
one module per family a user knows:
- ``placement``: validation, placing, tenants and quotas, choosing GPUs and CPU cores;
- ``waits``: the queue, serving waiters, suspended allocations waiting for their GPUs, expiry;
- ``takeback``: who may be taken back (the one rule), why not, choosing and telling victims;
- ``notices``: notices, their grace, withdrawal, the rest after it, GPUs kept for a waiter;
- ``recovery``: carrying out a notice: gone, shrunk or suspended; the preemption history;
- ``elastic``: growing into free GPUs, giving back what idles; ``drain``: GPUs out of service;
- ``records``: what is durable, what changed since it was stored, restoring it.

Rules kept here:
- A refused call raises ``Refused`` (the request is wrong), ``LimitReached`` (one wait too many) or
  ``Insufficient`` (the node is too full, with what was in the way) and changes nothing.
- ``checkpoint`` / ``rollback``: the shell takes a checkpoint before a change and rolls back to it
  when the change cannot be stored, so the ledger is exactly what it was, waiters that the change
  would have served included. Both cost what the change changed, not what the ledger holds, and so
  do ``changed_records`` and every call but the walks ``records``, ``allocations`` and
  ``suspended``: one release among 20 000 allocations costs what it costs among 10.
- Each call tells, withdraws and carries out at most ``NOTICE_BATCH`` notices in all (a whole GPU
  of 10 000 fractions is told over many calls); ``next_deadline`` answers the last ``advance``'s
  time while some are left, so the shell's timer calls again at once. It is never a time
  ``advance`` has already passed with nothing to do there.
- The same task id twice is the same allocation when it asks for the same terms, and is refused,
  naming each difference, when it does not (``model.check_same_terms``); one request per task id
  waits at a time. A request that may wait and does not fit waits; ``advance`` finds victims for it.

Never: keep state outside ``self.state`` (a checkpoint would miss it); decide what a rule module
decides. Pure: no clock, no storage; time is integer microseconds passed in.
"""

from __future__ import annotations

from itertools import islice

from msgspec import structs

import gpud.core.ledger.drain as drain
import gpud.core.ledger.elastic as elastic
import gpud.core.ledger.notices as notices
import gpud.core.ledger.placement as placement
import gpud.core.ledger.records as records
import gpud.core.ledger.recovery as recovery
import gpud.core.ledger.takeback as takeback
import gpud.core.ledger.waits as waits
from gpud.core.errors import LimitReached, Refused
from gpud.core.ledger.model import (
    IDLE,
    NOTICE_BATCH,
    UNIT,
    Allocation,
    GpuSpec,
    Insufficient,
    LedgerEffect,
    Notice,
    PreemptionConfig,
    Request,
    TaskRecord,
    TenantQuota,
    Waiter,
    check_same_terms,
    terms,
)
from gpud.core.ledger.state import Checkpoint, LedgerState, checkpoint, new_state, rollback
from gpud.core.shields import Shield
from gpud_client.protocol import ErrorCode


class Ledger:
    def __init__(
        self,
        gpus: list[GpuSpec],
        cpus: list[int],
        *,
        cpu_numa: dict[int, int] | None = None,
        tenants: dict[str, TenantQuota] | None = None,
        seed: int = 0,
        max_waiters: int = 256,
        preemption: PreemptionConfig | None = None,
    ) -> None:
        self.state: LedgerState = new_state(
            gpus,
            cpus,
            cpu_numa=cpu_numa or {},
            tenants=tenants or {},
            seed=seed,
            max_waiters=max_waiters,
            preemption=preemption or PreemptionConfig(),
        )

    @property
    def preemption(self) -> PreemptionConfig:
        return self.state.preemption

    @preemption.setter
    def preemption(self, config: PreemptionConfig) -> None:
        self.state.preemption = config

    @property
    def reachable(self) -> set[str]:
        """The shell's fact: the task ids someone can be told about (a live holder, or an owner pid
        gpud may signal). Only those are ever taken back for a waiter."""
        return self.state.reachable

    @reachable.setter
    def reachable(self, task_ids: set[str]) -> None:
        self.state.reachable = task_ids

    # --- calls ------------------------------------------------------------

    def allocate(self, req: Request, now: int, *, rejoin: bool = False) -> Allocation | None:
        """The allocation, or None if the request now waits (``wait_us`` > 0; ``advance`` then
        looks for victims that would let it fit).

        Raises Refused for a wrong request and Insufficient when it does not
        fit and may not wait; either way nothing changed. ``rejoin``: the task's wait (restored
        from the store, its connection gone) is the caller's now, with the same terms."""
        st = self.state
        if (held := st.allocs.get(req.task_id)) is not None:
            check_same_terms(req, terms(held), "holds")
            return held
        if (waiter := st.waiting.get(req.task_id)) is not None:
            check_same_terms(req, terms(waiter.suspended or waiter.request), "waits for")
            if waiter.suspended is not None or rejoin:  # its holder again, or a wait whose connection is gone
                return None
            raise Refused(
                ErrorCode.INVALID,
                f"task {req.task_id!r} already waits for this allocation: one request "
                "per task id waits at a time, and the first is answered when it fits",
            )
        placement.validate(st, req)
        try:
            return placement.place(st, req, now)
        except Insufficient as short:
            if req.wait_us <= 0:
                raise takeback.explained(st, short, req, now) from None
            if len(st.waiting) >= st.max_waiters:
                raise LimitReached(
                    "max_allocation_waiters", f"{short.message}, and {len(st.waiting)} requests already wait"
                ) from None
            waits.enqueue(st, Waiter(req, now + req.wait_us, now, seq=st.seq + 1), short)
            return None

    def release(self, task_id: str, now: int) -> tuple[Allocation | None, list[LedgerEffect]]:
        """Free a task's allocation and serve waiters that now fit, or withdraw its wait (and the
        notices it caused, a batch now and the rest by ``advance``). An allocation freed under a
        notice counts as that preemption done."""
        st = self.state
        st.budget.left = NOTICE_BATCH
        alloc = st.allocs.get(task_id)
        if alloc is None:
            return None, waits.unwait(st, task_id, now) if task_id in st.waiting else []
        return alloc, recovery.released(st, alloc, now)

    def yield_(self, task_id: str, now: int) -> list[LedgerEffect]:
        """The holder of a notice did what it asked: carry it out now."""
        st = self.state
        if task_id not in st.notices:
            what = "has no allocation" if task_id not in st.allocs else "was not asked to leave"
            raise Refused(ErrorCode.INVALID, f"task {task_id!r} {what}: there is nothing to yield")
        st.budget.left = NOTICE_BATCH
        return recovery.yielded(st, task_id, now)

    def protect(self, task_id: str, protected: bool) -> Allocation:
        """An admin's protection: a protected allocation is never chosen as a victim (a notice it
        already has stands)."""
        st = self.state
        alloc = st.allocs.get(task_id)
        if alloc is None:
            raise Refused(ErrorCode.UNKNOWN_TASK, f"no allocation for task {task_id!r} (see gpuctl allocs)")
        alloc = structs.replace(alloc, protected=protected)
        st.allocs[task_id] = alloc
        return alloc

    def drain(self, gpu: int, on: bool, now: int) -> list[LedgerEffect]:
        """Drain a GPU (no new grants; ``advance`` tells its allocations to leave, a batch at a time)
        or put it back, withdrawing the drain's notices that still run (a batch now, the rest by
        ``advance``) but those of allocations another of whose GPUs drains."""
        return drain.set_draining(self.state, gpu, on, now)

    def checkpoint(self) -> Checkpoint:
        """A moment to ``rollback`` to if a change cannot be stored. From now on the journal saves
        the old value of whatever changes; a newer checkpoint supersedes this one."""
        return checkpoint(self.state)

    def rollback(self, cp: Checkpoint) -> None:
        """Back to exactly the state of ``cp`` (ValueError: a newer checkpoint superseded it), in
        what changed since."""
        rollback(self.state, cp)

    def restore(self, alloc: Allocation) -> None:
        """Put back an allocation read from the store at start-up (ValueError: it cannot be)."""
        records.restore(self.state, alloc)

    def restore_record(self, rec: TaskRecord, now: int) -> None:
        """Put back one stored task (``records``' counterpart; ValueError: it cannot be). Times
        from before a reboot (monotonic time started again) are brought within reach of ``now``."""
        records.restore_record(self.state, rec, now)

    def records(self, before: dict[str, TaskRecord] | None = None) -> dict[str, TaskRecord]:
        """Everything durable, per task id (a walk over all; after a change, ``changed_records``)."""
        return records.records(self.state, before)

    def changed_records(self) -> tuple[dict[str, TaskRecord], set[str]]:
        """What to store since the last ``mark_stored``: the records that may differ from the
        stored ones, and the task ids that have none now."""
        return records.changed_records(self.state)

    def mark_stored(self) -> None:
        """The shell stored ``changed_records``: nothing differs from the store now."""
        self.state.changed.clear()

    def reconfigure(
        self, *, tenants: dict[str, TenantQuota], max_waiters: int, preemption: PreemptionConfig | None = None
    ) -> None:
        """New tenant quotas, waiter cap and preemption settings (a reload): they apply from now on."""
        st = self.state
        st.tenants = dict(tenants)
        st.max_waiters = max_waiters
        if preemption is not None:
            st.preemption = preemption

    def advance(self, now: int) -> list[LedgerEffect]:
        """Carry out notices whose grace ended, expire waiters whose deadline passed, withdraw
        notices nobody needs, tell allocations on draining GPUs to leave, grow elastic allocations,
        find victims for waiters that do not fit and tell them: at most ``NOTICE_BATCH`` notices
        told, withdrawn or carried out in all, the rest at the next call."""
        st = self.state
        st.budget.left = NOTICE_BATCH
        effects: list[LedgerEffect] = waits.serve(st, now) if st.serving else []
        st.advanced_to = max(st.advanced_to, now)
        if st.notices:  # (each step is called only when it may have something to do: the common call has none)
            effects += recovery.carry_out_due(st, now)
        if st.waiting:
            effects += waits.expire(st, now)
        if st.immune:
            notices.forget_rests(st, now)
        if st.index.told or st.withdrawing:
            effects += notices.withdraw_left(st, now)
        if st.undraining:
            effects += drain.undrain(st, now)
        if st.draining:
            effects += drain.tell(st, now)
        if st.index.elastic:
            effects += elastic.grow(st, now)
            effects += elastic.shrink_idle(st, now)
        first = st.index.first_immunity()  # victims are chosen among all who may be: no rest left to forget
        return effects + takeback.plan(st, now, choose=first is None or first > now)

    def next_deadline(self) -> int | None:
        st = self.state
        if not (st.waiting or st.notices or st.immune or st.grow_since or st.draining or _busy(st)):
            return None  # (the common call: no wait, notice, rest, growth, drain or batch, so no time)
        times = st.index.first_deadlines()  # of notices and waits
        times += [elastic.grow_at(st, t) for t in st.grow_since]
        times += takeback.maturities(st)
        times += elastic.idle_times(st)
        if _batches_left(st):
            times.append(st.advanced_to)
        return min(times, default=None)

    def observe(self, gpu: int, percent: float, now: int) -> bool:
        """A reading of ``gpu``'s utilisation (the shell's NVML samples); True when the GPU turned
        busy or idle (``next_deadline`` may be sooner). See ``elastic.observe``."""
        return elastic.observe(self.state, gpu, percent, now)

    # --- reading ------------------------------------------------------------

    def allocations(self) -> list[Allocation]:
        """All running allocations, in the order they were made (a walk: see ``allocations_page``)."""
        return list(self.state.allocs.values())

    def allocations_page(self, after: str | None, limit: int) -> list[Allocation]:
        """Up to ``limit`` running and suspended allocations in task id order, those after ``after``
        (None: from the first), in O(limit + log n)."""
        st = self.state
        ids = st.index.listed.after(after) if after is not None else iter(st.index.listed)
        out = []
        for t in islice(ids, max(0, limit)):
            a = st.allocs.get(t) or st.waiting[t].suspended
            assert a is not None  # listed: running or suspended
            out.append(a)
        return out

    def allocation_count(self) -> int:
        """How many allocations run or are suspended."""
        return len(self.state.index.listed)

    def get(self, task_id: str) -> Allocation | None:
        return self.state.allocs.get(task_id)

    def waiting(self) -> list[Request]:
        st = self.state
        return [st.waiting[t].request for _, _, t in st.waiters if st.waiting[t].suspended is None]

    def waiter_info(self, now: int) -> list[tuple[Request, int, str]]:
        """Each waiter that is not a suspended allocation: its request, since when, and why it waits
        (``waits.waiter_info``)."""
        return waits.waiter_info(self.state, now)

    def suspended(self) -> list[Allocation]:
        """The suspended allocations (a walk: see ``suspended_of`` and ``suspended_count``)."""
        return [w.suspended for w in self.state.waiting.values() if w.suspended is not None]

    def suspended_of(self, task_id: str) -> Allocation | None:
        """The task's allocation if it is suspended (waits for its GPUs), in O(1)."""
        w = self.state.waiting.get(task_id)
        return None if w is None else w.suspended

    def suspended_count(self) -> int:
        return len(self.state.index.parked_order)

    def notice_of(self, task_id: str) -> Notice | None:
        return self.state.notices.get(task_id)

    def history_of(self, task_id: str) -> tuple[int, bool]:
        return self.state.history.get(task_id, (0, False))

    def draining(self) -> frozenset[int]:
        return frozenset(self.state.draining)

    def shield(self, alloc: Allocation, now: int) -> Shield | None:
        """What keeps ``alloc`` from being taken back now by a request of a higher priority, and
        until when; None: nothing does (``takeback.shield``: the one rule)."""
        return takeback.shield(self.state, alloc, now)

    def explained(self, short: Insufficient, req: Request, now: int) -> Insufficient:
        """``short`` with why nothing could be taken back for ``req`` (what was in its way)."""
        return takeback.explained(self.state, short, req, now)

    def fractions_on(self, gpu: int) -> list[Allocation]:
        """The fractional allocations on ``gpu`` (their sessions are limited to their share)."""
        st = self.state
        return [st.allocs[t] for t, share in st.on_gpu[gpu].items() if share < UNIT]

    def gpu_free(self, index: int) -> int:
        return self.state.free[index]

    def gpu_tasks(self, index: int) -> dict[str, int]:
        return dict(self.state.on_gpu[index])

    def cpus_free(self) -> list[int]:
        return sorted(self.state.free_cpus)

    @property
    def cpu_count(self) -> int:
        return len(self.state.cpus)

    def tenant_usage(self, tenant: str) -> int:
        return self.state.index.tenant_usage(tenant)


def _busy(st: LedgerState) -> bool:
    """Whether a batch or an elastic allocation may still make a time (``next_deadline``'s other
    sources: victims chosen, notices or drains withdrawn, waiters served, elastic allocations)."""
    return bool(st.index.chosen or st.withdrawing or st.undraining or st.serving or st.index.elastic)


def _batches_left(st: LedgerState) -> bool:
    """Whether work waits for the next ``advance``: victims to tell, notices to withdraw,
    allocations on draining GPUs to tell, rests to forget, waiters to serve."""
    index = st.index
    if index.chosen or st.withdrawing or st.undraining or st.serving:
        return True
    if index.told and any(by != IDLE and by not in st.waiting for by in index.told):
        return True
    if (first := index.first_immunity()) is not None and first <= st.advanced_to:
        return True
    if not st.draining:
        return False
    untold = index.untold  # (read only while a GPU drains: it is brought up to date when read)
    return any(any(map(st.reachable.__contains__, untold.get(g, ()))) for g in st.draining)
