"""The ledger at scale: checkpoints and rollbacks in what changed, the records to store without a
walk, the paged listing, the index every call reads instead of walking all allocations, and victim
selection read from it. Pure: fake integer time, no clock; work is counted, never timed."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpud.core.ledger.notices as notices
import gpud.core.ledger.placement as placement
import gpud.core.ledger.takeback as takeback
from gpud.core.errors import Refused
from gpud.core.ledger import (
    NEVER,
    UNIT,
    GpuSpec,
    Insufficient,
    Ledger,
    Noticed,
    PreemptionConfig,
    Request,
    TaskRecord,
    TenantQuota,
)
from gpud.core.ledger_index import as_victim
from gpud.core.preemption import (
    Candidate,
    Chunk,
    Need,
    Pool,
    Room,
    Victim,
    _prefix,
    _waste_cover,
    choose,
    in_order,
    rank,
)
from gpud.core.victims import Listed
from gpud_client.protocol import PreemptReason, PreemptStrategy, Recovery, Strategy

from .statecheck import state_of

S = 1_000_000
CONFIG = PreemptionConfig(grace_us=30 * S, min_runtime_us=300 * S, cooldown_us=60 * S, elastic_window_us=30 * S)
TENANTS = {"a": TenantQuota(UNIT, borrow=UNIT), "b": TenantQuota(2 * UNIT, borrow=UNIT // 2)}


def node(gpus: int = 3, cpus: int = 6, strategy: PreemptStrategy = PreemptStrategy.LOWEST_PRIORITY) -> Ledger:
    specs = [GpuSpec(i, f"GPU-{i}") for i in range(gpus)]
    return Ledger(specs, list(range(cpus)), tenants=TENANTS, preemption=replace(CONFIG, strategy=strategy))


# --- what the index must say: recomputed from the state by walking it ------------------------------


def check_index(led: Ledger) -> None:
    ix, allocs, waiting = led.state.index, dict(led.state.allocs), dict(led.state.waiting)
    listed = sorted([*allocs, *(t for t, w in waiting.items() if w.suspended is not None)])
    assert list(ix.listed) == listed and led.allocation_count() == len(listed)
    for tenant in {*TENANTS, *(a.tenant for a in allocs.values() if a.tenant)}:
        mine = [a for a in allocs.values() if a.tenant == tenant]
        assert ix.tenant_usage(tenant) == sum(a.total for a in mine), tenant
        assert list(ix.newest_of(tenant)) == [a.task_id for a in sorted(mine, key=lambda a: (-a.created_us, a.task_id))]
    assert list(ix._maturing) == sorted((a.created_us, t) for t, a in allocs.items() if a.priority > 0)
    lower: dict[int, dict[tuple[int, int, int], list[tuple[int, str]]]] = {}
    for t, a in allocs.items():
        if a.priority < 100 and not a.protected and a.on_preempt != Recovery.SHRINK:
            for g in a.gpus:
                lower.setdefault(g, {}).setdefault((a.total, a.share, a.priority), []).append((-a.created_us, t))
    indexed = {g: {p: list(keys) for p, keys in groups.items()} for g, groups in ix.lower_groups.items() if groups}
    assert indexed == {g: {p: sorted(keys) for p, keys in groups.items()} for g, groups in lower.items()}
    assert set(ix.cpu_holders) == {t for t, a in allocs.items() if a.cpus}
    assert set(ix.elastic) == {t for t, a in allocs.items() if a.gpus_max}
    assert list(ix._notice_due) == sorted((n.deadline, t) for t, n in led.state.notices.items())
    assert list(ix._wait_due) == sorted((w.deadline, t) for t, w in waiting.items() if w.deadline < NEVER)
    assert list(ix._immune_due) == sorted((u, t) for t, u in led.state.immune.items())
    check_gpu_index(led)


def check_gpu_index(led: Ledger) -> None:
    """The counts per GPU, the notices by waiter and by drained GPU, the victims planned."""
    ix, allocs = led.state.index, dict(led.state.allocs)
    held: dict[int, int] = {}
    untold: dict[int, list[str]] = {}
    immune: dict[int, int] = {}
    tenants: dict[int, dict[str, int]] = {}
    for t, a in allocs.items():
        for g in a.gpus:
            held[g] = held.get(g, 0) + 1
            if t not in led.state.notices:
                untold.setdefault(g, []).append(t)
            if t in led.state.immune:
                immune[g] = immune.get(g, 0) + 1
            if a.tenant is not None:
                tenants.setdefault(g, {})[a.tenant] = tenants.get(g, {}).get(a.tenant, 0) + a.share
    assert ix.held_on == held and ix.immune_on == immune and ix.tenant_on == tenants
    assert {g: list(keys) for g, keys in ix.untold.items()} == {g: sorted(ts) for g, ts in untold.items()}
    told: dict[str, list[str]] = {}
    drained: dict[int, list[str]] = {}
    for t, n in led.state.notices.items():
        for where, key in [(drained, g) for g in n.gpus] if n.by == "drain" else [(told, n.by)]:
            where.setdefault(key, []).append(t)  # type: ignore[attr-defined]
    assert {b: list(keys) for b, keys in ix.told.items()} == {b: sorted(ts) for b, ts in told.items()}
    assert {g: list(keys) for g, keys in ix.drain_on.items()} == {g: sorted(ts) for g, ts in drained.items()}
    assert ix.chosen == {v: t for t, w in led.state.waiting.items() for v in w.plan}


def reference_victims(led: Ledger, req: Request, now: int) -> list[Candidate]:
    """Victim selection as it was before the index: one pass over every allocation, full lists."""
    room = Room({g: led.state.free[g] for g in placement.open_gpus(led.state, req)}, len(led.state.free_cpus))
    need = Need(req.gpus if not req.pinned else len(req.pinned) * min(req.gpus, UNIT), req.cpus)
    mature = now - led.preemption.min_runtime_us
    extras: list[Candidate] = []
    lower: list[Candidate] = []
    for t, a in led.state.allocs.items():
        if a.priority >= 100 or a.protected or a.priority > req.priority:
            continue
        if t in led.state.notices or t not in led.reachable or t in led.state.immune or t in led.state.index.chosen:
            continue
        if a.extras:
            extras.append(as_victim(a, PreemptReason.ELASTIC, a.extras))
        if a.priority < req.priority and a.on_preempt != Recovery.SHRINK and (not a.priority or a.created_us <= mature):
            lower.append(as_victim(a, PreemptReason.PRIORITY, a.gpus))
    reclaim: list[Candidate] = []
    if req.tenant is not None and led.tenant_usage(req.tenant) + req.gpus <= TENANTS[req.tenant].gpus:
        for tenant, quota in TENANTS.items():
            over = led.tenant_usage(tenant) - quota.gpus
            mine = sorted(
                (a for a in led.state.allocs.values() if a.tenant == tenant), key=lambda a: (-a.created_us, a.task_id)
            )
            for a in mine if tenant != req.tenant else []:
                if over <= 0:
                    break
                if takeback.eligible(led.state, a) and a.on_preempt != Recovery.SHRINK:
                    reclaim.append(as_victim(a, PreemptReason.QUOTA_RECLAIM, a.gpus))
                over -= a.total
    taken = {c.task_id for c in reclaim}
    pools = [
        Pool(extras, PreemptStrategy.LOWEST_PRIORITY),
        Pool(reclaim, PreemptStrategy.NEWEST_FIRST),
        Pool([c for c in lower if c.task_id not in taken], led.preemption.strategy),
    ]

    return expanded(takeback.one_per_task(choose(need, room, pools, takeback.tenant_fits(led.state, req))))


def expanded(victims: Sequence[Victim]) -> list[Candidate]:
    """Chunks as the candidates they stand for."""
    return [c for v in victims for c in (v.members() if isinstance(v, Chunk) else [v])]


# --- seeded random sequences -----------------------------------------------------------------------


def random_request(rng: random.Random, task: str) -> Request:
    elastic = rng.random() < 0.15
    return Request(
        task_id=task,
        gpus=UNIT * rng.randint(1, 2) if elastic else rng.choice([0, 1, 2500, 5000, 7500, UNIT, 2 * UNIT]),
        cpus=rng.randint(0, 2),
        priority=rng.choice([0, 10, 10, 50, 90, 100]),
        wait_us=rng.choice([0, S, 100 * S]),
        on_preempt=Recovery.SHRINK if elastic and rng.random() < 0.5 else rng.choice(list(Recovery)[:3]),
        gpus_max=3 if elastic else 0,
        tenant=rng.choice([None, None, "a", "b"]),
        strategy=rng.choice([Strategy.FIRST_FIT, Strategy.RANDOM, Strategy.BEST_FIT]),
    )


def step(led: Ledger, rng: random.Random, now: int, tasks: list[str]) -> None:
    """One random call (a refused one included: it changes nothing)."""
    t, op = rng.choice(tasks), rng.random()
    try:
        if op < 0.4:
            led.allocate(random_request(rng, t), now)
            if rng.random() < 0.85:
                led.reachable.add(t)
        elif op < 0.58:
            led.release(t, now)
        elif op < 0.68 and (told := sorted(led.state.notices)):
            led.yield_(rng.choice(told), now)
        elif op < 0.72:
            led.drain(rng.randrange(3), rng.random() < 0.5, now)
        elif op < 0.78 and led.get(t) is not None:
            led.protect(t, rng.random() < 0.3)
        elif op < 0.8:
            led.reachable.discard(t)
        else:
            led.advance(now)
    except (Insufficient, Refused):
        pass


def restarted(led: Ledger, now: int) -> Ledger:
    fresh = node(strategy=led.preemption.strategy)
    fresh.reachable = set(led.reachable)
    for rec in led.records().values():
        fresh.restore_record(rec, now)
    return fresh


def ledger_state(led: Ledger) -> object:
    """What a checkpoint saves: all but the shell's fact ``reachable`` and the utilisation readings."""
    name, attrs = state_of(led.state)
    return name, {k: v for k, v in attrs.items() if k not in ("reachable", "busy_since", "idle_since")}


