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

Pure: the ledger builds the candidates (who is eligible is its rule) and calls ``choose``; their
shapes and the pools' orders are ``gpud.core.victims``'. The strategy's pool may be ``Ranked``
rather than listed: per GPU, groups of candidates of equal units,
share and priority, each newest first, which are read in the strategy's order only as far as the
choice needs (a fraction needs the cheapest few of 20 000). Everything is in the ledger's fixed
point (one GPU = ``UNIT``).

Thousands of victims on one GPU (fractions of 1/10000) are chosen as one ``Chunk``, never a
Candidate each: all of a GPU's fractions when it is emptied for whole GPUs (the pool tells from the
counts it keeps whether every allocation on the GPU is a candidate: ``Ranked.whole``), or the first
of one group that cover a fraction (``Ranked.first``). A chunk stands for its members in the order
they would have been read, so the choice is the one made candidate by candidate: its cost is theirs,
and never more than needed drops it whole when the request fits without it, keeps it whole when
none of its members could go (the GPU needs them all), and only else weighs its members one by one.
So choosing among 20 000 costs what the GPUs' groups number, not what their allocations do (but a
``minimum_waste`` cover, which is read one by one).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from heapq import merge
from typing import Any

from gpud.core.victims import (
    Candidate,
    Chunk,
    Group,
    GroupKey,
    Listed,
    Need,
    Pool,
    Ranked,
    Room,
    TenantCheck,
    Victim,
    chunk_of,
    in_order,
    newest_first,
    nothing_on,
    run_in_order,
    runs_of,
    strategy_key,
)
from gpud_client.protocol import PreemptStrategy
from gpud_client.units import GPU_UNIT as UNIT

__all__ = [
    "BULK",
    "Candidate",
    "Chunk",
    "Group",
    "GroupKey",
    "Need",
    "Pool",
    "Ranked",
    "Room",
    "TenantCheck",
    "Victim",
    "choose",
    "chunk_of",
    "in_order",
    "nothing_on",
    "rank",
]

BULK = 64  # a GPU's candidates are taken as one Chunk when at least this many would be


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

    def add(self, c: Victim, sign: int = 1) -> None:
        if isinstance(c, Chunk):
            self._give(c.gpu, sign * c.units)
        else:
            for g in c.gpus:
                self._give(g, sign * c.share)
        self.cpus += sign * c.cpus

    def _give(self, g: int, share: int) -> None:
        free = self.room.free
        if g in free:
            before = free[g] + self.freed.get(g, 0)
            after = before + share
            self.freed[g] = after - free[g]
            self.ok += (after >= self.target) - (before >= self.target)

    def free_on(self, g: int) -> int:
        return self.room.free[g] + self.freed.get(g, 0)

    def gpus_fit(self) -> bool:
        return self.ok >= self.wanted

    def gpus_fit_without(self, g: int, share: int) -> bool:
        """Whether the GPUs would still fit with ``share`` of ``g`` not given back."""
        if g not in self.room.free:
            return self.gpus_fit()
        free = self.free_on(g)
        return self.ok - (free >= self.target) + (free - share >= self.target) >= self.wanted

    def fits(self, chosen: Sequence[Victim] | Callable[[], Sequence[Victim]]) -> bool:
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
) -> list[Victim]:
    """The victims that let ``need`` fit, fewest by the rules above; [] when no set does."""
    fit = _Fit(need, room, tenant_ok)
    chosen: list[Victim] = []
    last = len(pools) - 1
    for i, pool in enumerate(pools):
        if fit.fits(chosen):
            break
        candidates = pool.candidates
        if i == last:  # the strategy's pool: aimed at the GPUs that cost it least
            ranked = Listed(candidates) if isinstance(candidates, Sequence) else candidates
            _aimed(fit, chosen, ranked, pool.strategy)
        else:
            assert isinstance(candidates, Sequence), "only the strategy's pool may be ranked"
            _greedy(fit, chosen, _ordered(candidates, pool.strategy))
    if not fit.fits(chosen):
        return []
    return _fewest(fit, chosen)


def _fewest(fit: _Fit, chosen: list[Victim]) -> list[Victim]:
    """Never more than needed: each victim, the last chosen first (the dearest), is dropped again
    when the request fits without it. A chunk goes whole when it can, stays whole when none of its
    members could go, and is else weighed member by member as the victims it stands for."""
    held: list[Victim | None] = list(chosen)

    def rest() -> list[Victim]:
        return [v for v in held if v is not None]

    i = len(held) - 1
    while i >= 0:
        v = held[i]
        assert v is not None
        fit.add(v, -1)
        held[i] = None
        if fit.fits(rest):
            i -= 1
            continue
        fit.add(v)
        held[i] = v
        if isinstance(v, Chunk) and fit.gpus_fit_without(v.gpu, v.smallest):
            members = v.members()
            held[i : i + 1] = members  # counted as the chunk was: their sums are its
            i += len(members) - 1
            continue
        i -= 1
    return rest()


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


