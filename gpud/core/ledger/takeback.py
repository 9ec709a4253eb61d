"""Taking back: who may be taken back and why not, choosing a waiter's victims, telling them in batches.

Rules kept here (the strategies' rules are in ``gpud.core.preemption``):
- Who may be taken back is one rule, read everywhere from here: by its terms (``shields.by_terms``:
  never production, never a protected allocation), by whether someone can be told about it (the
  shell's ``reachable``: a live holder, or an owner pid gpud may signal), and by what keeps it
  ``away`` now (told to leave already, resting after a withdrawn notice, planned for a waiter).
  ``eligible`` reads it one allocation at a time, the index's pools in bulk, ``shield`` says it
  in words with until when (with the minimum runtime: 1..99 once they ran ``min_runtime_us``,
  spot at any time), and ``blocked`` says why nothing could be taken back for a request.
- A waiter that does not fit may take back an elastic allocation's GPUs above its minimum
  (priorities up to its own), allocations on borrowed tenant quota when it asks within its own
  quota, and strictly lower priorities. Never more victims than needed; no set that fits: none.
- A waiter's victims are chosen at once (its plan; nobody else may choose them meanwhile) and told
  a batch at a time; each victim's grace starts when it is told. One no longer to be taken as
  planned (it left, was protected, was told by a drain) is skipped. Victims are chosen only once
  no expired rest is left to forget. A plan is not durable: after a restart its waiter waits for
  the victims it told, then chooses again.
- Among equals the lower task id goes first, never the order the allocations came in: a restart
  or a rollback does not keep that order.

Never: choose while preemption is off (a drain still tells); walk every allocation: the pools,
the suspended waiters that may choose and the blockers read are all bounded reads of the index.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import replace
from heapq import merge
from itertools import chain

import gpud.core.ledger.notices as notices
import gpud.core.ledger.placement as placement
from gpud.core.ledger.model import IDLE, NOTICE_BATCH, UNIT, Allocation, Insufficient, LedgerEffect, Noticed, Request
from gpud.core.ledger.state import LedgerState
from gpud.core.ledger_index import DRAIN, Queued, as_victim
from gpud.core.preemption import Candidate, Chunk, Need, Pool, Room, Victim, choose
from gpud.core.shields import (
    AT_MINIMUM,
    MIN_RUNTIME,
    OFF,
    RESTING,
    UNREACHABLE,
    Blocked,
    Shield,
    by_terms,
    runs_minimum,
)
from gpud.core.victim_pool import VictimPool
from gpud_client.protocol import PreemptReason, PreemptStrategy, Recovery

BLOCKERS_READ = 64  # allocations read to say why nothing could be taken back for a request
PLAN_READ = 8 * NOTICE_BATCH  # planned victims looked at per call (those no longer to tell cost no notice)


# --- who may be taken back: the one rule ------------------------------------------------------------


def away(st: LedgerState, *, plans: bool = True) -> tuple[Collection[str], ...]:
    """What keeps an allocation from being chosen now, whatever its terms: told to leave already, resting
    after a withdrawn notice (``cooldown_us``), and (``plans``) planned for a waiter."""
    return (st.notices, st.immune, st.index.chosen) if plans else (st.notices, st.immune)


def eligible(st: LedgerState, a: Allocation, *, plans: bool = True) -> bool:
    """Whether a waiter may choose ``a`` now (``plans`` False: tell it as planned), by the rule: its
    terms, someone to tell, nothing keeping it away."""
    t = a.task_id
    if t not in st.reachable or by_terms(a) is not None:
        return False
    for keeps in away(st, plans=plans):
        if t in keeps:
            return False
    return True


def shield(st: LedgerState, a: Allocation, now: int) -> Shield | None:
    """What keeps ``a`` from being taken back now by a request of a higher priority, and until
    when; None: nothing does (the one rule of what ALLOCATE, ALLOCS and a refusal say). A drain is
    the operator's: it takes production and protected allocations too."""
    if (kept := by_terms(a)) is not None:
        return kept
    if not st.preemption.enabled:
        return OFF
    if a.task_id not in st.reachable:
        return UNREACHABLE
    if a.on_preempt == Recovery.SHRINK and not a.extras:
        return AT_MINIMUM
    if (rest := st.immune.get(a.task_id)) is not None and rest > now:
        return Shield(RESTING, rest)
    mature = a.created_us + st.preemption.min_runtime_us
    if runs_minimum(a.priority) and now < mature and not a.extras and not placement.over_quota(st, a.tenant):
        return Shield(MIN_RUNTIME, mature)  # (extras and borrowed quota are taken at any time)
    return None


