"""What the rules of a run (``core/run.py``, ``core/recovery.py``) ask the run's driver to do.

Plain values: the driver (``gpud_client.run.supervisor``) carries them out in order and tells the
core how each process-control action went. No I/O here, and no signal module: a signal is its number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpud_client import protocol as p

# What a run is doing, as gpud shows it (``RunCore.shown``; the ``run.state`` label): its program's
# state, or where a preemption has it: told to save and end (checkpointing), ended to start again on
# other devices (restarting), waiting for its allocation again to restart (waiting-to-restart), being
# paused to give its devices back (suspending), paused while its allocation waits (suspended).
RunShown = Literal[
    "starting",
    "running",
    "paused",
    "parked",
    "ending",
    "checkpointing",
    "restarting",
    "waiting-to-restart",
    "suspending",
    "suspended",
    "ended",
]

CONTROL_FAILED = 1  # the run's exit status when it ended the program itself
PREEMPTED = 1  # the run's exit status when gpud's preemption ended the task (fail, a revocation)
SIGKILL, SIGTERM = 9, 15  # POSIX's numbers, the same on every Linux


@dataclass(frozen=True, slots=True)
class Start:
    """Let the program (held before its exec) run; a program that ran before starts afresh."""


@dataclass(frozen=True, slots=True)
class Pause:
    why: str


@dataclass(frozen=True, slots=True)
class Resume:
    """Resume the tree (restoring its parked memory first)."""


@dataclass(frozen=True, slots=True)
class Release:
    """LOCK_RELEASED: the tree is paused."""


@dataclass(frozen=True, slots=True)
class Request:
    """Ask for the lock again (the driver's lock thread waits for the grant)."""


@dataclass(frozen=True, slots=True)
class Park:
    """Move the paused tree's GPU memory to host memory; the driver answers ``park_done``."""


@dataclass(frozen=True, slots=True)
class AnswerPark:
    ok: bool
    message: str = ""


@dataclass(frozen=True, slots=True)
class Forward:
    signal: int


@dataclass(frozen=True, slots=True)
class EndProgram:
    """Kill the whole tree: its state is unknown or it may not go on."""

    why: str


@dataclass(frozen=True, slots=True)
class Exit:
    status: int
    why: str = ""


@dataclass(frozen=True, slots=True)
class Yield:
    """YIELD the run's allocation: the program did what gpud's PREEMPT asked."""


@dataclass(frozen=True, slots=True)
class Allocate:
    """ALLOCATE the run's task again, waiting for room (``--wait``, or until granted); the driver
    answers ``reallocated`` or ``reallocation_failed``."""


@dataclass(frozen=True, slots=True)
class UseAllocation:
    """The next start runs on these devices (its environment, a fraction's session), with
    GPUD_RESUME=1 when ``resume``."""

    allocation: p.Allocated
    resume: bool


@dataclass(frozen=True, slots=True)
class ReportEscape:
    """Tell gpud (ESCAPED) that process ``pid`` of the paused program ran; ``escapes``: the run's count."""

    pid: int
    escapes: int


@dataclass(frozen=True, slots=True)
class Say:
    """One line for the run's user (stderr)."""

    text: str


RunAction = (
    Start
    | Pause
    | Resume
    | Release
    | Request
    | Park
    | AnswerPark
    | Forward
    | EndProgram
    | Exit
    | Yield
    | Allocate
    | UseAllocation
    | ReportEscape
    | Say
)
