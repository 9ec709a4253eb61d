"""Victims' shapes: what one allocation would give back (``Candidate``), what a request needs and
the room there is (``Need``, ``Room``), thousands of fractions of one GPU taken as one ``Chunk``, and
the pools a choice reads: listed, or ``Ranked`` per GPU in groups of equal units, share and priority,
each newest first, read in a strategy's order only as far as the choice needs.

Values and orders only: choosing among them is ``gpud.core.preemption``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from heapq import merge
from itertools import islice
from typing import Any, NamedTuple, Protocol

from gpud_client.protocol import PreemptReason, PreemptStrategy


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


@dataclass(frozen=True, slots=True, eq=False)
class Chunk:
    """Victims on one GPU taken as one: fractions of ``gpu`` alone, each taken whole for priority.
    What a plan needs of them is counted; their ids and Candidates are made only when asked for."""

    gpu: int
    count: int
    units: int  # their shares together
    cpus: int  # the CPU cores they hold together
    priorities: tuple[tuple[int, int], ...]  # (priority, how many), the highest first
    oldest: int  # when the first of them was made
    smallest: int  # the smallest share among them
    ids: Callable[[], Sequence[str]]  # their task ids
    members: Callable[[], list[Candidate]]  # each as a Candidate, in the order they were chosen in
    tenants: Callable[[], Mapping[str | None, int]]  # their units per tenant
    # Whether they all are candidates, when that is dearer to find than the rest (a walk, in C): asked
    # of a GPU's chunk only when it is the cheapest to empty (one that is not stands for nothing).
    holds: Callable[[], bool] = bool


def nothing_on(gpu: int) -> Chunk:
    """No victims: what ``Ranked.whole`` answers when some allocation on ``gpu`` is no candidate."""
    return Chunk(gpu, 0, 0, 0, (), 0, 0, tuple, list, dict)


def chunk_of(gpu: int, members: list[Candidate]) -> Chunk:
    """Candidates already read (fractions of ``gpu`` alone), as one chunk."""
    priorities: dict[int, int] = {}
    tenants: dict[str | None, int] = {}
    for c in members:
        priorities[c.priority] = priorities.get(c.priority, 0) + 1
        tenants[c.tenant] = tenants.get(c.tenant, 0) + c.units
    return Chunk(
        gpu,
        len(members),
        sum(c.units for c in members),
        sum(c.cpus for c in members),
        tuple(sorted(priorities.items(), reverse=True)),
        min(c.created for c in members),
        min(c.share for c in members),
        lambda: [c.task_id for c in members],
        lambda: list(members),
        lambda: tenants,
    )


Victim = Candidate | Chunk
TenantCheck = Callable[[Sequence[Victim]], bool] | None  # None: the request has no tenant to check


GroupKey = tuple[int, int, int]  # (units, share, priority)


class Group(Protocol):
    """The candidates on one GPU of one ``GroupKey``: newest first (ties: the lower task id), or
    the reverse, those in ``taken`` left out. Each is read only as far as needed."""

    def newest(self, taken: Container[str] = ()) -> Iterator[Candidate]: ...

    def oldest(self, taken: Container[str] = ()) -> Iterator[Candidate]: ...


class Ranked(Protocol):
    """A pool read as far as needed: per GPU its candidates by ``GroupKey``, and those that give
    back CPU cores (in any order); in bulk, the first of a group and all of a GPU as chunks."""

    def on(self, gpu: int) -> Mapping[GroupKey, Group]: ...

    def with_cpus(self) -> Iterable[Candidate]: ...

    def first(self, gpu: int, key: GroupKey, n: int, taken: Container[str]) -> Chunk | None:
        """The first ``n`` candidates of a group (fewer when there are not so many), newest first,
        those in ``taken`` left out, as one chunk; None: there is none."""
        ...

    def last(self, gpu: int, key: GroupKey, n: int, taken: Container[str]) -> Chunk | None:
        """As ``first``, but the oldest ``n``, oldest first."""
        ...

    def whole(self, gpu: int, taken: Collection[str], strategy: PreemptStrategy) -> Chunk | None:
        """Every candidate on ``gpu``, when they are many fractions: a chunk of them (``nothing_on``
        when some allocation on it, but those in ``taken``, is no candidate: it cannot be emptied);
        None: read them one by one (few of them, or some of them in ``taken``)."""
        ...


@dataclass(frozen=True, slots=True)
class Pool:
    """Candidates tried together, in the order of ``strategy`` (only the last pool may be ``Ranked``)."""

    candidates: Sequence[Candidate] | Ranked
    strategy: PreemptStrategy


class ListedGroup:
    def __init__(self) -> None:
        self.candidates: list[Candidate] = []

    def newest(self, taken: Container[str] = ()) -> Iterator[Candidate]:
        return (c for c in self.candidates if c.task_id not in taken) if taken else iter(self.candidates)

    def oldest(self, taken: Container[str] = ()) -> Iterator[Candidate]:
        out = reversed(self.candidates)
        return (c for c in out if c.task_id not in taken) if taken else out


class Listed:
    """A listed pool read as ``Ranked``."""

    def __init__(self, pool: Sequence[Candidate]) -> None:
        self.by_gpu: dict[int, dict[GroupKey, ListedGroup]] = {}
        for c in pool:
            for g in c.gpus:
                groups = self.by_gpu.setdefault(g, {})
                groups.setdefault((c.units, c.share, c.priority), ListedGroup()).candidates.append(c)
        for groups in self.by_gpu.values():
            for group in groups.values():
                group.candidates.sort(key=newest_first)
        self.cpus = [c for c in pool if c.cpus]

    def on(self, gpu: int) -> Mapping[GroupKey, Group]:
        return self.by_gpu.get(gpu, {})

    def with_cpus(self) -> Iterable[Candidate]:
        return self.cpus

    def first(self, gpu: int, key: GroupKey, n: int, taken: Container[str]) -> Chunk | None:
        group = self.by_gpu.get(gpu, {}).get(key)
        members = list(islice(group.newest(taken), n)) if group is not None else []
        return chunk_of(gpu, members) if members else None

    def last(self, gpu: int, key: GroupKey, n: int, taken: Container[str]) -> Chunk | None:
        group = self.by_gpu.get(gpu, {}).get(key)
        members = list(islice(group.oldest(taken), n)) if group is not None else []
        return chunk_of(gpu, members) if members else None

    def whole(self, gpu: int, taken: Collection[str], strategy: PreemptStrategy) -> Chunk | None:
        return None  # listed: read one by one


def newest_first(c: Candidate) -> tuple[Any, ...]:
    """The order within a group, and between groups where the strategy's order leaves a tie."""
    return (-c.created, c.priority, c.task_id)


