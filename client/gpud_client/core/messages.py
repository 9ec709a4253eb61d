"""Request messages from the clients' keyword arguments, built alike for both clients. No I/O."""

from __future__ import annotations

from typing import Any

import msgspec

from gpud_client import protocol as p
from gpud_client.units import parse_bytes

NO_MAX_WAIT_MS = 86_400_000  # an acquire without max_wait: the policy's answers within a day at most


def size(value: int | str | None) -> int | None:
    return parse_bytes(value) if isinstance(value, str) else value


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
        id=0,
        gpu=gpu,
        task_type=task_type,
        priority=priority,
        max_wait_ms=max_wait_ms,
        hold_max_ms=hold_max_ms,
        queue_limit=queue_limit,
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
    *,
    on_preempt: p.Recovery | str = p.Recovery.TERMINATE,
    gpus_max: int | None = None,
    protected: bool = False,
    notify: bool = True,
    memory_bytes: int | None = None,
) -> p.Allocate:
    level = priority if isinstance(priority, int) else None
    klass = p.PriorityClass(priority) if isinstance(priority, str) else None
    return p.Allocate(
        id=0,
        task_id=task_id,
        gpus=float(gpus),
        cpus=cpus,
        prefer=list(prefer or []),
        strategy=p.Strategy(strategy),
        tenant=tenant,
        priority=level,
        priority_class=klass,
        wait_ms=wait_ms,
        owner_pid=owner_pid,
        on_preempt=p.Recovery(on_preempt),
        gpus_max=gpus_max,
        protected=protected,
        notify=notify,
        memory_bytes=memory_bytes,
    )


def policy_msg(task_type: str, fields: dict[str, Any]) -> p.SetPolicy:
    return msgspec.convert({"type": "SET_POLICY", "id": 0, "task_type": task_type, **fields}, p.SetPolicy)
