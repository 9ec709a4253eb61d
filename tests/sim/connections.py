"""The clients' connections in the simulated world: connect (some before HELLO), HELLO, every
request through ``handle_payload`` as the listener's read loop would, every reply and push read
back and handed to the part it concerns, disconnects and crashes, reconnects, queries.

A client reads what the daemon wrote to it after every request and every timer (``deliver``);
a request's answer goes to the judge its part registered for that kind (``World.answers``), or to
``answer_simple`` (admin operations, queries, OOM reports). All reconnect after a daemon crash
and attach their sessions again, as the client library does. The invariants:
- the daemon's connections are exactly the open ones, and nothing is written to a closed one; the
  daemon's owners of sessions and leases are the connections whose clients hold them;
- admission refuses a connection exactly at the caps (per uid, in all);
- every request is answered exactly once (an answer names a request outstanding), by its
  deadline if it waits; every push names something the client has; no ERROR without a message,
  none ``internal``; admin operations succeed for an admin and are refused to anyone else;
- the queries list what the clients were told (allocations, waits, drains, leases, clients,
  the GPUs' modes and switches).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from gpud.kit.state import ClientLink
from gpud.serving.connections import handle_payload
from gpud_client import protocol as p

from .model import ADMIN_UID, KINDS, MAX_CLIENTS, MS, USERS, Answer, Client, Part, Pending, short
from .restarts import MAX_LATE_US

if TYPE_CHECKING:
    from .world import World

PUSHES_ON_SESSIONS = (p.LockOk, p.DropLock, p.Revoked, p.LimitsChanged, p.MemLimitExceeded, p.Park)
ADMIN_KINDS = ("SET_MODE", "SET_TQ", "SCHED_ON", "SCHED_OFF", "SET_POLICY", "RESET_ALLOCS")


class Connections(Part):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.codec = p.daemon_codec()
        self.reader = p.client_codec()
        self.closed_conns: deque[ClientLink] = deque(maxlen=32)
        self.lost_now = False  # a connection ended in this event

    def answers(self) -> dict[str, Answer]:
        return {"HELLO": self.answer_hello, "FOREIGN": self.answer_foreign}

    def steps(self) -> dict[str, Callable[[], None]]:
        return {
            "connect": self.do_connect,
            "query": self.do_query,
            "misc": self.do_misc,
            "crash_client": self.do_crash_client,
        }

    def laters(self) -> dict[str, Callable[..., None]]:
        return {"reconnect": self.later_reconnect}

    def end_event(self) -> None:
        self.lost_now = False

    # --- sending and receiving ---------------------------------------------------------------

    def send(self, c: Client, msg: Any, kind: str, **info: Any) -> Pending:
        """One request through ``handle_payload``, as the listener's read loop would; then
        every connection's outbox is read by its client, and the event is checked."""
        assert c.conn is not None
        pend = Pending(msg.id, kind, msg, self.now, info=info)
        c.pending[msg.id] = pend
        self.event("client {} ({}, uid {}) -> {}", c.cid, c.kind, c.uid, msg)
        keep = handle_payload(self.daemon, c.conn, msgspec.msgpack.encode(msg), self.codec)
        if not keep:  # the listener closes it; its writer flushes what was queued
            self.lose_connection(c, "the daemon closed it", crashed=False)
        else:
            self.deliver()
        return pend

    def finish(self, c: Client, pend: Pending, answered_now: bool = True) -> None:
        """After a request that is answered at once (or only on refusal): it must be."""
        if c.pending.get(pend.rid) is pend:
            if answered_now:
                self.fail(f"client {c.cid}: {pend.kind} (id {pend.rid}) got no answer")
            del c.pending[pend.rid]  # silent success (LOCK_REQUEST, LOCK_RELEASED, MEM_UPDATE, quiet RELEASE)

    def deliver(self) -> None:
        """Each client reads what the daemon wrote to it (the writer tasks, the clients' readers)."""
        for c in self.clients:
            conn = c.conn
            if conn is None:
                continue
            if conn.pending:
                data = b"".join(conn.pending)
                conn.pending.clear()
                conn.pending_bytes -= len(data)
                for payload in c.frames.feed(data):
                    self.on_message(c, self.reader.decode(payload))
            if c.conn is conn and conn.closing and conn.client_id in self.daemon.links.connections:
                self.lose_connection(c, "dropped by the daemon", crashed=False)

    def lose_connection(self, c: Client, why: str, *, crashed: bool, keep_intents: bool = False) -> None:
        """The connection ends: the daemon frees what it held (``Daemon.close``), the writer
        flushes what was queued, and the client forgets its sessions, leases and requests."""
        conn = c.conn
        assert conn is not None
        self.deliver()  # what was written to it before: the writer flushes it
        self.daemon.close(conn)
        if conn.pending:
            self.fail(f"the daemon wrote to connection {conn.client_id} while closing it: {list(conn.pending)[:2]}")
        self.deliver()  # what its sessions' release gave others
        self.event("client {}: connection ends ({})", c.cid, why)
        self.lost_now = True
        self.forget_connection(c, keep_intents=keep_intents)
        self.closed_conns.append(conn)
        if crashed:
            self.world.owners.crashed(c)

    def forget_connection(self, c: Client, *, keep_intents: bool) -> None:
        locks, allocs = self.world.locks, self.world.allocs
        c.intents = (
            [
                {
                    "gpu": s.gpu,
                    "priority": s.priority,
                    "core_limit": s.core_limit,
                    "mem_estimate": s.mem_estimate,
                    "task_id": s.task_id,
                    "parkable": s.parkable,
                    "busy": s.state != "idle",
                }
                for s in c.sessions.values()
            ]
            if keep_intents
            else []
        )
        for s in c.sessions.values():
            locks.end_hold(s.sid)
        for lease in c.leases.values():
            locks.end_hold(lease.sid)
        # Its allocations outlive it; it is no longer told of them. A runner that comes back asks for
        # them again (the same terms), and for what it waited for (a wait dies with its connection).
        held = [a for a in (*allocs.acked.values(), *allocs.suspended.values()) if a.holder is c.conn]
        for a in held:
            a.holder = None
            a.owner.reach = a.owner.alive()  # (Allocations.connection_closed: _reach)
        for q in allocs.waits_of(c):
            allocs.wait_ended(c, q)
        waits = [q.msg for q in allocs.waits_of(c)]
        c.alloc_intents = [a.again(0, existing=self.rng.random() < 0.5) for a in held] + (waits if keep_intents else [])
        c.conn, c.greeted = None, False
        c.sessions.clear()
        c.leases.clear()
        c.pending.clear()
        c.early_parks.clear()

    # --- messages from the daemon ---------------------------------------------------------------

    def on_message(self, c: Client, msg: Any) -> None:
        w = self.world
        rid = getattr(msg, "id", None)
        if rid is not None:
            pend = c.pending.pop(rid, None)
            if pend is None:
                self.fail(f"client {c.cid} got {short(msg)}, which answers no request it has outstanding")
            self.on_answer(c, pend, msg)
            return
        if isinstance(msg, p.Error):
            self.fail(f"client {c.cid} got an ERROR for no request: {short(msg)}")
        if isinstance(msg, p.Park) and msg.session not in c.sessions and self.all_pending("ATTACH", c):
            w.parking.on_early_park(c, msg)
            return
        if isinstance(msg, PUSHES_ON_SESSIONS) and msg.session not in c.sessions:
            self.fail(
                f"client {c.cid} got {short(msg)} for a session it does not have (its sessions: {sorted(c.sessions)})"
            )
        match msg:
            case p.LockOk():
                w.locks.on_lock_ok(c, c.sessions[msg.session], msg)
            case p.DropLock():
                w.locks.on_drop(c, c.sessions[msg.session], msg)
            case p.Park():
                w.parking.on_park(c, c.sessions[msg.session], answer=True)
            case p.Revoked():
                w.locks.on_revoked(c, c.sessions[msg.session], msg)
            case p.LimitsChanged():
                w.locks.on_limits_changed(c.sessions[msg.session], msg)
            case p.MemLimitExceeded():
                w.locks.on_mem_limit_exceeded(c, c.sessions[msg.session], msg)
            case p.SchedState():
                if not 0 <= msg.gpu < len(self.gpus):
                    self.fail(f"SCHED_STATE for unknown GPU {msg.gpu}")
            case p.LeaseRevoked():
                w.leases.on_revoked(c, msg)
            case p.Preempt():
                w.preemption.on_preempt(c, msg)
            case p.PreemptWithdrawn():
                w.preemption.on_withdrawn(c, msg)
            case p.AllocRevoked():
                w.preemption.on_alloc_revoked(c, msg)
            case p.AllocChanged():
                w.preemption.on_alloc_changed(c, msg)
            case p.Goodbye():
                if not w.restarts.goodbye_expected:
                    self.fail(f"client {c.cid} got GOODBYE but the daemon is not shutting down")
            case _:
                self.fail(f"client {c.cid} got an unexpected push {short(msg)}")

    def on_answer(self, c: Client, pend: Pending, msg: Any) -> None:
        code = msg.code if isinstance(msg, p.Error) else None
        kind = pend.kind
        if kind == "ALLOCATE" and pend.deadline is not None:
            self.world.allocs.waits_ended_now.add(pend.msg.task_id)
        if isinstance(msg, p.Error):
            self.stats[f"errors ({msg.code})"] += 1
        if isinstance(msg, p.Error) and not msg.message.strip():
            self.fail(f"an ERROR without a message: {short(msg)}")
        if code == p.ErrorCode.SHUTTING_DOWN:
            if not self.daemon.shutting_down:
                self.fail(f"shutting_down answered while the daemon is not shutting down: {short(msg)}")
            return
        if code == p.ErrorCode.HELLO_REQUIRED:
            if c.greeted or kind == "HELLO":
                self.fail(f"client {c.cid}: {short(msg)} but it sent HELLO")
            return
        if code == p.ErrorCode.INTERNAL:
            self.fail(f"client {c.cid}: {kind} answered internal: {msg.message}")
        self.world.answers.get(kind, self.answer_simple)(c, pend, msg)

    def answer_hello(self, c: Client, pend: Pending, msg: Any) -> None:
        if isinstance(msg, p.Welcome):
            self.expect(
                pend.msg.version == p.PROTOCOL_VERSION and not c.greeted,
                c,
                pend,
                msg,
                "welcomed twice or wrong version",
            )
            c.greeted, c.client_id = True, msg.client_id
            self.expect([g.index for g in msg.gpus] == list(range(len(self.gpus))), c, pend, msg, "GPUs")
        else:
            expected = p.ErrorCode.INVALID if c.greeted else p.ErrorCode.VERSION
            self.expect(isinstance(msg, p.Error) and msg.code == expected, c, pend, msg, f"expected {expected}")

    def answer_simple(self, c: Client, pend: Pending, msg: Any) -> None:
        """Admin operations, queries, OOM reports."""
        w = self.world
        kind = pend.kind
        if kind in ADMIN_KINDS:
            if c.admin:
                self.expect(isinstance(msg, p.Ok), c, pend, msg, "an admin's request must succeed")
                if isinstance(pend.msg, p.ResetAllocations):
                    w.allocs.reset(pend)
                else:
                    w.locks.apply_admin(pend.msg)
            else:
                self.expect(
                    isinstance(msg, p.Error) and msg.code == p.ErrorCode.PERMISSION_DENIED,
                    c,
                    pend,
                    msg,
                    "only an admin may do this",
                )
            return
        match msg:
            case p.AllocationsReply():
                w.allocs.listed(c, pend, msg)
            case p.LeasesReply():
                w.leases.listed(c, pend, msg)
            case p.StatusReply():
                self.expect(len(msg.gpus) == len(self.gpus), c, pend, msg, "one entry per GPU")
                for g in msg.gpus:
                    gm = self.gpus[g.index]
                    self.expect(g.mode == gm.mode and g.scheduler_on == gm.enabled, c, pend, msg, "mode / switch")
                    self.expect(g.draining == (g.index in w.allocs.draining), c, pend, msg, "draining")
            case p.ClientsReply():
                ids = sorted(i.client_id for i in msg.clients)
                self.expect(ids == sorted(x.client_id for x in self.connected()), c, pend, msg, "connected clients")
                w.parking.listed(c, pend, msg)
            case p.PoliciesReply() | p.Ok():
                pass
            case _:
                self.fail(f"client {c.cid}: {short(pend.msg)} answered {short(msg)}")

    def answer_foreign(self, c: Client, pend: Pending, msg: Any) -> None:
        self.expect(
            isinstance(msg, p.Error) and msg.code == p.ErrorCode.UNKNOWN_SESSION,
            c,
            pend,
            msg,
            "another client's session is not this connection's",
        )

    # --- connecting -----------------------------------------------------------------------------------

    def hello(self, c: Client, version: int = p.PROTOCOL_VERSION) -> None:
        pend = self.send(c, p.Hello(id=c.rid(), version=version, name=f"c{c.cid}"), "HELLO")
        self.finish(c, pend)
        self.after_event()

    def connect(self, c: Client, *, greet: bool = True) -> bool:
        d = self.daemon
        refusal = d.links.admission_refusal(c.uid)
        mine = sum(1 for x in self.clients if x.conn is not None and x.uid == c.uid)
        total = sum(1 for x in self.clients if x.conn is not None)
        over = mine >= self.config.max_connections_per_uid or total >= self.config.max_connections
        if (refusal is not None) != over:
            self.fail(
                f"client {c.cid} (uid {c.uid}): admission {refusal} with {mine} of its uid's and {total} "
                f"connections open"
            )
        if refusal is not None:
            self.event("client {}: connection refused ({})", c.cid, refusal[0])
            return False
        c.conn = d.links.open((c.pid, c.uid, c.gid), frozenset(), -1, trio.CancelScope())
        c.gen += 1
        c.frames = p.FrameDecoder(p.MAX_REPLY_BYTES)
        c.greeted = False
        self.event(
            "client {} ({}, uid {}, pid {}) connects: client id {}", c.cid, c.kind, c.uid, c.pid, c.conn.client_id
        )
        self.after_event()
        if greet:
            self.hello(c)
        return True

    def new_client(self) -> Client:
        uid = self.rng.choice([ADMIN_UID, 0, *USERS, USERS[0], USERS[1]])
        cid = len(self.clients) + 1
        c = Client(cid, uid, self.rng.choice(KINDS), pid=0)
        self.world.owners.start(c)
        self.clients.append(c)
        return c

    def later_reconnect(self, cid: int) -> None:
        """The client library after the daemon came back: connect, HELLO, ask again for the
        allocations it holds and the waits it had (a runner's way), attach again."""
        c = self.clients[cid - 1]
        if c.conn is not None or not c.alive:
            return
        intents, c.intents = c.intents, []
        if not self.connect(c):
            self.later(self.now + self.rng.randrange(MS, 50 * MS), "reconnect", cid)
            c.intents = intents
            return
        again, c.alloc_intents = c.alloc_intents, []
        for m in again:
            if c.conn is None or not c.greeted:
                return
            if self.rng.random() < 0.8:
                self.world.allocs.allocate(c, msgspec.structs.replace(m, id=c.rid()))
        locks = self.world.locks
        for intent in intents:
            if c.conn is None or not c.greeted:
                return
            s = locks.attach(
                c,
                gpu=intent["gpu"],
                priority=intent["priority"],
                core_limit=intent["core_limit"],
                mem_estimate=intent["mem_estimate"],
                task_id=intent["task_id"],
                parkable=intent["parkable"],
            )
            if s is not None and intent["busy"] and c.conn is not None:
                locks.lock_request(c, s)

    # --- steps ----------------------------------------------------------------------------------------

    def do_connect(self) -> None:
        idle = [c for c in self.clients if c.conn is None]
        if len(self.clients) < MAX_CLIENTS and (not idle or self.rng.random() < 0.5):
            c = self.new_client()
        else:
            c = self.pick(idle)
            if c is None:
                return self.world.do_advance()
            if not c.alive:  # a new process of the same program
                self.world.owners.respawn(c)
        self.connect(c, greet=self.rng.random() < 0.97)

    def do_query(self) -> None:
        c = self.pick(self.connected())
        if c is None:
            return
        kind = self.rng.choice([p.Status, p.ListClients, p.ListLeases, p.ListAllocations, p.ListPolicies])
        msg = kind(id=c.rid())
        pend = self.send(c, msg, str(msg.__struct_config__.tag))
        self.finish(c, pend)
        self.after_event()

    def do_misc(self) -> None:
        r = self.rng
        roll = r.random()
        c = self.pick(self.connected())
        silent = [x for x in self.clients if x.conn is not None and not x.greeted]
        if silent:  # connected without HELLO: a request first (refused), then HELLO
            fresh = self.pick(silent)
        elif roll < 0.3 or c is None:
            fresh = self.pick([x for x in self.clients if x.conn is None and x.alive])
            if fresh is None or not self.connect(fresh, greet=False):
                return
        if silent or roll < 0.3 or c is None:
            pend = self.send(fresh, p.Attach(id=fresh.rid(), gpu=0), "ATTACH")
            self.finish(fresh, pend)
            self.after_event()
            if fresh.conn is not None:
                self.hello(fresh, version=p.PROTOCOL_VERSION if r.random() < 0.8 else 2)
        elif roll < 0.45:
            self.hello(c)  # again: refused, nothing changes
        elif roll < 0.65:  # someone else's session
            theirs = [s for x in self.clients if x is not c for s in x.sessions.values()]
            s = self.pick(theirs)
            if s is not None:
                pend = self.send(c, p.LockRequest(id=c.rid(), session=s.sid), "FOREIGN", sid=s.sid)
                self.finish(c, pend)
                self.after_event()
        elif roll < 0.85 or not c.sessions:
            pend = self.send(c, p.ReportOom(id=c.rid(), gpu=r.randrange(len(self.gpus)), task_type="ASR"), "REPORT_OOM")
            self.finish(c, pend)
            self.after_event()
        else:  # PARKED for a session that was not attached parkable: refused, nothing changes
            s = self.pick(list(c.sessions.values()))
            if not s.parkable:
                pend = self.send(
                    c, p.Parked(id=c.rid(), session=s.sid, ok=True), "PARKED", expected=p.ErrorCode.INVALID
                )
                self.finish(c, pend)
                self.after_event()

    def do_crash_client(self) -> None:
        c = self.pick([x for x in self.clients if x.conn is not None])
        if c is None:
            return
        self.lose_connection(c, "the process crashed", crashed=True)
        self.after_event()
        if c.kind == "crashy" or self.rng.random() < 0.5:  # restarted by its supervisor
            self.later(self.now + self.rng.randrange(MS, 100 * MS), "reconnect", c.cid)
            self.world.owners.respawn(c)

    # --- the checks ---------------------------------------------------------------------------------

    def check(self) -> None:
        """The daemon's connections are the open ones and it wrote to no closed one; its owners of
        sessions and leases are the connections whose clients hold them; every request that waits
        is answered by its deadline."""
        d, now = self.daemon, self.now
        conns = {c.conn.client_id: c.conn for c in self.clients if c.conn is not None}
        if d.links.connections != conns:
            self.fail(f"the daemon's connections {sorted(d.links.connections)} are not the open ones {sorted(conns)}")
        for conn in self.closed_conns:
            if conn.pending:
                self.fail(f"the daemon wrote to closed connection {conn.client_id}: {list(conn.pending)[:2]}")
        owned: dict[int, Client] = {}
        for c in self.clients:
            for sid in c.sessions:
                owned[sid] = c
            for lease in c.leases.values():
                owned[lease.sid] = c
        for c in self.clients:
            for q in c.waiting_leases():
                owned[q.info["sid"]] = c
        daemon_owned = {sid: conn.client_id for sid, conn in d.links.owners.items()}
        model_owned = {sid: c.conn.client_id for sid, c in owned.items() if c.conn is not None}
        if daemon_owned != model_owned:
            self.fail(f"the daemon's owners {daemon_owned} are not what the clients hold {model_owned}")
        retrying = self.world.restarts.retrying()
        for c in self.clients:
            for q in c.pending.values():
                late = now - q.deadline if q.deadline is not None else 0
                if late > 0 and not (q.kind == "ALLOCATE" and retrying and late <= MAX_LATE_US):
                    self.fail(
                        f"client {c.cid}: {short(q.msg)} sent at {q.sent_at} still unanswered "
                        f"{now - q.deadline} us after its deadline"
                    )
