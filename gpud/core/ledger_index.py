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

What only the listing and taking back read (the paged listing, per tenant newest first, the
maturing, the groups a request may take back whole, the counts per GPU and the allocations without a
notice) is brought up to date when read (``_fresh``, behind each reader), not at each change: a
change marks the task stale with the facts indexed there and a change back unmarks it, so an
allocation made and freed while nobody lists or takes anything back costs a dict's insert and delete.

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
    plain: bool = False  # an allocation (or nothing) with no notice, rest or wait: the common facts


_NONE = _Facts(None, None, None, None, False, plain=True)


def _apart(a: _Facts, b: _Facts) -> bool:
    """Whether what ``_fresh`` indexes differs between facts ``a`` and ``b``."""
    return (
        a.alloc is not b.alloc
        or a.suspended is not b.suspended
        or (a.notice is None) is not (b.notice is None)
        or (a.immune_until is None) is not (b.immune_until is None)
    )


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
        "_listed",
        "_tenant_used",
        "_tenant_newest",
        "_made_at",
        "_groups",
        "cpu_holders",
        "elastic",
        "_notice_due",
        "_wait_due",
        "_immune_due",
        "_held_on",
        "_untold",
        "_immune_on",
        "_tenant_on",
        "_stale",
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
        self._tenant_used: dict[str, int] = {}
        # Read only by the listing and taking back, brought up to date when read (``_fresh``).
        self._listed: SortedKeys[str] = SortedKeys()
        self._tenant_newest: dict[str, SortedKeys[tuple[int, str]]] = {}  # (-created, task id)
        self._made_at = ByTime()  # allocations of priority above 0 by when they were made
        self._groups: dict[int, dict[GroupKey, SortedKeys[tuple[int, str]]]] = {}
        self._held_on: dict[int, int] = {}
        self._untold: dict[int, SortedKeys[str]] = {}
        self._immune_on: dict[int, int] = {}
        self._tenant_on: dict[int, dict[str, int]] = {}
        self._stale: dict[str, _Facts] = {}  # task id -> its facts as those indexes hold them
        self.cpu_holders: dict[str, None] = {}
        self.elastic: dict[str, None] = {}
        self._notice_due = ByTime()
        self._wait_due = ByTime()
        self._immune_due = ByTime()
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
        immune = self.immune.get(t)
        old = self._facts.get(t, _NONE)
        if w is None and n is None and immune is None and old.plain:  # an allocation made or freed, alone
            if old.alloc is a:
                return
            facts = _NONE if a is None else _Facts(a, None, None, None, False, plain=True)
            if old.alloc is not None:
                self._put_alloc(t, old.alloc, -1)
            if a is not None:
                self._put_alloc(t, a, 1)
                self._facts[t] = facts
            else:
                del self._facts[t]
            self._mark_stale(t, old, facts)
            return
        if w is None:
            plain = n is None and immune is None
            facts = _NONE if plain and a is None else _Facts(a, n, immune, None, False, plain=plain)
        else:
            wait = None if w.deadline >= self._never else w.deadline
            parked = None
            if w.suspended is not None:
                r = w.request
                parked = ((-r.priority, w.seq, t), min(r.gpus, UNIT), r.pinned)
            facts = _Facts(a, n, immune, wait, w.suspended is not None, w.plan, parked)
        if old.alloc is a and old == facts:
            return
        if _apart(old, facts):
            self._mark_stale(t, old, facts)
        self._put(t, old, facts)
        if facts == _NONE:
            self._facts.pop(t, None)
        else:
            self._facts[t] = facts

    def _put(self, t: str, old: _Facts, new: _Facts) -> None:
        """Index ``t`` by its facts ``new`` where it was indexed by ``old`` (all but what ``_fresh``
        brings up to date when read)."""
        a, b = old.alloc, new.alloc
        if a is not b:
            if a is not None:
                self._put_alloc(t, a, -1)
            if b is not None:
                self._put_alloc(t, b, 1)
        if old.notice != new.notice:
            if old.notice is not None:
                self._put_notice(t, old.notice, False)
            if new.notice is not None:
                self._put_notice(t, new.notice, True)
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

    def _put_alloc(self, t: str, a: Alloc, sign: int) -> None:
        """Index (sign 1) or unindex (-1) allocation ``a`` of ``t``: what placement and every call read."""
        if a.tenant is not None:
            self._tenant_used[a.tenant] = self._tenant_used.get(a.tenant, 0) + sign * a.total
        if not (a.cpus or a.gpus_max):
            return
        for held, yes in ((self.cpu_holders, a.cpus), (self.elastic, a.gpus_max)):
            if yes and sign > 0:
                held[t] = None
            elif yes:
                del held[t]

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

    # --- what only the listing and taking back read: brought up to date when read ----------------

    def _mark_stale(self, t: str, old: _Facts, new: _Facts) -> None:
        """``t``'s facts that ``_fresh`` indexes change from ``old`` to ``new``."""
        stale = self._stale
        held = stale.get(t)
        if held is None:
            stale[t] = old
        elif not _apart(held, new):
            del stale[t]  # back to what is indexed there

    def _fresh(self) -> None:
        """Bring what only the listing and taking back read up to date with the facts."""
        stale = self._stale
        if not stale:
            return
        self._stale = {}
        facts = self._facts
        for t, held in stale.items():
            self._put_takeback(t, held, -1)
            self._put_takeback(t, facts.get(t, _NONE), 1)

    def _put_takeback(self, t: str, f: _Facts, sign: int) -> None:
        """Index (sign 1) or unindex (-1) task ``t`` with facts ``f`` where ``_fresh`` does."""
        a = f.alloc
        add = sign > 0
        if a is not None or f.suspended:
            self._listed.add(t) if add else self._listed.remove(t)
        if a is None:
            return
        key = (-a.created_us, t)
        if a.tenant is not None:
            newest = self._tenant_newest.setdefault(a.tenant, SortedKeys())
            newest.add(key) if add else newest.remove(key)
        if runs_minimum(a.priority):
            self._made_at.add(a.created_us, t) if add else self._made_at.remove(a.created_us, t)
        if takes_whole(a):
            group_key = (a.total, a.share, a.priority)
            for g in a.gpus:
                groups = self._groups.setdefault(g, {})
                group = groups.setdefault(group_key, SortedKeys())
                group.add(key) if add else group.remove(key)
                if not group:
                    del groups[group_key]
        for g in a.gpus:
            _count(self._held_on, g, sign)
            if a.tenant is not None:
                _count(self._tenant_on.setdefault(g, {}), a.tenant, sign * a.share)
                if not self._tenant_on[g]:
                    del self._tenant_on[g]
            if f.notice is None:
                keys = self._untold.setdefault(g, SortedKeys())
                keys.add(t) if add else keys.remove(t)
                if not keys:
                    del self._untold[g]
            if f.immune_until is not None:
                _count(self._immune_on, g, sign)

    @property
    def listed(self) -> SortedKeys[str]:  # the running and suspended allocations by task id
        self._fresh()
        return self._listed

    @property
    def lower_groups(self) -> dict[int, dict[GroupKey, SortedKeys[tuple[int, str]]]]:
        """Per GPU and (units, share, priority), the allocations a request may take back whole, as
        (-created, task id): the groups ``preemption.Ranked`` reads."""
        self._fresh()
        return self._groups

    @property
    def held_on(self) -> dict[int, int]:  # GPU -> how many allocations hold it
        self._fresh()
        return self._held_on

    @property
    def untold(self) -> dict[int, SortedKeys[str]]:  # GPU -> its allocations without a notice
        self._fresh()
        return self._untold

    @property
    def immune_on(self) -> dict[int, int]:  # GPU -> how many of its allocations are immune
        self._fresh()
        return self._immune_on

    @property
    def tenant_on(self) -> dict[int, dict[str, int]]:  # GPU -> tenant -> units its allocations hold
        self._fresh()
        return self._tenant_on

    @property
    def _maturing(self) -> ByTime:  # the allocations of priority above 0 by when they were made
        self._fresh()
        return self._made_at

    # --- reading ------------------------------------------------------------

    def tenant_usage(self, tenant: str) -> int:
        return self._tenant_used.get(tenant, 0)

    def newest_of(self, tenant: str) -> Iterator[str]:
        """The tenant's allocations, newest first (ties: the lower task id)."""
        self._fresh()
        return (t for _, t in self._tenant_newest.get(tenant, ()))

    def first_maturity(self, after: int, min_runtime: int) -> int | None:
        """The earliest time after ``after`` when an allocation of priority above 0 reaches its minimum runtime."""
        made = self._maturing.first_after(after - min_runtime)  # (brought up to date)
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
