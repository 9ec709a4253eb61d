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
  ``core/recovery.py`` (``RecoveryRules``, a collaborator ``RunCore`` hands those pushes to)
  decide: end, checkpoint, suspend or restart the program.

Both rule families move one explicit state, ``Run.state`` (``core/run_state.py``, with the table
of its moves): ``Normal(program)``, ``Ending``, ``Suspending``, ``Suspended``, ``Waiting`` or
``Ended``; after ``Ended`` nothing happens. Their actions are in ``core/run_actions.py``.
"""

from __future__ import annotations

from dataclasses import replace

from gpud_client import protocol as p
from gpud_client.core.recovery import RecoveryRules
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
    Say,
    Start,
    UseAllocation,
    Yield,
)
from gpud_client.core.run_state import (
    Ended,
    Ending,
    Normal,
    Parking,
    Resize,
    Run,
    RunConfig,
    State,
    Suspended,
    Suspending,
    Waiting,
    shown,
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
    "Say",
    "Start",
    "UseAllocation",
    "Yield",
]


class RunCore:
    """A run's rules: the driver tells it what happened and carries out the actions it returns, in order."""

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
        self.config = RunConfig(
            idle_release=idle_release,
            signal_grace=signal_grace,
            can_park=can_park,
            arbitrated=arbitrated,
            recovery=p.Recovery(recovery),
            on_resize=on_resize,
            checkpoint_signal=checkpoint_signal,
            max_escapes=max_escapes,
        )
        self.run = Run()
        self.recovery = RecoveryRules(self.config, self.run)
        self.last_activity = 0.0  # when its activity last moved (idle release)
        self.activity: float | None = None  # as last looked at; None: not since the grant
        self.idle_releases = 0
        self.escapes = 0

    @property
    def state(self) -> State:
        return self.run.state

    def shown(self) -> RunShown:
        """What the run is doing, for ``gpuctl clients`` and ``top``: where a preemption has it, else its
        program's state (not whether it holds a session: a suspended run holds none)."""
        return shown(self.run.state)

    # --- what happened -----------------------------------------------------------

    def begin(self, now: float) -> list[RunAction]:
        """The run is set up: ask for the lock, or start at once when not arbitrated."""
        if not self.config.arbitrated:
            return self.granted(now)
        return [Request()]

    def granted(self, now: float) -> list[RunAction]:
        run = self.run
        match run.state:
            case Suspending() | Suspended() | Waiting():
                return [Release()]  # asked for before: the devices are not the run's now
            case Ended():
                return []
        run.holding = True
        self.last_activity, self.activity, run.repause_at = now, None, None
        match run.state:
            case Normal(program="starting"):
                run.state = Normal("running")
                return [Start()]
            case Normal(program="paused"):
                run.resumed_from, run.state = "paused", Normal("running")
                return [Resume()]
            case Normal(program="parked"):
                run.resumed_from, run.state = "parked", Normal("running")
                return [Resume()]
        return []  # an ending program runs to its end; a running one (a signal's grace) goes on, arbitrated

    def dropped(self, now: float) -> list[RunAction]:
        """DROP_LOCK: pause, give the lock back, ask again."""
        run = self.run
        if not run.holding or isinstance(run.state, Ended):
            return []
        if isinstance(run.state, Ending):
            run.holding = False
            return [Release()]  # it is never paused while it ends, and needs no further turn
        return self._give_back("the daemon asked for the lock (DROP_LOCK)")

    def lost(self, now: float, why: str = "") -> list[RunAction]:
        """The lock went without our LOCK_RELEASED (revoked, or gpud gone: ``why``): pause, end the
        session's open slice (``Release``), ask again; and say so as it is (a program paused at once
        did not run on unarbitrated)."""
        run = self.run
        if not run.holding or isinstance(run.state, Ended):
            return []
        if isinstance(run.state, Ending):
            run.holding = False
            return [Release()]
        lost = why or "the GPU lock was lost"
        if run.program != "running":
            run.holding = False
            return [Say(f"the program stays paused: {lost}; it waits for its turn"), Release(), Request()]
        pause, *rest = self._give_back("the lock was lost")
        return [pause, Say(f"the program was paused at once: {lost}; it waits for its turn"), *rest]

    def resume_refused(self, why: str = "") -> list[RunAction]:
        """The backend could not resume yet (``why``: no room on the GPU for the parked memory): the
        program stays parked, the turn goes back, and the lock is asked for again. A run of whole GPUs
        has no turn to wait for: its program is ended rather than left paused for good."""
        run = self.run
        if isinstance(run.state, Ended):
            return []
        if not self.config.arbitrated:
            return self.failed(f"could not resume the program on its own GPUs: {why}; it was ended, never left paused")
        run.holding = False
        run.set_program(run.resumed_from)
        return [Say(f"could not resume the program yet: {why}; giving the turn back"), Release(), Request()]

    def park_asked(self) -> list[RunAction]:
        run = self.run
        if isinstance(run.state, Ended):
            return []
        if run.holding or run.program == "running":
            return [AnswerPark(False, "the program holds the GPU again")]
        if not run.started or run.program == "parked":
            return [AnswerPark(True)]  # nothing of it is on the GPU
        if not self.config.can_park:
            return [AnswerPark(False, "this run's backend cannot park GPU memory (signal)")]
        in_flight = run.parking
        run.parking = Parking(answer=True, suspend=in_flight is not None and in_flight.suspend)
        return [] if in_flight is not None else [Park()]  # the suspend's park in flight answers it too

    def park_done(self, ok: bool, message: str = "") -> list[RunAction]:
        run = self.run
        parking, run.parking = run.parking or Parking(), None
        if isinstance(run.state, Ended):
            return []
        if ok and run.program == "paused":
            run.set_program("parked")
        answer: list[RunAction] = [AnswerPark(ok, message)] if parking.answer else []
        if parking.suspend:
            return [*answer, *self.recovery.suspend_parked(ok, message)]
        return answer

    def tick(self, now: float, activity: float | None) -> list[RunAction]:
        """A look at the program: its cumulative activity (the CPU seconds its tree has used)."""
        run = self.run
        if isinstance(run.state, Ended):
            return []
        actions: list[RunAction] = []
        if isinstance(state := run.state, Ending) and state.kill_at is not None and now >= state.kill_at:
            run.state = replace(state, kill_at=None)
            actions += [Say(state.kill_why), Forward(SIGKILL)]
        if run.repause_at is not None and now >= run.repause_at:
            run.repause_at = None
            if run.program == "running" and not run.holding and not isinstance(run.state, Ending):
                actions.append(
                    run.pause(f"the signal's grace of {self.config.signal_grace:g} s is over; waiting for its turn")
                )
        idle_release = self.config.idle_release
        if run.state != Normal("running") or not run.holding or idle_release is None or not self.config.arbitrated:
            return actions
        if activity is not None and self.activity is None:
            self.activity = activity  # the first look since the grant: what activity is measured from
        elif activity is not None and activity != self.activity:
            self.activity, self.last_activity = activity, now
        elif now - self.last_activity >= idle_release:
            self.idle_releases += 1
            return [*actions, *self._give_back(f"idle for {idle_release:g} s")]
        return actions

    def next_tick(self, now: float, interval: float) -> float:
        """When ``tick`` should next be called."""
        run, config = self.run, self.config
        at = now + interval
        kill_at = run.state.kill_at if isinstance(run.state, Ending) else None
        for deadline in (run.repause_at, kill_at):
            if deadline is not None:
                at = min(at, deadline)
        if config.idle_release is not None and run.holding and run.program == "running" and config.arbitrated:
            at = min(at, max(now, self.last_activity + config.idle_release))  # released on time, not a tick late
        return at

    def signalled(self, signum: int, now: float) -> list[RunAction]:
        run = self.run
        match run.state:
            case Ended():
                return []
            case Waiting():
                run.state = Ended()
                return [Exit(128 + signum, f"signal {signum} while the run waited for its allocation")]
        if not run.started:
            run.state = Ended()
            return [Exit(128 + signum, f"signal {signum} before the program started")]
        if run.program == "paused" and not run.holding:
            run.set_program("running")
            run.repause_at = now + self.config.signal_grace
            return [Resume(), Forward(signum)]
        return [Forward(signum)]  # parked: its memory is not on the GPU: it acts on it when resumed

    def exited(self, status: int) -> list[RunAction]:
        match state := self.run.state:
            case Ending():
                return self.recovery.program_ended(state, status)
            case Ended():
                return []
        self.run.state = Ended()
        return [Exit(status)]

    def failed(self, why: str) -> list[RunAction]:
        """Process control failed and the program's state is unknown: it ends."""
        if isinstance(self.run.state, Ended):
            return []
        self.run.state = Ended()
        return [EndProgram(why), Exit(CONTROL_FAILED, why)]

    def escaped(self, pid: int, why: str, *, fatal: bool = False) -> list[RunAction]:
        """Process ``pid`` of the paused tree was seen running (``why``) and stopped again; ``fatal``: it
        could not be stopped again. Counted, reported; the ``max_escapes``-th (or a fatal one) ends it."""
        if isinstance(self.run.state, Ended):
            return []
        self.escapes += 1
        report: list[RunAction] = [ReportEscape(pid, self.escapes)]
        if fatal:
            return [*report, *self.failed(f"process {pid} of the program ran while paused: {why}")]
        most = self.config.max_escapes
        if most and self.escapes >= most:
            why = (
                f"processes of the program ran while it was paused {self.escapes} times (continued from outside "
                f"the run; the last: process {pid}, {why}): --max-escapes {most} ends it"
            )
            return [*report, *self.failed(why)]
        of = f" of {most}" if most else ""
        return [
            *report,
            Say(f"process {pid} of the program ran while paused ({why}); stopped again (escape {self.escapes}{of})"),
        ]

    def _give_back(self, why: str) -> list[RunAction]:
        self.run.holding = False
        return [self.run.pause(why), Release(), Request()]

    # --- what gpud says of the allocation (``RecoveryRules``) ---------------------------

    @property
    def gone(self) -> bool:
        """The allocation no longer exists (gpud took it back)."""
        return self.recovery.gone

    def use_allocation(self, allocation: p.Allocated) -> None:
        self.recovery.use_allocation(allocation)

    def preempted(self, push: p.Preempt, now: float) -> list[RunAction]:
        return self.recovery.preempted(push, now)

    def withdrawn(self, now: float) -> list[RunAction]:
        return self.recovery.withdrawn(now)

    def revoked(self, push: p.AllocRevoked, now: float) -> list[RunAction]:
        return self.recovery.revoked(push, now)

    def changed(self, push: p.AllocChanged, now: float) -> list[RunAction]:
        return self.recovery.changed(push, now)

    def reallocated(self, allocation: p.Allocated, now: float) -> list[RunAction]:
        return self.recovery.reallocated(allocation, now)

    def reallocation_failed(self, why: str) -> list[RunAction]:
        return self.recovery.reallocation_failed(why)