def runs_of(groups: Mapping[GroupKey, Group], by: Callable[[GroupKey], tuple[int, ...]]) -> list[list[GroupKey]]:
    """The groups' keys in runs of equal ``by``, the runs in ascending order."""
    runs: dict[tuple[int, ...], list[GroupKey]] = {}
    for k in groups:
        runs.setdefault(by(k), []).append(k)
    return [runs[r] for r in sorted(runs)]


def strategy_key(strategy: PreemptStrategy) -> Callable[[GroupKey], tuple[int, ...]]:
    """The strategy's key on a group: groups it does not tell apart are merged newest first."""
    match strategy:
        case PreemptStrategy.NEWEST_FIRST:  # (-created, priority, id)
            return lambda k: ()
        case PreemptStrategy.MINIMUM_VICTIMS:  # (-share, priority, -created, id)
            return lambda k: (-k[1], k[2])
        case _:  # (priority, -created, id)
            return lambda k: (k[2],)


def run_in_order(
    groups: Mapping[GroupKey, Group], run: list[GroupKey], taken: Container[str] = ()
) -> Iterator[Candidate]:
    if len(run) == 1:
        return groups[run[0]].newest(taken)
    merged: Iterator[Candidate] = merge(*(groups[k].newest(taken) for k in run), key=newest_first)
    return merged


def in_order(groups: Mapping[GroupKey, Group], strategy: PreemptStrategy) -> Iterator[Candidate]:
    """The candidates of ``groups`` in ``rank(strategy)``'s order, made as they are read: the
    groups in the order of the strategy's key, those it does not tell apart merged newest first."""
    for run in runs_of(groups, strategy_key(strategy)):
        yield from run_in_order(groups, run)
