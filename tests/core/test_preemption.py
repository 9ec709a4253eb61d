"""Taking allocations back (issue 25): choosing victims, grace, recoveries, elastic allocations,
tenant quota reclaim, drained GPUs, restarts and rollbacks.

Every scenario runs on a ``Checked`` ledger, which checks after each call that no device is held by
two allocations at once. Time is fake: integer microseconds, passed in.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from gpud.core import shields
from gpud.core.errors import Refused
from gpud.core.ledger import (
    UNIT,
    Allocation,
    Checkpoint,
    Expired,
    GpuSpec,
    Grown,
    Insufficient,
    Ledger,
    LedgerEffect,
    Notice,
    Noticed,
    PreemptionConfig,
    Request,
    Served,
    TakenBack,
    TaskRecord,
    TenantQuota,
    Withdrawn,
)
from gpud.core.preemption import Candidate, Need, Pool, Room, choose
from gpud_client.protocol import ErrorCode, PreemptReason, PreemptStrategy, Recovery

from .statecheck import state_of

S = 1_000_000
GRACE = 30 * S
MIN_RUN = 300 * S
COOLDOWN = 60 * S
WINDOW = 30 * S
MATURE = MIN_RUN + 10 * S  # by now everything created near 0 has run long enough to be preempted
CONFIG = PreemptionConfig(
    grace_us=GRACE, min_runtime_us=MIN_RUN, cooldown_us=COOLDOWN, elastic_cooldown_us=COOLDOWN, elastic_window_us=WINDOW
)


# --- the ledger, checked after every call -----------------------------------------------------------


def held_once(led: Checked) -> None:
    """No device is held by two allocations: each GPU's shares add up to at most one GPU, each
    allocation is recorded once on each of its GPUs and nowhere else, CPU cores are not shared."""
    allocs = {a.task_id: a for a in led.allocations()}
    found: dict[str, set[int]] = {}
    for g in led.indices:
        tasks, free = led.gpu_tasks(g), led.gpu_free(g)
        assert free >= 0 and all(share > 0 for share in tasks.values()), (g, free, tasks)
        assert free + sum(tasks.values()) == UNIT, f"GPU {g}: {free} free and {tasks}"
        for t, share in tasks.items():
            assert t in allocs and allocs[t].share == share, (g, t, share)
            found.setdefault(t, set()).add(g)
    for t, a in allocs.items():
        assert len(set(a.gpus)) == len(a.gpus) and found.get(t, set()) == set(a.gpus), a
        assert a.share == UNIT or len(a.gpus) <= 1, a
    used = [c for a in allocs.values() for c in a.cpus]
    assert len(used) == len(set(used)) and set(used).isdisjoint(led.cpus_free())
    assert len(used) + len(led.cpus_free()) == led.cpu_count
    assert not {a.task_id for a in led.suspended()} & allocs.keys(), "a suspended allocation holds devices"
    for tenant, quota in led.state.tenants.items():
        assert led.tenant_usage(tenant) <= quota.gpus + quota.borrow, tenant
    for t, n in led.state.notices.items():
        assert t in allocs and set(n.gpus) <= set(allocs[t].gpus), n
        assert n.gpus == allocs[t].gpus if n.whole else n.gpus, n


def told_rightly(led: Checked, e: Noticed, now: int) -> None:
    """A notice goes to an allocation someone can be told about; one for a waiter goes only to an
    allocation it may take back."""
    a, n = e.allocation, e.notice
    assert a.task_id in led.reachable and n.issued == now and n.deadline == now + led.preemption.grace_us, e
    if n.reason == PreemptReason.DRAIN:
        return
    waiter = led.state.waiting[n.by].request
    assert not a.protected and a.priority < 100, e
    if n.reason == PreemptReason.PRIORITY:
        assert a.priority < waiter.priority and a.on_preempt != Recovery.SHRINK, e
        assert a.priority == 0 or a.created_us + led.preemption.min_runtime_us <= now, e
    elif n.reason == PreemptReason.ELASTIC:
        assert not n.whole and n.gpus == a.extras and a.priority <= waiter.priority, e
    else:
        assert n.reason == PreemptReason.QUOTA_RECLAIM and waiter.tenant is not None, e
        assert a.tenant not in (None, waiter.tenant), e


class Checked(Ledger):
    """A ledger that checks ``held_once`` after every call, refused calls included."""

    def __init__(self, gpus: list[GpuSpec], cpus: list[int], **kw: object) -> None:
        super().__init__(gpus, cpus, **kw)  # type: ignore[arg-type]
        self.indices = [g.index for g in gpus]

    def allocate(self, req: Request, now: int) -> Allocation | None:
        try:
            return super().allocate(req, now)
        finally:
            held_once(self)

    def release(self, task_id: str, now: int) -> tuple[Allocation | None, list[LedgerEffect]]:
        try:
            return super().release(task_id, now)
        finally:
            held_once(self)

    def yield_(self, task_id: str, now: int) -> list[LedgerEffect]:
        try:
            return super().yield_(task_id, now)
        finally:
            held_once(self)

    def protect(self, task_id: str, protected: bool) -> Allocation:
        try:
            return super().protect(task_id, protected)
        finally:
            held_once(self)

    def drain(self, gpu: int, on: bool, now: int) -> list[LedgerEffect]:
        try:
            return super().drain(gpu, on, now)
        finally:
            held_once(self)

    def advance(self, now: int) -> list[LedgerEffect]:
        try:
            effects = super().advance(now)
        finally:
            held_once(self)
        for e in effects:
            if isinstance(e, Noticed):
                told_rightly(self, e, now)
            if isinstance(e, Served) and not e.resumed:
                assert not set(e.allocation.gpus) & self.draining(), e
        return effects

    def rollback(self, cp: Checkpoint) -> None:
        super().rollback(cp)
        held_once(self)

    def restore_record(self, rec: TaskRecord, now: int) -> None:
        try:
            super().restore_record(rec, now)
        finally:
            held_once(self)


def node(
    gpus: int = 4, cpus: int = 8, strategy: PreemptStrategy = PreemptStrategy.LOWEST_PRIORITY, **kw: object
) -> Checked:
    specs = [GpuSpec(i, f"GPU-{i}") for i in range(gpus)]
    return Checked(specs, list(range(cpus)), preemption=replace(CONFIG, strategy=strategy), **kw)


def req(task: str, gpus: float, **kw: object) -> Request:
    return Request(task_id=task, gpus=round(gpus * UNIT), **kw)  # type: ignore[arg-type]


def hold(led: Ledger, task: str, gpus: float, now: int = 0, **kw: object) -> Allocation:
    """An allocation someone can be told about (the shell's ``reachable``)."""
    a = led.allocate(req(task, gpus, **kw), now)
    assert a is not None, task
    led.reachable.add(task)
    return a


def wait(led: Ledger, task: str, gpus: float, now: int, wait_s: float = 3600, **kw: object) -> None:
    assert led.allocate(req(task, gpus, wait_us=round(wait_s * S), **kw), now) is None


def noticed(effects: Sequence[LedgerEffect]) -> dict[str, Notice]:
    return {e.allocation.task_id: e.notice for e in effects if isinstance(e, Noticed)}


def served(effects: Sequence[LedgerEffect]) -> list[str]:
    return [e.allocation.task_id for e in effects if isinstance(e, Served)]


def kinds(effects: Sequence[LedgerEffect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def shares(led: Checked) -> dict[int, dict[str, int]]:
    return {g: led.gpu_tasks(g) for g in led.indices}


# --- choosing victims: the strategies ------------------------------------------------------------------

# task -> (its GPUs, how much, priority, created): placed with ``prefer``, so the layout is exactly this
Layout = dict[str, tuple[tuple[int, ...], float, int, int]]

FRACTION: Layout = {
    "h0": ((0,), 0.5, 90, 0),
    "p": ((0,), 0.25, 20, 1),
    "q": ((0,), 0.25, 20, 2),
    "h1": ((1,), 0.25, 90, 0),
    "s": ((1,), 0.75, 30, 3),
    "z": ((2,), 1, 5, 0),
    "n": ((3,), 1, 40, 4),
}
WHOLE: Layout = {
    "b": ((0,), 0.5, 20, 1),
    "c": ((0,), 0.5, 20, 2),
    "x": ((1, 2), 2, 30, 3),
    "h3": ((3,), 0.5, 90, 0),
    "z": ((3,), 0.5, 5, 4),  # spot, but freeing it frees no whole GPU: never a victim
}


def laid_out(layout: Layout, strategy: PreemptStrategy, cpus: int = 8) -> Checked:
    led = node(gpus=4, cpus=cpus, strategy=strategy)
    for task, (gpus, amount, priority, created) in layout.items():
        a = hold(led, task, amount, created, prefer=gpus, priority=priority)
        assert a.gpus == gpus, a
    return led


@pytest.mark.parametrize(
    ("strategy", "victims"),
    [
        (PreemptStrategy.LOWEST_PRIORITY, {"z"}),  # priority 5 first
        (PreemptStrategy.NEWEST_FIRST, {"n"}),  # created last
        (PreemptStrategy.MINIMUM_VICTIMS, {"s"}),  # one victim, and the least freed of those
        (PreemptStrategy.MINIMUM_WASTE, {"p", "q"}),  # exactly the half asked for
    ],
)
def test_each_strategy_for_a_fraction_of_one_gpu(strategy: PreemptStrategy, victims: set[str]) -> None:
    led = laid_out(FRACTION, strategy)
    before = shares(led)
    wait(led, "w", 0.5, MATURE, priority=50)
    effects = led.advance(MATURE)
    got = noticed(effects)
    assert set(got) == victims and kinds(effects) == ["Noticed"] * len(victims)
    for n in got.values():
        assert (n.reason, n.whole, n.by) == (PreemptReason.PRIORITY, True, "w")
        assert (n.issued, n.deadline) == (MATURE, MATURE + GRACE)
    assert shares(led) == before  # told, not taken: the devices stay theirs through the grace
    assert led.get("w") is None and [r.task_id for r in led.waiting()] == ["w"]


@pytest.mark.parametrize(
    ("strategy", "victims"),
    [
        (PreemptStrategy.LOWEST_PRIORITY, {"b", "c"}),
        (PreemptStrategy.NEWEST_FIRST, {"x"}),
        (PreemptStrategy.MINIMUM_VICTIMS, {"x"}),  # one allocation, though it frees two GPUs
        (PreemptStrategy.MINIMUM_WASTE, {"b", "c"}),  # exactly one GPU
    ],
)
def test_each_strategy_for_a_whole_gpu(strategy: PreemptStrategy, victims: set[str]) -> None:
    led = laid_out(WHOLE, strategy)
    wait(led, "w", 1, MATURE, priority=50)
    assert set(noticed(led.advance(MATURE))) == victims


@pytest.mark.parametrize(
    ("strategy", "victims"),
    [
        (PreemptStrategy.LOWEST_PRIORITY, {"a"}),
        (PreemptStrategy.NEWEST_FIRST, {"b", "c"}),
        (PreemptStrategy.MINIMUM_VICTIMS, {"a"}),
        (PreemptStrategy.MINIMUM_WASTE, {"a"}),
    ],
)
def test_each_strategy_for_cpu_cores(strategy: PreemptStrategy, victims: set[str]) -> None:
    led = node(gpus=1, cpus=4, strategy=strategy)
    hold(led, "a", 0, 0, cpus=2, priority=10)
    hold(led, "b", 0, 1, cpus=1, priority=5)
    hold(led, "c", 0, 2, cpus=1, priority=30)
    wait(led, "w", 0, MATURE, cpus=2, priority=50)
    assert set(noticed(led.advance(MATURE))) == victims
    effects = led.yield_(sorted(victims)[0], MATURE + 1)
    effects += led.advance(MATURE + GRACE)  # the rest overrun their grace
    assert served(effects) == ["w"] and len(led.get("w").cpus) == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("strategy", list(PreemptStrategy))
def test_a_gang_gets_all_its_gpus_or_takes_no_one(strategy: PreemptStrategy) -> None:
    led = node(gpus=3, strategy=strategy)
    hold(led, "prod", 1, 0, priority=100)
    hold(led, "spot", 1, 0, priority=0)
    hold(led, "low", 1, 0, priority=10)
    wait(led, "gang3", 3, MATURE, priority=50)  # the production GPU cannot be had: no one is told
    assert led.advance(MATURE) == [] and led.state.notices == {}
    led.release("gang3", MATURE + 1)
    wait(led, "gang2", 2, MATURE + 2, priority=50)
    assert set(noticed(led.advance(MATURE + 2))) == {"spot", "low"}
    effects = led.yield_("spot", MATURE + 3)
    assert kinds(effects) == ["TakenBack"]  # one GPU is free, and half a gang is none
    assert led.get("gang2") is None and led.gpu_free(1) == UNIT
    effects = led.yield_("low", MATURE + 4)
    assert kinds(effects) == ["TakenBack", "Served"]
    assert led.get("gang2").gpus == (1, 2)  # type: ignore[union-attr]


@pytest.mark.parametrize("strategy", list(PreemptStrategy))
def test_never_more_victims_than_needed(strategy: PreemptStrategy) -> None:
    """A fraction of a GPU and two CPU cores: each victim chosen gives back something needed."""
    led = node(gpus=2, cpus=4, strategy=strategy)
    hold(led, "g0", 1, 0, prefer=(0,), priority=10)
    hold(led, "g1", 1, 1, prefer=(1,), priority=10)
    hold(led, "cores", 0, 2, cpus=3, priority=10)
    hold(led, "core", 0, 3, cpus=1, priority=10)
    wait(led, "w", 0.5, MATURE, cpus=1, priority=50)
    victims = noticed(led.advance(MATURE))
    assert len(victims) == 2 and len(victims.keys() & {"g0", "g1"}) == 1 and victims.keys() & {"cores", "core"}


def test_choose_drops_victims_the_request_fits_without() -> None:
    """Lowest priority first takes x, y and z; x is not needed once y and z are chosen."""

    def c(task: str, gpu: int, priority: int) -> Candidate:
        return Candidate(task, (gpu,), UNIT // 2, 0, priority, 0, True, PreemptReason.PRIORITY)

    pool = [c("x", 0, 1), c("y", 1, 2), c("z", 1, 3), c("v", 0, 4)]
    room = Room({0: 0, 1: 0}, 0)
    chosen = choose(Need(UNIT, 0), room, [Pool(pool, PreemptStrategy.LOWEST_PRIORITY)], lambda _: True)
    assert [v.task_id for v in chosen] == ["y", "z"]
    assert choose(Need(2 * UNIT, 0), room, [Pool(pool[:3], PreemptStrategy.LOWEST_PRIORITY)], lambda _: True) == []
    assert choose(Need(UNIT, 0), room, [Pool(pool, PreemptStrategy.NEWEST_FIRST)], lambda _: False) == []
    assert choose(Need(UNIT, 0), Room({0: UNIT}, 0), [Pool(pool, PreemptStrategy.MINIMUM_WASTE)], lambda _: True) == []


def test_choose_takes_the_pools_in_order() -> None:
    extra = Candidate("elastic", (0,), UNIT, 0, 50, 0, False, PreemptReason.ELASTIC)
    spot = Candidate("spot", (1,), UNIT, 0, 0, 0, True, PreemptReason.PRIORITY)
    pools = [Pool([extra], PreemptStrategy.LOWEST_PRIORITY), Pool([spot], PreemptStrategy.LOWEST_PRIORITY)]
    assert choose(Need(UNIT, 0), Room({0: 0, 1: 0}, 0), pools, lambda _: True) == [extra]
    assert choose(Need(2 * UNIT, 0), Room({0: 0, 1: 0}, 0), pools, lambda _: True) == [extra, spot]


def test_no_victims_when_no_set_makes_the_request_fit() -> None:
    led = node(gpus=2)
    hold(led, "prod", 1, 0, priority=100)
    hold(led, "spot", 0.5, 0, priority=0)
    wait(led, "w", 1, 1, wait_s=10, priority=50, cpus=8)  # a GPU could be had, the 8 cores not
    hold(led, "core", 0, 0, cpus=1, priority=100)
    assert led.advance(2) == [] and led.notice_of("spot") is None
    [expired] = led.advance(1 + 10 * S)
    assert isinstance(expired, Expired) and expired.task_id == "w"


# --- who may be preempted ----------------------------------------------------------------------


def test_minimum_runtime_then_preempted_at_maturity() -> None:
    led = node(gpus=1)
    hold(led, "a", 1, 0, priority=10)
    wait(led, "w", 1, 10 * S, priority=50)
    assert led.advance(10 * S) == []
    assert led.next_deadline() == MIN_RUN  # the timer wakes when "a" may be taken back
    assert led.advance(MIN_RUN - 1) == []
    [e] = led.advance(MIN_RUN)
    assert isinstance(e, Noticed) and e.allocation.task_id == "a" and e.notice.deadline == MIN_RUN + GRACE
    assert led.next_deadline() == MIN_RUN + GRACE


def test_spot_at_any_time() -> None:
    led = node(gpus=1)
    hold(led, "spot", 1, 0, priority=0)
    wait(led, "w", 1, 1, priority=1)
    assert set(noticed(led.advance(1))) == {"spot"}


@pytest.mark.parametrize(
    ("terms", "why"),
    [
        ({"priority": 100}, "production priority"),
        ({"priority": 0, "protected": True}, "protected by an admin"),
    ],
)
def test_production_and_protected_never(terms: dict[str, object], why: str) -> None:
    led = node(gpus=1)
    a = hold(led, "a", 1, 0, **terms)
    assert (led.shield(a, 0) or shields.Shield("")).why == why
    wait(led, "w", 1, MATURE, priority=100)
    assert led.advance(MATURE) == [] and led.advance(10 * MATURE) == []


def test_protect_and_unprotect() -> None:
    led = node(gpus=1)
    hold(led, "a", 1, 0, priority=0)
    assert led.protect("a", True).protected
    wait(led, "w", 1, 1, priority=50)
    assert led.advance(1) == []
    assert led.shield(led.protect("a", False), 2) is None
    assert set(noticed(led.advance(2))) == {"a"}
    with pytest.raises(Refused) as err:
        led.protect("nobody", True)
    assert err.value.code == ErrorCode.UNKNOWN_TASK


def test_no_one_to_tell_never() -> None:
    led = node(gpus=1)
    a = led.allocate(req("oneshot", 1, priority=0), 0)
    assert a is not None and "no one to tell" in (led.shield(a, 0) or shields.Shield("")).why
    wait(led, "w", 1, 1, priority=50)
    assert led.advance(1) == []
    led.reachable.add("oneshot")  # a client holds it now
    assert set(noticed(led.advance(2))) == {"oneshot"}


@pytest.mark.parametrize("holder", [50, 60])
def test_strictly_lower_priority_only(holder: int) -> None:
    led = node(gpus=1)
    hold(led, "a", 1, 0, priority=holder)
    wait(led, "w", 1, MATURE, priority=50)
    assert led.advance(MATURE) == []


def test_next_deadline_is_never_in_the_past_while_a_waiter_cannot_preempt() -> None:
    """A waiter behind an allocation it may not take (equal priority): the timer must not spin."""
    led = node(gpus=1)
    hold(led, "a", 1, 0, priority=50)
    wait(led, "w", 1, MATURE, priority=50)
    assert led.advance(MATURE) == []
    deadline = led.next_deadline()
    assert deadline is not None and deadline > MATURE  # the waiter's own deadline, not "a"'s maturity
    assert deadline == MATURE + 3600 * S


# --- grace --------------------------------------------------------------------------------------


def preempting(recovery: Recovery = Recovery.TERMINATE, wait_s: float = 3600) -> Checked:
    """One GPU held by spot "v" (with ``recovery``), "w" waits for it; "v" is told at 10 s."""
    led = node(gpus=1, cpus=2)
    hold(led, "v", 1, 0, priority=0, cpus=1, on_preempt=recovery)
    wait(led, "w", 1, 10 * S, wait_s=wait_s, priority=50)
    assert set(noticed(led.advance(10 * S))) == {"v"}
    return led


def test_the_devices_stay_the_victims_until_it_yields() -> None:
    led = preempting()
    assert led.advance(10 * S + GRACE - 1) == []
    assert led.gpu_tasks(0) == {"v": UNIT}
    effects = led.yield_("v", 20 * S)
    [taken, got] = effects
    assert isinstance(taken, TakenBack) and taken.after is None and not taken.suspended and not taken.overran
    assert isinstance(got, Served) and got.allocation.task_id == "w" and not got.resumed
    assert led.get("v") is None and led.history_of("v") == (1, False)
    assert led.next_deadline() is None


def test_a_free_under_notice_is_the_preemption_done() -> None:
    led = preempting()
    alloc, effects = led.release("v", 20 * S)
    assert alloc is not None and served(effects) == ["w"] and led.history_of("v") == (1, False)


def test_the_grace_end_takes_the_devices_back() -> None:
    led = preempting()
    [taken, got] = led.advance(10 * S + GRACE)
    assert isinstance(taken, TakenBack) and taken.overran and taken.after is None
    assert isinstance(got, Served) and got.allocation.task_id == "w"


def test_yield_without_a_notice_is_refused_and_changes_nothing() -> None:
    led = node(gpus=1)
    hold(led, "a", 1, 0)
    before = state_of(led)
    with pytest.raises(Refused, match="'a' was not asked to leave"):
        led.yield_("a", 1)
    with pytest.raises(Refused, match="'b' has no allocation"):
        led.yield_("b", 1)
    assert state_of(led) == before


def test_a_waiter_that_gives_up_withdraws_its_notices_and_the_victim_rests() -> None:
    led = preempting()
    alloc, effects = led.release("w", 11 * S)
    assert alloc is None and kinds(effects) == ["Withdrawn"]
    [withdrawn] = effects
    assert isinstance(withdrawn, Withdrawn) and withdrawn.allocation.task_id == "v" and withdrawn.notice.by == "w"
    assert led.notice_of("v") is None and led.gpu_tasks(0) == {"v": UNIT}
    wait(led, "w2", 1, 12 * S, priority=50)
    assert led.advance(12 * S) == []  # no thrash: "v" is not chosen again for the cooldown
    assert led.next_deadline() == 11 * S + COOLDOWN
    assert led.advance(11 * S + COOLDOWN - 1) == []
    assert set(noticed(led.advance(11 * S + COOLDOWN))) == {"v"}


def test_a_wait_shorter_than_the_grace_lasts_until_the_grace_ends() -> None:
    led = preempting(wait_s=1)
    assert led.advance(11 * S) == [] and [r.task_id for r in led.waiting()] == ["w"]
    assert led.next_deadline() == 10 * S + GRACE
    assert served(led.advance(10 * S + GRACE)) == ["w"]


def test_a_waiter_whose_victims_left_and_still_does_not_fit_expires() -> None:
    led = node(gpus=2)
    hold(led, "v", 1, 0, priority=0)
    hold(led, "other", 1, 0, priority=0)
    wait(led, "w", 2, 1, wait_s=1, priority=50)
    assert set(noticed(led.advance(1))) == {"v", "other"}
    led.protect("other", True)  # its notice stands
    led.yield_("v", 2)
    hold(led, "sneak", 1, 3, priority=100)  # takes the GPU "v" gave back
    assert kinds(led.advance(1 + GRACE)) == ["TakenBack"]  # then it is served, or it expires
    assert kinds(led.advance(2 + GRACE)) == ["Expired"]
    assert led.waiting() == [] and led.gpu_free(1) == UNIT


# --- recoveries -----------------------------------------------------------------------------------


def test_suspend_waits_pinned_and_resumes_as_the_same_allocation() -> None:
    led = node(gpus=2, cpus=4)
    hold(led, "other", 1, 0, prefer=(1,), priority=0)
    led.protect("other", True)
    before = hold(led, "v", 1, 5, prefer=(0,), priority=0, cpus=2, on_preempt=Recovery.SUSPEND)
    wait(led, "w", 1, 10 * S, priority=50)
    assert set(noticed(led.advance(10 * S))) == {"v"}
    [taken, got] = led.yield_("v", 11 * S)
    assert isinstance(taken, TakenBack) and taken.suspended and taken.after is None
    assert served([got]) == ["w"]
    [s] = led.suspended()
    assert s.task_id == "v" and s.preemptions == 1 and led.get("v") is None
    assert [r.task_id for r in led.waiting()] == []  # not a plain waiter
    assert led.allocate(req("v", 1, priority=0, cpus=2, on_preempt=Recovery.SUSPEND), 12 * S) is None  # still waits
    led.protect("other", False)
    led.release("other", 13 * S)  # GPU 1 is free, but "v" waits for its own GPU
    assert led.suspended() == [s] and led.advance(14 * S) == []
    _, effects = led.release("w", 15 * S)
    [resumed] = effects
    assert isinstance(resumed, Served) and resumed.resumed
    after = resumed.allocation
    assert (after.gpus, after.created_us, after.preemptions, len(after.cpus)) == (before.gpus, 5, 1, 2)
    assert led.suspended() == [] and led.get("v") == after


def test_suspend_not_yielded_by_the_grace_end_is_gone() -> None:
    led = preempting(Recovery.SUSPEND)
    [taken, got] = led.advance(10 * S + GRACE)
    assert isinstance(taken, TakenBack) and taken.overran and not taken.suspended and taken.after is None
    assert served([got]) == ["w"] and led.suspended() == [] and led.history_of("v") == (1, True)


def test_a_suspended_allocation_freed_is_gone() -> None:
    led = preempting(Recovery.SUSPEND)
    led.yield_("v", 11 * S)
    assert [a.task_id for a in led.suspended()] == ["v"]
    assert led.release("v", 12 * S) == (None, [])
    assert led.suspended() == [] and led.history_of("v") == (0, False)
    led.release("w", 13 * S)
    assert led.get("v") is None


def test_checkpoint_the_next_allocation_resumes() -> None:
    led = preempting(Recovery.CHECKPOINT)
    led.yield_("v", 11 * S)
    assert led.history_of("v") == (1, True)
    wait(led, "v", 1, 12 * S, priority=0, cpus=1, on_preempt=Recovery.CHECKPOINT)
    _, effects = led.release("w", 13 * S)
    [got] = effects
    assert isinstance(got, Served) and got.allocation.resume and got.allocation.preemptions == 1
    led.reachable.add("v")
    wait(led, "w", 1, 14 * S, priority=50)
    led.advance(14 * S)  # preempted again: counted
    led.advance(14 * S + GRACE)
    assert led.history_of("v") == (2, True)
    led.release("w", 15 * S + GRACE)
    again = led.allocate(req("v", 1, priority=0, cpus=1, on_preempt=Recovery.CHECKPOINT), 16 * S + GRACE)
    assert again is not None and again.preemptions == 2 and again.resume
    led.release("v", 17 * S + GRACE)  # a normal free: the history is done with
    fresh = led.allocate(req("v", 1, priority=0, cpus=1, on_preempt=Recovery.CHECKPOINT), 18 * S + GRACE)
    assert fresh is not None and (fresh.preemptions, fresh.resume) == (0, False)


def test_terminate_the_allocation_is_gone_and_its_next_start_is_fresh() -> None:
    led = preempting(Recovery.TERMINATE)
    led.yield_("v", 11 * S)
    assert led.history_of("v") == (1, False)
    led.release("w", 12 * S)
    a = led.allocate(req("v", 1, priority=0, cpus=1), 13 * S)
    assert a is not None and (a.preemptions, a.resume) == (1, False)


def elastic_node() -> Checked:
    """Four GPUs: "e" (1..3, shrink, priority 10) got three; "x" holds the fourth."""
    led = node(gpus=4)
    hold(led, "x", 1, 0, priority=90)
    e = hold(led, "e", 1, 0, gpus_max=3, on_preempt=Recovery.SHRINK, priority=10)
    assert e.gpus == (1, 2, 3) and e.gpus_min == 1 and e.extras == (2, 3)
    return led


def test_shrink_takes_only_the_extras_never_the_whole() -> None:
    led = elastic_node()
    wait(led, "w", 2, MATURE, priority=50)
    [e] = led.advance(MATURE)
    assert isinstance(e, Noticed) and e.notice.gpus == (2, 3) and not e.notice.whole
    assert e.notice.reason == PreemptReason.ELASTIC
    [taken, got] = led.yield_("e", MATURE + 1)
    assert isinstance(taken, TakenBack) and taken.after is not None and taken.after.gpus == (1,)
    assert served([got]) == ["w"] and led.get("w").gpus == (2, 3)  # type: ignore[union-attr]
    assert led.history_of("e") == (0, False)  # giving back a loan is no preemption
    wait(led, "w2", 1, MATURE + 2, priority=50)
    shrunk = led.get("e")
    assert shrunk is not None and led.shield(shrunk, 0) == shields.AT_MINIMUM
    assert led.advance(MATURE + 2) == [] and led.advance(10 * MATURE) == []


# --- elastic allocations -------------------------------------------------------------------------


def test_elastic_gets_what_is_free_up_to_its_maximum_when_no_one_waits() -> None:
    led = node(gpus=4)
    hold(led, "x", 1, 0)
    e = hold(led, "e", 1, 1, gpus_max=4, priority=50)
    assert e.gpus == (1, 2, 3) and e.gpus_min == 1 and e.gpus_max == 4


@pytest.mark.parametrize(("waiter", "got"), [(50, 1), (90, 1), (10, 2)])
def test_elastic_gets_its_minimum_while_someone_as_important_waits(waiter: int, got: int) -> None:
    led = node(gpus=4)
    hold(led, "x", 2, 0, priority=100)
    wait(led, "w", 3, 1, priority=waiter)
    e = hold(led, "e", 1, 2, gpus_max=4, priority=50)
    assert len(e.gpus) == got


def test_elastic_grows_after_the_window_and_at_most_once_per_cooldown() -> None:
    led = node(gpus=3)
    hold(led, "x", 1, 0, prefer=(1,), priority=90)
    hold(led, "y", 1, 0, prefer=(2,), priority=90)
    e = hold(led, "e", 1, 0, gpus_max=3, priority=50)
    assert e.gpus == (0,)
    led.release("x", 1 * S)
    assert led.advance(1 * S) == []
    # the window started at 1 s, but "e" changed (was made) at 0: it may grow at its cooldown's end
    assert led.next_deadline() == COOLDOWN
    assert led.advance(COOLDOWN - 1) == []
    [grown] = led.advance(COOLDOWN)
    assert isinstance(grown, Grown) and grown.allocation.gpus == (0, 1) and grown.allocation.changed_us == COOLDOWN
    assert led.allocate(req("e", 1, gpus_max=3, priority=50), COOLDOWN + 1) == grown.allocation  # same terms
    with pytest.raises(Refused, match="already holds 1 GPU"):
        led.allocate(req("e", 2, gpus_max=3, priority=50), COOLDOWN + 1)
    # a waiter of equal priority takes the extra back; then it goes again
    wait(led, "w", 1, COOLDOWN + 2, priority=50)
    [n] = led.advance(COOLDOWN + 2)
    assert isinstance(n, Noticed) and n.notice.gpus == (1,) and not n.notice.whole
    assert served(led.yield_("e", COOLDOWN + 3)) == ["w"]
    led.release("w", COOLDOWN + 4)
    led.release("y", COOLDOWN + 4)
    assert led.advance(COOLDOWN + 4) == []
    assert led.next_deadline() == COOLDOWN + 3 + COOLDOWN  # not before its cooldown from the shrink
    assert led.advance(COOLDOWN + 4 + WINDOW) == []
    # a waiter that comes and goes restarts the window
    wait(led, "w2", 3, 2 * COOLDOWN, priority=50)
    assert led.advance(2 * COOLDOWN) == []
    led.release("w2", 2 * COOLDOWN + 1)
    assert led.advance(2 * COOLDOWN + 3) == []
    assert led.next_deadline() == 2 * COOLDOWN + 3 + WINDOW
    [grown] = led.advance(2 * COOLDOWN + 3 + WINDOW)
    assert isinstance(grown, Grown) and grown.allocation.gpus == (0, 1, 2)


def test_elastic_growth_waits_while_someone_as_important_waits() -> None:
    led = node(gpus=3)
    hold(led, "x", 2, 0, priority=90)
    hold(led, "e", 1, 0, gpus_max=3, priority=50)
    wait(led, "w", 3, 1, priority=50)
    led.release("x", 2)  # "w" still does not fit: "e" holds one of three
    for t in (2, 2 * COOLDOWN, 3 * COOLDOWN):
        assert not [e for e in led.advance(t) if isinstance(e, Grown)]


def test_extras_are_taken_before_anyone_is_preempted_whole() -> None:
    led = node(gpus=3)
    hold(led, "spot", 1, 0, priority=0)
    e = hold(led, "e", 1, 0, gpus_max=2, priority=10)
    assert e.gpus == (1, 2)
    wait(led, "w", 1, MATURE, priority=50)
    [n] = led.advance(MATURE)
    assert isinstance(n, Noticed) and n.allocation.task_id == "e" and n.notice.gpus == (2,)
    assert not n.notice.whole and n.notice.reason == PreemptReason.ELASTIC
    [taken, got] = led.advance(MATURE + GRACE)
    assert isinstance(taken, TakenBack) and taken.after is not None and taken.after.gpus == (1,) and taken.overran
    assert served([got]) == ["w"] and led.get("spot") is not None


def test_an_elastic_allocation_preempted_whole_when_its_extras_are_not_enough() -> None:
    led = node(gpus=2)
    hold(led, "e", 1, 0, gpus_max=2, priority=10)
    wait(led, "w", 2, MATURE, priority=50)
    [n] = led.advance(MATURE)
    assert isinstance(n, Noticed) and n.notice.whole and n.notice.gpus == (0, 1)
    assert n.notice.reason == PreemptReason.PRIORITY


# --- tenant quota reclaim ------------------------------------------------------------------------


def tenants() -> Checked:
    """Tenant a lends its idle quota; b borrowed two GPUs of it (b3, and b4 the newest)."""
    quotas = {"a": TenantQuota(2 * UNIT), "b": TenantQuota(2 * UNIT, borrow=2 * UNIT)}
    led = node(gpus=4, tenants=quotas)
    for i in range(1, 5):
        hold(led, f"b{i}", 1, i, tenant="b", priority=90)
    return led


def test_the_lender_asking_within_its_quota_takes_back_the_newest_borrowed() -> None:
    led = tenants()
    wait(led, "a1", 1, 10, tenant="a", priority=10)  # lower priority, and "b4" has run for no time
    [n] = led.advance(10)
    assert isinstance(n, Noticed) and n.allocation.task_id == "b4"
    assert n.notice.reason == PreemptReason.QUOTA_RECLAIM and n.notice.whole and n.notice.by == "a1"
    assert served(led.yield_("b4", 11)) == ["a1"]


def test_quota_reclaim_never_takes_production_or_protected() -> None:
    quotas = {"a": TenantQuota(2 * UNIT), "b": TenantQuota(2 * UNIT, borrow=2 * UNIT)}
    led = node(gpus=4, tenants=quotas)
    hold(led, "b1", 1, 1, tenant="b", priority=10)
    hold(led, "b2", 1, 2, tenant="b", priority=10)
    hold(led, "b3", 1, 3, tenant="b", priority=10, protected=True)  # borrowed
    hold(led, "b4", 1, 4, tenant="b", priority=100)  # borrowed, the newest
    wait(led, "a1", 1, 10, tenant="a", priority=50)  # b1 and b2 are within b's quota (and too young)
    assert led.advance(10) == []
    led.protect("b3", False)
    [n] = led.advance(11)
    assert isinstance(n, Noticed) and n.allocation.task_id == "b3" and n.notice.reason == PreemptReason.QUOTA_RECLAIM


def test_no_reclaim_beyond_the_lenders_own_quota() -> None:
    quotas = {"a": TenantQuota(UNIT, borrow=UNIT), "b": TenantQuota(3 * UNIT, borrow=UNIT)}
    led = node(gpus=4, tenants=quotas)
    hold(led, "a1", 1, 0, tenant="a", priority=10)
    for i in range(1, 4):
        hold(led, f"b{i}", 1, i, tenant="b", priority=90)
    wait(led, "a2", 1, 10, tenant="a", priority=10)  # over its own quota: it may only borrow
    assert led.advance(MATURE) == []


# --- drained GPUs --------------------------------------------------------------------------------


def test_a_drained_gpu_empties_and_takes_no_new_grants() -> None:
    led = node(gpus=2)
    hold(led, "prod", 0.5, 0, prefer=(0,), priority=100)
    hold(led, "spot", 0.25, 0, prefer=(0,), priority=0)
    led.allocate(req("oneshot", 0.25, prefer=(0,)), 0)  # no one to tell: left alone
    assert led.drain(0, True, 1) == []
    effects = led.advance(1)
    got = noticed(effects)
    assert set(got) == {"prod", "spot"}
    assert all(n.reason == PreemptReason.DRAIN and n.by == "drain" and n.whole for n in got.values())
    assert led.draining() == frozenset({0})
    a = led.allocate(req("new", 0.25), 2)
    assert a is not None and a.gpus == (1,)
    led.yield_("spot", 3)
    assert led.gpu_tasks(0) == {"prod": UNIT // 2, "oneshot": UNIT // 4}
    with pytest.raises(Insufficient):
        led.allocate(req("new2", 1), 4)  # GPU 0 is not in service
    led.advance(1 + GRACE)
    assert led.gpu_tasks(0) == {"oneshot": UNIT // 4} and led.notice_of("prod") is None


def test_undrain_withdraws_the_drains_notices_and_serves() -> None:
    led = node(gpus=2)
    hold(led, "a", 0.5, 0, prefer=(0,))
    led.allocate(req("x", 1, prefer=(1,)), 0)
    led.drain(0, True, 1)
    wait(led, "w", 0.5, 1)  # GPU 0 has room, but takes no new grants
    assert set(noticed(led.advance(1))) == {"a"}
    effects = led.drain(0, False, 2)
    assert kinds(effects) == ["Withdrawn", "Served"] and served(effects) == ["w"]
    assert led.notice_of("a") is None and led.draining() == frozenset()
    with pytest.raises(Refused) as err:
        led.drain(7, True, 3)
    assert err.value.code == ErrorCode.UNKNOWN_GPU


def test_a_drained_gpu_takes_an_elastic_allocations_extra_only() -> None:
    led = node(gpus=2)
    e = hold(led, "e", 1, 0, gpus_max=2, priority=10)
    assert e.gpus == (0, 1)
    led.drain(1, True, 1)
    [n] = led.advance(1)
    assert isinstance(n, Noticed) and n.notice.gpus == (1,) and not n.notice.whole
    [taken] = led.yield_("e", 2)
    assert isinstance(taken, TakenBack) and taken.after is not None and taken.after.gpus == (0,)
    assert not [e for e in led.advance(2 * COOLDOWN + WINDOW) if isinstance(e, Grown)]  # not onto a drained GPU


# --- a restart in the middle ------------------------------------------------------------------------


def mid_preemption() -> Checked:
    """After a while: "w" waits for "v" (terminate) and "s" (suspend), told 10 s ago; "sus" is
    suspended, waiting for GPU 2; "ck" was preempted with checkpoint and has no allocation."""
    led = node(gpus=4, cpus=8)
    hold(led, "f0", 1, 0, prefer=(0,), priority=100)
    hold(led, "f1", 1, 0, prefer=(1,), priority=100)
    hold(led, "ck", 1, 0, prefer=(3,), priority=0, on_preempt=Recovery.CHECKPOINT)
    hold(led, "sus", 1, 0, prefer=(2,), priority=0, on_preempt=Recovery.SUSPEND)
    wait(led, "p", 2, 1, priority=60)  # takes "ck" and "sus"
    assert set(noticed(led.advance(1))) == {"ck", "sus"}
    led.yield_("ck", 2)
    led.yield_("sus", 3)
    assert led.get("p") is not None and [a.task_id for a in led.suspended()] == ["sus"]
    led.release("f0", 4)
    led.release("f1", 4)
    hold(led, "v", 1, 4, prefer=(0,), priority=10, cpus=2)
    hold(led, "s", 1, 5, prefer=(1,), priority=10, on_preempt=Recovery.SUSPEND)
    wait(led, "w", 2, 10 * S + MIN_RUN, wait_s=1, priority=50, cpus=1)
    assert set(noticed(led.advance(10 * S + MIN_RUN))) == {"v", "s"}
    assert led.advance(20 * S + MIN_RUN) == []
    return led


@pytest.mark.parametrize("order", ["as stored", "reversed"])
def test_a_restart_in_the_middle_goes_on(order: str) -> None:
    led = mid_preemption()
    now = 20 * S + MIN_RUN
    records = list(led.records().values())
    assert {r.task_id for r in records} == {"ck", "sus", "p", "v", "s", "w"}
    fresh = node(gpus=4, cpus=8)
    fresh.reachable |= {"v", "s", "p"}
    for rec in records if order == "as stored" else reversed(records):
        fresh.restore_record(rec, now)
    assert fresh.records() == led.records()
    assert fresh.notice_of("v") == led.notice_of("v") and fresh.notice_of("s") == led.notice_of("s")
    assert fresh.next_deadline() == led.next_deadline() == 10 * S + MIN_RUN + GRACE
    assert [r.task_id for r in fresh.waiting()] == ["w"] and fresh.waiter_info(now)[0][2].startswith("waits for s, v")
    assert fresh.suspended() == led.suspended() and fresh.history_of("ck") == (1, True)
    assert fresh.advance(now + 1) == []
    effects = fresh.advance(10 * S + MIN_RUN + GRACE)
    assert kinds(effects) == ["TakenBack", "TakenBack", "Served"] and served(effects) == ["w"]
    assert {e.before.task_id for e in effects if isinstance(e, TakenBack)} == {"v", "s"}
    assert fresh.history_of("s") == (1, True)  # the grace ended: not yielded, so gone, not suspended
    _, effects = fresh.release("p", 10 * S + MIN_RUN + GRACE + 1)
    [resumed] = effects
    assert isinstance(resumed, Served) and resumed.resumed and resumed.allocation.task_id == "sus"
    assert resumed.allocation.gpus == (2,) and resumed.allocation.preemptions == 1
    c = fresh.allocate(req("ck", 1, priority=0, on_preempt=Recovery.CHECKPOINT), 10 * S + MIN_RUN + GRACE + 2)
    assert c is not None and c.resume and c.preemptions == 1


def test_a_restored_plain_wait_is_not_kept() -> None:
    """A wait with no victims dies with its connection: nothing to store."""
    led = node(gpus=1)
    hold(led, "a", 1, 0, priority=50)
    wait(led, "w", 1, 1)
    assert set(led.records()) == {"a"}


def test_a_restored_record_that_does_not_fit_is_refused() -> None:
    led = mid_preemption()
    fresh = node(gpus=4, cpus=8)
    hold(fresh, "squatter", 1, 0, prefer=(0,))
    with pytest.raises(ValueError, match="does not fit GPU 0"):
        fresh.restore_record(led.records()["v"], 1)


# --- checkpoint and rollback ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    ["yield", "grace end", "waiter gives up", "drain", "undrain", "victim frees", "new waiter", "protect"],
)
def test_rollback_restores_notices_victims_history_and_draining(change: str) -> None:
    led = mid_preemption()
    led.drain(3, True, 20 * S + MIN_RUN)
    now = 21 * S + MIN_RUN
    before, cp = state_of(led), led.checkpoint()
    match change:
        case "yield":
            led.yield_("v", now)
        case "grace end":
            led.advance(10 * S + MIN_RUN + GRACE)
        case "waiter gives up":
            led.release("w", now)
        case "drain":
            led.drain(0, True, now)
            led.advance(now)
        case "undrain":
            led.drain(3, False, now)
        case "victim frees":
            led.release("s", now)
        case "new waiter":
            wait(led, "w2", 1, now, priority=99)
            led.advance(now)
        case "protect":
            led.protect("p", True)
    assert state_of(led) != before
    led.rollback(cp)
    assert state_of(led) == before


# --- invariants over random sequences ------------------------------------------------------------


def random_request(rng: random.Random, task: str) -> Request:
    elastic = rng.random() < 0.2
    return Request(
        task_id=task,
        gpus=UNIT * rng.randint(1, 2) if elastic else rng.choice([0, 2500, 5000, UNIT, 2 * UNIT]),
        cpus=rng.randint(1, 2),
        priority=rng.choice([0, 10, 50, 90, 100]),
        wait_us=rng.choice([0, S, 100 * S]),
        on_preempt=Recovery.SHRINK if elastic and rng.random() < 0.5 else rng.choice(list(Recovery)[:3]),
        gpus_max=3 if elastic else 0,
        tenant=rng.choice([None, "a", "b"]),
    )


FUZZ_TENANTS = {"a": TenantQuota(UNIT, borrow=UNIT), "b": TenantQuota(2 * UNIT, borrow=UNIT // 2)}


def restarted(led: Checked, now: int) -> Checked:
    """A fresh ledger from ``led``'s records, as the shell builds one at start-up."""
    fresh = node(gpus=3, cpus=6, strategy=led.preemption.strategy, tenants=FUZZ_TENANTS)
    fresh.reachable = set(led.reachable)
    for rec in led.records().values():
        fresh.restore_record(rec, now)
    assert fresh.records() == led.records()
    return fresh


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences_never_hold_a_device_twice(seed: int) -> None:
    """Allocations, waits, frees, yields, drains, protection and restarts in random order: ``Checked``
    checks every call; after ``advance`` the timer is never due at once; in the end every plain
    waiter was served or expired, and no notice outlives its grace."""
    rng = random.Random(seed)
    led = node(gpus=3, cpus=6, strategy=rng.choice(list(PreemptStrategy)), tenants=FUZZ_TENANTS)
    tasks = [f"t{i}" for i in range(8)]
    now = 0
    for _ in range(150):
        now += rng.choice([1, S, 10 * S, GRACE, MIN_RUN])
        t, op = rng.choice(tasks), rng.random()
        try:
            if op < 0.4:
                led.allocate(random_request(rng, t), now)
                if rng.random() < 0.8:
                    led.reachable.add(t)
            elif op < 0.6:
                led.release(t, now)
            elif op < 0.72 and (told := sorted(led.state.notices)):
                led.yield_(rng.choice(told), now)
            elif op < 0.75:
                led.drain(rng.randrange(3), rng.random() < 0.5, now)
            elif op < 0.82 and led.get(t) is not None:
                led.protect(t, rng.random() < 0.3)
            elif op < 0.85:
                led = restarted(led, now)
            else:
                led.advance(now)
                deadline = led.next_deadline()
                assert deadline is None or deadline > now, "the timer would wake at once, and again"
        except (Insufficient, Refused):
            pass
    for _ in range(5):
        now += GRACE + 100 * S + 1
        led.advance(now)
    assert led.waiting() == [] and all(n.deadline > now for n in led.state.notices.values())


# --- found while writing these tests ---------------------------------------------------------------


def test_a_suspended_elastic_allocation_answers_its_own_terms_and_restores() -> None:
    led = node(gpus=2)
    e = hold(led, "e", 1, 0, gpus_max=2, priority=0, on_preempt=Recovery.SUSPEND)
    assert e.gpus == (0, 1)
    wait(led, "w", 2, 1, priority=50)
    [n] = led.advance(1)
    assert isinstance(n, Noticed) and n.notice.whole  # its extras are not enough: taken whole
    led.yield_("e", 2)
    assert [a.task_id for a in led.suspended()] == ["e"]
    again = req("e", 1, gpus_max=2, priority=0, on_preempt=Recovery.SUSPEND)
    assert led.allocate(again, 3) is None  # the same terms: it waits on, suspended
    fresh = node(gpus=2)
    for rec in led.records().values():
        fresh.restore_record(rec, 4)
    assert fresh.suspended() == led.suspended()
    _, effects = fresh.release("w", 5)
    [resumed] = effects
    assert isinstance(resumed, Served) and resumed.resumed and resumed.allocation.gpus == (0, 1)


def test_elastic_stays_within_its_tenants_quota() -> None:
    quotas = {"a": TenantQuota(2 * UNIT, borrow=UNIT), "b": TenantQuota(2 * UNIT)}
    led = node(gpus=4, tenants=quotas)
    e = hold(led, "e", 1, 0, gpus_max=4, tenant="a")
    assert len(e.gpus) == 3  # its quota and the one GPU it may borrow
    assert led.tenant_usage("a") == 3 * UNIT
    led.release("e", 1)
    hold(led, "b1", 1, 1, tenant="b")
    hold(led, "b2", 1, 1, tenant="b")
    f = hold(led, "f", 1, 2, gpus_max=4, tenant="a")
    assert len(f.gpus) == 2  # b uses all its quota: nothing to borrow
    led.release("b2", 3)  # two GPUs free, and one of b's quota idle
    effects = led.advance(3) + led.advance(2 + COOLDOWN)
    grown = [x for x in effects if isinstance(x, Grown)]
    assert [len(g.allocation.gpus) for g in grown] == [3] and led.tenant_usage("a") == 3 * UNIT


def test_a_waiter_served_otherwise_withdraws_the_notices_it_no_longer_needs() -> None:
    led = node(gpus=2)
    hold(led, "v", 1, 0, priority=0)
    hold(led, "x", 1, 0, priority=100)
    wait(led, "w", 1, 1, priority=50)
    assert set(noticed(led.advance(1))) == {"v"}
    _, effects = led.release("x", 2)  # "w" fits without "v" now
    assert kinds(effects) == ["Served", "Withdrawn"] and served(effects) == ["w"]
    assert led.notice_of("v") is None and led.get("v") is not None
    assert led.advance(1 + GRACE) == [] and led.history_of("v") == (0, False)


def test_undraining_one_gpu_keeps_the_notice_while_another_of_its_gpus_drains() -> None:
    led = node(gpus=2)
    hold(led, "a", 2, 0)
    led.drain(0, True, 1)
    led.drain(1, True, 1)
    [n] = led.advance(1)
    assert isinstance(n, Noticed) and n.notice.gpus == (0, 1)
    assert led.drain(1, False, 2) == []  # GPU 0 still drains: the notice (and its deadline) stands
    assert led.notice_of("a") == n.notice
    [w] = led.drain(0, False, 3)
    assert isinstance(w, Withdrawn)


def test_a_waiter_whose_victims_left_is_served_with_what_they_gave_back() -> None:
    led = node(gpus=2)
    hold(led, "v0", 1, 0, priority=0)
    hold(led, "v1", 1, 0, priority=0)
    wait(led, "w", 2, 1, priority=50)
    assert set(noticed(led.advance(1))) == {"v0", "v1"}
    led.yield_("v0", 2)
    with pytest.raises(Insufficient):
        hold(led, "late", 1, 3, priority=10)  # the freed GPU is kept for "w"
    led.advance(1 + GRACE)  # "v1" goes: "w" has both
    assert led.get("v1") is None and led.get("w") is not None


def test_what_a_victim_gave_back_is_kept_for_its_waiter_while_the_rest_of_its_victims_leave() -> None:
    """A gang's first victim leaves early: its GPU is not taken by a lower-priority newcomer (the
    gang would then have to take something back again, and could starve)."""
    ledger = Ledger(
        [GpuSpec(0, "g0"), GpuSpec(1, "g1")], [], preemption=PreemptionConfig(grace_us=10, min_runtime_us=0)
    )
    for task in ("a", "b"):
        ledger.allocate(Request(task, UNIT, priority=10), 0)
        ledger.reachable.add(task)
    assert ledger.allocate(Request("gang", 2 * UNIT, priority=90, wait_us=1_000), 1) is None
    noticed = [e for e in ledger.advance(1) if isinstance(e, Noticed)]
    assert sorted(e.allocation.task_id for e in noticed) == ["a", "b"]
    ledger.release("a", 2)  # the first victim leaves at once
    with pytest.raises(Insufficient):
        ledger.allocate(Request("newcomer", UNIT, priority=50), 3)  # GPU 0 is the gang's
    effects = ledger.yield_("b", 4)
    assert [e.allocation.gpus for e in effects if isinstance(e, Served)] == [(0, 1)]
    assert ledger.allocate(Request("later", UNIT, priority=50, wait_us=10), 5) is None  # nothing kept any more


# --- elastic pacing by utilisation -----------------------------------------------------------------


def busy_node(busy_percent: int = 50, hog: bool = False) -> Ledger:
    cfg = PreemptionConfig(
        grace_us=10, min_runtime_us=0, elastic_window_us=100, elastic_cooldown_us=100, busy_percent=busy_percent
    )
    led = Ledger([GpuSpec(i, f"g{i}") for i in range(3)], [], preemption=cfg)
    if hog:
        led.allocate(Request("hog", 2 * UNIT, priority=10), 0)
    led.allocate(Request("e", UNIT, gpus_max=3, priority=10), 0)
    led.reachable.add("e")
    return led


def test_an_elastic_allocation_grows_only_while_its_gpus_stay_busy_through_the_window() -> None:
    led = busy_node(hog=True)
    assert led.get("e").gpus == (2,)  # type: ignore[union-attr]
    led.release("hog", 3)
    led.observe(2, 20, 3)  # idle: growth waits however free the others are
    assert not any(isinstance(e, Grown) for e in led.advance(500))
    assert led.observe(2, 90, 500)  # busy from now
    assert not any(isinstance(e, Grown) for e in led.advance(500))
    assert led.next_deadline() == 600
    assert not any(isinstance(e, Grown) for e in led.advance(599))
    assert [e.allocation.gpus for e in led.advance(600) if isinstance(e, Grown)] == [(2, 0, 1)]


def test_an_elastic_allocation_whose_gpus_idle_through_the_window_gives_its_extras_back() -> None:
    led = busy_node()
    assert led.get("e").gpus == (0, 1, 2)  # type: ignore[union-attr]  # what was free, at once
    for g in range(3):
        led.observe(g, 5, 50)
    assert led.next_deadline() == 150  # the window from the first idle reading (cooldown ended at 100)
    (n,) = [e for e in led.advance(150) if isinstance(e, Noticed)]
    assert (n.notice.gpus, n.notice.whole, n.notice.by, n.notice.reason) == (
        (1, 2),
        False,
        "idle",
        PreemptReason.ELASTIC,
    )
    led.yield_("e", 151)
    assert led.get("e").gpus == (0,)  # type: ignore[union-attr]
    led.observe(0, 95, 160)  # busy again: it may grow after the cooldown, a busy window, GPUs free a window
    assert not any(isinstance(e, Grown) for e in led.advance(255))
    assert not any(isinstance(e, Grown) for e in led.advance(354))
    assert [e.allocation.gpus for e in led.advance(355) if isinstance(e, Grown)] == [(0, 1, 2)]


def test_without_a_busy_threshold_readings_change_nothing() -> None:
    led = busy_node(busy_percent=0)
    assert led.observe(0, 0, 1) is False
    assert not any(isinstance(e, Noticed) for e in led.advance(10_000))
