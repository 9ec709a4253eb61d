"""A fault stays with its connection, effect, record or tick: in-process, on real sockets.

The daemon is the in-process one of ``tests/inprocess.py``, on the real clock and served
by the real listener, so that faults in the connection tasks and timers are exercised.

Each test injects an exception where a bug could be (a request handler, the
cleanup of a closing connection, one effect, one reaped record, one NVML sample)
and checks that only that connection or record is affected, that the fault is
logged once with its traceback and counted, and that the daemon serves on. Only a
scheduler whose records disagree stops the daemon.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import structlog
import trio
from inprocess import Node  # tests/ is on the path of its top-level modules
from trio.testing import wait_all_tasks_blocked

import gpud.capabilities.allocations
import gpud.serving.monitor
from gpud.core.errors import Inconsistent
from gpud.core.scheduler import Grant
from gpud.host.config import Config
from gpud.host.devices import Gpu, Reading
from gpud.kit.state import now_us
from gpud.serving.listener import open_listener, serve
from gpud.serving.monitor import run_monitor
from gpud.serving.server import Daemon
from gpud_client import protocol as p


class Peer:
    """A raw protocol client on a trio socket."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.frames = p.FrameDecoder(p.MAX_REPLY_BYTES)
        self.codec = p.client_codec()
        self.ready: list[bytes] = []
        self.ids = 0

    @classmethod
    async def connect(cls, node: Node, name: str = "peer") -> Peer:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.connect(node.config.socket)
        peer = cls(sock)
        assert isinstance(await peer.call(p.Hello(id=0, version=p.PROTOCOL_VERSION, name=name)), p.Welcome)
        return peer

    async def send(self, msg: msgspec.Struct) -> None:
        await self.sock.send(self.codec.encode(msg))

    async def recv(self) -> Any:
        with trio.fail_after(5):
            while not self.ready:
                data = await self.sock.recv(65536)
                if not data:
                    raise EOFError("the daemon closed the connection")
                self.ready.extend(self.frames.feed(data))
        return self.codec.decode(self.ready.pop(0))

    async def call(self, msg: msgspec.Struct) -> Any:
        self.ids += 1
        await self.send(msgspec.structs.replace(msg, id=self.ids))  # type: ignore[arg-type]
        return await self.recv()

    async def closed(self) -> bool:
        with trio.fail_after(5):
            while True:
                try:
                    await self.recv()
                except EOFError:
                    return True


@pytest.fixture
async def node(nursery: trio.Nursery) -> AsyncIterator[Node]:
    node = Node(clock=now_us, socket=os.path.join(tempfile.mkdtemp(prefix="gpud-c-", dir="/tmp"), "s"))
    listener, _ = await open_listener(node.config)
    await nursery.start(serve, node.daemon, listener)
    try:
        yield node
    finally:
        node.close_store()


async def lock(peer: Peer, gpu: int = 0) -> tuple[int, int]:
    attached = await peer.call(p.Attach(id=0, gpu=gpu))
    await peer.send(p.LockRequest(id=99, session=attached.session))
    ok = await peer.recv()
    assert isinstance(ok, p.LockOk)
    return attached.session, ok.grant


async def handoff_still_works(node: Node) -> None:
    """Two fresh clients hand GPU 1's lock over: the daemon serves on."""
    a, b = await Peer.connect(node, "a"), await Peer.connect(node, "b")
    sa, ga = await lock(a, gpu=1)
    sb = (await b.call(p.Attach(id=0, gpu=1))).session
    await b.send(p.LockRequest(id=7, session=sb))
    await a.send(p.LockReleased(id=8, session=sa, grant=ga))
    assert isinstance(await b.recv(), p.LockOk)


def raising(exc: BaseException) -> Callable[..., Any]:
    def fail(*args: object, **kwargs: object) -> Any:
        raise exc

    return fail


