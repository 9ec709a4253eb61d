"""Placement and tenants: which GPUs and CPU cores a request gets, and whether its tenant may have them.

Rules kept here:
- A fraction comes from one GPU: two halves of different GPUs never make one. GPUs already partly
  used are filled before a whole GPU is split; released fractions merge back into their GPU.
- A request for n whole GPUs takes n GPUs that are entirely free, all or nothing. ``prefer`` is
  tried first, then the strategy orders the rest. An elastic request gets what is free up to its
  maximum (and up to what its tenant may use) when nobody of equal or higher priority waits.
- CPU cores are explicit core ids; cores on the NUMA node of the chosen GPUs come first when the
  node is known.
- Tenants: a tenant may use its quota plus borrowed idle quota of the other tenants, up to its
  borrow bound.
- No new grant on a draining GPU; a suspended allocation waits for exactly its own GPUs; what a
  victim gave back is kept for its waiter from requests of the waiter's priority or lower, so a
  newcomer cannot take it while the rest of the preemption runs.

Never: change what is held when a request is refused (``Refused``: it is wrong; ``Insufficient``: the
node is too full now); ``commit`` and ``drop`` are the only changes of what is held.
"""

from __future__ import annotations

from functools import partial
from itertools import islice

from msgspec import structs

from gpud.core.errors import Refused
from gpud.core.ledger.model import UNIT, Allocation, Insufficient, Request
from gpud.core.ledger.state import LedgerState
from gpud_client.protocol import ErrorCode, Recovery, Strategy


def validate(st: LedgerState, req: Request) -> None:
    n = len(st.gpus)
    if req.gpus < 0:
        raise Refused(ErrorCode.INVALID, f"gpus must be positive, got {req.gpus / UNIT:g}")
    if req.gpus == 0 and req.cpus <= 0:
        raise Refused(ErrorCode.INVALID, "0 GPUs and 0 CPU cores: ask for at least some GPU share or one CPU core")
    if req.gpus > UNIT and req.gpus % UNIT:
        raise Refused(
            ErrorCode.INVALID,
            f"{req.gpus / UNIT:g} GPUs: ask for a whole number of GPUs, or a fraction below 1 from one GPU",
        )
    if req.gpus // UNIT > n:
        raise Refused(ErrorCode.INVALID, f"{req.gpus // UNIT} GPUs asked, this node has {n}")
    if req.gpus_max:
        if req.gpus < UNIT or req.gpus % UNIT:
            raise Refused(ErrorCode.INVALID, "an elastic allocation is of whole GPUs: gpus=MIN..MAX, MIN >= 1")
        if req.gpus_max <= req.gpus // UNIT:
            raise Refused(
                ErrorCode.INVALID,
                f"elastic range {req.gpus // UNIT}..{req.gpus_max}: the maximum must be above the minimum",
            )
        if req.gpus_max > n:
            raise Refused(ErrorCode.INVALID, f"elastic range up to {req.gpus_max} GPUs, this node has {n}")
    elif req.on_preempt == Recovery.SHRINK:
        raise Refused(ErrorCode.INVALID, "on_preempt shrink needs an elastic allocation (gpus=MIN..MAX)")
    if req.cpus < 0 or req.cpus > len(st.cpus):
        raise Refused(ErrorCode.INVALID, f"{req.cpus} CPU cores asked, this node has {len(st.cpus)}")
    for g in req.prefer:
        if g not in st.gpus:
            raise Refused(
                ErrorCode.UNKNOWN_GPU,
                f"unknown GPU {g} in prefer (this node has GPUs " + ", ".join(map(str, st.gpus)) + ")",
            )
    if req.memory_bytes is not None and not 0 < req.gpus < UNIT:
        raise Refused(ErrorCode.INVALID, "memory_bytes is a fraction's memory ceiling: ask for a fraction of one GPU")
    if req.strategy == Strategy.ONLY:
        check_only(req)
    if req.tenant is not None and req.tenant not in st.tenants:
        known = ", ".join(sorted(st.tenants)) or "none configured"
        raise Refused(ErrorCode.UNKNOWN_TENANT, f"unknown tenant {req.tenant!r} (tenants: {known})")


def check_only(req: Request) -> None:
    """Strategy ``only``: a scheduler (Kubernetes') chose the GPUs already; gpud places there or refuses.
    So the GPUs are named, as many as whole GPUs are asked (a fraction: of one of them), and it does
    not wait (what placed it counted them free) nor grow."""
    named = len(set(req.prefer))
    if not named:
        raise Refused(ErrorCode.INVALID, "strategy only places on the GPUs named in prefer: name them")
    if req.gpus >= UNIT and req.gpus // UNIT != named:
        raise Refused(
            ErrorCode.INVALID,
            f"strategy only with {req.gpus // UNIT} whole GPU(s) names as many in prefer, not {named}",
        )
    if req.gpus_max:
        raise Refused(ErrorCode.INVALID, "strategy only places exactly: an elastic range cannot go with it")
    if req.wait_us:
        raise Refused(
            ErrorCode.INVALID, "strategy only does not wait: the scheduler that chose the GPUs found them free"
        )


