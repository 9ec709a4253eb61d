"""The ledger's outcomes carried out once stored: waiters answered, holders told of notices, withdrawals,
take-backs, shrinks, growth and resumes, owner processes signalled where the contact rules say so."""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gpud.capabilities.allocations.answers import Answers
from gpud.capabilities.allocations.tasks import TaskBook
from gpud.core.contacts import Tell
from gpud.core.ledger import UNIT, Allocation, Expired, Grown, Noticed, Served, TakenBack, Withdrawn, recovery_told
from gpud.host.config import Config
from gpud.host.metrics import REPEATED_AFTER, Metrics
from gpud.kit.effects import Effects
from gpud.kit.links import Links
from gpud_client import protocol as p

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class Telling:
    book: TaskBook
    answers: Answers
    links: Links
    metrics: Metrics
    config: Config  # (replaced on reconfigure)
    wake: Callable[[], None]

    def register(self, effects: Effects) -> None:
        for effect, carry in (
            (Served, self.served),
            (Expired, self.expired),
            (Noticed, self.noticed),
            (Withdrawn, self.withdrawn),
            (TakenBack, self.taken_back),
            (Grown, self.grown),
        ):
            effects.on(effect, carry)

    def counted(self, result: str) -> None:
        """One request's outcome: granted (at once or after its wait), repeated (the same task's
        allocation again), insufficient (at once, or when its wait ran out), withdrawn (a wait freed)."""
        self.metrics.node.allocation_requests.labels(result).inc()

    def granted(self, alloc: Allocation, waited_us: int) -> None:
        """A request granted, at once (0) or after the wait its connection made."""
        self.counted("granted")
        self.metrics.node.allocation_wait.labels(alloc.tenant or "").observe(max(0, waited_us) / 1e6)

    def prime(self) -> None:
        """The series named by the configuration (at start and after a reload)."""
        self.metrics.prime_allocations(self.config.preemption_strategy, self.config.tenants)

    def answer_error(self, task_id: str, code: p.ErrorCode, message: str) -> None:
        """The wait of ``task_id`` ends unserved: its waiter, if a connection waits, is told why."""
        waiter = self.book.contacts.take_waiter(task_id)
        if waiter is not None:
            self.links.send(waiter.conn, p.Error(id=waiter.rid, code=code, message=f"task {task_id!r}: {message}"))

    def served(self, e: Served, now: int) -> None:
        """A waiter the stored change served (a suspended allocation: its holder is told)."""
        task_id = e.allocation.task_id
        made(e.allocation)
        if e.resumed:
            log.info("allocation_resumed", task_id=task_id, gpus=list(e.allocation.gpus))
            if (holder := self.book.holder(task_id)) is not None:
                change = p.AllocChanged(change="resumed", allocation=self.answers.answer(0, e.allocation, 0.0))
                self.links.send(holder, change)
            return
        waiter = self.book.contacts.served(task_id, now)
        if waiter is None:  # a wait restored from the store: its client asks again and is answered,
            self.counted("granted")  # (how long it waited before the restart is not known)
            self.wake()  # else it is released after the crash grace (see the reaper)
            return
        self.granted(e.allocation, now - waiter.since)
        self.book.reach(task_id)
        self.links.send(waiter.conn, self.answers.answer(waiter.rid, e.allocation, (now - waiter.since) / 1000))

    def expired(self, e: Expired, now: int) -> None:
        log.info("allocation_expired", task_id=e.task_id, why=e.reason.message)
        self.answer_error(e.task_id, p.ErrorCode.INSUFFICIENT, f"{e.reason.message} (waited the full wait_ms)")
        self.counted("insufficient")
        self.book.settle(e.task_id)

    def noticed(self, e: Noticed, now: int) -> None:
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
        if a.preemptions >= REPEATED_AFTER:
            self.metrics.node.preemptions_repeated.labels(n.reason).inc()
        tell, holder = self.book.contacts.notice(a.task_id, n.whole)
        if tell is Tell.HOLDER:
            assert holder is not None
            push = p.Preempt(
                task_id=a.task_id,
                reason=n.reason,
                recovery=recovery_told(a, n),
                gpus=list(n.gpus),
                whole=n.whole,
                grace_s=round(grace_s, 3),
                by=n.by,
            )
            self.links.send(holder, push)
        elif tell is Tell.OWNER and self.book.owners.signal(a.task_id, signal.SIGTERM, "preempt_notice"):
            self.book.contacts.owner_signalled(a.task_id)  # as Kubernetes tells a pod

    def withdrawn(self, e: Withdrawn, now: int) -> None:
        holder = self.book.contacts.withdrawn(e.allocation.task_id)  # a signalled owner may stay now
        log.info("allocation_preempt_withdrawn", task_id=e.allocation.task_id, by=e.notice.by)
        if holder is not None:
            self.links.send(holder, p.PreemptWithdrawn(task_id=e.allocation.task_id))

    def taken_back(self, e: TakenBack, now: int) -> None:
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
        if e.after is not None:
            if (holder := self.book.holder(a.task_id)) is not None:
                self.links.send(
                    holder, p.AllocChanged(change="shrunk", allocation=self.answers.answer(0, e.after, 0.0))
                )
            return
        said = self.book.contacts.taken_back(a.task_id, gone=not e.suspended)
        if said.holder is not None:
            state = p.AllocState.SUSPENDED if e.suspended else p.AllocState.RUNNING
            revoked = p.AllocRevoked(task_id=a.task_id, reason=n.reason, state=state, gone=not e.suspended)
            self.links.send(said.holder, revoked)
        if said.kill:
            self.book.owners.signal(a.task_id, signal.SIGKILL, "preempt_grace_over")  # as Kubernetes ends a pod
        if not e.suspended:
            self.book.forget(a.task_id)

    def grown(self, e: Grown, now: int) -> None:
        a = e.allocation
        log.info("allocation_grown", task_id=a.task_id, gpus=list(a.gpus))
        self.metrics.node.allocations_grown.inc()
        if (holder := self.book.holder(a.task_id)) is not None:
            self.links.send(holder, p.AllocChanged(change="grown", allocation=self.answers.answer(0, a, 0.0)))


def made(alloc: Allocation) -> None:
    log.info(
        "allocation_made",
        task_id=alloc.task_id,
        gpus=list(alloc.gpus),
        share=alloc.share / UNIT,
        cpus=list(alloc.cpus),
        tenant=alloc.tenant,
        owner_pid=alloc.owner_pid,
    )
