"""Leases (GpuArbiter) on the per-GPU scheduler, on fake time (microseconds)."""

from __future__ import annotations

import pytest

from gpud.core.errors import Refused
from gpud.core.leases import DEFAULT_POLICIES, LeasePolicy, refusal_status, resolve_terms
from gpud.core.scheduler import Drop, GpuScheduler, Grant, HoldOverdue, LeaseDenied, Revoke, SchedulerConfig
from gpud_client.protocol import BusyPolicy, DropReason, LeaseReason, LeaseStatus, Mode, RevokeReason

from .statecheck import state_of

MS = 1000
GIB = 2**30


def gpu(mode: Mode = Mode.SERIAL, force: bool = False) -> GpuScheduler:
    return GpuScheduler(
        SchedulerConfig(tq_us=30_000 * MS, mode=mode, memory_total_bytes=16 * GIB, lease_force_release=force)
    )


def lease(
    s: GpuScheduler,
    sid: int,
    now: int,
    *,
    prio: int = 50,
    wait: int = 3000,
    hold: int = 8000,
    limit: int = 8,
    mem: int | None = None,
) -> list[object]:
    return list(
        s.acquire_lease(
            sid, now, priority=prio, max_wait_us=wait * MS, hold_max_us=hold * MS, queue_limit=limit, mem_estimate=mem
        )
    )


def test_acquire_on_a_free_gpu_and_release() -> None:
    s = gpu()
    assert lease(s, 1, 0) == [Grant(1, 1)]
    assert s.release_lease(1, 5 * MS) == []
    assert s.holders() == [] and s.view(5 * MS).sessions == 0


def test_waiting_leases_are_served_by_priority_then_fifo() -> None:
    s = gpu()
    lease(s, 1, 0)
    lease(s, 2, 1, prio=20)  # repair
    lease(s, 3, 2, prio=80)  # NMT
    lease(s, 4, 3, prio=90)  # ASR
    lease(s, 5, 4, prio=80)  # NMT, after 3
    assert s.queue() == [4, 3, 5, 2]
    assert s.release_lease(1, 10) == [Grant(4, 2)]


def test_a_lease_still_waiting_at_max_wait_times_out() -> None:
    s = gpu()
    lease(s, 1, 0)
    lease(s, 2, 0, wait=400)
    assert s.next_deadline() == 400 * MS
    assert s.advance(400 * MS - 1) == []
    assert s.advance(400 * MS) == [LeaseDenied(2, LeaseReason.TIMEOUT)]
    assert s.queue() == [] and s.view(400 * MS).sessions == 1


def test_max_wait_zero_means_only_if_free_now() -> None:
    s = gpu()
    assert lease(s, 1, 0, wait=0) == [Grant(1, 1)]
    s.advance(1)
    before = state_of(s)
    assert lease(s, 2, 1, wait=0) == [LeaseDenied(2, LeaseReason.GPU_BUSY)]
    assert state_of(s) == before  # nothing queued


def test_queue_full_on_arrival_is_denied_and_nothing_is_queued() -> None:
    s = gpu()
    lease(s, 1, 0)
    for sid in (2, 3):
        lease(s, sid, sid, limit=2)
    s.advance(5)
    before = state_of(s)
    assert lease(s, 4, 5, limit=2) == [LeaseDenied(4, LeaseReason.QUEUE_FULL)]
    assert state_of(s) == before


def test_a_lease_that_would_be_granted_now_ignores_the_queue_limit() -> None:
    s = gpu(mode=Mode.CONCURRENT)
    lease(s, 1, 0, mem=GIB)
    assert lease(s, 2, 1, limit=0, mem=GIB) == [Grant(2, 2)]


def test_the_watchdog_reports_once_and_keeps_the_lease_by_default() -> None:
    s = gpu()
    lease(s, 1, 0, hold=100)
    assert s.next_deadline() == 100 * MS
    assert s.advance(100 * MS) == [HoldOverdue(1, 100 * MS, False)]
    assert s.advance(500 * MS) == []
    assert s.holders() == [1]


def test_the_watchdog_can_release_by_force() -> None:
    s = gpu(force=True)
    lease(s, 1, 0, hold=100)
    lease(s, 2, 10, hold=100)
    assert s.advance(100 * MS) == [HoldOverdue(1, 100 * MS, True), Revoke(1, 1, RevokeReason.HOLD_MAX), Grant(2, 2)]
    with pytest.raises(Refused):
        s.release_lease(1, 101 * MS)  # gone: the shell answers a release of it idempotently


