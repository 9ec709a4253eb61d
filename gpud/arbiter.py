"""The shell's side of leases (GpuArbiter): ids, answers, logs and metrics.

The per-GPU scheduler decides (grant, deny, watchdog); this module remembers
which ACQUIRE a lease answers, sends LEASE_RESULT, and writes the one log line
per acquire with its trace (job_id, session_id, utterance_index, stage), its
status, wait and hold. It never decides anything itself.

Task types are any name a client sends, so metric labels use the name only when
a policy is configured for it, and ``other`` for the rest: a client sending
20 000 task types adds no series.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import structlog

from gpud.core.authority import check_priority
from gpud.core.leases import LeasePolicy, LeaseTerms, refusal_status, resolve_terms
from gpud.core.scheduler import Effect, Grant, HoldOverdue, LeaseDenied, Refused, Revoke
from gpud.metrics import Metrics
from gpud.state import ClientLink, GpuSlot, Host
from gpud_client import protocol as p


log = structlog.get_logger("gpud.arbiter")


@dataclass(eq=False)
class LeaseRecord:
    sid: int
    lease_id: str
    conn: ClientLink
    gpu: int
    terms: LeaseTerms
    trace: p.Trace
    request_id: int
    requested_at: int
    label: str  # task type as a metric label, fixed at acquire (a policy added later does not move it)
    waiting: bool = False
    granted_at: int | None = None
    overdue: bool = False


class _Children:
    """The metric children of one (gpu, task_type), looked up once."""

    def __init__(self, m: Metrics, gpu: int, task_type: str) -> None:
        labels = (str(gpu), task_type)
        self.acquired = {st: m.acquire_total.labels(*labels, str(st)) for st in p.LeaseStatus}
        self.queue_wait = m.queue_wait.labels(*labels)
        self.hold = m.hold.labels(*labels)
        self.queue_length = m.queue_length.labels(*labels)
        self.timeouts = m.timeouts.labels(*labels)
        self.queue_full = m.queue_full.labels(*labels)
        self.watchdog = m.watchdog.labels(*labels)


class Arbiter:
    def __init__(self, daemon: Host, metrics: Metrics, policies: dict[str, LeasePolicy]) -> None:
        self.daemon = daemon
        self.metrics = metrics
        self.policies = policies
        self.by_sid: dict[int, LeaseRecord] = {}
        self.by_id: dict[str, LeaseRecord] = {}
        self._prefix = secrets.token_hex(3)  # ids of one daemon run never repeat another's
        self._children: dict[tuple[int, str], _Children] = {}
        self._terms: dict[tuple[object, ...], LeaseTerms] = {}  # emptied when policies change
        self._prime()

    def _prime(self) -> None:
        """Every (gpu, configured task type or other) has its series from the start."""
        for slot in self.daemon.slots:
            for label in [*self.policies, "other"]:
                key = (slot.gpu.index, label)
                if key not in self._children:
                    self._children[key] = _Children(self.metrics, *key)

    def _m(self, rec: LeaseRecord) -> _Children:
        key = (rec.gpu, rec.label)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = _Children(self.metrics, *key)
        return found

    def label(self, task_type: str) -> str:
        """A task type as a metric label: configured policies by name, the rest ``other``."""
        return task_type if task_type in self.policies else "other"

    # --- requests -----------------------------------------------------------

    def acquire(self, conn: ClientLink, msg: p.Acquire, sid: int, now: int) -> None:
        slot = self.daemon.slots[self.daemon.gpu_index(msg.gpu)]
        self.daemon.check_room(conn)
        check_priority(msg.priority, self.daemon.priority_ceiling(conn), "lease")
        key = (msg.task_type, msg.priority, msg.busy_policy, msg.max_wait_ms, msg.queue_limit, msg.hold_max_ms,
               msg.mem_estimate)
        terms = self._terms.get(key)
        if terms is None:  # services repeat the same request shape: resolve it once
            cfg = self.daemon.config
            terms = resolve_terms(
                msg.task_type, self.policies, priority=msg.priority, busy_policy=msg.busy_policy,
                max_wait_ms=msg.max_wait_ms, queue_limit=msg.queue_limit, hold_max_ms=msg.hold_max_ms,
                mem_estimate=msg.mem_estimate, default_queue_limit=cfg.lease_queue_limit,
                default_hold_max_ms=cfg.lease_hold_max_ms,
            )
            if len(self._terms) < 4096:
                self._terms[key] = terms
        rec = LeaseRecord(sid, f"{self._prefix}-{sid}", conn, slot.gpu.index, terms, msg.trace, msg.id, now,
                          self.label(terms.task_type))
        self.by_sid[sid] = rec
        self.by_id[rec.lease_id] = rec
        conn.sessions[sid] = slot.gpu.index
        self.daemon.owners[sid] = conn
        effects = slot.scheduler.acquire_lease(
            sid, now, priority=terms.priority, max_wait_us=terms.max_wait_ms * 1000,
            hold_max_us=terms.hold_max_ms * 1000, queue_limit=terms.queue_limit, mem_estimate=terms.mem_estimate,
        )
        self.daemon.carry_out(slot, effects, now)
        if sid in self.by_sid and rec.granted_at is None:  # neither granted nor denied: it waits
            rec.waiting = True
            self._m(rec).queue_length.inc()

    def release(self, conn: ClientLink, lease_id: str, now: int) -> None:
        rec = self.by_id.get(lease_id)
        if rec is None:
            return  # released already, or never ours to know: idempotent
        if rec.conn is not conn:
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED, f"lease {lease_id} belongs to client {rec.conn.client_id}, not to you"
            )
        slot = self.daemon.slots[rec.gpu]
        self._finish(rec, now, "released")
        self.daemon.carry_out(slot, slot.scheduler.release_lease(rec.sid, now), now)

    def connection_closed(self, conn: ClientLink, now: int) -> None:
        """Its leases die with it (the scheduler side is detached by the caller)."""
        for rec in [r for r in self.by_sid.values() if r.conn is conn]:
            self._finish(rec, now, "disconnected")

    # --- effects ------------------------------------------------------------

    def owns(self, sid: int) -> bool:
        return sid in self.by_sid

    def carry_out(self, slot: GpuSlot, effect: Effect, now: int) -> None:
        rec = self.by_sid[effect.session]
        match effect:
            case Grant():
                self._leave_queue(rec)
                rec.granted_at = now
                wait_ms = (now - rec.requested_at) / 1000
                self._answer(rec, p.LeaseStatus.ACQUIRED, None, wait_ms)
            case LeaseDenied(reason=reason):
                self._leave_queue(rec)
                wait_ms = (now - rec.requested_at) / 1000
                self._answer(rec, refusal_status(rec.terms.busy_policy), reason, wait_ms)
                self._forget(rec)
                self._log(rec, refusal_status(rec.terms.busy_policy), reason, wait_ms, None, "denied")
            case HoldOverdue(held_us=held, forced=forced):
                rec.overdue = True
                self._m(rec).watchdog.inc()
                log.warning(
                    "lease_overdue", lease_id=rec.lease_id, gpu=rec.gpu, task_type=rec.terms.task_type,
                    held_ms=held / 1000, hold_max_ms=rec.terms.hold_max_ms, forced_release=forced, pid=rec.conn.pid,
                    **_trace(rec.trace),
                )
            case Revoke(reason=reason):
                self.daemon.send(rec.conn, p.LeaseRevoked(lease_id=rec.lease_id, reason=reason))
                self._finish(rec, now, "revoked")

    # --- reading ------------------------------------------------------------

    def infos(self, now: int) -> list[p.LeaseInfo]:
        out = []
        for rec in self.by_sid.values():
            holding = rec.granted_at is not None
            out.append(
                p.LeaseInfo(
                    lease_id=rec.lease_id, gpu=rec.gpu, task_type=rec.terms.task_type,
                    state="holding" if holding else "waiting", priority=rec.terms.priority,
                    busy_policy=rec.terms.busy_policy, client_id=rec.conn.client_id, name=rec.conn.name,
                    pid=rec.conn.pid,
                    waited_ms=((rec.granted_at if holding else now) - rec.requested_at) / 1000,  # type: ignore[operator]
                    held_ms=(now - rec.granted_at) / 1000 if rec.granted_at is not None else 0.0,
                    hold_max_ms=rec.terms.hold_max_ms, overdue=rec.overdue, trace=rec.trace,
                )
            )
        return out

    def policy_infos(self) -> dict[str, p.PolicyInfo]:
        cfg = self.daemon.config
        out = {}
        for name in sorted(self.policies):
            t = resolve_terms(name, self.policies, default_queue_limit=cfg.lease_queue_limit,
                              default_hold_max_ms=cfg.lease_hold_max_ms)
            out[name] = p.PolicyInfo(priority=t.priority, busy_policy=t.busy_policy, max_wait_ms=t.max_wait_ms,
                                     queue_limit=t.queue_limit, hold_max_ms=t.hold_max_ms)
        return out

    def set_policies(self, policies: dict[str, LeasePolicy]) -> None:
        self.policies = policies
        self._terms.clear()
        self._prime()

    def set_policy(self, msg: p.SetPolicy) -> LeasePolicy:
        base = self.policies.get(msg.task_type) or self.policies["OTHER"]
        new = LeasePolicy(
            priority=base.priority if msg.priority is None else msg.priority,
            busy_policy=base.busy_policy if msg.busy_policy is None else msg.busy_policy,
            max_wait_ms=base.max_wait_ms if msg.max_wait_ms is None else msg.max_wait_ms,
            queue_limit=base.queue_limit if msg.queue_limit is None else msg.queue_limit,
            hold_max_ms=base.hold_max_ms if msg.hold_max_ms is None else msg.hold_max_ms,
        )
        self.policies[msg.task_type] = new
        self._terms.clear()
        self._prime()
        return new

    # --- bookkeeping ----------------------------------------------------------

    def _answer(self, rec: LeaseRecord, status: p.LeaseStatus, reason: p.LeaseReason | None, wait_ms: float) -> None:
        m = self._m(rec)
        m.acquired[status].inc()
        m.queue_wait.observe(wait_ms / 1000)
        if reason == p.LeaseReason.TIMEOUT:
            m.timeouts.inc()
        elif reason == p.LeaseReason.QUEUE_FULL:
            m.queue_full.inc()
        acquired = status == p.LeaseStatus.ACQUIRED
        self.daemon.send(
            rec.conn,
            p.LeaseResult(
                id=rec.request_id, status=status, gpu=rec.gpu, task_type=rec.terms.task_type,
                lease_id=rec.lease_id if acquired else None, acquired_at=time.time() if acquired else None,
                queue_wait_ms=round(wait_ms, 3), reason=reason,
            ),
        )

    def _finish(self, rec: LeaseRecord, now: int, how: str) -> None:
        """The lease ends (released, revoked, its client gone): log, count, forget."""
        self._leave_queue(rec)
        self._forget(rec)
        if rec.granted_at is None:
            log.info("lease_abandoned", lease_id=rec.lease_id, gpu=rec.gpu, task_type=rec.terms.task_type,
                     wait_ms=(now - rec.requested_at) / 1000, ended_by=how, **_trace(rec.trace))
            return
        hold_ms = (now - rec.granted_at) / 1000
        self._m(rec).hold.observe(hold_ms / 1000)
        self._log(rec, p.LeaseStatus.ACQUIRED, None, (rec.granted_at - rec.requested_at) / 1000, hold_ms, how)

    def _forget(self, rec: LeaseRecord) -> None:
        self.by_sid.pop(rec.sid, None)
        self.by_id.pop(rec.lease_id, None)
        rec.conn.sessions.pop(rec.sid, None)
        self.daemon.owners.pop(rec.sid, None)

    def _leave_queue(self, rec: LeaseRecord) -> None:
        if rec.waiting:
            rec.waiting = False
            self._m(rec).queue_length.dec()

    def _log(self, rec: LeaseRecord, status: p.LeaseStatus, reason: p.LeaseReason | None, wait_ms: float,
             hold_ms: float | None, ended_by: str) -> None:
        log.info(
            "lease", lease_id=rec.lease_id, gpu=rec.gpu, task_type=rec.terms.task_type, status=str(status),
            reason=None if reason is None else str(reason), wait_ms=round(wait_ms, 3),
            hold_ms=None if hold_ms is None else round(hold_ms, 3), ended_by=ended_by, **_trace(rec.trace),
        )


def _trace(t: p.Trace) -> dict[str, object]:
    return {"job_id": t.job_id, "session_id": t.session_id, "utterance_index": t.utterance_index, "stage": t.stage}
