"""The asyncio client library against a real daemon.

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

import pytest

from gpud.spawn import DaemonProcess
from gpud_client import DaemonUnavailable, DropReason, ErrorCode, GpudError, MemoryLimitExceeded, ProtocolError
from gpud_client import protocol as p
from gpud_client.aio import AsyncClient, AsyncSession

from .wire import attach, connect, expect, gpu_status, nothing_arrives, request, take_lock


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def holders(d: DaemonProcess, gpu: int = 0) -> list[str]:
    conn = connect(d, "observer")
    try:
        return [h.name for h in gpu_status(conn, gpu).holders]
    finally:
        conn.close()


async def one_slice(s: AsyncSession) -> bool:
    async with s.slice():
        return s.holding


async def my_session_info(c: AsyncClient) -> p.SessionInfo:
    mine = [ci for ci in (await c.clients()).clients if ci.client_id == c.client_id]
    return mine[0].sessions[0]


def test_the_lock_is_kept_between_slices(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, name="loop") as c:
            s = await c.session(0, idle_release=None)
            for _ in range(20):
                async with s.slice():
                    assert s.holding
            assert s.holding and s.grants == 1
            assert holders(daemon) == ["loop"] and (await c.status()).gpus[0].grants == 1

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["plain", "coroutine"])
def test_a_pending_drop_releases_at_slice_exit_with_on_drop_and_synchronize(
    daemon_factory: Callable[..., DaemonProcess], kind: str
) -> None:
    d = daemon_factory("--simulate", "1", "--tq", "0.1")
    events: list[str] = []
    holders_at_sync: list[list[str]] = []

    def on_drop_plain(reason: DropReason) -> None:
        events.append(f"drop:{reason}")

    def sync_plain() -> None:
        holders_at_sync.append(holders(d))
        events.append("sync")

    async def on_drop_coroutine(reason: DropReason) -> None:
        await asyncio.sleep(0)
        events.append(f"drop:{reason}")

    async def sync_coroutine() -> None:
        await asyncio.sleep(0.05)
        sync_plain()

    async def main() -> None:
        async with await AsyncClient.connect(d.socket, name="trainer") as c:
            s = await c.session(
                0, idle_release=None,
                on_drop=on_drop_plain if kind == "plain" else on_drop_coroutine,
                synchronize=sync_plain if kind == "plain" else sync_coroutine,
            )
            with connect(d, "other") as other:
                so = attach(other)
                async with s.slice():
                    request(other, so)
                    await wait_for(lambda: events == ["drop:tq"])  # told at once, while the slice still runs
                    assert s.drop_pending == DropReason.TQ and holders(d) == ["trainer"]
                assert events == ["drop:tq", "sync"] and not s.holding and s.drops == 1
                assert holders_at_sync == [["trainer"]]  # synchronize ran before LOCK_RELEASED
                assert (await asyncio.to_thread(expect, other, p.LockOk)).session == so

    asyncio.run(main())


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
                    await asyncio.sleep(0.01)
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
                await asyncio.sleep(0.1)
                assert not later.done()
                other.send(p.LockReleased(id=99, session=so))
                assert await asyncio.wait_for(later, 2)

    caplog.set_level(logging.WARNING, logger="gpud_client")
    asyncio.run(main())
    assert not [r for r in caplog.records if "not_holder" in r.getMessage()]


def test_an_unused_lock_is_released_after_idle_release(daemon: DaemonProcess) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with await AsyncClient.connect(daemon.socket) as c:
            s = await c.session(0, idle_release=0.2)
            for _ in range(4):  # slices closer together than idle_release keep it
                async with s.slice():
                    pass
                await asyncio.sleep(0.08)
            assert s.holding and s.grants == 1
            t0 = loop.time()
            await wait_for(lambda: not s.holding)
            assert loop.time() - t0 >= 0.1  # 0.2 s after the last slice, 0.08 s before t0
            await wait_for(lambda: holders(daemon) == [])

    asyncio.run(main())


def test_memory_above_the_limit_raises_at_the_next_slice(daemon: DaemonProcess) -> None:
    use = [0]

    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, name="greedy") as c:
            s = await c.session(0, mem_estimate="1GiB", mem_limit="2GiB", framework_hooks=False)
            async with s.slice():
                await s.report_memory(3 * 2**30)
            await wait_for(lambda: s.mem_error is not None)
            with pytest.raises(MemoryLimitExceeded, match="above its limit of 2147483648 bytes") as err:
                async with s.slice():
                    pass
            assert err.value.used_bytes == 3 * 2**30
            async with s.slice():  # raised once; the next slice runs
                pass
            info = await my_session_info(c)
            assert (info.mem_used_bytes, info.mem_violations) == (3 * 2**30, 1)
            await s.close()
            probed = await c.session(1, memory_probe=lambda: use[0])
            use[0] = 5 * 2**30
            async with probed.slice():
                pass
            await wait_for(lambda: probed.mem_reported == 5 * 2**30)

    asyncio.run(main())


def test_limits_and_admin_calls(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, name="lim") as c:
            s = await c.session(0, framework_hooks=False)
            assert await c.set_limits(core_limit=40) == [s.id]
            await wait_for(lambda: s.core_limit == 40)  # LIMITS_CHANGED push
            await s.set_limits(mem_limit="1GiB")
            await wait_for(lambda: s.mem_limit == 2**30)
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
            await wait_for(lambda: c.scheduler_on[1] is False)  # SCHED_STATE push
            g1 = (await c.status()).gpus[1]
            assert (g1.tq_s, g1.mode, g1.scheduler_on) == (0.5, p.Mode.SERIAL, False)
            await c.set_scheduler(True, gpu=1)
            await wait_for(lambda: c.scheduler_on[1] is True)

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
            await wait_for(lambda: c._wire is None and not s1.holding and s1.id == 0)
            with pytest.raises(DaemonUnavailable, match="reconnecting"):
                await c.status()
            away = asyncio.create_task(one_slice(s0))  # started while the daemon is away: it waits
            await asyncio.sleep(0.1)
            assert not away.done()
            await asyncio.to_thread(daemon.start)
            await wait_for(lambda: c.reconnects == 1)
            assert await asyncio.wait_for(away, 5)
            async with s1.slice():
                assert s1.holding
            assert holders(daemon, 0) == holders(daemon, 1) == ["survivor"]
            assert (s0.gpu, s1.gpu) == (0, 1) and s0.id and s1.id
            mine = [ci for ci in (await c.clients()).clients if ci.name == "survivor"]
            assert len(mine) == 1 and len(mine[0].sessions) == 2

    asyncio.run(main())


def test_while_the_daemon_is_away_a_slice_raises_or_proceeds_as_configured(daemon: DaemonProcess) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        strict = await AsyncClient.connect(daemon.socket, unavailable_timeout=0.3)
        lax = await AsyncClient.connect(daemon.socket, unavailable_timeout=0.1, proceed_unarbitrated=True)
        try:
            s, t = await strict.session(0), await lax.session(1)
            await asyncio.to_thread(daemon.stop)
            await wait_for(lambda: strict._wire is None and lax._wire is None)
            t0 = loop.time()
            with pytest.raises(DaemonUnavailable, match="unreachable for 0.3 s"):
                async with s.slice():
                    pass
            assert loop.time() - t0 >= 0.25 and not s.in_slice
            ran = False
            async with t.slice():
                ran = True
            assert ran and not t.holding
        finally:
            await strict.close()
            await lax.close()

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
                    await wait_for(lambda: s.state == "waiting")
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    assert s.state == "waiting" and not s.entering  # LOCK_REQUEST cannot be withdrawn

                # 1. The grant that arrives for a cancelled waiter is given back at once.
                take_lock(other, so)
                await cancelled_while_waiting()
                other.send(p.LockReleased(id=other.next_id(), session=so))
                await wait_for(lambda: s.grants == 1 and s.state == "idle")
                await wait_for(lambda: holders(daemon) == [])
                # 2. A slice started after a cancelled one takes the queued grant.
                take_lock(other, so)
                await cancelled_while_waiting()
                later = asyncio.create_task(one_slice(s))
                await asyncio.sleep(0.05)
                assert not later.done()
                other.send(p.LockReleased(id=other.next_id(), session=so))
                assert await asyncio.wait_for(later, 2)
                assert s.grants == 2 and s.holding and holders(daemon) == ["impatient"]
                await s.release()
                # 3. Cancelled after the grant arrived but before the task resumed.
                take_lock(other, so)
                task = asyncio.create_task(one_slice(s))
                await wait_for(lambda: s.state == "waiting")
                dispatch = c._dispatch

                def cancel_on_grant(msg: object) -> None:
                    dispatch(msg)
                    if isinstance(msg, p.LockOk):
                        task.cancel()

                c._dispatch = cancel_on_grant  # type: ignore[method-assign]
                other.send(p.LockReleased(id=other.next_id(), session=so))
                with pytest.raises(asyncio.CancelledError):
                    await task
                c._dispatch = dispatch  # type: ignore[method-assign]
                assert s.grants == 3 and s.state == "idle"
                await wait_for(lambda: holders(daemon) == [])
                # 4. Cancelled in synchronize: the lock is given back all the same.
                hang = asyncio.Event()

                async def synchronize() -> None:
                    await hang.wait()

                s.synchronize = synchronize
                await s.acquire()
                releasing = asyncio.create_task(s.release())
                await wait_for(lambda: s.state == "releasing")
                releasing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await releasing
                assert s.state == "idle"
                await wait_for(lambda: holders(daemon) == [])
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
            await wait_for(lambda: holders(daemon, 0) == [])
            assert holders(daemon, 1) == ["two"]

    asyncio.run(main())


def test_acquire_keeps_the_lock_until_release(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, name="pinned") as c:
            s = await c.session(0, idle_release=0.05)
            await s.acquire()
            await asyncio.sleep(0.2)  # well past idle_release
            assert s.holding and holders(daemon) == ["pinned"]
            await s.release()
            assert not s.holding
            await wait_for(lambda: holders(daemon) == [])

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
                await asyncio.sleep(0.1)
                waiter.cancel()  # the caller gives up while queued
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
            # the abandoned NMT acquire got the GPU after r's release and was given straight back
            for _ in range(200):
                if not (await c.leases()).leases:
                    break
                await asyncio.sleep(0.01)
            assert (await c.leases()).leases == []
            with contextlib.suppress(RuntimeError):
                async with c.lease("gpu:0", task_type="TTS") as r2:
                    assert r2.acquired
                    raise RuntimeError("tts failed")
            assert (await c.leases()).leases == []
            await other.close()

    asyncio.run(main())
