"""Allocations in the simulated world: ALLOCATE (every priority class from spot 0 to production 100,
each recovery, elastic ranges, protected, tenants, waits), FREE, the ledger and its waits, the
fractional allocations' ceilings on sessions, RESET_ALLOCS.

The allocations acknowledged to a client are the model (``acked``, ``suspended``); a wait that
outlived a daemon is a ``Ghost`` until its client asks again. Taking allocations back (notices,
drains, protection) is ``Preemption``'s; what the store keeps across a restart, ``Restarts``'s. The
invariants:
- ledger, allocator and the model agree exactly (nothing acknowledged lost, nothing freed back,
  nothing twice); an allocation answered twice is the same; a request whose store write failed
  is answered ``store_failed`` and left the ledger exactly as it was; the allocations someone can
  be told of are those held by a connection (the last one ALLOCATED) or by a live owner;
- permissions (admin ops, other uids' tasks, tenants, priority ceilings, owner processes) and the
  limits a fractional allocation puts on a session are what the rules say;
- no device (GPU share, CPU core) is held by two allocations, in the ledger's books or the
  model's; a tenant stays within its quota and borrowing;
- an allocation waiter has its answer by wait_ms; no allocation waiter fits the node and still
  waits; a draining GPU gets no new allocation, and every allocation on it that someone holds is
  told once the timer has run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from gpud.core.errors import Refused
from gpud.core.ledger import UNIT, Insufficient
from gpud.kit.state import ClientLink
from gpud_client import protocol as p

from .model import MS, SIM_CPUS, Answer, Client, Part, Pending
from .owners import OwnerM

if TYPE_CHECKING:
    from .world import World

SHARED_TASKS = ["shared-1", "shared-2"]  # task ids several uids ask for


@dataclass(eq=False)
class NoticeM:
    """A PREEMPT as its holder saw it (or, for one restored after a restart, as it was stored)."""

    reason: p.PreemptReason
    gpus: tuple[int, ...]
    whole: bool
    by: str
    issued: int
    deadline: int

    def same(self, n: Any) -> bool:
        """Whether the ledger's ``Notice`` ``n`` is this one."""
        return n is not None and (n.reason, n.gpus, n.whole, n.by, n.issued, n.deadline) == (
            self.reason,
            self.gpus,
            self.whole,
            self.by,
            self.issued,
            self.deadline,
        )


@dataclass(eq=False)
class Acked:
    """An allocation acknowledged (ALLOCATED) and not freed (OK) or taken back; in ``Allocations.acked``
    while it holds devices, in ``Allocations.suspended`` while it waits for its own GPUs again."""

    task_id: str
    uid: int
    gpus: tuple[int, ...]
    share: int  # fixed point
    cpus: tuple[int, ...]
    tenant: str | None
    priority: int = 50
    on_preempt: p.Recovery = p.Recovery.TERMINATE
    gpus_min: int = 0  # elastic: whole GPUs it may be shrunk to (0: not elastic)
    gpus_max: int = 0
    protected: bool = False
    created: int = 0  # when it was made: its minimum runtime counts from then
    preemptions: int = 0
    resume: bool = False
    holder: ClientLink | None = None  # the connection told of its preemption (the last one ALLOCATED)
    notice: NoticeM | None = None  # the PREEMPT that runs
    told: int = 0  # PREEMPT pushes (or notices) it got: thrash
    withdrawn: int = 0  # of those, withdrawn
    rested_until: int = 0  # a notice withdrawn because its waiter gave up: not chosen again before then
    changed: int = 0  # its last elastic change (or resume): it grows again elastic_cooldown after
    owner_pid: int | None = None  # as asked (a term)
    owner: OwnerM = field(default_factory=lambda: OwnerM())

    @property
    def terms(self) -> tuple[Any, ...]:
        """What a repeat must ask for again (the ledger's ``_terms``)."""
        gpus = self.gpus_min * UNIT if self.gpus_min else self.share * len(self.gpus)
        return (gpus, len(self.cpus), self.tenant, self.priority, self.on_preempt, self.gpus_max, self.owner_pid)

    @property
    def extras(self) -> tuple[int, ...]:
        return self.gpus[self.gpus_min :] if self.gpus_min else ()

    def again(self, rid: int, *, wait_ms: int = 0, existing: bool = False) -> p.Allocate:
        """The ALLOCATE that asks for this allocation again (a runner that reconnects: ``existing``,
        only the allocation it holds; or one that starts the task again)."""
        gpus, cpus, tenant, priority, on_preempt, gpus_max, owner_pid = self.terms
        return p.Allocate(
            id=rid,
            task_id=self.task_id,
            gpus=gpus / UNIT,
            cpus=cpus,
            tenant=tenant,
            priority=priority,
            wait_ms=wait_ms,
            on_preempt=on_preempt,
            gpus_max=gpus_max or None,
            existing=existing,
            owner_pid=owner_pid,
            owner_any_uid=self.owner.any_uid,
        )


