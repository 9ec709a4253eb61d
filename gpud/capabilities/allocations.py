"""The shell's side of allocations: requests in, ledger decisions, SQLite out.

The ledger (``gpud.core.ledger``) decides; this module checks who may ask,
commits every change to the store before it answers (so nothing acknowledged
is ever lost), answers waiters when the ledger serves or expires them, and
reclaims allocations whose owner process died. It never decides placement.

A change is the ledger's decision and its record, together: the ledger is
checkpointed first, and when the store cannot record the change (disk full,
an I/O error, the database locked) the ledger is rolled back to exactly that
checkpoint, waiters the change would have served included, and the request
is refused with ``store_failed``. Only then is anything answered.
"""

from __future__ import annotations

import os
import signal
from collections import Counter, deque
from collections.abc import Callable

import structlog

from gpud.core.authority import Members, check_may_free, check_task_owner, check_tenant, owning_allocation
from gpud.core.errors import LimitReached, Refused
from gpud.core.ledger import (
    UNIT,
    Allocation,
    Checkpoint,
    Expired,
    GpuSpec,
    Grown,
    Insufficient,
    Ledger,
    Noticed,
    PreemptionConfig,
    Request,
    Served,
    TakenBack,
    TaskRecord,
    TenantQuota,
    Withdrawn,
    recovery_told,
    to_fixed,
)
from gpud.host.config import Config
from gpud.host.owners import Kind, TaskOwners
from gpud.host.procs import Held, Signals
from gpud.host.store import Store, StoreError
from gpud.kit.faults import Faults
from gpud.kit.parts import Part, Pieces
from gpud.kit.state import ClientLink, Handler
from gpud_client import protocol as p

log = structlog.get_logger(__name__)
STORE_RETRY_US = 100_000  # a change the store refused at a deadline is tried again this much later
REAP_BATCH = 64  # dead owners' allocations released per store write and loop turn (see reap)
REACH_BATCH = 1024  # tasks whose holder left looked at per loop turn (see connection_closed)


