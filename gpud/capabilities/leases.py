"""The shell's side of leases (GpuArbiter): ids, answers, logs and metrics.

The per-GPU scheduler decides (grant, deny, watchdog); this module remembers
which ACQUIRE a lease answers, sends LEASE_RESULT, and writes the one log line
per acquire with its trace (job_id, session_id, utterance_index, stage), its
status, wait and hold. It never decides anything itself.

Task types are any name a client sends, so metric labels use the name only when
a policy is configured for it, and ``OTHER`` for the rest, whose policy they
run under: a client sending 20 000 task types adds no series.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import structlog

from gpud.core.errors import Refused
from gpud.core.leases import LeasePolicy, LeaseTerms, refusal_status, resolve_terms
from gpud.core.scheduler import Grant, HoldOverdue, LeaseDenied, Revoke
from gpud.host.config import Config
from gpud.host.metrics import Metrics
from gpud.kit.parts import Part, Pieces
from gpud.kit.state import ClientLink, Handler
from gpud_client import protocol as p

log = structlog.get_logger(__name__)


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


class Leases(Part):
    """Leases: ACQUIRE, RELEASE, LIST_LEASES, SET_POLICY, LIST_POLICIES, REPORT_OOM, and the
    answers the schedulers decide for leases (LEASE_RESULT, LEASE_REVOKED)."""

    def __init__(self, pieces: Pieces, config: Config, ids: Iterator[int], settle: Callable[[int], None]) -> None:
        super().__init__(pieces)
        self.config = config
        self.policies = config.lease_policies()
        self.ids = ids
        self.settle = settle  # every GPU's accounts up to now, before figures are read
        self.by_sid: dict[int, LeaseRecord] = {}
        self.by_id: dict[str, LeaseRecord] = {}
        self._prefix = secrets.token_hex(3)  # ids of one daemon run never repeat another's
        self._children: dict[tuple[int, str], _Children] = {}
        self._terms: dict[tuple[object, ...], LeaseTerms] = {}  # emptied when policies change
        self._prime()
        effects = self.effects
        effects.leases_are(self.by_sid)
        effects.on_lease(Grant, self._granted)
        effects.on_lease(LeaseDenied, self._denied)
        effects.on_lease(HoldOverdue, self._overdue)
        effects.on_lease(Revoke, self._revoked)

    def handlers(self) -> dict[type, Handler]:
        return {
            p.Acquire: self.acquire,
            p.Release: self.release,
            p.ListLeases: self.list_leases,
            p.SetPolicy: self.set_policy,
            p.ListPolicies: self.list_policies,
            p.ReportOom: self.report_oom,
        }

    def _prime(self) -> None:
        """Every (gpu, task type with a policy) has its series from the start."""
        for slot in self.slots:
            for label in self.policies:
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
        """A task type as a metric label: configured policies by name, the rest ``OTHER`` (their policy)."""
        return task_type if task_type in self.policies else "OTHER"

    # --- requests -----------------------------------------------------------

    def acquire(self, conn: ClientLink, msg: p.Acquire, now: int) -> None:
        """Answered by LEASE_RESULT, now or later."""
        slot = self.refs.slot(msg.gpu)
        if slot.draining:
            raise Refused(
                p.ErrorCode.INSUFFICIENT,
                f"GPU {slot.gpu.index} is being drained: no new lease on it (gpuctl undrain puts it back)",
            )
        self.links.check_room(conn)
        self.access.check_priority(conn, msg.priority, "lease")
        key = (
            msg.task_type,
            msg.priority,
            msg.busy_policy,
            msg.max_wait_ms,
            msg.queue_limit,
            msg.hold_max_ms,
            msg.mem_estimate,
        )
        terms = self._terms.get(key)
        if terms is None:  # services repeat the same request shape: resolve it once
            cfg = self.config
            terms = resolve_terms(
                msg.task_type,
                self.policies,
                priority=msg.priority,
                busy_policy=msg.busy_policy,
                max_wait_ms=msg.max_wait_ms,
                queue_limit=msg.queue_limit,
                hold_max_ms=msg.hold_max_ms,
                mem_estimate=msg.mem_estimate,
                default_queue_limit=cfg.lease_queue_limit,
                default_hold_max_ms=cfg.lease_hold_max_ms,
            )
            if len(self._terms) < 4096:
                self._terms[key] = terms
        policy = self.policies.get(msg.task_type) or self.policies["OTHER"]
        priority = self.access.lease_priority(conn, msg.task_type, policy, terms.priority)
        if priority != terms.priority:
            terms = replace(terms, priority=priority)
        sid = next(self.ids)
        rec = LeaseRecord(
            sid,
            f"{self._prefix}-{sid}",
            conn,
            slot.gpu.index,
            terms,
            msg.trace,
            msg.id,
            now,
            self.label(terms.task_type),
        )
        self.by_sid[sid] = rec
        self.by_id[rec.lease_id] = rec
        self.links.own(conn, sid, slot.gpu.index)
        effects = slot.scheduler.acquire_lease(
            sid,
            now,
            priority=terms.priority,
            max_wait_us=terms.max_wait_ms * 1000,
            hold_max_us=terms.hold_max_ms * 1000,
            queue_limit=terms.queue_limit,
            mem_estimate=terms.mem_estimate,
        )
        self.effects.carry_out(effects, now, slot)
        if sid in self.by_sid and rec.granted_at is None:  # neither granted nor denied: it waits
            rec.waiting = True
            self._m(rec).queue_length.inc()

    def release(self, conn: ClientLink, msg: p.Release, now: int) -> p.Ok | None:
        rec = self.by_id.get(msg.lease_id)
        if rec is not None:  # else released already, or never ours to know: idempotent
            if rec.conn is not conn:
                raise Refused(
                    p.ErrorCode.PERMISSION_DENIED,
                    f"lease {msg.lease_id} belongs to client {rec.conn.client_id}, not to you",
                )
            slot = self.slots[rec.gpu]
            self._finish(rec, now, "released")
            self.effects.carry_out(slot.scheduler.release_lease(rec.sid, now), now, slot)
        return None if msg.quiet else p.Ok(id=msg.id)

    def connection_closed(self, conn: ClientLink, now: int) -> None:
        """Its leases die with it: out of their schedulers, logged, forgotten."""
        for sid in list(conn.sessions):
            rec = self.by_sid.get(sid)
            if rec is None:
                continue
            slot = self.slots[rec.gpu]
            self._finish(rec, now, "disconnected")
            try:
                self.effects.carry_out(slot.scheduler.release_lease(sid, now), now, slot)
            except Refused:
                pass  # already gone from the scheduler

    def list_leases(self, conn: ClientLink, msg: p.ListLeases, now: int) -> p.LeasesReply:
        self.settle(now)
        return p.LeasesReply(id=msg.id, leases=self.infos(now))

    def list_policies(self, conn: ClientLink, msg: p.ListPolicies, now: int) -> p.PoliciesReply:
        return p.PoliciesReply(id=msg.id, policies=self.policy_infos())

    def report_oom(self, conn: ClientLink, msg: p.ReportOom, now: int) -> p.Ok:
        gpu = self.refs.index(msg.gpu)
        self.metrics.oom.labels(gpu, self.label(msg.task_type)).inc()
        log.info("gpu_oom_reported", gpu=gpu, task_type=msg.task_type, pid=conn.pid, client=conn.client_id)
        return p.Ok(id=msg.id)

    # --- effects ------------------------------------------------------------

    def owns(self, sid: int) -> bool:
        return sid in self.by_sid

    def _granted(self, e: Grant, now: int) -> None:
        rec = self.by_sid[e.session]
        self._leave_queue(rec)
        rec.granted_at = now
        self._answer(rec, p.LeaseStatus.ACQUIRED, None, (now - rec.requested_at) / 1000)

    def _denied(self, e: LeaseDenied, now: int) -> None:
        rec = self.by_sid[e.session]
        self._leave_queue(rec)
        wait_ms = (now - rec.requested_at) / 1000
        status = refusal_status(rec.terms.busy_policy)
        self._answer(rec, status, e.reason, wait_ms)
        self._forget(rec)
        self._log(rec, status, e.reason, wait_ms, None, "denied")

    def _overdue(self, e: HoldOverdue, now: int) -> None:
        rec = self.by_sid[e.session]
        rec.overdue = True
        self._m(rec).watchdog.inc()
        log.warning(
            "lease_overdue",
            lease_id=rec.lease_id,
            gpu=rec.gpu,
            task_type=rec.terms.task_type,
            held_ms=e.held_us / 1000,
            hold_max_ms=rec.terms.hold_max_ms,
            forced_release=e.forced,
            pid=rec.conn.pid,
            **_trace(rec.trace),
        )

    def _revoked(self, e: Revoke, now: int) -> None:
        rec = self.by_sid[e.session]
        self.links.send(rec.conn, p.LeaseRevoked(lease_id=rec.lease_id, reason=e.reason))
        self._finish(rec, now, "revoked")

    # --- reading ------------------------------------------------------------

    def infos(self, now: int) -> list[p.LeaseInfo]:
        out = []
        for rec in self.by_sid.values():
            holding = rec.granted_at is not None
            out.append(
                p.LeaseInfo(
                    lease_id=rec.lease_id,
                    gpu=rec.gpu,
                    task_type=rec.terms.task_type,
                    state="holding" if holding else "waiting",
                    priority=rec.terms.priority,
                    busy_policy=rec.terms.busy_policy,
                    client_id=rec.conn.client_id,
                    name=rec.conn.name,
                    pid=rec.conn.pid,
                    waited_ms=((rec.granted_at if holding else now) - rec.requested_at) / 1000,  # type: ignore[operator]
                    held_ms=(now - rec.granted_at) / 1000 if rec.granted_at is not None else 0.0,
                    hold_max_ms=rec.terms.hold_max_ms,
                    overdue=rec.overdue,
                    trace=rec.trace,
                )
            )
        return out

    def policy_infos(self) -> dict[str, p.PolicyInfo]:
        cfg = self.config
        out = {}
        for name in sorted(self.policies):
            t = resolve_terms(
                name,
                self.policies,
                default_queue_limit=cfg.lease_queue_limit,
                default_hold_max_ms=cfg.lease_hold_max_ms,
            )
            out[name] = p.PolicyInfo(
                priority=t.priority,
                busy_policy=t.busy_policy,
                max_wait_ms=t.max_wait_ms,
                queue_limit=t.queue_limit,
                hold_max_ms=t.hold_max_ms,
                uids=sorted(self.policies[name].uids),
                gids=sorted(self.policies[name].gids),
            )
        return out

    def reconfigure(self, config: Config) -> None:
        """A reload: a task type whose policy the new configuration changes (added, altered or
        removed) takes the new one; the others keep theirs, a ``gpuctl policy`` change included."""
        before, after = self.config.lease_policies(), config.lease_policies()
        for name in before.keys() | after.keys():
            if before.get(name) != after.get(name):
                if name in after:
                    self.policies[name] = after[name]
                else:
                    self.policies.pop(name, None)
        self.config = config
        self._terms.clear()
        self._prime()

    def set_policy(self, conn: ClientLink, msg: p.SetPolicy, now: int) -> p.Ok:
        self.access.require_admin(conn, msg)
        base = self.policies.get(msg.task_type) or self.policies["OTHER"]
        new = LeasePolicy(
            priority=base.priority if msg.priority is None else msg.priority,
            busy_policy=base.busy_policy if msg.busy_policy is None else msg.busy_policy,
            max_wait_ms=base.max_wait_ms if msg.max_wait_ms is None else msg.max_wait_ms,
            queue_limit=base.queue_limit if msg.queue_limit is None else msg.queue_limit,
            hold_max_ms=base.hold_max_ms if msg.hold_max_ms is None else msg.hold_max_ms,
            uids=base.uids,
            gids=base.gids,  # who may use it is the config file's word
        )
        self.policies[msg.task_type] = new
        self._terms.clear()
        self._prime()
        log.info(
            "policy_set",
            task_type=msg.task_type,
            priority=new.priority,
            busy_policy=str(new.busy_policy),
            max_wait_ms=new.max_wait_ms,
            by_pid=conn.pid,
        )
        return p.Ok(id=msg.id)

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
        self.links.send(
            rec.conn,
            p.LeaseResult(
                id=rec.request_id,
                status=status,
                gpu=rec.gpu,
                task_type=rec.terms.task_type,
                lease_id=rec.lease_id if acquired else None,
                acquired_at=time.time() if acquired else None,
                queue_wait_ms=round(wait_ms, 3),
                reason=reason,
            ),
        )

    def _finish(self, rec: LeaseRecord, now: int, how: str) -> None:
        """The lease ends (released, revoked, its client gone): log, count, forget."""
        self._leave_queue(rec)
        self._forget(rec)
        if rec.granted_at is None:
            log.info(
                "lease_abandoned",
                lease_id=rec.lease_id,
                gpu=rec.gpu,
                task_type=rec.terms.task_type,
                wait_ms=(now - rec.requested_at) / 1000,
                ended_by=how,
                **_trace(rec.trace),
            )
            return
        hold_ms = (now - rec.granted_at) / 1000
        self._m(rec).hold.observe(hold_ms / 1000)
        self._log(rec, p.LeaseStatus.ACQUIRED, None, (rec.granted_at - rec.requested_at) / 1000, hold_ms, how)

    def _forget(self, rec: LeaseRecord) -> None:
        self.by_sid.pop(rec.sid, None)
        self.by_id.pop(rec.lease_id, None)
        self.links.disown(rec.conn, rec.sid)

    def _leave_queue(self, rec: LeaseRecord) -> None:
        if rec.waiting:
            rec.waiting = False
            self._m(rec).queue_length.dec()

    def _log(
        self,
        rec: LeaseRecord,
        status: p.LeaseStatus,
        reason: p.LeaseReason | None,
        wait_ms: float,
        hold_ms: float | None,
        ended_by: str,
    ) -> None:
        log.info(
            "lease",
            lease_id=rec.lease_id,
            gpu=rec.gpu,
            task_type=rec.terms.task_type,
            status=str(status),
            reason=None if reason is None else str(reason),
            wait_ms=round(wait_ms, 3),
            hold_ms=None if hold_ms is None else round(hold_ms, 3),
            ended_by=ended_by,
            **_trace(rec.trace),
        )


def _trace(t: p.Trace) -> dict[str, object]:
    return {"job_id": t.job_id, "session_id": t.session_id, "utterance_index": t.utterance_index, "stage": t.stage}
