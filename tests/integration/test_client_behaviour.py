"""One behavioural suite that the sync ``Client`` and the asyncio ``AsyncClient`` both pass.

Every test runs once per client (``[sync]``, ``[async]``) against a real daemon on a real
socket. A scenario is written once, as a coroutine run with ``asyncio.run``, against
``drivers.Driver``: the sync client's blocking calls run in worker threads, so the loop (and
with it the asyncio client) goes on meanwhile. For the same reason the raw-protocol helpers
that wait for something the client must do first (answer a drop, release a lock) run in a
thread too. Waits are on state (``eventually``), never on time; the few bounded waits that
remain show that something does *not* happen.

The scenarios at the top are the fixes of the client rewrite (a grant that comes as its caller
gives up, request ids across a reconnect, a GPU gone after a restart, a lock lost with the
connection, jittered backoff, hooks off the reader, a request over the frame limit); the basics
follow.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import (
    DaemonUnavailable,
    DropReason,
    ErrorCode,
    GpudError,
    LockLost,
    MemoryLimitExceeded,
    ProtocolError,
)
from gpud_client import protocol as p

from .drivers import KINDS, Driver, Gate, Kind
from .waiting import eventually_async
from .wire import attach, connect, expect, gpu_status, nothing_arrives, request

both = pytest.mark.parametrize("kind", KINDS)


def holders(d: DaemonProcess, gpu: int = 0) -> list[str]:
    """The names of GPU ``gpu``'s lock holders, as the daemon tells a fresh observer."""
    with connect(d, "observer") as conn:
        return [h.name for h in gpu_status(conn, gpu).holders]


async def my_leases(c: Driver) -> list[str]:
    """The states of the leases the daemon lists for this client."""
    return [le.state for le in (await c.leases()).leases if le.client_id == c.client_id]


async def leases_are(c: Driver, expected: list[str]) -> bool:
    return await my_leases(c) == expected


def config(tmp_path: Path, **values: int | float) -> str:
    """A gpud TOML configuration file with these keys."""
    path = tmp_path / "gpud.toml"
    path.write_text("".join(f"{k} = {v}\n" for k, v in values.items()))
    return str(path)


def raw_acquire(conn: Any, max_wait_ms: int = 0) -> p.LeaseResult:
    reply: p.LeaseResult = conn.call(
        p.Acquire(id=conn.next_id(), gpu="gpu:0", task_type="OTHER", max_wait_ms=max_wait_ms)
    )
    return reply


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


# --- 1. a lease granted as its caller gives up is released at once ------------------------------


async def give_up_as_the_answer_arrives(c: Driver) -> None:
    """Ask for a lease on a free GPU, and give up right after its LEASE_RESULT arrived but before the
    caller saw it. asyncio: the acquiring task is cancelled by the reader's hand-over of the answer,
    so it is cancelled before it resumes. sync: the caller's wait times out while the reader holds the
    answer back; the caller's ``abandon`` (under the client's lock) waits for it and hands it to the
    core first: the order in which the reader and the caller meet when the answer wins that race."""
    core = c.raw._core
    receive, abandon = core.receive, core.abandon
    if c.kind == "async":
        task: asyncio.Task[Any] = asyncio.create_task(c.raw.acquire("gpu:0", "OTHER", max_wait_ms=0))

        def cancel_on_answer(msg: Any, now: float) -> Any:
            actions = receive(msg, now)
            if isinstance(msg, p.LeaseResult):
                task.cancel()
            return actions

        core.receive = cancel_on_answer
        try:
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            core.receive = receive
        return
    held: list[tuple[Any, float]] = []
    arrived = threading.Event()

    def hold_the_answer(msg: Any, now: float) -> Any:
        if isinstance(msg, p.LeaseResult) and not held:
            held.append((msg, now))
            arrived.set()
            return []
        return receive(msg, now)

    def answer_then_abandon(rid: int) -> Any:
        lock = c.raw._lock  # held once, by the caller giving up: the reader may come in meanwhile
        lock.release()
        try:
            arrived.wait(5)
        finally:
            lock.acquire()
        for msg, now in held:
            c.raw._carry_out(receive(msg, now))
        return abandon(rid)

    core.receive, core.abandon = hold_the_answer, answer_then_abandon
    try:
        with pytest.raises(DaemonUnavailable, match="did not answer"):
            await c.call(p.Acquire(id=0, gpu="gpu:0", task_type="OTHER", max_wait_ms=0), timeout=0.05)
    finally:
        core.receive, core.abandon = receive, abandon
    assert held, "the LEASE_RESULT never came"


