"""gpuctl top in a pseudo-terminal: it draws, refreshes, and exits on q or Ctrl-C."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import sys
import termios
import time

import pytest

from gpud.spawn import DaemonProcess
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
            os.execv(sys.executable, [sys.executable, "-m", "gpud.cli", "--socket", daemon.socket, "top",
                                      "--interval", "0.2"])
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
