"""Durable allocations: one SQLite database in the state directory.

One transaction per change, and the daemon acknowledges a change only after
its commit returns, so a restart or a crash loses nothing acknowledged. WAL
journal; ``synchronous=NORMAL`` (the default) survives any crash of the daemon
process, ``synchronous=FULL`` (``state_sync = "full"``) also a power cut, at
the price of an fsync per change. The standard library's sqlite3 only.

Calls are synchronous and short (tens of microseconds with NORMAL): the
daemon makes them inline rather than paying a thread hop per allocation.

Records are decoded with the protocol's bounds, one by one: a row that does not
decode (corrupt, or written with values no client may send) is reported by
``load`` and can be moved to the ``set_aside`` table with its reason, where an
operator can read it; it never stops the daemon from starting.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from gpud.core.ledger import UNIT, Allocation
from gpud_client.protocol import Pid, Priority, TaskId

_SCHEMA = """
CREATE TABLE IF NOT EXISTS allocations (
    task_id TEXT PRIMARY KEY,
    record  BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS set_aside (
    task_id TEXT NOT NULL,
    record  BLOB,
    reason  TEXT NOT NULL,
    at      REAL NOT NULL
);
"""
SCHEMA_VERSION = "1"


_Index = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]


class _Record(msgspec.Struct, frozen=True):
    task_id: TaskId
    gpus: Annotated[list[_Index], msgspec.Meta(max_length=1024)]
    share: Annotated[int, msgspec.Meta(ge=0, le=UNIT)]
    cpus: Annotated[list[_Index], msgspec.Meta(max_length=1_000_000)]
    tenant: Annotated[str, msgspec.Meta(max_length=128)] | None
    priority: Priority
    owner_pid: Pid | None
    created_us: int
    uid: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]


@dataclass
class Loaded:
    records: list[tuple[Allocation, int]] = field(default_factory=list)  # (allocation, uid)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (task id, why)


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

    def load(self) -> Loaded:
        out = Loaded()
        for task_id, blob in self._db.execute("SELECT task_id, record FROM allocations ORDER BY rowid"):
            try:
                r = self._dec.decode(blob)
                if r.task_id != task_id:
                    raise ValueError(f"the record names task {r.task_id!r}")
            except (msgspec.MsgspecError, ValueError, TypeError) as exc:
                out.unreadable.append((str(task_id), str(exc)))
                continue
            alloc = Allocation(r.task_id, tuple(r.gpus), r.share, tuple(r.cpus), r.tenant, r.priority, r.owner_pid,
                               r.created_us)
            out.records.append((alloc, r.uid))
        return out

    def set_aside(self, task_id: str, reason: str) -> None:
        """Move a record that cannot be used out of the allocations, keeping it for a person."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT INTO set_aside SELECT task_id, record, ?, ? FROM allocations WHERE task_id = ?",
                (reason, time.time(), task_id),
            )
            self._db.execute("DELETE FROM allocations WHERE task_id = ?", (task_id,))

    def close(self) -> None:
        self._db.close()
