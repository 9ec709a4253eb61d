"""Victim selection in-process, for bench/preempt.py: how long ``Ledger.advance`` takes to choose the
victims of one waiting request on a node holding 1 000 allocations, for each preemption strategy.

A layout fills every GPU of a node with allocations of fixed shares (``LAYOUTS``), 1 000 in all,
each placed on its GPU with ``prefer``, at a seeded random priority among 0, 10, 25 and 50 and a
seeded creation time, every one of them reachable (someone could be told) and past its minimum
runtime. Then a production request (priority 100) that does not fit waits, and ``advance`` is timed
(``time.perf_counter_ns``) around the one call that plans its victims; the ledger is rolled back to
its checkpoint after each call (not timed), so every call plans from the same state. The planning
must find victims, or nothing is reported.

It times the ledger as the daemon runs it, garbage collector included; nothing else runs in the
process meanwhile.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any

from gpud.core.ledger import UNIT, GpuSpec, Ledger, Noticed, PreemptionConfig, Request
from gpud_client.protocol import PreemptStrategy

ALLOCATIONS = 1000
# name -> the shares one GPU is filled with (fixed point); the GPU count makes 1 000 allocations
LAYOUTS: dict[str, tuple[int, ...]] = {
    "node8": (UNIT // 125,) * 125,  # an 8-GPU node, 125 allocations of 1/125 on each
    "node40": (UNIT // 25,) * 25,  # 40 GPUs, 25 allocations of 1/25 on each
    "eighths": (UNIT // 8,) * 8,  # 125 GPUs, 8 allocations of 1/8 each
    "mixed": (UNIT // 2, UNIT // 4, UNIT // 8, UNIT // 8),  # 250 GPUs, 4 allocations each
    "whole": (UNIT,),  # 1 000 GPUs, one whole-GPU allocation each
}
NEEDS = (UNIT, UNIT // 2)  # what the production request asks: one whole GPU, half of one
PRIORITIES = (0, 10, 25, 50)
CPUS = 64
SEED = 25


def build(shares: tuple[int, ...], seed: int = SEED) -> tuple[Ledger, int]:
    """A ledger whose every GPU holds ``shares``, 1 000 allocations in all; and the time after the
    last one was made (us)."""
    if ALLOCATIONS % len(shares):
        raise ValueError(f"{len(shares)} allocations per GPU do not make {ALLOCATIONS}")
    rng = random.Random(seed)
    gpus = ALLOCATIONS // len(shares)
    ledger = Ledger(
        [GpuSpec(i, f"GPU-bench-{i}") for i in range(gpus)],
        list(range(CPUS)),
        preemption=PreemptionConfig(min_runtime_us=0),
    )
    now = 1_000_000
    for g in range(gpus):
        for share in shares:
            now += rng.randint(1, 1000)
            task = f"t{len(ledger.allocations())}"
            ledger.allocate(Request(task, share, prefer=(g,), priority=rng.choice(PRIORITIES)), now)
            ledger.reachable.add(task)
    if len(ledger.allocations()) != ALLOCATIONS:
        raise RuntimeError(f"the layout made {len(ledger.allocations())} allocations, not {ALLOCATIONS}")
    return ledger, now


def time_planning(ledger: Ledger, now: int, need: int, strategy: PreemptStrategy, runs: int) -> tuple[list[int], int]:
    """``advance`` timed ``runs`` times (ns) for a production request of ``need`` waiting under
    ``strategy``, and how many victims it chose. The ledger is as it was afterwards."""
    ledger.preemption = replace(ledger.preemption, strategy=strategy)
    if ledger.allocate(Request("production", need, priority=100, wait_us=60_000_000), now + 1) is not None:
        raise RuntimeError("the production request fitted: there is nothing to plan")
    waiting = ledger.checkpoint()  # one at a time (the ledger's journal): the wait is withdrawn at the end
    samples, victims = [], set()
    try:
        for _ in range(runs):
            t0 = time.perf_counter_ns()
            effects = ledger.advance(now + 2)
            samples.append(time.perf_counter_ns() - t0)
            victims.add(sum(isinstance(e, Noticed) for e in effects))
            ledger.rollback(waiting)
    finally:
        ledger.rollback(waiting)
        ledger.release("production", now + 1)  # no notice was left: nobody to cool down
    if victims != {max(victims)} or not max(victims):
        raise RuntimeError(f"planning chose {sorted(victims)} victims: it must choose the same, at least one")
    return samples, max(victims)


def measure(runs: int) -> list[dict[str, Any]]:
    """Every layout x need x strategy: what was planned and the ``runs`` samples (us)."""
    cells = []
    for name, shares in LAYOUTS.items():
        ledger, now = build(shares)
        for need in NEEDS:
            for strategy in PreemptStrategy:
                samples, victims = time_planning(ledger, now, need, strategy, runs)
                cells.append(
                    {
                        "layout": name,
                        "gpus": ALLOCATIONS // len(shares),
                        "allocations": ALLOCATIONS,
                        "need_gpus": need / UNIT,
                        "strategy": str(strategy),
                        "victims": victims,
                        "samples_us": [s / 1000 for s in samples],
                    }
                )
    return cells