@dataclass(eq=False)
class Ghost:
    """A wait that outlived the daemon (it had victims, so it is stored): nobody's request now."""

    task_id: str
    uid: int
    terms: tuple[Any, ...]  # as ``Acked.terms`` says them
    earliest: int  # it does not expire before (its wait_ms from when it was asked)
    answer_by: int  # it ends by then (served or expired), its victims' grace included
    owner: OwnerM = field(default_factory=lambda: OwnerM())


def asked_priority(m: p.Allocate) -> int:
    """The priority an ALLOCATE asks for: its own, else its class's, else 50."""
    if m.priority is not None:
        return m.priority
    return p.PRIORITY_OF_CLASS[m.priority_class] if m.priority_class else 50


def asked_terms(m: p.Allocate) -> tuple[Any, ...]:
    """An ALLOCATE's terms, as ``Acked.terms`` says them."""
    gpus = round(m.gpus * UNIT)
    return (gpus, m.cpus, m.tenant, asked_priority(m), m.on_preempt, m.gpus_max or 0, m.owner_pid)


def shape(a: Any) -> tuple[Any, ...]:
    """What the model and the ledger must agree on for an allocation (``Acked`` or ``Allocation``)."""
    created = a.created if isinstance(a, Acked) else a.created_us
    changed = a.changed if isinstance(a, Acked) else a.changed_us
    return (
        a.gpus, a.share, a.cpus, a.tenant, a.priority, a.on_preempt, a.gpus_min, a.gpus_max, a.protected,
        a.preemptions, a.resume, created, changed,
    )  # fmt: skip


