"""Parking (``gpuctl run``): a paused program's GPU memory is counted until it parks, on fake time."""

from __future__ import annotations

import pytest

from gpud.core.errors import Refused
from gpud.core.scheduler import AskPark, Drop, GpuScheduler, Grant, LeaseDenied, ParkOverdue, SchedulerConfig
from gpud_client.protocol import DropReason, ErrorCode, LeaseReason, Mode

S = 1_000_000
GIB = 2**30
PARK_TIMEOUT = 60 * S


def gpu(mode: Mode = Mode.SERIAL) -> GpuScheduler:
    # 10 GiB, no reserve: two 6 GiB programs do not fit together, two 4 GiB ones do
    return GpuScheduler(
        SchedulerConfig(
            mode=mode, memory_total_bytes=10 * GIB, memory_reserve_percent=0, tq_us=30 * S, park_timeout_us=PARK_TIMEOUT
        )
    )


def two_runs(s: GpuScheduler, need: int = 6 * GIB) -> None:
    s.attach(1, 0, mem_estimate=need, parkable=True)
    s.attach(2, 0, mem_estimate=need, parkable=True)


def test_a_parkable_session_counts_as_resident_until_its_first_park() -> None:
    s = gpu()
    two_runs(s)
    # session 2's program may be paused on the GPU (a daemon restart): 1 waits for it to park
    assert s.request(1, 0) == [AskPark(2, 0)]
    assert s.holders() == []
    assert s.parked(2, True, 5) == [Grant(1, 1)]
    assert s.session(2, 5).parked


def test_two_programs_over_capacity_take_turns_each_parked_while_the_other_holds() -> None:
    s = gpu()
    two_runs(s)
    s.request(1, 0)
    s.parked(2, True, 0)
    assert s.request(2, 1) == []
    assert s.advance(30 * S) == [Drop(1, 1, DropReason.TQ)]
    # 1 released (paused, its memory still on the GPU): 2 is granted only once 1 has parked
    assert s.release(1, 30 * S + 10) == [AskPark(1, 1)]
    assert s.holders() == []
    assert s.parked(1, True, 31 * S) == [Grant(2, 2)]
    assert s.session(1, 31 * S).parked and not s.session(2, 31 * S).parked


def test_programs_that_fit_together_are_never_asked_to_park() -> None:
    s = gpu()
    two_runs(s, need=4 * GIB)
    assert s.request(1, 0) == [Grant(1, 1)]
    s.request(2, 1)
    s.advance(30 * S)
    assert s.release(1, 30 * S) == [Grant(2, 2)]
    assert not s.session(1, 30 * S).parked


def test_only_as_many_as_needed_park_lowest_priority_and_oldest_first() -> None:
    s = gpu(Mode.CONCURRENT)
    for sid, prio in [(1, 5), (2, 0), (3, 0)]:
        s.attach(sid, 0, mem_estimate=3 * GIB, parkable=True, priority=prio)
    s.attach(4, 0, mem_estimate=6 * GIB)
    # 9 GiB resident beside a 6 GiB newcomer: 5 GiB too many, so two of the three park
    assert s.request(4, 0) == [AskPark(2, 0), AskPark(3, 0)]
    assert s.parked(2, True, 1) == []
    assert s.parked(3, True, 2) == [Grant(4, 1)]


def test_a_refused_park_is_not_asked_again_and_the_waiter_goes_on() -> None:
    s = gpu()
    two_runs(s)
    assert s.request(1, 0) == [AskPark(2, 0)]
    # nothing else could be asked: granted as on a GPU without gpud
    assert s.parked(2, False, 1) == [Grant(1, 1)]
    s.request(2, 2)
    s.advance(30 * S)
    assert s.release(1, 30 * S) == [AskPark(1, 1)]


def test_an_unanswered_park_times_out_as_refused() -> None:
    s = gpu()
    two_runs(s)
    s.request(1, 0)
    assert s.next_deadline() == PARK_TIMEOUT
    assert s.advance(PARK_TIMEOUT) == [ParkOverdue(2), Grant(1, 1)]


def test_a_grant_makes_memory_resident_again_and_a_late_parked_changes_nothing() -> None:
    s = gpu()
    two_runs(s)
    s.request(1, 0)
    s.detach(1, 1)  # the waiter left before the park was answered
    s.request(2, 2)
    assert s.holders() == [2]
    assert s.parked(2, True, 3) == []
    assert not s.session(2, 3).parked


def test_a_leaving_session_frees_its_resident_memory() -> None:
    s = gpu()
    two_runs(s)
    s.request(1, 0)
    assert s.detach(2, 1) == [Grant(1, 1)]


def test_scheduler_off_asks_nothing() -> None:
    s = gpu()
    two_runs(s)
    s.set_enabled(False, 0)
    assert s.request(1, 0) == [Grant(1, 1)]


def test_parked_from_a_session_that_is_not_parkable_is_refused() -> None:
    s = gpu()
    s.attach(1, 0)
    with pytest.raises(Refused) as e:
        s.parked(1, True, 0)
    assert e.value.code == ErrorCode.INVALID


def test_library_sessions_are_not_counted_while_they_do_not_hold() -> None:
    s = gpu()
    s.attach(1, 0, mem_estimate=6 * GIB)
    s.attach(2, 0, mem_estimate=6 * GIB)
    s.request(1, 0)
    s.request(2, 1)
    s.advance(30 * S)
    assert s.release(1, 30 * S) == [Grant(2, 2)]


def test_a_lease_that_may_not_wait_is_busy_when_residents_would_have_to_park_and_asks_nothing() -> None:
    """Found by the simulation: it was answered TIMEOUT, and a PARK went out for nobody."""
    s = gpu()
    s.attach(1, 0, mem_estimate=6 * GIB, parkable=True)
    effects = s.acquire_lease(2, 1, priority=0, max_wait_us=0, hold_max_us=S, queue_limit=10, mem_estimate=6 * GIB)
    assert effects == [LeaseDenied(2, LeaseReason.GPU_BUSY)]


def test_a_lease_whose_wait_ends_now_asks_for_no_park() -> None:
    s = gpu()
    s.attach(1, 0, mem_estimate=6 * GIB)
    s.attach(3, 0, mem_estimate=6 * GIB, parkable=True)
    s.parked(3, True, 0)
    s.request(1, 0)
    s.request(3, 0)
    s.acquire_lease(2, 1, priority=50, max_wait_us=S, hold_max_us=S, queue_limit=10, mem_estimate=6 * GIB)
    s.detach(3, 2)  # out of the way
    s.attach(4, 2, mem_estimate=6 * GIB, parkable=True)  # resident: the lease would need it parked
    assert s.release(1, 1 + S) == [LeaseDenied(2, LeaseReason.TIMEOUT)]  # its wait ends as the GPU frees
