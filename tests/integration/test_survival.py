"""The daemon process survives what used to end it: numbers that overflow a syscall
later, and stored records it can no longer use (no crash loop on restart)."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import msgspec

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p

from .wire import connect


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gpud.toml"
    path.write_text(text)
    return str(path)


def reaps_done(d: DaemonProcess, at_least: int) -> None:
    """Let the reaper run a few times (it ticks every 50 ms here) while the daemon answers."""
    deadline = time.monotonic() + at_least * 0.05 + 2
    conn = connect(d, "watcher")
    while time.monotonic() < deadline:
        assert d.proc is not None and d.proc.poll() is None, d.log()[-2000:]
        conn.call(p.Status(id=conn.next_id()))
        time.sleep(0.05)  # not a wait: the daemon must live and answer while time passes (no count of reaps to watch)
    conn.close()


def test_an_owner_pid_past_pid_max_is_refused_and_the_daemon_lives(tmp_path: Path) -> None:
    d = DaemonProcess("--simulate", "2x16GiB", "--config", config(tmp_path, "reap_interval_s = 0.05\n")).start()
    try:
        conn = connect(d)
        for pid in (2**40, 2**31, p.PID_MAX + 1):
            raw = {"type": "ALLOCATE", "id": 5, "task_id": f"t{pid}", "gpus": 1.0, "owner_pid": pid}
            conn.send_raw(p.frame(msgspec.msgpack.encode(raw)))
            err = conn.recv(5)
            assert isinstance(err, p.Error) and err.code == p.ErrorCode.INVALID and "$.owner_pid" in err.message
        reaps_done(d, 10)  # before, the reaper's kill(2**40, 0) overflowed and ended the daemon
        assert conn.call(p.ListAllocations(id=conn.next_id())).allocations == []
    finally:
        d.cleanup()


def _write_records(state_dir: Path, rows: list[tuple[str, bytes]]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(state_dir / "allocations.sqlite3")
    db.executescript(
        "CREATE TABLE allocations (task_id TEXT PRIMARY KEY, record BLOB NOT NULL);"
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('schema', '1');"
    )
    db.executemany("INSERT INTO allocations VALUES (?, ?)", rows)
    db.commit()
    db.close()


def _record(task_id: str, gpus: list[int], share: int, owner_pid: int | None) -> bytes:
    return msgspec.msgpack.encode(
        {
            "task_id": task_id,
            "gpus": gpus,
            "share": share,
            "cpus": [],
            "tenant": None,
            "priority": 50,
            "owner_pid": owner_pid,
            "created_us": 0,
            "uid": 0,
        }
    )


def test_records_that_cannot_be_used_are_set_aside_not_a_crash_loop(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _write_records(
        state,
        [
            ("good", _record("good", [0], 2500, None)),
            ("huge-pid", _record("huge-pid", [1], 10000, 2**40)),  # an older daemon accepted this
            ("corrupt", b"\xc1\xc1 not msgpack"),
            ("gone-gpu", _record("gone-gpu", [7], 10000, None)),  # the node has 2 GPUs now
            ("bad-share", _record("bad-share", [1], 20000, None)),
        ],
    )
    args = (
        "--simulate",
        "2x16GiB",
        "--state-dir",
        str(state),
        "--config",
        config(tmp_path, "reap_interval_s = 0.05\n"),
    )
    for run in range(2):  # a restart comes up the same way, with nothing left to set aside
        d = DaemonProcess(*args).start()
        try:
            reaps_done(d, 10)
            conn = connect(d)
            listing = conn.call(p.ListAllocations(id=conn.next_id()))
            assert [a.task_id for a in listing.allocations] == ["good"]
            aside = [line for line in d.log().splitlines() if '"allocation_set_aside"' in line]
            if run == 0:
                assert len(aside) == 4 and all(t in d.log() for t in ("huge-pid", "corrupt", "gone-gpu", "bad-share"))
            else:
                assert aside == []
        finally:
            d.stop()
    db = sqlite3.connect(state / "allocations.sqlite3")
    kept = dict(db.execute("SELECT task_id, reason FROM set_aside").fetchall())
    db.close()
    assert set(kept) == {"huge-pid", "corrupt", "gone-gpu", "bad-share"}
    assert "owner_pid" in kept["huge-pid"] and "GPU 7" in kept["gone-gpu"]
    os.remove(state / "allocations.sqlite3")
