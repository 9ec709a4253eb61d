"""Locks and sessions: ATTACH, DETACH, LOCK_REQUEST, LOCK_RELEASED, MEM_UPDATE,
SET_LIMITS, and the pushes the schedulers decide for sessions (LOCK_OK,
DROP_LOCK, REVOKED, MEM_LIMIT_EXCEEDED).

Each handler checks who may ask (the connection's caps, priority ceilings,
admin rights), calls the GPU's scheduler and hands its effects to ``Effects``;
it returns the answer or raises ``Refused``. Lock metrics are cells bound per
GPU once, so a lock cycle updates numbers, not metric families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import structlog

from gpud.core.authority import fraction_ceilings
from gpud.core.errors import Refused
from gpud.core.ledger import Allocation
from gpud.core.scheduler import AskPark, Drop, Grant, MemOverLimit, ParkOverdue, Revoke
from gpud.host.logging import debug
from gpud.host.metrics import Metrics, session_labels
from gpud.kit.parts import Part, Pieces
from gpud.kit.state import ClientLink, GpuSlot, Handler
from gpud_client import protocol as p

log = structlog.get_logger(__name__)

# The allocation a new session of a connection on a GPU belongs to (its ceilings), if any.
AllocationOf = Callable[[ClientLink, "str | None", int], "Allocation | None"]


class _GpuCells:
    """One GPU's lock metrics, looked up once."""

    def __init__(self, m: Metrics, gpu: int) -> None:
        self.grants = m.lock_grants.labels(gpu)
        self.wait = m.node.lock_wait.labels(gpu)
        self.hold = m.node.lock_hold.labels(gpu)
        self.drop_to_release = m.node.drop_to_release.labels(gpu)
        self.drops = {r: m.lock_drops.labels(gpu, str(r)) for r in p.DropReason}
        self.revocations = {r: m.lock_revocations.labels(gpu, str(r)) for r in p.RevokeReason}