def _cost(victims: Sequence[Victim], strategy: PreemptStrategy) -> tuple[Any, ...]:
    """What a set of victims costs under ``strategy``: the cheapest set is chosen (a chunk costs
    what its members would)."""
    count = units = 0
    oldest: int | None = None
    for v in victims:
        made = v.oldest if isinstance(v, Chunk) else v.created
        count += v.count if isinstance(v, Chunk) else 1
        units += v.units
        oldest = made if oldest is None or made < oldest else oldest
    first = 0 if oldest is None else oldest
    match strategy:
        case PreemptStrategy.MINIMUM_VICTIMS:
            return (count, units)
        case PreemptStrategy.MINIMUM_WASTE:
            return (units, count)
        case PreemptStrategy.NEWEST_FIRST:
            return (-first, count)
        case _:  # the highest priority taken, then the next..., then the fewest, the newest
            priorities: list[int] = []
            for v in victims:
                if isinstance(v, Chunk):
                    for p, n in v.priorities:
                        priorities += [p] * n
                else:
                    priorities.append(v.priority)
            return (sorted(priorities, reverse=True), count, -first)


def _useful(fit: _Fit, c: Candidate) -> bool:
    """Whether ``c`` gives back something the request still lacks."""
    short_cpus = fit.room.cpus + fit.cpus < fit.need.cpus
    if c.cpus and short_cpus:
        return True
    if fit.gpus_fit() or not c.gpus:
        return False
    return any(g in fit.room.free for g in c.gpus)


def _greedy(fit: _Fit, chosen: list[Victim], ordered: Sequence[Candidate]) -> None:
    for c in ordered:
        if fit.fits(chosen):
            return
        if _useful(fit, c):
            chosen.append(c)
            fit.add(c)


def _take(fit: _Fit, chosen: list[Victim], victims: Sequence[Victim]) -> None:
    for c in victims:
        chosen.append(c)
        fit.add(c)


def _shares(victims: Sequence[Victim]) -> int:
    return sum(v.units if isinstance(v, Chunk) else v.share for v in victims)


def _rest_on(
    pool: Ranked, g: int, taken: set[str], strategy: PreemptStrategy, listed: dict[int, list[Candidate]]
) -> Sequence[Victim]:
    """What is left to take on ``g``: its chunk, or its candidates not taken yet (read once)."""
    chunk = pool.whole(g, taken, strategy)
    if chunk is not None:
        return [chunk] if chunk.count else []
    if g not in listed:
        listed[g] = list(in_order(pool.on(g), strategy))
    on = listed[g]
    return [c for c in on if c.task_id not in taken] if taken else on


def _aimed(fit: _Fit, chosen: list[Victim], pool: Ranked, strategy: PreemptStrategy) -> None:
    """Victims aimed at the GPUs that cost the least to make room on: for a fraction the one GPU
    whose cheapest cover costs least; for whole GPUs, one GPU after another, each emptied of what
    is left on it; then CPU cores (the most first for the fewest victims or the least waste)."""
    # an elastic one chosen for its extras may still go whole (the pools before are listed: no chunks)
    taken = {c.task_id for c in chosen if isinstance(c, Candidate) and c.whole}
    emptied: set[int] = set()  # GPUs taken as one chunk: every candidate on them is taken
    gpus = sorted(fit.room.free)
    key = rank(strategy)
    if 0 < fit.need.gpus < UNIT and not fit.gpus_fit():
        cover = _cheapest_cover(fit, pool, gpus, taken, strategy)
        for v in cover:
            taken.update(v.ids()) if isinstance(v, Chunk) else taken.add(v.task_id)
        _take(fit, chosen, cover)
    elif fit.need.gpus >= UNIT:
        listed: dict[int, list[Candidate]] = {}
        while not fit.gpus_fit():
            options: list[tuple[tuple[Any, ...], int, Sequence[Victim]]] = []
            for g in gpus:
                short = UNIT - fit.free_on(g)
                if short <= 0:
                    continue
                rest = _rest_on(pool, g, taken, strategy, listed)
                if _shares(rest) < short:
                    continue
                options.append((_cost(rest, strategy), g, rest))
            options.sort(key=lambda o: (o[0], o[1]))  # the cheapest, the lower GPU among equals
            best = next((rest for _, _, rest in options if all(v.holds() for v in rest if isinstance(v, Chunk))), None)
            if best is None:
                break
            for v in best:
                emptied.add(v.gpu) if isinstance(v, Chunk) else taken.add(v.task_id)
            _take(fit, chosen, best)
    cpus = [
        c
        for c in pool.with_cpus()
        if c.cpus and c.task_id not in taken and not (emptied and emptied.intersection(c.gpus))
    ]
    if strategy in (PreemptStrategy.MINIMUM_VICTIMS, PreemptStrategy.MINIMUM_WASTE):
        by_cores = sorted(cpus, key=lambda c: (-c.cpus, *key(c)))
    else:  # the strategy's own order: the lowest priorities, or the newest
        by_cores = sorted(cpus, key=key)
    _greedy(fit, chosen, by_cores)


