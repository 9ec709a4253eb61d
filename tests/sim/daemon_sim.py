"""Deterministic simulation of the whole daemon: one seed, one world, every invariant after every event.

A real ``Daemon`` (schedulers, arbiter, allocator, its SQLite store in a temporary
directory) is driven in process: no sockets, no trio run, a fake clock in integer
microseconds that only this module moves. A ``random.Random(seed)`` draws the
configuration (GPUs, mode, TQ, drop_timeout, park_timeout, compute window, lease
policies, tenants, small caps, restart grace, how often the store fails; preemption on or
off, its strategy, a grace, minimum runtime and cooldowns of milliseconds) and then every
step: clients connect (some before HELLO), attach sessions (some parkable, as ``gpuctl
run`` does), request and release the lock, answer PARK (or not),
report memory, change limits, take leases (and abandon them), allocate (every priority
class from spot 0 to production 100, each recovery, elastic ranges, protected), free and
wait (requests that may take others' allocations back), yield, run admin operations
(mode, TQ, scheduler on/off, policies, reset, drain and undrain, protect), query,
crash; the daemon itself crashes, often while a preemption runs (its objects are dropped without a word, the
store is closed, a new ``Daemon`` is built on the same state directory with the
restart grace) or restarts gracefully (GOODBYE); the store's ``write`` fails now
and then.

Processes are a table of the simulation's (``tests/sim/procs.py``), the daemon's kernel: each
client is a process (under a login shell of its uid, sometimes), with children; init, a kernel
thread and a process standing for gpud itself are there too (as is, in some seeds, a /proc that
hides everything). An ALLOCATE names an ``owner_pid`` now and then (``notify`` off more often
then, so that gpud signals the owner rather than pushing PREEMPT): the client's own process, its
child or shell, a sibling, a setuid child, another uid's process, another login session of its
uid, init, gpud, a kernel thread, a process that exited, a pid that a new process took, a pid
nobody has; an admin adds ``owner_any_uid`` (and so, refused, does anyone else). Owners exit (a
client's crash takes its process, sometimes its children), exit on gpud's SIGTERM now and then,
and a dead owner's pid is taken by a new process (of its uid, often). The reaper runs every
``reap_interval_s`` (drawn; 0 in some seeds: never).

Time moves the way the shell's timers move it: to every scheduler and
ledger deadline in order (``carry_out(slot, advance(now))``,
``allocator.advance(now)``), to the reaper's rounds, and to the moments simulated clients act.

Clients are models of what a process believes: its sessions (idle, waiting,
holding which grant, dropped when), its leases, its outstanding requests and when
each was sent, and the allocations acknowledged to it. Their behaviours: ``good``
(releases soon after DROP_LOCK, keeps the lock between slices otherwise), ``slow``
(releases late after DROP_LOCK, often after drop_timeout: revoked), ``stubborn``
(ignores DROP_LOCK, holds long, sends stale LOCK_RELEASED), ``abandoner`` (never
gives a lease back), ``crashy`` (crashes often); all reconnect after a daemon
crash and attach their sessions again, as the client library does. A parkable
session's client answers PARK after a drawn delay, PARKED ok mostly, not ok
sometimes; a ``slow`` one often after park_timeout, a ``stubborn`` one never.
The connection that last got ALLOCATED for a task holds it (the daemon pushes its
preemption there): on PREEMPT a ``good`` holder yields at once or soon, or frees
instead, a ``slow`` one yields around the grace's end, a ``crashy`` one may crash, a
``stubborn`` one or an abandoner never answers; after ALLOC_REVOKED a runner asks for the
task again (a checkpoint resumes) or frees a suspended one; after a reconnect it asks
again for what it held and waited for.

After every event (one request, one timer expiry, one client action, one crash)
``World.check`` compares the daemon with the model and with the rules:
- the daemon's holders, queue, owners and leases are exactly what connected clients
  believe (so nothing is granted to, or kept for, a disconnected client), and the
  mode, scheduler switch and TQ are what the admin was told;
- serial mode: never two holders, unless they were admitted before the GPU
  became serial or while the scheduler was off;
- concurrent and auto: a grant leaves the holders' memory (max of estimate and
  reported use, unknown = the whole GPU) within capacity unless alone; auto drops
  sessions while reported memory overflows;
- parking: a PARK goes only to a parkable session of that connection that does
  not hold, with the scheduler on, while something waits for (or was just granted)
  the GPU; never again while one is unanswered, after PARKED ok, or after a refusal
  or a park_timeout, until the session has held once more; at every grant the
  holders' memory and that of the parkable sessions resident on the GPU (attached,
  not holding, not parked since their last grant) fit the capacity unless every
  resident one has refused or timed out; the daemon's parkable sessions (resident,
  asked, refused) and CLIENTS' parkable/parked/parks are what the clients saw;
- billing: in every finished window and in the current one, no session was billed
  more than the time it held the GPU in that window, and all together no more than
  the window's wall time; a limited holder over its budget has its DROP_LOCK;
- a DROP_LOCK not answered within drop_timeout is a REVOKED exactly then; a
  holder past TQ with a runnable waiter has its DROP_LOCK; a GPU with no holder
  has no runnable waiter unless a PARK is out; every deadline that is due has
  been acted on;
- waits: a lock waiter is granted within the bound derived in ``lock_bound`` (a
  PARK asked while it waits adds park_timeout) and
  never after someone queued behind it; a lease waiter has its LEASE_RESULT by its
  max_wait, an allocation waiter its answer by wait_ms; no allocation waiter fits
  the node and still waits; nothing is granted during the restart grace;
- allocations: ledger, allocator, store (read back, also with a fresh ``Store``)
  and the model agree exactly (nothing acknowledged lost, nothing freed back,
  nothing twice); an allocation answered twice is the same; a request whose store
  write failed is answered ``store_failed`` and left the ledger exactly as it was;
  permissions (admin ops, other uids' tasks, tenants, priority ceilings) and the
  limits a fractional allocation puts on a session are what the rules say;
- taking back (``reconcile``, ``notice_wrong``): no device (GPU share, CPU core) is held
  by two allocations, in the ledger's books or the model's; a PREEMPT goes to the
  allocation's holder, once at a time, with its recovery and the configured grace; only a
  drain tells production (100) or a protected allocation to leave, and nothing but a drain
  with preemption off; a victim of ``priority`` has a strictly lower priority than the
  waiter named ``by`` and ran the minimum runtime unless spot; ``elastic`` takes exactly the
  extras, for a waiter of its priority or higher; ``quota_reclaim`` takes from a tenant over
  its quota for another's; a victim whose notice was withdrawn rests for the cooldown; a
  notice ends in ALLOC_REVOKED or ALLOC_CHANGED(shrunk) when yielded (suspended only then,
  for on_preempt suspend) or at its grace's end (later only while the timer retries a
  store write), or is withdrawn only when its waiter gave up or was served or its GPU was
  put back; what changed for an allocation nobody holds (grown, resumed, carried out,
  withdrawn) is found in the ledger and judged by the same rules; notices with their
  deadlines, suspended allocations, waits that had victims and the preemption history
  survive a crash, and the next allocation of a preempted task says ``resume``; a draining
  GPU gets no new allocation, session or lease, and every allocation on it that someone
  holds is told once the timer has run; no victim gets more notices than the simulated
  time / preemption_cooldown + 2 (the thrash figures are printed at the end of a run);
- owners (``check_owners``, ``judge_signal``): an ALLOCATE naming an owner is refused
  (permission_denied, naming why) exactly when the rules say (never init, gpud or a kernel thread;
  the caller's uid is the target's real or saved uid unless an admin says owner_any_uid; the
  caller, an ancestor of its uid or a descendant of one of those; where /proc shows nothing, only
  the caller); the daemon holds exactly the process each task was allocated for (after a
  restart too, never a process that took its pid), and the store keeps its start time; the
  allocations someone can be told of are those held by a connection or by a live owner; every
  signal is delivered, at that moment, to the held owner (pid and start) of an allocation of the
  signal's task, of its uid (unless an admin named it with owner_any_uid), never to init, gpud or
  a kernel thread: SIGTERM for a whole notice nobody holds, SIGKILL at that notice's end; an
  allocation whose owner exited is released within ``reap_interval_s`` (its wait answered);
- every request is answered exactly once, every push names something the client
  has, and the daemon counted no fault.

Each rule is one ``check_*`` method (or one ``expect`` in the ``answer_*`` handler of
a request), so an experiment can switch one off and see another fire.

A failure prints the seed, the step, the last events, the GPUs' state and the one
command that replays it exactly::

    .venv/bin/python -m tests.sim.daemon_sim --seed N [--steps S] [--verbose]
    .venv/bin/python -m tests.sim.daemon_sim --seeds N [--stats]   # seeds 0..N-1
    .venv/bin/python -m tests.sim.daemon_sim --seeds N --strict    # the known daemon bugs fail too
    .venv/bin/python -m tests.sim.daemon_sim --seeds N --churn     # owners exit, pids are reused, gpud
                                                                   # crashes, all far more often (CHURN)

Determinism: everything random comes from the seed; the ledger's generator and the
arbiter's lease id prefix (the daemon's two random sources) are set from it; the
daemon sees 4 CPU cores whatever the machine has; the model never iterates a set of
strings, so hash randomisation changes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import heapq
import itertools
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgspec
import structlog
import trio

from gpud.capabilities import allocations as allocations_module
from gpud.capabilities.allocations import STORE_RETRY_US
from gpud.core import shields
from gpud.core.errors import Refused
from gpud.core.leases import LeaseTerms, refusal_status, resolve_terms
from gpud.core.ledger import UNIT, Insufficient, recovery_told
from gpud.host.config import Config, PolicyConfig, TenantConfig
from gpud.host.owners import TaskOwners
from gpud.host.procs import Signals
from gpud.host.store import Store, StoreError
from gpud.serving.connections import handle_payload
from gpud.serving.server import Daemon
from gpud.serving.state import ClientLink
from gpud.serving.timers import tick_allocations, tick_gpu
from gpud_client import protocol as p

try:
    from inprocess import Node  # run by pytest: tests/ is on the path
except ImportError:  # python -m tests.sim.daemon_sim, from the repository root
    from tests.inprocess import Node

from .procs import Proc, Table

DEFAULT_STEPS = 400
TRACE_LINES = 30
START_US = 1_000_000_000_000  # the fake clock's first reading
MS = 1_000
GIB = 2**30
SIM_CPUS = 4  # the CPU cores the daemon's ledger sees, whatever this machine has
ADMIN_UID = os.getuid()  # the daemon's own uid: an admin (so is 0)
USERS = [u for u in (1000, 1001, 1002, 1003) if u != ADMIN_UID][:3]  # non-admins
MAX_CLIENTS = 7
KINDS = ["good", "good", "good", "slow", "slow", "stubborn", "abandoner", "crashy", "crashy"]
# The longest a client of each kind keeps a lease before giving it back (None: never).
LEASE_HOLD_MAX_US: dict[str, int | None] = {
    "good": 20 * MS,
    "slow": 60 * MS,
    "stubborn": 60 * MS,
    "crashy": 20 * MS,
    "abandoner": None,
}
TASK_TYPES = ["ASR", "NMT", "SEMANTIC_REPAIR", "OTHER", "BATCH", "TTS"]
SHARED_TASKS = ["shared-1", "shared-2"]  # task ids several uids ask for
PUSHES_ON_SESSIONS = (p.LockOk, p.DropLock, p.Revoked, p.LimitsChanged, p.MemLimitExceeded, p.Park)
ADMIN_KINDS = ("SET_MODE", "SET_TQ", "SCHED_ON", "SCHED_OFF", "SET_POLICY", "RESET_ALLOCS")
# Daemon bugs the checks let pass until they are fixed, each counted as "known bug: ..." in the
# stats; ``--strict`` (or ``run_seed(strict=True)``) fails on them instead.
# (The two the parking checks found first, a PARK before its ATTACHED and PARKs asked for a lease
# that leaves at once, are fixed: their checks now always fail; so are the two the owner checks
# found first, no SIGKILL at the grace's end and an owner that exited while gpud was down never
# reaped.)
KNOWN_BUGS: set[str] = set()
# What an ALLOCATE names as its owner process, and how often (see ``World.draw_owner``).
OWNER_WEIGHTS = [
    ("own", 6), ("child", 4), ("grandchild", 0.5), ("shell", 1), ("sibling", 1), ("setuid child", 0.5),
    ("dropped child", 0.5), ("another uid", 2), ("another session", 1), ("init", 0.4), ("gpud", 0.4),
    ("kernel thread", 0.4), ("exited", 1), ("reused", 1), ("nobody", 0.4),
]  # fmt: skip
OWNER_KINDS = [k for k, _ in OWNER_WEIGHTS]
# ``--churn``: the steps' weights that change, so that the paths through a restart with owners that
# exited and pids that were reused (few in a default run) come up in a few hundred seeds.
CHURN = {"crash_daemon": 3, "owner_exits": 4, "pid_reuse": 4, "restart_daemon": 1, "allocate": 10}
# How late a preemption or a wait may end while the allocations' timer tries again a change the store
# refused (each try STORE_RETRY_US later; 25 failed writes in a row do not happen).
MAX_LATE_US = 25 * STORE_RETRY_US


class SimFailure(AssertionError):
    """An invariant does not hold."""


# --- the model: what each simulated process believes --------------------------------------


@dataclass(eq=False)
class Sess:
    """A session as its client sees it."""

    sid: int
    gpu: int
    priority: int
    core_limit: int
    mem_estimate: int | None
    mem_limit: int | None
    task_id: str | None
    core_ceiling: int = 100
    mem_ceiling: int | None = None
    mem_used: int | None = None
    state: str = "idle"  # idle | waiting | holding
    grant: int = 0
    seq: int = 0  # arrival order of its current request on the GPU (the daemon's FIFO)
    requested_at: int = 0
    granted_at: int = 0
    drop_at: int | None = None  # DROP_LOCK the daemon still counts for this grant (SCHED_OFF cancels it)
    drop_reason: p.DropReason | None = None
    drop_seen: bool = False  # a DROP_LOCK came for this grant (the client releases at slice end)
    bound: int | None = None  # a waiting request must be granted by then (None: no bound applies)
    counted: set[tuple[int, int]] = field(default_factory=set)  # (sid, seq) of grants the bound allows for
    limits_changed: bool = False  # in this event (it may have been throttled for a moment)
    # Parking (gpuctl run), as the client saw it; all but ``parks`` start afresh at each grant.
    parkable: bool = False
    parked: bool = False  # it answered PARKED ok while not holding: its memory is off the GPU
    park_asked: int | None = None  # when the PARK it has not answered came
    park_refused: bool = False  # it answered PARKED not ok, or left a PARK unanswered for park_timeout
    parks: int = 0  # PARKED ok answers the daemon counts


@dataclass(eq=False)
class LeaseM:
    lease_id: str
    sid: int
    gpu: int
    priority: int
    seq: int
    granted_at: int
    hold_max_us: int
    mem_estimate: int | None


@dataclass(eq=False)
class Pending:
    rid: int
    kind: str
    msg: Any
    sent_at: int
    deadline: int | None = None  # an answer that may come later must come by then
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Client:
    cid: int
    uid: int
    kind: str
    pid: int
    conn: ClientLink | None = None
    gen: int = 0  # connections opened so far (agenda entries name the one they belong to)
    greeted: bool = False
    client_id: int = 0  # the daemon's id for the connection (WELCOME)
    frames: p.FrameDecoder = field(default_factory=lambda: p.FrameDecoder(p.MAX_REPLY_BYTES))
    next_rid: int = 1
    pending: dict[int, Pending] = field(default_factory=dict)
    sessions: dict[int, Sess] = field(default_factory=dict)
    leases: dict[str, LeaseM] = field(default_factory=dict)
    intents: list[dict[str, Any]] = field(default_factory=list)  # sessions to attach again after a restart
    early_parks: dict[int, int] = field(default_factory=dict)  # PARKs for sessions not yet ATTACHED (known bug)
    alloc_intents: list[p.Allocate] = field(default_factory=list)  # ALLOCATEs to send again after a reconnect
    alive: bool = True  # False: the process is gone for good
    proc: Proc | None = None  # its process now (``pid``), in the world's process table
    shell: Proc | None = None  # the login shell it was started from (None: started by init)

    @property
    def gid(self) -> int:
        return self.uid

    @property
    def admin(self) -> bool:
        return self.uid in (0, ADMIN_UID)

    def rid(self) -> int:
        self.next_rid += 1
        return self.next_rid

    def waiting_leases(self) -> list[Pending]:
        return [q for q in self.pending.values() if q.kind == "ACQUIRE" and "sid" in q.info]


@dataclass(eq=False)
class NoticeM:
    """A PREEMPT as its holder saw it (or, for one restored after a restart, as it was stored)."""

    reason: p.PreemptReason
    gpus: tuple[int, ...]
    whole: bool
    by: str
    issued: int
    deadline: int

    def same(self, n: Any) -> bool:
        """Whether the ledger's ``Notice`` ``n`` is this one."""
        return n is not None and (n.reason, n.gpus, n.whole, n.by, n.issued, n.deadline) == (
            self.reason,
            self.gpus,
            self.whole,
            self.by,
            self.issued,
            self.deadline,
        )


@dataclass(eq=False)
class Acked:
    """An allocation acknowledged (ALLOCATED) and not freed (OK) or taken back; in ``World.acked``
    while it holds devices, in ``World.suspended`` while it waits for its own GPUs again."""

    task_id: str
    uid: int
    gpus: tuple[int, ...]
    share: int  # fixed point
    cpus: tuple[int, ...]
    tenant: str | None
    priority: int = 50
    on_preempt: p.Recovery = p.Recovery.TERMINATE
    gpus_min: int = 0  # elastic: whole GPUs it may be shrunk to (0: not elastic)
    gpus_max: int = 0
    protected: bool = False
    created: int = 0  # when it was made: its minimum runtime counts from then
    preemptions: int = 0
    resume: bool = False
    holder: ClientLink | None = None  # the connection told of its preemption (the last one ALLOCATED)
    notice: NoticeM | None = None  # the PREEMPT that runs
    told: int = 0  # PREEMPT pushes (or notices) it got: thrash
    withdrawn: int = 0  # of those, withdrawn
    rested_until: int = 0  # a notice withdrawn because its waiter gave up: not chosen again before then
    changed: int = 0  # its last elastic change (or resume): it grows again elastic_cooldown after
    owner_pid: int | None = None  # as asked (a term)
    owner: OwnerM = field(default_factory=lambda: OwnerM())

    @property
    def terms(self) -> tuple[Any, ...]:
        """What a repeat must ask for again (the ledger's ``_terms``)."""
        gpus = self.gpus_min * UNIT if self.gpus_min else self.share * len(self.gpus)
        return (gpus, len(self.cpus), self.tenant, self.priority, self.on_preempt, self.gpus_max, self.owner_pid)

    @property
    def extras(self) -> tuple[int, ...]:
        return self.gpus[self.gpus_min :] if self.gpus_min else ()

    def again(self, rid: int, *, wait_ms: int = 0, existing: bool = False) -> p.Allocate:
        """The ALLOCATE that asks for this allocation again (a runner that reconnects: ``existing``,
        only the allocation it holds; or one that starts the task again)."""
        gpus, cpus, tenant, priority, on_preempt, gpus_max, owner_pid = self.terms
        return p.Allocate(
            id=rid,
            task_id=self.task_id,
            gpus=gpus / UNIT,
            cpus=cpus,
            tenant=tenant,
            priority=priority,
            wait_ms=wait_ms,
            on_preempt=on_preempt,
            gpus_max=gpus_max or None,
            existing=existing,
            owner_pid=owner_pid,
            owner_any_uid=self.owner.any_uid,
        )


@dataclass(eq=False)
class Ghost:
    """A wait that outlived the daemon (it had victims, so it is stored): nobody's request now."""

    task_id: str
    uid: int
    terms: tuple[Any, ...]  # as ``Acked.terms`` says them
    earliest: int  # it does not expire before (its wait_ms from when it was asked)
    answer_by: int  # it ends by then (served or expired), its victims' grace included
    owner: OwnerM = field(default_factory=lambda: OwnerM())


@dataclass(eq=False)
class OwnerM:
    """A task's owner process as the model knows it: the process its ALLOCATE named (None: none), whether
    the daemon holds it now (from the claim on; after a restart only if it still runs), whether the
    daemon counts the task reachable through it (as of the last time it asked: ``Allocations._reach``),
    and the notice whose SIGTERM it got from this daemon (``Allocations.signalled``)."""

    proc: Proc | None = None
    any_uid: bool = False  # named by an admin with owner_any_uid
    held: bool = False
    reach: bool = False
    termed: int | None = None  # the issue time of the notice it got SIGTERM for
    killed: int | None = None  # when it got SIGKILL
    orphan_at: int | None = None  # a restarted daemon found it gone (or its pid another's): reaped next

    def reapable(self) -> bool:
        """Its process exited, and the daemon knows: it held it, or found it gone at a restart."""
        return self.proc is not None and not self.proc.alive and (self.held or self.orphan_at is not None)

    def alive(self) -> bool:
        """The daemon holds it and it runs."""
        return self.held and self.proc is not None and self.proc.alive


@dataclass(eq=False)
class GpuModel:
    index: int
    total: int
    capacity: int
    mode: p.Mode
    enabled: bool
    tq_us: int
    serial_clean: bool = True  # serial and on since the GPU last had at most one holder
    last_grant: int = 0
    window_seen: int | None = None


@dataclass(eq=False)
class GpuNow:
    """One GPU as the checks see it after an event."""

    g: int
    gm: GpuModel
    sched: Any
    view: Any
    sessions: list[tuple[Client, Sess]]
    leases: list[tuple[Client, LeaseM]]
    lease_sids: set[int]
    waiting_leases: list[int]  # sids of leases waiting for this GPU
    runnable: list[Any]  # the queue's waiters that are not throttled


# --- configuration ------------------------------------------------------------------------------


def draw_config(rng: random.Random, state_dir: str) -> Config:
    policies = {
        "ASR": PolicyConfig(priority=90, busy_policy=p.BusyPolicy.WAIT, max_wait_ms=rng.choice([10, 50, 300])),
        "SEMANTIC_REPAIR": PolicyConfig(priority=20, busy_policy=p.BusyPolicy.SKIP, max_wait_ms=rng.choice([0, 40])),
        # reserved: its priority is this uid's alone; anyone else but an admin is refused it
        "TTS": PolicyConfig(
            priority=70, busy_policy=p.BusyPolicy.WAIT, max_wait_ms=rng.choice([10, 100]), uids=USERS[-1:]
        ),
        "BATCH": PolicyConfig(
            priority=30,
            busy_policy=p.BusyPolicy.FALLBACK_CPU,
            max_wait_ms=rng.choice([5, 100]),
            queue_limit=rng.choice([None, 1]),
            hold_max_ms=rng.choice([None, 15]),
        ),
    }
    return Config(
        state_dir=state_dir, metrics_addr="off", admin_group="",
        reap_interval_s=rng.choice([0, 0.02, 0.05, 0.1, 0.3]),  # 0: dead owners' allocations are never reclaimed
        simulate=rng.choice(["1x16GiB", "2x16GiB", "2x16GiB", "3x8GiB"]),
        mode=rng.choice(list(p.Mode)),
        tq_s=rng.choice([0.01, 0.03, 0.1]),
        drop_timeout_s=rng.choice([0.005, 0.02, 0.05]),
        park_timeout_s=rng.choice([0.01, 0.03, 0.1]),  # short: stubborn and slow clients time out in a run
        memory_reserve_percent=rng.choice([0, 10]),
        compute_window_s=rng.choice([0.1, 0.25, 1.0]),
        quota_sample_interval_s=rng.choice([0.005, 0.02]),
        quota_carryover_percent=rng.choice([0, 50, 100]),
        drop_tail_billing_percent=rng.choice([0, 50, 100]),
        share_windows=rng.choice([3, 10]),
        lease_queue_limit=rng.choice([1, 3, 8]),
        lease_hold_max_ms=rng.choice([10, 40, 8000]),
        lease_force_release=rng.random() < 0.4,
        policies=policies,
        restart_grace_s=rng.choice([0.0, 0.01, 0.05]),
        tenants={
            "team": TenantConfig(gpus=1.0, borrow=0.5, uids=[USERS[0]]),
            "lab": TenantConfig(gpus=0.5, borrow=0.0),
        },
        max_connections=rng.choice([5, 64]),
        max_connections_per_uid=rng.choice([2, 8]),
        max_sessions_per_connection=rng.choice([3, 6]),
        max_lock_queue=rng.choice([3, 16]),
        max_allocation_waiters=rng.choice([1, 4]),
        priority_max_uids={str(USERS[1]): 80},
        # Taking allocations back, on the simulation's time scale (a seed runs for seconds).
        preemption=rng.random() < 0.85,
        preemption_strategy=rng.choice(list(p.PreemptStrategy)),
        preemption_grace_s=rng.choice([0.005, 0.02, 0.1]),
        preemption_min_runtime_s=rng.choice([0.0, 0.01, 0.1, 1.0]),
        preemption_cooldown_s=rng.choice([0.01, 0.05, 0.3]),
        elastic_cooldown_s=rng.choice([0.0, 0.02, 0.2]),
        elastic_window_s=rng.choice([0.0, 0.005, 0.05]),
    )  # fmt: skip


def asked_priority(m: p.Allocate) -> int:
    """The priority an ALLOCATE asks for: its own, else its class's, else 50."""
    if m.priority is not None:
        return m.priority
    return p.PRIORITY_OF_CLASS[m.priority_class] if m.priority_class else 50


def asked_terms(m: p.Allocate) -> tuple[Any, ...]:
    """An ALLOCATE's terms, as ``Acked.terms`` says them."""
    gpus = round(m.gpus * UNIT)
    return (gpus, m.cpus, m.tenant, asked_priority(m), m.on_preempt, m.gpus_max or 0, m.owner_pid)


