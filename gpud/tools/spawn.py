"""Start a real gpud in a subprocess on a short socket path.

Used by the demo, the benchmarks and the tests: one way to run a daemon that
is not systemd. The socket lives in a fresh directory under /tmp because Unix
socket paths are limited to about 108 bytes.

A daemon starts as ``python -m gpud.main`` (a new interpreter: what the demo and the
benchmarks measure), or, with ``DaemonProcess.preload`` set, forked from a server
process that imported gpud once (``multiprocessing``'s forkserver): the same daemon in
a process of its own, started without paying for the interpreter and its imports
each time (unless ``PYTHONPATH`` changed since this process started: then a new
interpreter). The test suite starts hundreds of daemons and uses the second way.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

_PYTHONPATH_AT_START = os.environ.get("PYTHONPATH")


class Proc(Protocol):
    """What a started daemon offers: the part of ``subprocess.Popen`` the callers use."""

    pid: int

    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def _run_daemon(argv: list[str], log_path: str, env: dict[str, str], cwd: str) -> None:
    """In the forked process: the caller's environment (as given) and directory, the log as stdout and
    stderr, then gpud's own entry point, as ``python -m gpud.main`` runs it."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = ["gpud", *argv]
    sys.exit(importlib.import_module("gpud.main").main(argv))


class Forked:
    """A daemon forked by the forkserver, behind ``Popen``'s methods (a signal's death reads
    as ``-signum``, as with ``Popen``)."""

    _context: Any = None

    @staticmethod
    def usable() -> bool:
        """False once PYTHONPATH is not what this process started with: a forked daemon imports
        from this process's path, a fresh interpreter from the new one (a stand-in NVML module)."""
        return os.environ.get("PYTHONPATH") == _PYTHONPATH_AT_START

    def __init__(self, argv: list[str], log_path: str, env: dict[str, str]) -> None:
        if Forked._context is None:
            Forked._context = multiprocessing.get_context("forkserver")
            Forked._context.set_forkserver_preload(["gpud.main"])
        self._process = Forked._context.Process(
            target=_run_daemon, args=(argv, log_path, env, os.getcwd()), name="gpud", daemon=False
        )
        self._process.start()
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        code: int | None = self._process.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired("gpud", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class DaemonProcess:
    preload = False  # fork from a server that imported gpud once, rather than start an interpreter

    def __init__(self, *args: str, workdir: str | None = None) -> None:
        # Unix socket paths are limited to ~108 bytes: keep them short.
        self.workdir = workdir or tempfile.mkdtemp(prefix="gpud-", dir="/tmp")
        self.socket = os.path.join(self.workdir, "gpud.sock")
        self.log_path = Path(self.workdir, "gpud.log")
        self.args = list(args) or ["--simulate", "2"]
        self.proc: Proc | None = None

    def start(self, timeout: float = 10.0) -> DaemonProcess:
        """Start the daemon and return once it says READY=1 on its notify socket, as systemd
        would hear it (or, when the caller's environment names a notify socket of its own,
        once its socket accepts a connection)."""
        extra = [] if any(a.startswith("--metrics-addr") for a in self.args) else ["--metrics-addr", "off"]
        if not any(a.startswith("--state-dir") for a in self.args):
            extra += ["--state-dir", os.path.join(self.workdir, "state")]
        argv = ["--socket", self.socket, "--log-format", "json", *extra, *self.args]
        env = dict(os.environ)
        notify = None
        if "NOTIFY_SOCKET" not in env:
            notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            notify.bind(os.path.join(self.workdir, f"notify-{time.monotonic_ns()}"))
            env["NOTIFY_SOCKET"] = notify.getsockname()
        proc: Proc
        try:
            if self.preload and Forked.usable():
                proc = Forked(argv, str(self.log_path), env)
            else:
                with open(self.log_path, "ab") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "gpud.main", *argv],
                        stdout=log,
                        stderr=log,
                        stdin=subprocess.DEVNULL,
                        env=env,
                    )
            self.proc = proc
            if self._ready(proc, notify, time.monotonic() + timeout):
                return self
        finally:
            if notify is not None:
                os.unlink(notify.getsockname())
                notify.close()
        raise RuntimeError(f"gpud did not get ready on {self.socket} within {timeout}s:\n{self.log()}")

    def _ready(self, proc: Proc, notify: socket.socket | None, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"gpud exited with {proc.returncode}:\n{self.log()}")
            if notify is not None:
                if select.select([notify], [], [], 0.05)[0] and b"READY=1" in notify.recv(4096).split(b"\n"):
                    return True
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(self.socket)
                    return True
                except OSError:
                    time.sleep(0.02)
        return False

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
