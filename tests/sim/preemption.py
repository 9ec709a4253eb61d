"""Taking allocations back in the simulated world: PREEMPT and its answers (YIELD, FREE, nothing),
PREEMPT_WITHDRAWN, ALLOC_REVOKED, ALLOC_CHANGED (shrunk, grown, resumed), drains, protection, and
what changed for an allocation no connection holds.

The connection that last got ALLOCATED for a task holds it (the daemon pushes its preemption
there): on PREEMPT a ``good`` holder yields at once or soon, or frees instead, a ``slow`` one
yields around the grace's end, a ``crashy`` one may crash, a ``stubborn`` one or an abandoner never
answers; after ALLOC_REVOKED a runner asks for the task again (a checkpoint resumes) or frees a
suspended one. The invariants (``noticed``, ``notice_wrong``, ``reconcile``):
- a PREEMPT goes to the allocation's holder, once at a time, with its recovery and the configured
  grace; what ALLOCS called not preemptible when it was issued is not preempted then;
- only a drain tells production (100) or a protected allocation to leave, and nothing but a drain
  with preemption off; a victim of ``priority`` has a strictly lower priority than the waiter named
  ``by`` and ran the minimum runtime unless spot; ``elastic`` takes exactly the extras, for a
  waiter of its priority or higher; ``quota_reclaim`` takes from a tenant over its quota for
  another's; a victim whose notice was withdrawn rests for the cooldown;
- a notice ends in ALLOC_REVOKED or ALLOC_CHANGED(shrunk) when yielded (suspended only then, for
  on_preempt suspend) or at its grace's end (later only while the timer retries a store write), or
  is withdrawn only when its waiter gave up or was served or its GPU was put back;
- what changed for an allocation nobody holds (grown, resumed, carried out, withdrawn, reaped) is
  found in the ledger and judged by the same rules; an allocation grows only within its range,
  after its cooldown, off draining GPUs, while nothing of its priority or higher waits;
- no victim gets more notices than the simulated time / preemption_cooldown + 2 (the thrash
  figures are printed at the end of a run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from gpud.core import shields
from gpud.core.ledger import UNIT, recovery_told
from gpud_client import protocol as p

from .allocations import Acked, NoticeM
from .model import MS, START_US, USERS, Answer, Client, Part, Pending, short
from .restarts import MAX_LATE_US

if TYPE_CHECKING:
    from .world import World


class Preemption(Part):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.grace_us = round(self.config.preemption_grace_s * 1e6)
        self.min_runtime_us = round(self.config.preemption_min_runtime_s * 1e6)
        self.cooldown_us = round(self.config.preemption_cooldown_s * 1e6)
        self.started = START_US
        self.yields_now: set[str] = set()  # tasks whose YIELD (or FREE under a notice) was sent in this event
        self.withdrawals_now: list[tuple[Acked, NoticeM]] = []  # PREEMPT_WITHDRAWN pushes of this event
        self.again_terms: dict[str, p.Allocate] = {}  # tasks a runner asks for again after they were taken back
        # (notices, withdrawn, lifetime us, the bound on its notices) of each victim, when it ended
        self.victims: list[tuple[int, int, int, int]] = []

    def answers(self) -> dict[str, Answer]:
        return {"YIELD": self.answer_yield, "DRAIN": self.answer_drain, "PROTECT": self.answer_protect}

    def steps(self) -> dict[str, Callable[[], None]]:
        return {"yield": self.do_yield, "contend": self.do_contend}

    def laters(self) -> dict[str, Callable[..., None]]:
        return {"react": self.later_react, "again": self.later_again, "free": self.later_free}

    def end_event(self) -> None:
        self.yields_now.clear()
        self.withdrawals_now.clear()

    # --- the holders' side ----------------------------------------------------------------------------

    def held_by(self, c: Client, task: str, msg: Any) -> Acked:
        """The allocation a push names: one the model has, and this connection holds it."""
        a = self.world.allocs.get(task)
        if a is None:
            self.fail(f"client {c.cid} got {short(msg)} for an allocation that does not exist")
        if a.holder is not c.conn:
            holder = next((x.cid for x in self.clients if x.conn is not None and x.conn is a.holder), None)
            self.fail(
                f"client {c.cid} got {short(msg)}, but the connection holding {task} is "
                + (
                    "none (nobody asked for it since the last restart or disconnect)"
                    if holder is None
                    else f"client {holder}'s"
                )
            )
        return a

    def on_preempt(self, c: Client, msg: p.Preempt) -> None:
        a = self.held_by(c, msg.task_id, msg)
        if msg.task_id in self.world.allocs.suspended:
            self.fail(f"client {c.cid} got {short(msg)} for a suspended allocation")
        if a.notice is not None:
            self.fail(f"client {c.cid} got {short(msg)} while the notice of {a.notice.issued} runs")
        n = NoticeM(msg.reason, tuple(msg.gpus), msg.whole, msg.by, self.now, self.now + self.grace_us)
        self.noticed(a, n, msg, f"client {c.cid} got {short(msg)}")
        self.react(c, a, n)
        if self.rng.random() < 0.1:  # gpud dies while the notice runs
            self.later(self.now + self.rng.randrange(0, max(1, self.grace_us)), "crash")

    def noticed(self, a: Acked, n: NoticeM, msg: p.Preempt, what: str) -> None:
        """Notice ``n`` (as ``msg`` says it) given to ``a``: judged by the rules, and what it changes."""
        allocs = self.world.allocs
        why = self.notice_wrong(a, n, msg) or self.notice_unsaid(a, n)
        if why:
            self.fail(
                f"{what} for {a.task_id} (priority {a.priority}, gpus {a.gpus}, "
                f"on_preempt {a.on_preempt}, protected {a.protected}, running {self.now - a.created} us): {why}"
            )
        a.notice = n
        a.told += 1
        self.stats[f"preempt notices ({msg.reason}, {'whole' if msg.whole else 'partial'})"] += 1
        self.stats["preempt notices"] += 1
        if (q := allocs.asking(n.by)) is not None:  # it waits until its victims have left
            q.info["victims"] = True
            q.info["answer_by"] = max(q.info.get("answer_by", 0), n.deadline + 1)
            if q.deadline is not None:
                q.deadline = max(q.deadline, n.deadline + 1)
        if (g := allocs.ghosts.get(n.by)) is not None:
            g.answer_by = max(g.answer_by, n.deadline + 1)
        bound = (self.now - self.started) // max(1, self.cooldown_us) + 2
        if a.told > bound:
            self.fail(
                f"thrash: {a.task_id} got its notice number {a.told} after {(self.now - self.started) / 1e6:.3f} s "
                f"simulated, more than time / preemption_cooldown + 2 = {bound}"
            )

    def noticed_unheld(self, a: Acked, la: Any, ln: Any) -> None:
        """A notice the ledger gave ``a``, which no connection holds: only through its live owner process
        can it be told (reachable), by SIGTERM when it is told to leave whole."""
        t, o = a.task_id, a.owner
        if a.holder is not None or not o.reach:
            self.fail(f"the daemon runs a notice for {t} ({ln}) that its holder was never told")
        if ln.issued != self.now:
            self.fail(f"the notice of {t} ({ln}) was given before this event, and not judged then")
        n = NoticeM(ln.reason, tuple(ln.gpus), ln.whole, ln.by, ln.issued, ln.deadline)
        grace_s = round((ln.deadline - ln.issued) / 1e6, 3)
        msg = p.Preempt(
            task_id=t, reason=ln.reason, recovery=recovery_told(la, ln), gpus=list(ln.gpus), whole=ln.whole,
            grace_s=grace_s, by=ln.by,
        )  # fmt: skip
        self.noticed(a, n, msg, f"notice {short(msg)} (nobody holds it; its owner {o.proc})")
        if n.whole and o.alive() and o.termed != n.issued:
            self.fail(f"{t} is told to leave whole, nobody holds it, and its owner {o.proc} got no SIGTERM")
        self.stats["notices to an owner nobody holds" + (" (SIGTERM)" if o.termed == n.issued else "")] += 1

    def notice_unsaid(self, a: Acked, n: NoticeM) -> str:
        """A waiter's notice to an allocation that ALLOCS called not preemptible when it was issued:
        what gpud says must be what it does ("" if nothing). Who can be told may have changed since."""
        la = self.daemon.allocations.ledger.get(a.task_id)
        if n.reason == p.PreemptReason.DRAIN or n.by == "idle" or la is None:
            return ""
        shield = self.daemon.allocations.ledger.shield(la, n.issued)
        if shield is None or shield == shields.UNREACHABLE or shield.why == shields.RESTING:
            return ""  # (the model judges its rest itself: a notice withdrawn meanwhile starts one)
        return f"gpud said it was not preemptible then: {shield.text(n.issued)}"

    def notice_wrong(self, a: Acked, n: NoticeM, msg: p.Preempt) -> str:
        """What is wrong with notice ``n`` to ``a`` ("" if nothing): the rules of taking back."""
        allocs = self.world.allocs
        recovery = a.on_preempt
        if n.whole and recovery == p.Recovery.SHRINK:  # (a drain of its minimum): it ends
            recovery = p.Recovery.TERMINATE
        if msg.recovery != recovery:
            return f"recovery {msg.recovery}, but its on_preempt is {a.on_preempt}"
        if msg.grace_s != round(self.grace_us / 1e6, 3):
            return f"grace {msg.grace_s} s, configured {self.config.preemption_grace_s} s"
        if not n.gpus and a.gpus or not set(n.gpus) <= set(a.gpus) or n.whole != (n.gpus == a.gpus):
            return f"GPUs {n.gpus} (whole={n.whole}) of an allocation of {a.gpus}"
        if not n.whole and not set(n.gpus) <= set(a.extras):
            return f"a partial notice takes only GPUs above the elastic minimum (extras {a.extras})"
        if n.reason == p.PreemptReason.DRAIN:
            if n.by != "drain" or not set(n.gpus) & (allocs.draining | allocs.drain_now):
                return f"drain notice by {n.by!r} for GPUs {n.gpus}, draining {sorted(allocs.draining)}"
            return ""
        if not self.config.preemption:
            return "preemption is off: only a drain takes allocations back"
        if a.priority >= 100:
            return "production (100) is never preempted by a waiting request, only a drain tells it to leave"
        if a.protected:
            return "a protected allocation is never preempted by a waiting request"
        if self.now < a.rested_until:
            return f"a notice of it was withdrawn; it rests until {a.rested_until} (preemption_cooldown)"
        waiter = allocs.waiter_of(n.by)
        if waiter is None:
            return f"by {n.by!r}, which does not wait"
        priority, tenant = waiter
        match n.reason:
            case p.PreemptReason.PRIORITY:
                if not n.whole or a.on_preempt == p.Recovery.SHRINK:
                    return "a priority preemption takes the whole allocation, never a shrink one"
                if a.priority >= priority:
                    return f"its priority {a.priority} is not below the waiter's {priority}"
                if a.priority > 0 and self.now - a.created < self.min_runtime_us:
                    return f"it ran less than preemption_min_runtime ({self.min_runtime_us} us) and is not spot"
            case p.PreemptReason.ELASTIC:
                if n.whole or n.gpus != a.extras or a.priority > priority:
                    return f"an elastic notice takes the extras {a.extras} for a waiter of priority >= {a.priority}"
            case p.PreemptReason.QUOTA_RECLAIM:
                if not n.whole or a.on_preempt == p.Recovery.SHRINK:
                    return "a quota reclaim takes the whole allocation, never a shrink one"
                lent = self.config.tenants.get(a.tenant or "")
                used = sum(len(x.gpus) * x.share for x in allocs.acked.values() if x.tenant == a.tenant)
                if lent is None or tenant is None or tenant == a.tenant or used <= round(lent.gpus * UNIT):
                    return f"tenant {a.tenant} (using {used / UNIT}) borrows nothing the waiter's tenant {tenant} needs"
        return ""

    def react(self, c: Client, a: Acked, n: NoticeM) -> None:
        """What the holder does about a notice: yield at once or after a while (a slow one often
        after the grace), free instead, crash, or nothing (a stubborn one or an abandoner)."""
        r, g = self.rng, max(2, self.grace_us)
        if c.kind in ("stubborn", "abandoner"):
            self.stats["notices left to run out"] += 1
            return
        if c.kind == "crashy" and r.random() < 0.4:
            action, delay = "crash", r.randrange(0, g)
        elif c.kind == "slow":
            action, delay = "yield", r.randrange(g // 2, 2 * g)
        else:
            action = r.choices(["yield", "free", "never"], [7, 2, 1])[0]
            delay = 0 if r.random() < 0.3 else r.randrange(0, g // 2)
        self.later(self.now + delay, "react", c.cid, c.gen, a.task_id, n.issued, action)

    def later_react(self, cid: int, gen: int, task: str, issued: int, action: str) -> None:
        c = self.client(cid, gen)
        if c is None:
            return
        a = self.world.allocs.acked.get(task)
        if a is None or a.notice is None or a.notice.issued != issued:  # withdrawn or carried out meanwhile
            if action == "yield" and self.rng.random() < 0.3:
                self.yield_(c, task)  # a late YIELD: refused
            return
        if action == "yield":
            self.yield_(c, task)
        elif action == "free":
            self.world.allocs.free(c, task)
        elif action == "crash":
            self.world.conns.lose_connection(c, "crashed on its PREEMPT", crashed=True)
            self.after_event()
            if self.rng.random() < 0.5:
                self.later(self.now + self.rng.randrange(MS, 20 * MS), "reconnect", c.cid)
                self.world.owners.respawn(c)

    def later_again(self, cid: int, gen: int, task: str) -> None:
        """A runner whose allocation was taken back asks for its task again (checkpoint: it resumes)."""
        c = self.client(cid, gen)
        allocs = self.world.allocs
        if c is not None and task not in allocs.acked and task not in allocs.suspended:
            again = self.again_terms.pop(task, None)
            if again is not None:
                allocs.allocate(c, msgspec.structs.replace(again, id=c.rid()))

    def later_free(self, cid: int, gen: int, task: str) -> None:
        c = self.client(cid, gen)
        if c is not None and task in self.world.allocs.suspended:
            self.world.allocs.free(c, task)

    def yield_(self, c: Client, task: str) -> None:
        allocs = self.world.allocs
        a = allocs.acked.get(task)
        expected: p.ErrorCode | None = None
        if a is None:
            expected = p.ErrorCode.UNKNOWN_TASK
        elif not c.admin and a.uid != c.uid:
            tenant = self.config.tenants.get(a.tenant or "")
            if tenant is None or (c.uid not in tenant.uids and c.gid not in tenant.gids):
                expected = p.ErrorCode.PERMISSION_DENIED
        if expected is None and (a is None or a.notice is None):
            expected = p.ErrorCode.INVALID
        if expected is None:
            self.yields_now.add(task)
        cp, waiters = self.daemon.allocations.ledger.checkpoint(), dict(self.daemon.allocations.waiters)
        injected = self.world.restarts.injected
        pend = self.send(c, p.Yield(id=c.rid(), task_id=task), "YIELD", expected=expected, injected=injected)
        self.finish(c, pend)
        if pend.info.get("store_failed"):
            allocs.check_rolled_back(cp, waiters, f"YIELD {task}")
        self.after_event()

    def answer_yield(self, c: Client, pend: Pending, msg: Any) -> None:
        expected = pend.info["expected"]
        if isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED:
            self.expect(
                self.world.restarts.injected > pend.info["injected"],
                c,
                pend,
                msg,
                "store_failed without a failed write",
            )
            pend.info["store_failed"] = True
            a = self.world.allocs.acked.get(pend.msg.task_id)
            if a is not None and a.notice is not None:  # the runner tries again
                self.later(self.now + MS, "react", c.cid, c.gen, a.task_id, a.notice.issued, "yield")
            return
        if isinstance(msg, p.Error):
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'OK'}")
            self.stats[f"yields refused ({msg.code})"] += 1
            return
        self.expect(isinstance(msg, p.Ok) and expected is None, c, pend, msg, f"expected {expected}")
        self.stats["yields"] += 1

    def on_withdrawn(self, c: Client, msg: p.PreemptWithdrawn) -> None:
        a = self.held_by(c, msg.task_id, msg)
        if a.notice is None:
            self.fail(f"client {c.cid} got {short(msg)}, but no notice of {a.task_id} runs")
        self.withdrawals_now.append((a, a.notice))
        self.withdrawn(a, a.notice)

    def withdrawn(self, a: Acked, n: NoticeM) -> None:
        a.notice = None
        a.withdrawn += 1
        self.world.restarts.unstored_notices[a.task_id] = n
        why = "drain off" if n.reason == p.PreemptReason.DRAIN else "waiter gone or served"
        self.stats[f"notices withdrawn ({why})"] += 1
        if n.reason != p.PreemptReason.DRAIN:
            a.rested_until = self.now + self.cooldown_us

    def withdrawal_wrong(self, n: NoticeM, waits: set[str]) -> str:
        """Why notice ``n`` may not have been withdrawn now ("" if it may): its GPU is no longer
        drained, or the request it was for gave up."""
        if n.reason == p.PreemptReason.DRAIN:
            draining = self.world.allocs.draining
            return "" if any(g not in draining for g in n.gpus) else f"its GPUs {n.gpus} are still drained"
        return f"{n.by!r} still waits" if n.by in waits else ""

    def on_alloc_revoked(self, c: Client, msg: p.AllocRevoked) -> None:
        a = self.held_by(c, msg.task_id, msg)
        n = a.notice
        if a.task_id in self.world.allocs.suspended or n is None or not n.whole:
            self.fail(f"client {c.cid} got {short(msg)}, but no notice to give {a.task_id} back whole runs")
        suspend = self.taken_back_how(a, n)
        want = (n.reason, not suspend, p.AllocState.SUSPENDED if suspend else p.AllocState.RUNNING)
        if (msg.reason, msg.gone, msg.state) != want:
            self.fail(f"client {c.cid} got {short(msg)}, expected reason/gone/state {want}")
        self.taken_back(a, n, suspend)
        if suspend and self.rng.random() < 0.25:  # the runner gives up on it
            self.later(self.now + self.rng.randrange(0, 20 * MS), "free", c.cid, c.gen, a.task_id)
        elif not suspend and self.rng.random() < 0.4:  # a runner starts its task again (a checkpoint resumes)
            self.again_terms[a.task_id] = a.again(0, wait_ms=self.rng.choice([50, 200, 1000]))
            self.later(self.now + self.rng.randrange(0, 20 * MS), "again", c.cid, c.gen, a.task_id)

    def taken_back_how(self, a: Acked, n: NoticeM) -> bool:
        """A notice carried out now: it must have been yielded (or freed) or its grace be over.
        Whether the allocation is suspended (yielded with on_preempt suspend) rather than gone."""
        yielded = a.task_id in self.yields_now
        if not yielded and self.now < n.deadline:
            self.fail(f"{a.task_id} taken back {n.deadline - self.now} us before its grace ended, and it did not yield")
        return n.whole and yielded and a.on_preempt == p.Recovery.SUSPEND

    def taken_back(self, a: Acked, n: NoticeM, suspend: bool) -> None:
        allocs = self.world.allocs
        self.stats[f"preemptions carried out ({'yielded' if a.task_id in self.yields_now else 'grace over'})"] += 1
        o = a.owner
        if n.whole and not suspend and o.termed == n.issued and o.killed is None and o.alive():
            self.known_bug(
                "no SIGKILL at the grace's end",
                f"{a.task_id} was taken back; its owner {o.proc} got SIGTERM for it and no SIGKILL at its end",
            )
        a.notice = None
        if not n.whole:
            a.gpus, a.changed = tuple(g for g in a.gpus if g not in n.gpus), self.now
            return
        del allocs.acked[a.task_id]
        if suspend:
            a.preemptions, a.resume = a.preemptions + 1, True
            allocs.suspended[a.task_id] = a
            self.stats["allocations suspended"] += 1
        else:
            self.remember(a)
            self.retire(a)

    def on_alloc_changed(self, c: Client, msg: p.AllocChanged) -> None:
        al = msg.allocation
        a = self.held_by(c, al.task_id, msg)
        suspended = self.world.allocs.suspended
        gpus = tuple(al.gpus)
        why = ""
        if al.state != p.AllocState.RUNNING or (round(al.share * UNIT), al.tenant, al.priority) != (
            a.share,
            a.tenant,
            a.priority,
        ):
            why = "it runs, with its share, tenant and priority"
        elif msg.change == "shrunk":
            n = a.notice
            if a.task_id in suspended or n is None or n.whole:
                why = "no partial notice runs"
            else:
                self.taken_back_how(a, n)
                if gpus != tuple(g for g in a.gpus if g not in n.gpus):
                    why = f"shrunk from {a.gpus} by {n.gpus}"
                else:
                    self.taken_back(a, n, False)
                    self.stats["elastic allocations shrunk"] += 1
        elif msg.change == "grown":
            why = "suspended" if a.task_id in suspended else self.growth_wrong(a, gpus)
            if not why:
                a.gpus, a.changed = gpus, self.now
                self.stats["elastic allocations grown"] += 1
        elif msg.change == "resumed":
            if a.task_id not in suspended or gpus != a.gpus:
                why = f"resumed on its own GPUs {a.gpus}, and only a suspended allocation"
            else:
                self.resumed(a, tuple(al.cpus))
        if why:
            self.fail(f"client {c.cid} got {short(msg)} for {a.task_id} (gpus {a.gpus}): {why}")

    def growth_wrong(self, a: Acked, gpus: tuple[int, ...], *, pushed: bool = True) -> str:
        allocs = self.world.allocs
        if a.notice is not None:
            return "an allocation under a notice does not grow"
        if not a.gpus_max or gpus[: len(a.gpus)] != a.gpus or not len(a.gpus) < len(gpus) <= a.gpus_max:
            return f"not a growth of {a.gpus} within {a.gpus_min}..{a.gpus_max}"
        if set(gpus[len(a.gpus) :]) & (allocs.draining - allocs.undrain_now):
            return f"grew onto a draining GPU ({sorted(allocs.draining)})"
        if self.now < a.changed + round(self.config.elastic_cooldown_s * 1e6):
            return f"grew {self.now - a.changed} us after its last change, within elastic_cooldown"
        if pushed:  # judged when the event is over: a waiter served in the same tick may be answered after it
            self.world.deferred.append(lambda: self.judge_growth(a, gpus))
        else:
            self.judge_growth(a, gpus)
        return ""

    def judge_growth(self, a: Acked, gpus: tuple[int, ...]) -> None:
        if any(prio >= a.priority for prio in self.world.allocs.model_waiters()):
            self.fail(f"{a.task_id} grew to {gpus} while a request of its priority {a.priority} or higher waits")

    def resumed(self, a: Acked, cpus: tuple[int, ...]) -> None:
        allocs = self.world.allocs
        del allocs.suspended[a.task_id]
        a.cpus, a.changed = cpus, self.now
        allocs.acked[a.task_id] = a
        self.stats["suspended allocations resumed"] += 1

    def remember(self, a: Acked) -> None:
        """Taken back whole (or freed under a whole notice): the task's next allocation hears of it."""
        self.world.allocs.history[a.task_id] = (
            a.preemptions + 1,
            a.on_preempt in (p.Recovery.CHECKPOINT, p.Recovery.SUSPEND) or a.resume,
        )

    def retire(self, a: Acked) -> None:
        """An allocation ends: its notices count in the thrash figures."""
        if a.told:
            bound = (self.now - self.started) // max(1, self.cooldown_us) + 2
            self.victims.append((a.told, a.withdrawn, max(1, self.now - a.created), bound))

    # --- steps ----------------------------------------------------------------------------------------

    def do_contend(self) -> None:
        """A request that may take something back: whole GPUs or a fraction at a high priority (or a
        tenant's own quota) with a wait, or spot work that fills the node and is taken back first."""
        c = self.pick(self.connected())
        if c is None:
            return
        r = self.rng
        tenant = r.choice([None, None, "team", "team", "lab"])
        if tenant == "team" and not c.admin and c.uid != USERS[0]:
            tenant = "lab"  # team is USERS[0]'s (it may borrow lab's idle quota; lab then takes it back)
        gpus = r.choice({None: [1.0, 1.0, 0.5], "team": [1.0, 0.5], "lab": [0.5, 0.25]}[tenant])
        elastic = tenant is None and gpus == 1.0 and len(self.gpus) > 1 and r.random() < 0.5
        spot = r.random() < 0.35
        msg = p.Allocate(
            id=c.rid(),
            task_id=r.choice([f"c{c.cid}-t{k}" for k in range(3, 6)]),
            gpus=gpus,
            cpus=r.choice([0, 0, 1]),
            tenant=tenant,
            priority=0 if spot else r.choice([self.ceiling(c), self.ceiling(c), 10, 60, 100]),
            wait_ms=0 if spot else r.choice([30, 200, 1000]),
            on_preempt=r.choice(
                [*p.Recovery, p.Recovery.SHRINK] if elastic else [x for x in p.Recovery if x != "shrink"]
            ),
            gpus_max=r.randint(2, len(self.gpus)) if elastic else None,
        )
        if r.random() < 0.6:  # its own process, or a child: the owner a notice nobody listens for signals
            owner = c.pid if r.random() < 0.6 or c.proc is None else self.world.owners.draw_owner(c)[0]
            msg = msgspec.structs.replace(msg, owner_pid=owner, notify=r.random() < 0.3)
        self.world.allocs.allocate(c, msg)

    def do_yield(self) -> None:
        """A YIELD out of turn: mostly refused (nothing asked it to leave, not its own, unknown)."""
        c = self.pick(self.connected())
        if c is not None:
            self.yield_(c, self.rng.choice([*sorted(self.world.allocs.acked)[:4], "never-allocated"]))

    # --- what nobody was told -----------------------------------------------------------------------

    def check(self) -> None:
        """What nobody was told, carried out on the model and judged (``reconcile``), before
        ``Allocations.check`` compares the ledger with the model."""
        self.reconcile()

    def reconcile(self) -> None:
        """What changed in the daemon that no client was told because no connection holds the
        allocation now (or the wait was nobody's): carried out on the model, each as the rules allow
        it. A holder's own pushes were applied as they came."""
        d, allocs, restarts = self.daemon, self.world.allocs, self.world.restarts
        led = d.allocations.ledger
        live = {a.task_id: a for a in led.allocations()}
        susp = {a.task_id for a in led.suspended()}
        waits = {r.task_id for r in led.waiting()} | susp
        for a, n in self.withdrawals_now:
            why = self.withdrawal_wrong(n, waits)
            if why:
                self.fail(f"the notice of {a.task_id} ({n}) was withdrawn, but {why}")
        if (
            self.world.owners.reaps_now
        ):  # the reaper's: what is gone whose owner exited (a notice it had counts as done)
            for t, a in [*allocs.acked.items(), *allocs.suspended.items()]:
                if t not in live and t not in susp and a.owner.reapable():
                    self.reaped(a, led.history_of(t), waits)
        for t, a in list(allocs.acked.items()):
            n, la = a.notice, live.get(t)
            ln = led.notice_of(t) if la is not None else None
            if n is not None and not n.same(ln):
                self.notice_ended(a, n, la, t in susp, waits)
                if ln is not None and t in allocs.acked:  # and another given in the same tick (nobody holds it)
                    self.noticed_unheld(a, la, ln)
            elif n is None and ln is not None:
                self.noticed_unheld(a, la, ln)
            elif n is not None and self.now >= n.deadline:
                late = self.now - n.deadline
                booting = self.world.booting
                if not (booting or (restarts.retrying() and late <= MAX_LATE_US)):
                    self.fail(f"the preemption of {t} still runs {late} us after its grace ended ({n})")
                self.stats["events with a preemption late (a store write failed, tried again)"] += not booting
            if t in allocs.acked and la is not None and la.gpus != a.gpus:
                if a.holder is not None:
                    self.fail(f"{t} is on GPUs {la.gpus} in the daemon, {a.gpus} for its holder, who was not told")
                why = self.growth_wrong(a, la.gpus, pushed=False)
                if why:
                    self.fail(f"{t} grew from {a.gpus} to {la.gpus} while nobody held it: {why}")
                a.gpus, a.changed = la.gpus, self.now
                self.stats["elastic allocations grown (nobody told)"] += 1
        for t, a in list(allocs.suspended.items()):
            if t in live:
                if a.holder is not None or live[t].gpus != a.gpus:
                    self.fail(f"suspended {t} resumed on {live[t].gpus} (its GPUs {a.gpus}) and its holder not told")
                self.resumed(a, live[t].cpus)
        for t, g in list(allocs.ghosts.items()):
            if t in live and t not in allocs.acked:
                msg = d.allocations.answers.answer(0, live[t], 0.0)
                _, why = allocs.made(g.uid, msg, g, g.owner)
                if why:
                    self.fail(f"the wait of {t} restored after a restart was served {short(msg)}: {why}")
                del allocs.ghosts[t]
                self.stats["restored waits served"] += 1
            elif t not in waits and self.world.owners.reaps_now and g.owner.reapable():
                del allocs.ghosts[t]  # withdrawn by the reaper (or served in this tick, then reaped)
                allocs.waits_ended_now.add(t)
                self.stats["restored waits ended by the reaper (owner exited)"] += 1
            elif t not in waits:
                if self.now < g.earliest:
                    self.fail(f"the wait of {t} restored after a restart ended {g.earliest - self.now} us early")
                del allocs.ghosts[t]
                allocs.waits_ended_now.add(t)
                self.stats["restored waits expired"] += 1
            elif self.now > g.answer_by and not (self.world.booting or restarts.retrying()):
                self.fail(f"the wait of {t} restored after a restart still waits {self.now - g.answer_by} us late")

    def reaped(self, a: Acked, history: tuple[int, bool], waits: set[str]) -> None:
        """The reaper released ``a``, whose owner exited: as a FREE would (nobody is told), and under a
        notice to leave whole it counts as that preemption done (``history``: the ledger's for the task
        now). In the same tick the notice it had may have been withdrawn first, or one given (nobody
        holds it: it counted as reachable through its owner, dead since)."""
        allocs = self.world.allocs
        (allocs.acked if a.task_id in allocs.acked else allocs.suspended).pop(a.task_id)
        n, done = a.notice, history[0] > a.preemptions
        if done and (n is None or not n.whole):
            if n is not None or a.holder is not None or not a.owner.reach:
                self.fail(f"{a.task_id} was reaped as told to leave whole, but its notice is {n}")
            self.stats["allocations told to leave and reaped in one tick (owner exited)"] += 1
        elif n is not None and n.whole and not done:
            why = self.withdrawal_wrong(n, waits)
            if why:
                self.fail(f"the notice of {a.task_id} ({n}) was withdrawn before it was reaped, but {why}")
            self.stats["notices withdrawn, then reaped in one tick (owner exited)"] += 1
        if done:
            self.remember(a)
        self.retire(a)
        self.stats["allocations reaped (owner exited)"] += 1
        self.stats["allocations reaped with a connection holding them (not told)"] += a.holder is not None

    def notice_ended(self, a: Acked, n: NoticeM, la: Any, suspended: bool, waits: set[str]) -> None:
        """The daemon's notice for ``a`` ended and its holder (there is none) was not told:
        withdrawn, or carried out when yielded or at the grace's end."""
        t = a.task_id
        if a.holder is not None:
            now = "gone" if la is None else f"on GPUs {la.gpus}" + (" (suspended)" if suspended else "")
            self.fail(f"the notice of {t} ({n}) ended in the daemon (now {now}) but its holder was not told")
        if la is not None and la.gpus == a.gpus:
            why = self.withdrawal_wrong(n, waits)
            if why:
                self.fail(f"the notice of {t} ({n}) was withdrawn, but {why}")
            self.withdrawn(a, n)
            return
        suspend = self.taken_back_how(a, n)
        if n.whole and (la is not None or suspended != suspend):
            self.fail(f"{t} taken back whole: expected {'suspended' if suspend else 'gone'}, the daemon has it {la}")
        kept = tuple(g for g in a.gpus if g not in n.gpus)  # (it may have grown again since: judged next)
        if not n.whole and (la is None or la.gpus[: len(kept)] != kept):
            self.fail(f"{t} shrunk by {n.gpus} from {a.gpus}: the daemon has it {la}")
        self.taken_back(a, n, suspend)
        self.stats["preemptions carried out (nobody told)"] += 1

    # --- the admins' requests -------------------------------------------------------------------------

    def answer_drain(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Drain = pend.msg
        draining = self.world.allocs.draining
        if not c.admin:
            self.expect(
                isinstance(msg, p.Error) and msg.code == p.ErrorCode.PERMISSION_DENIED, c, pend, msg, "admins only"
            )
        elif isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED:
            injected = self.world.restarts.injected > pend.info["injected"]
            self.expect(injected, c, pend, msg, "store_failed without a failed write")
            pend.info["store_failed"] = True
        else:
            was = pend.info["gpu"] in draining
            self.expect(
                isinstance(msg, p.Drained) and (msg.draining, msg.was_draining) == (m.on, was),
                c,
                pend,
                msg,
                f"an admin drains (or puts back) GPU {pend.info['gpu']}, which {'drained' if was else 'did not'} before",
            )
            (draining.add if m.on else draining.discard)(pend.info["gpu"])
            self.stats["GPUs drained" if m.on else "GPUs put back"] += 1

    def answer_protect(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Protect = pend.msg
        a = self.world.allocs.acked.get(m.task_id)
        expected = p.ErrorCode.PERMISSION_DENIED if not c.admin else p.ErrorCode.UNKNOWN_TASK if a is None else None
        if isinstance(msg, p.Error) and msg.code == p.ErrorCode.STORE_FAILED and expected is None:
            injected = self.world.restarts.injected > pend.info["injected"]
            self.expect(injected, c, pend, msg, "store_failed without a failed write")
            pend.info["store_failed"] = True
        elif isinstance(msg, p.Error):
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'OK'}")
        else:
            self.expect(isinstance(msg, p.Ok) and expected is None, c, pend, msg, f"expected {expected}")
            assert a is not None
            a.protected = m.protected
            self.stats["allocations protected" if m.protected else "allocations unprotected"] += 1
