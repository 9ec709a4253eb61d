"""Distinct keys kept sorted, at a cost that does not grow with their number.

How: the keys lie in blocks of at most ``2 * LOAD`` sorted keys, and ``_maxes[i]`` is the largest
key of block ``i``. A bisect over the maxes finds the block, a bisect in the block the place, so
adding, removing and reading on from a key cost O(log n + LOAD) however many keys there are (one
plain sorted list would move every key behind the place: 20 000 of them per change). ``ByTime``
keeps ids by a time many share (deadlines given at once) with one dict per time.

Never: hold a key twice or an empty block; be changed while one of its iterators is read (take
what is needed into a list first).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from itertools import chain
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Any)  # keys compare with ``<`` (tuples of ints and strings, strings)

LOAD = 256


class SortedKeys(Generic[K]):
    __slots__ = ("_blocks", "_maxes", "_len")

    def __init__(self) -> None:
        self._blocks: list[list[K]] = []
        self._maxes: list[K] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        return chain.from_iterable(self._blocks)

    def blocks(self) -> Iterator[list[K]]:
        """The keys a block (a list, in order) at a time: for what C does faster on a list."""
        return iter(self._blocks)

    def __repr__(self) -> str:
        return f"<{self._len} sorted keys>"

    def __contains__(self, key: K) -> bool:
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):
            return False
        block = self._blocks[i]
        j = bisect_left(block, key)
        return j < len(block) and block[j] == key

    def add(self, key: K) -> None:
        """Add ``key`` (KeyError: it is there already)."""
        maxes, blocks = self._maxes, self._blocks
        if not maxes:
            blocks.append([key])
            maxes.append(key)
            self._len = 1
            return
        i = bisect_left(maxes, key)
        if i == len(maxes):
            i -= 1
            blocks[i].append(key)
            maxes[i] = key
        else:
            if maxes[i] == key:
                raise KeyError(key)
            block = blocks[i]
            j = bisect_left(block, key)
            if block[j] == key:
                raise KeyError(key)
            block.insert(j, key)
        self._len += 1
        block = blocks[i]
        if len(block) > 2 * LOAD:  # split in two halves: each block stays small
            half = block[LOAD:]
            del block[LOAD:]
            blocks.insert(i + 1, half)
            maxes[i] = block[-1]
            maxes.insert(i + 1, half[-1])

    def remove(self, key: K) -> None:
        """Remove ``key`` (KeyError: it is not there)."""
        maxes = self._maxes
        i = bisect_left(maxes, key)
        if i == len(maxes):
            raise KeyError(key)
        block = self._blocks[i]
        j = bisect_left(block, key)
        if j == len(block) or block[j] != key:
            raise KeyError(key)
        del block[j]
        self._len -= 1
        if not block:
            del self._blocks[i]
            del maxes[i]
        elif j == len(block):
            maxes[i] = block[-1]

    def first(self) -> K | None:
        return self._blocks[0][0] if self._blocks else None

    def last(self) -> K | None:
        return self._blocks[-1][-1] if self._blocks else None

    def from_(self, key: K) -> Iterator[K]:
        """The keys from ``key`` on (``key`` itself included), in order."""
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):
            return iter(())
        block = self._blocks[i]
        return chain(block[bisect_left(block, key) :], chain.from_iterable(self._blocks[i + 1 :]))

    def down_to(self, key: K | None = None) -> Iterator[K]:
        """The keys from the largest down to ``key`` (itself included; None: all), in descending order."""
        for i in range(len(self._blocks) - 1, -1, -1):
            block = self._blocks[i]
            if key is None or not block[0] < key:
                yield from reversed(block)
                continue
            yield from reversed(block[bisect_left(block, key) :])
            return

    def after(self, key: K) -> Iterator[K]:
        """The keys above ``key``, in order."""
        i = bisect_right(self._maxes, key)
        if i == len(self._maxes):
            return iter(())
        block = self._blocks[i]
        return chain(block[bisect_right(block, key) :], chain.from_iterable(self._blocks[i + 1 :]))


class ByTime:
    """Ids by a time (a deadline), many of them often sharing one (10 000 notices given at once):
    the distinct times in ``SortedKeys``, the ids of each in a dict, so adding or removing an id of
    a time already there is a dict's insert or delete. Read in (time, id) order."""

    __slots__ = ("_times", "_ids")

    def __init__(self) -> None:
        self._times: SortedKeys[int] = SortedKeys()
        self._ids: dict[int, dict[str, None]] = {}

    def __repr__(self) -> str:
        return f"<ids at {len(self._times)} times>"

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return ((at, key) for at in self._times for key in sorted(self._ids[at]))

    def add(self, at: int, key: str) -> None:
        ids = self._ids.get(at)
        if ids is None:
            ids = self._ids[at] = {}
            self._times.add(at)
        elif key in ids:
            raise KeyError(key)
        ids[key] = None

    def remove(self, at: int, key: str) -> None:
        ids = self._ids[at]
        del ids[key]
        if not ids:
            del self._ids[at]
            self._times.remove(at)

    def first(self) -> int | None:
        return self._times.first()

    def first_after(self, at: int) -> int | None:
        return next(self._times.after(at), None)

    def until(self, now: int, limit: int | None = None) -> list[str]:
        """The ids of the times up to ``now``, in (time, id) order (the first ``limit`` of them)."""
        out: list[str] = []
        for at in self._times:
            if at > now or (limit is not None and len(out) >= limit):
                break
            out += sorted(self._ids[at])
        return out if limit is None else out[:limit]
