"""Crashes, restarts and store faults in the simulated world, and what the store keeps across them.

The daemon crashes, often while a preemption runs (its objects are dropped without a word, the
store is closed, a new ``Daemon`` is built on the same state directory with the restart grace) or
restarts gracefully (GOODBYE, then every connection closes); the store's ``write`` fails now and
then (``store_fail_p``, drawn per seed). Clients reconnect after a daemon crash and attach their
sessions again, and ask again for the allocations they held and waited for, as the client library
and a runner do (``Connections.later_reconnect``). The invariants:
- the store (read back, also with a fresh ``Store``) and the model agree exactly: allocations with
  their notices and deadlines, suspended allocations, waits that had victims, the preemption
  history, the drained GPUs; it may lag only while the daemon knows it could not store a
  withdrawal (``behind``);
- notices, suspended allocations, waits that had victims and the preemption history survive a
  crash, and the next allocation of a preempted task says ``resume``; a withdrawal the store had
  not taken comes back; every greeted client gets GOODBYE before a graceful restart.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpud.capabilities.allocations import STORE_RETRY_US
from gpud.host.store import Store, StoreError
from gpud_client import protocol as p

from .allocations import Ghost, NoticeM, asked_terms, shape
from .model import MS, Client, Part, Pending

if TYPE_CHECKING:
    from gpud.serving.server import Daemon

    from .world import World

# How late a preemption or a wait may end while the allocations' timer tries again a change the store
# refused (each try STORE_RETRY_US later; 25 failed writes in a row do not happen).
MAX_LATE_US = 25 * STORE_RETRY_US


class Restarts(Part):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.store_fail_p = self.rng.choice([0.0, 0.0, 0.05, 0.25])
        self.writes = 0  # the daemon's store writes (tried) so far
        self.injected = 0  # store writes failed on purpose so far
        # Withdrawals the store may not hold yet (a wait given up while the store failed: withdrawn
        # anyway, stored when the timer tries again); a crash before that brings them back.
        self.unstored_notices: dict[str, NoticeM] = {}
        self.unstored_waits: dict[str, Ghost] = {}
        self.goodbye_expected = False
        self._stored: tuple[Any, int, dict[str, Any], dict[str, int]] | None = None  # see stored_allocations

    def steps(self) -> dict[str, Callable[[], None]]:
        return {
            "crash_daemon": self.do_crash_daemon,
            "restart_daemon": self.do_restart_daemon,
            "crash_preempting": self.do_crash_preempting,
        }

    def laters(self) -> dict[str, Callable[..., None]]:
        return {"crash": self.later_crash}

    def on_daemon(self, d: Daemon) -> None:
        real_write = d.allocations.store.write

        def write(*args: Any, **kwargs: Any) -> None:
            self.writes += 1
            if self.store_fail_p and self.rng.random() < self.store_fail_p:
                self.injected += 1
                self.stats["store writes failed (injected)"] += 1
                self.event("the store's write fails (injected)")
                raise StoreError("injected by the simulation")
            real_write(*args, **kwargs)

        d.allocations.store.write = write  # type: ignore[method-assign]

    def behind(self) -> bool:
        """The daemon knows its store does not hold all its changes yet (a withdrawal it could not store)."""
        put, gone = self.daemon.allocations.ledger.changed_records()  # changed since the store took the last
        return bool(put or gone)

    def retrying(self) -> bool:
        """The allocations' timer could not store a change and tries again later (STORE_RETRY_US)."""
        return self.daemon.allocations.durable.retry_at is not None

    # --- crashes and restarts -----------------------------------------------------------------------

    def do_crash_daemon(self) -> None:
        """gpud dies: no GOODBYE, no close; its clients see their connections end. A new
        daemon starts on the same state directory, with the restart grace."""
        self.event("the daemon crashes")
        self.stats["daemon crashes"] += 1
        self.restart(grace_us=round(self.config.restart_grace_s * 1e6))

    def do_crash_preempting(self) -> None:
        """gpud crashes while a preemption runs (else time passes)."""
        if any(a.notice is not None for a in self.world.allocs.acked.values()):
            self.stats["daemon crashes during a preemption"] += 1
            return self.do_crash_daemon()
        return self.world.do_advance()

    def later_crash(self) -> None:
        if any(a.notice is not None for a in self.world.allocs.acked.values()):
            self.stats["daemon crashes during a preemption"] += 1
        self.do_crash_daemon()

    def do_restart_daemon(self) -> None:
        """gpud stops cleanly (GOODBYE, then every connection closes) and starts again."""
        d, conns = self.daemon, self.world.conns
        self.event("the daemon shuts down (GOODBYE)")
        self.stats["daemon restarts (GOODBYE)"] += 1
        self.goodbye_expected = True
        d.farewell("restart")
        greeted = [c for c in self.clients if c.conn is not None and c.conn.greeted]
        got = {c.cid for c in greeted if any(b"GOODBYE" in chunk for chunk in c.conn.pending)}  # type: ignore[union-attr]
        conns.deliver()
        c = self.pick(self.connected())
        if c is not None:
            pend = self.send(c, p.Status(id=c.rid()), "STATUS")
            self.finish(c, pend)
        missing = sorted(x.cid for x in greeted if x.cid not in got)
        if missing:
            self.fail(f"clients {missing} got no GOODBYE")
        for x in self.clients:
            if x.conn is not None:  # each connection ends (the listener closes it after GOODBYE)
                conns.lose_connection(x, "closed after GOODBYE", crashed=False, keep_intents=True)
                self.after_event()
                if x.alive:
                    self.later(self.now + self.rng.randrange(0, 50 * MS), "reconnect", x.cid)
        self.goodbye_expected = False
        self.restart(grace_us=0)

    def restart(self, *, grace_us: int) -> None:
        w, conns = self.world, self.world.conns
        old = self.daemon
        old.allocations.store.close()
        waits = {q.msg.task_id: (c, q) for c in self.clients for q in w.allocs.waits_of(c)}
        for c in self.clients:
            if c.conn is not None:
                conns.closed_conns.append(c.conn)
                conns.forget_connection(c, keep_intents=True)
                if c.alive:
                    self.later(self.now + self.rng.randrange(0, 50 * MS), "reconnect", c.cid)
        w.agenda = [e for e in w.agenda if e[2] == "reconnect"]
        heapq.heapify(w.agenda)
        w.now += self.rng.choice([0, 100, 5 * MS])
        w.daemon = w.build_daemon(grace_us)
        self.event("a new daemon starts (restart grace {} us)", grace_us)
        self.restored(waits)
        w.owners.rehold()
        self.check_fresh_store()
        w.booting = True
        self.after_event()
        w.advance(self.now)  # the new daemon's timers run at once: what fell due while it was down
        w.booting = False

    def restored(self, waits: dict[str, tuple[Client, Pending]]) -> None:
        """After a restart: nobody holds anything yet; no victim rests any more (not durable); the
        waits that had victims are back, nobody's request until their clients ask again."""
        allocs = self.world.allocs
        led = self.daemon.allocations.ledger
        for a in (*allocs.acked.values(), *allocs.suspended.values()):
            a.rested_until = 0
        ghosts, allocs.ghosts = allocs.ghosts, {}
        for r in led.waiting():
            c, q = waits.get(r.task_id, (None, None))
            if r.task_id in ghosts:  # restored once more
                allocs.ghosts[r.task_id] = ghosts[r.task_id]
            elif q is not None and c is not None:
                allocs.ghosts[r.task_id] = Ghost(
                    r.task_id, c.uid, asked_terms(q.msg), q.info["earliest"], q.deadline or 0, q.info["owner"]
                )
                self.stats["waits restored after a crash"] += 1
            elif r.task_id in self.unstored_waits:
                allocs.ghosts[r.task_id] = self.unstored_waits[r.task_id]
                self.stats["withdrawn waits back after a crash (the store had failed)"] += 1
            else:
                self.fail(f"a wait for {r.task_id} came back after the restart, but nothing waited for it")
        for t, a in allocs.acked.items():
            n = self.unstored_notices.get(t)
            if a.notice is None and n is not None and n.same(led.notice_of(t)):
                a.notice = n
                self.stats["withdrawn notices back after a crash (the store had failed)"] += 1
        self.unstored_notices.clear()
        self.unstored_waits.clear()
        lost = [t for t, (_, q) in waits.items() if q.info.get("victims") and t not in allocs.ghosts]
        if lost:
            self.fail(f"the waits {lost} had victims told to leave for them, and did not survive the restart")

    # --- what the store holds -------------------------------------------------------------------------

    def durable_model(self) -> dict[str, Any]:
        """What the store must hold, per task id (see ``durable``)."""
        allocs = self.world.allocs
        out: dict[str, Any] = {}
        for t, a in allocs.acked.items():
            n = a.notice
            notice = n and (n.reason, n.gpus, n.whole, n.by, n.issued, n.deadline)
            out[t] = ("held", a.uid, shape(a), notice)
        for t, a in allocs.suspended.items():
            out[t] = ("suspended", a.uid, shape(a))
        for c in self.clients:
            for q in allocs.waits_of(c):
                if q.info.get("victims"):
                    out[q.msg.task_id] = ("waits", asked_terms(q.msg)[3])
        for t, g in allocs.ghosts.items():
            out[t] = ("waits", g.terms[3])
        for t, (n, resume) in allocs.history.items():
            out.setdefault(t, ("history", n, resume))
        return out

    @staticmethod
    def durable(records: list[tuple[Any, int]]) -> dict[str, Any]:
        """The store's records as ``durable_model`` says them."""
        out: dict[str, Any] = {}
        for rec, uid in records:
            if rec.allocation is not None:
                n = rec.notice
                notice = n and (n.reason, n.gpus, n.whole, n.by, n.issued, n.deadline)
                out[rec.task_id] = ("held", uid, shape(rec.allocation), notice)
            elif rec.suspended is not None:
                out[rec.task_id] = ("suspended", uid, shape(rec.suspended))
            elif rec.waiting is not None:
                out[rec.task_id] = ("waits", rec.waiting.priority)
            else:
                out[rec.task_id] = ("history", rec.preemptions, rec.resume)
        return out

    @staticmethod
    def diff(got: dict[str, Any], want: dict[str, Any]) -> str:
        keys = sorted(set(got) | set(want))
        return "; ".join(f"{k}: {got.get(k)} (expected {want.get(k)})" for k in keys if got.get(k) != want.get(k))

    def stored_allocations(self) -> dict[str, Any]:
        """What the daemon's store holds, read back. Read again only when the store's connection
        has changed rows since the last reading (SQLite's ``total_changes``) or the store is
        another one: the same rows read back the same."""
        store = self.daemon.allocations.store
        changes = store._db.total_changes
        if self._stored is None or self._stored[0] is not store or self._stored[1] != changes:
            loaded = store.load()
            self._stored = (store, changes, self.durable(loaded.records), loaded.starts)
        return self._stored[2]

    def stored_starts(self) -> dict[str, int]:
        """The owners' start times the daemon's store keeps, per task id."""
        self.stored_allocations()  # (read again only if the store changed)
        assert self._stored is not None
        return self._stored[3]

    def check_fresh_store(self) -> None:
        """What a new daemon would read: exactly what was acknowledged (allocations with their
        notices, suspended allocations, waits that had victims, preemption history)."""
        self._stored = None  # another connection opens the file: read it afresh next time too
        store = Store(self.world.state_dir)
        try:
            loaded = store.load()
        finally:
            store.close()
        draining = self.world.allocs.draining
        got, want = self.durable(loaded.records), self.durable_model()
        behind = self.behind() if got != want else False
        if (got != want and not behind) or loaded.unreadable or sorted(loaded.draining) != sorted(draining):
            self.fail(
                f"read back from the store: {self.diff(got, want)} (unreadable {loaded.unreadable}, "
                f"draining {loaded.draining}, expected {sorted(draining)})"
            )

    def check(self) -> None:
        """The daemon's store holds what the model says, unless the daemon knows it is behind."""
        want = self.durable_model()
        stored = self.stored_allocations()
        if stored != want and not self.behind():
            self.fail(f"the store holds {self.diff(stored, want)}")
        self.stats["events with the store behind (a withdrawal not stored yet)"] += stored != want
        if (self.unstored_notices or self.unstored_waits) and not self.behind():
            self.unstored_notices.clear()
            self.unstored_waits.clear()
