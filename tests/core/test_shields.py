"""What keeps an allocation from being taken back, said one way everywhere (``Ledger.shield``): in the
answers, in a refused or expired request, in the waiters' listing; and the elastic pacing the docs
describe. Fake time, integer microseconds."""

from __future__ import annotations

import pytest

from gpud.core import shields
from gpud.core.ledger import Expired, Grown, Insufficient, TakenBack
from gpud.core.shields import Blocked, Shield

from .test_preemption import COOLDOWN, MATURE, MIN_RUN, WINDOW, S, hold, node, noticed, req, served, wait


def test_inside_its_minimum_runtime_until_when() -> None:
    led = node(gpus=1)
    a = hold(led, "be", 1, 0, priority=50)
    shield = led.shield(a, 60 * S)
    assert shield == Shield(shields.MIN_RUNTIME, MIN_RUN)
    assert shield.text(60 * S) == "inside its minimum runtime for 240 s more"
    assert shield.left_s(60 * S) == 240.0
    assert led.shield(a, MIN_RUN) is None  # from then on a higher priority may take it back
    spot = node(gpus=1)
    assert spot.shield(hold(spot, "s", 1, 0, priority=0), 1) is None  # spot: at any time


def test_resting_after_a_withdrawn_notice() -> None:
    led = node(gpus=1)
    a = hold(led, "v", 1, 0, priority=0)
    wait(led, "w", 1, 1, priority=50)
    assert set(noticed(led.advance(1))) == {"v"}
    _, effects = led.release("w", 2)  # the waiter gives up: the notice is withdrawn, its victim rests
    assert led.shield(a, 2) == Shield(shields.RESTING, 2 + COOLDOWN)
    assert led.shield(a, 2 + COOLDOWN) is None


def test_a_request_that_expires_says_what_was_in_its_way() -> None:
    led = node(gpus=2)
    hold(led, "be", 1, 0, priority=50)
    hold(led, "serve", 1, 0, priority=100)
    wait(led, "prod", 1, 10 * S, wait_s=20, priority=100)
    assert led.advance(10 * S) == []  # nothing may be taken back for it
    [_, why] = led.waiter_info(20 * S)[0][1:]
    assert why == (
        "1 whole GPU(s) asked, 0 entirely free now; nothing could be taken back: "
        "serve: not of a lower priority than 100; be: inside its minimum runtime for 280 s more"
    )
    [expired] = [e for e in led.advance(30 * S) if isinstance(e, Expired)]
    assert expired.reason.message == (
        "1 whole GPU(s) asked, 0 entirely free now; nothing could be taken back: "
        "serve: not of a lower priority than 100; be: inside its minimum runtime for 270 s more"
    )


def test_a_request_that_does_not_wait_says_what_is_in_its_way() -> None:
    led = node(gpus=2)
    hold(led, "be", 1, 0, priority=50)
    hold(led, "spot", 1, 0, priority=0)
    with pytest.raises(Insufficient) as err:
        led.allocate(req("prod", 1, priority=100), MATURE)
    assert err.value.message == (
        "1 whole GPU(s) asked, 0 entirely free now; nothing could be taken back: "
        "be, spot: of a lower priority: taken back only for a request that waits (wait_ms)"
    )
    with pytest.raises(Insufficient) as err:  # the same priority: nothing is below it
        led.allocate(req("peer", 1, priority=50), MATURE)
    assert "be: not of a lower priority than 50" in err.value.message


def test_the_soonest_of_a_group_and_a_bounded_read() -> None:
    blocked = Blocked(0)
    for i in range(5):
        blocked.add_shield(f"t{i}", Shield(shields.MIN_RUNTIME, (10 - i) * S))
    assert blocked.text() == (
        "nothing could be taken back: t0, t1, t2 and 2 more: "
        "inside its minimum runtime for 6.0 s more (the soonest of them)"
    )
    blocked.read_all = False
    assert blocked.text().startswith("nothing could be taken back (of the allocations read): ")


def test_the_waiters_listing_names_only_victims_that_have_not_left() -> None:
    led = node(gpus=2)
    hold(led, "a", 1, 0, priority=0)
    hold(led, "b", 1, 0, priority=0)
    wait(led, "w", 2, 1, priority=50)
    assert set(noticed(led.advance(1))) == {"a", "b"}
    assert led.waiter_info(2)[0][2] == "waits for a, b to leave (their grace runs)"
    [taken] = led.yield_("a", 3)
    assert isinstance(taken, TakenBack)
    assert led.waiter_info(4)[0][2] == "waits for b to leave (their grace runs)"
    assert served(led.yield_("b", 5)) == ["w"]
    assert led.waiter_info(6) == []


def test_an_elastic_allocation_grows_back_after_its_cooldown_and_the_window() -> None:
    """As docs/preemption.md says: it grows once whole GPUs have stayed free through the window AND
    its last change (a shrink too) is a cooldown old; so after a shrink, no sooner than the cooldown."""
    led = node(gpus=4)
    hold(led, "x", 1, 0, priority=90)
    hold(led, "e", 1, 0, gpus_max=3, on_preempt="shrink", priority=10)
    wait(led, "w", 2, MATURE, priority=50)
    led.advance(MATURE)
    shrunk_at = MATURE + 1
    assert served(led.yield_("e", shrunk_at)) == ["w"]
    freed_at = MATURE + 2
    led.release("w", freed_at)
    assert led.advance(freed_at) == []
    assert led.next_deadline() == shrunk_at + COOLDOWN  # not freed_at + WINDOW, which is sooner
    assert led.advance(freed_at + WINDOW) == []
    [grown] = led.advance(shrunk_at + COOLDOWN)
    assert isinstance(grown, Grown) and grown.allocation.gpus == (1, 2, 3)
    # GPUs freed late: the window from then decides
    wait(led, "w2", 2, MATURE + 100 * S, priority=50)
    led.advance(MATURE + 100 * S)
    shrunk_at = MATURE + 101 * S
    assert served(led.yield_("e", shrunk_at)) == ["w2"]
    freed_at = shrunk_at + 50 * S
    led.release("w2", freed_at)
    led.advance(freed_at)
    assert led.next_deadline() == freed_at + WINDOW
