"""What the ledger holds and answers: the value types, the effects, and the terms of a request.

Rules kept here:
- Quantities are fixed point: one GPU is ``UNIT`` (10000) parts, so sums are exact. A request is a
  whole number of GPUs (>= 1) or a fraction (< 1); ``to_fixed`` refuses what is not exact.
- The same task id twice is the same allocation when it asks for the same terms: GPUs, CPU cores,
  tenant, priority, owner pid, recovery and elastic maximum (``check_same_terms``). ``prefer``,
  ``strategy`` and the wait only say where to place and how long to wait, so they are not terms.
- What the ledger keeps per allocation for life (``Allocation``, ``Notice``, ``TaskRecord``) is in
  no reference cycle and not tracked by the garbage collector: 20 000 allocations do not lengthen
  its full collections.

Never: hold state; every type here is a value, replaced and never changed in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from gpud.core.errors import Refused
from gpud.core.preemption import Candidate
from gpud_client.protocol import DEFAULT_PRIORITY, ErrorCode, PreemptReason, PreemptStrategy, Recovery, Strategy
from gpud_client.units import GPU_UNIT, fixed_gpus

UNIT = GPU_UNIT  # one GPU
NOTICE_BATCH = 64  # notices told, withdrawn or carried out per call, at most (the shell spends ~60-90 us on each)
NEVER = 1 << 62  # a suspended allocation's wait has no deadline
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
    priority: int = DEFAULT_PRIORITY
    owner_pid: int | None = None
    wait_us: int = 0
    on_preempt: Recovery = Recovery.TERMINATE
    gpus_max: int = 0  # elastic: at most this many whole GPUs (``gpus`` is the minimum); 0: not elastic
    protected: bool = False
    pinned: tuple[int, ...] = ()  # a suspended allocation waits for exactly these GPUs
    memory_bytes: int | None = None  # a fraction's memory ceiling for its sessions (None: its share's)


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
    memory_bytes: int | None = None  # a fraction's memory ceiling for its sessions (None: its share's)

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
    by: str  # the waiting task, "drain", or "idle"


def recovery_told(alloc: Allocation, notice: Notice) -> Recovery:
    """What the holder of a notice is told to do: its recovery; but one that only ever shrinks, taken
    whole (by a drain), ends."""
    if notice.whole and alloc.on_preempt == Recovery.SHRINK:
        return Recovery.TERMINATE
    return alloc.on_preempt


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
    "memory_bytes": lambda v: "its share's memory" if v is None else f"{v} bytes of memory",
}


def terms(x: Request | Allocation) -> dict[str, Any]:
    if isinstance(x, Allocation):
        return {
            "gpus": x.gpus_min * UNIT if x.gpus_min else x.total,
            "cpus": len(x.cpus),
            "tenant": x.tenant,
            "priority": x.priority,
            "owner_pid": x.owner_pid,
            "on_preempt": x.on_preempt,
            "gpus_max": x.gpus_max,
            "memory_bytes": x.memory_bytes,
        }
    return {
        "gpus": x.gpus,
        "cpus": x.cpus,
        "tenant": x.tenant,
        "priority": x.priority,
        "owner_pid": x.owner_pid,
        "on_preempt": x.on_preempt,
        "gpus_max": x.gpus_max,
        "memory_bytes": x.memory_bytes,
    }


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def check_same_terms(req: Request, held: dict[str, Any], verb: str) -> None:
    """Refuse a repeat of a task id that asks for other terms than it ``verb`` (holds, waits for)."""
    asked = terms(req)
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
class Waiter:
    request: Request
    deadline: int
    since: int = 0
    victims: tuple[str, ...] = ()  # allocations told to leave for it, by task id
    suspended: Allocation | None = None  # a suspended allocation waiting for its GPUs
    plan: tuple[str, ...] = ()  # victims chosen, not told yet, in the order they are told
    how: tuple[Candidate, ...] = ()  # those of them not taken whole for priority: how they are taken
    seq: int = 0  # its place in the queue among equal priorities


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
