"""Who holds one GPU's lock: admitting waiters and dropping holders, every rule due at ``now``
(``settle``), in order.

- The head of the queue is admitted when it fits (``serial``: alone; ``concurrent`` and ``auto``:
  while the holders' memory fits in total x (1 - reserve %); the first holder on an idle GPU
  always); a throttled waiter is passed over. Off (SCHED_OFF), every request is granted at once.
- A waiter that does not fit drops running sessions of lower priority (reason preempt), lowest
  first, as many as it needs; a holder that held for TQ while a waiter cannot be admitted gets one
  DROP_LOCK (tq) per grant; a session over its compute budget one (quota); ``auto`` drops sessions
  (memory) while the holders' reported memory overflows. Leases are never dropped.
- A holder that has not released within ``drop_timeout`` of its DROP_LOCK is revoked; a lease held
  past hold_max is reported once and, if configured, released by force.
- The restart grace (``grants_from``): nothing is granted before it ends.
"""

from __future__ import annotations

from gpud.core.scheduler.model import Drop, Effect, Grant, HoldOverdue, MemOverLimit, Revoke, SchedState, Session
from gpud.core.scheduler.parking import park_overdue, room_beside_parkable
from gpud.core.scheduler.queue import dequeue, end_hold, expire_waits, forget
from gpud_client.protocol import DropReason, Mode, RevokeReason


def settle(st: SchedState, now: int) -> list[Effect]:
    """Apply every rule that is due at ``now``, in order. A rule is skipped only when the set it
    walks is empty (it would find nothing): this runs on every request."""
    effects: list[Effect] = []
    if st.grants_from is not None and now >= st.grants_from:
        st.grants_from = None  # the restart grace is over
    st.acc.settle(now)
    if st.parkable:
        park_overdue(st, now, effects)
    if st.running:
        _revoke_unresponsive(st, now, effects)
        if st.enabled:
            _watch_leases(st, now, effects)
            if st.acc.has_limits:
                _drop_exhausted(st, now, effects)
            _drop_memory_overflow(st, now, effects)
    if st.queue:
        _admit(st, now, effects)
    if st.waits and expire_waits(st, now, effects):
        _admit(st, now, effects)  # a waiter that left may have blocked the others
    if st.queue:
        _drop_expired(st, now, effects)
    return effects


def admissible_now(st: SchedState, s: Session) -> bool:
    """Would ``s`` be granted at once if it joined the queue now?"""
    if st.grants_from is not None:
        return False
    ahead = blocked_waiter(st)
    fits = (ahead is None or ahead.priority < s.priority) and _fits(st, s)
    return fits and (not st.enabled or room_beside_parkable(st, s, 0, None))


def blocked_waiter(st: SchedState) -> Session | None:
    """The first waiter that is not throttled (after ``_admit``: it does not fit)."""
    for _, _, sid in st.queue:
        if not st.throttled(sid):
            return st.sessions[sid]
    return None


def check_memory_limit(s: Session, effects: list[Effect]) -> None:
    over = s.mem_limit is not None and s.mem_used is not None and s.mem_used > s.mem_limit
    if over and not s.mem_over and s.mem_limit is not None and s.mem_used is not None:
        s.mem_violations += 1
        effects.append(MemOverLimit(s.id, s.mem_used, s.mem_limit))
    s.mem_over = over


def _drop(st: SchedState, s: Session, reason: DropReason, now: int, effects: list[Effect]) -> None:
    s.drop_reason = reason
    s.drop_sent_at = now
    s.drops[reason] += 1
    st.drops[reason] += 1
    st.acc.begin_tail(s.id, now)
    effects.append(Drop(s.id, s.grant, reason))


def _watch_leases(st: SchedState, now: int, effects: list[Effect]) -> None:
    for s in list(st.running.values()):
        if s.lease and not s.overdue and s.hold_max_us is not None and now >= s.granted_at + s.hold_max_us:
            s.overdue = True
            forced = st.cfg.lease_force_release
            effects.append(HoldOverdue(s.id, now - s.granted_at, forced))
            if forced:
                effects.append(Revoke(s.id, s.grant, RevokeReason.HOLD_MAX))
                forget(st, s, now)


