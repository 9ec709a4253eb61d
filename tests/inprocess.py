"""The in-process daemon: a real ``Daemon`` on a fake clock, driven without sockets.

Requests go through the listener's own ``handle_payload``, time moves only when a
test moves it, and the timers' own ``tick`` runs each GPU's and the allocations'
deadlines as they fall due; so a drop timeout or a wait of seconds passes at
once, and every run sees the same daemon. Connections carry whatever
credentials the test gives them (any uid, gid, groups and pid: no root needed).
A connection's answers queue in its outbox (``fd=-1``) unless the test gives it
one end of a socket pair, as the fuzz does to exercise the writer's path.

Three ways to talk to it, from raw to the library's:

- ``Peer.feed(payload)``: bytes as a client sent them, broken ones included;
- ``Peer.call(msg)``, ``Peer.exchange(msg)``, ``Peer.send(msg)``: one protocol message, and its
  answer or everything that came back;
- ``CoreClient``: the real client core (``gpud_client.core.ClientCore``) wired to a
  ``Peer``, so sessions, slices, drops and give-backs follow the library's rules.

The fuzz, the containment and storage-fault tests, the whole-daemon simulation and
the in-process integration tests (``tests/integration/test_inproc_*.py``) share it.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from gpud.host.config import Config
from gpud.host.devices import Gpu, simulated_gpus
from gpud.host.metrics import Metrics
from gpud.host.store import Store, StoreError
from gpud.kit.state import ClientLink
from gpud.serving.connections import handle_payload, serve_connection
from gpud.serving.monitor import publish
from gpud.serving.server import Daemon
from gpud.serving.timers import tick_allocations, tick_gpu
from gpud_client import protocol as p
from gpud_client.core import HOLD, ClientCore, SessionState
from gpud_client.core.actions import Action, ApplyMemoryLimit, CallOnDrop, CallOnLost, GiveBack, Log, Resolve, Send

START_US = 10**12  # the fake clock's first reading: far from zero, as a monotonic clock is
ME = (os.getpid(), os.getuid(), os.getgid())


class FakeClock:
    """The daemon's clock (``Daemon(clock=...)``): integer microseconds the test moves."""

    def __init__(self, us: int = START_US) -> None:
        self.us = us

    def __call__(self) -> int:
        return self.us


@dataclass(eq=False)
class Peer:
    """The test's end of one in-process connection."""

    node: Node
    conn: ClientLink
    codec: p.Codec = field(default_factory=p.daemon_codec)
    reader: p.Codec = field(default_factory=p.client_codec)
    frames: p.FrameDecoder = field(default_factory=lambda: p.FrameDecoder(p.MAX_REPLY_BYTES))
    ids: int = 0
    closed: bool = False
    unread: list[Any] = field(default_factory=list)  # what came and no call() took

    @property
    def client_id(self) -> int:
        return self.conn.client_id

    def feed(self, payload: bytes) -> bool:
        """One frame's payload, as the read loop hands it over. False: the daemon closes the connection."""
        keep = handle_payload(self.node.daemon, self.conn, payload, self.codec)
        if not keep:
            self.node.close(self)
        return keep

    def send(self, msg: msgspec.Struct) -> bool:
        return self.feed(msgspec.msgpack.encode(msg))

    def received(self) -> list[Any]:
        """What the daemon wrote to this connection since the last look (unread answers first)."""
        got, self.unread = self.unread, []
        conn = self.conn
        if conn.pending:
            data = b"".join(conn.pending)
            conn.pending.clear()
            conn.pending_bytes -= len(data)
            got += [self.reader.decode(f) for f in self.frames.feed(data)]
        return got

    def call(self, msg: msgspec.Struct) -> Any:
        """Send ``msg`` with a fresh id and return its answer; anything else that came stays unread.
        None if nothing answers it (yet): a LOCK_REQUEST's grant, an allocation that waits."""
        self.ids += 1
        rid = self.ids
        self.send(msgspec.structs.replace(msg, id=rid))  # type: ignore[arg-type]
        answer = None
        for m in self.received():
            if answer is None and getattr(m, "id", None) == rid:
                answer = m
            else:
                self.unread.append(m)
        return answer

    def exchange(self, msg: msgspec.Struct) -> list[Any]:
        """Send ``msg`` as it is (its own id) and return everything that came back, in order."""
        self.send(msg)
        return self.received()

    def pushes(self, kind: type | tuple[type, ...] = object) -> list[Any]:
        """What came unasked (or unread) of the given kinds; the rest stays unread."""
        got = self.received()
        taken = [m for m in got if isinstance(m, kind)]
        self.unread = [m for m in got if not isinstance(m, kind)]
        return taken