@pytest.mark.parametrize(
    "exc", [ZeroDivisionError("boom"), ExceptionGroup("from a nursery", [ValueError("inner"), KeyError("k")])]
)
async def test_a_request_that_fails_closes_only_its_connection(
    node: Node, monkeypatch: pytest.MonkeyPatch, exc: Exception
) -> None:
    holder = await Peer.connect(node, "holder")
    held = await lock(holder)
    victim = await Peer.connect(node, "victim")
    monkeypatch.setitem(node.daemon.handlers, p.Attach, raising(exc))
    with structlog.testing.capture_logs() as logs:
        err = await victim.call(p.Attach(id=0, gpu=0))
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.INTERNAL and "ATTACH" in err.message
        assert await victim.closed()
    faults = [e for e in logs if e["event"] == "fault"]
    assert len(faults) == 1 and faults[0]["where"] == "request" and faults[0]["exc_info"] is exc
    assert node.faults("request") == 1
    monkeypatch.undo()
    status = await holder.call(p.Status(id=0))
    assert [(h.session, h.grant) for h in status.gpus[0].holders] == [held]  # the bystander keeps its lock
    await handoff_still_works(node)


async def test_a_fault_while_a_slow_connection_is_being_dropped_stays_with_it(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = await Peer.connect(node, "slow")
    session, _ = await lock(victim)
    real_handle = node.daemon.handle

    def drop_then_fail(conn: Any, msg: Any) -> Any:
        if isinstance(msg, p.Status):
            node.daemon.links.drop(conn, "too_slow")  # as a push past its outbox limit would
            raise RuntimeError("fault in a closing connection")
        return real_handle(conn, msg)

    monkeypatch.setattr(node.daemon, "handle", drop_then_fail)
    await victim.send(p.Status(id=5))
    await victim.sock.send(p.frame(b"\xc1"))  # and a broken frame behind it
    await wait_all_tasks_blocked()  # the daemon has read both and handled them
    assert not any(c.name == "slow" for c in node.daemon.links.connections.values())
    monkeypatch.undo()
    assert session not in node.daemon.links.owners  # its lock went with it
    assert node.faults("request") == 1
    await handoff_still_works(node)


async def test_a_fault_in_a_closing_connections_cleanup_is_logged_and_the_daemon_serves_on(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer = await Peer.connect(node, "leaver")
    await lock(peer)
    monkeypatch.setattr(node.daemon.leases, "connection_closed", raising(ExceptionGroup("cleanup", [OSError(5)])))
    peer.sock.close()
    await wait_all_tasks_blocked()  # the daemon has seen the close and cleaned up
    assert node.faults("close") >= 1
    monkeypatch.undo()
    assert not node.daemon.links.owners and not node.daemon.links.connections  # the rest of the cleanup ran
    await handoff_still_works(node)


async def test_an_effect_that_cannot_be_carried_out_is_skipped_and_the_rest_are_not(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await Peer.connect(node, "a"), await Peer.connect(node, "b")
    sa = (await a.call(p.Attach(id=0, gpu=0, priority=10))).session
    sb = (await b.call(p.Attach(id=0, gpu=0, priority=10))).session
    await a.send(p.LockRequest(id=1, session=sa))
    assert isinstance(await a.recv(), p.LockOk)
    await b.send(p.LockRequest(id=2, session=sb))
    real = node.daemon.effects._handlers[Grant]
    failed: list[Any] = []

    def fail_first(effect: Any, now: int) -> None:
        if not failed:
            failed.append(effect)
            raise LookupError("one bad effect")
        real(effect, now)

    monkeypatch.setitem(node.daemon.effects._handlers, Grant, fail_first)
    await a.call(p.Detach(id=0, session=sa))  # frees the GPU: the grant to b is the effect that fails
    monkeypatch.undo()
    assert node.faults("effect") == 1 and failed
    await handoff_still_works(node)


async def test_a_gpu_timer_tick_that_fails_is_skipped_and_the_timer_goes_on(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder, waiter = await Peer.connect(node, "holder"), await Peer.connect(node, "waiter")
    lease = await holder.call(p.Acquire(id=0, gpu=0))
    assert lease.acquired
    scheduler = node.daemon.slots[0].scheduler
    real_advance = scheduler.advance
    ticked = trio.Event()

    def bad_tick(now: int) -> Any:
        ticked.set()
        raise KeyError("one bad tick")

    monkeypatch.setattr(scheduler, "advance", bad_tick)
    await waiter.send(p.Acquire(id=1, gpu=0, max_wait_ms=50))  # only the timer can answer TIMEOUT
    with trio.fail_after(5):
        await ticked.wait()
    await wait_all_tasks_blocked()  # the timer task has dealt with the failure
    assert node.faults("timer") >= 1
    monkeypatch.setattr(scheduler, "advance", real_advance)
    answer = await waiter.recv()
    assert isinstance(answer, p.LeaseResult) and answer.reason == p.LeaseReason.TIMEOUT


async def test_a_reaped_record_that_fails_is_skipped_and_the_others_are_reaped(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer = await Peer.connect(node, "runner")
    owners = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]  # its children: owners it may name
    for i, owner in enumerate(owners):
        assert isinstance(
            await peer.call(p.Allocate(id=0, task_id=f"t{i}", gpus=0.25, owner_pid=owner.pid)), p.Allocated
        )
        owner.kill()
        owner.wait()
    ledger = node.daemon.allocations.ledger
    real_release = ledger.release
    monkeypatch.setattr(ledger, "release", lambda task, now: 1 / 0 if task == "t0" else real_release(task, now))
    node.daemon.allocations.reap(now_us())
    assert node.faults("reaper") == 1
    assert [a.task_id for a in ledger.allocations()] == ["t0"]


async def test_a_monitor_sample_that_fails_is_skipped(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    sampled_thrice = trio.Event()

    class Flaky:
        calls = 0
        gpus = [Gpu(7, "GPU-ghost", "ghost", 2**30, False)]  # a GPU the daemon does not have: ignored

        def sample_gpu(self, gpu: Gpu) -> Reading:  # in a worker thread
            Flaky.calls += 1
            if Flaky.calls == 3:
                trio.from_thread.run_sync(sampled_thrice.set)
            return Reading(index=gpu.index, healthy=True)

    real_publish = gpud.serving.monitor.publish
    failed: list[int] = []

    def publish(daemon: Daemon) -> None:
        if Flaky.calls == 1 and not failed:  # once: the next refresh may come before the next sample
            failed.append(Flaky.calls)
            raise RuntimeError("a gauge refresh that fails")
        real_publish(daemon)

    monkeypatch.setattr(gpud.serving.monitor, "publish", publish)
    node.daemon.config = msgspec.structs.replace(node.daemon.config, monitor_interval_s=0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_monitor, node.daemon, Flaky())  # type: ignore[arg-type]
        with trio.fail_after(5):
            await sampled_thrice.wait()
        nursery.cancel_scope.cancel()
    assert failed and node.faults("monitor") == 1


async def test_an_inconsistent_scheduler_stops_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node("1x16GiB", clock=now_us, socket=os.path.join(tempfile.mkdtemp(prefix="gpud-c-", dir="/tmp"), "s"))
    daemon = node.daemon
    listener, _ = await open_listener(node.config)

    def corrupt(conn: Any, msg: Any, now: int) -> Any:
        daemon.slots[0].scheduler.st.queue.append((0, 0, 12345))  # a queued session that does not exist
        raise RuntimeError("a bug that left the scheduler wrong")

    monkeypatch.setitem(daemon.handlers, p.Attach, corrupt)
    with pytest.RaisesGroup(Inconsistent, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, daemon, listener)
            peer = await Peer.connect(node)
            await peer.send(p.Attach(id=1, gpu=0))
            await trio.sleep_forever()
    node.close_store()


async def test_a_sessions_series_go_at_once_with_the_session(node: Node) -> None:
    from gpud.serving.monitor import publish

    def series(session: int) -> int:
        return sum(
            1
            for family in node.registry.collect()
            for sample in family.samples
            if sample.labels.get("session") == str(session)
        )

    peer, other = await Peer.connect(node, "gone"), await Peer.connect(node, "closed")
    detached = (await peer.call(p.Attach(id=0, gpu=0, mem_limit=2**30))).session
    closed = (await other.call(p.Attach(id=0, gpu=1))).session
    publish(node.daemon)
    assert series(detached) == 6 and series(closed) == 5  # the memory limit has its own series
    assert isinstance(await peer.call(p.Detach(id=0, session=detached)), p.Ok)
    other.sock.close()
    await wait_all_tasks_blocked()  # the daemon has seen the close and cleaned up
    assert not node.daemon.links.owners
    assert series(detached) == 0 and series(closed) == 0  # no monitor sample in between


async def test_a_driver_that_hangs_at_start_up_fails_the_start_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import gpud.main

    release = threading.Event()
    monkeypatch.setattr(gpud.main, "discover", lambda simulate: release.wait(30))
    monkeypatch.setattr(gpud.main, "DISCOVERY_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(RuntimeError, match="NVML did not answer within 0.2 s at start-up"):
            await gpud.main._discover(Config())
    finally:
        release.set()
