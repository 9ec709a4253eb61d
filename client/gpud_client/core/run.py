"""The rules of a run (``gpuctl run``): when its program runs, pauses, parks, and how the run ends.

A run is a supervisor that holds a session for a program it starts and carries the
daemon's decisions out on the program's whole process tree. Its decisions are here,
on injected time, with no process, socket or clock: the driver
(``gpud_client.run.supervisor``) feeds in what happened and carries out the actions
in order, telling the core how each process-control action went.

- The program starts only once the session holds the lock, and runs only while it
  does. A DROP_LOCK, or a lock lost (a revocation, gpud gone), pauses the whole tree;
  then the lock goes back and is asked for again at once: the program is treated as
  always having work, like a training job.
- Idle release: a program that shows no activity (its CPU time, or its GPU
  utilisation where NVML reports it) for ``idle_release`` seconds while it holds is
  paused and gives the lock back, then waits behind the sessions queued meanwhile.
- Parking: the daemon's PARK is answered by parking the paused program (when the
  backend can), or at once when there is nothing on the GPU to park; a grant resumes a
  parked program (the driver restores its memory first).
- Signals to the run reach the program's process group. A paused program is resumed
  to receive one (it could not act on it stopped) and paused again after
  ``signal_grace`` unless its turn came meanwhile: it runs unarbitrated at most that long.
- The run ends with the program's exit status. A process-control failure that leaves
  the program's state unknown ends the program: it never goes on unarbitrated, and is
  never left paused for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RunState = Literal["starting", "running", "paused", "parked", "ended"]


@dataclass(frozen=True, slots=True)
class Start:
    """Let the program (held before its exec) run."""


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


RunAction = Start | Pause | Resume | Release | Request | Park | AnswerPark | Forward | EndProgram | Exit

CONTROL_FAILED = 1  # the run's exit status when it ended the program itself


class RunCore:
    def __init__(
        self,
        *,
        idle_release: float | None = None,
        signal_grace: float = 5.0,
        can_park: bool = False,
        arbitrated: bool = True,
    ) -> None:
        self.idle_release = idle_release
        self.signal_grace = signal_grace
        self.can_park = can_park
        self.arbitrated = arbitrated  # False: a whole-GPU allocation (or no daemon): never paused
        self.state: RunState = "starting"
        self.holding = False
        self.started = False
        self.parked = False
        self.parking = False
        self.last_activity = 0.0
        self.activity: float | None = None
        self.repause_at: float | None = None
        self.resumed_from: RunState = "paused"
        self.last_park_bytes: int | None = None  # what the last park moved (the driver says)
        self.pauses = 0
        self.idle_releases = 0

    # --- what happened -----------------------------------------------------------

    def begin(self, now: float) -> list[RunAction]:
        """The run is set up: ask for the lock, or start at once when not arbitrated."""
        if not self.arbitrated:
            return self.granted(now)
        return [Request()]

    def granted(self, now: float) -> list[RunAction]:
        self.holding = True
        self.last_activity, self.activity, self.repause_at = now, None, None
        if self.state == "ended":
            return []
        if not self.started:
            self.started = True
            self.state = "running"
            return [Start()]
        if self.state in ("paused", "parked"):
            self.resumed_from = self.state
            self.state, self.parked = "running", False
            return [Resume()]
        return []  # it was running already (a signal's grace): it goes on, now arbitrated

    def dropped(self, now: float) -> list[RunAction]:
        """DROP_LOCK: pause, give the lock back, ask again."""
        if not self.holding:
            return []
        return self._give_back("the daemon asked for the lock (DROP_LOCK)")

    def lost(self, now: float) -> list[RunAction]:
        """The lock went without our LOCK_RELEASED (revoked, or gpud gone): pause, end the session's
        open slice (``Release``), ask again."""
        if not self.holding:
            return []
        if self.state != "running":
            self.holding = False
            return [Release(), Request()]
        return self._give_back("the lock was lost")

    def resume_refused(self) -> list[RunAction]:
        """The backend could not resume yet (no room on the GPU for the parked memory): the program
        stays parked, the turn goes back, and the lock is asked for again."""
        self.holding = False
        self.state = self.resumed_from
        self.parked = self.state == "parked"
        return [Release(), Request()]

    def park_asked(self) -> list[RunAction]:
        if self.holding or self.state == "running":
            return [AnswerPark(False, "the program holds the GPU again")]
        if not self.started or self.parked:
            return [AnswerPark(True)]  # nothing of it is on the GPU
        if not self.can_park:
            return [AnswerPark(False, "this run's backend cannot park GPU memory (signal)")]
        if self.parking:
            return []
        self.parking = True
        return [Park()]

    def park_done(self, ok: bool, message: str = "") -> list[RunAction]:
        self.parking = False
        if ok and self.state == "paused":
            self.state, self.parked = "parked", True
        return [AnswerPark(ok, message)]

    def tick(self, now: float, activity: float | None) -> list[RunAction]:
        """A look at the program: its cumulative activity (the CPU seconds its tree has used)."""
        actions: list[RunAction] = []
        if self.repause_at is not None and now >= self.repause_at:
            self.repause_at = None
            if self.state == "running" and not self.holding:
                self.state = "paused"
                self.pauses += 1
                actions.append(Pause(f"the signal's grace of {self.signal_grace:g} s is over; waiting for its turn"))
        if self.state != "running" or not self.holding or self.idle_release is None or not self.arbitrated:
            return actions
        if activity is not None and self.activity is None:
            self.activity = activity  # the first look since the grant: what activity is measured from
        elif activity is not None and activity != self.activity:
            self.activity, self.last_activity = activity, now
        elif now - self.last_activity >= self.idle_release:
            self.idle_releases += 1
            return [*actions, *self._give_back(f"idle for {self.idle_release:g} s")]
        return actions

    def next_tick(self, now: float, interval: float) -> float:
        """When ``tick`` should next be called."""
        at = now + interval
        if self.repause_at is not None:
            at = min(at, self.repause_at)
        if self.idle_release is not None and self.holding and self.state == "running" and self.arbitrated:
            at = min(at, max(now, self.last_activity + self.idle_release))  # released on time, not a tick late
        return at

    def signalled(self, signum: int, now: float) -> list[RunAction]:
        if not self.started:
            self.state = "ended"
            return [Exit(128 + signum, f"signal {signum} before the program started")]
        if self.state in ("paused", "parked") and not self.holding:
            if self.state == "parked":
                return [Forward(signum)]  # its memory is not on the GPU: it acts on it when resumed
            self.state = "running"
            self.repause_at = now + self.signal_grace
            return [Resume(), Forward(signum)]
        return [Forward(signum)]

    def exited(self, status: int) -> list[RunAction]:
        self.state = "ended"
        return [Exit(status)]

    def failed(self, why: str) -> list[RunAction]:
        """Process control failed and the program's state is unknown: it ends."""
        if self.state == "ended":
            return []
        self.state = "ended"
        return [EndProgram(why), Exit(CONTROL_FAILED, why)]

    def _give_back(self, why: str) -> list[RunAction]:
        self.holding = False
        self.state = "paused"
        self.pauses += 1
        return [Pause(why), Release(), Request()]
