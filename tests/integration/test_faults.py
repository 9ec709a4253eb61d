"""Faults around a real daemon process: its store, its state directory, its socket,
its shutdown, and a start that follows a crash."""

from __future__ import annotations

import os
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import ProtocolError

from .waiting import eventually
from .wire import attach, connect, take_lock


def run_gpud(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpud.main", "--metrics-addr", "off", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- one daemon per state directory and per socket ------------------------------------


def test_a_second_daemon_on_the_same_state_directory_refuses_to_start(daemon: DaemonProcess) -> None:
    state = os.path.join(daemon.workdir, "state")
    out = run_gpud("--simulate", "1", "--socket", os.path.join(daemon.workdir, "other.sock"), "--state-dir", state)
    assert out.returncode == 1
    assert (
        f"gpud pid {daemon.proc.pid if daemon.proc else '?'} is already running with the state directory {state}"
        in out.stderr
    )
    assert not os.path.exists(os.path.join(daemon.workdir, "other.sock"))
    connect(daemon).close()  # the first one serves on


def test_a_path_that_is_not_a_socket_is_never_removed(tmp_path: Path) -> None:
    path = tmp_path / "gpud.sock"
    path.write_text("someone's file\n")
    out = run_gpud("--simulate", "1", "--socket", str(path), "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 1 and f"{path} exists and is not a socket: gpud will not remove it" in out.stderr
    assert path.read_text() == "someone's file\n"


def test_a_socket_that_never_accepts_is_probed_with_a_timeout(tmp_path: Path) -> None:
    path = str(tmp_path / "gpud.sock")
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(path)
    squatter.listen(0)
    filled = []
    while True:  # fill its backlog: one more connect would block
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        filled.append(s)
    try:
        began = time.monotonic()
        out = run_gpud("--simulate", "1", "--socket", path, "--state-dir", str(tmp_path / "state"))
        assert out.returncode == 1 and "listens on" in out.stderr and "does not accept" in out.stderr, out.stderr
        assert time.monotonic() - began < 15
        assert os.path.exists(path)  # a live listener's socket stays
    finally:
        for s in [*filled, squatter]:
            s.close()


def test_a_socket_replaced_while_running_is_not_removed_at_exit(daemon: DaemonProcess) -> None:
    os.unlink(daemon.socket)
    successor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    successor.bind(daemon.socket)  # as another daemon would after finding the path gone
    successor.listen(1)
    try:
        assert daemon.stop() == 0
        assert os.path.exists(daemon.socket)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(daemon.socket)  # still the successor's
        probe.close()
        assert '"socket_not_removed"' in daemon.log()
    finally:
        successor.close()


# --- the store ---------------------------------------------------------------------------


def test_a_store_of_a_newer_gpud_stops_the_start_and_says_what_to_do(tmp_path: Path) -> None:
    state = tmp_path / "state"
    d = DaemonProcess("--simulate", "1", "--state-dir", str(state)).start()
    d.stop()
    db = sqlite3.connect(state / "allocations.sqlite3", isolation_level=None)
    db.execute("UPDATE meta SET value = '3' WHERE key = 'schema'")
    db.close()
    out = run_gpud("--simulate", "1", "--socket", d.socket, "--state-dir", str(state))
    assert out.returncode == 1
    assert (
        "was written by a newer gpud (store schema 3; this gpud reads schema 2 and older): upgrade gpud" in out.stderr
    )
    d.cleanup()


def test_a_file_that_is_no_store_stops_the_start_and_says_what_to_do(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "allocations.sqlite3").write_bytes(os.urandom(8192))
    out = run_gpud("--simulate", "1", "--socket", str(tmp_path / "s"), "--state-dir", str(state))
    assert out.returncode == 1 and "is not a readable gpud store" in out.stderr and "move it away" in out.stderr


def test_a_state_directory_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    state = tmp_path / "file" / "state"
    out = run_gpud("--simulate", "1", "--socket", str(tmp_path / "s"), "--state-dir", str(state))
    assert out.returncode == 1 and f"cannot use the state directory {state}" in out.stderr


def test_a_store_locked_by_another_process_refuses_changes_and_locks_go_on(daemon: DaemonProcess) -> None:
    path = os.path.join(daemon.workdir, "state", "allocations.sqlite3")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); sys.stdin.readline()",
            path,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        conn = connect(daemon)
        began = time.monotonic()
        with pytest.raises(ProtocolError) as err:
            conn.call(p.Allocate(id=conn.next_id(), task_id="job", gpus=0.5))
        assert err.value.code == p.ErrorCode.STORE_FAILED and "database is locked" in str(err.value)
        assert time.monotonic() - began < 2  # not SQLite's default 5 s busy wait
        take_lock(conn, attach(conn, gpu=0))  # locks and leases are served as ever
        lease = conn.call(p.Acquire(id=conn.next_id(), gpu=1, task_type="ASR", max_wait_ms=0))
        assert isinstance(lease, p.LeaseResult) and lease.acquired
    finally:
        holder.communicate("\n", timeout=10)
    done = conn.call(p.Allocate(id=conn.next_id(), task_id="job", gpus=0.5))
    assert isinstance(done, p.Allocated)
    listing = conn.call(p.ListAllocations(id=conn.next_id()))
    assert [a.task_id for a in listing.allocations] == ["job"]


# --- shutdown and the start after a crash ------------------------------------------------


def test_requests_during_shutdown_get_shutting_down_and_exit_is_clean(daemon: DaemonProcess) -> None:
    conn = connect(daemon)
    answers: list[object] = []
    acked: set[str] = set()

    def flood() -> None:
        i = 0
        try:
            while True:
                i += 1
                msg = (
                    p.Allocate(id=conn.next_id(), task_id=f"t{i}", gpus=0.01)
                    if i % 2
                    else p.Free(id=conn.next_id(), task_id=f"t{i - 1}")
                )
                answer = conn.call(msg, timeout=5)
                answers.append(answer)
                if isinstance(answer, p.Allocated):
                    acked.add(answer.task_id)
                elif isinstance(answer, p.Ok):
                    acked.discard(f"t{i - 1}")
        except Exception as exc:  # the connection ends after the goodbye
            answers.append(exc)

    flooder = threading.Thread(target=flood)
    flooder.start()
    eventually(lambda: len(answers) >= 50, "50 answers to the flood")
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(10) == 0
    flooder.join(10)
    daemon.stop()
    codes = {exc.code for exc in answers if isinstance(exc, ProtocolError)}
    assert codes <= {p.ErrorCode.SHUTTING_DOWN}, codes
    assert any(isinstance(a, p.Allocated) for a in answers)
    assert '"fault"' not in daemon.log() and "Traceback" not in daemon.log()
    daemon.start()  # what was acknowledged is there, nothing else
    listing = connect(daemon).call(p.ListAllocations(id=1))
    assert {a.task_id for a in listing.allocations} == acked
    assert '"restarted_after_crash"' not in daemon.log()


def test_a_start_after_a_crash_grants_nothing_during_the_grace(daemon: DaemonProcess) -> None:
    daemon.stop(sig=signal.SIGKILL)
    daemon.start()
    assert '"restarted_after_crash"' in daemon.log()
    conn = connect(daemon)
    session = attach(conn, gpu=0)
    began = time.monotonic()
    take_lock(conn, session)
    waited = time.monotonic() - began
    lease = conn.call(p.Acquire(id=conn.next_id(), gpu=1, task_type="ASR", max_wait_ms=0))
    assert isinstance(lease, p.LeaseResult) and lease.acquired  # the grace is over
    assert waited > 0.2, f"granted {waited:.3f} s after connecting: inside the 1 s grace"


@contextmanager
def files_capped(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Connection, Path]]:
    """A daemon with one acknowledged allocation ("before"), whose files a test then keeps
    from growing (``cap``: RLIMIT_FSIZE set from outside on the running process, so the
    kernel refuses the write with EFBIG as a full disk would with ENOSPC)."""
    state = tmp_path / "state"
    d = DaemonProcess("--simulate", "1x16GiB", "--state-dir", str(state), workdir=str(tmp_path)).start()
    try:
        conn = connect(d)
        assert isinstance(conn.call(p.Allocate(id=conn.next_id(), task_id="before", gpus=0.25)), p.Allocated)
        yield d, conn, state
    finally:
        d.cleanup()


