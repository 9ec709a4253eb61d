"""What a start says about the run before it: only a daemon that was serving can have crashed.

Real daemon processes on one state directory, one after another as systemd would start them. A
start that fails before it serves (a bad ``--simulate``, a metrics port already taken) is no crash:
the next good start neither logs ``restarted_after_crash`` nor withholds grants for the restart
grace. A serving daemon killed with SIGKILL is one, and a failed start after it does not hide it.
The grace is set to 60 s, so a lease that may not wait tells at once whether it applies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.host import lockfile
from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p


class Starts:
    """Daemons started one at a time on one state directory, each with a log of its own."""

    def __init__(self, tmp_path: Path) -> None:
        self.state_dir = str(tmp_path / "state")
        self.config = tmp_path / "gpud.toml"
        self.config.write_text("restart_grace_s = 60\n")
        self.started: list[DaemonProcess] = []

    def daemon(self, *args: str) -> DaemonProcess:
        d = DaemonProcess(*args, "--config", str(self.config), "--state-dir", self.state_dir)
        self.started.append(d)
        return d

    def good(self) -> DaemonProcess:
        return self.daemon("--simulate", "1").start(timeout=30)

    def failed(self, *args: str, why: str) -> None:
        with pytest.raises(RuntimeError, match=f"(?s)gpud exited with [12]:.*{why}"):
            self.daemon(*args).start(timeout=30)  # returns when the process has exited

    def cleanup(self) -> None:
        for d in self.started:
            d.cleanup()


@pytest.fixture
def starts(tmp_path: Path) -> Iterator[Starts]:
    s = Starts(tmp_path)
    try:
        yield s
    finally:
        s.cleanup()


def events(d: DaemonProcess, name: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    return [e for e in lines if e["event"] == name]


def lease_at_once(d: DaemonProcess) -> p.LeaseStatus:
    """A lease on an idle GPU that may not wait: ACQUIRED, or SKIPPED while the restart grace lasts."""
    with Client(d.socket, name="at-once", reconnect=False) as c:
        with c.lease("gpu:0", max_wait_ms=0, busy_policy=p.BusyPolicy.SKIP) as r:
            return r.status


def fail_both_ways(starts: Starts) -> None:
    starts.failed("--simulate", "bogus", "--metrics-addr", "off", why="bad --simulate value 'bogus'")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        starts.failed("--simulate", "1", "--metrics-addr", f"127.0.0.1:{port}", why="cannot serve metrics")


def test_failed_starts_leave_no_crash_behind(starts: Starts) -> None:
    d = starts.good()
    assert d.stop() == 0
    fail_both_ways(starts)
    d = starts.good()
    assert events(d, "restarted_after_crash") == []
    assert lease_at_once(d) == p.LeaseStatus.ACQUIRED  # no restart grace


def test_failed_starts_on_a_fresh_state_directory_leave_no_crash_behind(starts: Starts) -> None:
    fail_both_ways(starts)
    d = starts.good()
    assert events(d, "restarted_after_crash") == []
    assert lease_at_once(d) == p.LeaseStatus.ACQUIRED


def test_a_crash_of_a_serving_daemon_outlives_a_failed_start(starts: Starts) -> None:
    crashed = starts.good()
    assert crashed.proc is not None
    pid = crashed.proc.pid
    crashed.stop(signal.SIGKILL)
    fail_both_ways(starts)
    d = starts.good()
    (after,) = events(d, "restarted_after_crash")
    assert after["previous_pid"] == pid and after["restart_grace_s"] == 60.0
    assert lease_at_once(d) == p.LeaseStatus.SKIPPED  # the grace applies
    assert d.stop() == 0
    d = starts.good()  # a clean stop after it: the crash was answered
    assert events(d, "restarted_after_crash") == []
    assert lease_at_once(d) == p.LeaseStatus.ACQUIRED


def test_the_lock_file_tells_a_crash_from_a_start_that_died(tmp_path: Path) -> None:
    """The lock file's line as starts die at each point (closing the descriptor without ``release``
    is what the kernel does for a killed daemon); a bare pid is what an older gpud leaves."""
    state = str(tmp_path)
    first = lockfile.acquire(state)
    assert first.crashed_pid is None
    first.mark_serving()
    os.close(first.fd)  # killed while serving
    starting = lockfile.acquire(state)
    assert starting.crashed_pid == os.getpid()
    os.close(starting.fd)  # killed before it served: the crash stays the one to answer
    starting = lockfile.acquire(state)
    assert starting.crashed_pid == os.getpid()
    starting.release(clean=False)  # a start that failed: the same
    serving = lockfile.acquire(state)
    assert serving.crashed_pid == os.getpid()
    serving.mark_serving()
    serving.release(clean=True)
    fresh = lockfile.acquire(state)
    assert fresh.crashed_pid is None
    os.close(fresh.fd)  # killed before it served, with no crash before it
    older = lockfile.acquire(state)
    assert older.crashed_pid is None
    os.close(older.fd)
    Path(state, lockfile.LOCK_NAME).write_text("4242\n" + "x" * 200)  # an older gpud's, with junk after it
    older = lockfile.acquire(state)
    assert older.crashed_pid == 4242
    older.release(clean=False)
    assert lockfile.acquire(state).crashed_pid == 4242
