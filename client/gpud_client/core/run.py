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
- Escapes: a process of the paused program seen running (continued from outside the
  run: the signal backend stops it again at once) is counted and reported to gpud;
  the ``max_escapes``-th ends the program, as one that will not stop does (0: never).
- When gpud takes the run's allocation back (PREEMPT and the pushes after it), the rules of
  ``core/recovery.py``, a part of ``RunCore``, decide: end, checkpoint, suspend or restart
  the program. The actions of both are in ``core/run_actions.py``.
"""

from __future__ import annotations

from gpud_client import protocol as p
from gpud_client.core.recovery import RecoveryRules, Resize
from gpud_client.core.run_actions import (
    CONTROL_FAILED,
    PREEMPTED,
    SIGKILL,
    SIGTERM,
    Allocate,
    AnswerPark,
    EndProgram,
    Exit,
    Forward,
    Park,
    Pause,
    Release,
    ReportEscape,
    Request,
    Resume,
    RunAction,
    RunShown,
    RunState,
    Say,
    Start,
    UseAllocation,
    Yield,
)

__all__ = [
    "CONTROL_FAILED",
    "PREEMPTED",
    "SIGKILL",
    "SIGTERM",
    "Allocate",
    "AnswerPark",
    "EndProgram",
    "Exit",
    "Forward",
    "Park",
    "Pause",
    "Release",
    "ReportEscape",
    "Request",
    "Resume",
    "RunAction",
    "RunCore",
    "RunShown",
    "RunState",
    "Say",
    "Start",
    "UseAllocation",
    "Yield",
]


class RunCore(RecoveryRules):
    def __init__(
        self,
        *,
        idle_release: float | None = None,
        signal_grace: float = 5.0,
        can_park: bool = False,
        arbitrated: bool = True,
        recovery: p.Recovery | str = p.Recovery.TERMINATE,
        on_resize: Resize = "restart",
        checkpoint_signal: int = 10,
        max_escapes: int = 3,
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
        self.max_escapes = max_escapes  # 0: never ended for escaping
        self.escapes = 0
        self._init_recovery(recovery, on_resize, checkpoint_signal)

    def shown(self) -> RunShown:
        """What the run is doing, for ``gpuctl clients`` and ``top``: where a preemption has it, else its
        program's state (not whether it holds a session: a suspended run holds none)."""
        if self.state == "ended":
            return "ended"
        match self.phase:
            case "ending" if self.after == "checkpoint":
                return "checkpointing"
            case "ending" if self.after == "restart":
                return "restarting"
            case "ending":
                return "ending"
            case "waiting":
                return "waiting-to-restart"
            case "suspending" | "suspended":
                return self.phase
        return self.state

    # --- what happened -----------------------------------------------------------

    def begin(self, now: float) -> list[RunAction]:
        """The run is set up: ask for the lock, or start at once when not arbitrated."""
        if not self.arbitrated:
            return self.granted(now)
        return [Request()]

    def granted(self, now: float) -> list[RunAction]:
        if self.phase in ("suspending", "suspended", "waiting") and self.state != "ended":
            return [Release()]  # asked for before: the devices are not the run's now
        self.holding = True
        self.last_activity, self.activity, self.repause_at = now, None, None
        if self.state == "ended" or self.phase == "ending":
            return []  # an ending program runs to its end
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
        if self.phase == "ending":
            self.holding = False
            return [Release()]  # it is never paused while it ends, and needs no further turn
        return self._give_back("the daemon asked for the lock (DROP_LOCK)")

    def lost(self, now: float, why: str = "") -> list[RunAction]:
        """The lock went without our LOCK_RELEASED (revoked, or gpud gone: ``why``): pause, end the
        session's open slice (``Release``), ask again; and say so as it is (a program paused at once
        did not run on unarbitrated)."""
        if not self.holding:
            return []
        if self.phase == "ending":
            self.holding = False
            return [Release()]
        lost = why or "the GPU lock was lost"
        if self.state != "running":
            self.holding = False
            return [Say(f"the program stays paused: {lost}; it waits for its turn"), Release(), Request()]
        pause, *rest = self._give_back("the lock was lost")
        return [pause, Say(f"the program was paused at once: {lost}; it waits for its turn"), *rest]

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
        self.park_for_daemon = True
        if self.parking:
            return []  # the suspend's park in flight answers it too
        self.parking = True
        return [Park()]

    def park_done(self, ok: bool, message: str = "") -> list[RunAction]:
        self.parking = False
        if ok and self.state == "paused":
            self.state, self.parked = "parked", True
        answer: list[RunAction] = [AnswerPark(ok, message)] if self.park_for_daemon else []
        self.park_for_daemon = False
        if self.suspend_park:
            return [*answer, *self._suspend_parked(ok, message)]
        return answer

    def tick(self, now: float, activity: float | None) -> list[RunAction]:
        """A look at the program: its cumulative activity (the CPU seconds its tree has used)."""
        actions: list[RunAction] = []
        if self.kill_at is not None and now >= self.kill_at:
            self.kill_at = None
            if self.started and self.state != "ended":
                actions += [Say(self.kill_why), Forward(SIGKILL)]
        if self.repause_at is not None and now >= self.repause_at:
            self.repause_at = None
            if self.state == "running" and not self.holding and self.phase != "ending":
                self.state = "paused"
                self.pauses += 1
                actions.append(Pause(f"the signal's grace of {self.signal_grace:g} s is over; waiting for its turn"))
        if self.state != "running" or not self.holding or self.idle_release is None or not self.arbitrated:
            return actions
        if self.phase != "normal":
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
        for deadline in (self.repause_at, self.kill_at):
            if deadline is not None:
                at = min(at, deadline)
        if self.idle_release is not None and self.holding and self.state == "running" and self.arbitrated:
            at = min(at, max(now, self.last_activity + self.idle_release))  # released on time, not a tick late
        return at

    def signalled(self, signum: int, now: float) -> list[RunAction]:
        if self.state == "ended":
            return []
        if not self.started:
            self.state = "ended"
            when = (
                "while the run waited for its allocation" if self.phase == "waiting" else "before the program started"
            )
            return [Exit(128 + signum, f"signal {signum} {when}")]
        if self.state in ("paused", "parked") and not self.holding:
            if self.state == "parked":
                return [Forward(signum)]  # its memory is not on the GPU: it acts on it when resumed
            self.state = "running"
            self.repause_at = now + self.signal_grace
            return [Resume(), Forward(signum)]
        return [Forward(signum)]

    def exited(self, status: int) -> list[RunAction]:
        if self.phase == "ending" and self.state != "ended":
            return self._ended(status)
        self.state = "ended"
        return [Exit(status)]

    def failed(self, why: str) -> list[RunAction]:
        """Process control failed and the program's state is unknown: it ends."""
        if self.state == "ended":
            return []
        self.state = "ended"
        return [EndProgram(why), Exit(CONTROL_FAILED, why)]

    def escaped(self, pid: int, why: str, *, fatal: bool = False) -> list[RunAction]:
        """Process ``pid`` of the paused tree was seen running (``why``) and stopped again; ``fatal``: it
        could not be stopped again. Counted, reported; the ``max_escapes``-th (or a fatal one) ends it."""
        if self.state == "ended":
            return []
        self.escapes += 1
        report: list[RunAction] = [ReportEscape(pid, self.escapes)]
        if fatal:
            return [*report, *self.failed(f"process {pid} of the program ran while paused: {why}")]
        if self.max_escapes and self.escapes >= self.max_escapes:
            why = (
                f"processes of the program ran while it was paused {self.escapes} times (continued from outside "
                f"the run; the last: process {pid}, {why}): --max-escapes {self.max_escapes} ends it"
            )
            return [*report, *self.failed(why)]
        of = f" of {self.max_escapes}" if self.max_escapes else ""
        return [
            *report,
            Say(f"process {pid} of the program ran while paused ({why}); stopped again (escape {self.escapes}{of})"),
        ]

    def _give_back(self, why: str) -> list[RunAction]:
        self.holding = False
        self.state = "paused"
        self.pauses += 1
        return [Pause(why), Release(), Request()]
