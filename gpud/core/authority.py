"""Who may ask for what: priority ceilings, and which allocation a session belongs to.

Rules kept here:
- An admin (uid 0, the daemon's uid, the admin group) may declare any priority.
  Anyone else may declare at most the maximum configured for its uid, else the
  highest maximum of its groups, else the node's ``priority_max``. A declared
  priority above that is refused (``permission_denied``), never silently lowered:
  the caller learns its real standing.
- Naming a task type gives no one more than it may declare: a lease runs at its
  policy's priority (or the lower one it asked for) cut to the caller's ceiling,
  unless the policy names the caller among its uids or gids. A policy that names
  uids or gids is reserved to them (and admins): anyone else is refused.
- A task id belongs to the uid that allocated (or is waiting for) it: another
  uid's request for it is refused, never answered with its devices. Only a
  tenant's members may allocate as it (a tenant that lists no uids or gids is
  open to all); freeing another uid's task needs admin rights or membership of
  a tenant that *lists* the freeing uid or gid ("open to all" frees nothing).
- Limits set by an admin or derived from a fractional allocation are ceilings
  (kept by the scheduler, see ``scheduler.py``).
- A session belongs to a fractional allocation on its GPU when it names the
  task (its own, or any for an admin); else, among its own uid's fractional
  allocations on that GPU, the one whose owner process (held by gpud) is the
  session's process or its nearest ancestor; else the smallest of them. So a
  process cannot escape its allocation's limits by not naming the task, and
  another uid's allocation never sets a session's ceiling (naming someone's
  shell as an owner caps nobody: see ``gpud.core.owners``).

Pure functions over plain data; the shell reads peer credentials, process
ancestry and configuration and passes them in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from gpud.core.errors import Refused
from gpud.core.leases import LeasePolicy
from gpud.core.ledger import UNIT, Allocation
from gpud_client.protocol import NORMAL_PRIORITY, PRODUCTION_PRIORITY, ErrorCode

ADMIN_PRIORITY = PRODUCTION_PRIORITY  # an admin may declare any priority


@dataclass(frozen=True, slots=True)
class PriorityRules:
    default_max: int = NORMAL_PRIORITY
    by_uid: Mapping[int, int] = field(default_factory=dict)
    by_gid: Mapping[int, int] = field(default_factory=dict)


def priority_ceiling(rules: PriorityRules, uid: int, gids: Iterable[int], *, admin: bool) -> int:
    """The highest priority this peer may declare for itself."""
    if admin:
        return ADMIN_PRIORITY
    if uid in rules.by_uid:
        return rules.by_uid[uid]
    caps = [rules.by_gid[g] for g in gids if g in rules.by_gid]
    return max(caps) if caps else rules.default_max


@dataclass(frozen=True, slots=True)
class Members:
    """Who belongs to a tenant; none listed: anyone may allocate as it (but free nobody's tasks)."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    def lists(self, uid: int, gid: int) -> bool:
        return uid in self.uids or gid in self.gids


def check_task_owner(task_id: str, owner: int | None, uid: int, *, admin: bool, what: str) -> None:
    """Another uid's task id is refused, never answered with its devices (``owner`` None: nobody's yet)."""
    if owner is not None and owner != uid and not admin:
        raise Refused(ErrorCode.PERMISSION_DENIED, f"task {task_id!r} belongs to uid {owner}: you may not {what} it")


def check_tenant(tenant: str, members: Members | None, uid: int, gid: int, *, admin: bool) -> None:
    """Only a tenant's members (anyone, if it lists none) allocate as it; an unknown tenant is the ledger's to refuse."""
    if members is None or admin or not (members.uids or members.gids) or members.lists(uid, gid):
        return
    raise Refused(ErrorCode.PERMISSION_DENIED, f"uid {uid} may not allocate as tenant {tenant!r}")


def check_may_free(
    task_id: str, owner: int | None, tenant: str | None, members: Members | None, uid: int, gid: int, *, admin: bool
) -> None:
    """Its own uid, an admin, or a member a tenant lists by name (never "anyone") may free a task."""
    if admin or owner == uid or (members is not None and members.lists(uid, gid)):
        return
    raise Refused(
        ErrorCode.PERMISSION_DENIED,
        f"task {task_id!r} belongs to tenant {tenant!r} / uid {owner}; freeing it needs admin rights",
    )


def check_priority(asked: int | None, ceiling: int, what: str) -> None:
    """Refuse a declared priority above the peer's ceiling; changes nothing."""
    if asked is not None and asked > ceiling:
        raise Refused(
            ErrorCode.PERMISSION_DENIED,
            f"{what} priority {asked} is above your maximum {ceiling} (priority_max for your uid or group)",
        )


def lease_priority(
    task_type: str, policy: LeasePolicy, priority: int, uid: int, gids: Iterable[int], *, admin: bool, ceiling: int
) -> int:
    """The priority a lease of ``task_type`` runs at, ``priority`` being what its terms say; a caller
    its reserved policy does not name is refused (changes nothing)."""
    if admin:
        return priority
    if policy.reserved:
        if uid in policy.uids or not policy.gids.isdisjoint(gids):
            return priority
        raise Refused(
            ErrorCode.PERMISSION_DENIED,
            f"task type {task_type} is reserved for uids {sorted(policy.uids)} and gids {sorted(policy.gids)} "
            f"(its policy's uids and gids); peer uid {uid} is neither",
        )
    return min(priority, ceiling)


def owning_allocation(
    allocations: Iterable[Allocation], owners: Mapping[str, int], gpu: int, owned: Sequence[Set[str]], uid: int
) -> Allocation | None:
    """The fractional allocation on ``gpu`` a session of ``uid`` belongs to when it names none
    (``owners``: task id -> uid; ``owned``: the task ids the session's process, then each of its
    ancestors, owns as a held owner process): its own uid's only, by the nearest owner, else the
    smallest."""
    mine = [a for a in allocations if gpu in a.gpus and 0 < a.share < UNIT and owners.get(a.task_id) == uid]
    for tasks in owned:  # the nearest ancestor that owns one wins
        if tasks and (near := [a for a in mine if a.task_id in tasks]):
            return min(near, key=lambda a: (a.share, a.task_id))
    return min(mine, key=lambda a: (a.share, a.task_id), default=None)


def fraction_ceilings(alloc: Allocation | None, gpu: int, memory_total: int) -> tuple[int, int | None]:
    """(core ceiling %, memory ceiling bytes) that an allocation puts on a session on ``gpu``."""
    if alloc is None or alloc.share >= UNIT or gpu not in alloc.gpus:
        return 100, None
    memory = memory_total * alloc.share // UNIT if alloc.memory_bytes is None else min(alloc.memory_bytes, memory_total)
    return max(1, alloc.share * 100 // UNIT), memory