def applied(stored: dict[str, TaskRecord], changed: tuple[dict[str, TaskRecord], set[str]]) -> dict[str, TaskRecord]:
    put, gone = changed
    out = {t: r for t, r in stored.items() if t not in gone}
    out.update(put)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_rollbacks_are_exact_and_changed_records_agree_with_the_full_walk(seed: int) -> None:
    """After every random call: the index is what walking the state gives; the records to store,
    applied to those last stored, are exactly ``records()``; and a rollback (of one call, or of
    several since a checkpoint) leaves the ledger exactly as it was, unstored changes still to store."""
    rng = random.Random(seed)
    led = node(strategy=rng.choice(list(PreemptStrategy)))
    tasks = [f"t{i}" for i in range(9)]
    stored: dict[str, TaskRecord] = {}
    now = 0
    for _ in range(200):
        now += rng.choice([1, S, 10 * S, 30 * S, 300 * S])
        if rng.random() < 0.05:
            led = restarted(led, now)
            stored = led.records()
            led.mark_stored()
        reachable = set(led.reachable)
        before, cp = ledger_state(led), led.checkpoint()
        for _ in range(rng.choice([1, 1, 1, 3])):
            step(led, rng, now, tasks)
        check_index(led)
        if rng.random() < 0.3:  # the store failed: back to the checkpoint
            led.rollback(cp)
            led.reachable = reachable  # the shell's fact, not the ledger's state
            assert ledger_state(led) == before
            assert led.checkpoint() == cp
            check_index(led)
        elif ledger_state(led) != before:
            assert led.checkpoint() != cp
        assert applied(stored, led.changed_records()) == led.records()
        if rng.random() < 0.8:  # stored (else the changes wait for the next store)
            stored = applied(stored, led.changed_records())
            led.mark_stored()


