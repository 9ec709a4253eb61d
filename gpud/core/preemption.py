"""Choosing victims: which allocations to take back so that a waiting request fits.

Rules kept here:
- A request fits when, with the victims' devices given back, there is a GPU with room for its
  fraction (a fraction comes from one GPU) or as many entirely free GPUs as it asks, as many free
  CPU cores as it asks, and its tenant's quota allows it (the ledger's check, passed in).
- Candidates come in pools, tried in order: the GPUs elastic allocations got above their minimum
  (on loan: taken before anyone is preempted whole), allocations running on borrowed tenant quota
  when the request is within its own tenant's quota (the borrower's newest first), then
  allocations of strictly lower priority, ordered by the node's strategy:
  ``lowest_priority`` (equal priorities newest first), ``newest_first``, ``minimum_victims``
  (the fewest allocations, aimed at the GPU that needs the fewest), ``minimum_waste`` (the
  fewest GPU units freed beyond the need).
- Never more victims than needed: once the request fits, each victim is dropped again (the
  last chosen first) if the request still fits without it. No set that fits: no victims at all.

Pure: the ledger builds the candidates (who is eligible is its rule) and calls ``choose``.
Everything is in the ledger's fixed point (one GPU = ``UNIT``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from gpud_client.protocol import PreemptReason, PreemptStrategy
from gpud_client.units import GPU_UNIT as UNIT


class Candidate(NamedTuple):
    """Devices one allocation would give back if chosen (a tuple: a thousand are made per plan)."""

    task_id: str
    gpus: tuple[int, ...]  # the GPUs it gives back (all, or an elastic allocation's extras)
    share: int  # of each of them
    cpus: int  # CPU cores it gives back
    priority: int
    created: int
    whole: bool  # the whole allocation (False: only an elastic allocation's extras)
    reason: PreemptReason
    tenant: str | None = None

    @property
    def units(self) -> int:
        return self.share * len(self.gpus)


@dataclass(frozen=True, slots=True)
class Need:
    gpus: int  # fixed point: k * UNIT, or a fraction of one GPU
    cpus: int


@dataclass(slots=True)
class Room:
    """What is free now: share per GPU that may take new grants (draining GPUs left out), CPU cores."""

    free: dict[int, int]
    cpus: int


TenantCheck = Callable[[Sequence[Candidate]], bool] | None  # None: the request has no tenant to check


@dataclass(frozen=True, slots=True)
class Pool:
    """Candidates tried together, in the order of ``strategy``."""

    candidates: Sequence[Candidate]
    strategy: PreemptStrategy


class _Fit:
    """The room with a set of victims' devices given back, kept up to date as victims come and go:
    ``ok`` counts the GPUs that have room enough (a whole GPU, or the fraction asked)."""

    def __init__(self, need: Need, room: Room, tenant_ok: TenantCheck) -> None:
        self.need, self.room, self.tenant_ok = need, room, tenant_ok
        self.freed: dict[int, int] = {}
        self.cpus = 0
        self.target = need.gpus if 0 < need.gpus < UNIT else UNIT
        self.wanted = 0 if need.gpus == 0 else max(1, need.gpus // UNIT)
        self.ok = sum(1 for free in room.free.values() if free >= self.target)

    def add(self, c: Candidate, sign: int = 1) -> None:
        free = self.room.free
        for g in c.gpus:
            if g in free:
                before = free[g] + self.freed.get(g, 0)
                after = before + sign * c.share
                self.freed[g] = after - free[g]
                self.ok += (after >= self.target) - (before >= self.target)
        self.cpus += sign * c.cpus

    def free_on(self, g: int) -> int:
        return self.room.free[g] + self.freed.get(g, 0)

    def gpus_fit(self) -> bool:
        return self.ok >= self.wanted

    def fits(self, chosen: Sequence[Candidate] | Callable[[], Sequence[Candidate]]) -> bool:
        """Whether the request fits with ``chosen`` given back (a callable: made only if the tenant
        check needs the list)."""
        if not (self.gpus_fit() and self.room.cpus + self.cpus >= self.need.cpus):
            return False
        if self.tenant_ok is None:
            return True
        return self.tenant_ok(chosen() if callable(chosen) else chosen)


def choose(
    need: Need,
    room: Room,
    pools: Sequence[Pool],
    tenant_ok: TenantCheck,
) -> list[Candidate]:
    """The victims that let ``need`` fit, fewest by the rules above; [] when no set does."""
    fit = _Fit(need, room, tenant_ok)
    chosen: list[Candidate] = []
    last = len(pools) - 1
    for i, pool in enumerate(pools):
        if fit.fits(chosen):
            break
        if i == last:  # the strategy's pool: aimed at the GPUs that cost it least
            _aimed(fit, chosen, pool.candidates, pool.strategy)
        else:
            _greedy(fit, chosen, _ordered(pool.candidates, pool.strategy))
    if not fit.fits(chosen):
        return []
    dropped: set[int] = set()  # never more than needed: the last chosen are the dearest
    for i in range(len(chosen) - 1, -1, -1):
        fit.add(chosen[i], -1)
        dropped.add(i)
        if not fit.fits(lambda: [v for j, v in enumerate(chosen) if j not in dropped]):
            dropped.discard(i)
            fit.add(chosen[i])
    return [v for j, v in enumerate(chosen) if j not in dropped]


def _key(strategy: PreemptStrategy) -> Callable[[Candidate], tuple[int, ...]]:
    """The order victims are taken in on one GPU."""
    match strategy:
        case PreemptStrategy.NEWEST_FIRST:
            return lambda c: (-c.created, c.priority)
        case PreemptStrategy.MINIMUM_VICTIMS:
            return lambda c: (-c.share, c.priority, -c.created)
        case _:
            return lambda c: (c.priority, -c.created)


def _ordered(pool: Sequence[Candidate], strategy: PreemptStrategy) -> list[Candidate]:
    return sorted(pool, key=lambda c: (*_key(strategy)(c), c.task_id))


def _cost(victims: Sequence[Candidate], strategy: PreemptStrategy) -> tuple[Any, ...]:
    """What a set of victims costs under ``strategy``: the cheapest set is chosen."""
    count, units = len(victims), sum(c.units for c in victims)
    match strategy:
        case PreemptStrategy.MINIMUM_VICTIMS:
            return (count, units)
        case PreemptStrategy.MINIMUM_WASTE:
            return (units, count)
        case PreemptStrategy.NEWEST_FIRST:
            return (-min((c.created for c in victims), default=0), count)
        case _:  # the highest priority taken, then the next..., then the fewest, the newest
            return (
                sorted((c.priority for c in victims), reverse=True),
                count,
                -min((c.created for c in victims), default=0),
            )


def _bound(on: Sequence[Candidate], short: int, strategy: PreemptStrategy) -> tuple[Any, ...]:
    """No more than the cost (``_cost``) of any set of ``on`` that covers ``short``."""
    if short <= 0:
        return ()
    match strategy:
        case PreemptStrategy.MINIMUM_VICTIMS:
            return (1,)
        case PreemptStrategy.MINIMUM_WASTE:
            return (short,)
        case PreemptStrategy.NEWEST_FIRST:
            return (-max(c.created for c in on),)
        case _:
            return ([min(c.priority for c in on)],)


def _useful(fit: _Fit, c: Candidate) -> bool:
    """Whether ``c`` gives back something the request still lacks."""
    short_cpus = fit.room.cpus + fit.cpus < fit.need.cpus
    if c.cpus and short_cpus:
        return True
    if fit.gpus_fit() or not c.gpus:
        return False
    return any(g in fit.room.free for g in c.gpus)


def _greedy(fit: _Fit, chosen: list[Candidate], ordered: Sequence[Candidate]) -> None:
    for c in ordered:
        if fit.fits(chosen):
            return
        if _useful(fit, c):
            chosen.append(c)
            fit.add(c)


def _take(fit: _Fit, chosen: list[Candidate], victims: Sequence[Candidate]) -> None:
    for c in victims:
        chosen.append(c)
        fit.add(c)


def _aimed(fit: _Fit, chosen: list[Candidate], pool: Sequence[Candidate], strategy: PreemptStrategy) -> None:
    """Victims aimed at the GPUs that cost the least to make room on: for a fraction the one GPU
    whose cheapest cover costs least; for whole GPUs, one GPU after another, each emptied of what
    is left on it; then CPU cores (the most first for the fewest victims or the least waste)."""
    taken = {c.task_id for c in chosen if c.whole}  # an elastic one chosen for its extras may still go whole
    by_gpu: dict[int, list[Candidate]] = {}
    free = fit.room.free
    for c in pool:
        if taken and c.task_id in taken:
            continue
        for g in c.gpus:
            if g in free:
                on = by_gpu.get(g)
                if on is None:
                    by_gpu[g] = [c]
                else:
                    on.append(c)
    key = _key(strategy)
    if 0 < fit.need.gpus < UNIT and not fit.gpus_fit():
        best: list[Candidate] | None = None
        best_cost: tuple[Any, ...] = ()
        # Newest first: GPUs in the order of a bound no cover on them can beat (the newest there), so
        # that once a bound is above the best cost found, so is every later GPU's. The other costs'
        # bounds tie too often to pay for the sorting.
        newest = strategy == PreemptStrategy.NEWEST_FIRST
        gpus: Iterable[tuple[int, list[Candidate]]] = by_gpu.items()
        if newest:
            gpus = sorted(gpus, key=lambda item: _bound(item[1], fit.need.gpus - fit.free_on(item[0]), strategy))
        for g, on in gpus:
            short = fit.need.gpus - fit.free_on(g)
            if newest and best is not None and _bound(on, short, strategy) > best_cost:
                break
            picked = _cover(short, on, strategy, key)
            if picked is None:
                continue
            cost = _cost(picked, strategy)
            if best is None or cost < best_cost:
                best, best_cost = picked, cost
        _take(fit, chosen, best or [])
    elif fit.need.gpus >= UNIT:
        while not fit.gpus_fit():
            best = None
            for g, on in by_gpu.items():
                short = UNIT - fit.free_on(g)
                if short <= 0:
                    continue
                rest = [c for c in on if c.task_id not in taken] if taken else on
                if sum(c.share for c in rest) < short:
                    continue
                cost = _cost(rest, strategy)
                if best is None or cost < best_cost:
                    best, best_cost = rest, cost
            if best is None:
                break
            taken.update(c.task_id for c in best)
            _take(fit, chosen, best)
    if strategy in (PreemptStrategy.MINIMUM_VICTIMS, PreemptStrategy.MINIMUM_WASTE):
        rest = sorted((c for c in pool if c.task_id not in taken and c.cpus), key=lambda c: (-c.cpus, *key(c)))
    else:  # the strategy's own order: the lowest priorities, or the newest
        rest = sorted((c for c in pool if c.task_id not in taken and c.cpus), key=key)
    _greedy(fit, chosen, rest)


def _cover(
    short: int, on: Sequence[Candidate], strategy: PreemptStrategy, key: Callable[[Candidate], tuple[int, ...]]
) -> list[Candidate] | None:
    """Victims on one GPU whose shares add up to ``short``, in the strategy's order; for the least
    waste, the smallest single one that covers, else the largest first while they fit under what
    is short, then the smallest that covers the rest."""
    if short <= 0:
        return []
    if sum(c.share for c in on) < short:
        return None
    picked: list[Candidate] = []
    got = 0
    if strategy != PreemptStrategy.MINIMUM_WASTE:
        for c in sorted(on, key=key):
            if got >= short:
                break
            picked.append(c)
            got += c.share
        return picked
    ordered = sorted(on, key=lambda c: (c.share * len(c.gpus), c.priority, -c.created))
    taken: set[str] = set()
    for c in reversed(ordered):
        if got + c.share <= short:
            picked.append(c)
            taken.add(c.task_id)
            got += c.share
    if got < short:
        covering = next((c for c in ordered if c.task_id not in taken and got + c.share >= short), None)
        if covering is not None:
            picked.append(covering)
        else:
            for c in reversed(ordered):
                if c.task_id not in taken and got < short:
                    picked.append(c)
                    got += c.share
    return picked
