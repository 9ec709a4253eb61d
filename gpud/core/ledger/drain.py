"""Drain: taking a GPU out of service and putting it back.

Rules kept here:
- A draining GPU takes no new grants; every allocation on it that can be told gets a notice (reason
  ``drain``, production and protected allocations included: it is the operator's decision), in task
  id order, a batch a call. An elastic allocation gives back only the drained GPU when it is one of
  its extras, else it is taken whole.
- Putting a GPU back withdraws its drain's notices that still run (a batch now, the rest by the next
  calls), without a rest, but those of allocations another of whose GPUs drains.

Never: tell past the call's budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import gpud.core.ledger.notices as notices
import gpud.core.ledger.waits as waits
from gpud.core.errors import Refused
from gpud.core.ledger.model import NOTICE_BATCH, LedgerEffect
from gpud.core.ledger.state import LedgerState
from gpud.core.ledger_index import DRAIN
from gpud_client.protocol import ErrorCode, PreemptReason


def set_draining(st: LedgerState, gpu: int, on: bool, now: int) -> list[LedgerEffect]:
    """Drain ``gpu`` (its allocations are told by the next calls) or put it back, withdrawing the
    drain's notices that still run (a batch now) and serving who fits."""
    if gpu not in st.gpus:
        raise Refused(ErrorCode.UNKNOWN_GPU, f"unknown GPU {gpu}")
    if on:
        st.draining |= {gpu}
        st.undraining -= {gpu}
        return []
    st.budget.left = NOTICE_BATCH
    st.draining -= {gpu}
    st.undraining |= {gpu}
    return undrain(st, now) + waits.serve(st, now)


def tell(st: LedgerState, now: int) -> list[LedgerEffect]:
    """The next batch of the allocations on draining GPUs that can be told, by task id."""
    effects: list[LedgerEffect] = []
    for gpu in sorted(st.draining):
        untold = st.index.untold.get(gpu)
        if st.budget.left <= 0 or untold is None:
            continue
        for task_id in list(islice(filter(st.reachable.__contains__, untold), st.budget.left)):
            alloc = st.allocs[task_id]
            whole = gpu not in alloc.extras
            gpus = alloc.gpus if whole else (gpu,)
            effects += notices.notice(st, alloc, PreemptReason.DRAIN, gpus, whole, DRAIN, now)
    return effects


def undrain(st: LedgerState, now: int) -> list[LedgerEffect]:
    """The next batch of the drain notices of GPUs put back (but those another of whose GPUs
    drains). A GPU stays listed until a batch finds fewer than it could take."""
    effects: list[LedgerEffect] = []
    if not st.undraining:
        return effects
    left: set[int] = set()
    for g in sorted(st.undraining):
        want = st.budget.left
        on = st.index.drain_on.get(g)
        if want <= 0:
            left.add(g)
            continue
        picked = [] if on is None else list(islice(_undrained(st, on), want))
        effects += notices.withdraw(st, picked, now, rest=False)
        if len(picked) == want:
            left.add(g)
    st.undraining = frozenset(left)
    return effects


def _undrained(st: LedgerState, on: Iterable[str]) -> Iterable[str]:
    return (t for t in on if not st.draining.intersection(st.notices[t].gpus))
