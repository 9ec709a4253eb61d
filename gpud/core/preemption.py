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

Ties between candidates of equal cost go to the lower task id, and between GPUs to the lower index:
never to the order in which the candidates came (after a restart or a rollback it differs).

Pure: the ledger builds the candidates (who is eligible is its rule) and calls ``choose``. The
strategy's pool may be ``Ranked`` rather than listed: per GPU, groups of candidates of equal units,
share and priority, each newest first, which are read in the strategy's order only as far as the
choice needs (a fraction needs the cheapest few of 20 000). Everything is in the ledger's fixed
point (one GPU = ``UNIT``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from heapq import merge
from typing import Any, NamedTuple, Protocol

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


GroupKey = tuple[int, int, int]  # (units, share, priority)


class Group(Protocol):
    """The candidates on one GPU of one ``GroupKey``: newest first (ties: the lower task id), or
    the reverse. Each is read only as far as needed."""

    def newest(self) -> Iterator[Candidate]: ...

    def oldest(self) -> Iterator[Candidate]: ...


class Ranked(Protocol):
    """A pool read as far as needed: per GPU its candidates by ``GroupKey``, and those that give
    back CPU cores (in any order)."""

    def on(self, gpu: int) -> Mapping[GroupKey, Group]: ...

    def with_cpus(self) -> Iterable[Candidate]: ...


@dataclass(frozen=True, slots=True)
class Pool:
    """Candidates tried together, in the order of ``strategy`` (only the last pool may be ``Ranked``)."""

    candidates: Sequence[Candidate] | Ranked
    strategy: PreemptStrategy


class _ListedGroup:
    def __init__(self) -> None:
        self.candidates: list[Candidate] = []

    def newest(self) -> Iterator[Candidate]:
        return iter(self.candidates)

    def oldest(self) -> Iterator[Candidate]:
        return reversed(self.candidates)


class _Listed:
    """A listed pool read as ``Ranked``."""

    def __init__(self, pool: Sequence[Candidate]) -> None:
        self.by_gpu: dict[int, dict[GroupKey, _ListedGroup]] = {}
        for c in pool:
            for g in c.gpus:
                groups = self.by_gpu.setdefault(g, {})
                groups.setdefault((c.units, c.share, c.priority), _ListedGroup()).candidates.append(c)
        for groups in self.by_gpu.values():
            for group in groups.values():
                group.candidates.sort(key=_newest)
        self.cpus = [c for c in pool if c.cpus]

    def on(self, gpu: int) -> Mapping[GroupKey, Group]:
        return self.by_gpu.get(gpu, {})

    def with_cpus(self) -> Iterable[Candidate]:
        return self.cpus


def _newest(c: Candidate) -> tuple[Any, ...]:
    """The order within a group, and between groups where the strategy's order leaves a tie."""
    return (-c.created, c.priority, c.task_id)


def _runs(groups: Mapping[GroupKey, Group], by: Callable[[GroupKey], tuple[int, ...]]) -> list[list[GroupKey]]:
    """The groups' keys in runs of equal ``by``, the runs in ascending order."""
    runs: dict[tuple[int, ...], list[GroupKey]] = {}
    for k in groups:
        runs.setdefault(by(k), []).append(k)
    return [runs[r] for r in sorted(runs)]


def _in_order(groups: Mapping[GroupKey, Group], strategy: PreemptStrategy) -> Iterator[Candidate]:
    """The candidates of ``groups`` in ``rank(strategy)``'s order, made as they are read: the
    groups in the order of the strategy's key, those it does not tell apart merged newest first."""
    match strategy:
        case PreemptStrategy.NEWEST_FIRST:  # (-created, priority, id)
            by: Callable[[GroupKey], tuple[int, ...]] = lambda k: ()  # noqa: E731
        case PreemptStrategy.MINIMUM_VICTIMS:  # (-share, priority, -created, id)
            by = lambda k: (-k[1], k[2])  # noqa: E731
        case _:  # (priority, -created, id)
            by = lambda k: (k[2],)  # noqa: E731
    for run in _runs(groups, by):
        if len(run) == 1:
            yield from groups[run[0]].newest()
        else:
            yield from merge(*(groups[k].newest() for k in run), key=_newest)


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
        candidates = pool.candidates
        if i == last:  # the strategy's pool: aimed at the GPUs that cost it least
            ranked = _Listed(candidates) if isinstance(candidates, Sequence) else candidates
            _aimed(fit, chosen, ranked, pool.strategy)
        else:
            assert isinstance(candidates, Sequence), "only the strategy's pool may be ranked"
            _greedy(fit, chosen, _ordered(candidates, pool.strategy))
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


def rank(strategy: PreemptStrategy) -> Callable[[Candidate], tuple[Any, ...]]:
    """The order victims are taken in on one GPU, ties to the lower task id."""
    key = _key(strategy)
    return lambda c: (*key(c), c.task_id)


def _ordered(pool: Sequence[Candidate], strategy: PreemptStrategy) -> list[Candidate]:
    return sorted(pool, key=rank(strategy))


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


def _aimed(fit: _Fit, chosen: list[Candidate], pool: Ranked, strategy: PreemptStrategy) -> None:
    """Victims aimed at the GPUs that cost the least to make room on: for a fraction the one GPU
    whose cheapest cover costs least; for whole GPUs, one GPU after another, each emptied of what
    is left on it; then CPU cores (the most first for the fewest victims or the least waste)."""
    taken = {c.task_id for c in chosen if c.whole}  # an elastic one chosen for its extras may still go whole
    gpus = sorted(fit.room.free)
    key = rank(strategy)
    if 0 < fit.need.gpus < UNIT and not fit.gpus_fit():
        cover = _cheapest_cover(fit, pool, gpus, taken, strategy)
        taken.update(c.task_id for c in cover)
        _take(fit, chosen, cover)
    elif fit.need.gpus >= UNIT:
        by_gpu = {g: on for g in gpus if (on := [c for c in _in_order(pool.on(g), strategy) if c.task_id not in taken])}
        while not fit.gpus_fit():
            best: list[Candidate] | None = None
            best_cost: tuple[Any, ...] = ()
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
    cpus = [c for c in pool.with_cpus() if c.task_id not in taken and c.cpus]
    if strategy in (PreemptStrategy.MINIMUM_VICTIMS, PreemptStrategy.MINIMUM_WASTE):
        rest = sorted(cpus, key=lambda c: (-c.cpus, *key(c)))
    else:  # the strategy's own order: the lowest priorities, or the newest
        rest = sorted(cpus, key=key)
    _greedy(fit, chosen, rest)


def _cheapest_cover(
    fit: _Fit, pool: Ranked, gpus: list[int], taken: set[str], strategy: PreemptStrategy
) -> list[Candidate]:
    """For a fraction: the cover of the GPU where it costs least ([] when none covers). Each GPU's
    candidates are read in the strategy's order only until they cover (but for the least waste)."""
    best: list[Candidate] | None = None
    best_cost: tuple[Any, ...] = ()
    ranked: Iterable[tuple[int, Iterator[Candidate]]] = (
        (g, (c for c in _in_order(pool.on(g), strategy) if c.task_id not in taken)) for g in gpus
    )
    newest = strategy == PreemptStrategy.NEWEST_FIRST
    if newest:
        # GPUs in the order of a bound no cover on them can beat (the newest there), so that once a
        # bound is above the best cost found, so is every later GPU's. The other costs' bounds tie
        # too often to pay for reading the GPUs ahead.
        heads = []
        for g, on in ranked:
            first = next(on, None)
            if first is not None:
                heads.append(((-first.created,), g, first, on))
        heads.sort(key=lambda h: (h[0], h[1]))
        ranked = ((g, _prepend(first, on)) for _, g, first, on in heads)
        bounds = {g: bound for bound, g, _, _ in heads}
    for g, on in ranked:
        short = fit.need.gpus - fit.free_on(g)
        if newest and best is not None and bounds[g] > best_cost:
            break
        if strategy == PreemptStrategy.MINIMUM_WASTE:
            picked = _waste_cover(short, pool.on(g), taken)
        else:
            picked = _prefix(short, on)
        if picked is None:
            continue
        cost = _cost(picked, strategy)
        if best is None or cost < best_cost:
            best, best_cost = picked, cost
    return best or []


def _prepend(first: Candidate, rest: Iterator[Candidate]) -> Iterator[Candidate]:
    yield first
    yield from rest


def _prefix(short: int, on: Iterable[Candidate]) -> list[Candidate] | None:
    """The first victims (in the strategy's order) whose shares add up to ``short``; None: all do not."""
    picked: list[Candidate] = []
    got = 0
    if short <= 0:
        return picked
    for c in on:
        picked.append(c)
        got += c.share
        if got >= short:
            return picked
    return None


def _waste_cover(short: int, groups: Mapping[GroupKey, Group], taken: set[str]) -> list[Candidate] | None:
    """For the least waste: victims on one GPU whose shares add up to ``short``, in the order of
    (units, priority, -created, id): the largest first while they fit under what is short, then the
    smallest that covers the rest, else the largest again until covered. None: all do not cover.
    Groups whose shares are all too large (or too small) to be picked are not read."""
    runs = _runs(groups, lambda k: (k[0], k[2]))  # units, priority

    def read(run: list[GroupKey], down: bool) -> Iterator[Candidate]:
        if len(run) == 1:
            found = groups[run[0]].oldest() if down else groups[run[0]].newest()
        else:
            found = merge(*(groups[k].oldest() if down else groups[k].newest() for k in run), key=_newest, reverse=down)
        return (c for c in found if c.task_id not in taken)

    picked: list[Candidate] = []
    got = 0
    if short <= 0:
        return picked
    mine: set[str] = set()
    for run in reversed(runs):
        if min(k[1] for k in run) > short - got:
            continue
        same = len({k[1] for k in run}) == 1
        for c in read(run, True):
            if got + c.share <= short:
                picked.append(c)
                mine.add(c.task_id)
                got += c.share
            elif same:
                break  # the rest of the run is as large
    if got < short:
        for run in runs:
            if max(k[1] for k in run) < short - got:
                continue
            covering = next((c for c in read(run, False) if c.task_id not in mine and got + c.share >= short), None)
            if covering is not None:
                picked.append(covering)
                return picked
        for run in reversed(runs):
            for c in read(run, True):
                if got >= short:
                    return picked
                if c.task_id not in mine:
                    picked.append(c)
                    got += c.share
    return picked if got >= short else None