def cap(d: DaemonProcess, limit: int) -> None:
    assert d.proc is not None
    resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def refused_for_want_of_room(conn: Connection, task: str) -> None:
    with pytest.raises(ProtocolError) as err:
        conn.call(p.Allocate(id=conn.next_id(), task_id=task, gpus=0.25))
    assert err.value.code == p.ErrorCode.STORE_FAILED and f"task {task!r} was not allocated" in str(err.value)


def test_a_full_disk_refuses_the_change_and_nothing_is_lost(tmp_path: Path) -> None:
    with files_capped(tmp_path) as (d, conn, state):
        files = [state / "allocations.sqlite3", state / "allocations.sqlite3-wal", d.log_path]
        cap(d, max(f.stat().st_size for f in files))  # the store's files may not grow (the log has room)
        refused_for_want_of_room(conn, "during")
        take_lock(conn, attach(conn, gpu=0))  # locks go on
        cap(d, resource.RLIM_INFINITY)
        assert isinstance(conn.call(p.Allocate(id=conn.next_id(), task_id="after", gpus=0.25)), p.Allocated)
        d.stop(sig=signal.SIGKILL)
        d.start()
        listing = connect(d).call(p.ListAllocations(id=1))
        assert sorted(a.task_id for a in listing.allocations) == ["after", "before"]  # (pages: in task id order)


def test_a_disk_too_full_for_the_log_too_never_stops_the_daemon(tmp_path: Path) -> None:
    """The log file cannot grow either: log lines are dropped and counted, requests are
    still answered on their connection (before, the failed log write closed it, and a
    timer's would have ended the daemon)."""
    with files_capped(tmp_path) as (d, conn, _):
        cap(d, d.log_path.stat().st_size)  # smaller than the store's files: nothing may grow
        for task in ("during-1", "during-2"):
            refused_for_want_of_room(conn, task)
        take_lock(conn, attach(conn, gpu=0))
        assert isinstance(conn.call(p.Status(id=conn.next_id())), p.StatusReply)
        cap(d, resource.RLIM_INFINITY)
        assert isinstance(conn.call(p.Allocate(id=conn.next_id(), task_id="after", gpus=0.25)), p.Allocated)
        assert '"event":"log_lines_dropped"' in d.log()
        assert d.proc is not None and d.proc.poll() is None
