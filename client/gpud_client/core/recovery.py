"""The rules of a run whose allocation gpud takes back: PREEMPT, PREEMPT_WITHDRAWN, ALLOC_REVOKED and
ALLOC_CHANGED, on injected time.

``RecoveryRules`` is a collaborator of ``RunCore`` (``core/run.py``): it keeps the allocation's side
(what the allocation is, what the program was started on, whether it is gone) and moves the run's
one state (``core/run_state.py``, shared with the lock's rules) into and out of the states a
preemption brings:

- ``Ending``: the program is being ended, for a whole notice (terminate, fail: SIGTERM; checkpoint:
  its signal) or to restart it on other devices (an elastic resize, a partial notice). It is never
  paused meanwhile: a paused program is resumed to act on the signal, a DROP_LOCK only gives the
  lock back. It is killed at ``kill_at``: the daemon's grace less ``KILL_MARGIN_S`` (so that it has
  ended before the daemon takes the devices), or the signal grace for a restart. Once it has ended,
  ``after`` says what comes next. A second notice keeps the earlier deadline.
- ``Suspending``, ``Suspended``: the tree is paused (and parked where the backend can), then YIELD;
  meanwhile the run neither holds nor asks for the lock. ALLOC_CHANGED ``resumed`` resumes it.
- ``Waiting``: a checkpointed program has ended and yielded; the run asks for its allocation again
  and starts the program with the answer's resume flag (GPUD_RESUME=1).

It must never let a program run on devices that are no longer the run's: ALLOC_REVOKED ``gone``
kills a program that still runs, at once. Not a reason to kill: the revocation that answers the
run's own YIELD while it waits (nothing runs then).
"""

from __future__ import annotations

from dataclasses import replace

import msgspec

from gpud_client import protocol as p
from gpud_client.core.run_actions import (
    PREEMPTED,
    SIGKILL,
    SIGTERM,
    Allocate,
    Exit,
    Forward,
    Park,
    Release,
    Request,
    Resume,
    RunAction,
    Say,
    Start,
    UseAllocation,
    Yield,
)
from gpud_client.core.run_state import (
    After,
    Ended,
    Ending,
    Normal,
    Parking,
    Program,
    Run,
    RunConfig,
    Suspended,
    Suspending,
    Waiting,
)
from gpud_client.core.run_state import Resize as Resize

KILL_MARGIN_S = 0.5  # the run kills an ending program this long before the daemon's grace ends
_ENDS = (p.Recovery.TERMINATE, p.Recovery.SHRINK)  # a whole notice that ends the task


def without(a: p.Allocated, gpus: list[int]) -> p.Allocated:
    """``a`` less ``gpus`` (what a partial notice takes): what its program runs on next."""
    kept = [i for i, g in enumerate(a.gpus) if g not in gpus]
    return msgspec.structs.replace(
        a,
        gpus=[a.gpus[i] for i in kept],
        uuids=[a.uuids[i] for i in kept if i < len(a.uuids)],
        cuda_visible_devices=",".join(str(a.gpus[i]) for i in kept),
    )


def notice_line(push: p.Preempt) -> str:
    return f"task {push.task_id} was preempted by {push.by} ({push.reason})"