class Allocations(Part):
    """Allocations: ALLOCATE, FREE, LIST_ALLOCATIONS, RESET_ALLOCATIONS, and the answers to
    waiters the ledger serves or expires."""

    def __init__(
        self,
        pieces: Pieces,
        faults: Faults,
        config: Config,
        cpus: list[int],
        wake: Callable[[], None],
        clock: Callable[[], int],
    ) -> None:
        super().__init__(pieces)
        self.clock = clock
        self.faults = faults
        self.config = config
        self.wake = wake  # the allocator timer: a wait's deadline is new
        for effect, carry in (
            (Served, self._served),
            (Expired, self._expired),
            (Noticed, self._noticed),
            (Withdrawn, self._withdrawn),
            (TakenBack, self._taken_back),
            (Grown, self._grown),
        ):
            self.effects.on(effect, carry)
        specs = [GpuSpec(s.gpu.index, s.gpu.uuid) for s in self.slots]
        self.ledger = Ledger(
            specs,
            cpus,
            tenants=_quotas(config),
            seed=int.from_bytes(os.urandom(4), "big"),
            max_waiters=config.max_allocation_waiters,
            preemption=_preemption(config),
        )
        self.holders: dict[str, ClientLink] = {}  # task id -> the connection told of its preemption
        self.signalled: set[str] = set()  # task ids whose owner gpud itself told to leave (SIGTERM)
        self.deaf: set[str] = set()  # waiting task ids whose client does not listen for PREEMPT
        signals = Signals(lambda sig, why: self.metrics.node.signals_sent.labels(sig, why).inc())
        self.owners = TaskOwners(signals)
        self.uids = self.owners.uids  # task id -> uid that allocated it (or waits for it)
        self._reaping: deque[str] = deque()  # dead owners' tasks still to release, a batch a turn
        self._held_by: dict[ClientLink, set[str]] = {}  # a connection -> the tasks it is told of
        self._unreached: deque[str] = deque()  # tasks whose holder left: reachable still? a batch a turn
        self._unclaimed: dict[str, int] = {}  # restored waits served while their client is away -> since
        self._retry_at: int | None = None  # the store failed a tick's change: when to try it again
        try:
            self.store = Store(config.state_dir, sync=config.state_sync)
            self.waiters: dict[str, tuple[ClientLink, int, int]] = {}  # task id -> (conn, request id, since)
            self._restore()
        except StoreError as exc:
            raise RuntimeError(f"the allocation store cannot be used: {exc}") from None

    def _restore(self) -> None:
        """Put back what the store holds; a record that cannot be used any more is set aside
        (kept in the store's set_aside table with the reason), never a reason to stop."""
        loaded = self.store.load()
        now = self.clock()
        for task_id, reason in loaded.unreadable:
            self._set_aside(task_id, f"unreadable record: {reason}")
        restored: Counter[str] = Counter()
        for rec, uid in loaded.records:
            try:
                self.ledger.restore_record(rec, now)
            except (ValueError, Refused) as exc:  # the node shrank, or the record contradicts another
                self._set_aside(rec.task_id, str(exc))
                continue
            restored[_restored_as(rec)] += 1
            self.owners.recorded(rec.task_id, rec, uid)
            owner = rec.allocation or rec.suspended or rec.waiting
            if owner is not None and owner.owner_pid is not None:
                self.owners.restore(rec.task_id, owner.owner_pid, uid, loaded.starts.get(rec.task_id))
        for gpu in loaded.draining:
            if gpu < len(self.slots):
                self.ledger.drain(gpu, True, now)
                self.slots[gpu].draining = True
        self.ledger.mark_stored()  # as restored (times brought within reach: no need to write them)
        for task_id in self.uids:
            self._reach(task_id)
        if restored:  # history alone is no allocation: named apart
            log.info(
                "allocations_restored",
                count=restored["allocation"],
                suspended=restored["suspended"],
                waits=restored["wait"],
                history=restored["history"],
                path=self.store.path,
            )

    def _set_aside(self, task_id: str, reason: str) -> None:
        log.error(
            "allocation_set_aside",
            task_id=task_id,
            reason=reason,
            path=self.store.path,
            hint="kept in the set_aside table of the store; gpud runs without it",
        )
        self.metrics.node.store_records_set_aside.inc()
        try:
            self.store.set_aside(task_id, reason)
        except StoreError as exc:
            log.error("store_failed", task_id=task_id, error=str(exc))

    def reconfigure(self, config: Config) -> None:
        """Tenants, their quotas and the waiter cap change live; allocations stay as they are."""
        self.config = config
        self.ledger.reconfigure(
            tenants=_quotas(config), max_waiters=config.max_allocation_waiters, preemption=_preemption(config)
        )

    def session_allocation(self, conn: ClientLink, named: str | None, gpu: int) -> Allocation | None:
        """The allocation a new session of ``conn`` on ``gpu`` belongs to (see core.authority)."""
        if named is not None and (alloc := self.ledger.get(named)) is not None:
            self._check_owner(conn, named, "attach a session to")
            return alloc
        mine = [a for t in self.owners.tasks_of(conn.uid) if (a := self.ledger.get(t)) is not None]
        if not any(gpu in a.gpus and 0 < a.share < UNIT for a in mine):
            return None  # nothing to belong to: no need to read /proc
        owned = self.owners.owned_by(self.owners.host.ancestry(conn.pid))
        return owning_allocation(mine, self.uids, gpu, owned, conn.uid)

    # --- requests -----------------------------------------------------------

    def handlers(self) -> dict[type, Handler]:
        return {
            p.Allocate: self.allocate,
            p.Free: self.free,
            p.ListAllocations: self.list_allocations,
            p.ResetAllocations: self.reset,
            p.Yield: self.yield_,
            p.Protect: self.protect,
            p.Drain: self.drain,
        }

    def allocate(self, conn: ClientLink, msg: p.Allocate, now: int) -> p.Allocated | None:
        existing = self.ledger.get(msg.task_id)
        suspended = self._suspended(msg.task_id) is not None
        rejoin = msg.task_id not in self.waiters and any(r.task_id == msg.task_id for r in self.ledger.waiting())
        if existing is not None or suspended or rejoin or msg.task_id in self.waiters:
            self._check_owner(conn, msg.task_id, "ask for")
        if msg.tenant is not None:
            self._check_member(conn, msg.tenant)
        priority = msg.priority
        if priority is None:
            priority = p.PRIORITY_OF_CLASS[msg.priority_class] if msg.priority_class else None
        self.access.check_priority(conn, priority, "allocation")
        priority = p.DEFAULT_PRIORITY if priority is None else priority
        if msg.existing and existing is None and not suspended:
            raise Refused(
                p.ErrorCode.UNKNOWN_TASK,
                f"task {msg.task_id!r} holds no allocation any more (freed or taken back while its client was away)",
            )
        if msg.protected and not self.access.is_admin(conn):
            raise Refused(p.ErrorCode.PERMISSION_DENIED, f"a protected allocation needs admin rights (uid {conn.uid})")
        fresh = existing is None and not suspended and not rejoin and msg.task_id not in self.waiters
        owner = None
        if fresh:
            self._check_caps(conn, msg)
            if msg.owner_pid is not None:
                owner = self._claim_owner(conn, msg)
        try:
            answer = self._allocate(conn, msg, now, priority, existing, suspended, rejoin, owner)
        except BaseException:
            if owner is not None:
                self.owners.unused(owner)
            raise
        if not fresh and msg.owner_pid == conn.pid and self.owners.owner(msg.task_id) is None:
            self._claim_again(conn, msg.task_id)
        return answer

    def _allocate(
        self,
        conn: ClientLink,
        msg: p.Allocate,
        now: int,
        priority: int,
        existing: Allocation | None,
        suspended: bool,
        rejoin: bool,
        owner: Held | None,
    ) -> p.Allocated | None:
        req = Request(
            task_id=msg.task_id,
            gpus=to_fixed(msg.gpus),
            cpus=msg.cpus,
            prefer=tuple(self._prefer(ref) for ref in msg.prefer),
            strategy=msg.strategy,
            tenant=msg.tenant,
            priority=priority,
            owner_pid=msg.owner_pid,  # a repeat's terms are compared; a fresh one's owner is ``owner``
            wait_us=msg.wait_ms * 1000,
            on_preempt=msg.on_preempt,
            gpus_max=msg.gpus_max or 0,
            protected=msg.protected,
        )
        cp = self.ledger.checkpoint()
        try:
            alloc = self.ledger.allocate(req, now, rejoin=rejoin)
        except Insufficient as short:
            self._counted("insufficient")
            log.info("allocation_refused", task_id=msg.task_id, priority=priority, why=short.message)
            raise Refused(p.ErrorCode.INSUFFICIENT, short.message) from None
        if suspended:  # its holder again (a new connection after a restart): told when it resumes
            self._hold(msg.task_id, conn, msg.notify)
            held = self._suspended(msg.task_id)
            assert held is not None  # the ledger answered None: it still waits
            return self.answer(msg.id, held, 0.0, p.AllocState.SUSPENDED)
        if alloc is None:
            self.waiters[msg.task_id] = (conn, msg.id, now)
            self._unclaimed.pop(msg.task_id, None)
            if not rejoin:  # it owns the task id now, not the uid of an earlier wait or run of it
                self.owners.set_uid(msg.task_id, conn.uid)
            if owner is not None:
                self.owners.attach(msg.task_id, owner)
            self.deaf.discard(msg.task_id)
            if not msg.notify:
                self.deaf.add(msg.task_id)
            self.wake()
            log.info("allocation_waiting", task_id=msg.task_id, wait_ms=msg.wait_ms, priority=priority)
            self.advance(now)  # victims for it, if it may take some back
            return None
        if existing is None:
            self._sync(cp, f"task {msg.task_id!r} was not allocated", {msg.task_id: conn.uid}, owner)
            self._made(alloc)
        self._unclaimed.pop(msg.task_id, None)
        self._hold(msg.task_id, conn, msg.notify)
        self._counted("granted" if existing is None else "repeated")
        return self.answer(msg.id, alloc, 0.0)

    def _check_caps(self, conn: ClientLink, msg: p.Allocate) -> None:
        """What one uid may make the daemon hold (docs/security.md; counted as every cap is, by the
        request handler); an admin is capped too."""
        cfg, uid = self.config, conn.uid
        if msg.wait_ms > 0:
            waits = sum(1 for c, _, _ in self.waiters.values() if c.uid == uid)
            if waits >= cfg.max_allocation_waits_per_uid:
                raise LimitReached(
                    "max_allocation_waits_per_uid", f"uid {uid} already has {waits} allocation requests waiting"
                )
        held = self.owners.count(uid, Kind.ALLOCATION)
        if held >= cfg.max_allocations_per_uid:
            raise LimitReached("max_allocations_per_uid", f"uid {uid} already holds {held} allocations")
        records = self.owners.count(uid)
        if records >= cfg.max_allocation_records_per_uid:
            raise LimitReached(
                "max_allocation_records_per_uid",
                f"uid {uid} already has {records} records in the store (allocations, waits, preemption history)",
            )

    def _claim_again(self, conn: ClientLink, task_id: str) -> None:
        """A client that was given its task again (after a restart that could not hold its owner: /proc
        hidden from gpud) and named itself as the owner it was: held again, as the kernel vouches for it."""
        held = self.ledger.get(task_id) or self._suspended(task_id)
        if held is None or held.owner_pid != conn.pid:
            return
        try:
            owner = self.owners.claim(conn.pid, conn.uid, conn.pid)
        except Refused:
            return
        self.owners.attach(task_id, owner)

    def _claim_owner(self, conn: ClientLink, msg: p.Allocate) -> Held:
        """The owner process the request names, held; refused unless the caller may name it."""
        assert msg.owner_pid is not None
        if msg.owner_any_uid and not self.access.is_admin(conn):
            raise Refused(p.ErrorCode.PERMISSION_DENIED, f"owner_any_uid needs admin rights (uid {conn.uid})")
        try:
            held = self.owners.claim(conn.pid, conn.uid, msg.owner_pid, any_uid=msg.owner_any_uid)
        except Refused:
            self.metrics.node.owner_refusals.inc()
            log.warning("owner_refused", task_id=msg.task_id, owner_pid=msg.owner_pid, uid=conn.uid, pid=conn.pid)
            raise
        if msg.owner_any_uid:
            log.warning(
                "owner_any_uid", task_id=msg.task_id, owner_pid=msg.owner_pid, owner_uid=held.uid, by_uid=conn.uid
            )
        return held

    def _counted(self, result: str) -> None:
        """One request's outcome: granted (at once or after its wait), repeated (the same task's
        allocation again), insufficient (at once, or when its wait ran out), withdrawn (a wait freed)."""
        self.metrics.node.allocation_requests.labels(result).inc()

    def free(self, conn: ClientLink, msg: p.Free, now: int) -> p.Ok:
        self._free(conn, msg.task_id, now)
        return p.Ok(id=msg.id)

    def _free(self, conn: ClientLink, task_id: str, now: int) -> None:
        alloc = self.ledger.get(task_id) or self._suspended(task_id)
        waits = task_id in self.waiters or any(r.task_id == task_id for r in self.ledger.waiting())
        if alloc is None and not waits:
            raise Refused(p.ErrorCode.UNKNOWN_TASK, f"no allocation for task {task_id!r} (see gpuctl allocs)")
        if alloc is None:
            waiter = self.waiters.get(task_id)
            if waiter is None:  # a wait restored from the store: its uid's to withdraw
                self._check_owner(conn, task_id, "withdraw the wait of")
            elif waiter[0] is not conn and not self.access.is_admin(conn):
                raise Refused(p.ErrorCode.PERMISSION_DENIED, f"task {task_id!r} waits for another client")
            self._answer_error(task_id, p.ErrorCode.INSUFFICIENT, "the wait was withdrawn")
            self._counted("withdrawn")
            self._withdraw_wait(task_id, now)
            return
        self._check_may_free(conn, alloc)
        cp = self.ledger.checkpoint()
        noticed = self.ledger.notice_of(task_id)
        _, effects = self.ledger.release(task_id, now)
        self._sync(cp, f"task {task_id!r} was not freed")
        self._forget(task_id)
        log.info("allocation_freed", task_id=task_id, by_pid=conn.pid, preempted=noticed is not None)
        self.effects.carry_out(effects, now)

    def list_allocations(self, conn: ClientLink, msg: p.ListAllocations, now: int) -> p.AllocationsReply:
        self.advance(now)
        return self.listing(msg.id, msg.after, msg.limit or p.ALLOCS_PAGE)

    def reset(self, conn: ClientLink, msg: p.ResetAllocations, now: int) -> p.Ok:
        if not self.access.is_admin(conn):
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED, f"releasing every allocation needs admin rights (uid {conn.uid})"
            )
        released = self.ledger.allocations() + self.ledger.suspended()
        cp = self.ledger.checkpoint()
        effects = [e for alloc in released for e in self.ledger.release(alloc.task_id, now)[1]]
        self._sync(cp, "no allocation was released")
        for alloc in released:
            self._forget(alloc.task_id)
        log.warning("allocations_reset", by_pid=conn.pid, count=len(released))
        self.effects.carry_out(effects, now)
        return p.Ok(id=msg.id)

    def connection_closed(self, conn: ClientLink, now: int) -> None:
        """Waits die with their connection; allocations outlive it (they are durable)."""
        for task_id in [t for t, (c, _, _) in self.waiters.items() if c is conn]:
            del self.waiters[task_id]
            self._withdraw_wait(task_id, now)
        held = self._held_by.pop(conn, set())
        for task_id in held:  # unreachable until looked at again: never preempted with nobody told
            del self.holders[task_id]
            self.ledger.reachable.discard(task_id)
        if len(held) <= REACH_BATCH:
            for task_id in held:
                self._reach(task_id)
        else:  # whether its owner can be told instead, a batch a turn (a client may hold thousands)
            self._unreached.extend(sorted(held))
            self.wake()

    def _withdraw_wait(self, task_id: str, now: int) -> None:
        """A wait given up: it frees nothing, and withdraws the notices it caused."""
        cp = self.ledger.checkpoint()
        _, effects = self.ledger.release(task_id, now)
        try:
            self._sync(cp, f"the wait of task {task_id!r} was not withdrawn")
        except Refused:  # withdrawn anyway (its client is gone): its victims are told; stored when tried again
            _, effects = self.ledger.release(task_id, now)
            self._retry_at = now + STORE_RETRY_US
            self.wake()
        self._settle(task_id)
        self.effects.carry_out(effects, now)

    # --- taking allocations back ------------------------------------------------

    def yield_(self, conn: ClientLink, msg: p.Yield, now: int) -> p.Ok:
        alloc = self.ledger.get(msg.task_id)
        if alloc is None:
            raise Refused(p.ErrorCode.UNKNOWN_TASK, f"no allocation for task {msg.task_id!r} (see gpuctl allocs)")
        self._check_may_free(conn, alloc)
        cp = self.ledger.checkpoint()
        effects = self.ledger.yield_(msg.task_id, now)
        self._sync(cp, f"task {msg.task_id!r} did not yield")
        self.effects.carry_out(effects, now)
        return p.Ok(id=msg.id)

    def protect(self, conn: ClientLink, msg: p.Protect, now: int) -> p.Ok:
        if not self.access.is_admin(conn):
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED, f"protecting an allocation needs admin rights (uid {conn.uid})"
            )
        cp = self.ledger.checkpoint()
        self.ledger.protect(msg.task_id, msg.protected)
        self._sync(cp, f"task {msg.task_id!r} was not changed")
        log.info("allocation_protected", task_id=msg.task_id, protected=msg.protected, by_pid=conn.pid)
        self.advance(now)  # unprotected, it may be what a waiter takes back
        return p.Ok(id=msg.id)

    def drain(self, conn: ClientLink, msg: p.Drain, now: int) -> p.Drained:
        if not self.access.is_admin(conn):
            raise Refused(p.ErrorCode.PERMISSION_DENIED, f"draining a GPU needs admin rights (uid {conn.uid})")
        gpu = self.refs.index(msg.gpu)
        was = gpu in self.ledger.draining()
        if was == msg.on:  # drained already, or never: nothing to do, nothing to log
            return p.Drained(id=msg.id, gpu=gpu, draining=was, was_draining=was)
        cp = self.ledger.checkpoint()
        effects = self.ledger.drain(gpu, msg.on, now)
        self._sync(cp, f"GPU {gpu} was not {'drained' if msg.on else 'put back'}", draining=True)
        self.slots[gpu].draining = msg.on
        log.warning("gpu_draining" if msg.on else "gpu_undrained", gpu=gpu, by_pid=conn.pid)
        self.effects.carry_out(effects, now)
        self.advance(now)  # the drain's notices
        return p.Drained(id=msg.id, gpu=gpu, draining=msg.on, was_draining=was)

    def _suspended(self, task_id: str) -> Allocation | None:
        return self.ledger.suspended_of(task_id)

    def _hold(self, task_id: str, conn: ClientLink, notify: bool = True) -> None:
        """``conn`` is told of this task's preemption from now on (if it listens: ``notify``)."""
        before = self.holders.get(task_id)
        if before is not None and (before is not conn or not notify):
            del self.holders[task_id]
            self._held_by[before].discard(task_id)
        if notify:
            self.holders[task_id] = conn
            self._held_by.setdefault(conn, set()).add(task_id)
        self._reach(task_id)

    def _reach(self, task_id: str) -> None:
        """Whether someone can be told about ``task_id``: the core's ``reachable`` fact."""
        alloc = self.ledger.get(task_id) or self._suspended(task_id)
        told = task_id in self.holders or (alloc is not None and self.owners.alive(task_id))
        if told and task_id not in self.ledger.reachable:
            self.wake()  # someone to tell now: a drain's (or a waiter's) notice may be due at once
        if told:
            self.ledger.reachable.add(task_id)
        else:
            self.ledger.reachable.discard(task_id)

    def _forget(self, task_id: str) -> None:
        if (conn := self.holders.pop(task_id, None)) is not None:
            self._held_by[conn].discard(task_id)
        self.signalled.discard(task_id)
        self.ledger.reachable.discard(task_id)
        self._unclaimed.pop(task_id, None)
        self._settle(task_id)

    def _settle(self, task_id: str) -> None:
        """A task that holds nothing and waits for nothing any more lets its owner process go."""
        if self._holds_or_waits(task_id):
            return
        self.owners.detach(task_id)
        self.owners.forget_uid(task_id)

    def _noticed(self, e: Noticed, now: int) -> None:
        n, a = e.notice, e.allocation
        grace_s = (n.deadline - now) / 1e6
        log.warning(
            "allocation_preempting",
            task_id=a.task_id,
            reason=n.reason,
            by=n.by,
            gpus=list(n.gpus),
            whole=n.whole,
            recovery=recovery_told(a, n),
            grace_s=round(grace_s, 3),
            priority=a.priority,
        )
        self.metrics.node.preemptions.labels(n.reason, self.config.preemption_strategy).inc()
        conn = self.holders.get(a.task_id)
        if conn is not None:
            push = p.Preempt(
                task_id=a.task_id,
                reason=n.reason,
                recovery=recovery_told(a, n),
                gpus=list(n.gpus),
                whole=n.whole,
                grace_s=round(grace_s, 3),
                by=n.by,
            )
            self.links.send(conn, push)
        elif n.whole and self.owners.signal(a.task_id, signal.SIGTERM, "preempt_notice"):
            self.signalled.add(a.task_id)  # no one holds it: its owner is told as Kubernetes tells a pod

    def _withdrawn(self, e: Withdrawn, now: int) -> None:
        self.signalled.discard(e.allocation.task_id)  # its owner was told to leave: now it stays
        log.info("allocation_preempt_withdrawn", task_id=e.allocation.task_id, by=e.notice.by)
        if (conn := self.holders.get(e.allocation.task_id)) is not None:
            self.links.send(conn, p.PreemptWithdrawn(task_id=e.allocation.task_id))

    def _taken_back(self, e: TakenBack, now: int) -> None:
        a, n = e.before, e.notice
        if e.overran:
            self.metrics.node.preemption_overruns.labels(n.reason).inc()
        log.warning(
            "allocation_taken_back",
            task_id=a.task_id,
            reason=n.reason,
            by=n.by,
            overran=e.overran,
            suspended=e.suspended,
            gpus=list(n.gpus),
            held_s=round((now - n.issued) / 1e6, 3),
        )
        conn = self.holders.get(a.task_id)
        if e.after is not None:
            if conn is not None:
                self.links.send(conn, p.AllocChanged(change="shrunk", allocation=self.answer(0, e.after, 0.0)))
            return
        state = p.AllocState.SUSPENDED if e.suspended else p.AllocState.RUNNING
        if conn is not None:
            self.links.send(conn, p.AllocRevoked(task_id=a.task_id, reason=n.reason, state=state, gone=not e.suspended))
        if not e.suspended:
            if a.task_id in self.signalled:
                self.owners.signal(a.task_id, signal.SIGKILL, "preempt_grace_over")  # as Kubernetes ends a pod
            self._forget(a.task_id)

    def _grown(self, e: Grown, now: int) -> None:
        a = e.allocation
        log.info("allocation_grown", task_id=a.task_id, gpus=list(a.gpus))
        if (conn := self.holders.get(a.task_id)) is not None:
            self.links.send(conn, p.AllocChanged(change="grown", allocation=self.answer(0, a, 0.0)))

    # --- timers -------------------------------------------------------------

    def advance(self, now: int) -> None:
        """The ledger's deadlines; its changes stored before they are carried out (when the store
        cannot, nothing changes and the next tick tries again)."""
        cp = self.ledger.checkpoint()
        effects = self.ledger.advance(now)
        if not effects and self._retry_at is None:
            return
        try:  # (with no effects: a change the store refused before, tried again)
            self._sync(cp, "the allocations' deadlines were not carried out")
        except Refused:
            self._retry_at = now + STORE_RETRY_US  # not at once: the deadline stays due, the timer must not spin
            return
        self._retry_at = None
        self.effects.carry_out(effects, now)

    def observe_utilization(self, gpu: int, ratio: float, now: int) -> None:
        """A GPU's utilisation (0..1) as the monitor read it: elastic allocations' pacing."""
        if self.ledger.observe(gpu, ratio * 100, now):
            self.wake()  # the allocations' timer: an elastic allocation's window starts now

    def next_deadline(self) -> int | None:
        """The ledger's next deadline, or after a failed store the time to try again (now, while
        dead owners' allocations are left to reap)."""
        if self.reaping:
            return self.clock()
        due = self.ledger.next_deadline()
        if self._retry_at is None:
            return due
        return self._retry_at if due is None else max(due, self._retry_at)

    @property
    def reaping(self) -> bool:
        """Dead owners' allocations are still being released (or tasks whose holder left looked
        at again), a batch a turn."""
        return bool(self._reaping or self._unreached)

    def reap(self, now: int) -> None:
        """Reclaim allocations whose owner process is gone (and restored waits served while their
        client was away that nobody claimed within ``crash_grace_s``): at most REAP_BATCH a call,
        in one ledger change and one store write, so that no loop turn grows with how many there
        are; the timer calls again at once while some are left. A batch the store cannot record
        is tried again at the next call; one record's fault skips only it."""
        if not self._reaping:
            self._reaping.extend(self.owners.orphaned())
            grace = round(self.config.crash_grace_s * 1e6)
            self._reaping.extend(
                t
                for t, since in self._unclaimed.items()
                if now - since >= grace and t not in self.holders and not self.owners.alive(t)
            )
        self.reap_more(now)

    def reap_more(self, now: int) -> None:
        """The next batch of what ``reap`` found, and of tasks whose holder left."""
        for _ in range(min(REACH_BATCH, len(self._unreached))):
            self._reach(self._unreached.popleft())
        batch = [self._reaping.popleft() for _ in range(min(REAP_BATCH, len(self._reaping)))]
        held = []
        for task_id in batch:  # a wait (rare) is withdrawn on its own, with its own store write
            if self.owners.alive(task_id):
                continue  # its owner asked for it again meanwhile (see _claim_again)
            if self.ledger.get(task_id) or self._suspended(task_id):
                held.append(task_id)
            elif task_id in self.waiters or any(r.task_id == task_id for r in self.ledger.waiting()):
                self._answer_error(task_id, p.ErrorCode.INSUFFICIENT, "its owner process exited while it waited")
                self._withdraw_wait(task_id, now)
            else:
                self._settle(task_id)
        cp = self.ledger.checkpoint()
        effects, released = [], []
        for task_id in held:
            try:
                alloc = self.ledger.get(task_id) or self._suspended(task_id)
                assert alloc is not None
                effects += self.ledger.release(task_id, now)[1]
                released.append(alloc)
            except Exception as exc:
                self.faults.record("reaper", exc, task_id=task_id)
        if not released:
            return
        try:
            self._sync(cp, f"{len(released)} allocations of dead owners were not reclaimed")
        except Refused:  # logged by _sync; the next reap tries them again
            self._reaping.extendleft(reversed([a.task_id for a in released]))
            return
        for alloc in released:
            self._forget(alloc.task_id)
        by_owner: dict[int | None, list[str]] = {}
        for alloc in released:
            by_owner.setdefault(alloc.owner_pid, []).append(alloc.task_id)
        for pid, tasks in by_owner.items():
            log.warning("allocations_reaped", owner_pid=pid, count=len(tasks), task_ids=tasks[:8])
        self.effects.carry_out(effects, now)

    def _served(self, e: Served, now: int) -> None:
        """A waiter the stored change served (a suspended allocation: its holder is told)."""
        task_id = e.allocation.task_id
        self._made(e.allocation)
        if e.resumed:
            log.info("allocation_resumed", task_id=task_id, gpus=list(e.allocation.gpus))
            if (holder := self.holders.get(task_id)) is not None:
                self.links.send(holder, p.AllocChanged(change="resumed", allocation=self.answer(0, e.allocation, 0.0)))
            return
        self._counted("granted")
        waiter = self.waiters.pop(task_id, None)
        if waiter is None:  # a wait restored from the store: its client asks again and is answered,
            self._unclaimed[task_id] = now  # else it is released after the crash grace (see reap)
            self.wake()
            return
        conn, rid, since = waiter
        self._hold(task_id, conn, task_id not in self.deaf)
        self.deaf.discard(task_id)
        self.links.send(conn, self.answer(rid, e.allocation, (now - since) / 1000))

    def _expired(self, e: Expired, now: int) -> None:
        log.info("allocation_expired", task_id=e.task_id, why=e.reason.message)
        self._answer_error(e.task_id, p.ErrorCode.INSUFFICIENT, f"{e.reason.message} (waited the full wait_ms)")
        self._counted("insufficient")
        self._settle(e.task_id)

    # --- answers ------------------------------------------------------------

    def answer(self, rid: int, alloc: Allocation, waited_ms: float, state: p.AllocState | None = None) -> p.Allocated:
        notice = self.ledger.notice_of(alloc.task_id)
        now = self.clock()
        shield = self.ledger.shield(alloc, now)
        why = "" if shield is None else shield.text(now)
        if state is None:
            state = p.AllocState.RUNNING if notice is None else p.AllocState.PREEMPTING
        if notice is not None:
            why = f"{notice.reason} for {notice.by}" + (
                "" if notice.whole else f": gives back GPUs {list(notice.gpus)}"
            )
        elif state == p.AllocState.SUSPENDED:
            why = "suspended: waits for its GPUs " + ",".join(map(str, alloc.gpus))
        return p.Allocated(
            id=rid,
            task_id=alloc.task_id,
            gpus=list(alloc.gpus),
            uuids=[self.slots[g].gpu.uuid for g in alloc.gpus],
            share=alloc.share / UNIT,
            cpus=list(alloc.cpus),
            cuda_visible_devices=",".join(map(str, alloc.gpus)),
            tenant=alloc.tenant,
            priority=alloc.priority,
            owner_pid=alloc.owner_pid,
            waited_ms=round(waited_ms, 3),
            on_preempt=alloc.on_preempt,
            gpus_min=alloc.gpus_min or None,
            gpus_max=alloc.gpus_max or None,
            protected=alloc.protected,
            state=state,
            preemptible=shield is None,
            why=why,
            preemptible_in_s=None if shield is None else shield.left_s(now),
            deadline_s=None if notice is None else round(max(0, notice.deadline - self.clock()) / 1e6, 3),
            resume=alloc.resume,
            preemptions=alloc.preemptions,
            preemption_grace_s=self.config.preemption_grace_s,
        )

    def listing(self, rid: int, after: str | None = None, limit: int = p.ALLOCS_PAGE) -> p.AllocationsReply:
        """One page: at most ``limit`` allocations after task id ``after``, built in O(limit) however
        many there are (the GPUs' tasks: those of this page)."""
        page = self.ledger.allocations_page(after, limit + 1)
        more = len(page) > limit
        page = page[:limit]
        running = {a.task_id: a for a in page if self.ledger.get(a.task_id) is a}
        gpus = []
        for slot in self.slots:
            free = self.ledger.gpu_free(slot.gpu.index)
            tasks = {t: min(a.share, UNIT) / UNIT for t, a in running.items() if slot.gpu.index in a.gpus}
            gpus.append(
                p.GpuAllocationSummary(
                    index=slot.gpu.index,
                    uuid=slot.gpu.uuid,
                    allocated=(UNIT - free) / UNIT,
                    free=free / UNIT,
                    tasks=tasks,
                )
            )
        tenants = {
            name: p.TenantSummary(quota=t.gpus, borrow=t.borrow, used=self.ledger.tenant_usage(name) / UNIT)
            for name, t in self.config.tenants.items()
        }
        now = self.clock()
        return p.AllocationsReply(
            id=rid,
            allocations=[
                self.answer(0, a, 0.0, None if a.task_id in running else p.AllocState.SUSPENDED) for a in page
            ],
            total=self.ledger.allocation_count(),
            next_after=page[-1].task_id if more else None,
            waiting=[r.task_id for r in self.ledger.waiting()],
            waiters=[
                p.AllocWaiter(
                    task_id=r.task_id,
                    gpus=r.gpus / UNIT,
                    priority=r.priority,
                    waited_s=round((now - since) / 1e6, 3),
                    why=why,
                )
                for r, since, why in self.ledger.waiter_info(now)
            ],
            draining=sorted(self.ledger.draining()),
            gpus=gpus,
            cpus_total=self.ledger.cpu_count,
            cpus_free=self.ledger.cpus_free(),
            tenants=tenants,
        )

    # --- helpers ------------------------------------------------------------

    def _sync(
        self,
        cp: Checkpoint,
        refusal: str,
        uids: dict[str, int] | None = None,
        owner: Held | None = None,
        *,
        draining: bool = False,
    ) -> None:
        """Store what one ledger change changed (every task whose record differs, the allocations
        it served included: a new task's uid is in ``uids``, its owner process ``owner``); when the
        store cannot, roll the ledger back to ``cp`` and refuse with ``store_failed``."""
        uids = uids or {}
        put, delete = self.ledger.changed_records()
        if not put and not delete and not draining:
            return
        rows = [(r, uids.get(t, self.uids.get(t, 0))) for t, r in put.items()]
        starts = {t: owner.start for t in uids} if owner is not None else {}
        starts.update({t: self.owners.start_of(t) for t in put if t not in starts})
        try:
            self.store.write(
                put=rows, delete=delete, draining=self.ledger.draining() if draining else None, starts=starts
            )
        except StoreError as exc:
            self.ledger.rollback(cp)
            self.metrics.node.store_failures.inc()
            self.faults.often("store_failed", refused=refusal, error=str(exc))
            raise Refused(p.ErrorCode.STORE_FAILED, f"{refusal}: the store could not record it ({exc})") from None
        self._stored(put, delete, rows, owner, uids)
        if (due := self.ledger.next_deadline()) is not None and due <= self.clock():
            self.wake()  # the change left work for later turns (notices in batches): the timer goes on at once

    def _stored(
        self,
        put: dict[str, TaskRecord],
        delete: set[str],
        rows: list[tuple[TaskRecord, int]],
        owner: Held | None,
        uids: dict[str, int],
    ) -> None:
        """The store took a change: what it holds, whose it is, and who owns what follow it."""
        self.ledger.mark_stored()
        for rec, uid in rows:
            self.owners.recorded(rec.task_id, rec, uid)
        for t in delete:
            self.owners.recorded(t, None, None)
        for t in uids:
            if owner is not None and (t in put or t in self.waiters):
                self.owners.attach(t, owner)
        for t in [*put, *delete]:
            if not self._holds_or_waits(t) and t not in self.signalled:  # (SIGKILLed at its grace's end)
                self.owners.detach(t)  # nothing of it holds devices or waits any more
                self.owners.forget_uid(t)

    def _holds_or_waits(self, task_id: str) -> bool:
        """Whether ``task_id`` holds devices, is suspended, or waits (in this connection's or the store's)."""
        return (
            task_id in self.waiters
            or self.ledger.get(task_id) is not None
            or self.owners.kind(task_id) in (Kind.ALLOCATION, Kind.WAIT)
        )

    def _made(self, alloc: Allocation) -> None:
        log.info(
            "allocation_made",
            task_id=alloc.task_id,
            gpus=list(alloc.gpus),
            share=alloc.share / UNIT,
            cpus=list(alloc.cpus),
            tenant=alloc.tenant,
            owner_pid=alloc.owner_pid,
        )

    def _answer_error(self, task_id: str, code: p.ErrorCode, message: str) -> None:
        waiter = self.waiters.pop(task_id, None)
        if waiter is not None:
            conn, rid, _ = waiter
            self.links.send(conn, p.Error(id=rid, code=code, message=f"task {task_id!r}: {message}"))

    def _prefer(self, ref: int | str) -> int:
        try:
            return self.refs.index(ref)
        except Refused as exc:
            raise Refused(p.ErrorCode.UNKNOWN_GPU, f"{exc.message} in prefer") from None

    # Who may ask for, allocate as and free what: the rules are gpud.core.authority's.

    def _members(self, tenant: str | None) -> Members | None:
        t = self.config.tenants.get(tenant or "")
        return None if t is None else Members(frozenset(t.uids), frozenset(t.gids))

    def _check_owner(self, conn: ClientLink, task_id: str, what: str) -> None:
        owner = self.uids.get(task_id)
        if owner is None and task_id in self.waiters:
            owner = self.waiters[task_id][0].uid
        check_task_owner(task_id, owner, conn.uid, admin=self.access.is_admin(conn), what=what)

    def _check_member(self, conn: ClientLink, tenant: str) -> None:
        check_tenant(tenant, self._members(tenant), conn.uid, conn.gid, admin=self.access.is_admin(conn))

    def _check_may_free(self, conn: ClientLink, alloc: Allocation) -> None:
        check_may_free(
            alloc.task_id,
            self.uids.get(alloc.task_id),
            alloc.tenant,
            self._members(alloc.tenant),
            conn.uid,
            conn.gid,
            admin=self.access.is_admin(conn),
        )


def _preemption(config: Config) -> PreemptionConfig:
    return PreemptionConfig(
        grace_us=round(config.preemption_grace_s * 1e6),
        min_runtime_us=round(config.preemption_min_runtime_s * 1e6),
        strategy=config.preemption_strategy,
        cooldown_us=round(config.preemption_cooldown_s * 1e6),
        elastic_cooldown_us=round(config.elastic_cooldown_s * 1e6),
        elastic_window_us=round(config.elastic_window_s * 1e6),
        busy_percent=config.elastic_busy_percent,
        enabled=config.preemption,
    )


def _quotas(config: Config) -> dict[str, TenantQuota]:
    return {name: TenantQuota(to_fixed(t.gpus), to_fixed(t.borrow)) for name, t in config.tenants.items()}


def _restored_as(rec: TaskRecord) -> str:
    """What a stored record puts back: an allocation, a suspended one, a wait, or only the preemption
    history of a task that ended (its next allocation hears of it)."""
    if rec.allocation is not None:
        return "allocation"
    if rec.suspended is not None:
        return "suspended"
    return "wait" if rec.waiting is not None else "history"
