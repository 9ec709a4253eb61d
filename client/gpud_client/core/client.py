"""The client's rules, written once and without I/O (h11's shape, as the daemon's core).

A driver feeds ``ClientCore`` what happened -- a message arrived
(``receive(msg, now)``), the connection was lost or (re)made, a slice begins or
ends, an idle sweep is due, a caller gave up -- and carries out the actions it
returns (``gpud_client.core.actions``). Every call is made under the driver's
lock (sync) or on the loop (asyncio), so the core needs no lock of its own.
Time is the driver's monotonic clock in seconds, passed in.

It must never read a clock, touch a socket, start a thread or a task, log, or
call a user hook: a hook is an action, so the driver can run it off its reader
and outside its lock. A lock granted to nobody (the slice that asked was
cancelled or gave up) is handed back at once, without ``synchronize``: no work
ran under it.
"""

from __future__ import annotations

import math
from typing import Any, assert_never

import msgspec

from gpud_client import protocol as p
from gpud_client.core.actions import (
    WAKE,
    Action,
    AllocationPush,
    ApplyMemoryLimit,
    CallAllocationListeners,
    CallOnDrop,
    CallOnLost,
    CallOnPark,
    GiveBack,
    Level,
    Log,
    Resolve,
    Send,
)
from gpud_client.core.requests import Requests, unavailable
from gpud_client.core.session import SessionState
from gpud_client.core.slices import NO_ACTIONS, SliceRules
from gpud_client.errors import DaemonUnavailable, GpudError, LockLost, MemoryLimitExceeded, ProtocolError, error_from

Answer = (
    p.Error
    | p.Welcome
    | p.Attached
    | p.LimitsSet
    | p.Allocated
    | p.AllocationsReply
    | p.LeaseResult
    | p.LeasesReply
    | p.PoliciesReply
    | p.Ok
    | p.Drained
    | p.StatusReply
    | p.ClientsReply
    | p.Contained
    | p.ProgramState
    | p.RunsReply
)


