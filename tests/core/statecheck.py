"""Deep state of a core object, to assert that a refused call changed nothing.

Dataclasses and objects become (type name, {attribute: state}), dicts stay dicts,
sequences become lists, ints, strings and None stay as they are, and every other
leaf (floats, enums, bools, an ``itertools.count``) becomes its repr. Two snapshots
are equal exactly when the states are.

The simulations take a snapshot before every call they make, so how to walk each
type is decided once per type and kept in ``_WALKERS``, and each walker looks its
children's walkers up itself (a call of ``state_of`` per leaf was most of the cost).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections import deque
from collections.abc import Callable
from typing import Any

Walker = Callable[[Any], Any]
_PLAIN = frozenset({int, str, type(None)})  # equal exactly when their reprs are: kept as they are
_ATOMS = (int, float, str, bytes, type(None), enum.Enum)
_WALKERS: dict[type, Walker] = {}


def state_of(o: Any) -> Any:
    if type(o) in _PLAIN:
        return o
    return (_WALKERS.get(type(o)) or _learn(type(o)))(o)


def _learn(t: type) -> Walker:
    walk = _WALKERS[t] = _walker(t)
    return walk


def _walker(t: type) -> Walker:
    """How to snapshot an instance of ``t``: decided on the type alone, so it can be kept."""
    plain, get = _PLAIN, _WALKERS.get
    if issubclass(t, _ATOMS):
        return repr
    name = t.__name__
    if dataclasses.is_dataclass(t):
        names = tuple(f.name for f in dataclasses.fields(t))
        if not names:
            return lambda o: (name, {})
        values = operator.attrgetter(*names) if len(names) > 1 else lambda o: (getattr(o, names[0]),)

        def fields(o: Any) -> Any:
            return (
                name,
                {n: v if type(v) in plain else (get(type(v)) or _learn(type(v)))(v) for n, v in zip(names, values(o))},
            )

        return fields
    if issubclass(t, dict):
        return lambda o: {k: v if type(v) in plain else (get(type(v)) or _learn(type(v)))(v) for k, v in o.items()}
    if issubclass(t, (list, tuple, deque)):
        return lambda o: [v if type(v) in plain else (get(type(v)) or _learn(type(v)))(v) for v in o]
    if t.__dictoffset__ != 0:  # every instance carries a __dict__
        return lambda o: _attributes(name, o)
    return _attributes_or_repr


def _attributes(name: str, o: Any) -> Any:
    plain, get = _PLAIN, _WALKERS.get
    return (name, {k: v if type(v) in plain else (get(type(v)) or _learn(type(v)))(v) for k, v in vars(o).items()})


def _attributes_or_repr(o: Any) -> Any:
    """A type whose instances may lend a ``__dict__`` (a bound method lends its function's) or have none."""
    if hasattr(o, "__dict__"):
        return _attributes(type(o).__name__, o)
    return repr(o)  # itertools.count and the like (its repr shows the next value)