def blocked(st: LedgerState, req: Request, now: int) -> Blocked:
    """Why nothing could be taken back for ``req``: the allocations on the GPUs it may use (or
    holding CPU cores, for a request of cores alone), at most ``BLOCKERS_READ`` of them, each by
    what keeps it there: what keeps it away, its priority, its shield."""
    out = Blocked(now)
    if req.gpus:
        ids: Iterable[str] = chain.from_iterable(st.on_gpu[g] for g in placement.open_gpus(st, req))
    else:
        ids = (t for t, a in st.allocs.items() if a.cpus)
    seen: set[str] = set()
    for t in ids:
        if t in seen:
            continue
        if len(seen) == BLOCKERS_READ:
            out.read_all = False
            break
        seen.add(t)
        a = st.allocs[t]
        if (n := st.notices.get(t)) is not None:
            out.add(t, "told to leave already" + ("" if n.by in (DRAIN, IDLE) else f" (for task {n.by})"))
        elif (waiter := st.index.chosen.get(t)) is not None:
            out.add(t, f"chosen to leave for task {waiter}")
        elif a.priority >= req.priority and not (a.extras and a.priority <= req.priority):
            out.add(t, f"not of a lower priority than {req.priority}")
        elif (why := shield(st, a, now)) is not None:
            out.add_shield(t, why)
        elif req.wait_us <= 0:
            out.add(t, "of a lower priority: taken back only for a request that waits (wait_ms)")
        else:
            out.add(t, "may be taken back, but would not make room enough")
    return out


def explained(st: LedgerState, short: Insufficient, req: Request, now: int) -> Insufficient:
    """``short`` with why nothing could be taken back for ``req`` (what was in its way)."""
    if short.what == "tenant_quota" or not (why := blocked(st, req, now)):
        return short
    return Insufficient(short.what, f"{short.message}; {why.text()}")


# --- choosing ---------------------------------------------------------------------------------------


def victims_for(st: LedgerState, req: Request, now: int) -> list[Victim]:
    open_gpus = placement.open_gpus(st, req)
    room = Room({g: st.free[g] for g in open_gpus}, len(st.free_cpus))
    need = Need(req.gpus if not req.pinned else len(req.pinned) * min(req.gpus, UNIT), req.cpus)
    reclaim: list[Candidate] = []
    if req.tenant is not None and st.index.tenant_usage(req.tenant) + req.gpus <= st.tenants[req.tenant].gpus:
        reclaim = _borrowed(st, req.tenant)
    # The strategy's pool is read from the index, as far as the choice needs: not a pass over all.
    mature = now - st.preemption.min_runtime_us
    lower = VictimPool(st.index, req.priority, mature, st.reachable, (*away(st), {c.task_id for c in reclaim}))
    pools = [
        Pool(_extras(st, req.priority), PreemptStrategy.LOWEST_PRIORITY),
        Pool(reclaim, PreemptStrategy.NEWEST_FIRST),
        Pool(lower, st.preemption.strategy),
    ]
    return one_per_task(choose(need, room, pools, tenant_fits(st, req)))


