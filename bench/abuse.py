"""Abuse: does gpud keep serving well-behaved clients while other processes send it garbage?

What is measured, against a real daemon (``--simulate 2x16GiB``, metrics on a
free local port, ``--log-level warning``) in its own process:
- two well-behaved clients (one process, bare blocking ``Connection``s) loop:
  a lock handoff on GPU 0 (A holds; B asks; ~200 us later A releases; the
  handoff is A's LOCK_RELEASED send -> B's LOCK_OK receipt, as in
  bench/handoff.py), then a lease on GPU 1 (ACQUIRE ASR, RELEASE). Every ERROR,
  unexpected message, 2 s without the awaited message or lost connection is
  one error; they then reconnect and go on. A handoff B gave up waiting for
  is a sample of 2000 ms (a lower bound) rather than no sample, so that a
  stall shows in the percentiles.
- phase quiet: the good clients alone for N s; phase abuse: the same while
  ABUSERS processes run ``ATTACKS`` for N s (random bytes, truncated and
  oversized frames, frames that are no msgpack (or hold strings that are no
  UTF-8) or no map, unknown types,
  fields of the wrong type, 64-bit extremes in every integer field, deep
  nesting, names and labels at and over their limits, pipelined floods on
  connections that never read, 20 000 task types, rapid connects, idle
  connections without HELLO); then SETTLE_S more of the good clients alone,
  so a failure the abuse arms for later (the owner reaper runs every 5 s) is
  seen too.
- the daemon's VmRSS and its number of metric samples just before and just
  after the abuse (the targets), and again at the end of the settle phase;
  at the end whether it still runs and answers STATUS.

Abusers keep what they may legitimately hold harmless to the good clients:
their sessions and leases are on GPU 1 and declare 0 bytes (they fit beside
the good lease), their allocations are whole GPUs (a fractional one would set
limits on every session of their uid on that GPU, the good clients' too),
and admin requests they send are either no-ops or refused.
So any harm the good clients see is the daemon's. Every abuser loop is bounded
in count and time; the only target is this daemon's Unix socket.

It reports honestly: the first WARMUP handoffs are the only samples left out,
the targets are printed beside the figures, and it exits 0 whether or not
they are met. The test tests/integration/test_abuse.py reuses ``run_scenario``.

    .venv/bin/python bench/abuse.py [--json] [--seconds N] [--settle N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import socket
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from typing import Any

import msgspec

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import DaemonUnavailable, GpudError

from harness import Run, machine_line, progress  # bench/, on the path when run as a script
from percentiles import percentile

ABUSERS = 3  # processes; with at most IDLE_CONNS each, well below ~60 connections in all
GOOD_TIMEOUT_S = 2.0  # a good client waiting longer than this for its answer counts an error
QUEUED_NS = 200_000  # B asks this long before A releases
LEASE_BYTES = 2**30
LEASE_WAIT_MS = 1500  # below GOOD_TIMEOUT_S: a starved lease is answered SKIPPED, not a client timeout
WARMUP = 20  # first handoffs left out (connections and caches warming up)
SETTLE_S = 5.0  # the daemon's default reap_interval_s: one reaper pass after the abuse
IO_TIMEOUT_S = 2.0  # an abuser's socket operations
IDLE_CONNS = 12
BACKOFF_S = 0.01
FLOOD_MESSAGES = 4000
TASK_TYPES = 20_000
START_TIMEOUT_S = 60.0
RETRY_S = 0.2
KEPT_ERRORS = 50
HUGE = (2**63 - 1, 2**64 - 1, -(2**63))  # in every integer field
# ... and these too, except where a large valid value is a legitimate claim on the GPU (memory).
EXTRA = (2**40, 2**32, -1)
CLAIMS = frozenset({"mem_estimate", "used_bytes"})
NO_GPU = 9  # no such GPU: admin requests that would matter if valid are refused
NO_SESSION = 999_999_999
TARGETS = {"handoff_p99_ms_abuse": 20.0, "rss_growth_mb": 50.0, "series_growth_ratio": 0.10}


def enc(obj: object) -> bytes:
    """One frame holding ``obj`` as msgpack, whatever it is."""
    payload: bytes = msgspec.msgpack.encode(obj)
    return p.frame(payload)


HELLO = enc({"type": "HELLO", "id": 0, "version": p.PROTOCOL_VERSION, "name": "abuser"})


# --- abusers (run in their own processes) -----------------------------------------


@dataclass
class Attack:
    """What one attack may use: the socket path, its deadline, a seeded random source."""

    path: str
    until: float  # time.monotonic()
    rng: random.Random
    memo: dict[str, int]  # what this attack kept from its previous run in this process
    sent: int = 0  # frames (or raw chunks) sent
    failed: dict[str, int] = field(default_factory=dict)  # operations that failed, by error: a close, a reset...

    def time_left(self) -> bool:
        return time.monotonic() < self.until

    def connect(self, *, hello: bool = True) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(IO_TIMEOUT_S)
        try:
            s.connect(self.path)
            if hello:
                self.send(s, HELLO)
        except BaseException:
            s.close()
            raise
        return s

    def send(self, s: socket.socket, *chunks: bytes) -> None:
        s.sendall(b"".join(chunks))
        self.sent += len(chunks)

    @contextmanager
    def tolerated(self) -> Iterator[None]:
        """The daemon closing on us, or refusing, is what abuse should meet: counted, not fatal."""
        try:
            yield
        except (OSError, GpudError) as exc:
            why = type(exc).__name__
            self.failed[why] = self.failed.get(why, 0) + 1
            if isinstance(exc, (BlockingIOError, ConnectionRefusedError, DaemonUnavailable)):
                time.sleep(BACKOFF_S)  # a full listen backlog fails a connect at once: no busy loop


def drain(s: socket.socket) -> None:
    """Read and forget whatever the daemon has sent so far, without waiting."""
    s.setblocking(False)  # with a timeout set, recv would first wait for data that may never come
    try:
        while s.recv(1 << 16):
            pass
    except (BlockingIOError, InterruptedError):
        pass
    finally:
        s.settimeout(IO_TIMEOUT_S)


def greeted_session(a: Attack) -> tuple[Connection, int]:
    """A connection past HELLO with a session on GPU 1 that declares 0 bytes."""
    conn = Connection(a.path, timeout=IO_TIMEOUT_S)
    try:
        conn.hello("abuser")
        att: p.Attached = conn.call(p.Attach(id=conn.next_id(), gpu=1, mem_estimate=0), timeout=IO_TIMEOUT_S)
    except BaseException:
        conn.close()
        raise
    conn.sock.settimeout(IO_TIMEOUT_S)
    return conn, att.session


def random_bytes(a: Attack) -> None:
    for i in range(40):
        if not a.time_left():
            return
        with a.tolerated(), closing(a.connect(hello=i % 2 == 0)) as s:
            a.send(s, a.rng.randbytes(a.rng.randint(1, 8192)))


def truncated_frames(a: Attack) -> None:
    for i in range(60):
        if not a.time_left():
            return
        with a.tolerated(), closing(a.connect(hello=i % 2 == 0)) as s:
            promised = a.rng.randint(16, p.MAX_FRAME_BYTES)
            body = a.rng.randbytes(a.rng.randint(0, min(promised - 1, 4096)))
            a.send(s, (promised.to_bytes(4, "big") + body) if i % 5 else b"\x00\x01")


def oversized_headers(a: Attack) -> None:
    lengths = (p.MAX_FRAME_BYTES + 1, 10 * 2**20, 2**31, 2**32 - 1)
    for i in range(40):
        if not a.time_left():
            return
        with a.tolerated(), closing(a.connect(hello=i % 2 == 0)) as s:
            a.send(s, lengths[i % len(lengths)].to_bytes(4, "big") + b"\x00" * 1024)


NOT_MSGPACK = (
    b"\xc1",  # the one byte msgpack never uses
    b"\x85\xa4ty",  # a map cut short
    b"\xdb\xff\xff\xff\xff",  # a str claiming 4 GiB
    b"\xc5\xff",  # a bin16 header cut short
    b"\x81\xa4type\xa6STATUS\x00\x00",  # trailing bytes after a message
    b"\xc7\x0c\xff" + b"\xff" * 12,  # a timestamp with nanoseconds out of range
    b"\xa1\xff",  # a str that is not UTF-8
    b"\x81\xa4type\xa2\xc3\x28",  # ... as the type of a message
)


def not_msgpack(a: Attack) -> None:
    for i in range(60):
        if not a.time_left():
            return
        payload = NOT_MSGPACK[i % len(NOT_MSGPACK)] if i % 4 else a.rng.randbytes(64)
        with a.tolerated(), closing(a.connect(hello=i % 3 != 0)) as s:
            a.send(s, p.frame(payload))


NOT_A_MAP: tuple[object, ...] = (
    [1, 2, 3],
    "STATUS",
    42,
    None,
    True,
    1.5,
    b"bin",
    [{"type": "STATUS", "id": 1}],
    2**64 - 1,
    -(2**63),
    msgspec.msgpack.Ext(1, b"\x00" * 8),
)
UNKNOWN_TYPES: tuple[dict[Any, Any], ...] = (
    {"type": "FORMAT_DISK", "id": 1},
    {"type": 5, "id": 1},
    {"type": None},
    {"type": ["STATUS"]},
    {"type": {"STATUS": 1}},
    {"id": 1},
    {},
    {"type": "status", "id": 1},
    {"type": "STATUS ", "id": 2**64 - 1},
    {"type": "x" * 60_000, "id": 1},
    {"type": "STATUS", "id": 1, "extra": 1},
    {1: 2, "type": "STATUS"},
    {"type": b"STATUS", "id": 1},
    {"type": "\x00\x1b[2J", "id": -1},
)


def not_a_map(a: Attack) -> None:
    with a.tolerated(), closing(a.connect()) as s:
        for i in range(400):
            if not a.time_left():
                return
            a.send(s, enc(NOT_A_MAP[i % len(NOT_A_MAP)]))
            if i % 50 == 49:
                drain(s)


def unknown_types(a: Attack) -> None:
    with a.tolerated(), closing(a.connect()) as s:
        for i in range(600):
            if not a.time_left():
                return
            known = UNKNOWN_TYPES[i % len(UNKNOWN_TYPES)]
            a.send(s, enc(known if i % 2 else {"type": f"T{a.rng.getrandbits(64):x}", "id": i}))
            if i % 50 == 49:
                drain(s)


def baselines(session: int, pid: int) -> dict[str, dict[str, Any]]:
    """One valid request of every type that does no harm if the daemon accepts it."""
    lease = {"gpu": 1, "task_type": "ABUSE", "max_wait_ms": 0, "busy_policy": "SKIP", "mem_estimate": 0}
    return {
        "HELLO": {"version": p.PROTOCOL_VERSION, "name": "abuser", "labels": {"role": "abuser"}},
        "ATTACH": {"gpu": 1, "priority": 0, "core_limit": 100, "mem_limit": 2**30, "mem_estimate": 0},
        "DETACH": {"session": NO_SESSION},
        "LOCK_REQUEST": {"session": session},
        "LOCK_RELEASED": {"session": session, "grant": 1},
        "MEM_UPDATE": {"session": session, "used_bytes": 0},
        "SET_LIMITS": {"client": None, "gpu": 1, "session": session, "core_limit": 50, "mem_limit": 2**30},
        "SET_MODE": {"mode": "auto", "gpu": NO_GPU},
        "ACQUIRE": {
            **lease,
            "priority": 0,
            "hold_max_ms": 1000,
            "queue_limit": 1,
            "trace": {"job_id": "j", "utterance_index": 0, "stage": "s"},
        },
        "RELEASE": {"lease_id": "no-such-lease", "quiet": False},
        "REPORT_OOM": {"gpu": 1, "task_type": "ABUSE"},
        "LEASES": {},
        "SET_POLICY": {
            "task_type": "ABUSE",
            "priority": 0,
            "busy_policy": "SKIP",
            "max_wait_ms": 0,
            "queue_limit": 1,
            "hold_max_ms": 1000,
        },
        "POLICIES": {},
        "ALLOCATE": {
            "task_id": f"abuse-{pid}",
            "gpus": 1.0,
            "cpus": 0,
            "prefer": [1],
            "strategy": "first_fit",
            "priority": 0,
            "wait_ms": 0,
            "owner_pid": pid,
        },
        "FREE": {"task_id": f"abuse-{pid}"},
        "ALLOCS": {},
        "RESET_ALLOCS": {},
        "SCHED_ON": {"gpu": NO_GPU},
        "SCHED_OFF": {"gpu": NO_GPU},
        "SET_TQ": {"seconds": 30.0, "gpu": 1},  # the default: a no-op if accepted
        "STATUS": {},
        "CLIENTS": {},
    }


# Wrong for every field of every message: strings where ints go (with a control character no
# name or pattern allows), lists where strings go, nested maps, bytes, a bool.
CONFUSED: tuple[object, ...] = ("\x00not a number", [1, "x", [2]], {"a": {"b": [1, {"c": None}]}}, b"\x00", True)
# Integer fields (dotted: inside a nested struct; [] suffix: a list's element), by message.
INT_FIELDS = {
    "ATTACH": ("id", "gpu", "priority", "core_limit", "mem_limit", "mem_estimate"),
    "ACQUIRE": (
        "id",
        "gpu",
        "priority",
        "max_wait_ms",
        "hold_max_ms",
        "queue_limit",
        "mem_estimate",
        "trace.utterance_index",
    ),
    "ALLOCATE": ("id", "gpus", "cpus", "priority", "wait_ms", "owner_pid", "prefer[]"),
    "SET_TQ": ("id", "seconds", "gpu"),
    "MEM_UPDATE": ("id", "session", "used_bytes"),
    "SET_LIMITS": ("id", "client", "gpu", "session", "core_limit", "mem_limit"),
}


def variant(kind: str, base: dict[str, Any], path: str, value: object, rid: int = 1) -> dict[str, Any]:
    """``base`` as a ``kind`` message with the field at ``path`` set to ``value``."""
    msg: dict[str, Any] = {"type": kind, "id": rid, **base}
    if path.endswith("[]"):
        msg[path[:-2]] = [value]
    elif "." in path:
        outer, inner = path.split(".", 1)
        msg[outer] = {**msg.get(outer, {}), inner: value}
    else:
        msg[path] = value
    return msg


def _pipelined(a: Attack, make: Callable[[int], Iterator[dict[str, Any]]]) -> None:
    """Send ``make(session)`` on one connection holding a session, reading replies only to discard them."""
    with a.tolerated():
        conn, session = greeted_session(a)
        with closing(conn):
            for i, msg in enumerate(make(session)):
                if not a.time_left():
                    return
                a.send(conn.sock, enc(msg))
                if i % 50 == 49:
                    drain(conn.sock)


def type_confused(a: Attack) -> None:
    def messages(session: int) -> Iterator[dict[str, Any]]:
        for kind, base in baselines(session, os.getpid()).items():
            for name in ("id", *base):
                for value in CONFUSED:
                    yield variant(kind, base, name, value)

    _pipelined(a, messages)


def huge_ints(a: Attack) -> None:
    def messages(session: int) -> Iterator[dict[str, Any]]:
        base = baselines(session, os.getpid())
        for kind, fields in INT_FIELDS.items():
            for path in fields:
                for value in HUGE if path in CLAIMS else HUGE + EXTRA:
                    yield variant(kind, base[kind], path, value)

    _pipelined(a, messages)


NESTED = (
    b"\x91" * 50_000 + b"\xc0",  # [[[... nil ...]]]
    b"\x81\xa1k" * 20_000 + b"\xc0",  # {"k": {"k": ...}}
    b"\x83\xa4type\xa6STATUS\xa2id\x01\xa1x" + b"\x91" * 40_000 + b"\xc0",  # deep inside a known message
    b"\x83\xa4type\xa6ATTACH\xa2id\x01\xa3gpu" + b"\x91" * 40_000 + b"\xc0",  # deep where a field goes
)
NESTED_HELLO = b"\x84\xa4type\xa5HELLO\xa2id\x01\xa7version\x01\xa6labels" + b"\x81\xa1k" * 20_000 + b"\xc0"


def deep_nesting(a: Attack) -> None:
    for i in range(40):
        if not a.time_left():
            return
        payload = NESTED[i % len(NESTED)] if i % 5 else NESTED_HELLO
        with a.tolerated(), closing(a.connect(hello=i % 5 != 0 and i % 3 != 0)) as s:
            a.send(s, p.frame(payload))


def _hellos_at_limits() -> list[dict[str, Any]]:
    labels_full = {f"{i:0128d}": "v" * 128 for i in range(p.MAX_LABELS)}
    return [
        {"name": "n" * 128},
        {"name": "n" * 129},
        {"name": "n" * 60_000},
        {"labels": labels_full},
        {"labels": {f"k{i}": "v" for i in range(p.MAX_LABELS + 1)}},
        {"labels": {"k" * 129: "v"}},
        {"labels": {"k": "v" * 129}},
        {"name": "\x1b[31mred"},
    ]


def _requests_at_limits(pid: int) -> list[dict[str, Any]]:
    acquire = {"type": "ACQUIRE", "id": 2, "gpu": 1, "max_wait_ms": 0, "busy_policy": "SKIP", "mem_estimate": 0}
    allocate = {"type": "ALLOCATE", "id": 3, "gpus": 1.0, "prefer": [1], "owner_pid": pid}
    out = [{**acquire, "task_type": "T" * n} for n in (64, 65)]
    out += [{**acquire, "trace": {"job_id": "j" * n, "stage": "s" * n}} for n in (128, 129)]
    out += [{"type": "ATTACH", "id": 4, "gpu": 1, "mem_estimate": 0, "task_id": "t" * n} for n in (256, 257)]
    out += [{**allocate, "task_id": "t" * n} for n in (256, 257)]
    out += [{**allocate, "task_id": f"abuse-{pid}", "prefer": [1] * n} for n in (1024, 1025)]
    return out


def exactly(size: int) -> bytes:
    """A STATUS with an unknown padding field whose frame payload is ``size`` bytes."""
    pad = size - len(msgspec.msgpack.encode({"type": "STATUS", "id": 5, "pad": ""})) - 2  # str16 header
    return enc({"type": "STATUS", "id": 5, "pad": "x" * pad})


def size_limits(a: Attack) -> None:
    for extra in _hellos_at_limits():
        if not a.time_left():
            return
        hello = enc({"type": "HELLO", "id": 1, "version": p.PROTOCOL_VERSION, **extra})
        with a.tolerated(), closing(a.connect(hello=False)) as s:
            a.send(s, hello, enc({"type": "STATUS", "id": 2}))
    with a.tolerated(), closing(a.connect()) as s:
        for msg in _requests_at_limits(os.getpid()):
            a.send(s, enc(msg))
        a.send(s, exactly(p.MAX_FRAME_BYTES), exactly(p.MAX_FRAME_BYTES + 1))  # the last one closes it
        drain(s)


def pipelined_flood(a: Attack) -> None:
    """Thousands of valid requests on a connection that never reads a reply."""
    with a.tolerated():
        conn, session = greeted_session(a)
        with closing(conn):
            kinds = (
                lambda rid: {"type": "LOCK_REQUEST", "id": rid, "session": session},
                lambda rid: {"type": "STATUS", "id": rid},
                lambda rid: {"type": "CLIENTS", "id": rid},
                lambda rid: {"type": "ATTACH", "id": rid, "gpu": 1, "mem_estimate": 0},
            )
            batch: list[bytes] = []
            for rid in range(1, FLOOD_MESSAGES + 1):
                batch.append(enc(kinds[a.rng.randrange(len(kinds))](rid)))
                if len(batch) == 100:
                    if not a.time_left():
                        return
                    a.send(conn.sock, *batch)
                    batch.clear()


def many_task_types(a: Attack) -> None:
    """TASK_TYPES distinct task types in ACQUIRE and REPORT_OOM; a later run goes on where the last stopped."""
    with a.tolerated():
        conn = Connection(a.path, timeout=IO_TIMEOUT_S)
        with closing(conn):
            conn.hello("abuser")
            for start in range(a.memo.get("next", 0), TASK_TYPES, 250):
                if not a.time_left():
                    return
                _task_type_batch(a, conn, [f"abuse-{i:05d}" for i in range(start, start + 250)])
                a.memo["next"] = start + 250


def _task_type_batch(a: Attack, conn: Connection, names: list[str]) -> None:
    lease = {"type": "ACQUIRE", "gpu": 1, "max_wait_ms": 0, "busy_policy": "SKIP", "mem_estimate": 0}
    frames = [enc({**lease, "id": conn.next_id(), "task_type": n}) for n in names]
    frames += [enc({"type": "REPORT_OOM", "id": conn.next_id(), "gpu": 1, "task_type": n}) for n in names]
    a.send(conn.sock, *frames)
    acquired: list[str] = []
    for _ in range(2 * len(names)):  # a LEASE_RESULT and an OK (or an ERROR) per name
        msg = conn.recv(IO_TIMEOUT_S)
        if isinstance(msg, p.LeaseResult) and msg.lease_id is not None:
            acquired.append(msg.lease_id)
    # Give the leases back so that what the abuser holds stays small: only the names pile up.
    a.send(conn.sock, *(enc({"type": "RELEASE", "id": conn.next_id(), "lease_id": x, "quiet": True}) for x in acquired))


def rapid_open_close(a: Attack) -> None:
    for i in range(1000):
        if not a.time_left():
            return
        with a.tolerated(), closing(a.connect(hello=i % 4 == 0)):
            pass


def never_hello(a: Attack) -> None:
    """Connections that never send HELLO: idle, half a header, or a frame cut short; held for up to 3 s."""
    socks: list[socket.socket] = []
    try:
        for i in range(IDLE_CONNS):
            with a.tolerated():
                socks.append(a.connect(hello=False))
                if i % 3:
                    a.send(socks[-1], b"\x00\x00" if i % 3 == 1 else b"\x00\x00\x00\x10\x81")
        time.sleep(max(0.0, min(3.0, a.until - time.monotonic())))  # holding them is the attack
    finally:
        for s in socks:
            s.close()


ATTACKS: dict[str, Callable[[Attack], None]] = {
    f.__name__: f
    for f in (
        random_bytes,
        truncated_frames,
        oversized_headers,
        not_msgpack,
        not_a_map,
        unknown_types,
        type_confused,
        huge_ints,
        deep_nesting,
        size_limits,
        pipelined_flood,
        many_task_types,
        rapid_open_close,
        never_hello,
    )
}


LATE_TURN_S = 0.2  # what an attack that starts after the end gets, in the first pass


def run_abuser(path: str, names: list[str], seconds: float, seed: int, start: Any, out: Pipe) -> None:
    """One abuser process: its attacks in turn, each with a fair share of the time, until ``seconds`` pass.
    Every attack is made at least once, however slow the machine: the first pass never stops early,
    and an attack that starts late gets a short turn of its own."""
    rng = random.Random(seed)
    sent: dict[str, int] = dict.fromkeys(names, 0)
    failed: dict[str, dict[str, int]] = {name: {} for name in names}
    failures: dict[str, str] = {}
    memos: dict[str, dict[str, int]] = {name: {} for name in names}
    start.wait(START_TIMEOUT_S)
    end = time.monotonic() + seconds
    share = max(0.5, seconds / len(names))
    for turn in range(1000):  # passes; the clock ends it long before
        for name in names:
            now = time.monotonic()
            if now >= end and turn > 0:
                break
            a = Attack(path, max(now + LATE_TURN_S, min(end, now + share)), rng, memos[name])
            try:
                ATTACKS[name](a)
            except Exception as exc:  # a bug of this benchmark, not of the daemon: say so, go on
                failures[name] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            sent[name] += a.sent
            for why, n in a.failed.items():
                failed[name][why] = failed[name].get(why, 0) + n
        if time.monotonic() >= end:
            break
    out.send({"sent": sent, "failed": failed, "failures": failures})
    out.close()


# --- the well-behaved clients (their own process) --------------------------------


class Misbehaved(Exception):
    """The daemon answered a good client with an error or something it did not ask for."""


def expect(conn: Connection, kind: type, *, rid: int | None = None, session: int | None = None) -> Any:
    """The next message, which must be a ``kind`` (answering ``rid``, or about ``session``)."""
    msg = conn.recv(GOOD_TIMEOUT_S)
    if isinstance(msg, p.Error):
        raise Misbehaved(f"ERROR {msg.code}: {msg.message} (request {msg.id})")
    wrong_id = rid is not None and getattr(msg, "id", None) != rid
    wrong_session = session is not None and getattr(msg, "session", None) != session
    if not isinstance(msg, kind) or wrong_id or wrong_session:
        raise Misbehaved(f"unexpected {msg!r} while waiting for {kind.__name__}")
    return msg


def _spin_until(deadline_ns: int) -> None:
    while time.monotonic_ns() < deadline_ns:
        os.sched_yield()


class GoodPair:
    """Two well-behaved clients, A and B, each with a session on GPU 0."""

    def __init__(self, path: str) -> None:
        self.a = Connection(path, timeout=GOOD_TIMEOUT_S)
        try:
            self.b = Connection(path, timeout=GOOD_TIMEOUT_S)
        except BaseException:
            self.a.close()
            raise
        try:
            self.sa, self.sb = self._greet(self.a, "good-a"), self._greet(self.b, "good-b")
        except BaseException:
            self.close()
            raise
        self.turn = 0
        self.released_at: int | None = None  # A released; B's LOCK_OK not in yet

    @staticmethod
    def _greet(conn: Connection, name: str) -> int:
        rid = conn.next_id()
        conn.send(p.Hello(id=rid, version=p.PROTOCOL_VERSION, name=name))
        expect(conn, p.Welcome, rid=rid)
        rid = conn.next_id()
        conn.send(p.Attach(id=rid, gpu=0))
        session: int = expect(conn, p.Attached, rid=rid).session
        return session

    def handoff(self) -> tuple[int, int]:
        """(when A released, ns until B's LOCK_OK arrived), B having asked QUEUED_NS before."""
        a, b = self.a, self.b
        a.send(p.LockRequest(id=a.next_id(), session=self.sa))
        grant_a = expect(a, p.LockOk, session=self.sa).grant
        b.send(p.LockRequest(id=b.next_id(), session=self.sb))
        _spin_until(time.monotonic_ns() + QUEUED_NS)
        t_release = self.released_at = time.monotonic_ns()
        a.send(p.LockReleased(id=a.next_id(), session=self.sa, grant=grant_a))
        grant_b = expect(b, p.LockOk, session=self.sb).grant
        t_grant = time.monotonic_ns()
        self.released_at = None
        b.send(p.LockReleased(id=b.next_id(), session=self.sb, grant=grant_b))
        return t_release, t_grant - t_release

    def lease(self) -> None:
        """An ASR lease on GPU 1, taken by A and B in turn, and given back."""
        conn = self.b if self.turn else self.a
        self.turn ^= 1
        rid = conn.next_id()
        conn.send(p.Acquire(id=rid, gpu=1, task_type="ASR", mem_estimate=LEASE_BYTES, max_wait_ms=LEASE_WAIT_MS))
        result: p.LeaseResult = expect(conn, p.LeaseResult, rid=rid)
        if not result.acquired or result.lease_id is None:
            raise Misbehaved(f"the lease on GPU 1 was not acquired: {result.status} ({result.reason})")
        rid = conn.next_id()
        conn.send(p.Release(id=rid, lease_id=result.lease_id))
        expect(conn, p.Ok, rid=rid)

    def close(self) -> None:
        self.a.close()
        self.b.close()


GOOD_FAILURES = (GpudError, OSError, Misbehaved)
TIMED_OUT_NS = round(GOOD_TIMEOUT_S * 1e9)  # a handoff B gave up waiting for: counted at this lower bound


def good_clients(path: str, ready: Any, stop: Any, out: Pipe) -> None:
    """Handoffs and leases until told to stop; every failure is stamped, then they reconnect."""
    handoffs: list[tuple[int, int]] = []
    leases: list[int] = []
    errors: list[tuple[int, str]] = []
    pair: GoodPair | None = None
    try:
        pair = GoodPair(path)
    except GOOD_FAILURES as exc:
        errors.append((time.monotonic_ns(), f"connecting: {type(exc).__name__}: {exc}"))
    ready.set()
    while not stop.is_set():
        try:
            pair = pair or GoodPair(path)
            handoffs.append(pair.handoff())
            pair.lease()
            leases.append(time.monotonic_ns())
        except GOOD_FAILURES as exc:
            errors.append((time.monotonic_ns(), f"{type(exc).__name__}: {exc}"))
            if pair is not None and pair.released_at is not None and isinstance(exc, TimeoutError):
                handoffs.append((pair.released_at, TIMED_OUT_NS))  # it took at least this long
            if pair is not None:
                pair.close()
                pair = None
            stop.wait(RETRY_S)  # a pause before reconnecting, not a synchronisation
    if pair is not None:
        pair.close()
    out.send({"handoffs": handoffs, "leases": leases, "errors": errors})
    out.close()


# --- the scenario (parent side) ------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Plan:
    quiet_s: float = 10.0
    abuse_s: float = 10.0
    settle_s: float = SETTLE_S
    abusers: int = ABUSERS
    seed: int = 1


@dataclass(frozen=True)
class Snapshot:
    rss_mb: float | None  # None: the process is gone
    families: dict[str, int] | None  # samples by metric name; None: no metrics endpoint, or it did not answer

    @property
    def series(self) -> int | None:
        return None if self.families is None else sum(self.families.values())


@dataclass
class Observed:
    """What one scenario saw; ``report`` makes the figures."""

    marks: dict[str, int]  # phase -> its start, monotonic ns ("end" closes the last)
    handoffs: list[tuple[int, int]]  # (t_release_ns, handoff_ns)
    leases: list[int]
    errors: list[tuple[int, str]]
    before: Snapshot
    after: Snapshot
    end: Snapshot  # after the settle phase: what the abuse left for good
    alive: bool
    exit_code: int | None
    abusers: list[dict[str, Any]] = field(default_factory=list)

    def phase_of(self, t_ns: int) -> str:
        found = "start"
        for phase, began in self.marks.items():
            if t_ns >= began:
                found = phase
        return found

    def handoffs_ms(self, phase: str) -> list[float]:
        return [ns / 1e6 for t, ns in self.handoffs[WARMUP:] if self.phase_of(t) == phase]

    def longest_pause_ms(self, phase: str) -> float | None:
        """The longest time in ``phase`` without a handoff (its start and end count as handoffs)."""
        names = list(self.marks)
        if phase not in names or names.index(phase) + 1 >= len(names):
            return None
        end = self.marks[names[names.index(phase) + 1]]
        times = [self.marks[phase], *(t for t, _ in self.handoffs if self.phase_of(t) == phase), end]
        return max(b - a for a, b in zip(times, times[1:])) / 1e6

    def errors_in(self, phase: str) -> list[str]:
        return [text for t, text in self.errors if self.phase_of(t) == phase]


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return kb / 1024


def count_series(url: str) -> dict[str, int] | None:
    """Sample lines (neither comment nor empty) on the metrics endpoint, by metric name."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    families: dict[str, int] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            families[name] = families.get(name, 0) + 1
    return families


def snapshot(d: DaemonProcess, metrics_url: str | None) -> Snapshot:
    pid = d.proc.pid if d.proc is not None and d.proc.poll() is None else None
    return Snapshot(rss_mb(pid) if pid else None, count_series(metrics_url) if metrics_url else None)


def answers_status(d: DaemonProcess) -> bool:
    if d.proc is None or d.proc.poll() is not None:
        return False
    try:
        with Connection(d.socket, timeout=5.0) as conn:
            conn.hello("abuse-check")
            return isinstance(conn.call(p.Status(id=conn.next_id()), timeout=5.0), p.StatusReply)
    except (GpudError, OSError):
        return False


def _receive(pipe: Pipe, proc: Any, timeout: float) -> dict[str, Any]:
    try:
        if pipe.poll(timeout):
            got: dict[str, Any] = pipe.recv()
            return got
        return {"missing": f"{proc.name} sent nothing within {timeout:.0f} s"}
    except EOFError:
        return {"missing": f"{proc.name} died without results (its traceback is above)"}
    finally:
        pipe.close()


def _end(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join()


def abuse(ctx: Any, path: str, plan: Plan) -> tuple[int, list[dict[str, Any]]]:
    """Run the abuser processes together; when they began (ns) and what each reported."""
    names = list(ATTACKS)
    start = ctx.Barrier(plan.abusers + 1)
    procs, pipes = [], []
    try:
        for i in range(plan.abusers):
            ours, theirs = ctx.Pipe(duplex=False)
            args = (path, names[i :: plan.abusers], plan.abuse_s, plan.seed + i, start, theirs)
            proc = ctx.Process(target=run_abuser, args=args, name=f"abuser-{i}", daemon=True)
            proc.start()
            theirs.close()  # so a dead abuser shows up as EOF on ours
            procs.append(proc)
            pipes.append(ours)
        start.wait(START_TIMEOUT_S)
        began = time.monotonic_ns()
        return began, [_receive(pipe, proc, plan.abuse_s + 30) for pipe, proc in zip(pipes, procs)]
    finally:
        _end(procs)


def run_scenario(d: DaemonProcess, plan: Plan, metrics_url: str | None = None) -> Observed:
    """Good clients through quiet, abuse and settle phases against the running daemon ``d``."""
    ctx = mp.get_context("spawn")  # workers import this module by name: no inherited state
    ready, stop = ctx.Event(), ctx.Event()
    ours, theirs = ctx.Pipe(duplex=False)
    good = ctx.Process(target=good_clients, args=(d.socket, ready, stop, theirs), name="good-clients", daemon=True)
    good.start()
    theirs.close()
    try:
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the good clients did not start")
        marks = {"quiet": time.monotonic_ns()}
        time.sleep(plan.quiet_s)  # the phase lasts this long; nothing is waited for
        before = snapshot(d, metrics_url)
        marks["abuse"], reports = abuse(ctx, d.socket, plan)
        marks["settle"] = time.monotonic_ns()
        after = snapshot(d, metrics_url)
        time.sleep(plan.settle_s)
        marks["end"] = time.monotonic_ns()
        end = snapshot(d, metrics_url)
    finally:
        stop.set()
        seen = _receive(ours, good, 30)
        _end([good])
    alive = answers_status(d)
    exit_code = d.proc.poll() if d.proc is not None else None
    if "missing" in seen:
        raise RuntimeError(seen["missing"])
    return Observed(
        marks, seen["handoffs"], seen["leases"], seen["errors"], before, after, end, alive, exit_code, reports
    )


def log_findings(text: str) -> tuple[dict[str, int], list[str]]:
    """The daemon's log: how often each event came, and every traceback in it."""
    events: dict[str, int] = {}
    tracebacks: list[str] = []
    bare: list[str] = []  # not JSON: what an unhandled crash prints
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            bare.append(line)
            continue
        if not isinstance(record, dict):
            bare.append(line)
            continue
        event = str(record.get("event", "?"))
        events[event] = events.get(event, 0) + 1
        if "exception" in record:
            tracebacks.append(f"{event} {record.get('error', '')}\n{record['exception']}")
    raw = "\n".join(bare)
    if "Traceback (most recent call last)" in raw:
        tracebacks.append(raw[raw.index("Traceback (most recent call last)") :])
    return events, tracebacks


_EXCEPTION_LINE = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::|$)")


