"""The daemon: the one place its parts are built and wired.

- ``links`` (``gpud.kit.links``): the connection registry and the send path;
- ``effects`` (``gpud.kit.effects``): the one way the cores' decisions are carried out;
- one handler object per capability, each given only the pieces it needs:
  ``locks`` (locks and sessions), ``leases``, ``allocations``, ``admin``
  (scheduler settings), ``status`` (STATUS, CLIENTS), from ``gpud.capabilities``;
- ``access`` (``gpud.kit.access``): admin rights and priority ceilings.

``handle`` answers one decoded request through a table from message type to
handler; ``close`` frees what a connection held; ``farewell`` and ``reload``
act on the whole daemon. The socket and the tasks are in ``gpud.serving.listener``,
``gpud.serving.connections`` and ``gpud.serving.timers``.

A refused call raises ``Refused`` and is answered with an Error. A fault in
carrying out one effect is logged, counted and skipped (the others are still
carried out); only an inconsistent scheduler stops the daemon.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

import msgspec
import structlog
import trio

from gpud.capabilities.admin import Admin
from gpud.capabilities.allocations import Allocations
from gpud.capabilities.leases import Leases
from gpud.capabilities.locks import Locks
from gpud.capabilities.runs import Runs
from gpud.capabilities.status import Status
from gpud.capabilities.task_sockets import TaskSockets
from gpud.core.errors import Refused
from gpud.core.ledger import UNIT
from gpud.core.quota import QuotaConfig
from gpud.core.scheduler import GpuScheduler, SchedulerConfig
from gpud.core.scopes import check_scoped, scoped_attach
from gpud.host.config import Config
from gpud.host.devices import Gpu
from gpud.host.metrics import Metrics, session_labels
from gpud.kit.access import Access
from gpud.kit.effects import Effects
from gpud.kit.faults import Faults
from gpud.kit.links import Links
from gpud.kit.parts import Pieces
from gpud.kit.state import ClientLink, Clock, GpuRefs, GpuSlot, Handler, now_us
from gpud_client import protocol as p

log = structlog.get_logger(__name__)


class Daemon:
    """State shared by every connection: GPUs, schedulers, who owns what."""

    def __init__(
        self,
        config: Config,
        gpus: list[Gpu],
        metrics: Metrics,
        *,
        clock: Clock = now_us,
        restart_grace_us: int = 0,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.gpus = gpus
        self.now = clock  # integer microseconds; a simulation passes its own
        self.started_at = clock()
        grants_from = self.started_at + restart_grace_us if restart_grace_us > 0 else None
        self.slots = [
            GpuSlot(g, GpuScheduler(scheduler_config(config, g), now=self.started_at, grants_from=grants_from))
            for g in gpus
        ]
        self.shutting_down = False
        self.faults = Faults(metrics)
        metrics.prime([g.index for g in gpus])
        self.refs = GpuRefs(self.slots)
        self.links = Links(config, metrics, clock)
        self.effects = Effects(self.faults)
        self.access = Access(config)
        ids = itertools.count(1)  # sessions and leases share one id space: ``links.owners`` holds both
        self.allocations_wake = trio.Event()
        pieces = Pieces(self.slots, self.refs, self.links, self.effects, self.access, metrics)
        self.allocations = Allocations(
            pieces, self.faults, config, sorted(os.sched_getaffinity(0)), self.wake_allocations, clock
        )
        self.leases = Leases(pieces, config, ids, self.settle_all)
        self.locks = Locks(pieces, ids, self.allocations.session_allocation, self.leases.owns)
        self.admin = Admin(self.refs, self.links, self.effects, self.access)
        self.status = Status(
            self.slots,
            self.links,
            self.started_at,
            self.settle_all,
            lambda g: self.allocations.ledger.gpu_free(g) < UNIT,  # no walk over its tasks: STATUS stays cheap
        )
        self.handlers: dict[type, Handler] = {p.Hello: self.hello, p.Relabel: self.relabel}
        # gpuctl run's programs: their cgroups, frozen and thawed by gpud (docs/run.md)
        self.runs = Runs(
            self.links, metrics, self.faults, self.access, lambda: self.config, clock, lambda: self.shutting_down
        )
        # sockets of one task's own (gpud-k8s's claims): listened on by the runtime (serving.listener)
        self.task_sockets = TaskSockets(self.links, self.access)
        for part in (self.locks, self.leases, self.allocations, self.admin, self.status, self.runs, self.task_sockets):
            self.handlers.update(part.handlers())

    def wake_allocations(self) -> None:
        self.allocations_wake.set()

    def handle(self, conn: ClientLink, msg: Any) -> msgspec.Struct | None:
        """One decoded request -> its answer (None: none now, or none at all). Raises Refused."""
        if self.shutting_down:
            raise Refused(
                p.ErrorCode.SHUTTING_DOWN, "gpud is shutting down; the client library reconnects when it is back"
            )
        if not conn.greeted and not isinstance(msg, p.Hello):
            raise Refused(p.ErrorCode.HELLO_REQUIRED, f"send HELLO before {msg.__struct_config__.tag}")
        handler = self.handlers.get(type(msg))
        if handler is None:
            raise Refused(p.ErrorCode.UNKNOWN_TYPE, f"unhandled message {type(msg).__name__}")
        if conn.scope is not None:  # a connection on a task's own socket: what it may ask (core.scopes)
            check_scoped(conn.scope, msg)
            if isinstance(msg, p.Attach):
                msg = scoped_attach(conn.scope, msg)
        self.effects.run_after_answer()  # an earlier request's, when its caller sent no answer (tests)
        return handler(conn, msg, self.now())

    def relabel(self, conn: ClientLink, msg: p.Relabel, now: int) -> None:
        """The client's labels, replaced (what ``gpuctl clients`` shows; a run's state)."""
        conn.labels = dict(msg.labels)

    def hello(self, conn: ClientLink, msg: p.Hello, now: int) -> p.Welcome:
        if conn.greeted:
            raise Refused(p.ErrorCode.INVALID, "HELLO was already received on this connection")
        if msg.version != p.PROTOCOL_VERSION:
            raise Refused(
                p.ErrorCode.VERSION,
                f"protocol version {msg.version} is not supported (daemon speaks {p.PROTOCOL_VERSION})",
            )
        conn.greeted = True
        conn.name = msg.name
        conn.labels = dict(msg.labels)
        self.runs.greeted(conn)
        log.info("client_attached", client=conn.client_id, pid=conn.pid, uid=conn.uid, name=conn.name)
        gpus = [
            p.GpuInfo(
                index=s.gpu.index,
                uuid=s.gpu.uuid,
                name=s.gpu.name,
                memory_total_bytes=s.gpu.memory_total_bytes,
                simulated=s.gpu.simulated,
                scheduler_on=s.scheduler.enabled,
            )
            for s in self.slots
        ]
        return p.Welcome(
            id=msg.id,
            client_id=conn.client_id,
            version=p.PROTOCOL_VERSION,
            gpus=gpus,
            max_frame_bytes=self.config.max_frame_bytes,
        )

    # --- connection lifetime --------------------------------------------------

    def check_schedulers(self) -> None:
        """After a fault: stop (raise ``Inconsistent``) if a scheduler's records disagree."""
        for slot in self.slots:
            slot.scheduler.check()

    def close(self, conn: ClientLink) -> None:
        """Everything the connection held or queued is freed at once; a fault in
        one part of the cleanup does not keep the rest from running."""
        self.links.forget(conn)
        now = self.now()
        for part in (self.locks, self.leases, self.allocations, self.runs):
            try:
                part.connection_closed(conn, now)
            except Exception as exc:
                self.faults.record("close", exc, client=conn.client_id, part=type(part).__name__)
        for sid, gpu in conn.sessions.items():  # left by a failed cleanup: their gauges go all the same
            self.metrics.node.forget_session(session_labels(gpu, sid, conn.name, conn.pid))
        conn.sessions.clear()
        if sum(conn.protocol_errors.values()) > 1:  # the first was logged when it came
            log.info("protocol_errors", client=conn.client_id, pid=conn.pid, counts=dict(conn.protocol_errors))
        if conn.greeted:
            log.info("client_detached", client=conn.client_id, pid=conn.pid, name=conn.name)

    # --- whole-daemon operations -----------------------------------------------

    def farewell(self, reason: str) -> None:
        """Tell every client we are going; from now on every request is refused with
        ``shutting_down``, so the store (already up to date) changes no more."""
        self.shutting_down = True
        self.links.broadcast(p.Goodbye(reason=reason))

    def reload(self, config: Config, now: int) -> tuple[list[str], list[str]]:
        """Apply what can change live: (keys changed now, keys whose change waits for a restart).

        A key changes only if its loaded value (file, environment, flags) differs from the last
        load's: ``self.config`` holds the last load's values of every live key, as run-time
        changes (gpuctl tq, mode, sched, policy, limit) live in the schedulers and the arbiter,
        never in it. So a run-time change survives a reload that leaves its key alone, and a
        reload that changes its key replaces it (the file's change is the operator's newest
        word). Restart keys keep their running values, and are reported while they differ."""
        old = self.config
        changed = [k for k in config.__struct_fields__ if getattr(old, k) != getattr(config, k)]
        later = [k for k in changed if k in RESTART_KEYS]
        config = msgspec.structs.replace(config, **{k: getattr(old, k) for k in later})
        self.config = config
        self.links.config = config
        self.access.reconfigure(config)
        self.allocations.reconfigure(config)
        for slot in self.slots:
            sched = slot.scheduler
            new = take_changes(sched.config, scheduler_config(old, slot.gpu), scheduler_config(config, slot.gpu))
            if new != sched.config:
                self.effects.carry_out(sched.reconfigure(new, now), now, slot)
        self.leases.reconfigure(config)
        return [k for k in changed if k not in later], later

    def settle_all(self, now: int) -> None:
        """Bring every account up to ``now`` before reporting figures."""
        for slot in self.slots:
            self.effects.carry_out(slot.scheduler.advance(now), now, slot)


