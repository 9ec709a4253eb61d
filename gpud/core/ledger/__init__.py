"""The allocation ledger: whole and fractional GPUs and CPU cores per task id, durable in the
shell's store, taken back by notice (the facade and its rules: ``gpud.core.ledger.ledger``; its one
state: ``gpud.core.ledger.state``)."""

from gpud.core.ledger.ledger import Ledger
from gpud.core.ledger.model import (
    NEVER,
    NOTICE_BATCH,
    UNIT,
    Allocation,
    Expired,
    GpuSpec,
    Grown,
    Insufficient,
    LedgerEffect,
    Notice,
    Noticed,
    PreemptionConfig,
    Request,
    Served,
    TakenBack,
    TaskRecord,
    TenantQuota,
    Withdrawn,
    recovery_told,
    to_fixed,
)
from gpud.core.ledger.state import Checkpoint, LedgerState

__all__ = [
    "NEVER",
    "NOTICE_BATCH",
    "UNIT",
    "Allocation",
    "Checkpoint",
    "Expired",
    "GpuSpec",
    "Grown",
    "Insufficient",
    "Ledger",
    "LedgerEffect",
    "LedgerState",
    "Notice",
    "Noticed",
    "PreemptionConfig",
    "Request",
    "Served",
    "TakenBack",
    "TaskRecord",
    "TenantQuota",
    "Withdrawn",
    "recovery_told",
    "to_fixed",
]
