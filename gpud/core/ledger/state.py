"""The ledger's state as one object, and its checkpoint and rollback.

How: ``LedgerState`` holds every field the ledger keeps, each declared with how a checkpoint keeps
it (``Kept``):
- ``BY_JOURNAL``: the dicts the undo journal records (``gpud.core.journal``): the first change of a
  key after a checkpoint saves its old value, so a rollback costs what changed since, not what the
  ledger holds; the random generator's state is saved there too, before its first draw;
- ``AS_IS``: values that are replaced, never changed in place: a checkpoint holds them;
- ``AS_COPY``: the free share per GPU, changed in place (a dict of a few GPUs whose keys never
  change): a checkpoint holds a copy;
- ``NOT``: the node and its settings (a reload is no change to undo), the shell's fact
  ``reachable``, readings of utilisation, the index (derived: brought up to date for each key the
  journal puts back) and what one call may still do (``Budget``).
``checkpoint`` and ``rollback`` read the declarations: a new field says how it is kept where it is
declared, and no list kept elsewhere can leave it out.

Never: change an ``AS_IS`` value in place (a checkpoint holds that very object: a list, a dict or a
frozenset is replaced whole); change a journaled dict through ``dict``'s own methods.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from gpud.core.journal import JDict, Journal
from gpud.core.ledger.model import (
    NEVER,
    NOTICE_BATCH,
    UNIT,
    Allocation,
    GpuSpec,
    Insufficient,
    Notice,
    PreemptionConfig,
    TenantQuota,
    Waiter,
)
from gpud.core.ledger_index import LedgerIndex, Queued


class Kept(enum.Enum):
    """How a checkpoint keeps a field of the state."""

    BY_JOURNAL = "the journal saves the old value of what changes"
    AS_IS = "replaced, never changed in place: the checkpoint holds the value"
    AS_COPY = "changed in place: the checkpoint holds a copy"
    NOT = "not rolled back"


def _kept(how: Kept) -> Any:
    return field(metadata={"kept": how})


class Budget:
    """What one call may still tell, withdraw or carry out (not state: it starts afresh each call)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = NOTICE_BATCH

    def __repr__(self) -> str:
        return "<notice budget>"


@dataclass(slots=True, eq=False, repr=False)
class LedgerState:
    # The node, and the settings a reload changes.
    gpus: dict[int, GpuSpec] = _kept(Kept.NOT)
    cpus: list[int] = _kept(Kept.NOT)  # sorted
    cpu_numa: dict[int, int] = _kept(Kept.NOT)
    tenants: dict[str, TenantQuota] = _kept(Kept.NOT)
    max_waiters: int = _kept(Kept.NOT)
    preemption: PreemptionConfig = _kept(Kept.NOT)
    journal: Journal = _kept(Kept.NOT)  # records the journaled fields' changes since the last checkpoint
    # Placement.
    allocs: JDict[str, Allocation] = _kept(Kept.BY_JOURNAL)
    on_gpu: dict[int, JDict[str, int]] = _kept(Kept.BY_JOURNAL)  # per GPU: task id -> its share there
    free: dict[int, int] = _kept(Kept.AS_COPY)  # per GPU: the share no allocation holds
    free_cpus: frozenset[int] = _kept(Kept.AS_IS)
    rng: random.Random = _kept(Kept.BY_JOURNAL)  # the "random" strategy's
    rr_last: int = _kept(Kept.AS_IS)  # the GPU the "round_robin" strategy chose last
    # Waits: the requests in queue order (-priority, seq, task id); the suspended allocations are
    # queued by the index. ``why``: the last reason each waiter did not fit (not durable).
    waiters: list[Queued] = _kept(Kept.AS_IS)
    waiting: JDict[str, Waiter] = _kept(Kept.BY_JOURNAL)
    why: JDict[str, Insufficient] = _kept(Kept.BY_JOURNAL)
    seq: int = _kept(Kept.AS_IS)
    serving: bool = _kept(Kept.AS_IS)  # a batch of waiters was served: more may fit, the next call looks again
    # Taking back.
    notices: JDict[str, Notice] = _kept(Kept.BY_JOURNAL)
    immune: JDict[str, int] = _kept(Kept.BY_JOURNAL)  # task id -> until when it is not chosen again
    history: JDict[str, tuple[int, bool]] = _kept(Kept.BY_JOURNAL)  # task id -> (preemptions, resume): none held
    reserved: dict[int, str] = _kept(Kept.AS_IS)  # GPU a victim gave back -> the waiter it was taken for
    withdrawing: frozenset[str] = _kept(Kept.AS_IS)  # waiters gone whose notices are still withdrawn
    advanced_to: int = _kept(Kept.AS_IS)  # the last ``advance``: maturities up to it are in the past
    # Elastic allocations; readings of GPU utilisation (observations, not decisions).
    grow_since: JDict[str, int] = _kept(Kept.BY_JOURNAL)  # elastic task id -> since when it could grow
    busy_since: dict[int, int] = _kept(Kept.NOT)
    idle_since: dict[int, int] = _kept(Kept.NOT)
    # Drain.
    draining: frozenset[int] = _kept(Kept.AS_IS)
    undraining: frozenset[int] = _kept(Kept.AS_IS)  # GPUs put back whose drain notices are still withdrawn
    # Records: the task ids whose record may differ from the stored one.
    changed: JDict[str, None] = _kept(Kept.BY_JOURNAL)
    # The shell's fact: the task ids someone can be told about. Then what is derived, and per call.
    reachable: set[str] = _kept(Kept.NOT)
    index: LedgerIndex = _kept(Kept.NOT)
    budget: Budget = _kept(Kept.NOT)


