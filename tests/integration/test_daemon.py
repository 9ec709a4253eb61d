"""Starting the daemon: where it listens, stale and live sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import DaemonUnavailable

from .waiting import eventually
from .wire import attach, connect, gpu_status


def test_socket_from_the_environment_and_its_directory_is_created() -> None:
    base = tempfile.mkdtemp(prefix="gpud-", dir="/tmp")
    path = os.path.join(base, "run", "gpud", "gpud.sock")
    env = {**os.environ, "GPUD_SOCKET": path}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpud.main", "--simulate", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def listening() -> Connection | None:
            assert proc.poll() is None, "gpud exited"
            try:
                return Connection(path)
            except DaemonUnavailable:
                return None

        conn = eventually(listening, f"gpud listens on {path}")
        conn.hello("env")
        assert len(gpu_status_all(conn)) == 1
        conn.close()
    finally:
        proc.terminate()
        proc.wait(5)
    assert proc.returncode == 0
    assert not os.path.exists(path), "the socket is removed on shutdown"


def gpu_status_all(conn: Connection) -> list[p.GpuStatus]:
    reply: p.StatusReply = conn.call(p.Status(id=conn.next_id()))
    return reply.gpus


def test_a_stale_socket_file_is_replaced(daemon: DaemonProcess) -> None:
    daemon.stop(sig=9)  # killed: the socket file stays behind
    assert os.path.exists(daemon.socket)
    daemon.start()
    assert gpu_status(connect(daemon)).holders == []


def test_a_live_daemon_is_not_displaced(daemon: DaemonProcess) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpud.main", "--simulate", "1", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert f"another daemon is listening on {daemon.socket}" in out.stderr
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(daemon.socket)  # the first daemon still serves
    probe.close()


# --- a reload and run-time changes --------------------------------------------------------


def _gpuctl(d: DaemonProcess, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _events(d: DaemonProcess, name: str) -> list[dict[str, Any]]:
    lines = (json.loads(x) for x in d.log().splitlines() if x.startswith("{"))
    return [e for e in lines if e.get("event") == name]


def _hup(d: DaemonProcess, cfg: Path, text: str) -> dict[str, Any]:
    """Write the file, SIGHUP, and return this reload's ``config_reloaded`` line."""
    seen = len(_events(d, "config_reloaded"))
    cfg.write_text(text)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    eventually(lambda: len(_events(d, "config_reloaded")) > seen, "config_reloaded", why=d.log)
    return _events(d, "config_reloaded")[seen]


def _state(d: DaemonProcess) -> tuple[list[tuple[float, str, bool]], dict[str, Any], int]:
    """Per GPU (TQ, mode, scheduler on), ASR's policy, and the core limit of client "limited"."""
    gpus = [(g["tq_s"], g["mode"], g["scheduler_on"]) for g in json.loads(_gpuctl(d, "status", "--json"))["gpus"]]
    asr = json.loads(_gpuctl(d, "policy", "ASR", "--json"))["policies"]["ASR"]
    clients = json.loads(_gpuctl(d, "clients", "--json"))["clients"]
    (limited,) = [c for c in clients if c["name"] == "limited"]
    return gpus, asr, limited["sessions"][0]["core_limit"]


def test_a_reload_keeps_run_time_changes_to_keys_the_file_did_not_change(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    cfg = tmp_path / "gpud.toml"
    base = 'tq_s = 30.0\nlog_level = "info"\n'
    cfg.write_text(base)
    d = daemon_factory("--simulate", "2", "--config", str(cfg))
    client = connect(d, "limited")
    attach(client, 1)
    _gpuctl(d, "tq", "7")
    _gpuctl(d, "mode", "serial")
    _gpuctl(d, "sched", "off", "--gpu", "1")
    _gpuctl(d, "policy", "ASR", "--max-wait", "1234")
    _gpuctl(d, "limit", "limited", "--core", "40")
    kept = ([(7.0, "serial", True), (7.0, "serial", False)], 1234, 40)

    text = base.replace('"info"', '"debug"')
    reloaded = _hup(d, cfg, text)
    assert reloaded["changed"] == ["log_level"]
    gpus, asr, core = _state(d)
    assert (gpus, asr["max_wait_ms"], core) == kept  # nothing the file did not change

    # The file's own change to a key wins over the run-time value: the operator's newest word.
    text = text.replace("30.0", "12.0")
    reloaded = _hup(d, cfg, text)
    assert reloaded["changed"] == ["tq_s"]
    gpus, asr, core = _state(d)
    assert (gpus, asr["max_wait_ms"], core) == ([(12.0, "serial", True), (12.0, "serial", False)], 1234, 40)

    reloaded = _hup(d, cfg, text + '[policies.ASR]\npriority = 90\nbusy_policy = "WAIT"\nmax_wait_ms = 2500\n')
    assert reloaded["changed"] == ["policies"]
    assert _state(d)[1]["max_wait_ms"] == 2500
    client.close()


def test_a_reloaded_log_level_takes_effect(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Said changed, and changed: from a reload to ``warning`` on, no info line is written."""
    cfg = tmp_path / "gpud.toml"
    cfg.write_text('log_level = "info"\n')
    d = daemon_factory("--simulate", "1", "--config", str(cfg))
    _hup(d, cfg, 'log_level = "info"\n')  # every logger has been used once (a cached one kept its level)
    seen = len(_events(d, "config_reloaded"))
    cfg.write_text('log_level = "warning"\nsocket_mode = 0o600\n')  # a restart key: warned about
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    eventually(lambda: _events(d, "config_reload_needs_restart"), "config_reload_needs_restart", why=d.log)
    connect(d, "quiet").close()
    _gpuctl(d, "status")
    cfg.write_text('log_level = "warning"\nsocket_mode = 0o600\n')
    d.proc.send_signal(signal.SIGHUP)
    eventually(lambda: len(_events(d, "config_reload_needs_restart")) == 2, "second warning", why=d.log)
    assert len(_events(d, "config_reloaded")) == seen  # info: not written since
    assert all(e.get("name") != "quiet" for e in _events(d, "client_attached"))


def test_gpuctl_policy_shows_who_a_reserved_policy_is_for(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    cfg = tmp_path / "gpud.toml"
    cfg.write_text(
        '[policies.ASR]\npriority = 90\nbusy_policy = "WAIT"\nmax_wait_ms = 3000\nuids = [1001, 1000]\ngids = [2001]\n'
    )
    d = daemon_factory("--simulate", "1", "--config", str(cfg))
    table = _gpuctl(d, "policy").splitlines()
    header = table[0].split()
    assert header[-3:] == ["MAX", "RESERVED", "FOR"]
    rows = {line.split()[0]: line for line in table[1:]}
    assert rows["ASR"].rstrip().endswith("uid 1000,1001 gid 2001")
    assert rows["OTHER"].rstrip().endswith(" -")
    asr = json.loads(_gpuctl(d, "policy", "ASR", "--json"))["policies"]["ASR"]
    assert (asr["uids"], asr["gids"]) == ([1000, 1001], [2001])
