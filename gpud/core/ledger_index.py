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
- per GPU, how many allocations hold it, how many of them are immune, their units per tenant, and
  those without a notice by task id: whether a GPU can be emptied is counted, not walked, and a
  drain tells the next few;
- the running notices by the waiter they were given for, and a drain's by the GPUs they name; the
  victims planned for each waiter and not told yet (nobody else may choose them), and the waiters
  with such a plan: batches read on;
- the suspended allocations waiting for their GPUs (uncapped: thousands of victims may suspend), in
  the queue's order, and per GPU they wait for and share they need: serving reads only those whose
  GPU has room for them;
- deadlines of notices, waits and immunities (``advance`` and ``next_deadline`` read the first);
- the allocations that hold CPU cores (at most the node's cores) and the elastic ones.

``gpud.core.victim_pool`` reads these indexes in bulk as a choice takes victims by the thousand.

The facts kept per task (``_Facts``) hold no reference cycle, so the garbage collector does not
track them: 20 000 allocations do not lengthen its full collections.

Never: decide anything (the rules are the ledger's and ``gpud.core.preemption``'s); read another
task's facts while indexing one; be read between a change of the ledger's dicts and its ``update``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import msgspec

from gpud.core.preemption import Candidate, GroupKey
from gpud.core.shields import by_terms, runs_minimum
from gpud.core.sortedkeys import ByTime, SortedKeys
from gpud_client.protocol import PreemptReason, Recovery
from gpud_client.units import GPU_UNIT as UNIT


class Alloc(Protocol):
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


class _Told(Protocol):
    """What the index reads of a ``gpud.core.ledger.Notice``."""

    @property
    def deadline(self) -> int: ...
    @property
    def by(self) -> str: ...
    @property
    def gpus(self) -> tuple[int, ...]: ...


class _Request(Protocol):
    @property
    def gpus(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def pinned(self) -> tuple[int, ...]: ...


class _Wait(Protocol):
    @property
    def request(self) -> _Request: ...
    @property
    def deadline(self) -> int: ...
    @property
    def suspended(self) -> object | None: ...
    @property
    def plan(self) -> tuple[str, ...]: ...
    @property
    def seq(self) -> int: ...


Queued = tuple[int, int, str]  # (-priority, seq, task id): a waiter's place in the queue


DRAIN = "drain"  # the ``by`` of a drain's notices


def as_victim(a: Alloc, reason: PreemptReason, gpus: tuple[int, ...]) -> Candidate:
    whole = gpus == a.gpus
    return Candidate(
        a.task_id, gpus, a.share, len(a.cpus) if whole else 0, a.priority, a.created_us, whole, reason, a.tenant
    )


class _Facts(msgspec.Struct, frozen=True, gc=False):
    alloc: Any  # Alloc | None
    notice: Any  # _Told | None
    immune_until: int | None
    wait_deadline: int | None  # None: no wait, or one without a deadline
    suspended: bool
    plan: tuple[str, ...] = ()  # a waiter's victims not told yet
    parked: Any = None  # a suspended allocation's wait: ((-priority, seq, task id), share, pinned GPUs)


_NONE = _Facts(None, None, None, None, False)


def takes_whole(a: Alloc) -> bool:
    """Whether a request of a higher priority may ever take it back whole, by its terms (the rule's
    part in ``gpud.core.shields``; one that only shrinks never is): once it is mature, when nothing
    keeps it away (the ledger's ``takeback.away``) and someone can be told (the shell's
    ``reachable``). Those change with time or often (10 000 notices at once): read when choosing."""
    return by_terms(a) is None and a.on_preempt != Recovery.SHRINK


class LedgerIndex:
    __slots__ = (
        "allocs",
        "notices",
        "immune",
        "_waiting",
        "_never",
        "_facts",
        "listed",
        "_tenant_used",
        "_by_tenant",
        "_maturing",
        "lower_groups",
        "cpu_holders",
        "elastic",
        "_notice_due",
        "_wait_due",
        "_immune_due",
        "held_on",
        "untold",
        "immune_on",
        "tenant_on",
        "told",
        "drain_on",
        "chosen",
        "planning",
        "parked",
        "parked_order",
        "reads",
    )

    def __init__(
        self,
        allocs: Mapping[str, Alloc],
        notices: Mapping[str, _Told],
        immune: Mapping[str, int],
        waiting: Mapping[str, _Wait],
        never: int,
    ) -> None:
        self.allocs, self.notices, self.immune, self._waiting = allocs, notices, immune, waiting
        self._never = never
        self._facts: dict[str, _Facts] = {}
        self.reads = 0  # allocations made into candidates: what choosing read
        self.listed: SortedKeys[str] = SortedKeys()
        self._tenant_used: dict[str, int] = {}
        self._by_tenant: dict[str, SortedKeys[tuple[int, str]]] = {}  # (-created, task id)
        self._maturing = ByTime()  # allocations of priority above 0 by when they were made
        # gpu -> (units, share, priority) -> (-created, id): the groups ``preemption.Ranked`` reads
        self.lower_groups: dict[int, dict[GroupKey, SortedKeys[tuple[int, str]]]] = {}
        self.cpu_holders: dict[str, None] = {}
        self.elastic: dict[str, None] = {}
        self._notice_due = ByTime()
        self._wait_due = ByTime()
        self._immune_due = ByTime()
        self.held_on: dict[int, int] = {}  # gpu -> how many allocations hold it
        self.untold: dict[int, SortedKeys[str]] = {}  # gpu -> its allocations without a notice
        self.immune_on: dict[int, int] = {}  # gpu -> how many of its allocations are immune
        self.tenant_on: dict[int, dict[str, int]] = {}  # gpu -> tenant -> units its allocations hold
        self.told: dict[str, SortedKeys[str]] = {}  # waiter (or "idle") -> the allocations told for it
        self.drain_on: dict[int, SortedKeys[str]] = {}  # gpu -> the allocations a drain's notice names it for
        self.chosen: dict[str, str] = {}  # victim planned, not told yet -> its waiter
        self.planning: dict[str, None] = {}  # the waiters with victims planned, not told yet
        self.parked_order: SortedKeys[Queued] = SortedKeys()  # the suspended allocations waiting, in order
        self.parked: dict[int, dict[int, SortedKeys[Queued]]] = {}  # gpu -> share -> those waiting for it

    def __repr__(self) -> str:
        return "<ledger index>"  # derived, not state

    def update(self, t: str) -> None:
        a = self.allocs.get(t)
        n = self.notices.get(t)
        w = self._waiting.get(t)
        wait = None if w is None or w.deadline >= self._never else w.deadline
        suspended = w is not None and w.suspended is not None
        parked = None
        if w is not None and suspended:
            r = w.request
            parked = ((-r.priority, w.seq, t), min(r.gpus, UNIT), r.pinned)
        facts = _Facts(a, n, self.immune.get(t), wait, suspended, () if w is None else w.plan, parked)
        old = self._facts.get(t, _NONE)
        if old.alloc is a:
            if old == facts:
                return
            self._put_told(t, old, facts)  # the same allocation told, or no longer: the common change
        else:
            self._put(t, old, -1)
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
            if runs_minimum(a.priority):
                put_at(self._maturing, a.created_us)
            for held, yes in ((self.cpu_holders, bool(a.cpus)), (self.elastic, bool(a.gpus_max))):
                if yes and sign > 0:
                    held[t] = None
                elif yes:
                    del held[t]
            if takes_whole(a):
                key = (a.total, a.share, a.priority)
                for g in a.gpus:
                    groups = self.lower_groups.setdefault(g, {})
                    group = groups.setdefault(key, SortedKeys())
                    put(group, (-a.created_us, t))
                    if not group:
                        del groups[key]
            for g in a.gpus:
                _count(self.held_on, g, sign)
                if a.tenant is not None:
                    _count(self.tenant_on.setdefault(g, {}), a.tenant, sign * a.share)
                    if not self.tenant_on[g]:
                        del self.tenant_on[g]
            if f.notice is None:
                self._put_untold(t, a, add)
            if f.immune_until is not None:
                for g in a.gpus:
                    _count(self.immune_on, g, sign)
        if f.notice is not None:
            self._put_notice(t, f.notice, add)
        if f.plan:
            self._put_plan(t, f.plan if add else (), () if add else f.plan)
            if add:
                self.planning[t] = None
            else:
                del self.planning[t]
        if f.parked is not None:
            self._put_parked(f.parked, add)
        if f.notice is not None:
            put_at(self._notice_due, f.notice.deadline)
        if f.wait_deadline is not None:
            put_at(self._wait_due, f.wait_deadline)
        if f.immune_until is not None:
            put_at(self._immune_due, f.immune_until)

    def _put_told(self, t: str, old: _Facts, new: _Facts) -> None:
        """The allocation (or the wait) is the same: only a notice, immunity, wait or plan changed."""
        a = new.alloc
        if a is None and old.suspended != new.suspended:  # (with an allocation it is listed either way)
            self.listed.add(t) if new.suspended else self.listed.remove(t)
        if old.notice != new.notice:
            if old.notice is not None:
                self._put_notice(t, old.notice, False)
            if new.notice is not None:
                self._put_notice(t, new.notice, True)
            if a is not None and (old.notice is None) != (new.notice is None):
                self._put_untold(t, a, new.notice is None)
        if a is not None and (old.immune_until is None) != (new.immune_until is None):
            for g in a.gpus:
                _count(self.immune_on, g, 1 if new.immune_until is not None else -1)
        if old.plan != new.plan:
            self._put_plan(t, new.plan, old.plan)
            if new.plan and not old.plan:
                self.planning[t] = None
            elif old.plan and not new.plan:
                del self.planning[t]
        if old.parked != new.parked:
            if old.parked is not None:
                self._put_parked(old.parked, False)
            if new.parked is not None:
                self._put_parked(new.parked, True)
        for due, was, now in (
            (self._notice_due, _deadline(old.notice), _deadline(new.notice)),
            (self._wait_due, old.wait_deadline, new.wait_deadline),
            (self._immune_due, old.immune_until, new.immune_until),
        ):
            if was != now:
                if was is not None:
                    due.remove(was, t)
                if now is not None:
                    due.add(now, t)

    def _put_untold(self, t: str, a: Alloc, add: bool) -> None:
        for g in a.gpus:
            keys = self.untold.setdefault(g, SortedKeys())
            keys.add(t) if add else keys.remove(t)
            if not keys:
                del self.untold[g]

    def _put_notice(self, t: str, n: _Told, add: bool) -> None:
        """A running notice, by its waiter (a drain's by each GPU it names)."""
        places: Iterable[tuple[dict[Any, SortedKeys[str]], Any]]
        places = ((self.drain_on, g) for g in n.gpus) if n.by == DRAIN else ((self.told, n.by),)
        for where, key in places:
            keys = where.setdefault(key, SortedKeys())
            keys.add(t) if add else keys.remove(t)
            if not keys:
                del where[key]

    def _put_plan(self, t: str, new: tuple[str, ...], old: tuple[str, ...]) -> None:
        """The victims planned for waiter ``t`` and not told yet: ``old`` then, ``new`` now. A plan
        shrinks from the front as its victims are told: only those told are taken out."""
        if len(new) <= len(old) and old[len(old) - len(new) :] == new:
            old = old[: len(old) - len(new)]
            new = ()
        chosen = self.chosen
        for v in old:
            del chosen[v]
        if new and not chosen:
            self.chosen = dict.fromkeys(new, t)  # (one pass: the common case, one waiter's plan)
        elif new:
            chosen.update(dict.fromkeys(new, t))

    def _put_parked(self, parked: tuple[Queued, int, tuple[int, ...]], add: bool) -> None:
        queued, share, pinned = parked
        self.parked_order.add(queued) if add else self.parked_order.remove(queued)
        for g in pinned:
            by_share = self.parked.setdefault(g, {})
            keys = by_share.setdefault(share, SortedKeys())
            keys.add(queued) if add else keys.remove(queued)
            if not keys:
                del by_share[share]
                if not by_share:
                    del self.parked[g]

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

    def due_notices(self, now: int, limit: int | None = None) -> list[str]:
        return self._notice_due.until(now, limit)

    def due_waits(self, now: int) -> list[str]:
        return self._wait_due.until(now)

    def due_immunities(self, now: int, limit: int | None = None) -> list[str]:
        return self._immune_due.until(now, limit)

    def first_deadlines(self) -> list[int]:
        """The first deadline of notices and of waits (those there are)."""
        return [at for due in (self._notice_due, self._wait_due) if (at := due.first()) is not None]

    def first_immunity_after(self, after: int) -> int | None:
        return self._immune_due.first_after(after)

    def first_immunity(self) -> int | None:
        return self._immune_due.first()

    def victim(self, a: Alloc) -> Candidate:
        """``a`` as a whole victim (made when read, not kept: a plan may read thousands)."""
        self.reads += 1
        return as_victim(a, PreemptReason.PRIORITY, a.gpus)


def _count(counts: dict[Any, int], key: Any, by: int) -> None:
    n = counts.get(key, 0) + by
    if n:
        counts[key] = n
    else:
        del counts[key]


def _deadline(n: _Told | None) -> int | None:
    return None if n is None else n.deadline
