"""The gpud wire protocol: every message, the framing and the error codes.

This module is the one definition; the daemon imports it and nobody redefines a
message. A frame is a 4-byte big-endian length followed by one msgpack message.
Messages are frozen msgspec Structs in tagged unions keyed by ``type``; limits
live in the types, so a decoded message is already validated.

Requests carry an ``id`` chosen by the client; answers carry the ``id`` they
answer; pushes (LOCK_OK, DROP_LOCK, REVOKED, SCHED_STATE, LIMITS_CHANGED,
MEM_LIMIT_EXCEEDED, LEASE_REVOKED, GOODBYE) carry none. The lock
vocabulary is nvshare's: LOCK_REQUEST, LOCK_OK, DROP_LOCK, LOCK_RELEASED,
SCHED_ON, SCHED_OFF, SET_TQ.

Nothing here does I/O: ``FrameDecoder`` is fed bytes and yields payloads, and it
refuses a length over the limit before buffering it.
"""

from __future__ import annotations

import enum
import os
import struct
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/gpud/gpud.sock"
SOCKET_ENV = "GPUD_SOCKET"
# The most payload bytes (after the 4-byte length) a client may send in one frame: the
# daemon's default. A daemon configured otherwise says its own limit in WELCOME.
MAX_FRAME_BYTES = 64 * 1024
# The most a client accepts from the daemon in one frame: answers such as CLIENTS or STATUS on a
# busy node are far larger than any request, so the two directions have different limits.
MAX_REPLY_BYTES = 64 * 2**20
# ALLOCS answers a page at a time: building and encoding one page stays within a few ms of the
# daemon's loop however many allocations there are.
ALLOCS_PAGE = 200
ALLOCS_PAGE_MAX = 1000
PageLimit = Annotated[int, Meta(ge=1, le=ALLOCS_PAGE_MAX)]
_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size

RequestId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
SessionId = Annotated[int, Meta(ge=1, le=2**63 - 1)]
GrantNo = Annotated[int, Meta(ge=1, le=2**63 - 1)]
# The priority classes' numbers (``PriorityClass``, ``PRIORITY_OF_CLASS``), named once: the core, the
# daemon, gpuctl and the clients use these names, never the numbers. Production is never taken back
# by a request, spot at any time; a request that names no priority runs at the default.
PRODUCTION_PRIORITY = 100
HIGH_PRIORITY = 75
NORMAL_PRIORITY = 50
BEST_EFFORT_PRIORITY = 10
SPOT_PRIORITY = 0
DEFAULT_PRIORITY = NORMAL_PRIORITY
Priority = Annotated[int, Meta(ge=SPOT_PRIORITY, le=PRODUCTION_PRIORITY)]
# Names, labels and trace fields end up in tables, logs and metric labels: no control characters.
_PRINTABLE = r"^[^\x00-\x1f\x7f-\x9f]*$"
Name = Annotated[str, Meta(max_length=128, pattern=_PRINTABLE)]
MAX_LABELS = 32
Labels = Annotated[dict[Name, Name], Meta(max_length=MAX_LABELS)]
Reason = Annotated[str, Meta(max_length=512, pattern=_PRINTABLE)]  # a client's one-line explanation
MAX_GPUS = 1024  # the most GPUs one daemon serves: indexes, GPU lists and quantities are bounded by it
# A GPU is named by its index, "gpu:N", or its UUID.
GpuRef = Union[
    Annotated[int, Meta(ge=0, le=MAX_GPUS - 1)],
    Annotated[str, Meta(min_length=1, max_length=96, pattern=r"^[A-Za-z0-9:_.-]+$")],
]
GpuRefs = Annotated[list[GpuRef], Meta(max_length=MAX_GPUS)]
Seconds = Annotated[float, Meta(ge=0.001, le=86400)]  # a time quantum: 1 ms .. 1 day
CoreLimit = Annotated[int, Meta(ge=1, le=100)]  # percent of GPU time; 100 = unlimited
Bytes = Annotated[int, Meta(ge=0, le=2**62)]
Millis = Annotated[int, Meta(ge=0, le=86_400_000)]
HoldMaxMs = Annotated[int, Meta(ge=1, le=86_400_000)]
QueueLimit = Annotated[int, Meta(ge=0, le=100_000)]
# Linux's pid_max is at most 2**22: anything above cannot be a process, and would overflow kill(2).
PID_MAX = 4_194_304
Pid = Annotated[int, Meta(ge=1, le=PID_MAX)]
Gpus = Annotated[float, Meta(ge=0, le=MAX_GPUS)]  # a whole number >= 1, or a fraction < 1 (1/10000 steps)
WholeGpus = Annotated[int, Meta(ge=1, le=MAX_GPUS)]  # an elastic allocation's maximum
AllocChange = Annotated[str, Meta(pattern="^(grown|shrunk|resumed)$")]
CpuCount = Annotated[int, Meta(ge=0, le=100_000)]
TaskId = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:@/+=-]+$")]
TaskType = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
LeaseId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
ClientRef = Union[
    Annotated[int, Meta(ge=1, le=2**63 - 1)], Annotated[str, Meta(min_length=1, max_length=128, pattern=_PRINTABLE)]
]
UtteranceIndex = Annotated[int, Meta(ge=0, le=2**53)]
# The daemon's max_frame_bytes setting (config.py); WELCOME tells clients the value in force.
FrameBytes = Annotated[int, Meta(ge=1024, le=16 * 2**20)]


