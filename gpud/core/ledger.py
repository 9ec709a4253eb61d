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
  Both cost what the change changed, not what the ledger holds (``gpud.core.journal``), and so
  do ``changed_records`` (what to store) and every call but the walks ``records`` and
  ``allocations`` (``gpud.core.ledger_index``): one release among 20 000 allocations costs what
  it costs among 10.

Taking allocations back (the rules of choosing victims are in ``gpud.core.preemption``):
- Priority 100 (production) is never preempted by a request; 1..99 once it has run
  ``min_runtime_us``; 0 (spot) at any time; a protected allocation never; nor one no one can be
  told about (the shell keeps ``reachable``: a live holder, or an owner pid gpud may signal).
- A waiter that does not fit may take back strictly lower priorities, an elastic allocation's
  GPUs above its minimum (priorities up to its own), and allocations on borrowed tenant quota
  when it asks within its own quota. Its victims get a ``Notice`` and ``grace_us``; their devices
  stay theirs until they yield or free, or the grace ends: no device is held twice. The waiter
  then waits at least until its victims' grace has ended; giving up (or being served before they
  left) withdraws the notices, and a victim whose notice was withdrawn is not chosen again for
  ``cooldown_us`` (no thrash).
- Recovery ``suspend``: a victim that yields waits again, pinned to its GPUs, at its priority, and
  is ``Served(resumed=True)`` when they are free. ``checkpoint``: the task's next allocation says
  ``resume``. ``shrink``: only an elastic allocation's extras are ever taken.
- Elastic allocations (``gpus_min``..``gpus_max`` whole GPUs) get what is free up to the maximum
  (and up to what their tenant may use) when nobody of equal or higher priority waits, grow when
  whole GPUs have stayed free for ``elastic_window_us`` and no such waiter waits, at most once per
  ``elastic_cooldown_us`` (since their last change).
- A draining GPU takes no new grants; every allocation on it that can be told gets a notice,
  withdrawn when none of the GPUs it names drains any more.
- ``next_deadline`` is never a time ``advance`` has already passed with nothing to do there.
- Among equals the lower task id goes first (victims, elastic growth), never the order the
  allocations came in: a restart or a rollback does not keep that order.