class Node:
    """A real ``Daemon`` on simulated GPUs and a fake clock; its store on a real SQLite file."""

    def __init__(
        self,
        gpus: str = "2x16GiB",
        *,
        state_dir: str | None = None,
        clock: Callable[[], int] | None = None,
        registry: CollectorRegistry | None = None,
        config: Config | None = None,
        restart_grace_us: int = 0,
        **fields: Any,
    ) -> None:
        """``clock``: a ``FakeClock`` (the default) or the real one (``gpud.kit.state.now_us``) for a daemon
        served on a real socket (``open_listener`` and ``serve``). The configuration is ``config`` as it is
        (a simulation's draw), or ``Config``'s defaults with these ``fields``, a socket nobody listens on,
        no metrics endpoint, no reaping, and a state directory of its own unless ``state_dir`` is given.
        ``restart_grace_us``: as after a crash (nothing is granted for that long)."""
        if config is not None and (fields or state_dir):
            raise ValueError("give a whole Config, or Config's fields and a state directory, not both")
        self.workdir = None if state_dir or config else tempfile.mkdtemp(prefix="gpud-inproc-")
        settings: dict[str, Any] = {
            "socket": "/nonexistent/gpud.sock",
            "metrics_addr": "off",
            "reap_interval_s": 0,
            "state_dir": state_dir or os.path.join(self.workdir or "", "state"),
        }
        self.config = config or Config(**(settings | fields))
        self.clock = clock or FakeClock()
        self.registry = registry or CollectorRegistry()
        self.gpus: list[Gpu] = simulated_gpus(gpus)
        self.daemon = Daemon(
            self.config, self.gpus, Metrics(self.registry), clock=self.clock, restart_grace_us=restart_grace_us
        )
        self.failing_writes = False  # the store refuses writes while True
        self.next_reap = self.clock()  # with reap_interval_s set: the first tick reaps, as the timer does at start
        real_write = self.daemon.allocations.store.write

        def write(*args: Any, **kwargs: Any) -> None:
            if self.failing_writes:
                raise StoreError("disk I/O error (injected)")
            real_write(*args, **kwargs)

        self.daemon.allocations.store.write = write  # type: ignore[method-assign]

    def close_store(self) -> None:
        """Close the store (and remove the state directory the node made for itself, if it did)."""
        self.daemon.allocations.store.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # --- connections ------------------------------------------------------------------

    def connect(
        self,
        name: str = "peer",
        *,
        uid: int | None = None,
        gid: int | None = None,
        groups: frozenset[int] = frozenset(),
        pid: int | None = None,
        fd: int = -1,
        hello: bool = True,
    ) -> Peer:
        """A new connection with these credentials (this process's by default), greeted unless told not to."""
        creds = (ME[0] if pid is None else pid, ME[1] if uid is None else uid, ME[2] if gid is None else gid)
        peer = Peer(self, self.daemon.links.open(creds, groups, fd, trio.CancelScope()))
        if hello:
            welcome = peer.call(p.Hello(id=0, version=p.PROTOCOL_VERSION, name=name))
            assert isinstance(welcome, p.Welcome), welcome
        return peer

    def close(self, peer: Peer) -> None:
        """What the listener does when a connection ends (the peer hung up or was dropped)."""
        if not peer.closed:
            peer.closed = True
            self.daemon.close(peer.conn)

    # --- time ---------------------------------------------------------------------------

    @property
    def fake(self) -> FakeClock:
        assert isinstance(self.clock, FakeClock), "this node runs on the real clock: time is not the test's to move"
        return self.clock

    def now(self) -> int:
        return self.clock()

    def tick(self) -> None:
        """Run what the timer tasks run at this instant: every GPU's due deadlines, the allocations'; and,
        when ``reap_interval_s`` is set (the harness's default is 0: never), the reaping of dead owners'
        allocations once an interval, as ``run_allocations_timer`` does (owners are real pids)."""
        now = self.clock()
        for slot in self.daemon.slots:
            tick_gpu(self.daemon, slot, now)
        interval = self.daemon.config.reap_interval_s
        reap = bool(interval) and now >= self.next_reap
        tick_allocations(self.daemon, now, reap=reap)
        if reap:
            self.next_reap = now + round(interval * 1e6)

    def next_deadline(self) -> int | None:
        times = [t for t in (s.scheduler.next_deadline() for s in self.daemon.slots) if t is not None]
        if (t := self.daemon.allocations.next_deadline()) is not None:
            times.append(t)
        if self.daemon.config.reap_interval_s:
            times.append(self.next_reap)
        return min(times) if times else None

    def advance(self, us: int) -> None:
        """Move time ``us`` forward, stopping at each deadline on the way to run it, as the timers would."""
        clock = self.fake
        end = clock.us + us
        self.tick()
        while (due := self.next_deadline()) is not None and due <= end:
            if due <= clock.us:  # the timers just ran at this instant and left it due: they would spin
                raise AssertionError(f"a deadline ({due}) stays due after the timers ran at {clock.us}")
            clock.us = due
            self.tick()
        clock.us = end
        self.tick()

    def advance_s(self, seconds: float) -> None:
        self.advance(round(seconds * 1e6))

    # --- what a test reads --------------------------------------------------------------

    def faults(self, where: str) -> float:
        return self.registry.get_sample_value("gpud_faults_total", {"where": where}) or 0.0

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.registry.get_sample_value(name, labels or {})

    def stored(self) -> list[str]:
        """The task ids the store holds, read back through a second connection to the file."""
        store = Store(self.config.state_dir)
        try:
            return [a.task_id for a, _ in store.load().records]
        finally:
            store.close()

    def publish(self) -> None:
        """Refresh the gauges as the monitor does once an interval (all of ``monitor.publish``'s steps)."""
        for _ in publish(self.daemon):
            pass

    # --- one real connection ------------------------------------------------------------

    def serve_bytes(self, *writes: bytes) -> list[Any]:
        """Bytes as a client wrote them on a new connection, each write once the daemon has done with
        the one before, and then no more: served by the listener's own connection task
        (``serve_connection``: the kernel's credentials, the framing, the read loop) over a socket
        pair. Returns what the daemon wrote back until it closed the connection."""
        return trio.run(self._serve_bytes, writes)

    async def _serve_bytes(self, writes: tuple[bytes, ...]) -> list[Any]:
        ours, theirs = socket.socketpair()
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        client = trio.SocketStream(trio.socket.from_stdlib_socket(theirs))

        async def serve() -> None:
            try:
                await serve_connection(self.daemon, stream)
            finally:
                await trio.aclose_forcefully(stream)  # as the listener does

        async def write() -> None:
            try:
                for data in writes:
                    await client.send_all(data)
                    await trio.testing.wait_all_tasks_blocked()  # the daemon has read and answered it
                await client.send_eof()
            except trio.BrokenResourceError:
                pass  # closed before it read it all

        got = b""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            nursery.start_soon(write)
            try:
                while chunk := await client.receive_some():
                    got += chunk
            except trio.BrokenResourceError:
                pass  # reset: closed with bytes unread
        await client.aclose()
        reader = p.client_codec()
        return [reader.decode(f) for f in p.FrameDecoder(p.MAX_REPLY_BYTES).feed(got)]


