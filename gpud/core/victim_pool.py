"""The allocations a request may take back whole, read from the ledger's index as far as a choice
reads (``preemption.Ranked``): per GPU, groups of equal units, share and priority, newest first,
past the immature; in bulk what a choice takes by the thousand (``preemption.Chunk``): whether a GPU
can be emptied, from the index's counts (a walk in C only for the GPU chosen: reachable, not planned
for another waiter), and a group's first or last few as task ids filtered in C.

Never: decide who is eligible (the ledger passes what keeps allocations away, the shell's
``reachable``, the priority and when the immature begin); change the index.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping
from itertools import filterfalse, islice
from operator import itemgetter

import gpud.core.preemption as preemption
from gpud.core.ledger_index import Alloc, LedgerIndex, takes_whole
from gpud.core.preemption import Candidate, Chunk, Group, GroupKey, in_order, nothing_on
from gpud.core.shields import runs_minimum
from gpud.core.sortedkeys import SortedKeys
from gpud_client.protocol import PreemptStrategy
from gpud_client.units import GPU_UNIT as UNIT

_second = itemgetter(1)


class _Group:
    """One group of a GPU for one request: its mature (or priority 0), eligible allocations."""

    __slots__ = ("_keys", "_cut", "_pool")

    def __init__(self, keys: SortedKeys[tuple[int, str]], cut: tuple[int, str] | None, pool: VictimPool) -> None:
        self._keys, self._cut, self._pool = keys, cut, pool

    def ids(self, taken: Container[str] = ()) -> Iterator[str]:
        """The task ids of its candidates, newest first, read at C speed past those that are not."""
        keys = self._keys.from_(self._cut) if self._cut is not None else iter(self._keys)
        return self._pool._eligible(map(_second, keys), taken)

    def ids_oldest(self, taken: Container[str] = ()) -> Iterator[str]:
        return self._pool._eligible(map(_second, self._keys.down_to(self._cut)), taken)

    def newest(self, taken: Container[str] = ()) -> Iterator[Candidate]:
        return map(self._pool._victim, self.ids(taken))

    def oldest(self, taken: Container[str] = ()) -> Iterator[Candidate]:
        return map(self._pool._victim, self.ids_oldest(taken))


class VictimPool:
    """The allocations of priority below ``priority`` that a request may take back whole, mature
    by ``mature`` (or spot), reachable and in none of ``away`` (the ledger's rule: those told to
    leave, resting, planned for another waiter, and those the request takes otherwise):
    ``preemption.Ranked``, read from the index as far as the choice reads."""

    def __init__(
        self,
        index: LedgerIndex,
        priority: int,
        mature: int,
        reachable: Container[str],
        away: tuple[Collection[str], ...],
    ) -> None:
        self._index, self._priority, self._mature = index, priority, mature
        self._reachable = reachable
        # what leaves an allocation out, each looked up in C (the ledger's dicts, the shell's set)
        self._out: list[Collection[str]] = list(away)
        out = self._out
        self._ok: Callable[[str], bool] = lambda t: t in reachable and not any(t in o for o in out)

    def _eligible(self, ids: Iterator[str], taken: Container[str]) -> Iterator[str]:
        ids = filter(self._reachable.__contains__, ids)
        for out in (*self._out, taken):
            if out:
                ids = filterfalse(out.__contains__, ids)
        return ids

    def _victim(self, t: str) -> Candidate:
        return self._index.victim(self._index.allocs[t])

    def on(self, gpu: int) -> dict[GroupKey, Group]:
        cut = (-self._mature, "")  # (-created, id) from here on: made by ``mature``
        return {
            k: _Group(keys, cut if runs_minimum(k[2]) else None, self)
            for k, keys in self._index.lower_groups.get(gpu, {}).items()
            if k[2] < self._priority
        }

    def with_cpus(self) -> list[Candidate]:
        index, out = self._index, []
        for t in index.cpu_holders:
            a = index.allocs[t]
            if (
                takes_whole(a)
                and a.priority < self._priority
                and (not runs_minimum(a.priority) or a.created_us <= self._mature)
            ):
                if self._ok(t):
                    out.append(index.victim(a))
        return out

    def first(self, gpu: int, key: GroupKey, n: int, taken: Container[str]) -> Chunk | None:
        return self._chunk(gpu, key, n, taken, newest=True)

    def last(self, gpu: int, key: GroupKey, n: int, taken: Container[str]) -> Chunk | None:
        return self._chunk(gpu, key, n, taken, newest=False)

    def _chunk(self, gpu: int, key: GroupKey, n: int, taken: Container[str], *, newest: bool) -> Chunk | None:
        keys = self._index.lower_groups.get(gpu, {}).get(key)
        if keys is None or key[2] >= self._priority:
            return None
        group = _Group(keys, (-self._mature, "") if runs_minimum(key[2]) else None, self)
        ids = list(islice(group.ids(taken) if newest else group.ids_oldest(taken), n))
        if not ids:
            return None
        allocs = self._index.allocs
        return Chunk(
            gpu,
            len(ids),
            len(ids) * key[1],
            self._cpus_among(ids),
            ((key[2], len(ids)),),
            allocs[ids[-1] if newest else ids[0]].created_us,
            key[1],
            lambda: ids,
            lambda: [self._victim(t) for t in ids],
            lambda: _tenants(allocs[t] for t in ids),
        )

    def whole(self, gpu: int, taken: Collection[str], strategy: PreemptStrategy) -> Chunk | None:
        """Counted from the index: every allocation on ``gpu`` is of a group below the priority,
        none immature, told or immune; and, looked up in C when the GPU is chosen (``Chunk.holds``),
        none in the rest of ``away`` (planned for another waiter, taken otherwise), all reachable."""
        index = self._index
        held = index.held_on.get(gpu, 0)
        if held < preemption.BULK or any(gpu in a.gpus for t in taken if (a := index.allocs.get(t)) is not None):
            return None
        groups = [(k, keys) for k, keys in index.lower_groups.get(gpu, {}).items() if k[2] < self._priority]
        if any(k[0] != k[1] or k[1] >= UNIT for k, _ in groups):
            return None  # a whole allocation among them (not with this many): read it
        untold = index.untold.get(gpu)
        cut = self._mature
        if (
            sum(len(keys) for _, keys in groups) != held
            or untold is None
            or len(untold) != held
            or index.immune_on.get(gpu)
            or any(runs_minimum(k[2]) and _made(keys.first()) > cut for k, keys in groups)  # the newest is immature
        ):
            return nothing_on(gpu)
        counted = (index.notices, index.immune)  # (read above from the counts per GPU)
        rest, reachable = [o for o in self._out if all(o is not c for c in counted)], self._reachable
        priorities: dict[int, int] = {}
        for k, keys in groups:
            priorities[k[2]] = priorities.get(k[2], 0) + len(keys)
        cpus = sum(len(a.cpus) for t in index.cpu_holders if gpu in (a := index.allocs[t]).gpus)
        return Chunk(
            gpu,
            held,
            sum(len(keys) * k[1] for k, keys in groups),
            cpus,
            tuple(sorted(priorities.items(), reverse=True)),
            min(_made(keys.last()) for _, keys in groups),
            min(k[1] for k, _ in groups),
            lambda: list(untold),
            lambda: list(in_order(self.on(gpu), strategy)),
            lambda: _with_none(index.tenant_on.get(gpu, {})),
            lambda: not any(_meets(o, untold) for o in rest) and _within(untold, reachable),
        )

    def _cpus_among(self, ids: list[str]) -> int:
        holders = self._index.cpu_holders
        if not holders:
            return 0
        among = set(ids)
        return sum(len(self._index.allocs[t].cpus) for t in holders if t in among)


def _made(key: tuple[int, str] | None) -> int:
    """When the allocation of a (-created, id) key was made."""
    assert key is not None  # (groups are never empty)
    return -key[0]


def _meets(out: Collection[str], ids: SortedKeys[str]) -> bool:
    """Whether any of ``ids`` is in ``out``, walking the smaller of the two."""
    if not out:
        return False
    if len(out) < len(ids):
        return any(t in ids for t in out)
    keys = out.keys() if isinstance(out, dict) else out
    if isinstance(keys, (set, frozenset, type({}.keys()))):
        return not all(keys.isdisjoint(block) for block in ids.blocks())
    return any(map(out.__contains__, ids))


def _within(ids: SortedKeys[str], of: Container[str]) -> bool:
    """Whether every one of ``ids`` is in ``of`` (a set: a block at a time, in C)."""
    if isinstance(of, (set, frozenset)):
        return all(of.issuperset(block) for block in ids.blocks())
    return all(map(of.__contains__, ids))


def _with_none(units: Mapping[str, int]) -> dict[str | None, int]:
    out: dict[str | None, int] = {}
    out.update(units)
    return out


def _tenants(allocs: Iterable[Alloc]) -> dict[str | None, int]:
    out: dict[str | None, int] = {}
    for a in allocs:
        out[a.tenant] = out.get(a.tenant, 0) + a.total
    return out
