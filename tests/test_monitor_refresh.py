"""The gauge refresh in bounded pieces (gpud.serving.monitor.publish): at 10 000 sessions one pass must not
hold the event loop, so it works in steps of at most ``sessions`` sessions, the monitor yields to
the loop between them, and the gauges come out right although sessions come and go in between.

In process, no sockets and no timing: steps are counted by the sessions each one reads."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import trio
from prometheus_client import CollectorRegistry

from gpud.host.config import Config
from gpud.host.devices import simulated_gpus
from gpud.host.metrics import Metrics
from gpud.kit.state import ClientLink
from gpud.main import SLOW_TURN_ENV, instruments
from gpud.serving.monitor import Monitor, publish
from gpud.serving.server import Daemon
from gpud_client import protocol as p

PER_CONNECTION = 100


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    workdir = tempfile.mkdtemp(prefix="gpud-m-", dir="/tmp")
    config = Config(socket=os.path.join(workdir, "s"), state_dir=os.path.join(workdir, "st"), metrics_addr="off")
    d = Daemon(config, simulated_gpus("2x16GiB"), Metrics(CollectorRegistry()))
    try:
        yield d
    finally:
        d.allocations.store.close()


def client(d: Daemon, pid: int, name: str) -> ClientLink:
    conn = d.links.open((pid, 0, 0), frozenset(), -1, trio.CancelScope())
    assert isinstance(d.handle(conn, p.Hello(id=0, version=p.PROTOCOL_VERSION, name=name)), p.Welcome)
    return conn


def attach(d: Daemon, conn: ClientLink, gpu: int, **limits: Any) -> int:
    reply = d.handle(conn, p.Attach(id=1, gpu=gpu, **limits))
    assert isinstance(reply, p.Attached)
    return reply.session


def values(d: Daemon) -> dict[str, dict[str, float]]:
    """Every per-session sample: session -> {metric name: value}."""
    out: dict[str, dict[str, float]] = {}
    for family in (
        d.metrics.node.session_core_limit,
        d.metrics.node.session_window_used,
        d.metrics.node.session_throttled,
        d.metrics.node.session_memory,
        d.metrics.node.session_memory_limit,
    ):
        for metric in family.collect():
            for s in metric.samples:
                out.setdefault(s.labels["session"], {})[s.name] = s.value
    return out


def expected(d: Daemon, sid: int, gpu: int) -> dict[str, float]:
    v = d.slots[gpu].scheduler.session(sid, d.now())
    want = {
        "gpud_session_core_limit_ratio": v.core_limit / 100,
        "gpud_session_window_used_seconds": v.used_us / 1e6,
        "gpud_session_throttled": 1.0 if v.throttled else 0.0,
        "gpud_session_memory_bytes": float(v.mem_used or 0),
    }
    if v.mem_limit is not None:
        want["gpud_session_memory_limit_bytes"] = float(v.mem_limit)
    return want


def counting_reads(d: Daemon, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the session figures each scheduler gives out: ``reads[0]`` grows by one a session."""
    reads = [0]
    for slot in d.slots:
        real = slot.scheduler.session

        def session(sid: int, now: int, real: Any = real) -> Any:
            reads[0] += 1
            return real(sid, now)

        monkeypatch.setattr(slot.scheduler, "session", session)
    return reads


