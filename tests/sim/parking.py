"""Parking in the simulated world: PARK pushed to a parkable session (as ``gpuctl run`` attaches
its own) and its PARKED answer, ok or not, on time or after park_timeout.

A parkable session's client answers PARK after a drawn delay, PARKED ok mostly, not ok sometimes;
a ``slow`` one often after park_timeout, a ``stubborn`` one never. The invariants:
- a PARK goes only to a parkable session of that connection that does not hold, with the scheduler
  on, while something waits for (or was just granted) the GPU; never again while one is
  unanswered, after PARKED ok, or after a refusal or a park_timeout, until the session has held
  once more;
- the sessions asked are the lowest priority, then the oldest grant, first, and no more of them
  than the first runnable waiter needs;
- at every grant the holders' memory and that of the parkable sessions resident on the GPU
  (attached, not holding, not parked since their last grant) fit the capacity unless every
  resident one has refused or timed out;
- the daemon's parkable sessions (resident, asked, refused) and CLIENTS' parkable/parked/parks are
  what the clients saw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpud_client import protocol as p

from .model import MS, Answer, Client, Part, Pending, short

if TYPE_CHECKING:
    from .locks import GpuNow, Sess
    from .world import World


class Parking(Part):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.pt_us = round(self.config.park_timeout_s * 1e6)
        self.parks_now: set[int] = set()  # GPUs where a PARK was answered or timed out in this event
        self.lease_timeouts_now: set[int] = set()  # GPUs where a lease was refused TIMEOUT in this event
        self.asked_now: dict[int, set[int]] = {}  # GPU -> the sessions asked to PARK in this event

    def answers(self) -> dict[str, Answer]:
        return {"PARKED": self.answer_parked}

    def laters(self) -> dict[str, Callable[..., None]]:
        return {"parked": self.later_parked}

    def end_event(self) -> None:
        self.parks_now.clear()
        self.lease_timeouts_now.clear()
        self.asked_now.clear()

    # --- pushes ---------------------------------------------------------------------------------

    def on_early_park(self, c: Client, msg: p.Park) -> None:
        """A PARK for a session whose ATTACHED has not come yet."""
        self.known_bug("park before attached", f"client {c.cid}: {short(msg)} before its ATTACHED")
        c.early_parks[msg.session] = self.now  # dropped, as the client library does; timed out later

    def on_park(self, c: Client, s: Sess, *, answer: bool) -> None:
        """A PARK: only to a parkable session that does not hold, once until it is answered,
        and never again after an answer or a park_timeout until the session has held."""
        self.park_timeouts(s)
        why = None
        if not s.parkable:
            why = "it was not attached as parkable"
        elif s.state == "holding":
            why = f"it holds the lock (grant {s.grant})"
        elif s.park_asked is not None:
            why = f"the PARK of {self.now - s.park_asked} us ago is unanswered and it has not held since"
        elif s.parked:
            why = "it answered PARKED ok and has not held since"
        elif s.park_refused:
            why = "it refused a PARK (or left one unanswered for park_timeout) and has not held since"
        if why is not None:
            self.fail(f"client {c.cid}: PARK for session {s.sid}, but {why}")
        s.park_asked = self.now
        self.stats["parks asked"] += 1
        key = (s.priority, s.grant, s.sid)  # its place in the order parks are asked in (a grant may follow)
        deferred = self.world.deferred
        deferred.append(lambda: self.judge_park(s, key))
        if s.gpu not in self.asked_now:
            self.asked_now[s.gpu] = set()
            deferred.append(lambda: self.judge_asks(s.gpu))
        self.asked_now[s.gpu].add(s.sid)
        for other in self.world.locks.sessions_on(s.gpu):  # the waiters' grants may wait for this park
            if other.state == "waiting" and other.bound is not None:
                other.bound += self.pt_us
        if c.kind == "stubborn" or not answer:
            return  # never answers: park_timeout ends it
        if c.kind == "slow":
            delay = self.rng.randrange(self.pt_us // 2, 2 * self.pt_us)
        else:
            delay = self.rng.randrange(0, max(1, min(2 * MS, self.pt_us // 2)))
        self.later(self.now + delay, "parked", c.cid, c.gen, s.sid, self.rng.random() < 0.8)

    def judge_park(self, s: Sess, key: tuple[int, int, int]) -> None:
        """At the end of the event: the scheduler was on (an admin's OK may be read after the
        push); the sessions asked are the lowest priority, then the oldest grant, first (every
        one before it was asked, or refused, or may be the waiter the parks are for); and
        something waits for the GPU or was granted it (a PARK is asked for a waiter)."""
        gm = self.gpus[s.gpu]
        if not gm.enabled:
            self.fail(f"session {s.sid}: PARK on GPU {s.gpu}, whose scheduler is off")
        for r in self.resident(s.gpu):
            if (r.priority, r.grant, r.sid) < key and r.park_asked is None and not r.park_refused:
                if r.state != "waiting":
                    self.fail(
                        f"session {s.sid} (priority {s.priority}, last grant {key[1]}) asked to PARK before "
                        f"session {r.sid} (priority {r.priority}, last grant {r.grant}), which comes first"
                    )
        waiting = self.daemon.slots[s.gpu].scheduler.queue()
        grants_now = self.world.lock_waits.grants_now
        if waiting or any(x[0] == s.gpu for x in grants_now) or self.world.conns.lost_now:
            return  # (a closed connection's waiter may have been asked for before it was detached)
        why = f"session {s.sid}: PARK on GPU {s.gpu}, but nothing waits for it and nothing was granted"
        if s.gpu in self.lease_timeouts_now:
            self.known_bug("parks asked for a lease that leaves at once", why)
        else:
            self.fail(why)

    def judge_asks(self, gpu: int) -> None:
        """At the end of an event that asked parks on the GPU and granted nothing there: no more
        were asked than the first runnable waiter needs (each one asked, walking the resident
        sessions in order, was still short of room)."""
        grants_now = self.world.lock_waits.grants_now
        if self.world.conns.lost_now or gpu in self.lease_timeouts_now or any(x[0] == gpu for x in grants_now):
            return  # the waiter they were asked for may be gone or granted: judged at the grant
        gm, asked = self.gpus[gpu], self.asked_now[gpu]
        view = self.daemon.slots[gpu].scheduler.view(self.now)
        head = next((w.session for w in view.queue if not w.throttled), None)
        if head is None:
            return  # (judge_park reports a PARK with nothing waiting)
        need = {s.sid: gm.need(s.mem_estimate, s.mem_used) for s in self.world.locks.sessions_on(gpu)}
        for c in self.clients:
            need.update({x.sid: gm.need(x.mem_estimate, None) for x in c.leases.values() if x.gpu == gpu})
            for q in c.waiting_leases():
                if q.info["gpu"] == gpu:
                    need[q.info["sid"]] = gm.need(q.info["terms"].mem_estimate, None)
        resident = sorted((r for r in self.resident(gpu) if r.sid != head), key=lambda r: (r.priority, r.grant, r.sid))
        over = need[head] + sum(need[h.session] for h in view.holders) + sum(need[r.sid] for r in resident)
        over -= gm.capacity
        for r in resident:
            if over <= 0 and r.sid in asked:
                self.fail(
                    f"GPU {gpu}: session {r.sid} asked to PARK, but those before it already make room for "
                    f"{head} (asked now: {sorted(asked)})"
                )
            if not r.park_refused:
                over -= need[r.sid]

    def park_timeouts(self, s: Sess) -> None:
        """A PARK unanswered for park_timeout counts as refused (the daemon says nothing)."""
        if s.park_asked is not None and self.now >= s.park_asked + self.pt_us:
            s.park_asked, s.park_refused = None, True
            self.parks_now.add(s.gpu)
            self.stats["parks timed out"] += 1

    def resident(self, gpu: int) -> list[Sess]:
        """The parkable sessions whose memory is on the GPU while they do not hold."""
        out = [s for s in self.world.locks.sessions_on(gpu) if s.parkable and s.state != "holding" and not s.parked]
        for s in out:
            self.park_timeouts(s)
        return out

    def parks_needed(self, gpu: int, need: int) -> bool:
        """Whether a newcomer needing ``need`` bytes on an idle GPU waits for parks: the parkable
        sessions resident there do not fit beside it and one of them may still be asked."""
        gm = self.gpus[gpu]
        resident = self.resident(gpu)
        over = need + sum(gm.need(s.mem_estimate, s.mem_used) for s in resident) > gm.capacity
        return over and any(not s.park_refused for s in resident)

    # --- answers and the clients' side ----------------------------------------------------------

    def answer_parked(self, c: Client, pend: Pending, msg: Any) -> None:
        expected = pend.info["expected"]
        ok = isinstance(msg, p.Error) and msg.code == expected
        self.expect(ok, c, pend, msg, f"expected {expected or 'no answer'}")

    def listed(self, c: Client, pend: Pending, msg: p.ClientsReply) -> None:
        """CLIENTS: each session's parkable, parked and parks are what its client saw."""
        mine = {s.sid: s for x in self.clients for s in x.sessions.values()}
        for info in (i for client in msg.clients for i in client.sessions if i.session in mine):
            s = mine[info.session]
            seen = (s.parkable, s.parked, s.parks)
            self.expect(
                (info.parkable, info.parked, info.parks) == seen,
                c,
                pend,
                msg,
                f"session {s.sid} parkable/parked/parks {seen}",
            )

    def later_parked(self, cid: int, gen: int, sid: int, ok: bool) -> None:
        """The answer to a PARK: also late (after park_timeout) or after the session has held
        since; the daemon takes either as the program's state now, unless it holds."""
        c = self.client(cid, gen)
        s = c.sessions.get(sid) if c else None
        if c is None or s is None:
            return
        self.park_timeouts(s)
        if s.state != "holding":
            if ok:
                s.parked, s.parks = True, s.parks + 1
            else:
                s.park_refused = True
            self.stats["parks answered " + ("ok" if ok else "not ok (refused)")] += 1
            if s.park_asked is None:
                self.stats["parks answered after park_timeout or a grant"] += 1
        s.park_asked = None
        self.parks_now.add(s.gpu)
        msg = p.Parked(id=c.rid(), session=sid, ok=ok, message="" if ok else "no host memory")
        pend = self.send(c, msg, "PARKED", expected=None)
        self.finish(c, pend, answered_now=False)
        self.after_event()

    # --- the checks ---------------------------------------------------------------------------------

    def check_gpu(self, on: GpuNow) -> None:
        """The daemon's parkable sessions are what their clients saw (resident or parked, a PARK
        out since when, refused since the last grant); at a grant, the holders' memory and the
        resident parkable sessions' fit the capacity unless every resident one refused or timed out.
        (One of ``Locks.check_gpu``'s rules: a PARK that timed out counts before the queue is judged.)"""
        mine = [s for _, s in on.sessions if s.parkable]
        theirs = on.sched.st.parkable
        if not mine and not theirs:
            return
        for s in mine:
            self.park_timeouts(s)
        model = {s.sid: (not s.parked, s.park_asked, s.park_refused) for s in mine}
        daemon = {sid: (x.resident, x.park_asked_at, x.park_refused) for sid, x in theirs.items()}
        if model != daemon:
            self.fail(
                f"GPU {on.g}: the daemon's parkable sessions (resident, PARK asked at, refused) {daemon} are not "
                f"what their clients saw {model}"
            )
        gm = on.gm
        if not gm.enabled or not self.world.lock_waits.granted_on(on.g):
            return
        if on.g in self.parks_now:
            self.stats["grants that waited for a park"] += 1
        resident = [s for s in mine if s.state != "holding" and not s.parked]
        if not resident:
            return
        need = {s.sid: gm.need(s.mem_estimate, s.mem_used) for _, s in on.sessions}
        need.update({lease.sid: gm.need(lease.mem_estimate, None) for _, lease in on.leases})
        held = sum(need[h.session] for h in on.view.holders)
        kept = sum(need[s.sid] for s in resident)
        if held + kept <= gm.capacity:
            return
        asked = [s.sid for s in resident if not s.park_refused]
        if asked:
            self.fail(
                f"GPU {on.g}: granted with the holders needing {held} bytes and the resident parkable sessions "
                f"{ {s.sid: need[s.sid] for s in resident} } {kept} more, over capacity {gm.capacity}, though "
                f"{asked} could still be asked to park"
            )
        self.stats["grants over capacity beside refused parks"] += 1
