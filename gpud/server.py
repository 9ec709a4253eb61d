"""The daemon's state: GPUs, schedulers, connections and who owns what.

``carry_out`` executes the effects the per-GPU schedulers return (pushes to
clients, metrics, logs) and re-arms the GPU's timer; ``open`` and ``close``
admit and free connections under the caps. It only moves bytes, reads the
clock and carries out what the core decides; requests are handled in
``gpud.requests``, the sockets and tasks are in ``gpud.listener``.

Pushes go to a connection's outbox, counted in bytes, so a push to a slow
client never blocks anyone else: past ``outbox_limit_bytes`` unread it is
disconnected (logged once). A message for an idle connection (nothing queued,
the writer not mid-write) is written straight to its non-blocking socket from
the task that decided it: a grant reaches the next holder without a trip
through the scheduler to the writer task. Whatever the kernel does not take
goes to the outbox, in order.

A refused call raises ``Refused`` and is answered with an Error. A fault in
carrying out one effect is logged, counted and skipped (the others are still
carried out); only an inconsistent scheduler stops the daemon.
"""

from __future__ import annotations

import grp
import itertools
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import trio

from gpud.allocator import Allocator
from gpud.arbiter import Arbiter
from gpud.config import Config
from gpud.core.authority import PriorityRules, priority_ceiling
from gpud.core.gpus import GpuIdentity, resolve_gpu
from gpud.core.quota import QuotaConfig
from gpud.core.scheduler import (
    Drop, Effect, Grant, GpuScheduler, LimitReached, MemOverLimit, Refused, Revoke, SchedulerConfig,
)
from gpud.devices import Gpu
from gpud.faults import Faults
from gpud.metrics import Metrics, session_labels
from gpud.state import ClientLink, GpuSlot, now_us
from gpud_client import protocol as p

log = structlog.get_logger("gpud.server")
_GPU_REFS_KEPT = 256  # resolved GPU keys remembered (a client may send any number of spellings)