class ErrorCode(enum.StrEnum):
    """Why a request was refused. Stable strings: scripts match on them."""

    BAD_FRAME = "bad_frame"  # framing broken: the connection is closed after the error
    FRAME_TOO_LARGE = "frame_too_large"  # length over the limit: closed after the error
    UNKNOWN_TYPE = "unknown_type"  # a well-formed message of a type the daemon does not know
    INVALID = "invalid"  # a field missing, of the wrong type or out of range
    HELLO_REQUIRED = "hello_required"  # a request before HELLO
    VERSION = "version"  # protocol versions do not match
    UNKNOWN_GPU = "unknown_gpu"
    UNKNOWN_SESSION = "unknown_session"
    UNKNOWN_CLIENT = "unknown_client"
    UNKNOWN_TENANT = "unknown_tenant"
    UNKNOWN_TASK = "unknown_task"
    INSUFFICIENT = "insufficient"  # not enough free GPUs, CPU cores or tenant quota now
    NOT_HOLDER = "not_holder"  # LOCK_RELEASED for a lock the session does not hold
    STALE_GRANT = "stale_grant"  # LOCK_RELEASED naming an earlier grant
    ALREADY_REQUESTED = "already_requested"  # LOCK_REQUEST while waiting or holding
    PERMISSION_DENIED = "permission_denied"
    SHUTTING_DOWN = "shutting_down"
    LIMIT_REACHED = "limit_reached"  # a cap of the daemon (connections, sessions, queues...): the message names it
    STORE_FAILED = "store_failed"  # the change could not be stored durably, so it was not made: try again
    INTERNAL = "internal"


class DropReason(enum.StrEnum):
    """Why a holder is asked to give the lock back (DROP_LOCK)."""

    TQ = "tq"  # held for the time quantum while someone waits
    QUOTA = "quota"  # compute budget of the window used up
    PREEMPT = "preempt"  # a higher-priority request cannot be admitted
    MEMORY = "memory"  # reported memory no longer fits beside the others


class RevokeReason(enum.StrEnum):
    """Why a lock was taken away without the holder's LOCK_RELEASED."""

    DROP_TIMEOUT = "drop_timeout"  # DROP_LOCK ignored past drop_timeout
    HOLD_MAX = "hold_max"  # a lease held past hold_max, with forced release configured


class Mode(enum.StrEnum):
    """How a GPU admits holders."""

    SERIAL = "serial"  # one holder at a time (nvshare's anti-thrashing mode)
    CONCURRENT = "concurrent"  # holders whose memory fits together
    AUTO = "auto"  # concurrent while memory fits; drops sessions on overflow


class BusyPolicy(enum.StrEnum):
    """What a lease that cannot have the GPU answers (GpuArbiter)."""

    WAIT = "WAIT"  # wait up to max_wait; answers SKIPPED if it never gets it
    SKIP = "SKIP"  # answers SKIPPED: the caller passes (e.g. no semantic repair)
    FALLBACK_CPU = "FALLBACK_CPU"  # answers FALLBACK_CPU: the caller runs on the CPU


class LeaseStatus(enum.StrEnum):
    ACQUIRED = "ACQUIRED"
    SKIPPED = "SKIPPED"
    FALLBACK_CPU = "FALLBACK_CPU"


class LeaseReason(enum.StrEnum):
    GPU_BUSY = "GPU_BUSY"  # max_wait 0 and the GPU is not free now
    QUEUE_FULL = "QUEUE_FULL"  # queue_limit waiters already on arrival
    TIMEOUT = "TIMEOUT"  # still waiting at max_wait


class Strategy(enum.StrEnum):
    """How an allocation picks among GPUs that fit."""

    FIRST_FIT = "first_fit"  # lowest index first
    BEST_FIT = "best_fit"  # the tightest fit first (least free share)
    ROUND_ROBIN = "round_robin"  # start after the GPU chosen last
    LEAST_LOADED = "least_loaded"  # the most free share first
    RANDOM = "random"  # random among those that fit (Ray's rule)
    # only the GPUs in prefer (all of them, or one for a fraction): a scheduler placed it already (gpud-k8s)
    ONLY = "only"


class PriorityClass(enum.StrEnum):
    """Named priorities. An allocation of priority 100 (production) is never preempted; 1..99 may
    be once it has run ``preemption_min_runtime_s``; 0 (spot) at any time."""

    PRODUCTION = "production"
    HIGH = "high"
    NORMAL = "normal"
    BEST_EFFORT = "best-effort"
    SPOT = "spot"


PRIORITY_OF_CLASS = {
    PriorityClass.PRODUCTION: PRODUCTION_PRIORITY,
    PriorityClass.HIGH: HIGH_PRIORITY,
    PriorityClass.NORMAL: NORMAL_PRIORITY,
    PriorityClass.BEST_EFFORT: BEST_EFFORT_PRIORITY,
    PriorityClass.SPOT: SPOT_PRIORITY,
}


class Recovery(enum.StrEnum):
    """What whoever runs a task does when its allocation is preempted (``on_preempt``)."""

    TERMINATE = "terminate"  # SIGTERM to the program, SIGKILL when the grace ends
    CHECKPOINT = "checkpoint"  # the program is told, saves and exits; its next start resumes
    SUSPEND = "suspend"  # paused and parked, devices given back, resumed when they are free again
    SHRINK = "shrink"  # an elastic allocation gives back only GPUs above its minimum
    FAIL = "fail"  # the task ends with the reason


class PreemptStrategy(enum.StrEnum):
    """How victims are chosen when a waiting request may take allocations back."""

    LOWEST_PRIORITY = "lowest_priority"  # the lowest priorities; equal priorities newest first
    NEWEST_FIRST = "newest_first"  # the allocations made last
    MINIMUM_VICTIMS = "minimum_victims"  # the fewest allocations
    MINIMUM_WASTE = "minimum_waste"  # the fewest GPU units freed beyond the need