# What only a restart can change: sockets, devices, the store, the metrics endpoint.
RESTART_KEYS = frozenset(
    {"socket", "socket_mode", "simulate", "state_dir", "state_sync", "metrics_addr", "run_cgroups"}
)


def take_changes(running: Any, before: Any, after: Any) -> Any:
    """``running`` (a frozen dataclass of settings, perhaps changed at run time) with the fields
    that changed from ``before`` to ``after`` (two loads of the configuration) taken from
    ``after``, nested settings field by field; the others keep their running values."""
    changes = {}
    for f in dataclasses.fields(running):
        was, now = getattr(before, f.name), getattr(after, f.name)
        if was != now:
            value = getattr(running, f.name)
            changes[f.name] = take_changes(value, was, now) if dataclasses.is_dataclass(value) else now
    return dataclasses.replace(running, **changes) if changes else running


def scheduler_config(config: Config, gpu: Gpu) -> SchedulerConfig:
    return SchedulerConfig(
        tq_us=round(config.tq_s * 1e6),
        drop_timeout_us=round(config.drop_timeout_s * 1e6),
        mode=config.mode,
        memory_total_bytes=gpu.memory_total_bytes,
        memory_reserve_percent=config.memory_reserve_percent,
        lease_force_release=config.lease_force_release,
        max_queue=config.max_lock_queue,
        park_timeout_us=round(config.park_timeout_s * 1e6),
        quota=QuotaConfig(
            window_us=round(config.compute_window_s * 1e6),
            carryover_percent=config.quota_carryover_percent,
            drop_tail_billing_percent=config.drop_tail_billing_percent,
            sample_interval_us=round(config.quota_sample_interval_s * 1e6),
            share_windows=config.share_windows,
        ),
    )
