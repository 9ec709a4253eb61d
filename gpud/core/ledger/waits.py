"""Waits: the queue of requests that did not fit, the suspended allocations waiting for their GPUs,
and serving them.

Rules kept here:
- A request that does not fit and may wait takes a place in a queue served in priority order (FIFO
  within a priority, ``seq``); each waiter is granted as soon as it fits, until its deadline. At
  most ``max_waiters`` requests wait at once (the facade refuses one more).
- A suspended allocation waits in any number (thousands of victims may suspend), without a
  deadline, at its priority, for exactly its own GPUs: serving reads only those whose GPUs have room
  for them, in the queue's order, and serves a batch of waiters at most per call, the rest at the
  next calls (``serving``).
- A waiter that gives up or is served withdraws the notices it caused (``notices.withdraw_for``);
  withdrawing a wait frees nothing, so it serves no one, unless GPUs were kept for it.
- A waiter expires at its deadline, but never while its victims leave: it waits at least until
  their grace has ended.

Never: serve past the call's budget; walk every suspended allocation.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterator
from heapq import merge
from itertools import islice
from typing import Any

import gpud.core.ledger.notices as notices
import gpud.core.ledger.placement as placement
import gpud.core.ledger.takeback as takeback
from gpud.core.ledger.model import Expired, Insufficient, LedgerEffect, Request, Served, Waiter
from gpud.core.ledger.state import LedgerState
from gpud.core.ledger_index import Queued
from gpud.core.sortedkeys import SortedKeys

BLOCKED_WAITERS = 16  # waiters (the first in the queue) whose listing says what is in their way


def enqueue(st: LedgerState, w: Waiter, why: Insufficient) -> None:
    """``w`` (its ``seq`` the next) waits: its place in the queue is (-priority, seq)."""
    st.seq += 1
    assert w.seq == st.seq
    st.waiting[w.request.task_id] = w
    st.why[w.request.task_id] = why
    if w.suspended is None:  # (a suspended allocation is queued by the index)
        waiters = list(st.waiters)  # a copy: a checkpoint holds the list it saw
        insort(waiters, (-w.request.priority, st.seq, w.request.task_id))
        st.waiters = waiters


def unwait(st: LedgerState, task_id: str, now: int) -> list[LedgerEffect]:
    """Out of the queue; the notices it caused are withdrawn (their victims then rest a while),
    those over this call's batch by the next calls; it tells no more of its plan."""
    w = st.waiting.pop(task_id)
    del st.why[task_id]
    if w.suspended is None:
        st.waiters = [x for x in st.waiters if x[2] != task_id]
    else:
        st.history.pop(task_id, None)
    kept = len(st.reserved)
    effects = notices.withdraw_for(st, w, now)
    if len(st.reserved) < kept:  # the GPUs kept for it are open to the others again
        effects += serve(st, now)
    return effects


def expire(st: LedgerState, now: int) -> list[LedgerEffect]:
    """The waiters whose deadline passed and whose victims have left, out with why."""
    effects: list[LedgerEffect] = []
    for task_id in st.index.due_waits(now):
        w = st.waiting.get(task_id)
        if w is not None and now >= w.deadline and not notices.leaving(st, w):
            why = takeback.explained(st, st.why[task_id], w.request, now)
            effects += unwait(st, task_id, now)
            effects.append(Expired(task_id, why))
    return effects