class ClientCore(SliceRules):
    def __init__(self, path: str, *, unavailable_timeout: float = 10.0, proceed_unarbitrated: bool = False) -> None:
        self.path = path
        self.unavailable_timeout = unavailable_timeout
        self.proceed_unarbitrated = proceed_unarbitrated
        self.requests = Requests()
        self.connected = False
        self.closed = False
        self.welcome: p.Welcome | None = None
        self.scheduler_on: dict[int, bool] = {}
        self.reconnects = 0
        self.revoked_leases: set[str] = set()
        self.sessions: dict[int, SessionState] = {}  # the daemon's session id -> session, this connection
        self.all: list[SessionState] = []  # every session not closed, attached now or not
        self.lock_requests: dict[int, SessionState] = {}  # LOCK_REQUEST id -> session
        self.idle_wake_at = math.inf  # when the driver runs the idle sweep next
        self.reattaching = 0  # re-attach answers still to come on this connection
        self.held: dict[str, p.Allocate] = {}  # allocations made through this client, to hold again after a reconnect
        self.reholding: set[int] = set()  # request ids of those ALLOCATEs on this connection

    # --- the connection -------------------------------------------------------

    def hello(self, name: str, labels: dict[str, str]) -> Send:
        return self.requests.encode(p.Hello(id=0, version=p.PROTOCOL_VERSION, name=name, labels=labels))

    def welcomed(self, reply: Any) -> list[Action]:
        """The answer to HELLO on a new connection. Sessions the client had are attached again."""
        if isinstance(reply, p.Error):
            raise error_from(reply.code, reply.message)
        if not isinstance(reply, p.Welcome):
            raise ProtocolError(p.ErrorCode.INVALID, f"gpud answered HELLO with {type(reply).__name__}")
        first = self.welcome is None
        self.welcome, self.connected = reply, True
        self.requests.max_frame_bytes = reply.max_frame_bytes
        self.scheduler_on = {g.index: g.scheduler_on for g in reply.gpus}
        if first:
            return NO_ACTIONS
        actions: list[Action] = []
        for s in self.all:
            s.attach_error = None  # tried afresh on every connection
            actions.append(self.requests.start(attach_msg(s), None, s))
        self.reattaching = len(self.all)
        for msg in self.held.values():  # told of their preemption again: held by this connection now
            send = self.requests.start(msgspec.structs.replace(msg, existing=True, wait_ms=0), None, None)
            self.reholding.add(send.msg.id)  # type: ignore[attr-defined]
            actions.append(send)
        return [*actions, *self._back(), WAKE]

    def _back(self) -> list[Action]:
        """Once every session has its re-attach answer, the reconnect is done (and counted)."""
        if self.reattaching:
            return NO_ACTIONS
        self.reconnects += 1
        failed = sum(1 for s in self.all if s.attach_error is not None)
        return [
            Log(
                Level.INFO,
                f"reconnected to gpud at {self.path}; {len(self.all) - failed} session(s) re-attached"
                + (f", {failed} refused" if failed else ""),
            )
        ]

    def connection_lost(self, why: str) -> list[Action]:
        """The connection ended. Requests fail; sessions wait for the next one; a held lock is lost."""
        if not self.connected:
            return NO_ACTIONS
        self.connected, self.reattaching = False, 0
        self.reholding.clear()
        actions = self.requests.fail_all(unavailable(self.path, why))
        self.lock_requests.clear()
        for s in self.sessions.values():
            if s.state in ("holding", "releasing") and not s.entering:  # a grant no slice used yet is no loss
                actions += self._lose(s, f"the connection to gpud was lost ({why})")
            s.state, s.drop_pending, s.id, s.error = "idle", None, 0, None
        self.sessions.clear()
        actions.append(Log(Level.WARNING, f"lost connection to gpud at {self.path}: {why}"))
        actions.append(WAKE)
        return actions

    def close(self) -> list[Action]:
        """The application closes the client: requests fail, sessions end; no lock counts as lost."""
        self.closed, self.connected = True, False
        actions = self.requests.fail_all(GpudError("the client is closed"))
        for s in self.all:
            s.closed, s.state, s.drop_pending, s.id = True, "idle", None, 0
        self.all.clear()
        self.sessions.clear()
        self.lock_requests.clear()
        return [*actions, WAKE]

    # --- requests -------------------------------------------------------------

    def start(self, msg: Any, waiter: Any) -> Send:
        """A request to send; its answer resolves ``waiter``. Refused unless connected."""
        self._require_connection()
        return self.requests.start(msg, waiter)

    def finish(self, rid: int) -> Any:
        return self.requests.finish(rid)

    def abandon(self, rid: int) -> list[Action]:
        """The caller of ``rid`` gave up; a lease or a session it was already given goes back now."""
        req = self.requests.abandon(rid)
        return NO_ACTIONS if req is None else self._unwanted(req.answer, req.session, bound=True)

    def attach(self, s: SessionState, waiter: Any) -> Send:
        self._require_connection()
        return self.requests.start(attach_msg(s), waiter, s)

    def _require_connection(self) -> None:
        if self.closed:
            raise GpudError("the client is closed")
        if not self.connected:
            raise DaemonUnavailable(f"not connected to gpud at {self.path} (reconnecting)")

    def _unwanted(self, answer: Any, session: SessionState | None, *, bound: bool) -> list[Action]:
        """What a caller who gave up was given anyway goes straight back. ``bound``: an ATTACHED that
        was bound before the caller gave up; the session's id now (a reconnect may have changed it)."""
        if isinstance(answer, p.LeaseResult) and answer.acquired and answer.lease_id is not None:
            return self.send(p.Release(id=0, lease_id=answer.lease_id, quiet=True))
        if isinstance(answer, p.Attached) and session is not None:
            sid = session.id if bound else answer.session
            self.sessions.pop(session.id, None)
            if session in self.all:
                self.all.remove(session)
            session.closed, session.id = True, 0  # a re-attach still in flight is detached when answered
            return self.send(p.Detach(id=0, session=sid)) if sid else NO_ACTIONS
        return NO_ACTIONS

    # --- what arrives ---------------------------------------------------------

    def receive(self, msg: p.DaemonMessage, now: float) -> list[Action]:
        match msg:
            case p.LockOk():
                return self._granted(msg, now)
            case p.DropLock():
                return self._drop(msg)
            case p.Revoked():
                return self._revoked(msg)
            case p.Park(session=sid):
                if (s := self.sessions.get(sid)) is None:
                    return NO_ACTIONS
                if s.on_park is None:
                    return self.send(p.Parked(id=0, session=sid, ok=False, message="this session cannot park"))
                return [CallOnPark(s)]
            case p.LimitsChanged(session=sid, core_limit=core, mem_limit=mem):
                s = self.sessions.get(sid)
                return NO_ACTIONS if s is None else self._limits(s, core, mem)
            case p.MemLimitExceeded(session=sid, used_bytes=used, limit_bytes=limit):
                if (s := self.sessions.get(sid)) is not None:
                    s.mem_error = MemoryLimitExceeded(sid, used, limit)
                return NO_ACTIONS
            case p.LeaseRevoked(lease_id=lease_id, reason=reason):
                self.revoked_leases.add(lease_id)
                return [Log(Level.WARNING, f"gpud released lease {lease_id} by force ({reason})")]
            case p.Goodbye(reason=reason):
                return [Log(Level.INFO, f"gpud is shutting down ({reason}); reconnecting when it is back")]
            case p.SchedState(gpu=gpu, on=on):
                self.scheduler_on[gpu] = on
                return NO_ACTIONS
            case p.AllocRevoked(task_id=task, gone=True):
                self.held.pop(task, None)
                return [Log(Level.INFO, describe_push(msg)), CallAllocationListeners(msg)]
            case p.Preempt() | p.PreemptWithdrawn() | p.AllocRevoked() | p.AllocChanged():
                return [Log(Level.INFO, describe_push(msg)), CallAllocationListeners(msg)]
            case p.Error(id=rid) if rid is not None and rid in self.lock_requests:
                s = self.lock_requests.pop(rid)
                s.error = error_from(msg.code, msg.message)
                if s.state == "waiting":
                    s.state = "idle"
                return [WAKE]
            case (
                p.Error()
                | p.Welcome()
                | p.Attached()
                | p.LimitsSet()
                | p.Allocated()
                | p.AllocationsReply()
                | p.LeaseResult()
                | p.LeasesReply()
                | p.PoliciesReply()
                | p.Ok()
                | p.Drained()
                | p.StatusReply()
                | p.ClientsReply()
                | p.Contained()
                | p.ProgramState()
                | p.RunsReply()
            ):
                return self._answered(msg)
            case _:
                assert_never(msg)

    def _answered(self, msg: Answer) -> list[Action]:
        req = self.requests.answer(msg.id, msg) if msg.id is not None else None
        if req is None:
            if msg.id is not None and (late := self.requests.late(msg.id)) is not None:
                return self._unwanted(msg, late.session, bound=False)  # its caller gave up: a late grant goes back
            if isinstance(msg, p.Error):
                return [Log(Level.WARNING, f"gpud reported {msg.code}: {msg.message}")]
            return NO_ACTIONS
        actions: list[Action] = NO_ACTIONS
        if msg.id in self.reholding and isinstance(req.msg, p.Allocate):
            self.requests.pending.pop(msg.id, None)
            return self._reheld(req.msg, msg)
        if isinstance(req.msg, p.Allocate) and isinstance(msg, p.Allocated):
            self.held[msg.task_id] = req.msg
        elif isinstance(req.msg, p.Free) and isinstance(msg, p.Ok):
            self.held.pop(req.msg.task_id, None)
        if req.session is not None:
            actions = self._attach_answered(req.session, msg, reattach=req.waiter is None)
        if req.waiter is None:  # the core's own request (a re-attach): nobody collects it
            self.requests.pending.pop(msg.id, None)  # type: ignore[arg-type]
            self.reattaching -= 1
            return [*actions, *self._back()]
        return [*actions, Resolve(req.waiter)]

    def _reheld(self, asked: p.Allocate, msg: Answer) -> list[Action]:
        """The answer to holding an allocation again after a reconnect: gone, its holder is told so."""
        self.reholding.discard(msg.id)
        if not isinstance(msg, p.Error):
            return NO_ACTIONS
        self.held.pop(asked.task_id, None)
        lost = p.AllocRevoked(task_id=asked.task_id, reason=p.PreemptReason.LOST, state=p.AllocState.RUNNING, gone=True)
        return [Log(Level.WARNING, f"task {asked.task_id}: {msg.message}"), CallAllocationListeners(lost)]

    def _attach_answered(self, s: SessionState, msg: Any, *, reattach: bool) -> list[Action]:
        if isinstance(msg, p.Attached):
            if s.closed:  # closed while its re-attach was on its way
                return self.send(p.Detach(id=0, session=msg.session))
            changed = msg.mem_limit != s.mem_limit
            s.id, s.gpu, s.memory_total_bytes = msg.session, msg.gpu, msg.memory_total_bytes
            s.state, s.drop_pending, s.mem_reported, s.attach_error, s.error = "idle", None, None, None, None
            self.sessions[s.id] = s
            self.scheduler_on[msg.gpu] = msg.scheduler_on
            if s not in self.all:
                self.all.append(s)
            return [*self._limits(s, msg.core_limit, msg.mem_limit, changed), WAKE]
        if reattach and isinstance(msg, p.Error):
            s.attach_error = GpudError(
                f"the session on GPU {s.gpu_ref!r} could not be re-attached after a reconnect: {msg.code}: {msg.message}"
            )
            return [Log(Level.WARNING, str(s.attach_error)), WAKE]
        return NO_ACTIONS

    def _limits(self, s: SessionState, core: int, mem: int | None, changed: bool | None = None) -> list[Action]:
        changed = mem != s.mem_limit if changed is None else changed
        s.core_limit, s.mem_limit = core, mem
        if s.framework_hooks and (mem is not None or changed):
            return [ApplyMemoryLimit(s, mem)]
        return NO_ACTIONS

    def _granted(self, msg: p.LockOk, now: float) -> list[Action]:
        s = self.sessions.get(msg.session)
        if s is None:
            return NO_ACTIONS
        self.lock_requests.pop(s.request_id, None)
        s.state, s.grant, s.drop_pending = "holding", msg.grant, None
        s.grants += 1
        s.last_used = now
        if not (s.entering or s.in_slice):  # the slice that asked is gone
            return self._hand_back(s)
        return [WAKE]

    def _drop(self, msg: p.DropLock) -> list[Action]:
        s = self.sessions.get(msg.session)
        if s is None or s.state != "holding" or s.grant != msg.grant:
            return NO_ACTIONS
        s.drops += 1
        s.drop_pending = msg.reason
        if s.on_drop is not None:
            return [CallOnDrop(s, msg.reason, msg.grant)]
        return self.drop_told(s, msg.grant)

    def drop_told(self, s: SessionState, grant: int) -> list[Action]:
        """After ``on_drop``: a lock no slice uses is given back now; a running slice gives it at its end."""
        if s.state != "holding" or s.grant != grant or s.drop_pending is None or s.in_slice or s.entering:
            return NO_ACTIONS
        if s.synchronize is None:
            return self._hand_back(s)
        s.state = "releasing"
        return [GiveBack(s, grant)]

    def parked(self, s: SessionState, ok: bool, message: str) -> list[Action]:
        """The session's answer to PARK; nothing when it is not attached (a re-attach counts its
        memory as on the GPU until the next PARK is answered)."""
        if not s.id or s.closed:
            return NO_ACTIONS
        return self.send(p.Parked(id=0, session=s.id, ok=ok, message=message[:512]))

    def _revoked(self, msg: p.Revoked) -> list[Action]:
        s = self.sessions.get(msg.session)
        if s is None or s.grant != msg.grant or s.state not in ("holding", "releasing"):
            return NO_ACTIONS  # a stale grant's revocation changes nothing
        s.state, s.drop_pending = "idle", None
        s.revocations += 1
        return [*self._lose(s, f"gpud revoked it ({msg.reason})"), WAKE]

    def _lose(self, s: SessionState, why: str) -> list[Action]:
        """A warning only when work ran under it and no ``on_lost`` hook is there to say what its
        owner made of it (a run pauses its program at once: "ran unarbitrated" would be untrue); a
        lock kept between slices goes without harm."""
        err = LockLost(s.id, s.gpu, why, in_use=s.in_slice)
        if s.in_slice:
            s.lost = err
        warn = s.in_slice and s.on_lost is None
        return [Log(Level.WARNING if warn else Level.INFO, str(err)), CallOnLost(s, err)]


