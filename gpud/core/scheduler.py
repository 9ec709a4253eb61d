"""One GPU's scheduler: nvshare's time-sliced lock, memory-aware concurrency,
compute limits and priorities, as a pure state machine.

Rules kept here:
- Sessions attach to the GPU. LOCK_REQUEST joins one queue ordered by priority
  (higher first), then arrival; with equal priorities that is nvshare's FCFS.
  The head of the queue is admitted when it fits; a throttled session is
  passed over (it waits for its next window) without blocking the others.
- Modes: ``serial`` admits one holder; ``concurrent`` admits while the memory
  of the holders (max of declared estimate and reported use; unknown memory
  counts as the whole GPU) fits in total x (1 - reserve %); ``auto`` is
  concurrent and, when reported memory of the holders overflows, drops
  sessions (reason memory) until it fits. The first holder on an idle GPU is
  always admitted.
- Time quantum: a holder that has held the lock for TQ since its grant while a
  waiter cannot be admitted beside it gets one DROP_LOCK (reason tq) per grant.
- Compute limits (``quota.py``): a running session whose budget is used up
  gets DROP_LOCK (reason quota) and is throttled until the next window.
- Priority: a waiter that cannot be admitted drops running sessions of lower
  priority (reason preempt), lowest first, as many as it needs to fit.
- A holder that has not released within ``drop_timeout`` of a DROP_LOCK is
  revoked: it leaves the running set, is told, and is counted.
- Scheduler off (SCHED_OFF): every request is granted at once, the queue is
  emptied, nothing is dropped or throttled; accounting still runs.
- Detaching (a closed connection) frees the lock and the queue place at once.
- Ceilings: a limit set with authority (an admin, or a fractional allocation at
  attach) is also the session's ceiling; the session may lower its own limits and
  raise them back up to the ceiling, never above, and may not lift a memory
  ceiling. An admin's new limit is the new ceiling.
- At most ``max_queue`` lock requests wait per GPU (leases have their own
  ``queue_limit``); one more is refused.
- Leases (GpuArbiter) share the queue, the modes and memory admission; they
  are never dropped (no TQ, no quota, no preemption, no memory drops). One
  that cannot have the GPU at once is refused on arrival when its max_wait is
  0 (GPU_BUSY) or queue_limit waiters are already queued (QUEUE_FULL), and
  removed at max_wait (TIMEOUT). A lease held past hold_max is reported once
  (the watchdog) and, if configured, released by force.
- Parking (``gpuctl run``): a parkable session's program keeps its GPU memory
  while it does not hold the lock (it is paused, not gone), so that memory is
  resident beside the holders; it counts from attach until the program parks it.
  Before a waiter is granted, the resident memory of parkable sessions that do
  not hold must fit beside it and the holders; if not, the scheduler asks
  them to park (PARK), lowest priority and oldest grant first, as many as it
  needs, and the grant waits for their PARKED. A park that is refused or not
  answered within ``park_timeout`` leaves that memory counted and is not asked
  again until the session has held the lock once more; when nothing more can
  be asked, the waiter is granted as a GPU without gpud would (the driver may
  refuse its allocations). A grant makes the session's memory resident again.
  Off (SCHED_OFF), nothing is asked.
- Restart grace (``grants_from``): before that time nothing is granted, lock
  or lease; requests queue as usual (a lease that may not wait is refused as
  busy) and are served in order when it ends. gpud sets it after a start that
  follows a crash, so that a process that held the lock when the daemon died
  learns it (its connection closed) before anyone else is granted.

Every call takes ``now`` (integer microseconds) and returns effects for the
shell to carry out; ``next_deadline()`` says when to call ``advance``. A refused
call raises ``Refused`` and leaves the state exactly as it was. This module
never reads a clock, sleeps, logs, or touches a socket.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field, replace

from gpud.core.errors import Inconsistent, LimitReached, Refused
from gpud.core.quota import ComputeAccounts, QuotaConfig
from gpud.core.snapshots import HolderView, SchedulerView, SessionState, SessionView, WaiterView
from gpud_client.protocol import DropReason, ErrorCode, LeaseReason, Mode, RevokeReason

__all__ = [
    "AskPark",
    "Drop",
    "Effect",
    "GpuScheduler",
    "Grant",
    "HoldOverdue",
    "LeaseDenied",
    "MemOverLimit",
    "ParkOverdue",
    "Revoke",
    "SchedulerConfig",
]


@dataclass(frozen=True, slots=True)
class Grant:
    session: int
    grant: int
    waited_us: int = field(default=0, compare=False)  # for metrics; not part of the decision


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


@dataclass(frozen=True, slots=True)
class MemOverLimit:
    session: int
    used_bytes: int
    limit_bytes: int


@dataclass(frozen=True, slots=True)
class LeaseDenied:
    """The lease did not get the GPU and is gone."""

    session: int
    reason: LeaseReason


@dataclass(frozen=True, slots=True)
class HoldOverdue:
    """Watchdog: a lease has been held past its hold_max (reported once)."""

    session: int
    held_us: int
    forced: bool  # released by force (lease_force_release)


@dataclass(frozen=True, slots=True)
class AskPark:
    """Ask a parkable session's program to move its GPU memory to host memory (PARK)."""

    session: int
    grant: int  # its last grant (0: none yet), for the logs


