"""The allocation ledger: fixed point, fractions, strategies, tenants, waits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.core.errors import Refused
from gpud.core.ledger import UNIT, Expired, GpuSpec, Insufficient, Ledger, Request, Served, TenantQuota
from gpud_client.protocol import ErrorCode, Strategy

from .statecheck import state_of

MS = 1000


def node(gpus: int = 4, cpus: int = 8, **kw: object) -> Ledger:
    specs = [GpuSpec(i, f"GPU-{i}", numa_node=i // 2) for i in range(gpus)]
    numa = {c: c // (cpus // 2) for c in range(cpus)}
    return Ledger(specs, list(range(cpus)), cpu_numa=numa, **kw)  # type: ignore[arg-type]


def req(task: str, gpus: float, **kw: object) -> Request:
    return Request(task_id=task, gpus=round(gpus * UNIT), **kw)  # type: ignore[arg-type]


def test_whole_gpus_first_fit_with_cpus_near_them() -> None:
    led = node()
    a = led.allocate(req("a", 2, cpus=2), 0)
    assert a is not None and a.gpus == (0, 1) and a.share == UNIT and a.cpus == (0, 1)
    b = led.allocate(req("b", 1, cpus=2), 0)
    assert b is not None and b.gpus == (2,) and b.cpus == (4, 5)  # GPU 2 is on NUMA node 1


def test_fractions_fill_partly_used_gpus_before_splitting_a_whole_one() -> None:
    led = node()
    a = led.allocate(req("a", 0.5), 0)
    b = led.allocate(req("b", 0.25), 0)
    c = led.allocate(req("c", 0.25), 0)
    d = led.allocate(req("d", 0.5), 0)
    assert [x.gpus for x in (a, b, c, d) if x] == [(0,), (0,), (0,), (1,)]
    assert led.gpu_free(0) == 0


def test_a_fraction_never_spans_gpus() -> None:
    led = node(gpus=2)
    led.allocate(req("a", 0.6), 0)
    led.allocate(req("b", 0.6), 0)
    with pytest.raises(Insufficient) as err:
        led.allocate(req("c", 0.5), 0)  # 0.4 + 0.4 free, but on two GPUs
    assert err.value.what == "gpus" and "most free on any GPU is 0.4" in err.value.message


def test_released_fractions_merge_back() -> None:
    led = node(gpus=1)
    for t in "abcd":
        led.allocate(req(t, 0.25), 0)
    for t in "bd":
        led.release(t, 1)
    assert led.gpu_free(0) == UNIT // 2
    assert led.allocate(req("e", 0.5), 2) is not None


def test_exact_fixed_point_sums() -> None:
    led = node(gpus=1)
    for i in range(3):
        led.allocate(Request(task_id=f"t{i}", gpus=3333), 0)
    assert led.gpu_free(0) == 1
    with pytest.raises(Insufficient):
        led.allocate(Request(task_id="x", gpus=2), 0)
    assert led.allocate(Request(task_id="y", gpus=1), 0) is not None


def test_multi_gpu_requests_are_all_or_nothing() -> None:
    led = node(gpus=4)
    led.allocate(req("half", 0.5), 0)
    led.allocate(req("two", 2), 0)
    before = state_of(led)
    with pytest.raises(Insufficient, match="2 whole GPU"):
        led.allocate(req("greedy", 2), 0)  # only GPU 3 is entirely free
    assert state_of(led) == before


def test_idempotent_by_task_id() -> None:
    led = node()
    a = led.allocate(req("t", 1, cpus=1, owner_pid=42), 0)
    assert led.allocate(req("t", 1, cpus=1, owner_pid=42), 5) == a
    assert len(led.allocations()) == 1


def test_where_and_how_long_are_not_terms_a_repeat_must_match() -> None:
    """prefer, strategy and the wait only say where to place and how long to wait."""
    led = node()
    a = led.allocate(req("t", 0.5, cpus=2), 0)
    again = req("t", 0.5, cpus=2, prefer=(3,), strategy=Strategy.RANDOM, wait_us=5000 * MS)
    assert led.allocate(again, 5) == a
    assert led.waiting() == [] and led.next_deadline() is None


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"gpus": 2 * UNIT}, "already holds 1 GPU and 4 CPU cores; this request asks for 2 GPUs ("),
        ({"cpus": 1}, "already holds 1 GPU and 4 CPU cores; this request asks for 1 CPU core ("),
        ({"gpus": UNIT // 4, "cpus": 0}, "this request asks for 0.25 of a GPU and no CPU core ("),
        ({"tenant": "speech"}, "holds 1 GPU, 4 CPU cores and tenant 'vision'; this request asks for tenant 'speech'"),
        ({"tenant": None}, "this request asks for no tenant ("),
        ({"priority": 90}, "holds 1 GPU, 4 CPU cores and priority 50; this request asks for priority 90"),
        ({"owner_pid": 7}, "holds 1 GPU, 4 CPU cores and owner pid 42; this request asks for owner pid 7"),
        ({"owner_pid": None}, "this request asks for no owner pid ("),
        (
            {"gpus": 2 * UNIT, "priority": 90, "owner_pid": 7},
            "holds 1 GPU, 4 CPU cores, priority 50 and owner pid 42; this request asks for 2 GPUs, priority 90 and owner pid 7",
        ),
    ],
)
def test_a_repeat_with_other_terms_is_refused_naming_each_difference(changes: dict[str, object], needle: str) -> None:
    led = node(tenants={"vision": TenantQuota(4 * UNIT), "speech": TenantQuota(4 * UNIT)})
    terms: dict[str, object] = {"gpus": UNIT, "cpus": 4, "tenant": "vision", "priority": 50, "owner_pid": 42}
    led.allocate(Request(task_id="etl-1", **terms), 0)  # type: ignore[arg-type]
    before = state_of(led)
    with pytest.raises(Refused) as err:
        led.allocate(Request(task_id="etl-1", **{**terms, **changes}), 1)  # type: ignore[arg-type]
    assert err.value.code == ErrorCode.INVALID
    assert err.value.message.startswith("task 'etl-1' already holds") and needle in err.value.message
    assert state_of(led) == before


def test_the_issues_example_reads_as_written() -> None:
    led = node()
    led.allocate(req("etl-1", 1, cpus=4), 0)
    with pytest.raises(
        Refused, match=r"^task 'etl-1' already holds 1 GPU and 4 CPU cores; this request asks for 2 GPUs \("
    ):
        led.allocate(req("etl-1", 2, cpus=4), 1)


def test_a_second_request_for_a_waiting_task_id_is_refused_and_the_first_waits_on() -> None:
    led = node(gpus=1)
    led.allocate(req("running", 1), 0)
    assert led.allocate(req("w", 1, cpus=1, wait_us=100 * MS), 0) is None
    before = state_of(led)
    with pytest.raises(
        Refused, match="task 'w' already waits for 1 GPU and 1 CPU core; this request asks for 0.5 of a GPU"
    ):
        led.allocate(req("w", 0.5, cpus=1, wait_us=100 * MS), 1)
    assert state_of(led) == before
    with pytest.raises(Refused, match="task 'w' already waits for this allocation: one request per task id waits"):
        led.allocate(req("w", 1, cpus=1, wait_us=100 * MS), 2)  # the same terms: still one waiter
    assert state_of(led) == before
    _, effects = led.release("running", 3)
    assert [e.allocation.task_id for e in effects if isinstance(e, Served)] == ["w"]
    assert led.allocate(req("w", 1, cpus=1), 4) is not None  # held now: the same terms are answered


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (Strategy.FIRST_FIT, 0),  # lowest index that fits: GPU 0 (0.3 free)
        (Strategy.BEST_FIT, 1),  # tightest: GPU 1 (0.2 free)
        (Strategy.LEAST_LOADED, 0),  # among partly used, the most free
    ],
)
def test_each_strategy_on_a_fixed_scenario(strategy: Strategy, expected: int) -> None:
    led = node(gpus=3)
    led.allocate(Request(task_id="x", gpus=7000, prefer=(0,)), 0)
    led.allocate(Request(task_id="y", gpus=8000, prefer=(1,)), 0)
    got = led.allocate(Request(task_id="z", gpus=2000, strategy=strategy), 0)
    assert got is not None and got.gpus == (expected,)


def test_round_robin_and_random_spread_whole_gpus() -> None:
    led = node(gpus=3)
    picks = []
    for i in range(3):
        a = led.allocate(Request(task_id=f"r{i}", gpus=UNIT, strategy=Strategy.ROUND_ROBIN), 0)
        assert a is not None
        picks.append(a.gpus[0])
        led.release(f"r{i}", 0)
    assert picks == [0, 1, 2]
    rnd = node(gpus=4, seed=7)
    seen = set()
    for i in range(12):
        a = rnd.allocate(Request(task_id=f"x{i}", gpus=UNIT, strategy=Strategy.RANDOM), 0)
        assert a is not None
        seen.add(a.gpus[0])
        rnd.release(f"x{i}", 0)
    assert len(seen) > 1


def test_prefer_is_tried_first() -> None:
    led = node()
    a = led.allocate(req("a", 1, prefer=(3,)), 0)
    assert a is not None and a.gpus == (3,)
    b = led.allocate(req("b", 0.5, prefer=(2,)), 0)
    assert b is not None and b.gpus == (2,)


@pytest.mark.parametrize(
    ("request_", "code", "needle"),
    [
        (Request(task_id="z", gpus=0), ErrorCode.INVALID, "at least"),
        (Request(task_id="z", gpus=-UNIT), ErrorCode.INVALID, "positive"),
        (Request(task_id="z", gpus=15000), ErrorCode.INVALID, "1.5 GPUs"),
        (Request(task_id="z", gpus=5 * UNIT), ErrorCode.INVALID, "this node has 4"),
        (Request(task_id="z", gpus=UNIT, cpus=9), ErrorCode.INVALID, "this node has 8"),
        (Request(task_id="z", gpus=UNIT, prefer=(7,)), ErrorCode.UNKNOWN_GPU, "unknown GPU 7"),
        (Request(task_id="z", gpus=UNIT, tenant="nobody"), ErrorCode.UNKNOWN_TENANT, "unknown tenant"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(request_: Request, code: ErrorCode, needle: str) -> None:
    led = node()
    led.allocate(req("keep", 0.5), 0)
    before = state_of(led)
    with pytest.raises(Refused) as err:
        led.allocate(request_, 1)
    assert err.value.code == code and needle in err.value.message
    assert state_of(led) == before


def test_tenant_quota_with_bounded_borrowing() -> None:
    led = node(gpus=4, tenants={"vision": TenantQuota(2 * UNIT, borrow=UNIT), "speech": TenantQuota(2 * UNIT)})
    assert led.allocate(req("v1", 2, tenant="vision"), 0) is not None
    assert led.allocate(req("v2", 1, tenant="vision"), 0) is not None  # borrows 1 of speech's idle 2
    with pytest.raises(Insufficient) as err:
        led.allocate(req("v3", 1, tenant="vision"), 0)  # a second borrowed GPU is over the bound
    assert err.value.what == "tenant_quota"
    assert led.allocate(req("s1", 1, tenant="speech"), 0) is not None
    with pytest.raises(Insufficient):
        led.allocate(req("s2", 1, tenant="speech"), 0)  # 4 GPUs in use: nothing free
    led.release("v2", 1)
    assert led.allocate(req("s2", 1, tenant="speech"), 2) is not None


def test_borrowing_only_from_idle_quota() -> None:
    led = node(gpus=4, tenants={"a": TenantQuota(UNIT, borrow=3 * UNIT), "b": TenantQuota(UNIT)})
    led.allocate(req("b1", 1, tenant="b"), 0)
    led.allocate(req("a1", 1, tenant="a"), 0)
    with pytest.raises(Insufficient, match="idle elsewhere 0"):
        led.allocate(req("a2", 1, tenant="a"), 0)


def test_waiters_are_served_in_priority_order_when_resources_free() -> None:
    led = node(gpus=1)
    led.allocate(req("running", 1), 0)
    assert led.allocate(req("low", 1, priority=10, wait_us=5000 * MS), 1) is None
    assert led.allocate(req("high", 1, priority=90, wait_us=5000 * MS), 2) is None
    assert [r.task_id for r in led.waiting()] == ["high", "low"]
    _, effects = led.release("running", 10)
    assert [type(e) for e in effects] == [Served] and effects[0].allocation.task_id == "high"  # type: ignore[union-attr]
    assert led.next_deadline() == 1 + 5000 * MS
    [expired] = led.advance(1 + 5000 * MS)
    assert isinstance(expired, Expired) and expired.task_id == "low"


def test_a_waiter_expires_at_its_deadline_with_the_reason() -> None:
    led = node(gpus=1)
    led.allocate(req("running", 1), 0)
    led.allocate(req("w", 1, wait_us=100 * MS), 0)
    assert led.advance(100 * MS - 1) == []
    [e] = led.advance(100 * MS)
    assert isinstance(e, Expired) and e.task_id == "w" and e.reason.what == "gpus"
    assert led.waiting() == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.integers(0, 11),
            st.sampled_from([1, 2500, 3333, 5000, 10000, 20000]),
            st.integers(0, 3),
            st.sampled_from(list(Strategy)),
        ),
        max_size=60,
    )
)
def test_random_sequences_never_over_allocate(steps: list[tuple[bool, int, int, int, Strategy]]) -> None:
    led = node(gpus=3, cpus=6)
    for allocate, t, gpus, cpus, strategy in steps:
        task = f"t{t}"
        if allocate:
            before = {g: led.gpu_free(g) for g in range(3)}
            try:
                a = led.allocate(Request(task_id=task, gpus=gpus, cpus=cpus, strategy=strategy), 0)
            except (Insufficient, Refused):
                assert {g: led.gpu_free(g) for g in range(3)} == before
                continue
            assert a is not None
            assert len(a.gpus) == len(set(a.gpus))
            assert a.share < UNIT and len(a.gpus) == 1 or a.share == UNIT  # a fraction stays on one GPU
        else:
            taken = led.get(task)
            before = {g: led.gpu_free(g) for g in range(3)}
            released, _ = led.release(task, 0)
            assert released == taken
            if released:
                for g in released.gpus:
                    assert led.gpu_free(g) == before[g] + released.share  # exactly what was taken
        for g in range(3):
            free = led.gpu_free(g)
            assert 0 <= free <= UNIT
            assert free + sum(led.gpu_tasks(g).values()) == UNIT
        used = [c for a in led.allocations() for c in a.cpus]
        assert len(used) == len(set(used)) and set(used).isdisjoint(led.cpus_free())
        assert len(used) + len(led.cpus_free()) == 6


def test_gpus_are_converted_to_fixed_point_exactly() -> None:
    from gpud.core.ledger import to_fixed

    assert (to_fixed(0.25), to_fixed(2), to_fixed(0.0001)) == (2500, 20000, 1)
    for bad in (0.00001, float("nan"), float("inf")):
        with pytest.raises(Refused):
            to_fixed(bad)


def test_fractions_on_a_gpu_are_the_partial_allocations_there() -> None:
    led = node()
    led.allocate(req("quarter", 0.25, prefer=(1,)), 0)
    led.allocate(req("whole", 1), 0)
    assert [a.task_id for a in led.fractions_on(1)] == ["quarter"]
    assert led.fractions_on(0) == [] and led.fractions_on(2) == []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from([0.25, 0.5, 1, 2]), st.booleans()), max_size=12),
    st.sampled_from("abcdef"),
    st.sampled_from(["release", "allocate", "advance"]),
)
def test_rollback_restores_exactly_the_checkpointed_state(
    ops: list[tuple[str, float, bool]], task: str, change: str
) -> None:
    """Whatever the change (a release serving waiters, an allocation, expiries), a
    rollback leaves the ledger as it was: what the shell relies on when a write fails."""
    led = node(gpus=2, cpus=4)
    for t, gpus, wait in ops:
        try:
            led.allocate(req(t, gpus, cpus=1, wait_us=100 * MS if wait else 0, strategy=Strategy.RANDOM), 0)
        except (Insufficient, Refused):
            pass
    before, rng = state_of(led), led.state.rng.getstate()
    cp = led.checkpoint()
    try:
        if change == "release":
            led.release(task, 1)
        elif change == "allocate":
            led.allocate(req(task + "x", 0.5, cpus=1, wait_us=MS, strategy=Strategy.RANDOM), 1)
        else:
            led.advance(200 * MS)
    except (Insufficient, Refused):
        pass
    led.rollback(cp)
    assert state_of(led) == before and led.state.rng.getstate() == rng


def test_a_rolled_back_release_keeps_the_waiter_it_served_waiting() -> None:
    led = node(gpus=1, cpus=2)
    led.allocate(req("a", 1), 0)
    assert led.allocate(req("b", 1, wait_us=10 * MS), 0) is None
    cp = led.checkpoint()
    _, effects = led.release("a", 1)
    assert [type(e) for e in effects] == [Served]
    led.rollback(cp)
    assert led.get("a") is not None and led.get("b") is None
    assert [r.task_id for r in led.waiting()] == ["b"]
    _, effects = led.release("a", 2)  # the same change, tried again, serves it
    assert [e.allocation.task_id for e in effects if isinstance(e, Served)] == ["b"]


def test_withdrawing_a_wait_serves_no_one() -> None:
    led = node(gpus=1, cpus=2)
    led.allocate(req("a", 1), 0)
    led.allocate(req("b", 1, wait_us=10 * MS), 0)
    assert led.release("b", 1) == (None, [])
    assert led.waiting() == []


def test_strategy_only_places_on_the_named_gpus_or_nowhere() -> None:
    led = node(gpus=4)
    a = led.allocate(req("a", 0.25, prefer=(2,), strategy=Strategy.ONLY), 0)
    assert a is not None and a.gpus == (2,), "not GPU 0, which first fit would take"
    b = led.allocate(req("b", 2, prefer=(3, 1), strategy=Strategy.ONLY), 0)
    assert b is not None and b.gpus == (1, 3)
    led.drain(0, True, 0)
    before = state_of(led)
    with pytest.raises(Insufficient, match=r"GPUs \[2\] are not entirely free: strategy only places on \[2\] alone"):
        led.allocate(req("c", 1, prefer=(2,), strategy=Strategy.ONLY), 0)
    with pytest.raises(Insufficient, match=r"on \[1\] alone \(strategy only\), the most free there is 0"):
        led.allocate(req("d", 0.5, prefer=(1,), strategy=Strategy.ONLY), 0)
    with pytest.raises(Insufficient, match=r"GPUs \[0\] take nothing new now"):
        led.allocate(req("e", 0.5, prefer=(0,), strategy=Strategy.ONLY), 0)
    assert state_of(led) == before, "refused: nothing changed"


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (req("x", 0.5, strategy=Strategy.ONLY), "name them"),
        (req("x", 2, prefer=(0,), strategy=Strategy.ONLY), "names as many in prefer, not 1"),
        (req("x", 1, prefer=(0,), strategy=Strategy.ONLY, wait_us=1000), "does not wait"),
        (req("x", 1, prefer=(0,), strategy=Strategy.ONLY, gpus_max=2), "elastic range"),
    ],
)
def test_strategy_only_refuses_what_it_cannot_place_exactly(request_: Request, message: str) -> None:
    with pytest.raises(Refused, match=message) as info:
        node().allocate(request_, 0)
    assert info.value.code == ErrorCode.INVALID


def test_a_fractions_memory_ceiling_is_one_of_its_terms() -> None:
    led = node()
    a = led.allocate(req("a", 0.25, memory_bytes=4 << 30), 0)
    assert a is not None and a.memory_bytes == 4 << 30
    assert led.allocate(req("a", 0.25, memory_bytes=4 << 30), 0) is a, "the same terms: the same allocation"
    with pytest.raises(
        Refused, match="already holds .*4294967296 bytes of memory; this request asks for its share's memory"
    ):
        led.allocate(req("a", 0.25), 0)
    with pytest.raises(Refused, match="memory_bytes is a fraction's memory ceiling"):
        led.allocate(req("b", 1, memory_bytes=4 << 30), 0)
