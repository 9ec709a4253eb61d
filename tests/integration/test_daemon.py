"""Starting the daemon: where it listens, stale and live sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

from gpud.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import DaemonUnavailable

from .wire import connect, gpu_status


def test_socket_from_the_environment_and_its_directory_is_created() -> None:
    base = tempfile.mkdtemp(prefix="gpud-", dir="/tmp")
    path = os.path.join(base, "run", "gpud", "gpud.sock")
    env = {**os.environ, "GPUD_SOCKET": path}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpud.main", "--simulate", "1"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                conn = Connection(path)
                break
            except DaemonUnavailable:
                assert proc.poll() is None and time.monotonic() < deadline, "gpud did not listen"
                time.sleep(0.02)
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
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 1
    assert f"another daemon is listening on {daemon.socket}" in out.stderr
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(daemon.socket)  # the first daemon still serves
    probe.close()
