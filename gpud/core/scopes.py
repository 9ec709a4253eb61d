"""What a connection on a task's own socket may ask (OPEN_TASK_SOCKET; docs/kubernetes.md).

Such a connection belongs to its task, whoever its peer is: a container's processes, whose uid (root
included, in a pod without a user namespace) and pid say nothing of the claim they run for. The
rules, one per message type, applied before any handler:

- sessions and their lock (ATTACH, LOCK_REQUEST, LOCK_RELEASED, PARKED, MEM_UPDATE, SET_LIMITS,
  DETACH): served; a session belongs to the task's allocation (an ATTACH naming another task is
  refused), whose share and memory are its ceilings;
- the task's allocation: ALLOCATE only as ``existing`` (holding it again, told of its preemption;
  the claim's devices are the cluster's to give, not the container's to ask for) and YIELD, both
  naming the task alone; ALLOCS shows the task's allocation alone;
- what reads the node (HELLO, LABELS, STATUS): served;
- everything else (another task's allocation, FREE, leases, runs, an admin's settings, the other
  clients): refused, naming the socket's task. Admin rights never come with such a connection.
"""

from __future__ import annotations

import msgspec

from gpud.core.errors import Refused
from gpud_client import protocol as p

SERVED: frozenset[type] = frozenset(
    {
        p.Hello,
        p.Relabel,
        p.Status,
        p.Attach,
        p.Detach,
        p.LockRequest,
        p.LockReleased,
        p.MemUpdate,
        p.Parked,
        p.SetLimits,
        p.Allocate,
        p.Yield,
        p.ListAllocations,
    }
)


def check_scoped(scope: str, msg: msgspec.Struct) -> None:
    """Refuse what a connection on task ``scope``'s own socket may not ask; nothing else is changed."""
    kind = type(msg)
    tag = msg.__struct_config__.tag
    if kind not in SERVED:
        raise Refused(p.ErrorCode.PERMISSION_DENIED, f"{tag} is not served on the socket of task {scope!r}")
    if isinstance(msg, p.Attach) and msg.task_id not in (None, scope):
        raise Refused(
            p.ErrorCode.PERMISSION_DENIED,
            f"a session on the socket of task {scope!r} belongs to it, not to {msg.task_id!r}",
        )
    if isinstance(msg, p.Allocate | p.Yield) and msg.task_id != scope:
        raise Refused(
            p.ErrorCode.PERMISSION_DENIED,
            f"the socket of task {scope!r} serves its allocation alone, not {msg.task_id!r}",
        )
    if isinstance(msg, p.Allocate) and not msg.existing:
        raise Refused(
            p.ErrorCode.PERMISSION_DENIED,
            f"on the socket of task {scope!r}, ALLOCATE holds its allocation again (existing), it makes none",
        )


def scoped_attach(scope: str, msg: p.Attach) -> p.Attach:
    """A session on a task's socket belongs to its task's allocation, named or not."""
    return msg if msg.task_id == scope else msgspec.structs.replace(msg, task_id=scope)
