"""Sessions and the GPU lock in the simulated world: attach, request, release, detach, memory
reports, limits, the admins' mode, TQ and scheduler switch; the per-GPU schedulers' rules.

Clients are models of what a process believes: its sessions (idle, waiting, holding which grant,
dropped when). Their behaviours: ``good`` (releases soon after DROP_LOCK, keeps the lock between
slices otherwise), ``slow`` (releases late after DROP_LOCK, often after drop_timeout: revoked),
``stubborn`` (ignores DROP_LOCK, holds long, sends stale LOCK_RELEASED).

The invariants (``check``, one method per rule, on each GPU; parking's are ``Parking``'s):
- the daemon's holders and queue are exactly what connected clients believe (so nothing is
  granted to, or kept for, a disconnected client), and the mode, scheduler switch and TQ are what
  the admin was told;
- serial mode: never two holders, unless they were admitted before the GPU became serial or while
  the scheduler was off;
- concurrent and auto: a grant leaves the holders' memory (max of estimate and reported use,
  unknown = the whole GPU) within capacity unless alone; auto drops sessions while reported
  memory overflows;
- billing: in every finished window and in the current one, no session was billed more than the
  time it held the GPU in that window, and all together no more than the window's wall time; a
  limited holder over its budget has its DROP_LOCK;
- a DROP_LOCK not answered within drop_timeout is a REVOKED exactly then; a holder past TQ with a
  runnable waiter has its DROP_LOCK; a GPU with no holder has no runnable waiter unless a PARK is
  out; every deadline that is due has been acted on;
- a session's limits are what its request and a fractional allocation's ceilings make them, and
  only an admin raises another client's; a draining GPU takes no new session but its allocations';
- nothing is granted during the restart grace (the order of grants and the bound on a wait are
  ``LockWaits``'s).

Its clients draw from the seed's generator only where a process decides something (how long to
hold, when to release or ask again); it never keeps a copy of another part's model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpud.core.ledger import UNIT
from gpud_client import protocol as p

from .leases import LeaseM
from .model import GIB, MS, START_US, Answer, Client, GpuModel, Part, Pending, short

if TYPE_CHECKING:
    from gpud.serving.server import Daemon

    from .world import World

# --- the model: a session as its client sees it ---------------------------------------------------


@dataclass(eq=False)
class Sess:
    """A session as its client sees it."""

    sid: int
    gpu: int
    priority: int
    core_limit: int
    mem_estimate: int | None
    mem_limit: int | None
    task_id: str | None
    core_ceiling: int = 100
    mem_ceiling: int | None = None
    mem_used: int | None = None
    state: str = "idle"  # idle | waiting | holding
    grant: int = 0
    seq: int = 0  # arrival order of its current request on the GPU (the daemon's FIFO)
    requested_at: int = 0
    granted_at: int = 0
    drop_at: int | None = None  # DROP_LOCK the daemon still counts for this grant (SCHED_OFF cancels it)
    drop_reason: p.DropReason | None = None
    drop_seen: bool = False  # a DROP_LOCK came for this grant (the client releases at slice end)
    bound: int | None = None  # a waiting request must be granted by then (None: no bound applies)
    counted: set[tuple[int, int]] = field(default_factory=set)  # (sid, seq) of grants the bound allows for
    limits_changed: bool = False  # in this event (it may have been throttled for a moment)
    # Parking (gpuctl run), as the client saw it; all but ``parks`` start afresh at each grant.
    parkable: bool = False
    parked: bool = False  # it answered PARKED ok while not holding: its memory is off the GPU
    park_asked: int | None = None  # when the PARK it has not answered came
    park_refused: bool = False  # it answered PARKED not ok, or left a PARK unanswered for park_timeout
    parks: int = 0  # PARKED ok answers the daemon counts


@dataclass(eq=False)
class GpuNow:
    """One GPU as the checks see it after an event."""

    g: int
    gm: GpuModel
    sched: Any
    view: Any
    sessions: list[tuple[Client, Sess]]
    leases: list[tuple[Client, LeaseM]]
    lease_sids: set[int]
    waiting_leases: list[int]  # sids of leases waiting for this GPU
    runnable: list[Any]  # the queue's waiters that are not throttled


def overlap(intervals: list[list[Any]], lo: int, hi: int, now: int) -> int:
    """Microseconds of [lo, hi) covered by the hold intervals (an open one ends now)."""
    total = 0
    for start, end in intervals:
        a, b = max(start, lo), min(now if end is None else end, hi)
        if b > a:
            total += b - a
    return total


class Locks(Part):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.dt_us = round(self.config.drop_timeout_s * 1e6)
        self.holds: dict[int, list[list[Any]]] = {}  # sid -> hold intervals, for this daemon run

    def answers(self) -> dict[str, Answer]:
        return {
            "ATTACH": self.answer_attach,
            "LOCK_REQUEST": self.answer_lock_request,
            "LOCK_RELEASED": self.answer_lock_released,
            "MEM_UPDATE": self.answer_mem_update,
            "DETACH": self.answer_detach,
            "SET_LIMITS": self.answer_set_limits,
        }

    def steps(self) -> dict[str, Callable[[], None]]:
        return {
            "attach": self.do_attach,
            "lock_request": self.do_lock_request,
            "release": self.do_release,
            "detach": self.do_detach,
            "mem_update": self.do_mem_update,
            "set_limits": self.do_set_limits,
        }

    def laters(self) -> dict[str, Callable[..., None]]:
        return {"release": self.later_release, "request": self.later_request}

    def on_daemon(self, d: Daemon) -> None:
        self.holds = {}

    def sessions_on(self, gpu: int) -> list[Sess]:
        return [s for c in self.clients for s in c.sessions.values() if s.gpu == gpu]

    def begin_hold(self, sid: int) -> None:
        self.holds.setdefault(sid, []).append([self.now, None])

    def end_hold(self, sid: int) -> None:
        intervals = self.holds.get(sid)
        if intervals and intervals[-1][1] is None:
            intervals[-1][1] = self.now

    # --- pushes ---------------------------------------------------------------------------------

    def on_lock_ok(self, c: Client, s: Sess, msg: p.LockOk) -> None:
        gm = self.gpus[s.gpu]
        grace_end = self.world.grace_end
        if s.state != "waiting":
            self.fail(f"client {c.cid}: LOCK_OK for session {s.sid}, which is {s.state}, not waiting")
        if self.now < grace_end:
            self.fail(f"session {s.sid} granted {grace_end - self.now} us before the restart grace ends")
        if s.requested_at < grace_end <= self.now:
            self.stats["lock requests held through a restart grace"] += 1
        self.stats["lock grants"] += 1
        if s.bound is not None:
            self.stats["lock grants within a bound"] += 1
            if s.requested_at < self.now:
                self.stats["lock waits bounded"] += 1
        s.state, s.grant, s.granted_at = "holding", msg.grant, self.now
        s.drop_at = s.drop_reason = None
        s.drop_seen = False
        s.parked, s.park_asked, s.park_refused = False, None, False  # its memory is on the GPU again
        self.begin_hold(s.sid)
        self.world.lock_waits.grants_now.append((s.gpu, s.sid, s.seq, s.priority, msg.grant))
        tq = gm.tq_us
        if c.kind == "stubborn":
            hold = self.rng.randrange(5 * tq, 20 * tq)
        elif self.rng.random() < 0.35:
            hold = None  # keeps the lock between slices until asked (the client library's way)
        else:
            hold = self.rng.randrange(MS, 3 * tq)
        if hold is not None:
            self.later(self.now + hold, "release", c.cid, c.gen, s.sid, msg.grant)

    def on_drop(self, c: Client, s: Sess, msg: p.DropLock) -> None:
        gm = self.gpus[s.gpu]
        if s.state != "holding" or s.grant != msg.grant:
            self.fail(f"client {c.cid}: {short(msg)} but session {s.sid} is {s.state} with grant {s.grant}")
        if s.drop_at is not None:
            self.fail(f"session {s.sid}: a second DROP_LOCK for grant {s.grant} before the first was answered")
        # Judged at the end of the event: an admin's OK (SET_TQ) or a LIMITS_CHANGED push that
        # explains the drop may be read after it (each client reads its own connection).
        self.world.deferred.append(lambda: self.judge_drop(s, msg, gm))
        s.drop_at, s.drop_reason, s.drop_seen = self.now, msg.reason, True
        self.stats[f"drops ({msg.reason})"] += 1
        dt = self.dt_us
        if c.kind == "stubborn":
            return  # ignores it: revoked after drop_timeout
        if c.kind == "slow":
            delay = self.rng.randrange(dt // 2, 2 * dt)
        else:
            delay = self.rng.randrange(0, max(1, min(2 * MS, dt // 2)))
        self.later(self.now + delay, "release", c.cid, c.gen, s.sid, msg.grant)

    def judge_drop(self, s: Sess, msg: p.DropLock, gm: GpuModel) -> None:
        if msg.reason == p.DropReason.TQ and self.now < s.granted_at + gm.tq_us:
            self.fail(f"session {s.sid}: TQ drop after {self.now - s.granted_at} us, TQ is {gm.tq_us} us")
        if msg.reason == p.DropReason.QUOTA and s.core_limit >= 100:
            self.fail(f"session {s.sid}: quota drop of a session with no limit ({s.core_limit} %)")
        if msg.reason == p.DropReason.MEMORY and gm.mode != p.Mode.AUTO:
            self.fail(f"session {s.sid}: memory drop in {gm.mode} mode")

    def on_revoked(self, c: Client, s: Sess, msg: p.Revoked) -> None:
        if s.state != "holding" or s.grant != msg.grant:
            self.fail(f"client {c.cid}: {short(msg)} but session {s.sid} is {s.state} with grant {s.grant}")
        if msg.reason == p.RevokeReason.DROP_TIMEOUT:
            if s.drop_at is None or self.now < s.drop_at + self.dt_us:
                self.fail(
                    f"session {s.sid} revoked (drop_timeout) with DROP_LOCK sent at {s.drop_at}, "
                    f"now {self.now}, drop_timeout {self.dt_us} us"
                )
        else:
            self.fail(f"session {s.sid} revoked for {msg.reason}: only leases are revoked for that")
        s.state, s.drop_at, s.drop_reason = "idle", None, None
        self.stats["revocations (drop_timeout)"] += 1
        self.end_hold(s.sid)
        if self.rng.random() < 0.6:
            self.later(self.now + self.rng.randrange(0, 30 * MS), "request", c.cid, c.gen, s.sid)

    def on_limits_changed(self, s: Sess, msg: p.LimitsChanged) -> None:
        s.core_limit, s.mem_limit, s.limits_changed = msg.core_limit, msg.mem_limit, True
        if s.core_limit < 100:
            s.bound = None  # a limited session waits for its budget too: no bound

    def on_mem_limit_exceeded(self, c: Client, s: Sess, msg: p.MemLimitExceeded) -> None:
        if not (s.mem_used is not None and msg.used_bytes == s.mem_used > msg.limit_bytes):
            self.fail(f"client {c.cid}: {short(msg)} but it reported {s.mem_used} (limit {s.mem_limit})")

    # --- answers --------------------------------------------------------------------------------

    def apply_admin(self, msg: Any) -> None:
        """An admin's OK for a mode, TQ or scheduler switch: what the GPUs are now."""
        gpus = self.gpus if getattr(msg, "gpu", None) is None else [self.gpus[msg.gpu]]
        match msg:
            case p.SetMode():
                for gm in gpus:
                    gm.mode = p.Mode(msg.mode)
            case p.SetTq():
                for gm in gpus:
                    gm.tq_us = max(1, round(msg.seconds * 1e6))
            case p.SchedOn() | p.SchedOff():
                on = isinstance(msg, p.SchedOn)
                for gm in gpus:
                    gm.enabled = on
                    if not on:  # the daemon cancels pending drops while off
                        for s in self.sessions_on(gm.index):
                            s.drop_at = s.drop_reason = None
            case _:
                return
        for gm in gpus:  # the rules the bounds were derived under changed: no bound for those waiting now
            for s in self.sessions_on(gm.index):
                s.bound = None

    def answer_attach(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Attach = pend.msg
        allocs = self.world.allocs
        cap = self.config.max_sessions_per_connection
        owner = allocs.acked.get(m.task_id) if m.task_id else None
        expected = None
        if len(c.sessions) + len(c.leases) + len(c.waiting_leases()) >= cap:
            expected = p.ErrorCode.LIMIT_REACHED
        elif m.priority > self.ceiling(c):
            expected = p.ErrorCode.PERMISSION_DENIED
        elif owner is not None and owner.uid != c.uid and not c.admin:
            expected = p.ErrorCode.PERMISSION_DENIED
        elif pend.info.get("gpu") in allocs.draining and allocs.allocation_for(c, pend.info["gpu"], m.task_id) is None:
            expected = p.ErrorCode.INSUFFICIENT  # a draining GPU takes no new session but its allocations'
        early, c.early_parks = c.early_parks, {}
        if set(early) - {getattr(msg, "session", None)}:
            self.fail(f"client {c.cid} got a PARK for sessions {sorted(early)}, which {short(msg)} did not attach")
        if isinstance(msg, p.Error):
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'ATTACHED'}")
            return
        self.expect(isinstance(msg, p.Attached) and expected is None, c, pend, msg, f"expected {expected}")
        gpu = m.gpu if isinstance(m.gpu, int) else pend.info["gpu"]
        self.expect(
            msg.gpu == gpu and all(msg.session not in x.sessions for x in self.clients),
            c,
            pend,
            msg,
            "a new session on the GPU asked for",
        )
        core_ceiling, mem_ceiling = allocs.fraction_ceilings(c, gpu, m.task_id)
        core = min(m.core_limit, core_ceiling)
        mem = (
            m.mem_limit
            if mem_ceiling is None
            else (mem_ceiling if m.mem_limit is None else min(m.mem_limit, mem_ceiling))
        )
        self.expect(
            msg.core_limit == core and msg.mem_limit == mem,
            c,
            pend,
            msg,
            f"limits: expected core {core} mem {mem} (the allocation's ceilings {core_ceiling}/{mem_ceiling})",
        )
        c.sessions[msg.session] = Sess(
            msg.session,
            gpu,
            m.priority,
            msg.core_limit,
            m.mem_estimate,
            msg.mem_limit,
            m.task_id,
            core_ceiling,
            mem_ceiling,
            parkable=m.parkable,
        )
        if early:  # asked before it was ATTACHED: the client never saw it, park_timeout ends it
            self.world.parking.on_park(c, c.sessions[msg.session], answer=False)

    def answer_lock_request(self, c: Client, pend: Pending, msg: Any) -> None:
        s = c.sessions.get(pend.info["sid"])
        self.expect(
            isinstance(msg, p.Error) and s is not None, c, pend, msg, "LOCK_REQUEST is answered only by an error"
        )
        assert s is not None
        queued = len(self.daemon.slots[s.gpu].scheduler.queue())
        self.expect(
            msg.code == p.ErrorCode.LIMIT_REACHED and queued >= self.config.max_lock_queue,
            c,
            pend,
            msg,
            f"{queued} queued, max_lock_queue {self.config.max_lock_queue}",
        )
        s.state = "idle"  # refused: nothing changed

    def answer_lock_released(self, c: Client, pend: Pending, msg: Any) -> None:
        ok = (
            isinstance(msg, p.Error)
            and pend.info["stale"]
            and msg.code in (p.ErrorCode.NOT_HOLDER, p.ErrorCode.STALE_GRANT)
        )
        self.expect(ok, c, pend, msg, "only a stale LOCK_RELEASED is refused (not_holder / stale_grant)")

    def answer_mem_update(self, c: Client, pend: Pending, msg: Any) -> None:
        self.expect(False, c, pend, msg, "a MEM_UPDATE for the client's own session is not refused")

    def answer_detach(self, c: Client, pend: Pending, msg: Any) -> None:
        self.expect(isinstance(msg, p.Ok), c, pend, msg, "detaching one's own session")

    def answer_set_limits(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.SetLimits = pend.msg
        target: Client = pend.info["target"]
        chosen = pend.info["chosen"]
        expected = None
        # Authority over ceilings is an admin's acting on another client; its own sessions obey them.
        authority = c.admin and target is not c
        if target is not c and not c.admin:
            expected = p.ErrorCode.PERMISSION_DENIED
        elif not chosen:
            expected = p.ErrorCode.UNKNOWN_SESSION
        elif not authority:
            for s in chosen:
                if m.core_limit is not None and m.core_limit > s.core_ceiling:
                    expected = p.ErrorCode.PERMISSION_DENIED
                if (
                    m.mem_limit is not None
                    and s.mem_ceiling is not None
                    and (m.mem_limit == 0 or m.mem_limit > s.mem_ceiling)
                ):
                    expected = p.ErrorCode.PERMISSION_DENIED
        if isinstance(msg, p.Error):
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'LIMITS_SET'}")
            return
        self.expect(isinstance(msg, p.LimitsSet) and expected is None, c, pend, msg, f"expected {expected}")
        self.expect(sorted(msg.sessions) == sorted(s.sid for s in chosen), c, pend, msg, "the sessions chosen")
        for s in chosen:
            if authority:  # an admin's limits for another client are the new ceilings
                if m.core_limit is not None:
                    s.core_ceiling = m.core_limit
                if m.mem_limit is not None:
                    s.mem_ceiling = m.mem_limit or None

    # --- the client's side of each request ---------------------------------------------------------

    def attach(
        self,
        c: Client,
        *,
        gpu: int | None = None,
        priority: int | None = None,
        core_limit: int | None = None,
        mem_estimate: Any = "draw",
        task_id: Any = "draw",
        parkable: bool | None = None,
    ) -> Sess | None:
        r = self.rng
        gpu = r.randrange(len(self.gpus)) if gpu is None else gpu
        if priority is None:
            priority = r.choice([0, 0, 0, 0, 10, 10, 50, 60])
        if core_limit is None:
            core_limit = r.choice([100, 100, 100, 50, 20])
        if mem_estimate == "draw":
            mem_estimate = r.choice([None, GIB, 4 * GIB, 8 * GIB])
        if task_id == "draw":
            tasks = sorted(t for t, a in self.world.allocs.acked.items() if 0 < a.share < UNIT)
            task_id = r.choice(tasks) if tasks and r.random() < 0.3 else None
        mem_limit = r.choice([None, None, 2 * GIB, 12 * GIB])
        if parkable is None:
            parkable = r.random() < 0.3
        ref: int | str = gpu if r.random() < 0.8 else r.choice([f"gpu:{gpu}", self.daemon.slots[gpu].gpu.uuid])
        msg = p.Attach(
            id=c.rid(),
            gpu=ref,
            priority=priority,
            core_limit=core_limit,
            mem_limit=mem_limit,
            mem_estimate=mem_estimate,
            task_id=task_id,
            parkable=parkable,
        )
        before = set(c.sessions)
        pend = self.send(c, msg, "ATTACH", gpu=gpu)
        self.finish(c, pend)
        self.after_event()
        new = set(c.sessions) - before
        return c.sessions[new.pop()] if new else None

    def lock_request(self, c: Client, s: Sess) -> None:
        s.state, s.seq, s.requested_at, s.bound = "waiting", self.world.lock_waits.arrival(), self.now, None
        s.counted = set()
        pend = self.send(c, p.LockRequest(id=c.rid(), session=s.sid), "LOCK_REQUEST", sid=s.sid)
        self.finish(c, pend, answered_now=False)
        if c.conn is not None and s.state == "waiting":
            s.bound = self.world.lock_waits.lock_bound(s)
        self.after_event()

    def release(self, c: Client, s: Sess, *, grant: int | None, stale: bool = False) -> None:
        if not stale:
            s.state, s.drop_at, s.drop_reason = "idle", None, None
            self.end_hold(s.sid)
        msg = p.LockReleased(id=c.rid(), session=s.sid, grant=grant)
        pend = self.send(c, msg, "LOCK_RELEASED", sid=s.sid, stale=stale)
        self.finish(c, pend, answered_now=stale)
        self.after_event()
        if not stale and c.conn is not None and self.rng.random() < 0.5:
            self.later(self.now + self.rng.randrange(0, 20 * MS), "request", c.cid, c.gen, s.sid)

    def later_release(self, cid: int, gen: int, sid: int, grant: int) -> None:
        c = self.client(cid, gen)
        s = c.sessions.get(sid) if c else None
        if c is None or s is None:
            return
        if s.state == "holding" and s.grant == grant:
            self.release(c, s, grant=grant if self.rng.random() < 0.8 else None)
        elif c.kind in ("slow", "stubborn"):  # too late: it was revoked meanwhile
            self.release(c, s, grant=grant, stale=True)

    def later_request(self, cid: int, gen: int, sid: int) -> None:
        c = self.client(cid, gen)
        s = c.sessions.get(sid) if c else None
        if c is not None and s is not None and s.state == "idle":
            self.lock_request(c, s)

    # --- steps ----------------------------------------------------------------------------------------

    def do_attach(self) -> None:
        c = self.pick(self.connected())
        if c is not None:
            self.attach(c)

    def do_lock_request(self) -> None:
        idle = [(c, s) for c in self.connected() for s in c.sessions.values() if s.state == "idle"]
        if not idle:
            return self.do_attach()
        self.lock_request(*self.pick(idle))

    def do_release(self) -> None:
        holding = [(c, s) for c in self.connected() for s in c.sessions.values() if s.state == "holding"]
        if holding:
            c, s = self.pick(holding)
            self.release(c, s, grant=s.grant)

    def do_detach(self) -> None:
        some = [(c, s) for c in self.connected() for s in c.sessions.values()]
        if not some:
            return
        c, s = self.pick(some)
        del c.sessions[s.sid]
        self.end_hold(s.sid)
        pend = self.send(c, p.Detach(id=c.rid(), session=s.sid), "DETACH")
        self.finish(c, pend)
        self.after_event()

    def do_mem_update(self) -> None:
        some = [(c, s) for c in self.connected() for s in c.sessions.values()]
        if not some:
            return
        c, s = self.pick(some)
        s.mem_used = self.rng.choice([0, GIB, 6 * GIB, 12 * GIB, 15 * GIB])
        pend = self.send(c, p.MemUpdate(id=c.rid(), session=s.sid, used_bytes=s.mem_used), "MEM_UPDATE")
        self.finish(c, pend, answered_now=False)
        self.after_event()

    def do_set_limits(self) -> None:
        c = self.pick(self.connected())
        if c is None:
            return
        r = self.rng
        target = c if r.random() < 0.6 else self.pick(self.connected())
        gpu = r.choice([None, None, r.randrange(len(self.gpus))])
        sids = sorted(target.sessions)
        session = r.choice([None, None, *sids[:2]])
        core = r.choice([None, 10, 30, 60, 100])
        mem = r.choice([None, None, 0, 4 * GIB])
        if core is None and mem is None:
            core = 50
        chosen = [
            s
            for s in target.sessions.values()
            if (gpu is None or s.gpu == gpu) and (session is None or s.sid == session)
        ]
        msg = p.SetLimits(
            id=c.rid(),
            client=None if target is c else target.client_id,
            gpu=gpu,
            session=session,
            core_limit=core,
            mem_limit=mem,
        )
        pend = self.send(c, msg, "SET_LIMITS", target=target, chosen=chosen)
        self.finish(c, pend)
        self.after_event()

    # --- the checks ---------------------------------------------------------------------------------

    def check(self) -> None:
        """Every rule about each GPU; ``sessions``, ``leases`` and ``waiting_on`` are the clients'
        on each GPU, in client order."""
        sessions: list[list[tuple[Client, Sess]]] = [[] for _ in self.gpus]
        leases: list[list[tuple[Client, LeaseM]]] = [[] for _ in self.gpus]
        waiting_on: list[list[int]] = [[] for _ in self.gpus]
        for c in self.clients:
            for s in c.sessions.values():
                sessions[s.gpu].append((c, s))
            for lease in c.leases.values():
                leases[lease.gpu].append((c, lease))
        for c in self.clients:
            for q in c.waiting_leases():
                waiting_on[q.info["gpu"]].append(q.info["sid"])
        for slot in self.daemon.slots:
            g = slot.gpu.index
            self.check_gpu(slot, sessions[g], leases[g], waiting_on[g])

    def check_gpu(
        self,
        slot: Any,
        sessions: list[tuple[Client, Sess]],
        leases: list[tuple[Client, LeaseM]],
        waiting_leases: list[int],
    ) -> None:
        """Every rule about one GPU, each its own method (so an experiment can tell them apart)."""
        sched = slot.scheduler
        g = slot.gpu.index
        sched.check()
        view = sched.view(self.now)
        on = GpuNow(
            g,
            self.gpus[g],
            sched,
            view,
            sessions,
            leases,
            {lease.sid for _, lease in leases},
            waiting_leases,
            [w for w in view.queue if not w.throttled],
        )
        for check in (
            self.check_settings,
            self.check_holders_match,
            self.world.parking.check_gpu,
            self.check_queue_match,
            self.check_serial,
            self.check_memory,
            self.check_drops_and_tq,
            self.check_quota,
        ):
            check(on)
        self.check_billing(sched, on.gm, [s.sid for _, s in sessions] + sorted(on.lease_sids) + waiting_leases)

    def check_settings(self, on: GpuNow) -> None:
        """Mode, switch and TQ are what the admins were told; nothing due is left undone."""
        v, gm = on.view, on.gm
        if (v.mode, v.enabled, v.tq_us) != (gm.mode, gm.enabled, gm.tq_us):
            self.fail(
                f"GPU {on.g}: mode/on/TQ {v.mode}/{v.enabled}/{v.tq_us} but admins were told "
                f"{gm.mode}/{gm.enabled}/{gm.tq_us}"
            )
        deadline = on.sched.next_deadline()
        if deadline is not None and deadline <= self.now:
            self.fail(f"GPU {on.g}: a deadline {self.now - deadline} us old is due but was not acted on")

    def check_holders_match(self, on: GpuNow) -> None:
        """The daemon's holders (and their pending drops) are exactly what connected clients
        believe they hold: nothing held for, or granted to, anyone else."""
        model: dict[int, int | str] = {s.sid: s.grant for _, s in on.sessions if s.state == "holding"}
        model.update({sid: "lease" for sid in on.lease_sids})
        daemon = {h.session: "lease" if h.session in on.lease_sids else h.grant for h in on.view.holders}
        if daemon != model:
            self.fail(
                f"GPU {on.g}: the daemon's holders (session: grant) {daemon} are not what clients "
                f"believe they hold {model}"
            )
        mine = {s.sid: s for _, s in on.sessions}
        for h in on.view.holders:
            s = mine.get(h.session)
            if s is not None and (h.drop_pending is None) != (s.drop_at is None):
                self.fail(
                    f"GPU {on.g}: session {h.session} drop pending {h.drop_pending} in the daemon, "
                    f"{s.drop_reason} for its client"
                )

    def check_queue_match(self, on: GpuNow) -> None:
        """The queue is exactly what clients wait for, and an idle GPU has no runnable waiter."""
        waiting = {s.sid for _, s in on.sessions if s.state == "waiting"}
        waiting |= set(on.waiting_leases)
        queue = {w.session for w in on.view.queue}
        if queue != waiting:
            self.fail(f"GPU {on.g}: the daemon's queue {sorted(queue)} is not what clients wait for {sorted(waiting)}")
        if on.gm.enabled and self.now >= self.world.grace_end and not on.view.holders and on.runnable:
            if not any(s.park_asked is not None for _, s in on.sessions):  # else: its grant waits for a PARKED
                self.fail(f"GPU {on.g}: nobody holds it but {on.runnable[0].session} waits, not throttled")

    def check_serial(self, on: GpuNow) -> None:
        """Serial: one holder, unless they were admitted before the GPU became serial or while
        its scheduler was off (then: until it is down to one)."""
        gm, holders = on.gm, on.view.holders
        if gm.mode != p.Mode.SERIAL or not gm.enabled:
            gm.serial_clean = False
        elif len(holders) <= 1:
            gm.serial_clean = True
        elif gm.serial_clean:
            self.fail(f"GPU {on.g}: {len(holders)} holders in serial mode: {[h.session for h in holders]}")

    def check_memory(self, on: GpuNow) -> None:
        """Concurrent and auto: a grant beside others fits the capacity (max of estimate and
        reported use; unknown is the whole GPU); auto drops sessions while reported use overflows."""
        gm, holders = on.gm, on.view.holders
        granted = self.world.lock_waits.granted_on(on.g)
        if gm.enabled and len(holders) > 1 and granted:
            self.stats[f"grants beside another holder ({gm.mode})"] += 1
        beside = gm.mode != p.Mode.SERIAL and len(holders) > 1 and granted
        if not gm.enabled or not (beside or gm.mode == p.Mode.AUTO):
            return  # neither rule applies
        needs = {s.sid: gm.need(s.mem_estimate, s.mem_used) for _, s in on.sessions}
        needs.update({lease.sid: gm.need(lease.mem_estimate, None) for _, lease in on.leases})
        if beside:
            used = sum(needs[h.session] for h in holders)
            if used > gm.capacity:
                self.fail(
                    f"GPU {on.g}: granted in {gm.mode} mode with the holders needing {used} bytes > capacity "
                    f"{gm.capacity} ({ {h.session: needs[h.session] for h in holders} })"
                )
        if gm.mode == p.Mode.AUTO:
            staying = [h for h in holders if h.drop_pending is None]
            over = sum(needs[h.session] for h in staying) - gm.capacity
            if over > 0 and len(staying) > 1 and any(h.session not in on.lease_sids for h in staying):
                self.fail(f"GPU {on.g}: auto mode, holders' memory {over} bytes over capacity and no session dropped")

    def check_drops_and_tq(self, on: GpuNow) -> None:
        """A DROP_LOCK unanswered for drop_timeout has become a REVOKED; a session that has held
        past TQ while a runnable request waits has its DROP_LOCK."""
        dt, gm = self.dt_us, on.gm
        for c, s in on.sessions:
            if s.state != "holding":
                continue
            if s.drop_at is not None and self.now >= s.drop_at + dt:
                self.fail(
                    f"session {s.sid} still holds {self.now - s.drop_at} us after its DROP_LOCK (drop_timeout {dt} us)"
                )
            if gm.enabled and on.runnable and self.now >= s.granted_at + gm.tq_us and s.drop_at is None:
                self.fail(
                    f"session {s.sid} (client {c.cid}) has held GPU {on.g} for {self.now - s.granted_at} us, "
                    f"past TQ {gm.tq_us} us, while {on.runnable[0].session} waits, and has no DROP_LOCK "
                    f"pending (one was {'sent' if s.drop_seen else 'never sent'} for this grant)"
                )

    def check_quota(self, on: GpuNow) -> None:
        """A limited holder whose window budget is used up has its DROP_LOCK."""
        if not on.gm.enabled:
            return
        acc = on.sched.accounts
        for _, s in on.sessions:
            if s.state == "holding" and s.core_limit < 100 and s.drop_at is None:
                used, budget = acc.account(s.sid).used_ns, acc.budget_ns(s.sid)
                if budget is not None and used >= budget:
                    self.fail(f"session {s.sid} used {used} ns of its {budget} ns budget and runs undisturbed")

    def check_billing(self, sched: Any, gm: GpuModel, sids: list[int]) -> None:
        """Weighted billing never bills a session more than the time it held the GPU, nor
        all of them together more than the wall time, window by window."""
        now = self.now
        acc = sched.accounts
        W = acc.cfg.window_us
        ws = acc.window_start
        total = 0
        for sid in sids:
            a = acc.account(sid)
            made = a.used_ns - a.carried_ns
            # Held time is never negative: only a session billed something can have been overbilled.
            held = overlap(self.holds.get(sid, []), ws, now, now) if made > 0 else 0
            if made > held * 1000:
                self.fail(f"GPU {gm.index}: session {sid} billed {made} ns in the current window but held it {held} us")
            total += made
        if total > (now - ws) * 1000:
            self.fail(f"GPU {gm.index}: {total} ns billed in a window {now - ws} us old")
        if gm.window_seen is not None and ws > gm.window_seen:
            ended = (ws - gm.window_seen) // W
            self.stats["finished windows checked"] += min(ended, acc.cfg.share_windows)
            for j in range(1, min(ended, acc.cfg.share_windows) + 1):
                lo, hi = ws - j * W, ws - (j - 1) * W
                total = 0
                for sid in sids:
                    h = acc.account(sid).history
                    if len(h) >= j:
                        held = overlap(self.holds.get(sid, []), lo, hi, now) if h[-j] > 0 else 0
                        if h[-j] > held * 1000:
                            self.fail(
                                f"GPU {gm.index}: session {sid} billed {h[-j]} ns in window [{lo - START_US}, "
                                f"{hi - START_US}) but held the GPU {held} us of it"
                            )
                        total += h[-j]
                if total > W * 1000:
                    self.fail(f"GPU {gm.index}: {total} ns billed in one window of {W} us")
        gm.window_seen = ws
