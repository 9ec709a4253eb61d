"""The rules of one claim's containers on the node: their turns on the GPU, their suspension and their
eviction (docs/kubernetes.md#taking-turns, #taking-back). Pure: the shell (``gpud_k8s.keeping``) tells
what happened, on injected time, and carries out the actions in order.

Containers that know nothing of gpud take turns as a ``gpuctl run`` program does, their cgroups held
by gpud (ADOPT) and frozen between turns:

- Found containers are handed to gpud at once (``Adopt``); while the claim does not hold the GPU's
  lock they are frozen at once (``Pause``), and the lock is asked for. A claim without containers asks
  for nothing and holds nothing: a lock granted then goes straight back.
- A grant resumes them (``Resume``); a DROP_LOCK, or a lock lost, pauses them, gives the lock back and
  asks again: a container is treated as always having work. A new container found while the claim
  holds the lock runs with the others; one found while it waits is frozen with them.
- gpud's PARK (memory wanted on the GPU) is answered by parking the paused containers' GPU memory
  where the pause can (``pause: cuda``), else refused, saying why.

When gpud takes the claim's allocation back (PREEMPT, to the agent that holds it for the claim), the
claim's ``recovery`` decides:

- ``suspend``: pause (and park, where it can), give the lock back, and ``Yield``: the containers stay
  frozen, with no lock asked for, until ALLOC_CHANGED ``resumed``, then they take turns again (or, a
  claim that does not take turns, simply run again); a PREEMPT_WITHDRAWN meanwhile resumes them too.
- anything else (``terminate``, ``checkpoint``, ``restart``): the containers go on (taking turns) for
  the grace, and the pods that hold the claim are evicted (``Evict``) when it ends, through the Eviction
  API, so that their controller makes them again (``GPUD_RESUME`` says so where the claim is held through
  the client); a PREEMPT_WITHDRAWN before then cancels it.
- the allocation gone (ALLOC_REVOKED ``gone``: the grace ended, or it was taken with no notice): the
  containers are paused for good, the lock given back, and the pods evicted if they were not yet. A
  container never runs on without the allocation its claim was prepared with.

A pod that holds the claim being deleted (an eviction, Kubernetes' own preemption, a rollout) has its
containers resumed to act on their SIGTERM within its termination grace (``terminating``), as a paused
``gpuctl run`` program is resumed for a signal; its turns end there.

The lock's session, the pushes' connection and the cgroups are the shell's; nothing here waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpud_client.protocol import Recovery


@dataclass(frozen=True, slots=True)
class Adopt:
    cgroups: tuple[str, ...]  # every container cgroup of the claim now (paths in the cgroup2 hierarchy)


@dataclass(frozen=True, slots=True)
class Pause:
    pass


@dataclass(frozen=True, slots=True)
class Resume:
    pass


@dataclass(frozen=True, slots=True)
class Request:
    pass


@dataclass(frozen=True, slots=True)
class Release:
    pass


@dataclass(frozen=True, slots=True)
class Park:
    pass


@dataclass(frozen=True, slots=True)
class AnswerPark:
    ok: bool
    message: str = ""


@dataclass(frozen=True, slots=True)
class Yield:
    pass


@dataclass(frozen=True, slots=True)
class Evict:
    why: str


Action = Adopt | Pause | Resume | Request | Release | Park | AnswerPark | Yield | Evict
Program = Literal["none", "running", "paused", "parked"]
# turns: the claim's own; suspending/suspended: given back by recovery suspend; noticed: preempted,
# evicted at ``evict_at``; gone: its allocation is no more (its containers stay paused); ending: its pods
# are being deleted (they run, to act on their SIGTERM)
Mode = Literal["turns", "suspending", "suspended", "noticed", "gone", "ending"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnConfig:
    time_slice: bool  # the containers take turns (else they run while the claim's allocation is theirs)
    recovery: Recovery = Recovery.TERMINATE
    can_park: bool = False  # the pause can move the containers' GPU memory to the host (pause: cuda)


@dataclass(slots=True)
class ClaimTurns:
    config: TurnConfig
    cgroups: tuple[str, ...] = ()
    program: Program = "none"
    mode: Mode = "turns"
    holding: bool = False
    asked: bool = False  # a lock request is out
    parking: bool = False  # a Park is in flight
    evict_at: float | None = None
    evicted: bool = False

    # --- what the node says ---------------------------------------------------------

    def found(self, cgroups: tuple[str, ...], now: float) -> list[Action]:
        """The claim's containers' cgroups, as they are now (sorted)."""
        if cgroups == self.cgroups:
            return []
        had, self.cgroups = self.cgroups, cgroups
        acts: list[Action] = [Adopt(cgroups)]
        if not cgroups:
            self.program = "none"
            if self.holding:  # nothing left to run in its turn
                self.holding = False
                acts.append(Release())
            return acts
        if self._kept_paused():
            acts.append(Pause())  # the new ones with the others: none of them runs now
            self.program = "paused" if self.program in ("none", "running") else self.program
        elif self.program == "none":
            self.program = "running"
        if not had and self._wants_turns() and not self.asked and not self.holding:
            self.asked = True
            acts.append(Request())
        return acts

    # --- the lock (time-sliced claims) --------------------------------------------------

    def granted(self, now: float) -> list[Action]:
        self.asked = False
        if not self._wants_turns() or not self.cgroups:
            return [Release()]
        self.holding = True
        if self.program in ("paused", "parked"):
            self.program = "running"
            return [Resume()]
        return []

    def dropped(self, now: float) -> list[Action]:
        """DROP_LOCK, or the lock lost (revoked, gpud gone): pause, give it back, ask again."""
        if not self.holding:
            return []
        self.holding = False
        acts: list[Action] = []
        if self.program == "running":
            self.program = "paused"
            acts.append(Pause())
        acts.append(Release())
        if self._wants_turns() and self.cgroups and not self.asked:
            self.asked = True
            acts.append(Request())
        return acts

    def park_asked(self) -> list[Action]:
        if self.holding or self.program == "running":
            return [AnswerPark(False, "the claim's containers hold the GPU again")]
        if self.program in ("none", "parked"):
            return [AnswerPark(True)]  # nothing of them is on the GPU
        if not self.config.can_park:
            return [
                AnswerPark(False, "the claim's containers are paused by the cgroup freezer alone (pause: cuda parks)")
            ]
        if self.parking:
            return []
        self.parking = True
        return [Park()]

    def park_done(self, ok: bool, message: str = "") -> list[Action]:
        self.parking = False
        if ok and self.program == "paused":
            self.program = "parked"
        acts: list[Action] = [AnswerPark(ok, message)] if self.mode != "suspending" else []
        if self.mode == "suspending":
            self.mode = "suspended"
            acts.append(Yield())
        return acts

    # --- gpud takes the allocation back ---------------------------------------------------

    def preempted(self, recovery: Recovery, grace_s: float, now: float) -> list[Action]:
        if self.mode in ("gone", "suspending", "suspended", "ending"):
            return []
        if recovery is not Recovery.SUSPEND:
            if self.mode == "turns":
                self.mode, self.evict_at = "noticed", now + grace_s
            return []
        self.mode = "suspending"
        acts = self._stop()
        if self.config.can_park and self.program == "paused":
            self.parking = True
            return [*acts, Park()]  # its Yield follows the park
        self.mode = "suspended"
        return [*acts, Yield()]

    def withdrawn(self, now: float) -> list[Action]:
        """The request that preempted the claim gave up: as it was."""
        if self.mode == "noticed":
            self.mode, self.evict_at = "turns", None
            return []
        return self.resumed(now)

    def resumed(self, now: float) -> list[Action]:
        """A suspended claim has its devices again (ALLOC_CHANGED resumed)."""
        if self.mode not in ("suspending", "suspended"):
            return []
        self.mode = "turns"
        if self.parking:  # the park still in flight answers nobody now
            self.parking = False
        if not self.cgroups:
            return []
        if self._wants_turns():
            self.asked = True
            return [Request()]
        self.program = "running"
        return [Resume()]

    def revoked(self, gone: bool, now: float) -> list[Action]:
        """ALLOC_REVOKED: ``gone``: the allocation is no more; else it is suspended (as it should be)."""
        if not gone:
            if self.mode in ("turns", "noticed"):
                self.mode = "suspended"
                return self._stop()
            return []
        if self.mode == "gone":
            return []
        self.mode, self.evict_at = "gone", None
        acts = self._stop()
        if not self.evicted:
            self.evicted = True
            acts.append(Evict("gpud took the claim's allocation back"))
        return acts

    def terminating(self, now: float) -> list[Action]:
        """A pod that holds the claim is being deleted (its containers get SIGTERM, then SIGKILL at the end of
        its termination grace): they run, to act on it, as a paused ``gpuctl run`` program is resumed for a
        signal. The turns end; a claim whose allocation is gone stays paused (it has no GPU to end on)."""
        if self.mode in ("ending", "gone"):
            return []
        self.mode, self.evict_at, self.parking = "ending", None, False
        acts: list[Action] = []
        if self.holding:
            self.holding = False
            acts.append(Release())
        if self.program in ("paused", "parked"):
            self.program = "running"
            acts.insert(0, Resume())
        return acts

    def tick(self, now: float) -> list[Action]:
        if self.mode == "noticed" and self.evict_at is not None and now >= self.evict_at:
            self.evict_at = None
            if not self.evicted:
                self.evicted = True
                return [Evict("the claim's preemption grace is over")]
        return []

    def next_tick(self, now: float, interval: float) -> float:
        return min(now + interval, self.evict_at) if self.evict_at is not None else now + interval

    # --- the parts ---------------------------------------------------------------------

    def _wants_turns(self) -> bool:
        return self.config.time_slice and self.mode in ("turns", "noticed")

    def _kept_paused(self) -> bool:
        """Containers found now must not run: waiting for a turn, suspended, or the allocation gone."""
        if self.mode in ("suspending", "suspended", "gone"):
            return True
        return self.config.time_slice and not self.holding and self.mode != "ending"

    def _stop(self) -> list[Action]:
        acts: list[Action] = []
        if self.program == "running":
            self.program = "paused"
            acts.append(Pause())
        if self.holding:
            self.holding = False
            acts.append(Release())
        return acts
