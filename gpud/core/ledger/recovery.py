"""Recovery and suspension: carrying out a notice, and what a task remembers of its preemptions.

Rules kept here:
- A notice is carried out when its holder yields (it did what the notice asked) or its grace ends
  (it overran); an allocation freed under a notice counts as that preemption done. A notice whose
  waiter gave up is withdrawn instead: carried out by no deadline and no yield.
- Carried out: an elastic allocation's extras are taken and it runs on; a whole allocation with
  recovery ``suspend`` that yielded waits again, pinned to its GPUs, at its priority, without a
  deadline, and is ``Served(resumed=True)`` when they are free; any other is gone. One to suspend
  that overran is gone too: its program must not keep running on devices no longer its own.
- A whole preemption is remembered per task id: how many, and whether its next start resumes
  (``checkpoint`` and ``suspend`` ask it to). The history is bounded: the oldest are forgotten.
- What a victim gives back is kept for its waiter, then waiters are served.

Never: carry out more than the call's budget (the caller counts each).
"""

from __future__ import annotations

from msgspec import structs

import gpud.core.ledger.notices as notices
import gpud.core.ledger.placement as placement
import gpud.core.ledger.waits as waits
from gpud.core.ledger.model import (
    NEVER,
    NOTICE_BATCH,
    UNIT,
    Allocation,
    Insufficient,
    LedgerEffect,
    Request,
    TakenBack,
    Waiter,
)
from gpud.core.ledger.state import LedgerState
from gpud.core.ledger_index import DRAIN
from gpud_client.protocol import Recovery


def released(st: LedgerState, alloc: Allocation, now: int) -> list[LedgerEffect]:
    """``alloc`` is freed: under a notice, that preemption is done (unless the notice was withdrawn
    in all but name); then waiters that now fit are served."""
    notice = st.notices.pop(alloc.task_id, None)
    if notice is not None and notices.nobodys(st, notice):
        notice = None  # withdrawn in all but name: freeing it is no preemption
    if notice is not None and notice.whole:
        remember(st, alloc)
    else:
        st.history.pop(alloc.task_id, None)
    if notice is not None:
        notices.keep_for_waiter(st, notice)
    placement.drop(st, alloc)
    return waits.serve(st, now)


def yielded(st: LedgerState, task_id: str, now: int) -> list[LedgerEffect]:
    """The holder of a notice did what it asked: carried out now (withdrawn if its waiter gave up,
    its withdrawal not told yet)."""
    n = st.notices[task_id]
    if notices.nobodys(st, n):
        return notices.withdraw(st, [task_id], now, rest=n.by != DRAIN)
    return take_back(st, task_id, now, overran=False)


def carry_out_due(st: LedgerState, now: int) -> list[LedgerEffect]:
    """Notices whose grace ended, the earliest deadline first, as far as the call's budget goes."""
    effects: list[LedgerEffect] = []
    for task_id in st.index.due_notices(now, NOTICE_BATCH):
        n = st.notices.get(task_id)  # (one carried out may have served a waiter, withdrawing others)
        if st.budget.left <= 0:
            break
        if n is None or now < n.deadline:
            continue
        if notices.nobodys(st, n):
            effects += notices.withdraw(st, [task_id], now, rest=n.by != DRAIN)
        else:
            st.budget.left -= 1
            effects += take_back(st, task_id, now, overran=True)
    return effects


def take_back(st: LedgerState, task_id: str, now: int, *, overran: bool) -> list[LedgerEffect]:
    n = st.notices.pop(task_id)
    alloc = st.allocs[task_id]
    notices.keep_for_waiter(st, n)
    if not n.whole:
        placement.drop(st, alloc)
        after = structs.replace(alloc, gpus=tuple(g for g in alloc.gpus if g not in n.gpus), changed_us=now)
        placement.commit(st, after)
        return [TakenBack(alloc, n, after, False, overran), *waits.serve(st, now)]
    placement.drop(st, alloc)
    suspend = alloc.on_preempt == Recovery.SUSPEND and not overran
    effects: list[LedgerEffect] = [TakenBack(alloc, n, None, suspend, overran)]
    if suspend:
        req = Request(
            task_id,
            alloc.total if not alloc.gpus_min else len(alloc.gpus) * UNIT,
            cpus=len(alloc.cpus),
            tenant=alloc.tenant,
            priority=alloc.priority,
            owner_pid=alloc.owner_pid,
            on_preempt=alloc.on_preempt,
            protected=alloc.protected,
            pinned=alloc.gpus,  # exactly these GPUs: no elastic range (its terms are the allocation's)
        )
        held = structs.replace(alloc, preemptions=alloc.preemptions + 1, resume=True)
        waits.enqueue(st, Waiter(req, NEVER, now, suspended=held, seq=st.seq + 1), Insufficient("gpus", "suspended"))
    else:
        remember(st, alloc)
    return effects + waits.serve(st, now)


def remember(st: LedgerState, alloc: Allocation) -> None:
    """A whole preemption: the task's next allocation hears of it."""
    resume = alloc.on_preempt in (Recovery.CHECKPOINT, Recovery.SUSPEND) or alloc.resume
    st.history[alloc.task_id] = (alloc.preemptions + 1, resume)
    # Bounded: the oldest are forgotten (one a rollback put back counts as the newest).
    while len(st.history) > 4 * st.max_waiters + 4096:
        del st.history[next(iter(st.history))]
