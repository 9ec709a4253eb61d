"""Elastic allocations: growing into whole GPUs that stay free, and giving back what idles.

Rules kept here:
- An elastic allocation (``gpus_min``..``gpus_max`` whole GPUs) is granted what is free up to its
  maximum when nobody of equal or higher priority waits (``placement``), and grows when whole GPUs
  have stayed free for ``elastic_window_us`` and no such waiter waits, at most once per
  ``elastic_cooldown_us`` since its last change (a growth or a shrink), so it does not flap. It
  grows no further than its tenant may use. Among equals the lower task id grows first.
- With ``busy_percent`` set, it grows only while its own GPUs stayed busy through the window, and
  gives its extras back (a notice by ``IDLE``, the usual grace) when they idled through the window.
  Utilisation is observed (``observe``), never decided here.
- A waiter takes an elastic allocation's extras before anyone is preempted whole (``takeback``).

Never: grow an allocation that has a notice, onto a draining GPU; wake for a time already passed.
"""

from __future__ import annotations

from msgspec import structs

import gpud.core.ledger.notices as notices
import gpud.core.ledger.placement as placement
from gpud.core.ledger.model import IDLE, UNIT, Allocation, Grown, LedgerEffect
from gpud.core.ledger.state import LedgerState
from gpud_client.protocol import PreemptReason


def observe(st: LedgerState, gpu: int, percent: float, now: int) -> bool:
    """A reading of ``gpu``'s utilisation (the shell's NVML samples): busy at or above
    ``busy_percent``. Only elastic allocations' pacing reads it, and only when that is set.
    True when the GPU turned busy or idle (``next_deadline`` may be sooner)."""
    if not st.preemption.busy_percent or gpu not in st.gpus:
        return False
    busy = percent >= st.preemption.busy_percent
    now_in, other = (st.busy_since, st.idle_since) if busy else (st.idle_since, st.busy_since)
    other.pop(gpu, None)
    if gpu in now_in:
        return False
    now_in[gpu] = now
    return True


def _through_window(st: LedgerState, since: dict[int, int], gpus: tuple[int, ...]) -> int | None:
    """When every one of ``gpus`` will have been so (busy, idle) for the window; None: one is not."""
    if not gpus or any(g not in since for g in gpus):
        return None
    return max(since[g] for g in gpus) + st.preemption.elastic_window_us


def shrink_idle(st: LedgerState, now: int) -> list[LedgerEffect]:
    """Elastic allocations whose GPUs idled through the window give their extras back."""
    effects: list[LedgerEffect] = []
    if not st.preemption.busy_percent:
        return effects
    for a in _elastic(st):
        if not a.extras or a.task_id in st.notices or a.task_id not in st.reachable:
            continue
        at = _through_window(st, st.idle_since, a.gpus)
        if at is not None and now >= max(at, a.changed_us + st.preemption.elastic_cooldown_us):
            effects += notices.notice(st, a, PreemptReason.ELASTIC, a.extras, False, IDLE, now)
    return effects


def idle_times(st: LedgerState) -> list[int]:
    """When elastic allocations above their minimum will have idled through the window."""
    if not st.preemption.busy_percent:
        return []
    out = []
    for a in _elastic(st):
        if a.extras and a.task_id not in st.notices and a.task_id in st.reachable:
            at = _through_window(st, st.idle_since, a.gpus)
            if at is not None:
                out.append(max(at, a.changed_us + st.preemption.elastic_cooldown_us))
    return [t for t in out if t > st.advanced_to]


def grow(st: LedgerState, now: int) -> list[LedgerEffect]:
    """Elastic allocations take whole GPUs that stayed free through the window (and, with
    ``busy_percent``, while their own GPUs stayed busy)."""
    effects: list[LedgerEffect] = []
    for a in _elastic(st):
        if not a.gpus_max or len(a.gpus) >= a.gpus_max or a.task_id in st.notices:
            continue
        if st.preemption.busy_percent and _through_window(st, st.busy_since, a.gpus) is None:
            st.grow_since.pop(a.task_id, None)
            continue
        free = [g for g, f in st.free.items() if f == UNIT and g not in st.draining]
        free = free[: min(a.gpus_max - len(a.gpus), placement.tenant_room(st, a.tenant) // UNIT)]
        if not free or placement.waits_at(st, a.priority):
            st.grow_since.pop(a.task_id, None)
            continue
        st.grow_since.setdefault(a.task_id, now)
        if now < grow_at(st, a.task_id):
            continue
        del st.grow_since[a.task_id]
        placement.drop(st, a)
        grown = structs.replace(a, gpus=a.gpus + tuple(free), changed_us=now)
        placement.commit(st, grown)
        effects.append(Grown(grown))
    return effects


def _elastic(st: LedgerState) -> list[Allocation]:
    """The elastic allocations, by task id (the first grows first when GPUs are scarce)."""
    return [st.allocs[t] for t in sorted(st.index.elastic)]


def grow_at(st: LedgerState, task_id: str) -> int:
    """When an elastic allocation that could grow since ``grow_since`` may: the GPUs stayed free
    through the window, and its cooldown since its last change is over."""
    cfg = st.preemption
    a = st.allocs[task_id]
    at = max(st.grow_since[task_id] + cfg.elastic_window_us, a.changed_us + cfg.elastic_cooldown_us)
    if cfg.busy_percent:
        at = max(at, _through_window(st, st.busy_since, a.gpus) or 0)
    return at
