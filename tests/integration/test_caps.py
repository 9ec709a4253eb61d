"""The caps the listener enforces on real sockets, against real daemons started with small
ones: connections (total, per uid, without HELLO), unread outboxes, and running out of
descriptors. The caps on what requests may make the daemon hold (sessions, lock and lease
queues, allocation waiters, metric series) are tested in process (``tests/daemon/test_caps.py``).

Every wait polls STATUS, the log or the metrics against a deadline; a refusal by a cap
is an ERROR limit_reached whose message names the configuration key."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpud.main import FD_RESERVE
from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection

from .waiting import eventually
from .wire import attach, connect, nothing_arrives, request, take_lock

Factory = Callable[..., DaemonProcess]


# --- helpers ----------------------------------------------------------------------------


def start(factory: Factory, tmp_path: Path, *flags: str, toml: str = "", **caps: Any) -> DaemonProcess:
    """A daemon on two simulated GPUs with ``caps`` in its TOML file and metrics on a free port."""
    cfg = tmp_path / "gpud.toml"
    cfg.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in caps.items()) + toml)
    return factory("--simulate", "2x16GiB", "--metrics-addr", "127.0.0.1:0", "--config", str(cfg), *flags)


def events(d: DaemonProcess, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == name]


def scrape(d: DaemonProcess) -> str:
    (listening,) = events(d, "metrics_listening")
    with urllib.request.urlopen(f"http://127.0.0.1:{listening['port']}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def sample(d: DaemonProcess, name: str, **labels: str) -> float | None:
    """The sample's value, or None while the series does not exist."""
    for family in text_string_to_metric_families(scrape(d)):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def send_hello(s: socket.socket) -> None:
    try:
        s.sendall(p.client_codec().encode(p.Hello(id=1, version=p.PROTOCOL_VERSION, name="raw")))
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at accept and closed already: its ERROR is still there to read


def read_until_closed(s: socket.socket) -> list[Any]:
    """Everything the daemon says until it closes (a reset counts as the close)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    s.close()
    codec = p.client_codec()
    return [codec.decode(x) for x in p.FrameDecoder(p.MAX_REPLY_BYTES).feed(data)]


def refused_by(path: str, cap: str) -> None:
    """A new connection (greeting or not) gets one ERROR naming ``cap`` and is closed."""
    s = raw(path)
    send_hello(s)
    got = read_until_closed(s)
    assert len(got) == 1 and isinstance(got[0], p.Error), got
    assert got[0].code == p.ErrorCode.LIMIT_REACHED and f"({cap})" in got[0].message, got[0]


def greeted(path: str) -> socket.socket | p.Error:
    """A raw connection that got WELCOME, or the ERROR that refused it."""
    s = raw(path)
    send_hello(s)
    dec = p.FrameDecoder()
    frames: list[bytes] = []
    while not frames:
        chunk = s.recv(65536)
        assert chunk, "closed without a word"
        frames = dec.feed(chunk)
    msg = p.client_codec().decode(frames[0])
    if isinstance(msg, p.Welcome):
        return s
    s.close()
    assert isinstance(msg, p.Error), msg
    return msg


def recv_skipping_sched_state(conn: Connection, kind: type, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while isinstance(msg := conn.recv(max(0.001, deadline - time.monotonic())), p.SchedState):
        pass
    assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
    return msg


Party = tuple[Connection, int]  # a connection and its session


def handoff(holder: Party, waiter: Party, grant: int) -> int:
    """The waiter asks, the holder releases: the waiter's LOCK_OK within 2 s. Returns its grant."""
    request(*waiter)
    holder[0].send(p.LockReleased(id=holder[0].next_id(), session=holder[1], grant=grant))
    ok = recv_skipping_sched_state(waiter[0], p.LockOk, 2.0)
    assert ok.session == waiter[1]
    return int(ok.grant)


def client_ids(conn: Connection) -> set[int]:
    return {c.client_id for c in conn.call(p.ListClients(id=conn.next_id())).clients}


# --- connections ------------------------------------------------------------------------


