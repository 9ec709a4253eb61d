"""What the client core asks its driver to do, and the reconnect backoff.

The core never performs I/O: every decision comes back as one of these
actions, and a driver (the sync ``Client`` or the asyncio ``AsyncClient``)
carries them out in order. ``Send`` and ``Resolve`` are done at once, under
the driver's lock; the hook actions (``CallOnDrop``, ``GiveBack``,
``CallOnLost``) run user code and so are run outside it, never on the reader.
``CallAllocationListeners`` runs user code too, outside the lock, but on the
reader (sync) or in the reader task (asyncio), so that listeners see an
allocation's pushes in the order they came.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from gpud_client import protocol as p
from gpud_client.errors import LockLost

if TYPE_CHECKING:
    from gpud_client.core.session import SessionState

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 2.0


@dataclass(frozen=True, slots=True)
class Send:
    """Write these bytes (``msg``, encoded and framed) to the daemon."""

    msg: msgspec.Struct
    data: bytes


@dataclass(frozen=True, slots=True)
class Resolve:
    """The request ``waiter`` waits for has its answer (or its failure): wake it."""

    waiter: Any


@dataclass(frozen=True, slots=True)
class Wake:
    """A session's state changed: callers waiting for a lock look again."""


WAKE = Wake()


@dataclass(frozen=True, slots=True)
class ArmIdle:
    """A held lock goes idle at ``at`` (client clock), before the idle sweep was due."""

    at: float


@dataclass(frozen=True, slots=True)
class CallOnDrop:
    """Run the session's ``on_drop(reason)``, then hand ``core.drop_told(session, grant)`` its result."""

    session: SessionState
    reason: p.DropReason
    grant: int


@dataclass(frozen=True, slots=True)
class GiveBack:
    """Run the session's ``synchronize``, then ``core.given_back(session, grant)`` sends LOCK_RELEASED."""

    session: SessionState
    grant: int


@dataclass(frozen=True, slots=True)
class CallOnLost:
    """The session held the lock and lost it: run its ``on_lost(error)``."""

    session: SessionState
    error: LockLost


@dataclass(frozen=True, slots=True)
class CallOnPark:
    """The daemon asks the session to park its program's GPU memory (PARK): run its ``on_park()``;
    the session answers later with ``parked(ok, message)``."""

    session: SessionState


@dataclass(frozen=True, slots=True)
class ApplyMemoryLimit:
    """The session's memory limit changed: cap the framework's allocator (PyTorch) where it is used."""

    session: SessionState
    limit: int | None


AllocationPush = p.Preempt | p.PreemptWithdrawn | p.AllocRevoked | p.AllocChanged


@dataclass(frozen=True, slots=True)
class CallAllocationListeners:
    """A push about an allocation (PREEMPT, PREEMPT_WITHDRAWN, ALLOC_REVOKED, ALLOC_CHANGED): hand it
    to each of the application's allocation listeners, in the order the pushes came."""

    push: AllocationPush


class Level(enum.IntEnum):
    DEBUG = 10
    INFO = 20
    WARNING = 30


@dataclass(frozen=True, slots=True)
class Log:
    level: Level
    text: str


Action = (
    Send
    | Resolve
    | Wake
    | ArmIdle
    | CallOnDrop
    | GiveBack
    | CallOnLost
    | CallOnPark
    | CallAllocationListeners
    | ApplyMemoryLimit
    | Log
)
Hook = CallOnDrop | GiveBack | CallOnLost | CallOnPark | CallAllocationListeners


def reconnect_delay(attempt: int, draw: float) -> float:
    """Seconds to wait before reconnect ``attempt`` (0, 1, ...): 50 ms doubling to 2 s, each wait drawn
    between half and all of that by ``draw`` in [0, 1), so clients that lost the same daemon do not
    come back in lockstep."""
    ceiling = min(BACKOFF_START_S * (1 << min(attempt, 16)), BACKOFF_MAX_S)
    return ceiling * (0.5 + 0.5 * draw)