class Daemon:
    """State shared by every connection: GPUs, schedulers, who owns what."""

    def __init__(
        self, config: Config, gpus: list[Gpu], metrics: Metrics, *, clock: Callable[[], int] = now_us,
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
        self._identities = [GpuIdentity(g.index, g.uuid) for g in gpus]
        self._gpu_refs: dict[int | str, int] = {}
        self.connections: dict[int, ClientLink] = {}
        self.owners: dict[int, ClientLink] = {}  # session -> connection
        self._client_ids = itertools.count(1)
        self._session_ids = itertools.count(1)
        self._codec = p.daemon_codec()
        self._message_counters: dict[type, Any] = {}
        self.per_uid: Counter[int] = Counter()  # open connections by peer uid
        self.descriptor_room = 1_000_000  # connections the open-file limit leaves room for (set at start)
        self.daemon_uid = os.getuid()
        self.admin_gid = admin_gid(config.admin_group)
        self.priority_rules = priority_rules(config)
        self.faults = Faults(metrics)
        metrics.prime([g.index for g in gpus])
        self.arbiter = Arbiter(self, metrics, config.lease_policies())
        self.allocator = Allocator(self, config, sorted(os.sched_getaffinity(0)))
        self.allocator_wake = trio.Event()

    def new_session_id(self) -> int:
        return next(self._session_ids)

    def wake_allocator(self) -> None:
        self.allocator_wake.set()

    # --- plumbing -----------------------------------------------------------

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._codec.encode(msg)

    def send(self, conn: ClientLink, msg: msgspec.Struct) -> None:
        if conn.closing:
            return
        data = self.encode(msg)
        if conn.fd >= 0 and not conn.writing and not conn.pending:
            try:
                sent = os.write(conn.fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:  # the peer is gone; its reader sees EOF and cleans up
                self.drop(conn, "peer_gone")
                return
            if sent == len(data):
                return
            data = data[sent:]
        if conn.pending_bytes > self.config.outbox_limit_bytes:
            log.warning("client_too_slow", client=conn.client_id, pid=conn.pid, unread_bytes=conn.pending_bytes,
                        limit_bytes=self.config.outbox_limit_bytes)
            self.drop(conn, "too_slow")
            return
        conn.pending.append(data)
        conn.pending_bytes += len(data)
        conn.writer_wake.set()

    def drop(self, conn: ClientLink, reason: str) -> None:
        """Close a connection from outside its own task: once, whatever called it."""
        if conn.closing:
            return
        conn.closing = True
        conn.cancel.cancel()
        self.metrics.node.connections_dropped.labels(reason).inc()

    def send_error(self, conn: ClientLink, rid: int | None, code: p.ErrorCode, message: str) -> None:
        self.metrics.node.protocol_errors.labels(str(code)).inc()
        self.send(conn, p.Error(id=rid, code=code, message=message))

    def count_message(self, kind: type) -> None:
        child = self._message_counters.get(kind)
        if child is None:
            child = self._message_counters[kind] = self.metrics.node.messages.labels(kind.__struct_config__.tag)  # type: ignore[attr-defined]
        child.inc()

    def gpu_index(self, ref: int | str) -> int:
        found = self._gpu_refs.get(ref)
        if found is not None:
            return found
        try:
            index = resolve_gpu(ref, self._identities)
        except ValueError as exc:
            raise Refused(p.ErrorCode.UNKNOWN_GPU, str(exc)) from None
        if len(self._gpu_refs) < _GPU_REFS_KEPT:  # services repeat the same key: resolve it once
            self._gpu_refs[ref] = index
        return index

    def targets(self, ref: int | str | None) -> list[GpuSlot]:
        return self.slots if ref is None else [self.slots[self.gpu_index(ref)]]

    def carry_out(self, slot: GpuSlot, effects: list[Effect], now: int) -> None:
        """Execute the scheduler's decisions, taken at ``now``, and re-arm its timer."""
        gpu = slot.gpu.index
        for e in effects:
            try:
                self._carry_out_one(slot, e, now)
            except Exception as exc:  # one effect's fault skips that effect, never the rest
                self.faults.record("effect", exc, gpu=gpu, effect=type(e).__name__, session=e.session)
        deadline = slot.scheduler.next_deadline()
        if deadline is not None and (slot.armed_for is None or deadline < slot.armed_for):
            slot.wake.set()  # only an earlier deadline needs the timer now; a later one it finds itself

    def _carry_out_one(self, slot: GpuSlot, e: Effect, now: int) -> None:
        gpu = slot.gpu.index
        if self.arbiter.owns(e.session):
            self.arbiter.carry_out(slot, e, now)
            return
        owner = self.owners.get(e.session)
        if owner is None:
            return
        match e:
            case Grant(session=sid, grant=g, waited_us=waited):
                log.debug("lock_granted", gpu=gpu, session=sid, grant=g, client=owner.client_id)
                self.metrics.lock_grants.labels(gpu).inc()
                self.metrics.node.lock_wait.labels(gpu).observe(waited / 1e6)
                self.send(owner, p.LockOk(session=sid, grant=g))
            case Drop(session=sid, grant=g, reason=r):
                log.debug("lock_drop", gpu=gpu, session=sid, grant=g, reason=str(r))
                if r == p.DropReason.QUOTA:
                    log.info("session_throttled", gpu=gpu, session=sid, client=owner.client_id, pid=owner.pid)
                self.metrics.lock_drops.labels(gpu, str(r)).inc()
                self.send(owner, p.DropLock(session=sid, grant=g, reason=r))
            case Revoke(session=sid, grant=g, reason=r):
                log.warning("lock_revoked", gpu=gpu, session=sid, grant=g, reason=str(r), pid=owner.pid)
                self.metrics.lock_revocations.labels(gpu, str(r)).inc()
                self.send(owner, p.Revoked(session=sid, grant=g, reason=r))
            case MemOverLimit(session=sid, used_bytes=used, limit_bytes=limit):
                log.warning("memory_limit_exceeded", gpu=gpu, session=sid, pid=owner.pid, used_bytes=used,
                            limit_bytes=limit)
                self.send(owner, p.MemLimitExceeded(session=sid, used_bytes=used, limit_bytes=limit))

    def is_admin(self, conn: ClientLink) -> bool:
        """uid 0, the daemon's own uid, or a member of ``admin_group``."""
        if conn.uid == 0 or conn.uid == self.daemon_uid:
            return True
        gid = self.admin_gid
        return gid is not None and (conn.gid == gid or gid in conn.groups)

    def priority_ceiling(self, conn: ClientLink) -> int:
        return priority_ceiling(self.priority_rules, conn.uid, conn.groups | {conn.gid}, admin=self.is_admin(conn))

    # --- connection lifetime --------------------------------------------------

    @property
    def max_connections(self) -> int:
        """The configured cap, lowered to what the open-file limit leaves room for."""
        return min(self.config.max_connections, self.descriptor_room)

    def admission_refusal(self, uid: int) -> tuple[str, str] | None:
        """(cap, message) when a new connection from ``uid`` is refused, else None."""
        if len(self.connections) >= self.max_connections:
            return "max_connections", (
                f"gpud serves at most {self.max_connections} connections (max_connections); try again later"
            )
        cap = self.config.max_connections_per_uid
        if self.per_uid[uid] >= cap:
            return "max_connections_per_uid", (
                f"uid {uid} has {cap} connections open, the most allowed (max_connections_per_uid)"
            )
        return None

    def check_schedulers(self) -> None:
        """After a fault: stop (raise ``Inconsistent``) if a scheduler's records disagree."""
        for slot in self.slots:
            slot.scheduler.check()

    def open(
        self, creds: tuple[int, int, int], groups: frozenset[int], fd: int, cancel: trio.CancelScope
    ) -> ClientLink:
        pid, uid, gid = creds
        conn = ClientLink(next(self._client_ids), pid, uid, gid, groups, fd, cancel, self.now())
        self.connections[conn.client_id] = conn
        self.per_uid[uid] += 1
        self.metrics.node.clients.set(len(self.connections))
        return conn

    def close(self, conn: ClientLink) -> None:
        """Everything the connection held or queued is freed at once; a fault in
        one part of the cleanup does not keep the rest from running."""
        conn.closing = True
        if self.connections.pop(conn.client_id, None) is not None:
            self.per_uid[conn.uid] -= 1
            if self.per_uid[conn.uid] <= 0:
                del self.per_uid[conn.uid]
        self.metrics.node.clients.set(len(self.connections))
        now = self.now()
        for sid, gpu in list(conn.sessions.items()):
            slot = self.slots[gpu]
            self.owners.pop(sid, None)
            self.metrics.node.forget_session(session_labels(gpu, sid, conn.name, conn.pid))
            try:
                self.carry_out(slot, slot.scheduler.detach(sid, now), now)
            except Refused:
                pass  # already gone from the scheduler
        for part in (self.arbiter, self.allocator):
            try:
                part.connection_closed(conn, now)
            except Exception as exc:
                self.faults.record("close", exc, client=conn.client_id, part=type(part).__name__)
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
        for conn in list(self.connections.values()):
            if conn.greeted:
                self.send(conn, p.Goodbye(reason=reason))

    def reload(self, config: Config, now: int) -> tuple[list[str], list[str]]:
        """Apply what can change live: (keys changed now, keys whose change waits for a restart).
        The latter keep their running values, so the daemon's config is always what is in force."""
        old = self.config
        changed = [k for k in config.__struct_fields__ if getattr(old, k) != getattr(config, k)]
        later = [k for k in changed if k in RESTART_KEYS]
        config = msgspec.structs.replace(config, **{k: getattr(old, k) for k in later})
        self.config = config
        self.admin_gid = admin_gid(config.admin_group)
        self.priority_rules = priority_rules(config)
        self.allocator.reconfigure(config)
        for slot in self.slots:
            new = scheduler_config(config, slot.gpu)
            sched = slot.scheduler
            if new.tq_us != sched.config.tq_us:
                self.carry_out(slot, sched.set_tq(new.tq_us, now), now)
            if new.mode != sched.config.mode:
                self.carry_out(slot, sched.set_mode(new.mode, now), now)
            self.carry_out(slot, sched.reconfigure(new, now), now)
        self.arbiter.set_policies(config.lease_policies())
        return [k for k in changed if k not in later], later

    def settle_all(self, now: int) -> None:
        """Bring every account up to ``now`` before reporting figures."""
        for slot in self.slots:
            self.carry_out(slot, slot.scheduler.advance(now), now)

    def check_room(self, conn: ClientLink) -> None:
        """Refuse one more session or lease on a connection that has its cap of them."""
        cap = self.config.max_sessions_per_connection
        if len(conn.sessions) >= cap:
            raise LimitReached("max_sessions_per_connection", f"this connection has {cap} sessions and leases open")

# What only a restart can change: sockets, devices, the store, the metrics endpoint.
RESTART_KEYS = frozenset({"socket", "socket_mode", "simulate", "state_dir", "state_sync", "metrics_addr"})


def scheduler_config(config: Config, gpu: Gpu) -> SchedulerConfig:
    return SchedulerConfig(
        tq_us=round(config.tq_s * 1e6),
        drop_timeout_us=round(config.drop_timeout_s * 1e6),
        mode=config.mode,
        memory_total_bytes=gpu.memory_total_bytes,
        memory_reserve_percent=config.memory_reserve_percent,
        lease_force_release=config.lease_force_release,
        max_queue=config.max_lock_queue,
        quota=QuotaConfig(
            window_us=round(config.compute_window_s * 1e6),
            carryover_percent=config.quota_carryover_percent,
            drop_tail_billing_percent=config.drop_tail_billing_percent,
            sample_interval_us=round(config.quota_sample_interval_s * 1e6),
            share_windows=config.share_windows,
        ),
    )


def admin_gid(name: str) -> int | None:
    return group_id(name) if name else None


def group_id(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        log.info("group_missing", group=name)
        return None


def priority_rules(config: Config) -> PriorityRules:
    by_gid = {gid: cap for name, cap in config.priority_max_groups.items() if (gid := group_id(name)) is not None}
    return PriorityRules(
        default_max=config.priority_max, by_uid={int(u): cap for u, cap in config.priority_max_uids.items()},
        by_gid=by_gid,
    )
