"""Compute limits, memory admission, modes and priority on fake time (microseconds)."""

from __future__ import annotations

import pytest

from gpud.core.errors import Refused
from gpud.core.quota import QuotaConfig
from gpud.core.scheduler import Drop, GpuScheduler, Grant, MemOverLimit, SchedulerConfig
from gpud_client.protocol import DropReason, ErrorCode, Mode

from .statecheck import state_of

MS = 1000
S = 1_000_000
GIB = 2**30
W = 1 * S  # window used by these tests


def gpu(
    mode: Mode = Mode.CONCURRENT,
    carry: int = 0,
    tail: int = 100,
    memory: int = 10 * GIB,
    reserve: int = 0,
    sample: int = 10 * S,  # out of the way unless a test is about it
) -> GpuScheduler:
    return GpuScheduler(
        SchedulerConfig(
            tq_us=3600 * S,
            drop_timeout_us=3600 * S,
            mode=mode,
            memory_total_bytes=memory,
            memory_reserve_percent=reserve,
            quota=QuotaConfig(
                window_us=W, carryover_percent=carry, drop_tail_billing_percent=tail, sample_interval_us=sample
            ),
        )
    )


def used_ms(s: GpuScheduler, sid: int, now: int) -> float:
    s.advance(now)
    return s.session(sid, now).used_us / 1000


def start(s: GpuScheduler, *sessions: tuple[int, int], at: int = 0, mem: int = GIB) -> None:
    """Attach (session, core_limit) pairs with a known memory need and request."""
    for sid, limit in sessions:
        s.attach(sid, at, core_limit=limit, mem_estimate=mem)
        s.request(sid, at)


# --- billing ----------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_k_concurrent_holders_are_each_billed_wall_time_over_k(k: int) -> None:
    s = gpu()
    start(s, *[(i, 100) for i in range(1, k + 1)])
    assert len(s.holders()) == k
    for i in range(1, k + 1):
        assert used_ms(s, i, 300 * MS) == pytest.approx(300 / k, abs=0.001)


def test_billing_is_settled_when_the_running_set_changes() -> None:
    s = gpu()
    start(s, (1, 100), (2, 100))
    s.release(2, 200 * MS)  # 200 ms shared: 100 ms each
    assert used_ms(s, 2, 900 * MS) == pytest.approx(100)
    assert used_ms(s, 1, 900 * MS) == pytest.approx(100 + 700)


def test_the_window_resets_use_and_keeps_history() -> None:
    s = gpu()
    start(s, (1, 100))
    s.release(1, 400 * MS)
    assert used_ms(s, 1, W - 1) == pytest.approx(400)
    assert used_ms(s, 1, W) == 0
    assert s.session(1, W).recent_share_percent == pytest.approx(40)


# --- budgets and throttling ---------------------------------------------------


def test_budget_exhaustion_drops_at_the_exact_microsecond() -> None:
    s = gpu()
    start(s, (1, 25))
    assert s.next_deadline() == 250 * MS
    assert s.advance(250 * MS - 1) == []
    assert s.advance(250 * MS) == [Drop(1, 1, DropReason.QUOTA)]


def test_exhaustion_deadline_accounts_for_concurrency() -> None:
    s = gpu()
    start(s, (1, 25), (2, 100))
    # 250 ms of budget billed at 1/2 rate runs out after 500 ms of wall time
    assert s.next_deadline() == 500 * MS
    s.release(2, 100 * MS)  # alone from here: 200 ms left at full rate
    assert s.next_deadline() == 300 * MS


def test_the_timer_never_sleeps_longer_than_the_sample_interval_while_limited() -> None:
    s = gpu(sample=50 * MS)
    start(s, (1, 100))
    assert s.next_deadline() is None  # unlimited alone: nothing to watch
    s.set_limits(1, 10 * MS, core_limit=90)
    assert s.next_deadline() == 60 * MS
    s.advance(60 * MS)
    assert s.next_deadline() == 110 * MS
    s.release(1, 70 * MS)
    assert s.next_deadline() is None  # nothing runs, nothing throttled


