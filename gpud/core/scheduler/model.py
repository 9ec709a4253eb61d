"""What one GPU's scheduler decides and keeps: its effects, its configuration, each session's
record, and the one state object its rules work on (``SchedState``).

Values only: the rules are in the scheduler's other modules, each a set of functions over a
``SchedState``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from gpud.core.errors import Refused
from gpud.core.quota import ComputeAccounts, QuotaConfig
from gpud.core.snapshots import SessionState
from gpud_client.protocol import DropReason, ErrorCode, LeaseReason, Mode, RevokeReason


@dataclass(frozen=True, slots=True)
class Grant:
    session: int
    grant: int
    waited_us: int = field(default=0, compare=False)  # for metrics; not part of the decision


@dataclass(frozen=True, slots=True)
class Drop:
    session: int
    grant: int
    reason: DropReason


@dataclass(frozen=True, slots=True)
class Revoke:
    session: int
    grant: int
    reason: RevokeReason


@dataclass(frozen=True, slots=True)
class MemOverLimit:
    session: int
    used_bytes: int
    limit_bytes: int


@dataclass(frozen=True, slots=True)
class LeaseDenied:
    """The lease did not get the GPU and is gone."""

    session: int
    reason: LeaseReason


@dataclass(frozen=True, slots=True)
class HoldOverdue:
    """Watchdog: a lease has been held past its hold_max (reported once)."""

    session: int
    held_us: int
    forced: bool  # released by force (lease_force_release)


@dataclass(frozen=True, slots=True)
class AskPark:
    """Ask a parkable session's program to move its GPU memory to host memory (PARK)."""

    session: int
    grant: int  # its last grant (0: none yet), for the logs


@dataclass(frozen=True, slots=True)
class ParkOverdue:
    """A park was not answered within ``park_timeout``: its memory stays counted."""

    session: int


Effect = Grant | Drop | Revoke | MemOverLimit | LeaseDenied | HoldOverdue | AskPark | ParkOverdue


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    tq_us: int = 30_000_000
    drop_timeout_us: int = 10_000_000
    mode: Mode = Mode.AUTO
    memory_total_bytes: int = 80 * 2**30
    memory_reserve_percent: int = 10
    quota: QuotaConfig = QuotaConfig()
    lease_force_release: bool = False
    max_queue: int = 1024  # waiting lock requests per GPU
    park_timeout_us: int = 120_000_000  # a PARK unanswered this long counts as refused


DEFAULT_CONFIG = SchedulerConfig()


@dataclass(slots=True)
class Session:
    """One session (or lease) on the GPU: its terms, where it is, and what it did."""

    id: int
    priority: int
    mem_estimate: int | None = None
    mem_used: int | None = None
    mem_limit: int | None = None
    core_ceiling: int = 100
    mem_ceiling: int | None = None
    mem_over: bool = False
    lease: bool = False
    wait_deadline: int | None = None  # a waiting lease's max_wait
    queue_key: tuple[int, int, int] | None = None  # its entry in the queue while waiting
    hold_max_us: int | None = None  # a lease's watchdog
    overdue: bool = False
    state: SessionState = "idle"
    requested_at: int = 0
    grant: int = 0
    granted_at: int = 0
    drop_reason: DropReason | None = None
    drop_sent_at: int = 0
    tq_dropped: bool = False
    grants: int = 0
    hold_us: int = 0
    wait_us: int = 0
    drops: Counter[str] = field(default_factory=Counter)
    revocations: int = 0
    mem_violations: int = 0
    last_hold_us: int = 0
    last_drop_to_release_us: int | None = None
    parkable: bool = False
    resident: bool = False  # a parkable session's memory is on the GPU while it does not hold
    park_asked_at: int | None = None
    park_refused: bool = False  # refused (or timed out) since its last grant: not asked again
    parks: int = 0


@dataclass(slots=True, eq=False)
class SchedState:
    """Everything one GPU's scheduler keeps."""

    cfg: SchedulerConfig
    acc: ComputeAccounts
    enabled: bool = True
    grants_from: int | None = None  # no grant before this time (the restart grace), then None
    sessions: dict[int, Session] = field(default_factory=dict)
    parkable: dict[int, Session] = field(default_factory=dict)  # few: the rules that walk them cost nothing otherwise
    running: dict[int, Session] = field(default_factory=dict)  # insertion order = grant order
    queue: list[tuple[int, int, int]] = field(default_factory=list)  # (-priority, seq, session)
    # (wait deadline, seq, session) of waiting leases; an entry whose seq is no longer the
    # session's queue entry is stale and skipped: expiry and the next deadline cost O(log n)
    waits: list[tuple[int, int, int]] = field(default_factory=list)
    seq: itertools.count[int] = field(default_factory=itertools.count)
    grant_seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    grants: int = 0
    drops: Counter[str] = field(default_factory=Counter)
    revocations: int = 0

    def get(self, session: int) -> Session:
        try:
            return self.sessions[session]
        except KeyError:
            raise Refused(ErrorCode.UNKNOWN_SESSION, f"no session {session} on this GPU") from None

    def get_session(self, session: int) -> Session:
        """A session, not a lease: what has lock requests and limits of its own."""
        s = self.get(session)
        if s.lease:
            raise Refused(ErrorCode.INVALID, f"{session} is a lease: it has no lock requests or limits of its own")
        return s

    def capacity(self) -> int:
        return self.cfg.memory_total_bytes * (100 - self.cfg.memory_reserve_percent) // 100

    def need(self, s: Session) -> int:
        if s.mem_estimate is None and s.mem_used is None:
            return self.cfg.memory_total_bytes  # unknown: it may need all of it
        return max(s.mem_estimate or 0, s.mem_used or 0)

    def throttled(self, sid: int) -> bool:
        if not self.acc.is_limited(sid):
            return False  # no budget, never throttled (every lease, most sessions)
        return self.acc.account(sid).throttled or self.acc.over_budget(sid)


def check_limit(core_limit: int) -> None:
    if not 1 <= core_limit <= 100:
        raise Refused(ErrorCode.INVALID, f"core limit must be 1..100 percent, got {core_limit}")
