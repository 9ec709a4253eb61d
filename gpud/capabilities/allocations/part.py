"""ALLOCATE, FREE, YIELD, PROTECT, DRAIN, LIST_ALLOCATIONS, RESET_ALLOCATIONS: who may ask, the ledger's
decision, stored before it is answered (``durable``), its outcomes carried out (``telling``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import structlog

from gpud.capabilities.allocations.answers import Answers
from gpud.capabilities.allocations.durable import Durable
from gpud.capabilities.allocations.reaping import Reaper
from gpud.capabilities.allocations.settings import preemption_config, tenant_quotas
from gpud.capabilities.allocations.tasks import TaskBook
from gpud.capabilities.allocations.telling import Telling, made
from gpud.core.authority import Members, check_may_free, check_task_owner, check_tenant, owning_allocation
from gpud.core.contacts import Waiter
from gpud.core.errors import LimitReached, Refused
from gpud.core.ledger import UNIT, Allocation, GpuSpec, Insufficient, Ledger, Request, to_fixed
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


class Allocations(Part):
    """Allocations: the requests, and the timer's deadlines and reaping."""

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
        specs = [GpuSpec(s.gpu.index, s.gpu.uuid) for s in self.slots]
        self.ledger = Ledger(
            specs,
            cpus,
            tenants=tenant_quotas(config),
            seed=int.from_bytes(os.urandom(4), "big"),
            max_waiters=config.max_allocation_waiters,
            preemption=preemption_config(config),
        )
        signals = Signals(lambda sig, why: self.metrics.node.signals_sent.labels(sig, why).inc())
        self.owners = TaskOwners(signals)
        self.book = TaskBook(self.ledger, self.owners, self._wake)
        self.answers = Answers(self.ledger, self.slots, config, clock)
        self.telling = Telling(self.book, self.answers, self.links, self.metrics, config, self._wake)
        self.telling.register(self.effects)
        self.telling.prime()
        try:
            self.store = Store(config.state_dir, sync=config.state_sync)
            self.durable = Durable(self.ledger, self.store, self.book, self.metrics, faults, clock, self._wake)
            self.durable.restore(self.slots)
        except StoreError as exc:
            raise RuntimeError(f"the allocation store cannot be used: {exc}") from None
        self.reaper = Reaper(
            self.ledger,
            self.book,
            self.durable,
            self.telling,
            self.effects,
            faults,
            self._withdraw_wait,
            self._wake,
            round(config.crash_grace_s * 1e6),
        )

    def _wake(self) -> None:
        """The allocations' timer, for the parts: ``wake`` as it is at the call (a simulation wraps it)."""
        self.wake()

    @property
    def uids(self) -> dict[str, int]:
        """Task id -> the uid that allocated it (or waits for it)."""
        return self.owners.uids

    @property
    def waiters(self) -> dict[str, Waiter[ClientLink]]:
        """Task id -> the connection waiting for its answer (a walk: for checks)."""
        return dict(self.book.contacts.waiters())

    @property
    def holders(self) -> dict[str, ClientLink]:
        """Task id -> the connection told of its preemption (a walk: for checks)."""
        return dict(self.book.contacts.holders())

    def reconfigure(self, config: Config) -> None:
        """Tenants, their quotas and the waiter cap change live; allocations stay as they are."""
        self.config = self.answers.config = self.telling.config = config
        self.telling.prime()
        self.reaper.crash_grace_us = round(config.crash_grace_s * 1e6)
        self.ledger.reconfigure(
            tenants=tenant_quotas(config),
            max_waiters=config.max_allocation_waiters,
            preemption=preemption_config(config),
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
        if conn.scope is not None:
            return self._hold_scoped(conn, msg)
        existing = self.ledger.get(msg.task_id)
        suspended = self.ledger.suspended_of(msg.task_id) is not None
        waiting = self.book.waiter(msg.task_id) is not None
        rejoin = not waiting and any(r.task_id == msg.task_id for r in self.ledger.waiting())
        if existing is not None or suspended or rejoin or waiting:
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
        fresh = existing is None and not suspended and not rejoin and not waiting
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
            memory_bytes=msg.memory_bytes,
        )
        cp = self.ledger.checkpoint()
        try:
            alloc = self.ledger.allocate(req, now, rejoin=rejoin)
        except Insufficient as short:
            self.telling.counted("insufficient")
            log.info("allocation_refused", task_id=msg.task_id, priority=priority, why=short.message)
            raise Refused(p.ErrorCode.INSUFFICIENT, short.message) from None
        if suspended:  # its holder again (a new connection after a restart): told when it resumes
            self.book.hold(msg.task_id, conn, msg.notify)
            held = self.ledger.suspended_of(msg.task_id)
            assert held is not None  # the ledger answered None: it still waits
            return self.answers.answer(msg.id, held, 0.0, p.AllocState.SUSPENDED)
        if alloc is None:
            self.book.contacts.wait(msg.task_id, conn, msg.id, now, msg.notify)
            if not rejoin:  # it owns the task id now, not the uid of an earlier wait or run of it
                self.owners.set_uid(msg.task_id, conn.uid)
            if owner is not None:
                self.owners.attach(msg.task_id, owner)
            self.wake()
            log.info("allocation_waiting", task_id=msg.task_id, wait_ms=msg.wait_ms, priority=priority)
            self.advance(now)  # victims for it, if it may take some back
            return None
        if existing is None:
            self.durable.sync(cp, f"task {msg.task_id!r} was not allocated", {msg.task_id: conn.uid}, owner)
            made(alloc)
        self.book.hold(msg.task_id, conn, msg.notify)
        if existing is None:
            self.telling.granted(alloc, 0)
        else:
            self.telling.counted("repeated")
        return self.answers.answer(msg.id, alloc, 0.0)

    def _hold_scoped(self, conn: ClientLink, msg: p.Allocate) -> p.Allocated:
        """ALLOCATE (existing) on a task's own socket: its allocation as it is, whatever terms the
        request carries (they are the claim's, not the container's), held by this connection from
        now on (told of its preemption, if it listens)."""
        task_id = msg.task_id  # (the socket's task: gpud.core.scopes)
        running = self.ledger.get(task_id)
        held = running or self.ledger.suspended_of(task_id)
        if held is None:
            raise Refused(p.ErrorCode.UNKNOWN_TASK, f"task {task_id!r} holds no allocation (its claim was unprepared?)")
        self.book.hold(task_id, conn, msg.notify)
        self.telling.counted("repeated")
        return self.answers.answer(msg.id, held, 0.0, None if running else p.AllocState.SUSPENDED)

    def _check_caps(self, conn: ClientLink, msg: p.Allocate) -> None:
        """What one uid may make the daemon hold (docs/security.md; counted as every cap is, by the
        request handler); an admin is capped too."""
        cfg, uid = self.config, conn.uid
        if msg.wait_ms > 0:
            waits = sum(1 for _, w in self.book.contacts.waiters() if w.conn.uid == uid)
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
        held = self.book.held(task_id)
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

    def free(self, conn: ClientLink, msg: p.Free, now: int) -> p.Ok:
        task_id = msg.task_id
        alloc = self.book.held(task_id)
        if alloc is None and not self.book.waits(task_id):
            raise Refused(p.ErrorCode.UNKNOWN_TASK, f"no allocation for task {task_id!r} (see gpuctl allocs)")
        if alloc is None:
            waiter = self.book.waiter(task_id)
            if waiter is None:  # a wait restored from the store: its uid's to withdraw
                self._check_owner(conn, task_id, "withdraw the wait of")
            elif waiter.conn is not conn and not self.access.is_admin(conn):
                raise Refused(p.ErrorCode.PERMISSION_DENIED, f"task {task_id!r} waits for another client")
            self.telling.answer_error(task_id, p.ErrorCode.INSUFFICIENT, "the wait was withdrawn")
            self.telling.counted("withdrawn")
            self._withdraw_wait(task_id, now)
            return p.Ok(id=msg.id)
        self._check_may_free(conn, alloc)
        cp = self.ledger.checkpoint()
        noticed = self.ledger.notice_of(task_id)
        _, effects = self.ledger.release(task_id, now)
        self.durable.sync(cp, f"task {task_id!r} was not freed")
        self.book.forget(task_id)
        log.info("allocation_freed", task_id=task_id, by_pid=conn.pid, preempted=noticed is not None)
        self.effects.carry_out(effects, now)
        return p.Ok(id=msg.id)

    def list_allocations(self, conn: ClientLink, msg: p.ListAllocations, now: int) -> p.AllocationsReply:
        self.advance(now)
        if conn.scope is not None:  # on a task's own socket: that task's allocation alone
            return self.answers.own(msg.id, conn.scope)
        return self.answers.listing(msg.id, msg.after, msg.limit or p.ALLOCS_PAGE)

    def reset(self, conn: ClientLink, msg: p.ResetAllocations, now: int) -> p.Ok:
        if not self.access.is_admin(conn):
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED, f"releasing every allocation needs admin rights (uid {conn.uid})"
            )
        released = self.ledger.allocations() + self.ledger.suspended()
        cp = self.ledger.checkpoint()
        effects = [e for alloc in released for e in self.ledger.release(alloc.task_id, now)[1]]
        self.durable.sync(cp, "no allocation was released")
        for alloc in released:
            self.book.forget(alloc.task_id)
        log.warning("allocations_reset", by_pid=conn.pid, count=len(released))
        self.effects.carry_out(effects, now)
        return p.Ok(id=msg.id)

    def connection_closed(self, conn: ClientLink, now: int) -> None:
        """Waits die with their connection; allocations outlive it (they are durable)."""
        waits, held = self.book.contacts.closed(conn)
        for task_id in waits:
            self._withdraw_wait(task_id, now)
        self.reaper.unheld(held)

    def _withdraw_wait(self, task_id: str, now: int) -> None:
        """A wait given up: it frees nothing, and withdraws the notices it caused."""
        cp = self.ledger.checkpoint()
        _, effects = self.ledger.release(task_id, now)
        try:
            self.durable.sync(cp, f"the wait of task {task_id!r} was not withdrawn")
        except Refused:  # withdrawn anyway (its client is gone): its victims are told; stored when tried again
            _, effects = self.ledger.release(task_id, now)
            self.durable.retry_at = now + STORE_RETRY_US
            self.wake()
        self.book.settle(task_id)
        self.effects.carry_out(effects, now)

    # --- taking allocations back ------------------------------------------------

    def yield_(self, conn: ClientLink, msg: p.Yield, now: int) -> p.Ok:
        alloc = self.ledger.get(msg.task_id)
        if alloc is None:
            raise Refused(p.ErrorCode.UNKNOWN_TASK, f"no allocation for task {msg.task_id!r} (see gpuctl allocs)")
        self._check_may_free(conn, alloc)
        cp = self.ledger.checkpoint()
        effects = self.ledger.yield_(msg.task_id, now)
        self.durable.sync(cp, f"task {msg.task_id!r} did not yield")
        self.effects.carry_out(effects, now)
        return p.Ok(id=msg.id)

    def protect(self, conn: ClientLink, msg: p.Protect, now: int) -> p.Ok:
        if not self.access.is_admin(conn):
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED, f"protecting an allocation needs admin rights (uid {conn.uid})"
            )
        cp = self.ledger.checkpoint()
        self.ledger.protect(msg.task_id, msg.protected)
        self.durable.sync(cp, f"task {msg.task_id!r} was not changed")
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
        self.durable.sync(cp, f"GPU {gpu} was not {'drained' if msg.on else 'put back'}", draining=True)
        self.slots[gpu].draining = msg.on
        log.warning("gpu_draining" if msg.on else "gpu_undrained", gpu=gpu, by_pid=conn.pid)
        self.effects.carry_out(effects, now)
        self.advance(now)  # the drain's notices
        return p.Drained(id=msg.id, gpu=gpu, draining=msg.on, was_draining=was)

    # --- timers -------------------------------------------------------------

    def advance(self, now: int) -> None:
        """The ledger's deadlines; its changes stored before they are carried out (when the store
        cannot, nothing changes and the next tick tries again)."""
        cp = self.ledger.checkpoint()
        effects = self.ledger.advance(now)
        if not effects and self.durable.retry_at is None:
            return
        try:  # (with no effects: a change the store refused before, tried again)
            self.durable.sync(cp, "the allocations' deadlines were not carried out")
        except Refused:
            self.durable.retry_at = now + STORE_RETRY_US  # not at once: the deadline stays due, the timer must not spin
            return
        self.durable.retry_at = None
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
        retry = self.durable.retry_at
        if retry is None:
            return due
        return retry if due is None else max(due, retry)

    @property
    def reaping(self) -> bool:
        """Dead owners' allocations are still being released (or tasks whose holder left looked
        at again), a batch a turn."""
        return self.reaper.busy

    def reap(self, now: int) -> None:
        self.reaper.reap(now)

    def reap_more(self, now: int) -> None:
        self.reaper.reap_more(now)

    # --- who may ask for, allocate as and free what: the rules are gpud.core.authority's ---

    def _prefer(self, ref: int | str) -> int:
        try:
            return self.refs.index(ref)
        except Refused as exc:
            raise Refused(p.ErrorCode.UNKNOWN_GPU, f"{exc.message} in prefer") from None

    def _members(self, tenant: str | None) -> Members | None:
        t = self.config.tenants.get(tenant or "")
        return None if t is None else Members(frozenset(t.uids), frozenset(t.gids))

    def _check_owner(self, conn: ClientLink, task_id: str, what: str) -> None:
        if conn.scope is not None and conn.scope == task_id:
            return  # a connection on the task's own socket is the task's, whatever its uid
        owner = self.uids.get(task_id)
        if owner is None and (waiter := self.book.waiter(task_id)) is not None:
            owner = waiter.conn.uid
        check_task_owner(task_id, owner, conn.uid, admin=self.access.is_admin(conn), what=what)

    def _check_member(self, conn: ClientLink, tenant: str) -> None:
        check_tenant(tenant, self._members(tenant), conn.uid, conn.gid, admin=self.access.is_admin(conn))

    def _check_may_free(self, conn: ClientLink, alloc: Allocation) -> None:
        if conn.scope is not None and conn.scope == alloc.task_id:
            return  # (YIELD on the task's own socket; FREE is not served there: gpud.core.scopes)
        check_may_free(
            alloc.task_id,
            self.uids.get(alloc.task_id),
            alloc.tenant,
            self._members(alloc.tenant),
            conn.uid,
            conn.gid,
            admin=self.access.is_admin(conn),
        )
