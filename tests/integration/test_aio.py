"""The asyncio client against a real daemon: what only the asyncio driver has (cancellation, tasks;
the behaviours both clients share are in test_client_behaviour.py).

pytest runs in trio mode here, so each test is a plain function that runs its
coroutine with ``asyncio.run``. Blocking raw-protocol helpers that wait on
something our client must do first (answer a drop, release) run in a thread,
so the event loop keeps going meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import DaemonUnavailable, DropReason, ErrorCode, GpudError, ProtocolError
from gpud_client import protocol as p
from gpud_client.aio import AsyncClient, AsyncSession

from .waiting import eventually_async
from .wire import attach, connect, expect, gpu_status, nothing_arrives, request, take_lock


def holders(d: DaemonProcess, gpu: int = 0) -> list[str]:
    conn = connect(d, "observer")
    try:
        return [h.name for h in gpu_status(conn, gpu).holders]
    finally:
        conn.close()


def queue(d: DaemonProcess, gpu: int = 0) -> list[int]:
    """The sessions waiting for GPU ``gpu``, as the daemon tells a fresh observer."""
    with connect(d, "observer") as conn:
        return [w.session for w in gpu_status(conn, gpu).queue]


async def lease_states(c: AsyncClient, expected: list[str]) -> bool:
    return [le.state for le in (await c.leases()).leases] == expected


async def one_slice(s: AsyncSession) -> bool:
    async with s.slice():
        return s.holding


async def my_session_info(c: AsyncClient) -> p.SessionInfo:
    mine = [ci for ci in (await c.clients()).clients if ci.client_id == c.client_id]
    return mine[0].sessions[0]


@pytest.mark.parametrize("hooks", ["none", "coroutine on_drop releasing itself"])
def test_a_drop_between_slices_is_answered_at_once(
    daemon_factory: Callable[..., DaemonProcess], hooks: str, caplog: pytest.LogCaptureFixture
) -> None:
    d = daemon_factory("--simulate", "1", "--tq", "0.1")
    syncs: list[int] = []

    async def main() -> None:
        async with await AsyncClient.connect(d.socket) as c:
            s = await c.session(0, idle_release=None)
            if hooks != "none":

                async def on_drop(reason: DropReason) -> None:
                    await asyncio.sleep(0.01)  # a hook that takes a while: the drop is answered after it
                    await s.release()

                async def synchronize() -> None:
                    syncs.append(1)

                s.on_drop, s.synchronize = on_drop, synchronize
            async with s.slice():
                pass
            with connect(d) as other:
                so = attach(other)
                request(other, so)
                await asyncio.to_thread(expect, other, p.LockOk, 2)
                assert s.drops == 1 and not s.holding
                assert syncs == ([] if hooks == "none" else [1])
                assert await asyncio.to_thread(nothing_arrives, other, 0.1)  # one LOCK_RELEASED, no refusal
                # the next slice waits its turn
                later = asyncio.create_task(one_slice(s))
                await eventually_async(lambda: queue(d) == [s.id], "the next slice's LOCK_REQUEST is queued")
                assert not later.done()
                other.send(p.LockReleased(id=99, session=so))
                assert await asyncio.wait_for(later, 2)

    caplog.set_level(logging.WARNING, logger="gpud_client")
    asyncio.run(main())
    assert not [r for r in caplog.records if "not_holder" in r.getMessage()]


def test_limits_and_admin_calls(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, name="lim") as c:
            s = await c.session(0, framework_hooks=False)
            assert await c.set_limits(core_limit=40) == [s.id]
            await eventually_async(lambda: s.core_limit == 40, "the new core limit")  # LIMITS_CHANGED push
            await s.set_limits(mem_limit="1GiB")
            await eventually_async(lambda: s.mem_limit == 2**30, "the new memory limit")
            info = await my_session_info(c)
            assert (info.core_limit, info.mem_limit_bytes) == (40, 2**30)
            with pytest.raises(ProtocolError) as err:
                await c.set_limits("nobody-here", core_limit=5)
            assert err.value.code == ErrorCode.UNKNOWN_CLIENT
            with pytest.raises(ValueError, match="not a size"):
                await c.set_limits(mem_limit="lots")
            await c.set_tq(0.5, gpu=1)
            await c.set_mode("serial", gpu=1)
            await c.set_scheduler(False, gpu=1)
            await eventually_async(lambda: c.scheduler_on[1] is False, "GPU 1 unscheduled")  # SCHED_STATE push
            g1 = (await c.status()).gpus[1]
            assert (g1.tq_s, g1.mode, g1.scheduler_on) == (0.5, p.Mode.SERIAL, False)
            await c.set_scheduler(True, gpu=1)
            await eventually_async(lambda: c.scheduler_on[1] is True, "GPU 1 scheduled")

    asyncio.run(main())


def test_refusals_raise_protocol_error_with_their_code(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket) as c:
            with pytest.raises(ProtocolError) as err:
                await c.session("gpu:7")
            assert err.value.code == ErrorCode.UNKNOWN_GPU and "unknown GPU 'gpu:7'" in str(err.value)
            with pytest.raises(ProtocolError) as err:
                await c.set_tq(0)
            assert err.value.code == ErrorCode.INVALID
            # a refused LOCK_REQUEST is raised from the slice that sent it
            s = await c.session(0)
            await c.call(p.Detach(id=0, session=s.id))  # behind the session's back
            with pytest.raises(ProtocolError) as err:
                async with s.slice():
                    pass
            assert err.value.code == ErrorCode.UNKNOWN_SESSION and s.state == "idle"
            assert len((await c.status()).gpus) == 2  # the connection stays usable

    asyncio.run(main())


def test_no_daemon_raises_daemon_unavailable() -> None:
    async def main() -> None:
        with pytest.raises(DaemonUnavailable, match="cannot connect to gpud at /tmp/gpud-nowhere/s: .*no such socket"):
            await AsyncClient.connect("/tmp/gpud-nowhere/s")
        with pytest.raises(GpudError, match="not connected"):
            await AsyncClient("/tmp/gpud-nowhere/s").status()

    asyncio.run(main())


def test_reconnect_and_reattach_after_a_daemon_restart(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, name="survivor") as c:
            s0 = await c.session(0, idle_release=None)
            s1 = await c.session(1, idle_release=None)
            async with s1.slice():
                pass
            await asyncio.to_thread(daemon.stop)
            await eventually_async(lambda: c._wire is None and not s1.holding and s1.id == 0, "the daemon gone")
            with pytest.raises(DaemonUnavailable, match="reconnecting"):
                await c.status()
            away = asyncio.create_task(one_slice(s0))  # started while the daemon is away: it waits
            await eventually_async(lambda: s0.entering, "the slice waits for the lock")
            assert not away.done()
            await asyncio.to_thread(daemon.start)
            await eventually_async(lambda: c.reconnects == 1, "the client reconnects")
            assert await asyncio.wait_for(away, 5)
            async with s1.slice():
                assert s1.holding
            assert holders(daemon, 0) == holders(daemon, 1) == ["survivor"]
            assert (s0.gpu, s1.gpu) == (0, 1) and s0.id and s1.id
            mine = [ci for ci in (await c.clients()).clients if ci.name == "survivor"]
            assert len(mine) == 1 and len(mine[0].sessions) == 2

    asyncio.run(main())


def test_a_cancelled_wait_neither_loses_nor_keeps_the_grant(
    daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, name="impatient") as c:
            s = await c.session(0, idle_release=None)
            with connect(daemon, "other") as other:
                so = attach(other)

                async def cancelled_while_waiting() -> None:
                    task = asyncio.create_task(one_slice(s))
                    await eventually_async(lambda: s.state == "waiting", "the slice's LOCK_REQUEST is sent")
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    assert s.state == "waiting" and not s.entering  # LOCK_REQUEST cannot be withdrawn

                # 1. The grant that arrives for a cancelled waiter is given back at once.
                take_lock(other, so)
                await cancelled_while_waiting()
                other.send(p.LockReleased(id=other.next_id(), session=so))
                await eventually_async(lambda: s.grants == 1 and s.state == "idle", "the grant is given back")
                await eventually_async(lambda: holders(daemon) == [], "GPU 0 has no holder")
                # 2. A slice started after a cancelled one takes the queued grant.
                take_lock(other, so)
                await cancelled_while_waiting()
                later = asyncio.create_task(one_slice(s))
                await eventually_async(lambda: s.entering, "the later slice waits for the queued grant")
                assert not later.done()
                other.send(p.LockReleased(id=other.next_id(), session=so))
                assert await asyncio.wait_for(later, 2)
                assert s.grants == 2 and s.holding and holders(daemon) == ["impatient"]
                await s.release()
                # 3. Cancelled after the grant arrived but before the task resumed.
                take_lock(other, so)
                task = asyncio.create_task(one_slice(s))
                await eventually_async(lambda: s.state == "waiting", "the slice's LOCK_REQUEST is sent")
                receive = c._core.receive

                def cancel_on_grant(msg: Any, now: float) -> Any:
                    actions = receive(msg, now)
                    if isinstance(msg, p.LockOk):
                        task.cancel()
                    return actions

                c._core.receive = cancel_on_grant  # type: ignore[method-assign]
                other.send(p.LockReleased(id=other.next_id(), session=so))
                with pytest.raises(asyncio.CancelledError):
                    await task
                c._core.receive = receive  # type: ignore[method-assign]
                assert s.grants == 3 and s.state == "idle"
                await eventually_async(lambda: holders(daemon) == [], "GPU 0 has no holder")
                # 4. Cancelled in synchronize: the lock is given back all the same.
                hang = asyncio.Event()

                async def synchronize() -> None:
                    await hang.wait()

                s.synchronize = synchronize
                await s.acquire()
                releasing = asyncio.create_task(s.release())
                await eventually_async(lambda: s.state == "releasing", "synchronize runs")
                releasing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await releasing
                assert s.state == "idle"
                await eventually_async(lambda: holders(daemon) == [], "GPU 0 has no holder")
                assert s.grants == 4

    caplog.set_level(logging.WARNING, logger="gpud_client")
    asyncio.run(main())
    assert not [r for r in caplog.records if r.name == "gpud_client"]  # no refusal of any kind


def test_two_sessions_in_one_process_on_different_gpus(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, name="two") as c:
            s0 = await c.session(0, idle_release=None)
            s1 = await c.session(1, idle_release=None)

            async def work(s: AsyncSession) -> None:
                for _ in range(10):
                    async with s.slice():
                        await asyncio.sleep(0)

            await asyncio.gather(work(s0), work(s1))
            assert s0.holding and s1.holding and (s0.grants, s1.grants) == (1, 1)
            assert holders(daemon, 0) == holders(daemon, 1) == ["two"]
            async with s0.slice(), s1.slice():  # slices of different sessions may overlap
                pass
            async with s0.slice():
                with pytest.raises(GpudError, match="do not nest"):
                    async with s0.slice():
                        pass
            await s0.close()
            with pytest.raises(GpudError, match="closed"):
                async with s0.slice():
                    pass
            await eventually_async(lambda: holders(daemon, 0) == [], "GPU 0 has no holder")
            assert holders(daemon, 1) == ["two"]

    asyncio.run(main())


def test_async_leases_acquire_release_and_cancellation(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, name="aio-asr") as c:
            async with c.lease("gpu:0", task_type="ASR", trace={"job_id": "j", "stage": "asr"}) as r:
                assert r.acquired and r.lease_id
                assert [le.lease_id for le in (await c.leases()).leases] == [r.lease_id]
                other = await AsyncClient.connect(daemon.socket, name="aio-repair")
                skipped = await other.acquire("gpu:0", task_type="SEMANTIC_REPAIR", max_wait_ms=50)
                assert (skipped.status, skipped.reason) == ("SKIPPED", "TIMEOUT")
                waiter = asyncio.ensure_future(other.acquire("gpu:0", task_type="NMT", max_wait_ms=5000))
                await eventually_async(lambda: lease_states(c, ["holding", "waiting"]), "the NMT acquire is queued")
                waiter.cancel()  # the caller gives up while queued
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
            # the abandoned NMT acquire got the GPU after r's release and was given straight back
            await eventually_async(lambda: lease_states(c, []), "the abandoned grant is given back")
            assert (await c.leases()).leases == []
            with contextlib.suppress(RuntimeError):
                async with c.lease("gpu:0", task_type="TTS") as r2:
                    assert r2.acquired
                    raise RuntimeError("tts failed")
            assert (await c.leases()).leases == []
            await other.close()

    asyncio.run(main())