@pytest.mark.parametrize("seed", range(30))
def test_victims_read_from_the_index_are_those_the_full_lists_give(seed: int) -> None:
    rng = random.Random(1000 + seed)
    led = node(strategy=rng.choice(list(PreemptStrategy)))
    tasks = [f"t{i}" for i in range(10)]
    now, compared = 0, 0
    for _ in range(200):
        now += rng.choice([1, S, 10 * S, 100 * S, 300 * S])
        step(led, rng, now, tasks)
        for w in list(led.state.waiting.values()):
            if w.suspended is None and not notices.leaving(led.state, w):
                chosen = expanded(takeback.victims_for(led.state, w.request, now))
                assert chosen == reference_victims(led, w.request, now), w.request
                compared += 1
    assert compared > 0


# --- the paged listing ---------------------------------------------------------------------------------


def test_allocations_page_in_task_id_order_suspended_included() -> None:
    led = node(gpus=2)
    assert led.allocations_page(None, 10) == [] and led.allocation_count() == 0
    for t in ["m", "c", "x", "a"]:
        led.allocate(Request(t, 2500, priority=10), 0)
        led.reachable.add(t)
    led.allocate(Request("s", UNIT, priority=0, on_preempt=Recovery.SUSPEND), 0)
    led.reachable.add("s")
    led.allocate(Request("w", UNIT, priority=50, wait_us=100 * S), 1)
    [n] = [e for e in led.advance(1) if isinstance(e, Noticed)]
    led.yield_(n.allocation.task_id, 2)
    assert [a.task_id for a in led.suspended()] == ["s"]
    assert [a.task_id for a in led.allocations_page(None, 100)] == ["a", "c", "m", "s", "w", "x"]
    assert led.allocation_count() == 6
    assert [a.task_id for a in led.allocations_page(None, 2)] == ["a", "c"]
    assert [a.task_id for a in led.allocations_page("c", 2)] == ["m", "s"]  # after, not from
    assert [a.task_id for a in led.allocations_page("d", 2)] == ["m", "s"]  # between two ids
    assert [a.task_id for a in led.allocations_page("s", 10)] == ["w", "x"]
    assert led.allocations_page("x", 10) == [] and led.allocations_page("zz", 10) == []
    assert led.allocations_page(None, 0) == [] and led.allocations_page(None, -1) == []
    assert led.allocations_page("", 1)[0].task_id == "a"
    assert led.allocations_page("m", 1) == led.suspended()  # as ``suspended`` has it