def tenant_fits(st: LedgerState, req: Request) -> Callable[[Sequence[Victim]], bool] | None:
    """Whether ``req`` fits its tenant's quota once these victims are gone (None: no tenant)."""
    if req.tenant is None:
        return None

    def fits(victims: Sequence[Victim]) -> bool:
        minus: dict[str, int] = {}
        for c in victims:
            for tenant, units in c.tenants().items() if isinstance(c, Chunk) else ((c.tenant, c.units),):
                if tenant is not None:
                    minus[tenant] = minus.get(tenant, 0) + units
        try:
            placement.check_tenant(st, req, minus)
        except Insufficient:
            return False
        return True

    return fits


def _extras(st: LedgerState, priority: int) -> list[Candidate]:
    """Elastic allocations' GPUs above their minimum, of priorities up to ``priority``."""
    out = []
    for t in st.index.elastic:
        a = st.allocs[t]
        if a.extras and a.priority <= priority and eligible(st, a):
            out.append(as_victim(a, PreemptReason.ELASTIC, a.extras))
    return out


def _borrowed(st: LedgerState, lender: str) -> list[Candidate]:
    """Allocations of tenants above their quota, newest first, as far as they are over it."""
    out: list[Candidate] = []
    for tenant, quota in st.tenants.items():
        if tenant == lender:
            continue
        over = st.index.tenant_usage(tenant) - quota.gpus
        for t in st.index.newest_of(tenant) if over > 0 else ():
            a = st.allocs[t]
            if eligible(st, a) and a.on_preempt != Recovery.SHRINK:
                out.append(as_victim(a, PreemptReason.QUOTA_RECLAIM, a.gpus))
            over -= a.total
            if over <= 0:
                break
    return out


def one_per_task(chosen: list[Victim]) -> list[Victim]:
    """An allocation chosen for its extras and then whole is told once, whole (a chunk's are whole
    fractions: never chosen for extras)."""
    by_task: dict[str, Candidate] = {}
    order: list[str | Chunk] = []
    for c in chosen:
        if isinstance(c, Chunk):
            order.append(c)
            continue
        if c.task_id not in by_task:
            order.append(c.task_id)
        if c.task_id not in by_task or c.whole:
            by_task[c.task_id] = c
    return [by_task[x] if isinstance(x, str) else x for x in order]


# --- planning and telling -----------------------------------------------------------------------------


def plan(st: LedgerState, now: int, *, choose: bool) -> list[LedgerEffect]:
    """Each waiter, highest priority first: victims chosen at once when it has none and does not
    fit (``choose``: no rest is left to forget), then the next batch of its plan told (a victim no
    longer to be taken as planned is skipped: it left, was told by a drain...)."""
    effects: list[LedgerEffect] = []
    choose = choose and st.preemption.enabled
    if not choose and not st.index.chosen:  # (every victim planned is chosen until told)
        return effects
    parked = parked_planning(st, choose)
    if not st.waiters and not parked:
        return effects
    grace = st.preemption.grace_us
    for _, _, task_id in merge(list(st.waiters), sorted(parked)) if parked else list(st.waiters):
        w = st.waiting.get(task_id)
        if w is None:
            continue
        planned, how, victims, deadline = w.plan, w.how, w.victims, w.deadline
        if choose and not notices.leaving(st, w) and (chosen := victims_for(st, w.request, now)):
            planned, how = _planned(chosen)
            victims, deadline = (), max(w.deadline, now + grace + 1)
        read, told = _tell(st, task_id, planned, how, now) if planned and st.budget.left > 0 else (0, [])
        effects += told
        if told:  # it waits at least until their grace ends (its own wait does not expire meanwhile)
            victims = tuple(sorted(victims + tuple(e.allocation.task_id for e in told if isinstance(e, Noticed))))
            deadline = max(deadline, now + grace + 1)
        if planned is not w.plan or read:
            rest = planned[read:]
            st.waiting[task_id] = replace(w, plan=rest, how=how if rest else (), victims=victims, deadline=deadline)
    return effects


