"""Storage faults: real SQLite failures at the store, and what the daemon answers.

The store is exercised on real files: a full database (``max_page_count``), one
locked by another connection, a file that is no database, one damaged, one
written by a newer gpud, a state directory gpud may not write. The daemon is
driven in-process (``tests/inprocess.py``) with a store whose writes fail, to check that a refused change leaves the ledger exactly as it was,
waiters included, and that nothing unstored is ever acknowledged.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from core.statecheck import state_of  # tests/ is on the path of its top-level modules
from inprocess import Node

from gpud.core.ledger import UNIT, Allocation
from gpud.host.logging import LineWriter
from gpud.host.store import BUSY_TIMEOUT_MS, Store, StoreError
from gpud_client import protocol as p


def alloc(task: str, gpu: int = 0) -> Allocation:
    return Allocation(task, (gpu,), UNIT, (), None, 50, None, 0)


# --- the store on real SQLite ------------------------------------------------------


def test_a_full_database_refuses_the_write_and_keeps_what_was_there(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    store.write(put=[(alloc("a"), 1000)])
    (pages,) = store._db.execute("PRAGMA page_count").fetchone()
    store._db.execute(f"PRAGMA max_page_count={pages}")  # SQLite's own SQLITE_FULL, as on a full disk
    big = Allocation("b" * 100, tuple(range(1024)), UNIT, tuple(range(100_000)), None, 50, None, 0)
    with pytest.raises(StoreError, match="full"):
        store.write(put=[(big, 1000)], delete=["a"])
    assert [a.task_id for a, _ in store.load().records] == ["a"]  # the failed change left nothing behind
    store._db.execute("PRAGMA max_page_count=1073741823")
    store.write(put=[(alloc("c"), 1000)])  # and the store works again once there is room
    assert [a.task_id for a, _ in store.load().records] == ["a", "c"]


def test_a_database_locked_by_another_process_fails_fast(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    began = time.perf_counter()
    with pytest.raises(StoreError, match="locked"):
        store.write(put=[(alloc("a"), 1000)])
    waited = time.perf_counter() - began
    assert waited < 1.0, f"a write waited {waited:.3f} s on another process's lock (busy timeout {BUSY_TIMEOUT_MS} ms)"
    other.execute("COMMIT")
    store.write(put=[(alloc("a"), 1000)])
    assert len(store.load().records) == 1


def test_a_file_that_is_no_database_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "allocations.sqlite3").write_bytes(b"this is not SQLite " * 300)
    with pytest.raises(StoreError, match="not a readable gpud store.*move it away .*or restore it from a backup"):
        Store(str(tmp_path))


def test_a_damaged_database_says_what_to_do(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    store.write(put=[(Allocation(f"t{i}", (0,), 1, tuple(range(2000)), None, 50, None, 0), 1) for i in range(50)])
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    (root,) = store._db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'allocations'").fetchone()
    (size,) = store._db.execute("PRAGMA page_size").fetchone()
    store.close()
    path = tmp_path / "allocations.sqlite3"
    data = bytearray(path.read_bytes())
    data[(root - 1) * size : (root - 1) * size + 64] = b"\x42" * 64  # scribble over the table's root page
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="(damaged|not a readable gpud store).*move it away"):
        Store(str(tmp_path))


def test_a_store_of_a_newer_gpud_is_refused_with_the_versions(tmp_path: Path) -> None:
    Store(str(tmp_path)).close()
    db = sqlite3.connect(tmp_path / "allocations.sqlite3", isolation_level=None)
    db.execute("UPDATE meta SET value = '7' WHERE key = 'schema'")
    db.close()
    with pytest.raises(
        StoreError, match="newer gpud \\(store schema 7; this gpud reads schema 2 and older\\): upgrade"
    ):
        Store(str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_state_directory_gpud_may_not_write_is_named(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o500)
    try:
        with pytest.raises(StoreError, match=f"the state directory {state} is not writable by uid {os.getuid()}"):
            Store(str(state))
    finally:
        state.chmod(0o700)


# --- the daemon: a write that fails changes nothing ---------------------------------


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node("1x16GiB", state_dir=str(tmp_path / "state"))
    yield n
    n.close_store()


def test_an_allocation_that_cannot_be_stored_is_refused_and_not_made(node: Node) -> None:
    a = node.connect("a")
    before = state_of(node.daemon.allocations.ledger)
    node.failing_writes = True
    [answer] = a.exchange(p.Allocate(id=5, task_id="job-1", gpus=0.5))
    assert isinstance(answer, p.Error) and answer.id == 5 and answer.code == p.ErrorCode.STORE_FAILED
    assert "task 'job-1' was not allocated: the store could not record it (disk I/O error" in answer.message
    assert state_of(node.daemon.allocations.ledger) == before
    assert "job-1" not in node.daemon.allocations.uids and node.stored() == []
    node.failing_writes = False
    [answer] = a.exchange(p.Allocate(id=6, task_id="job-1", gpus=0.5))
    assert isinstance(answer, p.Allocated) and node.stored() == ["job-1"]


def test_a_free_that_cannot_be_stored_keeps_the_allocation_and_its_waiter_waiting(node: Node) -> None:
    """The free would serve a waiter: both stay as they were, nothing is answered to the
    waiter, and the same free later both frees and serves (stored in one transaction)."""
    a, b = node.connect("a"), node.connect("b")
    assert isinstance(a.exchange(p.Allocate(id=1, task_id="first", gpus=1))[0], p.Allocated)
    assert b.exchange(p.Allocate(id=2, task_id="second", gpus=1, wait_ms=60_000)) == []
    before = state_of(node.daemon.allocations.ledger)
    node.failing_writes = True
    [answer] = a.exchange(p.Free(id=3, task_id="first"))
    assert isinstance(answer, p.Error) and answer.code == p.ErrorCode.STORE_FAILED
    assert "task 'first' was not freed" in answer.message
    assert state_of(node.daemon.allocations.ledger) == before
    assert b.received() == [] and set(node.daemon.allocations.waiters) == {"second"}
    assert node.stored() == ["first"]
    node.failing_writes = False
    assert isinstance(a.exchange(p.Free(id=4, task_id="first"))[0], p.Ok)
    [served] = b.received()
    assert isinstance(served, p.Allocated) and served.id == 2 and served.task_id == "second"
    assert node.stored() == ["second"] and node.daemon.allocations.uids == {"second": os.getuid()}


def test_a_reset_that_cannot_be_stored_releases_nothing(node: Node) -> None:
    a = node.connect("a")
    a.exchange(p.Allocate(id=1, task_id="x", gpus=0.5))
    node.failing_writes = True
    [answer] = a.exchange(p.ResetAllocations(id=2))
    assert isinstance(answer, p.Error) and answer.code == p.ErrorCode.STORE_FAILED
    assert [al.task_id for al in node.daemon.allocations.ledger.allocations()] == ["x"] and node.stored() == ["x"]


def test_locks_and_leases_are_served_while_the_store_fails(node: Node) -> None:
    a = node.connect("a")
    node.failing_writes = True
    [attached] = a.exchange(p.Attach(id=1, gpu=0))
    assert a.exchange(p.LockRequest(id=2, session=attached.session))[0] == p.LockOk(session=attached.session, grant=1)
    [lease] = a.exchange(p.Acquire(id=3, gpu=0, task_type="ASR", max_wait_ms=0))
    assert isinstance(lease, p.LeaseResult)


def test_requests_during_shutdown_are_refused_as_shutting_down(node: Node) -> None:
    a = node.connect("a")
    node.daemon.farewell("test")
    assert isinstance(a.received()[0], p.Goodbye)
    for msg in (p.Allocate(id=1, task_id="late", gpus=0.5), p.Free(id=2, task_id="late"), p.Status(id=3)):
        [answer] = a.exchange(msg)
        assert isinstance(answer, p.Error) and answer.code == p.ErrorCode.SHUTTING_DOWN, answer
    assert node.stored() == []


# --- the log -------------------------------------------------------------------------


class _Refusing:
    """A stream whose writes fail until told otherwise (a full disk, a closed pipe)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.full = True

    def fileno(self) -> int:
        raise OSError("no descriptor")

    def write(self, data: str) -> None:
        if self.full:
            raise OSError(28, "No space left on device")
        self.lines.append(data)

    def flush(self) -> None:
        pass


def test_a_log_line_that_cannot_be_written_is_dropped_counted_and_never_raised() -> None:
    stream = _Refusing()
    writer = LineWriter(stream, json=True)  # type: ignore[arg-type]
    writer.msg('{"event":"one"}')
    writer.msg('{"event":"two"}')
    assert writer.dropped == 2 and stream.lines == []
    stream.full = False
    writer.msg('{"event":"three"}')
    assert stream.lines == ['{"event":"log_lines_dropped","count":2,"level":"warning"}\n', '{"event":"three"}\n']
    assert writer.dropped == 0
