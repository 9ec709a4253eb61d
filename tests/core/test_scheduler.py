"""The time-sliced lock's rules on fake time (microseconds), no sleeping."""

from __future__ import annotations

import pytest

from gpud.core.errors import Refused
from gpud.core.quota import QuotaConfig
from gpud.core.scheduler import Drop, GpuScheduler, Grant, LeaseDenied, Revoke, SchedulerConfig
from gpud_client.protocol import DropReason, ErrorCode, LeaseReason, RevokeReason

from .statecheck import state_of

S = 1_000_000  # one second in microseconds
TQ = 30 * S
DROP_TIMEOUT = 10 * S


def sched(*sessions: int, tq: int = TQ, drop_timeout: int = DROP_TIMEOUT) -> GpuScheduler:
    s = GpuScheduler(SchedulerConfig(tq_us=tq, drop_timeout_us=drop_timeout))
    for sid in sessions:
        s.attach(sid, 0)
    return s


def test_first_request_is_granted_at_once() -> None:
    s = sched(1)
    assert s.request(1, 5) == [Grant(1, 1)]
    assert s.holders() == [1]


def test_requests_are_granted_in_arrival_order_one_holder_at_a_time() -> None:
    s = sched(1, 2, 3)
    s.request(1, 0)
    assert s.request(3, 1) == []
    assert s.request(2, 2) == []
    assert s.queue() == [3, 2]
    assert s.release(1, 10) == [Grant(3, 2)]
    assert s.release(3, 11) == [Grant(2, 3)]
    assert s.holders() == [2] and s.queue() == []


def test_higher_priority_goes_first_fifo_within_a_priority() -> None:
    s = GpuScheduler()
    for sid, prio in [(1, 0), (2, 0), (3, 50), (4, 50)]:
        s.attach(sid, 0, priority=prio)
    s.request(1, 0)
    for sid in (2, 3, 4):
        s.request(sid, sid)
    assert s.queue() == [3, 4, 2]


def test_release_passes_the_lock_on_within_the_same_call() -> None:
    s = sched(1, 2)
    s.request(1, 0)
    s.request(2, 1)
    effects = s.release(1, 7)
    assert effects == [Grant(2, 2)]
    assert s.session(2, 7).wait_us == 6


def test_no_waiter_no_drop() -> None:
    s = sched(1)
    s.request(1, 0)
    assert s.next_deadline() is None
    assert s.advance(10 * TQ) == []
    assert s.holders() == [1]


def test_tq_drops_the_holder_once_when_someone_waits() -> None:
    s = sched(1, 2)
    s.request(1, 0)
    s.request(2, 5 * S)
    assert s.next_deadline() == TQ
    assert s.advance(TQ - 1) == []
    assert s.advance(TQ) == [Drop(1, 1, DropReason.TQ)]
    # once per grant: no second drop however long it keeps holding (until revoked)
    assert s.advance(TQ + 1) == []
    assert s.view(TQ).holders[0].drop_pending == DropReason.TQ


def test_waiter_arriving_after_tq_triggers_the_drop_at_once() -> None:
    s = sched(1, 2)
    s.request(1, 0)
    assert s.request(2, 2 * TQ) == [Drop(1, 1, DropReason.TQ)]


def test_drop_timeout_revokes_and_passes_the_lock_on() -> None:
    s = sched(1, 2)
    s.request(1, 0)
    s.request(2, 1)
    s.advance(TQ)
    assert s.next_deadline() == TQ + DROP_TIMEOUT
    assert s.advance(TQ + DROP_TIMEOUT - 1) == []
    assert s.advance(TQ + DROP_TIMEOUT) == [Revoke(1, 1, RevokeReason.DROP_TIMEOUT), Grant(2, 2)]
    assert s.session(1, TQ + DROP_TIMEOUT).revocations == 1
    assert s.view(TQ + DROP_TIMEOUT).revocations == 1


def test_release_after_drop_cancels_the_revocation() -> None:
    s = sched(1, 2)
    s.request(1, 0)
    s.request(2, 1)
    s.advance(TQ)
    assert s.release(1, TQ + 5) == [Grant(2, 2)]
    assert s.session(1, TQ + 5).revocations == 0
    # the new holder gets its own full quantum, not the old deadline
    assert s.next_deadline() is None  # nobody waits behind 2