def test_leases_are_never_dropped() -> None:
    s = GpuScheduler(SchedulerConfig(tq_us=10 * MS, mode=Mode.AUTO, memory_total_bytes=16 * GIB))
    lease(s, 1, 0, prio=10, mem=8 * GIB, hold=1000)
    s.attach(2, 0, priority=99, mem_estimate=12 * GIB)
    assert s.request(2, 1) == []  # no preemption of a lease, however high the priority
    assert s.advance(1000 * MS) == [HoldOverdue(1, 1000 * MS, False)]  # and no TQ drop
    s.report_memory(2, 1, 1001 * MS)
    assert Drop(1, 1, DropReason.MEMORY) not in s.advance(1002 * MS)


def test_a_high_priority_lease_preempts_a_low_priority_session() -> None:
    s = gpu()
    s.attach(1, 0, priority=10)
    s.request(1, 0)
    assert lease(s, 2, 5, prio=90) == [Drop(1, 1, DropReason.PREEMPT)]
    assert s.release(1, 6) == [Grant(2, 2)]


def test_leases_share_memory_admission_with_sessions() -> None:
    s = gpu(mode=Mode.CONCURRENT)
    s.attach(1, 0, mem_estimate=10 * GIB, priority=60)
    s.request(1, 0)
    assert lease(s, 2, 1, mem=4 * GIB) == [Grant(2, 2)]  # 14 GiB <= 16 x 0.9
    assert lease(s, 3, 2, mem=4 * GIB) == []


def test_leases_are_billed_and_counted_as_concurrent_holders() -> None:
    s = gpu(mode=Mode.CONCURRENT)
    s.attach(1, 0, mem_estimate=GIB, core_limit=50)
    s.request(1, 0)
    lease(s, 2, 0, mem=GIB)
    s.advance(600 * MS)
    assert s.session(1, 600 * MS).used_us == 300 * MS  # billed at half rate beside the lease
    assert s.session(2, 600 * MS).used_us == 300 * MS


def test_withdrawing_a_waiting_lease() -> None:
    s = gpu()
    lease(s, 1, 0)
    lease(s, 2, 1)
    assert s.release_lease(2, 2) == []
    assert s.queue() == []
    s.attach(3, 3)
    with pytest.raises(Refused, match="is a session"):
        s.release_lease(3, 4)
    with pytest.raises(Refused, match="is a lease"):
        s.set_limits(1, 5, core_limit=10)
    with pytest.raises(Refused, match="is a lease"):
        s.release(1, 5)


# --- policies -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "prio", "policy", "wait"),
    [
        ("ASR", 90, "WAIT", 3000),
        ("NMT", 80, "WAIT", 3000),
        ("TTS", 70, "WAIT", 2000),
        ("SEMANTIC_REPAIR", 20, "SKIP", 400),
        ("OTHER", 50, "WAIT", 3000),
        ("VAD", 50, "WAIT", 3000),
    ],
)
def test_task_type_defaults(task: str, prio: int, policy: str, wait: int) -> None:
    t = resolve_terms(task, DEFAULT_POLICIES)
    assert (t.priority, t.busy_policy, t.max_wait_ms, t.queue_limit, t.hold_max_ms) == (prio, policy, wait, 8, 8000)


def test_request_fields_override_the_policy() -> None:
    policies = {**DEFAULT_POLICIES, "ASR": LeasePolicy(95, BusyPolicy.WAIT, 1000, queue_limit=4)}
    t = resolve_terms("ASR", policies, max_wait_ms=0, busy_policy=BusyPolicy.FALLBACK_CPU, hold_max_ms=500)
    assert (t.priority, t.busy_policy, t.max_wait_ms, t.queue_limit, t.hold_max_ms) == (95, "FALLBACK_CPU", 0, 4, 500)


@pytest.mark.parametrize(
    ("policy", "status"),
    [
        (BusyPolicy.WAIT, LeaseStatus.SKIPPED),
        (BusyPolicy.SKIP, LeaseStatus.SKIPPED),
        (BusyPolicy.FALLBACK_CPU, LeaseStatus.FALLBACK_CPU),
    ],
)
def test_each_busy_policy_answers(policy: BusyPolicy, status: LeaseStatus) -> None:
    assert refusal_status(policy) == status


def test_granted_leases_leave_no_pile_of_wait_deadlines_behind() -> None:
    """Each waiting lease keeps one entry in the heap of wait deadlines; a granted one's entry is
    stale and is dropped when the heap outgrows the queue, so a day-long max_wait cannot hoard memory."""
    cfg = SchedulerConfig(mode=Mode.SERIAL)
    s = GpuScheduler(cfg, now=0)
    s.acquire_lease(1, 0, priority=50, max_wait_us=10**6, hold_max_us=10**6, queue_limit=100)
    for lease in range(2, 2000):
        s.acquire_lease(lease, lease, priority=50, max_wait_us=86_400 * 10**6, hold_max_us=10**6, queue_limit=100)
        s.release_lease(lease - 1, lease)  # the waiter is granted at once
    assert len(s.st.waits) <= 2 * len(s.queue()) + 65
