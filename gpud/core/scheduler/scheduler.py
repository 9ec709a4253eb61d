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
call raises ``Refused`` and leaves the state exactly as it was. This package
never reads a clock, sleeps, logs, or touches a socket.

``GpuScheduler`` (here) is the calls; the state is one ``SchedState`` (``model``),
and the rules are functions over it: ``admission`` (who holds: admitting, the
drops, revocation, the restart grace), ``queue`` (the order, waits, leaving),
``parking``, ``views`` (what it shows, its self-check).
"""

from __future__ import annotations

from dataclasses import replace

from gpud.core.errors import LimitReached, Refused
from gpud.core.quota import ComputeAccounts
from gpud.core.scheduler.admission import admissible_now, blocked_waiter, check_memory_limit, settle
from gpud.core.scheduler.model import (
    DEFAULT_CONFIG,
    Effect,
    LeaseDenied,
    SchedState,
    SchedulerConfig,
    Session,
    check_limit,
)
from gpud.core.scheduler.parking import parked_bytes
from gpud.core.scheduler.queue import end_hold, enqueue, first_wait, forget
from gpud.core.scheduler.views import check as check_records
from gpud.core.scheduler.views import scheduler_view, session_view
from gpud.core.snapshots import SchedulerView, SessionView
from gpud_client.protocol import ErrorCode, LeaseReason, Mode


class GpuScheduler:
    """The scheduler of one GPU. See the module comment for the rules."""

    def __init__(
        self,
        config: SchedulerConfig = DEFAULT_CONFIG,
        *,
        enabled: bool = True,
        now: int = 0,
        grants_from: int | None = None,
    ) -> None:
        self.st = SchedState(config, ComputeAccounts(config.quota, now), enabled, grants_from)

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
        if session in self.st.sessions:
            raise Refused(ErrorCode.INVALID, f"session {session} is already attached")
        check_limit(core_limit)
        check_limit(core_ceiling)
        core_limit = min(core_limit, core_ceiling)
        if mem_ceiling is not None:
            mem_limit = mem_ceiling if mem_limit is None else min(mem_limit, mem_ceiling)
        self.st.sessions[session] = Session(
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
            self.st.parkable[session] = self.st.sessions[session]
        self.st.acc.add(session, core_limit, now)
        return settle(self.st, now)

    def detach(self, session: int, now: int) -> list[Effect]:
        forget(self.st, self.st.get(session), now)
        return settle(self.st, now)

    def request(self, session: int, now: int) -> list[Effect]:
        s = self.st.get_session(session)
        if s.state != "idle":
            raise Refused(ErrorCode.ALREADY_REQUESTED, f"session {session} is already {s.state}")
        if len(self.st.queue) >= self.st.cfg.max_queue:
            raise LimitReached(
                "max_lock_queue", f"{len(self.st.queue)} requests already wait for this GPU, the most allowed"
            )
        s.state = "waiting"
        s.requested_at = now
        enqueue(self.st, s, s.priority)
        return settle(self.st, now)

    def release(self, session: int, now: int, *, grant: int | None = None) -> list[Effect]:
        s = self.st.get_session(session)
        if s.state != "holding":
            raise Refused(ErrorCode.NOT_HOLDER, f"session {session} does not hold the lock (it is {s.state})")
        if grant is not None and grant != s.grant:
            raise Refused(ErrorCode.STALE_GRANT, f"session {session} holds grant {s.grant}, not grant {grant}")
        end_hold(self.st, s, now)
        return settle(self.st, now)

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
        if lease in self.st.sessions:
            raise Refused(ErrorCode.INVALID, f"lease {lease} already exists")
        s = Session(lease, priority, mem_estimate=mem_estimate, lease=True, hold_max_us=hold_max_us)
        effects = settle(self.st, now)  # busy or free is judged on the state at ``now``
        if not admissible_now(self.st, s):
            if max_wait_us == 0:
                return [*effects, LeaseDenied(lease, LeaseReason.GPU_BUSY)]
            if len(self.st.queue) >= queue_limit:
                return [*effects, LeaseDenied(lease, LeaseReason.QUEUE_FULL)]
        self.st.sessions[lease] = s
        self.st.acc.add(lease, 100, now)  # billed like any holder, no limit of its own
        s.state, s.requested_at, s.wait_deadline = "waiting", now, now + max_wait_us
        enqueue(self.st, s, priority)
        return effects + settle(self.st, now)

    def release_lease(self, lease: int, now: int) -> list[Effect]:
        """Give a lease back (or withdraw a waiting one); it is gone after."""
        s = self.st.get(lease)
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
        s = self.st.get_session(session)
        if core_limit is not None:
            check_limit(core_limit)
        if not authority:
            self.check_limits(session, core_limit=core_limit, mem_limit=mem_limit)
        if core_limit is not None:
            self.st.acc.set_limit(session, core_limit, now)
            if authority:
                s.core_ceiling = core_limit
        effects: list[Effect] = []
        if mem_limit is not None:
            s.mem_limit = mem_limit or None  # 0 lifts the limit
            if authority:
                s.mem_ceiling = s.mem_limit
            s.mem_over = False  # a new limit is reported afresh
            check_memory_limit(s, effects)
        return effects + settle(self.st, now)

    def check_limits(self, session: int, *, core_limit: int | None = None, mem_limit: int | None = None) -> None:
        """Refuse limits the session may not set itself (above its ceilings); changes nothing."""
        s = self.st.get_session(session)
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
        s = self.st.get(session)
        s.mem_used = used_bytes
        effects: list[Effect] = []
        check_memory_limit(s, effects)
        return effects + settle(self.st, now)

    def parked(self, session: int, ok: bool, now: int) -> list[Effect]:
        """A parkable session's answer to PARK: its memory left the GPU (``ok``), or could not."""
        s = self.st.get_session(session)
        if not s.parkable:
            raise Refused(ErrorCode.INVALID, f"session {session} was not attached as parkable")
        s.park_asked_at = None
        if s.state != "holding":  # a grant since the ask made its memory resident again
            if ok:
                s.resident = False
                s.parks += 1
            else:
                s.park_refused = True
        return settle(self.st, now)

    def set_tq(self, tq_us: int, now: int) -> list[Effect]:
        if tq_us <= 0:
            raise Refused(ErrorCode.INVALID, f"time quantum must be positive, got {tq_us} us")
        self.st.cfg = replace(self.st.cfg, tq_us=tq_us)
        return settle(self.st, now)

    def reconfigure(self, config: SchedulerConfig, now: int) -> list[Effect]:
        """A reloaded configuration; accounts keep their use, holders keep the lock."""
        self.st.acc.reconfigure(config.quota, now)
        self.st.cfg = replace(config, memory_total_bytes=self.st.cfg.memory_total_bytes)
        return settle(self.st, now)

    def set_mode(self, mode: Mode, now: int) -> list[Effect]:
        self.st.cfg = replace(self.st.cfg, mode=Mode(mode))
        return settle(self.st, now)

    def set_enabled(self, enabled: bool, now: int) -> list[Effect]:
        self.st.enabled = enabled
        if not enabled:
            for s in self.st.running.values():  # nothing is dropped while off
                s.tq_dropped = False  # a cancelled TQ drop: the quantum counts again once on
                if s.drop_reason is not None:
                    s.drop_reason = None
                    self.st.acc.start(s.id, now)
        return settle(self.st, now)

    def advance(self, now: int) -> list[Effect]:
        """Carry out whatever is due at ``now`` (timer expiry)."""
        return settle(self.st, now)

    def next_deadline(self) -> int | None:
        """When ``advance`` next has something to do, or None."""
        times: list[int] = []
        if self.st.enabled:
            blocked = bool(self.st.queue) and blocked_waiter(self.st) is not None
            for s in self.st.running.values():
                if s.lease:
                    if not s.overdue and s.hold_max_us is not None:
                        times.append(s.granted_at + s.hold_max_us)
                elif s.drop_reason is not None:
                    times.append(s.drop_sent_at + self.st.cfg.drop_timeout_us)
                elif blocked and not s.tq_dropped:
                    times.append(s.granted_at + self.st.cfg.tq_us)
        if self.st.waits and (wait := first_wait(self.st)) is not None:  # off, a lease still waits (restart grace)
            times.append(wait[0])
        if self.st.grants_from is not None and self.st.queue:
            times.append(self.st.grants_from)
        for s in self.st.parkable.values():
            if s.park_asked_at is not None:
                times.append(s.park_asked_at + self.st.cfg.park_timeout_us)
        quota = self.st.acc.next_deadline()
        if quota is not None:
            times.append(quota)
        return min(times, default=None)

    # --- reading ------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.st.enabled

    @property
    def config(self) -> SchedulerConfig:
        return self.st.cfg

    @property
    def accounts(self) -> ComputeAccounts:
        return self.st.acc

    def holders(self) -> list[int]:
        return list(self.st.running)

    def queue(self) -> list[int]:
        return [sid for _, _, sid in self.st.queue]

    def last_hold(self, session: int) -> tuple[int, int | None]:
        """The session's last hold, in us: its length, and DROP_LOCK to release (None: no drop)."""
        s = self.st.get(session)
        return s.last_hold_us, s.last_drop_to_release_us

    def session(self, session: int, now: int) -> SessionView:
        """As of the last call; ``advance(now)`` first for figures up to now."""
        return session_view(self.st, session, now)

    def parked_bytes(self) -> int:
        """GPU memory of the parked sessions' programs (what they last reported), now in host memory."""
        return parked_bytes(self.st)

    def view(self, now: int) -> SchedulerView:
        """As of the last call; ``advance(now)`` first for figures up to now."""
        return scheduler_view(self.st, now)

    def check(self) -> None:
        """Raise ``Inconsistent`` if the scheduler's own records disagree (after a fault)."""
        check_records(self.st)
