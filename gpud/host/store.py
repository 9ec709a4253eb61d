"""Durable allocations: one SQLite database in the state directory.

One transaction per change, and the daemon acknowledges a change only after
its commit returns, so a restart or a crash loses nothing acknowledged. WAL
journal; ``synchronous=NORMAL`` (the default) survives any crash of the daemon
process, ``synchronous=FULL`` (``state_sync = "full"``) also a power cut, at
the price of an fsync per change. The standard library's sqlite3 only.

Calls are synchronous and short (tens of microseconds with NORMAL): the
daemon makes them inline rather than paying a thread hop per allocation. So
that the event loop never waits long, a database locked by another process
(a backup, an operator's ``sqlite3`` shell) is waited for at most
``BUSY_TIMEOUT_MS`` once serving; then the write fails.

A write that fails (disk full, an I/O error, the database locked) raises
``StoreError`` naming the cause; its transaction is rolled back, so the store
is as it was. A store that cannot be used at start-up (not a database,
damaged, written by a newer gpud, a state directory gpud may not write)
raises ``StoreError`` saying what is wrong and what to do.

Records are decoded with the protocol's bounds, one by one: a row that does not
decode (corrupt, or written with values no client may send) is reported by
``load`` and can be moved to the ``set_aside`` table with its reason, where an
operator can read it; it never stops the daemon from starting.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from gpud.core.ledger import UNIT, Allocation, Notice, Request, TaskRecord
from gpud_client.protocol import Pid, PreemptReason, Priority, Recovery, Strategy, TaskId

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
SCHEMA_VERSION = 2  # 2: notices, suspended and waiting tasks, preemption history, drained GPUs (reads 1)
_PUT = "INSERT OR REPLACE INTO allocations VALUES (?, ?)"
_DELETE = "DELETE FROM allocations WHERE task_id = ?"
BUSY_TIMEOUT_MS = 5  # the longest a write waits for another process's lock while serving
OPEN_BUSY_TIMEOUT_MS = 2000  # at start-up, before anything is served
_MOVE_AWAY = "move it away (gpud then starts with no allocations) or restore it from a backup"


class StoreError(Exception):
    """The store could not be read or written; a failed write changed nothing."""


_Index = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]


_Gpus = Annotated[list[_Index], msgspec.Meta(max_length=1024)]
_Tenant = Annotated[str, msgspec.Meta(max_length=128)] | None


class _Notice(msgspec.Struct, frozen=True):
    reason: PreemptReason
    gpus: _Gpus
    whole: bool
    issued: int
    deadline: int
    by: Annotated[str, msgspec.Meta(max_length=256)]


class _Wait(msgspec.Struct, frozen=True):
    """A task that waits durably: suspended (``suspended`` holds its allocation), or with victims."""

    gpus: Annotated[int, msgspec.Meta(ge=0, le=1024 * UNIT)]
    cpus: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]
    prefer: _Gpus
    strategy: Strategy
    tenant: _Tenant
    priority: Priority
    owner_pid: Pid | None
    wait_us: int
    on_preempt: Recovery
    gpus_max: Annotated[int, msgspec.Meta(ge=0, le=1024)]
    protected: bool
    pinned: _Gpus
    deadline: int
    since: int
    victims: Annotated[list[TaskId], msgspec.Meta(max_length=1024)]
    memory_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**62)] | None = None  # (None in older records)


class _Record(msgspec.Struct, frozen=True):
    task_id: TaskId
    gpus: _Gpus
    share: Annotated[int, msgspec.Meta(ge=0, le=UNIT)]
    cpus: Annotated[list[_Index], msgspec.Meta(max_length=1_000_000)]
    tenant: _Tenant
    priority: Priority
    owner_pid: Pid | None
    created_us: int
    uid: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
    # schema 2 (a schema 1 record reads with these defaults)
    held: bool = True  # False: no allocation now (the fields above are a suspended one's, or unused)
    on_preempt: Recovery = Recovery.TERMINATE
    gpus_min: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    gpus_max: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    protected: bool = False
    preemptions: Annotated[int, msgspec.Meta(ge=0)] = 0
    resume: bool = False
    changed_us: int = 0
    notice: _Notice | None = None
    wait: _Wait | None = None
    suspended: bool = False
    # The owner process's start time (clock ticks after boot): after a restart, only that very
    # process is its owner again, never a reuse of its pid. None in older records.
    owner_start: int | None = None
    # A fraction's memory ceiling (ALLOCATE's memory_bytes). None in older records: its share's.
    memory_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**62)] | None = None


@dataclass
class Loaded:
    records: list[tuple[TaskRecord, int]] = field(default_factory=list)  # (task, uid)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (task id, why)
    draining: list[int] = field(default_factory=list)  # GPUs an operator drains
    starts: dict[str, int] = field(default_factory=dict)  # task id -> its owner's start time, where stored


class Store:
    def __init__(self, state_dir: str, *, sync: Literal["normal", "full"] = "normal") -> None:
        self.path = os.path.join(state_dir, "allocations.sqlite3")
        try:
            os.makedirs(state_dir, mode=0o750, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"cannot create the state directory {state_dir}: {exc.strerror} "
                f"(create it, writable by uid {os.getuid()}, or set state_dir)"
            ) from None
        if not os.access(state_dir, os.W_OK | os.X_OK):
            raise StoreError(
                f"the state directory {state_dir} is not writable by uid {os.getuid()}: gpud keeps its "
                f"allocations there (fix its owner or mode, or set state_dir)"
            )
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(_Record)
        try:
            self._db = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=OPEN_BUSY_TIMEOUT_MS / 1000
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self.path}: {exc}") from None
        try:
            self._open(sync)
        except sqlite3.Error as exc:
            self._db.close()
            raise StoreError(self._explain_open(exc)) from None
        except StoreError:
            self._db.close()
            raise

    def _open(self, sync: str) -> None:
        db = self._db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={sync.upper()}")
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "meta" in tables:
            row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            version = int(row[0]) if row is not None and str(row[0]).isdigit() else None
            if version is None:
                raise StoreError(f"{self.path} has no readable schema version: it is not a gpud store; {_MOVE_AWAY}")
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} was written by a newer gpud (store schema {version}; this gpud reads schema "
                    f"{SCHEMA_VERSION} and older): upgrade gpud, or {_MOVE_AWAY}"
                )
        (verdict,) = db.execute("PRAGMA quick_check").fetchone()
        if verdict != "ok":
            raise StoreError(f"{self.path} is damaged (SQLite quick_check: {verdict}); {_MOVE_AWAY}")
        db.executescript(_SCHEMA)
        db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")

    def _explain_open(self, exc: sqlite3.Error) -> str:
        text = str(exc)
        if "not a database" in text or "malformed" in text:
            return f"{self.path} is not a readable gpud store (SQLite: {text}); {_MOVE_AWAY}"
        if "locked" in text or "busy" in text:
            return f"{self.path} is locked by another process (SQLite: {text}); stop it, then start gpud again"
        if "readonly" in text or "unable to open" in text:
            return f"{self.path} cannot be written by uid {os.getuid()} (SQLite: {text}); fix its owner or mode"
        return f"cannot use {self.path} (SQLite: {text})"

    def write(
        self,
        put: Iterable[tuple[TaskRecord, int]] = (),
        delete: Iterable[str] = (),
        *,
        clear: bool = False,
        draining: Iterable[int] | None = None,
        starts: Mapping[str, int | None] | None = None,
    ) -> None:
        """One change, in one transaction: all of it is stored, or none (``StoreError``).
        ``starts``: the owner processes' start times, by task id."""
        starts = starts or {}
        rows = [(r.task_id, self._enc.encode(self._record(r, uid, starts.get(r.task_id)))) for r, uid in put]
        gone = [(t,) for t in delete]
        drained = None if draining is None else ",".join(map(str, sorted(draining)))
        if not clear and drained is None and len(rows) + len(gone) == 1:  # (the common change: one task's record)
            self._statement(_PUT if rows else _DELETE, rows[0] if rows else gone[0])
            return

        def change(db: sqlite3.Connection) -> None:
            if clear:
                db.execute("DELETE FROM allocations")
            if gone:
                db.executemany(_DELETE, gone)
            if rows:
                db.executemany(_PUT, rows)
            if drained is not None:
                db.execute("INSERT OR REPLACE INTO meta VALUES ('draining', ?)", (drained,))

        self._transaction(change)

    def _statement(self, sql: str, args: tuple[object, ...]) -> None:
        """A change of one statement, a transaction of its own: SQLite commits it whole before it
        returns, or rolls it back whole (no BEGIN and COMMIT to pay for)."""
        try:
            self._db.execute(sql, args)
        except sqlite3.Error as exc:
            raise StoreError(f"{exc} (store {self.path})") from None

    def _transaction(self, change: Callable[[sqlite3.Connection], None]) -> None:
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                change(db)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"{exc} (store {self.path})") from None

    @staticmethod
    def _record(rec: TaskRecord | Allocation, uid: int, owner_start: int | None = None) -> _Record:
        if isinstance(rec, Allocation):
            rec = TaskRecord(rec.task_id, allocation=rec)
        a = rec.allocation
        if a is not None and rec.notice is None and rec.waiting is None:  # (the common record: the same fields)
            return _Record(
                rec.task_id,
                list(a.gpus),
                a.share,
                list(a.cpus),
                a.tenant,
                a.priority,
                a.owner_pid,
                a.created_us,
                uid,
                True,
                a.on_preempt,
                a.gpus_min,
                a.gpus_max,
                a.protected,
                a.preemptions,
                a.resume,
                a.changed_us,
                None,
                None,
                rec.suspended is not None,
                owner_start,
                a.memory_bytes,
            )
        a = rec.allocation or rec.suspended
        n, w = rec.notice, rec.waiting
        return _Record(
            rec.task_id,
            list(a.gpus) if a else [],
            a.share if a else 0,
            list(a.cpus) if a else [],
            a.tenant if a else None,
            a.priority if a else 0,
            a.owner_pid if a else None,
            a.created_us if a else 0,
            uid,
            held=rec.allocation is not None,
            on_preempt=a.on_preempt if a else Recovery.TERMINATE,
            gpus_min=a.gpus_min if a else 0,
            gpus_max=a.gpus_max if a else 0,
            protected=a.protected if a else False,
            preemptions=rec.allocation.preemptions if rec.allocation else rec.preemptions,
            resume=rec.allocation.resume if rec.allocation else rec.resume,
            changed_us=a.changed_us if a else 0,
            notice=None if n is None else _Notice(n.reason, list(n.gpus), n.whole, n.issued, n.deadline, n.by),
            wait=None
            if w is None
            else _Wait(
                w.gpus,
                w.cpus,
                list(w.prefer),
                w.strategy,
                w.tenant,
                w.priority,
                w.owner_pid,
                w.wait_us,
                w.on_preempt,
                w.gpus_max,
                w.protected,
                list(w.pinned),
                rec.wait_deadline,
                rec.wait_since,
                list(rec.victims),
                w.memory_bytes,
            ),
            suspended=rec.suspended is not None,
            owner_start=owner_start,
            memory_bytes=a.memory_bytes if a else None,
        )

    @staticmethod
    def _task(r: _Record) -> TaskRecord:
        alloc = Allocation(
            r.task_id,
            tuple(r.gpus),
            r.share,
            tuple(r.cpus),
            r.tenant,
            r.priority,
            r.owner_pid,
            r.created_us,
            on_preempt=r.on_preempt,
            gpus_min=r.gpus_min,
            gpus_max=r.gpus_max,
            protected=r.protected,
            preemptions=r.preemptions,
            resume=r.resume,
            changed_us=r.changed_us,
            memory_bytes=r.memory_bytes,
        )
        n, w = r.notice, r.wait
        notice = None if n is None else Notice(r.task_id, n.reason, tuple(n.gpus), n.whole, n.issued, n.deadline, n.by)
        if w is None:
            return TaskRecord(
                r.task_id,
                allocation=alloc if r.held else None,
                notice=notice,
                preemptions=r.preemptions,
                resume=r.resume,
            )
        req = Request(
            r.task_id,
            w.gpus,
            w.cpus,
            tuple(w.prefer),
            w.strategy,
            w.tenant,
            w.priority,
            w.owner_pid,
            w.wait_us,
            w.on_preempt,
            w.gpus_max,
            w.protected,
            tuple(w.pinned),
            w.memory_bytes,
        )
        return TaskRecord(
            r.task_id,
            waiting=req,
            wait_deadline=w.deadline,
            wait_since=w.since,
            victims=tuple(w.victims),
            suspended=alloc if r.suspended else None,
            preemptions=r.preemptions,
            resume=r.resume,
        )

    def load(self) -> Loaded:
        out = Loaded()
        try:
            rows = self._db.execute("SELECT task_id, record FROM allocations ORDER BY rowid").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(self._explain_open(exc)) from None
        for task_id, blob in rows:
            try:
                r = self._dec.decode(blob)
                if r.task_id != task_id:
                    raise ValueError(f"the record names task {r.task_id!r}")
            except (msgspec.MsgspecError, ValueError, TypeError) as exc:
                out.unreadable.append((str(task_id), str(exc)))
                continue
            out.records.append((self._task(r), r.uid))
            if r.owner_start is not None:
                out.starts[r.task_id] = r.owner_start
        row = self._db.execute("SELECT value FROM meta WHERE key = 'draining'").fetchone()
        if row is not None and row[0]:
            out.draining = [int(g) for g in str(row[0]).split(",") if g.isdigit()]
        return out

    def set_aside(self, task_id: str, reason: str) -> None:
        """Move a record that cannot be used out of the allocations, keeping it for a person."""

        def move(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO set_aside SELECT task_id, record, ?, ? FROM allocations WHERE task_id = ?",
                (reason, time.time(), task_id),
            )
            db.execute("DELETE FROM allocations WHERE task_id = ?", (task_id,))

        self._transaction(move)

    def close(self) -> None:
        self._db.close()
