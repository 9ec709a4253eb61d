"""What one GPU's scheduler shows (``gpud.core.snapshots``), and its self-check after a fault.

Read only: nothing here changes the state.
"""

from __future__ import annotations

from gpud.core.errors import Inconsistent
from gpud.core.scheduler.model import SchedState
from gpud.core.snapshots import HolderView, SchedulerView, SessionView, WaiterView


def session_view(st: SchedState, session: int, now: int) -> SessionView:
    s = st.get(session)
    a = st.acc.account(session)
    budget = st.acc.budget_ns(session)
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
        recent_share_percent=st.acc.recent_share(session),
        throttled=st.throttled(session),
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


def scheduler_view(st: SchedState, now: int) -> SchedulerView:
    return SchedulerView(
        enabled=st.enabled,
        mode=st.cfg.mode,
        tq_us=st.cfg.tq_us,
        drop_timeout_us=st.cfg.drop_timeout_us,
        window_us=st.acc.cfg.window_us,
        memory_capacity_bytes=st.capacity(),
        memory_in_use_bytes=sum(st.need(s) for s in st.running.values()),
        holders=tuple(HolderView(s.id, s.grant, now - s.granted_at, s.drop_reason) for s in st.running.values()),
        queue=tuple(
            WaiterView(sid, -negp, now - st.sessions[sid].requested_at, st.throttled(sid)) for negp, _, sid in st.queue
        ),
        sessions=len(st.sessions),
        grants=st.grants,
        drops=dict(st.drops),
        revocations=st.revocations,
    )


def check(st: SchedState) -> None:
    """Raise ``Inconsistent`` if the scheduler's own records disagree (after a fault)."""
    queued = [sid for _, _, sid in st.queue]
    problems = []
    if len(queued) != len(set(queued)):
        problems.append("a session is queued twice")
    for sid in queued:
        if st.sessions.get(sid) is None or st.sessions[sid].state != "waiting":
            problems.append(f"queued session {sid} is not a waiting session")
    for sid, s in st.running.items():
        if st.sessions.get(sid) is not s or s.state != "holding":
            problems.append(f"running session {sid} is not a holding session")
    for sid, s in st.sessions.items():
        if (s.state == "holding") != (sid in st.running) or (s.state == "waiting") != (sid in set(queued)):
            problems.append(f"session {sid} is {s.state} but not where that state belongs")
        if not st.acc.has(sid):
            problems.append(f"session {sid} has no compute account")
        if s.parkable != (st.parkable.get(sid) is s):
            problems.append(f"session {sid}'s parkable flag disagrees with the parkable set")
    if problems:
        raise Inconsistent("; ".join(problems[:5]))
