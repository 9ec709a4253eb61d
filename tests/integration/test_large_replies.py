"""Answers larger than a request frame reach every reader whole, on a real daemon.

Requests are capped at 64 KiB (``p.MAX_FRAME_BYTES``); the daemon's answers are not,
and the clients accept frames up to ``p.MAX_REPLY_BYTES``. Each test starts a daemon
carrying a busy node: 1000 idle sessions on 20 connections, 500 leases with full
traces waiting behind one lease holder on GPU 0, 500 fractional allocations. Then
STATUS, CLIENTS, LEASES and ALLOCS are read by gpuctl (JSON and tables), gpuctl top,
the sync client, the asyncio client and a connection that pipelines 50 CLIENTS
requests before reading any answer. Throughout, a session on another connection holds
GPU 1's lock and must keep it: no DROP_LOCK, no REVOKED, the same grant.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.aio import AsyncClient
from gpud_client.connection import Connection

from .waiting import eventually
from .wire import attach, connect, expect, gpu_status, nothing_arrives, take_lock

SESSION_CONNS, SESSIONS_EACH = 20, 50
WAITER_CONNS, LEASES_EACH = 10, 50
ALLOCATIONS = 500
TASK = "BULK"
HOLDER, LEASE_HOLDER, CHECKER, ALLOCATOR = "gpu1-trainer", "lease-holder", "checker", "allocator"


def _pad(prefix: str, char: str, length: int = 124) -> str:
    return prefix + char * (length - len(prefix))


def session_conn_name(k: int) -> str:
    return _pad(f"sessions-{k:02d}-", "s", 120)


def waiter_name(k: int) -> str:
    return _pad(f"lease-waiter-{k:02d}-", "w", 120)


def trace(i: int) -> p.Trace:
    """Every field filled, names near their 128-character limit."""
    return p.Trace(
        job_id=_pad(f"job-{i:04d}-", "j"),
        session_id=_pad(f"sess-{i:04d}-", "k"),
        utterance_index=2**53 - i,
        stage=_pad(f"stage-{i:04d}-", "g"),
    )


def task_id(i: int) -> str:
    return _pad(f"task-{i:04d}-", "t", 200)


@dataclass
class Node:
    d: DaemonProcess
    holder: Connection  # holds GPU 1's lock, never reads anything else
    lock_session: int
    lock_grant: int
    checker: Connection
    lease_id: str
    conns: list[Connection] = field(default_factory=list)

    @property
    def waiter_names(self) -> set[str]:
        return {waiter_name(k) for k in range(WAITER_CONNS)}


def waiting_leases(conn: Connection) -> int:
    return sum(le.state == "waiting" for le in conn.call(p.ListLeases(id=conn.next_id())).leases)


def _open(d: DaemonProcess, name: str, conns: list[Connection]) -> Connection:
    conn = connect(d, name)
    conns.append(conn)
    return conn


def _load(node: Node) -> None:
    """The busy node: sessions, waiting leases, allocations (pipelined, answers checked)."""
    for k in range(SESSION_CONNS):
        conn = _open(node.d, session_conn_name(k), node.conns)
        for j in range(SESSIONS_EACH):
            conn.send(p.Attach(id=conn.next_id(), gpu=j % 2))
        for _ in range(SESSIONS_EACH):
            expect(conn, p.Attached)
    for k in range(WAITER_CONNS):
        conn = _open(node.d, waiter_name(k), node.conns)
        for j in range(LEASES_EACH):
            conn.send(
                p.Acquire(
                    id=conn.next_id(), gpu=0, task_type=TASK, max_wait_ms=60_000, trace=trace(k * LEASES_EACH + j)
                )
            )
    eventually(lambda: waiting_leases(node.checker) == WAITER_CONNS * LEASES_EACH, "500 waiting leases", timeout=20)
    alloc = _open(node.d, ALLOCATOR, node.conns)
    for start in range(0, ALLOCATIONS, 50):
        for i in range(start, start + 50):
            alloc.send(p.Allocate(id=alloc.next_id(), task_id=task_id(i), gpus=0.001))
        for _ in range(50):
            expect(alloc, p.Allocated, timeout=10)


@pytest.fixture
def node(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> Iterator[Node]:
    cfg = tmp_path / "gpud.toml"
    cfg.write_text(
        "lease_queue_limit = 1000\n\n"
        f'[policies.{TASK}]\npriority = 50\nbusy_policy = "WAIT"\nmax_wait_ms = 600000\nqueue_limit = 1000\n'
    )
    d = daemon_factory("--simulate", "2x16GiB", "--config", str(cfg))
    conns: list[Connection] = []
    try:
        holder = _open(d, HOLDER, conns)
        lock_session = attach(holder, gpu=1)
        ok = take_lock(holder, lock_session)
        checker = _open(d, CHECKER, conns)
        leaser = _open(d, LEASE_HOLDER, conns)
        got = leaser.call(
            p.Acquire(id=leaser.next_id(), gpu=0, task_type=TASK, hold_max_ms=3_600_000, trace=trace(9999))
        )
        assert got.acquired and got.lease_id, got
        node = Node(d, holder, lock_session, ok.grant, checker, got.lease_id, conns)
        _load(node)
        yield node
    finally:
        for conn in conns:
            conn.close()


# --- what every reader must find in the answers ------------------------------------


def is_large(reply: msgspec.Struct) -> bool:
    return len(msgspec.msgpack.encode(reply)) > p.MAX_FRAME_BYTES


def check_status(reply: p.StatusReply, node: Node) -> None:
    g0, g1 = reply.gpus
    assert [h.name for h in g0.holders] == [LEASE_HOLDER]
    assert len(g0.queue) == WAITER_CONNS * LEASES_EACH
    assert {w.name for w in g0.queue} == node.waiter_names
    assert [(h.name, h.session, h.grant) for h in g1.holders] == [(HOLDER, node.lock_session, node.lock_grant)]
    assert g1.queue == []
    assert g0.clients == SESSION_CONNS + WAITER_CONNS + 1 and g1.clients == SESSION_CONNS + 1


def check_clients(reply: p.ClientsReply, node: Node) -> None:
    by_name = {c.name: c for c in reply.clients}
    for k in range(SESSION_CONNS):
        sessions = by_name[session_conn_name(k)].sessions
        assert [(s.gpu, s.state) for s in sessions] == [(j % 2, "idle") for j in range(SESSIONS_EACH)]
    for name in node.waiter_names:
        assert [s.state for s in by_name[name].sessions] == ["waiting"] * LEASES_EACH
    assert [(s.session, s.state, s.grants) for s in by_name[HOLDER].sessions] == [(node.lock_session, "holding", 1)]
    total = sum(len(c.sessions) for c in reply.clients)
    assert total == SESSION_CONNS * SESSIONS_EACH + WAITER_CONNS * LEASES_EACH + 2


def check_leases(reply: p.LeasesReply, node: Node) -> None:
    holding = [le for le in reply.leases if le.state == "holding"]
    waiting = [le for le in reply.leases if le.state == "waiting"]
    assert [(le.lease_id, le.name) for le in holding] == [(node.lease_id, LEASE_HOLDER)]
    assert len(reply.leases) == 1 + len(waiting) and len(waiting) == WAITER_CONNS * LEASES_EACH
    assert {le.trace.job_id: le.trace for le in waiting} == {t.job_id: t for t in map(trace, range(len(waiting)))}
    assert {le.name for le in waiting} == node.waiter_names and {le.task_type for le in waiting} == {TASK}


def check_allocs(reply: p.AllocationsReply) -> None:
    assert sorted(a.task_id for a in reply.allocations) == sorted(map(task_id, range(ALLOCATIONS)))
    assert {(tuple(a.gpus), a.share) for a in reply.allocations} == {((0,), 0.001)}
    assert reply.gpus[0].allocated == pytest.approx(ALLOCATIONS * 0.001)
    assert len(reply.gpus[0].tasks) == ALLOCATIONS and reply.waiting == []


def assert_lock_kept(node: Node) -> None:
    """GPU 1's holder still holds its first grant and was told nothing (no DROP_LOCK, no REVOKED)."""
    g1 = gpu_status(node.checker, 1)
    assert [(h.session, h.grant) for h in g1.holders] == [(node.lock_session, node.lock_grant)]
    assert g1.grants == 1 and g1.revocations == 0 and not any(g1.drops.values()), g1
    assert nothing_arrives(node.holder, 0.05)


