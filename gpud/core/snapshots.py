"""Read-only snapshots of a GPU scheduler, for status answers and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpud_client.protocol import DropReason, Mode

SessionState = Literal["idle", "waiting", "holding"]


@dataclass(frozen=True, slots=True)
class HolderView:
    session: int
    grant: int
    held_us: int
    drop_pending: DropReason | None


@dataclass(frozen=True, slots=True)
class WaiterView:
    session: int
    priority: int
    waited_us: int
    throttled: bool


@dataclass(frozen=True, slots=True)
class SessionView:
    session: int
    state: SessionState
    priority: int
    grant: int
    grants: int
    hold_us: int
    wait_us: int
    drops: dict[str, int]
    revocations: int
    core_limit: int
    budget_us: int | None  # None: unlimited
    used_us: int  # weighted GPU time billed in the current window
    recent_share_percent: float  # over the last finished windows
    throttled: bool
    throttles: int
    mem_estimate: int | None
    mem_used: int | None
    mem_limit: int | None
    core_ceiling: int
    mem_ceiling: int | None
    mem_violations: int
    last_hold_us: int  # the most recent hold, for metrics
    last_drop_to_release_us: int | None  # how long that hold's DROP_LOCK took to be answered
    parkable: bool = False
    parked: bool = False  # a parkable session whose memory is in host memory
    parks: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerView:
    enabled: bool
    mode: Mode
    tq_us: int
    drop_timeout_us: int
    window_us: int
    memory_capacity_bytes: int
    memory_in_use_bytes: int
    holders: tuple[HolderView, ...]
    queue: tuple[WaiterView, ...]
    sessions: int
    grants: int
    drops: dict[str, int]
    revocations: int