def place(st: LedgerState, req: Request, now: int, suspended: Allocation | None = None) -> Allocation:
    """``req``'s allocation, committed (Insufficient: it does not fit now; nothing changed).
    ``suspended``: the same allocation gets its devices back."""
    check_tenant(st, req)
    gpus = choose_gpus(st, req) if req.gpus > 0 else []
    cpus = choose_cpus(st, req.cpus, gpus)
    share = UNIT if req.gpus >= UNIT else req.gpus
    pre, resume = st.history.get(req.task_id, (0, False))
    alloc = Allocation(
        req.task_id,
        tuple(gpus),
        share if gpus else 0,
        tuple(cpus),
        req.tenant,
        req.priority,
        req.owner_pid,
        now,
        on_preempt=req.on_preempt,
        gpus_min=req.gpus // UNIT if req.gpus_max else 0,
        gpus_max=req.gpus_max,
        protected=req.protected,
        preemptions=pre,
        resume=resume,
        changed_us=now,
        memory_bytes=req.memory_bytes,
    )
    if suspended is not None:  # the same allocation, its devices back
        alloc = structs.replace(suspended, cpus=tuple(cpus), changed_us=now)
    if req.strategy == Strategy.ROUND_ROBIN and gpus:
        st.rr_last = gpus[-1]
    st.history.pop(req.task_id, None)
    commit(st, alloc)
    return alloc


def commit(st: LedgerState, alloc: Allocation) -> None:
    free, on_gpu = st.free, st.on_gpu
    for g in alloc.gpus:
        free[g] -= alloc.share
        on_gpu[g][alloc.task_id] = alloc.share
    if alloc.cpus:
        st.free_cpus = st.free_cpus.difference(alloc.cpus)
    st.allocs[alloc.task_id] = alloc


def drop(st: LedgerState, alloc: Allocation) -> None:
    del st.allocs[alloc.task_id]
    free, on_gpu = st.free, st.on_gpu
    for g in alloc.gpus:
        free[g] += on_gpu[g].pop(alloc.task_id)
    if alloc.cpus:
        st.free_cpus = st.free_cpus.union(alloc.cpus)
    st.grow_since.pop(alloc.task_id, None)


def check_tenant(st: LedgerState, req: Request, minus: dict[str, int] | None = None) -> None:
    """Insufficient when ``req``'s tenant may not use that much more now (``minus``: units its
    tenants would no longer use)."""
    if req.tenant is None:
        return
    minus = minus or {}
    quota = st.tenants[req.tenant]

    def usage(t: str) -> int:
        return st.index.tenant_usage(t) - minus.get(t, 0)

    used = usage(req.tenant)
    over = used + req.gpus - quota.gpus
    if over <= 0:
        return
    idle = sum(max(0, q.gpus - usage(t)) for t, q in st.tenants.items() if t != req.tenant)
    if over > quota.borrow or over > idle:
        raise Insufficient(
            "tenant_quota",
            f"tenant {req.tenant!r} uses {used / UNIT:g} of its {quota.gpus / UNIT:g} GPUs; "
            f"{req.gpus / UNIT:g} more needs {over / UNIT:g} borrowed, and it may borrow "
            f"{min(quota.borrow, idle) / UNIT:g} now (bound {quota.borrow / UNIT:g}, idle elsewhere {idle / UNIT:g})",
        )


def tenant_room(st: LedgerState, tenant: str | None) -> int:
    """How much more ``tenant`` may use now: the rest of its quota and what it may still borrow
    (``check_tenant``'s rule solved for the amount)."""
    if tenant is None:
        return len(st.gpus) * UNIT
    usage = st.index.tenant_usage
    quota, used = st.tenants[tenant], usage(tenant)
    idle = sum(max(0, q.gpus - usage(t)) for t, q in st.tenants.items() if t != tenant)
    return max(0, quota.gpus - used + min(quota.borrow, idle))


def over_quota(st: LedgerState, tenant: str | None) -> bool:
    """Whether ``tenant`` uses more than its quota (what it borrowed may be reclaimed)."""
    quota = st.tenants.get(tenant or "")
    return quota is not None and st.index.tenant_usage(tenant or "") > quota.gpus


