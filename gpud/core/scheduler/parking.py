"""Parking (``gpuctl run``): a parkable session's program keeps its GPU memory while it does not hold
the lock (it is paused, not gone), so that memory counts beside the holders until its program parks
it in host memory.

- Before a waiter is granted, the resident memory of parkable sessions that do not hold must fit
  beside it and the holders; if not, they are asked to park (PARK), lowest priority and oldest grant
  first, as many as it needs, and the grant waits for their PARKED.
- A park refused or not answered within ``park_timeout`` leaves that memory counted and is not asked
  again until the session has held the lock once more; when nothing more can be asked, the waiter is
  granted as a GPU without gpud would. A lease whose wait ends now asks nothing.
"""

from __future__ import annotations

from gpud.core.scheduler.model import AskPark, Effect, ParkOverdue, SchedState, Session


def resident(st: SchedState) -> list[Session]:
    """Parkable sessions whose memory is on the GPU while they do not hold."""
    return [s for s in st.parkable.values() if s.resident and s.state != "holding"]


def room_beside_parkable(st: SchedState, waiter: Session, now: int, effects: list[Effect] | None) -> bool:
    """Whether ``waiter`` may be granted beside the memory parkable sessions keep on the GPU;
    if not, ask enough of them to park (``effects`` None: only look). False while a park it
    needs is still out."""
    kept = [r for r in resident(st) if r is not waiter]
    if not kept:
        return True
    if effects is not None and waiter.wait_deadline is not None and now >= waiter.wait_deadline:
        effects = None
    held = sum(st.need(h) for h in st.running.values())
    over = st.need(waiter) + held + sum(st.need(r) for r in kept) - st.capacity()
    out = False
    for r in sorted(kept, key=lambda r: (r.priority, r.grant)):
        if over <= 0:
            break
        if r.park_refused:
            continue
        if r.park_asked_at is None and effects is not None:
            r.park_asked_at = now
            effects.append(AskPark(r.id, r.grant))
        out = True
        over -= st.need(r)
    return not out


def park_overdue(st: SchedState, now: int, effects: list[Effect]) -> None:
    for s in st.parkable.values():
        if s.park_asked_at is not None and now >= s.park_asked_at + st.cfg.park_timeout_us:
            s.park_asked_at, s.park_refused = None, True
            effects.append(ParkOverdue(s.id))


def parked_bytes(st: SchedState) -> int:
    """GPU memory of the parked sessions' programs (what they last reported), now in host memory."""
    return sum(
        s.mem_used or s.mem_estimate or 0 for s in st.parkable.values() if not s.resident and s.state != "holding"
    )
