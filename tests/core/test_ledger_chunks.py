"""Victims chosen in chunks are those chosen candidate by candidate: with ``BULK`` at 2 (nearly every
GPU's fractions a chunk) and at a billion (none), on random ledgers, every strategy, the victims are
the same, in the same order. And among 20 000 fractions a whole GPU is chosen from counts: no
allocation is made into a candidate. Pure: fake integer time."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpud.core.ledger.takeback as takeback
from gpud.core import preemption
from gpud.core.ledger import (
    NOTICE_BATCH,
    UNIT,
    GpuSpec,
    Insufficient,
    Ledger,
    Noticed,
    PreemptionConfig,
    Request,
    TenantQuota,
)
from gpud.core.preemption import Candidate, Chunk, Need, Pool, Room, Victim
from gpud_client.protocol import PreemptReason, PreemptStrategy, Recovery

from .test_ledger_scale import step

S = 1_000_000
CONFIG = PreemptionConfig(grace_us=30 * S, min_runtime_us=300 * S, cooldown_us=60 * S)
TENANTS = {"a": TenantQuota(UNIT, borrow=UNIT), "b": TenantQuota(2 * UNIT, borrow=UNIT // 2)}


def expanded(victims: list[Victim]) -> list[Candidate]:
    return [c for v in victims for c in (v.members() if isinstance(v, Chunk) else [v])]


def random_ledger(rng: random.Random) -> tuple[Ledger, int]:
    strategy = rng.choice(list(PreemptStrategy))
    led = Ledger(
        [GpuSpec(i, f"GPU-{i}") for i in range(3)],
        list(range(8)),
        tenants=TENANTS,
        preemption=replace(CONFIG, strategy=strategy),
    )
    now, i = 0, 0
    for g in range(3):  # each GPU (nearly) filled with fractions of one or two sizes
        sizes = rng.choice([[1], [1, 2], [20, 50], [100], [100, 200], [1000], [5, 2500]])
        for _ in range(400):
            now += rng.choice([1, S, 100 * S])
            t = f"f{i:03d}"
            i += 1
            req = Request(
                t,
                rng.choice(sizes),
                cpus=1 if rng.random() < 0.08 else 0,
                priority=rng.choice([0, 0, 0, 10, 10, 50]),
                tenant=rng.choice([None, None, "a", "b"]),
                prefer=(g,),
                on_preempt=rng.choice([Recovery.TERMINATE, Recovery.SUSPEND]),
            )
            try:
                if (a := led.allocate(req, now)) is None or a.gpus != (g,):
                    led.release(t, now)
                    break
            except Insufficient:
                break
            if rng.random() < 0.995:
                led.reachable.add(t)
            if led.gpu_free(g) < UNIT // 20 and rng.random() < 0.5:
                break
    tasks = [f"f{j:03d}" for j in range(0, i, max(1, i // 15))] + ["x", "y"]
    for _ in range(rng.randint(0, 15)):  # notices, immunities, protection, drains...
        now += rng.choice([1, S, 10 * S, 300 * S])
        step(led, rng, now, tasks)
    return led, now + 400 * S


def test_chunks_choose_what_candidates_one_by_one_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    chunked_choices = 0
    for seed in range(80):
        rng = random.Random(7000 + seed)
        led, now = random_ledger(rng)
        for _ in range(12):
            req = Request(
                "w",
                rng.choice([UNIT, UNIT, 2 * UNIT, 1, 3, 40, 500, 2500, 5000, 9000]),
                cpus=rng.choice([0, 0, 1, 3]),
                priority=rng.choice([10, 50, 100]),
                tenant=rng.choice([None, None, "a", "b"]),
            )
            monkeypatch.setattr(preemption, "BULK", 10**9)
            one_by_one = takeback.victims_for(led.state, req, now)
            assert not any(isinstance(v, Chunk) for v in one_by_one)
            monkeypatch.setattr(preemption, "BULK", 2)
            chunked = takeback.victims_for(led.state, req, now)
            assert expanded(chunked) == one_by_one, (seed, req)
            chunked_choices += any(isinstance(v, Chunk) for v in chunked)
    assert chunked_choices > 100  # the chunks were put to the test


def test_a_whole_gpu_among_20000_is_chosen_from_counts() -> None:
    led = Ledger([GpuSpec(i, f"GPU-{i}") for i in range(2)], list(range(8)), preemption=CONFIG)
    for i in range(20_000):
        t = f"t{i:06d}"
        led.allocate(Request(t, 1, priority=0, owner_pid=100), i)
        led.reachable.add(t)
    assert led.allocate(Request("w", UNIT, priority=100, wait_us=100 * S), 400 * S) is None
    reads = led.state.index.reads
    [chunk] = takeback.victims_for(led.state, Request("w", UNIT, priority=100), 400 * S)
    assert isinstance(chunk, Chunk) and chunk.count == 10_000 and chunk.gpu == 1  # the newest: GPU 1's
    assert led.state.index.reads == reads  # not one of them made into a candidate
    effects = led.advance(400 * S)
    assert len(effects) == NOTICE_BATCH and all(isinstance(e, Noticed) and 1 in e.allocation.gpus for e in effects)
    # GPU 0: the others are planned
    half = takeback.victims_for(led.state, Request("h", UNIT // 2, priority=100), 400 * S)
    assert [v.count for v in half if isinstance(v, Chunk)] == [UNIT // 2] and {
        v.gpu for v in half if isinstance(v, Chunk)
    } == {0}


@st.composite
def fractions(draw: st.DrawFn) -> tuple[Need, Room, list[Candidate], PreemptStrategy]:
    """Small fractions on two or three GPUs, some holding CPU cores; a fraction or CPU cores asked."""
    gpus = draw(st.integers(2, 3))
    pool = []
    for i in range(draw(st.integers(0, 60))):
        g = draw(st.integers(0, gpus - 1))
        pool.append(
            Candidate(
                f"c{i:02d}",
                (g,),
                draw(st.sampled_from([1, 1, 2, 5, 10])),
                draw(st.sampled_from([0, 0, 0, 1, 2])),
                draw(st.sampled_from([0, 0, 10])),
                draw(st.integers(0, 5)),
                True,
                PreemptReason.PRIORITY,
                draw(st.sampled_from([None, "a"])),
            )
        )
    room = Room({g: draw(st.integers(0, 20)) for g in range(gpus)}, draw(st.integers(0, 2)))
    need = Need(draw(st.sampled_from([0, 5, 20, 40, 80])), draw(st.integers(0, 4)))
    return need, room, pool, draw(st.sampled_from(list(PreemptStrategy)))


@settings(max_examples=500, deadline=None)
@given(fractions(), st.booleans())
def test_covers_in_chunks_are_the_covers_read_one_by_one(
    case: tuple[Need, Room, list[Candidate], PreemptStrategy], tenant: bool
) -> None:
    need, room, pool, strategy = case
    if need.gpus == 0 and need.cpus == 0:
        return

    def tenant_ok(victims: Sequence[Victim]) -> bool:  # at least 8 units of tenant a taken back
        return sum(sum(v.tenants().values()) if isinstance(v, Chunk) else v.units for v in victims) >= 8

    check = tenant_ok if tenant else None
    saved = preemption.BULK
    try:
        preemption.BULK = 10**9
        one_by_one = preemption.choose(need, Room(dict(room.free), room.cpus), [Pool(pool, strategy)], check)
        preemption.BULK = 2
        chunked = preemption.choose(need, Room(dict(room.free), room.cpus), [Pool(pool, strategy)], check)
    finally:
        preemption.BULK = saved
    assert expanded(chunked) == one_by_one
