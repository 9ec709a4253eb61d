"""Property-based fuzzing of the daemon's request handling, in process.

A real ``Daemon`` on two simulated 16 GiB GPUs with small caps, and up to four
simulated connections (socketpairs; root and non-root peers, some that read
their answers and some that never do). Hypothesis draws every step: a valid
request built from the protocol's Structs, naming ids seen in earlier answers
or made up; the same as a raw map with a field pushed out of range or given the
wrong type; a malformed payload; or a lifetime event (open, close, drop, hang
up, timers, time passing). Each payload goes through ``handle_payload`` as the
listener's read loop would, and a False answer closes the connection as the
listener would. Time is a fake clock the test moves, so every run of an example
is the same and deadlines seconds away (max_wait, hold_max) pass at once.

After every step: nothing escaped; every scheduler's own ``check()`` passes;
connections, ``owners``, the arbiter, the allocator and the schedulers agree on
who owns what; nothing is owned by a closed connection; the ledger's sums hold
and the store holds what the ledger holds; no fault was counted (every bad
input must be answered as the peer's error); and every frame the daemon wrote
decodes as a DaemonMessage addressed to the connection that got it.

The default run draws 200 examples; ``GPUD_FUZZ_EXAMPLES=N`` draws N (500 is a
thorough run). ``pytest --hypothesis-show-statistics`` shows which answers the
examples got.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import tempfile
import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec
import structlog
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st
from inprocess import FakeClock, Node  # tests/ is on the path of its top-level modules

from gpud.core.errors import Refused
from gpud.core.ledger import UNIT
from gpud.host.config import Config, TenantConfig
from gpud.host.devices import simulated_gpus
from gpud.host.metrics import FAULT_PLACES
from gpud.serving.connections import handle_payload
from gpud.serving.timers import tick_allocations, tick_gpu
from gpud_client import protocol as p

try:
    from tests.sim.daemon_sim import scratch_root
except ImportError:  # run by the pytest script: tests/ is on the path, the repository root is not
    from sim.daemon_sim import scratch_root  # type: ignore[no-redef]

if TYPE_CHECKING:
    from gpud.kit.state import ClientLink

GIB = 2**30
EXAMPLES = int(os.environ.get("GPUD_FUZZ_EXAMPLES", "200"))  # about 15 s on a 2-core machine
MAX_PEERS = 4
MAX_STEPS = 120
ANOTHER_STEP = [False] + [True] * 39  # 40 steps on average
STEP_US = 100  # each step takes this long on the fake clock
SLEEPS_US = [1_000, 4_000, 12_000, 150_000, 3_500_000, 9_000_000]  # past TQ, drop timeouts, max_wait, hold_max
CREDENTIALS = [(0, 0), (1000, 1000), (1001, 1001)]  # root (admin) and two users (1001 may ask priority 80)
# Mostly GPU 0, so that sessions and leases contend for it.
GPU_REFS: list[int | str] = [0, 0, 1, "gpu:0", "0", *(g.uuid for g in simulated_gpus("2")), 2, 1023, "gpu:9", "G"]
NAMES = ["", "a", "b", "trainer", "n" * 128]
TASK_IDS = ["t1", "t2", "t3", "t4", "job/a", "x@y:1"]
TASK_TYPES = ["OTHER", "ASR", "SEMANTIC_REPAIR", "X1", "new.type"]
MEMORY = [None, 0, 1, GIB, 8 * GIB, 15 * GIB, 2**62]
PRIORITIES = [0, 0, 10, 50, 51, 80, 100]
EXTREMES: list[Any] = [
    2**63 - 1,
    2**63,
    2**64 - 1,
    -1,
    -(2**63),
    0,
    2**62 + 1,
    2**53 + 1,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e308,
    -1e308,
    -0.0,
    5e-324,
    "\x00\x07\x1b[2J",
    "\u202e\x85",
    "x" * 5000,
    [0] * 1025,
    {f"k{i}": "v" for i in range(33)},
    "gpu:" + "9" * 90,
]
CONFUSED: list[Any] = ["1", "", 1.5, True, False, None, [], {}, b"\x00\x01", [1, [2, [3]]], {"type": "HELLO"}]
# Two mixes, drawn per example: everything at once, or mostly well-behaved clients contending
# for the GPUs (so that queues fill, quanta expire and holders are dropped and revoked).
STEPS = {
    "chaos": ["valid"] * 8
    + ["extreme", "confused", "malformed", "flood", "open", "close", "drop", "hang_up"]
    + ["settle", "advance", "allocator", "time", "time"],
    "busy": ["valid"] * 14 + ["time"] * 2 + ["settle", "advance", "allocator", "extreme", "open", "close"],
}
VALID = {
    "chaos": ["NEXT"] * 8
    + ["ATTACH", "LOCK_REQUEST", "LOCK_RELEASED", "ACQUIRE", "RELEASE", "FREE"] * 2
    + ["ALLOCATE"] * 4
    + ["DETACH", "MEM_UPDATE", "SET_LIMITS", "HELLO", "SET_MODE", "SCHED_ON", "SCHED_OFF"]
    + ["SET_TQ", "REPORT_OOM", "LEASES", "SET_POLICY", "POLICIES", "ALLOCS", "RESET_ALLOCS", "STATUS", "CLIENTS"],
    "busy": ["NEXT"] * 12
    + ["ACQUIRE", "ALLOCATE"] * 2
    + ["RELEASE", "FREE", "DETACH", "SET_LIMITS", "SET_MODE", "SCHED_OFF", "SCHED_ON", "STATUS", "LEASES"],
}
SESSION_PUSHES = (p.LockOk, p.DropLock, p.Revoked, p.LimitsChanged, p.MemLimitExceeded)


T = TypeVar("T")

# Every draw names its strategy. Hypothesis validates and labels a strategy object the first time
# it is drawn from, so the same strategy is built once and kept, not built again for each draw.
BOOLEANS = st.booleans()
_SAMPLED: dict[tuple[tuple[type, Any], ...], st.SearchStrategy[Any]] = {}


def sampled_from(values: Sequence[T]) -> st.SearchStrategy[T]:
    """``st.sampled_from(values)``, kept for values that are all hashable (floats by their repr, so
    that 0.0 and -0.0 stay apart; every value with its type, so that 1 and True do)."""
    try:
        key = tuple((type(v), repr(v) if type(v) is float else v) for v in values)
        strategy = _SAMPLED.get(key)
    except TypeError:  # an unhashable value (a list, a dict): built for this draw alone
        return st.sampled_from(values)
    if strategy is None:
        if len(_SAMPLED) > 10_000:
            _SAMPLED.clear()
        strategy = _SAMPLED[key] = st.sampled_from(tuple(values))
    return cast("st.SearchStrategy[T]", strategy)


@functools.cache
def integers(min_value: int, max_value: int) -> st.SearchStrategy[int]:
    return st.integers(min_value, max_value)


@functools.cache
def binary(*, min_size: int = 0, max_size: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=min_size, max_size=max_size)


@dataclass(eq=False)
class Peer:
    """The test's end of one simulated connection."""

    conn: ClientLink
    daemon_end: socket.socket
    client_end: socket.socket | None  # None once the peer hung up
    reads: bool  # drains its answers every step (else only when closed)
    codec: p.Codec = field(default_factory=p.daemon_codec)
    frames: p.FrameDecoder = field(default_factory=lambda: p.FrameDecoder(p.MAX_REPLY_BYTES))
    reader: p.Codec = field(default_factory=p.client_codec)
    request_ids: set[int] = field(default_factory=set)  # ids this connection sent (recoverable ones)
    owned: set[int] = field(default_factory=set)  # every session or lease it ever held
    leases: set[str] = field(default_factory=set)  # lease ids it was answered