def parked_planning(st: LedgerState, choose: bool) -> set[Queued]:
    """The suspended allocations that have victims to tell, or (``choose``) may take some back: a
    lower priority on a GPU they wait for or holding CPU cores, an elastic allocation's extras of
    their priority or lower, or (with tenants, one over its quota) borrowed quota. Not a walk over
    them all: a few more than may, never fewer."""
    index = st.index
    if not index.parked_order:
        return set()
    waiting = st.waiting
    out = {(-w.request.priority, w.seq, t) for t in index.planning if (w := waiting[t]).suspended is not None}
    if not choose:
        return out
    if st.tenants and any(index.tenant_usage(t) > q.gpus for t, q in st.tenants.items()):
        return out | set(index.parked_order)  # (quota reclaimed: rare, read them all)
    extras = [a.priority for t in index.elastic if (a := st.allocs[t]).extras]
    if extras:  # priorities from the highest down to the lowest with extras
        out.update(_above(index.parked_order, min(extras) - 1))
    if index.cpu_holders:  # (at most the node's cores)
        out.update(_above(index.parked_order, min(st.allocs[t].priority for t in index.cpu_holders)))
    for g, by_share in index.parked.items():
        lowest = min((k[2] for k in index.lower_groups.get(g, {})), default=None)
        if lowest is not None:
            for keys in by_share.values():
                out.update(_above(keys, lowest))
    return out


def _tell(
    st: LedgerState, task_id: str, planned: tuple[str, ...], how: tuple[Candidate, ...], now: int
) -> tuple[int, list[LedgerEffect]]:
    """The next batch of a waiter's plan told: how many of the plan were read, and the notices."""
    effects: list[LedgerEffect] = []
    taken = {c.task_id: c for c in how}
    read = 0
    for t in planned:
        if st.budget.left <= 0 or read >= PLAN_READ:
            break
        read += 1
        if (c := _still_victim(st, t, taken.get(t))) is not None:
            effects += notices.notice(st, st.allocs[t], c.reason, c.gpus, c.whole, task_id, now)
    return read, effects


def _still_victim(st: LedgerState, t: str, planned: Candidate | None) -> Candidate | None:
    """A planned victim as it is to be told now; None: it is no longer to be taken as planned."""
    a = st.allocs.get(t)
    if a is None or not eligible(st, a, plans=False):
        return None
    if planned is None:
        return as_victim(a, PreemptReason.PRIORITY, a.gpus)
    if planned.whole:
        return planned if a.gpus == planned.gpus else None
    return planned if set(planned.gpus) <= set(a.extras) else None


def _planned(victims: list[Victim]) -> tuple[tuple[str, ...], tuple[Candidate, ...]]:
    """A plan: the victims' task ids in the order they are told, and how those not taken whole for
    priority are taken (the rest are read again when told)."""
    ids: list[str] = []
    how: list[Candidate] = []
    for v in victims:
        if isinstance(v, Chunk):
            ids += v.ids()
            continue
        ids.append(v.task_id)
        if v.reason != PreemptReason.PRIORITY or not v.whole:
            how.append(v)
    return tuple(ids), tuple(how)


def _above(keys: Iterable[Queued], priority: int) -> Iterator[Queued]:
    """The places in ``keys`` (in queue order) of the waiters of a priority above ``priority``."""
    for queued in keys:
        if -queued[0] <= priority:
            return
        yield queued


def maturities(st: LedgerState) -> list[int]:
    """When allocations reach their minimum runtime or their rest ends, while some waiter may want
    them. Only those still to come: one already past is no reason to wake (the timer would wake
    again at once)."""
    if not any(not notices.leaving(st, st.waiting[t]) for _, _, t in st.waiters):  # (the requests)
        return []
    at = [
        st.index.first_maturity(st.advanced_to, st.preemption.min_runtime_us),
        st.index.first_immunity_after(st.advanced_to),
    ]
    return [t for t in at if t is not None]
