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
from collections.abc import Callable

import structlog

from gpud.core.authority import Members, check_may_free, check_task_owner, check_tenant, owning_allocation
from gpud.core.errors import Refused
from gpud.core.ledger import (
    UNIT,
    Allocation,
    Checkpoint,
    Expired,
    GpuSpec,
    Insufficient,
    Ledger,
    LedgerEffect,
    Request,
    Served,
    TenantQuota,
    to_fixed,
)
from gpud.host.config import Config
from gpud.host.store import Store, StoreError
from gpud.serving.faults import Faults
from gpud.serving.parts import Part, Pieces
from gpud.serving.state import ClientLink, Handler
from gpud_client import protocol as p

log = structlog.get_logger(__name__)


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
    ) -> None:
        super().__init__(pieces)
        self.faults = faults
        self.config = config
        self.wake = wake  # the allocator timer: a wait's deadline is new
        self.effects.on(Served, self._served)
        self.effects.on(Expired, self._expired)
        specs = [GpuSpec(s.gpu.index, s.gpu.uuid) for s in self.slots]
        self.ledger = Ledger(
            specs,
            cpus,
            tenants=_quotas(config),
            seed=int.from_bytes(os.urandom(4), "big"),
            max_waiters=config.max_allocation_waiters,
        )
        try:
            self.store = Store(config.state_dir, sync=config.state_sync)
            self.uids: dict[str, int] = {}  # task id -> uid that allocated it
            self.waiters: dict[str, tuple[ClientLink, int, int]] = {}  # task id -> (conn, request id, since)
            self._restore()
        except StoreError as exc:
            raise RuntimeError(f"the allocation store cannot be used: {exc}") from None

    def _restore(self) -> None:
        """Put back what the store holds; a record that cannot be used any more is set aside
        (kept in the store's set_aside table with the reason), never a reason to stop."""
        loaded = self.store.load()
        for task_id, reason in loaded.unreadable:
            self._set_aside(task_id, f"unreadable record: {reason}")
        for alloc, uid in loaded.records:
            try:
                self.ledger.restore(alloc)
            except ValueError as exc:  # the node shrank, or the record contradicts another
                self._set_aside(alloc.task_id, str(exc))
                continue
            self.uids[alloc.task_id] = uid
        if self.uids:
            log.info("allocations_restored", count=len(self.uids), path=self.store.path)

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
        self.ledger.reconfigure(tenants=_quotas(config), max_waiters=config.max_allocation_waiters)

    def session_allocation(self, conn: ClientLink, named: str | None, gpu: int) -> Allocation | None:
        """The allocation a new session of ``conn`` on ``gpu`` belongs to (see core.authority)."""
        if named is not None and (alloc := self.ledger.get(named)) is not None:
            self._check_owner(conn, named, "attach a session to")
            return alloc
        fractional = self.ledger.fractions_on(gpu)
        if not fractional:
            return None  # nothing to belong to: no need to read /proc
        return owning_allocation(fractional, self.uids, gpu, ancestry(conn.pid), conn.uid)

    # --- requests -----------------------------------------------------------

    def handlers(self) -> dict[type, Handler]:
        return {
            p.Allocate: self.allocate,
            p.Free: self.free,
            p.ListAllocations: self.list_allocations,
            p.ResetAllocations: self.reset,
        }

    def allocate(self, conn: ClientLink, msg: p.Allocate, now: int) -> p.Allocated | None:
        if self.ledger.get(msg.task_id) is not None or msg.task_id in self.waiters:
            self._check_owner(conn, msg.task_id, "ask for")
        if msg.tenant is not None:
            self._check_member(conn, msg.tenant)
        priority = msg.priority
        if priority is None:
            priority = p.PRIORITY_OF_CLASS[msg.priority_class] if msg.priority_class else None
        self.access.check_priority(conn, priority, "allocation")
        priority = 50 if priority is None else priority
        req = Request(
            task_id=msg.task_id,
            gpus=to_fixed(msg.gpus),
            cpus=msg.cpus,
            prefer=tuple(self._prefer(ref) for ref in msg.prefer),
            strategy=msg.strategy,
            tenant=msg.tenant,
            priority=priority,
            owner_pid=msg.owner_pid,
            wait_us=msg.wait_ms * 1000,
        )
        existing = self.ledger.get(msg.task_id)
        cp = self.ledger.checkpoint()
        try:
            alloc = self.ledger.allocate(req, now)
        except Insufficient as short:
            self._counted("insufficient")
            raise Refused(p.ErrorCode.INSUFFICIENT, short.message) from None
        if alloc is None:
            self.waiters[msg.task_id] = (conn, msg.id, now)
            self.wake()
            log.info("allocation_waiting", task_id=msg.task_id, wait_ms=msg.wait_ms, priority=priority)
            return None
        if existing is None:
            self._store(cp, f"task {msg.task_id!r} was not allocated", put=[(alloc, conn.uid)])
            self._made(alloc)
        self._counted("granted" if existing is None else "repeated")
        return self.answer(msg.id, alloc, 0.0)

    def _counted(self, result: str) -> None:
        """One request's outcome: granted (at once or after its wait), repeated (the same task's
        allocation again), insufficient (at once, or when its wait ran out), withdrawn (a wait freed)."""
        self.metrics.node.allocation_requests.labels(result).inc()

    def free(self, conn: ClientLink, msg: p.Free, now: int) -> p.Ok:
        self._free(conn, msg.task_id, now)
        return p.Ok(id=msg.id)

    def _free(self, conn: ClientLink, task_id: str, now: int) -> None:
        alloc = self.ledger.get(task_id)
        if alloc is None and task_id not in self.waiters:
            raise Refused(p.ErrorCode.UNKNOWN_TASK, f"no allocation for task {task_id!r} (see gpuctl allocs)")
        if alloc is None:
            waiter = self.waiters[task_id][0]
            if waiter is not conn and not self.access.is_admin(conn):
                raise Refused(p.ErrorCode.PERMISSION_DENIED, f"task {task_id!r} waits for another client")
            self._answer_error(task_id, p.ErrorCode.INSUFFICIENT, "the wait was withdrawn")
            self._counted("withdrawn")
            self.ledger.release(task_id, now)  # a withdrawn wait frees nothing and serves no one
            return
        self._check_may_free(conn, alloc)
        cp = self.ledger.checkpoint()
        _, effects = self.ledger.release(task_id, now)
        self._store(cp, f"task {task_id!r} was not freed", delete=[task_id], effects=effects)
        self.uids.pop(task_id, None)
        log.info("allocation_freed", task_id=task_id, by_pid=conn.pid)
        self.effects.carry_out(effects, now)

    def list_allocations(self, conn: ClientLink, msg: p.ListAllocations, now: int) -> p.AllocationsReply:
        self.advance(now)
        return self.listing(msg.id)

    def reset(self, conn: ClientLink, msg: p.ResetAllocations, now: int) -> p.Ok:
        if not self.access.is_admin(conn):
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED, f"releasing every allocation needs admin rights (uid {conn.uid})"
            )
        released = self.ledger.allocations()
        cp = self.ledger.checkpoint()
        effects = [e for alloc in released for e in self.ledger.release(alloc.task_id, now)[1]]
        self._store(cp, "no allocation was released", clear=True, effects=effects)
        for alloc in released:
            self.uids.pop(alloc.task_id, None)
        log.warning("allocations_reset", by_pid=conn.pid, count=len(released))
        self.effects.carry_out(effects, now)
        return p.Ok(id=msg.id)

    def connection_closed(self, conn: ClientLink, now: int) -> None:
        """Waits die with their connection; allocations outlive it (they are durable)."""
        for task_id in [t for t, (c, _, _) in self.waiters.items() if c is conn]:
            del self.waiters[task_id]
            self.ledger.release(task_id, now)  # a withdrawn wait frees nothing and serves no one

    # --- timers -------------------------------------------------------------

    def advance(self, now: int) -> None:
        self.effects.carry_out(self.ledger.advance(now), now)

    def reap(self, now: int) -> None:
        """Reclaim allocations whose owner process is gone; one record's fault skips only it
        (a reclaim the store cannot record is tried again at the next reap)."""
        for alloc in self.ledger.allocations():
            try:
                if alloc.owner_pid is not None and not _alive(alloc.owner_pid):
                    cp = self.ledger.checkpoint()
                    _, effects = self.ledger.release(alloc.task_id, now)
                    self._store(
                        cp, f"task {alloc.task_id!r} was not reclaimed", delete=[alloc.task_id], effects=effects
                    )
                    self.uids.pop(alloc.task_id, None)
                    log.warning("allocation_reaped", task_id=alloc.task_id, owner_pid=alloc.owner_pid)
                    self.effects.carry_out(effects, now)
            except Refused:
                pass  # logged by _store
            except Exception as exc:
                self.faults.record("reaper", exc, task_id=alloc.task_id, owner_pid=alloc.owner_pid)

    def _served(self, e: Served, now: int) -> None:
        """A waiter the stored change served."""
        conn, rid, since = self.waiters.pop(e.allocation.task_id)
        self._made(e.allocation)
        self._counted("granted")
        self.links.send(conn, self.answer(rid, e.allocation, (now - since) / 1000))

    def _expired(self, e: Expired, now: int) -> None:
        self._answer_error(e.task_id, p.ErrorCode.INSUFFICIENT, f"{e.reason.message} (waited the full wait_ms)")
        self._counted("insufficient")

    # --- answers ------------------------------------------------------------

    def answer(self, rid: int, alloc: Allocation, waited_ms: float) -> p.Allocated:
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
        )

    def listing(self, rid: int) -> p.AllocationsReply:
        gpus = []
        for slot in self.slots:
            free = self.ledger.gpu_free(slot.gpu.index)
            tasks = {t: share / UNIT for t, share in self.ledger.gpu_tasks(slot.gpu.index).items()}
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
        return p.AllocationsReply(
            id=rid,
            allocations=[self.answer(0, a, 0.0) for a in self.ledger.allocations()],
            waiting=[r.task_id for r in self.ledger.waiting()],
            gpus=gpus,
            cpus_total=self.ledger.cpu_count,
            cpus_free=self.ledger.cpus_free(),
            tenants=tenants,
        )

    # --- helpers ------------------------------------------------------------

    def _store(
        self,
        cp: Checkpoint,
        refusal: str,
        *,
        put: list[tuple[Allocation, int]] | None = None,
        delete: list[str] | None = None,
        clear: bool = False,
        effects: list[LedgerEffect] | None = None,
    ) -> None:
        """Record one ledger change, the allocations it served included; when the store
        cannot, roll the ledger back to ``cp`` and refuse with ``store_failed``."""
        served = [
            (e.allocation, self.waiters[e.allocation.task_id][0].uid) for e in effects or [] if isinstance(e, Served)
        ]
        rows = (put or []) + served
        try:
            self.store.write(put=rows, delete=delete or [], clear=clear)
        except StoreError as exc:
            self.ledger.rollback(cp)
            self.metrics.node.store_failures.inc()
            self.faults.often("store_failed", refused=refusal, error=str(exc))
            raise Refused(p.ErrorCode.STORE_FAILED, f"{refusal}: the store could not record it ({exc})") from None
        for alloc, uid in rows:
            self.uids[alloc.task_id] = uid

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


def _quotas(config: Config) -> dict[str, TenantQuota]:
    return {name: TenantQuota(to_fixed(t.gpus), to_fixed(t.borrow)) for name, t in config.tenants.items()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ancestry(pid: int, depth: int = 64) -> list[int]:
    """``pid`` and its ancestors, nearest first, as far as /proc shows them (a hardened
    /proc that hides other users' processes gives just ``pid``: matching falls back to uid)."""
    chain = [pid]
    while len(chain) < depth:
        try:
            with open(f"/proc/{chain[-1]}/stat", "rb") as f:
                stat = f.read()
            parent = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if parent <= 1 or parent in chain:
            break
        chain.append(parent)
    return chain