@dataclass(frozen=True, slots=True)
class ParkOverdue:
    """A park was not answered within ``park_timeout``: its memory stays counted."""

    session: int


Effect = Grant | Drop | Revoke | MemOverLimit | LeaseDenied | HoldOverdue | AskPark | ParkOverdue


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    tq_us: int = 30_000_000
    drop_timeout_us: int = 10_000_000
    mode: Mode = Mode.AUTO
    memory_total_bytes: int = 80 * 2**30
    memory_reserve_percent: int = 10
    quota: QuotaConfig = QuotaConfig()
    lease_force_release: bool = False
    max_queue: int = 1024  # waiting lock requests per GPU
    park_timeout_us: int = 120_000_000  # a PARK unanswered this long counts as refused


@dataclass(slots=True)
class _Session:
    id: int
    priority: int
    mem_estimate: int | None = None
    mem_used: int | None = None
    mem_limit: int | None = None
    core_ceiling: int = 100
    mem_ceiling: int | None = None
    mem_over: bool = False
    lease: bool = False
    wait_deadline: int | None = None  # a waiting lease's max_wait
    queue_key: tuple[int, int, int] | None = None  # its entry in the queue while waiting
    hold_max_us: int | None = None  # a lease's watchdog
    overdue: bool = False
    state: SessionState = "idle"
    requested_at: int = 0
    grant: int = 0
    granted_at: int = 0
    drop_reason: DropReason | None = None
    drop_sent_at: int = 0
    tq_dropped: bool = False
    grants: int = 0
    hold_us: int = 0
    wait_us: int = 0
    drops: Counter[str] = field(default_factory=Counter)
    revocations: int = 0
    mem_violations: int = 0
    last_hold_us: int = 0
    last_drop_to_release_us: int | None = None
    parkable: bool = False
    resident: bool = False  # a parkable session's memory is on the GPU while it does not hold
    park_asked_at: int | None = None
    park_refused: bool = False  # refused (or timed out) since its last grant: not asked again
    parks: int = 0