@contextmanager
def node(gpus: str = "2x16GiB", **config: Any) -> Iterator[Node]:
    n = Node(gpus, **config)
    try:
        yield n
    finally:
        n.close_store()


class CoreClient:
    """The real client core over an in-process connection: the library's rules without its threads.

    A request is answered before ``request`` returns (the daemon answers at once or not yet);
    a hook (``on_drop``, ``synchronize``) runs when the push that calls it is delivered."""

    def __init__(self, node: Node, name: str = "client", **creds: Any) -> None:
        self.node = node
        self.core = ClientCore(node.config.socket)
        self.peer = node.connect(name, hello=False, **creds)
        self.logs: list[str] = []
        self.resolved: set[object] = set()
        self._carry_out([self.core.hello(name, {})])
        [reply] = self.peer.received()
        self._carry_out(self.core.welcomed(reply))

    def now(self) -> float:
        return self.node.now() / 1e6

    def deliver(self) -> None:
        """Hand the core what the daemon wrote to this connection, and carry out what it says."""
        for msg in self.peer.received():
            self._carry_out(self.core.receive(msg, self.now()))

    def request(self, msg: msgspec.Struct) -> Any:
        """A request and its answer (the core's ``finish``: an Error is raised as the library raises it)."""
        waiter = object()
        send = self.core.start(msg, waiter)
        self._carry_out([send])
        self.deliver()
        assert waiter in self.resolved, f"gpud did not answer {type(msg).__name__} at once"
        return self.core.finish(send.msg.id)  # type: ignore[attr-defined]

    def attach(
        self,
        gpu: int | str = 0,
        *,
        priority: int = 50,
        core_limit: int = 100,
        mem_limit: int | None = None,
        mem_estimate: int | None = None,
        on_drop: Callable[[p.DropReason], Any] | None = None,
        synchronize: Callable[[], Any] | None = None,
        task_id: str | None = None,
    ) -> SessionState:
        s = SessionState(
            gpu,
            priority=priority,
            idle_release=None,
            core_limit=core_limit,
            mem_limit=mem_limit,
            mem_estimate=mem_estimate,
            memory_probe=None,
            framework_hooks=False,
            on_drop=on_drop,
            synchronize=synchronize,
            task_id=task_id,
        )
        waiter = object()
        send = self.core.attach(s, waiter)
        self._carry_out([send])
        self.deliver()
        self.core.finish(send.msg.id)  # type: ignore[attr-defined]
        return s

    def enter(self, s: SessionState) -> bool:
        """A slice begins: True once it holds the lock, False while it waits (call ``step`` again later)."""
        if not s.entering and not s.in_slice and self.core.begin_slice(s):
            return True
        return self.step(s)

    def step(self, s: SessionState) -> bool:
        step, actions = self.core.lock_step(s, self.now())
        self._carry_out(actions)
        self.deliver()
        if step != HOLD:
            step, actions = self.core.lock_step(s, self.now())
            self._carry_out(actions)
        return step == HOLD

    def exit(self, s: SessionState) -> None:
        """The slice ends: the lock is kept between slices, or given back if a drop is pending."""
        self._carry_out(self.core.end_slice(s, self.now()))
        self.deliver()

    def release(self, s: SessionState) -> None:
        self._carry_out(self.core.release(s))
        self.deliver()

    def report_memory(self, s: SessionState, used_bytes: int) -> None:
        """``Session.report_memory``: MEM_UPDATE, and whatever the daemon pushes back."""
        self._carry_out(self.core.report_memory(s, used_bytes))
        self.deliver()

    def _carry_out(self, actions: list[Action]) -> None:
        for a in actions:
            match a:
                case Send(data=data):
                    for payload in p.FrameDecoder(p.MAX_FRAME_BYTES).feed(data):
                        self.peer.feed(payload)
                case Resolve(waiter=waiter):
                    self.resolved.add(waiter)
                case Log(text=text):
                    self.logs.append(text)
                case CallOnDrop(session=s, reason=reason, grant=grant):
                    if s.on_drop is not None:
                        s.on_drop(reason)
                    self._carry_out(self.core.drop_told(s, grant))
                case GiveBack(session=s, grant=grant):
                    if s.synchronize is not None:
                        s.synchronize()
                    self._carry_out(self.core.given_back(s, grant))
                case CallOnLost(session=s, error=error):
                    if s.on_lost is not None:
                        s.on_lost(error)
                case ApplyMemoryLimit():
                    pass  # no framework allocator in process
                case _:
                    pass  # Wake, ArmIdle: nobody waits on a condition here