Telling in batches (so that no call grows with how many allocations a GPU holds: 10 000 fractions):
- A waiter's victims are chosen at once (its plan; nobody else may choose them meanwhile) and told
  ``NOTICE_BATCH`` at a time: each call tells, withdraws and carries out at most that many notices
  in all, and the rest wait for the next calls, ``next_deadline`` answering the last ``advance``'s
  time while some are left (the shell's timer calls again at once). Each victim's grace starts when
  it is told; the waiter waits until every one of them has left (or was not told after all: one
  that left, was protected, or is no longer there as planned is skipped).
- A drain tells the allocations on its GPUs likewise, in task id order; putting a GPU back withdraws
  its drain's notices likewise.
- A waiter that gives up (or is served) tells no more, and the notices it caused are withdrawn in
  batches: until then they are the notices of nobody, carried out by no deadline and no yield (a
  yield withdraws its own); a new wait of the same task id chooses nothing until they are gone.
- A plan is not durable: after a restart its waiter waits for the victims it told to leave (the
  store keeps them with its wait), then chooses again. A notice whose waiter is not there after a
  restart is withdrawn.
- Expired immunities are forgotten in batches, and no plan is made until they all are.
- Suspended allocations wait in any number (thousands of victims may suspend): serving reads only
  those whose GPUs have room for them, and serves a batch of waiters at most per call, the rest at
  the next calls; choosing victims reads only those that could take something back.

What it holds per allocation for life (``Allocation``, ``Notice``, ``TaskRecord``, the index's facts)
is in no reference cycle and not tracked by the garbage collector: 20 000 allocations do not
lengthen its full collections.

A refused call raises ``Refused`` (the request is wrong) or ``Insufficient``
(the node is too full) and changes nothing. Pure: no clock, no storage; time
is integer microseconds passed in.
"""

from __future__ import annotations

import random
from bisect import insort
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from heapq import merge
from itertools import chain, islice
from typing import Any

import msgspec
from msgspec import structs

from gpud.core.errors import LimitReached, Refused
from gpud.core.journal import JDict, Journal
from gpud.core.ledger_index import DRAIN, LedgerIndex, Queued, as_victim
from gpud.core.preemption import Candidate, Chunk, Need, Pool, Room, Victim, choose
from gpud.core.shields import AT_MINIMUM, MIN_RUNTIME, OFF, PRODUCTION, PROTECTED, RESTING, UNREACHABLE, Blocked, Shield
from gpud.core.sortedkeys import SortedKeys
from gpud_client.protocol import ErrorCode, PreemptReason, PreemptStrategy, Recovery, Strategy
from gpud_client.units import GPU_UNIT, fixed_gpus

UNIT = GPU_UNIT  # one GPU
NOTICE_BATCH = 64  # notices told, withdrawn or carried out per call, at most (the shell spends ~60-90 us on each)
IMMUNITY_BATCH = 1024  # expired immunities forgotten per ``advance``
BLOCKERS_READ = 64  # allocations read to say why nothing could be taken back for a request
BLOCKED_WAITERS = 16  # waiters (the first in the queue) whose listing says what is in their way
PLAN_READ = 8 * NOTICE_BATCH  # planned victims looked at per call (those no longer to tell cost no notice)
IDLE = "idle"  # the ``by`` of an elastic allocation's notice to give back what idles


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
    on_preempt: Recovery = Recovery.TERMINATE
    gpus_max: int = 0  # elastic: at most this many whole GPUs (``gpus`` is the minimum); 0: not elastic
    protected: bool = False
    pinned: tuple[int, ...] = ()  # a suspended allocation waits for exactly these GPUs


class Allocation(msgspec.Struct, frozen=True, gc=False):
    """One task's devices. Never in a reference cycle, so not tracked by the garbage collector (the
    ledger holds 20 000 of them for life: a full collection need not scan them)."""

    task_id: str
    gpus: tuple[int, ...]
    share: int  # fixed point per GPU: UNIT for whole GPUs
    cpus: tuple[int, ...]
    tenant: str | None
    priority: int
    owner_pid: int | None
    created_us: int
    on_preempt: Recovery = Recovery.TERMINATE
    gpus_min: int = 0  # elastic: whole GPUs it may be shrunk to; 0: not elastic
    gpus_max: int = 0
    protected: bool = False
    preemptions: int = 0  # how often this task was preempted
    resume: bool = False  # its last preemption asked it to checkpoint: this start resumes
    changed_us: int = 0  # its last elastic change

    @property
    def total(self) -> int:
        return self.share * len(self.gpus)

    @property
    def extras(self) -> tuple[int, ...]:
        """The GPUs an elastic allocation holds above its minimum (the last ones it got)."""
        return self.gpus[self.gpus_min :] if self.gpus_min else ()


@dataclass(frozen=True, slots=True)
class PreemptionConfig:
    grace_us: int = 30_000_000
    min_runtime_us: int = 300_000_000
    strategy: PreemptStrategy = PreemptStrategy.LOWEST_PRIORITY
    cooldown_us: int = 60_000_000  # a victim whose notice was withdrawn is not chosen again for this long
    elastic_cooldown_us: int = 60_000_000
    elastic_window_us: int = 30_000_000
    enabled: bool = True  # False: waiters never take anything back (a drain still does)
    # Elastic allocations grow only while their GPUs are busy (utilisation at or above this, through
    # the window) and give back their extras when their GPUs idle below it through the window. 0: off.
    busy_percent: int = 0


class Notice(msgspec.Struct, frozen=True, gc=False):
    """An allocation told to give ``gpus`` back (all of them: ``whole``) by ``deadline`` (not tracked
    by the garbage collector, as ``Allocation``)."""

    task_id: str
    reason: PreemptReason
    gpus: tuple[int, ...]
    whole: bool
    issued: int
    deadline: int
    by: str  # the waiting task, or "drain"


def recovery_told(alloc: Allocation, notice: Notice) -> Recovery:
    """What the holder of a notice is told to do: its recovery; but one that only ever shrinks, taken
    whole (by a drain), ends."""
    if notice.whole and alloc.on_preempt == Recovery.SHRINK:
        return Recovery.TERMINATE
    return alloc.on_preempt


NEVER = 1 << 62  # a suspended allocation's wait has no deadline


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
    "on_preempt": lambda v: f"on_preempt {v}",
    "gpus_max": lambda v: "no elastic range" if not v else f"at most {v} GPUs",
}


def _terms(x: Request | Allocation) -> dict[str, Any]:
    if isinstance(x, Allocation):
        return {
            "gpus": x.gpus_min * UNIT if x.gpus_min else x.total,
            "cpus": len(x.cpus),
            "tenant": x.tenant,
            "priority": x.priority,
            "owner_pid": x.owner_pid,
            "on_preempt": x.on_preempt,
            "gpus_max": x.gpus_max,
        }
    return {
        "gpus": x.gpus,
        "cpus": x.cpus,
        "tenant": x.tenant,
        "priority": x.priority,
        "owner_pid": x.owner_pid,
        "on_preempt": x.on_preempt,
        "gpus_max": x.gpus_max,
    }


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
    """A waiter got its allocation (``resumed``: a suspended allocation has its devices again)."""

    allocation: Allocation
    resumed: bool = False


@dataclass(frozen=True, slots=True)
class Expired:
    """A waiter's deadline passed; it is out of the queue."""

    task_id: str
    reason: Insufficient


@dataclass(frozen=True, slots=True)
class Noticed:
    """An allocation is told to leave (``notice``)."""

    allocation: Allocation
    notice: Notice


@dataclass(frozen=True, slots=True)
class Withdrawn:
    """A notice is withdrawn: the waiter gave up, or the GPU is no longer drained."""

    allocation: Allocation
    notice: Notice


@dataclass(frozen=True, slots=True)
class TakenBack:
    """A notice is carried out: the allocation is gone (``after`` None), suspended
    (``suspended``), or shrunk to ``after``; ``overran``: its grace ended, it did not yield."""

    before: Allocation
    notice: Notice
    after: Allocation | None
    suspended: bool
    overran: bool


@dataclass(frozen=True, slots=True)
class Grown:
    """An elastic allocation got more GPUs."""

    allocation: Allocation


LedgerEffect = Served | Expired | Noticed | Withdrawn | TakenBack | Grown


@dataclass(frozen=True, slots=True)
class _Waiter:
    request: Request
    deadline: int
    since: int = 0
    victims: tuple[str, ...] = ()  # allocations told to leave for it, by task id
    suspended: Allocation | None = None  # a suspended allocation waiting for its GPUs
    plan: tuple[str, ...] = ()  # victims chosen, not told yet, in the order they are told
    how: tuple[Candidate, ...] = ()  # those of them not taken whole for priority: how they are taken
    seq: int = 0  # its place in the queue among equal priorities


class _Budget:
    """What one call may still tell, withdraw or carry out (not state: it starts afresh each call)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = NOTICE_BATCH

    def __repr__(self) -> str:
        return "<notice budget>"


class TaskRecord(msgspec.Struct, frozen=True, gc=False):
    """What is durable of one task id: its allocation and notice, its wait when it is suspended or
    has victims, its preemption history. See ``Ledger.records``."""

    task_id: str
    allocation: Allocation | None = None
    notice: Notice | None = None
    waiting: Request | None = None
    wait_deadline: int = 0
    wait_since: int = 0
    victims: tuple[str, ...] = ()
    suspended: Allocation | None = None
    preemptions: int = 0
    resume: bool = False


@dataclass(slots=True)
class _Gpu:
    spec: GpuSpec
    tasks: JDict[str, int]
    free: int = UNIT


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A moment to roll back to (see ``Ledger.checkpoint``). Two checkpoints are equal when the
    ledger was in the same state at both."""

    state: int  # the journal's name of the state of the ledger's dicts
    small: tuple[Any, ...]  # the rest, each small or never changed in place
    epoch: int = field(compare=False)


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
        # The state: dicts whose changes the journal can undo (``checkpoint``), and small values
        # that are replaced, never changed in place, so that a checkpoint keeps them as they are.
        j = self._journal = Journal()
        self._gpus = {g.index: _Gpu(g, JDict(j)) for g in gpus}
        self._cpus = sorted(cpus)
        self._free_cpus = frozenset(cpus)
        self._cpu_numa = dict(cpu_numa or {})
        self._tenants = dict(tenants or {})
        self._allocs: JDict[str, Allocation] = JDict(j, self._record_changed)
        self._waiters: list[Queued] = []  # the requests waiting (not the suspended allocations: see the index)
        self._waiting: JDict[str, _Waiter] = JDict(j, self._record_changed)
        self._seq = 0
        self._rng = random.Random(seed)
        self._rr_last = -1
        self._max_waiters = max_waiters
        self.preemption = preemption or PreemptionConfig()
        self._notices: JDict[str, Notice] = JDict(j, self._record_changed)
        # task id -> (preemptions, resume): no allocation now
        self._history: JDict[str, tuple[int, bool]] = JDict(j, self._record_changed)
        self._immune: JDict[str, int] = JDict(j, self._reindex)  # task id -> until when it is not chosen again
        self._draining: frozenset[int] = frozenset()
        self._grow_since: JDict[str, int] = JDict(j)  # elastic task id -> since when it could grow
        self._advanced_to = 0  # the last ``advance``: maturities up to it are in the past
        self._reserved: dict[int, str] = {}  # GPU a victim gave back -> the waiter it was taken for
        self._why: JDict[str, Insufficient] = JDict(j)  # why each waiter waits: the last reason it did not fit
        self._changed: JDict[str, None] = JDict(j)  # task ids whose record may differ from the stored one
        self._index = LedgerIndex(self._allocs, self._notices, self._immune, self._waiting, NEVER)
        # Readings of GPU utilisation (observations, not decisions): since when each GPU is busy or idle.
        self._busy_since: dict[int, int] = {}
        self._idle_since: dict[int, int] = {}
        self.reachable: set[str] = set()  # the shell's fact: task ids someone can be told about
        self._withdrawing: frozenset[str] = frozenset()  # waiters gone whose notices are still withdrawn
        self._undraining: frozenset[int] = frozenset()  # GPUs put back whose drain notices are still withdrawn
        self._serving = False  # a batch of waiters was served: more may fit, the next call looks again
        self._budget = _Budget()

    # --- calls ------------------------------------------------------------

    def allocate(self, req: Request, now: int, *, rejoin: bool = False) -> Allocation | None:
        """The allocation, or None if the request now waits (``wait_us`` > 0; ``advance`` then
        looks for victims that would let it fit).

        Raises Refused for a wrong request and Insufficient when it does not
        fit and may not wait; either way nothing changed. ``rejoin``: the task's wait (restored
        from the store, its connection gone) is the caller's now, with the same terms."""
        if (held := self._allocs.get(req.task_id)) is not None:
            _check_same_terms(req, _terms(held), "holds")
            return held
        if (waiter := self._waiting.get(req.task_id)) is not None:
            _check_same_terms(req, _terms(waiter.suspended or waiter.request), "waits for")
            if waiter.suspended is not None or rejoin:  # its holder again, or a wait whose connection is gone
                return None
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
                raise self.explained(short, req, now) from None
            if len(self._waiting) >= self._max_waiters:
                raise LimitReached(
                    "max_allocation_waiters", f"{short.message}, and {len(self._waiting)} requests already wait"
                ) from None
            self._enqueue(_Waiter(req, now + req.wait_us, now, seq=self._seq + 1), short)
            return None

    def release(self, task_id: str, now: int) -> tuple[Allocation | None, list[LedgerEffect]]:
        """Free a task's allocation and serve waiters that now fit, or withdraw its wait (and the
        notices it caused, a batch now and the rest by ``advance``). An allocation freed under a
        notice counts as that preemption done."""
        self._budget.left = NOTICE_BATCH
        alloc = self._allocs.get(task_id)
        if alloc is None:
            effects: list[LedgerEffect] = []
            if task_id in self._waiting:
                effects = self._unwait(task_id, now)
            return None, effects
        notice = self._notices.pop(task_id, None)
        if notice is not None and self._nobodys(notice):
            notice = None  # withdrawn in all but name: freeing it is no preemption
        if notice is not None and notice.whole:
            self._remember(alloc)
        else:
            self._history.pop(task_id, None)
        if notice is not None and notice.by in self._waiting:
            self._reserved = {**self._reserved, **{g: notice.by for g in notice.gpus}}
        self._drop(alloc)
        return alloc, self._serve(now)

    def yield_(self, task_id: str, now: int) -> list[LedgerEffect]:
        """The holder of a notice did what it asked: carry it out now."""
        if task_id not in self._notices:
            what = "has no allocation" if task_id not in self._allocs else "was not asked to leave"
            raise Refused(ErrorCode.INVALID, f"task {task_id!r} {what}: there is nothing to yield")
        self._budget.left = NOTICE_BATCH
        n = self._notices[task_id]
        if self._nobodys(n):  # its waiter gave up (its withdrawal not told yet): withdrawn, not carried out
            return self._withdraw([task_id], now, rest=n.by != DRAIN)
        return self._take_back(task_id, now, overran=False)

    def protect(self, task_id: str, protected: bool) -> Allocation:
        """An admin's protection: a protected allocation is never chosen as a victim (a notice it
        already has stands)."""
        alloc = self._allocs.get(task_id)
        if alloc is None:
            raise Refused(ErrorCode.UNKNOWN_TASK, f"no allocation for task {task_id!r} (see gpuctl allocs)")
        alloc = structs.replace(alloc, protected=protected)
        self._allocs[task_id] = alloc
        return alloc

    def drain(self, gpu: int, on: bool, now: int) -> list[LedgerEffect]:
        """Drain a GPU (no new grants; ``advance`` tells its allocations to leave, a batch at a time)
        or put it back, withdrawing the drain's notices that still run (a batch now, the rest by
        ``advance``) but those of allocations another of whose GPUs drains."""
        if gpu not in self._gpus:
            raise Refused(ErrorCode.UNKNOWN_GPU, f"unknown GPU {gpu}")
        if on:
            self._draining |= {gpu}
            self._undraining -= {gpu}
            return []
        self._budget.left = NOTICE_BATCH
        self._draining -= {gpu}
        self._undraining |= {gpu}
        return self._undrain(now) + self._serve(now)

    def checkpoint(self) -> Checkpoint:
        """A moment to ``rollback`` to if a change cannot be stored. From now on the journal saves
        the old value of whatever changes; a newer checkpoint supersedes this one."""
        epoch, state = self._journal.start()
        return Checkpoint(state, self._small(), epoch)

    def _small(self) -> tuple[Any, ...]:
        frees = tuple(g.free for g in self._gpus.values())
        rest = (self._draining, self._advanced_to, self._reserved, self._withdrawing, self._undraining, self._serving)
        return (frees, self._free_cpus, self._waiters, self._seq, self._rr_last, *rest)

    def rollback(self, cp: Checkpoint) -> None:
        """Back to exactly the state of ``cp`` (ValueError: a newer checkpoint superseded it), in
        what changed since: the journal puts back the old values, the index follows them."""
        keys = self._journal.undo(cp.epoch, cp.state)
        frees, self._free_cpus, self._waiters, self._seq, self._rr_last, *rest = cp.small
        self._draining, self._advanced_to, self._reserved, self._withdrawing, self._undraining, self._serving = rest
        for g, free in zip(self._gpus.values(), frees):
            g.free = free
        for t in keys:
            self._index.update(t)

    def _record_changed(self, t: str) -> None:
        """The allocation, notice, wait or history of ``t`` changed: so may its record."""
        self._changed[t] = None
        self._index.update(t)

    def _reindex(self, t: str) -> None:
        self._index.update(t)

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
        if not self._free_cpus.issuperset(alloc.cpus):
            raise ValueError(f"stored allocation of {alloc.task_id!r} uses CPU cores that are not free")
        self._commit(alloc)

    def restore_record(self, rec: TaskRecord, now: int) -> None:
        """Put back one stored task (``records``' counterpart; ValueError: it cannot be). Times
        from before a reboot (monotonic time started again) are brought within reach of ``now``."""
        if rec.allocation is not None:
            alloc = rec.allocation
            if alloc.created_us > now:
                alloc = structs.replace(alloc, created_us=now, changed_us=min(alloc.changed_us, now))
            self.restore(alloc)
            if rec.notice is not None:
                n = rec.notice
                if n.deadline > now + self.preemption.grace_us:
                    n = structs.replace(n, issued=now, deadline=now + self.preemption.grace_us)
                self._notices[rec.task_id] = n
        elif rec.waiting is not None:
            # The cap is for requests (a suspended allocation is none), and those stored were admitted under
            # it: only a lowered cap refuses one.
            requests = len(self._waiters)
            full = rec.suspended is None and requests >= self._max_waiters
            if rec.task_id in self._waiting or full:
                raise ValueError(f"stored wait of {rec.task_id!r} is there twice, or too many waits are stored")
            self._validate(rec.waiting)
            short = Insufficient("gpus", "waiting since before gpud restarted")
            # within reach of now: its own wait, or its victims' grace when that is longer (as ``_plan`` set it)
            reach = max(rec.waiting.wait_us, self.preemption.grace_us + 1) if rec.victims else rec.waiting.wait_us
            deadline = NEVER if rec.suspended is not None else min(rec.wait_deadline, now + reach)
            seq = self._seq + 1
            self._enqueue(
                _Waiter(
                    rec.waiting, deadline, min(rec.wait_since, now), tuple(sorted(rec.victims)), rec.suspended, seq=seq
                ),
                short,
            )
        if rec.allocation is None and rec.suspended is None and (rec.preemptions or rec.resume):
            self._history[rec.task_id] = (rec.preemptions, rec.resume)

    def records(self, before: dict[str, TaskRecord] | None = None) -> dict[str, TaskRecord]:
        """Everything durable, per task id (a walk over all: for start-up and checks; after a
        change, ``changed_records``). ``before``: the last records; an allocation's record that did
        not change is the same object (allocations and notices are replaced, never changed)."""
        out: dict[str, TaskRecord] = {}
        before = before or {}
        for t in [*self._allocs, *self._waiting, *self._history]:  # in this order, as the store expects
            if t not in out and (rec := self._record(t, before.get(t))) is not None:
                out[t] = rec
        return out

    def changed_records(self) -> tuple[dict[str, TaskRecord], set[str]]:
        """What to store since the last ``mark_stored``: the records of the tasks whose record may
        differ from the stored one, and the task ids that have none now (a few may never have been
        stored). Applied to the records last stored, they give ``records()``."""
        put: dict[str, TaskRecord] = {}
        gone: set[str] = set()
        for t in self._changed:
            rec = self._record(t)
            if rec is None:
                gone.add(t)
            else:
                put[t] = rec
        return put, gone

    def mark_stored(self) -> None:
        """The shell stored ``changed_records``: nothing differs from the store now (a rollback to a
        checkpoint taken before puts back what was to be stored then)."""
        self._changed.clear()

    def _record(self, t: str, old: TaskRecord | None = None) -> TaskRecord | None:
        if (a := self._allocs.get(t)) is not None:
            n = self._notices.get(t)
            return old if old is not None and old.allocation is a and old.notice is n else TaskRecord(t, a, n)
        w = self._waiting.get(t)
        pre, resume = self._history.get(t, (0, False))
        if w is None or (w.suspended is None and not w.victims):  # a plain wait dies with its connection
            return TaskRecord(t, preemptions=pre, resume=resume) if t in self._history else None
        if w.suspended is not None:  # its own count and flag (the store keeps one pair per task)
            pre, resume = w.suspended.preemptions, w.suspended.resume
        return TaskRecord(
            t,
            waiting=w.request,
            wait_deadline=w.deadline,
            wait_since=w.since,
            victims=w.victims,
            suspended=w.suspended,
            preemptions=pre,
            resume=resume,
        )

    def reconfigure(
        self, *, tenants: dict[str, TenantQuota], max_waiters: int, preemption: PreemptionConfig | None = None
    ) -> None:
        """New tenant quotas, waiter cap and preemption settings (a reload): they apply from now on."""
        self._tenants = dict(tenants)
        self._max_waiters = max_waiters
        if preemption is not None:
            self.preemption = preemption

    def advance(self, now: int) -> list[LedgerEffect]:
        """Carry out notices whose grace ended, expire waiters whose deadline passed, withdraw
        notices nobody needs, tell allocations on draining GPUs to leave, grow elastic allocations,
        find victims for waiters that do not fit and tell them: at most ``NOTICE_BATCH`` notices
        told, withdrawn or carried out in all, the rest at the next call."""
        self._budget.left = NOTICE_BATCH
        effects: list[LedgerEffect] = self._serve(now) if self._serving else []
        self._advanced_to = max(self._advanced_to, now)
        for task_id in self._index.due_notices(now, NOTICE_BATCH):  # the earliest deadline first
            n = self._notices.get(task_id)  # (one carried out may have served a waiter, withdrawing others)
            if self._budget.left <= 0:
                break
            if n is None or now < n.deadline:
                continue
            if self._nobodys(n):
                effects += self._withdraw([task_id], now, rest=n.by != DRAIN)
            else:
                self._budget.left -= 1
                effects += self._take_back(task_id, now, overran=True)
        for task_id in self._index.due_waits(now):
            w = self._waiting.get(task_id)
            if w is not None and now >= w.deadline and not self._leaving(w):
                why = self.explained(self._why[task_id], w.request, now)
                effects += self._unwait(task_id, now)
                effects.append(Expired(task_id, why))
        if (first := self._index.first_immunity()) is not None and first <= now:
            for task_id in self._index.due_immunities(now, IMMUNITY_BATCH):
                del self._immune[task_id]
        if self._index.told or self._withdrawing:
            effects += self._withdraw_left(now)
        effects += self._undrain(now)
        if self._draining:
            effects += self._drain_notices(now)
        if self._index.elastic:
            effects += self._grow(now)
            effects += self._shrink_idle(now)
        first = self._index.first_immunity()  # victims are chosen among all who may be: none left immune
        return effects + self._plan(now, choose=first is None or first > now)

    def next_deadline(self) -> int | None:
        times = self._index.first_deadlines()  # of notices and waits
        times += [self._grow_at(t) for t in self._grow_since]
        times += self._maturities()
        times += self._idle_times()
        if self._batches_left():
            times.append(self._advanced_to)
        return min(times, default=None)

    def _batches_left(self) -> bool:
        """Whether work waits for the next ``advance``: victims to tell, notices to withdraw,
        allocations on draining GPUs to tell, immunities to forget."""
        index = self._index
        if index.chosen or self._withdrawing or self._undraining or self._serving:
            return True
        if index.told and any(by != IDLE and by not in self._waiting for by in index.told):
            return True
        if (first := index.first_immunity()) is not None and first <= self._advanced_to:
            return True
        untold = index.untold
        return bool(self._draining) and any(
            any(map(self.reachable.__contains__, untold.get(g, ()))) for g in self._draining
        )

    # --- reading ------------------------------------------------------------

    def allocations(self) -> list[Allocation]:
        """All running allocations, in the order they were made (a walk: see ``allocations_page``)."""
        return list(self._allocs.values())

    def allocations_page(self, after: str | None, limit: int) -> list[Allocation]:
        """Up to ``limit`` running and suspended allocations in task id order, those after ``after``
        (None: from the first), in O(limit + log n)."""
        ids = self._index.listed.after(after) if after is not None else iter(self._index.listed)
        out = []
        for t in islice(ids, max(0, limit)):
            a = self._allocs.get(t) or self._waiting[t].suspended
            assert a is not None  # listed: running or suspended
            out.append(a)
        return out

    def allocation_count(self) -> int:
        """How many allocations run or are suspended."""
        return len(self._index.listed)

    def get(self, task_id: str) -> Allocation | None:
        return self._allocs.get(task_id)

    def waiting(self) -> list[Request]:
        return [self._waiting[t].request for _, _, t in self._waiters if self._waiting[t].suspended is None]

    def waiter_info(self, now: int) -> list[tuple[Request, int, str]]:
        """Each waiter that is not a suspended allocation: its request, since when, and why it waits:
        the victims it waits for that have not left yet, else why it does not fit and (for the first
        ``BLOCKED_WAITERS`` in the queue) why nothing could be taken back for it."""
        out: list[tuple[Request, int, str]] = []
        for _, _, t in self._waiters:
            w = self._waiting[t]
            if w.suspended is not None:
                continue
            if self._leaving(w):
                why = _waits_for(w, self._index.told.get(t))
            elif len(out) < BLOCKED_WAITERS:
                why = self.explained(self._why[t], w.request, now).message
            else:
                why = self._why[t].message
            out.append((w.request, w.since, why))
        return out

    def suspended(self) -> list[Allocation]:
        """The suspended allocations (a walk: see ``suspended_of`` and ``suspended_count``)."""
        return [w.suspended for w in self._waiting.values() if w.suspended is not None]

    def suspended_of(self, task_id: str) -> Allocation | None:
        """The task's allocation if it is suspended (waits for its GPUs), in O(1)."""
        w = self._waiting.get(task_id)
        return None if w is None else w.suspended

    def suspended_count(self) -> int:
        return len(self._index.parked_order)

    def notice_of(self, task_id: str) -> Notice | None:
        return self._notices.get(task_id)

    def history_of(self, task_id: str) -> tuple[int, bool]:
        return self._history.get(task_id, (0, False))

    def draining(self) -> frozenset[int]:
        return frozenset(self._draining)

    def shield(self, alloc: Allocation, now: int) -> Shield | None:
        """What keeps ``alloc`` from being taken back now by a request of a higher priority, and
        until when; None: nothing does (the one rule of what ALLOCATE, ALLOCS and a refusal say).
        A drain is the operator's: it takes production and protected allocations too."""
        if alloc.protected:
            return PROTECTED
        if alloc.priority >= 100:
            return PRODUCTION
        if not self.preemption.enabled:
            return OFF
        if alloc.task_id not in self.reachable:
            return UNREACHABLE
        if alloc.on_preempt == Recovery.SHRINK and not alloc.extras:
            return AT_MINIMUM
        if (rest := self._immune.get(alloc.task_id)) is not None and rest > now:
            return Shield(RESTING, rest)
        mature = alloc.created_us + self.preemption.min_runtime_us
        if alloc.priority > 0 and now < mature and not alloc.extras and not self._over_quota(alloc.tenant):
            return Shield(MIN_RUNTIME, mature)  # (extras and borrowed quota are taken at any time)
        return None

    def _over_quota(self, tenant: str | None) -> bool:
        """Whether ``tenant`` uses more than its quota (what it borrowed may be reclaimed)."""
        quota = self._tenants.get(tenant or "")
        return quota is not None and self.tenant_usage(tenant or "") > quota.gpus

    def _blocked(self, req: Request, now: int) -> Blocked:
        """Why nothing could be taken back for ``req``: the allocations on the GPUs it may use (or
        holding CPU cores, for a request of cores alone), at most ``BLOCKERS_READ`` of them, each by
        what keeps it there."""
        out = Blocked(now)
        if req.gpus:
            ids: Iterable[str] = chain.from_iterable(self._gpus[g.spec.index].tasks for g in self._open_gpus(req))
        else:
            ids = (t for t, a in self._allocs.items() if a.cpus)
        seen: set[str] = set()
        for t in ids:
            if t in seen:
                continue
            if len(seen) == BLOCKERS_READ:
                out.read_all = False
                break
            seen.add(t)
            a = self._allocs[t]
            if (n := self._notices.get(t)) is not None:
                out.add(t, "told to leave already" + ("" if n.by in (DRAIN, IDLE) else f" (for task {n.by})"))
            elif (waiter := self._index.chosen.get(t)) is not None:
                out.add(t, f"chosen to leave for task {waiter}")
            elif a.priority >= req.priority and not (a.extras and a.priority <= req.priority):
                out.add(t, f"not of a lower priority than {req.priority}")
            elif (shield := self.shield(a, now)) is not None:
                out.add_shield(t, shield)
            elif req.wait_us <= 0:
                out.add(t, "of a lower priority: taken back only for a request that waits (wait_ms)")
            else:
                out.add(t, "may be taken back, but would not make room enough")
        return out

    def explained(self, short: Insufficient, req: Request, now: int) -> Insufficient:
        """``short`` with why nothing could be taken back for ``req`` (what was in its way)."""
        if short.what == "tenant_quota" or not (blocked := self._blocked(req, now)):
            return short
        return Insufficient(short.what, f"{short.message}; {blocked.text()}")

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
        return self._index.tenant_usage(tenant)

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

    def _place(self, req: Request, now: int, suspended: Allocation | None = None) -> Allocation:
        self._check_tenant(req)
        gpus = self._choose_gpus(req) if req.gpus > 0 else []
        cpus = self._choose_cpus(req.cpus, gpus)
        share = UNIT if req.gpus >= UNIT else req.gpus
        pre, resume = self._history.get(req.task_id, (0, False))
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
        )
        if suspended is not None:  # the same allocation, its devices back
            alloc = structs.replace(suspended, cpus=tuple(cpus), changed_us=now)
        if req.strategy == Strategy.ROUND_ROBIN and gpus:
            self._rr_last = gpus[-1]
        self._history.pop(req.task_id, None)
        self._commit(alloc)
        return alloc

    def _commit(self, alloc: Allocation) -> None:
        for g in alloc.gpus:
            gpu = self._gpus[g]
            gpu.free -= alloc.share
            gpu.tasks[alloc.task_id] = alloc.share
        if alloc.cpus:
            self._free_cpus = self._free_cpus.difference(alloc.cpus)
        self._allocs[alloc.task_id] = alloc

    def _drop(self, alloc: Allocation) -> None:
        del self._allocs[alloc.task_id]
        for g in alloc.gpus:
            gpu = self._gpus[g]
            gpu.free += gpu.tasks.pop(alloc.task_id)
        if alloc.cpus:
            self._free_cpus = self._free_cpus.union(alloc.cpus)
        self._grow_since.pop(alloc.task_id, None)

    def _check_tenant(self, req: Request, minus: dict[str, int] | None = None) -> None:
        if req.tenant is None:
            return
        minus = minus or {}
        quota = self._tenants[req.tenant]

        def usage(t: str) -> int:
            return self.tenant_usage(t) - minus.get(t, 0)

        used = usage(req.tenant)
        over = used + req.gpus - quota.gpus
        if over <= 0:
            return
        idle = sum(max(0, q.gpus - usage(t)) for t, q in self._tenants.items() if t != req.tenant)
        if over > quota.borrow or over > idle:
            raise Insufficient(
                "tenant_quota",
                f"tenant {req.tenant!r} uses {used / UNIT:g} of its {quota.gpus / UNIT:g} GPUs; "
                f"{req.gpus / UNIT:g} more needs {over / UNIT:g} borrowed, and it may borrow "
                f"{min(quota.borrow, idle) / UNIT:g} now (bound {quota.borrow / UNIT:g}, idle elsewhere {idle / UNIT:g})",
            )

    def _tenant_room(self, tenant: str | None) -> int:
        """How much more ``tenant`` may use now: the rest of its quota and what it may still borrow
        (``_check_tenant``'s rule solved for the amount)."""
        if tenant is None:
            return len(self._gpus) * UNIT
        quota, used = self._tenants[tenant], self.tenant_usage(tenant)
        idle = sum(max(0, q.gpus - self.tenant_usage(t)) for t, q in self._tenants.items() if t != tenant)
        return max(0, quota.gpus - used + min(quota.borrow, idle))

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
                if not self._journal.keeps("rng"):
                    self._journal.keep("rng", partial(self._rng.setstate, self._rng.getstate()))
                self._rng.shuffle(ordered)
            case _:
                ordered = sorted(candidates, key=lambda g: g.spec.index)
        preferred = [g for p in req.prefer for g in ordered if g.spec.index == p]
        return preferred + [g for g in ordered if g not in preferred]

    def _open_gpus(self, req: Request) -> list[_Gpu]:
        """The GPUs a request may be placed on: not draining, its own when it is pinned, and not
        kept for a waiter of its priority or higher whose victim gave them back (so what a
        preemption freed is not taken by whoever comes next while the rest of it runs)."""
        return [
            g
            for g in self._gpus.values()
            if g.spec.index not in self._draining
            and (not req.pinned or g.spec.index in req.pinned)
            and not self._kept_from(g.spec.index, req)
        ]

    def _waits_at(self, priority: int, *, but: str = "") -> bool:
        """Whether a waiter of ``priority`` or higher waits (``but`` not counted)."""
        firsts = [*self._waiters[:2], *islice(self._index.parked_order, 2)]
        return any(-p >= priority and t != but for p, _, t in firsts)

    def _kept_from(self, gpu: int, req: Request) -> bool:
        waiter = self._waiting.get(self._reserved.get(gpu, ""))
        return waiter is not None and waiter.request.task_id != req.task_id and waiter.request.priority >= req.priority

    def _choose_gpus(self, req: Request) -> list[int]:
        gpus = self._open_gpus(req)
        if req.pinned:
            if len(gpus) < len(req.pinned) or any(g.free < min(req.gpus, UNIT) for g in gpus):
                raise Insufficient("gpus", f"waits for its own GPUs {list(req.pinned)} to be free again")
            return list(req.pinned)
        if req.gpus >= UNIT:
            need = req.gpus // UNIT
            free = [g for g in gpus if g.free == UNIT]
            if len(free) < need:
                raise Insufficient("gpus", f"{need} whole GPU(s) asked, {len(free)} entirely free now")
            if req.gpus_max and not self._waits_at(req.priority, but=req.task_id):
                # elastic: what is free, up to its maximum and what its tenant may still use
                need = max(need, min(req.gpus_max, len(free), self._tenant_room(req.tenant) // UNIT))
            return [g.spec.index for g in self._order(free, req)[:need]]
        fits = [g for g in gpus if g.free >= req.gpus]
        if not fits:
            most = max((g.free for g in gpus), default=0)
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

    def _enqueue(self, w: _Waiter, why: Insufficient) -> None:
        """``w`` (its ``seq`` the next) waits: its place in the queue is (-priority, seq)."""
        self._seq += 1
        assert w.seq == self._seq
        self._waiting[w.request.task_id] = w
        self._why[w.request.task_id] = why
        if w.suspended is None:  # (a suspended allocation is queued by the index)
            waiters = list(self._waiters)  # a copy: a checkpoint holds the list it saw
            insort(waiters, (-w.request.priority, self._seq, w.request.task_id))
            self._waiters = waiters

    def _unwait(self, task_id: str, now: int) -> list[LedgerEffect]:
        """Out of the queue; the notices it caused are withdrawn (their victims then rest a while),
        those over this call's batch by the next calls; it tells no more of its plan."""
        w = self._waiting.pop(task_id)
        del self._why[task_id]
        if w.suspended is None:
            self._waiters = [x for x in self._waiters if x[2] != task_id]
        else:
            self._history.pop(task_id, None)
        kept = len(self._reserved)
        effects = self._withdraw_for(w, now)
        if len(self._reserved) < kept:  # the GPUs kept for it are open to the others again
            effects += self._serve(now)
        return effects

    def _withdraw_for(self, w: _Waiter, now: int) -> list[LedgerEffect]:
        """The notices given for ``w`` (no longer waiting) that still run are withdrawn: it gave up,
        or it was served without them; those over this call's batch by the next calls. Their victims
        are not chosen again for a while (no thrash)."""
        t = w.request.task_id
        self._reserved = {g: x for g, x in self._reserved.items() if x != t}
        told = self._index.told.get(t)
        effects = self._withdraw(list(islice(told, max(0, self._budget.left))), now) if told else []
        if t in self._index.told:
            self._withdrawing |= {t}
        return effects

    def _withdraw(self, ids: Iterable[str], now: int, *, rest: bool = True) -> list[LedgerEffect]:
        """These notices are withdrawn (``rest``: their allocations are not chosen again for a while)."""
        effects: list[LedgerEffect] = []
        for v in ids:
            n = self._notices.pop(v)
            if rest:
                self._immune[v] = now + self.preemption.cooldown_us
            effects.append(Withdrawn(self._allocs[v], n))
            self._budget.left -= 1
        return effects

    def _nobodys(self, n: Notice) -> bool:
        """Whether a notice is to be withdrawn (a later batch will): its waiter gave up or is not
        there after a restart, or none of the GPUs its drain names drains any more."""
        if n.by == DRAIN:
            return not self._draining.intersection(n.gpus)
        return n.by != IDLE and (n.by not in self._waiting or n.by in self._withdrawing)

    def _withdraw_left(self, now: int) -> list[LedgerEffect]:
        """The next batch of notices whose waiter is gone."""
        effects: list[LedgerEffect] = []
        told = self._index.told
        for by in sorted(told):
            if self._budget.left <= 0:
                break
            if by != IDLE and (by not in self._waiting or by in self._withdrawing):
                effects += self._withdraw(list(islice(told[by], self._budget.left)), now)
        if self._withdrawing:
            self._withdrawing = frozenset(b for b in self._withdrawing if b in told)
        return effects

    def _undrain(self, now: int) -> list[LedgerEffect]:
        """The next batch of the drain notices of GPUs put back (but those another of whose GPUs
        drains). A GPU stays listed until a batch finds fewer than it could take."""
        effects: list[LedgerEffect] = []
        if not self._undraining:
            return effects
        left: set[int] = set()
        for g in sorted(self._undraining):
            want = self._budget.left
            on = self._index.drain_on.get(g)
            if want <= 0:
                left.add(g)
                continue
            picked = [] if on is None else list(islice(self._undrained(on), want))
            effects += self._withdraw(picked, now, rest=False)
            if len(picked) == want:
                left.add(g)
        self._undraining = frozenset(left)
        return effects

    def _undrained(self, on: Iterable[str]) -> Iterable[str]:
        return (t for t in on if not self._draining.intersection(self._notices[t].gpus))

    def _leaving(self, w: _Waiter) -> bool:
        """Whether ``w`` waits for victims: some of its plan are still to be told, or a notice given
        for it still runs (or one given for an earlier wait of its task id, still to be withdrawn).
        It waits at least until they end, and chooses no more meanwhile."""
        return bool(w.plan) or w.request.task_id in self._index.told

    def _remember(self, alloc: Allocation) -> None:
        """A whole preemption: the task's next allocation hears of it."""
        resume = alloc.on_preempt in (Recovery.CHECKPOINT, Recovery.SUSPEND) or alloc.resume
        self._history[alloc.task_id] = (alloc.preemptions + 1, resume)
        # Bounded: the oldest are forgotten (one a rollback put back counts as the newest).
        while len(self._history) > 4 * self._max_waiters + 4096:
            del self._history[next(iter(self._history))]

    def _take_back(self, task_id: str, now: int, *, overran: bool) -> list[LedgerEffect]:
        n = self._notices.pop(task_id)
        alloc = self._allocs[task_id]
        if n.by in self._waiting:
            self._reserved = {**self._reserved, **{g: n.by for g in n.gpus}}
        if not n.whole:
            self._drop(alloc)
            after = structs.replace(alloc, gpus=tuple(g for g in alloc.gpus if g not in n.gpus), changed_us=now)
            self._commit(after)
            return [TakenBack(alloc, n, after, False, overran), *self._serve(now)]
        self._drop(alloc)
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
            self._enqueue(
                _Waiter(req, NEVER, now, suspended=held, seq=self._seq + 1), Insufficient("gpus", "suspended")
            )
        else:
            self._remember(alloc)
        return effects + self._serve(now)

    def _serve(self, now: int) -> list[LedgerEffect]:
        """Grant waiters in priority order, each as soon as it fits: the requests, and of the suspended
        allocations those whose GPUs have room for them now (the others would not fit). At most this
        call's batch are served; when it is spent, the next call looks again (``_serving``)."""
        effects: list[LedgerEffect] = []
        self._serving = False
        again = bool(self._waiters or self._index.parked)
        while again:  # once more when one served leaves GPUs it kept open to the others
            again = False
            seen: set[str] = set()
            parked = self._parked_with_room() if self._index.parked else []
            for _, _, task_id in merge(list(self._waiters), *parked) if parked else list(self._waiters):
                if task_id in seen or (w := self._waiting.get(task_id)) is None:
                    continue  # (a suspended allocation waiting for two GPUs is read on each)
                seen.add(task_id)
                if self._budget.left <= 0:
                    self._serving = True
                    return effects
                try:
                    alloc = self._place(w.request, now, w.suspended)
                except Insufficient as short:
                    self._why[task_id] = short  # not durable: kept apart from the wait, whose record it would touch
                    continue
                del self._waiting[task_id]
                del self._why[task_id]
                if w.suspended is None:
                    self._waiters = [x for x in self._waiters if x[2] != task_id]
                self._budget.left -= 1
                effects.append(Served(alloc, resumed=w.suspended is not None))
                kept = len(self._reserved)
                effects += self._withdraw_for(w, now)  # served before all its victims left: they may stay
                if len(self._reserved) < kept:
                    again = True
                    break
        return effects

    def _parked_with_room(self) -> list[Iterator[Queued]]:
        """The suspended allocations that may fit now, per GPU they wait for and share they need, each
        in queue order: only on a GPU that is not draining, with room for the share, and not kept from
        them for a waiter of their priority or higher. Read as they are served (the index changes)."""
        out: list[Iterator[Queued]] = []
        for g, by_share in self._index.parked.items():
            gpu = self._gpus.get(g)
            if gpu is None or g in self._draining:
                continue
            keeper = self._waiting.get(self._reserved.get(g, ""))
            cut = -keeper.request.priority if keeper is not None else None  # (-priority) from here on: kept from
            out += [_read_on(keys, gpu, share, cut) for share, keys in by_share.items() if share <= gpu.free]
            if keeper is not None and keeper.suspended is not None and g in keeper.request.pinned:
                out.append(
                    iter([(-keeper.request.priority, keeper.seq, keeper.request.task_id)])
                )  # not kept from itself
        return out

    # --- taking back ---------------------------------------------------------

    def _drain_notices(self, now: int) -> list[LedgerEffect]:
        """The next batch of the allocations on draining GPUs that can be told, by task id."""
        effects: list[LedgerEffect] = []
        for gpu in sorted(self._draining):
            untold = self._index.untold.get(gpu)
            if self._budget.left <= 0 or untold is None:
                continue
            for task_id in list(islice(filter(self.reachable.__contains__, untold), self._budget.left)):
                alloc = self._allocs[task_id]
                whole = gpu not in alloc.extras
                gpus = alloc.gpus if whole else (gpu,)
                effects += self._notice(alloc, PreemptReason.DRAIN, gpus, whole, DRAIN, now)
        return effects

    def _notice(
        self, alloc: Allocation, reason: PreemptReason, gpus: tuple[int, ...], whole: bool, by: str, now: int
    ) -> list[LedgerEffect]:
        n = Notice(alloc.task_id, reason, gpus, whole, now, now + self.preemption.grace_us, by)
        self._notices[alloc.task_id] = n
        self._grow_since.pop(alloc.task_id, None)
        self._budget.left -= 1
        return [Noticed(alloc, n)]

    def _eligible(self, alloc: Allocation) -> bool:
        return (
            alloc.task_id not in self._notices
            and alloc.task_id in self.reachable
            and not alloc.protected
            and alloc.priority < 100
            and alloc.task_id not in self._immune
        )

    def _choosable(self, alloc: Allocation) -> bool:
        """Eligible, and not planned for a waiter already."""
        return self._eligible(alloc) and alloc.task_id not in self._index.chosen

    def _maturities(self) -> list[int]:
        """When allocations reach their minimum runtime, while some waiter may want them. Only those
        still to come: one already past is no reason to wake (the timer would wake again at once)."""
        if not any(not self._leaving(self._waiting[t]) for _, _, t in self._waiters):  # (the requests)
            return []
        at = [
            self._index.first_maturity(self._advanced_to, self.preemption.min_runtime_us),
            self._index.first_immunity_after(self._advanced_to),
        ]
        return [t for t in at if t is not None]

    def _plan(self, now: int, *, choose: bool) -> list[LedgerEffect]:
        """Each waiter, highest priority first: victims chosen at once when it has none and does not
        fit (``choose``: no immunity is left to forget), then the next batch of its plan told (a
        victim no longer to be taken as planned is skipped: it left, was told by a drain...)."""
        effects: list[LedgerEffect] = []
        choose = choose and self.preemption.enabled
        if not choose and not self._index.chosen:  # (every victim planned is chosen until told)
            return effects
        parked = self._parked_planning(choose)
        if not self._waiters and not parked:
            return effects
        for _, _, task_id in merge(list(self._waiters), sorted(parked)) if parked else list(self._waiters):
            w = self._waiting.get(task_id)
            if w is None:
                continue
            plan, how, victims, deadline = w.plan, w.how, w.victims, w.deadline
            if choose and not self._leaving(w) and (chosen := self._victims_for(w.request, now)):
                plan, how = _planned(chosen)
                victims, deadline = (), max(w.deadline, now + self.preemption.grace_us + 1)
            read, told = self._tell(task_id, plan, how, now) if plan and self._budget.left > 0 else (0, [])
            effects += told
            if told:  # it waits at least until their grace ends (its own wait does not expire meanwhile)
                victims = tuple(sorted(victims + tuple(e.allocation.task_id for e in told if isinstance(e, Noticed))))
                deadline = max(deadline, now + self.preemption.grace_us + 1)
            if plan is not w.plan or read:
                rest = plan[read:]
                w = replace(w, plan=rest, how=how if rest else (), victims=victims, deadline=deadline)
                self._waiting[task_id] = w
        return effects

    def _parked_planning(self, choose: bool) -> set[Queued]:
        """The suspended allocations that have victims to tell, or (``choose``) may take some back: a
        lower priority on a GPU they wait for or holding CPU cores, an elastic allocation's extras of
        their priority or lower, or (with tenants, one over its quota) borrowed quota. Not a walk over
        them all: a few more than may, never fewer."""
        index = self._index
        if not index.parked_order:
            return set()
        waiting = self._waiting
        out = {(-w.request.priority, w.seq, t) for t in index.planning if (w := waiting[t]).suspended is not None}
        if not choose:
            return out
        if self._tenants and any(self.tenant_usage(t) > q.gpus for t, q in self._tenants.items()):
            return out | set(index.parked_order)  # (quota reclaimed: rare, read them all)
        extras = [a.priority for t in index.elastic if (a := self._allocs[t]).extras]
        if extras:  # priorities from the highest down to the lowest with extras
            out.update(_above(index.parked_order, min(extras) - 1))
        if index.cpu_holders:  # (at most the node's cores)
            out.update(_above(index.parked_order, min(self._allocs[t].priority for t in index.cpu_holders)))
        for g, by_share in index.parked.items():
            lowest = min((k[2] for k in index._lower.get(g, {})), default=None)
            if lowest is not None:
                for keys in by_share.values():
                    out.update(_above(keys, lowest))
        return out

    def _tell(
        self, task_id: str, plan: tuple[str, ...], how: tuple[Candidate, ...], now: int
    ) -> tuple[int, list[LedgerEffect]]:
        """The next batch of a waiter's plan told: how many of the plan were read, and the notices."""
        effects: list[LedgerEffect] = []
        taken = {c.task_id: c for c in how}
        read = 0
        for t in plan:
            if self._budget.left <= 0 or read >= PLAN_READ:
                break
            read += 1
            if (c := self._still_victim(t, taken.get(t))) is not None:
                effects += self._notice(self._allocs[t], c.reason, c.gpus, c.whole, task_id, now)
        return read, effects

    def _still_victim(self, t: str, planned: Candidate | None) -> Candidate | None:
        """A planned victim as it is to be told now; None: it is no longer to be taken as planned."""
        a = self._allocs.get(t)
        if a is None or not self._eligible(a):
            return None
        if planned is None:
            return as_victim(a, PreemptReason.PRIORITY, a.gpus)
        if planned.whole:
            return planned if a.gpus == planned.gpus else None
        return planned if set(planned.gpus) <= set(a.extras) else None

    def _victims_for(self, req: Request, now: int) -> list[Victim]:
        open_gpus = self._open_gpus(req)
        room = Room({g.spec.index: g.free for g in open_gpus}, len(self._free_cpus))
        need = Need(req.gpus if not req.pinned else len(req.pinned) * min(req.gpus, UNIT), req.cpus)
        reclaim: list[Candidate] = []
        if req.tenant is not None and self.tenant_usage(req.tenant) + req.gpus <= self._tenants[req.tenant].gpus:
            reclaim = self._borrowed(req.tenant)
        # The strategy's pool is read from the index, as far as the choice needs: not a pass over all.
        mature = now - self.preemption.min_runtime_us
        lower = self._index.lower_pool(req.priority, mature, self.reachable, {c.task_id for c in reclaim})
        pools = [
            Pool(self._extras(req.priority), PreemptStrategy.LOWEST_PRIORITY),
            Pool(reclaim, PreemptStrategy.NEWEST_FIRST),
            Pool(lower, self.preemption.strategy),
        ]

        return _one_per_task(choose(need, room, pools, self._tenant_fits(req)))

    def _tenant_fits(self, req: Request) -> Callable[[Sequence[Victim]], bool] | None:
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
                self._check_tenant(req, minus)
            except Insufficient:
                return False
            return True

        return fits

    def _extras(self, priority: int) -> list[Candidate]:
        """Elastic allocations' GPUs above their minimum, of priorities up to ``priority``."""
        out = []
        for t in self._index.elastic:
            a = self._allocs[t]
            if a.extras and a.priority <= priority and self._choosable(a):
                out.append(as_victim(a, PreemptReason.ELASTIC, a.extras))
        return out

    def _borrowed(self, lender: str) -> list[Candidate]:
        """Allocations of tenants above their quota, newest first, as far as they are over it."""
        out: list[Candidate] = []
        for tenant, quota in self._tenants.items():
            if tenant == lender:
                continue
            over = self.tenant_usage(tenant) - quota.gpus
            for t in self._index.newest_of(tenant) if over > 0 else ():
                a = self._allocs[t]
                if self._choosable(a) and a.on_preempt != Recovery.SHRINK:
                    out.append(as_victim(a, PreemptReason.QUOTA_RECLAIM, a.gpus))
                over -= a.total
                if over <= 0:
                    break
        return out

    def observe(self, gpu: int, percent: float, now: int) -> bool:
        """A reading of ``gpu``'s utilisation (the shell's NVML samples): busy at or above
        ``busy_percent``. Only elastic allocations' pacing reads it, and only when that is set.
        True when the GPU turned busy or idle (``next_deadline`` may be sooner)."""
        if not self.preemption.busy_percent or gpu not in self._gpus:
            return False
        busy = percent >= self.preemption.busy_percent
        now_in, other = (self._busy_since, self._idle_since) if busy else (self._idle_since, self._busy_since)
        other.pop(gpu, None)
        if gpu in now_in:
            return False
        now_in[gpu] = now
        return True

    def _through_window(self, since: dict[int, int], gpus: tuple[int, ...]) -> int | None:
        """When every one of ``gpus`` will have been so (busy, idle) for the window; None: one is not."""
        if not gpus or any(g not in since for g in gpus):
            return None
        return max(since[g] for g in gpus) + self.preemption.elastic_window_us

    def _shrink_idle(self, now: int) -> list[LedgerEffect]:
        """Elastic allocations whose GPUs idled through the window give their extras back."""
        effects: list[LedgerEffect] = []
        if not self.preemption.busy_percent:
            return effects
        for a in self._elastic():
            if not a.extras or a.task_id in self._notices or a.task_id not in self.reachable:
                continue
            at = self._through_window(self._idle_since, a.gpus)
            if at is not None and now >= max(at, a.changed_us + self.preemption.elastic_cooldown_us):
                effects += self._notice(a, PreemptReason.ELASTIC, a.extras, False, IDLE, now)
        return effects

    def _idle_times(self) -> list[int]:
        """When elastic allocations above their minimum will have idled through the window."""
        if not self.preemption.busy_percent:
            return []
        out = []
        for a in self._elastic():
            if a.extras and a.task_id not in self._notices and a.task_id in self.reachable:
                at = self._through_window(self._idle_since, a.gpus)
                if at is not None:
                    out.append(max(at, a.changed_us + self.preemption.elastic_cooldown_us))
        return [t for t in out if t > self._advanced_to]

    def _grow(self, now: int) -> list[LedgerEffect]:
        """Elastic allocations take whole GPUs that stayed free through the window (and, with
        ``busy_percent``, while their own GPUs stayed busy)."""
        effects: list[LedgerEffect] = []
        for a in self._elastic():
            if not a.gpus_max or len(a.gpus) >= a.gpus_max or a.task_id in self._notices:
                continue
            if self.preemption.busy_percent and self._through_window(self._busy_since, a.gpus) is None:
                self._grow_since.pop(a.task_id, None)
                continue
            free = [g.spec.index for g in self._gpus.values() if g.free == UNIT and g.spec.index not in self._draining]
            free = free[: min(a.gpus_max - len(a.gpus), self._tenant_room(a.tenant) // UNIT)]
            waits = self._waits_at(a.priority)
            if not free or waits:
                self._grow_since.pop(a.task_id, None)
                continue
            self._grow_since.setdefault(a.task_id, now)
            if now < self._grow_at(a.task_id):
                continue
            del self._grow_since[a.task_id]
            self._drop(a)
            grown = structs.replace(a, gpus=a.gpus + tuple(free), changed_us=now)
            self._commit(grown)
            effects.append(Grown(grown))
        return effects

    def _elastic(self) -> list[Allocation]:
        """The elastic allocations, by task id (the first grows first when GPUs are scarce)."""
        return [self._allocs[t] for t in sorted(self._index.elastic)]

    def _grow_at(self, task_id: str) -> int:
        """When an elastic allocation that could grow since ``_grow_since`` may: the GPUs stayed free
        through the window, and its cooldown since its last change is over."""
        cfg = self.preemption
        a = self._allocs[task_id]
        at = max(self._grow_since[task_id] + cfg.elastic_window_us, a.changed_us + cfg.elastic_cooldown_us)
        if cfg.busy_percent:
            at = max(at, self._through_window(self._busy_since, a.gpus) or 0)
        return at


def _one_per_task(chosen: list[Victim]) -> list[Victim]:
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


def _read_on(keys: Any, gpu: _Gpu, share: int, cut: int | None) -> Iterator[Queued]:
    """Suspended allocations waiting for ``gpu`` with ``share`` (a ``SortedKeys`` of their places), in
    order, while it has room for that share and until those it is kept from: read a few at a time
    after the last one read, so that serving them (which takes them out) does not disturb it."""
    last: Queued | None = None
    while True:
        ahead = list(islice(keys.after(last) if last is not None else iter(keys), 16))
        for queued in ahead:
            if gpu.free < share or (cut is not None and queued[0] >= cut):
                return
            yield queued
        if len(ahead) < 16:
            return
        last = ahead[-1]


def _above(keys: Iterable[Queued], priority: int) -> Iterator[Queued]:
    """The places in ``keys`` (in queue order) of the waiters of a priority above ``priority``."""
    for queued in keys:
        if -queued[0] <= priority:
            return
        yield queued


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


def _waits_for(w: _Waiter, told: SortedKeys[str] | None) -> str:
    """Why a waiter with victims waits: those ``told`` for it that have not left yet (a few of them
    named: it may have thousands), and how many of its plan are still to be told."""
    names = list(islice(told or (), 8 + 1))
    if len(names) > 8:
        leaving = f"{len(told or ())} allocations ({', '.join(names[:3])}, ...)"
    else:
        leaving = ", ".join(names)
    if not leaving:
        return f"waits for {len(w.plan)} allocations to be told to leave"
    more = f"; {len(w.plan)} more to be told" if w.plan else ""
    return f"waits for {leaving} to leave (their grace runs){more}"