def test_only_the_over_budget_session_is_throttled_others_run_on() -> None:
    s = gpu()
    start(s, (1, 20), (2, 60), (3, 100))
    # each billed at 1/3: session 1 reaches 200 ms at 600 ms of wall time
    assert s.advance(600 * MS) == [Drop(1, 1, DropReason.QUOTA)]
    s.release(1, 601 * MS)
    assert s.holders() == [2, 3]
    s.request(1, 602 * MS)
    assert s.queue() == [1] and s.session(1, 602 * MS).throttled
    assert s.view(602 * MS).queue[0].throttled


def test_throttled_until_the_next_window_then_granted() -> None:
    s = gpu(mode=Mode.SERIAL)
    start(s, (1, 30))
    s.advance(300 * MS)
    s.release(1, 300 * MS)
    s.request(1, 310 * MS)
    assert s.holders() == [] and s.next_deadline() == W
    assert s.advance(W) == [Grant(1, 2)]


def test_a_throttled_head_does_not_block_others() -> None:
    s = gpu(mode=Mode.SERIAL)
    start(s, (1, 10))
    s.advance(100 * MS)
    s.release(1, 100 * MS)
    s.attach(2, 100 * MS, mem_estimate=GIB)
    s.request(1, 110 * MS)
    assert s.request(2, 120 * MS) == [Grant(2, 2)]


def test_oversubscribed_limits_are_scaled_and_unlimited_sessions_do_not_count() -> None:
    s = gpu()
    start(s, (1, 60), (2, 90), (3, 100))
    # 60 + 90 = 150 > 100: budgets scale by 100/150 -> 40 % and 60 % of the window
    assert s.session(1, 0).budget_us == 400 * MS
    assert s.session(2, 0).budget_us == 600 * MS
    assert s.session(3, 0).budget_us is None


def test_limits_under_100_in_sum_are_not_scaled() -> None:
    s = gpu()
    start(s, (1, 30), (2, 60))
    assert (s.session(1, 0).budget_us, s.session(2, 0).budget_us) == (300 * MS, 600 * MS)


def test_drop_tail_is_billed_at_its_percentage() -> None:
    s = gpu(tail=50)
    start(s, (1, 20))
    s.advance(200 * MS)  # dropped at 200 ms
    s.release(1, 300 * MS)  # 100 ms tail at 50 %
    assert used_ms(s, 1, 300 * MS) == pytest.approx(250)


def test_carryover_starts_the_next_window_with_the_overshoot() -> None:
    s = gpu(carry=50)
    start(s, (1, 20))
    s.advance(200 * MS)
    s.release(1, 400 * MS)  # 200 ms over budget
    assert used_ms(s, 1, W) == pytest.approx(100)  # half of the overshoot carried
    assert not s.session(1, W).throttled


def test_a_large_carry_keeps_a_session_throttled_into_the_next_window() -> None:
    s = gpu(carry=100)
    start(s, (1, 10))
    s.advance(100 * MS)
    s.release(1, 350 * MS)  # 250 ms over a 100 ms budget
    s.request(1, 400 * MS)
    assert s.advance(W) == []  # carried 250 ms >= 100 ms budget: still throttled
    assert s.session(1, W).used_us == 250 * MS
    assert s.advance(2 * W) == []  # 150 ms carried
    assert s.advance(3 * W) == [Grant(1, 2)]  # 50 ms carried < budget


def test_a_limit_change_mid_window_keeps_the_use() -> None:
    s = gpu()
    start(s, (1, 100))
    s.advance(300 * MS)
    assert s.set_limits(1, 300 * MS, core_limit=50) == []
    assert used_ms(s, 1, 300 * MS) == pytest.approx(300)
    assert s.next_deadline() == 500 * MS  # 200 ms left of the new 500 ms budget
    assert s.set_limits(1, 400 * MS, core_limit=30) == [Drop(1, 1, DropReason.QUOTA)]
    assert used_ms(s, 1, 400 * MS) == pytest.approx(400)


def test_raising_a_limit_lifts_the_throttle_at_once() -> None:
    s = gpu(mode=Mode.SERIAL)
    start(s, (1, 10))
    s.advance(100 * MS)
    s.release(1, 100 * MS)
    s.request(1, 150 * MS)
    assert s.set_limits(1, 200 * MS, core_limit=50) == [Grant(1, 2)]