def order(st: LedgerState, gpus: list[int], req: Request) -> list[int]:
    free = st.free
    match req.strategy:
        case Strategy.BEST_FIT:
            ordered = sorted(gpus, key=lambda g: (free[g], g))
        case Strategy.LEAST_LOADED:
            ordered = sorted(gpus, key=lambda g: (-free[g], g))
        case Strategy.ROUND_ROBIN:
            ordered = sorted(gpus, key=lambda g: (g - st.rr_last - 1) % (1 << 30))
        case Strategy.RANDOM:
            ordered = sorted(gpus)
            if not st.journal.keeps("rng"):
                st.journal.keep("rng", partial(st.rng.setstate, st.rng.getstate()))
            st.rng.shuffle(ordered)
        case _:
            ordered = sorted(gpus)
    preferred = [g for p in req.prefer for g in ordered if g == p]
    return preferred + [g for g in ordered if g not in preferred]


def open_gpus(st: LedgerState, req: Request) -> list[int]:
    """The GPUs a request may be placed on: not draining, its own when it is pinned, and not
    kept for a waiter of its priority or higher whose victim gave them back (so what a
    preemption freed is not taken by whoever comes next while the rest of it runs)."""
    if not (st.draining or st.reserved or req.pinned):
        return list(st.gpus)  # (the common call: none drains, none is kept, the request is not pinned)
    return [
        g for g in st.gpus if g not in st.draining and (not req.pinned or g in req.pinned) and not kept_from(st, g, req)
    ]


def kept_from(st: LedgerState, gpu: int, req: Request) -> bool:
    waiter = st.waiting.get(st.reserved.get(gpu, ""))
    return waiter is not None and waiter.request.task_id != req.task_id and waiter.request.priority >= req.priority


def waits_at(st: LedgerState, priority: int, *, but: str = "") -> bool:
    """Whether a waiter of ``priority`` or higher waits (``but`` not counted)."""
    firsts = [*st.waiters[:2], *islice(st.index.parked_order, 2)]
    return any(-p >= priority and t != but for p, _, t in firsts)


def choose_gpus(st: LedgerState, req: Request) -> list[int]:
    gpus = open_gpus(st, req)
    free = st.free
    if req.strategy == Strategy.ONLY:  # exactly the GPUs named, or nothing
        return only_gpus(st, req, gpus)
    if req.pinned:
        if len(gpus) < len(req.pinned) or any(free[g] < min(req.gpus, UNIT) for g in gpus):
            raise Insufficient("gpus", f"waits for its own GPUs {list(req.pinned)} to be free again")
        return list(req.pinned)
    if req.gpus >= UNIT:
        need = req.gpus // UNIT
        whole = [g for g in gpus if free[g] == UNIT]
        if len(whole) < need:
            raise Insufficient("gpus", f"{need} whole GPU(s) asked, {len(whole)} entirely free now")
        if req.gpus_max and not waits_at(st, req.priority, but=req.task_id):
            # elastic: what is free, up to its maximum and what its tenant may still use
            need = max(need, min(req.gpus_max, len(whole), tenant_room(st, req.tenant) // UNIT))
        return order(st, whole, req)[:need]
    fits = [g for g in gpus if free[g] >= req.gpus]
    if not fits:
        most = max((free[g] for g in gpus), default=0)
        raise Insufficient("gpus", f"{req.gpus / UNIT:g} of one GPU asked, the most free on any GPU is {most / UNIT:g}")
    partly = [g for g in fits if free[g] < UNIT]
    entirely = [g for g in fits if free[g] == UNIT]
    if not req.prefer and req.strategy == Strategy.FIRST_FIT:
        return [min(partly or entirely)]  # (``order``'s first, without sorting: the common request)
    preferred = [g for g in fits if g in req.prefer]
    if preferred:
        return [order(st, preferred, req)[0]]
    return [(order(st, partly, req) or order(st, entirely, req))[0]]


def only_gpus(st: LedgerState, req: Request, open_to_it: list[int]) -> list[int]:
    named = sorted(set(req.prefer))
    closed = [g for g in named if g not in open_to_it]
    if closed:
        raise Insufficient("gpus", f"GPUs {closed} take nothing new now (drained, or kept for a waiter): strategy only")
    if req.gpus >= UNIT:
        busy = [g for g in named if st.free[g] < UNIT]
        if busy:
            raise Insufficient("gpus", f"GPUs {busy} are not entirely free: strategy only places on {named} alone")
        return named
    fits = [g for g in named if st.free[g] >= req.gpus]
    if not fits:
        most = max(st.free[g] for g in named)
        raise Insufficient(
            "gpus",
            f"{req.gpus / UNIT:g} of one GPU asked on {named} alone (strategy only), the most free there is {most / UNIT:g}",
        )
    return [fits[0]]


def choose_cpus(st: LedgerState, count: int, gpus: list[int]) -> list[int]:
    if count == 0:
        return []
    if len(st.free_cpus) < count:
        raise Insufficient("cpus", f"{count} CPU core(s) asked, {len(st.free_cpus)} free now")
    nodes = {st.gpus[g].numa_node for g in gpus} - {None}
    local = sorted(c for c in st.free_cpus if st.cpu_numa.get(c) in nodes)
    rest = sorted(c for c in st.free_cpus if c not in local)
    return (local + rest)[:count]