@pytest.mark.parametrize("cap", ["max_connections_per_uid", "max_connections"])
def test_a_connection_over_the_cap_is_refused_and_the_others_keep_working(
    daemon_factory: Factory, tmp_path: Path, cap: str
) -> None:
    d = start(daemon_factory, tmp_path, toml=f"{cap} = 3\n")
    eventually(lambda: sample(d, "gpud_clients") == 0, "the start-up probe's connection is closed")
    conns = [connect(d, f"c{i}") for i in range(3)]
    refused_by(d.socket, cap)
    for c in conns:
        assert isinstance(c.call(p.Status(id=c.next_id())), p.StatusReply)
    assert sample(d, "gpud_connections_refused_total", reason=cap) == 1
    conns.pop().close()
    eventually(lambda: sample(d, "gpud_clients") == 2, "the daemon saw the close")
    conns.append(connect(d, "again"))
    refused_by(d.socket, cap)  # full again
    assert sample(d, "gpud_connections_refused_total", reason=cap) == 2
    for c in conns:
        c.close()


def test_a_connection_without_hello_is_closed_after_hello_timeout(daemon_factory: Factory, tmp_path: Path) -> None:
    d = start(daemon_factory, tmp_path, hello_timeout_s=0.3)
    first = connect(d, "greeted")
    silent = raw(d.socket)
    got = read_until_closed(silent)
    assert [type(m) for m in got] == [p.Error], got
    assert got[0].code == p.ErrorCode.HELLO_REQUIRED and "(hello_timeout_s)" in got[0].message
    # ``first`` connected before ``silent``, so it is past its own 0.3 s too, and still served.
    assert isinstance(first.call(p.Status(id=first.next_id())), p.StatusReply)
    nothing_arrives(first, 0.05)
    assert sample(d, "gpud_connections_dropped_total", reason="no_hello") == 1
    first.close()


# --- a client that never reads ------------------------------------------------------------


def flood(conn: Connection, session: int) -> threading.Thread:
    """20 000 MEM_UPDATEs (no answers: the daemon reads them all) then 20 000 CLIENTS (answers
    of some KiB each, never read), in a few writes from a thread, which blocks once the daemon
    stops reading and ends when the connection does."""
    codec = p.client_codec()
    updates = (p.MemUpdate(id=i, session=session, used_bytes=i) for i in range(1, 20_001))
    burst = b"".join(codec.encode(m) for m in updates)
    burst += b"".join(codec.encode(p.ListClients(id=i)) for i in range(20_001, 40_001))
    step = len(burst) // 4 + 1

    def write() -> None:
        try:
            for k in range(0, len(burst), step):
                conn.sock.sendall(burst[k : k + step])
        except OSError:
            pass  # dropped (or shut down at the end) while the daemon no longer reads

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    return writer


def messages(d: DaemonProcess, kind: str) -> float:
    return sample(d, "gpud_messages_total", type=kind) or 0


def test_a_client_that_never_reads_is_dropped_once_and_delays_nobody(daemon_factory: Factory, tmp_path: Path) -> None:
    d = start(daemon_factory, tmp_path, "--mode", "serial", outbox_high_water_bytes=65536, outbox_limit_bytes=65536)
    flooder = connect(d, "never-reads")
    sessions = [attach(flooder, 1) for _ in range(20)]  # so that each CLIENTS answer is some KiB
    a, b, admin = connect(d, "a"), connect(d, "b"), connect(d, "admin")
    (fid,) = [c.client_id for c in admin.call(p.ListClients(id=admin.next_id())).clients if c.name == "never-reads"]
    holder, waiter = (a, attach(a, 0)), (b, attach(b, 0))
    grant = take_lock(*holder).grant
    writer = flood(flooder, sessions[0])
    try:
        eventually(lambda: messages(d, "MEM_UPDATE") > 0, "the flood is being read")
        cycles, deadline = 0, time.monotonic() + 30
        # Lock handoffs, each within 2 s, at least 50 and until the daemon has read the flood.
        while cycles < 50 or (cycles % 10 or messages(d, "MEM_UPDATE") < 20_000) and time.monotonic() < deadline:
            grant = handoff(holder, waiter, grant)
            holder, waiter, cycles = waiter, holder, cycles + 1
        assert messages(d, "MEM_UPDATE") == 20_000
        eventually(lambda: messages(d, "CLIENTS") > 0, "the daemon reads the CLIENTS requests")
        assert messages(d, "CLIENTS") < 20_000  # it stopped reading a client whose answers pile up
        assert fid in client_ids(admin)  # paused for its answers, not dropped
        for i in range(300):  # pushes (SCHED_STATE to every greeted client) it does not read
            msg = p.SchedOff(id=admin.next_id(), gpu=1) if i % 2 == 0 else p.SchedOn(id=admin.next_id(), gpu=1)
            assert isinstance(admin.call(msg), p.Ok)
        eventually(lambda: fid not in client_ids(admin), "the client that never reads is disconnected")
        too_slow = events(d, "client_too_slow")
        assert [e["client"] for e in too_slow] == [fid], too_slow  # one line, not one per message
        assert sample(d, "gpud_connections_dropped_total", reason="too_slow") == 1
        handoff(holder, waiter, grant)  # the clients that read were not dropped
        assert d.proc is not None and d.proc.poll() is None
        assert isinstance(a.call(p.Status(id=a.next_id())), p.StatusReply)
    finally:
        try:
            flooder.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        writer.join(10)
        flooder.close()