def describe_push(msg: AllocationPush) -> str:
    """One line for the log: what gpud did to which allocation."""
    match msg:
        case p.Preempt(task_id=task, whole=True):
            return f"gpud preempts task {task} ({msg.reason}, for {msg.by}): {msg.recovery} within {msg.grace_s:g} s"
        case p.Preempt(task_id=task):
            return f"gpud takes GPUs {msg.gpus} back from task {task} ({msg.reason}, for {msg.by}) within {msg.grace_s:g} s"
        case p.PreemptWithdrawn(task_id=task):
            return f"gpud withdrew the preemption of task {task}"
        case p.AllocRevoked(task_id=task, gone=gone):
            return f"gpud took the allocation of task {task} back ({msg.reason}): " + (
                "it is gone" if gone else f"it is {msg.state}"
            )
        case p.AllocChanged(change=change, allocation=a):
            return f"the allocation of task {a.task_id} {change}: GPUs {a.gpus}"
        case _:
            assert_never(msg)


def attach_msg(s: SessionState) -> p.Attach:
    return p.Attach(
        id=0,
        gpu=s.gpu_ref,
        priority=s.priority,
        core_limit=s.core_limit,
        mem_limit=s.mem_limit,
        mem_estimate=s.mem_estimate,
        task_id=s.task_id,
        parkable=s.on_park is not None,
    )