# --- gpuctl -----------------------------------------------------------------------


def gpuctl(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def gpuctl_json(d: DaemonProcess, command: str, kind: type[Any]) -> Any:
    out = gpuctl(d, command, "--json")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout) > p.MAX_FRAME_BYTES
    tag = kind.__struct_config__.tag
    return msgspec.convert({**json.loads(out.stdout), "id": 0, "type": tag}, kind)


def test_gpuctl_json_answers_are_whole(node: Node) -> None:
    check_status(gpuctl_json(node.d, "status", p.StatusReply), node)
    check_clients(gpuctl_json(node.d, "clients", p.ClientsReply), node)
    check_leases(gpuctl_json(node.d, "leases", p.LeasesReply), node)
    check_allocs(gpuctl_json(node.d, "allocs", p.AllocationsReply))
    assert_lock_kept(node)


def table(d: DaemonProcess, command: str) -> list[str]:
    out = gpuctl(d, command)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_gpuctl_tables_list_every_row(node: Node) -> None:
    waiting = WAITER_CONNS * LEASES_EACH
    head, header, gpu0, gpu1 = table(node.d, "status")
    assert header.split()[:2] == ["GPU", "NAME"] and gpu0.startswith("0 ") and gpu1.startswith("1 ")
    assert gpu0.count("lease-waiter-") == waiting and f"{HOLDER}[" in gpu1
    rows = table(node.d, "clients")[1:]
    # one row per session; the allocator, the checker and gpuctl itself have none: one "-" row each
    assert len(rows) == SESSION_CONNS * SESSIONS_EACH + waiting + 2 + 3
    assert sum(" idle " in r for r in rows) == SESSION_CONNS * SESSIONS_EACH
    assert sum(" waiting " in r for r in rows) == waiting
    rows = table(node.d, "leases")[1:]
    assert len(rows) == 1 + waiting and sum(f" {TASK}  waiting " in r for r in rows) == waiting
    assert all("job_id=job-" in r for r in rows)
    lines = table(node.d, "allocs")
    assert sum(line.startswith("task-") for line in lines) == ALLOCATIONS
    assert lines[ALLOCATIONS + 1] == "" and lines[ALLOCATIONS + 3].split()[:2] == ["0", "0.5"]
    assert_lock_kept(node)


