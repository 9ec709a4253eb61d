"""The rules of a run whose allocation gpud takes back: PREEMPT, PREEMPT_WITHDRAWN, ALLOC_REVOKED and
ALLOC_CHANGED, on injected time.

``RecoveryRules`` is a part of ``RunCore`` (``core/run.py``), as ``SliceRules`` is of the client
core: it keeps the allocation's side of the run and shares the lock side's state. Its phases:

- ``normal``: the allocation is the run's; the lock rules apply.
- ``ending``: the program is being ended, for a whole notice (terminate, fail: SIGTERM; checkpoint:
  its signal) or to restart it on other devices (an elastic resize, a partial notice). It is never
  paused meanwhile: a paused program is resumed to act on the signal, a DROP_LOCK only gives the
  lock back. It is killed at ``kill_at``: the daemon's grace less ``KILL_MARGIN_S`` (so that it has
  ended before the daemon takes the devices), or the signal grace for a restart. Once it has ended,
  ``after`` says what comes next.
- ``suspending``, ``suspended``: the tree is paused (and parked where the backend can), then YIELD;
  meanwhile the run neither holds nor asks for the lock. ALLOC_CHANGED ``resumed`` resumes it.
- ``waiting``: a checkpointed program has ended and yielded; the run asks for its allocation again
  and starts the program with the answer's resume flag (GPUD_RESUME=1).

It must never let a program run on devices that are no longer the run's: ALLOC_REVOKED ``gone``
kills a program that still runs, at once. Not a reason to kill: the revocation that answers the
run's own YIELD while it waits (nothing runs then).
"""

from __future__ import annotations

from typing import Literal

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
    Pause,
    Release,
    Request,
    Resume,
    RunAction,
    RunState,
    Say,
    Start,
    UseAllocation,
    Yield,
)

