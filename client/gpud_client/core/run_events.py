"""What happens to a run (``gpuctl run``), as its driver hears it: one small typed value per event.

The driver (``gpud_client.run.supervisor``) puts them on its queue from whichever thread hears them
(the lock's, the program's watcher, the client's reader, a signal handler) and its loop hands each to
``RunCore`` with a ``match``. Plain values, no I/O: a signal is its number, a session only its
identity. ``name`` and ``trace()`` are what ``--trace`` writes of one (``run/trace.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gpud_client import protocol as p
from gpud_client.core.actions import AllocationPush


class _Event:
    __slots__ = ()
    name: ClassVar[str]

    def trace(self) -> dict[str, Any]:
        return {}


# --- the lock, the program, the run's own signals ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Granted(_Event):
    """The session got the lock; one closed since (a restart on another allocation) is not the run's."""

    session: object  # compared by identity only
    name: ClassVar[str] = "granted"


@dataclass(frozen=True, slots=True)
class GrantFailed(_Event):
    why: str  # gpud refused the session's ACQUIRE
    name: ClassVar[str] = "grant_failed"


@dataclass(frozen=True, slots=True)
class Dropped(_Event):
    reason: p.DropReason  # DROP_LOCK
    name: ClassVar[str] = "drop"


@dataclass(frozen=True, slots=True)
class Lost(_Event):
    why: str  # the lock went without LOCK_RELEASED
    name: ClassVar[str] = "lost"


@dataclass(frozen=True, slots=True)
class ParkAsked(_Event):
    """gpud's PARK."""

    name: ClassVar[str] = "park"


@dataclass(frozen=True, slots=True)
class Signalled(_Event):
    signum: int  # to the run (SIGINT, SIGTERM, SIGHUP)
    name: ClassVar[str] = "signal"

    def trace(self) -> dict[str, Any]:
        return {"value": self.signum}


@dataclass(frozen=True, slots=True)
class Exited(_Event):
    status: int  # the program's, as a shell gives it (128 + a signal's number)
    name: ClassVar[str] = "exited"

    def trace(self) -> dict[str, Any]:
        return {"value": self.status}


@dataclass(frozen=True, slots=True)
class Escaped(_Event):
    """Process ``pid`` of the paused tree was seen running and stopped again (``fatal``: it could not be)."""

    pid: int
    why: str
    fatal: bool = False
    name: ClassVar[str] = "escape"

    def trace(self) -> dict[str, Any]:
        return {"pid": self.pid, "why": self.why}


# --- gpud's word on the run's allocation ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Preempted(_Event):
    push: p.Preempt
    name: ClassVar[str] = "preempt"

    def trace(self) -> dict[str, Any]:
        push = self.push
        return {
            "reason": str(push.reason),
            "recovery": str(push.recovery),
            "gpus": push.gpus,
            "whole": push.whole,
            "grace_s": push.grace_s,
            "by": push.by,
        }


@dataclass(frozen=True, slots=True)
class Withdrawn(_Event):
    push: p.PreemptWithdrawn
    name: ClassVar[str] = "withdrawn"


@dataclass(frozen=True, slots=True)
class Revoked(_Event):
    push: p.AllocRevoked
    name: ClassVar[str] = "revoked"

    def trace(self) -> dict[str, Any]:
        return {"reason": str(self.push.reason), "state": str(self.push.state), "gone": self.push.gone}


@dataclass(frozen=True, slots=True)
class Changed(_Event):
    push: p.AllocChanged
    name: ClassVar[str] = "changed"

    def trace(self) -> dict[str, Any]:
        return {"change": self.push.change, "gpus": self.push.allocation.gpus}


@dataclass(frozen=True, slots=True)
class Reallocated(_Event):
    """The ALLOCATED that answers the run's ``Allocate``."""

    allocation: p.Allocated
    name: ClassVar[str] = "reallocated"

    def trace(self) -> dict[str, Any]:
        return {"gpus": self.allocation.gpus, "resume": self.allocation.resume}


@dataclass(frozen=True, slots=True)
class ReallocationFailed(_Event):
    why: str
    name: ClassVar[str] = "reallocation_failed"

    def trace(self) -> dict[str, Any]:
        return {"why": self.why}


RunEvent = (
    Granted
    | GrantFailed
    | Dropped
    | Lost
    | ParkAsked
    | Signalled
    | Exited
    | Escaped
    | Preempted
    | Withdrawn
    | Revoked
    | Changed
    | Reallocated
    | ReallocationFailed
)


def pushed(push: AllocationPush) -> RunEvent:
    """The event of one of gpud's pushes about the run's allocation."""
    match push:
        case p.Preempt():
            return Preempted(push)
        case p.PreemptWithdrawn():
            return Withdrawn(push)
        case p.AllocRevoked():
            return Revoked(push)
        case p.AllocChanged():
            return Changed(push)
