"""Durable allocations: one SQLite database in the state directory.

One transaction per change, and the daemon acknowledges a change only after
its commit returns, so a restart or a crash loses nothing acknowledged. WAL
journal; ``synchronous=NORMAL`` (the default) survives any crash of the daemon
process, ``synchronous=FULL`` (``state_sync = "full"``) also a power cut, at
the price of an fsync per change. The standard library's sqlite3 only.

Calls are synchronous and short (tens of microseconds with NORMAL): the
daemon makes them inline rather than paying a thread hop per allocation.
"""

from __future__ import annotations

import os
import sqlite3
from typing import Literal

import msgspec

from gpud.core.ledger import Allocation

_SCHEMA = """
CREATE TABLE IF NOT EXISTS allocations (
    task_id TEXT PRIMARY KEY,
    record  BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
SCHEMA_VERSION = "1"


class _Record(msgspec.Struct, frozen=True):
    task_id: str
    gpus: list[int]
    share: int
    cpus: list[int]
    tenant: str | None
    priority: int
    owner_pid: int | None
    created_us: int
    uid: int


class Store:
    def __init__(self, state_dir: str, *, sync: Literal["normal", "full"] = "normal") -> None:
        os.makedirs(state_dir, mode=0o750, exist_ok=True)
        self.path = os.path.join(state_dir, "allocations.sqlite3")
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={sync.upper()}")
        self._db.executescript(_SCHEMA)
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(_Record)

    def put(self, alloc: Allocation, uid: int) -> None:
        record = _Record(alloc.task_id, list(alloc.gpus), alloc.share, list(alloc.cpus), alloc.tenant,
                         alloc.priority, alloc.owner_pid, alloc.created_us, uid)
        with self._db:  # one transaction, committed on exit
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("INSERT OR REPLACE INTO allocations VALUES (?, ?)", (alloc.task_id, self._enc.encode(record)))

    def delete(self, task_id: str) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM allocations WHERE task_id = ?", (task_id,))

    def clear(self) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM allocations")

    def load(self) -> list[tuple[Allocation, int]]:
        rows = self._db.execute("SELECT record FROM allocations ORDER BY rowid").fetchall()
        out = []
        for (blob,) in rows:
            r = self._dec.decode(blob)
            out.append(
                (Allocation(r.task_id, tuple(r.gpus), r.share, tuple(r.cpus), r.tenant, r.priority, r.owner_pid,
                            r.created_us), r.uid)
            )
        return out

    def close(self) -> None:
        self._db.close()