KILL_MARGIN_S = 0.5  # the run kills an ending program this long before the daemon's grace ends
Phase = Literal["normal", "ending", "suspending", "suspended", "waiting"]
After = Literal["exit", "fail", "checkpoint", "restart", "revoked"]
Resize = Literal["restart", "keep"]
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
    # The lock side's state (RunCore's), shared.
    state: RunState
    holding: bool
    started: bool
    parked: bool
    parking: bool
    arbitrated: bool
    can_park: bool
    signal_grace: float
    repause_at: float | None
    pauses: int

    def _init_recovery(self, recovery: p.Recovery | str, on_resize: Resize, checkpoint_signal: int) -> None:
        self.recovery = p.Recovery(recovery)
        self.on_resize: Resize = on_resize
        self.checkpoint_signal = checkpoint_signal
        self.allocation: p.Allocated | None = None  # the run's, as gpud last said it
        self.program_gpus: list[int] | None = None  # what the program was started on
        self.phase: Phase = "normal"
        self.after: After = "exit"
        self.notice: p.Preempt | None = None  # the whole notice being carried out (None: withdrawn)
        self.partial: p.Preempt | None = None  # a partial notice to YIELD once the program has ended
        self.next_allocation: p.Allocated | None = None  # what a restart runs on
        self.kill_at: float | None = None
        self.kill_why = ""
        self.suspend_park = False  # the park in flight is the suspend's (not gpud's PARK)
        self.park_for_daemon = False  # the park in flight answers gpud's PARK
        self.gone = False  # the allocation no longer exists
        self.told_waiting = False
        self.preemptions = 0

    def use_allocation(self, allocation: p.Allocated) -> None:
        """The allocation the run starts its program on (the first ALLOCATED)."""
        self.allocation = allocation
        self.program_gpus = list(allocation.gpus)

    # --- what gpud says ---------------------------------------------------------------------------

    def preempted(self, push: p.Preempt, now: float) -> list[RunAction]:
        if self.state == "ended" or self.allocation is None:
            return []
        self.preemptions += 1
        if not push.whole:
            return self._partial(push, now)
        grace = f"{push.grace_s:g} s"
        kill_at = now + max(0.0, push.grace_s - KILL_MARGIN_S)
        if self.phase != "normal":
            return self._noticed_again(push, kill_at)
        self.notice, self.partial = push, None
        match push.recovery:
            case p.Recovery.SUSPEND:
                return [Say(f"{notice_line(push)}: suspending the program"), *self._suspend(push)]
            case p.Recovery.CHECKPOINT:
                say = Say(f"{notice_line(push)}: its checkpoint signal ({self.checkpoint_signal}); it has {grace}")
                return [say, *self._end("checkpoint", self.checkpoint_signal, kill_at, grace)]
            case p.Recovery.FAIL:
                return [Say(f"{notice_line(push)}: ending the program (--on-preempt fail)")] + self._end(
                    "fail", SIGTERM, kill_at, grace
                )
            case _:  # terminate, and a shrink taken whole (never sent: an elastic minimum is kept)
                return [Say(f"{notice_line(push)}: ending the program within {grace}")] + self._end(
                    "exit", SIGTERM, kill_at, grace
                )

    def _noticed_again(self, push: p.Preempt, kill_at: float) -> list[RunAction]:
        """A whole notice while the program already ends (a restart, an earlier notice) or is being
        suspended: the earlier deadline holds, and a restart becomes what the notice asks (a suspend,
        as a checkpoint: the program has been told to end already)."""
        if self.phase != "ending":
            return []  # suspending, suspended or waiting: the devices are on their way back
        self.notice, self.partial = push, None
        self.kill_at = kill_at if self.kill_at is None else min(self.kill_at, kill_at)
        if self.after == "restart":
            recovery = push.recovery
            self.after = "fail" if recovery == p.Recovery.FAIL else "exit" if recovery in _ENDS else "checkpoint"
        return [Say(f"{notice_line(push)}: the program is ending already")]

    def withdrawn(self, now: float) -> list[RunAction]:
        """The waiter gave up: undo what can be. A suspend not yet yielded resumes; a checkpoint that
        ends restarts on the allocation it keeps; a terminate or fail already signalled goes on."""
        if self.phase == "suspending":
            self.phase, self.notice = "normal", None
            return [] if self.parking else self._back_to_work()
        if self.phase == "ending":
            self.kill_at = None  # the devices stay the run's: no hurry
            self.notice = None
            if self.after == "restart" and self.partial is not None:
                self.partial, self.next_allocation = None, None  # restarted on the whole allocation
        return []

    def revoked(self, push: p.AllocRevoked, now: float) -> list[RunAction]:
        if not push.gone:
            return []  # suspended: the answer to its YIELD; it waits for ALLOC_CHANGED resumed
        self.gone = True
        if self.phase == "waiting" or self.state == "ended":
            return []  # nothing runs: the answer to its YIELD, or a late word
        if self.phase == "ending":
            self.kill_at = None
            return [Forward(SIGKILL)] if self.started else []
        why = (
            f"gpud revoked the allocation of task {push.task_id} ({push.reason}): its devices are no "
            "longer the run's, so the program was killed"
        )
        self.phase, self.after, self.kill_why = "ending", "revoked", why
        if not self.started:
            return [Say(why), *self._ended(None)]
        self.repause_at = None
        return [Say(why), Forward(SIGKILL)]

    def changed(self, push: p.AllocChanged, now: float) -> list[RunAction]:
        a = push.allocation
        self.allocation = a
        if push.change == "resumed":
            if self.phase not in ("suspending", "suspended"):
                return []
            self.phase, self.notice, self.gone = "normal", None, False
            return [Say(f"task {a.task_id} has its devices again: resuming the program"), *self._back_to_work()]
        if self.phase == "ending" and self.after == "restart":
            self.next_allocation = a  # its restart runs on these
            return []
        if self.program_gpus is not None and sorted(a.gpus) == sorted(self.program_gpus):
            return []  # the program runs on these already (a partial notice restarted it on them)
        if self.on_resize == "keep" or self.phase != "normal":
            return []
        self.next_allocation = a
        say = Say(f"task {a.task_id} {push.change} to GPUs {a.gpus}: restarting the program on them")
        return [say, *self._end("restart", SIGTERM, now + self.signal_grace, f"{self.signal_grace:g} s")]

    def reallocated(self, allocation: p.Allocated, now: float) -> list[RunAction]:
        """The ALLOCATED that answers ``Allocate``."""
        if self.phase != "waiting" or self.state == "ended":
            return []
        self.gone = False
        return self._restart(allocation, resume=allocation.resume)

    def reallocation_failed(self, why: str) -> list[RunAction]:
        if self.state == "ended":
            return []
        self.state = "ended"
        return [Say(why), Exit(PREEMPTED, why)]

    # --- the program's end -------------------------------------------------------------------------

    def _partial(self, push: p.Preempt, now: float) -> list[RunAction]:
        assert self.allocation is not None
        say = Say(f"{notice_line(push)}: giving back GPUs {push.gpus}")
        if self.phase == "ending" and self.after == "restart":
            self.partial = push
            self.next_allocation = without(self.next_allocation or self.allocation, push.gpus)
            return [say]
        if self.on_resize == "keep" or self.phase != "normal":
            return [say, Yield()]  # the program goes on as it is (keep), or is not running on them
        self.partial = push
        self.next_allocation = without(self.allocation, push.gpus)
        grace = min(self.signal_grace, max(0.0, push.grace_s - KILL_MARGIN_S))
        return [say, *self._end("restart", SIGTERM, now + grace, f"{grace:g} s")]

    def _end(self, after: After, signum: int, kill_at: float, grace: str) -> list[RunAction]:
        """End the program with ``signum``, SIGKILL at ``kill_at``; ``after`` it has ended."""
        self.phase, self.after = "ending", after
        if not self.started:
            return self._ended(None)
        self.kill_at, self.kill_why = kill_at, f"the program did not end within {grace}: killing it"
        self.repause_at = None
        actions: list[RunAction] = []
        if self.state in ("paused", "parked"):
            self.state, self.parked = "running", False
            actions.append(Resume())  # stopped, it could not act on the signal
        return [*actions, Forward(signum)]

    def _ended(self, status: int | None) -> list[RunAction]:
        """The program ended (``status``; None: it never started) in the ending phase."""
        self.kill_at = None
        self.started, self.state = False, "starting"
        actions = self._let_go()
        match self.after:
            case "exit":
                self.state = "ended"
                if status is not None:
                    return [*actions, Exit(status)]  # the program's own status
                why = "the task was preempted before its program started"
                return [*actions, Say(why), Exit(PREEMPTED, why)]
            case "fail":
                self.state = "ended"
                why = self._fail_line()
                return [*actions, Say(why), Exit(PREEMPTED, why)]
            case "revoked":
                self.state = "ended"
                return [*actions, Exit(PREEMPTED, self.kill_why)]
            case "checkpoint":
                if self.notice is None and not self.gone:  # withdrawn: the allocation is still the run's
                    assert self.allocation is not None
                    return [*actions, *self._restart(self.allocation, resume=True)]
                self.phase = "waiting"
                if not self.told_waiting:
                    self.told_waiting = True
                    task = self.allocation.task_id if self.allocation is not None else "?"
                    actions.append(Say(f"task {task}: waiting for its allocation again to resume the program"))
                return [*actions, *([] if self.gone else [Yield()]), Allocate()]
            case "restart":
                assert self.allocation is not None
                yielded = [Yield()] if self.partial is not None and not self.gone else []
                self.partial = None
                return [*actions, *yielded, *self._restart(self.next_allocation or self.allocation, resume=True)]

    def _let_go(self) -> list[RunAction]:
        """The lock goes back, not to be asked for again now (a whole-GPU run holds no lock)."""
        held, self.holding = self.holding, False
        return [Release()] if held and self.arbitrated else []

    def _fail_line(self) -> str:
        if self.notice is None:
            return "the task was preempted (the notice was withdrawn after the program was told to end)"
        return f"{notice_line(self.notice)}; the task fails (--on-preempt fail)"

    def _restart(self, allocation: p.Allocated, *, resume: bool) -> list[RunAction]:
        self.phase, self.notice, self.next_allocation = "normal", None, None
        self.allocation, self.program_gpus = allocation, list(allocation.gpus)
        actions: list[RunAction] = [UseAllocation(allocation, resume)]
        if self.arbitrated:
            return [*actions, Request()]  # it starts at its grant
        self.started, self.state = True, "running"
        return [*actions, Start()]

    # --- suspend -------------------------------------------------------------------------------------

    def _suspend(self, push: p.Preempt) -> list[RunAction]:
        self.phase = "suspending"
        self.repause_at = None
        actions: list[RunAction] = []
        if self.started and self.state == "running":
            self.state = "paused"
            self.pauses += 1
            actions.append(Pause(f"{notice_line(push)}: suspended"))
        actions += self._let_go()  # not asked for again while suspended
        if self.started and self.can_park and not self.parked:
            self.suspend_park = True
            if self.parking:
                return actions  # gpud's PARK is in flight: its end yields too
            self.parking = True
            return [*actions, Park()]
        return [*actions, *self._suspended()]

    def _suspended(self) -> list[RunAction]:
        self.phase = "suspended"
        return [Yield()]

    def _suspend_parked(self, ok: bool, message: str) -> list[RunAction]:
        """The suspend's park ended (``park_done``)."""
        self.suspend_park = False
        say: list[RunAction] = (
            [] if ok else [Say(f"could not park the program's GPU memory ({message}); it stays there")]
        )
        if self.phase == "suspending":
            return [*say, *self._suspended()]
        if self.phase == "normal":  # withdrawn while it parked
            return [*say, *self._back_to_work()]
        return say

    def _back_to_work(self) -> list[RunAction]:
        """Back to normal after a suspend: a program with a session waits for its grant to go on."""
        if self.arbitrated:
            return [Request()]
        if not self.started:
            self.started, self.state = True, "running"
            return [Start()]
        self.repause_at = None
        if self.state in ("paused", "parked"):
            self.state, self.parked = "running", False
            return [Resume()]
        return []
