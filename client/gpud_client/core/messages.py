"""What the sync and the asyncio client build and apply alike, written once.

The fields a session has in either client, and pure helpers: request messages
from the clients' keyword arguments, and what the daemon's answers and pushes
do to a session's fields (limits with the PyTorch hook, binding, grants,
revocations). No I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from gpud_client import protocol as p
from gpud_client.errors import GpudError, MemoryLimitExceeded
from gpud_client.frameworks import apply_torch_memory_limit, torch_memory_probe
from gpud_client.units import parse_bytes

log = logging.getLogger("gpud_client")
NO_MAX_WAIT_MS = 86_400_000  # an acquire without max_wait: the policy's answers within a day at most
MEM_REPORT_STEP = 16 * 2**20  # report memory when it moved at least this much
State = Literal["idle", "waiting", "holding", "releasing"]


class SessionFields:
    """What a session of either client knows of itself; the rules below change it."""

    def __init__(
        self,
        gpu: int | str,
        *,
        priority: int,
        idle_release: float | None,
        core_limit: int,
        mem_limit: int | None,
        mem_estimate: int | None,
        memory_probe: Callable[[], int] | None,
        framework_hooks: bool,
    ) -> None:
        self.gpu_ref = gpu
        self.priority = priority
        self.core_limit = core_limit
        self.mem_limit = mem_limit
        self.mem_estimate = mem_estimate
        self.framework_hooks = framework_hooks
        self.memory_probe = memory_probe or (torch_memory_probe() if framework_hooks else None)
        self.mem_reported: int | None = None
        self.mem_error: MemoryLimitExceeded | None = None
        self.memory_total_bytes = 0
        self.idle_release = idle_release
        self.id = 0  # the daemon's session id; changes on re-attach
        self.gpu = -1
        self.state: State = "idle"
        self.grant = 0
        self.drop_pending: p.DropReason | None = None
        self.in_slice = False
        self.request_id = 0
        self.last_used = 0.0  # on the client's clock
        self.error: GpudError | None = None
        self.closed = False
        # counters an application can read
        self.grants = 0
        self.drops = 0
        self.revocations = 0

    @property
    def holding(self) -> bool:
        return self.state == "holding"


def size(value: int | str | None) -> int | None:
    return parse_bytes(value) if isinstance(value, str) else value


def attach_msg(s: SessionFields) -> p.Attach:
    return p.Attach(
        id=0, gpu=s.gpu_ref, priority=s.priority, core_limit=s.core_limit,
        mem_limit=s.mem_limit, mem_estimate=s.mem_estimate,
    )


def memory_to_report(s: SessionFields) -> int | None:
    """At a slice's end: the session's memory use if it moved enough since the last report, else None."""
    if s.memory_probe is None:
        return None
    try:
        used = s.memory_probe()
    except Exception:
        log.exception("memory probe failed")
        return None
    if s.mem_reported is not None and abs(used - s.mem_reported) < MEM_REPORT_STEP:
        return None
    return used


def bind(s: SessionFields, reply: p.Attached) -> None:
    """The daemon attached (or re-attached) the session: its id, GPU and limits; no lock held."""
    s.id, s.gpu, s.memory_total_bytes = reply.session, reply.gpu, reply.memory_total_bytes
    s.mem_reported = None
    apply_limits(s, reply.core_limit, reply.mem_limit)
    s.state, s.drop_pending = "idle", None


def granted(s: SessionFields, grant: int, now: float) -> None:
    """LOCK_OK: the session holds the lock under ``grant``."""
    s.state, s.grant, s.drop_pending = "holding", grant, None
    s.grants += 1
    s.last_used = now


def revoked(s: SessionFields, grant: int, reason: p.RevokeReason) -> None:
    """REVOKED: the lock of ``grant`` is gone (a stale grant's revocation changes nothing)."""
    if s.grant == grant and s.state in ("holding", "releasing"):
        s.state, s.drop_pending = "idle", None
        s.revocations += 1
        log.warning("gpud revoked the GPU lock of session %d (%s)", s.id, reason)


def apply_limits(s: SessionFields, core_limit: int, mem_limit: int | None) -> None:
    """Record the session's limits; cap PyTorch's allocator when it is in use."""
    changed = mem_limit != s.mem_limit
    s.core_limit, s.mem_limit = core_limit, mem_limit
    if s.framework_hooks and (mem_limit is not None or changed):
        try:
            apply_torch_memory_limit(mem_limit)
        except Exception:
            log.exception("could not apply the memory limit to PyTorch")


def acquire_msg(
    gpu: int | str,
    task_type: str,
    *,
    priority: int | None = None,
    max_wait_ms: int | None = None,
    hold_max_ms: int | None = None,
    queue_limit: int | None = None,
    busy_policy: p.BusyPolicy | str | None = None,
    mem_estimate: int | str | None = None,
    trace: p.Trace | dict[str, Any] | None = None,
) -> p.Acquire:
    return p.Acquire(
        id=0, gpu=gpu, task_type=task_type, priority=priority, max_wait_ms=max_wait_ms,
        hold_max_ms=hold_max_ms, queue_limit=queue_limit,
        busy_policy=None if busy_policy is None else p.BusyPolicy(busy_policy),
        mem_estimate=size(mem_estimate),
        trace=msgspec.convert(trace, p.Trace) if isinstance(trace, dict) else (trace or p.Trace()),
    )


def acquire_timeout(msg: p.Acquire, request_timeout: float) -> float:
    """How long to wait for LEASE_RESULT: the lease's max wait plus the request timeout."""
    max_wait = msg.max_wait_ms if msg.max_wait_ms is not None else NO_MAX_WAIT_MS
    return max_wait / 1000 + request_timeout


def allocate_msg(
    task_id: str,
    gpus: float,
    cpus: int,
    prefer: list[int | str] | None,
    strategy: p.Strategy | str,
    tenant: str | None,
    priority: int | p.PriorityClass | str | None,
    wait_ms: int,
    owner_pid: int | None,
) -> p.Allocate:
    level = priority if isinstance(priority, int) else None
    klass = p.PriorityClass(priority) if isinstance(priority, str) else None
    return p.Allocate(
        id=0, task_id=task_id, gpus=float(gpus), cpus=cpus, prefer=list(prefer or []), strategy=p.Strategy(strategy),
        tenant=tenant, priority=level, priority_class=klass, wait_ms=wait_ms, owner_pid=owner_pid,
    )


def policy_msg(task_type: str, fields: dict[str, Any]) -> p.SetPolicy:
    return msgspec.convert({"type": "SET_POLICY", "id": 0, "task_type": task_type, **fields}, p.SetPolicy)