def _request_id(payload: bytes) -> int | None:
    """The id the daemon can recover from a payload (as ``describe_bad_message`` does)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception:
        return None
    rid = raw.get("id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63 else None


def _samples(metric: Any) -> list[Any]:
    return [s for family in metric.collect() for s in family.samples]


class Fuzz:
    def __init__(self, data: st.DataObject, config: Config, clock: FakeClock) -> None:
        self.data = data
        self.clock = clock
        self.mix = data.draw(sampled_from(sorted(STEPS)), label="mix")
        # The in-process daemon (tests/inprocess.py) on the test's clock: every run of an example sees the
        # same daemon (with the real clock Hypothesis's data generation is flaky), and deadlines pass at once.
        self.node = Node("2x16GiB", config=config, clock=clock)
        self.registry = self.node.registry
        self.daemon = self.node.daemon
        assert self.daemon.started_at == clock.us, "the fake clock is not the daemon's"
        self.daemon.allocations.ledger.state.rng.seed(0)  # the "random" strategy's choices, the same every run
        self.peers: list[Peer] = []
        self.closed: list[Peer] = []
        self.sessions: set[int] = set()
        self.grants: set[int] = set()
        self.leases: set[str] = set()
        self.tasks: set[str] = set()

    def draw(self, strategy: st.SearchStrategy[Any], label: str) -> Any:
        return self.data.draw(strategy, label=label)

    def choose(self, label: str, known: set[Any], made_up: list[Any]) -> Any:
        return self.draw(sampled_from(sorted(known, key=repr) + made_up), label)

    # --- connections ----------------------------------------------------------

    def open_peer(self) -> Peer:
        uid, gid = self.draw(sampled_from(CREDENTIALS), "uid/gid")
        pid = self.draw(sampled_from([os.getpid(), 1, p.PID_MAX]), "pid")
        groups = self.draw(sampled_from([frozenset(), frozenset({gid, 4242})]), "groups")
        reads = self.draw(BOOLEANS, "reads its answers")
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        if self.draw(BOOLEANS, "small socket buffer"):
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        conn = self.node.connect(uid=uid, gid=gid, groups=groups, pid=pid, fd=a.fileno(), hello=False).conn
        peer = Peer(conn, a, b, reads)
        self.peers.append(peer)
        note(f"open client {peer.conn.client_id}: uid {uid} pid {pid} reads={reads}")
        if self.draw(sampled_from([True] * 5 + [False]), "HELLO first"):
            name = self.draw(sampled_from(NAMES), "name")
            self.feed(peer, msgspec.msgpack.encode(p.Hello(id=0, version=p.PROTOCOL_VERSION, name=name)))
        return peer

    def pick_peer(self) -> Peer:
        if not self.peers:
            return self.open_peer()
        return self.peers[self.draw(integers(0, len(self.peers) - 1), "connection")]

    def feed(self, peer: Peer, payload: bytes) -> None:
        rid = _request_id(payload)
        if rid is not None:
            peer.request_ids.add(rid)
        note(f"client {peer.conn.client_id} sends {payload[:160]!r}{'...' if len(payload) > 160 else ''}")
        keep = handle_payload(self.daemon, peer.conn, payload, peer.codec)
        peer.owned |= set(peer.conn.sessions)
        if not keep:
            note(f"client {peer.conn.client_id}: handle_payload says close")
            self.close(peer)

    def flood(self, peer: Peer) -> None:
        """One payload pipelined many times, fed as ``_read_loop`` feeds a batch: it stops at a
        closing connection and where answers pile up above the high-water mark (it would wait)."""
        payload, times = self.payload(peer), self.draw(sampled_from([10, 60, 200]), "times")
        note(f"client {peer.conn.client_id} pipelines the next payload {times} times")
        for _ in range(times):
            conn = peer.conn
            if conn.closing or conn.pending_bytes > self.daemon.config.outbox_high_water_bytes:
                return
            self.feed(peer, payload)

    def close(self, peer: Peer) -> None:
        """What the listener does when a connection ends: close, flush unless dropped, close the socket."""
        self.daemon.close(peer.conn)
        self.peers.remove(peer)
        self.closed.append(peer)
        if not peer.conn.cancel.cancel_called:  # the writer task flushes what is queued
            while self.flush(peer) and self.drain(peer):
                pass
        peer.daemon_end.close()
        self.drain(peer)
        if peer.client_end is not None:
            peer.client_end.close()
            peer.client_end = None

    def flush(self, peer: Peer) -> bool:
        """Do what the writer task does with the connection's queued bytes."""
        conn = peer.conn
        if not conn.pending or conn.cancel.cancel_called:
            return False
        data = b"".join(conn.pending)
        try:
            sent = os.write(conn.fd, data)
        except OSError:  # full, or the peer is gone
            return False
        conn.pending.clear()
        if sent < len(data):
            conn.pending.append(data[sent:])
        conn.pending_bytes -= sent
        return sent > 0

    def drain(self, peer: Peer) -> bool:
        """Read and check what the daemon wrote; True if anything came."""
        got = False
        while peer.client_end is not None:
            try:
                chunk = peer.client_end.recv(1 << 20)
            except BlockingIOError:
                return got
            if not chunk:
                return got
            got = True
            for payload in peer.frames.feed(chunk):
                self.check_frame(peer, payload)
        return got

    def check_frame(self, peer: Peer, payload: bytes) -> None:
        msg = peer.reader.decode(payload)  # raises: not a DaemonMessage
        event(f"answer {msg.code}" if isinstance(msg, p.Error) else f"answer {msg.__struct_config__.tag}")
        rid = getattr(msg, "id", None)
        assert rid is None or rid in peer.request_ids, f"{msg!r} answers no request of client {peer.conn.client_id}"
        match msg:
            case p.Error():
                assert msg.message.strip(), f"an ERROR without a message: {msg!r}"
            case p.Welcome():
                assert msg.client_id == peer.conn.client_id
            case p.Attached():
                self.sessions.add(msg.session)
                peer.owned.add(msg.session)
            case p.LeaseResult(lease_id=str(lease_id)):
                self.leases.add(lease_id)
                peer.leases.add(lease_id)
            case p.LeaseRevoked():
                assert msg.lease_id in peer.leases, f"{msg!r} names a lease client {peer.conn.client_id} never had"
            case p.Allocated():
                self.tasks.add(msg.task_id)
        if isinstance(msg, SESSION_PUSHES):
            assert msg.session in peer.owned, f"{msg!r} names a session client {peer.conn.client_id} never had"
        if isinstance(msg, (p.LockOk, p.DropLock, p.Revoked)):
            self.grants.add(msg.grant)

    # --- payloads -------------------------------------------------------------

    def gpu(self, label: str = "gpu") -> int | str:
        return self.draw(sampled_from(GPU_REFS), label)

    def maybe(self, label: str, values: list[Any]) -> Any:
        return self.draw(sampled_from([None, *values]), label)

    def session(self, peer: Peer) -> int:
        """Mostly one of the peer's own sessions; else one seen anywhere, or made up."""
        own = sorted(peer.conn.sessions)
        if own and self.draw(sampled_from([True, True, True, False]), "own session"):
            return self.draw(sampled_from(own), "session")
        return self.choose("session", self.sessions | set(self.daemon.links.owners), [1, 2, 50, 2**63 - 1])

    def grant(self, peer: Peer, sid: int) -> int | None:
        """The grant the session holds (as its LOCK_OK said), a stale or made-up one, or none."""
        current: list[int | None] = []
        gpu = peer.conn.sessions.get(sid)
        if gpu is not None and not self.daemon.leases.owns(sid):
            held = self.daemon.slots[gpu].scheduler.session(sid, self.clock()).grant
            current = [held, held - 1] if held > 1 else [held] if held else []
        return self.choose("grant", self.grants, current + [None, 1, 2**63 - 1])

    def next_call(self, peer: Peer, rid: int) -> msgspec.Struct | None:
        """What a well-behaved client does next with one of its sessions (None: it has none)."""
        sessions = sorted(s for s in peer.conn.sessions if not self.daemon.leases.owns(s))
        if not sessions or self.draw(sampled_from([False, False, True]), "one more session"):
            return None
        sid = self.draw(sampled_from(sessions), "own session")
        v = self.daemon.slots[peer.conn.sessions[sid]].scheduler.session(sid, self.clock())
        if v.state == "idle":
            return p.LockRequest(id=rid, session=sid)
        if v.state == "holding" and self.draw(BOOLEANS, "release it now"):
            return p.LockReleased(id=rid, session=sid, grant=v.grant)
        used = self.draw(sampled_from([GIB, 8 * GIB, 15 * GIB]), "used_bytes")
        return p.MemUpdate(id=rid, session=sid, used_bytes=used)  # holding on, or waiting

    def valid(self, peer: Peer) -> msgspec.Struct:
        d, rid = self.draw, self.draw(sampled_from([1, 2, 3, 0, 2**63 - 1]), "id")
        kind = d(sampled_from(VALID[self.mix]), "message")
        ids = {"id": rid}
        if kind == "NEXT":
            follow_up = self.next_call(peer, rid)
            if follow_up is not None:
                return follow_up
            kind = "ATTACH"
        match kind:
            case "HELLO":
                labels = d(sampled_from([{}, {"task_id": "t1"}, {"task_id": "nope"}, {"k": "v"}]), "labels")
                version = d(sampled_from([1, 0, 2, 2**63]), "version")
                return p.Hello(**ids, version=version, name=d(sampled_from(NAMES), "name"), labels=labels)
            case "ATTACH":
                return p.Attach(
                    **ids, gpu=self.gpu(), priority=d(sampled_from(PRIORITIES), "priority"),
                    core_limit=d(sampled_from([100, 1, 30]), "core_limit"),
                    mem_limit=d(sampled_from(MEMORY), "mem_limit"),
                    mem_estimate=d(sampled_from(MEMORY), "mem_estimate"), task_id=self.maybe("task_id", TASK_IDS),
                )  # fmt: skip
            case "DETACH":
                return p.Detach(**ids, session=self.session(peer))
            case "LOCK_REQUEST":
                return p.LockRequest(**ids, session=self.session(peer))
            case "LOCK_RELEASED":
                sid = self.session(peer)
                return p.LockReleased(**ids, session=sid, grant=self.grant(peer, sid))
            case "MEM_UPDATE":
                used = d(sampled_from([0, GIB, 8 * GIB, 16 * GIB, 2**62]), "used_bytes")
                return p.MemUpdate(**ids, session=self.session(peer), used_bytes=used)
            case "SET_LIMITS":
                others = {q.conn.client_id for q in self.peers}
                client = self.choose("client", others, [None, "a", "b", 999, "nobody"])
                session = self.maybe("session", [self.session(peer)])
                gpu = self.maybe("gpu", [0, 1, 5])
                return p.SetLimits(**ids, client=client, gpu=gpu, session=session,
                                   core_limit=self.maybe("core_limit", [1, 50, 100]),
                                   mem_limit=self.maybe("mem_limit", [0, 1, GIB, 2**62]))  # fmt: skip
            case "SET_MODE":
                mode = d(sampled_from(list(p.Mode)), "mode")
                return p.SetMode(**ids, mode=mode, gpu=self.maybe("gpu", [0, 1, 7]))
            case "SCHED_ON":
                return p.SchedOn(**ids, gpu=self.maybe("gpu", [0, 1, 7]))
            case "SCHED_OFF":
                return p.SchedOff(**ids, gpu=self.maybe("gpu", [0, 1, 7]))
            case "SET_TQ":
                seconds = d(sampled_from([0.001, 0.002, 0.5, 30.0, 86400.0]), "seconds")
                return p.SetTq(**ids, seconds=seconds, gpu=self.maybe("gpu", [0, 1, 7]))
            case "ACQUIRE":
                trace = d(sampled_from([p.Trace(), p.Trace(job_id="j", utterance_index=2**53, stage="s")]), "trace")
                return p.Acquire(
                    **ids, gpu=self.gpu(), task_type=d(sampled_from(TASK_TYPES), "task_type"),
                    priority=self.maybe("priority", PRIORITIES),
                    max_wait_ms=self.maybe("max_wait_ms", [0, 2, 50, 86_400_000]),
                    hold_max_ms=self.maybe("hold_max_ms", [1, 5, 8000]),
                    queue_limit=self.maybe("queue_limit", [0, 1, 100_000]),
                    busy_policy=self.maybe("busy_policy", list(p.BusyPolicy)),
                    mem_estimate=self.maybe("mem_estimate", MEMORY[1:]), trace=trace,
                )  # fmt: skip
            case "RELEASE":
                lease = self.choose("lease_id", self.leases | set(self.daemon.leases.by_id), ["nope", "abc-1"])
                return p.Release(**ids, lease_id=lease, quiet=d(BOOLEANS, "quiet"))
            case "REPORT_OOM":
                return p.ReportOom(**ids, gpu=self.gpu(), task_type=d(sampled_from(TASK_TYPES), "task_type"))
            case "SET_POLICY":
                return p.SetPolicy(
                    **ids, task_type=d(sampled_from(TASK_TYPES), "task_type"),
                    priority=self.maybe("priority", PRIORITIES),
                    busy_policy=self.maybe("busy_policy", list(p.BusyPolicy)),
                    max_wait_ms=self.maybe("max_wait_ms", [0, 5, 3000]),
                    queue_limit=self.maybe("queue_limit", [0, 1, 100_000]),
                    hold_max_ms=self.maybe("hold_max_ms", [1, 8000]),
                )  # fmt: skip
            case "ALLOCATE":
                return p.Allocate(
                    **ids, task_id=self.choose("task_id", self.tasks, TASK_IDS),
                    gpus=d(sampled_from([1.0, 0.5, 0.25, 0.3333, 1.0, 2.0, 0.0, 3.0, 1.5, 1e-5, 5e-324, 1e3]),
                           "gpus"),
                    cpus=d(sampled_from([0, 1, 0, 2, 3, 100_000]), "cpus"),
                    prefer=d(sampled_from([[], [], [1], [0, 1, 1], ["gpu:5"]]), "prefer"),
                    strategy=d(sampled_from(list(p.Strategy)), "strategy"),
                    tenant=self.maybe("tenant", ["team", "nope"]), priority=self.maybe("priority", PRIORITIES),
                    priority_class=self.maybe("priority_class", [None, None, *p.PriorityClass]),
                    wait_ms=d(sampled_from([0, 5, 1000, 5000]), "wait_ms"),
                    owner_pid=self.maybe("owner_pid", [os.getpid(), p.PID_MAX]),
                )  # fmt: skip
            case "FREE":
                return p.Free(**ids, task_id=self.choose("task_id", self.tasks, TASK_IDS))
        simple = {"LEASES": p.ListLeases, "POLICIES": p.ListPolicies, "ALLOCS": p.ListAllocations,
                  "RESET_ALLOCS": p.ResetAllocations, "STATUS": p.Status, "CLIENTS": p.ListClients}  # fmt: skip
        return simple[kind](**ids)

    def mutated(self, peer: Peer, values: list[Any]) -> bytes:
        """A valid message as a raw map with one to three fields replaced (or added)."""
        raw = msgspec.to_builtins(self.valid(peer))
        for _ in range(self.draw(integers(1, 3), "fields changed")):
            key = self.draw(sampled_from(sorted(raw) + ["extra"]), "field")
            raw[key] = self.draw(sampled_from(values), "value")
        return msgspec.msgpack.encode(raw)

    def malformed(self, peer: Peer) -> bytes:
        kinds = ["random", "truncated", "nested", "non-map", "no-type", "bad-type", "trailing", "raw"]
        kind = self.draw(sampled_from(kinds), "malformed")
        match kind:
            case "random":
                return self.draw(binary(max_size=48), "bytes")
            case "truncated":
                whole = msgspec.msgpack.encode(self.valid(peer))
                return whole[: self.draw(integers(0, len(whole) - 1), "cut at")]
            case "nested":
                depth = self.draw(sampled_from([10, 1000, 20_000, 65_000]), "depth")
                opener = self.draw(sampled_from([b"\x91", b"\x81\xa1a", b"\xdc\x00\x01"]), "opener")
                return opener * (depth // len(opener)) + b"\x00"
            case "non-map":
                values = [0, -1, 2**64 - 1, 1.5, "HELLO", [], ["HELLO", 1], None, True, b"x"]
                return msgspec.msgpack.encode(self.draw(sampled_from(values), "value"))
            case "no-type":
                return msgspec.msgpack.encode({"id": 1, "session": 1})
            case "bad-type":
                tags = [1, None, "", "hello", "WELCOME", "ERROR", "X" * 1000, "HELLO\x00"]
                return msgspec.msgpack.encode({"type": self.draw(sampled_from(tags), "type"), "id": 1})
            case "trailing":
                trailer = self.draw(binary(min_size=1, max_size=8), "trailer")
                return msgspec.msgpack.encode(self.valid(peer)) + trailer
        return self.draw(
            sampled_from([
                b"", b"\xc1", b"\x81\xa4type\xa2\xff\xfe", b"\x81\x01\x02", b"\x82\xa4type\xa5HELLO\xa4type\xa4STOP",
                msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"x")), b"\x81\xa4type\xc4\x05HELLO",
                b"\x83\xa4type\xa5HELLO\xa2id\x01\xa7version\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
            ]),
            "raw bytes",
        )  # fmt: skip

    def payload(self, peer: Peer, kind: str | None = None) -> bytes:
        kind = kind or self.draw(sampled_from(["valid", "extreme", "confused", "malformed"]), "payload")
        if kind == "extreme":
            return self.mutated(peer, EXTREMES)
        if kind == "confused":
            return self.mutated(peer, CONFUSED)
        if kind == "malformed":
            return self.malformed(peer)
        return msgspec.msgpack.encode(self.valid(peer))

    # --- steps ----------------------------------------------------------------

    async def step(self) -> None:
        kind = self.draw(sampled_from(STEPS[self.mix]), "step")
        if (kind == "open" and len(self.peers) < MAX_PEERS) or not self.peers:
            self.open_peer()
        elif kind in ("valid", "extreme", "confused", "malformed", "open"):  # "open" with MAX_PEERS open
            peer = self.pick_peer()
            self.feed(peer, self.payload(peer, "valid" if kind == "open" else kind))
        elif kind in ("close", "flood", "drop", "hang_up"):
            peer = self.pick_peer()
            note(f"{kind} client {peer.conn.client_id}")
            getattr(self, kind)(peer)
        else:
            self.timers(kind)
        self.clock.us += STEP_US
        for peer in list(self.peers):  # the writer tasks, and the peers that read
            self.flush(peer)
            if peer.reads:
                while self.drain(peer) and self.flush(peer):
                    pass

    def drop(self, peer: Peer) -> None:
        """Dropped as a slow reader would be, and handed one more payload before the listener closes it."""
        self.daemon.links.drop(peer.conn, "too_slow")
        self.feed(peer, self.payload(peer))

    def hang_up(self, peer: Peer) -> None:
        """The peer closes its end; the daemon finds out when it next writes (or at close)."""
        if peer.client_end is not None:
            self.drain(peer)
            peer.client_end.close()
            peer.client_end = None

    def timers(self, kind: str) -> None:
        """What the GPU timers and the allocator timer do, or time passing."""
        d, now = self.daemon, self.clock()
        if kind == "settle":
            d.settle_all(now)
        elif kind == "advance":
            slot = d.slots[self.draw(integers(0, len(d.slots) - 1), "gpu")]
            tick_gpu(d, slot, now)
        elif kind == "allocator":
            tick_allocations(d, now, reap=self.draw(BOOLEANS, "reap"))
        else:
            self.clock.us += self.draw(sampled_from(SLEEPS_US), "time passes (us)")

    # --- invariants -------------------------------------------------------------

    def check(self) -> None:
        d, now = self.daemon, self.clock()
        open_conns = {peer.conn.client_id: peer.conn for peer in self.peers}
        assert d.links.connections == open_conns, "daemon.links.connections is not exactly the open connections"
        assert d.links.per_uid == Counter(c.uid for c in open_conns.values())
        assert _samples(d.metrics.node.clients)[0].value == len(open_conns)
        for slot in d.slots:
            slot.scheduler.check()  # Inconsistent must never be raised
        for conn in open_conns.values():
            for sid, gpu in conn.sessions.items():
                assert d.links.owners.get(sid) is conn, f"session {sid} of client {conn.client_id} is not owned by it"
                sched = d.slots[gpu].scheduler
                try:
                    sched.session(sid, now)
                except Refused:
                    raise AssertionError(f"session {sid} of client {conn.client_id} is not on GPU {gpu}") from None
                if d.leases.owns(sid):
                    assert sid in sched.holders() or sid in sched.queue(), f"lease {sid} neither holds nor waits"
        owned_per_gpu: Counter[int] = Counter()
        for sid, conn in d.links.owners.items():
            assert open_conns.get(conn.client_id) is conn, f"session {sid} is owned by closed client {conn.client_id}"
            assert sid in conn.sessions, f"owners names client {conn.client_id} for {sid}, which it does not hold"
            owned_per_gpu[conn.sessions[sid]] += 1
        for slot in d.slots:
            sessions = slot.scheduler.view(now).sessions
            owned = owned_per_gpu[slot.gpu.index]
            assert sessions == owned, f"GPU {slot.gpu.index}: {sessions} sessions in its scheduler, {owned} owned"
        for peer in self.closed:
            conn = peer.conn
            assert not conn.sessions and conn not in d.links.owners.values(), (
                f"closed client {conn.client_id} owns something"
            )
        self.check_arbiter(open_conns)
        self.check_allocator(open_conns)
        faults = [s for s in _samples(d.metrics.node.faults) if s.name.endswith("_total") and s.value]
        assert not faults, f"faults counted: {faults}"

    def check_arbiter(self, open_conns: dict[int, ClientLink]) -> None:
        arb = self.daemon.leases
        assert set(arb.by_id) == {r.lease_id for r in arb.by_sid.values()}
        waiting = 0
        for sid, rec in arb.by_sid.items():
            assert rec.sid == sid and open_conns.get(rec.conn.client_id) is rec.conn, f"lease {sid} of a closed client"
            assert rec.conn.sessions.get(sid) == rec.gpu and self.daemon.links.owners.get(sid) is rec.conn
            sched = self.daemon.slots[rec.gpu].scheduler
            assert (rec.granted_at is not None) == (sid in sched.holders()), f"lease {sid}: answered vs holding"
            assert rec.waiting == (sid in sched.queue()), f"lease {sid}: waiting flag vs queue"
            waiting += rec.waiting
        gauges = [s.value for s in _samples(self.daemon.metrics.queue_length)]
        assert all(v >= 0 for v in gauges), f"gpud_arbiter_queue_length went negative: {gauges}"
        assert sum(gauges) == waiting, f"gpud_arbiter_queue_length sums to {sum(gauges)}, {waiting} leases wait"

    def check_allocator(self, open_conns: dict[int, ClientLink]) -> None:
        alloc = self.daemon.allocations
        led = alloc.ledger
        for slot in self.daemon.slots:
            g = slot.gpu.index
            free, tasks = led.gpu_free(g), led.gpu_tasks(g)
            assert 0 <= free <= UNIT and free + sum(tasks.values()) == UNIT, f"GPU {g}: free {free}, tasks {tasks}"
            for task, share in tasks.items():
                a = led.get(task)
                assert a is not None and g in a.gpus and a.share == share > 0
        cores = [c for a in led.allocations() for c in a.cpus]
        assert len(cores) == len(set(cores)), f"CPU cores assigned twice: {cores}"
        assert not set(cores) & set(led.cpus_free()) and len(cores) + len(led.cpus_free()) == led.cpu_count
        held = {a.task_id for a in led.allocations()}
        assert set(alloc.uids) == held, "allocator.uids and the ledger disagree"
        assert {a.task_id for a, _ in alloc.store.load().records} == held, "the store and the ledger disagree"
        assert set(alloc.waiters) == {r.task_id for r in led.waiting()}, "allocation waiters and the ledger disagree"
        for task, w in alloc.waiters.items():
            assert open_conns.get(w.conn.client_id) is w.conn, f"task {task} waits for closed client {w.conn.client_id}"

    def finish(self) -> None:
        """Close every connection as the listener would; then nothing may be left held."""
        for peer in list(self.peers):
            self.close(peer)
        self.check()
        assert not self.daemon.links.owners and not self.daemon.leases.by_sid and not self.daemon.allocations.waiters
        for slot in self.daemon.slots:
            assert slot.scheduler.view(self.clock()).sessions == 0
        # What a scrape of the registry shows (restricted to this series: collecting every family
        # for each example was a good part of the test's time).
        scrape = self.registry.restricted_registry(["gpud_faults_total"]).collect()
        faults = {s.labels["where"]: s.value for f in scrape if f.name == "gpud_faults"
                  for s in f.samples if s.name == "gpud_faults_total"}  # fmt: skip
        assert set(FAULT_PLACES) <= set(faults) and not any(faults.values()), f"faults counted: {faults}"

    def release(self) -> None:
        """Whatever happened: every socket closed, the store closed."""
        for peer in self.peers + self.closed:
            peer.daemon_end.close()
            if peer.client_end is not None:
                peer.client_end.close()
        self.daemon.allocations.store.close()


