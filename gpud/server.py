"""The daemon's state and its request handling: GPUs, schedulers, owners.

``Daemon.handle`` turns one decoded request into core calls and an answer;
``carry_out`` executes the effects the per-GPU schedulers return (pushes to
clients, metrics, logs) and re-arms the GPU's timer. It only moves bytes,
reads the clock and carries out what the core decides; the sockets and tasks
are in ``gpud.listener``.

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
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import trio

from gpud.allocator import Allocator
from gpud.arbiter import Arbiter
from gpud.config import Config
from gpud.core.authority import PriorityRules, check_priority, fraction_ceilings, priority_ceiling
from gpud.core.gpus import GpuIdentity, resolve_gpu
from gpud.core.quota import QuotaConfig
from gpud.core.scheduler import (
    Drop, Effect, Grant, GpuScheduler, LimitReached, MemOverLimit, Refused, Revoke, SchedulerConfig,
)
from gpud.devices import Gpu
from gpud.faults import Faults
from gpud.metrics import Metrics
from gpud.views import clients_reply, status_reply
from gpud_client import protocol as p

log = structlog.get_logger("gpud.server")
_GPU_REFS_KEPT = 256  # resolved GPU keys remembered (a client may send any number of spellings)


def now_us() -> int:
    return time.monotonic_ns() // 1000


@dataclass(eq=False)
class Connection:
    client_id: int
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]  # supplementary groups, from SO_PEERGROUPS
    fd: int
    cancel: trio.CancelScope  # cancelled to drop the connection at once
    connected_at: int
    pending: deque[bytes] = field(default_factory=deque)  # bytes the writer task has not sent yet
    pending_bytes: int = 0  # in ``pending`` and in the writer's hands
    writing: bool = False  # the writer task holds bytes not yet on the socket
    writer_wake: trio.Event = field(default_factory=trio.Event)
    drained: trio.Event = field(default_factory=trio.Event)
    closing: bool = False
    name: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    greeted: bool = False
    sessions: dict[int, int] = field(default_factory=dict)  # session or lease -> gpu index
    protocol_errors: Counter[str] = field(default_factory=Counter)


@dataclass(eq=False)
class GpuSlot:
    gpu: Gpu
    scheduler: GpuScheduler
    wake: trio.Event = field(default_factory=trio.Event)
    armed_for: int | None = None  # the deadline the timer task sleeps toward
    healthy: bool = True


class Daemon:
    """State shared by every connection: GPUs, schedulers, who owns what."""

    def __init__(self, config: Config, gpus: list[Gpu], metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.gpus = gpus
        self.started_at = now_us()
        self.slots = [GpuSlot(g, GpuScheduler(scheduler_config(config, g), now=self.started_at)) for g in gpus]
        self._identities = [GpuIdentity(g.index, g.uuid) for g in gpus]
        self._gpu_refs: dict[int | str, int] = {}
        self.connections: dict[int, Connection] = {}
        self.owners: dict[int, Connection] = {}  # session -> connection
        self._client_ids = itertools.count(1)
        self._session_ids = itertools.count(1)
        self._codec = p.daemon_codec()
        self._message_counters: dict[type, Any] = {}
        self.per_uid: Counter[int] = Counter()  # open connections by peer uid
        self.descriptor_room = 1_000_000  # connections the open-file limit leaves room for (set at start)
        self.max_connections = config.max_connections
        self.daemon_uid = os.getuid()
        self.admin_gid = admin_gid(config.admin_group)
        self.priority_rules = priority_rules(config)
        self.faults = Faults(metrics)
        metrics.prime([g.index for g in gpus])
        self.arbiter = Arbiter(self, metrics, config.lease_policies())
        self.allocator = Allocator(self, config, sorted(os.sched_getaffinity(0)))
        self.allocator_wake = trio.Event()

    def wake_allocator(self) -> None:
        self.allocator_wake.set()

    # --- plumbing -----------------------------------------------------------

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._codec.encode(msg)

    def send(self, conn: Connection, msg: msgspec.Struct) -> None:
        if conn.closing:
            return
        data = self.encode(msg)
        if not conn.writing and not conn.pending:
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

    def drop(self, conn: Connection, reason: str) -> None:
        """Close a connection from outside its own task: once, whatever called it."""
        if conn.closing:
            return
        conn.closing = True
        conn.cancel.cancel()
        self.metrics.node.connections_dropped.labels(reason).inc()

    def send_error(self, conn: Connection, rid: int | None, code: p.ErrorCode, message: str) -> None:
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

    def is_admin(self, conn: Connection) -> bool:
        """uid 0, the daemon's own uid, or a member of ``admin_group``."""
        if conn.uid == 0 or conn.uid == self.daemon_uid:
            return True
        gid = self.admin_gid
        return gid is not None and (conn.gid == gid or gid in conn.groups)

    def priority_ceiling(self, conn: Connection) -> int:
        return priority_ceiling(self.priority_rules, conn.uid, conn.groups | {conn.gid}, admin=self.is_admin(conn))

    # --- connection lifetime --------------------------------------------------

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
    ) -> Connection:
        pid, uid, gid = creds
        conn = Connection(next(self._client_ids), pid, uid, gid, groups, fd, cancel, now_us())
        self.connections[conn.client_id] = conn
        self.per_uid[uid] += 1
        self.metrics.node.clients.set(len(self.connections))
        return conn

    def close(self, conn: Connection) -> None:
        """Everything the connection held or queued is freed at once; a fault in
        one part of the cleanup does not keep the rest from running."""
        conn.closing = True
        if self.connections.pop(conn.client_id, None) is not None:
            self.per_uid[conn.uid] -= 1
            if self.per_uid[conn.uid] <= 0:
                del self.per_uid[conn.uid]
        self.metrics.node.clients.set(len(self.connections))
        now = now_us()
        for sid, gpu in list(conn.sessions.items()):
            slot = self.slots[gpu]
            self.owners.pop(sid, None)
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

    # --- requests -----------------------------------------------------------

    def handle(self, conn: Connection, msg: Any) -> msgspec.Struct | None:
        """One decoded request -> its answer (or None). Raises Refused."""
        if not conn.greeted:
            if not isinstance(msg, p.Hello):
                raise Refused(p.ErrorCode.HELLO_REQUIRED, f"send HELLO before {msg.__struct_config__.tag}")
            return self.hello(conn, msg)
        now = now_us()
        match msg:
            case p.Hello():
                raise Refused(p.ErrorCode.INVALID, "HELLO was already received on this connection")
            case p.LockRequest(session=sid):
                self.lock_op(conn, sid, now, lambda s: s.request(sid, now))
                return None
            case p.LockReleased(session=sid, grant=g):
                self.lock_op(conn, sid, now, lambda s: s.release(sid, now, grant=g))
                self.observe_release(conn, sid)
                return None
            case p.Acquire():
                self.arbiter.acquire(conn, msg, next(self._session_ids), now)
                return None  # LEASE_RESULT comes from the arbiter, now or later
            case p.Release(lease_id=lease_id, quiet=quiet):
                self.arbiter.release(conn, lease_id, now)
                return None if quiet else p.Ok(id=msg.id)
            case p.MemUpdate(session=sid, used_bytes=used):
                self.lock_op(conn, sid, now, lambda s: s.report_memory(sid, used, now))
                return None
            case p.Attach():
                return self.attach(conn, msg, now)
            case p.SetLimits():
                return self.set_limits(conn, msg, now)
            case p.SetMode(mode=mode, gpu=ref):
                self.require_admin(conn, msg)
                slots = self.targets(ref)
                for slot in slots:
                    self.carry_out(slot, slot.scheduler.set_mode(mode, now), now)
                log.info("mode_set", gpus=[s.gpu.index for s in slots], mode=str(mode), by_pid=conn.pid)
                return p.Ok(id=msg.id)
            case p.Detach(session=sid):
                if self.arbiter.owns(sid):
                    raise Refused(p.ErrorCode.INVALID, f"{sid} is a lease: give it back with RELEASE")
                slot = self.owned(conn, sid)
                effects = slot.scheduler.detach(sid, now)
                del conn.sessions[sid]
                del self.owners[sid]
                self.carry_out(slot, effects, now)
                return p.Ok(id=msg.id)
            case p.SchedOn() | p.SchedOff():
                self.require_admin(conn, msg)
                on = isinstance(msg, p.SchedOn)
                for slot in self.targets(msg.gpu):
                    self.carry_out(slot, slot.scheduler.set_enabled(on, now), now)
                    log.info("scheduler_switched", gpu=slot.gpu.index, on=on, by_pid=conn.pid)
                    for other in list(self.connections.values()):
                        if other.greeted:
                            self.send(other, p.SchedState(gpu=slot.gpu.index, on=on))
                return p.Ok(id=msg.id)
            case p.SetTq(seconds=seconds, gpu=ref):
                self.require_admin(conn, msg)
                slots = self.targets(ref)
                for slot in slots:
                    self.carry_out(slot, slot.scheduler.set_tq(max(1, round(seconds * 1e6)), now), now)
                log.info("tq_set", gpus=[s.gpu.index for s in slots], tq_s=seconds, by_pid=conn.pid)
                return p.Ok(id=msg.id)
            case p.ReportOom(gpu=ref, task_type=task):
                gpu = self.gpu_index(ref)
                self.metrics.oom.labels(gpu, self.arbiter.label(task)).inc()
                log.info("gpu_oom_reported", gpu=gpu, task_type=task, pid=conn.pid, client=conn.client_id)
                return p.Ok(id=msg.id)
            case p.ListLeases():
                self.settle_all(now)
                return p.LeasesReply(id=msg.id, leases=self.arbiter.infos(now))
            case p.SetPolicy():
                self.require_admin(conn, msg)
                policy = self.arbiter.set_policy(msg)
                log.info("policy_set", task_type=msg.task_type, priority=policy.priority,
                         busy_policy=str(policy.busy_policy), max_wait_ms=policy.max_wait_ms, by_pid=conn.pid)
                return p.Ok(id=msg.id)
            case p.ListPolicies():
                return p.PoliciesReply(id=msg.id, policies=self.arbiter.policy_infos())
            case p.Allocate():
                return self.allocator.allocate(conn, msg, now)  # None: it waits, answered later
            case p.Free(task_id=task_id):
                self.allocator.free(conn, task_id, now)
                return p.Ok(id=msg.id)
            case p.ListAllocations():
                self.allocator.advance(now)
                return self.allocator.listing(msg.id)
            case p.ResetAllocations():
                self.allocator.reset(conn, now)
                return p.Ok(id=msg.id)
            case p.Status():
                self.settle_all(now)
                return status_reply(self, msg.id, now)
            case p.ListClients():
                self.settle_all(now)
                return clients_reply(self, msg.id, now)
        raise Refused(p.ErrorCode.UNKNOWN_TYPE, f"unhandled message {type(msg).__name__}")

    def farewell(self, reason: str) -> None:
        """Tell every client we are going; the store is already up to date."""
        for conn in list(self.connections.values()):
            if conn.greeted:
                self.send(conn, p.Goodbye(reason=reason))
        self.allocator.store.close()

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
        self.max_connections = min(config.max_connections, self.descriptor_room)
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

    def attach(self, conn: Connection, msg: p.Attach, now: int) -> p.Attached:
        slot = self.slots[self.gpu_index(msg.gpu)]
        self.check_room(conn)
        check_priority(msg.priority, self.priority_ceiling(conn), "session")
        # A fractional allocation of the session's task (named, or matched by process or uid)
        # caps its limits: the caps are ceilings the client cannot lift later.
        alloc = self.allocator.session_allocation(conn, msg.task_id or conn.labels.get("task_id"), slot.gpu.index)
        core_ceiling, mem_ceiling = fraction_ceilings(alloc, slot.gpu.index, slot.gpu.memory_total_bytes)
        sid = next(self._session_ids)
        effects = slot.scheduler.attach(
            sid, now, priority=msg.priority, core_limit=msg.core_limit, mem_estimate=msg.mem_estimate,
            mem_limit=msg.mem_limit, core_ceiling=core_ceiling, mem_ceiling=mem_ceiling,
        )
        conn.sessions[sid] = slot.gpu.index
        self.owners[sid] = conn
        self.carry_out(slot, effects, now)
        v = slot.scheduler.session(sid, now)
        log.info(
            "session_attached", client=conn.client_id, session=sid, gpu=slot.gpu.index, core_limit=v.core_limit,
            mem_limit_bytes=v.mem_limit, priority=msg.priority, task_id=alloc.task_id if alloc else None,
        )
        return p.Attached(
            id=msg.id, session=sid, gpu=slot.gpu.index, scheduler_on=slot.scheduler.enabled,
            core_limit=v.core_limit, mem_limit=v.mem_limit, memory_total_bytes=slot.gpu.memory_total_bytes,
        )

    def check_room(self, conn: Connection) -> None:
        """Refuse one more session or lease on a connection that has its cap of them."""
        cap = self.config.max_sessions_per_connection
        if len(conn.sessions) >= cap:
            raise LimitReached("max_sessions_per_connection", f"this connection has {cap} sessions and leases open")

    def find_client(self, ref: int | str) -> Connection:
        if isinstance(ref, int):
            found = [c for c in self.connections.values() if c.client_id == ref and c.greeted]
        else:
            found = [c for c in self.connections.values() if c.name == ref and c.greeted]
        if not found:
            raise Refused(p.ErrorCode.UNKNOWN_CLIENT, f"no client {ref!r} is connected (see gpuctl clients)")
        if len(found) > 1:
            ids = ", ".join(str(c.client_id) for c in found)
            raise Refused(p.ErrorCode.INVALID, f"{len(found)} clients are named {ref!r}: use a client id ({ids})")
        return found[0]

    def set_limits(self, conn: Connection, msg: p.SetLimits, now: int) -> p.LimitsSet:
        if msg.core_limit is None and msg.mem_limit is None:
            raise Refused(p.ErrorCode.INVALID, "nothing to change: give core_limit and/or mem_limit")
        target = conn if msg.client is None else self.find_client(msg.client)
        if target is not conn and not self.is_admin(conn):
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED,
                f"changing another client's limits needs uid 0, the daemon's uid or the admin group (peer uid {conn.uid})",
            )
        gpu = None if msg.gpu is None else self.gpu_index(msg.gpu)
        chosen = [
            (sid, g) for sid, g in target.sessions.items()
            if (gpu is None or g == gpu) and (msg.session is None or sid == msg.session) and not self.arbiter.owns(sid)
        ]
        if not chosen:
            raise Refused(p.ErrorCode.UNKNOWN_SESSION, f"client {target.client_id} has no such session")
        admin = self.is_admin(conn)
        if not admin:  # every chosen session is checked before any changes: all or nothing
            for sid, g in chosen:
                self.slots[g].scheduler.check_limits(sid, core_limit=msg.core_limit, mem_limit=msg.mem_limit)
        for sid, g in chosen:
            slot = self.slots[g]
            effects = slot.scheduler.set_limits(
                sid, now, core_limit=msg.core_limit, mem_limit=msg.mem_limit, authority=admin
            )
            self.carry_out(slot, effects, now)
            v = slot.scheduler.session(sid, now)
            self.send(target, p.LimitsChanged(session=sid, core_limit=v.core_limit, mem_limit=v.mem_limit))
        log.info(
            "limits_set", client=target.client_id, sessions=[sid for sid, _ in chosen],
            core_limit=msg.core_limit, mem_limit_bytes=msg.mem_limit, by_pid=conn.pid,
        )
        return p.LimitsSet(id=msg.id, sessions=[sid for sid, _ in chosen])

    def hello(self, conn: Connection, msg: p.Hello) -> p.Welcome:
        if msg.version != p.PROTOCOL_VERSION:
            raise Refused(
                p.ErrorCode.VERSION,
                f"protocol version {msg.version} is not supported (daemon speaks {p.PROTOCOL_VERSION})",
            )
        conn.greeted = True
        conn.name = msg.name
        conn.labels = dict(msg.labels)
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
        return p.Welcome(id=msg.id, client_id=conn.client_id, version=p.PROTOCOL_VERSION, gpus=gpus)

    def observe_release(self, conn: Connection, sid: int) -> None:
        gpu = conn.sessions[sid]
        v = self.slots[gpu].scheduler.session(sid, 0)
        self.metrics.node.lock_hold.labels(gpu).observe(v.last_hold_us / 1e6)
        if v.last_drop_to_release_us is not None:
            self.metrics.node.drop_to_release.labels(gpu).observe(v.last_drop_to_release_us / 1e6)

    def owned(self, conn: Connection, sid: int) -> GpuSlot:
        gpu = conn.sessions.get(sid)
        if gpu is None:
            raise Refused(p.ErrorCode.UNKNOWN_SESSION, f"session {sid} is not attached on this connection")
        return self.slots[gpu]

    def lock_op(self, conn: Connection, sid: int, now: int, op: Any) -> None:
        slot = self.owned(conn, sid)
        self.carry_out(slot, op(slot.scheduler), now)

    def require_admin(self, conn: Connection, msg: msgspec.Struct) -> None:
        if not self.is_admin(conn):
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED,
                f"{msg.__struct_config__.tag} needs uid 0, the daemon's uid or the admin group (peer uid {conn.uid})",
            )


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
