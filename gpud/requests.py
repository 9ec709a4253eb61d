"""Requests: one decoded client message -> core calls and its answer.

``handle`` is what the listener calls for every decoded message of a greeted
(or greeting) connection. It checks who may ask (admin rights, ceilings, the
connection's caps), calls the cores through the daemon and returns the answer,
or raises ``Refused``; pushes and effects go out through ``Daemon.carry_out``.
Nothing here reads sockets or sleeps.
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog

from gpud.core.authority import check_priority, fraction_ceilings
from gpud.core.scheduler import Refused
from gpud.server import Daemon
from gpud.metrics import session_labels
from gpud.state import ClientLink, GpuSlot
from gpud.views import clients_reply, status_reply
from gpud_client import protocol as p

log = structlog.get_logger("gpud.server")


def handle(d: Daemon, conn: ClientLink, msg: Any) -> msgspec.Struct | None:
    """One decoded request -> its answer (or None). Raises Refused."""
    if d.shutting_down:
        raise Refused(p.ErrorCode.SHUTTING_DOWN, "gpud is shutting down; the client library reconnects when it is back")
    if not conn.greeted:
        if not isinstance(msg, p.Hello):
            raise Refused(p.ErrorCode.HELLO_REQUIRED, f"send HELLO before {msg.__struct_config__.tag}")
        return hello(d, conn, msg)
    now = d.now()
    match msg:
        case p.Hello():
            raise Refused(p.ErrorCode.INVALID, "HELLO was already received on this connection")
        case p.LockRequest(session=sid):
            lock_op(d, conn, sid, now, lambda s: s.request(sid, now))
            return None
        case p.LockReleased(session=sid, grant=g):
            lock_op(d, conn, sid, now, lambda s: s.release(sid, now, grant=g))
            observe_release(d, conn, sid)
            return None
        case p.Acquire():
            d.arbiter.acquire(conn, msg, d.new_session_id(), now)
            return None  # LEASE_RESULT comes from the arbiter, now or later
        case p.Release(lease_id=lease_id, quiet=quiet):
            d.arbiter.release(conn, lease_id, now)
            return None if quiet else p.Ok(id=msg.id)
        case p.MemUpdate(session=sid, used_bytes=used):
            lock_op(d, conn, sid, now, lambda s: s.report_memory(sid, used, now))
            return None
        case p.Attach():
            return attach(d, conn, msg, now)
        case p.SetLimits():
            return set_limits(d, conn, msg, now)
        case p.SetMode(mode=mode, gpu=ref):
            require_admin(d, conn, msg)
            slots = d.targets(ref)
            for slot in slots:
                d.carry_out(slot, slot.scheduler.set_mode(mode, now), now)
            log.info("mode_set", gpus=[s.gpu.index for s in slots], mode=str(mode), by_pid=conn.pid)
            return p.Ok(id=msg.id)
        case p.Detach(session=sid):
            if d.arbiter.owns(sid):
                raise Refused(p.ErrorCode.INVALID, f"{sid} is a lease: give it back with RELEASE")
            slot = owned(d, conn, sid)
            effects = slot.scheduler.detach(sid, now)
            del conn.sessions[sid]
            del d.owners[sid]
            d.metrics.node.forget_session(session_labels(slot.gpu.index, sid, conn.name, conn.pid))
            d.carry_out(slot, effects, now)
            return p.Ok(id=msg.id)
        case p.SchedOn() | p.SchedOff():
            require_admin(d, conn, msg)
            on = isinstance(msg, p.SchedOn)
            for slot in d.targets(msg.gpu):
                d.carry_out(slot, slot.scheduler.set_enabled(on, now), now)
                log.info("scheduler_switched", gpu=slot.gpu.index, on=on, by_pid=conn.pid)
                for other in list(d.connections.values()):
                    if other.greeted:
                        d.send(other, p.SchedState(gpu=slot.gpu.index, on=on))
            return p.Ok(id=msg.id)
        case p.SetTq(seconds=seconds, gpu=ref):
            require_admin(d, conn, msg)
            slots = d.targets(ref)
            for slot in slots:
                d.carry_out(slot, slot.scheduler.set_tq(max(1, round(seconds * 1e6)), now), now)
            log.info("tq_set", gpus=[s.gpu.index for s in slots], tq_s=seconds, by_pid=conn.pid)
            return p.Ok(id=msg.id)
        case p.ReportOom(gpu=ref, task_type=task):
            gpu = d.gpu_index(ref)
            d.metrics.oom.labels(gpu, d.arbiter.label(task)).inc()
            log.info("gpu_oom_reported", gpu=gpu, task_type=task, pid=conn.pid, client=conn.client_id)
            return p.Ok(id=msg.id)
        case p.ListLeases():
            d.settle_all(now)
            return p.LeasesReply(id=msg.id, leases=d.arbiter.infos(now))
        case p.SetPolicy():
            require_admin(d, conn, msg)
            policy = d.arbiter.set_policy(msg)
            log.info("policy_set", task_type=msg.task_type, priority=policy.priority,
                     busy_policy=str(policy.busy_policy), max_wait_ms=policy.max_wait_ms, by_pid=conn.pid)
            return p.Ok(id=msg.id)
        case p.ListPolicies():
            return p.PoliciesReply(id=msg.id, policies=d.arbiter.policy_infos())
        case p.Allocate():
            return d.allocator.allocate(conn, msg, now)  # None: it waits, answered later
        case p.Free(task_id=task_id):
            d.allocator.free(conn, task_id, now)
            return p.Ok(id=msg.id)
        case p.ListAllocations():
            d.allocator.advance(now)
            return d.allocator.listing(msg.id)
        case p.ResetAllocations():
            d.allocator.reset(conn, now)
            return p.Ok(id=msg.id)
        case p.Status():
            d.settle_all(now)
            return status_reply(d, msg.id, now)
        case p.ListClients():
            d.settle_all(now)
            return clients_reply(d, msg.id, now)
    raise Refused(p.ErrorCode.UNKNOWN_TYPE, f"unhandled message {type(msg).__name__}")


def hello(d: Daemon, conn: ClientLink, msg: p.Hello) -> p.Welcome:
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
        for s in d.slots
    ]
    return p.Welcome(
        id=msg.id, client_id=conn.client_id, version=p.PROTOCOL_VERSION, gpus=gpus,
        max_frame_bytes=d.config.max_frame_bytes,
    )


def attach(d: Daemon, conn: ClientLink, msg: p.Attach, now: int) -> p.Attached:
    slot = d.slots[d.gpu_index(msg.gpu)]
    d.check_room(conn)
    check_priority(msg.priority, d.priority_ceiling(conn), "session")
    # A fractional allocation of the session's task (named, or matched by process or uid)
    # caps its limits: the caps are ceilings the client cannot lift later.
    alloc = d.allocator.session_allocation(conn, msg.task_id or conn.labels.get("task_id"), slot.gpu.index)
    core_ceiling, mem_ceiling = fraction_ceilings(alloc, slot.gpu.index, slot.gpu.memory_total_bytes)
    sid = d.new_session_id()
    effects = slot.scheduler.attach(
        sid, now, priority=msg.priority, core_limit=msg.core_limit, mem_estimate=msg.mem_estimate,
        mem_limit=msg.mem_limit, core_ceiling=core_ceiling, mem_ceiling=mem_ceiling,
    )
    conn.sessions[sid] = slot.gpu.index
    d.owners[sid] = conn
    d.carry_out(slot, effects, now)
    v = slot.scheduler.session(sid, now)
    log.info(
        "session_attached", client=conn.client_id, session=sid, gpu=slot.gpu.index, core_limit=v.core_limit,
        mem_limit_bytes=v.mem_limit, priority=msg.priority, task_id=alloc.task_id if alloc else None,
    )
    return p.Attached(
        id=msg.id, session=sid, gpu=slot.gpu.index, scheduler_on=slot.scheduler.enabled,
        core_limit=v.core_limit, mem_limit=v.mem_limit, memory_total_bytes=slot.gpu.memory_total_bytes,
    )


def set_limits(d: Daemon, conn: ClientLink, msg: p.SetLimits, now: int) -> p.LimitsSet:
    if msg.core_limit is None and msg.mem_limit is None:
        raise Refused(p.ErrorCode.INVALID, "nothing to change: give core_limit and/or mem_limit")
    target = conn if msg.client is None else find_client(d, msg.client)
    if target is not conn and not d.is_admin(conn):
        raise Refused(
            p.ErrorCode.PERMISSION_DENIED,
            f"changing another client's limits needs uid 0, the daemon's uid or the admin group (peer uid {conn.uid})",
        )
    gpu = None if msg.gpu is None else d.gpu_index(msg.gpu)
    chosen = [
        (sid, g) for sid, g in target.sessions.items()
        if (gpu is None or g == gpu) and (msg.session is None or sid == msg.session) and not d.arbiter.owns(sid)
    ]
    if not chosen:
        raise Refused(p.ErrorCode.UNKNOWN_SESSION, f"client {target.client_id} has no such session")
    # A ceiling binds the session's own client whoever runs it: an allocation's share is not lifted by the
    # task it caps, even one running as root. An admin lifts it from another connection (gpuctl limit).
    authority = d.is_admin(conn) and target is not conn
    if not authority:  # every chosen session is checked before any changes: all or nothing
        for sid, g in chosen:
            d.slots[g].scheduler.check_limits(sid, core_limit=msg.core_limit, mem_limit=msg.mem_limit)
    for sid, g in chosen:
        slot = d.slots[g]
        effects = slot.scheduler.set_limits(
            sid, now, core_limit=msg.core_limit, mem_limit=msg.mem_limit, authority=authority
        )
        d.carry_out(slot, effects, now)
        v = slot.scheduler.session(sid, now)
        d.send(target, p.LimitsChanged(session=sid, core_limit=v.core_limit, mem_limit=v.mem_limit))
    log.info(
        "limits_set", client=target.client_id, sessions=[sid for sid, _ in chosen],
        core_limit=msg.core_limit, mem_limit_bytes=msg.mem_limit, by_pid=conn.pid,
    )
    return p.LimitsSet(id=msg.id, sessions=[sid for sid, _ in chosen])


def find_client(d: Daemon, ref: int | str) -> ClientLink:
    if isinstance(ref, int):
        found = [c for c in d.connections.values() if c.client_id == ref and c.greeted]
    else:
        found = [c for c in d.connections.values() if c.name == ref and c.greeted]
    if not found:
        raise Refused(p.ErrorCode.UNKNOWN_CLIENT, f"no client {ref!r} is connected (see gpuctl clients)")
    if len(found) > 1:
        ids = ", ".join(str(c.client_id) for c in found)
        raise Refused(p.ErrorCode.INVALID, f"{len(found)} clients are named {ref!r}: use a client id ({ids})")
    return found[0]


def lock_op(d: Daemon, conn: ClientLink, sid: int, now: int, op: Any) -> None:
    slot = owned(d, conn, sid)
    d.carry_out(slot, op(slot.scheduler), now)


def owned(d: Daemon, conn: ClientLink, sid: int) -> GpuSlot:
    gpu = conn.sessions.get(sid)
    if gpu is None:
        raise Refused(p.ErrorCode.UNKNOWN_SESSION, f"session {sid} is not attached on this connection")
    return d.slots[gpu]


def observe_release(d: Daemon, conn: ClientLink, sid: int) -> None:
    gpu = conn.sessions[sid]
    v = d.slots[gpu].scheduler.session(sid, 0)
    d.metrics.node.lock_hold.labels(gpu).observe(v.last_hold_us / 1e6)
    if v.last_drop_to_release_us is not None:
        d.metrics.node.drop_to_release.labels(gpu).observe(v.last_drop_to_release_us / 1e6)


def require_admin(d: Daemon, conn: ClientLink, msg: msgspec.Struct) -> None:
    if not d.is_admin(conn):
        raise Refused(
            p.ErrorCode.PERMISSION_DENIED,
            f"{msg.__struct_config__.tag} needs uid 0, the daemon's uid or the admin group (peer uid {conn.uid})",
        )