def test_bad_limits_are_refused_and_change_nothing() -> None:
    s = gpu()
    start(s, (1, 50))
    before = state_of(s)
    for bad in (0, 101, -5):
        with pytest.raises(Refused) as err:
            s.set_limits(1, 10, core_limit=bad)
        assert err.value.code == ErrorCode.INVALID and str(bad) in err.value.message
        with pytest.raises(Refused):
            s.attach(9, 10, core_limit=bad)
    assert state_of(s) == before


# --- memory -------------------------------------------------------------------


def test_concurrent_admission_while_memory_fits_with_reserve() -> None:
    s = gpu(memory=10 * GIB, reserve=10)  # 9 GiB usable
    for sid, need in [(1, 4), (2, 4), (3, 2)]:
        s.attach(sid, 0, mem_estimate=need * GIB)
    assert s.request(1, 0) == [Grant(1, 1)]
    assert s.request(2, 1) == [Grant(2, 2)]
    assert s.request(3, 2) == []  # 4 + 4 + 2 > 9
    assert s.release(2, 3) == [Grant(3, 3)]


def test_reported_use_counts_when_larger_than_the_estimate() -> None:
    s = gpu(memory=10 * GIB)
    for sid in (1, 2):
        s.attach(sid, 0, mem_estimate=GIB)
    s.request(1, 0)
    s.report_memory(1, 9 * GIB + 1, 1)
    assert s.request(2, 2) == []


def test_unknown_memory_is_admitted_only_alone() -> None:
    s = gpu()
    s.attach(1, 0)
    s.attach(2, 0)
    assert s.request(1, 0) == [Grant(1, 1)]  # the first holder on an idle GPU always
    assert s.request(2, 1) == []


def test_the_first_holder_is_admitted_even_if_too_big() -> None:
    s = gpu(memory=10 * GIB)
    s.attach(1, 0, mem_estimate=40 * GIB)
    assert s.request(1, 0) == [Grant(1, 1)]


def test_serial_mode_admits_one_holder() -> None:
    s = gpu(mode=Mode.SERIAL)
    start(s, (1, 100), (2, 100))
    assert s.holders() == [1] and s.queue() == [2]
    assert s.set_mode(Mode.CONCURRENT, 5) == [Grant(2, 2)]


def test_auto_mode_drops_sessions_when_reported_memory_overflows() -> None:
    s = gpu(mode=Mode.AUTO, memory=10 * GIB)
    s.attach(1, 0, mem_estimate=3 * GIB, priority=5)
    s.attach(2, 0, mem_estimate=3 * GIB)
    s.request(1, 0)
    s.request(2, 1)
    assert s.holders() == [1, 2]
    assert s.report_memory(1, 8 * GIB, 2) == [Drop(2, 2, DropReason.MEMORY)]  # lowest priority goes
    assert s.report_memory(1, 9 * GIB, 3) == []  # the last holder is never dropped


def test_of_holders_granted_at_the_same_instant_the_later_grant_is_dropped_first() -> None:
    """Several waiters can be granted in one pass (a release, a mode change): they share the
    instant, and the grant order still says which came last."""
    s = gpu(mode=Mode.SERIAL, memory=10 * GIB)
    for sid in (1, 2, 3):
        s.attach(sid, 0, mem_estimate=3 * GIB)
    for sid in (1, 2, 3):
        s.request(sid, sid)
    assert s.set_mode(Mode.AUTO, 10) == [Grant(2, 2), Grant(3, 3)]  # both at t=10
    assert s.report_memory(1, 5 * GIB, 11) == [Drop(3, 3, DropReason.MEMORY)]


def test_concurrent_mode_does_not_drop_on_overflow() -> None:
    s = gpu(mode=Mode.CONCURRENT, memory=10 * GIB)
    start(s, (1, 100), (2, 100), mem=3 * GIB)
    assert s.report_memory(1, 9 * GIB, 2) == []


