"""What gpud says of allocations: ALLOCATED (an answer, and the allocation inside every change pushed to
its holder) and a page of LIST_ALLOCATIONS, from the ledger as it is now."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpud.core.authority import fraction_ceilings
from gpud.core.ledger import UNIT, Allocation, Ledger
from gpud.host.config import Config
from gpud.kit.state import GpuSlot
from gpud_client import protocol as p


@dataclass(eq=False)
class Answers:
    ledger: Ledger
    slots: list[GpuSlot]
    config: Config  # (replaced on reconfigure)
    clock: Callable[[], int]

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
            deadline_s=None if notice is None else round(max(0, notice.deadline - now) / 1e6, 3),
            resume=alloc.resume,
            preemptions=alloc.preemptions,
            preemption_grace_s=self.config.preemption_grace_s,
            memory_bytes=self._memory(alloc),
        )

    def _memory(self, alloc: Allocation) -> int | None:
        """A fraction's memory ceiling for its sessions (whole GPUs: none)."""
        if not alloc.gpus or alloc.share >= UNIT:
            return None
        return fraction_ceilings(alloc, alloc.gpus[0], self.slots[alloc.gpus[0]].gpu.memory_total_bytes)[1]

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

    def own(self, rid: int, task_id: str) -> p.AllocationsReply:
        """What a connection on ``task_id``'s own socket is shown: its allocation alone (running or
        suspended), and of the node only the GPUs' totals."""
        alloc = self.ledger.get(task_id)
        state = None
        if alloc is None and (alloc := self.ledger.suspended_of(task_id)) is not None:
            state = p.AllocState.SUSPENDED
        gpus = [
            p.GpuAllocationSummary(
                index=slot.gpu.index,
                uuid=slot.gpu.uuid,
                allocated=(UNIT - (free := self.ledger.gpu_free(slot.gpu.index))) / UNIT,
                free=free / UNIT,
                tasks={task_id: min(alloc.share, UNIT) / UNIT}
                if alloc and state is None and slot.gpu.index in alloc.gpus
                else {},
            )
            for slot in self.slots
        ]
        return p.AllocationsReply(
            id=rid,
            allocations=[] if alloc is None else [self.answer(0, alloc, 0.0, state)],
            total=0 if alloc is None else 1,
            next_after=None,
            waiting=[],
            waiters=[],
            draining=sorted(self.ledger.draining()),
            gpus=gpus,
            cpus_total=self.ledger.cpu_count,
            cpus_free=self.ledger.cpus_free(),
            tenants={},
        )