def _cheapest_cover(
    fit: _Fit, pool: Ranked, gpus: list[int], taken: set[str], strategy: PreemptStrategy
) -> list[Victim]:
    """For a fraction: the cover of the GPU where it costs least ([] when none covers). Each GPU's
    candidates are read in the strategy's order only until they cover (but for the least waste)."""
    best: list[Victim] | None = None
    best_cost: tuple[Any, ...] = ()
    order = gpus
    newest = strategy == PreemptStrategy.NEWEST_FIRST
    bounds: dict[int, tuple[int]] = {}
    if newest:
        # GPUs in the order of a bound no cover on them can beat (the newest there), so that once a
        # bound is above the best cost found, so is every later GPU's. The other costs' bounds tie
        # too often to pay for reading the GPUs ahead.
        heads = []
        for g in gpus:
            made = [c.oldest for k in pool.on(g) if (c := pool.first(g, k, 1, taken)) is not None]
            if made:
                heads.append(((-max(made),), g))
        heads.sort()
        order = [g for _, g in heads]
        bounds = dict((g, bound) for bound, g in heads)
    for g in order:
        short = fit.need.gpus - fit.free_on(g)
        if newest and best is not None and bounds[g] > best_cost:
            break
        picked: list[Victim] | None
        if strategy == PreemptStrategy.MINIMUM_WASTE:
            waste = _waste_cover(short, pool.on(g), taken, pool, g)
            picked = None if waste is None else list(waste)
        else:
            picked = _cover(short, pool, g, strategy, taken)
        if picked is None:
            continue
        cost = _cost(picked, strategy)
        if best is None or cost < best_cost:
            best, best_cost = picked, cost
    return best or []


def _cover(short: int, pool: Ranked, g: int, strategy: PreemptStrategy, taken: set[str]) -> list[Victim] | None:
    """``_prefix`` of ``g``'s candidates in the strategy's order, those in ``taken`` left out; a
    run of one group of fractions read as one chunk when that many of it are needed."""
    picked: list[Victim] = []
    got = 0
    if short <= 0:
        return picked
    groups = pool.on(g)
    for run in runs_of(groups, strategy_key(strategy)):
        units, share, _ = run[0]
        n = -(-(short - got) // share)
        if len(run) == 1 and units == share < UNIT and n >= BULK:
            chunk = pool.first(g, run[0], n, taken)
            if chunk is not None:
                picked.append(chunk)
                got += chunk.units
            if got >= short:
                return picked
            continue
        for c in run_in_order(groups, run, taken):
            picked.append(c)
            got += c.share
            if got >= short:
                return picked
    return None


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


def _waste_cover(
    short: int, groups: Mapping[GroupKey, Group], taken: set[str], pool: Ranked | None = None, gpu: int = 0
) -> list[Victim] | None:
    """For the least waste: victims on one GPU whose shares add up to ``short``, in the order of
    (units, priority, -created, id): the largest first while they fit under what is short, then the
    smallest that covers the rest, else the largest again until covered. None: all do not cover.
    Groups whose shares are all too large (or too small) to be picked are not read; a run of one
    group of fractions is read as one chunk (from ``pool``, the ``gpu`` of ``groups``) when that
    many of it fit."""
    runs = runs_of(groups, lambda k: (k[0], k[2]))  # units, priority

    def read(run: list[GroupKey], down: bool, skip: Container[str]) -> Iterator[Candidate]:
        if len(run) == 1:
            return groups[run[0]].oldest(skip) if down else groups[run[0]].newest(skip)
        found: Iterator[Candidate] = merge(
            *(groups[k].oldest(skip) if down else groups[k].newest(skip) for k in run), key=newest_first, reverse=down
        )
        return found

    picked: list[Victim] = []
    got = 0
    if short <= 0:
        return picked
    mine: set[str] = set()
    for run in reversed(runs):
        if min(k[1] for k in run) > short - got:
            continue
        units, share, _ = run[0]
        if pool is not None and len(run) == 1 and units == share < UNIT and (short - got) // share >= BULK:
            chunk = pool.last(gpu, run[0], (short - got) // share, taken)
            if chunk is not None:
                picked.append(chunk)
                mine.update(chunk.ids())
                got += chunk.units
            continue  # the rest of the run is as large
        same = len({k[1] for k in run}) == 1
        for c in read(run, True, taken):
            if got + c.share <= short:
                picked.append(c)
                mine.add(c.task_id)
                got += c.share
            elif same:
                break  # the rest of the run is as large
    if got < short:
        skip = taken | mine
        for run in runs:
            if max(k[1] for k in run) < short - got:
                continue
            covering = next((c for c in read(run, False, skip) if got + c.share >= short), None)
            if covering is not None:
                picked.append(covering)
                return picked
        for run in reversed(runs):
            for c in read(run, True, skip):
                if got >= short:
                    return picked
                picked.append(c)
                got += c.share
    return picked if got >= short else None