def test_paging_through_thousands_gives_each_once() -> None:
    led = node(gpus=2, cpus=2)
    ids = [f"job-{random.Random(7).randrange(10**6)}-{i}" for i in range(3000)]
    for t in ids:
        led.allocate(Request(t, 5), 0)
    for t in ids[::3]:
        led.release(t, 1)
    seen: list[str] = []
    after = None
    while page := led.allocations_page(after, 128):
        seen += [a.task_id for a in page]
        after = page[-1].task_id
    assert seen == sorted(set(ids) - set(ids[::3])) and led.allocation_count() == len(seen)


# --- work counted at 20 000 allocations -------------------------------------------------------------


def full_node(n: int = 20_000) -> Ledger:
    """Two GPUs filled with n fractions of 2/n of a GPU (20 000: the smallest, 1/10000)."""
    led = Ledger([GpuSpec(i, f"GPU-{i}") for i in range(2)], list(range(8)), preemption=CONFIG)
    for i in range(n):
        t = f"t{i:06d}"
        led.allocate(Request(t, 2 * UNIT // n, priority=10, owner_pid=100), 0)
        led.reachable.add(t)
    led.mark_stored()
    return led


def test_a_change_among_20000_touches_what_it_changes_and_no_more() -> None:
    led = full_node()
    cp = led.checkpoint()
    assert led.state.journal.entries == 0
    led.release("t012345", 400 * S)
    assert led.state.journal.entries <= 4  # the allocation, its GPU's share, the changed set
    put, gone = led.changed_records()
    assert put == {} and gone == {"t012345"}
    led.rollback(cp)
    assert led.get("t012345") is not None and led.changed_records() == ({}, set())
    assert led.state.journal.entries == 0

    # A request that does not fit takes back one of 20 000: the choice reads a handful of them.
    cp = led.checkpoint()
    assert led.allocate(Request("w", 1, priority=50, wait_us=10 * S), 400 * S) is None
    read = led.state.index.reads
    [e] = led.advance(400 * S)
    assert isinstance(e, Noticed) and e.allocation.task_id == "t000000"  # lowest priority, newest, lowest id
    assert led.state.index.reads - read <= 2  # allocations made into candidates: the choice read no more
    assert led.state.journal.entries <= 8
    put, gone = led.changed_records()
    assert set(put) == {"t000000", "w"} and gone == set()
    led.rollback(cp)
    assert led.notice_of("t000000") is None and led.waiting() == []


def test_a_fraction_victim_that_also_frees_cpu_cores_is_counted_once() -> None:
    """The cover of a fraction was not marked taken, so the CPU cores pass counted its cores a second
    time and stopped short: the waiter's victims left it without the cores it needs."""
    led = Ledger([GpuSpec(0, "GPU-0")], list(range(4)), preemption=CONFIG)
    for t, gpus, cpus, priority in [("y", 5000, 0, 100), ("v", 5000, 1, 10), ("c", 0, 2, 20)]:
        led.allocate(Request(t, gpus, cpus=cpus, priority=priority), 0)
        led.reachable.add(t)
    assert led.allocate(Request("w", 5000, cpus=3, priority=50, wait_us=1000 * S), 400 * S) is None
    told = {e.allocation.task_id for e in led.advance(400 * S) if isinstance(e, Noticed)}
    assert told == {"v", "c"}  # v's half GPU and core, and c's two cores: 1 free + 1 + 2 = 3


def test_rolling_back_to_a_superseded_checkpoint_raises() -> None:
    led = node()
    old = led.checkpoint()
    led.allocate(Request("a", UNIT), 0)
    led.checkpoint()
    with pytest.raises(ValueError, match="superseded"):
        led.rollback(old)
    assert led.get("a") is not None


def test_allocations_restored_from_records_make_the_same_index() -> None:
    rng = random.Random(3)
    led = node()
    tasks = [f"t{i}" for i in range(12)]
    for i in range(150):
        step(led, rng, i * 10 * S, tasks)
    fresh = restarted(led, 1500 * S)
    check_index(fresh)
    assert {a.task_id for a in fresh.allocations_page(None, 100)} == {
        a.task_id for a in led.allocations_page(None, 100)
    }


# --- the choice read group by group is the choice over the whole sorted list -------------------------


@st.composite
def on_one_gpu(draw: st.DrawFn) -> list[Candidate]:
    """Candidates holding GPU 0: fractions of it, or whole GPUs (0 and maybe others)."""
    out = []
    for i in range(draw(st.integers(0, 25))):
        whole = draw(st.booleans())
        gpus = (0, *range(1, draw(st.integers(1, 3)))) if whole else (0,)
        share = UNIT if whole else draw(st.sampled_from([1, 2, 500, 2500, 2500, 5000, 7000]))
        out.append(
            Candidate(
                f"c{draw(st.integers(0, 40)):02d}-{i}",
                gpus,
                share,
                draw(st.integers(0, 2)),
                draw(st.sampled_from([0, 10, 10, 20, 50])),
                draw(st.sampled_from([0, 5, 5, 9])),
                True,
                PreemptReason.PRIORITY,
            )
        )
    return out


def cover_as_before(short: int, on: list[Candidate], strategy: PreemptStrategy) -> list[Candidate] | None:
    """The cover as ``preemption`` made it from one sorted list (ties now to the lower task id)."""
    if short <= 0:
        return []
    if sum(c.share for c in on) < short:
        return None
    picked: list[Candidate] = []
    got = 0
    if strategy != PreemptStrategy.MINIMUM_WASTE:
        for c in sorted(on, key=rank(strategy)):
            if got >= short:
                break
            picked.append(c)
            got += c.share
        return picked
    ordered = sorted(on, key=lambda c: (c.share * len(c.gpus), c.priority, -c.created, c.task_id))
    taken: set[str] = set()
    for c in reversed(ordered):
        if got + c.share <= short:
            picked.append(c)
            taken.add(c.task_id)
            got += c.share
    if got < short:
        covering = next((c for c in ordered if c.task_id not in taken and got + c.share >= short), None)
        if covering is not None:
            return [*picked, covering]
        for c in reversed(ordered):
            if c.task_id not in taken and got < short:
                picked.append(c)
                got += c.share
    return picked


@settings(max_examples=400, deadline=None)
@given(on_one_gpu(), st.integers(1, UNIT - 1), st.sampled_from(list(PreemptStrategy)))
def test_groups_read_in_order_cover_as_the_sorted_list_does(
    on: list[Candidate], short: int, strategy: PreemptStrategy
) -> None:
    groups = Listed(on).on(0)
    assert list(in_order(groups, strategy)) == sorted(on, key=rank(strategy))
    if strategy == PreemptStrategy.MINIMUM_WASTE:
        assert _waste_cover(short, groups, set()) == cover_as_before(short, on, strategy)
    else:
        assert _prefix(short, in_order(groups, strategy)) == cover_as_before(short, on, strategy)
