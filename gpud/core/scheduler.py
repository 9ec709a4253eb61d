"""One GPU's time-sliced lock: nvshare's rules as a pure state machine.

Rules kept here (serial mode):
- Sessions attach to the GPU. LOCK_REQUEST joins one queue ordered by priority
  (higher first), then arrival; with equal priorities that is nvshare's FCFS.
- The lock has one holder. When it is free the head of the queue gets it at
  once (LOCK_OK); LOCK_RELEASED passes it on within the same call.
- Time quantum: a holder that has held the lock for TQ since its grant while
  someone waits gets one DROP_LOCK (reason tq) per grant. No waiter, no drop.
- A holder that has not released within ``drop_timeout`` of its DROP_LOCK is
  revoked: it leaves the running set, is told, and is counted.
- Scheduler off (SCHED_OFF): every request is granted at once, the queue is
  emptied into the running set, no drops; accounting still runs.
- Detaching (a closed connection) frees the lock and the queue place at once.

Every call takes ``now`` (integer microseconds) and returns effects for the
shell to carry out; ``next_deadline()`` says when to call ``advance``. A refused
call raises ``Refused`` and leaves the state exactly as it was. This module
never reads a clock, sleeps, logs, or touches a socket.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from gpud_client.protocol import DropReason, ErrorCode, RevokeReason

SessionState = Literal["idle", "waiting", "holding"]


@dataclass(frozen=True, slots=True)
class Grant:
    session: int
    grant: int


@dataclass(frozen=True, slots=True)
class Drop:
    session: int
    grant: int
    reason: DropReason


@dataclass(frozen=True, slots=True)
class Revoke:
    session: int
    grant: int
    reason: RevokeReason


Effect = Grant | Drop | Revoke


class Refused(Exception):
    """A well-formed call the rules do not allow. Nothing was changed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    tq_us: int = 30_000_000
    drop_timeout_us: int = 10_000_000


@dataclass(slots=True)
class _Session:
    id: int
    priority: int
    state: SessionState = "idle"
    requested_at: int = 0
    grant: int = 0
    granted_at: int = 0
    drop_reason: DropReason | None = None
    drop_sent_at: int = 0
    tq_dropped: bool = False
    # lifetime counters, read by snapshots
    grants: int = 0
    hold_us: int = 0
    wait_us: int = 0
    drops: Counter[str] = field(default_factory=Counter)
    revocations: int = 0


@dataclass(frozen=True, slots=True)
class HolderView:
    session: int
    grant: int
    held_us: int
    drop_pending: DropReason | None


@dataclass(frozen=True, slots=True)
class WaiterView:
    session: int
    priority: int
    waited_us: int


@dataclass(frozen=True, slots=True)
class SessionView:
    session: int
    state: SessionState
    priority: int
    grant: int
    grants: int
    hold_us: int
    wait_us: int
    drops: dict[str, int]
    revocations: int


@dataclass(frozen=True, slots=True)
class SchedulerView:
    enabled: bool
    tq_us: int
    drop_timeout_us: int
    holders: tuple[HolderView, ...]
    queue: tuple[WaiterView, ...]
    sessions: int
    grants: int
    drops: dict[str, int]
    revocations: int


