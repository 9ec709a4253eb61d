"""What the ledger finds without a walk over every allocation: indexes derived from its state.

How: ``LedgerIndex.update(task_id)`` runs whenever the task's allocation, notice, immunity or wait
changed (the ledger's dicts call it after each change, and a rollback for each key it put back).
It reads the task's facts from the ledger's dicts and, when they differ from those it indexed,
takes the old entries out and puts the new ones in. So every index is a function of the state,
whatever led there: a rollback needs no undo of its own, and none is state (their reprs say
nothing). Kept, in ``SortedKeys`` or ``ByTime`` (a change costs O(log n), read on from a key):
- the running and suspended allocations by task id (the paged listing);
- per tenant, its usage and its allocations newest first (reclaiming borrowed quota);
- when allocations of priority above 0 were made: when the next reaches its minimum runtime;
- per GPU and (units, share, priority), the allocations a request may take back whole, newest
  first: victim selection reads only the cheapest few, skipping the immature (``VictimPool``);
- deadlines of notices, waits and immunities (``advance`` and ``next_deadline`` read the first);
- the allocations that hold CPU cores (at most the node's cores) and the elastic ones.

Never: decide anything (the rules are the ledger's and ``gpud.core.preemption``'s); read another
task's facts while indexing one; be read between a change of the ledger's dicts and its ``update``.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

from gpud.core.preemption import Candidate, Group, GroupKey
from gpud.core.sortedkeys import ByTime, SortedKeys
from gpud_client.protocol import PreemptReason, Recovery


class _Alloc(Protocol):
    """What the index reads of a ``gpud.core.ledger.Allocation`` (a protocol: the ledger imports this module)."""

    @property
    def task_id(self) -> str: ...
    @property
    def gpus(self) -> tuple[int, ...]: ...
    @property
    def share(self) -> int: ...
    @property
    def cpus(self) -> tuple[int, ...]: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def created_us(self) -> int: ...
    @property
    def on_preempt(self) -> Recovery: ...
    @property
    def gpus_max(self) -> int: ...
    @property
    def protected(self) -> bool: ...
    @property
    def total(self) -> int: ...


class _Deadline(Protocol):
    @property
    def deadline(self) -> int: ...


class _Wait(Protocol):
    @property
    def deadline(self) -> int: ...
    @property
    def suspended(self) -> object | None: ...


def as_victim(a: _Alloc, reason: PreemptReason, gpus: tuple[int, ...]) -> Candidate:
    whole = gpus == a.gpus
    return Candidate(
        a.task_id, gpus, a.share, len(a.cpus) if whole else 0, a.priority, a.created_us, whole, reason, a.tenant
    )


class _Facts(NamedTuple):
    alloc: _Alloc | None
    notice_deadline: int | None
    immune_until: int | None
    wait_deadline: int | None  # None: no wait, or one without a deadline
    suspended: bool


_NONE = _Facts(None, None, None, None, False)


def _lower(a: _Alloc) -> bool:
    """Whether a request of a higher priority may take it back whole: once it is mature, while it
    has no notice and no immunity, and when someone can be told (the shell's ``reachable``). Those
    three change with time or often (10 000 notices at once), so they are read when choosing."""
    return a.priority < 100 and not a.protected and a.on_preempt != Recovery.SHRINK


class LedgerIndex:
    __slots__ = (
        "_allocs",
        "_notices",
        "_immune",
        "_waiting",
        "_never",
        "_facts",
        "_made",
        "listed",
        "_tenant_used",
        "_by_tenant",
        "_maturing",
        "_lower",
        "cpu_holders",
        "elastic",
        "_notice_due",
        "_wait_due",
        "_immune_due",
    )

    def __init__(
        self,
        allocs: Mapping[str, _Alloc],
        notices: Mapping[str, _Deadline],
        immune: Mapping[str, int],
        waiting: Mapping[str, _Wait],
        never: int,
    ) -> None:
        self._allocs, self._notices, self._immune, self._waiting = allocs, notices, immune, waiting
        self._never = never
        self._facts: dict[str, _Facts] = {}
        self._made: dict[str, tuple[_Alloc, Candidate]] = {}  # each allocation as a whole victim, made once
        self.listed: SortedKeys[str] = SortedKeys()
        self._tenant_used: dict[str, int] = {}
        self._by_tenant: dict[str, SortedKeys[tuple[int, str]]] = {}  # (-created, task id)
        self._maturing = ByTime()  # allocations of priority above 0 by when they were made
        # gpu -> (units, share, priority) -> (-created, id): the groups ``preemption.Ranked`` reads
        self._lower: dict[int, dict[GroupKey, SortedKeys[tuple[int, str]]]] = {}
        self.cpu_holders: dict[str, None] = {}
        self.elastic: dict[str, None] = {}
        self._notice_due = ByTime()
        self._wait_due = ByTime()
        self._immune_due = ByTime()

    def __repr__(self) -> str:
        return "<ledger index>"  # derived, not state

    def update(self, t: str) -> None:
        a = self._allocs.get(t)
        n = self._notices.get(t)
        w = self._waiting.get(t)
        wait = None if w is None or w.deadline >= self._never else w.deadline
        facts = _Facts(
            a, None if n is None else n.deadline, self._immune.get(t), wait, w is not None and w.suspended is not None
        )
        old = self._facts.get(t, _NONE)
        if old.alloc is a:
            if old == facts:
                return
            self._put_told(t, old, facts)  # the same allocation told, or no longer: the common change
        else:
            self._put(t, old, -1)
            self._made.pop(t, None)
            self._put(t, facts, 1)
        if facts == _NONE:
            self._facts.pop(t, None)
        else:
            self._facts[t] = facts

    def _put(self, t: str, f: _Facts, sign: int) -> None:
        """Index (sign 1) or unindex (-1) task ``t`` with facts ``f``."""

        add = sign > 0

        def put(keys: SortedKeys[Any], key: Any) -> None:
            keys.add(key) if add else keys.remove(key)

        def put_at(ids: ByTime, at: int) -> None:
            ids.add(at, t) if add else ids.remove(at, t)

        a = f.alloc
        if a is not None or f.suspended:
            put(self.listed, t)
        if a is not None:
            if a.tenant is not None:
                self._tenant_used[a.tenant] = self._tenant_used.get(a.tenant, 0) + sign * a.total
                put(self._by_tenant.setdefault(a.tenant, SortedKeys()), (-a.created_us, t))
            if a.priority > 0:
                put_at(self._maturing, a.created_us)
            for held, yes in ((self.cpu_holders, bool(a.cpus)), (self.elastic, bool(a.gpus_max))):
                if yes and sign > 0:
                    held[t] = None
                elif yes:
                    del held[t]
            if _lower(a):
                key = (a.total, a.share, a.priority)
                for g in a.gpus:
                    groups = self._lower.setdefault(g, {})
                    group = groups.setdefault(key, SortedKeys())
                    put(group, (-a.created_us, t))
                    if not group:
                        del groups[key]
        for due, at in ((self._notice_due, f.notice_deadline), (self._wait_due, f.wait_deadline)):
            if at is not None:
                put_at(due, at)
        if f.immune_until is not None:
            put_at(self._immune_due, f.immune_until)

    def _put_told(self, t: str, old: _Facts, new: _Facts) -> None:
        """The allocation (or the wait) is the same: only a notice, immunity or wait changed."""
        a = new.alloc
        if a is None and old.suspended != new.suspended:  # (with an allocation it is listed either way)
            self.listed.add(t) if new.suspended else self.listed.remove(t)
        for due, was, now in (
            (self._notice_due, old.notice_deadline, new.notice_deadline),
            (self._wait_due, old.wait_deadline, new.wait_deadline),
            (self._immune_due, old.immune_until, new.immune_until),
        ):
            if was != now:
                if was is not None:
                    due.remove(was, t)
                if now is not None:
                    due.add(now, t)

    # --- reading ------------------------------------------------------------

    def tenant_usage(self, tenant: str) -> int:
        return self._tenant_used.get(tenant, 0)

    def newest_of(self, tenant: str) -> Iterator[str]:
        """The tenant's allocations, newest first (ties: the lower task id)."""
        return (t for _, t in self._by_tenant.get(tenant, ()))

    def first_maturity(self, after: int, min_runtime: int) -> int | None:
        """The earliest time after ``after`` when an allocation of priority above 0 reaches its minimum runtime."""
        made = self._maturing.first_after(after - min_runtime)
        return None if made is None else made + min_runtime

    def due_notices(self, now: int) -> list[str]:
        return self._notice_due.until(now)

    def due_waits(self, now: int) -> list[str]:
        return self._wait_due.until(now)

    def due_immunities(self, now: int) -> list[str]:
        return self._immune_due.until(now)

    def first_deadlines(self) -> list[int]:
        """The first deadline of notices and of waits (those there are)."""
        return [at for due in (self._notice_due, self._wait_due) if (at := due.first()) is not None]

    def first_immunity_after(self, after: int) -> int | None:
        return self._immune_due.first_after(after)

    def victim(self, a: _Alloc) -> Candidate:
        """``a`` as a whole victim, made once per allocation (a plan may read thousands)."""
        held = self._made.get(a.task_id)
        if held is None or held[0] is not a:
            held = self._made[a.task_id] = (a, as_victim(a, PreemptReason.PRIORITY, a.gpus))
        return held[1]

    def lower_pool(self, priority: int, mature: int, reachable: Container[str], skip: set[str]) -> VictimPool:
        return VictimPool(self, priority, mature, reachable, skip)


class _Group:
    """One group of a GPU for one request: its mature (or priority 0), eligible allocations."""

    __slots__ = ("_keys", "_cut", "_pool")

    def __init__(self, keys: SortedKeys[tuple[int, str]], cut: tuple[int, str] | None, pool: VictimPool) -> None:
        self._keys, self._cut, self._pool = keys, cut, pool

    def newest(self) -> Iterator[Candidate]:
        return self._pool._made(self._keys.from_(self._cut) if self._cut is not None else iter(self._keys))

    def oldest(self) -> Iterator[Candidate]:
        return self._pool._made(self._keys.down_to(self._cut))


class VictimPool:
    """The allocations of priority below ``priority`` that a request may take back whole, mature
    by ``mature`` (or of priority 0), reachable, without a notice or immunity and not in ``skip``:
    ``preemption.Ranked``, read from the index as far as the choice reads."""

    def __init__(
        self,
        index: LedgerIndex,
        priority: int,
        mature: int,
        reachable: Container[str],
        skip: set[str],
    ) -> None:
        self._index, self._priority, self._mature = index, priority, mature
        notices, immune = index._notices, index._immune
        self._ok: Callable[[str], bool] = lambda t: (
            t in reachable and t not in notices and t not in immune and t not in skip
        )

    def _made(self, keys: Iterator[tuple[int, str]]) -> Iterator[Candidate]:
        allocs, victim, ok = self._index._allocs, self._index.victim, self._ok
        return (victim(allocs[t]) for _, t in keys if ok(t))

    def on(self, gpu: int) -> dict[GroupKey, Group]:
        cut = (-self._mature, "")  # (-created, id) from here on: made by ``mature``
        return {
            k: _Group(keys, cut if k[2] else None, self)
            for k, keys in self._index._lower.get(gpu, {}).items()
            if k[2] < self._priority
        }

    def with_cpus(self) -> list[Candidate]:
        index, out = self._index, []
        for t in index.cpu_holders:
            a = index._allocs[t]
            if _lower(a) and a.priority < self._priority and (not a.priority or a.created_us <= self._mature):
                if self._ok(t):
                    out.append(index.victim(a))
        return out
