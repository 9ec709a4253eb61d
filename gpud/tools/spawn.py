"""Start a real gpud in a subprocess on a short socket path.

Used by the demo, the benchmarks and the tests: one way to run a daemon that
is not systemd. The socket lives in a fresh directory under /tmp because Unix
socket paths are limited to about 108 bytes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class DaemonProcess:
    def __init__(self, *args: str, workdir: str | None = None) -> None:
        # Unix socket paths are limited to ~108 bytes: keep them short.
        self.workdir = workdir or tempfile.mkdtemp(prefix="gpud-", dir="/tmp")
        self.socket = os.path.join(self.workdir, "gpud.sock")
        self.log_path = Path(self.workdir, "gpud.log")
        self.args = list(args) or ["--simulate", "2"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> DaemonProcess:
        extra = [] if any(a.startswith("--metrics-addr") for a in self.args) else ["--metrics-addr", "off"]
        if not any(a.startswith("--state-dir") for a in self.args):
            extra += ["--state-dir", os.path.join(self.workdir, "state")]
        cmd = [sys.executable, "-m", "gpud.main", "--socket", self.socket, "--log-format", "json", *extra, *self.args]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpud exited with {self.proc.returncode}:\n{self.log()}")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.socket)
                return self
            except OSError:
                time.sleep(0.02)
            finally:
                s.close()
        raise RuntimeError(f"gpud did not listen on {self.socket} within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
