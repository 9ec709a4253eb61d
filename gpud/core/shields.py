"""Why an allocation cannot be taken back now, and until when: one rule for what gpud says.

ALLOCATE's answer, ALLOCS, a refused or expired request and the log all say the same thing from
``Ledger.shield`` (what shields one allocation) and ``Blocked`` (why a request found nothing to take
back); this module holds their shape and words, and the part of the rule that the allocation's own
terms decide (``by_terms``, ``runs_minimum``), which the ledger's index reads too: it sits below both.
A shield that ends (a minimum runtime, the rest after a withdrawn notice) carries when, in the
ledger's time, so a reader is told "for 240 s more", never "yes" while it is not so.

Pure: no clock; ``now`` is passed in, integer microseconds.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from gpud_client.protocol import PRODUCTION_PRIORITY, SPOT_PRIORITY

NAMED = 3  # allocations named per reason (a request may be blocked by thousands)


class Shield(NamedTuple):
    """What keeps an allocation from being taken back now."""

    why: str
    until: int | None = None  # when it no longer holds; None: as long as the fact lasts

    def text(self, now: int) -> str:
        return self.why if self.until is None else f"{self.why} for {seconds(self.until - now)} more"

    def left_s(self, now: int) -> float | None:
        """Seconds until it may be taken back (None: not by time alone)."""
        return None if self.until is None else round(max(0, self.until - now) / 1e6, 3)


# The shields, each said once (``Ledger.shield`` picks).
OFF = Shield("preemption is off on this node (preemption = false)")
PROTECTED = Shield("protected by an admin")
PRODUCTION = Shield("production priority")
UNREACHABLE = Shield("no one to tell: no client holds it and it has no owner process gpud may signal")
AT_MINIMUM = Shield("on_preempt shrink, at its minimum")
MIN_RUNTIME = "inside its minimum runtime"
RESTING = "resting after a withdrawn notice (not chosen again so soon)"


class Terms(Protocol):
    """What ``by_terms`` reads of an allocation."""

    @property
    def protected(self) -> bool: ...
    @property
    def priority(self) -> int: ...


def by_terms(alloc: Terms) -> Shield | None:
    """What keeps an allocation from every request for as long as its terms stand: an admin's
    protection, production priority (a drain is the operator's: it takes them all the same)."""
    if alloc.protected:
        return PROTECTED
    if alloc.priority >= PRODUCTION_PRIORITY:
        return PRODUCTION
    return None


def runs_minimum(priority: int) -> bool:
    """Whether an allocation of ``priority`` runs its minimum runtime before a request may take it
    back whole: all but spot, which may be taken at any time."""
    return priority > SPOT_PRIORITY


def seconds(us: int) -> str:
    """A duration as people read it: 240 s, 4.5 s, 0.2 s."""
    s = max(0, us) / 1e6
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


class Blocked:
    """Why a request found nothing to take back: the allocations in its way, grouped by reason (a
    few named per reason, the rest counted), in the order they were read; a shield that ends says
    the soonest its group's does."""

    __slots__ = ("_fixed", "_timed", "_now", "read_all")

    def __init__(self, now: int) -> None:
        self._fixed: dict[str, list[str]] = {}
        self._timed: dict[str, tuple[int, list[str]]] = {}
        self._now = now
        self.read_all = True  # False: more allocations were there than were read

    def add(self, task_id: str, why: str) -> None:
        self._fixed.setdefault(why, []).append(task_id)

    def add_shield(self, task_id: str, shield: Shield) -> None:
        if shield.until is None:
            return self.add(task_id, shield.why)
        until, ids = self._timed.get(shield.why, (shield.until, []))
        ids.append(task_id)
        self._timed[shield.why] = (min(until, shield.until), ids)
        return None

    def __bool__(self) -> bool:
        return bool(self._fixed or self._timed)

    def text(self) -> str:
        """``nothing could be taken back: a, b: inside its minimum runtime for 240 s more; ...``"""
        parts = [_named(ids, why) for why, ids in self._fixed.items()]
        for why, (until, ids) in self._timed.items():
            soonest = " (the soonest of them)" if len(ids) > 1 else ""
            parts.append(_named(ids, Shield(why, until).text(self._now) + soonest))
        among = "" if self.read_all else " (of the allocations read)"
        return f"nothing could be taken back{among}: " + "; ".join(parts)


def _named(ids: list[str], why: str) -> str:
    names = ", ".join(ids[:NAMED]) + (f" and {len(ids) - NAMED} more" if len(ids) > NAMED else "")
    return f"{names}: {why}"
