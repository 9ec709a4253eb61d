"""The interface every process-control backend keeps, and its errors.

A backend pauses and resumes a process tree (``ProcessTree``), and where it can,
parks the tree's GPU memory in host memory and brings it back. The decisions
(when to pause, when to park) are not a backend's: the run's supervisor and the
daemon make them. A backend only carries them out, and says clearly when it
cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gpud_client.proctl.tree import ProcessTree


class ControlError(Exception):
    """A backend could not do what it was asked. ``fatal``: the program's state is no longer
    known (a driver call hung or failed half-way), so the run must end it rather than let it
    go on unarbitrated or leave it paused for good."""

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


@dataclass(slots=True)
class Paused:
    """What one pause did: which processes were locked through the driver and which were stopped
    with SIGSTOP (never both for one process), and what fell back and why."""

    locked: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)  # one line per process that fell back


class Backend(Protocol):
    name: str  # "signal", "cuda", "cgroup" or "cuda+cgroup"

    @property
    def can_park(self) -> bool:
        """Whether ``park`` can move GPU memory to host memory at all (the cuda backend)."""
        ...

    def pause(self, tree: ProcessTree) -> Paused:
        """Stop the whole tree from reaching the GPU, and return once its submitted GPU work has
        drained (``cuda``) or every process is stopped (``signal``). Raises ControlError."""
        ...

    def resume(self, tree: ProcessTree) -> None:
        """Undo the last pause: every process it paused goes on (restored first if parked)."""
        ...

    def park(self, tree: ProcessTree) -> int:
        """The tree is paused: move its GPU memory to host memory; returns the bytes moved.
        Refuses (ControlError, not fatal) when host memory is short; the tree stays paused."""
        ...

    def close(self) -> None: ...
