"""Notices: telling an allocation to leave, the grace, withdrawing, the rest after a withdrawal, and
what a victim gave back kept for its waiter.

Rules kept here:
- A notice gives its allocation ``grace_us`` from when it is told; until it yields or frees, or
  the grace ends, its devices stay its own: no device is ever held by two allocations.
- Each call tells, withdraws and carries out at most ``NOTICE_BATCH`` notices in all (the state's
  ``budget``); the rest wait for the next calls.
- A waiter that gives up (or is served before its victims left) withdraws the notices it caused,
  a batch at a time: until then they are the notices of nobody (``nobodys``), carried out by no
  deadline and no yield. A victim whose notice was withdrawn rests: it is not chosen again for
  ``cooldown_us`` (no thrash); expired rests are forgotten ``IMMUNITY_BATCH`` at a time.
- What a victim gives back is kept for its waiter (``reserved``) while the waiter waits; a waiter
  waits for its victims (``leaving``) and chooses no more meanwhile.

Never: tell or withdraw past the call's budget; withdraw a drain's notice with a rest (a drain is
no waiter that comes and goes).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from gpud.core.ledger.model import IDLE, Allocation, LedgerEffect, Notice, Noticed, Waiter, Withdrawn
from gpud.core.ledger.state import LedgerState
from gpud.core.ledger_index import DRAIN
from gpud_client.protocol import PreemptReason

IMMUNITY_BATCH = 1024  # expired rests forgotten per ``advance``


def notice(
    st: LedgerState, alloc: Allocation, reason: PreemptReason, gpus: tuple[int, ...], whole: bool, by: str, now: int
) -> list[LedgerEffect]:
    n = Notice(alloc.task_id, reason, gpus, whole, now, now + st.preemption.grace_us, by)
    st.notices[alloc.task_id] = n
    st.grow_since.pop(alloc.task_id, None)
    st.budget.left -= 1
    return [Noticed(alloc, n)]


def withdraw(st: LedgerState, ids: Iterable[str], now: int, *, rest: bool = True) -> list[LedgerEffect]:
    """These notices are withdrawn (``rest``: their allocations are not chosen again for a while)."""
    effects: list[LedgerEffect] = []
    for v in ids:
        n = st.notices.pop(v)
        if rest:
            st.immune[v] = now + st.preemption.cooldown_us
        effects.append(Withdrawn(st.allocs[v], n))
        st.budget.left -= 1
    return effects


def withdraw_for(st: LedgerState, w: Waiter, now: int) -> list[LedgerEffect]:
    """The notices given for ``w`` (no longer waiting) that still run are withdrawn: it gave up,
    or it was served without them; those over this call's batch by the next calls. Their victims
    are not chosen again for a while (no thrash). What they gave back is no longer kept for it."""
    t = w.request.task_id
    st.reserved = {g: x for g, x in st.reserved.items() if x != t}
    told = st.index.told.get(t)
    effects = withdraw(st, list(islice(told, max(0, st.budget.left))), now) if told else []
    if t in st.index.told:
        st.withdrawing |= {t}
    return effects


def withdraw_left(st: LedgerState, now: int) -> list[LedgerEffect]:
    """The next batch of notices whose waiter is gone."""
    effects: list[LedgerEffect] = []
    told = st.index.told
    for by in sorted(told):
        if st.budget.left <= 0:
            break
        if by != IDLE and (by not in st.waiting or by in st.withdrawing):
            effects += withdraw(st, list(islice(told[by], st.budget.left)), now)
    if st.withdrawing:
        st.withdrawing = frozenset(b for b in st.withdrawing if b in told)
    return effects


def nobodys(st: LedgerState, n: Notice) -> bool:
    """Whether a notice is to be withdrawn (a later batch will): its waiter gave up or is not
    there after a restart, or none of the GPUs its drain names drains any more."""
    if n.by == DRAIN:
        return not st.draining.intersection(n.gpus)
    return n.by != IDLE and (n.by not in st.waiting or n.by in st.withdrawing)


def keep_for_waiter(st: LedgerState, n: Notice) -> None:
    """What the victim of ``n`` gives back is kept for its waiter while the waiter waits."""
    if n.by in st.waiting:
        st.reserved = {**st.reserved, **{g: n.by for g in n.gpus}}


def leaving(st: LedgerState, w: Waiter) -> bool:
    """Whether ``w`` waits for victims: some of its plan are still to be told, or a notice given
    for it still runs (or one given for an earlier wait of its task id, still to be withdrawn).
    It waits at least until they end, and chooses no more meanwhile."""
    return bool(w.plan) or w.request.task_id in st.index.told


def forget_rests(st: LedgerState, now: int) -> None:
    """The next batch of rests that ended (no victim is chosen until they all are forgotten)."""
    if (first := st.index.first_immunity()) is not None and first <= now:
        for task_id in st.index.due_immunities(now, IMMUNITY_BATCH):
            del st.immune[task_id]
