"""Records: what is durable of each task id, what changed since the store last took it, and putting
stored tasks back at start-up.

Rules kept here:
- A task's record is its allocation and notice; or its wait, when it is suspended or has victims (a
  plain wait dies with its connection); or its preemption history alone.
- ``changed_records`` costs what changed since the last ``mark_stored``, not what the ledger holds:
  applied to the records last stored, it gives ``records()``. A rollback to a checkpoint taken before
  the store took them puts back what was to be stored then.
- A restored record must fit the node as it is now and the other records, with sane values, or it
  is refused (ValueError: the shell sets it aside). Times from before a reboot (monotonic time
  started again) are brought within reach of ``now``; a notice's grace runs on from where it was.

Never: walk the ledger but in ``records`` (start-up and checks).
"""

from __future__ import annotations

from msgspec import structs

import gpud.core.ledger.placement as placement
import gpud.core.ledger.waits as waits
from gpud.core.ledger.model import NEVER, UNIT, Allocation, Insufficient, TaskRecord, Waiter
from gpud.core.ledger.state import LedgerState
from gpud_client.protocol import PRODUCTION_PRIORITY, SPOT_PRIORITY


def restore(st: LedgerState, alloc: Allocation) -> None:
    """Put back an allocation read from the store at start-up (ValueError: it cannot be)."""
    t = alloc.task_id
    if t in st.allocs:
        raise ValueError(f"stored allocation of {t!r} is there twice")
    if not (0 < alloc.share <= UNIT if alloc.gpus else alloc.share == 0) or len(set(alloc.gpus)) != len(alloc.gpus):
        raise ValueError(f"stored allocation of {t!r} has share {alloc.share} of GPUs {alloc.gpus}")
    if len(alloc.gpus) > 1 and alloc.share != UNIT:
        raise ValueError(f"stored allocation of {t!r} splits a fraction over several GPUs")
    if len(set(alloc.cpus)) != len(alloc.cpus) or not SPOT_PRIORITY <= alloc.priority <= PRODUCTION_PRIORITY:
        raise ValueError(f"stored allocation of {t!r} has repeated CPU cores or priority {alloc.priority}")
    for g in alloc.gpus:
        if g not in st.free or st.free[g] < alloc.share:
            raise ValueError(f"stored allocation of {t!r} does not fit GPU {g} any more")
    if not st.free_cpus.issuperset(alloc.cpus):
        raise ValueError(f"stored allocation of {t!r} uses CPU cores that are not free")
    placement.commit(st, alloc)


def restore_record(st: LedgerState, rec: TaskRecord, now: int) -> None:
    """Put back one stored task (``records``' counterpart; ValueError: it cannot be)."""
    if rec.allocation is not None:
        alloc = rec.allocation
        if alloc.created_us > now:
            alloc = structs.replace(alloc, created_us=now, changed_us=min(alloc.changed_us, now))
        restore(st, alloc)
        if rec.notice is not None:
            n = rec.notice
            if n.deadline > now + st.preemption.grace_us:
                n = structs.replace(n, issued=now, deadline=now + st.preemption.grace_us)
            st.notices[rec.task_id] = n
    elif rec.waiting is not None:
        # The cap is for requests (a suspended allocation is none), and those stored were admitted under
        # it: only a lowered cap refuses one.
        full = rec.suspended is None and len(st.waiters) >= st.max_waiters
        if rec.task_id in st.waiting or full:
            raise ValueError(f"stored wait of {rec.task_id!r} is there twice, or too many waits are stored")
        placement.validate(st, rec.waiting)
        short = Insufficient("gpus", "waiting since before gpud restarted")
        # within reach of now: its own wait, or its victims' grace when that is longer (as a plan sets it)
        reach = max(rec.waiting.wait_us, st.preemption.grace_us + 1) if rec.victims else rec.waiting.wait_us
        deadline = NEVER if rec.suspended is not None else min(rec.wait_deadline, now + reach)
        since, victims = min(rec.wait_since, now), tuple(sorted(rec.victims))
        waits.enqueue(st, Waiter(rec.waiting, deadline, since, victims, rec.suspended, seq=st.seq + 1), short)
    if rec.allocation is None and rec.suspended is None and (rec.preemptions or rec.resume):
        st.history[rec.task_id] = (rec.preemptions, rec.resume)


def records(st: LedgerState, before: dict[str, TaskRecord] | None = None) -> dict[str, TaskRecord]:
    """Everything durable, per task id (a walk over all: for start-up and checks; after a change,
    ``changed_records``). ``before``: the last records; an allocation's record that did not change is
    the same object (allocations and notices are replaced, never changed)."""
    out: dict[str, TaskRecord] = {}
    before = before or {}
    for t in [*st.allocs, *st.waiting, *st.history]:  # in this order, as the store expects
        if t not in out and (rec := _record(st, t, before.get(t))) is not None:
            out[t] = rec
    return out


def changed_records(st: LedgerState) -> tuple[dict[str, TaskRecord], set[str]]:
    """What to store since the last ``mark_stored``: the records of the tasks whose record may
    differ from the stored one, and the task ids that have none now (a few may never have been
    stored)."""
    put: dict[str, TaskRecord] = {}
    gone: set[str] = set()
    for t in st.changed:
        rec = _record(st, t)
        if rec is None:
            gone.add(t)
        else:
            put[t] = rec
    return put, gone


def _record(st: LedgerState, t: str, old: TaskRecord | None = None) -> TaskRecord | None:
    if (a := st.allocs.get(t)) is not None:
        n = st.notices.get(t)
        return old if old is not None and old.allocation is a and old.notice is n else TaskRecord(t, a, n)
    w = st.waiting.get(t)
    pre, resume = st.history.get(t, (0, False))
    if w is None or (w.suspended is None and not w.victims):  # a plain wait dies with its connection
        return TaskRecord(t, preemptions=pre, resume=resume) if t in st.history else None
    if w.suspended is not None:  # its own count and flag (the store keeps one pair per task)
        pre, resume = w.suspended.preemptions, w.suspended.resume
    return TaskRecord(
        t,
        waiting=w.request,
        wait_deadline=w.deadline,
        wait_since=w.since,
        victims=w.victims,
        suspended=w.suspended,
        preemptions=pre,
        resume=resume,
    )