def fuzz_config(data: st.DataObject, state_dir: str) -> Config:
    d = data.draw
    return Config(
        state_dir=state_dir, metrics_addr="off", simulate="2x16GiB", admin_group="",
        max_sessions_per_connection=4, max_lock_queue=3, max_allocation_waiters=2, lease_queue_limit=3,
        outbox_limit_bytes=65536, outbox_high_water_bytes=65536, priority_max_uids={"1001": 80},
        tenants={"team": TenantConfig(gpus=1.0, borrow=0.5, uids=[1000])},
        tq_s=d(sampled_from([0.002, 30.0]), label="tq_s"),
        drop_timeout_s=d(sampled_from([0.003, 10.0]), label="drop_timeout_s"),
        mode=d(sampled_from(list(p.Mode)), label="mode"),
        lease_force_release=d(BOOLEANS, label="lease_force_release"),
        compute_window_s=0.1, quota_sample_interval_s=0.001,
    )  # fmt: skip


def _faults(logs: Sequence[Mapping[str, Any]]) -> str:
    out = []
    for entry in logs:
        if entry.get("event") == "fault" and isinstance(entry.get("exc_info"), BaseException):
            out.append("".join(traceback.format_exception(entry["exc_info"])))
    return "\n".join(out)


@settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no explain phase: it takes a minute and adds nothing
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)  # fmt: skip
@given(data=st.data())
async def test_request_handling_survives_anything(data: st.DataObject) -> None:
    state_dir = tempfile.mkdtemp(prefix="gpud-fuzz-", dir=scratch_root())
    try:
        clock = FakeClock()
        with structlog.testing.capture_logs() as logs:
            fuzz = Fuzz(data, fuzz_config(data, state_dir), clock)
            try:
                for _ in range(data.draw(integers(1, MAX_PEERS), label="connections at start")):
                    fuzz.open_peer()
                for _ in range(MAX_STEPS):  # a flag per step, not a count first: shrinking can drop steps
                    if not data.draw(sampled_from(ANOTHER_STEP), label="another step"):
                        break
                    await fuzz.step()
                    fuzz.check()
                fuzz.finish()
            except AssertionError:
                if faults := _faults(logs):
                    note(faults)  # the traceback of each fault counted, from the daemon's log
                raise
            finally:
                fuzz.release()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