def serve(st: LedgerState, now: int) -> list[LedgerEffect]:
    """Grant waiters in priority order, each as soon as it fits: the requests, and of the suspended
    allocations those whose GPUs have room for them now (the others would not fit). At most this
    call's batch are served; when it is spent, the next call looks again (``serving``)."""
    effects: list[LedgerEffect] = []
    st.serving = False
    again = bool(st.waiters or st.index.parked)
    while again:  # once more when one served leaves GPUs it kept open to the others
        again = False
        seen: set[str] = set()
        parked = _parked_with_room(st) if st.index.parked else []
        for _, _, task_id in merge(list(st.waiters), *parked) if parked else list(st.waiters):
            if task_id in seen or (w := st.waiting.get(task_id)) is None:
                continue  # (a suspended allocation waiting for two GPUs is read on each)
            seen.add(task_id)
            if st.budget.left <= 0:
                st.serving = True
                return effects
            try:
                alloc = placement.place(st, w.request, now, w.suspended)
            except Insufficient as short:
                st.why[task_id] = short  # not durable: kept apart from the wait, whose record it would touch
                continue
            del st.waiting[task_id]
            del st.why[task_id]
            if w.suspended is None:
                st.waiters = [x for x in st.waiters if x[2] != task_id]
            st.budget.left -= 1
            effects.append(Served(alloc, resumed=w.suspended is not None))
            kept = len(st.reserved)
            effects += notices.withdraw_for(st, w, now)  # served before all its victims left: they may stay
            if len(st.reserved) < kept:
                again = True
                break
    return effects


def _parked_with_room(st: LedgerState) -> list[Iterator[Queued]]:
    """The suspended allocations that may fit now, per GPU they wait for and share they need, each
    in queue order: only on a GPU that is not draining, with room for the share, and not kept from
    them for a waiter of their priority or higher. Read as they are served (the index changes)."""
    out: list[Iterator[Queued]] = []
    free = st.free
    for g, by_share in st.index.parked.items():
        if g not in free or g in st.draining:
            continue
        keeper = st.waiting.get(st.reserved.get(g, ""))
        cut = -keeper.request.priority if keeper is not None else None  # (-priority) from here on: kept from
        out += [_read_on(keys, free, g, share, cut) for share, keys in by_share.items() if share <= free[g]]
        if keeper is not None and keeper.suspended is not None and g in keeper.request.pinned:
            out.append(iter([(-keeper.request.priority, keeper.seq, keeper.request.task_id)]))  # not kept from itself
    return out


def _read_on(keys: SortedKeys[Any], free: dict[int, int], gpu: int, share: int, cut: int | None) -> Iterator[Queued]:
    """Suspended allocations waiting for ``gpu`` with ``share`` (a ``SortedKeys`` of their places), in
    order, while it has room for that share and until those it is kept from: read a few at a time
    after the last one read, so that serving them (which takes them out) does not disturb it."""
    last: Queued | None = None
    while True:
        ahead = list(islice(keys.after(last) if last is not None else iter(keys), 16))
        for queued in ahead:
            if free[gpu] < share or (cut is not None and queued[0] >= cut):
                return
            yield queued
        if len(ahead) < 16:
            return
        last = ahead[-1]


def waiter_info(st: LedgerState, now: int) -> list[tuple[Request, int, str]]:
    """Each waiter that is not a suspended allocation: its request, since when, and why it waits:
    the victims it waits for that have not left yet, else why it does not fit and (for the first
    ``BLOCKED_WAITERS`` in the queue) why nothing could be taken back for it."""
    out: list[tuple[Request, int, str]] = []
    for _, _, t in st.waiters:
        w = st.waiting[t]
        if w.suspended is not None:
            continue
        if notices.leaving(st, w):
            why = _waits_for(w, st.index.told.get(t))
        elif len(out) < BLOCKED_WAITERS:
            why = takeback.explained(st, st.why[t], w.request, now).message
        else:
            why = st.why[t].message
        out.append((w.request, w.since, why))
    return out


def _waits_for(w: Waiter, told: SortedKeys[str] | None) -> str:
    """Why a waiter with victims waits: those ``told`` for it that have not left yet (a few of them
    named: it may have thousands), and how many of its plan are still to be told."""
    names = list(islice(told or (), 8 + 1))
    if len(names) > 8:
        leaving = f"{len(told or ())} allocations ({', '.join(names[:3])}, ...)"
    else:
        leaving = ", ".join(names)
    if not leaving:
        return f"waits for {len(w.plan)} allocations to be told to leave"
    more = f"; {len(w.plan)} more to be told" if w.plan else ""
    return f"waits for {leaving} to leave (their grace runs){more}"
