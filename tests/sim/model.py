"""What every part of the simulated world shares: the constants, a client and its requests, a GPU as
the admins set it, the seed's configuration, the trace's lines, and ``Part``, the base of each
capability (its model, its steps, the answers it judges, its invariants).

A part reads the world through ``Part``'s few accessors and calls its neighbours through
``self.world``; it never keeps a copy of what another part owns. Nothing here draws from the seed's
generator except ``draw_config`` (first, in the world's constructor), so the order of draws is the
driver's and each part's own.
"""

from __future__ import annotations

import contextlib
import enum
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import structlog

from gpud.host.config import Config, PolicyConfig, TenantConfig
from gpud.kit.state import ClientLink
from gpud_client import protocol as p

if TYPE_CHECKING:
    from gpud.serving.server import Daemon

    from .leases import LeaseM
    from .locks import Sess
    from .procs import Proc
    from .world import World

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
TASK_TYPES = ["ASR", "NMT", "SEMANTIC_REPAIR", "OTHER", "BATCH", "TTS"]


class SimFailure(AssertionError):
    """An invariant does not hold."""


# --- the model: what each simulated process believes --------------------------------------


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

    def need(self, estimate: int | None, used: int | None) -> int:
        """The memory a holder needs here: the max of its estimate and its reported use."""
        if estimate is None and used is None:
            return self.total  # unknown: it may need all of it
        return max(estimate or 0, used or 0)


# --- one capability of the world ------------------------------------------------------------------

Answer = Callable[[Client, Pending, Any], None]  # judges the answer to one request (and applies it)


class Part:
    """One capability of the world: its model, the steps and agenda entries that drive it, the
    answers it judges, and ``check``, its invariants after every event. The tables are read once,
    by the driver, when the world is built."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.rng = world.rng
        self.config = world.config
        self.stats = world.stats
        self.clients = world.clients

    # What the driver reads from each part.

    def answers(self) -> dict[str, Answer]:
        """Request kind -> the judge of its answer (kinds not named here: ``Connections.answer_simple``)."""
        return {}

    def steps(self) -> dict[str, Callable[[], None]]:
        """Step name (``World.STEPS``) -> the step."""
        return {}

    def laters(self) -> dict[str, Callable[..., None]]:
        """Agenda entry -> what a client (or a process) does when its time comes."""
        return {}

    def on_daemon(self, d: Daemon) -> None:
        """A daemon was built (the first, or after a restart): watch the calls this part judges."""

    def end_event(self) -> None:
        """Forget what was true of the event that just ended."""

    def check(self) -> None:
        """This part's invariants, after every event."""

    # The world, as every part reads it.

    @property
    def now(self) -> int:
        return self.world.now

    @property
    def daemon(self) -> Daemon:
        return self.world.daemon

    @property
    def gpus(self) -> list[GpuModel]:
        return self.world.gpus

    def fail(self, message: str) -> NoReturn:
        raise SimFailure(message)

    def event(self, text: str, *args: Any) -> None:
        self.world.event(text, *args)

    def later(self, at: int, what: str, *args: Any) -> None:
        self.world.later(at, what, *args)

    def after_event(self) -> None:
        self.world.after_event()

    def known_bug(self, name: str, what: str) -> None:
        self.world.known_bug(name, what)

    def pick(self, items: list[Any]) -> Any:
        return self.rng.choice(items) if items else None

    def send(self, c: Client, msg: Any, kind: str, **info: Any) -> Pending:
        return self.world.conns.send(c, msg, kind, **info)

    def finish(self, c: Client, pend: Pending, answered_now: bool = True) -> None:
        self.world.conns.finish(c, pend, answered_now)

    def expect(self, ok: bool, c: Client, pend: Pending, msg: Any, why: str) -> None:
        if not ok:
            self.fail(
                f"client {c.cid} (uid {c.uid}{', admin' if c.admin else ''}): {short(pend.msg)} "
                f"answered {short(msg)}: {why}"
            )

    def connected(self) -> list[Client]:
        return [c for c in self.clients if c.conn is not None and c.greeted]

    def client(self, cid: int, gen: int | None) -> Client | None:
        """Client ``cid`` if it is connected and greeted (on connection ``gen``, unless None)."""
        c = self.clients[cid - 1]
        if c.conn is None or not c.greeted or (gen is not None and c.gen != gen):
            return None
        return c

    def all_pending(self, kind: str, client: Client | None = None) -> list[Pending]:
        clients = self.clients if client is None else [client]
        return [q for c in clients for q in c.pending.values() if q.kind == kind]

    def ceiling(self, c: Client) -> int:
        """The highest priority ``c`` may ask for."""
        if c.admin:
            return 100
        return self.config.priority_max_uids.get(str(c.uid), self.config.priority_max)


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


def describe_config(c: Config, store_fail_p: float) -> str:
    return (
        f"{c.simulate} mode={c.mode} tq={c.tq_s}s drop_timeout={c.drop_timeout_s}s "
        f"park_timeout={c.park_timeout_s}s window={c.compute_window_s}s "
        f"carryover={c.quota_carryover_percent} tail={c.drop_tail_billing_percent} "
        f"force_release={c.lease_force_release} hold_max={c.lease_hold_max_ms}ms grace={c.restart_grace_s}s "
        f"caps(conn={c.max_connections}/{c.max_connections_per_uid} sess={c.max_sessions_per_connection} "
        f"queue={c.max_lock_queue} waiters={c.max_allocation_waiters}) store_fail_p={store_fail_p} "
        f"preemption={c.preemption} {c.preemption_strategy} grace={c.preemption_grace_s}s "
        f"min_runtime={c.preemption_min_runtime_s}s cooldown={c.preemption_cooldown_s}s "
        f"elastic(cooldown={c.elastic_cooldown_s}s window={c.elastic_window_s}s)"
    )


# --- the host and the trace -----------------------------------------------------------------------


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