# --- gpuctl top ---------------------------------------------------------------------


def read_until(fd: int, needle: bytes, buf: bytes = b"", timeout: float = 20.0) -> bytes:
    """Read on from ``buf`` until ``needle`` is in all that was read."""
    deadline = time.monotonic() + timeout
    while needle not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} never appeared in {buf[-2000:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                buf += os.read(fd, 65536)
            except OSError:
                break
    return buf


def test_gpuctl_top_draws_the_busy_node(node: Node) -> None:
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(
            sys.executable,
            [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", node.d.socket, "top", "--interval", "30"],
        )
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 250, 0, 0))
    try:
        screen = read_until(fd, b"\x1b[1mGPU 1")  # GPU 1's heading comes after every line of GPU 0
        assert screen.count(f" {TASK} waiting lease-waiter-".encode()) == WAITER_CONNS * LEASES_EACH
        assert screen.count(f" {TASK} holding {LEASE_HOLDER}[".encode()) == 1
        assert b"  queue: lease-waiter-" in screen
        gpu1 = read_until(fd, f"\n  {HOLDER} ".encode(), screen).split(b"\x1b[1mGPU 1", 1)[1]
        assert "▶ holding".encode() in gpu1.split(f"\n  {HOLDER} ".encode(), 1)[1].split(b"\n", 1)[0]
        os.write(fd, b"q")
        t0 = time.monotonic()
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:  # keep reading: a terminal nobody reads blocks its writer
            assert time.monotonic() - t0 < 10, "gpuctl top did not exit"
            if select.select([fd], [], [], 0.05)[0]:
                try:
                    os.read(fd, 65536)
                except OSError:
                    pass
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)
    assert_lock_kept(node)


# --- the client libraries ------------------------------------------------------------


def check_all(
    node: Node, status: p.StatusReply, clients: p.ClientsReply, leases: p.LeasesReply, allocs: p.AllocationsReply
) -> None:
    assert all(map(is_large, (status, clients, leases, allocs))), [
        len(msgspec.msgpack.encode(r)) for r in (status, clients, leases, allocs)
    ]
    check_status(status, node)
    check_clients(clients, node)
    check_leases(leases, node)
    check_allocs(allocs)


def test_the_sync_client_gets_the_large_answers(node: Node) -> None:
    with Client(node.d.socket, name="sync-reader") as c:
        check_all(node, c.status(), c.clients(), c.leases(), c.allocations())
        check_clients(c.clients(), node)  # and the connection still works after them
    assert_lock_kept(node)


def test_the_asyncio_client_gets_the_large_answers(node: Node) -> None:
    async def main() -> tuple[p.StatusReply, p.ClientsReply, p.LeasesReply, p.AllocationsReply]:
        async with await AsyncClient.connect(node.d.socket, name="async-reader") as c:
            return await c.status(), await c.clients(), await c.leases(), await c.allocations()

    check_all(node, *asyncio.run(main()))
    assert_lock_kept(node)


# --- a reader that pipelines and reads late ------------------------------------------


def unread_bytes(conn: Connection) -> int:
    raw = fcntl.ioctl(conn.sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    count: int = struct.unpack("i", raw)[0]
    return count


def test_pipelined_large_answers_wait_for_a_late_reader(node: Node) -> None:
    late = _open(node.d, "late-reader", node.conns)
    first = late.next_id()
    late.send_raw(b"".join(p.client_codec().encode(p.ListClients(id=first + i)) for i in range(50)))
    eventually(lambda: unread_bytes(late) > p.MAX_FRAME_BYTES, "answers queued for the late reader", timeout=20)
    # While its answers wait unread, the daemon keeps serving others, large answers included.
    assert_lock_kept(node)
    check_clients(gpuctl_json(node.d, "clients", p.ClientsReply), node)
    with Client(node.d.socket, name="meanwhile") as c:
        assert is_large(c.leases())
        assert "late-reader" in {ci.name for ci in c.clients().clients}
    assert_lock_kept(node)
    assert unread_bytes(late) > p.MAX_FRAME_BYTES  # still unread
    for i in range(50):
        reply = expect(late, p.ClientsReply, timeout=10)
        assert reply.id == first + i and is_large(reply)
        check_clients(reply, node)
    assert nothing_arrives(late, 0.05)
    assert_lock_kept(node)