class GpuScheduler:
    """The scheduler of one GPU. See the module comment for the rules."""

    def __init__(
        self,
        config: SchedulerConfig = SchedulerConfig(),
        *,
        enabled: bool = True,
        now: int = 0,
        grants_from: int | None = None,
    ) -> None:
        self._cfg = config
        self._enabled = enabled
        self._grants_from = grants_from  # no grant before this time (the restart grace), then None
        self._acc = ComputeAccounts(config.quota, now)
        self._sessions: dict[int, _Session] = {}
        self._parkable: dict[int, _Session] = {}  # few: the rules that walk them cost nothing otherwise
        self._running: dict[int, _Session] = {}  # insertion order = grant order
        self._queue: list[tuple[int, int, int]] = []  # (-priority, seq, session)
        # (wait deadline, seq, session) of waiting leases; an entry whose seq is no longer the
        # session's queue entry is stale and skipped: expiry and the next deadline cost O(log n)
        self._waits: list[tuple[int, int, int]] = []
        self._seq = itertools.count()
        self._grant_seq = itertools.count(1)
        self._grants = 0
        self._drops: Counter[str] = Counter()
        self._revocations = 0

    # --- calls ------------------------------------------------------------

    def attach(
        self,
        session: int,
        now: int,
        *,
        priority: int = 0,
        core_limit: int = 100,
        mem_estimate: int | None = None,
        mem_limit: int | None = None,
        core_ceiling: int = 100,
        mem_ceiling: int | None = None,
        parkable: bool = False,
    ) -> list[Effect]:
        """Attach a session; the ceilings bound what it may later set itself. A parkable session's
        memory counts as resident until its first PARKED (after a daemon restart, its program may
        be paused with its memory on the GPU)."""
        if session in self._sessions:
            raise Refused(ErrorCode.INVALID, f"session {session} is already attached")
        _check_limit(core_limit)
        _check_limit(core_ceiling)
        core_limit = min(core_limit, core_ceiling)
        if mem_ceiling is not None:
            mem_limit = mem_ceiling if mem_limit is None else min(mem_limit, mem_ceiling)
        self._sessions[session] = _Session(
            session,
            priority,
            mem_estimate=mem_estimate,
            mem_limit=mem_limit,
            core_ceiling=core_ceiling,
            mem_ceiling=mem_ceiling,
            parkable=parkable,
            resident=parkable,
        )
        if parkable:
            self._parkable[session] = self._sessions[session]
        self._acc.add(session, core_limit, now)
        return self._settle(now)

    def detach(self, session: int, now: int) -> list[Effect]:
        self._forget(self._get(session), now)
        return self._settle(now)

    def request(self, session: int, now: int) -> list[Effect]:
        s = self._get_session(session)
        if s.state != "idle":
            raise Refused(ErrorCode.ALREADY_REQUESTED, f"session {session} is already {s.state}")
        if len(self._queue) >= self._cfg.max_queue:
            raise LimitReached(
                "max_lock_queue", f"{len(self._queue)} requests already wait for this GPU, the most allowed"
            )
        s.state = "waiting"
        s.requested_at = now
        self._enqueue(s, s.priority)
        return self._settle(now)

    def release(self, session: int, now: int, *, grant: int | None = None) -> list[Effect]:
        s = self._get_session(session)
        if s.state != "holding":
            raise Refused(ErrorCode.NOT_HOLDER, f"session {session} does not hold the lock (it is {s.state})")
        if grant is not None and grant != s.grant:
            raise Refused(ErrorCode.STALE_GRANT, f"session {session} holds grant {s.grant}, not grant {grant}")
        self._end_hold(s, now)
        return self._settle(now)

    def acquire_lease(
        self,
        lease: int,
        now: int,
        *,
        priority: int,
        max_wait_us: int,
        hold_max_us: int,
        queue_limit: int,
        mem_estimate: int | None = None,
    ) -> list[Effect]:
        """One acquire: granted now, queued until max_wait, or denied now."""
        if lease in self._sessions:
            raise Refused(ErrorCode.INVALID, f"lease {lease} already exists")
        s = _Session(lease, priority, mem_estimate=mem_estimate, lease=True, hold_max_us=hold_max_us)
        effects = self._settle(now)  # busy or free is judged on the state at ``now``
        if not self._admissible_now(s):
            if max_wait_us == 0:
                return [*effects, LeaseDenied(lease, LeaseReason.GPU_BUSY)]
            if len(self._queue) >= queue_limit:
                return [*effects, LeaseDenied(lease, LeaseReason.QUEUE_FULL)]
        self._sessions[lease] = s
        self._acc.add(lease, 100, now)  # billed like any holder, no limit of its own
        s.state, s.requested_at, s.wait_deadline = "waiting", now, now + max_wait_us
        self._enqueue(s, priority)
        return effects + self._settle(now)

    def release_lease(self, lease: int, now: int) -> list[Effect]:
        """Give a lease back (or withdraw a waiting one); it is gone after."""
        s = self._get(lease)
        if not s.lease:
            raise Refused(ErrorCode.INVALID, f"{lease} is a session, not a lease")
        return self.detach(lease, now)

    def set_limits(
        self,
        session: int,
        now: int,
        *,
        core_limit: int | None = None,
        mem_limit: int | None = None,
        authority: bool = False,
    ) -> list[Effect]:
        """Change limits at run time; the window's use is kept. With ``authority``
        (an admin) the new limits are also the new ceilings; without, they must
        stay under the ceilings. A mem_limit of 0 lifts the limit."""
        s = self._get_session(session)
        if core_limit is not None:
            _check_limit(core_limit)
        if not authority:
            self.check_limits(session, core_limit=core_limit, mem_limit=mem_limit)
        if core_limit is not None:
            self._acc.set_limit(session, core_limit, now)
            if authority:
                s.core_ceiling = core_limit
        effects: list[Effect] = []
        if mem_limit is not None:
            s.mem_limit = mem_limit or None  # 0 lifts the limit
            if authority:
                s.mem_ceiling = s.mem_limit
            s.mem_over = False  # a new limit is reported afresh
            self._check_memory_limit(s, effects)
        return effects + self._settle(now)

    def check_limits(self, session: int, *, core_limit: int | None = None, mem_limit: int | None = None) -> None:
        """Refuse limits the session may not set itself (above its ceilings); changes nothing."""
        s = self._get_session(session)
        if core_limit is not None and core_limit > s.core_ceiling:
            raise Refused(
                ErrorCode.PERMISSION_DENIED,
                f"core limit {core_limit} % is above session {s.id}'s ceiling of {s.core_ceiling} % "
                "(set by an admin or its fractional allocation)",
            )
        if mem_limit is not None and s.mem_ceiling is not None and (mem_limit == 0 or mem_limit > s.mem_ceiling):
            asked = "lifting the memory limit" if mem_limit == 0 else f"memory limit {mem_limit} bytes"
            raise Refused(
                ErrorCode.PERMISSION_DENIED,
                f"{asked} is above session {s.id}'s ceiling of {s.mem_ceiling} bytes "
                "(set by an admin or its fractional allocation)",
            )

    def report_memory(self, session: int, used_bytes: int, now: int) -> list[Effect]:
        s = self._get(session)
        s.mem_used = used_bytes
        effects: list[Effect] = []
        self._check_memory_limit(s, effects)
        return effects + self._settle(now)

    def parked(self, session: int, ok: bool, now: int) -> list[Effect]:
        """A parkable session's answer to PARK: its memory left the GPU (``ok``), or could not."""
        s = self._get_session(session)
        if not s.parkable:
            raise Refused(ErrorCode.INVALID, f"session {session} was not attached as parkable")
        s.park_asked_at = None
        if s.state != "holding":  # a grant since the ask made its memory resident again
            if ok:
                s.resident = False
                s.parks += 1
            else:
                s.park_refused = True
        return self._settle(now)

    def set_tq(self, tq_us: int, now: int) -> list[Effect]:
        if tq_us <= 0:
            raise Refused(ErrorCode.INVALID, f"time quantum must be positive, got {tq_us} us")
        self._cfg = replace(self._cfg, tq_us=tq_us)
        return self._settle(now)

    def reconfigure(self, config: SchedulerConfig, now: int) -> list[Effect]:
        """A reloaded configuration; accounts keep their use, holders keep the lock."""
        self._acc.reconfigure(config.quota, now)
        self._cfg = replace(config, memory_total_bytes=self._cfg.memory_total_bytes)
        return self._settle(now)

    def set_mode(self, mode: Mode, now: int) -> list[Effect]:
        self._cfg = replace(self._cfg, mode=Mode(mode))
        return self._settle(now)

    def set_enabled(self, enabled: bool, now: int) -> list[Effect]:
        self._enabled = enabled
        if not enabled:
            for s in self._running.values():  # nothing is dropped while off
                s.tq_dropped = False  # a cancelled TQ drop: the quantum counts again once on
                if s.drop_reason is not None:
                    s.drop_reason = None
                    self._acc.start(s.id, now)
        return self._settle(now)

    def advance(self, now: int) -> list[Effect]:
        """Carry out whatever is due at ``now`` (timer expiry)."""
        return self._settle(now)

    def next_deadline(self) -> int | None:
        """When ``advance`` next has something to do, or None."""
        times: list[int] = []
        if self._enabled:
            blocked = bool(self._queue) and self._blocked_waiter() is not None
            for s in self._running.values():
                if s.lease:
                    if not s.overdue and s.hold_max_us is not None:
                        times.append(s.granted_at + s.hold_max_us)
                elif s.drop_reason is not None:
                    times.append(s.drop_sent_at + self._cfg.drop_timeout_us)
                elif blocked and not s.tq_dropped:
                    times.append(s.granted_at + self._cfg.tq_us)
        if self._waits and (first_wait := self._first_wait()) is not None:  # off, a lease still waits (restart grace)
            times.append(first_wait[0])
        if self._grants_from is not None and self._queue:
            times.append(self._grants_from)
        for s in self._parkable.values():
            if s.park_asked_at is not None:
                times.append(s.park_asked_at + self._cfg.park_timeout_us)
        quota = self._acc.next_deadline()
        if quota is not None:
            times.append(quota)
        return min(times, default=None)

    # --- reading ------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def config(self) -> SchedulerConfig:
        return self._cfg

    @property
    def accounts(self) -> ComputeAccounts:
        return self._acc

    def holders(self) -> list[int]:
        return list(self._running)

    def queue(self) -> list[int]:
        return [sid for _, _, sid in self._queue]

    def last_hold(self, session: int) -> tuple[int, int | None]:
        """The session's last hold, in us: its length, and DROP_LOCK to release (None: no drop)."""
        s = self._get(session)
        return s.last_hold_us, s.last_drop_to_release_us

    def session(self, session: int, now: int) -> SessionView:
        """As of the last call; ``advance(now)`` first for figures up to now."""
        s = self._get(session)
        a = self._acc.account(session)
        budget = self._acc.budget_ns(session)
        return SessionView(
            session=s.id,
            state=s.state,
            priority=s.priority,
            grant=s.grant,
            grants=s.grants,
            hold_us=s.hold_us + (now - s.granted_at if s.state == "holding" else 0),
            wait_us=s.wait_us + (now - s.requested_at if s.state == "waiting" else 0),
            drops=dict(s.drops),
            revocations=s.revocations,
            core_limit=a.limit,
            budget_us=None if budget is None else budget // 1000,
            used_us=a.used_ns // 1000,
            recent_share_percent=self._acc.recent_share(session),
            throttled=self._throttled(session),
            throttles=a.throttles,
            mem_estimate=s.mem_estimate,
            mem_used=s.mem_used,
            mem_limit=s.mem_limit,
            core_ceiling=s.core_ceiling,
            mem_ceiling=s.mem_ceiling,
            mem_violations=s.mem_violations,
            last_hold_us=s.last_hold_us,
            last_drop_to_release_us=s.last_drop_to_release_us,
            parkable=s.parkable,
            parked=s.parkable and not s.resident and s.state != "holding",
            parks=s.parks,
        )

    def parked_bytes(self) -> int:
        """GPU memory of the parked sessions' programs (what they last reported), now in host memory."""
        return sum(
            s.mem_used or s.mem_estimate or 0
            for s in self._parkable.values()
            if not s.resident and s.state != "holding"
        )

    def view(self, now: int) -> SchedulerView:
        """As of the last call; ``advance(now)`` first for figures up to now."""
        return SchedulerView(
            enabled=self._enabled,
            mode=self._cfg.mode,
            tq_us=self._cfg.tq_us,
            drop_timeout_us=self._cfg.drop_timeout_us,
            window_us=self._acc.cfg.window_us,
            memory_capacity_bytes=self._capacity(),
            memory_in_use_bytes=sum(self._need(s) for s in self._running.values()),
            holders=tuple(HolderView(s.id, s.grant, now - s.granted_at, s.drop_reason) for s in self._running.values()),
            queue=tuple(
                WaiterView(sid, -negp, now - self._sessions[sid].requested_at, self._throttled(sid))
                for negp, _, sid in self._queue
            ),
            sessions=len(self._sessions),
            grants=self._grants,
            drops=dict(self._drops),
            revocations=self._revocations,
        )

    def check(self) -> None:
        """Raise ``Inconsistent`` if the scheduler's own records disagree (after a fault)."""
        queued = [sid for _, _, sid in self._queue]
        problems = []
        if len(queued) != len(set(queued)):
            problems.append("a session is queued twice")
        for sid in queued:
            if self._sessions.get(sid) is None or self._sessions[sid].state != "waiting":
                problems.append(f"queued session {sid} is not a waiting session")
        for sid, s in self._running.items():
            if self._sessions.get(sid) is not s or s.state != "holding":
                problems.append(f"running session {sid} is not a holding session")
        for sid, s in self._sessions.items():
            if (s.state == "holding") != (sid in self._running) or (s.state == "waiting") != (sid in set(queued)):
                problems.append(f"session {sid} is {s.state} but not where that state belongs")
            if not self._acc.has(sid):
                problems.append(f"session {sid} has no compute account")
            if s.parkable != (self._parkable.get(sid) is s):
                problems.append(f"session {sid}'s parkable flag disagrees with the parkable set")
        if problems:
            raise Inconsistent("; ".join(problems[:5]))

    # --- rules ------------------------------------------------------------

    def _get(self, session: int) -> _Session:
        try:
            return self._sessions[session]
        except KeyError:
            raise Refused(ErrorCode.UNKNOWN_SESSION, f"no session {session} on this GPU") from None

    def _get_session(self, session: int) -> _Session:
        s = self._get(session)
        if s.lease:
            raise Refused(ErrorCode.INVALID, f"{session} is a lease: it has no lock requests or limits of its own")
        return s

    def _capacity(self) -> int:
        return self._cfg.memory_total_bytes * (100 - self._cfg.memory_reserve_percent) // 100

    def _need(self, s: _Session) -> int:
        if s.mem_estimate is None and s.mem_used is None:
            return self._cfg.memory_total_bytes  # unknown: it may need all of it
        return max(s.mem_estimate or 0, s.mem_used or 0)

    def _throttled(self, sid: int) -> bool:
        if not self._acc.is_limited(sid):
            return False  # no budget, never throttled (every lease, most sessions)
        return self._acc.account(sid).throttled or self._acc.over_budget(sid)

    def _end_hold(self, s: _Session, now: int) -> None:
        del self._running[s.id]
        self._acc.stop(s.id, now)
        s.hold_us += now - s.granted_at
        s.last_hold_us = now - s.granted_at
        s.last_drop_to_release_us = None if s.drop_reason is None else now - s.drop_sent_at
        s.state = "idle"
        s.drop_reason = None

    def _drop(self, s: _Session, reason: DropReason, now: int, effects: list[Effect]) -> None:
        s.drop_reason = reason
        s.drop_sent_at = now
        s.drops[reason] += 1
        self._drops[reason] += 1
        self._acc.begin_tail(s.id, now)
        effects.append(Drop(s.id, s.grant, reason))

    def _check_memory_limit(self, s: _Session, effects: list[Effect]) -> None:
        over = s.mem_limit is not None and s.mem_used is not None and s.mem_used > s.mem_limit
        if over and not s.mem_over and s.mem_limit is not None and s.mem_used is not None:
            s.mem_violations += 1
            effects.append(MemOverLimit(s.id, s.mem_used, s.mem_limit))
        s.mem_over = over

    def _settle(self, now: int) -> list[Effect]:
        """Apply every rule that is due at ``now``, in order. A rule is skipped only when the set
        it walks is empty (it would find nothing): this runs on every request."""
        effects: list[Effect] = []
        if self._grants_from is not None and now >= self._grants_from:
            self._grants_from = None  # the restart grace is over
        self._acc.settle(now)
        if self._parkable:
            self._park_overdue(now, effects)
        if self._running:
            self._revoke_unresponsive(now, effects)
            if self._enabled:
                self._watch_leases(now, effects)
                if self._acc.has_limits:
                    self._drop_exhausted(now, effects)
                self._drop_memory_overflow(now, effects)
        if self._queue:
            self._admit(now, effects)
        if self._waits and self._expire_waits(now, effects):
            self._admit(now, effects)  # a waiter that left may have blocked the others
        if self._queue:
            self._drop_expired(now, effects)
        return effects

    def _watch_leases(self, now: int, effects: list[Effect]) -> None:
        for s in list(self._running.values()):
            if s.lease and not s.overdue and s.hold_max_us is not None and now >= s.granted_at + s.hold_max_us:
                s.overdue = True
                forced = self._cfg.lease_force_release
                effects.append(HoldOverdue(s.id, now - s.granted_at, forced))
                if forced:
                    effects.append(Revoke(s.id, s.grant, RevokeReason.HOLD_MAX))
                    self._forget(s, now)

    def _expire_waits(self, now: int, effects: list[Effect]) -> bool:
        expired = False
        while (first := self._first_wait()) is not None and now >= first[0]:
            s = self._sessions[first[2]]
            effects.append(LeaseDenied(s.id, LeaseReason.TIMEOUT))
            self._forget(s, now)
            expired = True
        return expired

    def _enqueue(self, s: _Session, priority: int) -> None:
        s.queue_key = key = (-priority, next(self._seq), s.id)
        bisect.insort(self._queue, key)
        if s.wait_deadline is not None:
            heapq.heappush(self._waits, (s.wait_deadline, key[1], s.id))
            if len(self._waits) > 2 * len(self._queue) + 64:  # granted leases' entries: rebuilt, amortized O(1)
                self._waits = [w for w in self._waits if self._waiting_entry(w)]
                heapq.heapify(self._waits)

    def _dequeue(self, s: _Session) -> None:
        key, s.queue_key = s.queue_key, None
        assert key is not None, "a waiting session is queued under its key"
        i = bisect.bisect_left(self._queue, key)
        if i < len(self._queue) and self._queue[i] == key:  # else check() reports the queue inconsistent
            del self._queue[i]

    def _first_wait(self) -> tuple[int, int, int] | None:
        """The earliest wait deadline of a lease still waiting; stale entries are dropped on the way."""
        waits = self._waits
        while waits:
            if self._waiting_entry(waits[0]):
                return waits[0]
            heapq.heappop(waits)
        return None

    def _waiting_entry(self, entry: tuple[int, int, int]) -> bool:
        s = self._sessions.get(entry[2])
        return s is not None and s.state == "waiting" and s.queue_key is not None and s.queue_key[1] == entry[1]

    def _forget(self, s: _Session, now: int) -> None:
        """Out of the running set or the queue, and out of the accounts."""
        if s.state == "holding":
            self._end_hold(s, now)
        elif s.state == "waiting":
            self._dequeue(s)
        del self._sessions[s.id]
        self._parkable.pop(s.id, None)
        self._acc.remove(s.id, now)

    def _admissible_now(self, s: _Session) -> bool:
        """Would ``s`` be granted at once if it joined the queue now?"""
        if self._grants_from is not None:
            return False
        ahead = self._blocked_waiter()
        fits = (ahead is None or ahead.priority < s.priority) and self._fits(s)
        return fits and (not self._enabled or self._room_beside_parkable(s, 0, None))

    def _revoke_unresponsive(self, now: int, effects: list[Effect]) -> None:
        for s in list(self._running.values()):
            if s.drop_reason is not None and now >= s.drop_sent_at + self._cfg.drop_timeout_us:
                effects.append(Revoke(s.id, s.grant, RevokeReason.DROP_TIMEOUT))
                s.revocations += 1
                self._revocations += 1
                self._end_hold(s, now)

    def _drop_exhausted(self, now: int, effects: list[Effect]) -> None:
        for sid in self._acc.exhausted():
            self._acc.throttle(sid)
            s = self._running[sid]
            if s.drop_reason is None:
                self._drop(s, DropReason.QUOTA, now, effects)

    def _drop_memory_overflow(self, now: int, effects: list[Effect]) -> None:
        if self._cfg.mode != Mode.AUTO or len(self._running) < 2:
            return
        staying = [s for s in self._running.values() if s.drop_reason is None]
        overflow = sum(self._need(s) for s in staying) - self._capacity()
        for s in sorted((s for s in staying if not s.lease), key=lambda s: (s.priority, -s.grant)):
            if overflow <= 0 or len(staying) <= 1:
                return
            self._drop(s, DropReason.MEMORY, now, effects)
            staying.remove(s)
            overflow -= self._need(s)

    def _blocked_waiter(self) -> _Session | None:
        """The first waiter that is not throttled (after ``_admit``: it does not fit)."""
        for _, _, sid in self._queue:
            if not self._throttled(sid):
                return self._sessions[sid]
        return None

    def _fits(self, s: _Session) -> bool:
        return not self._enabled or self._fits_beside(s, list(self._running.values()))

    def _admit(self, now: int, effects: list[Effect]) -> None:
        if self._grants_from is not None:
            return  # the restart grace: requests wait
        while (s := self._next_admissible()) is not None:
            if not self._fits(s):
                self._preempt_for(s, now, effects)
                return
            if self._enabled and not self._room_beside_parkable(s, now, effects):
                return  # parks asked: the grant waits for their PARKED
            self._dequeue(s)
            s.state = "holding"
            s.grant = next(self._grant_seq)
            s.granted_at = now
            s.tq_dropped = False
            s.drop_reason = None
            s.resident, s.park_asked_at, s.park_refused = s.parkable, None, False
            s.grants += 1
            s.wait_us += now - s.requested_at
            self._grants += 1
            self._running[s.id] = s
            self._acc.start(s.id, now)
            effects.append(Grant(s.id, s.grant, now - s.requested_at))

    def _next_admissible(self) -> _Session | None:
        if not self._enabled:
            return self._sessions[self._queue[0][2]] if self._queue else None
        return self._blocked_waiter()

    def _preempt_for(self, waiter: _Session, now: int, effects: list[Effect]) -> None:
        """Drop lower-priority holders, lowest first, if that lets ``waiter`` in."""
        staying = [s for s in self._running.values() if s.drop_reason is None]
        victims = sorted(
            (s for s in staying if s.priority < waiter.priority and not s.lease),
            key=lambda s: (s.priority, -s.grant),
        )
        if not victims or self._fits_beside(waiter, staying):
            return  # nobody may be dropped for it, or enough is already on its way out
        chosen: list[_Session] = []
        for v in victims:
            chosen.append(v)
            if self._fits_beside(waiter, [s for s in staying if s not in chosen]):
                for c in chosen:
                    self._drop(c, DropReason.PREEMPT, now, effects)
                return

    def _room_beside_parkable(self, waiter: _Session, now: int, effects: list[Effect] | None) -> bool:
        """Whether ``waiter`` may be granted beside the memory parkable sessions keep on the GPU;
        if not, ask enough of them to park (``effects`` None: only look). False while a park it
        needs is still out. A lease whose wait ends now asks nothing: it is gone in this settle."""
        resident = [r for r in self._resident if r is not waiter]
        if not resident:
            return True
        if effects is not None and waiter.wait_deadline is not None and now >= waiter.wait_deadline:
            effects = None
        held = sum(self._need(h) for h in self._running.values())
        over = self._need(waiter) + held + sum(self._need(r) for r in resident) - self._capacity()
        out = False
        for r in sorted(resident, key=lambda r: (r.priority, r.grant)):
            if over <= 0:
                break
            if r.park_refused:
                continue
            if r.park_asked_at is None and effects is not None:
                r.park_asked_at = now
                effects.append(AskPark(r.id, r.grant))
            out = True
            over -= self._need(r)
        return not out

    @property
    def _resident(self) -> list[_Session]:
        """Parkable sessions whose memory is on the GPU while they do not hold."""
        return [s for s in self._parkable.values() if s.resident and s.state != "holding"]

    def _park_overdue(self, now: int, effects: list[Effect]) -> None:
        for s in self._parkable.values():
            if s.park_asked_at is not None and now >= s.park_asked_at + self._cfg.park_timeout_us:
                s.park_asked_at, s.park_refused = None, True
                effects.append(ParkOverdue(s.id))

    def _fits_beside(self, waiter: _Session, holders: list[_Session]) -> bool:
        if not holders:
            return True
        if self._cfg.mode == Mode.SERIAL:
            return False
        return sum(self._need(s) for s in holders) + self._need(waiter) <= self._capacity()

    def _drop_expired(self, now: int, effects: list[Effect]) -> None:
        if not self._enabled or self._blocked_waiter() is None:
            return
        for s in self._running.values():
            if not s.lease and s.drop_reason is None and not s.tq_dropped and now >= s.granted_at + self._cfg.tq_us:
                s.tq_dropped = True
                self._drop(s, DropReason.TQ, now, effects)


def _check_limit(core_limit: int) -> None:
    if not 1 <= core_limit <= 100:
        raise Refused(ErrorCode.INVALID, f"core limit must be 1..100 percent, got {core_limit}")
