"""The one state of a run (``RunCore``), what is orthogonal to it, and the table of its moves.

A run is in exactly one of these states, and a state carries all that matters while the run is in
it, so no flag outlives the state it belongs to:

- ``Normal(program)``: the allocation is the run's (or the run has none): the lock's rules apply.
  ``program``: ``starting`` (not started yet), ``running``, ``paused`` or ``parked``.
- ``Ending(after, program, kill_at, ...)``: the program is told to end (SIGTERM, or its checkpoint
  signal) and is killed at ``kill_at``; ``after`` it has ended: ``exit`` (its status), ``fail``,
  ``revoked`` (the run fails), ``checkpoint`` (wait for the allocation, then start it again), or
  ``restart`` (on ``next_allocation`` at once, YIELDing the ``partial`` notice first). ``notice``:
  the whole notice carried out (None: withdrawn, or a restart). It never starts afresh in it.
- ``Suspending(program)``, ``Suspended(program)``: paused (and parked where the backend can) to
  give the devices back, before and after its YIELD. No lock is held or asked for.
- ``Waiting()``: a checkpointed program has ended and yielded; the allocation is asked for again.
- ``Ended()``: the run has said its ``Exit``. Nothing happens after it: every call answers nothing.

Orthogonal, in ``Run``: whether the session holds the lock (``holding``), a signal's grace (a paused
program resumed to act on a signal is paused again at ``repause_at``), a park in flight and whom it
answers (``parking``), and what a refused resume goes back to.

The moves (``RunCore`` keeps the lock's, ``RecoveryRules`` the allocation's):

    state                     event                        next                            asks for
    Normal(starting)          granted                      Normal(running)                 Start
    Normal(paused | parked)   granted                      Normal(running)                 Resume
    Normal(running), holding  dropped, lost, idle          Normal(paused)                  Pause Release Request
    any, paused               park_done ok                 the same, parked                AnswerPark | (suspend's)
    any, paused, no lock      signalled                    the same, running for a grace   Resume Forward
    any but Ending, running   the grace is over (tick)     the same, paused                Pause
    Normal                    whole notice: suspend        Suspending (parking)|Suspended  Pause Release Park | Yield
    Normal                    whole notice: the others     Ending(exit|fail|checkpoint)    Resume Forward
    Normal                    partial notice, resize       Ending(restart)                 Resume Forward(SIGTERM)
    Ending                    kill_at passed (tick)        the same, no deadline           Forward(SIGKILL)
    Ending                    exited                       Ended | Waiting | Normal        Exit | Yield Allocate | Start
    Suspending                park_done                    Suspended                       Yield
    Suspending                withdrawn                    Normal                          Request | Resume
    Suspending | Suspended    changed resumed              Normal                          Request | Resume
    Waiting                   reallocated                  Normal                          UseAllocation Request|Start
    Normal | Suspend...       revoked gone                 Ending(revoked)                 Forward(SIGKILL)
    not started | Waiting     signalled                    Ended                           Exit
    any                       exited (not Ending), failed  Ended                           Exit

Plain values, no I/O: only the two rule modules change a ``Run``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from gpud_client import protocol as p
from gpud_client.core.run_actions import Pause, RunShown

Program = Literal["starting", "running", "paused", "parked"]
Stopped = Literal["paused", "parked"]
After = Literal["exit", "fail", "checkpoint", "restart", "revoked"]
Resize = Literal["restart", "keep"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """What a run is set up with (``RunCore``'s keywords), fixed before it begins."""

    idle_release: float | None = None  # None: never given back for idleness
    signal_grace: float = 5.0
    can_park: bool = False  # the backend can move the paused program's GPU memory to the host
    arbitrated: bool = True  # False: whole GPUs (or no daemon): never paused for the lock
    recovery: p.Recovery = p.Recovery.TERMINATE
    on_resize: Resize = "restart"
    checkpoint_signal: int = 10
    max_escapes: int = 3  # 0: never ended for escaping


@dataclass(frozen=True, slots=True)
class Normal:
    program: Program = "starting"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ending:
    after: After
    program: Program  # never starting while the run is in it: a program not started ends at once
    kill_at: float | None = None  # None: no hurry (withdrawn), or killed already
    kill_why: str = ""  # said when it is killed; a revocation's line is also its Exit's
    notice: p.Preempt | None = None
    partial: p.Preempt | None = None  # to YIELD once the program has ended (a restart)
    next_allocation: p.Allocated | None = None  # what a restart runs on (None: the allocation)


@dataclass(frozen=True, slots=True)
class Suspending:
    program: Program


@dataclass(frozen=True, slots=True)
class Suspended:
    program: Program


@dataclass(frozen=True, slots=True)
class Waiting:
    pass


@dataclass(frozen=True, slots=True)
class Ended:
    pass


State = Normal | Ending | Suspending | Suspended | Waiting | Ended


@dataclass(frozen=True, slots=True)
class Parking:
    """A park in flight (the driver answers ``park_done``): whom its end answers."""

    answer: bool = False  # gpud's PARK waits for PARKED
    suspend: bool = False  # a suspend waits for it to YIELD


def shown(state: State) -> RunShown:
    """What gpud shows of a run in ``state``: where a preemption has it, else its program's state."""
    match state:
        case Normal(program=program):
            return program
        case Ending(after="checkpoint"):
            return "checkpointing"
        case Ending(after="restart"):
            return "restarting"
        case Ending():
            return "ending"
        case Suspending():
            return "suspending"
        case Suspended():
            return "suspended"
        case Waiting():
            return "waiting-to-restart"
        case Ended():
            return "ended"


@dataclass(slots=True)
class Run:
    """A run as both its rule families see it: its one state and what is orthogonal to it."""

    state: State = Normal()
    holding: bool = False  # the session holds the lock
    repause_at: float | None = None  # a signal's grace ends: paused again unless its turn came
    resumed_from: Stopped = "paused"  # what the last grant resumed it from: a refused resume goes back
    parking: Parking | None = None
    pauses: int = 0

    @property
    def program(self) -> Program | None:
        """The program's state; None: no program (it waits to start again, or the run has ended)."""
        match self.state:
            case Normal(program=program) | Ending(program=program) | Suspending(program=program):
                return program
            case Suspended(program=program):
                return program
            case Waiting() | Ended():
                return None

    @property
    def started(self) -> bool:
        return self.program not in (None, "starting")

    def set_program(self, program: Program) -> None:
        """The program's state moves within the run's (never to ``starting``: only a restart does that)."""
        match self.state:
            case Normal() | Ending() | Suspending() | Suspended():
                self.state = replace(self.state, program=program)
            case Waiting() | Ended():
                pass

    def pause(self, why: str) -> Pause:
        self.set_program("paused")
        self.pauses += 1
        return Pause(why)