class Allocations(Part):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.acked: dict[str, Acked] = {}
        self.suspended: dict[str, Acked] = {}  # suspended allocations: waiting for their own GPUs again
        self.ghosts: dict[str, Ghost] = {}  # waits restored from the store after a crash, nobody's request
        self.history: dict[str, tuple[int, bool]] = {}  # task id -> (preemptions, resume) with no allocation now
        self.draining: set[int] = set()  # GPUs an admin drains
        self.wait_priority: dict[str, tuple[int, str | None]] = {}  # task id -> (priority, tenant) of its last wait
        self.waits_ended_now: set[str] = set()  # allocation waits answered or dropped in this event
        self.drain_now: set[int] = set()  # GPUs an admin asked to drain in this event
        self.undrain_now: set[int] = set()  # GPUs an admin asked to put back in this event
        self._placed: Any = None  # see check

    def answers(self) -> dict[str, Answer]:
        return {"ALLOCATE": self.answer_allocate, "FREE": self.answer_free, "RESET_ALLOCS": self.answer_reset_allocs}

    def steps(self) -> dict[str, Callable[[], None]]:
        return {"allocate": self.do_allocate, "free": self.do_free}

    def end_event(self) -> None:
        self.waits_ended_now.clear()
        self.drain_now.clear()
        self.undrain_now.clear()

    def get(self, task: str) -> Acked | None:
        """The allocation of ``task``, running or suspended."""
        return self.acked.get(task) or self.suspended.get(task)

    # --- answers --------------------------------------------------------------------------------

    def answer_allocate(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Allocate = pend.msg
        info = pend.info
        injected = self.world.restarts.injected > info["injected"] and pend.sent_at == self.now
        injected = injected and pend.deadline is None
        if isinstance(msg, p.Error):
            if msg.code == p.ErrorCode.STORE_FAILED:
                self.expect(injected, c, pend, msg, "store_failed without a failed store write")
                info["store_failed"] = True
                return
            self.expect(not injected, c, pend, msg, "the store write failed: expected store_failed")
            expected = info["expected"]
            if expected is not None:
                self.expect(msg.code == expected, c, pend, msg, f"expected {expected}")
                self.expect(info["why"] in msg.message, c, pend, msg, f"expected a refusal that says {info['why']!r}")
                if info["why"]:
                    self.stats[f"owner pids refused ({info['why']})"] += 1
                    self.stats["owner pids refused"] += 1
            elif msg.code == p.ErrorCode.INSUFFICIENT and "owner process exited" in msg.message:
                owner: OwnerM = info["owner"]
                self.expect(
                    pend.deadline is not None and self.world.owners.reaps_now and owner.reapable(),
                    c,
                    pend,
                    msg,
                    f"the reaper ends a wait whose owner ({owner.proc}) exited, nothing else",
                )
                self.wait_ended(c, pend)
                self.stats["allocation waits ended by the reaper (owner exited)"] += 1
            elif msg.code == p.ErrorCode.INSUFFICIENT:
                self.expect(m.task_id not in self.acked, c, pend, msg, "it is allocated: the same answer again")
                if pend.deadline is not None:
                    self.stats["allocation waits " + ("withdrawn" if info.get("withdrawn") else "expired")] += 1
                if pend.deadline is not None and not info.get("withdrawn"):
                    self.expect(self.now >= info["earliest"], c, pend, msg, f"gave up before wait_ms ({pend.deadline})")
            elif msg.code == p.ErrorCode.LIMIT_REACHED:  # waits restored after a restart and suspended ones count
                waiting = len(self.daemon.allocations.waiters) + len(self.ghosts) + len(self.suspended)
                self.expect(
                    m.wait_ms > 0 and waiting >= self.config.max_allocation_waiters,
                    c,
                    pend,
                    msg,
                    f"{waiting} allocation waiters, cap {self.config.max_allocation_waiters}",
                )
            elif msg.code == p.ErrorCode.INVALID:
                self.expect(
                    m.task_id in info["waiting_tasks"], c, pend, msg, "a valid request (unless already waiting)"
                )
            else:
                self.expect(False, c, pend, msg, "unexpected refusal")
            return
        self.expect(
            isinstance(msg, p.Allocated) and info["expected"] is None, c, pend, msg, f"expected {info['expected']}"
        )
        self.expect(not injected, c, pend, msg, "ALLOCATED though its store write failed")
        self.stats["allocations answered" + (" after waiting" if pend.deadline is not None else "")] += 1
        self.expect(
            msg.task_id == m.task_id and msg.cuda_visible_devices == ",".join(map(str, msg.gpus)),
            c,
            pend,
            msg,
            "task id / CUDA_VISIBLE_DEVICES",
        )
        before = self.get(m.task_id)
        if before is not None:
            self.answered_again(c, pend, msg, before)
            return
        self.expect(not info["suspended"], c, pend, msg, "a suspended allocation is answered as it is")
        got, why = self.made(c.uid, msg, m, info["owner"])
        self.expect(not why, c, pend, msg, why)
        got.holder = c.conn if m.notify else None
        got.owner.reach = got.owner.alive()  # (Allocations._hold: reachable through its owner while it runs)
        self.stats["allocations with an owner process"] += got.owner.held
        self.ghosts.pop(m.task_id, None)  # a wait restored after a restart, served as its client asked again

    def made(self, uid: int, msg: p.Allocated, m: p.Allocate | Ghost, owner: OwnerM) -> tuple[Acked, str]:
        """A new allocation, answered or found served: the model's record of it, and what is wrong
        with it ("" when it is what ``m`` asked for; only then is it recorded)."""
        share = round(msg.share * UNIT)
        terms = asked_terms(m) if isinstance(m, p.Allocate) else m.terms
        want, cpus, tenant, priority, on_preempt, gpus_max, owner_pid = terms
        got = Acked(
            msg.task_id,
            uid,
            tuple(msg.gpus),
            share,
            tuple(msg.cpus),
            msg.tenant,
            msg.priority,
            msg.on_preempt,
            msg.gpus_min or 0,
            msg.gpus_max or 0,
            msg.protected,
            self.now,
            msg.preemptions,
            msg.resume,
            changed=self.now,
            owner_pid=msg.owner_pid,
            owner=owner,
        )
        if gpus_max:
            fits = want // UNIT <= len(got.gpus) <= gpus_max and share == UNIT and got.gpus_min == want // UNIT
        elif want >= UNIT:
            fits = len(got.gpus) == want // UNIT and share == UNIT
        elif want > 0:
            fits = len(got.gpus) == 1 and share == want
        else:
            fits = got.gpus == () and share == 0
        if isinstance(m, p.Allocate) and m.strategy == p.Strategy.ONLY:
            fits = fits and set(got.gpus) <= set(m.prefer)  # exactly where it was told, or refused
        history = self.history.pop(msg.task_id, (0, False))
        why = ""
        if not (fits and len(set(got.gpus)) == len(got.gpus)):
            why = "the GPUs asked for"
        elif set(got.gpus) & (self.draining - self.undrain_now):
            why = f"placed on a draining GPU (draining: {sorted(self.draining)})"
        elif not (len(got.cpus) == cpus == len(set(got.cpus)) and all(0 <= x < SIM_CPUS for x in got.cpus)):
            why = "the CPU cores asked for"
        elif (got.tenant, got.priority, got.on_preempt, got.gpus_max, got.owner_pid) != (
            tenant,
            priority,
            on_preempt,
            gpus_max,
            owner_pid,
        ):
            why = "the terms asked for (tenant, priority, on_preempt, gpus_max, owner_pid)"
        elif msg.state != p.AllocState.RUNNING:
            why = "a new allocation runs"
        elif (got.preemptions, got.resume) != history:
            why = f"preemptions / resume: the task's history is {history} (lost across a restart?)"
        if not why:
            self.acked[msg.task_id] = got
            self.stats["allocations that resume a preempted task"] += got.resume
        return got, why

    def answered_again(self, c: Client, pend: Pending, msg: p.Allocated, before: Acked) -> None:
        """The same task again: the same allocation, in the state its holder was told; this
        connection holds it now if it listens (a notice that runs is its to act on)."""
        share = round(msg.share * UNIT)
        same = (before.gpus, before.share, before.cpus, before.tenant) == (
            tuple(msg.gpus),
            share,
            tuple(msg.cpus),
            msg.tenant,
        )
        self.expect(same, c, pend, msg, f"the same task again must be the same allocation: {before}")
        n = before.notice
        if before.task_id in self.suspended:
            state, deadline = p.AllocState.SUSPENDED, None
        elif n is not None:
            state, deadline = p.AllocState.PREEMPTING, round(max(0, n.deadline - self.now) / 1e6, 3)
        else:
            state, deadline = p.AllocState.RUNNING, None
        self.expect(
            (msg.state, msg.deadline_s) == (state, deadline),
            c,
            pend,
            msg,
            f"its state is {state}" + (f", {deadline} s of grace left" if deadline is not None else ""),
        )
        self.expect(
            (msg.preemptions, msg.resume, msg.protected) == (before.preemptions, before.resume, before.protected),
            c,
            pend,
            msg,
            f"preemptions / resume / protected {(before.preemptions, before.resume, before.protected)}",
        )
        before.owner.reach = before.owner.alive()  # (Allocations._hold)
        if pend.msg.notify:
            before.holder = c.conn
            if n is not None:
                self.world.preemption.react(c, before, n)
        elif before.holder is c.conn:
            before.holder = None

    def answer_free(self, c: Client, pend: Pending, msg: Any) -> None:
        task = pend.msg.task_id
        info = pend.info
        injected = self.world.restarts.injected > info["injected"]
        if isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED:
            self.expect(injected, c, pend, msg, "store_failed without a failed store write")
            info["store_failed"] = True
            return
        expected = info["expected"]
        if isinstance(msg, p.Error):
            self.expect(not injected, c, pend, msg, "the store write failed: expected store_failed")
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'OK'}")
            return
        self.expect(isinstance(msg, p.Ok) and expected is None, c, pend, msg, f"expected {expected}")
        a = self.acked.pop(task, None) or self.suspended.pop(task, None)
        if a is not None:
            self.expect(not injected, c, pend, msg, "the store write failed: expected store_failed")
            if a.notice is not None and a.notice.whole:
                self.world.preemption.remember(a)
                self.stats["preemptions done by FREE"] += 1
            self.world.preemption.retire(a)
        elif (ghost := self.ghosts.pop(task, None)) is not None:
            self.waits_ended_now.add(task)
            self.world.restarts.unstored_waits[task] = ghost
            self.stats["restored waits withdrawn"] += 1
        else:
            waiter = info["waiter"]
            self.expect(waiter is not None, c, pend, msg, "freed a task that was neither allocated nor waiting")

    def answer_reset_allocs(self, c: Client, pend: Pending, msg: Any) -> None:
        injected = self.world.restarts.injected > pend.info["injected"]
        if c.admin and injected:
            self.expect(
                isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED,
                c,
                pend,
                msg,
                "the store write failed: expected store_failed",
            )
            return
        self.world.conns.answer_simple(c, pend, msg)

    def reset(self, pend: Pending) -> None:
        """An admin's OK for RESET_ALLOCS: every allocation is gone (the suspended ones too)."""
        history = self.daemon.allocations.ledger.state.history
        preemption = self.world.preemption
        for task in pend.info["tasks"]:
            a = self.acked.pop(task, None) or self.suspended.pop(task, None)
            if a is not None and a.notice is not None and a.notice.whole and task in history:
                # freed under its notice, unless a waiter served earlier in the reset withdrew it
                # (its holder, forgotten, is not told): the order of the releases decides
                preemption.remember(a)
            if a is not None:
                preemption.retire(a)

    def listed(self, c: Client, pend: Pending, msg: p.AllocationsReply) -> None:
        """ALLOCS: the allocations acknowledged (and which are suspended), the waits, the drains."""
        # (the listing runs the allocations' deadlines first: a notice given or withdrawn then
        # may reach its holder after this answer, so running and preempting are one here)
        listed = sorted((a.task_id, a.state == p.AllocState.SUSPENDED) for a in msg.allocations)
        model = sorted([(t, False) for t in self.acked] + [(t, True) for t in self.suspended])
        self.expect(listed == model, c, pend, msg, f"acknowledged (task, suspended): {model}")
        waits = [q for q in self.all_pending("ALLOCATE") if q.deadline is not None]
        waiting = sorted([q.msg.task_id for q in waits] + list(self.ghosts))
        # (a wait past its deadline, while the timer tries a store write again, may end in the listing's
        # own run of the deadlines: its answer reaches its client after this one)
        due = {q.msg.task_id for q in waits if q.deadline is not None and q.deadline <= self.now}
        self.expect(
            set(msg.waiting) <= set(waiting) and set(waiting) - set(msg.waiting) <= due,
            c,
            pend,
            msg,
            f"waiting: {waiting}",
        )
        self.expect(msg.draining == sorted(self.draining), c, pend, msg, f"draining {sorted(self.draining)}")

    # --- waits ----------------------------------------------------------------------------------

    def wait_ended(self, c: Client, q: Pending) -> None:
        """A wait given up (freed, or its connection gone); one that had victims is stored, and its
        withdrawal may not be yet."""
        self.waits_ended_now.add(q.msg.task_id)
        if q.info.get("victims"):
            terms = asked_terms(q.msg)
            self.world.restarts.unstored_waits[q.msg.task_id] = Ghost(
                q.msg.task_id, c.uid, terms, q.info["earliest"], q.deadline or 0, q.info["owner"]
            )

    def waits_of(self, c: Client) -> list[Pending]:
        return [q for q in c.pending.values() if q.kind == "ALLOCATE" and q.deadline is not None]

    def asking(self, task: str) -> Pending | None:
        """The ALLOCATE of ``task`` that waits, or is being handled now (it may wait)."""
        for q in self.all_pending("ALLOCATE"):
            if q.msg.task_id == task and (q.deadline is not None or q.sent_at == self.now):
                return q
        return None

    def waiter_of(self, task: str) -> tuple[int, str | None] | None:
        """(priority, tenant) of what a notice names as ``by``: a wait (also one that ended in this
        event), a wait restored after a restart, or a suspended allocation waiting for its GPUs."""
        if (q := self.asking(task)) is not None:
            return asked_priority(q.msg), q.msg.tenant
        if (g := self.ghosts.get(task)) is not None:
            return g.terms[3], g.terms[2]
        if (a := self.suspended.get(task)) is not None:
            return a.priority, a.tenant
        return self.wait_priority.get(task) if task in self.waits_ended_now else None

    def model_waiters(self) -> list[int]:
        """The priorities of everything that waits for devices."""
        out = [asked_priority(q.msg) for q in self.all_pending("ALLOCATE") if q.deadline or q.sent_at == self.now]
        return out + [g.terms[3] for g in self.ghosts.values()] + [a.priority for a in self.suspended.values()]

    def awake(self) -> bool:
        """The allocations' timer has yet to run for what this event changed (woken, or a new daemon)."""
        return self.world.woken or self.world.booting

    # --- sessions on a fractional allocation --------------------------------------------------------

    def allocation_for(self, c: Client, gpu: int, task_id: str | None) -> Acked | None:
        """The allocation a new session on ``gpu`` belongs to: the one it names, else a fractional one of
        its uid's on the GPU: of the nearest process (the session's, then its ancestors') that owns one
        and runs, else the smallest."""
        alloc = self.acked.get(task_id) if task_id else None
        if alloc is None:
            mine = [a for a in self.acked.values() if a.uid == c.uid and gpu in a.gpus and 0 < a.share < UNIT]
            table = self.world.owners.table
            for pid in table.ancestry(c.pid) if mine else ():
                near = [a for a in mine if a.owner.alive() and a.owner.proc is table.at[pid]]
                if near:
                    self.stats["sessions that belong to their process's allocation"] += 1
                    return min(near, key=lambda a: (a.share, a.task_id))
            alloc = min(mine, key=lambda a: (a.share, a.task_id), default=None)
        return alloc

    def fraction_ceilings(self, c: Client, gpu: int, task_id: str | None) -> tuple[int, int | None]:
        """What a fractional allocation puts on a new session (core %, memory bytes)."""
        alloc = self.allocation_for(c, gpu, task_id)
        if alloc is None or alloc.share >= UNIT or gpu not in alloc.gpus:
            return 100, None
        return max(1, alloc.share * 100 // UNIT), self.gpus[gpu].total * alloc.share // UNIT

    # --- the client's side of each request ---------------------------------------------------------

    def draw_allocate(self, c: Client) -> p.Allocate:
        """An ALLOCATE: whole GPUs, fractions, CPU cores only, bad shapes; priorities of every class
        (spot 0 and production 100 included), each recovery (shrink mostly with an elastic range),
        elastic ranges, an admin's protection, waits; or the same terms again."""
        r = self.rng
        n = len(self.gpus)
        own = [f"c{c.cid}-t{k}" for k in range(3)]
        others = sorted(self.acked)[:3] + sorted(self.suspended)[:1] + sorted(self.ghosts)[:1]
        task = r.choice(own + own + SHARED_TASKS + others)
        gpus = r.choice([1.0, 1.0, 2.0, 0.5, 0.25, 0.3333, 0.0, 1.5, 9.0])
        cpus = r.choice([0, 0, 1, 2] + ([0] if gpus else [1]))
        tenant = r.choice([None, None, None, "team", "lab", "nope"])
        ceiling = self.ceiling(c)  # often its highest: requests that may take lower ones back
        priority = r.choice([None, None, 0, 0, 10, 60, 80, 100, ceiling, ceiling])
        priority_class = r.choice([None, None, None, *p.PriorityClass]) if priority is None else None
        wait_ms = r.choice([0, 0, 0, 20, 50, 200, 1000])
        on_preempt = r.choice(list(p.Recovery))
        gpus_max = None
        if gpus in (1.0, 2.0) and r.random() < 0.3:
            gpus_max = r.randint(int(gpus) + 1, n) if gpus < n and r.random() < 0.9 else r.randint(1, n + 1)
        if on_preempt == p.Recovery.SHRINK and gpus_max is None and r.random() < 0.8:
            on_preempt = p.Recovery.TERMINATE  # shrink is for elastic ranges (a few are refused)
        prefer: list[int | str] = r.choice([[], [], [], [0], [n - 1], [], [], [0], [1 % n], [7]])
        held = self.get(task)
        if held is not None and r.random() < 0.5:  # a repeat with the same terms (prefer, strategy, wait may differ)
            return msgspec.structs.replace(
                held.again(c.rid(), wait_ms=wait_ms), prefer=prefer, strategy=r.choice(list(p.Strategy))
            )
        owner_pid, any_uid = self.world.owners.draw_owner(c) if r.random() < 0.5 else (None, False)
        return p.Allocate(
            id=c.rid(),
            task_id=task,
            gpus=gpus,
            cpus=cpus,
            prefer=prefer,
            strategy=r.choice(list(p.Strategy)),
            tenant=tenant,
            priority=priority,
            priority_class=priority_class,
            wait_ms=wait_ms,
            on_preempt=on_preempt,
            gpus_max=gpus_max,
            protected=r.random() < 0.08,
            # False: a one-shot gpuctl alloc, which does not listen for PREEMPT (its owner is signalled)
            notify=r.random() < (0.9 if owner_pid is None else 0.4),
            owner_pid=owner_pid,
            owner_any_uid=any_uid,
        )

    def allocate_refusal(
        self, c: Client, msg: p.Allocate, waiting: dict[str, Pending]
    ) -> tuple[p.ErrorCode | None, str]:
        """How the daemon must refuse ``msg`` (None: it allocates, or the request waits), and what the
        refusal's message must say ("" : anything), in the order it checks: the task's owner, the
        tenant's members, the priority ceiling, protection, a new task's owner process, prefer, the
        terms of what the task holds or waits for, the request's shape, the tenant."""
        task, n = msg.task_id, len(self.gpus)
        held = self.get(task)
        ghost = self.ghosts.get(task)
        owner_uid = held.uid if held else waiting[task].info["uid"] if task in waiting else ghost and ghost.uid
        member = self.config.tenants.get(msg.tenant or "")
        priority = None if msg.priority is None and msg.priority_class is None else asked_priority(msg)
        gpus = round(msg.gpus * UNIT)
        if owner_uid is not None and owner_uid != c.uid and not c.admin:
            return p.ErrorCode.PERMISSION_DENIED, ""
        if (
            member is not None
            and (member.uids or member.gids)
            and c.uid not in member.uids
            and c.gid not in member.gids
            and not c.admin
        ):
            return p.ErrorCode.PERMISSION_DENIED, ""
        if (priority or 0) > self.ceiling(c):
            return p.ErrorCode.PERMISSION_DENIED, ""
        if msg.existing and held is None:  # only the allocation the task holds, never a new one
            return p.ErrorCode.UNKNOWN_TASK, ""
        if msg.protected and not c.admin:
            return p.ErrorCode.PERMISSION_DENIED, ""
        if held is None and task not in waiting and ghost is None and msg.owner_pid is not None:
            why = self.world.owners.owner_refusal(c, msg.owner_pid, any_uid=msg.owner_any_uid)
            if why:
                return p.ErrorCode.PERMISSION_DENIED, why
        if 7 in msg.prefer:
            return p.ErrorCode.UNKNOWN_GPU, ""
        if held is not None:  # the same allocation again for the same terms, refused for others
            return (None if asked_terms(msg) == held.terms else p.ErrorCode.INVALID), ""
        if task in waiting:
            return p.ErrorCode.INVALID, ""
        if ghost is not None:  # its wait outlived the daemon: the same terms take it up again
            return (None if asked_terms(msg) == ghost.terms else p.ErrorCode.INVALID), ""
        bad_shape = msg.gpus in (1.5, 9.0) or (gpus == 0 and msg.cpus == 0) or msg.gpus > n
        if msg.gpus_max is not None:
            bad_shape = bad_shape or gpus < UNIT or gpus % UNIT != 0 or msg.gpus_max <= gpus // UNIT or msg.gpus_max > n
        elif msg.on_preempt == p.Recovery.SHRINK:
            bad_shape = True
        if bad_shape:
            return p.ErrorCode.INVALID, ""
        if msg.strategy == p.Strategy.ONLY:  # the GPUs named, as many as whole ones asked; no wait, no range
            named = len(set(msg.prefer))
            if not named or (gpus >= UNIT and gpus // UNIT != named) or msg.gpus_max is not None or msg.wait_ms:
                return p.ErrorCode.INVALID, "strategy only"
        if msg.tenant == "nope":
            return p.ErrorCode.UNKNOWN_TENANT, ""
        return None, ""

    def allocate(self, c: Client, msg: p.Allocate | None = None) -> None:
        msg = msg or self.draw_allocate(c)
        task = msg.task_id
        owners = self.world.owners
        waiting = {q.msg.task_id: q for q in self.all_pending("ALLOCATE") if q.deadline is not None}
        expected, why = self.allocate_refusal(c, msg, waiting)
        ghost = self.ghosts.get(task) if expected is None else None
        suspended = expected is None and task in self.suspended
        owner = ghost.owner if ghost is not None else OwnerM()
        fresh = task not in self.acked and task not in self.suspended and task not in waiting and ghost is None
        if expected is None and fresh and msg.owner_pid is not None:  # claimed: held from now on
            owner = OwnerM(owners.claimed(c, msg.owner_pid), msg.owner_any_uid, held=True)
        elif expected is None and c.proc is not None and msg.owner_pid == c.proc.pid:
            prev = self.get(task)  # asked again by the owner itself:
            o = prev.owner if prev is not None else None  # held again where a restart could not
            if o is not None and not o.held and o.proc is c.proc and c.proc.alive:
                o.held, o.orphan_at, o.reach = True, None, True
        cp, waiters = self.daemon.allocations.ledger.checkpoint(), dict(self.daemon.allocations.waiters)
        injected = self.world.restarts.injected
        pend = self.send(
            c,
            msg,
            "ALLOCATE",
            uid=c.uid,
            client=c,
            expected=expected,
            why=why,
            owner=owner,
            injected=injected,
            waiting_tasks=sorted(waiting),
            suspended=suspended,
        )
        if c.pending.get(pend.rid) is pend:
            if ghost is not None:  # it waits again, as the ledger kept it, for this connection (its owner too)
                pend.deadline = max(ghost.answer_by, pend.info.get("answer_by", 0))
                pend.info.update(rejoin=True, earliest=ghost.earliest, victims=True)
                del self.ghosts[task]
            elif msg.wait_ms == 0:
                self.fail(f"client {c.cid}: ALLOCATE with wait_ms 0 was not answered at once")
            else:
                pend.info["earliest"] = pend.sent_at + msg.wait_ms * MS
                pend.deadline = max(pend.info["earliest"], pend.info.get("answer_by", 0))
            self.wait_priority[task] = (asked_priority(msg), msg.tenant)
        if pend.info.get("store_failed"):
            self.check_rolled_back(cp, waiters, f"ALLOCATE {task}")
        self.after_event()

    def free(self, c: Client, task: str | None = None) -> None:
        r = self.rng
        waiting = {q.msg.task_id: q for q in self.all_pending("ALLOCATE") if q.deadline is not None}
        if task is None:
            mine = sorted(t for t, a in [*self.acked.items(), *self.suspended.items()] if a.uid == c.uid)
            everyone = sorted(self.acked) + sorted(self.suspended)
            task = r.choice(
                mine + mine + mine + everyone + sorted(waiting) * 2 + sorted(self.ghosts) + ["never-allocated"]
            )
        alloc = self.get(task)
        waiter = waiting.get(task)
        ghost = self.ghosts.get(task)
        expected: p.ErrorCode | None = None
        if alloc is None and ghost is not None:  # a wait restored after a restart: its uid's to withdraw
            expected = p.ErrorCode.PERMISSION_DENIED if ghost.uid != c.uid and not c.admin else None
        elif alloc is None and waiter is None:
            expected = p.ErrorCode.UNKNOWN_TASK
        elif alloc is None:
            assert waiter is not None
            if waiter.info["client"] is not c and not c.admin:
                expected = p.ErrorCode.PERMISSION_DENIED
        elif not c.admin and alloc.uid != c.uid:
            tenant = self.config.tenants.get(alloc.tenant or "")
            if tenant is None or (c.uid not in tenant.uids and c.gid not in tenant.gids):
                expected = p.ErrorCode.PERMISSION_DENIED
        if waiter is not None and expected is None and alloc is None:
            waiter.info["withdrawn"] = True
            self.wait_ended(waiter.info["client"], waiter)
        if alloc is not None and alloc.notice is not None and expected is None:
            self.world.preemption.yields_now.add(task)  # freed under a notice: that preemption is done
        cp, waiters = self.daemon.allocations.ledger.checkpoint(), dict(self.daemon.allocations.waiters)
        injected = self.world.restarts.injected
        pend = self.send(
            c, p.Free(id=c.rid(), task_id=task), "FREE", expected=expected, waiter=waiter, injected=injected
        )
        self.finish(c, pend)
        if pend.info.get("store_failed"):
            self.check_rolled_back(cp, waiters, f"FREE {task}")
        self.after_event()

    def check_rolled_back(self, cp: Any, waiters: dict[str, Any], what: str) -> None:
        """A request whose store write failed left the ledger and the waiters exactly as they were."""
        led, alloc = self.daemon.allocations.ledger, self.daemon.allocations
        if led.checkpoint() != cp:
            self.fail(f"{what}: the store write failed but the ledger is not as it was before")
        if dict(alloc.waiters) != waiters:
            self.fail(
                f"{what}: the store write failed but the allocation waiters changed "
                f"({sorted(waiters)} -> {sorted(alloc.waiters)})"
            )

    def do_allocate(self) -> None:
        c = self.pick(self.connected())
        if c is not None:
            self.allocate(c)

    def do_free(self) -> None:
        c = self.pick(self.connected())
        if c is not None:
            self.free(c)

    # --- the checks ---------------------------------------------------------------------------------

    def check(self) -> None:
        """The ledger and the allocator agree exactly with the model (allocations, suspended allocations,
        waits, holders, drained GPUs, preemption history); no device is held twice; a tenant stays
        within its quota; a waiter that fits is served; a draining GPU's allocations that can be told
        have been. (What nobody was told is carried out on the model first: ``Preemption.check``.)"""
        d = self.daemon
        alloc, led = d.allocations, d.allocations.ledger
        ledger = {a.task_id: shape(a) for a in led.allocations()}
        model = {t: shape(a) for t, a in self.acked.items()}
        if ledger != model:
            self.fail(f"the ledger {ledger} is not what was acknowledged {model}")
        suspended = {a.task_id: shape(a) for a in led.suspended()}
        if suspended != {t: shape(a) for t, a in self.suspended.items()}:
            self.fail(f"the ledger's suspended allocations {suspended} are not the model's {sorted(self.suspended)}")
        both = [*self.acked.items(), *self.suspended.items()]
        holders = {t: a.holder for t, a in both if a.holder is not None}
        reach = {t for t, a in both if a.owner.reach}
        if alloc.holders != holders or led.reachable != set(holders) | reach:
            self.fail(
                f"the connections told of preemptions {[(t, c.client_id) for t, c in alloc.holders.items()]} "
                f"(reachable {sorted(led.reachable)}) are not the ones that last got ALLOCATED "
                f"{[(t, c.client_id) for t, c in holders.items()]} (and those reached by their owner {sorted(reach)})"
            )
        if set(led.draining()) != self.draining or {s.gpu.index for s in d.slots if s.draining} != self.draining:
            self.fail(f"the daemon drains GPUs {sorted(led.draining())}, admins were told {sorted(self.draining)}")
        if led.state.history != self.history:
            self.fail(f"the ledger's preemption history {led.state.history} is not the model's {self.history}")
        uids = {t: a.uid for t, a in both}
        if {t: u for t, u in alloc.uids.items() if t in uids} != uids:
            self.fail(f"the allocator's owners {alloc.uids} are not the acknowledged {uids}")
        waits = {q.msg.task_id for q in self.all_pending("ALLOCATE") if q.deadline is not None}
        if set(alloc.waiters) != waits or {r.task_id for r in led.waiting()} != waits | set(self.ghosts):
            self.fail(
                f"allocation waiters: allocator {sorted(alloc.waiters)}, ledger "
                f"{sorted(r.task_id for r in led.waiting())}, clients {sorted(waits)}, restored {sorted(self.ghosts)}"
            )
        retrying = self.world.restarts.retrying()
        for a in self.acked.values():  # a drain tells everyone it can (the timer's next tick at the latest)
            if a.holder and not a.notice and set(a.gpus) & self.draining and not (self.awake() or retrying):
                self.fail(
                    f"{a.task_id} on GPUs {a.gpus} is held by a live connection, GPUs {sorted(self.draining)} "
                    "drain, and it has no notice"
                )
        # The rest depends only on the allocations, the waits, the drains and the GPUs kept for waiters:
        # judged again only when one of them changed.
        placed = (led, ledger, [r.task_id for r in led.waiting()], led.draining(), dict(led.state.reserved))
        if placed == self._placed:
            return
        self._placed = placed
        self.check_devices()
        for name, t in self.config.tenants.items():
            used = sum(len(a.gpus) * a.share for a in self.acked.values() if a.tenant == name)
            if used > round((t.gpus + t.borrow) * UNIT):
                self.fail(f"tenant {name} uses {used / UNIT} GPUs, over its quota {t.gpus} + borrow {t.borrow}")
        for req in led.waiting():  # each waiter is served as soon as it fits
            cp = led.checkpoint()
            try:
                led.allocate(dataclasses.replace(req, task_id=req.task_id + "+probe", wait_us=0), self.now)
                fits = True
            except (Insufficient, Refused):
                fits = False
            finally:
                led.rollback(cp)
            if fits:
                self.fail(f"allocation {req.task_id} still waits though it fits now")
            self.stats["allocation waiters probed"] += 1

    def check_devices(self) -> None:
        """No device is held by two allocations: the model's allocations share no CPU core and no
        GPU beyond its whole, and the ledger's books say the same (free + held = one GPU, all cores)."""
        led = self.daemon.allocations.ledger
        on: list[dict[str, int]] = [{} for _ in self.gpus]
        for t, a in self.acked.items():
            for g in a.gpus:
                on[g][t] = a.share
        for gm, mine in zip(self.gpus, on, strict=True):
            free, tasks = led.gpu_free(gm.index), led.gpu_tasks(gm.index)
            if (
                sum(mine.values()) > UNIT
                or tasks != mine
                or free + sum(tasks.values()) != UNIT
                or not 0 <= free <= UNIT
            ):
                self.fail(f"GPU {gm.index}: held by {mine} (the ledger: {tasks}, free {free}): held twice")
        cores = [x for a in self.acked.values() for x in a.cpus]
        if (
            len(cores) != len(set(cores))
            or set(cores) & set(led.cpus_free())
            or len(cores) + len(led.cpus_free()) != SIM_CPUS
        ):
            self.fail(f"CPU cores: allocated {sorted(cores)}, free {led.cpus_free()}")
