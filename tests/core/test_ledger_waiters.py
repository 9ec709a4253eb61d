"""Suspended allocations waiting in any number are read by the GPU they wait for, not walked: on
random sequences the ledger serves and chooses exactly as one that walks every waiter, in queue
order, at every call. Pure: fake integer time."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import pytest

import gpud.core.ledger.notices as notices
import gpud.core.ledger.placement as placement
import gpud.core.ledger.takeback as takeback
import gpud.core.ledger.waits as waits
from gpud.core.ledger import Insufficient, Ledger, LedgerEffect, LedgerState, Request, Served
from gpud.core.ledger_index import Queued
from gpud_client.protocol import Recovery

from . import test_ledger_scale as scale
from .test_ledger_scale import S, ledger_state, node, random_request, step


def serve_walking_all(st: LedgerState, now: int) -> list[LedgerEffect]:
    """``waits.serve`` as it was: every waiter tried, in queue order (no batch: the sequences are small)."""
    effects: list[LedgerEffect] = []
    for _, _, task_id in sorted([*st.waiters, *st.index.parked_order]):
        w = st.waiting.get(task_id)
        if w is None:
            continue
        try:
            alloc = placement.place(st, w.request, now, w.suspended)
        except Insufficient as short:
            st.why[task_id] = short
            continue
        del st.waiting[task_id]
        del st.why[task_id]
        if w.suspended is None:
            st.waiters = [x for x in st.waiters if x[2] != task_id]
        effects.append(Served(alloc, resumed=w.suspended is not None))
        effects += notices.withdraw_for(st, w, now)
    return effects


def walk_all(led: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    """``led`` serves and chooses as a walk over every waiter would (any other ledger as it does)."""
    serve, parked_planning = waits.serve, takeback.parked_planning

    def serving(st: LedgerState, now: int) -> list[LedgerEffect]:
        return serve_walking_all(st, now) if st is led.state else serve(st, now)

    def planning(st: LedgerState, choose: bool) -> set[Queued]:
        return set(st.index.parked_order) if st is led.state else parked_planning(st, choose)

    monkeypatch.setattr(waits, "serve", serving)
    monkeypatch.setattr(takeback, "parked_planning", planning)


def state(led: Ledger) -> Any:
    """The ledger's state but why the suspended ones wait (not read when they cannot fit)."""
    name, attrs = ledger_state(led)  # type: ignore[misc]
    attrs["why"] = {t: why for t, why in attrs["why"].items() if led.state.waiting[t].suspended is None}
    return name, attrs


def suspending(rng: random.Random, task: str) -> Request:
    req = random_request(rng, task)
    if rng.random() < 0.6 and not req.gpus_max:
        req = replace(req, on_preempt=Recovery.SUSPEND)
    return req


@pytest.mark.parametrize("seed", range(40))
def test_serving_and_choosing_read_the_waiters_that_may_fit_as_a_walk_over_all_would(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scale, "random_request", suspending)
    rng = random.Random(9000 + seed)
    strategy = rng.choice(list(scale.PreemptStrategy))
    fast, walking = node(strategy=strategy), node(strategy=strategy)
    walk_all(walking, monkeypatch)
    tasks = [f"t{i}" for i in range(9)]
    now = 0
    for _ in range(250):
        now += rng.choice([1, S, 10 * S, 30 * S, 300 * S])
        seed_step = rng.random()
        calls = [answers(led, partial(one_step, seed=seed_step, now=now, tasks=tasks)) for led in (fast, walking)]
        assert calls[0] == calls[1]
        assert state(fast) == state(walking)


def one_step(led: Ledger, *, seed: float, now: int, tasks: list[str]) -> None:
    step(led, random.Random(seed), now, tasks)


def answers(led: Ledger, act: Callable[[Ledger], None]) -> list[tuple[str, str]]:
    """What the ledger answered to each call ``act`` made of it."""
    calls: list[tuple[str, str]] = []
    real = {name: getattr(led, name) for name in ("advance", "release", "yield_", "drain")}

    def record(name: str, fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            result = fn(*args, **kw)
            calls.append((name, repr(result)))
            return result

        return call

    try:
        for name, fn in real.items():
            setattr(led, name, record(name, fn))
        act(led)
    finally:
        for name in real:
            delattr(led, name)
    return calls