def test_use_above_the_memory_limit_is_reported_once_per_crossing() -> None:
    s = gpu()
    s.attach(1, 0, mem_estimate=GIB, mem_limit=2 * GIB)
    assert s.report_memory(1, 3 * GIB, 1) == [MemOverLimit(1, 3 * GIB, 2 * GIB)]
    assert s.report_memory(1, 4 * GIB, 2) == []
    s.report_memory(1, GIB, 3)
    assert s.report_memory(1, 5 * GIB, 4) == [MemOverLimit(1, 5 * GIB, 2 * GIB)]
    assert s.session(1, 4).mem_violations == 2
    assert s.set_limits(1, 5, mem_limit=4 * GIB) == [MemOverLimit(1, 5 * GIB, 4 * GIB)]


# --- priority -----------------------------------------------------------------


def test_a_higher_priority_waiter_preempts_the_lowest_priority_holder() -> None:
    s = gpu(mode=Mode.SERIAL)
    s.attach(1, 0, priority=10)
    s.attach(2, 0, priority=50)
    s.request(1, 0)
    assert s.request(2, 5) == [Drop(1, 1, DropReason.PREEMPT)]
    assert s.release(1, 6) == [Grant(2, 2)]


def test_preemption_drops_only_as_many_as_needed_lowest_first() -> None:
    s = gpu(mode=Mode.CONCURRENT, memory=10 * GIB)
    for sid, prio, need in [(1, 30, 4), (2, 10, 4), (3, 20, 2), (4, 90, 4)]:
        s.attach(sid, 0, priority=prio, mem_estimate=need * GIB)
    for sid in (1, 2, 3):
        s.request(sid, sid)
    assert s.request(4, 10) == [Drop(2, 2, DropReason.PREEMPT)]  # freeing 4 GiB is enough
    assert s.release(2, 11) == [Grant(4, 4)]
    assert s.holders() == [1, 3, 4]


def test_of_holders_granted_at_the_same_instant_the_later_grant_is_preempted_first() -> None:
    s = gpu(mode=Mode.SERIAL, memory=10 * GIB)
    for sid, prio in [(1, 10), (2, 10), (3, 10), (4, 90)]:
        s.attach(sid, 0, priority=prio, mem_estimate=3 * GIB)
    for sid in (1, 2, 3):
        s.request(sid, sid)
    assert s.set_mode(Mode.CONCURRENT, 10) == [Grant(2, 2), Grant(3, 3)]  # both at t=10
    assert s.request(4, 11) == [Drop(3, 3, DropReason.PREEMPT)]


def test_equal_or_lower_priority_never_preempts() -> None:
    s = gpu(mode=Mode.SERIAL)
    s.attach(1, 0, priority=50)
    s.attach(2, 0, priority=50)
    s.request(1, 0)
    assert s.request(2, 1) == []


def test_a_lowered_limit_does_not_turn_past_use_into_debt() -> None:
    s = gpu(carry=100)
    start(s, (1, 100))
    s.advance(300 * MS)
    assert s.set_limits(1, 300 * MS, core_limit=20) == [Drop(1, 1, DropReason.QUOTA)]
    s.release(1, 301 * MS)  # 1 ms of tail beyond the use made under the old limit
    assert used_ms(s, 1, W) == pytest.approx(1)  # not 301 - 200 = 101 ms of "debt"
    assert not s.session(1, W).throttled


def test_oversubscription_arriving_mid_window_is_not_debt_either() -> None:
    s = gpu(carry=100)
    start(s, (1, 60))
    s.advance(500 * MS)
    s.attach(2, 500 * MS, core_limit=90, mem_estimate=GIB)  # 150 in sum: budget of 1 falls to 400 ms
    s.release(1, 500 * MS)
    assert used_ms(s, 1, W) == 0


def test_recent_share_counts_each_windows_own_use_once() -> None:
    s = gpu(carry=100, mode=Mode.SERIAL)
    start(s, (1, 20))
    s.advance(200 * MS)
    s.release(1, 300 * MS)  # 100 ms over: carried into the next window
    s.advance(2 * W)
    assert s.session(1, 2 * W).recent_share_percent == pytest.approx((30 + 0) / 2)