def _fields(how: Kept) -> tuple[str, ...]:
    return tuple(f.name for f in fields(LedgerState) if f.metadata["kept"] is how)


def _values(names: tuple[str, ...]) -> Callable[[LedgerState], tuple[Any, ...]]:
    """The named fields' values, as a tuple (read in C: a checkpoint is taken before every change)."""
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda st: (one(st),)
    return attrgetter(*names)


def _put_back(st: LedgerState, kept: tuple[Any, ...]) -> None:
    """What a rollback does with a checkpoint's ``kept``: the fields held as they were are set back,
    those copied are updated in place (others hold them)."""
    for name, value in zip(_AS_IS, kept):
        setattr(st, name, value)
    for name, value in zip(_AS_COPY, kept[len(_AS_IS) :]):
        getattr(st, name).update(value)


_AS_IS = _fields(Kept.AS_IS)
_AS_COPY = _fields(Kept.AS_COPY)
_read_as_is = _values(_AS_IS)
_read_as_copy = _values(_AS_COPY)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A moment to roll back to (see ``Ledger.checkpoint``). Two checkpoints are equal when the
    ledger was in the same state at both."""

    state: int  # the journal's name of the state of the journaled fields
    kept: tuple[Any, ...]  # the ``AS_IS`` fields' values, then copies of the ``AS_COPY`` ones
    epoch: int = field(compare=False)


def new_state(
    gpus: list[GpuSpec],
    cpus: list[int],
    *,
    cpu_numa: dict[int, int],
    tenants: dict[str, TenantQuota],
    seed: int,
    max_waiters: int,
    preemption: PreemptionConfig,
) -> LedgerState:
    j = Journal()
    changed: JDict[str, None] = JDict(j)

    def record_changed(t: str) -> None:
        """The allocation, notice, wait or history of ``t`` changed: so may its record."""
        changed[t] = None
        index.update(t)

    def reindex(t: str) -> None:
        index.update(t)

    allocs: JDict[str, Allocation] = JDict(j, record_changed)
    waiting: JDict[str, Waiter] = JDict(j, record_changed)
    notices: JDict[str, Notice] = JDict(j, record_changed)
    immune: JDict[str, int] = JDict(j, reindex)
    index = LedgerIndex(allocs, notices, immune, waiting, NEVER)
    return LedgerState(
        gpus={g.index: g for g in gpus},
        cpus=sorted(cpus),
        cpu_numa=dict(cpu_numa),
        tenants=dict(tenants),
        max_waiters=max_waiters,
        preemption=preemption,
        journal=j,
        allocs=allocs,
        on_gpu={g.index: JDict(j) for g in gpus},
        free={g.index: UNIT for g in gpus},
        free_cpus=frozenset(cpus),
        rng=random.Random(seed),
        rr_last=-1,
        waiters=[],
        waiting=waiting,
        why=JDict(j),
        seq=0,
        serving=False,
        notices=notices,
        immune=immune,
        history=JDict(j, record_changed),
        reserved={},
        withdrawing=frozenset(),
        advanced_to=0,
        grow_since=JDict(j),
        busy_since={},
        idle_since={},
        draining=frozenset(),
        undraining=frozenset(),
        changed=changed,
        reachable=set(),
        index=index,
        budget=Budget(),
    )


def checkpoint(st: LedgerState) -> Checkpoint:
    """A moment to ``rollback`` to: from now on the journal saves the old value of whatever changes;
    the other fields kept are held (or copied) now. A newer checkpoint supersedes this one."""
    epoch, state = st.journal.start()
    return Checkpoint(state, _read_as_is(st) + tuple(map(dict, _read_as_copy(st))), epoch)


def rollback(st: LedgerState, cp: Checkpoint) -> None:
    """Back to exactly the state of ``cp`` (ValueError: a newer checkpoint superseded it), in what
    changed since: the journal puts back the old values, the index follows them."""
    keys = st.journal.undo(cp.epoch, cp.state)
    _put_back(st, cp.kept)
    for t in keys:
        st.index.update(t)