def test_a_late_timer_cannot_drop_the_next_holder() -> None:
    s = sched(1, 2, 3)
    s.request(1, 0)
    s.request(2, 1)
    s.request(3, 2)
    deadline = s.next_deadline()
    s.release(1, 100)  # 2 is granted at 100; the old deadline is stale now
    assert s.advance(deadline or 0) == []
    assert s.next_deadline() == 100 + TQ


def test_release_by_a_non_holder_is_refused_and_changes_nothing() -> None:
    s = sched(1, 2, 3)
    s.request(1, 0)
    s.request(2, 1)
    before = state_of(s)
    for sid in (2, 3):
        with pytest.raises(Refused) as err:
            s.release(sid, 5)
        assert err.value.code == ErrorCode.NOT_HOLDER
    with pytest.raises(Refused) as err:
        s.release(99, 5)
    assert err.value.code == ErrorCode.UNKNOWN_SESSION
    with pytest.raises(Refused) as err:
        s.release(1, 5, grant=7)
    assert err.value.code == ErrorCode.STALE_GRANT
    assert state_of(s) == before


def test_a_second_request_is_refused_and_changes_nothing() -> None:
    s = sched(1, 2)
    s.request(1, 0)
    s.request(2, 1)
    before = state_of(s)
    for sid in (1, 2):
        with pytest.raises(Refused) as err:
            s.request(sid, 3)
        assert err.value.code == ErrorCode.ALREADY_REQUESTED
    assert state_of(s) == before


def test_detach_frees_the_lock_and_the_queue_place_at_once() -> None:
    s = sched(1, 2, 3)
    s.request(1, 0)
    s.request(2, 1)
    s.request(3, 2)
    assert s.detach(2, 3) == []
    assert s.queue() == [3]
    assert s.detach(1, 4) == [Grant(3, 2)]
    assert s.holders() == [3]


def test_scheduler_off_grants_everything_and_empties_the_queue() -> None:
    s = sched(1, 2, 3)
    s.request(1, 0)
    s.request(2, 1)
    s.request(3, 2)
    assert s.set_enabled(False, 10) == [Grant(2, 2), Grant(3, 3)]
    assert s.queue() == [] and s.holders() == [1, 2, 3]
    assert s.next_deadline() is None
    assert s.advance(100 * TQ) == []  # no drops while off
    s.release(1, 20)
    assert s.request(1, 21) == [Grant(1, 4)]


def test_scheduler_off_cancels_a_pending_drop() -> None:
    s = sched(1, 2)
    s.request(1, 0)
    s.request(2, 1)
    s.advance(TQ)
    s.set_enabled(False, TQ + 1)
    assert s.advance(TQ + 2 * DROP_TIMEOUT) == []
    assert s.session(1, 0).revocations == 0


def test_scheduler_on_again_queues_behind_the_holders() -> None:
    s = sched(1, 2, 3)
    s.set_enabled(False, 0)
    s.request(1, 0)
    s.request(2, 0)
    s.set_enabled(True, 1)
    assert s.request(3, 2) == []
    assert s.release(1, 3) == []  # 2 still holds
    assert s.release(2, 4) == [Grant(3, 3)]


def test_set_tq_applies_to_the_current_holder() -> None:
    s = sched(1, 2)
    s.request(1, 0)
    s.request(2, 1)
    assert s.set_tq(5 * S, 6 * S) == [Drop(1, 1, DropReason.TQ)]
    with pytest.raises(Refused):
        s.set_tq(0, 7 * S)
    assert s.config.tq_us == 5 * S


def test_accounting_of_hold_and_wait() -> None:
    s = sched(1, 2)
    s.request(1, 0)
    s.request(2, 10)
    s.release(1, 100)
    s.release(2, 250)
    one, two = s.session(1, 300), s.session(2, 300)
    assert (one.hold_us, one.wait_us, one.grants) == (100, 0, 1)
    assert (two.hold_us, two.wait_us, two.grants) == (150, 90, 1)
    assert s.view(300).grants == 2


def test_attach_twice_and_unknown_sessions_are_refused() -> None:
    s = sched(1)
    with pytest.raises(Refused):
        s.attach(1, 0)
    with pytest.raises(Refused) as err:
        s.request(5, 0)
    assert err.value.code == ErrorCode.UNKNOWN_SESSION
    with pytest.raises(Refused):
        s.detach(5, 0)


