"""The allocation ledger: whole and fractional GPUs and CPU cores per task id.

Rules kept here:
- Quantities are fixed point: one GPU is ``UNIT`` (10000) parts, so sums are
  exact. A request is a whole number of GPUs (>= 1) or a fraction (< 1).
- A fraction comes from one GPU: two halves of different GPUs never make one.
  GPUs already partly used are filled before a whole GPU is split; released
  fractions merge back into their GPU.
- A request for n whole GPUs takes n GPUs that are entirely free, all or
  nothing. ``prefer`` is tried first, then the strategy orders the rest.
- CPU cores are explicit core ids; cores on the NUMA node of the chosen GPUs
  come first when the node is known.
- The same task id twice is the same allocation (idempotent) when it asks for
  the same terms: GPUs, CPU cores, tenant, priority and owner pid. Different
  terms are refused, naming each difference, whether the id holds an
  allocation or waits for one: answering with the old allocation would hand
  the caller something it did not ask for. ``prefer``, ``strategy`` and the
  wait only say where to place and how long to wait, so they are not terms.
  One request per task id waits at a time: a second while the first waits is
  refused, the same terms or not.
- Tenants: a tenant may use its quota plus borrowed idle quota of the other
  tenants, up to its borrow bound.
- Not enough now: ``Insufficient`` naming what was short, or, with a wait, a
  place in a queue served in priority order (FIFO within a priority), each
  waiter granted as soon as it fits, until its deadline. At most
  ``max_waiters`` wait at once; one more that would wait is refused.
- A restored record must fit the node as it is now and the other records,
  with sane values, or it is refused (the shell sets it aside).
- Withdrawing a wait frees nothing, so it serves no one.
- ``checkpoint`` / ``rollback``: the shell takes a checkpoint before a change
  and rolls back to it when the change cannot be stored, so the ledger is
  exactly what it was, waiters that the change would have served included.

A refused call raises ``Refused`` (the request is wrong) or ``Insufficient``
(the node is too full) and changes nothing. Pure: no clock, no storage; time
is integer microseconds passed in.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpud.core.errors import LimitReached, Refused
from gpud_client.protocol import ErrorCode, Strategy
from gpud_client.units import GPU_UNIT, fixed_gpus

UNIT = GPU_UNIT  # one GPU


@dataclass(frozen=True, slots=True)
class GpuSpec:
    index: int
    uuid: str
    numa_node: int | None = None


@dataclass(frozen=True, slots=True)
class TenantQuota:
    gpus: int  # fixed point
    borrow: int = 0  # the most it may borrow from others' idle quota, fixed point


@dataclass(frozen=True, slots=True)
class Request:
    task_id: str
    gpus: int  # fixed point: k * UNIT for k whole GPUs, or 1..UNIT-1
    cpus: int = 0
    prefer: tuple[int, ...] = ()
    strategy: Strategy = Strategy.FIRST_FIT
    tenant: str | None = None
    priority: int = 50
    owner_pid: int | None = None
    wait_us: int = 0


@dataclass(frozen=True, slots=True)
class Allocation:
    task_id: str
    gpus: tuple[int, ...]
    share: int  # fixed point per GPU: UNIT for whole GPUs
    cpus: tuple[int, ...]
    tenant: str | None
    priority: int
    owner_pid: int | None
    created_us: int

    @property
    def total(self) -> int:
        return self.share * len(self.gpus)


def to_fixed(gpus: float) -> int:
    """GPUs as people and the wire write them (a float) -> fixed point, refusing what is not exact."""
    try:
        return fixed_gpus(gpus)
    except ValueError as exc:
        raise Refused(ErrorCode.INVALID, str(exc)) from None


def _gpus_text(fixed: int) -> str:
    if fixed == 0:
        return "no GPU"
    if fixed < UNIT:
        return f"{fixed / UNIT:g} of a GPU"
    return f"{fixed / UNIT:g} GPU" + ("" if fixed == UNIT else "s")


# The terms of a request: what a repeat must ask for again to be answered with the same allocation,
# each with how a message says it.
_TERM_TEXT: dict[str, Callable[[Any], str]] = {
    "gpus": _gpus_text,
    "cpus": lambda v: "no CPU core" if v == 0 else f"{v} CPU core" + ("s" if v > 1 else ""),
    "tenant": lambda v: "no tenant" if v is None else f"tenant {v!r}",
    "priority": lambda v: f"priority {v}",
    "owner_pid": lambda v: "no owner pid" if v is None else f"owner pid {v}",
}


def _terms(x: Request | Allocation) -> dict[str, Any]:
    if isinstance(x, Allocation):
        return {
            "gpus": x.total,
            "cpus": len(x.cpus),
            "tenant": x.tenant,
            "priority": x.priority,
            "owner_pid": x.owner_pid,
        }
    return {"gpus": x.gpus, "cpus": x.cpus, "tenant": x.tenant, "priority": x.priority, "owner_pid": x.owner_pid}


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _check_same_terms(req: Request, held: dict[str, Any], verb: str) -> None:
    """Refuse a repeat of a task id that asks for other terms than it ``verb`` (holds, waits for)."""
    asked = _terms(req)
    differ = [k for k in _TERM_TEXT if asked[k] != held[k]]
    if not differ:
        return
    has = [_TERM_TEXT[k](held[k]) for k in ("gpus", "cpus")]
    has += [_TERM_TEXT[k](held[k]) for k in differ if k not in ("gpus", "cpus")]
    raise Refused(
        ErrorCode.INVALID,
        f"task {req.task_id!r} already {verb} {_and(has)}; this request asks for "
        f"{_and([_TERM_TEXT[k](asked[k]) for k in differ])} (ask with the same terms, or free the task first)",
    )


class Insufficient(Exception):
    """The node (or the tenant's quota) cannot hold the request now."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what  # "gpus", "cpus" or "tenant_quota"
        self.message = message


@dataclass(frozen=True, slots=True)
class Served:
    """A waiter got its allocation."""

    allocation: Allocation


@dataclass(frozen=True, slots=True)
class Expired:
    """A waiter's deadline passed; it is out of the queue."""

    task_id: str
    reason: Insufficient


LedgerEffect = Served | Expired


@dataclass(slots=True)
class _Waiter:
    request: Request
    deadline: int
    last_reason: Insufficient


@dataclass(slots=True)
class _Gpu:
    spec: GpuSpec
    free: int = UNIT
    tasks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The ledger's whole state at one moment (see ``Ledger.checkpoint``)."""

    gpus: dict[int, tuple[int, dict[str, int]]]
    free_cpus: frozenset[int]
    allocs: dict[str, Allocation]
    waiters: list[tuple[int, int, str]]
    waiting: dict[str, tuple[Request, int, Insufficient]]
    seq: int
    rr_last: int
    rng: tuple[Any, ...]


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
    ) -> None:
        self._gpus = {g.index: _Gpu(g) for g in gpus}
        self._cpus = sorted(cpus)
        self._free_cpus = set(cpus)
        self._cpu_numa = dict(cpu_numa or {})
        self._tenants = dict(tenants or {})
        self._allocs: dict[str, Allocation] = {}
        self._waiters: list[tuple[int, int, str]] = []  # (-priority, seq, task_id)
        self._waiting: dict[str, _Waiter] = {}
        self._seq = 0
        self._rng = random.Random(seed)
        self._rr_last = -1
        self._max_waiters = max_waiters

    # --- calls ------------------------------------------------------------

    def allocate(self, req: Request, now: int) -> Allocation | None:
        """The allocation, or None if the request now waits (``wait_us`` > 0).

        Raises Refused for a wrong request and Insufficient when it does not
        fit and may not wait; either way nothing changed."""
        if (held := self._allocs.get(req.task_id)) is not None:
            _check_same_terms(req, _terms(held), "holds")
            return held
        if (waiter := self._waiting.get(req.task_id)) is not None:
            _check_same_terms(req, _terms(waiter.request), "waits for")
            raise Refused(
                ErrorCode.INVALID,
                f"task {req.task_id!r} already waits for this allocation: one request "
                "per task id waits at a time, and the first is answered when it fits",
            )
        self._validate(req)
        try:
            return self._place(req, now)
        except Insufficient as short:
            if req.wait_us <= 0:
                raise
            if len(self._waiting) >= self._max_waiters:
                raise LimitReached(
                    "max_allocation_waiters", f"{short.message}, and {len(self._waiting)} requests already wait"
                ) from None
            self._waiting[req.task_id] = _Waiter(req, now + req.wait_us, short)
            self._seq += 1
            self._waiters.append((-req.priority, self._seq, req.task_id))
            self._waiters.sort()
            return None

    def release(self, task_id: str, now: int) -> tuple[Allocation | None, list[LedgerEffect]]:
        """Free a task's allocation and serve waiters that now fit, or withdraw its wait."""
        alloc = self._allocs.pop(task_id, None)
        if alloc is None:
            if task_id in self._waiting:
                self._unwait(task_id)
            return None, []
        for g in alloc.gpus:
            gpu = self._gpus[g]
            gpu.free += gpu.tasks.pop(task_id)
        self._free_cpus.update(alloc.cpus)
        return alloc, self._serve(now)

    def checkpoint(self) -> Checkpoint:
        """A copy of the whole state, to ``rollback`` to if a change cannot be stored."""
        return Checkpoint(
            gpus={i: (g.free, dict(g.tasks)) for i, g in self._gpus.items()},
            free_cpus=frozenset(self._free_cpus),
            allocs=dict(self._allocs),
            waiters=list(self._waiters),
            waiting={t: (w.request, w.deadline, w.last_reason) for t, w in self._waiting.items()},
            seq=self._seq,
            rr_last=self._rr_last,
            rng=self._rng.getstate(),
        )

    def rollback(self, cp: Checkpoint) -> None:
        """Back to exactly the state of ``cp``."""
        for i, (free, tasks) in cp.gpus.items():
            self._gpus[i].free, self._gpus[i].tasks = free, dict(tasks)
        self._free_cpus = set(cp.free_cpus)
        self._allocs = dict(cp.allocs)
        self._waiters = list(cp.waiters)
        self._waiting = {t: _Waiter(*w) for t, w in cp.waiting.items()}
        self._seq, self._rr_last = cp.seq, cp.rr_last
        self._rng.setstate(cp.rng)

    def restore(self, alloc: Allocation) -> None:
        """Put back an allocation read from the store at start-up (ValueError: it cannot be)."""
        if alloc.task_id in self._allocs:
            raise ValueError(f"stored allocation of {alloc.task_id!r} is there twice")
        if not (0 < alloc.share <= UNIT if alloc.gpus else alloc.share == 0) or len(set(alloc.gpus)) != len(alloc.gpus):
            raise ValueError(f"stored allocation of {alloc.task_id!r} has share {alloc.share} of GPUs {alloc.gpus}")
        if len(alloc.gpus) > 1 and alloc.share != UNIT:
            raise ValueError(f"stored allocation of {alloc.task_id!r} splits a fraction over several GPUs")
        if len(set(alloc.cpus)) != len(alloc.cpus) or not 0 <= alloc.priority <= 100:
            raise ValueError(
                f"stored allocation of {alloc.task_id!r} has repeated CPU cores or priority {alloc.priority}"
            )
        for g in alloc.gpus:
            if g not in self._gpus or self._gpus[g].free < alloc.share:
                raise ValueError(f"stored allocation of {alloc.task_id!r} does not fit GPU {g} any more")
        if not set(alloc.cpus) <= self._free_cpus:
            raise ValueError(f"stored allocation of {alloc.task_id!r} uses CPU cores that are not free")
        self._commit(alloc)

    def reconfigure(self, *, tenants: dict[str, TenantQuota], max_waiters: int) -> None:
        """New tenant quotas and waiter cap (a reload): they apply to requests from now on."""
        self._tenants = dict(tenants)
        self._max_waiters = max_waiters

    def advance(self, now: int) -> list[LedgerEffect]:
        """Expire waiters whose deadline passed."""
        effects: list[LedgerEffect] = []
        for task_id, w in list(self._waiting.items()):
            if now >= w.deadline:
                self._unwait(task_id)
                effects.append(Expired(task_id, w.last_reason))
        return effects

    def next_deadline(self) -> int | None:
        return min((w.deadline for w in self._waiting.values()), default=None)

    # --- reading ------------------------------------------------------------

    def allocations(self) -> list[Allocation]:
        return list(self._allocs.values())

    def get(self, task_id: str) -> Allocation | None:
        return self._allocs.get(task_id)

    def waiting(self) -> list[Request]:
        return [self._waiting[t].request for _, _, t in self._waiters]

    def fractions_on(self, gpu: int) -> list[Allocation]:
        """The fractional allocations on ``gpu`` (their sessions are limited to their share)."""
        return [self._allocs[t] for t, share in self._gpus[gpu].tasks.items() if share < UNIT]

    def gpu_free(self, index: int) -> int:
        return self._gpus[index].free

    def gpu_tasks(self, index: int) -> dict[str, int]:
        return dict(self._gpus[index].tasks)

    def cpus_free(self) -> list[int]:
        return sorted(self._free_cpus)

    @property
    def cpu_count(self) -> int:
        return len(self._cpus)

    def tenant_usage(self, tenant: str) -> int:
        return sum(a.total for a in self._allocs.values() if a.tenant == tenant)

    # --- rules ------------------------------------------------------------

    def _validate(self, req: Request) -> None:
        n = len(self._gpus)
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
        if req.cpus < 0 or req.cpus > len(self._cpus):
            raise Refused(ErrorCode.INVALID, f"{req.cpus} CPU cores asked, this node has {len(self._cpus)}")
        for g in req.prefer:
            if g not in self._gpus:
                raise Refused(
                    ErrorCode.UNKNOWN_GPU,
                    f"unknown GPU {g} in prefer (this node has GPUs " + ", ".join(map(str, self._gpus)) + ")",
                )
        if req.tenant is not None and req.tenant not in self._tenants:
            known = ", ".join(sorted(self._tenants)) or "none configured"
            raise Refused(ErrorCode.UNKNOWN_TENANT, f"unknown tenant {req.tenant!r} (tenants: {known})")

    def _place(self, req: Request, now: int) -> Allocation:
        self._check_tenant(req)
        gpus = self._choose_gpus(req) if req.gpus > 0 else []
        cpus = self._choose_cpus(req.cpus, gpus)
        share = UNIT if req.gpus >= UNIT else req.gpus
        alloc = Allocation(
            req.task_id, tuple(gpus), share if gpus else 0, tuple(cpus), req.tenant, req.priority, req.owner_pid, now
        )
        if req.strategy == Strategy.ROUND_ROBIN and gpus:
            self._rr_last = gpus[-1]
        self._commit(alloc)
        return alloc

    def _commit(self, alloc: Allocation) -> None:
        for g in alloc.gpus:
            gpu = self._gpus[g]
            gpu.free -= alloc.share
            gpu.tasks[alloc.task_id] = alloc.share
        self._free_cpus.difference_update(alloc.cpus)
        self._allocs[alloc.task_id] = alloc

    def _check_tenant(self, req: Request) -> None:
        if req.tenant is None:
            return
        quota = self._tenants[req.tenant]
        used = self.tenant_usage(req.tenant)
        over = used + req.gpus - quota.gpus
        if over <= 0:
            return
        idle = sum(max(0, q.gpus - self.tenant_usage(t)) for t, q in self._tenants.items() if t != req.tenant)
        if over > quota.borrow or over > idle:
            raise Insufficient(
                "tenant_quota",
                f"tenant {req.tenant!r} uses {used / UNIT:g} of its {quota.gpus / UNIT:g} GPUs; "
                f"{req.gpus / UNIT:g} more needs {over / UNIT:g} borrowed, and it may borrow "
                f"{min(quota.borrow, idle) / UNIT:g} now (bound {quota.borrow / UNIT:g}, idle elsewhere {idle / UNIT:g})",
            )

    def _order(self, candidates: list[_Gpu], req: Request) -> list[_Gpu]:
        match req.strategy:
            case Strategy.BEST_FIT:
                ordered = sorted(candidates, key=lambda g: (g.free, g.spec.index))
            case Strategy.LEAST_LOADED:
                ordered = sorted(candidates, key=lambda g: (-g.free, g.spec.index))
            case Strategy.ROUND_ROBIN:
                ordered = sorted(candidates, key=lambda g: (g.spec.index - self._rr_last - 1) % (1 << 30))
            case Strategy.RANDOM:
                ordered = sorted(candidates, key=lambda g: g.spec.index)
                self._rng.shuffle(ordered)
            case _:
                ordered = sorted(candidates, key=lambda g: g.spec.index)
        preferred = [g for p in req.prefer for g in ordered if g.spec.index == p]
        return preferred + [g for g in ordered if g not in preferred]

    def _choose_gpus(self, req: Request) -> list[int]:
        if req.gpus >= UNIT:
            need = req.gpus // UNIT
            free = [g for g in self._gpus.values() if g.free == UNIT]
            if len(free) < need:
                raise Insufficient("gpus", f"{need} whole GPU(s) asked, {len(free)} entirely free now")
            return [g.spec.index for g in self._order(free, req)[:need]]
        fits = [g for g in self._gpus.values() if g.free >= req.gpus]
        if not fits:
            most = max((g.free for g in self._gpus.values()), default=0)
            raise Insufficient(
                "gpus", f"{req.gpus / UNIT:g} of one GPU asked, the most free on any GPU is {most / UNIT:g}"
            )
        partly = [g for g in fits if g.free < UNIT]
        whole = [g for g in fits if g.free == UNIT]
        preferred = [g for g in fits if g.spec.index in req.prefer]
        if preferred:
            return [self._order(preferred, req)[0].spec.index]
        return [(self._order(partly, req) or self._order(whole, req))[0].spec.index]

    def _choose_cpus(self, count: int, gpus: list[int]) -> list[int]:
        if count == 0:
            return []
        if len(self._free_cpus) < count:
            raise Insufficient("cpus", f"{count} CPU core(s) asked, {len(self._free_cpus)} free now")
        nodes = {self._gpus[g].spec.numa_node for g in gpus} - {None}
        local = sorted(c for c in self._free_cpus if self._cpu_numa.get(c) in nodes)
        rest = sorted(c for c in self._free_cpus if c not in local)
        return (local + rest)[:count]

    def _unwait(self, task_id: str) -> None:
        del self._waiting[task_id]
        self._waiters = [w for w in self._waiters if w[2] != task_id]

    def _serve(self, now: int) -> list[LedgerEffect]:
        """Grant waiters in priority order, each as soon as it fits."""
        effects: list[LedgerEffect] = []
        for _, _, task_id in list(self._waiters):
            w = self._waiting[task_id]
            try:
                alloc = self._place(w.request, now)
            except Insufficient as short:
                w.last_reason = short
                continue
            self._unwait(task_id)
            effects.append(Served(alloc))
        return effects