def test_a_refresh_goes_in_bounded_steps_and_the_gauges_come_out_right(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = daemon
    with structlog.testing.capture_logs():
        conns = [client(d, 1000 + i, f"c{i}") for i in range(10)]
        sessions = {
            (c.client_id, attach(d, c, i % 2, **({"mem_limit": 2**30} if i < 2 else {}))): (c, i % 2)
            for c in conns
            for i in range(PER_CONNECTION)
        }
        d.handle(conns[0], p.Acquire(id=2, gpu=1, task_type="ASR"))
        assert any(d.leases.owns(sid) for sid in conns[0].sessions)  # a lease: no per-session gauges
    ghost = ("0", "999999", "ghost", "1")  # the series of a session gone without them
    d.metrics.node.session_core_limit.labels(*ghost).set(1)
    d.metrics.node.session_children[ghost] = (d.metrics.node.session_core_limit.labels(*ghost),) * 4
    reads = counting_reads(d, monkeypatch)

    steps = publish(d, sessions=64)
    per_step = [reads[0]]
    changed = False
    for _ in steps:
        per_step.append(reads[0] - sum(per_step))
        if not changed and sum(per_step) > 300:  # mid-pass: sessions come and go, a limit is lifted
            changed = True
            with structlog.testing.capture_logs():
                gone_conn = conns[9]  # not refreshed yet: the snapshot is in connection order
                d.close(gone_conn)
                detached_sid = next(sid for (cid, sid), (c, _) in sessions.items() if c is conns[8])
                assert isinstance(d.handle(conns[8], p.Detach(id=3, session=detached_sid)), p.Ok)
                lifted = next(sid for (cid, sid), (c, _) in sessions.items() if c is conns[7])
                d.slots[0].scheduler.set_limits(lifted, d.now(), mem_limit=0, authority=True)
                late = attach(d, conns[0], 0)
    per_step.append(reads[0] - sum(per_step))
    assert changed
    assert max(per_step) <= 64, per_step
    assert len([n for n in per_step if n]) >= 1000 // 64  # it went in steps, not at once

    got = values(d)
    for (_, sid), (c, gpu) in sessions.items():
        if c is conns[9] or sid == detached_sid:
            assert str(sid) not in got, sid  # gone mid-pass: not brought back
        else:
            assert got[str(sid)] == expected(d, sid, gpu), sid
    assert "gpud_session_memory_limit_bytes" not in got[str(lifted)]
    assert str(late) not in got  # attached mid-pass: the next pass has it
    for _ in publish(d, sessions=64):
        pass
    assert values(d)[str(late)] == expected(d, late, 0)
    # The backstop: more sessions with series than attached (once ``late`` has its own).
    assert "999999" not in values(d) and ghost not in d.metrics.node.session_children
    assert len(values(d)) == 9 * PER_CONNECTION  # the lease has no per-session gauges


def test_a_few_sessions_are_refreshed_by_the_call_alone(daemon: Daemon) -> None:
    with structlog.testing.capture_logs():
        conn = client(daemon, 1000, "few")
        sids = [attach(daemon, conn, 0) for _ in range(20)]
    publish(daemon)  # not iterated
    assert sorted(values(daemon)) == sorted(str(s) for s in sids)


async def test_the_monitor_yields_to_the_loop_between_steps(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon
    with structlog.testing.capture_logs():
        for i in range(10):
            conn = client(d, 1000 + i, f"c{i}")
            for _ in range(PER_CONNECTION):
                attach(d, conn, 0)
    reads = counting_reads(d, monkeypatch)
    monkeypatch.setattr("gpud.serving.monitor.REFRESH_SESSIONS", 50)
    seen_between: list[int] = []  # sessions read when another task got to run

    started = trio.Event()

    async def other_task() -> None:
        started.set()
        while True:
            seen_between.append(reads[0])
            await trio.sleep(0)  # a checkpoint: the task gives its turn back after each look

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await started.wait()
        await Monitor(d, None)._publish()
        nursery.cancel_scope.cancel()
    # The other task ran at every step: trio runs each task once a batch, in either order, so
    # between two of its turns the refresh made one or two steps of at most 50 sessions.
    during = sorted({n for n in seen_between if 0 < n < 1000})
    assert all(b - a <= 2 * 50 for a, b in zip([0, *during], [*during, 1000])), during
    assert len(values(d)) == 1000


def test_the_slow_turn_instrument_logs_a_turn_that_holds_the_loop() -> None:
    """$GPUD_DEBUG_SLOW_TURN_MS (bench/scale.py reads what it logs): a task that computes 5 ms
    without a checkpoint makes one turn of at least 5 ms."""

    async def main() -> None:
        await trio.sleep(0)  # checkpoints, not waits: they begin and end the turn measured
        began = time.perf_counter()
        while time.perf_counter() - began < 0.005:
            pass
        await trio.sleep(0)

    with structlog.testing.capture_logs() as logs:
        trio.run(main, instruments=instruments({SLOW_TURN_ENV: "1"}))
    slow = [e for e in logs if e["event"] == "loop_turn_slow"]
    assert any(e["turn_ms"] >= 5 and {"cpu_ms", "gc_ms"} <= set(e) for e in slow), logs
    assert instruments({}) == [] and instruments({SLOW_TURN_ENV: ""}) == []
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match=SLOW_TURN_ENV):
            instruments({SLOW_TURN_ENV: bad})