@contextlib.contextmanager
def fixed_cpus(n: int) -> Iterator[None]:
    """The daemon reads the CPU cores it may hand out at construction: give it ``n``
    whatever this machine has, so a seed replays the same everywhere."""
    real = os.sched_getaffinity
    os.sched_getaffinity = lambda pid: set(range(n))
    try:
        yield
    finally:
        os.sched_getaffinity = real


@contextlib.contextmanager
def kernel(table: Table) -> Iterator[None]:
    """The daemon builds its ``TaskOwners`` at construction, and re-holds the owners of the records
    it restores right there: give it ``table`` as its kernel (``TaskOwners.host``), and the pid of
    the table's gpud process as its own."""

    def owners(signals: Signals) -> TaskOwners:
        o = TaskOwners(signals, table)  # type: ignore[arg-type]  # the Procs surface, duck-typed
        o.daemon_pid = table.daemon.pid
        return o

    real = allocations_module.TaskOwners
    allocations_module.TaskOwners = owners  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        allocations_module.TaskOwners = real  # type: ignore[misc]


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Drop the daemon's log lines (faults are caught where they are recorded)."""
    saved = structlog.get_config()

    def drop(_logger: Any, _name: str, _event: Any) -> Any:
        raise structlog.DropEvent

    structlog.configure(processors=[drop], cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.configure(**saved)


_FIELDS: dict[type, tuple[Any, ...]] = {}


def short(msg: Any, limit: int = 240) -> str:
    """A message as a line: its type and the fields that differ from their defaults."""
    if isinstance(msg, msgspec.Struct):
        parts = []
        fields = _FIELDS.get(type(msg))
        if fields is None:  # msgspec reads the annotations each time: once per type is enough
            fields = _FIELDS[type(msg)] = msgspec.structs.fields(msg)
        for f in fields:
            value = getattr(msg, f.name)
            if f.name == "acquired_at" or (f.required is False and value == f.default):
                continue
            parts.append(f"{f.name}={value.value if isinstance(value, enum.Enum) else value!r}")
        text = f"{type(msg).__name__}({', '.join(parts)})"
    else:
        text = repr(msg)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def trace_line(entry: tuple[int, int, str, tuple[Any, ...]]) -> str:
    step, now, text, args = entry
    shown = (short(a) if isinstance(a, msgspec.Struct) else a for a in args)
    return f"#{step} t={(now - START_US) / 1000:.3f}ms {text.format(*shown)}"


def scratch_root() -> str | None:
    """Where a test's state directories go: a memory file system when there is one (the
    simulation and the request fuzz open SQLite stores hundreds of times; on disk that is
    most of their wall time), else the usual temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def overlap(intervals: list[list[Any]], lo: int, hi: int, now: int) -> int:
    """Microseconds of [lo, hi) covered by the hold intervals (an open one ends now)."""
    total = 0
    for start, end in intervals:
        a, b = max(start, lo), min(now if end is None else end, hi)
        if b > a:
            total += b - a
    return total


# --- the world ------------------------------------------------------------------------------------


class World:
    def __init__(
        self, seed: int, steps: int = DEFAULT_STEPS, *, verbose: bool = False, strict: bool = False, churn: bool = False
    ) -> None:
        self.seed, self.steps, self.verbose, self.strict, self.churn = seed, steps, verbose, strict, churn
        self.rng = random.Random(seed)
        self.now = START_US
        self.step_no = 0
        self.events = 0
        # The last events as (step, time, format, arguments): formatted only when a report shows them.
        self.trace: deque[tuple[int, int, str, tuple[Any, ...]]] = deque(maxlen=TRACE_LINES)
        self.state_dir = tempfile.mkdtemp(prefix=f"gpud-sim-{seed}-", dir=scratch_root())
        self.config = draw_config(self.rng, self.state_dir)
        # The processes of this host; the daemon's kernel. Its /proc hides everything in some seeds.
        self.table = Table(self.clock, hidden=self.rng.random() < 0.08, daemon_uid=ADMIN_UID)
        self.table.on_signal = self.judge_signal
        self.reap_us = round(self.config.reap_interval_s * 1e6)
        self.next_reap = START_US  # the allocations' timer reaps when it starts, then every reap_interval_s
        self.reaps_now = False  # the reaper ran in this event
        self.signalling: tuple[str, str] | None = None  # (task id, why) of the signal gpud sends now
        self.broken = ""  # a failure found inside a call into the daemon
        self.writes = 0  # the daemon's store writes (tried) so far
        self.dt_us = round(self.config.drop_timeout_s * 1e6)
        self.pt_us = round(self.config.park_timeout_s * 1e6)
        self._stored: tuple[Any, int, dict[str, Any], dict[str, int]] | None = None  # see stored_allocations
        self._placed: Any = None  # see check_allocations
        self.store_fail_p = self.rng.choice([0.0, 0.0, 0.05, 0.25])
        self.codec = p.daemon_codec()
        self.reader = p.client_codec()
        self.clients: list[Client] = []
        self.agenda: list[tuple[int, int, str, tuple[Any, ...]]] = []
        self._agenda_seq = itertools.count()
        self._seq = itertools.count(1)  # arrival order of lock requests and acquires
        self.acked: dict[str, Acked] = {}
        # Taking allocations back: what the clients were told, and what the model knows besides.
        self.grace_us = round(self.config.preemption_grace_s * 1e6)
        self.min_runtime_us = round(self.config.preemption_min_runtime_s * 1e6)
        self.cooldown_us = round(self.config.preemption_cooldown_s * 1e6)
        self.suspended: dict[str, Acked] = {}  # suspended allocations: waiting for their own GPUs again
        self.ghosts: dict[str, Ghost] = {}  # waits restored from the store after a crash, nobody's request
        self.history: dict[str, tuple[int, bool]] = {}  # task id -> (preemptions, resume) with no allocation now
        self.draining: set[int] = set()  # GPUs an admin drains
        self.yields_now: set[str] = set()  # tasks whose YIELD (or FREE under a notice) was sent in this event
        self.withdrawals_now: list[tuple[Acked, NoticeM]] = []  # PREEMPT_WITHDRAWN pushes of this event
        self.wait_priority: dict[str, tuple[int, str | None]] = {}  # task id -> (priority, tenant) of its last wait
        # (notices, withdrawn, lifetime us, the bound on its notices) of each victim, when it ended
        self.victims: list[tuple[int, int, int, int]] = []
        self.started = START_US
        self.waits_ended_now: set[str] = set()  # allocation waits answered or dropped in this event
        self.again_terms: dict[str, p.Allocate] = {}  # tasks a runner asks for again after they were taken back
        self.booting = False  # a new daemon whose timers have not run yet (what fell due while it was down)
        self.drain_now: set[int] = set()  # GPUs an admin asked to drain in this event
        self.undrain_now: set[int] = set()  # GPUs an admin asked to put back in this event
        # Withdrawals the store may not hold yet (a wait given up while the store failed: withdrawn
        # anyway, stored when the timer tries again); a crash before that brings them back.
        self.unstored_notices: dict[str, NoticeM] = {}
        self.unstored_waits: dict[str, Ghost] = {}
        self.faults: list[str] = []
        self.injected = 0  # store writes failed on purpose so far
        self.daemon_runs = 0
        self.closed_conns: deque[ClientLink] = deque(maxlen=32)
        self.grants_now: list[tuple[int, int, int, int, int]] = []  # (gpu, sid, seq, priority, grant) this event
        self._last_grants: list[tuple[int, int, int, int, int]] = []
        self.deferred: list[Any] = []  # checks judged at the end of the event
        self.parks_now: set[int] = set()  # GPUs where a PARK was answered or timed out in this event
        self.lease_timeouts_now: set[int] = set()  # GPUs where a lease was refused TIMEOUT in this event
        self.lost_now = False  # a connection ended in this event
        self.asked_now: dict[int, set[int]] = {}  # GPU -> the sessions asked to PARK in this event
        self.stats: Counter[str] = Counter()  # what happened, to see what the checks saw
        self.spins, self.last_due = 0, 0  # timer rounds at one instant (a deadline that stays due)
        self._waiting: list[tuple[Client, Pending]] = []  # leases waiting, as of the last check
        self.goodbye_expected = False
        self.holds: dict[int, list[list[Any]]] = {}  # sid -> hold intervals, for this daemon run
        self.gpus: list[GpuModel] = []
        self.daemon: Daemon = self.build_daemon(grace_us=0)
        self.event("config: {}", self.describe_config())

    # --- plumbing ---------------------------------------------------------------------------

    def clock(self) -> int:
        return self.now

    def event(self, text: str, *args: Any) -> None:
        """One line of the trace: ``text.format(*args)``, a message argument shown by ``short``."""
        self.events += 1
        entry = (self.step_no, self.now, text, args)
        self.trace.append(entry)
        if self.verbose:
            print(trace_line(entry))

    def fail(self, message: str) -> NoReturn:
        raise SimFailure(message)

    def describe_gpus(self) -> list[str]:
        lines = []
        with contextlib.suppress(Exception):
            for slot in self.daemon.slots:
                v = slot.scheduler.view(self.now)
                grace = max(0, self.grace_end - self.now)
                lines.append(
                    f"GPU {slot.gpu.index}: {v.mode.value}, scheduler {'on' if v.enabled else 'off'}, TQ {v.tq_us} us"
                    + (f", restart grace {grace} us left" if grace else "")
                    + f"; holders {[(h.session, h.grant, h.drop_pending and h.drop_pending.value) for h in v.holders]}"
                    + f"; queue {[(w.session, w.priority, 'throttled' if w.throttled else '') for w in v.queue]}"
                )
        return lines

    def describe_config(self) -> str:
        c = self.config
        return (
            f"{c.simulate} mode={c.mode} tq={c.tq_s}s drop_timeout={c.drop_timeout_s}s "
            f"park_timeout={c.park_timeout_s}s window={c.compute_window_s}s "
            f"carryover={c.quota_carryover_percent} tail={c.drop_tail_billing_percent} "
            f"force_release={c.lease_force_release} hold_max={c.lease_hold_max_ms}ms grace={c.restart_grace_s}s "
            f"caps(conn={c.max_connections}/{c.max_connections_per_uid} sess={c.max_sessions_per_connection} "
            f"queue={c.max_lock_queue} waiters={c.max_allocation_waiters}) store_fail_p={self.store_fail_p} "
            f"preemption={c.preemption} {c.preemption_strategy} grace={c.preemption_grace_s}s "
            f"min_runtime={c.preemption_min_runtime_s}s cooldown={c.preemption_cooldown_s}s "
            f"elastic(cooldown={c.elastic_cooldown_s}s window={c.elastic_window_s}s)"
        )

    def build_daemon(self, grace_us: int) -> Daemon:
        with fixed_cpus(SIM_CPUS), kernel(self.table):  # the in-process daemon of tests/inprocess.py, on this world
            d = Node(
                self.config.simulate or "1", config=self.config, clock=self.clock, restart_grace_us=grace_us
            ).daemon
        assert d.allocations.owners.host is self.table
        self.daemon_runs += 1
        self.next_reap = self.now
        # The two random sources of a daemon, made replayable: the "random" placement strategy and
        # the prefix of lease ids (which only has to differ between daemon runs).
        d.allocations.ledger._rng.seed(self.seed * 1000 + self.daemon_runs)
        d.leases._prefix = f"sim{self.seed}r{self.daemon_runs}"
        real_write = d.allocations.store.write

        def write(*args: Any, **kwargs: Any) -> None:
            self.writes += 1
            if self.store_fail_p and self.rng.random() < self.store_fail_p:
                self.injected += 1
                self.stats["store writes failed (injected)"] += 1
                self.event("the store's write fails (injected)")
                raise StoreError("injected by the simulation")
            real_write(*args, **kwargs)

        d.allocations.store.write = write  # type: ignore[method-assign]
        real_record = d.faults.record

        def record(where: str, exc: BaseException, **context: object) -> None:
            self.faults.append(f"fault in {where} ({context}):\n" + "".join(traceback.format_exception(exc)))
            real_record(where, exc, **context)

        d.faults.record = record  # type: ignore[method-assign]
        signals = d.allocations.owners.signals
        real_send = signals.send

        def send(held: Any, sig: signal.Signals, *, task_id: str, why: str) -> bool:
            self.signalling = (task_id, why)  # what judge_signal is told, should the table deliver it
            try:
                return real_send(held, sig, task_id=task_id, why=why)
            finally:
                self.signalling = None

        signals.send = send  # type: ignore[method-assign]
        real_reap = d.allocations.reap

        def reap(now: int) -> None:
            self.reaps_now = True
            real_reap(now)

        d.allocations.reap = reap  # type: ignore[method-assign]
        real_wake = d.allocations.wake

        def wake() -> None:  # the allocations' timer task wakes and ticks at once (after this event)
            self.woken = True
            real_wake()

        d.allocations.wake = wake
        self.woken = False
        self.grace_end = d.started_at + grace_us
        self.holds = {}
        self.gpus = [
            GpuModel(
                s.gpu.index,
                s.gpu.memory_total_bytes,
                s.gpu.memory_total_bytes * (100 - self.config.memory_reserve_percent) // 100,
                self.config.mode,
                True,
                round(self.config.tq_s * 1e6),
            )
            for s in d.slots
        ]
        return d

    def later(self, at: int, what: str, *args: Any) -> None:
        heapq.heappush(self.agenda, (at, next(self._agenda_seq), what, args))

    def connected(self) -> list[Client]:
        return [c for c in self.clients if c.conn is not None and c.greeted]

    # --- sending and receiving ---------------------------------------------------------------

    def send(self, c: Client, msg: Any, kind: str, **info: Any) -> Pending:
        """One request through ``handle_payload``, as the listener's read loop would; then
        every connection's outbox is read by its client, and the event is checked."""
        assert c.conn is not None
        pend = Pending(msg.id, kind, msg, self.now, info=info)
        c.pending[msg.id] = pend
        self.event("client {} ({}, uid {}) -> {}", c.cid, c.kind, c.uid, msg)
        keep = handle_payload(self.daemon, c.conn, msgspec.msgpack.encode(msg), self.codec)
        if not keep:  # the listener closes it; its writer flushes what was queued
            self.lose_connection(c, "the daemon closed it", crashed=False)
        else:
            self.deliver()
        return pend

    def finish(self, c: Client, pend: Pending, answered_now: bool = True) -> None:
        """After a request that is answered at once (or only on refusal): it must be."""
        if c.pending.get(pend.rid) is pend:
            if answered_now:
                self.fail(f"client {c.cid}: {pend.kind} (id {pend.rid}) got no answer")
            del c.pending[pend.rid]  # silent success (LOCK_REQUEST, LOCK_RELEASED, MEM_UPDATE, quiet RELEASE)

    def deliver(self) -> None:
        """Each client reads what the daemon wrote to it (the writer tasks, the clients' readers)."""
        for c in self.clients:
            conn = c.conn
            if conn is None:
                continue
            if conn.pending:
                data = b"".join(conn.pending)
                conn.pending.clear()
                conn.pending_bytes -= len(data)
                for payload in c.frames.feed(data):
                    self.on_message(c, self.reader.decode(payload))
            if c.conn is conn and conn.closing and conn.client_id in self.daemon.links.connections:
                self.lose_connection(c, "dropped by the daemon", crashed=False)

    def lose_connection(self, c: Client, why: str, *, crashed: bool, keep_intents: bool = False) -> None:
        """The connection ends: the daemon frees what it held (``Daemon.close``), the writer
        flushes what was queued, and the client forgets its sessions, leases and requests."""
        conn = c.conn
        assert conn is not None
        self.deliver()  # what was written to it before: the writer flushes it
        self.daemon.close(conn)
        if conn.pending:
            self.fail(f"the daemon wrote to connection {conn.client_id} while closing it: {list(conn.pending)[:2]}")
        self.deliver()  # what its sessions' release gave others
        self.event("client {}: connection ends ({})", c.cid, why)
        self.lost_now = True
        self.forget_connection(c, keep_intents=keep_intents)
        self.closed_conns.append(conn)
        if crashed:
            c.alive = False
            self.exits(c.proc, "its client crashed")
            if self.rng.random() < 0.3:  # the whole process group
                for child in self.table.children(c.proc):
                    self.exits(child, "its parent's group was killed")

    def forget_connection(self, c: Client, *, keep_intents: bool) -> None:
        c.intents = (
            [
                {
                    "gpu": s.gpu,
                    "priority": s.priority,
                    "core_limit": s.core_limit,
                    "mem_estimate": s.mem_estimate,
                    "task_id": s.task_id,
                    "parkable": s.parkable,
                    "busy": s.state != "idle",
                }
                for s in c.sessions.values()
            ]
            if keep_intents
            else []
        )
        for s in c.sessions.values():
            self.end_hold(s.sid)
        for lease in c.leases.values():
            self.end_hold(lease.sid)
        # Its allocations outlive it; it is no longer told of them. A runner that comes back asks for
        # them again (the same terms), and for what it waited for (a wait dies with its connection).
        held = [a for a in (*self.acked.values(), *self.suspended.values()) if a.holder is c.conn]
        for a in held:
            a.holder = None
            a.owner.reach = a.owner.alive()  # (Allocations.connection_closed: _reach)
        for q in self.waits_of(c):
            self.wait_ended(c, q)
        waits = [q.msg for q in self.waits_of(c)]
        c.alloc_intents = [a.again(0, existing=self.rng.random() < 0.5) for a in held] + (waits if keep_intents else [])
        c.conn, c.greeted = None, False
        c.sessions.clear()
        c.leases.clear()
        c.pending.clear()
        c.early_parks.clear()

    def end_hold(self, sid: int) -> None:
        intervals = self.holds.get(sid)
        if intervals and intervals[-1][1] is None:
            intervals[-1][1] = self.now

    # --- messages from the daemon ---------------------------------------------------------------

    def on_message(self, c: Client, msg: Any) -> None:
        rid = getattr(msg, "id", None)
        if rid is not None:
            pend = c.pending.pop(rid, None)
            if pend is None:
                self.fail(f"client {c.cid} got {short(msg)}, which answers no request it has outstanding")
            self.on_answer(c, pend, msg)
            return
        if isinstance(msg, p.Error):
            self.fail(f"client {c.cid} got an ERROR for no request: {short(msg)}")
        if isinstance(msg, p.Park) and msg.session not in c.sessions and self.all_pending("ATTACH", c):
            self.known_bug("park before attached", f"client {c.cid}: {short(msg)} before its ATTACHED")
            c.early_parks[msg.session] = self.now  # dropped, as the client library does; timed out later
            return
        if isinstance(msg, PUSHES_ON_SESSIONS) and msg.session not in c.sessions:
            self.fail(
                f"client {c.cid} got {short(msg)} for a session it does not have (its sessions: {sorted(c.sessions)})"
            )
        match msg:
            case p.LockOk():
                self.on_lock_ok(c, c.sessions[msg.session], msg)
            case p.DropLock():
                self.on_drop(c, c.sessions[msg.session], msg)
            case p.Park():
                self.on_park(c, c.sessions[msg.session], answer=True)
            case p.Revoked():
                self.on_revoked(c, c.sessions[msg.session], msg)
            case p.LimitsChanged():
                s = c.sessions[msg.session]
                s.core_limit, s.mem_limit, s.limits_changed = msg.core_limit, msg.mem_limit, True
                if s.core_limit < 100:
                    s.bound = None  # a limited session waits for its budget too: no bound
            case p.MemLimitExceeded():
                s = c.sessions[msg.session]
                if not (s.mem_used is not None and msg.used_bytes == s.mem_used > msg.limit_bytes):
                    self.fail(f"client {c.cid}: {short(msg)} but it reported {s.mem_used} (limit {s.mem_limit})")
            case p.SchedState():
                if not 0 <= msg.gpu < len(self.gpus):
                    self.fail(f"SCHED_STATE for unknown GPU {msg.gpu}")
            case p.LeaseRevoked():
                lease = c.leases.pop(msg.lease_id, None)
                if lease is None:
                    self.fail(f"client {c.cid} got {short(msg)} for a lease it does not hold")
                if not self.config.lease_force_release or self.now < lease.granted_at + lease.hold_max_us:
                    self.fail(
                        f"lease {lease.lease_id} revoked at {self.now - lease.granted_at} us held, "
                        f"hold_max {lease.hold_max_us} us, force_release={self.config.lease_force_release}"
                    )
                self.end_hold(lease.sid)
                self.stats["leases revoked (hold_max)"] += 1
            case p.Preempt():
                self.on_preempt(c, msg)
            case p.PreemptWithdrawn():
                self.on_withdrawn(c, msg)
            case p.AllocRevoked():
                self.on_alloc_revoked(c, msg)
            case p.AllocChanged():
                self.on_alloc_changed(c, msg)
            case p.Goodbye():
                if not self.goodbye_expected:
                    self.fail(f"client {c.cid} got GOODBYE but the daemon is not shutting down")
            case _:
                self.fail(f"client {c.cid} got an unexpected push {short(msg)}")

    def on_lock_ok(self, c: Client, s: Sess, msg: p.LockOk) -> None:
        gm = self.gpus[s.gpu]
        if s.state != "waiting":
            self.fail(f"client {c.cid}: LOCK_OK for session {s.sid}, which is {s.state}, not waiting")
        if self.now < self.grace_end:
            self.fail(f"session {s.sid} granted {self.grace_end - self.now} us before the restart grace ends")
        if s.requested_at < self.grace_end <= self.now:
            self.stats["lock requests held through a restart grace"] += 1
        self.stats["lock grants"] += 1
        if s.bound is not None:
            self.stats["lock grants within a bound"] += 1
            if s.requested_at < self.now:
                self.stats["lock waits bounded"] += 1
        s.state, s.grant, s.granted_at = "holding", msg.grant, self.now
        s.drop_at = s.drop_reason = None
        s.drop_seen = False
        s.parked, s.park_asked, s.park_refused = False, None, False  # its memory is on the GPU again
        self.holds.setdefault(s.sid, []).append([self.now, None])
        self.grants_now.append((s.gpu, s.sid, s.seq, s.priority, msg.grant))
        tq = gm.tq_us
        if c.kind == "stubborn":
            hold = self.rng.randrange(5 * tq, 20 * tq)
        elif self.rng.random() < 0.35:
            hold = None  # keeps the lock between slices until asked (the client library's way)
        else:
            hold = self.rng.randrange(MS, 3 * tq)
        if hold is not None:
            self.later(self.now + hold, "release", c.cid, c.gen, s.sid, msg.grant)

    def on_drop(self, c: Client, s: Sess, msg: p.DropLock) -> None:
        gm = self.gpus[s.gpu]
        if s.state != "holding" or s.grant != msg.grant:
            self.fail(f"client {c.cid}: {short(msg)} but session {s.sid} is {s.state} with grant {s.grant}")
        if s.drop_at is not None:
            self.fail(f"session {s.sid}: a second DROP_LOCK for grant {s.grant} before the first was answered")
        # Judged at the end of the event: an admin's OK (SET_TQ) or a LIMITS_CHANGED push that
        # explains the drop may be read after it (each client reads its own connection).
        self.deferred.append(lambda: self.judge_drop(s, msg, gm))
        s.drop_at, s.drop_reason, s.drop_seen = self.now, msg.reason, True
        self.stats[f"drops ({msg.reason})"] += 1
        dt = self.dt_us
        if c.kind == "stubborn":
            return  # ignores it: revoked after drop_timeout
        if c.kind == "slow":
            delay = self.rng.randrange(dt // 2, 2 * dt)
        else:
            delay = self.rng.randrange(0, max(1, min(2 * MS, dt // 2)))
        self.later(self.now + delay, "release", c.cid, c.gen, s.sid, msg.grant)

    def judge_drop(self, s: Sess, msg: p.DropLock, gm: GpuModel) -> None:
        if msg.reason == p.DropReason.TQ and self.now < s.granted_at + gm.tq_us:
            self.fail(f"session {s.sid}: TQ drop after {self.now - s.granted_at} us, TQ is {gm.tq_us} us")
        if msg.reason == p.DropReason.QUOTA and s.core_limit >= 100:
            self.fail(f"session {s.sid}: quota drop of a session with no limit ({s.core_limit} %)")
        if msg.reason == p.DropReason.MEMORY and gm.mode != p.Mode.AUTO:
            self.fail(f"session {s.sid}: memory drop in {gm.mode} mode")

    def on_park(self, c: Client, s: Sess, *, answer: bool) -> None:
        """A PARK: only to a parkable session that does not hold, once until it is answered,
        and never again after an answer or a park_timeout until the session has held."""
        self.park_timeouts(s)
        why = None
        if not s.parkable:
            why = "it was not attached as parkable"
        elif s.state == "holding":
            why = f"it holds the lock (grant {s.grant})"
        elif s.park_asked is not None:
            why = f"the PARK of {self.now - s.park_asked} us ago is unanswered and it has not held since"
        elif s.parked:
            why = "it answered PARKED ok and has not held since"
        elif s.park_refused:
            why = "it refused a PARK (or left one unanswered for park_timeout) and has not held since"
        if why is not None:
            self.fail(f"client {c.cid}: PARK for session {s.sid}, but {why}")
        s.park_asked = self.now
        self.stats["parks asked"] += 1
        key = (s.priority, s.grant, s.sid)  # its place in the order parks are asked in (a grant may follow)
        self.deferred.append(lambda: self.judge_park(s, key))
        if s.gpu not in self.asked_now:
            self.asked_now[s.gpu] = set()
            self.deferred.append(lambda: self.judge_asks(s.gpu))
        self.asked_now[s.gpu].add(s.sid)
        for other in self.sessions_on(s.gpu):  # the waiters' grants may wait for this park: park_timeout more
            if other.state == "waiting" and other.bound is not None:
                other.bound += self.pt_us
        if c.kind == "stubborn" or not answer:
            return  # never answers: park_timeout ends it
        if c.kind == "slow":
            delay = self.rng.randrange(self.pt_us // 2, 2 * self.pt_us)
        else:
            delay = self.rng.randrange(0, max(1, min(2 * MS, self.pt_us // 2)))
        self.later(self.now + delay, "parked", c.cid, c.gen, s.sid, self.rng.random() < 0.8)

    def judge_park(self, s: Sess, key: tuple[int, int, int]) -> None:
        """At the end of the event: the scheduler was on (an admin's OK may be read after the
        push); the sessions asked are the lowest priority, then the oldest grant, first (every
        one before it was asked, or refused, or may be the waiter the parks are for); and
        something waits for the GPU or was granted it (a PARK is asked for a waiter)."""
        gm = self.gpus[s.gpu]
        if not gm.enabled:
            self.fail(f"session {s.sid}: PARK on GPU {s.gpu}, whose scheduler is off")
        for r in self.resident(s.gpu):
            if (r.priority, r.grant, r.sid) < key and r.park_asked is None and not r.park_refused:
                if r.state != "waiting":
                    self.fail(
                        f"session {s.sid} (priority {s.priority}, last grant {key[1]}) asked to PARK before "
                        f"session {r.sid} (priority {r.priority}, last grant {r.grant}), which comes first"
                    )
        waiting = self.daemon.slots[s.gpu].scheduler.queue()
        if waiting or any(x[0] == s.gpu for x in self.grants_now) or self.lost_now:
            return  # (a closed connection's waiter may have been asked for before it was detached)
        why = f"session {s.sid}: PARK on GPU {s.gpu}, but nothing waits for it and nothing was granted"
        if s.gpu in self.lease_timeouts_now:
            self.known_bug("parks asked for a lease that leaves at once", why)
        else:
            self.fail(why)

    def judge_asks(self, gpu: int) -> None:
        """At the end of an event that asked parks on the GPU and granted nothing there: no more
        were asked than the first runnable waiter needs (each one asked, walking the resident
        sessions in order, was still short of room)."""
        if self.lost_now or gpu in self.lease_timeouts_now or any(x[0] == gpu for x in self.grants_now):
            return  # the waiter they were asked for may be gone or granted: judged at the grant
        gm, asked = self.gpus[gpu], self.asked_now[gpu]
        view = self.daemon.slots[gpu].scheduler.view(self.now)
        head = next((w.session for w in view.queue if not w.throttled), None)
        if head is None:
            return  # (judge_park reports a PARK with nothing waiting)
        need = {s.sid: self.need(gm, s.mem_estimate, s.mem_used) for s in self.sessions_on(gpu)}
        for c in self.clients:
            need.update({x.sid: self.need(gm, x.mem_estimate, None) for x in c.leases.values() if x.gpu == gpu})
            for q in c.waiting_leases():
                if q.info["gpu"] == gpu:
                    need[q.info["sid"]] = self.need(gm, q.info["terms"].mem_estimate, None)
        resident = sorted((r for r in self.resident(gpu) if r.sid != head), key=lambda r: (r.priority, r.grant, r.sid))
        over = need[head] + sum(need[h.session] for h in view.holders) + sum(need[r.sid] for r in resident)
        over -= gm.capacity
        for r in resident:
            if over <= 0 and r.sid in asked:
                self.fail(
                    f"GPU {gpu}: session {r.sid} asked to PARK, but those before it already make room for "
                    f"{head} (asked now: {sorted(asked)})"
                )
            if not r.park_refused:
                over -= need[r.sid]

    def known_bug(self, name: str, what: str) -> None:
        """A daemon bug the checks let pass (``KNOWN_BUGS``) unless strict."""
        if self.strict or name not in KNOWN_BUGS:
            self.fail(f"{what} (known bug: {name})")
        self.stats[f"known bug: {name}"] += 1

    def park_timeouts(self, s: Sess) -> None:
        """A PARK unanswered for park_timeout counts as refused (the daemon says nothing)."""
        if s.park_asked is not None and self.now >= s.park_asked + self.pt_us:
            s.park_asked, s.park_refused = None, True
            self.parks_now.add(s.gpu)
            self.stats["parks timed out"] += 1

    def on_revoked(self, c: Client, s: Sess, msg: p.Revoked) -> None:
        if s.state != "holding" or s.grant != msg.grant:
            self.fail(f"client {c.cid}: {short(msg)} but session {s.sid} is {s.state} with grant {s.grant}")
        if msg.reason == p.RevokeReason.DROP_TIMEOUT:
            if s.drop_at is None or self.now < s.drop_at + self.dt_us:
                self.fail(
                    f"session {s.sid} revoked (drop_timeout) with DROP_LOCK sent at {s.drop_at}, "
                    f"now {self.now}, drop_timeout {self.dt_us} us"
                )
        else:
            self.fail(f"session {s.sid} revoked for {msg.reason}: only leases are revoked for that")
        s.state, s.drop_at, s.drop_reason = "idle", None, None
        self.stats["revocations (drop_timeout)"] += 1
        self.end_hold(s.sid)
        if self.rng.random() < 0.6:
            self.later(self.now + self.rng.randrange(0, 30 * MS), "request", c.cid, c.gen, s.sid)

    def on_answer(self, c: Client, pend: Pending, msg: Any) -> None:
        code = msg.code if isinstance(msg, p.Error) else None
        kind = pend.kind
        if kind == "ALLOCATE" and pend.deadline is not None:
            self.waits_ended_now.add(pend.msg.task_id)
        if isinstance(msg, p.Error):
            self.stats[f"errors ({msg.code})"] += 1
        if isinstance(msg, p.Error) and not msg.message.strip():
            self.fail(f"an ERROR without a message: {short(msg)}")
        if code == p.ErrorCode.SHUTTING_DOWN:
            if not self.daemon.shutting_down:
                self.fail(f"shutting_down answered while the daemon is not shutting down: {short(msg)}")
            return
        if code == p.ErrorCode.HELLO_REQUIRED:
            if c.greeted or kind == "HELLO":
                self.fail(f"client {c.cid}: {short(msg)} but it sent HELLO")
            return
        if code == p.ErrorCode.INTERNAL:
            self.fail(f"client {c.cid}: {kind} answered internal: {msg.message}")
        handler = getattr(self, "answer_" + kind.lower(), None)
        if handler is None:
            self.answer_simple(c, pend, msg)
        else:
            handler(c, pend, msg)

    def expect(self, ok: bool, c: Client, pend: Pending, msg: Any, why: str) -> None:
        if not ok:
            self.fail(
                f"client {c.cid} (uid {c.uid}{', admin' if c.admin else ''}): {short(pend.msg)} "
                f"answered {short(msg)}: {why}"
            )

    def answer_hello(self, c: Client, pend: Pending, msg: Any) -> None:
        if isinstance(msg, p.Welcome):
            self.expect(
                pend.msg.version == p.PROTOCOL_VERSION and not c.greeted,
                c,
                pend,
                msg,
                "welcomed twice or wrong version",
            )
            c.greeted, c.client_id = True, msg.client_id
            self.expect([g.index for g in msg.gpus] == list(range(len(self.gpus))), c, pend, msg, "GPUs")
        else:
            expected = p.ErrorCode.INVALID if c.greeted else p.ErrorCode.VERSION
            self.expect(isinstance(msg, p.Error) and msg.code == expected, c, pend, msg, f"expected {expected}")

    def answer_simple(self, c: Client, pend: Pending, msg: Any) -> None:
        """Admin operations, queries, OOM reports."""
        kind = pend.kind
        if kind in ADMIN_KINDS:
            if c.admin:
                self.expect(isinstance(msg, p.Ok), c, pend, msg, "an admin's request must succeed")
                self.apply_admin(pend)
            else:
                self.expect(
                    isinstance(msg, p.Error) and msg.code == p.ErrorCode.PERMISSION_DENIED,
                    c,
                    pend,
                    msg,
                    "only an admin may do this",
                )
            return
        match msg:
            case p.AllocationsReply():
                # (the listing runs the allocations' deadlines first: a notice given or withdrawn then
                # may reach its holder after this answer, so running and preempting are one here)
                listed = sorted((a.task_id, a.state == p.AllocState.SUSPENDED) for a in msg.allocations)
                model = sorted([(t, False) for t in self.acked] + [(t, True) for t in self.suspended])
                self.expect(listed == model, c, pend, msg, f"acknowledged (task, suspended): {model}")
                waits = [q for q in self.all_pending("ALLOCATE") if q.deadline is not None]
                waiting = sorted([q.msg.task_id for q in waits] + list(self.ghosts))
                # (a wait past its deadline, while the timer tries a store write again, may end in the listing's
                # own run of the deadlines: its answer reaches its client after this one)
                due = {q.msg.task_id for q in waits if q.deadline is not None and q.deadline <= self.now}
                self.expect(
                    set(msg.waiting) <= set(waiting) and set(waiting) - set(msg.waiting) <= due,
                    c,
                    pend,
                    msg,
                    f"waiting: {waiting}",
                )
                self.expect(msg.draining == sorted(self.draining), c, pend, msg, f"draining {sorted(self.draining)}")
            case p.LeasesReply():
                held = sorted(lease.lease_id for x in self.clients for lease in x.leases.values())
                listed = sorted(i.lease_id for i in msg.leases if i.state == "holding")
                self.expect(listed == held, c, pend, msg, f"held leases: {held}")
            case p.StatusReply():
                self.expect(len(msg.gpus) == len(self.gpus), c, pend, msg, "one entry per GPU")
                for g in msg.gpus:
                    gm = self.gpus[g.index]
                    self.expect(g.mode == gm.mode and g.scheduler_on == gm.enabled, c, pend, msg, "mode / switch")
                    self.expect(g.draining == (g.index in self.draining), c, pend, msg, "draining")
            case p.ClientsReply():
                ids = sorted(i.client_id for i in msg.clients)
                self.expect(ids == sorted(x.client_id for x in self.connected()), c, pend, msg, "connected clients")
                mine = {s.sid: s for x in self.clients for s in x.sessions.values()}
                for info in (i for client in msg.clients for i in client.sessions if i.session in mine):
                    s = mine[info.session]
                    seen = (s.parkable, s.parked, s.parks)
                    self.expect(
                        (info.parkable, info.parked, info.parks) == seen,
                        c,
                        pend,
                        msg,
                        f"session {s.sid} parkable/parked/parks {seen}",
                    )
            case p.PoliciesReply() | p.Ok():
                pass
            case _:
                self.fail(f"client {c.cid}: {short(pend.msg)} answered {short(msg)}")

    def apply_admin(self, pend: Pending) -> None:
        msg = pend.msg
        gpus = self.gpus if getattr(msg, "gpu", None) is None else [self.gpus[msg.gpu]]
        match msg:
            case p.SetMode():
                for gm in gpus:
                    gm.mode = p.Mode(msg.mode)
            case p.SetTq():
                for gm in gpus:
                    gm.tq_us = max(1, round(msg.seconds * 1e6))
            case p.SchedOn() | p.SchedOff():
                on = isinstance(msg, p.SchedOn)
                for gm in gpus:
                    gm.enabled = on
                    if not on:  # the daemon cancels pending drops while off
                        for s in self.sessions_on(gm.index):
                            s.drop_at = s.drop_reason = None
            case p.ResetAllocations():
                history = self.daemon.allocations.ledger._history
                for task in pend.info["tasks"]:  # the suspended ones too
                    a = self.acked.pop(task, None) or self.suspended.pop(task, None)
                    if a is not None and a.notice is not None and a.notice.whole and task in history:
                        # freed under its notice, unless a waiter served earlier in the reset withdrew it
                        # (its holder, forgotten, is not told): the order of the releases decides
                        self.remember(a)
                    if a is not None:
                        self.retire(a)
                return
            case _:
                return
        for gm in gpus:  # the rules the bounds were derived under changed: no bound for those waiting now
            for s in self.sessions_on(gm.index):
                s.bound = None

    def answer_attach(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Attach = pend.msg
        cap = self.config.max_sessions_per_connection
        owner = self.acked.get(m.task_id) if m.task_id else None
        expected = None
        if len(c.sessions) + len(c.leases) + len(c.waiting_leases()) >= cap:
            expected = p.ErrorCode.LIMIT_REACHED
        elif m.priority > self.ceiling(c):
            expected = p.ErrorCode.PERMISSION_DENIED
        elif owner is not None and owner.uid != c.uid and not c.admin:
            expected = p.ErrorCode.PERMISSION_DENIED
        elif pend.info.get("gpu") in self.draining and self.allocation_for(c, pend.info["gpu"], m.task_id) is None:
            expected = p.ErrorCode.INSUFFICIENT  # a draining GPU takes no new session but its allocations'
        early, c.early_parks = c.early_parks, {}
        if set(early) - {getattr(msg, "session", None)}:
            self.fail(f"client {c.cid} got a PARK for sessions {sorted(early)}, which {short(msg)} did not attach")
        if isinstance(msg, p.Error):
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'ATTACHED'}")
            return
        self.expect(isinstance(msg, p.Attached) and expected is None, c, pend, msg, f"expected {expected}")
        gpu = m.gpu if isinstance(m.gpu, int) else pend.info["gpu"]
        self.expect(
            msg.gpu == gpu and all(msg.session not in x.sessions for x in self.clients),
            c,
            pend,
            msg,
            "a new session on the GPU asked for",
        )
        core_ceiling, mem_ceiling = self.fraction_ceilings(c, gpu, m.task_id)
        core = min(m.core_limit, core_ceiling)
        mem = (
            m.mem_limit
            if mem_ceiling is None
            else (mem_ceiling if m.mem_limit is None else min(m.mem_limit, mem_ceiling))
        )
        self.expect(
            msg.core_limit == core and msg.mem_limit == mem,
            c,
            pend,
            msg,
            f"limits: expected core {core} mem {mem} (the allocation's ceilings {core_ceiling}/{mem_ceiling})",
        )
        c.sessions[msg.session] = Sess(
            msg.session,
            gpu,
            m.priority,
            msg.core_limit,
            m.mem_estimate,
            msg.mem_limit,
            m.task_id,
            core_ceiling,
            mem_ceiling,
            parkable=m.parkable,
        )
        if early:  # asked before it was ATTACHED: the client never saw it, park_timeout ends it
            self.on_park(c, c.sessions[msg.session], answer=False)

    def answer_lock_request(self, c: Client, pend: Pending, msg: Any) -> None:
        s = c.sessions.get(pend.info["sid"])
        self.expect(
            isinstance(msg, p.Error) and s is not None, c, pend, msg, "LOCK_REQUEST is answered only by an error"
        )
        assert s is not None
        queued = len(self.daemon.slots[s.gpu].scheduler.queue())
        self.expect(
            msg.code == p.ErrorCode.LIMIT_REACHED and queued >= self.config.max_lock_queue,
            c,
            pend,
            msg,
            f"{queued} queued, max_lock_queue {self.config.max_lock_queue}",
        )
        s.state = "idle"  # refused: nothing changed

    def answer_lock_released(self, c: Client, pend: Pending, msg: Any) -> None:
        ok = (
            isinstance(msg, p.Error)
            and pend.info["stale"]
            and msg.code in (p.ErrorCode.NOT_HOLDER, p.ErrorCode.STALE_GRANT)
        )
        self.expect(ok, c, pend, msg, "only a stale LOCK_RELEASED is refused (not_holder / stale_grant)")

    def answer_parked(self, c: Client, pend: Pending, msg: Any) -> None:
        expected = pend.info["expected"]
        ok = isinstance(msg, p.Error) and msg.code == expected
        self.expect(ok, c, pend, msg, f"expected {expected or 'no answer'}")

    def answer_mem_update(self, c: Client, pend: Pending, msg: Any) -> None:
        self.expect(False, c, pend, msg, "a MEM_UPDATE for the client's own session is not refused")

    def answer_detach(self, c: Client, pend: Pending, msg: Any) -> None:
        self.expect(isinstance(msg, p.Ok), c, pend, msg, "detaching one's own session")

    def answer_set_limits(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.SetLimits = pend.msg
        target: Client = pend.info["target"]
        chosen = pend.info["chosen"]
        expected = None
        # Authority over ceilings is an admin's acting on another client; its own sessions obey them.
        authority = c.admin and target is not c
        if target is not c and not c.admin:
            expected = p.ErrorCode.PERMISSION_DENIED
        elif not chosen:
            expected = p.ErrorCode.UNKNOWN_SESSION
        elif not authority:
            for s in chosen:
                if m.core_limit is not None and m.core_limit > s.core_ceiling:
                    expected = p.ErrorCode.PERMISSION_DENIED
                if (
                    m.mem_limit is not None
                    and s.mem_ceiling is not None
                    and (m.mem_limit == 0 or m.mem_limit > s.mem_ceiling)
                ):
                    expected = p.ErrorCode.PERMISSION_DENIED
        if isinstance(msg, p.Error):
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'LIMITS_SET'}")
            return
        self.expect(isinstance(msg, p.LimitsSet) and expected is None, c, pend, msg, f"expected {expected}")
        self.expect(sorted(msg.sessions) == sorted(s.sid for s in chosen), c, pend, msg, "the sessions chosen")
        for s in chosen:
            if authority:  # an admin's limits for another client are the new ceilings
                if m.core_limit is not None:
                    s.core_ceiling = m.core_limit
                if m.mem_limit is not None:
                    s.mem_ceiling = m.mem_limit or None

    def answer_acquire(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Acquire = pend.msg
        if isinstance(msg, p.Error):
            cap = self.config.max_sessions_per_connection
            expected: p.ErrorCode | None = None
            if pend.info["gpu"] in self.draining:
                expected = p.ErrorCode.INSUFFICIENT  # a draining GPU takes no new lease
            elif len(c.sessions) + len(c.leases) + len(c.waiting_leases()) >= cap:
                expected = p.ErrorCode.LIMIT_REACHED
            else:
                refused = (m.priority or 0) > self.ceiling(c) or pend.info["terms"] is None
                expected = p.ErrorCode.PERMISSION_DENIED if refused else None
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'a LEASE_RESULT'}")
            return
        self.expect(
            isinstance(msg, p.LeaseResult) and (m.priority or 0) <= self.ceiling(c),
            c,
            pend,
            msg,
            "a lease priority above the ceiling is refused",
        )
        gpu = pend.info["gpu"]
        self.expect(msg.gpu == gpu, c, pend, msg, "the GPU asked for")
        self.expect(
            gpu not in self.draining or pend.sent_at < self.now, c, pend, msg, "a draining GPU takes no new lease"
        )
        if msg.status == p.LeaseStatus.ACQUIRED:
            rec = self.daemon.leases.by_id.get(msg.lease_id or "")
            self.expect(rec is not None and rec.conn is c.conn, c, pend, msg, "the arbiter holds the lease for it")
            assert rec is not None and msg.lease_id is not None
            if self.now < self.grace_end:
                self.fail(f"lease {msg.lease_id} granted {self.grace_end - self.now} us before the restart grace ends")
            terms: LeaseTerms = pend.info["terms"]
            self.expect(rec.terms == terms, c, pend, msg, f"lease terms {rec.terms}, expected {terms}")
            lease = LeaseM(
                msg.lease_id,
                rec.sid,
                gpu,
                terms.priority,
                pend.info["seq"],
                self.now,
                terms.hold_max_ms * MS,
                terms.mem_estimate,
            )
            self.expect(all(msg.lease_id not in x.leases for x in self.clients), c, pend, msg, "a new lease id")
            c.leases[msg.lease_id] = lease
            self.stats["leases acquired" + (" after waiting" if self.now > pend.sent_at else "")] += 1
            self.holds.setdefault(rec.sid, []).append([self.now, None])
            self.grants_now.append((gpu, rec.sid, lease.seq, lease.priority, 0))
            hold_max = LEASE_HOLD_MAX_US[c.kind]
            if hold_max is not None:
                self.later(
                    self.now + self.rng.randrange(MS // 2, hold_max), "lease_release", c.cid, c.gen, msg.lease_id
                )
            return
        self.stats[f"leases refused ({msg.reason})"] += 1
        terms = pend.info["terms"]
        want = refusal_status(terms.busy_policy)
        self.expect(msg.status == want, c, pend, msg, f"busy policy {terms.busy_policy} answers {want}")
        if msg.reason in (p.LeaseReason.GPU_BUSY, p.LeaseReason.QUEUE_FULL):
            self.expect(self.now == pend.sent_at, c, pend, msg, "refused on arrival only")
            if msg.reason == p.LeaseReason.GPU_BUSY:
                self.expect(terms.max_wait_ms == 0, c, pend, msg, f"GPU_BUSY only when max_wait is 0 ({terms})")
            else:
                queued = len(self.daemon.slots[gpu].scheduler.queue())
                self.expect(
                    terms.max_wait_ms > 0 and queued >= terms.queue_limit,
                    c,
                    pend,
                    msg,
                    f"QUEUE_FULL with {queued} queued, queue_limit {terms.queue_limit}",
                )
        elif msg.reason == p.LeaseReason.TIMEOUT:
            self.lease_timeouts_now.add(gpu)
            if terms.max_wait_ms == 0 and any(not s.park_refused for s in self.resident(gpu)):
                self.known_bug(
                    "parks asked for a lease that leaves at once",
                    f"client {c.cid}: {short(pend.msg)} answered {short(msg)}, not GPU_BUSY, as parks are asked for it",
                )
                return
            self.expect(
                terms.max_wait_ms > 0,
                c,
                pend,
                msg,
                "its terms give max_wait 0 ms, which means only if free now: the answer is GPU_BUSY, never TIMEOUT",
            )
            self.expect(
                self.now >= pend.sent_at + terms.max_wait_ms * MS,
                c,
                pend,
                msg,
                f"timed out before its max_wait of {terms.max_wait_ms} ms",
            )
        else:
            self.expect(False, c, pend, msg, "a refused lease says why")
        self.expect(not pend.info.get("idle"), c, pend, msg, "the GPU was idle: the first holder is always admitted")

    def answer_release(self, c: Client, pend: Pending, msg: Any) -> None:
        if pend.info.get("other"):
            self.expect(
                isinstance(msg, p.Error) and msg.code == p.ErrorCode.PERMISSION_DENIED,
                c,
                pend,
                msg,
                "releasing another client's lease is refused",
            )
        else:
            self.expect(isinstance(msg, p.Ok), c, pend, msg, "release is idempotent")

    def answer_allocate(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Allocate = pend.msg
        info = pend.info
        injected = self.injected > info["injected"] and pend.sent_at == self.now and pend.deadline is None
        if isinstance(msg, p.Error):
            if msg.code == p.ErrorCode.STORE_FAILED:
                self.expect(injected, c, pend, msg, "store_failed without a failed store write")
                info["store_failed"] = True
                return
            self.expect(not injected, c, pend, msg, "the store write failed: expected store_failed")
            expected = info["expected"]
            if expected is not None:
                self.expect(msg.code == expected, c, pend, msg, f"expected {expected}")
                self.expect(info["why"] in msg.message, c, pend, msg, f"expected a refusal that says {info['why']!r}")
                if info["why"]:
                    self.stats[f"owner pids refused ({info['why']})"] += 1
                    self.stats["owner pids refused"] += 1
            elif msg.code == p.ErrorCode.INSUFFICIENT and "owner process exited" in msg.message:
                owner: OwnerM = info["owner"]
                self.expect(
                    pend.deadline is not None and self.reaps_now and owner.reapable(),
                    c,
                    pend,
                    msg,
                    f"the reaper ends a wait whose owner ({owner.proc}) exited, nothing else",
                )
                self.wait_ended(c, pend)
                self.stats["allocation waits ended by the reaper (owner exited)"] += 1
            elif msg.code == p.ErrorCode.INSUFFICIENT:
                self.expect(m.task_id not in self.acked, c, pend, msg, "it is allocated: the same answer again")
                if pend.deadline is not None:
                    self.stats["allocation waits " + ("withdrawn" if info.get("withdrawn") else "expired")] += 1
                if pend.deadline is not None and not info.get("withdrawn"):
                    self.expect(self.now >= info["earliest"], c, pend, msg, f"gave up before wait_ms ({pend.deadline})")
            elif msg.code == p.ErrorCode.LIMIT_REACHED:  # waits restored after a restart and suspended ones count
                waiting = len(self.daemon.allocations.waiters) + len(self.ghosts) + len(self.suspended)
                self.expect(
                    m.wait_ms > 0 and waiting >= self.config.max_allocation_waiters,
                    c,
                    pend,
                    msg,
                    f"{waiting} allocation waiters, cap {self.config.max_allocation_waiters}",
                )
            elif msg.code == p.ErrorCode.INVALID:
                self.expect(
                    m.task_id in info["waiting_tasks"], c, pend, msg, "a valid request (unless already waiting)"
                )
            else:
                self.expect(False, c, pend, msg, "unexpected refusal")
            return
        self.expect(
            isinstance(msg, p.Allocated) and info["expected"] is None, c, pend, msg, f"expected {info['expected']}"
        )
        self.expect(not injected, c, pend, msg, "ALLOCATED though its store write failed")
        self.stats["allocations answered" + (" after waiting" if pend.deadline is not None else "")] += 1
        self.expect(
            msg.task_id == m.task_id and msg.cuda_visible_devices == ",".join(map(str, msg.gpus)),
            c,
            pend,
            msg,
            "task id / CUDA_VISIBLE_DEVICES",
        )
        before = self.acked.get(m.task_id) or self.suspended.get(m.task_id)
        if before is not None:
            self.answered_again(c, pend, msg, before)
            return
        self.expect(not info["suspended"], c, pend, msg, "a suspended allocation is answered as it is")
        got, why = self.made(c.uid, msg, m, info["owner"])
        self.expect(not why, c, pend, msg, why)
        got.holder = c.conn if m.notify else None
        got.owner.reach = got.owner.alive()  # (Allocations._hold: reachable through its owner while it runs)
        self.stats["allocations with an owner process"] += got.owner.held
        self.ghosts.pop(m.task_id, None)  # a wait restored after a restart, served as its client asked again

    def made(self, uid: int, msg: p.Allocated, m: p.Allocate | Ghost, owner: OwnerM) -> tuple[Acked, str]:
        """A new allocation, answered or found served: the model's record of it, and what is wrong
        with it ("" when it is what ``m`` asked for; only then is it recorded)."""
        share = round(msg.share * UNIT)
        terms = asked_terms(m) if isinstance(m, p.Allocate) else m.terms
        want, cpus, tenant, priority, on_preempt, gpus_max, owner_pid = terms
        got = Acked(
            msg.task_id,
            uid,
            tuple(msg.gpus),
            share,
            tuple(msg.cpus),
            msg.tenant,
            msg.priority,
            msg.on_preempt,
            msg.gpus_min or 0,
            msg.gpus_max or 0,
            msg.protected,
            self.now,
            msg.preemptions,
            msg.resume,
            changed=self.now,
            owner_pid=msg.owner_pid,
            owner=owner,
        )
        if gpus_max:
            shape = want // UNIT <= len(got.gpus) <= gpus_max and share == UNIT and got.gpus_min == want // UNIT
        elif want >= UNIT:
            shape = len(got.gpus) == want // UNIT and share == UNIT
        elif want > 0:
            shape = len(got.gpus) == 1 and share == want
        else:
            shape = got.gpus == () and share == 0
        history = self.history.pop(msg.task_id, (0, False))
        why = ""
        if not (shape and len(set(got.gpus)) == len(got.gpus)):
            why = "the GPUs asked for"
        elif set(got.gpus) & (self.draining - self.undrain_now):
            why = f"placed on a draining GPU (draining: {sorted(self.draining)})"
        elif not (len(got.cpus) == cpus == len(set(got.cpus)) and all(0 <= x < SIM_CPUS for x in got.cpus)):
            why = "the CPU cores asked for"
        elif (got.tenant, got.priority, got.on_preempt, got.gpus_max, got.owner_pid) != (
            tenant,
            priority,
            on_preempt,
            gpus_max,
            owner_pid,
        ):
            why = "the terms asked for (tenant, priority, on_preempt, gpus_max, owner_pid)"
        elif msg.state != p.AllocState.RUNNING:
            why = "a new allocation runs"
        elif (got.preemptions, got.resume) != history:
            why = f"preemptions / resume: the task's history is {history} (lost across a restart?)"
        if not why:
            self.acked[msg.task_id] = got
            self.stats["allocations that resume a preempted task"] += got.resume
        return got, why

    def answered_again(self, c: Client, pend: Pending, msg: p.Allocated, before: Acked) -> None:
        """The same task again: the same allocation, in the state its holder was told; this
        connection holds it now if it listens (a notice that runs is its to act on)."""
        share = round(msg.share * UNIT)
        same = (before.gpus, before.share, before.cpus, before.tenant) == (
            tuple(msg.gpus),
            share,
            tuple(msg.cpus),
            msg.tenant,
        )
        self.expect(same, c, pend, msg, f"the same task again must be the same allocation: {before}")
        n = before.notice
        if before.task_id in self.suspended:
            state, deadline = p.AllocState.SUSPENDED, None
        elif n is not None:
            state, deadline = p.AllocState.PREEMPTING, round(max(0, n.deadline - self.now) / 1e6, 3)
        else:
            state, deadline = p.AllocState.RUNNING, None
        self.expect(
            (msg.state, msg.deadline_s) == (state, deadline),
            c,
            pend,
            msg,
            f"its state is {state}" + (f", {deadline} s of grace left" if deadline is not None else ""),
        )
        self.expect(
            (msg.preemptions, msg.resume, msg.protected) == (before.preemptions, before.resume, before.protected),
            c,
            pend,
            msg,
            f"preemptions / resume / protected {(before.preemptions, before.resume, before.protected)}",
        )
        before.owner.reach = before.owner.alive()  # (Allocations._hold)
        if pend.msg.notify:
            before.holder = c.conn
            if n is not None:
                self.react(c, before, n)
        elif before.holder is c.conn:
            before.holder = None

    def answer_free(self, c: Client, pend: Pending, msg: Any) -> None:
        task = pend.msg.task_id
        info = pend.info
        injected = self.injected > info["injected"]
        if isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED:
            self.expect(injected, c, pend, msg, "store_failed without a failed store write")
            info["store_failed"] = True
            return
        expected = info["expected"]
        if isinstance(msg, p.Error):
            self.expect(not injected, c, pend, msg, "the store write failed: expected store_failed")
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'OK'}")
            return
        self.expect(isinstance(msg, p.Ok) and expected is None, c, pend, msg, f"expected {expected}")
        a = self.acked.pop(task, None) or self.suspended.pop(task, None)
        if a is not None:
            self.expect(not injected, c, pend, msg, "the store write failed: expected store_failed")
            if a.notice is not None and a.notice.whole:
                self.remember(a)
                self.stats["preemptions done by FREE"] += 1
            self.retire(a)
        elif (ghost := self.ghosts.pop(task, None)) is not None:
            self.waits_ended_now.add(task)
            self.unstored_waits[task] = ghost
            self.stats["restored waits withdrawn"] += 1
        else:
            waiter = info["waiter"]
            self.expect(waiter is not None, c, pend, msg, "freed a task that was neither allocated nor waiting")

    # --- taking allocations back: the holders' side ------------------------------------------------

    def held_by(self, c: Client, task: str, msg: Any) -> Acked:
        """The allocation a push names: one the model has, and this connection holds it."""
        a = self.acked.get(task) or self.suspended.get(task)
        if a is None:
            self.fail(f"client {c.cid} got {short(msg)} for an allocation that does not exist")
        if a.holder is not c.conn:
            holder = next((x.cid for x in self.clients if x.conn is not None and x.conn is a.holder), None)
            self.fail(
                f"client {c.cid} got {short(msg)}, but the connection holding {task} is "
                + (
                    "none (nobody asked for it since the last restart or disconnect)"
                    if holder is None
                    else f"client {holder}'s"
                )
            )
        return a

    def wait_ended(self, c: Client, q: Pending) -> None:
        """A wait given up (freed, or its connection gone); one that had victims is stored, and its
        withdrawal may not be yet."""
        self.waits_ended_now.add(q.msg.task_id)
        if q.info.get("victims"):
            terms = asked_terms(q.msg)
            self.unstored_waits[q.msg.task_id] = Ghost(
                q.msg.task_id, c.uid, terms, q.info["earliest"], q.deadline or 0, q.info["owner"]
            )

    def behind(self) -> bool:
        """The daemon knows its store does not hold all its changes yet (a withdrawal it could not store)."""
        put, gone = self.daemon.allocations.ledger.changed_records()  # changed since the store took the last
        return bool(put or gone)

    def waits_of(self, c: Client) -> list[Pending]:
        return [q for q in c.pending.values() if q.kind == "ALLOCATE" and q.deadline is not None]

    def asking(self, task: str) -> Pending | None:
        """The ALLOCATE of ``task`` that waits, or is being handled now (it may wait)."""
        for q in self.all_pending("ALLOCATE"):
            if q.msg.task_id == task and (q.deadline is not None or q.sent_at == self.now):
                return q
        return None

    def waiter_of(self, task: str) -> tuple[int, str | None] | None:
        """(priority, tenant) of what a notice names as ``by``: a wait (also one that ended in this
        event), a wait restored after a restart, or a suspended allocation waiting for its GPUs."""
        if (q := self.asking(task)) is not None:
            return asked_priority(q.msg), q.msg.tenant
        if (g := self.ghosts.get(task)) is not None:
            return g.terms[3], g.terms[2]
        if (a := self.suspended.get(task)) is not None:
            return a.priority, a.tenant
        return self.wait_priority.get(task) if task in self.waits_ended_now else None

    def model_waiters(self) -> list[int]:
        """The priorities of everything that waits for devices."""
        out = [asked_priority(q.msg) for q in self.all_pending("ALLOCATE") if q.deadline or q.sent_at == self.now]
        return out + [g.terms[3] for g in self.ghosts.values()] + [a.priority for a in self.suspended.values()]

    def on_preempt(self, c: Client, msg: p.Preempt) -> None:
        a = self.held_by(c, msg.task_id, msg)
        if msg.task_id in self.suspended:
            self.fail(f"client {c.cid} got {short(msg)} for a suspended allocation")
        if a.notice is not None:
            self.fail(f"client {c.cid} got {short(msg)} while the notice of {a.notice.issued} runs")
        n = NoticeM(msg.reason, tuple(msg.gpus), msg.whole, msg.by, self.now, self.now + self.grace_us)
        self.noticed(a, n, msg, f"client {c.cid} got {short(msg)}")
        self.react(c, a, n)
        if self.rng.random() < 0.1:  # gpud dies while the notice runs
            self.later(self.now + self.rng.randrange(0, max(1, self.grace_us)), "crash")

    def noticed(self, a: Acked, n: NoticeM, msg: p.Preempt, what: str) -> None:
        """Notice ``n`` (as ``msg`` says it) given to ``a``: judged by the rules, and what it changes."""
        why = self.notice_wrong(a, n, msg) or self.notice_unsaid(a, n)
        if why:
            self.fail(
                f"{what} for {a.task_id} (priority {a.priority}, gpus {a.gpus}, "
                f"on_preempt {a.on_preempt}, protected {a.protected}, running {self.now - a.created} us): {why}"
            )
        a.notice = n
        a.told += 1
        self.stats[f"preempt notices ({msg.reason}, {'whole' if msg.whole else 'partial'})"] += 1
        self.stats["preempt notices"] += 1
        if (q := self.asking(n.by)) is not None:  # it waits until its victims have left
            q.info["victims"] = True
            q.info["answer_by"] = max(q.info.get("answer_by", 0), n.deadline + 1)
            if q.deadline is not None:
                q.deadline = max(q.deadline, n.deadline + 1)
        if (g := self.ghosts.get(n.by)) is not None:
            g.answer_by = max(g.answer_by, n.deadline + 1)
        bound = (self.now - self.started) // max(1, self.cooldown_us) + 2
        if a.told > bound:
            self.fail(
                f"thrash: {a.task_id} got its notice number {a.told} after {(self.now - self.started) / 1e6:.3f} s "
                f"simulated, more than time / preemption_cooldown + 2 = {bound}"
            )

    def noticed_unheld(self, a: Acked, la: Any, ln: Any) -> None:
        """A notice the ledger gave ``a``, which no connection holds: only through its live owner process
        can it be told (reachable), by SIGTERM when it is told to leave whole."""
        t, o = a.task_id, a.owner
        if a.holder is not None or not o.reach:
            self.fail(f"the daemon runs a notice for {t} ({ln}) that its holder was never told")
        if ln.issued != self.now:
            self.fail(f"the notice of {t} ({ln}) was given before this event, and not judged then")
        n = NoticeM(ln.reason, tuple(ln.gpus), ln.whole, ln.by, ln.issued, ln.deadline)
        grace_s = round((ln.deadline - ln.issued) / 1e6, 3)
        msg = p.Preempt(
            task_id=t, reason=ln.reason, recovery=recovery_told(la, ln), gpus=list(ln.gpus), whole=ln.whole,
            grace_s=grace_s, by=ln.by,
        )  # fmt: skip
        self.noticed(a, n, msg, f"notice {short(msg)} (nobody holds it; its owner {o.proc})")
        if n.whole and o.alive() and o.termed != n.issued:
            self.fail(f"{t} is told to leave whole, nobody holds it, and its owner {o.proc} got no SIGTERM")
        self.stats["notices to an owner nobody holds" + (" (SIGTERM)" if o.termed == n.issued else "")] += 1

    def judge_signal(self, proc: Proc, sig: signal.Signals) -> None:
        """A signal the table delivers now (``Table.on_signal``): judged at this moment, before it acts."""
        task, why = self.signalling or ("?", "?")
        self.event("gpud sends {} to {} for {} ({})", sig.name, proc, task, why)
        self.stats[f"owners signalled ({sig.name})"] += 1
        wrong = self.signal_wrong(proc, sig, task, why)
        if wrong:  # (raised inside the daemon, which may contain it: check() raises it again)
            self.broken = f"gpud sent {sig.name} to {proc} for task {task} ({why}): {wrong}"
            self.fail(self.broken)
        if sig == signal.SIGTERM and self.rng.random() < 0.5:  # it leaves as asked, after a while
            self.later(self.now + self.rng.randrange(0, 2 * max(1, self.grace_us)), "owner_exits", proc)
        elif sig == signal.SIGKILL:  # it ends now: a client's own process takes its connection along
            self.later(self.now, "owner_killed", proc)

    def signal_wrong(self, proc: Proc, sig: signal.Signals, task: str, why: str) -> str:
        """What is wrong with ``sig`` reaching ``proc`` now for ``task`` ("" if nothing)."""
        t = self.table
        if self.signalling is None:
            return "a signal not sent through TaskOwners.signal"
        if proc.pid <= 1 or proc is t.daemon or proc.kthread:
            return "init, gpud itself and kernel threads are never signalled"
        if t.at.get(proc.pid) is not proc:
            return "its pid is another process's now"
        a = self.acked.get(task) or self.suspended.get(task)
        if a is None:
            return "the task holds no allocation"
        o = a.owner
        if o.proc is not proc or not o.held:
            return f"the process the task was allocated for is {o.proc}" + ("" if o.held else ", not held since")
        if a.uid not in (proc.ruid, proc.suid) and not o.any_uid:
            return f"it is not a process of uid {a.uid}, whose allocation it is (and no admin said owner_any_uid)"
        if sig == signal.SIGTERM:
            ln = self.daemon.allocations.ledger.notice_of(task)
            if why != "preempt_notice" or ln is None or not ln.whole or ln.issued != self.now:
                return f"a SIGTERM goes with a notice to leave whole, given now (the ledger's: {ln})"
            if a.holder is not None:
                return "a connection holds the allocation: it is told by PREEMPT"
            o.termed = ln.issued
        elif sig == signal.SIGKILL:
            n = a.notice
            if why != "preempt_grace_over" or n is None or not n.whole or o.termed != n.issued:
                return f"a SIGKILL ends the notice whose SIGTERM the owner got (one for {o.termed}; the notice: {n})"
            if self.now < n.deadline and task not in self.yields_now:
                return f"{n.deadline - self.now} us before the notice's grace ends"
            o.killed = self.now
        else:
            return "gpud sends its owners SIGTERM and SIGKILL only"
        return ""

    def owners_m(self) -> dict[str, OwnerM]:
        """The owner of every task the model knows: allocations, suspended ones, waits, restored waits."""
        out = {t: a.owner for t, a in [*self.acked.items(), *self.suspended.items()]}
        for q in self.all_pending("ALLOCATE"):
            if q.deadline is not None:
                out.setdefault(q.msg.task_id, q.info["owner"])
        for t, g in self.ghosts.items():
            out.setdefault(t, g.owner)
        return out

    def rehold(self) -> None:
        """A new daemon holds again the owners of what it restored that still run, and nothing else; the
        signals it sent before are forgotten; an allocation is reachable through its owner if it runs."""
        for t, o in self.owners_m().items():
            o.termed = o.killed = None
            o.held = o.proc is not None and o.proc.alive and not self.table.hidden
            gone = o.proc is not None and not o.proc.alive
            # (where /proc hides everything, a live process at the dead owner's pid cannot be told apart)
            o.orphan_at = self.now if gone and not (self.table.hidden and self.table.live(o.proc.pid)) else None
            o.reach = o.held and (t in self.acked or t in self.suspended)

    def do_owner_exits(self) -> None:
        """An owner process exits: a held one mostly (a client's own: it crashed), else a client's child."""
        procs = [o.proc for o in self.owners_m().values() if o.held and o.proc is not None and o.proc.alive]
        procs += [k for c in self.clients if c.proc is not None for k in self.table.children(c.proc)][:2]
        proc = self.pick(list(dict.fromkeys(procs)))
        if proc is None:
            return self.do_advance()
        self.ended(proc, "it ended")

    def do_pid_reuse(self) -> None:
        """A new process takes the pid of one that exited (an owner's, mostly)."""
        owners = [o.proc for o in self.owners_m().values() if o.proc is not None]
        dead = [x for x in dict.fromkeys(owners) if not x.alive and self.table.at[x.pid] is x]
        dead = dead or [x for x in self.table.at.values() if not x.alive]
        self.reuse(self.pick(dead))
        self.after_event()

    def later_owner_exits(self, proc: Proc) -> None:
        self.ended(proc, "it left on SIGTERM")

    def later_owner_killed(self, proc: Proc) -> None:
        self.ended(proc, "SIGKILL from gpud at its grace's end")

    def ended(self, proc: Proc, why: str) -> None:
        """``proc`` exits, as one event; a client's own process is started again, sometimes."""
        if not proc.alive:
            return
        self.exits(proc, why)
        self.after_event()
        c = next((x for x in self.clients if x.proc is proc), None)
        if c is not None and self.rng.random() < 0.5:
            self.later(self.now + self.rng.randrange(MS, 100 * MS), "reconnect", c.cid)
            self.respawn(c)

    def later_crash(self) -> None:
        if any(a.notice is not None for a in self.acked.values()):
            self.stats["daemon crashes during a preemption"] += 1
        self.do_crash_daemon()

    def notice_unsaid(self, a: Acked, n: NoticeM) -> str:
        """A waiter's notice to an allocation that ALLOCS called not preemptible when it was issued:
        what gpud says must be what it does ("" if nothing). Who can be told may have changed since."""
        la = self.daemon.allocations.ledger.get(a.task_id)
        if n.reason == p.PreemptReason.DRAIN or n.by == "idle" or la is None:
            return ""
        shield = self.daemon.allocations.ledger.shield(la, n.issued)
        if shield is None or shield == shields.UNREACHABLE or shield.why == shields.RESTING:
            return ""  # (the model judges its rest itself: a notice withdrawn meanwhile starts one)
        return f"gpud said it was not preemptible then: {shield.text(n.issued)}"

    def notice_wrong(self, a: Acked, n: NoticeM, msg: p.Preempt) -> str:
        """What is wrong with notice ``n`` to ``a`` ("" if nothing): the rules of taking back."""
        recovery = a.on_preempt
        if n.whole and recovery == p.Recovery.SHRINK:  # (a drain of its minimum): it ends
            recovery = p.Recovery.TERMINATE
        if msg.recovery != recovery:
            return f"recovery {msg.recovery}, but its on_preempt is {a.on_preempt}"
        if msg.grace_s != round(self.grace_us / 1e6, 3):
            return f"grace {msg.grace_s} s, configured {self.config.preemption_grace_s} s"
        if not n.gpus and a.gpus or not set(n.gpus) <= set(a.gpus) or n.whole != (n.gpus == a.gpus):
            return f"GPUs {n.gpus} (whole={n.whole}) of an allocation of {a.gpus}"
        if not n.whole and not set(n.gpus) <= set(a.extras):
            return f"a partial notice takes only GPUs above the elastic minimum (extras {a.extras})"
        if n.reason == p.PreemptReason.DRAIN:
            if n.by != "drain" or not set(n.gpus) & (self.draining | self.drain_now):
                return f"drain notice by {n.by!r} for GPUs {n.gpus}, draining {sorted(self.draining)}"
            return ""
        if not self.config.preemption:
            return "preemption is off: only a drain takes allocations back"
        if a.priority >= 100:
            return "production (100) is never preempted by a waiting request, only a drain tells it to leave"
        if a.protected:
            return "a protected allocation is never preempted by a waiting request"
        if self.now < a.rested_until:
            return f"a notice of it was withdrawn; it rests until {a.rested_until} (preemption_cooldown)"
        waiter = self.waiter_of(n.by)
        if waiter is None:
            return f"by {n.by!r}, which does not wait"
        priority, tenant = waiter
        match n.reason:
            case p.PreemptReason.PRIORITY:
                if not n.whole or a.on_preempt == p.Recovery.SHRINK:
                    return "a priority preemption takes the whole allocation, never a shrink one"
                if a.priority >= priority:
                    return f"its priority {a.priority} is not below the waiter's {priority}"
                if a.priority > 0 and self.now - a.created < self.min_runtime_us:
                    return f"it ran less than preemption_min_runtime ({self.min_runtime_us} us) and is not spot"
            case p.PreemptReason.ELASTIC:
                if n.whole or n.gpus != a.extras or a.priority > priority:
                    return f"an elastic notice takes the extras {a.extras} for a waiter of priority >= {a.priority}"
            case p.PreemptReason.QUOTA_RECLAIM:
                if not n.whole or a.on_preempt == p.Recovery.SHRINK:
                    return "a quota reclaim takes the whole allocation, never a shrink one"
                lent = self.config.tenants.get(a.tenant or "")
                used = sum(len(x.gpus) * x.share for x in self.acked.values() if x.tenant == a.tenant)
                if lent is None or tenant is None or tenant == a.tenant or used <= round(lent.gpus * UNIT):
                    return f"tenant {a.tenant} (using {used / UNIT}) borrows nothing the waiter's tenant {tenant} needs"
        return ""

    def react(self, c: Client, a: Acked, n: NoticeM) -> None:
        """What the holder does about a notice: yield at once or after a while (a slow one often
        after the grace), free instead, crash, or nothing (a stubborn one or an abandoner)."""
        r, g = self.rng, max(2, self.grace_us)
        if c.kind in ("stubborn", "abandoner"):
            self.stats["notices left to run out"] += 1
            return
        if c.kind == "crashy" and r.random() < 0.4:
            action, delay = "crash", r.randrange(0, g)
        elif c.kind == "slow":
            action, delay = "yield", r.randrange(g // 2, 2 * g)
        else:
            action = r.choices(["yield", "free", "never"], [7, 2, 1])[0]
            delay = 0 if r.random() < 0.3 else r.randrange(0, g // 2)
        self.later(self.now + delay, "react", c.cid, c.gen, a.task_id, n.issued, action)

    def later_react(self, cid: int, gen: int, task: str, issued: int, action: str) -> None:
        c = self.client(cid, gen)
        if c is None:
            return
        a = self.acked.get(task)
        if a is None or a.notice is None or a.notice.issued != issued:  # withdrawn or carried out meanwhile
            if action == "yield" and self.rng.random() < 0.3:
                self.yield_(c, task)  # a late YIELD: refused
            return
        if action == "yield":
            self.yield_(c, task)
        elif action == "free":
            self.free(c, task)
        elif action == "crash":
            self.lose_connection(c, "crashed on its PREEMPT", crashed=True)
            self.after_event()
            if self.rng.random() < 0.5:
                self.later(self.now + self.rng.randrange(MS, 20 * MS), "reconnect", c.cid)
                self.respawn(c)

    def later_again(self, cid: int, gen: int, task: str) -> None:
        """A runner whose allocation was taken back asks for its task again (checkpoint: it resumes)."""
        c = self.client(cid, gen)
        if c is not None and task not in self.acked and task not in self.suspended:
            again = self.again_terms.pop(task, None)
            if again is not None:
                self.allocate(c, msgspec.structs.replace(again, id=c.rid()))

    def later_free(self, cid: int, gen: int, task: str) -> None:
        c = self.client(cid, gen)
        if c is not None and task in self.suspended:
            self.free(c, task)

    def yield_(self, c: Client, task: str) -> None:
        a = self.acked.get(task)
        expected: p.ErrorCode | None = None
        if a is None:
            expected = p.ErrorCode.UNKNOWN_TASK
        elif not c.admin and a.uid != c.uid:
            tenant = self.config.tenants.get(a.tenant or "")
            if tenant is None or (c.uid not in tenant.uids and c.gid not in tenant.gids):
                expected = p.ErrorCode.PERMISSION_DENIED
        if expected is None and (a is None or a.notice is None):
            expected = p.ErrorCode.INVALID
        if expected is None:
            self.yields_now.add(task)
        cp, waiters = self.daemon.allocations.ledger.checkpoint(), dict(self.daemon.allocations.waiters)
        pend = self.send(c, p.Yield(id=c.rid(), task_id=task), "YIELD", expected=expected, injected=self.injected)
        self.finish(c, pend)
        if pend.info.get("store_failed"):
            self.check_rolled_back(cp, waiters, f"YIELD {task}")
        self.after_event()

    def answer_yield(self, c: Client, pend: Pending, msg: Any) -> None:
        expected = pend.info["expected"]
        if isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED:
            self.expect(self.injected > pend.info["injected"], c, pend, msg, "store_failed without a failed write")
            pend.info["store_failed"] = True
            a = self.acked.get(pend.msg.task_id)
            if a is not None and a.notice is not None:  # the runner tries again
                self.later(self.now + MS, "react", c.cid, c.gen, a.task_id, a.notice.issued, "yield")
            return
        if isinstance(msg, p.Error):
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'OK'}")
            self.stats[f"yields refused ({msg.code})"] += 1
            return
        self.expect(isinstance(msg, p.Ok) and expected is None, c, pend, msg, f"expected {expected}")
        self.stats["yields"] += 1

    def on_withdrawn(self, c: Client, msg: p.PreemptWithdrawn) -> None:
        a = self.held_by(c, msg.task_id, msg)
        if a.notice is None:
            self.fail(f"client {c.cid} got {short(msg)}, but no notice of {a.task_id} runs")
        self.withdrawals_now.append((a, a.notice))
        self.withdrawn(a, a.notice)

    def withdrawn(self, a: Acked, n: NoticeM) -> None:
        a.notice = None
        a.withdrawn += 1
        self.unstored_notices[a.task_id] = n
        why = "drain off" if n.reason == p.PreemptReason.DRAIN else "waiter gone or served"
        self.stats[f"notices withdrawn ({why})"] += 1
        if n.reason != p.PreemptReason.DRAIN:
            a.rested_until = self.now + self.cooldown_us

    def withdrawal_wrong(self, n: NoticeM, waits: set[str]) -> str:
        """Why notice ``n`` may not have been withdrawn now ("" if it may): its GPU is no longer
        drained, or the request it was for gave up."""
        if n.reason == p.PreemptReason.DRAIN:
            return "" if any(g not in self.draining for g in n.gpus) else f"its GPUs {n.gpus} are still drained"
        return f"{n.by!r} still waits" if n.by in waits else ""

    def on_alloc_revoked(self, c: Client, msg: p.AllocRevoked) -> None:
        a = self.held_by(c, msg.task_id, msg)
        n = a.notice
        if a.task_id in self.suspended or n is None or not n.whole:
            self.fail(f"client {c.cid} got {short(msg)}, but no notice to give {a.task_id} back whole runs")
        suspend = self.taken_back_how(a, n)
        want = (n.reason, not suspend, p.AllocState.SUSPENDED if suspend else p.AllocState.RUNNING)
        if (msg.reason, msg.gone, msg.state) != want:
            self.fail(f"client {c.cid} got {short(msg)}, expected reason/gone/state {want}")
        self.taken_back(a, n, suspend)
        if suspend and self.rng.random() < 0.25:  # the runner gives up on it
            self.later(self.now + self.rng.randrange(0, 20 * MS), "free", c.cid, c.gen, a.task_id)
        elif not suspend and self.rng.random() < 0.4:  # a runner starts its task again (a checkpoint resumes)
            self.again_terms[a.task_id] = a.again(0, wait_ms=self.rng.choice([50, 200, 1000]))
            self.later(self.now + self.rng.randrange(0, 20 * MS), "again", c.cid, c.gen, a.task_id)

    def taken_back_how(self, a: Acked, n: NoticeM) -> bool:
        """A notice carried out now: it must have been yielded (or freed) or its grace be over.
        Whether the allocation is suspended (yielded with on_preempt suspend) rather than gone."""
        yielded = a.task_id in self.yields_now
        if not yielded and self.now < n.deadline:
            self.fail(f"{a.task_id} taken back {n.deadline - self.now} us before its grace ended, and it did not yield")
        return n.whole and yielded and a.on_preempt == p.Recovery.SUSPEND

    def taken_back(self, a: Acked, n: NoticeM, suspend: bool) -> None:
        self.stats[f"preemptions carried out ({'yielded' if a.task_id in self.yields_now else 'grace over'})"] += 1
        o = a.owner
        if n.whole and not suspend and o.termed == n.issued and o.killed is None and o.alive():
            self.known_bug(
                "no SIGKILL at the grace's end",
                f"{a.task_id} was taken back; its owner {o.proc} got SIGTERM for it and no SIGKILL at its end",
            )
        a.notice = None
        if not n.whole:
            a.gpus, a.changed = tuple(g for g in a.gpus if g not in n.gpus), self.now
            return
        del self.acked[a.task_id]
        if suspend:
            a.preemptions, a.resume = a.preemptions + 1, True
            self.suspended[a.task_id] = a
            self.stats["allocations suspended"] += 1
        else:
            self.remember(a)
            self.retire(a)

    def on_alloc_changed(self, c: Client, msg: p.AllocChanged) -> None:
        al = msg.allocation
        a = self.held_by(c, al.task_id, msg)
        gpus = tuple(al.gpus)
        why = ""
        if al.state != p.AllocState.RUNNING or (round(al.share * UNIT), al.tenant, al.priority) != (
            a.share,
            a.tenant,
            a.priority,
        ):
            why = "it runs, with its share, tenant and priority"
        elif msg.change == "shrunk":
            n = a.notice
            if a.task_id in self.suspended or n is None or n.whole:
                why = "no partial notice runs"
            else:
                self.taken_back_how(a, n)
                if gpus != tuple(g for g in a.gpus if g not in n.gpus):
                    why = f"shrunk from {a.gpus} by {n.gpus}"
                else:
                    self.taken_back(a, n, False)
                    self.stats["elastic allocations shrunk"] += 1
        elif msg.change == "grown":
            why = "suspended" if a.task_id in self.suspended else self.growth_wrong(a, gpus)
            if not why:
                a.gpus, a.changed = gpus, self.now
                self.stats["elastic allocations grown"] += 1
        elif msg.change == "resumed":
            if a.task_id not in self.suspended or gpus != a.gpus:
                why = f"resumed on its own GPUs {a.gpus}, and only a suspended allocation"
            else:
                self.resumed(a, tuple(al.cpus))
        if why:
            self.fail(f"client {c.cid} got {short(msg)} for {a.task_id} (gpus {a.gpus}): {why}")

    def growth_wrong(self, a: Acked, gpus: tuple[int, ...], *, pushed: bool = True) -> str:
        if a.notice is not None:
            return "an allocation under a notice does not grow"
        if not a.gpus_max or gpus[: len(a.gpus)] != a.gpus or not len(a.gpus) < len(gpus) <= a.gpus_max:
            return f"not a growth of {a.gpus} within {a.gpus_min}..{a.gpus_max}"
        if set(gpus[len(a.gpus) :]) & (self.draining - self.undrain_now):
            return f"grew onto a draining GPU ({sorted(self.draining)})"
        if self.now < a.changed + round(self.config.elastic_cooldown_s * 1e6):
            return f"grew {self.now - a.changed} us after its last change, within elastic_cooldown"
        if pushed:  # judged when the event is over: a waiter served in the same tick may be answered after it
            self.deferred.append(lambda: self.judge_growth(a, gpus))
        else:
            self.judge_growth(a, gpus)
        return ""

    def judge_growth(self, a: Acked, gpus: tuple[int, ...]) -> None:
        if any(prio >= a.priority for prio in self.model_waiters()):
            self.fail(f"{a.task_id} grew to {gpus} while a request of its priority {a.priority} or higher waits")

    def resumed(self, a: Acked, cpus: tuple[int, ...]) -> None:
        del self.suspended[a.task_id]
        a.cpus, a.changed = cpus, self.now
        self.acked[a.task_id] = a
        self.stats["suspended allocations resumed"] += 1

    def remember(self, a: Acked) -> None:
        """Taken back whole (or freed under a whole notice): the task's next allocation hears of it."""
        self.history[a.task_id] = (
            a.preemptions + 1,
            a.on_preempt in (p.Recovery.CHECKPOINT, p.Recovery.SUSPEND) or a.resume,
        )

    def retire(self, a: Acked) -> None:
        """An allocation ends: its notices count in the thrash figures."""
        if a.told:
            bound = (self.now - self.started) // max(1, self.cooldown_us) + 2
            self.victims.append((a.told, a.withdrawn, max(1, self.now - a.created), bound))

    def do_contend(self) -> None:
        """A request that may take something back: whole GPUs or a fraction at a high priority (or a
        tenant's own quota) with a wait, or spot work that fills the node and is taken back first."""
        c = self.pick(self.connected())
        if c is None:
            return
        r = self.rng
        tenant = r.choice([None, None, "team", "team", "lab"])
        if tenant == "team" and not c.admin and c.uid != USERS[0]:
            tenant = "lab"  # team is USERS[0]'s (it may borrow lab's idle quota; lab then takes it back)
        gpus = r.choice({None: [1.0, 1.0, 0.5], "team": [1.0, 0.5], "lab": [0.5, 0.25]}[tenant])
        elastic = tenant is None and gpus == 1.0 and len(self.gpus) > 1 and r.random() < 0.5
        spot = r.random() < 0.35
        msg = p.Allocate(
            id=c.rid(),
            task_id=r.choice([f"c{c.cid}-t{k}" for k in range(3, 6)]),
            gpus=gpus,
            cpus=r.choice([0, 0, 1]),
            tenant=tenant,
            priority=0 if spot else r.choice([self.ceiling(c), self.ceiling(c), 10, 60, 100]),
            wait_ms=0 if spot else r.choice([30, 200, 1000]),
            on_preempt=r.choice(
                [*p.Recovery, p.Recovery.SHRINK] if elastic else [x for x in p.Recovery if x != "shrink"]
            ),
            gpus_max=r.randint(2, len(self.gpus)) if elastic else None,
        )
        if r.random() < 0.6:  # its own process, or a child: the owner a notice nobody listens for signals
            owner = c.pid if r.random() < 0.6 or c.proc is None else self.draw_owner(c)[0]
            msg = msgspec.structs.replace(msg, owner_pid=owner, notify=r.random() < 0.3)
        self.allocate(c, msg)

    def do_yield(self) -> None:
        """A YIELD out of turn: mostly refused (nothing asked it to leave, not its own, unknown)."""
        c = self.pick(self.connected())
        if c is not None:
            self.yield_(c, self.rng.choice([*sorted(self.acked)[:4], "never-allocated"]))

    def do_crash_preempting(self) -> None:
        """gpud crashes while a preemption runs (else time passes)."""
        if any(a.notice is not None for a in self.acked.values()):
            self.stats["daemon crashes during a preemption"] += 1
            return self.do_crash_daemon()
        return self.do_advance()

    # --- taking allocations back: what nobody was told, the admin's requests ---------------------------

    def awake(self) -> bool:
        """The allocations' timer has yet to run for what this event changed (woken, or a new daemon)."""
        return self.woken or self.booting

    def retrying(self) -> bool:
        """The allocations' timer could not store a change and tries again later (STORE_RETRY_US)."""
        return getattr(self.daemon.allocations, "_retry_at", None) is not None

    def reconcile(self) -> None:
        """What changed in the daemon that no client was told because no connection holds the
        allocation now (or the wait was nobody's): carried out on the model, each as the rules allow
        it. A holder's own pushes were applied as they came."""
        d = self.daemon
        led = d.allocations.ledger
        live = {a.task_id: a for a in led.allocations()}
        susp = {a.task_id for a in led.suspended()}
        waits = {r.task_id for r in led.waiting()} | susp
        for a, n in self.withdrawals_now:
            why = self.withdrawal_wrong(n, waits)
            if why:
                self.fail(f"the notice of {a.task_id} ({n}) was withdrawn, but {why}")
        if self.reaps_now:  # the reaper's: what is gone whose owner exited (a notice it had counts as done)
            for t, a in [*self.acked.items(), *self.suspended.items()]:
                if t not in live and t not in susp and a.owner.reapable():
                    self.reaped(a, led.history_of(t), waits)
        for t, a in list(self.acked.items()):
            n, la = a.notice, live.get(t)
            ln = led.notice_of(t) if la is not None else None
            if n is not None and not n.same(ln):
                self.notice_ended(a, n, la, t in susp, waits)
                if ln is not None and t in self.acked:  # and another given in the same tick (nobody holds it)
                    self.noticed_unheld(a, la, ln)
            elif n is None and ln is not None:
                self.noticed_unheld(a, la, ln)
            elif n is not None and self.now >= n.deadline:
                late = self.now - n.deadline
                if not (self.booting or (self.retrying() and late <= MAX_LATE_US)):
                    self.fail(f"the preemption of {t} still runs {late} us after its grace ended ({n})")
                self.stats["events with a preemption late (a store write failed, tried again)"] += not self.booting
            if t in self.acked and la is not None and la.gpus != a.gpus:
                if a.holder is not None:
                    self.fail(f"{t} is on GPUs {la.gpus} in the daemon, {a.gpus} for its holder, who was not told")
                why = self.growth_wrong(a, la.gpus, pushed=False)
                if why:
                    self.fail(f"{t} grew from {a.gpus} to {la.gpus} while nobody held it: {why}")
                a.gpus, a.changed = la.gpus, self.now
                self.stats["elastic allocations grown (nobody told)"] += 1
        for t, a in list(self.suspended.items()):
            if t in live:
                if a.holder is not None or live[t].gpus != a.gpus:
                    self.fail(f"suspended {t} resumed on {live[t].gpus} (its GPUs {a.gpus}) and its holder not told")
                self.resumed(a, live[t].cpus)
        for t, g in list(self.ghosts.items()):
            if t in live and t not in self.acked:
                msg = d.allocations.answer(0, live[t], 0.0)
                _, why = self.made(g.uid, msg, g, g.owner)
                if why:
                    self.fail(f"the wait of {t} restored after a restart was served {short(msg)}: {why}")
                del self.ghosts[t]
                self.stats["restored waits served"] += 1
            elif t not in waits and self.reaps_now and g.owner.reapable():
                del self.ghosts[t]  # withdrawn by the reaper (or served in this tick, then reaped)
                self.waits_ended_now.add(t)
                self.stats["restored waits ended by the reaper (owner exited)"] += 1
            elif t not in waits:
                if self.now < g.earliest:
                    self.fail(f"the wait of {t} restored after a restart ended {g.earliest - self.now} us early")
                del self.ghosts[t]
                self.waits_ended_now.add(t)
                self.stats["restored waits expired"] += 1
            elif self.now > g.answer_by and not (self.booting or self.retrying()):
                self.fail(f"the wait of {t} restored after a restart still waits {self.now - g.answer_by} us late")

    def reaped(self, a: Acked, history: tuple[int, bool], waits: set[str]) -> None:
        """The reaper released ``a``, whose owner exited: as a FREE would (nobody is told), and under a
        notice to leave whole it counts as that preemption done (``history``: the ledger's for the task
        now). In the same tick the notice it had may have been withdrawn first, or one given (nobody
        holds it: it counted as reachable through its owner, dead since)."""
        (self.acked if a.task_id in self.acked else self.suspended).pop(a.task_id)
        n, done = a.notice, history[0] > a.preemptions
        if done and (n is None or not n.whole):
            if n is not None or a.holder is not None or not a.owner.reach:
                self.fail(f"{a.task_id} was reaped as told to leave whole, but its notice is {n}")
            self.stats["allocations told to leave and reaped in one tick (owner exited)"] += 1
        elif n is not None and n.whole and not done:
            why = self.withdrawal_wrong(n, waits)
            if why:
                self.fail(f"the notice of {a.task_id} ({n}) was withdrawn before it was reaped, but {why}")
            self.stats["notices withdrawn, then reaped in one tick (owner exited)"] += 1
        if done:
            self.remember(a)
        self.retire(a)
        self.stats["allocations reaped (owner exited)"] += 1
        self.stats["allocations reaped with a connection holding them (not told)"] += a.holder is not None

    def notice_ended(self, a: Acked, n: NoticeM, la: Any, suspended: bool, waits: set[str]) -> None:
        """The daemon's notice for ``a`` ended and its holder (there is none) was not told:
        withdrawn, or carried out when yielded or at the grace's end."""
        t = a.task_id
        if a.holder is not None:
            now = "gone" if la is None else f"on GPUs {la.gpus}" + (" (suspended)" if suspended else "")
            self.fail(f"the notice of {t} ({n}) ended in the daemon (now {now}) but its holder was not told")
        if la is not None and la.gpus == a.gpus:
            why = self.withdrawal_wrong(n, waits)
            if why:
                self.fail(f"the notice of {t} ({n}) was withdrawn, but {why}")
            self.withdrawn(a, n)
            return
        suspend = self.taken_back_how(a, n)
        if n.whole and (la is not None or suspended != suspend):
            self.fail(f"{t} taken back whole: expected {'suspended' if suspend else 'gone'}, the daemon has it {la}")
        kept = tuple(g for g in a.gpus if g not in n.gpus)  # (it may have grown again since: judged next)
        if not n.whole and (la is None or la.gpus[: len(kept)] != kept):
            self.fail(f"{t} shrunk by {n.gpus} from {a.gpus}: the daemon has it {la}")
        self.taken_back(a, n, suspend)
        self.stats["preemptions carried out (nobody told)"] += 1

    def restored(self, waits: dict[str, tuple[Client, Pending]]) -> None:
        """After a restart: nobody holds anything yet; no victim rests any more (not durable); the
        waits that had victims are back, nobody's request until their clients ask again."""
        led = self.daemon.allocations.ledger
        for a in (*self.acked.values(), *self.suspended.values()):
            a.rested_until = 0
        ghosts, self.ghosts = self.ghosts, {}
        for r in led.waiting():
            c, q = waits.get(r.task_id, (None, None))
            if r.task_id in ghosts:  # restored once more
                self.ghosts[r.task_id] = ghosts[r.task_id]
            elif q is not None and c is not None:
                self.ghosts[r.task_id] = Ghost(
                    r.task_id, c.uid, asked_terms(q.msg), q.info["earliest"], q.deadline or 0, q.info["owner"]
                )
                self.stats["waits restored after a crash"] += 1
            elif r.task_id in self.unstored_waits:
                self.ghosts[r.task_id] = self.unstored_waits[r.task_id]
                self.stats["withdrawn waits back after a crash (the store had failed)"] += 1
            else:
                self.fail(f"a wait for {r.task_id} came back after the restart, but nothing waited for it")
        for t, a in self.acked.items():
            n = self.unstored_notices.get(t)
            if a.notice is None and n is not None and n.same(led.notice_of(t)):
                a.notice = n
                self.stats["withdrawn notices back after a crash (the store had failed)"] += 1
        self.unstored_notices.clear()
        self.unstored_waits.clear()
        lost = [t for t, (_, q) in waits.items() if q.info.get("victims") and t not in self.ghosts]
        if lost:
            self.fail(f"the waits {lost} had victims told to leave for them, and did not survive the restart")

    def answer_drain(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Drain = pend.msg
        if not c.admin:
            self.expect(
                isinstance(msg, p.Error) and msg.code == p.ErrorCode.PERMISSION_DENIED, c, pend, msg, "admins only"
            )
        elif isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED:
            self.expect(self.injected > pend.info["injected"], c, pend, msg, "store_failed without a failed write")
            pend.info["store_failed"] = True
        else:
            was = pend.info["gpu"] in self.draining
            self.expect(
                isinstance(msg, p.Drained) and (msg.draining, msg.was_draining) == (m.on, was),
                c,
                pend,
                msg,
                f"an admin drains (or puts back) GPU {pend.info['gpu']}, which {'drained' if was else 'did not'} before",
            )
            (self.draining.add if m.on else self.draining.discard)(pend.info["gpu"])
            self.stats["GPUs drained" if m.on else "GPUs put back"] += 1

    def answer_protect(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Protect = pend.msg
        a = self.acked.get(m.task_id)
        expected = p.ErrorCode.PERMISSION_DENIED if not c.admin else p.ErrorCode.UNKNOWN_TASK if a is None else None
        if isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED and expected is None:
            self.expect(self.injected > pend.info["injected"], c, pend, msg, "store_failed without a failed write")
            pend.info["store_failed"] = True
        elif isinstance(msg, p.Error):
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'OK'}")
        else:
            self.expect(isinstance(msg, p.Ok) and expected is None, c, pend, msg, f"expected {expected}")
            assert a is not None
            a.protected = m.protected
            self.stats["allocations protected" if m.protected else "allocations unprotected"] += 1

    # --- the client's side of each request ---------------------------------------------------------

    def ceiling(self, c: Client) -> int:
        if c.admin:
            return 100
        return self.config.priority_max_uids.get(str(c.uid), self.config.priority_max)

    def allocation_for(self, c: Client, gpu: int, task_id: str | None) -> Acked | None:
        """The allocation a new session on ``gpu`` belongs to: the one it names, else a fractional one of
        its uid's on the GPU: of the nearest process (the session's, then its ancestors') that owns one
        and runs, else the smallest."""
        alloc = self.acked.get(task_id) if task_id else None
        if alloc is None:
            mine = [a for a in self.acked.values() if a.uid == c.uid and gpu in a.gpus and 0 < a.share < UNIT]
            for pid in self.table.ancestry(c.pid) if mine else ():
                near = [a for a in mine if a.owner.alive() and a.owner.proc is self.table.at[pid]]
                if near:
                    self.stats["sessions that belong to their process's allocation"] += 1
                    return min(near, key=lambda a: (a.share, a.task_id))
            alloc = min(mine, key=lambda a: (a.share, a.task_id), default=None)
        return alloc

    def fraction_ceilings(self, c: Client, gpu: int, task_id: str | None) -> tuple[int, int | None]:
        """What a fractional allocation puts on a new session (core %, memory bytes)."""
        alloc = self.allocation_for(c, gpu, task_id)
        if alloc is None or alloc.share >= UNIT or gpu not in alloc.gpus:
            return 100, None
        return max(1, alloc.share * 100 // UNIT), self.gpus[gpu].total * alloc.share // UNIT

    def all_pending(self, kind: str, client: Client | None = None) -> list[Pending]:
        clients = self.clients if client is None else [client]
        return [q for c in clients for q in c.pending.values() if q.kind == kind]

    def sessions_on(self, gpu: int) -> list[Sess]:
        return [s for c in self.clients for s in c.sessions.values() if s.gpu == gpu]

    def hello(self, c: Client, version: int = p.PROTOCOL_VERSION) -> None:
        pend = self.send(c, p.Hello(id=c.rid(), version=version, name=f"c{c.cid}"), "HELLO")
        self.finish(c, pend)
        self.after_event()

    def connect(self, c: Client, *, greet: bool = True) -> bool:
        d = self.daemon
        refusal = d.links.admission_refusal(c.uid)
        mine = sum(1 for x in self.clients if x.conn is not None and x.uid == c.uid)
        total = sum(1 for x in self.clients if x.conn is not None)
        over = mine >= self.config.max_connections_per_uid or total >= self.config.max_connections
        if (refusal is not None) != over:
            self.fail(
                f"client {c.cid} (uid {c.uid}): admission {refusal} with {mine} of its uid's and {total} "
                f"connections open"
            )
        if refusal is not None:
            self.event("client {}: connection refused ({})", c.cid, refusal[0])
            return False
        c.conn = d.links.open((c.pid, c.uid, c.gid), frozenset(), -1, trio.CancelScope())
        c.gen += 1
        c.frames = p.FrameDecoder(p.MAX_REPLY_BYTES)
        c.greeted = False
        self.event(
            "client {} ({}, uid {}, pid {}) connects: client id {}", c.cid, c.kind, c.uid, c.pid, c.conn.client_id
        )
        self.after_event()
        if greet:
            self.hello(c)
        return True

    def new_client(self) -> Client:
        uid = self.rng.choice([ADMIN_UID, 0, *USERS, USERS[0], USERS[1]])
        cid = len(self.clients) + 1
        c = Client(cid, uid, self.rng.choice(KINDS), pid=0)
        if self.rng.random() < 0.6:  # started from a login shell of its uid (else by init: a service)
            c.shell = self.table.spawn(self.table.init, uid, label=f"shell of client {cid}")
        self.respawn(c)
        self.clients.append(c)
        return c

    def respawn(self, c: Client) -> None:
        """A new process of the client's program (its first, or after a crash)."""
        shell = c.shell if c.shell is not None and c.shell.alive else self.table.init
        c.proc = self.table.spawn(shell, c.uid, label=f"client {c.cid}")
        c.alive, c.pid = True, c.proc.pid

    def attach(
        self,
        c: Client,
        *,
        gpu: int | None = None,
        priority: int | None = None,
        core_limit: int | None = None,
        mem_estimate: Any = "draw",
        task_id: Any = "draw",
        parkable: bool | None = None,
    ) -> Sess | None:
        r = self.rng
        gpu = r.randrange(len(self.gpus)) if gpu is None else gpu
        if priority is None:
            priority = r.choice([0, 0, 0, 0, 10, 10, 50, 60])
        if core_limit is None:
            core_limit = r.choice([100, 100, 100, 50, 20])
        if mem_estimate == "draw":
            mem_estimate = r.choice([None, GIB, 4 * GIB, 8 * GIB])
        if task_id == "draw":
            tasks = sorted(t for t, a in self.acked.items() if 0 < a.share < UNIT)
            task_id = r.choice(tasks) if tasks and r.random() < 0.3 else None
        mem_limit = r.choice([None, None, 2 * GIB, 12 * GIB])
        if parkable is None:
            parkable = r.random() < 0.3
        ref: int | str = gpu if r.random() < 0.8 else r.choice([f"gpu:{gpu}", self.daemon.slots[gpu].gpu.uuid])
        msg = p.Attach(
            id=c.rid(),
            gpu=ref,
            priority=priority,
            core_limit=core_limit,
            mem_limit=mem_limit,
            mem_estimate=mem_estimate,
            task_id=task_id,
            parkable=parkable,
        )
        before = set(c.sessions)
        pend = self.send(c, msg, "ATTACH", gpu=gpu)
        self.finish(c, pend)
        self.after_event()
        new = set(c.sessions) - before
        return c.sessions[new.pop()] if new else None

    def lock_request(self, c: Client, s: Sess) -> None:
        s.state, s.seq, s.requested_at, s.bound = "waiting", next(self._seq), self.now, None
        s.counted = set()
        pend = self.send(c, p.LockRequest(id=c.rid(), session=s.sid), "LOCK_REQUEST", sid=s.sid)
        self.finish(c, pend, answered_now=False)
        if c.conn is not None and s.state == "waiting":
            s.bound = self.lock_bound(s)
        self.after_event()

    def release(self, c: Client, s: Sess, *, grant: int | None, stale: bool = False) -> None:
        if not stale:
            s.state, s.drop_at, s.drop_reason = "idle", None, None
            self.end_hold(s.sid)
        msg = p.LockReleased(id=c.rid(), session=s.sid, grant=grant)
        pend = self.send(c, msg, "LOCK_RELEASED", sid=s.sid, stale=stale)
        self.finish(c, pend, answered_now=stale)
        self.after_event()
        if not stale and c.conn is not None and self.rng.random() < 0.5:
            self.later(self.now + self.rng.randrange(0, 20 * MS), "request", c.cid, c.gen, s.sid)

    def acquire(self, c: Client) -> None:
        r = self.rng
        gpu = r.randrange(len(self.gpus))
        task = r.choice(TASK_TYPES)
        max_wait = r.choice([None, None, 0, 5, 20, 100])
        busy = r.choice([None, None, *p.BusyPolicy])
        msg = p.Acquire(
            id=c.rid(),
            gpu=gpu,
            task_type=task,
            priority=r.choice([None, None, None, 10, 50, 85]),
            max_wait_ms=max_wait,
            hold_max_ms=r.choice([None, 10, 50]),
            queue_limit=r.choice([None, None, 0, 2]),
            busy_policy=busy,
            mem_estimate=r.choice([None, GIB, 4 * GIB, 12 * GIB]),
        )
        terms = self.lease_terms(c, msg)
        idle = not self.occupants(gpu) and self.gpus[gpu].enabled and self.now >= self.grace_end
        idle = idle and not self.parks_needed(gpu, self.need(self.gpus[gpu], msg.mem_estimate, None))
        pend = self.send(c, msg, "ACQUIRE", gpu=gpu, seq=next(self._seq), idle=idle, terms=terms)
        if c.pending.get(pend.rid) is pend:  # not answered yet: it waits
            rec = next(
                (x for x in self.daemon.leases.by_sid.values() if x.conn is c.conn and x.request_id == pend.rid), None
            )
            if rec is None:
                self.fail(f"client {c.cid}: ACQUIRE {pend.rid} got no answer and the arbiter has no record of it")
            assert rec is not None
            if rec.terms != terms:
                self.fail(
                    f"lease terms {rec.terms}, expected {terms} (policy {self.daemon.leases.policies.get(msg.task_type)})"
                )
            pend.info.update(sid=rec.sid, priority=terms.priority, hold_max_us=terms.hold_max_ms * MS)
            pend.deadline = pend.sent_at + terms.max_wait_ms * MS
        self.after_event()

    def resident(self, gpu: int) -> list[Sess]:
        """The parkable sessions whose memory is on the GPU while they do not hold."""
        out = [s for s in self.sessions_on(gpu) if s.parkable and s.state != "holding" and not s.parked]
        for s in out:
            self.park_timeouts(s)
        return out

    def parks_needed(self, gpu: int, need: int) -> bool:
        """Whether a newcomer needing ``need`` bytes on an idle GPU waits for parks: the parkable
        sessions resident there do not fit beside it and one of them may still be asked."""
        gm = self.gpus[gpu]
        resident = self.resident(gpu)
        over = need + sum(self.need(gm, s.mem_estimate, s.mem_used) for s in resident) > gm.capacity
        return over and any(not s.park_refused for s in resident)

    def lease_terms(self, c: Client, m: p.Acquire) -> LeaseTerms | None:
        """The lease's terms: the request's fields, cut to its task type's policy (tighten only), its
        priority cut to the caller's ceiling unless the policy names it. None: a reserved task type
        that does not name the caller, refused."""
        cfg = self.config
        terms = resolve_terms(
            m.task_type,
            self.daemon.leases.policies,
            priority=m.priority,
            busy_policy=m.busy_policy,
            max_wait_ms=m.max_wait_ms,
            queue_limit=m.queue_limit,
            hold_max_ms=m.hold_max_ms,
            mem_estimate=m.mem_estimate,
            default_queue_limit=cfg.lease_queue_limit,
            default_hold_max_ms=cfg.lease_hold_max_ms,
        )
        if c.admin:
            return terms
        policy = cfg.policies.get(m.task_type)
        named = policy is not None and (c.uid in policy.uids or c.gid in policy.gids)
        if policy is not None and (policy.uids or policy.gids):
            return terms if named else None
        return dataclasses.replace(terms, priority=min(terms.priority, self.ceiling(c)))

    def release_lease(self, c: Client, lease_id: str, *, other: bool = False) -> None:
        quiet = not other and self.rng.random() < 0.3
        if not other:
            lease = c.leases.pop(lease_id, None)
            if lease is not None:
                self.end_hold(lease.sid)
        pend = self.send(c, p.Release(id=c.rid(), lease_id=lease_id, quiet=quiet), "RELEASE", other=other)
        self.finish(c, pend, answered_now=not quiet)
        self.after_event()

    def draw_allocate(self, c: Client) -> p.Allocate:
        """An ALLOCATE: whole GPUs, fractions, CPU cores only, bad shapes; priorities of every class
        (spot 0 and production 100 included), each recovery (shrink mostly with an elastic range),
        elastic ranges, an admin's protection, waits; or the same terms again."""
        r = self.rng
        n = len(self.gpus)
        own = [f"c{c.cid}-t{k}" for k in range(3)]
        others = sorted(self.acked)[:3] + sorted(self.suspended)[:1] + sorted(self.ghosts)[:1]
        task = r.choice(own + own + SHARED_TASKS + others)
        gpus = r.choice([1.0, 1.0, 2.0, 0.5, 0.25, 0.3333, 0.0, 1.5, 9.0])
        cpus = r.choice([0, 0, 1, 2] + ([0] if gpus else [1]))
        tenant = r.choice([None, None, None, "team", "lab", "nope"])
        ceiling = self.ceiling(c)  # often its highest: requests that may take lower ones back
        priority = r.choice([None, None, 0, 0, 10, 60, 80, 100, ceiling, ceiling])
        priority_class = r.choice([None, None, None, *p.PriorityClass]) if priority is None else None
        wait_ms = r.choice([0, 0, 0, 20, 50, 200, 1000])
        on_preempt = r.choice(list(p.Recovery))
        gpus_max = None
        if gpus in (1.0, 2.0) and r.random() < 0.3:
            gpus_max = r.randint(int(gpus) + 1, n) if gpus < n and r.random() < 0.9 else r.randint(1, n + 1)
        if on_preempt == p.Recovery.SHRINK and gpus_max is None and r.random() < 0.8:
            on_preempt = p.Recovery.TERMINATE  # shrink is for elastic ranges (a few are refused)
        prefer: list[int | str] = r.choice([[], [], [], [0], [n - 1], [], [], [0], [1 % n], [7]])
        held = self.acked.get(task) or self.suspended.get(task)
        if held is not None and r.random() < 0.5:  # a repeat with the same terms (prefer, strategy, wait may differ)
            return msgspec.structs.replace(
                held.again(c.rid(), wait_ms=wait_ms), prefer=prefer, strategy=r.choice(list(p.Strategy))
            )
        owner_pid, any_uid = self.draw_owner(c) if r.random() < 0.5 else (None, False)
        return p.Allocate(
            id=c.rid(),
            task_id=task,
            gpus=gpus,
            cpus=cpus,
            prefer=prefer,
            strategy=r.choice(list(p.Strategy)),
            tenant=tenant,
            priority=priority,
            priority_class=priority_class,
            wait_ms=wait_ms,
            on_preempt=on_preempt,
            gpus_max=gpus_max,
            protected=r.random() < 0.08,
            # False: a one-shot gpuctl alloc, which does not listen for PREEMPT (its owner is signalled)
            notify=r.random() < (0.9 if owner_pid is None else 0.4),
            owner_pid=owner_pid,
            owner_any_uid=any_uid,
        )

    def allocate_refusal(
        self, c: Client, msg: p.Allocate, waiting: dict[str, Pending]
    ) -> tuple[p.ErrorCode | None, str]:
        """How the daemon must refuse ``msg`` (None: it allocates, or the request waits), and what the
        refusal's message must say ("" : anything), in the order it checks: the task's owner, the
        tenant's members, the priority ceiling, protection, a new task's owner process, prefer, the
        terms of what the task holds or waits for, the request's shape, the tenant."""
        task, n = msg.task_id, len(self.gpus)
        held = self.acked.get(task) or self.suspended.get(task)
        ghost = self.ghosts.get(task)
        owner_uid = held.uid if held else waiting[task].info["uid"] if task in waiting else ghost and ghost.uid
        member = self.config.tenants.get(msg.tenant or "")
        priority = None if msg.priority is None and msg.priority_class is None else asked_priority(msg)
        gpus = round(msg.gpus * UNIT)
        if owner_uid is not None and owner_uid != c.uid and not c.admin:
            return p.ErrorCode.PERMISSION_DENIED, ""
        if (
            member is not None
            and (member.uids or member.gids)
            and c.uid not in member.uids
            and c.gid not in member.gids
            and not c.admin
        ):
            return p.ErrorCode.PERMISSION_DENIED, ""
        if (priority or 0) > self.ceiling(c):
            return p.ErrorCode.PERMISSION_DENIED, ""
        if msg.existing and held is None:  # only the allocation the task holds, never a new one
            return p.ErrorCode.UNKNOWN_TASK, ""
        if msg.protected and not c.admin:
            return p.ErrorCode.PERMISSION_DENIED, ""
        if held is None and task not in waiting and ghost is None and msg.owner_pid is not None:
            why = self.owner_refusal(c, msg.owner_pid, any_uid=msg.owner_any_uid)
            if why:
                return p.ErrorCode.PERMISSION_DENIED, why
        if 7 in msg.prefer:
            return p.ErrorCode.UNKNOWN_GPU, ""
        if held is not None:  # the same allocation again for the same terms, refused for others
            return (None if asked_terms(msg) == held.terms else p.ErrorCode.INVALID), ""
        if task in waiting:
            return p.ErrorCode.INVALID, ""
        if ghost is not None:  # its wait outlived the daemon: the same terms take it up again
            return (None if asked_terms(msg) == ghost.terms else p.ErrorCode.INVALID), ""
        bad_shape = msg.gpus in (1.5, 9.0) or (gpus == 0 and msg.cpus == 0) or msg.gpus > n
        if msg.gpus_max is not None:
            bad_shape = bad_shape or gpus < UNIT or gpus % UNIT != 0 or msg.gpus_max <= gpus // UNIT or msg.gpus_max > n
        elif msg.on_preempt == p.Recovery.SHRINK:
            bad_shape = True
        if bad_shape:
            return p.ErrorCode.INVALID, ""
        if msg.tenant == "nope":
            return p.ErrorCode.UNKNOWN_TENANT, ""
        return None, ""

    def owner_refusal(self, c: Client, pid: int, *, any_uid: bool) -> str:
        """What the refusal of ``pid`` as the owner of a new task of ``c`` says ("": none), by the
        rules of docs/security.md, read off the process table: never init, gpud or a kernel thread;
        where /proc shows nothing, only the caller itself; the caller's uid must be the target's real
        or saved uid (unless an admin says owner_any_uid); the target must be the caller, an ancestor
        of its uid, or a descendant of one of those."""
        t = self.table
        target = t.live(pid)
        if any_uid and not c.admin:
            return "owner_any_uid needs admin rights"
        if pid <= 1:
            return "is init"
        if pid == t.daemon.pid:
            return "is gpud itself"
        if target is not None and target.kthread and not t.hidden:
            return "is a kernel thread"
        if target is None or t.hidden:
            return "" if pid == c.pid else "cannot read that process's credentials"
        if any_uid:
            return ""
        if c.uid not in (target.ruid, target.suid):
            return f"belongs to uid {target.ruid}, not to you"
        assert c.proc is not None
        lineage, up = [c.proc], c.proc.parent
        while up is not None and up.pid > 1 and up.ruid == c.uid:
            lineage.append(up)
            up = up.parent
        up = target
        while up is not None and up.pid > 1:
            if up in lineage:
                return ""
            up = up.parent
        return "is not yours to name"

    def claimed(self, c: Client, pid: int) -> Proc:
        """The process an owner pid the rules accept names: the caller itself where /proc shows nothing."""
        proc = c.proc if self.table.hidden else self.table.live(pid)
        assert proc is not None and proc.pid == pid
        return proc

    def draw_owner(self, c: Client) -> tuple[int, bool]:
        """An owner pid for a new task of ``c``, and whether it says owner_any_uid: mostly its own process
        or one of its lineage, else something the rules refuse (or take only from an admin)."""
        t, r = self.table, self.rng
        assert c.proc is not None
        kind = r.choices(OWNER_KINDS, [w for _, w in OWNER_WEIGHTS])[0]
        self.stats[f"owner pids drawn: {kind}"] += 1
        any_uid = r.random() < (0.4 if c.admin else 0.03)
        if kind == "own":
            return c.pid, any_uid and r.random() < 0.2
        if kind in ("child", "setuid child", "dropped child", "grandchild"):
            kids = [k for k in t.children(c.proc) if k.ruid == c.uid]
            if kind == "child" and kids and r.random() < 0.6:
                return r.choice(kids).pid, False
            parent = r.choice(kids) if kind == "grandchild" and kids else c.proc
            ruid, euid, suid = {"setuid child": (c.uid, 0, 0), "dropped child": (0, c.uid, 0)}.get(kind, (c.uid,) * 3)
            child = t.spawn(parent, ruid, euid=euid, suid=suid, label=f"{kind} of client {c.cid}")
            return child.pid, any_uid
        if kind in ("shell", "sibling"):
            if c.shell is None or not c.shell.alive:
                return c.pid, False
            if kind == "shell":
                return c.shell.pid, False
            return t.spawn(c.shell, c.uid, label=f"sibling of client {c.cid}").pid, False
        if kind in ("another uid", "another session"):
            uid = c.uid if kind == "another session" else r.choice([u for u in (0, *USERS) if u != c.uid])
            theirs = [x.proc for x in self.clients if x is not c and x.uid == uid and x.proc and x.proc.alive]
            if theirs and r.random() < 0.5:
                return r.choice(theirs).pid, any_uid
            return t.spawn(t.init, uid, label=f"a process of uid {uid}").pid, any_uid
        if kind == "exited":
            gone = sorted(x.pid for x in t.at.values() if not x.alive)
            if gone:
                return r.choice(gone), any_uid
            child = t.spawn(c.proc, c.uid, label=f"child of client {c.cid}")
            self.exits(child, "a short-lived child")
            return child.pid, any_uid
        if kind == "reused":
            return self.reuse(r.choice([x for x in t.at.values() if not x.alive] or [None])).pid, any_uid
        return {"init": 1, "gpud": t.daemon.pid, "kernel thread": t.kthread.pid}.get(kind, 999_999), any_uid

    def reuse(self, old: Proc | None) -> Proc:
        """A new process takes the pid of ``old``, which exited (None: a child that exits at once first);
        of the same uid mostly, started by a live client's process or by init."""
        t, r = self.table, self.rng
        if old is None:
            old = t.spawn(t.init, r.choice([0, *USERS]), label="a short-lived process")
            self.exits(old, "it was short-lived")
        uid = old.ruid if r.random() < 0.7 else r.choice([0, *USERS])
        parents = [x.proc for x in self.clients if x.proc is not None and x.proc.alive and x.uid == uid]
        parent = r.choice(parents) if parents and r.random() < 0.6 else t.init
        new = t.spawn(parent, uid, pid=old.pid, label=f"pid reused (was {old.label or 'a process'})")
        self.event("a new process takes the pid of {}: {}", old, new)
        self.stats["pids reused"] += 1
        return new

    def exits(self, proc: Proc | None, why: str) -> None:
        """``proc`` exits (a dead owner's allocations are the reaper's from now on)."""
        if proc is None or not proc.alive:
            return
        self.table.kill(proc)
        self.event("{} exits ({})", proc, why)
        if any(o.proc is proc and o.held for o in self.owners_m().values()):
            self.stats["owner processes exited"] += 1
        c = next((x for x in self.clients if x.proc is proc), None)
        if c is not None:  # a client's own process: its connection ends with it
            c.alive = False
            if c.conn is not None:
                self.lose_connection(c, f"its process exited ({why})", crashed=True)

    def allocate(self, c: Client, msg: p.Allocate | None = None) -> None:
        msg = msg or self.draw_allocate(c)
        task = msg.task_id
        waiting = {q.msg.task_id: q for q in self.all_pending("ALLOCATE") if q.deadline is not None}
        expected, why = self.allocate_refusal(c, msg, waiting)
        ghost = self.ghosts.get(task) if expected is None else None
        suspended = expected is None and task in self.suspended
        owner = ghost.owner if ghost is not None else OwnerM()
        fresh = task not in self.acked and task not in self.suspended and task not in waiting and ghost is None
        if expected is None and fresh and msg.owner_pid is not None:  # claimed: held from now on
            owner = OwnerM(self.claimed(c, msg.owner_pid), msg.owner_any_uid, held=True)
        elif expected is None and c.proc is not None and msg.owner_pid == c.proc.pid:
            prev = self.acked.get(task) or self.suspended.get(task)  # asked again by the owner itself:
            o = prev.owner if prev is not None else None  # held again where a restart could not
            if o is not None and not o.held and o.proc is c.proc and c.proc.alive:
                o.held, o.orphan_at, o.reach = True, None, True
        cp, waiters = self.daemon.allocations.ledger.checkpoint(), dict(self.daemon.allocations.waiters)
        injected = self.injected
        pend = self.send(
            c,
            msg,
            "ALLOCATE",
            uid=c.uid,
            client=c,
            expected=expected,
            why=why,
            owner=owner,
            injected=injected,
            waiting_tasks=sorted(waiting),
            suspended=suspended,
        )
        if c.pending.get(pend.rid) is pend:
            if ghost is not None:  # it waits again, as the ledger kept it, for this connection (its owner too)
                pend.deadline = max(ghost.answer_by, pend.info.get("answer_by", 0))
                pend.info.update(rejoin=True, earliest=ghost.earliest, victims=True)
                del self.ghosts[task]
            elif msg.wait_ms == 0:
                self.fail(f"client {c.cid}: ALLOCATE with wait_ms 0 was not answered at once")
            else:
                pend.info["earliest"] = pend.sent_at + msg.wait_ms * MS
                pend.deadline = max(pend.info["earliest"], pend.info.get("answer_by", 0))
            self.wait_priority[task] = (asked_priority(msg), msg.tenant)
        if pend.info.get("store_failed"):
            self.check_rolled_back(cp, waiters, f"ALLOCATE {task}")
        self.after_event()

    def free(self, c: Client, task: str | None = None) -> None:
        r = self.rng
        waiting = {q.msg.task_id: q for q in self.all_pending("ALLOCATE") if q.deadline is not None}
        if task is None:
            mine = sorted(t for t, a in [*self.acked.items(), *self.suspended.items()] if a.uid == c.uid)
            everyone = sorted(self.acked) + sorted(self.suspended)
            task = r.choice(
                mine + mine + mine + everyone + sorted(waiting) * 2 + sorted(self.ghosts) + ["never-allocated"]
            )
        alloc = self.acked.get(task) or self.suspended.get(task)
        waiter = waiting.get(task)
        ghost = self.ghosts.get(task)
        expected: p.ErrorCode | None = None
        if alloc is None and ghost is not None:  # a wait restored after a restart: its uid's to withdraw
            expected = p.ErrorCode.PERMISSION_DENIED if ghost.uid != c.uid and not c.admin else None
        elif alloc is None and waiter is None:
            expected = p.ErrorCode.UNKNOWN_TASK
        elif alloc is None:
            assert waiter is not None
            if waiter.info["client"] is not c and not c.admin:
                expected = p.ErrorCode.PERMISSION_DENIED
        elif not c.admin and alloc.uid != c.uid:
            tenant = self.config.tenants.get(alloc.tenant or "")
            if tenant is None or (c.uid not in tenant.uids and c.gid not in tenant.gids):
                expected = p.ErrorCode.PERMISSION_DENIED
        if waiter is not None and expected is None and alloc is None:
            waiter.info["withdrawn"] = True
            self.wait_ended(waiter.info["client"], waiter)
        if alloc is not None and alloc.notice is not None and expected is None:
            self.yields_now.add(task)  # freed under a notice: that preemption is done
        cp, waiters = self.daemon.allocations.ledger.checkpoint(), dict(self.daemon.allocations.waiters)
        injected = self.injected
        pend = self.send(
            c, p.Free(id=c.rid(), task_id=task), "FREE", expected=expected, waiter=waiter, injected=injected
        )
        self.finish(c, pend)
        if pend.info.get("store_failed"):
            self.check_rolled_back(cp, waiters, f"FREE {task}")
        self.after_event()

    def check_rolled_back(self, cp: Any, waiters: dict[str, Any], what: str) -> None:
        led, alloc = self.daemon.allocations.ledger, self.daemon.allocations
        if led.checkpoint() != cp:
            self.fail(f"{what}: the store write failed but the ledger is not as it was before")
        if dict(alloc.waiters) != waiters:
            self.fail(
                f"{what}: the store write failed but the allocation waiters changed "
                f"({sorted(waiters)} -> {sorted(alloc.waiters)})"
            )

    # --- the bound on a lock wait -----------------------------------------------------------------

    def hold_bound(self, gpu: int, kind: str, client: Client, hold_max_us: int | None) -> int | None:
        """How long one grant can keep a waiting request behind it waiting (None: unbounded).

        A session: while the request we bound waits, an unthrottled waiter exists (that
        request itself: only unlimited sessions get a bound), so the daemon drops every
        session holder (reason tq) once it has held TQ since its grant: a holder granted
        at g leaves by g + TQ + drop_timeout (released, or revoked drop_timeout after
        the DROP_LOCK); one that already held the GPU when the request came (at t0) is
        dropped at max(g + TQ, t0) and leaves by t0 + TQ + drop_timeout. Drops for
        quota, preemption or memory only come earlier (and are revoked just as late).
        So TQ + drop_timeout, counted from the grant or from the request, whichever is
        later. A lease is never dropped: hold_max if the daemon releases it by force,
        else only the client's own habit (the model's longest hold for its kind, or
        never, for an abandoner, and then there is no bound)."""
        if kind == "session":
            return self.gpus[gpu].tq_us + self.dt_us
        own = LEASE_HOLD_MAX_US[client.kind]
        if self.config.lease_force_release and hold_max_us is not None:
            return hold_max_us if own is None else min(own, hold_max_us)
        return own

    def occupants(self, gpu: int) -> list[tuple[str, Client, int, int, int, bool, int | None]]:
        """(kind, client, sid, seq, priority, holding, hold_max_us) of everything on the GPU."""
        out: list[tuple[str, Client, int, int, int, bool, int | None]] = []
        for c in self.clients:
            for s in c.sessions.values():
                if s.gpu == gpu and s.state != "idle":
                    out.append(("session", c, s.sid, s.seq, s.priority, s.state == "holding", None))
            for lease in c.leases.values():
                if lease.gpu == gpu:
                    out.append(("lease", c, lease.sid, lease.seq, lease.priority, True, lease.hold_max_us))
            for q in c.waiting_leases():
                if q.info["gpu"] == gpu:
                    out.append(
                        ("lease", c, q.info["sid"], q.info["seq"], q.info["priority"], False, q.info["hold_max_us"])
                    )
        return out

    def lock_bound(self, s: Sess) -> int | None:
        """The latest a LOCK_REQUEST that waits must be granted, as far as TQ and
        drop_timeout bound it; None where nothing does (a limited session also waits for
        its budget; a lease ahead held by a client that never gives it back, with no
        forced release).

        The derivation. Let t0 = max(the request, the end of the restart grace: nothing
        is granted before). Ahead of the request are the holders and the waiters before
        it in the queue's order (higher priority first, then arrival). Nobody behind it
        is admitted before it (``note_grants`` checks the order), and the GPU is never
        idle while it waits unthrottled (``check_queue_match``), so it waits only while
        someone ahead holds the GPU. Each of those holds at most ``hold_bound`` counted
        from its grant or from t0, whichever is later, and the next one ahead is granted
        the moment the previous one leaves (in serial mode; in concurrent mode several
        hold at once, which only shortens the wait). Hence it is granted by

            t0 + the sum of hold_bound over everyone ahead of it at t0,

        exact in serial mode (each holds the GPU alone, one after the other) and generous
        in concurrent mode. A request arriving later with a higher priority legitimately
        goes ahead: each such grant extends the bound by its own hold_bound when it
        happens (``note_grants``). Parking: a grant also waits while a PARK is out (the
        GPU may then be idle); each PARK is over within park_timeout (answered, timed
        out, or its session granted), so one out at t0 adds what is left of it, and
        each one asked later park_timeout when it is asked (``on_park``). A change of
        mode, TQ or the scheduler switch on the GPU changes the rules the bound was
        derived under: it is voided (``apply_admin``)."""
        gm = self.gpus[s.gpu]
        if not gm.enabled or s.core_limit < 100:
            return None
        total = 0
        for kind, client, sid, seq, priority, holding, hold_max in self.occupants(s.gpu):
            if sid == s.sid:
                continue
            if holding or (-priority, seq) < (-s.priority, s.seq):
                bound = self.hold_bound(s.gpu, kind, client, hold_max)
                if bound is None:
                    return None
                total += bound
                s.counted.add((sid, seq))
        for other in self.sessions_on(s.gpu):  # a grant may wait for a PARK already out: at most its rest
            if other.park_asked is not None:
                total += max(0, other.park_asked + self.pt_us - self.now)
        return max(self.now, self.grace_end) + total

    def note_grants(self) -> None:
        """Grants of this event: numbered in order, in queue order, extending bounds for those
        who legitimately went ahead."""
        for gm in self.gpus:
            numbers = sorted(x[4] for x in self.grants_now if x[0] == gm.index and x[4])
            if numbers and (numbers[0] <= gm.last_grant or len(set(numbers)) != len(numbers)):
                self.fail(f"GPU {gm.index}: grants {numbers} after grant {gm.last_grant} (numbers must grow)")
            if numbers:
                gm.last_grant = numbers[-1]
        for gpu, sid, seq, priority, _ in self.grants_now:
            gm = self.gpus[gpu]
            if not gm.enabled:
                continue
            self.stats[f"grants checked for queue order ({gm.mode})"] += 1
            view = {w.session: w for w in self.daemon.slots[gpu].scheduler.view(self.now).queue}
            for c in self.clients:
                for s in c.sessions.values():
                    if s.gpu != gpu or s.state != "waiting" or s.sid == sid:
                        continue
                    # Only a waiter that cannot have been throttled at the grant (no limit, none set in
                    # this event) is certain to have been passed over.
                    unlimited = s.core_limit >= 100 and not s.limits_changed
                    if unlimited and s.sid in view and (-s.priority, s.seq) < (-priority, seq):
                        self.fail(
                            f"GPU {gpu}: {sid} (priority {priority}, arrival {seq}) granted while session "
                            f"{s.sid} (priority {s.priority}, arrival {s.seq}) waits ahead of it"
                        )
                    if s.bound is not None and (sid, seq) not in s.counted:
                        s.counted.add((sid, seq))
                        owner = next(
                            (
                                x
                                for x in self.clients
                                if sid in x.sessions or any(lease.sid == sid for lease in x.leases.values())
                            ),
                            None,
                        )
                        if owner is None:
                            continue  # gone in the same event: it holds nothing any more
                        lease = next((lease for lease in owner.leases.values() if lease.sid == sid), None)
                        extra = self.hold_bound(
                            gpu, "lease" if lease else "session", owner, lease.hold_max_us if lease else None
                        )
                        s.bound = None if extra is None else s.bound + extra
        self.grants_now.clear()
        for c in self.clients:
            for s in c.sessions.values():
                s.limits_changed = False

    # --- the daemon's timers and the clients' own time --------------------------------------------

    def next_due(self) -> int | None:
        d = self.daemon
        times = [t for t in (s.scheduler.next_deadline() for s in d.slots) if t is not None]
        ledger = d.allocations.next_deadline()  # the ledger's, or when a change the store refused is tried again
        if ledger is not None:
            times.append(ledger)
        if self.agenda:
            times.append(self.agenda[0][0])
        if self.woken:
            times.append(self.now)
        if self.reap_us:
            times.append(self.next_reap)
        return min(times, default=None)

    def advance(self, to: int) -> None:
        """Move time to ``to``, running every deadline on the way at its instant, as the
        shell's timer tasks do, and every client action planned before it."""
        while (due := self.next_due()) is not None and due <= to:
            self.now = max(self.now, due)
            self.run_due()
        self.now = max(self.now, to)

    def run_due(self) -> None:
        """Every timer due now (one event: the timers of one instant), then the clients'
        actions planned for now, one event each."""
        d = self.daemon
        fired = []
        for slot in d.slots:
            deadline = slot.scheduler.next_deadline()
            if deadline is not None and deadline <= self.now:
                fired.append(f"GPU {slot.gpu.index}")
                tick_gpu(d, slot, self.now)
                self.deliver()
        deadline = d.allocations.next_deadline()
        reap = bool(self.reap_us) and self.now >= self.next_reap
        if self.woken or (deadline is not None and deadline <= self.now) or reap:
            # (a reaper's round that finds no owner dead and changes nothing is no event)
            busy = self.woken or (deadline is not None and deadline <= self.now) or d.allocations.owners.orphaned()
            writes = self.writes
            self.woken = False
            tick_allocations(d, self.now, reap=reap)
            if reap:
                self.next_reap = self.now + self.reap_us
            if busy or self.writes != writes:
                fired.append("allocations" + (" (reaper)" if reap else ""))
            else:
                self.reaps_now = False
            self.booting = False
            self.deliver()
        if fired:
            self.event("timers: {}", ", ".join(fired))
            self.after_event()
            deadline = d.allocations.next_deadline()
            if deadline is not None and deadline <= self.now and not d.allocations.reaping:
                self.fail(f"an allocation deadline {self.now - deadline} us old is due but was not acted on")
            self.spins = self.spins + 1 if self.now == self.last_due else 0
            self.last_due = self.now
            if self.spins > 1000:
                self.fail("the timers make no progress: their deadlines stay due")
        while self.agenda and self.agenda[0][0] <= self.now:
            _, _, what, args = heapq.heappop(self.agenda)
            getattr(self, "later_" + what)(*args)

    def client(self, cid: int, gen: int | None) -> Client | None:
        c = self.clients[cid - 1]
        if c.conn is None or not c.greeted or (gen is not None and c.gen != gen):
            return None
        return c

    def later_release(self, cid: int, gen: int, sid: int, grant: int) -> None:
        c = self.client(cid, gen)
        s = c.sessions.get(sid) if c else None
        if c is None or s is None:
            return
        if s.state == "holding" and s.grant == grant:
            self.release(c, s, grant=grant if self.rng.random() < 0.8 else None)
        elif c.kind in ("slow", "stubborn"):  # too late: it was revoked meanwhile
            self.release(c, s, grant=grant, stale=True)

    def later_request(self, cid: int, gen: int, sid: int) -> None:
        c = self.client(cid, gen)
        s = c.sessions.get(sid) if c else None
        if c is not None and s is not None and s.state == "idle":
            self.lock_request(c, s)

    def later_parked(self, cid: int, gen: int, sid: int, ok: bool) -> None:
        """The answer to a PARK: also late (after park_timeout) or after the session has held
        since; the daemon takes either as the program's state now, unless it holds."""
        c = self.client(cid, gen)
        s = c.sessions.get(sid) if c else None
        if c is None or s is None:
            return
        self.park_timeouts(s)
        if s.state != "holding":
            if ok:
                s.parked, s.parks = True, s.parks + 1
            else:
                s.park_refused = True
            self.stats["parks answered " + ("ok" if ok else "not ok (refused)")] += 1
            if s.park_asked is None:
                self.stats["parks answered after park_timeout or a grant"] += 1
        s.park_asked = None
        self.parks_now.add(s.gpu)
        msg = p.Parked(id=c.rid(), session=sid, ok=ok, message="" if ok else "no host memory")
        pend = self.send(c, msg, "PARKED", expected=None)
        self.finish(c, pend, answered_now=False)
        self.after_event()

    def later_lease_release(self, cid: int, gen: int, lease_id: str) -> None:
        c = self.client(cid, gen)
        if c is not None and lease_id in c.leases:
            self.release_lease(c, lease_id)

    def later_reconnect(self, cid: int) -> None:
        """The client library after the daemon came back: connect, HELLO, ask again for the
        allocations it holds and the waits it had (a runner's way), attach again."""
        c = self.clients[cid - 1]
        if c.conn is not None or not c.alive:
            return
        intents, c.intents = c.intents, []
        if not self.connect(c):
            self.later(self.now + self.rng.randrange(MS, 50 * MS), "reconnect", cid)
            c.intents = intents
            return
        again, c.alloc_intents = c.alloc_intents, []
        for m in again:
            if c.conn is None or not c.greeted:
                return
            if self.rng.random() < 0.8:
                self.allocate(c, msgspec.structs.replace(m, id=c.rid()))
        for intent in intents:
            if c.conn is None or not c.greeted:
                return
            s = self.attach(
                c,
                gpu=intent["gpu"],
                priority=intent["priority"],
                core_limit=intent["core_limit"],
                mem_estimate=intent["mem_estimate"],
                task_id=intent["task_id"],
                parkable=intent["parkable"],
            )
            if s is not None and intent["busy"] and c.conn is not None:
                self.lock_request(c, s)

    # --- one step -----------------------------------------------------------------------------------

    STEPS: list[tuple[str, float]] = [
        ("advance", 30),
        ("connect", 3),
        ("attach", 6),
        ("lock_request", 14),
        ("release", 3),
        ("detach", 1.5),
        ("mem_update", 3),
        ("set_limits", 2.5),
        ("acquire", 9),
        ("release_lease", 1.5),
        ("allocate", 7),
        ("free", 4),
        ("admin", 3),
        ("query", 1.5),
        ("misc", 1.5),
        ("crash_client", 1.2),
        ("crash_daemon", 0.35),
        ("restart_daemon", 0.15),
        ("yield", 0.4),
        ("contend", 5),
        ("crash_preempting", 1.5),
        ("owner_exits", 1.2),
        ("pid_reuse", 0.6),
    ]

    def run(self) -> None:
        names = [n for n, _ in self.STEPS]
        weights = [CHURN.get(n, w) if self.churn else w for n, w in self.STEPS]
        with quiet_logs():
            try:
                for _ in range(2):
                    self.do_connect()
                for self.step_no in range(1, self.steps + 1):  # noqa: B020 - the step number is state the trace reads
                    step = self.rng.choices(names, weights)[0]
                    getattr(self, "do_" + step)()
                    if self.woken:  # the allocations' timer was woken: it runs now
                        self.advance(self.now)
                    if self.step_no % 50 == 0:
                        self.check_fresh_store()
                self.check_fresh_store()
                for a in [*self.acked.values(), *self.suspended.values()]:
                    self.retire(a)
            finally:
                with contextlib.suppress(Exception):
                    self.daemon.allocations.store.close()
                shutil.rmtree(self.state_dir, ignore_errors=True)

    def pick(self, items: list[Any]) -> Any:
        return self.rng.choice(items) if items else None

    def do_advance(self) -> None:
        r = self.rng
        gm = self.gpus[0]
        step = r.choice([0, 100, MS, 3 * MS, gm.tq_us // 2, gm.tq_us, self.dt_us, 30 * MS, 150 * MS])
        self.advance(self.now + step)

    def do_connect(self) -> None:
        idle = [c for c in self.clients if c.conn is None]
        if len(self.clients) < MAX_CLIENTS and (not idle or self.rng.random() < 0.5):
            c = self.new_client()
        else:
            c = self.pick(idle)
            if c is None:
                return self.do_advance()
            if not c.alive:  # a new process of the same program
                self.respawn(c)
        self.connect(c, greet=self.rng.random() < 0.97)

    def do_attach(self) -> None:
        c = self.pick(self.connected())
        if c is not None:
            self.attach(c)

    def do_lock_request(self) -> None:
        idle = [(c, s) for c in self.connected() for s in c.sessions.values() if s.state == "idle"]
        if not idle:
            return self.do_attach()
        self.lock_request(*self.pick(idle))

    def do_release(self) -> None:
        holding = [(c, s) for c in self.connected() for s in c.sessions.values() if s.state == "holding"]
        if holding:
            c, s = self.pick(holding)
            self.release(c, s, grant=s.grant)

    def do_detach(self) -> None:
        some = [(c, s) for c in self.connected() for s in c.sessions.values()]
        if not some:
            return
        c, s = self.pick(some)
        del c.sessions[s.sid]
        self.end_hold(s.sid)
        pend = self.send(c, p.Detach(id=c.rid(), session=s.sid), "DETACH")
        self.finish(c, pend)
        self.after_event()

    def do_mem_update(self) -> None:
        some = [(c, s) for c in self.connected() for s in c.sessions.values()]
        if not some:
            return
        c, s = self.pick(some)
        s.mem_used = self.rng.choice([0, GIB, 6 * GIB, 12 * GIB, 15 * GIB])
        pend = self.send(c, p.MemUpdate(id=c.rid(), session=s.sid, used_bytes=s.mem_used), "MEM_UPDATE")
        self.finish(c, pend, answered_now=False)
        self.after_event()

    def do_set_limits(self) -> None:
        c = self.pick(self.connected())
        if c is None:
            return
        r = self.rng
        target = c if r.random() < 0.6 else self.pick(self.connected())
        gpu = r.choice([None, None, r.randrange(len(self.gpus))])
        sids = sorted(target.sessions)
        session = r.choice([None, None, *sids[:2]])
        core = r.choice([None, 10, 30, 60, 100])
        mem = r.choice([None, None, 0, 4 * GIB])
        if core is None and mem is None:
            core = 50
        chosen = [
            s
            for s in target.sessions.values()
            if (gpu is None or s.gpu == gpu) and (session is None or s.sid == session)
        ]
        msg = p.SetLimits(
            id=c.rid(),
            client=None if target is c else target.client_id,
            gpu=gpu,
            session=session,
            core_limit=core,
            mem_limit=mem,
        )
        pend = self.send(c, msg, "SET_LIMITS", target=target, chosen=chosen)
        self.finish(c, pend)
        self.after_event()

    def do_acquire(self) -> None:
        c = self.pick(self.connected())
        if c is not None:
            self.acquire(c)

    def do_release_lease(self) -> None:
        c = self.pick(self.connected())
        if c is None:
            return
        others = [lid for x in self.clients if x is not c for lid in x.leases]
        roll = self.rng.random()
        if c.leases and roll < 0.7:
            self.release_lease(c, self.pick(sorted(c.leases)))
        elif others and roll < 0.85:
            self.release_lease(c, self.pick(sorted(others)), other=True)
        else:
            self.release_lease(c, "gone-1")  # released already, or never existed: OK all the same

    def do_allocate(self) -> None:
        c = self.pick(self.connected())
        if c is not None:
            self.allocate(c)

    def do_free(self) -> None:
        c = self.pick(self.connected())
        if c is not None:
            self.free(c)

    def do_admin(self) -> None:
        admins = [c for c in self.connected() if c.admin]
        c = self.pick(admins) if admins and self.rng.random() < 0.85 else self.pick(self.connected())
        if c is None:
            return
        r = self.rng
        gpu = r.choice([None, r.randrange(len(self.gpus))])
        off = [gm.index for gm in self.gpus if not gm.enabled]
        op = r.choices(["mode", "tq", "sched", "policy", "reset", "drain", "protect"], [4, 2, 2, 2, 0.4, 1.2, 1.2])[0]
        rid = c.rid()
        info: dict[str, Any] = {}
        if op == "mode":
            msg: Any = p.SetMode(id=rid, mode=r.choice(list(p.Mode)), gpu=gpu)
        elif op == "tq":
            msg = p.SetTq(id=rid, seconds=r.choice([0.005, 0.02, 0.1]), gpu=gpu)
        elif op == "sched":
            msg = p.SchedOn(id=rid, gpu=gpu) if off and r.random() < 0.8 else p.SchedOff(id=rid, gpu=gpu)
        elif op == "policy":
            msg = p.SetPolicy(
                id=rid,
                task_type=r.choice(TASK_TYPES),
                priority=r.choice([None, 40, 95]),
                max_wait_ms=r.choice([None, 0, 30]),
                queue_limit=r.choice([None, 1, 4]),
                hold_max_ms=r.choice([None, 20]),
                busy_policy=r.choice([None, *p.BusyPolicy]),
            )
        elif op == "drain":
            g = r.randrange(len(self.gpus))
            on = g not in self.draining if r.random() < 0.8 else r.random() < 0.5
            ref: int | str = g if r.random() < 0.7 else r.choice([f"gpu:{g}", self.daemon.slots[g].gpu.uuid])
            msg = p.Drain(id=rid, gpu=ref, on=on)
            info["gpu"] = g
            # Its notices (on), or grants on the GPU (off), may be read before the admin reads its OK.
            (self.drain_now if on else self.undrain_now).add(g)
        elif op == "protect":
            task = r.choice([*sorted(self.acked)[:4], *sorted(self.suspended)[:1], "never-allocated"])
            msg = p.Protect(id=rid, task_id=task, protected=r.random() < 0.7)
        else:
            msg = p.ResetAllocations(id=rid)
        kind = str(msg.__struct_config__.tag)
        cp, waiters, injected = (
            self.daemon.allocations.ledger.checkpoint(),
            dict(self.daemon.allocations.waiters),
            self.injected,
        )
        pend = self.send(c, msg, kind, tasks=sorted(self.acked) + sorted(self.suspended), injected=injected, **info)
        self.finish(c, pend)
        if pend.info.get("store_failed") or (kind == "RESET_ALLOCS" and self.injected > injected):
            self.check_rolled_back(cp, waiters, kind)
        self.after_event()

    def answer_reset_allocs(self, c: Client, pend: Pending, msg: Any) -> None:
        injected = self.injected > pend.info["injected"]
        if c.admin and injected:
            self.expect(
                isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED,
                c,
                pend,
                msg,
                "the store write failed: expected store_failed",
            )
            return
        self.answer_simple(c, pend, msg)

    def do_query(self) -> None:
        c = self.pick(self.connected())
        if c is None:
            return
        kind = self.rng.choice([p.Status, p.ListClients, p.ListLeases, p.ListAllocations, p.ListPolicies])
        msg = kind(id=c.rid())
        pend = self.send(c, msg, str(msg.__struct_config__.tag))
        self.finish(c, pend)
        self.after_event()

    def do_misc(self) -> None:
        r = self.rng
        roll = r.random()
        c = self.pick(self.connected())
        silent = [x for x in self.clients if x.conn is not None and not x.greeted]
        if silent:  # connected without HELLO: a request first (refused), then HELLO
            fresh = self.pick(silent)
        elif roll < 0.3 or c is None:
            fresh = self.pick([x for x in self.clients if x.conn is None and x.alive])
            if fresh is None or not self.connect(fresh, greet=False):
                return
        if silent or roll < 0.3 or c is None:
            pend = self.send(fresh, p.Attach(id=fresh.rid(), gpu=0), "ATTACH")
            self.finish(fresh, pend)
            self.after_event()
            if fresh.conn is not None:
                self.hello(fresh, version=p.PROTOCOL_VERSION if r.random() < 0.8 else 2)
        elif roll < 0.45:
            self.hello(c)  # again: refused, nothing changes
        elif roll < 0.65:  # someone else's session
            theirs = [s for x in self.clients if x is not c for s in x.sessions.values()]
            s = self.pick(theirs)
            if s is not None:
                pend = self.send(c, p.LockRequest(id=c.rid(), session=s.sid), "FOREIGN", sid=s.sid)
                self.finish(c, pend)
                self.after_event()
        elif roll < 0.85 or not c.sessions:
            pend = self.send(c, p.ReportOom(id=c.rid(), gpu=r.randrange(len(self.gpus)), task_type="ASR"), "REPORT_OOM")
            self.finish(c, pend)
            self.after_event()
        else:  # PARKED for a session that was not attached parkable: refused, nothing changes
            s = self.pick(list(c.sessions.values()))
            if not s.parkable:
                pend = self.send(
                    c, p.Parked(id=c.rid(), session=s.sid, ok=True), "PARKED", expected=p.ErrorCode.INVALID
                )
                self.finish(c, pend)
                self.after_event()

    def answer_foreign(self, c: Client, pend: Pending, msg: Any) -> None:
        self.expect(
            isinstance(msg, p.Error) and msg.code == p.ErrorCode.UNKNOWN_SESSION,
            c,
            pend,
            msg,
            "another client's session is not this connection's",
        )

    def do_crash_client(self) -> None:
        c = self.pick([x for x in self.clients if x.conn is not None])
        if c is None:
            return
        self.lose_connection(c, "the process crashed", crashed=True)
        self.after_event()
        if c.kind == "crashy" or self.rng.random() < 0.5:  # restarted by its supervisor
            self.later(self.now + self.rng.randrange(MS, 100 * MS), "reconnect", c.cid)
            self.respawn(c)

    def do_crash_daemon(self) -> None:
        """gpud dies: no GOODBYE, no close; its clients see their connections end. A new
        daemon starts on the same state directory, with the restart grace."""
        self.event("the daemon crashes")
        self.stats["daemon crashes"] += 1
        self.restart(grace_us=round(self.config.restart_grace_s * 1e6))

    def do_restart_daemon(self) -> None:
        """gpud stops cleanly (GOODBYE, then every connection closes) and starts again."""
        d = self.daemon
        self.event("the daemon shuts down (GOODBYE)")
        self.stats["daemon restarts (GOODBYE)"] += 1
        self.goodbye_expected = True
        d.farewell("restart")
        greeted = [c for c in self.clients if c.conn is not None and c.conn.greeted]
        got = {c.cid for c in greeted if any(b"GOODBYE" in chunk for chunk in c.conn.pending)}  # type: ignore[union-attr]
        self.deliver()
        c = self.pick(self.connected())
        if c is not None:
            pend = self.send(c, p.Status(id=c.rid()), "STATUS")
            self.finish(c, pend)
        missing = sorted(x.cid for x in greeted if x.cid not in got)
        if missing:
            self.fail(f"clients {missing} got no GOODBYE")
        for x in self.clients:
            if x.conn is not None:  # each connection ends (the listener closes it after GOODBYE)
                self.lose_connection(x, "closed after GOODBYE", crashed=False, keep_intents=True)
                self.after_event()
                if x.alive:
                    self.later(self.now + self.rng.randrange(0, 50 * MS), "reconnect", x.cid)
        self.goodbye_expected = False
        self.restart(grace_us=0)

    def restart(self, *, grace_us: int) -> None:
        old = self.daemon
        old.allocations.store.close()
        waits = {q.msg.task_id: (c, q) for c in self.clients for q in self.waits_of(c)}
        for c in self.clients:
            if c.conn is not None:
                self.closed_conns.append(c.conn)
                self.forget_connection(c, keep_intents=True)
                if c.alive:
                    self.later(self.now + self.rng.randrange(0, 50 * MS), "reconnect", c.cid)
        self.agenda = [e for e in self.agenda if e[2] == "reconnect"]
        heapq.heapify(self.agenda)
        self.now += self.rng.choice([0, 100, 5 * MS])
        self.daemon = self.build_daemon(grace_us)
        self.event("a new daemon starts (restart grace {} us)", grace_us)
        self.restored(waits)
        self.rehold()
        self.check_fresh_store()
        self.booting = True
        self.after_event()
        self.advance(self.now)  # the new daemon's timers run at once: what fell due while it was down
        self.booting = False

    # --- the checks ---------------------------------------------------------------------------------

    def after_event(self) -> None:
        deferred, self.deferred = self.deferred, []
        for judge in deferred:
            judge()
        self._last_grants = list(self.grants_now)
        self.note_grants()
        self.check()
        self.yields_now.clear()
        self.withdrawals_now.clear()
        self.waits_ended_now.clear()
        self.drain_now.clear()
        self.undrain_now.clear()
        self.parks_now.clear()
        self.lease_timeouts_now.clear()
        self.lost_now = False
        self.asked_now.clear()

    def check(self) -> None:
        d, now = self.daemon, self.now
        if self.broken:
            self.fail(self.broken)
        if self.faults:
            self.fail("the daemon counted a fault:\n" + self.faults[0])
        conns = {c.conn.client_id: c.conn for c in self.clients if c.conn is not None}
        if d.links.connections != conns:
            self.fail(f"the daemon's connections {sorted(d.links.connections)} are not the open ones {sorted(conns)}")
        for conn in self.closed_conns:
            if conn.pending:
                self.fail(f"the daemon wrote to closed connection {conn.client_id}: {list(conn.pending)[:2]}")
        self._waiting = [(c, q) for c in self.clients for q in c.waiting_leases()]
        # One pass over what the clients believe: who owns what, and what is on each GPU.
        sessions: list[list[tuple[Client, Sess]]] = [[] for _ in self.gpus]
        leases: list[list[tuple[Client, LeaseM]]] = [[] for _ in self.gpus]
        waiting_on: list[list[int]] = [[] for _ in self.gpus]
        owned: dict[int, Client] = {}
        for c in self.clients:
            for sid, s in c.sessions.items():
                owned[sid] = c
                sessions[s.gpu].append((c, s))
            for lease in c.leases.values():
                owned[lease.sid] = c
                leases[lease.gpu].append((c, lease))
        for c, q in self._waiting:
            owned[q.info["sid"]] = c
            waiting_on[q.info["gpu"]].append(q.info["sid"])
        daemon_owned = {sid: conn.client_id for sid, conn in d.links.owners.items()}
        model_owned = {sid: c.conn.client_id for sid, c in owned.items() if c.conn is not None}
        if daemon_owned != model_owned:
            self.fail(f"the daemon's owners {daemon_owned} are not what the clients hold {model_owned}")
        arb = d.leases
        held = {lease.sid for on_gpu in leases for _, lease in on_gpu}
        waiting = {q.info["sid"] for _, q in self._waiting}
        if set(arb.by_sid) != held | waiting:
            self.fail(
                f"the arbiter's leases {sorted(arb.by_sid)} are not the clients' held {sorted(held)} "
                f"and waiting {sorted(waiting)}"
            )
        for slot in d.slots:
            g = slot.gpu.index
            self.check_gpu(slot, sessions[g], leases[g], waiting_on[g])
        for c in self.clients:
            for q in c.pending.values():
                late = now - q.deadline if q.deadline is not None else 0
                if late > 0 and not (q.kind == "ALLOCATE" and self.retrying() and late <= MAX_LATE_US):
                    self.fail(
                        f"client {c.cid}: {short(q.msg)} sent at {q.sent_at} still unanswered "
                        f"{now - q.deadline} us after its deadline"
                    )
        self.check_allocations()

    def check_gpu(
        self,
        slot: Any,
        sessions: list[tuple[Client, Sess]],
        leases: list[tuple[Client, LeaseM]],
        waiting_leases: list[int],
    ) -> None:
        """Every rule about one GPU, each its own method (so an experiment can tell them apart).
        ``sessions``, ``leases`` and ``waiting_leases`` are the clients' on this GPU, in client order."""
        sched = slot.scheduler
        g = slot.gpu.index
        sched.check()
        view = sched.view(self.now)
        on = GpuNow(
            g,
            self.gpus[g],
            sched,
            view,
            sessions,
            leases,
            held_leases(leases),
            waiting_leases,
            [w for w in view.queue if not w.throttled],
        )
        for check in (
            self.check_settings,
            self.check_holders_match,
            self.check_parking,
            self.check_queue_match,
            self.check_serial,
            self.check_memory,
            self.check_drops_and_tq,
            self.check_quota,
            self.check_lock_bounds,
            self.check_lease_holds,
        ):
            check(on)
        self.check_billing(sched, on.gm, [s.sid for _, s in sessions] + sorted(on.lease_sids) + waiting_leases)

    def check_settings(self, on: GpuNow) -> None:
        """Mode, switch and TQ are what the admins were told; nothing due is left undone."""
        v, gm = on.view, on.gm
        if (v.mode, v.enabled, v.tq_us) != (gm.mode, gm.enabled, gm.tq_us):
            self.fail(
                f"GPU {on.g}: mode/on/TQ {v.mode}/{v.enabled}/{v.tq_us} but admins were told "
                f"{gm.mode}/{gm.enabled}/{gm.tq_us}"
            )
        deadline = on.sched.next_deadline()
        if deadline is not None and deadline <= self.now:
            self.fail(f"GPU {on.g}: a deadline {self.now - deadline} us old is due but was not acted on")

    def check_holders_match(self, on: GpuNow) -> None:
        """The daemon's holders (and their pending drops) are exactly what connected clients
        believe they hold: nothing held for, or granted to, anyone else."""
        model: dict[int, int | str] = {s.sid: s.grant for _, s in on.sessions if s.state == "holding"}
        model.update({sid: "lease" for sid in on.lease_sids})
        daemon = {h.session: "lease" if h.session in on.lease_sids else h.grant for h in on.view.holders}
        if daemon != model:
            self.fail(
                f"GPU {on.g}: the daemon's holders (session: grant) {daemon} are not what clients "
                f"believe they hold {model}"
            )
        mine = {s.sid: s for _, s in on.sessions}
        for h in on.view.holders:
            s = mine.get(h.session)
            if s is not None and (h.drop_pending is None) != (s.drop_at is None):
                self.fail(
                    f"GPU {on.g}: session {h.session} drop pending {h.drop_pending} in the daemon, "
                    f"{s.drop_reason} for its client"
                )

    def check_queue_match(self, on: GpuNow) -> None:
        """The queue is exactly what clients wait for, and an idle GPU has no runnable waiter."""
        waiting = {s.sid for _, s in on.sessions if s.state == "waiting"}
        waiting |= set(on.waiting_leases)
        queue = {w.session for w in on.view.queue}
        if queue != waiting:
            self.fail(f"GPU {on.g}: the daemon's queue {sorted(queue)} is not what clients wait for {sorted(waiting)}")
        if on.gm.enabled and self.now >= self.grace_end and not on.view.holders and on.runnable:
            if not any(s.park_asked is not None for _, s in on.sessions):  # else: its grant waits for a PARKED
                self.fail(f"GPU {on.g}: nobody holds it but {on.runnable[0].session} waits, not throttled")

    def check_parking(self, on: GpuNow) -> None:
        """The daemon's parkable sessions are what their clients saw (resident or parked, a PARK
        out since when, refused since the last grant); at a grant, the holders' memory and the
        resident parkable sessions' fit the capacity unless every resident one refused or timed out."""
        mine = [s for _, s in on.sessions if s.parkable]
        theirs = on.sched._parkable
        if not mine and not theirs:
            return
        for s in mine:
            self.park_timeouts(s)
        model = {s.sid: (not s.parked, s.park_asked, s.park_refused) for s in mine}
        daemon = {sid: (x.resident, x.park_asked_at, x.park_refused) for sid, x in theirs.items()}
        if model != daemon:
            self.fail(
                f"GPU {on.g}: the daemon's parkable sessions (resident, PARK asked at, refused) {daemon} are not "
                f"what their clients saw {model}"
            )
        gm = on.gm
        if not gm.enabled or not self._granted_on(on.g):
            return
        if on.g in self.parks_now:
            self.stats["grants that waited for a park"] += 1
        resident = [s for s in mine if s.state != "holding" and not s.parked]
        if not resident:
            return
        need = {s.sid: self.need(gm, s.mem_estimate, s.mem_used) for _, s in on.sessions}
        need.update({lease.sid: self.need(gm, lease.mem_estimate, None) for _, lease in on.leases})
        held = sum(need[h.session] for h in on.view.holders)
        kept = sum(need[s.sid] for s in resident)
        if held + kept <= gm.capacity:
            return
        asked = [s.sid for s in resident if not s.park_refused]
        if asked:
            self.fail(
                f"GPU {on.g}: granted with the holders needing {held} bytes and the resident parkable sessions "
                f"{ {s.sid: need[s.sid] for s in resident} } {kept} more, over capacity {gm.capacity}, though "
                f"{asked} could still be asked to park"
            )
        self.stats["grants over capacity beside refused parks"] += 1

    def check_serial(self, on: GpuNow) -> None:
        """Serial: one holder, unless they were admitted before the GPU became serial or while
        its scheduler was off (then: until it is down to one)."""
        gm, holders = on.gm, on.view.holders
        if gm.mode != p.Mode.SERIAL or not gm.enabled:
            gm.serial_clean = False
        elif len(holders) <= 1:
            gm.serial_clean = True
        elif gm.serial_clean:
            self.fail(f"GPU {on.g}: {len(holders)} holders in serial mode: {[h.session for h in holders]}")

    def check_memory(self, on: GpuNow) -> None:
        """Concurrent and auto: a grant beside others fits the capacity (max of estimate and
        reported use; unknown is the whole GPU); auto drops sessions while reported use overflows."""
        gm, holders = on.gm, on.view.holders
        granted = self._granted_on(on.g)
        if gm.enabled and len(holders) > 1 and granted:
            self.stats[f"grants beside another holder ({gm.mode})"] += 1
        beside = gm.mode != p.Mode.SERIAL and len(holders) > 1 and granted
        if not gm.enabled or not (beside or gm.mode == p.Mode.AUTO):
            return  # neither rule applies
        need = {s.sid: self.need(gm, s.mem_estimate, s.mem_used) for _, s in on.sessions}
        need.update({lease.sid: self.need(gm, lease.mem_estimate, None) for _, lease in on.leases})
        if beside:
            used = sum(need[h.session] for h in holders)
            if used > gm.capacity:
                self.fail(
                    f"GPU {on.g}: granted in {gm.mode} mode with the holders needing {used} bytes > capacity "
                    f"{gm.capacity} ({ {h.session: need[h.session] for h in holders} })"
                )
        if gm.mode == p.Mode.AUTO:
            staying = [h for h in holders if h.drop_pending is None]
            over = sum(need[h.session] for h in staying) - gm.capacity
            if over > 0 and len(staying) > 1 and any(h.session not in on.lease_sids for h in staying):
                self.fail(f"GPU {on.g}: auto mode, holders' memory {over} bytes over capacity and no session dropped")

    def check_drops_and_tq(self, on: GpuNow) -> None:
        """A DROP_LOCK unanswered for drop_timeout has become a REVOKED; a session that has held
        past TQ while a runnable request waits has its DROP_LOCK."""
        dt, gm = self.dt_us, on.gm
        for c, s in on.sessions:
            if s.state != "holding":
                continue
            if s.drop_at is not None and self.now >= s.drop_at + dt:
                self.fail(
                    f"session {s.sid} still holds {self.now - s.drop_at} us after its DROP_LOCK (drop_timeout {dt} us)"
                )
            if gm.enabled and on.runnable and self.now >= s.granted_at + gm.tq_us and s.drop_at is None:
                self.fail(
                    f"session {s.sid} (client {c.cid}) has held GPU {on.g} for {self.now - s.granted_at} us, "
                    f"past TQ {gm.tq_us} us, while {on.runnable[0].session} waits, and has no DROP_LOCK "
                    f"pending (one was {'sent' if s.drop_seen else 'never sent'} for this grant)"
                )

    def check_quota(self, on: GpuNow) -> None:
        """A limited holder whose window budget is used up has its DROP_LOCK."""
        if not on.gm.enabled:
            return
        acc = on.sched.accounts
        for _, s in on.sessions:
            if s.state == "holding" and s.core_limit < 100 and s.drop_at is None:
                used, budget = acc.account(s.sid).used_ns, acc.budget_ns(s.sid)
                if budget is not None and used >= budget:
                    self.fail(f"session {s.sid} used {used} ns of its {budget} ns budget and runs undisturbed")

    def check_lock_bounds(self, on: GpuNow) -> None:
        """Every lock waiter with a bound (``lock_bound``) is granted by it."""
        for c, s in on.sessions:
            if s.state == "waiting" and s.bound is not None and self.now > s.bound:
                self.fail(
                    f"session {s.sid} (client {c.cid}, priority {s.priority}) has waited "
                    f"{self.now - s.requested_at} us for GPU {on.g}, {self.now - s.bound} us past its bound "
                    f"(TQ {on.gm.tq_us} us, drop_timeout {self.dt_us} us, {len(s.counted)} grants ahead of it)"
                )

    def check_lease_holds(self, on: GpuNow) -> None:
        """With forced release on, no lease is held past its hold_max."""
        if self.config.lease_force_release and on.gm.enabled:
            for _, lease in on.leases:
                if self.now >= lease.granted_at + lease.hold_max_us:
                    self.fail(
                        f"lease {lease.lease_id} held {self.now - lease.granted_at} us, past hold_max "
                        f"{lease.hold_max_us} us, with forced release on"
                    )

    def _granted_on(self, gpu: int) -> bool:
        return any(x[0] == gpu for x in self._last_grants)

    @staticmethod
    def need(gm: GpuModel, estimate: int | None, used: int | None) -> int:
        if estimate is None and used is None:
            return gm.total  # unknown: it may need all of it
        return max(estimate or 0, used or 0)

    def check_billing(self, sched: Any, gm: GpuModel, sids: list[int]) -> None:
        """Weighted billing never bills a session more than the time it held the GPU, nor
        all of them together more than the wall time, window by window."""
        now = self.now
        acc = sched.accounts
        W = acc.cfg.window_us
        ws = acc.window_start
        total = 0
        for sid in sids:
            a = acc.account(sid)
            made = a.used_ns - a.carried_ns
            # Held time is never negative: only a session billed something can have been overbilled.
            held = overlap(self.holds.get(sid, []), ws, now, now) if made > 0 else 0
            if made > held * 1000:
                self.fail(f"GPU {gm.index}: session {sid} billed {made} ns in the current window but held it {held} us")
            total += made
        if total > (now - ws) * 1000:
            self.fail(f"GPU {gm.index}: {total} ns billed in a window {now - ws} us old")
        if gm.window_seen is not None and ws > gm.window_seen:
            ended = (ws - gm.window_seen) // W
            self.stats["finished windows checked"] += min(ended, acc.cfg.share_windows)
            for j in range(1, min(ended, acc.cfg.share_windows) + 1):
                lo, hi = ws - j * W, ws - (j - 1) * W
                total = 0
                for sid in sids:
                    h = acc.account(sid).history
                    if len(h) >= j:
                        held = overlap(self.holds.get(sid, []), lo, hi, now) if h[-j] > 0 else 0
                        if h[-j] > held * 1000:
                            self.fail(
                                f"GPU {gm.index}: session {sid} billed {h[-j]} ns in window [{lo - START_US}, "
                                f"{hi - START_US}) but held the GPU {held} us of it"
                            )
                        total += h[-j]
                if total > W * 1000:
                    self.fail(f"GPU {gm.index}: {total} ns billed in one window of {W} us")
        gm.window_seen = ws

    def check_allocations(self) -> None:
        """Allocations: what nobody was told carried out on the model (``reconcile``); then the
        ledger, the allocator and the store agree exactly with the model (allocations with their
        notices, suspended allocations, waits, holders, drained GPUs, preemption history); no device
        is held twice; a tenant stays within its quota; a waiter that fits is served; a draining GPU's
        allocations that can be told have been."""
        d = self.daemon
        alloc, led = d.allocations, d.allocations.ledger
        self.reconcile()
        ledger = {a.task_id: self.shape(a) for a in led.allocations()}
        model = {t: self.shape(a) for t, a in self.acked.items()}
        if ledger != model:
            self.fail(f"the ledger {ledger} is not what was acknowledged {model}")
        suspended = {a.task_id: self.shape(a) for a in led.suspended()}
        if suspended != {t: self.shape(a) for t, a in self.suspended.items()}:
            self.fail(f"the ledger's suspended allocations {suspended} are not the model's {sorted(self.suspended)}")
        self.check_owners()
        holders = {t: a.holder for t, a in [*self.acked.items(), *self.suspended.items()] if a.holder is not None}
        reach = {t for t, a in [*self.acked.items(), *self.suspended.items()] if a.owner.reach}
        if alloc.holders != holders or led.reachable != set(holders) | reach:
            self.fail(
                f"the connections told of preemptions {[(t, c.client_id) for t, c in alloc.holders.items()]} "
                f"(reachable {sorted(led.reachable)}) are not the ones that last got ALLOCATED "
                f"{[(t, c.client_id) for t, c in holders.items()]} (and those reached by their owner {sorted(reach)})"
            )
        if set(led.draining()) != self.draining or {s.gpu.index for s in d.slots if s.draining} != self.draining:
            self.fail(f"the daemon drains GPUs {sorted(led.draining())}, admins were told {sorted(self.draining)}")
        if led._history != self.history:
            self.fail(f"the ledger's preemption history {led._history} is not the model's {self.history}")
        uids = {t: a.uid for t, a in [*self.acked.items(), *self.suspended.items()]}
        if {t: u for t, u in alloc.uids.items() if t in uids} != uids:
            self.fail(f"the allocator's owners {alloc.uids} are not the acknowledged {uids}")
        want = self.durable_model(model)
        stored = self.stored_allocations()
        if stored != want and not self.behind():
            self.fail(f"the store holds {self.diff(stored, want)}")
        self.stats["events with the store behind (a withdrawal not stored yet)"] += stored != want
        if (self.unstored_notices or self.unstored_waits) and not self.behind():
            self.unstored_notices.clear()
            self.unstored_waits.clear()
        waits = {q.msg.task_id for q in self.all_pending("ALLOCATE") if q.deadline is not None}
        if set(alloc.waiters) != waits or {r.task_id for r in led.waiting()} != waits | set(self.ghosts):
            self.fail(
                f"allocation waiters: allocator {sorted(alloc.waiters)}, ledger "
                f"{sorted(r.task_id for r in led.waiting())}, clients {sorted(waits)}, restored {sorted(self.ghosts)}"
            )
        for a in self.acked.values():  # a drain tells everyone it can (the timer's next tick at the latest)
            if a.holder and not a.notice and set(a.gpus) & self.draining and not (self.awake() or self.retrying()):
                self.fail(
                    f"{a.task_id} on GPUs {a.gpus} is held by a live connection, GPUs {sorted(self.draining)} "
                    "drain, and it has no notice"
                )
        # The rest depends only on the allocations, the waits, the drains and the GPUs kept for waiters:
        # judged again only when one of them changed.
        placed = (led, ledger, [r.task_id for r in led.waiting()], led.draining(), dict(getattr(led, "_reserved", {})))
        if placed == self._placed:
            return
        self._placed = placed
        self.check_devices()
        for name, t in self.config.tenants.items():
            used = sum(len(a.gpus) * a.share for a in self.acked.values() if a.tenant == name)
            if used > round((t.gpus + t.borrow) * UNIT):
                self.fail(f"tenant {name} uses {used / UNIT} GPUs, over its quota {t.gpus} + borrow {t.borrow}")
        for req in led.waiting():  # each waiter is served as soon as it fits
            cp = led.checkpoint()
            try:
                led.allocate(dataclasses.replace(req, task_id=req.task_id + "+probe", wait_us=0), self.now)
                fits = True
            except (Insufficient, Refused):
                fits = False
            finally:
                led.rollback(cp)
            if fits:
                self.fail(f"allocation {req.task_id} still waits though it fits now")
            self.stats["allocation waiters probed"] += 1

    def check_owners(self) -> None:
        """The daemon holds exactly the owner processes the model says (the very processes the tasks were
        allocated for: never one that took a pid since), and an allocation whose owner exited is gone
        within reap_interval_s of its exit."""
        owners = self.daemon.allocations.owners
        got = {t: h.proc for t, h in owners._held.items()}
        want = {t: o.proc for t, o in self.owners_m().items() if o.held}
        if got != want and not self.behind():
            t = next(t for t in sorted(set(got) | set(want)) if got.get(t) is not want.get(t))
            o = self.owners_m().get(t)
            self.fail(
                f"the daemon holds {got.get(t)} as the owner of {t}; the process it was allocated for is "
                f"{o and o.proc}, " + ("which it holds" if o and o.held else "not held (exited, or gone from its pid)")
            )
        if not self.table.hidden and not self.behind():
            self.stored_allocations()  # (read again only if the store changed)
            assert self._stored is not None
            starts = self._stored[3]
            for t, a in [*self.acked.items(), *self.suspended.items()]:
                if a.owner.held and a.owner.proc is not None and starts.get(t) != a.owner.proc.start:
                    self.fail(f"the store keeps the start time {starts.get(t)} for {t}'s owner {a.owner.proc}")
        if not self.reap_us:
            return
        for a in [*self.acked.values(), *self.suspended.values()]:
            proc = a.owner.proc
            if proc is None or not a.owner.reapable():
                continue
            assert proc.died_at is not None
            known = max(proc.died_at, a.owner.orphan_at or 0)  # (gone while gpud was down: since its start)
            if self.now > known + self.reap_us:
                self.fail(
                    f"{a.task_id}'s owner {proc} exited {(self.now - proc.died_at) / 1e3:.3f} ms ago, "
                    f"reap_interval_s is {self.config.reap_interval_s}: its allocation is still there"
                )

    def check_devices(self) -> None:
        """No device is held by two allocations: the model's allocations share no CPU core and no
        GPU beyond its whole, and the ledger's books say the same (free + held = one GPU, all cores)."""
        led = self.daemon.allocations.ledger
        on: list[dict[str, int]] = [{} for _ in self.gpus]
        for t, a in self.acked.items():
            for g in a.gpus:
                on[g][t] = a.share
        for gm, mine in zip(self.gpus, on, strict=True):
            free, tasks = led.gpu_free(gm.index), led.gpu_tasks(gm.index)
            if (
                sum(mine.values()) > UNIT
                or tasks != mine
                or free + sum(tasks.values()) != UNIT
                or not 0 <= free <= UNIT
            ):
                self.fail(f"GPU {gm.index}: held by {mine} (the ledger: {tasks}, free {free}): held twice")
        cores = [x for a in self.acked.values() for x in a.cpus]
        if (
            len(cores) != len(set(cores))
            or set(cores) & set(led.cpus_free())
            or len(cores) + len(led.cpus_free()) != SIM_CPUS
        ):
            self.fail(f"CPU cores: allocated {sorted(cores)}, free {led.cpus_free()}")

    @staticmethod
    def shape(a: Any) -> tuple[Any, ...]:
        """What the model and the ledger must agree on for an allocation (``Acked`` or ``Allocation``)."""
        created = a.created if isinstance(a, Acked) else a.created_us
        changed = a.changed if isinstance(a, Acked) else a.changed_us
        return (
            a.gpus, a.share, a.cpus, a.tenant, a.priority, a.on_preempt, a.gpus_min, a.gpus_max, a.protected,
            a.preemptions, a.resume, created, changed,
        )  # fmt: skip

    def durable_model(self, shapes: dict[str, tuple[Any, ...]] | None = None) -> dict[str, Any]:
        """What the store must hold, per task id (see ``durable``); ``shapes``: the allocations' shapes
        if they are at hand."""
        out: dict[str, Any] = {}
        for t, a in self.acked.items():
            n = a.notice
            notice = n and (n.reason, n.gpus, n.whole, n.by, n.issued, n.deadline)
            out[t] = ("held", a.uid, shapes[t] if shapes is not None else self.shape(a), notice)
        for t, a in self.suspended.items():
            out[t] = ("suspended", a.uid, self.shape(a))
        for c in self.clients:
            for q in self.waits_of(c):
                if q.info.get("victims"):
                    out[q.msg.task_id] = ("waits", asked_terms(q.msg)[3])
        for t, g in self.ghosts.items():
            out[t] = ("waits", g.terms[3])
        for t, (n, resume) in self.history.items():
            out.setdefault(t, ("history", n, resume))
        return out

    def durable(self, records: list[tuple[Any, int]]) -> dict[str, Any]:
        """The store's records as ``durable_model`` says them."""
        out: dict[str, Any] = {}
        for rec, uid in records:
            if rec.allocation is not None:
                n = rec.notice
                notice = n and (n.reason, n.gpus, n.whole, n.by, n.issued, n.deadline)
                out[rec.task_id] = ("held", uid, self.shape(rec.allocation), notice)
            elif rec.suspended is not None:
                out[rec.task_id] = ("suspended", uid, self.shape(rec.suspended))
            elif rec.waiting is not None:
                out[rec.task_id] = ("waits", rec.waiting.priority)
            else:
                out[rec.task_id] = ("history", rec.preemptions, rec.resume)
        return out

    @staticmethod
    def diff(got: dict[str, Any], want: dict[str, Any]) -> str:
        keys = sorted(set(got) | set(want))
        return "; ".join(f"{k}: {got.get(k)} (expected {want.get(k)})" for k in keys if got.get(k) != want.get(k))

    def stored_allocations(self) -> dict[str, Any]:
        """What the daemon's store holds, read back. Read again only when the store's connection
        has changed rows since the last reading (SQLite's ``total_changes``) or the store is
        another one: the same rows read back the same."""
        store = self.daemon.allocations.store
        changes = store._db.total_changes
        if self._stored is None or self._stored[0] is not store or self._stored[1] != changes:
            loaded = store.load()
            self._stored = (store, changes, self.durable(loaded.records), loaded.starts)
        return self._stored[2]

    def check_fresh_store(self) -> None:
        """What a new daemon would read: exactly what was acknowledged (allocations with their
        notices, suspended allocations, waits that had victims, preemption history)."""
        self._stored = None  # another connection opens the file: read it afresh next time too
        store = Store(self.state_dir)
        try:
            loaded = store.load()
        finally:
            store.close()
        got, want = self.durable(loaded.records), self.durable_model()
        behind = self.behind() if got != want else False
        if (got != want and not behind) or loaded.unreadable or sorted(loaded.draining) != sorted(self.draining):
            self.fail(
                f"read back from the store: {self.diff(got, want)} (unreadable {loaded.unreadable}, "
                f"draining {loaded.draining}, expected {sorted(self.draining)})"
            )


def held_leases(leases: list[tuple[Client, LeaseM]]) -> set[int]:
    return {lease.sid for _, lease in leases}


# --- running seeds ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    seed: int
    ok: bool
    report: str
    events: int
    seconds: float
    stats: Counter[str] = field(default_factory=Counter)
    victims: list[tuple[int, int, int, int]] = field(default_factory=list)  # see World.victims


def thrash(victims: list[tuple[int, int, int, int]]) -> str:
    """The thrash figures: PREEMPT notices per victim (an allocation told to leave at least once), per
    victim per simulated hour of its life, withdrawn; and the most one victim got against its bound
    (the simulated time / preemption_cooldown + 2 that fails a seed)."""
    if not victims:
        return "thrash: no allocation was told to leave"
    notices = sum(v[0] for v in victims)
    withdrawn = sum(v[1] for v in victims)
    hours = sum(v[2] for v in victims) / 3.6e9
    most = max(victims, key=lambda v: (v[0] / v[3], v[0]))
    return (
        f"thrash: {len(victims)} victims got {notices} PREEMPT notices ({notices / len(victims):.2f} each, at most "
        f"{max(v[0] for v in victims)}), {withdrawn} withdrawn ({withdrawn / notices:.0%}); "
        f"{notices / hours:.0f} per victim per simulated hour of its life; the closest to its bound: "
        f"{most[0]} of {most[3]}"
    )


def command(seed: int, steps: int, *, churn: bool = False) -> str:
    extra = ("" if steps == DEFAULT_STEPS else f" --steps {steps}") + (" --churn" if churn else "")
    return f".venv/bin/python -m tests.sim.daemon_sim --seed {seed}{extra}"


def run_seed(
    seed: int, steps: int = DEFAULT_STEPS, *, verbose: bool = False, strict: bool = False, churn: bool = False
) -> Outcome:
    began = time.perf_counter()
    world = World(seed, steps, verbose=verbose, strict=strict, churn=churn)
    try:
        world.run()
    except Exception as exc:  # a broken invariant, or an exception out of the daemon
        what = str(exc) if isinstance(exc, SimFailure) else "".join(traceback.format_exception(exc))
        report = "\n".join(
            [
                f"daemon_sim: seed {seed} failed at step {world.step_no} "
                f"(t={(world.now - START_US) / 1000:.3f} ms, event {world.events}): {what}",
                f"last {len(world.trace)} events:",
                *("  " + trace_line(entry) for entry in world.trace),
                "the GPUs then:",
                *("  " + line for line in world.describe_gpus()),
                f"reproduce: {command(seed, steps, churn=churn)}",
            ]
        )
        return Outcome(seed, False, report, world.events, time.perf_counter() - began, world.stats, world.victims)
    return Outcome(seed, True, "", world.events, time.perf_counter() - began, world.stats, world.victims)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.daemon_sim", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--seed", type=int, help="run this one seed")
    which.add_argument("--seeds", type=int, default=100, help="run seeds 0..N-1 (default 100)")
    parser.add_argument("--first", type=int, default=0, help="with --seeds: start at this seed")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps per seed (default {DEFAULT_STEPS})")
    parser.add_argument("--verbose", action="store_true", help="print every event")
    parser.add_argument("--stats", action="store_true", help="print what happened, summed over the seeds")
    parser.add_argument("--strict", action="store_true", help="fail on the known daemon bugs too (KNOWN_BUGS)")
    parser.add_argument("--churn", action="store_true", help="owners exit, pids are reused, gpud crashes: often")
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else list(range(args.first, args.first + args.seeds))
    began = time.perf_counter()
    failed: list[Outcome] = []
    events = 0
    stats: Counter[str] = Counter()
    victims: list[tuple[int, int, int, int]] = []
    for seed in seeds:
        out = run_seed(seed, args.steps, verbose=args.verbose, strict=args.strict, churn=args.churn)
        events += out.events
        stats += out.stats
        victims += out.victims
        if not out.ok:
            failed.append(out)
            if len(failed) <= 3:
                print(out.report, file=sys.stderr)
                print(file=sys.stderr)
    took = time.perf_counter() - began
    if args.stats:
        for name, count in sorted(stats.items()):
            print(f"{count:>9}  {name}")
    print(thrash(victims))
    print(
        f"{len(seeds)} seed(s) x {args.steps} steps: {len(seeds) - len(failed)} passed, {len(failed)} failed; "
        f"{events} events in {took:.1f} s"
    )
    if failed:
        print("failing seeds: " + " ".join(str(o.seed) for o in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