class GpuScheduler:
    """The lock of one GPU. See the module comment for the rules."""

    def __init__(self, config: SchedulerConfig = SchedulerConfig(), *, enabled: bool = True) -> None:
        self._cfg = config
        self._enabled = enabled
        self._sessions: dict[int, _Session] = {}
        self._running: dict[int, _Session] = {}  # insertion order = grant order
        self._queue: list[tuple[int, int, int]] = []  # (-priority, seq, session)
        self._seq = itertools.count()
        self._grant_seq = itertools.count(1)
        self._grants = 0
        self._drops: Counter[str] = Counter()
        self._revocations = 0

    # --- calls ------------------------------------------------------------

    def attach(self, session: int, now: int, *, priority: int = 0) -> list[Effect]:
        if session in self._sessions:
            raise Refused(ErrorCode.INVALID, f"session {session} is already attached")
        self._sessions[session] = _Session(id=session, priority=priority)
        return self._settle(now)

    def detach(self, session: int, now: int) -> list[Effect]:
        s = self._get(session)
        if s.state == "holding":
            self._end_hold(s, now)
        elif s.state == "waiting":
            self._unqueue(s)
        del self._sessions[session]
        return self._settle(now)

    def request(self, session: int, now: int) -> list[Effect]:
        s = self._get(session)
        if s.state != "idle":
            raise Refused(ErrorCode.ALREADY_REQUESTED, f"session {session} is already {s.state}")
        s.state = "waiting"
        s.requested_at = now
        bisect.insort(self._queue, (-s.priority, next(self._seq), s.id))
        return self._settle(now)

    def release(self, session: int, now: int, *, grant: int | None = None) -> list[Effect]:
        s = self._get(session)
        if s.state != "holding":
            raise Refused(ErrorCode.NOT_HOLDER, f"session {session} does not hold the lock (it is {s.state})")
        if grant is not None and grant != s.grant:
            raise Refused(
                ErrorCode.STALE_GRANT, f"session {session} holds grant {s.grant}, not grant {grant}"
            )
        self._end_hold(s, now)
        return self._settle(now)

    def set_tq(self, tq_us: int, now: int) -> list[Effect]:
        if tq_us <= 0:
            raise Refused(ErrorCode.INVALID, f"time quantum must be positive, got {tq_us} us")
        self._cfg = SchedulerConfig(tq_us=tq_us, drop_timeout_us=self._cfg.drop_timeout_us)
        return self._settle(now)

    def set_enabled(self, enabled: bool, now: int) -> list[Effect]:
        self._enabled = enabled
        if not enabled:
            for s in self._running.values():  # nothing is dropped while off
                s.drop_reason = None
        return self._settle(now)

    def advance(self, now: int) -> list[Effect]:
        """Carry out whatever is due at ``now`` (timer expiry)."""
        return self._settle(now)

    def next_deadline(self) -> int | None:
        """When ``advance`` next has something to do, or None."""
        if not self._enabled:
            return None
        times: list[int] = []
        for s in self._running.values():
            if s.drop_reason is not None:
                times.append(s.drop_sent_at + self._cfg.drop_timeout_us)
            elif self._queue and not s.tq_dropped:
                times.append(s.granted_at + self._cfg.tq_us)
        return min(times, default=None)

    # --- reading ------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def config(self) -> SchedulerConfig:
        return self._cfg

    def holders(self) -> list[int]:
        return list(self._running)

    def queue(self) -> list[int]:
        return [sid for _, _, sid in self._queue]

    def session(self, session: int, now: int) -> SessionView:
        s = self._get(session)
        held = now - s.granted_at if s.state == "holding" else 0
        waited = now - s.requested_at if s.state == "waiting" else 0
        return SessionView(
            session=s.id,
            state=s.state,
            priority=s.priority,
            grant=s.grant,
            grants=s.grants,
            hold_us=s.hold_us + held,
            wait_us=s.wait_us + waited,
            drops=dict(s.drops),
            revocations=s.revocations,
        )

    def view(self, now: int) -> SchedulerView:
        return SchedulerView(
            enabled=self._enabled,
            tq_us=self._cfg.tq_us,
            drop_timeout_us=self._cfg.drop_timeout_us,
            holders=tuple(
                HolderView(s.id, s.grant, now - s.granted_at, s.drop_reason) for s in self._running.values()
            ),
            queue=tuple(
                WaiterView(sid, -negp, now - self._sessions[sid].requested_at) for negp, _, sid in self._queue
            ),
            sessions=len(self._sessions),
            grants=self._grants,
            drops=dict(self._drops),
            revocations=self._revocations,
        )

    # --- rules ------------------------------------------------------------

    def _get(self, session: int) -> _Session:
        try:
            return self._sessions[session]
        except KeyError:
            raise Refused(ErrorCode.UNKNOWN_SESSION, f"no session {session} on this GPU") from None

    def _unqueue(self, s: _Session) -> None:
        self._queue = [e for e in self._queue if e[2] != s.id]
        s.state = "idle"

    def _end_hold(self, s: _Session, now: int) -> None:
        del self._running[s.id]
        s.hold_us += now - s.granted_at
        s.state = "idle"
        s.drop_reason = None

    def _settle(self, now: int) -> list[Effect]:
        """Apply every rule that is due at ``now``, in order, until stable."""
        effects: list[Effect] = []
        self._revoke_unresponsive(now, effects)
        self._admit(now, effects)
        self._drop_expired(now, effects)
        return effects

    def _revoke_unresponsive(self, now: int, effects: list[Effect]) -> None:
        for s in list(self._running.values()):
            if s.drop_reason is not None and now >= s.drop_sent_at + self._cfg.drop_timeout_us:
                effects.append(Revoke(s.id, s.grant, RevokeReason.DROP_TIMEOUT))
                s.revocations += 1
                self._revocations += 1
                self._end_hold(s, now)

    def _admit(self, now: int, effects: list[Effect]) -> None:
        while self._queue and (not self._enabled or not self._running):
            _, _, sid = self._queue.pop(0)
            s = self._sessions[sid]
            s.state = "holding"
            s.grant = next(self._grant_seq)
            s.granted_at = now
            s.tq_dropped = False
            s.drop_reason = None
            s.grants += 1
            s.wait_us += now - s.requested_at
            self._grants += 1
            self._running[sid] = s
            effects.append(Grant(sid, s.grant))

    def _drop_expired(self, now: int, effects: list[Effect]) -> None:
        if not self._enabled or not self._queue:
            return
        for s in self._running.values():
            if s.drop_reason is None and not s.tq_dropped and now >= s.granted_at + self._cfg.tq_us:
                s.tq_dropped = True
                s.drop_reason = DropReason.TQ
                s.drop_sent_at = now
                s.drops[DropReason.TQ] += 1
                self._drops[DropReason.TQ] += 1
                effects.append(Drop(s.id, s.grant, DropReason.TQ))
