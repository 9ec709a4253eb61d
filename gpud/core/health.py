"""GPU health from NVML probes: when to probe each GPU, and when it is unhealthy.

The shell reads each GPU in its own worker thread (a probe); this module decides.
Rules kept here:
- A GPU is probed once per monitor interval, counted from its last probe's start,
  and never again while that probe is still out: a hung driver call holds one
  thread per GPU, never a pile of them.
- A probe still out ``HANG_AFTER`` (3/2) monitor intervals after it started makes
  the GPU unhealthy: "its NVML call has not returned for X s". The GPU may stop
  answering just after a probe returned; the next probe starts at most one
  interval later and is found hung 1.5 intervals after that: within 2.5 intervals
  of the hang beginning, under the three allowed, with half an interval left for
  the event loop. A slow but live call gets 1.5 intervals before it counts as hung.
- A probe that raises makes the GPU unhealthy with the error; a probe that returns
  makes it healthy again, whatever it was before.
- Only changes are reported (``Unhealthy`` on healthy -> unhealthy, ``HealthyAgain``
  on the way back), so the shell logs each change once; the current reason is
  kept for ``view``.

Pure: time is integer microseconds passed in by the caller; no clock reads, no
threads, no I/O, no logging. A refused call (unknown GPU, no probe out) raises
``ValueError`` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["HANG_AFTER", "GpuHealth", "HealthEffect", "HealthView", "HealthyAgain", "Probe", "Unhealthy"]

HANG_AFTER = Fraction(3, 2)  # monitor intervals a probe may be out before its GPU is unhealthy


@dataclass(frozen=True, slots=True)
class Probe:
    """Start reading this GPU now (in a thread of its own)."""

    gpu: int


@dataclass(frozen=True, slots=True)
class Unhealthy:
    """The GPU turned unhealthy. ``hung_us``: how long its call had been out (None: the call raised)."""

    gpu: int
    reason: str
    hung_us: int | None = None


@dataclass(frozen=True, slots=True)
class HealthyAgain:
    """A probe of an unhealthy GPU returned; ``unhealthy_us``: how long it was unhealthy."""

    gpu: int
    unhealthy_us: int


HealthEffect = Probe | Unhealthy | HealthyAgain


@dataclass(frozen=True, slots=True)
class HealthView:
    gpu: int
    healthy: bool
    reason: str | None  # why it is unhealthy; None while healthy
    probe_out_since: int | None  # start of the probe still out; None: none out
    last_result_at: int | None  # when a probe last returned or raised
    probes: int  # probes started
    failures: int  # probes that raised or were found hung (once each)


@dataclass(slots=True)
class _Gpu:
    started: int | None = None  # start of the last probe (out or not)
    out: bool = False
    hung: bool = False  # the probe out was found hung (reported once per probe)
    healthy: bool = True
    reason: str | None = None
    unhealthy_since: int = 0
    last_result_at: int | None = None
    probes: int = 0
    failures: int = 0


def hung_reason(hung_us: int) -> str:
    return f"its NVML call has not returned for {round(hung_us / 1e6, 3):g} s"


class GpuHealth:
    """Probe cadence and health of the GPUs NVML reads (keyed by GPU index)."""

    def __init__(self, gpus: Iterable[int], *, interval_us: int, now: int = 0) -> None:
        self._gpus = {index: _Gpu() for index in gpus}
        self._first_due = now  # every GPU is probed at once
        self.interval_us = 0
        self.set_interval(interval_us)

    def set_interval(self, interval_us: int) -> None:
        """The monitor interval (a reload may change it); it applies from now on."""
        if interval_us < 1:
            raise ValueError(f"monitor interval must be at least 1 us, not {interval_us}")
        self.interval_us = interval_us

    @property
    def hang_after_us(self) -> int:
        return int(self.interval_us * HANG_AFTER)

    def advance(self, now: int) -> list[HealthEffect]:
        """Start the probes that are due; find the probes out too long."""
        effects: list[HealthEffect] = []
        for index, g in self._gpus.items():
            if g.out:
                assert g.started is not None
                hung_us = now - g.started
                if not g.hung and hung_us >= self.hang_after_us:
                    g.hung = True
                    g.failures += 1
                    effects += self._unhealthy(index, g, now, hung_reason(hung_us), hung_us)
            elif g.started is None or now >= g.started + self.interval_us:
                g.started, g.out = now, True
                g.probes += 1
                effects.append(Probe(index))
        return effects

    def finished(self, gpu: int, now: int, error: str | None = None) -> list[HealthEffect]:
        """The probe of ``gpu`` returned (``error`` None) or raised (``error``: what it said)."""
        g = self._gpu(gpu)
        if not g.out:
            raise ValueError(f"GPU {gpu} has no probe out")
        counted = g.hung  # a hung probe was counted as a failure when it was found hung
        g.out, g.hung, g.last_result_at = False, False, now
        if error is not None:
            g.failures += 0 if counted else 1
            return self._unhealthy(gpu, g, now, error, None)
        if g.healthy:
            return []
        g.healthy, g.reason = True, None
        return [HealthyAgain(gpu, now - g.unhealthy_since)]

    def next_deadline(self) -> int | None:
        """When ``advance`` next has something to do: a probe due, or one that turns hung."""
        times = []
        for g in self._gpus.values():
            if g.started is None:
                times.append(self._first_due)
            elif not g.out:
                times.append(g.started + self.interval_us)
            elif not g.hung:
                times.append(g.started + self.hang_after_us)
        return min(times, default=None)

    def view(self, gpu: int) -> HealthView:
        g = self._gpu(gpu)
        return HealthView(
            gpu, g.healthy, g.reason, g.started if g.out else None, g.last_result_at, g.probes, g.failures
        )

    def healthy(self, gpu: int) -> bool:
        return self._gpu(gpu).healthy

    def _gpu(self, gpu: int) -> _Gpu:
        g = self._gpus.get(gpu)
        if g is None:
            raise ValueError(f"unknown GPU {gpu}: probed GPUs are {sorted(self._gpus)}")
        return g

    @staticmethod
    def _unhealthy(index: int, g: _Gpu, now: int, reason: str, hung_us: int | None) -> list[HealthEffect]:
        g.reason = reason  # kept current; reported only on the change
        if not g.healthy:
            return []
        g.healthy, g.unhealthy_since = False, now
        return [Unhealthy(index, reason, hung_us)]