class Locks(Part):
    def __init__(
        self,
        pieces: Pieces,
        ids: Iterator[int],
        allocation_of: AllocationOf,
        is_lease: Callable[[int], bool],
    ) -> None:
        super().__init__(pieces)
        self.ids = ids
        self.allocation_of = allocation_of
        self.is_lease = is_lease
        self._cells = [_GpuCells(self.metrics, s.gpu.index) for s in self.slots]
        effects = self.effects
        effects.on(Grant, self._granted)
        effects.on(Drop, self._dropped)
        effects.on(Revoke, self._revoked)
        effects.on(MemOverLimit, self._over_memory)
        effects.on(AskPark, self._ask_park)
        effects.on(ParkOverdue, self._park_overdue)

    def handlers(self) -> dict[type, Handler]:
        return {
            p.LockRequest: self.lock_request,
            p.LockReleased: self.lock_released,
            p.MemUpdate: self.mem_update,
            p.Parked: self.parked,
            p.Attach: self.attach,
            p.Detach: self.detach,
            p.SetLimits: self.set_limits,
        }

    # --- the lock -------------------------------------------------------------

    def lock_request(self, conn: ClientLink, msg: p.LockRequest, now: int) -> None:
        slot = self._owned(conn, msg.session)
        self.effects.carry_out(slot.scheduler.request(msg.session, now), now, slot)

    def lock_released(self, conn: ClientLink, msg: p.LockReleased, now: int) -> None:
        sid = msg.session
        slot = self._owned(conn, sid)
        self.effects.carry_out(slot.scheduler.release(sid, now, grant=msg.grant), now, slot)
        held_us, drop_to_release_us = slot.scheduler.last_hold(sid)
        cells = self._cells[slot.gpu.index]
        cells.hold.observe(held_us / 1e6)
        if drop_to_release_us is not None:
            cells.drop_to_release.observe(drop_to_release_us / 1e6)

    def parked(self, conn: ClientLink, msg: p.Parked, now: int) -> None:
        slot = self._owned(conn, msg.session)
        effects = slot.scheduler.parked(msg.session, msg.ok, now)
        if msg.ok:
            log.info("session_parked", gpu=slot.gpu.index, session=msg.session, pid=conn.pid)
        else:
            log.warning("park_refused", gpu=slot.gpu.index, session=msg.session, pid=conn.pid, why=msg.message)
        self.effects.carry_out(effects, now, slot)

    def mem_update(self, conn: ClientLink, msg: p.MemUpdate, now: int) -> None:
        self.report_memory(self._owned(conn, msg.session), msg.session, msg.used_bytes, now)

    def report_memory(self, slot: GpuSlot, sid: int, used: int, now: int) -> None:
        self.effects.carry_out(slot.scheduler.report_memory(sid, used, now), now, slot)

    # --- sessions ---------------------------------------------------------------

    def attach(self, conn: ClientLink, msg: p.Attach, now: int) -> p.Attached:
        slot = self.refs.slot(msg.gpu)
        self.links.check_room(conn)
        self.access.check_priority(conn, msg.priority, "session")
        # A fractional allocation of the session's task (named, or matched by process or uid)
        # caps its limits: the caps are ceilings the client cannot lift later.
        alloc = self.allocation_of(conn, msg.task_id or conn.labels.get("task_id"), slot.gpu.index)
        if conn.scope is not None and (alloc is None or slot.gpu.index not in alloc.gpus):
            held = "holds no allocation" if alloc is None else f"holds GPUs {list(alloc.gpus)}"
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED,
                f"a session on the socket of task {conn.scope!r} runs on its allocation's GPUs: "
                f"the task {held}, not GPU {slot.gpu.index}",
            )
        if slot.draining and alloc is None:
            raise Refused(
                p.ErrorCode.INSUFFICIENT,
                f"GPU {slot.gpu.index} is being drained: no new session on it (gpuctl undrain puts it back)",
            )
        core_ceiling, mem_ceiling = fraction_ceilings(alloc, slot.gpu.index, slot.gpu.memory_total_bytes)
        sid = next(self.ids)
        effects = slot.scheduler.attach(
            sid,
            now,
            priority=msg.priority,
            core_limit=msg.core_limit,
            mem_estimate=msg.mem_estimate,
            mem_limit=msg.mem_limit,
            core_ceiling=core_ceiling,
            mem_ceiling=mem_ceiling,
            parkable=msg.parkable,
        )
        self.links.own(conn, sid, slot.gpu.index)
        v = slot.scheduler.session(sid, now)
        log.info(
            "session_attached",
            client=conn.client_id,
            session=sid,
            gpu=slot.gpu.index,
            core_limit=v.core_limit,
            mem_limit_bytes=v.mem_limit,
            priority=msg.priority,
            task_id=alloc.task_id if alloc else None,
        )
        # After the answer: a push for the new session (a PARK, its memory counting as on the GPU
        # from now) must not reach the client before the session does.
        self.effects.after_answer(effects, now, slot)
        return p.Attached(
            id=msg.id,
            session=sid,
            gpu=slot.gpu.index,
            scheduler_on=slot.scheduler.enabled,
            core_limit=v.core_limit,
            mem_limit=v.mem_limit,
            memory_total_bytes=slot.gpu.memory_total_bytes,
        )

    def detach(self, conn: ClientLink, msg: p.Detach, now: int) -> p.Ok:
        sid = msg.session
        if self.is_lease(sid):
            raise Refused(p.ErrorCode.INVALID, f"{sid} is a lease: give it back with RELEASE")
        slot = self._owned(conn, sid)
        effects = slot.scheduler.detach(sid, now)
        self.links.disown(conn, sid)
        self.metrics.node.forget_session(session_labels(slot.gpu.index, sid, conn.name, conn.pid))
        self.effects.carry_out(effects, now, slot)
        return p.Ok(id=msg.id)

    def connection_closed(self, conn: ClientLink, now: int) -> None:
        """Every session of a closed connection is detached (its leases are the arbiter's)."""
        for sid, gpu in list(conn.sessions.items()):
            if self.is_lease(sid):
                continue
            slot = self.slots[gpu]
            self.links.disown(conn, sid)
            self.metrics.node.forget_session(session_labels(gpu, sid, conn.name, conn.pid))
            try:
                self.effects.carry_out(slot.scheduler.detach(sid, now), now, slot)
            except Refused:
                pass  # already gone from the scheduler

    def set_limits(self, conn: ClientLink, msg: p.SetLimits, now: int) -> p.LimitsSet:
        if msg.core_limit is None and msg.mem_limit is None:
            raise Refused(p.ErrorCode.INVALID, "nothing to change: give core_limit and/or mem_limit")
        target = conn if msg.client is None else self.links.find_client(msg.client)
        if target is not conn and not self.access.is_admin(conn):
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED,
                f"changing another client's limits needs uid 0, the daemon's uid or the admin group "
                f"(peer uid {conn.uid})",
            )
        gpu = None if msg.gpu is None else self.refs.index(msg.gpu)
        chosen = [
            (sid, g)
            for sid, g in target.sessions.items()
            if (gpu is None or g == gpu) and (msg.session is None or sid == msg.session) and not self.is_lease(sid)
        ]
        if not chosen:
            raise Refused(p.ErrorCode.UNKNOWN_SESSION, f"client {target.client_id} has no such session")
        # A ceiling binds the session's own client whoever runs it: an allocation's share is not lifted by the
        # task it caps, even one running as root. An admin lifts it from another connection (gpuctl limit).
        authority = self.access.is_admin(conn) and target is not conn
        if not authority:  # every chosen session is checked before any changes: all or nothing
            for sid, g in chosen:
                self.slots[g].scheduler.check_limits(sid, core_limit=msg.core_limit, mem_limit=msg.mem_limit)
        for sid, g in chosen:
            slot = self.slots[g]
            effects = slot.scheduler.set_limits(
                sid, now, core_limit=msg.core_limit, mem_limit=msg.mem_limit, authority=authority
            )
            self.effects.carry_out(effects, now, slot)
            v = slot.scheduler.session(sid, now)
            self.links.send(target, p.LimitsChanged(session=sid, core_limit=v.core_limit, mem_limit=v.mem_limit))
        log.info(
            "limits_set",
            client=target.client_id,
            sessions=[sid for sid, _ in chosen],
            core_limit=msg.core_limit,
            mem_limit_bytes=msg.mem_limit,
            by_pid=conn.pid,
        )
        return p.LimitsSet(id=msg.id, sessions=[sid for sid, _ in chosen])

    def _owned(self, conn: ClientLink, sid: int) -> GpuSlot:
        gpu = conn.sessions.get(sid)
        if gpu is None:
            raise Refused(p.ErrorCode.UNKNOWN_SESSION, f"session {sid} is not attached on this connection")
        return self.slots[gpu]

    # --- pushes -------------------------------------------------------------------

    def _granted(self, e: Grant, now: int) -> None:
        owner = self.links.owners.get(e.session)
        if owner is None:
            return
        gpu = owner.sessions[e.session]
        self.links.send(owner, p.LockOk(session=e.session, grant=e.grant))
        cells = self._cells[gpu]
        cells.grants.value += 1
        cells.wait.observe(e.waited_us / 1e6)
        if debug.on:
            log.debug("lock_granted", gpu=gpu, session=e.session, grant=e.grant, client=owner.client_id)

    def _dropped(self, e: Drop, now: int) -> None:
        owner = self.links.owners.get(e.session)
        if owner is None:
            return
        gpu = owner.sessions[e.session]
        log.debug("lock_drop", gpu=gpu, session=e.session, grant=e.grant, reason=str(e.reason))
        if e.reason == p.DropReason.QUOTA:
            log.info("session_throttled", gpu=gpu, session=e.session, client=owner.client_id, pid=owner.pid)
        self._cells[gpu].drops[e.reason].value += 1
        self.links.send(owner, p.DropLock(session=e.session, grant=e.grant, reason=e.reason))

    def _revoked(self, e: Revoke, now: int) -> None:
        owner = self.links.owners.get(e.session)
        if owner is None:
            return
        gpu = owner.sessions[e.session]
        log.warning("lock_revoked", gpu=gpu, session=e.session, grant=e.grant, reason=str(e.reason), pid=owner.pid)
        self._cells[gpu].revocations[e.reason].value += 1
        self.links.send(owner, p.Revoked(session=e.session, grant=e.grant, reason=e.reason))

    def _ask_park(self, e: AskPark, now: int) -> None:
        owner = self.links.owners.get(e.session)
        if owner is None:
            return
        log.info("park_asked", gpu=owner.sessions[e.session], session=e.session, pid=owner.pid)
        self.links.send(owner, p.Park(session=e.session))

    def _park_overdue(self, e: ParkOverdue, now: int) -> None:
        owner = self.links.owners.get(e.session)
        gpu = owner.sessions.get(e.session) if owner is not None else None
        log.warning("park_overdue", gpu=gpu, session=e.session, pid=owner.pid if owner else None)

    def _over_memory(self, e: MemOverLimit, now: int) -> None:
        owner = self.links.owners.get(e.session)
        if owner is None:
            return
        log.warning(
            "memory_limit_exceeded",
            gpu=owner.sessions[e.session],
            session=e.session,
            pid=owner.pid,
            used_bytes=e.used_bytes,
            limit_bytes=e.limit_bytes,
        )
        self.links.send(
            owner, p.MemLimitExceeded(session=e.session, used_bytes=e.used_bytes, limit_bytes=e.limit_bytes)
        )
