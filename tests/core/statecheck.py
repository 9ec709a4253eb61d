"""Deep state of a core object, to assert that a refused call changed nothing."""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from typing import Any


def state_of(o: Any) -> Any:
    if isinstance(o, (int, float, str, bytes, type(None), enum.Enum)):
        return repr(o)
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return (type(o).__name__, {f.name: state_of(getattr(o, f.name)) for f in dataclasses.fields(o)})
    if isinstance(o, dict):
        return {k: state_of(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, deque)):
        return [state_of(v) for v in o]
    if hasattr(o, "__dict__"):
        return (type(o).__name__, {k: state_of(v) for k, v in vars(o).items()})
    return repr(o)  # ints, strings, enums, itertools.count (its repr shows the next value)
