"""Waits for the GPU lock: the order grants come in and how long a request may wait, for sessions
and leases alike.

A request that waits (a session's LOCK_REQUEST, a lease's ACQUIRE) gets its place in the arrival
order (``arrival``); every grant of an event (``grants_now``) is judged when the event ends
(``note_grants``). The invariants:
- grant numbers grow on each GPU; nobody is granted while an unthrottled session waits ahead of it
  (higher priority first, then arrival);
- a lock waiter is granted within the bound derived in ``lock_bound`` (a PARK asked while it waits
  adds park_timeout, ``Parking.on_park``); a grant that legitimately went ahead extends the bound
  by its own hold; nothing is granted during the restart grace (``lock_bound`` counts from its end).

It draws nothing from the seed's generator.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from .leases import LEASE_HOLD_MAX_US
from .model import Client, Part

if TYPE_CHECKING:
    from .locks import Sess
    from .world import World


class LockWaits(Part):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.arrivals = itertools.count(1)  # arrival order of lock requests and acquires
        self.grants_now: list[tuple[int, int, int, int, int]] = []  # (gpu, sid, seq, priority, grant) this event
        self._last_grants: list[tuple[int, int, int, int, int]] = []

    def arrival(self) -> int:
        return next(self.arrivals)

    def hold_bound(self, gpu: int, kind: str, client: Client, hold_max_us: int | None) -> int | None:
        """How long one grant can keep a waiting request behind it waiting (None: unbounded).

        A session: while the request we bound waits, an unthrottled waiter exists (that
        request itself: only unlimited sessions get a bound), so the daemon drops every
        session holder (reason tq) once it has held TQ since its grant: a holder granted
        at g leaves by g + TQ + drop_timeout (released, or revoked drop_timeout after
        the DROP_LOCK); one that already held the GPU when the request came (at t0) is
        dropped at max(g + TQ, t0) and leaves by t0 + TQ + drop_timeout. Drops for
        quota, preemption or memory only come earlier (and are revoked just as late).
        So TQ + drop_timeout, counted from the grant or from the request, whichever is
        later. A lease is never dropped: hold_max if the daemon releases it by force,
        else only the client's own habit (the model's longest hold for its kind, or
        never, for an abandoner, and then there is no bound)."""
        if kind == "session":
            return self.gpus[gpu].tq_us + self.world.locks.dt_us
        own = LEASE_HOLD_MAX_US[client.kind]
        if self.config.lease_force_release and hold_max_us is not None:
            return hold_max_us if own is None else min(own, hold_max_us)
        return own

    def occupants(self, gpu: int) -> list[tuple[str, Client, int, int, int, bool, int | None]]:
        """(kind, client, sid, seq, priority, holding, hold_max_us) of everything on the GPU."""
        out: list[tuple[str, Client, int, int, int, bool, int | None]] = []
        for c in self.clients:
            for s in c.sessions.values():
                if s.gpu == gpu and s.state != "idle":
                    out.append(("session", c, s.sid, s.seq, s.priority, s.state == "holding", None))
            for lease in c.leases.values():
                if lease.gpu == gpu:
                    out.append(("lease", c, lease.sid, lease.seq, lease.priority, True, lease.hold_max_us))
            for q in c.waiting_leases():
                if q.info["gpu"] == gpu:
                    out.append(
                        ("lease", c, q.info["sid"], q.info["seq"], q.info["priority"], False, q.info["hold_max_us"])
                    )
        return out

    def lock_bound(self, s: Sess) -> int | None:
        """The latest a LOCK_REQUEST that waits must be granted, as far as TQ and
        drop_timeout bound it; None where nothing does (a limited session also waits for
        its budget; a lease ahead held by a client that never gives it back, with no
        forced release).

        The derivation. Let t0 = max(the request, the end of the restart grace: nothing
        is granted before). Ahead of the request are the holders and the waiters before
        it in the queue's order (higher priority first, then arrival). Nobody behind it
        is admitted before it (``note_grants`` checks the order), and the GPU is never
        idle while it waits unthrottled (``Locks.check_queue_match``), so it waits only while
        someone ahead holds the GPU. Each of those holds at most ``hold_bound`` counted
        from its grant or from t0, whichever is later, and the next one ahead is granted
        the moment the previous one leaves (in serial mode; in concurrent mode several
        hold at once, which only shortens the wait). Hence it is granted by

            t0 + the sum of hold_bound over everyone ahead of it at t0,

        exact in serial mode (each holds the GPU alone, one after the other) and generous
        in concurrent mode. A request arriving later with a higher priority legitimately
        goes ahead: each such grant extends the bound by its own hold_bound when it
        happens (``note_grants``). Parking: a grant also waits while a PARK is out (the
        GPU may then be idle); each PARK is over within park_timeout (answered, timed
        out, or its session granted), so one out at t0 adds what is left of it, and
        each one asked later park_timeout when it is asked (``Parking.on_park``). A change
        of mode, TQ or the scheduler switch on the GPU changes the rules the bound was
        derived under: it is voided (``Locks.apply_admin``)."""
        gm = self.gpus[s.gpu]
        if not gm.enabled or s.core_limit < 100:
            return None
        total = 0
        for kind, client, sid, seq, priority, holding, hold_max in self.occupants(s.gpu):
            if sid == s.sid:
                continue
            if holding or (-priority, seq) < (-s.priority, s.seq):
                bound = self.hold_bound(s.gpu, kind, client, hold_max)
                if bound is None:
                    return None
                total += bound
                s.counted.add((sid, seq))
        pt_us = self.world.parking.pt_us
        for other in self.world.locks.sessions_on(s.gpu):  # a grant may wait for a PARK already out: at most its rest
            if other.park_asked is not None:
                total += max(0, other.park_asked + pt_us - self.now)
        return max(self.now, self.world.grace_end) + total

    def note_grants(self) -> None:
        """Grants of this event: numbered in order, in queue order, extending bounds for those
        who legitimately went ahead."""
        self._last_grants = list(self.grants_now)
        for gm in self.gpus:
            numbers = sorted(x[4] for x in self.grants_now if x[0] == gm.index and x[4])
            if numbers and (numbers[0] <= gm.last_grant or len(set(numbers)) != len(numbers)):
                self.fail(f"GPU {gm.index}: grants {numbers} after grant {gm.last_grant} (numbers must grow)")
            if numbers:
                gm.last_grant = numbers[-1]
        for gpu, sid, seq, priority, _ in self.grants_now:
            gm = self.gpus[gpu]
            if not gm.enabled:
                continue
            self.stats[f"grants checked for queue order ({gm.mode})"] += 1
            view = {w.session: w for w in self.daemon.slots[gpu].scheduler.view(self.now).queue}
            for c in self.clients:
                for s in c.sessions.values():
                    if s.gpu != gpu or s.state != "waiting" or s.sid == sid:
                        continue
                    # Only a waiter that cannot have been throttled at the grant (no limit, none set in
                    # this event) is certain to have been passed over.
                    unlimited = s.core_limit >= 100 and not s.limits_changed
                    if unlimited and s.sid in view and (-s.priority, s.seq) < (-priority, seq):
                        self.fail(
                            f"GPU {gpu}: {sid} (priority {priority}, arrival {seq}) granted while session "
                            f"{s.sid} (priority {s.priority}, arrival {s.seq}) waits ahead of it"
                        )
                    if s.bound is not None and (sid, seq) not in s.counted:
                        s.counted.add((sid, seq))
                        owner = next(
                            (
                                x
                                for x in self.clients
                                if sid in x.sessions or any(lease.sid == sid for lease in x.leases.values())
                            ),
                            None,
                        )
                        if owner is None:
                            continue  # gone in the same event: it holds nothing any more
                        lease = next((lease for lease in owner.leases.values() if lease.sid == sid), None)
                        extra = self.hold_bound(
                            gpu, "lease" if lease else "session", owner, lease.hold_max_us if lease else None
                        )
                        s.bound = None if extra is None else s.bound + extra
        self.grants_now.clear()
        for c in self.clients:
            for s in c.sessions.values():
                s.limits_changed = False

    def granted_on(self, gpu: int) -> bool:
        """Something was granted on ``gpu`` in the event just checked."""
        return any(x[0] == gpu for x in self._last_grants)

    def check(self) -> None:
        """Every lock waiter with a bound (``lock_bound``) is granted by it."""
        for c in self.clients:
            for s in c.sessions.values():
                if s.state == "waiting" and s.bound is not None and self.now > s.bound:
                    gm = self.gpus[s.gpu]
                    self.fail(
                        f"session {s.sid} (client {c.cid}, priority {s.priority}) has waited "
                        f"{self.now - s.requested_at} us for GPU {s.gpu}, {self.now - s.bound} us past its bound "
                        f"(TQ {gm.tq_us} us, drop_timeout {self.world.locks.dt_us} us, {len(s.counted)} grants ahead "
                        "of it)"
                    )
