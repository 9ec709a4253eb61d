"""The lock queue of one GPU: who waits in which order, who holds, and how a session leaves.

- One queue ordered by priority (higher first), then arrival: ``(-priority, seq, session)``,
  kept sorted. A waiting lease also has its wait deadline in a heap; an entry whose seq is no
  longer the session's queue entry is stale and skipped, so expiry and the next deadline cost
  O(log n), and the heap is rebuilt when stale entries outnumber the live ones (amortised O(1)).
- Leaving: a holder's hold ends (its time is billed), a waiter leaves the queue, and a session
  that is forgotten leaves the accounts too.
"""

from __future__ import annotations

import bisect
import heapq

from gpud.core.scheduler.model import Effect, LeaseDenied, SchedState, Session
from gpud_client.protocol import LeaseReason


def enqueue(st: SchedState, s: Session, priority: int) -> None:
    s.queue_key = key = (-priority, next(st.seq), s.id)
    bisect.insort(st.queue, key)
    if s.wait_deadline is not None:
        heapq.heappush(st.waits, (s.wait_deadline, key[1], s.id))
        if len(st.waits) > 2 * len(st.queue) + 64:  # granted leases' entries: rebuilt, amortized O(1)
            st.waits = [w for w in st.waits if waiting_entry(st, w)]
            heapq.heapify(st.waits)


def dequeue(st: SchedState, s: Session) -> None:
    key, s.queue_key = s.queue_key, None
    assert key is not None, "a waiting session is queued under its key"
    i = bisect.bisect_left(st.queue, key)
    if i < len(st.queue) and st.queue[i] == key:  # else check() reports the queue inconsistent
        del st.queue[i]


def first_wait(st: SchedState) -> tuple[int, int, int] | None:
    """The earliest wait deadline of a lease still waiting; stale entries are dropped on the way."""
    waits = st.waits
    while waits:
        if waiting_entry(st, waits[0]):
            return waits[0]
        heapq.heappop(waits)
    return None


def waiting_entry(st: SchedState, entry: tuple[int, int, int]) -> bool:
    s = st.sessions.get(entry[2])
    return s is not None and s.state == "waiting" and s.queue_key is not None and s.queue_key[1] == entry[1]


def expire_waits(st: SchedState, now: int, effects: list[Effect]) -> bool:
    """Leases whose max_wait has passed leave the queue, denied; True when one did."""
    expired = False
    while (first := first_wait(st)) is not None and now >= first[0]:
        s = st.sessions[first[2]]
        effects.append(LeaseDenied(s.id, LeaseReason.TIMEOUT))
        forget(st, s, now)
        expired = True
    return expired


def end_hold(st: SchedState, s: Session, now: int) -> None:
    del st.running[s.id]
    st.acc.stop(s.id, now)
    s.hold_us += now - s.granted_at
    s.last_hold_us = now - s.granted_at
    s.last_drop_to_release_us = None if s.drop_reason is None else now - s.drop_sent_at
    s.state = "idle"
    s.drop_reason = None


def forget(st: SchedState, s: Session, now: int) -> None:
    """Out of the running set or the queue, and out of the accounts."""
    if s.state == "holding":
        end_hold(st, s, now)
    elif s.state == "waiting":
        dequeue(st, s)
    del st.sessions[s.id]
    st.parkable.pop(s.id, None)
    st.acc.remove(s.id, now)