@both
def test_a_lease_granted_just_as_its_caller_gives_up_is_released_at_once(kind: Kind, daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await Driver.connect(kind, daemon.socket, name="quitter") as c:
            await give_up_as_the_answer_arrives(c)
            await eventually_async(lambda: leases_are(c, []), "the lease is released, not kept")
            with connect(daemon, "next") as other:  # nobody holds GPU 0
                r = raw_acquire(other)
                assert r.acquired and r.lease_id
                other.call(p.Release(id=other.next_id(), lease_id=r.lease_id))
            r = await c.acquire("gpu:0", max_wait_ms=0)  # the client works on
            assert r.acquired and r.lease_id and await my_leases(c) == ["holding"]
            await c.release_lease(r.lease_id)
            assert await my_leases(c) == []

    run(scenario)


@both
def test_a_lease_granted_after_its_caller_timed_out_is_released(kind: Kind, daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await Driver.connect(kind, daemon.socket, name="late") as c:
            with connect(daemon, "holder") as holder:
                held = raw_acquire(holder)
                assert held.acquired and held.lease_id
                with pytest.raises(DaemonUnavailable, match="did not answer"):
                    await c.call(p.Acquire(id=0, gpu="gpu:0", task_type="OTHER", max_wait_ms=3000), timeout=0.2)
                await eventually_async(lambda: leases_are(c, ["waiting"]), "the ACQUIRE is queued")
                holder.call(p.Release(id=holder.next_id(), lease_id=held.lease_id))  # the grant goes to c
                # max_wait is 3 s: a list empty well before says granted, then given back
                await eventually_async(lambda: leases_are(c, []), "the late grant is released", timeout=2)
                again = raw_acquire(holder)
                assert again.acquired and again.lease_id  # nobody holds GPU 0
                holder.call(p.Release(id=holder.next_id(), lease_id=again.lease_id))
            r = await c.acquire("gpu:0", max_wait_ms=0)
            assert r.acquired and r.lease_id and await my_leases(c) == ["holding"]
            await c.release_lease(r.lease_id)
            assert await my_leases(c) == [] and len((await c.status()).gpus) == 2

    run(scenario)


# --- 2. request ids given up before a reconnect ---------------------------------------------------


@both
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_an_acquire_abandoned_before_a_reconnect_does_not_swallow_a_later_answer(
    kind: Kind, stop: signal.Signals, daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """A daemon that stops still answers the queued ACQUIRE on its way out (the holder's connection
    closes first, and the waiter is granted); one that crashes does not, and then only the client
    can forget the request it gave up on."""
    d = daemon_factory("--simulate", "2", "--config", config(tmp_path, restart_grace_s=0))

    async def scenario() -> None:
        async with await Driver.connect(kind, d.socket, name="ids", request_timeout=1.0) as c:
            with connect(d, "holder") as holder:
                assert raw_acquire(holder).acquired
                with pytest.raises(DaemonUnavailable, match="did not answer"):
                    await c.call(p.Acquire(id=0, gpu="gpu:0", task_type="OTHER", max_wait_ms=3000), timeout=0.2)
                await eventually_async(lambda: leases_are(c, ["waiting"]), "the ACQUIRE is queued")
                await asyncio.to_thread(d.stop, stop)  # the holder and the queued ACQUIRE end with it
            await asyncio.to_thread(d.start)
            await eventually_async(lambda: c.reconnects == 1, "the client reconnects")
            r = await c.acquire("gpu:0", max_wait_ms=0)
            assert r.acquired and r.lease_id
            assert await my_leases(c) == ["holding"]  # held: the client did not give it back as "late"
            await c.release_lease(r.lease_id)
            assert await my_leases(c) == []

    run(scenario)


# --- 3. a daemon back with fewer GPUs ----------------------------------------------------------


@both
def test_a_session_whose_gpu_is_gone_after_a_restart_fails_alone(kind: Kind, daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await Driver.connect(kind, daemon.socket, name="fewer", unavailable_timeout=3) as c:
            keep = await c.session(0, idle_release=None)
            lost = await c.session(1, idle_release=None)
            async with lost.slice():
                pass
            await asyncio.to_thread(daemon.stop)
            daemon.args = ["--simulate", "1"]
            await asyncio.to_thread(daemon.start)
            await eventually_async(lambda: c.reconnects == 1, "reconnected although GPU 1 is gone")
            async with keep.slice():
                assert keep.holding
            assert holders(daemon) == ["fewer"]
            with pytest.raises(GpudError, match=r"could not be re-attached.*unknown GPU"):
                async with lost.slice():
                    pass
            with pytest.raises(GpudError, match=r"could not be re-attached.*unknown GPU"):  # again, not "nest"
                async with lost.slice():
                    pass
            async with keep.slice():  # the other session is untouched
                assert keep.holding and keep.grants == 1  # kept since its first slice

    run(scenario)


# --- 4. a lock held when the connection died -----------------------------------------------------


@both
def test_a_lock_lost_with_the_connection_is_told_at_once_and_raised_at_the_end(
    kind: Kind, daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "1", "--config", config(tmp_path, restart_grace_s=0))
    lost: list[BaseException] = []

    async def scenario() -> None:
        async with await Driver.connect(kind, d.socket, name="lost", unavailable_timeout=5) as c:
            s = await c.session(0, idle_release=None, on_lost=lost.append)
            with pytest.raises(LockLost, match="lost the GPU lock on GPU 0"):
                async with s.slice():
                    await asyncio.to_thread(d.stop, 9)
                    await eventually_async(lambda: lost, "on_lost is called while the slice runs")
                    assert isinstance(lost[0], LockLost) and not s.holding
            await asyncio.to_thread(d.start)
            await eventually_async(lambda: c.reconnects == 1 and s.id != 0, "reconnected and re-attached")
            await s.acquire()
            await asyncio.to_thread(d.stop, 9)
            await eventually_async(lambda: len(lost) == 2, "on_lost is called for the second loss")
            with pytest.raises(LockLost):
                await s.release()
            await asyncio.to_thread(d.start)
            await eventually_async(lambda: c.reconnects == 2 and s.id != 0, "reconnected and re-attached again")
            async with s.slice():  # raises nothing: each loss is raised once
                assert s.holding
            assert holders(d) == ["lost"] and len(lost) == 2

    run(scenario)


# --- 5. jittered reconnect backoff ------------------------------------------------------------


@both
def test_reconnect_backoff_is_jittered(kind: Kind, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpud_client._async_driver as async_driver
    import gpud_client._sync_driver as sync_driver

    driver = sync_driver if kind == "sync" else async_driver
    real = driver.reconnect_delay
    draws = iter([0.0, 0.5, 0.2, 0.8, 0.9, 0.1] + [0.5] * 100)
    waits: list[tuple[int, float, float]] = []

    class Draws:
        @staticmethod
        def random() -> float:
            return next(draws)

    def recording(attempt: int, draw: float) -> float:
        delay: float = real(attempt, draw)
        waits.append((attempt, draw, delay))
        return delay

    monkeypatch.setattr(driver, "random", Draws)
    monkeypatch.setattr(driver, "reconnect_delay", recording)

    async def scenario() -> None:
        async with await Driver.connect(kind, daemon.socket, name="jitter") as c:
            await asyncio.to_thread(daemon.stop)
            await eventually_async(lambda: len(waits) >= 3, "three waits while the daemon is away")
            await asyncio.to_thread(daemon.start)
            await eventually_async(lambda: c.reconnects == 1, "the client reconnects")

    run(scenario)
    assert [(a, d) for a, d, _ in waits[:3]] == [(0, 0.0), (1, 0.5), (2, 0.2)]
    assert [round(w, 6) for _, _, w in waits[:3]] == [0.025, 0.075, 0.12]  # half to all of 50, 100, 200 ms
    for attempt, _, wait in waits:
        ceiling = min(0.05 * 2**attempt, 2.0)
        assert ceiling / 2 <= wait <= ceiling


# --- 6. user hooks run off the reader and outside the client's lock ------------------------------


@both
def test_a_slow_on_drop_delays_no_push_for_another_session(
    kind: Kind, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = daemon_factory("--simulate", "2", "--tq", "0.1")
    gate = Gate()

    async def slow_on_drop(reason: DropReason) -> None:
        await gate.wait()

    async def scenario() -> None:
        async with await Driver.connect(kind, d.socket, name="hooks") as c:
            a = await c.session(0, idle_release=None, on_drop=slow_on_drop)
            b = await c.session(1, idle_release=None)
            async with a.slice():
                pass
            async with b.slice():
                pass
            with connect(d, "want0") as o0, connect(d, "want1") as o1:
                s0, s1 = attach(o0, 0), attach(o1, 1)
                request(o0, s0)
                await eventually_async(gate.reached.is_set, "A's on_drop runs")
                # A's hook blocks; B's DROP_LOCK is answered all the same ...
                request(o1, s1)
                assert (await asyncio.to_thread(expect, o1, p.LockOk, 3)).session == s1
                assert not b.holding and a.holding
                # ... and B's next LOCK_OK arrives while A's hook still blocks
                entered = asyncio.Event()

                async def b_slice() -> None:
                    async with b.slice():
                        entered.set()

                task = asyncio.create_task(b_slice())
                await eventually_async(lambda: [w.name for w in gpu_status(o0, 1).queue] == ["hooks"], "B is queued")
                o1.send(p.LockReleased(id=o1.next_id(), session=s1))
                await asyncio.wait_for(task, 3)
                assert entered.is_set() and b.holding and holders(d, 0) == ["hooks"]
                gate.open()
                assert (await asyncio.to_thread(expect, o0, p.LockOk, 3)).session == s0
                assert not a.holding

    try:
        run(scenario)
    finally:
        gate.open()


@both
def test_an_on_drop_may_call_the_client(kind: Kind, daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "2", "--tq", "0.1")

    async def scenario() -> None:
        async with await Driver.connect(kind, d.socket, name="asks", request_timeout=2) as c:
            seen: list[list[str]] = []

            async def on_drop(reason: DropReason) -> None:
                st = await c.status()  # a round trip through the reader, from the hook
                seen.append([h.name for h in st.gpus[0].holders])

            s = await c.session(0, idle_release=None, on_drop=on_drop)
            async with s.slice():
                pass
            with connect(d, "other") as other:
                so = attach(other)
                request(other, so)
                assert (await asyncio.to_thread(expect, other, p.LockOk, 4)).session == so
            assert seen == [["asks"]] and not s.holding  # the status came while it still held the lock
            assert len((await c.status()).gpus) == 2

    run(scenario)


@both
def test_an_on_drop_may_release_the_session_itself_once(
    kind: Kind, daemon_factory: Callable[..., DaemonProcess], caplog: pytest.LogCaptureFixture
) -> None:
    d = daemon_factory("--simulate", "2", "--tq", "0.1")
    syncs: list[int] = []

    async def scenario() -> None:
        async with await Driver.connect(kind, d.socket, name="self") as c:
            s = await c.session(0, idle_release=None, synchronize=lambda: syncs.append(1))

            async def on_drop(reason: DropReason) -> None:
                await s.release()

            s.set_hook("on_drop", on_drop)
            async with s.slice():
                pass
            with connect(d, "other") as other:
                so = attach(other)
                request(other, so)
                assert (await asyncio.to_thread(expect, other, p.LockOk, 3)).session == so
                await eventually_async(lambda: s.state == "idle", "the session released")
                # a bounded window, in which a second LOCK_RELEASED would come back refused (logged)
                assert await asyncio.to_thread(nothing_arrives, other, 0.2)
                assert [h.name for h in gpu_status(other).holders] == ["other"]
            assert syncs == [1] and s.drops == 1 and s.grants == 1

    caplog.set_level(logging.WARNING, logger="gpud_client")
    run(scenario)
    assert not [r.getMessage() for r in caplog.records if r.name == "gpud_client"]  # no refusal (not_holder)


# --- 7. a request over the daemon's frame limit -------------------------------------------------


@both
def test_a_request_over_the_frame_limit_is_refused_before_it_is_sent(
    kind: Kind, daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "2", "--config", config(tmp_path, max_frame_bytes=16384))
    prefer: list[int | str] = [f"GPU-{uuid.UUID(int=i)}" for i in range(1000)]  # about 42 KB of UUIDs

    async def scenario() -> None:
        async with await Driver.connect(kind, d.socket, name="big") as c:
            s = await c.session(0, idle_release=None)
            async with s.slice():
                pass
            with pytest.raises(ProtocolError, match="16384") as err:
                await c.allocate("t", gpus=1, prefer=prefer)
            assert err.value.code == ErrorCode.FRAME_TOO_LARGE and "max_frame_bytes" in str(err.value)
            assert s.holding and c.reconnects == 0
            assert [h.name for h in (await c.status()).gpus[0].holders] == ["big"]
            assert holders(d) == ["big"]

    run(scenario)


# --- 8. the basics ------------------------------------------------------------------------------


@both
def test_the_lock_is_kept_between_slices(kind: Kind, daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await Driver.connect(kind, daemon.socket, name="loop") as c:
            s = await c.session(0, idle_release=None)
            for _ in range(20):
                async with s.slice():
                    assert s.holding
            assert s.holding and s.grants == 1
            assert holders(daemon) == ["loop"] and (await c.status()).gpus[0].grants == 1

    run(scenario)


@both
def test_an_unused_lock_is_released_after_idle_release(kind: Kind, daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with await Driver.connect(kind, daemon.socket, name="idle") as c:
            s = await c.session(0, idle_release=0.2)
            async with s.slice():
                pass
            t0 = loop.time()
            assert s.holding
            await eventually_async(lambda: not s.holding, "the idle lock is released")
            assert loop.time() - t0 >= 0.15
            await eventually_async(lambda: holders(daemon) == [], "GPU 0 has no holder")
            assert s.grants == 1

    run(scenario)


@both
def test_a_pending_drop_releases_at_slice_exit_after_on_drop_and_synchronize(
    kind: Kind, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = daemon_factory("--simulate", "1", "--tq", "0.1")
    events: list[str] = []
    holders_at_sync: list[list[str]] = []

    def synchronize() -> None:
        holders_at_sync.append(holders(d))
        events.append("sync")

    async def scenario() -> None:
        async with await Driver.connect(kind, d.socket, name="trainer") as c:
            s = await c.session(
                0, idle_release=None, on_drop=lambda r: events.append(f"drop:{r}"), synchronize=synchronize
            )
            with connect(d, "other") as other:
                so = attach(other)
                async with s.slice():
                    request(other, so)
                    # told at once, while the slice runs
                    await eventually_async(lambda: events == ["drop:tq"], "on_drop is called")
                    assert s.drop_pending == DropReason.TQ and holders(d) == ["trainer"]
                assert events == ["drop:tq", "sync"] and not s.holding and s.drops == 1
                assert holders_at_sync == [["trainer"]]  # synchronize ran before LOCK_RELEASED
                assert (await asyncio.to_thread(expect, other, p.LockOk)).session == so

    run(scenario)


@both
def test_slices_do_not_nest_and_a_closed_session_refuses_slices(kind: Kind, daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await Driver.connect(kind, daemon.socket, name="nest") as c:
            s = await c.session(0)
            async with s.slice():
                with pytest.raises(GpudError, match="do not nest"):
                    async with s.slice():
                        pass
                assert s.holding
            await s.close()
            with pytest.raises(GpudError, match="closed"):
                async with s.slice():
                    pass
            await eventually_async(lambda: holders(daemon) == [], "GPU 0 has no holder")

    run(scenario)


@both
def test_acquire_keeps_the_lock_until_release(kind: Kind, daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await Driver.connect(kind, daemon.socket, name="pinned") as c:
            s = await c.session(0, idle_release=0.05)
            witness = await c.session(1, idle_release=0.05)
            await s.acquire()
            async with witness.slice():
                pass
            # the idle sweep that gives back the witness's lock comes after s's idle deadline too
            await eventually_async(lambda: not witness.holding, "the witness's idle lock is released")
            assert s.holding and holders(daemon) == ["pinned"]
            await s.release()
            assert not s.holding
            await eventually_async(lambda: holders(daemon) == [], "GPU 0 has no holder")

    run(scenario)


@both
def test_while_the_daemon_is_away_a_slice_raises_or_runs_unarbitrated(kind: Kind, daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with (
            await Driver.connect(kind, daemon.socket, unavailable_timeout=0.3) as strict,
            await Driver.connect(kind, daemon.socket, unavailable_timeout=0.1, proceed_unarbitrated=True) as lax,
        ):
            s, t = await strict.session(0), await lax.session(1)
            await asyncio.to_thread(daemon.stop)
            await eventually_async(lambda: not (strict.connected or lax.connected), "both see the daemon gone")
            t0 = loop.time()
            with pytest.raises(DaemonUnavailable, match="unreachable for 0.3 s"):
                async with s.slice():
                    pass
            assert loop.time() - t0 >= 0.25 and not s.in_slice
            ran = False
            async with t.slice():
                ran = not t.holding
            assert ran and not t.holding

    run(scenario)


@both
def test_memory_above_the_limit_raises_at_the_next_slice(kind: Kind, daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await Driver.connect(kind, daemon.socket, name="greedy") as c:
            s = await c.session(0, mem_estimate="1GiB", mem_limit="2GiB", framework_hooks=False)
            async with s.slice():
                await s.report_memory(3 * 2**30)
            await eventually_async(lambda: s.mem_error is not None, "the memory error arrives")
            with pytest.raises(MemoryLimitExceeded, match="above its limit of 2147483648 bytes") as err:
                async with s.slice():
                    pass
            assert err.value.used_bytes == 3 * 2**30
            async with s.slice():  # raised once; the next slice runs
                assert s.holding

    run(scenario)