# --- out of descriptors ---------------------------------------------------------------


class Notify:
    """A fake NOTIFY_SOCKET: what the daemon tells systemd."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(10)

    def wait_for(self, needle: str) -> str:
        while needle not in (msg := self.sock.recv(4096).decode()):
            pass
        return msg

    def drain(self) -> None:
        self.sock.setblocking(False)
        try:
            while True:
                self.sock.recv(4096)
        except BlockingIOError:
            pass
        self.sock.settimeout(10)


@pytest.fixture
def few_descriptors() -> Iterator[tuple[DaemonProcess, Notify]]:
    """A daemon whose RLIMIT_NOFILE is 128 (soft and hard), pinging a fake systemd watchdog."""
    d = DaemonProcess()
    notify = Notify(os.path.join(d.workdir, "notify"))
    env = {**os.environ, "NOTIFY_SOCKET": os.path.join(d.workdir, "notify"), "WATCHDOG_USEC": "200000"}
    cmd = [
        sys.executable,
        "-m",
        "gpud.main",
        "--socket",
        d.socket,
        "--log-format",
        "json",
        "--metrics-addr",
        "off",
        "--state-dir",
        os.path.join(d.workdir, "state"),
        "--simulate",
        "1",
    ]
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)),
        )
    try:
        notify.wait_for("READY=1")
        yield d, notify
    finally:
        notify.sock.close()
        d.cleanup()


def test_out_of_descriptors_the_connected_clients_and_the_watchdog_go_on(
    few_descriptors: tuple[DaemonProcess, Notify],
) -> None:
    d, notify = few_descriptors
    (lowered,) = events(d, "max_connections_lowered")
    room = lowered["max_connections"]
    assert room == 128 - FD_RESERVE
    kept = connect(d, "kept")
    session = attach(kept)
    table: list[socket.socket] = []
    while isinstance(got := greeted(d.socket), socket.socket):
        table.append(got)
        assert len(table) < room, "more connections than descriptors allow"
    assert len(table) == room - 1
    assert got.code == p.ErrorCode.LIMIT_REACHED and "(max_connections)" in got.message
    notify.drain()
    for _ in range(20):  # the table is full: the connected client is served, newcomers refused
        ok = take_lock(kept, session)
        kept.send(p.LockReleased(id=kept.next_id(), session=session, grant=ok.grant))
        assert isinstance(kept.call(p.Status(id=kept.next_id())), p.StatusReply)
        refused_by(d.socket, "max_connections")
    for _ in range(3):
        assert f"{room} client(s)" in notify.wait_for("WATCHDOG=1")
    for s in table[:5]:
        s.close()
    accepted: list[socket.socket] = []

    def five_accepted() -> bool:  # refusals until the daemon has seen the closes
        if isinstance(got := greeted(d.socket), socket.socket):
            accepted.append(got)
        return len(accepted) == 5

    eventually(five_accepted, "5 accepted again after 5 closes", why=lambda: f"only {len(accepted)}")
    refused_by(d.socket, "max_connections")
    assert isinstance(kept.call(p.Status(id=kept.next_id())), p.StatusReply)
    assert not events(d, "fault") and not events(d, "accept_failed")
    for s in table[5:] + accepted:
        s.close()
    kept.close()