class RecoveryRules:
    """The allocation's side of a run: ``RunCore`` hands it gpud's pushes and an ending program's end."""

    def __init__(self, config: RunConfig, run: Run) -> None:
        self.config = config
        self.run = run  # the run's state, shared with the lock's rules
        self.allocation: p.Allocated | None = None  # the run's, as gpud last said it
        self.program_gpus: list[int] | None = None  # what the program was started on
        self.gone = False  # the allocation no longer exists
        self.told_waiting = False  # the waiting line is said once
        self.preemptions = 0

    def use_allocation(self, allocation: p.Allocated) -> None:
        """The allocation the run starts its program on (the first ALLOCATED)."""
        self.allocation = allocation
        self.program_gpus = list(allocation.gpus)

    # --- what gpud says ---------------------------------------------------------------------------

    def preempted(self, push: p.Preempt, now: float) -> list[RunAction]:
        state = self.run.state
        if isinstance(state, Ended) or self.allocation is None:
            return []
        self.preemptions += 1
        if not push.whole:
            return self._partial(push, now)
        grace = f"{push.grace_s:g} s"
        kill_at = now + max(0.0, push.grace_s - KILL_MARGIN_S)
        if not isinstance(state, Normal):
            return self._noticed_again(push, kill_at)
        line = notice_line(push)
        match push.recovery:
            case p.Recovery.SUSPEND:
                return [Say(f"{line}: suspending the program"), *self._suspend(state, push)]
            case p.Recovery.CHECKPOINT:
                say = Say(f"{line}: its checkpoint signal ({self.config.checkpoint_signal}); it has {grace}")
                return [say, *self._end(state, "checkpoint", self.config.checkpoint_signal, kill_at, grace, push)]
            case p.Recovery.FAIL:
                say = Say(f"{line}: ending the program (--on-preempt fail)")
                return [say, *self._end(state, "fail", SIGTERM, kill_at, grace, push)]
            case _:  # terminate, and a shrink taken whole (never sent: an elastic minimum is kept)
                say = Say(f"{line}: ending the program within {grace}")
                return [say, *self._end(state, "exit", SIGTERM, kill_at, grace, push)]

    def _noticed_again(self, push: p.Preempt, kill_at: float) -> list[RunAction]:
        """A whole notice while the program already ends (a restart, an earlier notice) or is being
        suspended: the earlier deadline holds, and a restart becomes what the notice asks (a suspend,
        as a checkpoint: the program has been told to end already)."""
        state = self.run.state
        if not isinstance(state, Ending):
            return []  # suspending, suspended or waiting: the devices are on their way back
        after = state.after
        if after == "restart":
            recovery = push.recovery
            after = "fail" if recovery == p.Recovery.FAIL else "exit" if recovery in _ENDS else "checkpoint"
        earlier = kill_at if state.kill_at is None else min(state.kill_at, kill_at)
        self.run.state = replace(state, after=after, kill_at=earlier, notice=push, partial=None)
        return [Say(f"{notice_line(push)}: the program is ending already")]

    def withdrawn(self, now: float) -> list[RunAction]:
        """The waiter gave up: undo what can be. A suspend not yet yielded resumes; a checkpoint that
        ends restarts on the allocation it keeps; a terminate or fail already signalled goes on."""
        match state := self.run.state:
            case Suspending(program=program):
                self.run.state = Normal(program)
                return [] if self.run.parking is not None else self._back_to_work()  # else once parked
            case Ending(after="restart", partial=partial) if partial is not None:  # on the whole allocation
                self.run.state = replace(state, kill_at=None, notice=None, partial=None, next_allocation=None)
            case Ending():
                self.run.state = replace(state, kill_at=None, notice=None)  # the devices stay the run's
        return []

    def revoked(self, push: p.AllocRevoked, now: float) -> list[RunAction]:
        if not push.gone:
            return []  # suspended: the answer to its YIELD; it waits for ALLOC_CHANGED resumed
        self.gone = True
        run = self.run
        match state := run.state:
            case Waiting() | Ended():
                return []  # nothing runs: the answer to its YIELD, or a late word
            case Ending():
                run.state = replace(state, kill_at=None)
                return [Forward(SIGKILL)]
            case Normal(program=program) | Suspending(program=program) | Suspended(program=program):
                pass
        why = (
            f"gpud revoked the allocation of task {push.task_id} ({push.reason}): its devices are no "
            "longer the run's, so the program was killed"
        )
        ending = Ending(after="revoked", program=program, kill_why=why)
        if program == "starting":
            return [Say(why), *self.program_ended(ending, None)]
        run.repause_at = None
        run.state = ending
        return [Say(why), Forward(SIGKILL)]

    def changed(self, push: p.AllocChanged, now: float) -> list[RunAction]:
        a = push.allocation
        self.allocation = a
        state = self.run.state
        if push.change == "resumed":
            if not isinstance(state, Suspending | Suspended):
                return []
            self.run.state, self.gone = Normal(state.program), False
            return [Say(f"task {a.task_id} has its devices again: resuming the program"), *self._back_to_work()]
        if isinstance(state, Ending) and state.after == "restart":
            self.run.state = replace(state, next_allocation=a)  # its restart runs on these
            return []
        if self.program_gpus is not None and sorted(a.gpus) == sorted(self.program_gpus):
            return []  # the program runs on these already (a partial notice restarted it on them)
        if self.config.on_resize == "keep" or not isinstance(state, Normal):
            return []
        say = Say(f"task {a.task_id} {push.change} to GPUs {a.gpus}: restarting the program on them")
        grace = self.config.signal_grace
        return [say, *self._end(state, "restart", SIGTERM, now + grace, f"{grace:g} s", next_allocation=a)]

    def reallocated(self, allocation: p.Allocated, now: float) -> list[RunAction]:
        """The ALLOCATED that answers ``Allocate``."""
        if not isinstance(self.run.state, Waiting):
            return []
        self.gone = False
        return self._restart(allocation, resume=allocation.resume)

    def reallocation_failed(self, why: str) -> list[RunAction]:
        if isinstance(self.run.state, Ended):
            return []
        self.run.state = Ended()
        return [Say(why), Exit(PREEMPTED, why)]

    # --- the program's end -------------------------------------------------------------------------

    def _partial(self, push: p.Preempt, now: float) -> list[RunAction]:
        assert self.allocation is not None
        say = Say(f"{notice_line(push)}: giving back GPUs {push.gpus}")
        state = self.run.state
        if isinstance(state, Ending) and state.after == "restart":
            rest = without(state.next_allocation or self.allocation, push.gpus)
            self.run.state = replace(state, partial=push, next_allocation=rest)
            return [say]
        if self.config.on_resize == "keep" or not isinstance(state, Normal):
            return [say, Yield()]  # the program goes on as it is (keep), or is not running on them
        grace = min(self.config.signal_grace, max(0.0, push.grace_s - KILL_MARGIN_S))
        rest = without(self.allocation, push.gpus)
        return [
            say,
            *self._end(state, "restart", SIGTERM, now + grace, f"{grace:g} s", partial=push, next_allocation=rest),
        ]

    def _end(
        self,
        state: Normal,
        after: After,
        signum: int,
        kill_at: float,
        grace: str,
        notice: p.Preempt | None = None,
        *,
        partial: p.Preempt | None = None,
        next_allocation: p.Allocated | None = None,
    ) -> list[RunAction]:
        """End the program with ``signum``, SIGKILL at ``kill_at``; ``after`` it has ended."""
        ending = Ending(
            after=after, program=state.program, notice=notice, partial=partial, next_allocation=next_allocation
        )
        if state.program == "starting":
            return self.program_ended(ending, None)
        self.run.repause_at = None
        resume: list[RunAction] = [] if state.program == "running" else [Resume()]  # stopped, it could not act
        why = f"the program did not end within {grace}: killing it"
        self.run.state = replace(ending, program="running", kill_at=kill_at, kill_why=why)
        return [*resume, Forward(signum)]

    def program_ended(self, ending: Ending, status: int | None) -> list[RunAction]:
        """The program ended (``status``; None: it never started) while the run was ``ending``."""
        run = self.run
        actions = self._let_go()
        match ending.after:
            case "exit":
                run.state = Ended()
                if status is not None:
                    return [*actions, Exit(status)]  # the program's own status
                why = "the task was preempted before its program started"
                return [*actions, Say(why), Exit(PREEMPTED, why)]
            case "fail":
                run.state = Ended()
                why = self._fail_line(ending.notice)
                return [*actions, Say(why), Exit(PREEMPTED, why)]
            case "revoked":
                run.state = Ended()
                return [*actions, Exit(PREEMPTED, ending.kill_why)]
            case "checkpoint":
                if ending.notice is None and not self.gone:  # withdrawn: the allocation is still the run's
                    assert self.allocation is not None
                    return [*actions, *self._restart(self.allocation, resume=True)]
                run.state = Waiting()
                if not self.told_waiting:
                    self.told_waiting = True
                    task = self.allocation.task_id if self.allocation is not None else "?"
                    actions.append(Say(f"task {task}: waiting for its allocation again to resume the program"))
                return [*actions, *([] if self.gone else [Yield()]), Allocate()]
            case "restart":
                assert self.allocation is not None
                yielded = [Yield()] if ending.partial is not None and not self.gone else []
                return [*actions, *yielded, *self._restart(ending.next_allocation or self.allocation, resume=True)]

    def _let_go(self) -> list[RunAction]:
        """The lock goes back, not to be asked for again now (a whole-GPU run holds no lock)."""
        held, self.run.holding = self.run.holding, False
        return [Release()] if held and self.config.arbitrated else []

    def _fail_line(self, notice: p.Preempt | None) -> str:
        if notice is None:
            return "the task was preempted (the notice was withdrawn after the program was told to end)"
        return f"{notice_line(notice)}; the task fails (--on-preempt fail)"

    def _restart(self, allocation: p.Allocated, *, resume: bool) -> list[RunAction]:
        self.allocation, self.program_gpus = allocation, list(allocation.gpus)
        actions: list[RunAction] = [UseAllocation(allocation, resume)]
        if self.config.arbitrated:
            self.run.state = Normal("starting")
            return [*actions, Request()]  # it starts at its grant
        self.run.state = Normal("running")
        return [*actions, Start()]

    # --- suspend -------------------------------------------------------------------------------------

    def _suspend(self, state: Normal, push: p.Preempt) -> list[RunAction]:
        run = self.run
        run.state = Suspending(state.program)
        run.repause_at = None
        actions: list[RunAction] = []
        program = state.program
        if program == "running":
            actions.append(run.pause(f"{notice_line(push)}: suspended"))
            program = "paused"
        actions += self._let_go()  # not asked for again while suspended
        if program == "paused" and self.config.can_park:
            in_flight = run.parking
            run.parking = Parking(answer=in_flight is not None and in_flight.answer, suspend=True)
            if in_flight is not None:
                return actions  # gpud's PARK is in flight: its end yields too
            return [*actions, Park()]
        return [*actions, *self._suspended(program)]

    def _suspended(self, program: Program) -> list[RunAction]:
        self.run.state = Suspended(program)
        return [Yield()]

    def suspend_parked(self, ok: bool, message: str) -> list[RunAction]:
        """The suspend's park ended (``RunCore.park_done``)."""
        say: list[RunAction] = (
            [] if ok else [Say(f"could not park the program's GPU memory ({message}); it stays there")]
        )
        match self.run.state:
            case Suspending(program=program):
                return [*say, *self._suspended(program)]
            case Normal():  # withdrawn while it parked
                return [*say, *self._back_to_work()]
        return say

    def _back_to_work(self) -> list[RunAction]:
        """Back to ``Normal`` after a suspend: a program with a session waits for its grant to go on."""
        if self.config.arbitrated:
            return [Request()]
        run = self.run
        if not run.started:
            run.state = Normal("running")
            return [Start()]
        run.repause_at = None
        if run.program == "running":
            return []
        run.state = Normal("running")
        return [Resume()]