def _revoke_unresponsive(st: SchedState, now: int, effects: list[Effect]) -> None:
    for s in list(st.running.values()):
        if s.drop_reason is not None and now >= s.drop_sent_at + st.cfg.drop_timeout_us:
            effects.append(Revoke(s.id, s.grant, RevokeReason.DROP_TIMEOUT))
            s.revocations += 1
            st.revocations += 1
            end_hold(st, s, now)


def _drop_exhausted(st: SchedState, now: int, effects: list[Effect]) -> None:
    for sid in st.acc.exhausted():
        st.acc.throttle(sid)
        s = st.running[sid]
        if s.drop_reason is None:
            _drop(st, s, DropReason.QUOTA, now, effects)


def _drop_memory_overflow(st: SchedState, now: int, effects: list[Effect]) -> None:
    if st.cfg.mode != Mode.AUTO or len(st.running) < 2:
        return
    staying = [s for s in st.running.values() if s.drop_reason is None]
    overflow = sum(st.need(s) for s in staying) - st.capacity()
    for s in sorted((s for s in staying if not s.lease), key=lambda s: (s.priority, -s.grant)):
        if overflow <= 0 or len(staying) <= 1:
            return
        _drop(st, s, DropReason.MEMORY, now, effects)
        staying.remove(s)
        overflow -= st.need(s)


def _fits(st: SchedState, s: Session) -> bool:
    return not st.enabled or _fits_beside(st, s, list(st.running.values()))


def _fits_beside(st: SchedState, waiter: Session, holders: list[Session]) -> bool:
    if not holders:
        return True
    if st.cfg.mode == Mode.SERIAL:
        return False
    return sum(st.need(s) for s in holders) + st.need(waiter) <= st.capacity()


def _admit(st: SchedState, now: int, effects: list[Effect]) -> None:
    if st.grants_from is not None:
        return  # the restart grace: requests wait
    while (s := _next_admissible(st)) is not None:
        if not _fits(st, s):
            _preempt_for(st, s, now, effects)
            return
        if st.enabled and not room_beside_parkable(st, s, now, effects):
            return  # parks asked: the grant waits for their PARKED
        dequeue(st, s)
        s.state = "holding"
        s.grant = next(st.grant_seq)
        s.granted_at = now
        s.tq_dropped = False
        s.drop_reason = None
        s.resident, s.park_asked_at, s.park_refused = s.parkable, None, False
        s.grants += 1
        s.wait_us += now - s.requested_at
        st.grants += 1
        st.running[s.id] = s
        st.acc.start(s.id, now)
        effects.append(Grant(s.id, s.grant, now - s.requested_at))


def _next_admissible(st: SchedState) -> Session | None:
    if not st.enabled:
        return st.sessions[st.queue[0][2]] if st.queue else None
    return blocked_waiter(st)


def _preempt_for(st: SchedState, waiter: Session, now: int, effects: list[Effect]) -> None:
    """Drop lower-priority holders, lowest first, if that lets ``waiter`` in."""
    staying = [s for s in st.running.values() if s.drop_reason is None]
    victims = sorted(
        (s for s in staying if s.priority < waiter.priority and not s.lease),
        key=lambda s: (s.priority, -s.grant),
    )
    if not victims or _fits_beside(st, waiter, staying):
        return  # nobody may be dropped for it, or enough is already on its way out
    chosen: list[Session] = []
    for v in victims:
        chosen.append(v)
        if _fits_beside(st, waiter, [s for s in staying if s not in chosen]):
            for c in chosen:
                _drop(st, c, DropReason.PREEMPT, now, effects)
            return


def _drop_expired(st: SchedState, now: int, effects: list[Effect]) -> None:
    if not st.enabled or blocked_waiter(st) is None:
        return
    for s in st.running.values():
        if not s.lease and s.drop_reason is None and not s.tq_dropped and now >= s.granted_at + st.cfg.tq_us:
            s.tq_dropped = True
            _drop(st, s, DropReason.TQ, now, effects)
