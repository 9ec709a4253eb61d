"""gpuctl top in a pseudo-terminal: it draws, refreshes, and exits on q or Ctrl-C; without a terminal:
plain snapshots or JSON lines, no escape codes."""

from __future__ import annotations

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

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client


def read_until(fd: int, needle: bytes, timeout: float = 10.0) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while needle not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} never appeared in {buf[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                buf += os.read(fd, 65536)
            except OSError:
                break
    return buf


@pytest.mark.parametrize("key", [b"q", b"\x03"])
def test_top_draws_refreshes_and_exits(daemon: DaemonProcess, key: bytes) -> None:
    with Client(daemon.socket, name="trainer") as c:
        s = c.session(0, core_limit=30, idle_release=None)
        with s.slice():
            pass
        pid, fd = pty.fork()
        if pid == 0:
            if key == b"\x03":  # as under a non-interactive shell's "&": SIGINT ignored, Ctrl-C must still work
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.execv(
                sys.executable,
                [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", daemon.socket, "top", "--interval", "0.2"],
            )
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
        try:
            screen = read_until(fd, b"trainer")
            assert b"GPU 0" in screen and b"GPU 1" in screen and b"30%" in screen
            read_until(fd, b"\x1b[2J")  # it redraws
            os.write(fd, key)
            t0 = time.monotonic()
            status = None
            while status is None:  # keep reading: a terminal nobody reads blocks its writer
                assert time.monotonic() - t0 < 5, "gpuctl top did not exit"
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = raw
                    break
                if select.select([fd], [], [], 0.05)[0]:
                    try:
                        os.read(fd, 65536)
                    except OSError:
                        pass
            assert os.waitstatus_to_exitcode(status) == 0
            assert time.monotonic() - t0 < 2
        finally:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(fd)


def run_top(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """gpuctl top as a script or a log runs it: stdout a pipe, stdin not a terminal."""
    return subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", daemon.socket, "top", "--interval", "0.1", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )


def test_top_without_a_terminal_writes_plain_snapshots(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="trainer") as c:
        s = c.session(0, core_limit=30, idle_release=None)
        with s.slice():
            pass
        out = run_top(daemon, "--count", "2")
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout  # no clearing, no cursor moves, no bold
    assert out.stdout.count("GPU 0 ") == 2 and out.stdout.count("gpud ") == 2
    assert "mode auto" in out.stdout and "trainer" in out.stdout and "30%" in out.stdout
    assert "q to quit" not in out.stdout  # keys are not read without a terminal


def test_top_json_is_one_line_per_refresh(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="trainer") as c:
        c.session(1, core_limit=30, idle_release=None)
        out = run_top(daemon, "--json", "--count", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        snap = json.loads(line)
        assert [g["index"] for g in snap["gpus"]] == [0, 1] and snap["leases"] == []
        trainer = [cl for cl in snap["clients"] if cl["name"] == "trainer"]
        assert [(x["gpu"], x["core_limit"]) for x in trainer[0]["sessions"]] == [(1, 30)]


def test_top_with_the_daemon_gone_says_so() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", "/tmp/gpud-absent/gpud.sock", "top", "--json"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert (out.returncode, out.stdout) == (1, "")
    assert json.loads(out.stderr)["error"]["code"] == "unavailable"
