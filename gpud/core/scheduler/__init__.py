"""One GPU's scheduler: nvshare's time-sliced lock, memory-aware concurrency, compute limits and
priorities, as a pure state machine (the rules: ``gpud.core.scheduler.scheduler``)."""

from gpud.core.scheduler.model import (
    AskPark,
    Drop,
    Effect,
    Grant,
    HoldOverdue,
    LeaseDenied,
    MemOverLimit,
    ParkOverdue,
    Revoke,
    SchedulerConfig,
)
from gpud.core.scheduler.scheduler import GpuScheduler

__all__ = [
    "AskPark",
    "Drop",
    "Effect",
    "GpuScheduler",
    "Grant",
    "HoldOverdue",
    "LeaseDenied",
    "MemOverLimit",
    "ParkOverdue",
    "Revoke",
    "SchedulerConfig",
]
