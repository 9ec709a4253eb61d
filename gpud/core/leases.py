"""Lease policy (GpuArbiter): what an acquire means before it reaches a GPU.

Rules kept here:
- Any field a request leaves out comes from its task type's policy, and what
  the policy leaves out from the node defaults (queue_limit 8, hold_max 8 s).
- Terms a request sends may only tighten its policy, never loosen it: a lower
  priority, a shorter max_wait or hold_max, a smaller queue_limit are taken;
  anything above the policy's value is cut to it. The busy policy is the
  caller's choice (it changes only what the caller itself is answered).
  Any task type name is allowed; an unknown one gets the OTHER policy.
- A policy may name the uids and gids allowed to use it (``reserved``); who
  may use a task type, and at what priority, is ``authority.lease_priority``.
- The answer to a lease that does not get the GPU follows its busy policy:
  FALLBACK_CPU answers FALLBACK_CPU, SKIP and WAIT answer SKIPPED; the reason
  says why (GPU_BUSY: max_wait 0 and not free now; QUEUE_FULL: queue_limit
  reached on arrival; TIMEOUT: still waiting at max_wait).

Pure data and functions; the per-GPU queue itself is the scheduler's.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpud_client.protocol import BusyPolicy, LeaseReason, LeaseStatus

DEFAULT_QUEUE_LIMIT = 8
DEFAULT_HOLD_MAX_MS = 8000


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    priority: int
    busy_policy: BusyPolicy
    max_wait_ms: int
    queue_limit: int | None = None
    hold_max_ms: int | None = None
    uids: frozenset[int] = frozenset()  # with gids: the only non-admins who may use it (none: anyone)
    gids: frozenset[int] = frozenset()

    @property
    def reserved(self) -> bool:
        return bool(self.uids or self.gids)


DEFAULT_POLICIES: dict[str, LeasePolicy] = {
    "ASR": LeasePolicy(90, BusyPolicy.WAIT, 3000),
    "NMT": LeasePolicy(80, BusyPolicy.WAIT, 3000),
    "TTS": LeasePolicy(70, BusyPolicy.WAIT, 2000),
    "SEMANTIC_REPAIR": LeasePolicy(20, BusyPolicy.SKIP, 400),
    "OTHER": LeasePolicy(50, BusyPolicy.WAIT, 3000),
}


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """Everything an acquire needs, with every default filled in."""

    task_type: str
    priority: int
    busy_policy: BusyPolicy
    max_wait_ms: int
    queue_limit: int
    hold_max_ms: int
    mem_estimate: int | None


def resolve_terms(
    task_type: str,
    policies: dict[str, LeasePolicy],
    *,
    priority: int | None = None,
    busy_policy: BusyPolicy | None = None,
    max_wait_ms: int | None = None,
    queue_limit: int | None = None,
    hold_max_ms: int | None = None,
    mem_estimate: int | None = None,
    default_queue_limit: int = DEFAULT_QUEUE_LIMIT,
    default_hold_max_ms: int = DEFAULT_HOLD_MAX_MS,
) -> LeaseTerms:
    policy = policies.get(task_type) or policies.get("OTHER") or DEFAULT_POLICIES["OTHER"]
    return LeaseTerms(
        task_type=task_type,
        priority=_tighter(priority, policy.priority),
        busy_policy=policy.busy_policy if busy_policy is None else busy_policy,
        max_wait_ms=_tighter(max_wait_ms, policy.max_wait_ms),
        queue_limit=_tighter(queue_limit, _first(policy.queue_limit, default_queue_limit)),
        hold_max_ms=_tighter(hold_max_ms, _first(policy.hold_max_ms, default_hold_max_ms)),
        mem_estimate=mem_estimate,
    )


def _tighter(asked: int | None, policy: int) -> int:
    return policy if asked is None else min(asked, policy)


def refusal_status(busy_policy: BusyPolicy) -> LeaseStatus:
    """What a lease that did not get the GPU answers, by its busy policy."""
    return LeaseStatus.FALLBACK_CPU if busy_policy == BusyPolicy.FALLBACK_CPU else LeaseStatus.SKIPPED


def _first(*values: int | None) -> int:
    for v in values:
        if v is not None:
            return v
    raise ValueError("no value")


__all__ = [
    "DEFAULT_HOLD_MAX_MS",
    "DEFAULT_POLICIES",
    "DEFAULT_QUEUE_LIMIT",
    "LeasePolicy",
    "LeaseReason",
    "LeaseTerms",
    "refusal_status",
    "resolve_terms",
]
