"""The one way the shell carries out effects: routing, containment, the GPU timer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from gpud.core.scheduler import GpuScheduler
from gpud.host.config import Config
from gpud.host.devices import simulated_gpus
from gpud.host.metrics import Metrics
from gpud.kit.effects import Effects
from gpud.kit.faults import Faults
from gpud.kit.state import GpuSlot
from gpud.serving.server import scheduler_config


@dataclass(frozen=True)
class Granted:
    session: int


@dataclass(frozen=True)
class Denied:  # an effect only leases have
    session: int


@dataclass(frozen=True)
class Stray:
    session: int


def effects() -> tuple[Effects, CollectorRegistry, list[tuple[str, Any]]]:
    registry = CollectorRegistry()
    seen: list[tuple[str, Any]] = []
    fx = Effects(Faults(Metrics(registry)))
    fx.on(Granted, lambda e, now: seen.append(("session", e)))
    fx.on_lease(Granted, lambda e, now: seen.append(("lease", e)))
    fx.on_lease(Denied, lambda e, now: seen.append(("lease", e)))
    fx.leases_are({7})
    return fx, registry, seen


def faults(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("gpud_faults_total", {"where": "effect"}) or 0.0


def test_an_effect_goes_to_the_lease_or_the_session_that_owns_its_id() -> None:
    fx, _, seen = effects()
    fx.carry_out([Granted(7), Granted(3), Denied(7)], now=0)
    assert seen == [("lease", Granted(7)), ("session", Granted(3)), ("lease", Denied(7))]


def test_a_lease_effect_after_its_lease_is_gone_tells_nobody_and_is_no_fault() -> None:
    fx, registry, seen = effects()
    fx.carry_out([Denied(8)], now=0)
    assert seen == [] and faults(registry) == 0


def test_a_failing_or_unknown_effect_is_counted_and_skipped_and_the_rest_run() -> None:
    fx, registry, seen = effects()

    def boom(e: Any, now: int) -> None:
        raise RuntimeError("a push that fails")

    fx.on(Granted, boom)
    with structlog.testing.capture_logs() as logs:
        fx.carry_out([Granted(3), Stray(1), Granted(7)], now=0)
    assert seen == [("lease", Granted(7))] and faults(registry) == 2
    assert [e["effect"] for e in logs if e["event"] == "fault"] == ["Granted", "Stray"]
    assert any("no handler for Stray" in e["error"] for e in logs)


def test_a_schedulers_earlier_deadline_wakes_its_timer_and_a_later_one_does_not() -> None:
    config = Config(socket="/nonexistent", metrics_addr="off")
    gpu = simulated_gpus("1")[0]
    sched = GpuScheduler(scheduler_config(config, gpu), now=0)
    slot = GpuSlot(gpu, sched)
    fx, _, _ = effects()
    sched.attach(1, 0)
    sched.attach(2, 0)
    fx.carry_out(sched.request(1, 0), 0, slot)
    slot.armed_for = None
    fx.carry_out(sched.request(2, 0), 0, slot)  # a waiter behind a holder: its quantum now has an end
    assert slot.wake.is_set()
    deadline = sched.next_deadline()
    assert deadline is not None
    slot.wake = type(slot.wake)()
    slot.armed_for = deadline - 1  # the timer already sleeps toward something earlier
    fx.carry_out([], 0, slot)
    assert not slot.wake.is_set()
