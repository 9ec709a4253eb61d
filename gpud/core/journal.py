"""Undo for a core object's state: a checkpoint costs O(1), a rollback O(what changed since).

How: the object keeps its state in ``JDict``s sharing one ``Journal``. ``Journal.start`` (a
checkpoint) begins a new undo log; from then on the first change of a key in a ``JDict`` saves the
key's old value (or that it was absent) in that dict, and ``keep`` saves any other part (a random
generator's state) once. ``undo`` puts every saved value back, forgets them, and returns the keys
it put back, so that the object can bring what it derives from them up to date. The checkpoint stays
usable after an undo; a newer ``start`` supersedes it (``undo`` to it then raises ``ValueError``).

``state`` names the state: it takes a fresh number at the first change after a ``start`` and
returns to the checkpoint's at an undo, so two checkpoints with the same ``state`` (and
the same copies of whatever else the object copies) saw the same state.

Never: change a ``JDict`` through ``dict``'s methods called on it directly (the change would not be
saved); promise an order: a key deleted and put back by an undo comes last when iterated (nothing
the object decides may depend on the order of its dicts).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar, overload

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()  # a key that was absent at the checkpoint


class Journal:
    __slots__ = ("_recording", "_touched", "_kept", "_epoch", "_next", "_dirty", "state")

    def __init__(self) -> None:
        self._recording = False  # until the first checkpoint nothing can be undone, so nothing is saved
        self._touched: list[JDict[Any, Any]] = []
        self._kept: dict[str, Callable[[], None]] = {}
        self._epoch = 0
        self._next = 1
        self._dirty = True
        self.state = 0

    def __repr__(self) -> str:
        return "<undo journal>"  # not state: two equal states may have different journals

    @property
    def entries(self) -> int:
        """How many values are saved now: the work an undo would do."""
        return sum(len(d._saved) for d in self._touched) + len(self._kept)

    def start(self) -> tuple[int, int]:
        """A checkpoint: (its epoch, the state's number). Forgets what the last one saved."""
        for d in self._touched:
            d._saved.clear()
        self._touched.clear()
        self._kept.clear()
        self._epoch += 1
        self._recording = True
        self._dirty = False
        return self._epoch, self.state

    def undo(self, epoch: int, state: int) -> set[Any]:
        """Back to the checkpoint ``epoch`` took: the keys put back, of every dict."""
        if epoch != self._epoch:
            raise ValueError("a newer checkpoint superseded this one: it cannot be rolled back to")
        keys: set[Any] = set()
        for d in self._touched:
            keys.update(d._undo())
        for restore in self._kept.values():
            restore()
        self._touched.clear()
        self._kept.clear()
        self.state, self._dirty = state, False
        return keys

    def changing(self) -> None:
        """The state changes now (what the object copies at a checkpoint needs not say so)."""
        if not self._dirty:
            self._dirty = True
            self.state = self._next
            self._next += 1

    def keeps(self, name: str) -> bool:
        """Whether ``name`` needs no ``keep`` now (saved since the checkpoint, or none to undo to)."""
        return not self._recording or name in self._kept

    def keep(self, name: str, restore: Callable[[], None]) -> None:
        """Save a part that is no ``JDict``: ``restore`` puts back its value of now."""
        self.changing()
        if self._recording and name not in self._kept:
            self._kept[name] = restore


class JDict(dict[K, V]):
    """A dict whose changes the journal can undo. ``hook(key)`` runs after every change made
    through it (not after an undo: the caller of ``undo`` has the keys)."""

    __slots__ = ("_journal", "_saved", "_hook")

    def __init__(self, journal: Journal, hook: Callable[[K], None] | None = None) -> None:
        super().__init__()
        self._journal = journal
        self._saved: dict[K, Any] = {}
        self._hook = hook

    def _note(self, key: K) -> None:
        j = self._journal
        if not j._dirty:
            j.changing()
        if j._recording:
            saved = self._saved
            if key not in saved:
                if not saved:
                    j._touched.append(self)
                saved[key] = dict.get(self, key, _MISSING)

    def _undo(self) -> list[K]:
        for key, old in self._saved.items():
            if old is _MISSING:
                dict.pop(self, key, None)
            else:
                dict.__setitem__(self, key, old)
        keys = list(self._saved)
        self._saved.clear()
        return keys

    def __setitem__(self, key: K, value: V) -> None:
        j = self._journal  # (``_note``, inline: every change of the ledger passes here)
        if not j._dirty:
            j.changing()
        if j._recording:
            saved = self._saved
            if key not in saved:
                if not saved:
                    j._touched.append(self)
                saved[key] = dict.get(self, key, _MISSING)
        dict.__setitem__(self, key, value)
        if self._hook is not None:
            self._hook(key)

    def __delitem__(self, key: K) -> None:
        if key not in self:
            raise KeyError(key)
        self._drop(key)

    def _drop(self, key: K) -> None:
        """Delete ``key``, which is there."""
        self._note(key)
        dict.__delitem__(self, key)
        if self._hook is not None:
            self._hook(key)

    @overload
    def pop(self, key: K, /) -> V: ...
    @overload
    def pop(self, key: K, default: V, /) -> V: ...
    @overload
    def pop(self, key: K, default: D, /) -> V | D: ...
    def pop(self, key: K, *default: Any) -> Any:
        value = dict.get(self, key, _MISSING)
        if value is _MISSING:
            if default:
                return default[0]
            raise KeyError(key)
        self._drop(key)
        return value

    def popitem(self) -> tuple[K, V]:
        key = next(reversed(self))
        return key, self.pop(key)

    def setdefault(self, key: K, default: V = None) -> V:  # type: ignore[assignment]
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kw: Any) -> None:
        for key, value in dict(*args, **kw).items():
            self[key] = value

    def __ior__(self, other: Any) -> JDict[K, V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def clear(self) -> None:
        keys = list(self)
        for key in keys:
            self._note(key)
        dict.clear(self)  # not key by key: a dict keeps the room of deleted keys, and reading it walks that room
        if self._hook is not None:
            for key in keys:
                self._hook(key)