def traceback_kinds(tracebacks: list[str]) -> dict[str, int]:
    """How often each kind of traceback came, by its last exception line."""
    kinds: dict[str, int] = {}
    for tb in tracebacks:
        lines = [line.strip(" |+-") for line in tb.splitlines()]
        found = [line for line in lines if _EXCEPTION_LINE.match(line) and "Group" not in line]
        kind = re.sub(r"0x[0-9a-f]+|(?<!utf-)\d+", "N", found[-1] if found else lines[-1])  # bytes, positions
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


# --- figures -----------------------------------------------------------------------


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _pct(samples: list[float], pct: float) -> float | None:
    return round(percentile(samples, pct), 3) if samples else None


def _growth_met(before: float | None, after: float | None, limit: float, *, ratio: bool = False) -> bool:
    if before is None or after is None or (ratio and before <= 0):
        return False
    return (after - before) / before <= limit if ratio else after - before <= limit


def _growth_by_name(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    """The metric names whose number of samples changed the most, largest first."""
    if before is None or after is None:
        return {}
    growth = {name: after.get(name, 0) - before.get(name, 0) for name in before.keys() | after.keys()}
    return dict(sorted(((n, g) for n, g in growth.items() if g), key=lambda x: -abs(x[1]))[:12])


def figures(seen: Observed) -> dict[str, Any]:
    quiet, abused = seen.handoffs_ms("quiet"), seen.handoffs_ms("abuse")
    return {
        "handoff_p50_ms_quiet": _pct(quiet, 50),
        "handoff_p99_ms_quiet": _pct(quiet, 99),
        "handoff_p50_ms_abuse": _pct(abused, 50),
        "handoff_p99_ms_abuse": _pct(abused, 99),
        "errors_seen_by_good_clients": len(seen.errors),
        "daemon_alive": seen.alive,
        "rss_mb_before": None if seen.before.rss_mb is None else round(seen.before.rss_mb, 1),
        "rss_mb_after": None if seen.after.rss_mb is None else round(seen.after.rss_mb, 1),
        "metric_series_before": seen.before.series,
        "metric_series_after": seen.after.series,
        "rss_mb_end": None if seen.end.rss_mb is None else round(seen.end.rss_mb, 1),
        "metric_series_end": seen.end.series,
    }


def report(seen: Observed, plan: Plan, log_text: str, machine: dict[str, Any]) -> dict[str, Any]:
    result = figures(seen)
    p99 = result["handoff_p99_ms_abuse"]
    met = {
        "no_errors": result["errors_seen_by_good_clients"] == 0,
        "daemon_alive": seen.alive,
        "handoff_p99_ms_abuse": p99 is not None and p99 <= TARGETS["handoff_p99_ms_abuse"],
        "rss_growth_mb": _growth_met(seen.before.rss_mb, seen.after.rss_mb, TARGETS["rss_growth_mb"]),
        "series_growth_ratio": _growth_met(
            seen.before.series, seen.after.series, TARGETS["series_growth_ratio"], ratio=True
        ),
    }
    events, tracebacks = log_findings(log_text)
    phases = ("start", "quiet", "abuse", "settle", "end")
    sent: dict[str, dict[str, int]] = {}
    for r in seen.abusers:
        for name, n in r.get("sent", {}).items():
            sent[name] = {"sent": n, "failed": r["failed"][name]}
    return result | {
        "targets_met": all(met.values()),
        "met": met,
        "targets": {"errors_seen_by_good_clients": 0, "daemon_alive": True, **TARGETS},
        "metric_series_growth_by_name": _growth_by_name(seen.before.families, seen.after.families),
        "handoffs": {ph: len(seen.handoffs_ms(ph)) for ph in ("quiet", "abuse", "settle")},
        "longest_pause_ms": {ph: _round(seen.longest_pause_ms(ph)) for ph in ("quiet", "abuse", "settle")},
        "handoffs_timed_out": {
            ph: sum(1 for ms in seen.handoffs_ms(ph) if ms * 1e6 >= TIMED_OUT_NS) for ph in ("quiet", "abuse", "settle")
        },
        "leases": {ph: sum(1 for t in seen.leases if seen.phase_of(t) == ph) for ph in ("quiet", "abuse", "settle")},
        "errors_by_phase": {ph: len(seen.errors_in(ph)) for ph in phases if seen.errors_in(ph)},
        "first_errors": [f"{seen.phase_of(t)}: {text}" for t, text in seen.errors[:KEPT_ERRORS]],
        "attacks": sent,
        "abuser_problems": [r["missing"] for r in seen.abusers if "missing" in r]
        + [f"{k}: {v}" for r in seen.abusers for k, v in r.get("failures", {}).items()],
        "daemon_exit_code": seen.exit_code,
        "daemon_log_events": events,
        "daemon_log_tracebacks": traceback_kinds(tracebacks),
        "seconds_per_phase": plan.abuse_s,
        "settle_s": plan.settle_s,
        "abusers": plan.abusers,
        **machine,
    }


def _show(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:g}" if isinstance(value, float) else str(value)


def table(r: dict[str, Any]) -> str:
    t = r["targets"]
    rows = [
        (
            "handoff p50 / p99, quiet",
            f"{_show(r['handoff_p50_ms_quiet'])} / {_show(r['handoff_p99_ms_quiet'])} ms",
            "",
            None,
        ),
        (
            "handoff p50 / p99, abuse",
            f"{_show(r['handoff_p50_ms_abuse'])} / {_show(r['handoff_p99_ms_abuse'])} ms",
            f"p99 <= {t['handoff_p99_ms_abuse']:g} ms",
            "handoff_p99_ms_abuse",
        ),
        (
            "longest pause in handoffs, quiet / abuse",
            f"{_show(r['longest_pause_ms']['quiet'])} / {_show(r['longest_pause_ms']['abuse'])} ms",
            "",
            None,
        ),
        ("errors seen by good clients", _show(r["errors_seen_by_good_clients"]), "0", "no_errors"),
        ("daemon alive, answers STATUS", _show(r["daemon_alive"]), "yes", "daemon_alive"),
        (
            "daemon RSS before / after (/ end of settle)",
            f"{_show(r['rss_mb_before'])} / {_show(r['rss_mb_after'])} ({_show(r['rss_mb_end'])}) MB",
            f"+{t['rss_growth_mb']:g} MB at most",
            "rss_growth_mb",
        ),
        (
            "metric series before / after (/ end of settle)",
            f"{_show(r['metric_series_before'])} / {_show(r['metric_series_after'])} ({_show(r['metric_series_end'])})",
            f"+{t['series_growth_ratio']:.0%} at most",
            "series_growth_ratio",
        ),
    ]
    lines = [f"{'figure':<48}{'measured':>24}  {'target':<20}met"]
    for label, measured, target, key in rows:
        met = _show(r["met"][key]) if key else ""
        lines.append(f"{label:<48}{measured:>24}  {target:<20}{met}".rstrip())
    h, le, to = r["handoffs"], r["leases"], r["handoffs_timed_out"]
    lines.append(
        f"handoffs quiet/abuse/settle: {h['quiet']}/{h['abuse']}/{h['settle']} "
        f"(timed out, counted at {GOOD_TIMEOUT_S * 1000:g} ms: {to['quiet']}/{to['abuse']}/{to['settle']}); "
        f"leases {le['quiet']}/{le['abuse']}/{le['settle']}; errors by phase {r['errors_by_phase'] or '-'}"
    )
    if r["metric_series_growth_by_name"]:
        lines.append(
            "metric series that grew: " + ", ".join(f"{k} {v:+d}" for k, v in r["metric_series_growth_by_name"].items())
        )
    lines.append("attacks: frames sent, and operations that failed (the daemon closed, reset, refused...):")
    lines.extend(f"  {k:<18}{v['sent']:>7}  {v['failed'] or ''}" for k, v in r["attacks"].items())
    lines.extend(f"  good client error, {e}" for e in r["first_errors"][:10])
    lines.extend(f"  abuser problem: {e}" for e in r["abuser_problems"])
    lines.append(
        f"{r['seconds_per_phase']:g} s per phase + {r['settle_s']:g} s settle, {r['abusers']} abusers, "
        f"{machine_line(r)}; targets met: {_show(r['targets_met'])}"
    )
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def parse_args(argv: list[str] | None) -> tuple[Plan, bool]:
    ap = argparse.ArgumentParser(description="gpud under abuse: good clients' latency and errors, daemon health.")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--seconds", type=float, default=Plan.abuse_s, help="length of the quiet and the abuse phase")
    ap.add_argument(
        "--settle", type=float, default=Plan.settle_s, help=f"length of the phase after ({SETTLE_S:g}: one reap pass)"
    )
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.settle <= 0:
        ap.error("--seconds and --settle must be > 0")
    return Plan(quiet_s=args.seconds, abuse_s=args.seconds, settle_s=args.settle), args.json


def _complain(seen: Observed, log_text: str) -> None:
    _, tracebacks = log_findings(log_text)
    if not seen.alive:
        tail = "\n".join(log_text.splitlines()[-60:])
        progress(f"THE DAEMON DIED or stopped answering (exit code {seen.exit_code}); the tail of its log:\n{tail}")
    kinds = traceback_kinds(tracebacks)
    for kind in kinds:  # the first of each kind in full
        first = next(tb for tb in tracebacks if traceback_kinds([tb]) == {kind: 1})
        progress(f"the daemon logged {kinds[kind]} tracebacks ending in {kind}; the first:\n{first}")


def main(argv: list[str] | None = None) -> int:
    plan, as_json = parse_args(argv)
    run = Run()
    port = free_port()
    progress(f"quiet {plan.quiet_s:g} s, abuse {plan.abuse_s:g} s ({plan.abusers} abusers), settle {plan.settle_s:g} s")
    d = DaemonProcess("--simulate", "2x16GiB", "--metrics-addr", f"127.0.0.1:{port}", "--log-level", "warning")
    d.start()
    try:
        seen = run_scenario(d, plan, metrics_url=f"http://127.0.0.1:{port}/metrics")
        log_text = d.log()
    finally:
        d.cleanup()
    _complain(seen, log_text)
    result = report(seen, plan, log_text, run.machine())
    print(table(result))
    if as_json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
