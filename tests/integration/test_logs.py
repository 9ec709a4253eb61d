"""The daemon's log: JSON lines off a terminal, lifecycle events with stable keys,
nothing per protocol message at info, and debug lines when asked."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client

from .waiting import eventually
from .wire import attach, connect, expect, request, take_lock


def events(d: DaemonProcess) -> list[dict[str, object]]:
    return [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]


def wait_event(d: DaemonProcess, name: str) -> dict[str, object]:
    found: list[dict[str, object]] = eventually(
        lambda: [e for e in events(d) if e["event"] == name],
        f"{name} in the log",
        why=lambda: f"events: {[e['event'] for e in events(d)]}",
    )
    return found[-1]


def test_lifecycle_events_with_stable_keys(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    cfg = tmp_path / "gpud.toml"
    cfg.write_text("tq_s = 0.1\ndrop_timeout_s = 0.2\ncompute_window_s = 0.5\n")
    d = daemon_factory("--simulate", "1", "--config", str(cfg))
    from gpud_client import protocol as p

    a, b = connect(d, "a"), connect(d, "b")
    sa, sb = attach(a), attach(b)
    take_lock(a, sa)
    request(b, sb)
    expect(a, p.DropLock)
    expect(a, p.Revoked, timeout=3)  # a ignored its DROP_LOCK
    with Client(d.socket, name="limited") as c:
        s = c.session(0, core_limit=10, idle_release=None)
        b.close()
        for _ in range(30):
            with s.slice():
                time.sleep(0.01)  # a 10 ms kernel: 30 of them overrun the 10 % share (session_throttled)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    wait_event(d, "config_reloaded")
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(5)
    got = {e["event"]: e for e in events(d)}
    for name, keys in {
        "starting": {"version", "pid", "socket"},
        "ready": {"socket", "gpus"},
        "client_attached": {"client", "pid", "uid", "name"},
        "session_attached": {"client", "session", "gpu", "core_limit"},
        "lock_revoked": {"gpu", "session", "grant", "reason", "pid"},
        "session_throttled": {"gpu", "session", "client", "pid"},
        "client_detached": {"client", "pid", "name"},
        "config_reloaded": {"changed"},
        "shutdown": {"signal", "clients"},
    }.items():
        assert name in got, name
        assert keys <= set(got[name]), (name, got[name])
        assert {"timestamp", "level"} <= set(got[name])


def test_no_line_per_protocol_message_at_info(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        s = c.session(0)
        for _ in range(200):
            s.acquire()
            s.release()
    assert len(events(daemon)) < 15  # start-up, attach, detach: not one per request


def test_debug_shows_grants_and_drops(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "1", "--log-level", "debug")
    with Client(d.socket) as c:
        s = c.session(0)
        s.acquire()
        s.release()
    wait_event(d, "lock_granted")
