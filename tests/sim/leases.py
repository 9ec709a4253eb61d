"""Leases in the simulated world: ACQUIRE (waiting, or refused by its terms), RELEASE (one's own,
another's, one gone), LEASE_REVOKED at hold_max when the daemon releases by force.

A client keeps a lease for a while drawn from its kind's longest hold (``LEASE_HOLD_MAX_US``); an
``abandoner`` never gives one back. The invariants:
- the arbiter's leases are exactly those the clients hold and wait for;
- a lease's terms are the request's, cut to its task type's policy and the caller's priority
  ceiling (a reserved task type refused to anyone it does not name but an admin);
- a refused lease says why as its busy policy says; GPU_BUSY and QUEUE_FULL only on arrival;
  TIMEOUT only after max_wait, never with max_wait 0; an idle GPU admits the first at once;
- a lease waiter has its LEASE_RESULT by its max_wait; nothing is granted during the restart
  grace, nor a new lease on a draining GPU;
- with forced release on, no lease is held past its hold_max, and only then is one revoked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpud.core.leases import LeaseTerms, refusal_status, resolve_terms
from gpud_client import protocol as p

from .model import GIB, MS, TASK_TYPES, Answer, Client, Part, Pending, short

# The longest a client of each kind keeps a lease before giving it back (None: never).
LEASE_HOLD_MAX_US: dict[str, int | None] = {
    "good": 20 * MS,
    "slow": 60 * MS,
    "stubborn": 60 * MS,
    "crashy": 20 * MS,
    "abandoner": None,
}


@dataclass(eq=False)
class LeaseM:
    lease_id: str
    sid: int
    gpu: int
    priority: int
    seq: int
    granted_at: int
    hold_max_us: int
    mem_estimate: int | None


class Leases(Part):
    def answers(self) -> dict[str, Answer]:
        return {"ACQUIRE": self.answer_acquire, "RELEASE": self.answer_release}

    def steps(self) -> dict[str, Callable[[], None]]:
        return {"acquire": self.do_acquire, "release_lease": self.do_release_lease}

    def laters(self) -> dict[str, Callable[..., None]]:
        return {"lease_release": self.later_lease_release}

    # --- pushes and answers ---------------------------------------------------------------------

    def on_revoked(self, c: Client, msg: p.LeaseRevoked) -> None:
        lease = c.leases.pop(msg.lease_id, None)
        if lease is None:
            self.fail(f"client {c.cid} got {short(msg)} for a lease it does not hold")
        if not self.config.lease_force_release or self.now < lease.granted_at + lease.hold_max_us:
            self.fail(
                f"lease {lease.lease_id} revoked at {self.now - lease.granted_at} us held, "
                f"hold_max {lease.hold_max_us} us, force_release={self.config.lease_force_release}"
            )
        self.world.locks.end_hold(lease.sid)
        self.stats["leases revoked (hold_max)"] += 1

    def listed(self, c: Client, pend: Pending, msg: p.LeasesReply) -> None:
        """LEASES: the leases held are those the clients hold."""
        held = sorted(lease.lease_id for x in self.clients for lease in x.leases.values())
        listed = sorted(i.lease_id for i in msg.leases if i.state == "holding")
        self.expect(listed == held, c, pend, msg, f"held leases: {held}")

    def answer_acquire(self, c: Client, pend: Pending, msg: Any) -> None:
        m: p.Acquire = pend.msg
        draining = self.world.allocs.draining
        if isinstance(msg, p.Error):
            cap = self.config.max_sessions_per_connection
            expected: p.ErrorCode | None = None
            if pend.info["gpu"] in draining:
                expected = p.ErrorCode.INSUFFICIENT  # a draining GPU takes no new lease
            elif len(c.sessions) + len(c.leases) + len(c.waiting_leases()) >= cap:
                expected = p.ErrorCode.LIMIT_REACHED
            else:
                refused = (m.priority or 0) > self.ceiling(c) or pend.info["terms"] is None
                expected = p.ErrorCode.PERMISSION_DENIED if refused else None
            self.expect(msg.code == expected, c, pend, msg, f"expected {expected or 'a LEASE_RESULT'}")
            return
        self.expect(
            isinstance(msg, p.LeaseResult) and (m.priority or 0) <= self.ceiling(c),
            c,
            pend,
            msg,
            "a lease priority above the ceiling is refused",
        )
        gpu = pend.info["gpu"]
        self.expect(msg.gpu == gpu, c, pend, msg, "the GPU asked for")
        self.expect(gpu not in draining or pend.sent_at < self.now, c, pend, msg, "a draining GPU takes no new lease")
        if msg.status == p.LeaseStatus.ACQUIRED:
            rec = self.daemon.leases.by_id.get(msg.lease_id or "")
            self.expect(rec is not None and rec.conn is c.conn, c, pend, msg, "the arbiter holds the lease for it")
            assert rec is not None and msg.lease_id is not None
            grace_end = self.world.grace_end
            if self.now < grace_end:
                self.fail(f"lease {msg.lease_id} granted {grace_end - self.now} us before the restart grace ends")
            terms: LeaseTerms = pend.info["terms"]
            self.expect(rec.terms == terms, c, pend, msg, f"lease terms {rec.terms}, expected {terms}")
            lease = LeaseM(
                msg.lease_id,
                rec.sid,
                gpu,
                terms.priority,
                pend.info["seq"],
                self.now,
                terms.hold_max_ms * MS,
                terms.mem_estimate,
            )
            self.expect(all(msg.lease_id not in x.leases for x in self.clients), c, pend, msg, "a new lease id")
            c.leases[msg.lease_id] = lease
            self.stats["leases acquired" + (" after waiting" if self.now > pend.sent_at else "")] += 1
            self.world.locks.begin_hold(rec.sid)
            self.world.lock_waits.grants_now.append((gpu, rec.sid, lease.seq, lease.priority, 0))
            hold_max = LEASE_HOLD_MAX_US[c.kind]
            if hold_max is not None:
                self.later(
                    self.now + self.rng.randrange(MS // 2, hold_max), "lease_release", c.cid, c.gen, msg.lease_id
                )
            return
        self.stats[f"leases refused ({msg.reason})"] += 1
        terms = pend.info["terms"]
        want = refusal_status(terms.busy_policy)
        self.expect(msg.status == want, c, pend, msg, f"busy policy {terms.busy_policy} answers {want}")
        if msg.reason in (p.LeaseReason.GPU_BUSY, p.LeaseReason.QUEUE_FULL):
            self.expect(self.now == pend.sent_at, c, pend, msg, "refused on arrival only")
            if msg.reason == p.LeaseReason.GPU_BUSY:
                self.expect(terms.max_wait_ms == 0, c, pend, msg, f"GPU_BUSY only when max_wait is 0 ({terms})")
            else:
                queued = len(self.daemon.slots[gpu].scheduler.queue())
                self.expect(
                    terms.max_wait_ms > 0 and queued >= terms.queue_limit,
                    c,
                    pend,
                    msg,
                    f"QUEUE_FULL with {queued} queued, queue_limit {terms.queue_limit}",
                )
        elif msg.reason == p.LeaseReason.TIMEOUT:
            parking = self.world.parking
            parking.lease_timeouts_now.add(gpu)
            if terms.max_wait_ms == 0 and any(not s.park_refused for s in parking.resident(gpu)):
                self.known_bug(
                    "parks asked for a lease that leaves at once",
                    f"client {c.cid}: {short(pend.msg)} answered {short(msg)}, not GPU_BUSY, as parks are asked for it",
                )
                return
            self.expect(
                terms.max_wait_ms > 0,
                c,
                pend,
                msg,
                "its terms give max_wait 0 ms, which means only if free now: the answer is GPU_BUSY, never TIMEOUT",
            )
            self.expect(
                self.now >= pend.sent_at + terms.max_wait_ms * MS,
                c,
                pend,
                msg,
                f"timed out before its max_wait of {terms.max_wait_ms} ms",
            )
        else:
            self.expect(False, c, pend, msg, "a refused lease says why")
        self.expect(not pend.info.get("idle"), c, pend, msg, "the GPU was idle: the first holder is always admitted")

    def answer_release(self, c: Client, pend: Pending, msg: Any) -> None:
        if pend.info.get("other"):
            self.expect(
                isinstance(msg, p.Error) and msg.code == p.ErrorCode.PERMISSION_DENIED,
                c,
                pend,
                msg,
                "releasing another client's lease is refused",
            )
        else:
            self.expect(isinstance(msg, p.Ok), c, pend, msg, "release is idempotent")

    # --- the client's side of each request ---------------------------------------------------------

    def acquire(self, c: Client) -> None:
        r = self.rng
        gpu = r.randrange(len(self.gpus))
        task = r.choice(TASK_TYPES)
        max_wait = r.choice([None, None, 0, 5, 20, 100])
        busy = r.choice([None, None, *p.BusyPolicy])
        msg = p.Acquire(
            id=c.rid(),
            gpu=gpu,
            task_type=task,
            priority=r.choice([None, None, None, 10, 50, 85]),
            max_wait_ms=max_wait,
            hold_max_ms=r.choice([None, 10, 50]),
            queue_limit=r.choice([None, None, 0, 2]),
            busy_policy=busy,
            mem_estimate=r.choice([None, GIB, 4 * GIB, 12 * GIB]),
        )
        terms = self.lease_terms(c, msg)
        waits, parking = self.world.lock_waits, self.world.parking
        idle = not waits.occupants(gpu) and self.gpus[gpu].enabled and self.now >= self.world.grace_end
        idle = idle and not parking.parks_needed(gpu, self.gpus[gpu].need(msg.mem_estimate, None))
        pend = self.send(c, msg, "ACQUIRE", gpu=gpu, seq=waits.arrival(), idle=idle, terms=terms)
        if c.pending.get(pend.rid) is pend:  # not answered yet: it waits
            rec = next(
                (x for x in self.daemon.leases.by_sid.values() if x.conn is c.conn and x.request_id == pend.rid), None
            )
            if rec is None:
                self.fail(f"client {c.cid}: ACQUIRE {pend.rid} got no answer and the arbiter has no record of it")
            assert rec is not None
            if rec.terms != terms:
                self.fail(
                    f"lease terms {rec.terms}, expected {terms} (policy {self.daemon.leases.policies.get(msg.task_type)})"
                )
            pend.info.update(sid=rec.sid, priority=terms.priority, hold_max_us=terms.hold_max_ms * MS)
            pend.deadline = pend.sent_at + terms.max_wait_ms * MS
        self.after_event()

    def lease_terms(self, c: Client, m: p.Acquire) -> LeaseTerms | None:
        """The lease's terms: the request's fields, cut to its task type's policy (tighten only), its
        priority cut to the caller's ceiling unless the policy names it. None: a reserved task type
        that does not name the caller, refused."""
        cfg = self.config
        terms = resolve_terms(
            m.task_type,
            self.daemon.leases.policies,
            priority=m.priority,
            busy_policy=m.busy_policy,
            max_wait_ms=m.max_wait_ms,
            queue_limit=m.queue_limit,
            hold_max_ms=m.hold_max_ms,
            mem_estimate=m.mem_estimate,
            default_queue_limit=cfg.lease_queue_limit,
            default_hold_max_ms=cfg.lease_hold_max_ms,
        )
        if c.admin:
            return terms
        policy = cfg.policies.get(m.task_type)
        named = policy is not None and (c.uid in policy.uids or c.gid in policy.gids)
        if policy is not None and (policy.uids or policy.gids):
            return terms if named else None
        return dataclasses.replace(terms, priority=min(terms.priority, self.ceiling(c)))

    def release_lease(self, c: Client, lease_id: str, *, other: bool = False) -> None:
        quiet = not other and self.rng.random() < 0.3
        if not other:
            lease = c.leases.pop(lease_id, None)
            if lease is not None:
                self.world.locks.end_hold(lease.sid)
        pend = self.send(c, p.Release(id=c.rid(), lease_id=lease_id, quiet=quiet), "RELEASE", other=other)
        self.finish(c, pend, answered_now=not quiet)
        self.after_event()

    def later_lease_release(self, cid: int, gen: int, lease_id: str) -> None:
        c = self.client(cid, gen)
        if c is not None and lease_id in c.leases:
            self.release_lease(c, lease_id)

    # --- steps ----------------------------------------------------------------------------------------

    def do_acquire(self) -> None:
        c = self.pick(self.connected())
        if c is not None:
            self.acquire(c)

    def do_release_lease(self) -> None:
        c = self.pick(self.connected())
        if c is None:
            return
        others = [lid for x in self.clients if x is not c for lid in x.leases]
        roll = self.rng.random()
        if c.leases and roll < 0.7:
            self.release_lease(c, self.pick(sorted(c.leases)))
        elif others and roll < 0.85:
            self.release_lease(c, self.pick(sorted(others)), other=True)
        else:
            self.release_lease(c, "gone-1")  # released already, or never existed: OK all the same

    # --- the checks ---------------------------------------------------------------------------------

    def check(self) -> None:
        """The arbiter's leases are the clients' held and waiting ones; with forced release on, no
        lease is held past its hold_max."""
        held = {lease.sid for c in self.clients for lease in c.leases.values()}
        waiting = {q.info["sid"] for c in self.clients for q in c.waiting_leases()}
        arb = self.daemon.leases
        if set(arb.by_sid) != held | waiting:
            self.fail(
                f"the arbiter's leases {sorted(arb.by_sid)} are not the clients' held {sorted(held)} "
                f"and waiting {sorted(waiting)}"
            )
        if not self.config.lease_force_release:
            return
        for c in self.clients:
            for lease in c.leases.values():
                if self.gpus[lease.gpu].enabled and self.now >= lease.granted_at + lease.hold_max_us:
                    self.fail(
                        f"lease {lease.lease_id} held {self.now - lease.granted_at} us, past hold_max "
                        f"{lease.hold_max_us} us, with forced release on"
                    )
