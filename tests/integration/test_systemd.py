"""systemd: the units pass verify and the security score, sd_notify, watchdog,
socket activation, SIGHUP reload and SIGTERM shutdown, against a real daemon."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.connection import Connection

from .waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
GPUD = shutil.which("gpud", path=os.path.dirname(sys.executable)) or "gpud"
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")


def units(tmp: Path) -> Path:
    """The shipped units, with ExecStart= pointing at this checkout's gpud."""
    for name in ("gpud.service", "gpud.socket"):
        text = (ROOT / "systemd" / name).read_text().replace("/usr/local/bin/gpud", GPUD)
        (tmp / name).write_text(text)
    return tmp


@needs_analyze
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    d = units(tmp_path)
    out = subprocess.run(
        ["systemd-analyze", "verify", str(d / "gpud.service"), str(d / "gpud.socket")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [line for line in (out.stdout + out.stderr).splitlines() if "gpud" in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr


@needs_analyze
def test_the_service_rates_at_most_2_0_exposure(tmp_path: Path) -> None:
    d = units(tmp_path)
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(d / "gpud.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for gpud.service: ([0-9.]+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= 2.0


def test_the_units_keep_the_gpu_devices_reachable() -> None:
    text = (ROOT / "systemd" / "gpud.service").read_text()
    for needed in (
        "Type=notify",
        "WatchdogSec=",
        "DeviceAllow=char-nvidia-frontend rw",
        "DeviceAllow=/dev/nvidiactl rw",
        "RuntimeDirectory=gpud",
        "StateDirectory=gpud",
        "ExecReload=",
    ):
        assert needed in text, needed
    sock = (ROOT / "systemd" / "gpud.socket").read_text()
    assert "SocketMode=0660" in sock and "SocketGroup=gpud" in sock
    assert "g gpud " in (ROOT / "systemd" / "gpud.sysusers.conf").read_text()


def _size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def test_the_unit_protects_the_node_from_gpud_and_gpud_from_the_oom_killer() -> None:
    settings = dict(
        line.split("=", 1)
        for line in (ROOT / "systemd" / "gpud.service").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert -1000 < int(settings["OOMScoreAdjust"]) < 0  # killed after the jobs, never made unkillable
    high, top = _size(settings["MemoryHigh"]), _size(settings["MemoryMax"])
    assert 256 * 2**20 <= high < top <= 4 * 2**30  # far above the soak's RSS, bounded all the same
    assert 16 <= int(settings["TasksMax"]) <= 1024


class NotifyListener:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(10)
        self.messages: list[str] = []

    def wait_for(self, needle: str) -> str:
        while True:
            msg = self.sock.recv(4096).decode()
            self.messages.append(msg)
            if needle in msg:
                return msg


def test_ready_status_watchdog_and_stopping(tmp_path: Path) -> None:
    work = tempfile.mkdtemp(prefix="gpud-sd-", dir="/tmp")
    sock = os.path.join(work, "gpud.sock")
    notify = NotifyListener(os.path.join(work, "notify"))
    env = {**os.environ, "NOTIFY_SOCKET": os.path.join(work, "notify"), "WATCHDOG_USEC": "200000"}
    proc = subprocess.Popen(
        [GPUD, "--socket", sock, "--simulate", "2", "--metrics-addr", "off", "--state-dir", work + "/state"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ready = notify.wait_for("READY=1")
        assert "STATUS=2 simulated GPU(s), 0 client(s)" in ready
        Connection(sock).close()  # READY came only once the socket accepts
        pings = time.monotonic()
        notify.wait_for("WATCHDOG=1")
        notify.wait_for("WATCHDOG=1")
        assert time.monotonic() - pings < 1.0  # every WatchdogSec/2 = 0.1 s
        with Client(sock, name="bye") as c:
            c.session(0)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            notify.wait_for("STOPPING=1")
            assert proc.wait(5) == 0
            assert time.monotonic() - t0 < 2.0
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def test_socket_activation_serves_a_client() -> None:
    work = tempfile.mkdtemp(prefix="gpud-sa-", dir="/tmp")
    path = os.path.join(work, "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    # What systemd does: the listening socket as fd 3, LISTEN_PID = the daemon's pid.
    launcher = (
        "import os, sys\n"
        f"os.dup2({listener.fileno()}, 3)\n"
        "os.environ['LISTEN_PID'] = str(os.getpid()); os.environ['LISTEN_FDS'] = '1'\n"
        "os.execv(sys.argv[1], sys.argv[1:])\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            launcher,
            GPUD,
            "--socket",
            os.path.join(work, "unused.sock"),
            "--simulate",
            "1",
            "--metrics-addr",
            "off",
            "--state-dir",
            work + "/state",
        ],
        pass_fds=(listener.fileno(),),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    listener.close()
    try:
        with Client(path, name="activated") as c:  # connects even before the daemon accepts
            s = c.session(0)
            with s.slice():
                assert s.holding
            assert c.status().gpus[0].holders[0].name == "activated"
        assert not os.path.exists(os.path.join(work, "unused.sock"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0
        assert os.path.exists(path), "an activated socket belongs to systemd: it is not removed"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def test_sighup_reloads_without_dropping_a_client(tmp_path: Path) -> None:
    from gpud.tools.spawn import DaemonProcess

    cfg = tmp_path / "gpud.toml"
    cfg.write_text('tq_s = 30.0\nlog_level = "info"\n')
    d = DaemonProcess("--simulate", "1", "--config", str(cfg)).start()
    try:
        with Client(d.socket, name="stays") as c:
            s = c.session(0)
            with s.slice():
                pass
            cfg.write_text(
                'tq_s = 7.5\nmode = "serial"\nlog_level = "debug"\n'
                '[policies.ASR]\npriority = 99\nbusy_policy = "WAIT"\nmax_wait_ms = 100\n'
            )
            assert d.proc is not None
            d.proc.send_signal(signal.SIGHUP)
            eventually(lambda: '"config_reloaded"' in d.log(), "config_reloaded in the log", why=d.log)
            st = c.status().gpus[0]
            assert (st.tq_s, st.mode) == (7.5, "serial")
            assert c.policies()["ASR"].priority == 99
            assert s.holding and c.reconnects == 0  # nobody was dropped
            cfg.write_text("tq_s = -1\n")
            d.proc.send_signal(signal.SIGHUP)
            eventually(lambda: '"config_reload_failed"' in d.log(), "config_reload_failed in the log", why=d.log)
            assert c.status().gpus[0].tq_s == 7.5  # a bad file changes nothing
    finally:
        d.cleanup()


def test_sigterm_tells_clients_and_exits_0_within_2s() -> None:
    from gpud.tools.spawn import DaemonProcess

    d = DaemonProcess("--simulate", "1").start()
    try:
        conn = Connection(d.socket)
        conn.hello("listener")
        assert d.proc is not None
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        bye = conn.recv(5)
        assert isinstance(bye, p.Goodbye) and "SIGTERM" in bye.reason
        assert d.proc.wait(5) == 0 and time.monotonic() - t0 < 2.0
        assert not os.path.exists(d.socket)
    finally:
        d.cleanup()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_a_signal_sent_the_moment_ready_is_heard_is_handled(sig: signal.Signals) -> None:
    """systemd may send ExecReload's SIGHUP or a stop's SIGTERM as soon as READY=1 arrives (spawn
    waits for READY=1 on its notify socket too): gpud's handlers must be in place by then, not
    the default actions, which end the process."""
    from gpud.tools.spawn import DaemonProcess

    d = DaemonProcess("--simulate", "1").start()
    try:
        assert d.proc is not None
        d.proc.send_signal(sig)
        if sig == signal.SIGHUP:
            eventually(lambda: '"config_reloaded"' in d.log(), "config_reloaded in the log", why=d.log)
            assert d.proc.poll() is None
        else:
            assert d.proc.wait(5) == 0, d.log()
            assert '"shutdown"' in d.log()
    finally:
        d.cleanup()


# What systemd does: the listening socket as fd 3, LISTEN_FDS=1, LISTEN_PID = the daemon's pid.
LAUNCHER = (
    "import os, sys\n"
    "os.dup2(int(sys.argv[1]), 3)\n"
    "os.environ['LISTEN_PID'] = str(os.getpid()); os.environ['LISTEN_FDS'] = '1'\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _activate(how: str, path: str, argv: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen[bytes]:
    """gpud started on the socket at ``path`` the way systemd starts it: by systemd-socket-activate
    (which listens, and execs gpud on the first connection), or by hand with the same descriptors."""
    with open(log_path, "wb") as log:
        if how == "systemd-socket-activate":
            tool = shutil.which("systemd-socket-activate")
            if tool is None:
                pytest.skip("systemd-socket-activate is not installed")
            keep = [arg for name in env for arg in ("-E", name)]  # it passes on only PATH, HOME, TERM otherwise
            proc = subprocess.Popen([tool, "-l", path, *keep, *argv], env=env, stdout=log, stderr=log)

            def first_connection() -> bool:  # what starts the service; gpud accepts it later and reads its end
                assert proc.poll() is None, Path(log_path).read_text()
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
                    try:
                        first.connect(path)
                    except (FileNotFoundError, ConnectionRefusedError):  # not bound, or not listening yet
                        return False
                return True

            eventually(first_connection, f"{tool} listens on {path}", timeout=30)
            return proc
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(16)
            cmd = [sys.executable, "-c", LAUNCHER, str(listener.fileno()), *argv]
            return subprocess.Popen(cmd, env=env, stdout=log, stderr=log, pass_fds=(listener.fileno(),))


@pytest.mark.parametrize("how", ["systemd-socket-activate", "pass_fds"])
def test_starting_and_ready_name_the_socket_systemd_passed(how: str) -> None:
    work = tempfile.mkdtemp(prefix="gpud-sn-", dir="/tmp")
    path, unused = os.path.join(work, "activated.sock"), os.path.join(work, "unused.sock")
    notify = NotifyListener(os.path.join(work, "notify"))
    notify.sock.settimeout(60)  # a fresh interpreter on a busy machine
    env = {**os.environ, "NOTIFY_SOCKET": os.path.join(work, "notify")}
    argv = [GPUD, "--socket", unused, "--simulate", "1", "--metrics-addr", "off", "--log-format", "json"]
    argv += ["--state-dir", work + "/state"]
    log_path = os.path.join(work, "gpud.log")
    proc = _activate(how, path, argv, env, log_path)
    try:
        notify.wait_for("READY=1")
        with Client(path, name="activated") as c:
            assert c.status().gpus[0].index == 0
        lines = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.startswith("{")]
        said = {e["event"]: e for e in lines if e["event"] in ("starting", "ready")}
        for event in ("starting", "ready"):
            assert event in said, lines
            assert (said[event]["socket"], said[event].get("socket_from")) == (path, "systemd"), said[event]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert not os.path.exists(unused)
    finally:
        proc.kill()
        proc.wait()
        notify.sock.close()
        shutil.rmtree(work, ignore_errors=True)