def test_nothing_is_granted_during_the_restart_grace_then_in_queue_order() -> None:
    s = GpuScheduler(SchedulerConfig(tq_us=TQ, drop_timeout_us=DROP_TIMEOUT), now=0, grants_from=S)
    for sid in (1, 2):
        s.attach(sid, 0)
    assert s.request(2, 10) == [] and s.request(1, 20) == []
    assert s.next_deadline() == S  # the timer wakes when the grace ends
    assert s.advance(S - 1) == [] and s.holders() == []
    assert s.advance(S) == [Grant(2, 1, S - 10)]
    assert s.release(2, S + 5) == [Grant(1, 2, S + 5 - 20)]


def test_a_lease_that_may_not_wait_is_refused_as_busy_during_the_grace() -> None:
    s = GpuScheduler(SchedulerConfig(), now=0, grants_from=S)
    effects = s.acquire_lease(7, 10, priority=50, max_wait_us=0, hold_max_us=S, queue_limit=8)
    assert effects == [LeaseDenied(7, LeaseReason.GPU_BUSY)]
    s.acquire_lease(8, 10, priority=50, max_wait_us=2 * S, hold_max_us=S, queue_limit=8)
    assert s.advance(S)[0] == Grant(8, 1, S - 10)


def test_the_grace_ends_on_time_for_a_gpu_nobody_asked_for_meanwhile() -> None:
    s = GpuScheduler(SchedulerConfig(), now=0, grants_from=S)
    assert s.acquire_lease(7, S, priority=50, max_wait_us=0, hold_max_us=S, queue_limit=8)[0] == Grant(7, 1)


def test_a_waiting_lease_times_out_on_time_during_the_grace_with_the_scheduler_off() -> None:
    s = GpuScheduler(SchedulerConfig(), now=0, grants_from=S)
    s.set_enabled(False, 0)
    s.acquire_lease(7, 10, priority=50, max_wait_us=1000, hold_max_us=S, queue_limit=8)
    assert s.next_deadline() == 1010  # its max_wait, not the end of the grace
    assert s.advance(1010) == [LeaseDenied(7, LeaseReason.TIMEOUT)]


def test_a_lease_that_may_not_wait_is_busy_during_the_grace_with_the_scheduler_off() -> None:
    s = GpuScheduler(SchedulerConfig(), now=0, grants_from=S)
    s.set_enabled(False, 0)
    assert s.acquire_lease(7, 10, priority=50, max_wait_us=0, hold_max_us=S, queue_limit=8) == [
        LeaseDenied(7, LeaseReason.GPU_BUSY)
    ]
    assert s.queue() == []


def test_a_holder_is_dropped_again_at_its_next_tq_after_the_scheduler_was_off_and_on() -> None:
    """SCHED_OFF cancels a pending TQ drop; after SCHED_ON the holder's quantum counts again.
    Before, the cancelled drop left it marked as dropped: it kept the GPU for good."""
    s = sched(1, 2, tq=10 * S)
    s.request(1, 0)
    s.request(2, 1)
    assert s.advance(10 * S) == [Drop(1, 1, DropReason.TQ)]
    s.set_enabled(False, 10 * S + 1)  # the drop is cancelled; 2 is granted beside it (off: all at once)
    s.release(2, 10 * S + 2)
    s.set_enabled(True, 10 * S + 3)
    assert s.request(2, 10 * S + 4) == [Drop(1, 1, DropReason.TQ)]  # its quantum is long spent
    assert s.advance(10 * S + 4 + DROP_TIMEOUT) == [Revoke(1, 1, RevokeReason.DROP_TIMEOUT), Grant(2, 3)]


def test_a_lease_is_judged_busy_or_free_after_the_state_is_brought_up_to_now() -> None:
    """A window that ends within the acquire's own call un-throttles a queued session,
    which takes the GPU: a lease that may not wait is then busy, not timed out."""
    cfg = SchedulerConfig(quota=QuotaConfig(window_us=S))
    s = GpuScheduler(cfg, now=0)
    s.attach(1, 0, core_limit=10)
    s.attach(2, 0)
    s.request(1, 0)
    s.advance(S // 10)  # 1 used its 10 % budget: dropped
    s.release(1, S // 10 + 1)
    s.request(1, S // 10 + 2)  # throttled until the window ends: it waits, the GPU is free
    effects = s.acquire_lease(7, S, priority=50, max_wait_us=0, hold_max_us=S, queue_limit=8)
    assert LeaseDenied(7, LeaseReason.GPU_BUSY) in effects and Grant(1, 2) in effects
    assert LeaseDenied(7, LeaseReason.TIMEOUT) not in effects