class PreemptReason(enum.StrEnum):
    """Why an allocation is taken back (the PREEMPT push, metrics, logs)."""

    PRIORITY = "priority"  # a waiting request of strictly higher priority
    QUOTA_RECLAIM = "quota_reclaim"  # the lending tenant asks for its own quota
    ELASTIC = "elastic"  # GPUs an elastic allocation got above its minimum
    DRAIN = "drain"  # an operator drains the GPU
    LOST = "lost"  # gone while its client was away (said by the client library, not by gpud)


class AllocState(enum.StrEnum):
    RUNNING = "running"
    PREEMPTING = "preempting"  # told to leave; its devices stay its own until it does or the grace ends
    SUSPENDED = "suspended"  # paused, its devices given back, waiting for them at its priority


class _Msg(Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    """A request: the daemon refuses a field it does not know (a typo must not pass unseen)."""


class _Reply(Struct, frozen=True, kw_only=True, tag_field="type"):
    """An answer or a push: a client ignores fields a newer daemon added, so it keeps working."""


# --- client -> daemon -------------------------------------------------------


class Hello(_Msg, tag="HELLO", frozen=True, kw_only=True):
    id: RequestId
    version: int
    name: Name = ""
    labels: Labels = {}


class Relabel(_Msg, tag="LABELS", frozen=True, kw_only=True):
    """The client's labels from now on, in place of HELLO's (a run says what it is doing: ``run.state``).
    Not answered."""

    id: RequestId
    labels: Labels = {}


class Attach(_Msg, tag="ATTACH", frozen=True, kw_only=True):
    """Open a session on one GPU; answered by ATTACHED."""

    id: RequestId
    gpu: GpuRef
    priority: Priority = 0
    core_limit: CoreLimit = 100
    mem_limit: Bytes | None = None  # use above it is reported back (MEM_LIMIT_EXCEEDED)
    mem_estimate: Bytes | None = None  # for admission; None with no report: the whole GPU
    task_id: TaskId | None = None  # a fractional allocation of this task sets the limits (unless lower)
    # A supervised program (``gpuctl run``) that can park its GPU memory in host memory: while it
    # does not hold the lock, its memory stays on the GPU until the daemon asks for it with PARK.
    parkable: bool = False


class Detach(_Msg, tag="DETACH", frozen=True, kw_only=True):
    id: RequestId
    session: SessionId


class LockRequest(_Msg, tag="LOCK_REQUEST", frozen=True, kw_only=True):
    """Ask for the session's GPU lock. Answered only by an ERROR on refusal;
    the grant arrives later as a LOCK_OK push."""

    id: RequestId
    session: SessionId


class LockReleased(_Msg, tag="LOCK_RELEASED", frozen=True, kw_only=True):
    """Give the lock back. ``grant`` (optional) guards against releasing a
    later grant with a stale message. Answered only by an ERROR on refusal."""

    id: RequestId
    session: SessionId
    grant: GrantNo | None = None


class MemUpdate(_Msg, tag="MEM_UPDATE", frozen=True, kw_only=True):
    """The session's GPU memory use as the framework or NVML sees it.
    Answered only by an ERROR on refusal."""

    id: RequestId
    session: SessionId
    used_bytes: Bytes


class Parked(_Msg, tag="PARKED", frozen=True, kw_only=True):
    """Answers a PARK push: the program's GPU memory is in host memory (``ok``), or it could not be
    moved (``ok`` false, ``message`` says why: its memory stays on the GPU). Answered only by an
    ERROR on refusal."""

    id: RequestId
    session: SessionId
    ok: bool
    message: Reason = ""


class SetLimits(_Msg, tag="SET_LIMITS", frozen=True, kw_only=True):
    """Change core/memory limits of a client's sessions (all, or one GPU's, or
    one session). ``client`` None: the sender's own. Another client's needs
    admin rights. Answered by LIMITS_SET. A mem_limit of 0 lifts the limit."""

    id: RequestId
    client: ClientRef | None = None
    gpu: GpuRef | None = None
    session: SessionId | None = None
    core_limit: CoreLimit | None = None
    mem_limit: Bytes | None = None


class Trace(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where a lease comes from, for its log line. Never a metric label."""

    job_id: Name | None = None
    session_id: Name | None = None
    utterance_index: UtteranceIndex | None = None
    stage: Name | None = None


class Acquire(_Msg, tag="ACQUIRE", frozen=True, kw_only=True):
    """Ask for a lease (GpuArbiter). Fields left out come from the task type's
    policy. Answered by LEASE_RESULT once it is decided: at once, or when the
    GPU frees up, or at max_wait."""

    id: RequestId
    gpu: GpuRef
    task_type: TaskType = "OTHER"
    priority: Priority | None = None
    max_wait_ms: Millis | None = None
    hold_max_ms: HoldMaxMs | None = None
    queue_limit: QueueLimit | None = None
    busy_policy: BusyPolicy | None = None
    mem_estimate: Bytes | None = None
    trace: Trace = Trace()


class Release(_Msg, tag="RELEASE", frozen=True, kw_only=True):
    """Give a lease back. Idempotent: a lease already gone answers OK.
    ``quiet``: no OK on success (a refusal is still answered), for clients
    that do not wait for it."""

    id: RequestId
    lease_id: LeaseId
    quiet: bool = False


class ReportOom(_Msg, tag="REPORT_OOM", frozen=True, kw_only=True):
    """The client ran out of GPU memory (counted per GPU and task type)."""

    id: RequestId
    gpu: GpuRef
    task_type: TaskType = "OTHER"


class ListLeases(_Msg, tag="LEASES", frozen=True, kw_only=True):
    id: RequestId


class SetPolicy(_Msg, tag="SET_POLICY", frozen=True, kw_only=True):
    """Change (or create) a task type's lease policy; unset fields are kept."""

    id: RequestId
    task_type: TaskType
    priority: Priority | None = None
    busy_policy: BusyPolicy | None = None
    max_wait_ms: Millis | None = None
    queue_limit: QueueLimit | None = None
    hold_max_ms: HoldMaxMs | None = None


class ListPolicies(_Msg, tag="POLICIES", frozen=True, kw_only=True):
    id: RequestId


class Allocate(_Msg, tag="ALLOCATE", frozen=True, kw_only=True):
    """Assign GPUs (whole, or a fraction of one) and CPU cores to a task id.
    Answered by ALLOCATED, or by ERROR insufficient (at once, or after
    wait_ms in the priority queue). The same task id again: the same answer."""

    id: RequestId
    task_id: TaskId
    gpus: Gpus = 1.0
    cpus: CpuCount = 0
    prefer: GpuRefs = []
    strategy: Strategy = Strategy.FIRST_FIT
    tenant: Name | None = None
    priority: Priority | None = None
    priority_class: PriorityClass | None = None
    wait_ms: Millis = 0
    owner_pid: Pid | None = None  # reclaimed when this process dies; yours to signal (docs/security.md)
    owner_any_uid: bool = False  # admin: owner_pid may be another uid's process (logged)
    on_preempt: Recovery = Recovery.TERMINATE
    gpus_max: WholeGpus | None = None  # elastic: gpus (whole) is the minimum
    protected: bool = False  # admin: never preempted
    # Only the task's allocation as it is (running or suspended), never a new one: a client back after
    # a lost connection says it still holds it (and is told of its preemption again); refused when gone.
    existing: bool = False
    # The connection carries the recovery out when told (PREEMPT pushes). False: it does not listen,
    # so gpud tells the owner process by signals instead (and with no owner pid, never preempts it).
    notify: bool = True
    # A fraction's memory ceiling for its sessions, in bytes (None: its share of the GPU's memory; at most
    # the GPU's memory). Only with a fraction of one GPU.
    memory_bytes: Bytes | None = None


class Free(_Msg, tag="FREE", frozen=True, kw_only=True):
    """Release a task's allocation (or withdraw its wait)."""

    id: RequestId
    task_id: TaskId


class ListAllocations(_Msg, tag="ALLOCS", frozen=True, kw_only=True):
    """One page of the allocations, in task id order: those after ``after`` (None: from the
    first), at most ``limit`` (None: the daemon's page size). ALLOCS_REPLY's ``next_after`` asks
    for the next page."""

    id: RequestId
    after: TaskId | None = None
    limit: PageLimit | None = None


class Yield(_Msg, tag="YIELD", frozen=True, kw_only=True):
    """The holder of a preempted allocation did what the notice asked (its program ended, or was
    suspended, or let the named GPUs go): the devices go back now, not at the grace's end. Answered OK."""

    id: RequestId
    task_id: TaskId


class Protect(_Msg, tag="PROTECT", frozen=True, kw_only=True):
    """Admin: an allocation that is never preempted (or is again preemptible). Answered OK."""

    id: RequestId
    task_id: TaskId
    protected: bool = True


class Drain(_Msg, tag="DRAIN", frozen=True, kw_only=True):
    """Admin: no new grants on a GPU, its allocations preempted with their recovery (on), or back in
    service (off). Locks and leases finish their turn. Answered DRAINED."""

    id: RequestId
    gpu: GpuRef
    on: bool = True


class ResetAllocations(_Msg, tag="RESET_ALLOCS", frozen=True, kw_only=True):
    """Admin: release every allocation."""

    id: RequestId


class SetMode(_Msg, tag="SET_MODE", frozen=True, kw_only=True):
    id: RequestId
    mode: Mode
    gpu: GpuRef | None = None


class SchedOn(_Msg, tag="SCHED_ON", frozen=True, kw_only=True):
    id: RequestId
    gpu: GpuRef | None = None  # None: every GPU


class SchedOff(_Msg, tag="SCHED_OFF", frozen=True, kw_only=True):
    id: RequestId
    gpu: GpuRef | None = None


class SetTq(_Msg, tag="SET_TQ", frozen=True, kw_only=True):
    id: RequestId
    seconds: Seconds
    gpu: GpuRef | None = None


class Status(_Msg, tag="STATUS", frozen=True, kw_only=True):
    id: RequestId


class ListClients(_Msg, tag="CLIENTS", frozen=True, kw_only=True):
    id: RequestId


# --- a run's program, held by gpud (gpuctl run; docs/run.md#gpuds-cgroup-cgroup) ---------------
# Both directions in one block: a run hands gpud its program (CONTAIN), has gpud freeze and thaw the
# program's cgroup (FREEZE, THAW), tells gpud what its signal backend caught (ESCAPED); RUNS lists
# what the kernel says of every run's program.

ProgramBackend = Literal["cgroup", "signal"]  # gpud froze it in its cgroup, or only the run stops it
# What the kernel says of a run's program: its cgroup's ``frozen`` (cgroup), or the /proc states of
# its tree (signal): every process stopped, some, none; gone: no process left.
KernelState = Literal["frozen", "freezing", "running", "stopped", "partly_stopped", "gone", "unknown"]
Escapes = Annotated[int, Meta(ge=1, le=2**31)]
PauseName = Annotated[str, Meta(max_length=16, pattern=r"^[a-z+]*$")]  # a run's --pause backend: cuda, signal


class Contain(_Msg, tag="CONTAIN", frozen=True, kw_only=True):
    """A run hands gpud its program: ``pid``, the run's own descendant of the run's uid (checked by the
    kernel's word). ``cgroup``: put it in a cgroup of gpud's, which gpud freezes and thaws (FREEZE, THAW)
    and kills whole when the run is gone; else gpud only watches it. ``pause``: the run's own process
    control beside it (cuda, signal, none), for gpuctl. Answered by CONTAINED."""

    id: RequestId
    pid: Pid
    cgroup: bool = True
    pause: PauseName = ""


class Freeze(_Msg, tag="FREEZE", frozen=True, kw_only=True):
    """Freeze the cgroup of this connection's program; answered by PROGRAM_STATE once the kernel says
    it is frozen (``cgroup.events``), or when it did not freeze in time (``frozen`` false)."""

    id: RequestId


class Thaw(_Msg, tag="THAW", frozen=True, kw_only=True):
    """Thaw the cgroup of this connection's program; answered by PROGRAM_STATE."""

    id: RequestId


class Escaped(_Msg, tag="ESCAPED", frozen=True, kw_only=True):
    """The run's signal backend caught process ``pid`` of its paused program running (continued from
    outside) and stopped it again; ``escapes``: the run's count so far. Answered by OK."""

    id: RequestId
    pid: Pid
    escapes: Escapes


# A cgroup's path in the cgroup2 hierarchy: absolute, no NUL, no empty or dot components (checked).
CgroupPath = Annotated[str, Meta(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$")]
CgroupPaths = Annotated[list[CgroupPath], Meta(max_length=64)]  # one claim's containers


class Adopt(_Msg, tag="ADOPT", frozen=True, kw_only=True):
    """Admin: cgroups that are not gpud's own become this connection's program, frozen and thawed by
    FREEZE and THAW as a run's (gpud-k8s hands a Kubernetes claim's containers so: docs/kubernetes.md).
    ``cgroups``: their paths in the cgroup2 hierarchy, replacing what this connection handed before
    (an empty list hands them all back, thawed); ``task_id``: whose they are, for RUNS and the log.
    gpud checks each against the kernel (a directory of the hierarchy with a freezer; not the root, not
    gpud's own cgroup or the caller's or an ancestor of either, not init's, not a run's cgroup of gpud's,
    not another connection's) and never kills, moves or removes them; a connection that goes leaves
    them as the kernel has them. Answered by PROGRAM_STATE (``frozen``: all of them are)."""

    id: RequestId
    task_id: TaskId
    cgroups: CgroupPaths


class ListRuns(_Msg, tag="RUNS", frozen=True, kw_only=True):
    id: RequestId


# --- a task's own socket (docs/kubernetes.md#a-socket-per-claim) --------------------------------------
# A socket path: absolute, within what a Unix socket address holds (107 bytes), no NUL.
SocketPath = Annotated[str, Meta(min_length=2, max_length=107, pattern=r"^/[^\x00]*$")]


class OpenTaskSocket(_Msg, tag="OPEN_TASK_SOCKET", frozen=True, kw_only=True):
    """Admin: listen at ``path`` on a socket of ``task_id``'s own, for processes gpud cannot tell apart
    otherwise (a container's: their uids and pids say nothing of the claim they run for). Every
    connection on it belongs to the task: it attaches sessions to the task's allocation (whose share
    and memory are their ceilings), may hold the allocation and yield it, names no other task and is no
    admin, whatever its uid. ``path``'s directory must exist, be owned by gpud's uid or root and be
    writable by no one else. The same task and path again: nothing changes. Answered OK."""

    id: RequestId
    task_id: TaskId
    path: SocketPath


class CloseTaskSocket(_Msg, tag="CLOSE_TASK_SOCKET", frozen=True, kw_only=True):
    """Admin: stop listening on ``task_id``'s own socket (the file is removed) and close the connections
    made on it. A task with none: nothing to do. Answered OK."""

    id: RequestId
    task_id: TaskId


class Contained(_Reply, tag="CONTAINED", frozen=True, kw_only=True):
    id: RequestId
    pid: int
    backend: ProgramBackend
    cgroup: str = ""  # its cgroup's path in the cgroup2 hierarchy, "" when it has none
    frozen: bool = False  # adopted frozen: held again after a restart or a reconnect, as the kernel left it
    why: str = ""  # why it has no cgroup when one was asked for


class ProgramState(_Reply, tag="PROGRAM_STATE", frozen=True, kw_only=True):
    id: RequestId
    frozen: bool
    waited_ms: float = 0.0


class RunProgramInfo(Struct, frozen=True, kw_only=True):
    client_id: int  # 0: no run holds it now (its run went away; killed when the grace ends)
    pid: int
    backend: str  # how it is paused: cgroup, cuda+cgroup, signal, cuda, none
    cgroup: str
    state: KernelState
    processes: int  # in its cgroup, or in its tree
    stopped: int  # of them, stopped (signal) or frozen (cgroup)
    escapes: int  # reported by its run
    task_id: str = ""  # whose the cgroups are (ADOPT); "" for a run's program


class RunsReply(_Reply, tag="RUNS_REPLY", frozen=True, kw_only=True):
    id: RequestId
    runs: list[RunProgramInfo]


ClientMessage = Union[
    Hello,
    Relabel,
    Attach,
    Detach,
    LockRequest,
    LockReleased,
    MemUpdate,
    Parked,
    SetLimits,
    SetMode,
    Acquire,
    Release,
    ReportOom,
    ListLeases,
    SetPolicy,
    ListPolicies,
    Allocate,
    Free,
    ListAllocations,
    Yield,
    Protect,
    Drain,
    ResetAllocations,
    SchedOn,
    SchedOff,
    SetTq,
    Status,
    ListClients,
    Contain,
    Freeze,
    Thaw,
    Escaped,
    ListRuns,
    Adopt,
    OpenTaskSocket,
    CloseTaskSocket,
]


# --- daemon -> client -------------------------------------------------------


class GpuInfo(Struct, frozen=True, kw_only=True):
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    simulated: bool
    scheduler_on: bool


class Welcome(_Reply, tag="WELCOME", frozen=True, kw_only=True):
    id: RequestId
    client_id: int
    version: int
    gpus: list[GpuInfo]
    # The most bytes one request frame's payload may have on this daemon: the length in the
    # 4-byte header, which does not count itself. len(payload) <= max_frame_bytes is accepted;
    # one byte more and the daemon answers frame_too_large and closes the connection.
    max_frame_bytes: int = MAX_FRAME_BYTES


class Attached(_Reply, tag="ATTACHED", frozen=True, kw_only=True):
    id: RequestId
    session: SessionId
    gpu: int
    scheduler_on: bool
    core_limit: int
    mem_limit: int | None
    memory_total_bytes: int


class LeaseResult(_Reply, tag="LEASE_RESULT", frozen=True, kw_only=True):
    """The answer to ACQUIRE: ACQUIRED with a lease id, or SKIPPED /
    FALLBACK_CPU with the reason."""

    id: RequestId
    status: LeaseStatus
    gpu: int
    task_type: str
    lease_id: str | None = None
    acquired_at: float | None = None  # Unix time, seconds
    queue_wait_ms: float = 0.0
    reason: LeaseReason | None = None

    @property
    def acquired(self) -> bool:
        return self.status == LeaseStatus.ACQUIRED


class LeaseRevoked(_Reply, tag="LEASE_REVOKED", frozen=True, kw_only=True):
    """Push: the daemon released a lease by force (hold_max with forced release on)."""

    lease_id: str
    reason: RevokeReason


class LeaseInfo(Struct, frozen=True, kw_only=True):
    lease_id: str
    gpu: int
    task_type: str
    state: Literal["waiting", "holding"]
    priority: int
    busy_policy: BusyPolicy
    client_id: int
    name: str
    pid: int
    waited_ms: float
    held_ms: float
    hold_max_ms: int
    overdue: bool
    trace: Trace


class LeasesReply(_Reply, tag="LEASES_REPLY", frozen=True, kw_only=True):
    id: RequestId
    leases: list[LeaseInfo]


class PolicyInfo(Struct, frozen=True, kw_only=True):
    priority: int
    busy_policy: BusyPolicy
    max_wait_ms: int
    queue_limit: int
    hold_max_ms: int
    uids: list[int] = []  # with gids: the only non-admins who may use it (both empty: anyone)
    gids: list[int] = []


class PoliciesReply(_Reply, tag="POLICIES_REPLY", frozen=True, kw_only=True):
    id: RequestId
    policies: dict[str, PolicyInfo]


class Allocated(_Reply, tag="ALLOCATED", frozen=True, kw_only=True):
    id: RequestId
    task_id: str
    gpus: list[int]
    uuids: list[str]
    share: float  # of each GPU: 1.0 for whole GPUs
    cpus: list[int]
    cuda_visible_devices: str
    tenant: str | None
    priority: int
    owner_pid: int | None
    waited_ms: float = 0.0
    on_preempt: Recovery = Recovery.TERMINATE
    gpus_min: int | None = None  # elastic: the range it may be shrunk and grown in
    gpus_max: int | None = None
    protected: bool = False
    state: AllocState = AllocState.RUNNING
    preemptible: bool = True  # False: nothing may take it back now (``why``: production, protected,
    # no one to tell, inside its minimum runtime...)
    why: str = ""  # why it is in its state, or why it is not preemptible now
    preemptible_in_s: float | None = None  # not preemptible for this long yet (None: not by time alone)
    deadline_s: float | None = None  # preempting: seconds left in its grace
    resume: bool = False  # this start resumes a task preempted before (its checkpoint is there)
    preemptions: int = 0  # how often this task was preempted
    preemption_grace_s: float | None = None  # how long a preempted holder has to leave (the daemon's setting)
    memory_bytes: int | None = None  # a fraction's memory ceiling (ALLOCATE's memory_bytes, or its share's)


class GpuAllocationSummary(Struct, frozen=True, kw_only=True):
    index: int
    uuid: str
    allocated: float  # share of the GPU, 0..1
    free: float
    tasks: dict[str, float]


class TenantSummary(Struct, frozen=True, kw_only=True):
    quota: float
    borrow: float
    used: float


class AllocWaiter(Struct, frozen=True, kw_only=True):
    task_id: str
    gpus: float
    priority: int
    waited_s: float
    why: str  # what it waits for: what is short, or the victims whose grace runs


class AllocationsReply(_Reply, tag="ALLOCS_REPLY", frozen=True, kw_only=True):
    """One page of allocations (the GPUs' ``tasks``: those of this page); the waiters, GPUs,
    CPUs and tenants whole."""

    id: RequestId
    allocations: list[Allocated]
    total: int = 0  # allocations in all pages
    next_after: str | None = None  # more pages: ask again with after=next_after
    waiting: list[str]
    waiters: list[AllocWaiter] = []
    draining: list[int] = []  # GPUs an operator drains
    gpus: list[GpuAllocationSummary]
    cpus_total: int
    cpus_free: list[int]
    tenants: dict[str, TenantSummary]


def join_pages(pages: list[AllocationsReply]) -> AllocationsReply:
    """ALLOCS pages read one after another, as one answer (the last page's waiters, GPUs, CPUs and
    tenants; every page's allocations and GPU tasks). Not a snapshot: what changed between two
    pages shows as it was when each page was read."""
    last = pages[-1]
    gpus = [
        msgspec.structs.replace(g, tasks={t: s for page in pages for t, s in page.gpus[i].tasks.items()})
        if all(len(page.gpus) > i for page in pages)
        else g
        for i, g in enumerate(last.gpus)
    ]
    return msgspec.structs.replace(
        last, id=pages[0].id, allocations=[a for page in pages for a in page.allocations], gpus=gpus, next_after=None
    )


class LimitsSet(_Reply, tag="LIMITS_SET", frozen=True, kw_only=True):
    id: RequestId
    sessions: list[int]


class LimitsChanged(_Reply, tag="LIMITS_CHANGED", frozen=True, kw_only=True):
    """Push: the session's limits are now these."""

    session: SessionId
    core_limit: int
    mem_limit: int | None


class MemLimitExceeded(_Reply, tag="MEM_LIMIT_EXCEEDED", frozen=True, kw_only=True):
    """Push: reported use went above the session's memory limit."""

    session: SessionId
    used_bytes: int
    limit_bytes: int


class Ok(_Reply, tag="OK", frozen=True, kw_only=True):
    id: RequestId


class Drained(_Reply, tag="DRAINED", frozen=True, kw_only=True):
    """DRAIN's answer: the GPU (its index) drains now or not, and whether it did before (the same:
    nothing changed)."""

    id: RequestId
    gpu: int  # its index
    draining: bool
    was_draining: bool


class Error(_Reply, tag="ERROR", frozen=True, kw_only=True):
    id: RequestId | None
    code: ErrorCode
    message: str


class LockOk(_Reply, tag="LOCK_OK", frozen=True, kw_only=True):
    session: SessionId
    grant: GrantNo


class DropLock(_Reply, tag="DROP_LOCK", frozen=True, kw_only=True):
    session: SessionId
    grant: GrantNo
    reason: DropReason


class Park(_Reply, tag="PARK", frozen=True, kw_only=True):
    """Push to a parkable session that does not hold the lock: the next holder needs the GPU memory
    its program keeps there. Answered by PARKED."""

    session: SessionId


class Revoked(_Reply, tag="REVOKED", frozen=True, kw_only=True):
    session: SessionId
    grant: GrantNo
    reason: RevokeReason


class Preempt(_Reply, tag="PREEMPT", frozen=True, kw_only=True):
    """Push to the connection that holds an allocation: leave within ``grace_s``. ``gpus`` are the
    GPUs to give back: all of them (``whole``), or those an elastic allocation got above its minimum.
    Until YIELD, FREE or the grace's end the devices stay the holder's."""

    task_id: str
    reason: PreemptReason
    recovery: Recovery
    gpus: list[int]
    whole: bool
    grace_s: float
    by: str  # the task that waits for the devices, or "drain"


class PreemptWithdrawn(_Reply, tag="PREEMPT_WITHDRAWN", frozen=True, kw_only=True):
    """Push: the request that caused a PREEMPT gave up before the grace ended; carry on."""

    task_id: str


class AllocRevoked(_Reply, tag="ALLOC_REVOKED", frozen=True, kw_only=True):
    """Push: the allocation is taken back (the grace ended, or the holder yielded). A suspended
    allocation is not gone: it waits for its devices, and ALLOC_CHANGED ``resumed`` gives them back."""

    task_id: str
    reason: PreemptReason
    state: AllocState  # suspended, or running for an allocation that is gone
    gone: bool  # the allocation no longer exists (FREE is not needed)


class AllocChanged(_Reply, tag="ALLOC_CHANGED", frozen=True, kw_only=True):
    """Push: an allocation's devices changed: ``grown`` or ``shrunk`` (elastic), ``resumed`` (a
    suspended allocation has its devices again)."""

    change: AllocChange
    allocation: Allocated


class Goodbye(_Reply, tag="GOODBYE", frozen=True, kw_only=True):
    """Push: the daemon is shutting down; the connection closes next.
    Clients reconnect when it is back (their locks and leases are gone)."""

    reason: str


class SchedState(_Reply, tag="SCHED_STATE", frozen=True, kw_only=True):
    gpu: int
    on: bool


class HolderInfo(Struct, frozen=True, kw_only=True):
    session: int
    client_id: int
    name: str
    pid: int
    grant: int
    held_ms: float
    drop_pending: DropReason | None
    core_limit: int


class WaiterInfo(Struct, frozen=True, kw_only=True):
    session: int
    client_id: int
    name: str
    pid: int
    priority: int
    waited_ms: float
    throttled: bool


class GpuStatus(Struct, frozen=True, kw_only=True):
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    simulated: bool
    mode: Mode
    scheduler_on: bool
    tq_s: float
    window_s: float
    memory_capacity_bytes: int  # total less the reserve
    memory_in_use_bytes: int  # what the holders need, as admission counts it
    healthy: bool = True  # False while NVML fails for this GPU
    memory_used_bytes: int | None = None  # NVML's last reading, every process's (None: simulated)
    draining: bool = False  # an operator drains it: no new grants
    drained: bool = False  # draining, and no allocation is left on it
    pci_bus_id: str | None = None  # NVML's (domain:bus:device.function); None: simulated or unknown
    holders: list[HolderInfo]
    queue: list[WaiterInfo]
    clients: int
    grants: int
    drops: dict[str, int]
    revocations: int


class StatusReply(_Reply, tag="STATUS_REPLY", frozen=True, kw_only=True):
    id: RequestId
    version: str
    uptime_s: float
    gpus: list[GpuStatus]


class SessionInfo(Struct, frozen=True, kw_only=True):
    session: int
    gpu: int
    state: Literal["idle", "waiting", "holding"]
    priority: int
    grants: int
    hold_ms: float
    wait_ms: float
    drops: dict[str, int]
    revocations: int
    core_limit: int
    budget_ms: float | None  # per window after scaling; None: unlimited
    window_used_ms: float  # weighted GPU time billed in the current window
    window_share_percent: float  # window_used_ms / window length
    recent_share_percent: float  # over the last finished windows
    throttled: bool
    throttles: int
    mem_estimate_bytes: int | None
    mem_used_bytes: int | None
    mem_limit_bytes: int | None
    mem_violations: int
    core_ceiling: int = 100  # set by an admin or a fractional allocation: the session cannot go above
    mem_ceiling_bytes: int | None = None
    parkable: bool = False  # a supervised program that parks its memory when asked (gpuctl run)
    parked: bool = False  # its memory is in host memory now
    parks: int = 0  # how many times it parked


class ClientInfo(Struct, frozen=True, kw_only=True):
    client_id: int
    name: str
    pid: int
    uid: int
    gid: int
    labels: dict[str, str]
    connected_s: float
    sessions: list[SessionInfo]


class ClientsReply(_Reply, tag="CLIENTS_REPLY", frozen=True, kw_only=True):
    id: RequestId
    clients: list[ClientInfo]


DaemonMessage = Union[
    Welcome,
    Drained,
    Attached,
    LimitsSet,
    LimitsChanged,
    Allocated,
    AllocationsReply,
    LeaseResult,
    LeaseRevoked,
    LeasesReply,
    PoliciesReply,
    MemLimitExceeded,
    Ok,
    Error,
    LockOk,
    DropLock,
    Park,
    Revoked,
    Preempt,
    PreemptWithdrawn,
    AllocRevoked,
    AllocChanged,
    Goodbye,
    SchedState,
    StatusReply,
    ClientsReply,
    Contained,
    ProgramState,
    RunsReply,
]

CLIENT_TYPES = frozenset(t.__struct_config__.tag for t in ClientMessage.__args__)  # type: ignore[attr-defined]


# --- framing ----------------------------------------------------------------


class FrameTooLarge(Exception):
    """The peer announced a frame longer than the limit. ``payloads``: the whole frames that came
    before it in the same bytes, for the reader to handle before it answers the error."""

    def __init__(self, length: int, limit: int, payloads: list[bytes] | None = None) -> None:
        super().__init__(f"frame of {length} bytes is over the {limit}-byte limit")
        self.length = length
        self.limit = limit
        self.payloads = payloads or []

    def __reduce__(self) -> tuple[type[FrameTooLarge], tuple[int, int]]:
        return type(self), (self.length, self.limit)


def frame(payload: bytes) -> bytes:
    """Prefix one encoded message with its length."""
    return _HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Splits a byte stream into payloads. Pure: feed bytes, get payloads.

    The length is checked before anything is buffered for it, so a peer cannot
    make us hold more than ``max_frame`` bytes plus one read.
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_frame

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= HEADER_BYTES:
            (length,) = _HEADER.unpack_from(self._buf)
            if length > self._max:
                raise FrameTooLarge(length, self._max, out)
            end = HEADER_BYTES + length
            if len(self._buf) < end:
                break
            out.append(bytes(self._buf[HEADER_BYTES:end]))
            del self._buf[:end]
        return out

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)


class Codec:
    """One reused encoder and typed decoder for one side of a connection."""

    def __init__(self, incoming: Any) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(incoming)

    def encode(self, msg: Struct) -> bytes:
        return frame(self._enc.encode(msg))

    def decode(self, payload: bytes) -> Any:
        """One message; msgspec's errors, also for a message nested too deeply to read or
        with a string that is not UTF-8 (msgspec raises those as other exceptions)."""
        try:
            return self._dec.decode(payload)
        except RecursionError:
            raise msgspec.DecodeError("message nested too deeply") from None
        except UnicodeDecodeError as exc:
            raise msgspec.DecodeError(f"a string is not UTF-8: {exc}") from None


def client_codec() -> Codec:
    """What a client uses: it encodes ClientMessage and decodes DaemonMessage."""
    return Codec(DaemonMessage)


def daemon_codec() -> Codec:
    return Codec(ClientMessage)


def describe_bad_message(payload: bytes, exc: msgspec.MsgspecError) -> tuple[int | None, ErrorCode, str]:
    """Turn a payload that failed typed decoding into (id, code, message).

    The id is recovered from an untyped decode when there is one, so the peer
    can tell which request was refused.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError):
        return None, ErrorCode.BAD_FRAME, f"not a msgpack message: {exc}"
    if not isinstance(raw, dict):
        return None, ErrorCode.INVALID, f"a message must be a map with a 'type' field, got {type(raw).__name__}"
    rid = raw.get("id")
    rid = rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63 else None
    kind = raw.get("type")
    if isinstance(kind, str) and kind not in CLIENT_TYPES:
        return rid, ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}"
    return rid, ErrorCode.INVALID, str(exc)


def resolve_socket_path(explicit: str | None = None, environ: dict[str, str] | None = None) -> str:
    """--socket, else $GPUD_SOCKET, else the default: the same rule everywhere."""
    if explicit:
        return explicit
    env = os.environ if environ is None else environ
    return env.get(SOCKET_ENV) or DEFAULT_SOCKET
