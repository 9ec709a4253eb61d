"""Victims told in batches: a waiter that must take back 1 000 fractions tells ``NOTICE_BATCH`` of
them per call, never more, nothing held twice after any call, and is served only once they all left;
giving up, a failed store (rollback) and a restart in the middle keep that. Drains and withdrawals go
in batches likewise. Pure: fake integer time, no clock."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

import gpud.core.ledger.notices as notices
import gpud.core.ledger.placement as placement
from gpud.core.ledger import (
    NOTICE_BATCH,
    UNIT,
    GpuSpec,
    Ledger,
    LedgerEffect,
    Noticed,
    PreemptionConfig,
    Request,
    Served,
    TakenBack,
    Withdrawn,
)
from gpud_client.protocol import Recovery

from .test_ledger_scale import check_index, ledger_state

S = 1_000_000
GRACE = 30 * S
CONFIG = PreemptionConfig(grace_us=GRACE, min_runtime_us=300 * S, cooldown_us=60 * S)
VICTIMS = 1000
SHARE = UNIT // VICTIMS  # 1 000 spot fractions fill GPU 0
T0 = 400 * S


def node(gpus: int = 2) -> Ledger:
    return Ledger([GpuSpec(i, f"GPU-{i}") for i in range(gpus)], list(range(4)), preemption=CONFIG)


def filled(gpus: int = 2) -> Ledger:
    """GPU 0 holds 1 000 spot fractions (each reachable); every other GPU a production allocation."""
    led = node(gpus)
    for i in range(VICTIMS):
        t = f"v{i:04d}"
        assert led.allocate(Request(t, SHARE, priority=0, prefer=(0,)), 0) is not None
        led.reachable.add(t)
    for g in range(1, gpus):
        assert led.allocate(Request(f"prod{g}", UNIT, priority=100, prefer=(g,)), 0) is not None
    assert led.gpu_free(0) == 0
    return led


def waiting(led: Ledger, now: int = T0, task: str = "w") -> None:
    assert led.allocate(Request(task, UNIT, priority=100, wait_us=1000 * S), now) is None


def kinds(effects: list[LedgerEffect], kind: type) -> list[LedgerEffect]:
    return [e for e in effects if isinstance(e, kind)]


def check(led: Ledger, effects: list[LedgerEffect]) -> None:
    """After every call: a batch at most told or withdrawn, every GPU's shares add up, the waiter
    served only when none of its victims holds anything, the indexes what the state says."""
    assert len(kinds(effects, Noticed)) <= NOTICE_BATCH
    assert len(kinds(effects, Withdrawn)) <= NOTICE_BATCH
    for g in range(len(led.state.gpus)):
        held = sum(a.share for a in led.allocations() if g in a.gpus)
        assert held + led.gpu_free(g) == UNIT and led.gpu_free(g) >= 0  # no device held twice
    for e in kinds(effects, Served):
        assert isinstance(e, Served)
        if not e.resumed:  # a waiter (not a victim resumed): none of the victims holds GPU 0 any more
            assert not any(a.task_id.startswith("v") and 0 in a.gpus for a in led.allocations())
    check_index(led)


def tell_all(led: Ledger, now: int = T0) -> list[int]:
    """``advance`` until nothing is left to tell: how many were told at each call."""
    counts = []
    while True:
        effects = led.advance(now)
        check(led, effects)
        told = len(kinds(effects, Noticed))
        if not told:
            return counts
        counts.append(told)
        assert led.next_deadline() == now or led.state.index.chosen == {}  # called again at once while some are left


def test_a_waiter_tells_its_1000_victims_a_batch_per_call_and_is_served_once_all_left() -> None:
    led = filled()
    waiting(led)
    counts = tell_all(led)
    assert len(counts) == math.ceil(VICTIMS / NOTICE_BATCH) and sum(counts) == VICTIMS
    assert all(n == NOTICE_BATCH for n in counts[:-1])
    assert led.next_deadline() == T0 + GRACE  # nothing left to tell: the first grace's end
    victims = led.state.waiting["w"].victims
    assert len(victims) == VICTIMS and list(victims) == sorted(victims)
    for i, v in enumerate(sorted(victims)[:-1]):  # they leave one by one: the waiter waits for the last
        effects = led.yield_(v, T0 + 1 + i)
        check(led, effects)
        assert kinds(effects, TakenBack) and not kinds(effects, Served)
    effects = led.release(sorted(victims)[-1], T0 + S)[1]
    check(led, effects)
    [served] = kinds(effects, Served)
    assert isinstance(served, Served) and served.allocation.gpus == (0,)


def test_grace_ends_carry_notices_out_a_batch_per_call() -> None:
    led = filled()
    waiting(led)
    tell_all(led)
    now, calls, served = T0 + GRACE, 0, []
    while not served:
        effects = led.advance(now)
        check(led, effects)
        assert len(kinds(effects, TakenBack)) <= NOTICE_BATCH
        served = kinds(effects, Served)
        calls += 1
        assert served or led.next_deadline() == now  # more are due: called again at once
    assert calls == math.ceil(VICTIMS / NOTICE_BATCH)
    assert not any(a.task_id.startswith("v") for a in led.allocations())


def test_giving_up_midway_withdraws_what_was_told_in_batches_and_tells_no_more() -> None:
    led = filled()
    waiting(led)
    told: set[str] = set()
    for _ in range(3):
        told |= {e.allocation.task_id for e in kinds(led.advance(T0), Noticed)}  # type: ignore[attr-defined]
    assert len(told) == 3 * NOTICE_BATCH
    _, effects = led.release("w", T0 + 1)  # the waiter gives up
    check(led, effects)
    withdrawn = {e.allocation.task_id for e in kinds(effects, Withdrawn)}  # type: ignore[attr-defined]
    assert len(withdrawn) == NOTICE_BATCH
    assert led.next_deadline() == T0  # the rest at once (the last advance's time)
    while True:
        effects = led.advance(T0 + 2)
        check(led, effects)
        assert not kinds(effects, Noticed)  # its plan is gone with it
        if not effects:
            break
        withdrawn |= {e.allocation.task_id for e in kinds(effects, Withdrawn)}  # type: ignore[attr-defined]
    assert withdrawn == told and not led.state.notices and not led.state.index.chosen
    rests = {led.state.immune[t] - CONFIG.cooldown_us for t in told}
    assert rests == {T0 + 1, T0 + 2}  # each rests from its withdrawal
    assert led.next_deadline() != T0 + 2  # nothing left to do now


def test_notices_of_a_waiter_that_gave_up_are_neither_carried_out_nor_yielded() -> None:
    led = filled()
    waiting(led)
    led.advance(T0)
    led.advance(T0)
    led.release("w", T0 + 1)  # a batch withdrawn now, the rest still to be
    left = sorted(led.state.index.told["w"])
    assert len(left) == NOTICE_BATCH
    [withdrawn] = led.yield_(left[0], T0 + 2)  # its withdrawal was not told yet: withdrawn, not carried out
    assert isinstance(withdrawn, Withdrawn) and led.get(left[0]) is not None
    effects = led.advance(T0 + GRACE + 10)  # past their grace: withdrawn, never carried out
    assert not kinds(effects, TakenBack) and len(kinds(effects, Withdrawn)) == NOTICE_BATCH - 1
    assert all(led.get(t) is not None for t in left)


def test_a_new_wait_of_the_same_task_chooses_nothing_until_the_old_notices_are_withdrawn() -> None:
    led = filled()
    waiting(led)
    for _ in range(3):
        led.advance(T0)
    led.release("w", T0 + 1)
    waiting(led, T0 + 1)  # the same task id waits again at once
    effects = led.advance(T0 + 2)
    assert not kinds(effects, Noticed) and len(kinds(effects, Withdrawn)) == NOTICE_BATCH
    assert led.state.waiting["w"].victims == () and not led.state.waiting["w"].plan
    effects = led.advance(T0 + 3)  # the old ones withdrawn: it chooses (those not resting after their withdrawal)
    assert not led.state.index.told.get("w") or all(
        led.state.notices[t].issued == T0 + 3 for t in led.state.index.told["w"]
    )
    check(led, effects)


def test_a_rollback_midway_puts_back_exactly_what_was() -> None:
    led = filled()
    waiting(led)
    led.advance(T0)
    before, cp = ledger_state(led), led.checkpoint()
    first = [e.allocation.task_id for e in kinds(led.advance(T0 + 1), Noticed)]  # type: ignore[attr-defined]
    led.rollback(cp)
    assert ledger_state(led) == before and led.checkpoint() == cp
    check_index(led)
    again = [e.allocation.task_id for e in kinds(led.advance(T0 + 1), Noticed)]  # type: ignore[attr-defined]
    assert again == first and len(first) == NOTICE_BATCH


@pytest.mark.parametrize("batches", [1, 4])
def test_a_restart_midway_waits_for_those_told_then_chooses_the_rest(batches: int) -> None:
    led = filled()
    waiting(led)
    for _ in range(batches):
        led.advance(T0)
    told = set(led.state.index.told["w"])
    fresh = node()
    fresh.reachable = set(led.reachable)
    for rec in led.records().values():
        fresh.restore_record(rec, T0 + 5)
    fresh.mark_stored()
    check_index(fresh)
    assert set(fresh.state.index.told["w"]) == told and not fresh.state.index.chosen  # its plan was not durable
    effects = fresh.advance(T0 + 5)
    assert not kinds(effects, Noticed)  # it waits for those it told
    now, served = T0 + GRACE, []
    while not served:  # their grace ends, it chooses the rest, tells them, and so on
        effects = fresh.advance(now)
        check(fresh, effects)
        served = kinds(effects, Served)
        if not effects:
            now += GRACE
    assert not any(a.task_id.startswith("v") for a in fresh.allocations())


def test_a_notice_whose_waiter_is_not_there_after_a_restart_is_withdrawn() -> None:
    led = filled()
    waiting(led)
    led.advance(T0)
    fresh = node()
    fresh.reachable = set(led.reachable)
    for t, rec in led.records().items():
        if t != "w":  # its wait was lost (set aside as unreadable, say)
            fresh.restore_record(rec, T0 + 5)
    effects = fresh.advance(T0 + 5)
    assert len(kinds(effects, Withdrawn)) == NOTICE_BATCH and not fresh.state.notices


def test_a_drain_tells_in_batches_and_putting_it_back_withdraws_in_batches() -> None:
    led = filled()
    assert led.drain(0, True, T0) == []
    counts = tell_all(led)
    assert counts == [NOTICE_BATCH] * (VICTIMS // NOTICE_BATCH) + (
        [VICTIMS % NOTICE_BATCH] if VICTIMS % NOTICE_BATCH else []
    )
    effects = led.drain(0, False, T0 + 1)
    check(led, effects)
    withdrawn = len(kinds(effects, Withdrawn))
    assert withdrawn == NOTICE_BATCH and led.next_deadline() == T0
    while effects:
        effects = led.advance(T0 + 2)
        check(led, effects)
        withdrawn += len(kinds(effects, Withdrawn))
    assert withdrawn == VICTIMS and not led.state.notices and not led.state.undraining


def test_a_drain_put_back_midway_stops_telling() -> None:
    led = filled()
    led.drain(0, True, T0)
    led.advance(T0)
    led.drain(0, False, T0 + 1)
    while led.advance(T0 + 2):
        pass
    assert not led.state.notices


def test_expired_immunities_are_forgotten_in_batches_before_anyone_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notices, "IMMUNITY_BATCH", 300)
    led = filled()
    waiting(led)
    tell_all(led)
    led.release("w", T0 + 1)
    while led.advance(T0 + 1):
        pass
    assert len(led.state.immune) == VICTIMS
    waiting(led, T0 + 2, "w2")
    later = T0 + 2 + CONFIG.cooldown_us
    for left in (700, 400, 100):
        assert led.advance(later) == [] and len(led.state.immune) == left  # no plan while some are left
        assert not led.state.index.chosen and led.next_deadline() == later
    counts = tell_all(led, later)
    assert sum(counts) == VICTIMS and not led.state.immune


def test_planned_victims_are_not_chosen_by_another_waiter() -> None:
    led = filled(gpus=3)  # GPUs 1 and 2: production; GPU 0: the fractions
    led.release("prod2", 0)
    for i in range(VICTIMS):  # GPU 2 as full as GPU 0
        t = f"x{i:04d}"
        led.allocate(Request(t, SHARE, priority=0, prefer=(2,)), 1)
        led.reachable.add(t)
    waiting(led, T0, "w1")
    waiting(led, T0, "w2")
    led.advance(T0)
    plans = {t: set(w.plan) | set(w.victims) for t, w in led.state.waiting.items()}
    assert len(plans["w1"]) == len(plans["w2"]) == VICTIMS and not plans["w1"] & plans["w2"]
    tell_all(led)
    assert {led.state.notices[t].by for t in plans["w1"]} == {"w1"} and {
        led.state.notices[t].by for t in plans["w2"]
    } == {"w2"}


def test_a_store_failure_after_every_batch_changes_nothing() -> None:
    """Each batch rolled back once (a failed store) and then taken: the same as never failing."""
    led, twin = filled(), filled()
    for x in (led, twin):
        waiting(x)
    for _ in range(math.ceil(VICTIMS / NOTICE_BATCH) + 1):
        cp = led.checkpoint()
        led.advance(T0)
        led.rollback(cp)
        a, b = led.advance(T0), twin.advance(T0)
        assert [type(e) for e in a] == [type(e) for e in b]
        assert ledger_state(led) == ledger_state(twin)


def test_the_allocation_types_are_not_tracked_by_the_garbage_collector() -> None:
    import gc

    led = filled()
    waiting(led)
    led.advance(T0)
    alloc = led.get("v0000")
    assert alloc is not None and not gc.is_tracked(alloc)
    told = next(iter(led.state.notices.values()))
    assert not gc.is_tracked(told)
    assert not any(gc.is_tracked(f) for f in led.state.index._facts.values())
    assert not any(gc.is_tracked(r) for r in led.records().values())
    assert replace(CONFIG) == CONFIG  # (configs are dataclasses still)


def test_a_thousand_suspended_victims_wait_without_being_walked_and_resume_a_batch_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    led = node()
    for i in range(VICTIMS):
        t = f"v{i:04d}"
        led.allocate(Request(t, SHARE, priority=0, prefer=(0,), on_preempt=Recovery.SUSPEND), 0)
        led.reachable.add(t)
    led.allocate(Request("prod1", UNIT, priority=100, prefer=(1,)), 0)
    waiting(led)
    tell_all(led)
    placed = 0
    place = placement.place

    def counted(*args: Any, **kw: Any) -> Any:
        nonlocal placed
        placed += 1
        return place(*args, **kw)

    monkeypatch.setattr(placement, "place", counted)
    for i, v in enumerate(sorted(led.state.notices)):  # each yields: suspended, waiting for GPU 0 (kept for "w")
        placed = 0
        effects = led.yield_(v, T0 + 1 + i)
        check(led, effects)
        assert placed <= 1  # the waiter "w" tried; none of the suspended ones, however many wait
    assert led.get("w") is not None and led.get("w").gpus == (0,)  # type: ignore[union-attr]  # served at the last
    assert led.suspended_count() == VICTIMS and led.suspended_of("v0000") is not None
    placed = 0
    led.advance(T0 + S + 1)  # nothing fits them: nothing is tried
    assert placed == 0 and led.next_deadline() is None
    _, effects = led.release("w", T0 + 2 * S)  # GPU 0 free again: they resume, a batch per call
    check(led, effects)
    resumed = [e.allocation.task_id for e in kinds(effects, Served)]  # type: ignore[attr-defined]
    assert len(resumed) == NOTICE_BATCH and led.next_deadline() == T0 + S + 1  # called again at once
    while effects:
        effects = led.advance(T0 + 2 * S)
        check(led, effects)
        assert len(kinds(effects, Served)) <= NOTICE_BATCH
        resumed += [e.allocation.task_id for e in kinds(effects, Served)]  # type: ignore[attr-defined]
    assert resumed == sorted(resumed) and len(resumed) == VICTIMS  # in the queue's order: as they yielded
    assert led.suspended_count() == 0 and not led.state.serving


def test_a_suspended_waiter_is_served_before_a_lower_request_and_after_a_higher() -> None:
    led = node()
    led.allocate(Request("s", UNIT // 2, priority=50, on_preempt=Recovery.SUSPEND, prefer=(0,)), 0)
    led.allocate(Request("f", UNIT // 2, priority=0, prefer=(0,)), 0)
    led.allocate(Request("g", UNIT, priority=100, prefer=(1,)), 0)
    for t in ("s", "f", "g"):
        led.reachable.add(t)
    led.allocate(Request("w", UNIT, priority=90, wait_us=1000 * S), T0)
    led.advance(T0)
    assert set(led.state.notices) == {"s", "f"}
    led.yield_("s", T0 + 1)  # suspended, waiting for half of GPU 0
    _, effects = led.release("f", T0 + 2)
    assert [e.allocation.task_id for e in kinds(effects, Served)] == ["w"]  # type: ignore[attr-defined]
    led.allocate(Request("low", UNIT // 2, priority=10, wait_us=1000 * S), T0 + 4)
    led.allocate(Request("high", UNIT // 2, priority=60, wait_us=1000 * S), T0 + 4)
    _, effects = led.release("w", T0 + 5)
    assert [e.allocation.task_id for e in kinds(effects, Served)] == ["high", "s"]  # type: ignore[attr-defined]
