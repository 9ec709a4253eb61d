"""The client core's rules on fake time, against a scripted daemon: no socket, no thread, no sleep.

``Script`` plays gpud around one ``ClientCore``: it says WELCOME, attaches
sessions, pushes daemon messages (through the wire codec, so they are valid
messages) and keeps every message the client sent, decoded from the framed
bytes of its ``Send`` actions. Each test states one rule in its name. A test
that names a bug failed before its fix. The last part drives the core with seeded random events and checks the
invariants after every one.
"""

from __future__ import annotations

import ast
import math
import random
import struct
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import pytest

import gpud_client
from gpud_client import protocol as p
from gpud_client.core import HOLD, UNARBITRATED, ClientCore, SessionState, reconnect_delay
from gpud_client.core.actions import (
    WAKE,
    Action,
    ApplyMemoryLimit,
    ArmIdle,
    CallAllocationListeners,
    CallOnDrop,
    CallOnLost,
    GiveBack,
    Hook,
    Level,
    Log,
    Resolve,
    Send,
)
from gpud_client.core.messages import acquire_msg, allocate_msg
from gpud_client.errors import (
    DaemonUnavailable,
    GpudError,
    LockLost,
    MemoryLimitExceeded,
    PermissionDenied,
    ProtocolError,
)

PATH = "/run/gpud/test.sock"
MiB = 2**20
GiB = 2**30
GPUS = [
    p.GpuInfo(index=i, uuid=f"GPU-{i}", name="fake", memory_total_bytes=16 * GiB, simulated=True, scheduler_on=True)
    for i in range(2)
]
_TO_DAEMON = p.daemon_codec()  # decodes what the client sends
_TO_CLIENT = p.client_codec()  # decodes what the daemon sends
_DAEMON_ENCODER = msgspec.msgpack.Encoder()


class Waiter:
    """What a driver waits on (an Event, a Future); the core only names it back in ``Resolve``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Waiter({self.name})"


def decode(send: Send) -> Any:
    """What gpud reads from the bytes of ``send``: one whole frame holding ``send.msg``."""
    (length,) = struct.unpack(">I", send.data[: p.HEADER_BYTES])
    assert length == len(send.data) - p.HEADER_BYTES
    msg = _TO_DAEMON.decode(send.data[p.HEADER_BYTES :])
    assert msg == send.msg
    return msg


def wire(msg: msgspec.Struct) -> Any:
    """A daemon message as the client's reader gets it: encoded and decoded, so it must be valid."""
    return _TO_CLIENT.decode(_DAEMON_ENCODER.encode(msg))


def no_id(msgs: Iterable[Any]) -> list[Any]:
    """Messages with their request ids zeroed, to compare them with expected ones."""
    return [msgspec.structs.replace(m, id=0) if hasattr(m, "id") else m for m in msgs]


def effects(actions: list[Action]) -> list[Action]:
    """The actions other than sends, wake-ups, resolutions and logs."""
    return [a for a in actions if isinstance(a, (CallOnDrop, GiveBack, CallOnLost, ApplyMemoryLimit, ArmIdle))]


def _on_drop(reason: p.DropReason) -> None:
    raise AssertionError("the core never calls a hook")


def _synchronize() -> None:
    raise AssertionError("the core never calls a hook")


def new_session(
    gpu: int | str = 0,
    *,
    idle_release: float | None = None,
    on_drop: bool = False,
    synchronize: bool = False,
    framework_hooks: bool = False,
    mem_limit: int | None = None,
    priority: int = 0,
) -> SessionState:
    """A session as a driver builds it; the hooks are only there for the core to see they are set."""
    return SessionState(
        gpu,
        priority=priority,
        idle_release=idle_release,
        core_limit=100,
        mem_limit=mem_limit,
        mem_estimate=None,
        memory_probe=None,
        framework_hooks=framework_hooks,
        on_drop=_on_drop if on_drop else None,
        synchronize=_synchronize if synchronize else None,
    )


class Script:
    """A scripted gpud around one ``ClientCore``; ``sent`` is what the client sent, decoded."""

    def __init__(
        self,
        *,
        unavailable_timeout: float = 10.0,
        proceed_unarbitrated: bool = False,
        max_frame_bytes: int = p.MAX_FRAME_BYTES,
    ) -> None:
        self.core = ClientCore(PATH, unavailable_timeout=unavailable_timeout, proceed_unarbitrated=proceed_unarbitrated)
        self.now = 0.0
        self.sent: list[Any] = []  # since the last take()
        self.history: list[Any] = []  # all of it, HELLO included
        self.max_frame_bytes = max_frame_bytes
        self.client_id = 0
        self.next_session = 1
        self.next_grant = 1
        self.connect()

    def do(self, actions: list[Action]) -> list[Action]:
        """Keep what the client sends; the actions go back to the test."""
        for a in actions:
            if isinstance(a, Send):
                self.sent.append(decode(a))
                self.history.append(self.sent[-1])
        return actions

    def record(self, send: Send) -> Any:
        """A request a test sends itself (the driver would write it): decoded, and kept in the history."""
        msg = decode(send)
        self.history.append(msg)
        return msg

    def take(self) -> list[Any]:
        """What the client sent since the last take."""
        out, self.sent = self.sent, []
        return out

    def connect(self) -> list[Action]:
        """A new connection: HELLO, then WELCOME."""
        self.client_id += 1
        hello = self.record(self.core.hello("test", {}))
        welcome = p.Welcome(
            id=hello.id,
            client_id=self.client_id,
            version=p.PROTOCOL_VERSION,
            gpus=GPUS,
            max_frame_bytes=self.max_frame_bytes,
        )
        return self.do(self.core.welcomed(wire(welcome)))

    def lose(self, why: str = "connection reset by peer") -> list[Action]:
        return self.do(self.core.connection_lost(why))

    def push(self, msg: msgspec.Struct) -> list[Action]:
        return self.do(self.core.receive(wire(msg), self.now))

    def attached(self, attach: p.Attach, session: int | None = None) -> p.Attached:
        """gpud's ATTACHED for ``attach``: the next session id, or ``session``."""
        if session is None:
            session, self.next_session = self.next_session, self.next_session + 1
        return p.Attached(
            id=attach.id,
            session=session,
            gpu=attach.gpu if isinstance(attach.gpu, int) else 0,
            scheduler_on=True,
            core_limit=attach.core_limit,
            mem_limit=attach.mem_limit,
            memory_total_bytes=16 * GiB,
        )

    def session(self, gpu: int | str = 0, **fields: Any) -> SessionState:
        """A session attached the way ``Client.session`` does it: ATTACH, ATTACHED, finish."""
        s = new_session(gpu, **fields)
        waiter = Waiter("attach")
        attach = self.record(self.core.attach(s, waiter))
        assert Resolve(waiter) in self.push(self.attached(attach))
        assert self.core.finish(attach.id) == self.attached(attach, s.id)
        self.take()
        return s

    def reattach(self) -> dict[SessionState, p.Attach]:
        """A reconnect: the ATTACH the core sends for each session, by session."""
        self.connect()
        attaches = [m for m in self.take() if isinstance(m, p.Attach)]
        pending = self.core.requests.pending
        return {pending[a.id].session: a for a in attaches}  # type: ignore[misc]

    def answer_reattach(self) -> None:
        for attach in self.reattach().values():
            self.push(self.attached(attach))

    def grant(self, s: SessionState) -> int:
        g, self.next_grant = self.next_grant, self.next_grant + 1
        self.push(p.LockOk(session=s.id, grant=g))
        return g

    def request(self, s: SessionState) -> p.LockRequest:
        """A slice of ``s`` begins and asks for the lock: its LOCK_REQUEST."""
        assert self.core.begin_slice(s) is False
        step, actions = self.core.lock_step(s, self.now)
        assert step is None
        before = len(self.sent)
        self.do(actions)
        assert len(self.sent) == before + 1
        req = self.sent.pop()
        assert isinstance(req, p.LockRequest) and req.session == s.id
        return req

    def hold(self, s: SessionState) -> int:
        """A slice of ``s`` takes the lock (begin_slice, LOCK_REQUEST, LOCK_OK, HOLD); the grant."""
        self.request(s)
        g = self.grant(s)
        assert self.core.lock_step(s, self.now) == (HOLD, [])
        assert s.in_slice and s.holding
        self.take()
        return g

    def keep(self, s: SessionState) -> int:
        """``s`` holds the lock between slices (one slice ran and ended); the grant."""
        g = self.hold(s)
        self.do(self.core.end_slice(s, self.now))
        return g


def state(s: SessionState) -> str:
    """``s.state``, read afresh (mypy keeps an earlier assert's narrowing of the attribute)."""
    return s.state


def lock_released(s: SessionState, grant: int) -> p.LockReleased:
    return p.LockReleased(id=0, session=s.id, grant=grant)


# --- requests -----------------------------------------------------------------


def test_request_ids_are_unique_for_the_clients_life_never_reset_per_connection() -> None:
    d = Script()
    a = d.session()
    for _ in range(3):
        d.record(d.core.start(p.Status(id=0), Waiter("status")))
        d.keep(a)
        d.lose()
        d.answer_reattach()
    ids = [m.id for m in d.history]
    assert len(ids) > 10 and sum(isinstance(m, p.Hello) for m in d.history) == 4
    assert len(set(ids)) == len(ids) and ids == sorted(ids)


def test_an_answer_resolves_only_its_own_request() -> None:
    d = Script()
    a, b = Waiter("a"), Waiter("b")
    ra = decode(d.core.start(p.Status(id=0), a)).id
    rb = decode(d.core.start(p.ListLeases(id=0), b)).id
    reply = p.LeasesReply(id=rb, leases=[])
    assert d.push(reply) == [Resolve(b)]
    assert d.core.finish(rb) == reply
    assert d.core.requests.pending[ra].answer is None
    assert d.push(p.Ok(id=rb + 100)) == []  # an id nobody waits for resolves nothing
    assert list(d.core.requests.pending) == [ra]


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (p.ErrorCode.INVALID, ProtocolError),
        (p.ErrorCode.UNKNOWN_GPU, ProtocolError),
        (p.ErrorCode.PERMISSION_DENIED, PermissionDenied),
    ],
)
def test_finish_raises_the_daemons_error_with_its_code(code: p.ErrorCode, error: type[ProtocolError]) -> None:
    d = Script()
    rid = decode(d.core.start(p.SchedOff(id=0), w := Waiter("sched"))).id
    assert d.push(p.Error(id=rid, code=code, message="no such thing")) == [Resolve(w)]
    with pytest.raises(error, match="no such thing") as exc:
        d.core.finish(rid)
    assert type(exc.value) is error and exc.value.code == code
    assert rid not in d.core.requests.pending


def test_a_lost_connection_fails_every_pending_request_with_daemon_unavailable() -> None:
    d = Script()
    w1, w2, w3 = Waiter("1"), Waiter("2"), Waiter("3")
    r1 = decode(d.core.start(p.Status(id=0), w1)).id
    r2 = decode(d.core.start(acquire_msg(0, "ASR"), w2)).id
    r3 = decode(d.core.start(p.ListLeases(id=0), w3)).id
    d.push(reply := p.LeasesReply(id=r3, leases=[]))  # answered, not collected yet: keeps its answer
    actions = d.lose("connection reset by peer")
    assert [a for a in actions if isinstance(a, Resolve)] == [Resolve(w1), Resolve(w2)]
    for rid in (r1, r2):
        with pytest.raises(DaemonUnavailable, match=f"lost connection to gpud at {PATH}: connection reset by peer"):
            d.core.finish(rid)
    assert d.core.finish(r3) == reply
    assert d.core.requests.pending == {}


def test_requests_are_refused_while_disconnected_or_closed() -> None:
    d = Script()
    d.lose()
    with pytest.raises(DaemonUnavailable, match="reconnecting"):
        d.core.start(p.Status(id=0), Waiter("status"))
    with pytest.raises(DaemonUnavailable):
        d.core.attach(new_session(), Waiter("attach"))
    assert d.core.send(p.Release(id=0, lease_id="L1")) == []
    d.core.close()
    with pytest.raises(GpudError, match="closed"):
        d.core.start(p.Status(id=0), Waiter("status"))
    assert d.core.requests.pending == {} and d.take() == []


def test_the_cores_own_reattach_requests_are_not_left_pending() -> None:
    d = Script()
    a, b, c = d.session(), d.session(), d.session()
    d.lose()
    attaches = d.reattach()
    assert set(attaches) == {a, b, c}
    assert all(d.core.requests.pending[m.id].waiter is None for m in attaches.values())
    d.push(d.attached(attaches[a]))
    d.push(p.Error(id=attaches[b].id, code=p.ErrorCode.UNKNOWN_GPU, message="GPU 0 is gone"))
    assert list(d.core.requests.pending) == [attaches[c].id]
    d.lose()  # c's is still on its way
    assert d.core.requests.pending == {}


# --- leases given up on ---------------------------------------------------------


def lease_result(rid: int, lease_id: str | None, status: p.LeaseStatus = p.LeaseStatus.ACQUIRED) -> p.LeaseResult:
    reason = None if status == p.LeaseStatus.ACQUIRED else p.LeaseReason.GPU_BUSY
    return p.LeaseResult(id=rid, status=status, gpu=0, task_type="ASR", lease_id=lease_id, reason=reason)


def test_a_lease_granted_after_its_caller_gave_up_is_released_quietly() -> None:
    d = Script()
    w = Waiter("lease")
    rid = decode(d.core.start(acquire_msg(0, "ASR"), w)).id
    assert d.core.abandon(rid) == []
    assert rid not in d.core.requests.pending
    d.take()
    actions = d.push(lease_result(rid, "L1"))
    assert Resolve(w) not in actions
    assert no_id(d.take()) == [p.Release(id=0, lease_id="L1", quiet=True)]
    assert d.core.requests.abandoned == {}


def test_a_lease_granted_just_before_its_caller_gave_up_is_released_by_abandon() -> None:
    d = Script()
    w = Waiter("lease")
    rid = decode(d.core.start(acquire_msg(0, "ASR"), w)).id
    assert d.push(lease_result(rid, "L1")) == [Resolve(w)]
    d.take()
    actions = d.core.abandon(rid)
    assert no_id(decode(a) for a in actions if isinstance(a, Send)) == [p.Release(id=0, lease_id="L1", quiet=True)]
    assert rid not in d.core.requests.pending and d.core.requests.abandoned == {}


@pytest.mark.parametrize("status", [p.LeaseStatus.SKIPPED, p.LeaseStatus.FALLBACK_CPU])
def test_a_lease_not_granted_after_its_caller_gave_up_sends_nothing(status: p.LeaseStatus) -> None:
    d = Script()
    rid = decode(d.core.start(acquire_msg(0, "ASR"), Waiter("lease"))).id
    d.core.abandon(rid)
    d.take()
    assert d.push(lease_result(rid, None, status)) == []
    assert d.take() == [] and d.core.requests.abandoned == {}


def test_an_acquire_abandoned_before_a_reconnect_cannot_swallow_a_later_answer() -> None:
    d = Script()
    r1 = decode(d.core.start(acquire_msg(0, "ASR"), Waiter("old"))).id
    d.core.abandon(r1)
    d.lose()
    assert d.core.requests.abandoned == {}  # what it would have held died with the connection
    d.connect()
    w2 = Waiter("new")
    r2 = decode(d.core.start(acquire_msg(0, "ASR"), w2)).id
    assert r2 != r1
    d.take()
    assert d.push(lease_result(r2, "L2")) == [Resolve(w2)]
    assert d.core.finish(r2).lease_id == "L2"
    assert d.push(lease_result(r1, "L1")) == []  # even a stray answer to the old id gives nothing back
    assert d.take() == []


def test_a_session_attached_after_its_caller_gave_up_is_detached_and_not_kept() -> None:
    d = Script()
    s = new_session()
    w = Waiter("attach")
    attach = decode(d.core.attach(s, w))
    assert d.core.abandon(attach.id) == []
    d.take()
    actions = d.push(d.attached(attach, session=7))
    assert Resolve(w) not in actions
    assert no_id(d.take()) == [p.Detach(id=0, session=7)]
    assert s.closed and s not in d.core.all and 7 not in d.core.sessions
    d.lose()
    d.connect()
    assert [m for m in d.take() if isinstance(m, p.Attach)] == []  # not re-attached either


def test_a_session_attached_just_before_its_caller_gave_up_is_detached_by_abandon() -> None:
    d = Script()
    s = new_session()
    attach = decode(d.core.attach(s, w := Waiter("attach")))
    assert Resolve(w) in d.push(d.attached(attach, session=7))
    d.take()
    actions = d.core.abandon(attach.id)
    assert no_id(decode(a) for a in actions if isinstance(a, Send)) == [p.Detach(id=0, session=7)]
    assert s.closed and s not in d.core.all and 7 not in d.core.sessions


def test_an_attach_given_up_after_a_reconnect_detaches_the_sessions_current_id() -> None:
    d = Script()
    other = d.session()  # session 1
    s = new_session()
    attach = decode(d.core.attach(s, Waiter("attach")))
    d.push(d.attached(attach, session=2))  # answered; its caller has not collected it yet
    d.lose()
    attaches = d.reattach()  # a restarted gpud numbers sessions afresh
    d.push(d.attached(attaches[other], session=2))
    d.push(d.attached(attaches[s], session=3))
    d.take()
    d.do(d.core.abandon(attach.id))  # the caller gives up only now
    assert no_id(d.take()) == [p.Detach(id=0, session=3)]
    assert d.core.sessions == {2: other}


# --- sessions and locks -----------------------------------------------------------


def test_begin_slice_takes_the_fast_path_while_the_lock_is_kept() -> None:
    d = Script()
    s = d.session()
    d.keep(s)
    d.take()
    assert d.core.begin_slice(s) is True
    assert s.in_slice and not s.entering and d.take() == []


@pytest.mark.parametrize("where", ["in a slice", "entering"])
def test_slices_of_one_session_do_not_nest(where: str) -> None:
    d = Script()
    s = d.session()
    if where == "in a slice":
        d.hold(s)
    else:
        d.request(s)
    before = (s.state, s.in_slice, s.entering, s.request_id)
    with pytest.raises(GpudError, match="do not nest"):
        d.core.begin_slice(s)
    assert (s.state, s.in_slice, s.entering, s.request_id) == before
    assert d.take() == []


def test_a_closed_session_refuses_slices() -> None:
    d = Script()
    s = d.session()
    sid = s.id
    assert d.core.detach(s) == sid and s.closed  # the driver sends DETACH for it
    with pytest.raises(GpudError, match="closed"):
        d.core.begin_slice(s)
    assert not s.entering and not s.in_slice


def test_a_memory_error_is_raised_once_at_the_next_begin_slice_and_changes_nothing_else() -> None:
    d = Script()
    s = d.session()
    g = d.keep(s)
    d.push(p.MemLimitExceeded(session=s.id, used_bytes=9 * GiB, limit_bytes=8 * GiB))
    with pytest.raises(MemoryLimitExceeded):
        d.core.begin_slice(s)
    assert s.holding and s.grant == g and not s.in_slice and not s.entering
    assert d.core.begin_slice(s) is True


def test_lock_step_sends_one_lock_request_then_waits_while_waiting() -> None:
    d = Script()
    s = d.session()
    req = d.request(s)
    assert s.state == "waiting" and d.core.lock_requests == {req.id: s}
    for t in (0.5, 5.0, 500.0):
        assert d.core.lock_step(s, t) == (None, [])
    assert s.state == "waiting"


def test_lock_ok_lets_the_waiting_slice_hold() -> None:
    d = Script()
    s = d.session()
    d.request(s)
    assert d.push(p.LockOk(session=s.id, grant=5)) == [WAKE]
    assert d.core.lock_step(s, d.now) == (HOLD, [])
    assert s.holding and s.grant == 5 and s.in_slice and not s.entering and s.grants == 1
    assert d.core.lock_requests == {}


def test_a_refused_lock_request_raises_at_the_waiting_slice() -> None:
    d = Script()
    s = d.session()
    req = d.request(s)
    assert d.push(p.Error(id=req.id, code=p.ErrorCode.LIMIT_REACHED, message="max_lock_queue")) == [WAKE]
    with pytest.raises(ProtocolError, match="max_lock_queue") as exc:
        d.core.lock_step(s, d.now)
    assert exc.value.code == p.ErrorCode.LIMIT_REACHED
    assert s.state == "idle" and not s.entering and d.core.lock_requests == {}
    assert d.core.cancel_entry(s) == []  # what the driver calls after the raise
    d.take()
    d.request(s)  # the next slice asks afresh


def test_a_refusal_from_a_lost_connection_is_not_raised_on_the_next_one() -> None:
    d = Script()
    s = d.session()
    req = d.request(s)
    d.core.cancel_entry(s)  # the slice gave up; its request stays queued
    d.push(p.Error(id=req.id, code=p.ErrorCode.LIMIT_REACHED, message="max_lock_queue"))
    d.lose()
    d.answer_reattach()
    d.take()
    d.request(s)  # a slice on the new connection asks for the lock instead of raising the old refusal


def test_while_disconnected_a_slice_waits_at_most_unavailable_timeout_then_raises() -> None:
    d = Script(unavailable_timeout=5.0)
    s = d.session()
    d.lose()
    d.take()
    assert d.core.begin_slice(s) is False
    assert d.core.lock_step(s, 100.0) == (5.0, [])
    assert d.core.lock_step(s, 103.0) == (2.0, [])
    with pytest.raises(DaemonUnavailable, match="unreachable for 5.0 s"):
        d.core.lock_step(s, 105.0)
    assert not s.entering and not s.in_slice and d.take() == []


def test_while_disconnected_a_slice_runs_unarbitrated_when_allowed() -> None:
    d = Script(unavailable_timeout=5.0, proceed_unarbitrated=True)
    s = d.session()
    d.lose()
    d.core.begin_slice(s)
    assert d.core.lock_step(s, 100.0) == (5.0, [])
    step, actions = d.core.lock_step(s, 105.0)
    assert step == UNARBITRATED
    assert [a for a in actions if isinstance(a, Log) and a.level == Level.WARNING]
    assert not s.entering and not s.in_slice and s.state == "idle"
    d.core.begin_slice(s)  # the next slice waits for gpud afresh
    assert d.core.lock_step(s, 200.0) == (5.0, [])


def test_a_slice_waiting_for_gpud_asks_for_the_lock_once_its_session_is_reattached() -> None:
    d = Script(unavailable_timeout=5.0)
    s = d.session()
    d.lose()
    d.core.begin_slice(s)
    assert d.core.lock_step(s, 0.0) == (5.0, [])
    [attach] = d.reattach().values()
    assert d.core.lock_step(s, 1.0) == (4.0, [])  # connected, not attached yet
    d.push(d.attached(attach))
    step, actions = d.core.lock_step(s, 2.0)
    assert step is None and no_id(decode(a) for a in actions if isinstance(a, Send)) == [
        p.LockRequest(id=0, session=s.id)
    ]


def test_the_unavailable_timeout_counts_from_the_latest_loss() -> None:
    d = Script(unavailable_timeout=10.0)
    s = d.session()
    d.lose()
    d.core.begin_slice(s)
    assert d.core.lock_step(s, 0.0) == (10.0, [])
    d.answer_reattach()  # back at t=9: the slice asks for the lock and waits in gpud's queue
    assert d.core.lock_step(s, 9.0)[0] is None
    d.lose()  # lost again at t=15, after 6 s of a reachable gpud
    step, _ = d.core.lock_step(s, 15.0)
    assert step == 10.0


def test_a_grant_that_no_slice_waits_for_is_handed_back_at_once_without_synchronize() -> None:
    d = Script()
    s = d.session(synchronize=True)
    d.request(s)
    assert d.core.cancel_entry(s) == []  # nothing to give back yet: the request stays queued
    assert s.state == "waiting"
    actions = d.push(p.LockOk(session=s.id, grant=4))
    assert not [a for a in actions if isinstance(a, GiveBack)]
    assert no_id(d.take()) == [lock_released(s, 4)]
    assert state(s) == "idle" and s.grants == 1


def test_a_cancelled_slices_request_is_taken_over_by_the_next_slice() -> None:
    d = Script()
    s = d.session()
    d.request(s)
    d.core.cancel_entry(s)
    d.take()
    assert d.core.begin_slice(s) is False
    assert d.core.lock_step(s, d.now) == (None, [])  # no second LOCK_REQUEST
    d.push(p.LockOk(session=s.id, grant=4))
    assert d.core.lock_step(s, d.now) == (HOLD, [])
    assert d.take() == []


def test_cancel_entry_after_the_grant_arrived_hands_it_back() -> None:
    d = Script()
    s = d.session(synchronize=True)
    d.request(s)
    assert d.push(p.LockOk(session=s.id, grant=4)) == [WAKE]
    assert s.holding and s.entering
    actions = d.core.cancel_entry(s)
    assert not [a for a in actions if isinstance(a, GiveBack)]
    assert no_id(decode(a) for a in actions if isinstance(a, Send)) == [lock_released(s, 4)]
    assert s.state == "idle" and not s.entering and not s.in_slice


# --- DROP_LOCK ------------------------------------------------------------------


def test_a_drop_during_a_slice_is_given_back_at_the_slices_end() -> None:
    d = Script()
    s = d.session()
    g = d.hold(s)
    assert d.push(p.DropLock(session=s.id, grant=g, reason=p.DropReason.TQ)) == []
    assert d.take() == [] and s.drop_pending == p.DropReason.TQ
    assert d.core.end_slice(s, 1.0) == [GiveBack(s, g)]
    assert s.state == "releasing"
    d.do(d.core.given_back(s, g))
    assert no_id(d.take()) == [lock_released(s, g)]
    assert state(s) == "idle" and s.drops == 1


def test_a_drop_between_slices_without_hooks_is_released_at_once() -> None:
    d = Script()
    s = d.session()
    g = d.keep(s)
    actions = d.push(p.DropLock(session=s.id, grant=g, reason=p.DropReason.QUOTA))
    assert effects(actions) == []
    assert no_id(d.take()) == [lock_released(s, g)]
    assert s.state == "idle" and s.drop_pending is None


@pytest.mark.parametrize("synchronize", [True, False])
def test_a_drop_between_slices_calls_on_drop_then_gives_back(synchronize: bool) -> None:
    d = Script()
    s = d.session(on_drop=True, synchronize=synchronize)
    g = d.keep(s)
    assert d.push(p.DropLock(session=s.id, grant=g, reason=p.DropReason.PREEMPT)) == [
        CallOnDrop(s, p.DropReason.PREEMPT, g)
    ]
    assert d.take() == [] and s.holding
    actions = d.do(d.core.drop_told(s, g))
    if synchronize:
        assert effects(actions) == [GiveBack(s, g)] and d.take() == []
        d.do(d.core.given_back(s, g))
    else:
        assert effects(actions) == []
    assert no_id(d.take()) == [lock_released(s, g)]
    assert s.state == "idle"


@pytest.mark.parametrize("synchronized_first", [True, False])
def test_a_lock_released_by_on_drop_is_not_released_twice(synchronized_first: bool) -> None:
    d = Script()
    s = d.session(on_drop=True, synchronize=True)
    g = d.hold(s)  # acquire(): an open-ended slice
    assert d.push(p.DropLock(session=s.id, grant=g, reason=p.DropReason.TQ)) == [CallOnDrop(s, p.DropReason.TQ, g)]
    assert d.core.release(s) == [GiveBack(s, g)]  # on_drop calls release()
    if synchronized_first:
        d.do(d.core.given_back(s, g))
    assert d.do(d.core.drop_told(s, g)) == []  # on_drop returns: nothing more to do
    if not synchronized_first:
        d.do(d.core.given_back(s, g))
    assert no_id(d.take()) == [lock_released(s, g)]


def test_a_drop_naming_a_stale_grant_changes_nothing() -> None:
    d = Script()
    s = d.session()
    g1 = d.keep(s)
    d.push(p.DropLock(session=s.id, grant=g1, reason=p.DropReason.TQ))  # released at once
    g2 = d.keep(s)
    d.take()
    assert d.push(p.DropLock(session=s.id, grant=g1, reason=p.DropReason.TQ)) == []
    assert d.push(p.Revoked(session=s.id, grant=g1, reason=p.RevokeReason.DROP_TIMEOUT)) == []
    assert s.holding and s.grant == g2 and s.drop_pending is None and s.drops == 1 and s.revocations == 0
    assert d.take() == []


def test_given_back_after_a_revocation_sends_nothing() -> None:
    d = Script()
    s = d.session(synchronize=True)
    g = d.keep(s)
    assert effects(d.push(p.DropLock(session=s.id, grant=g, reason=p.DropReason.TQ))) == [GiveBack(s, g)]
    d.push(p.Revoked(session=s.id, grant=g, reason=p.RevokeReason.DROP_TIMEOUT))  # synchronize took too long
    assert d.core.given_back(s, g) == []
    assert d.take() == [] and s.state == "idle"


def test_given_back_after_a_lost_connection_sends_nothing() -> None:
    d = Script()
    s = d.session(synchronize=True)
    g = d.keep(s)
    d.push(p.DropLock(session=s.id, grant=g, reason=p.DropReason.TQ))
    d.lose()
    d.answer_reattach()
    d.take()
    assert d.core.given_back(s, g) == []
    assert d.take() == []


# --- idle release ------------------------------------------------------------------


def test_end_slice_arms_the_idle_sweep_only_when_it_is_due_earlier() -> None:
    d = Script()
    a = d.session(idle_release=1.0)
    b = d.session(idle_release=0.3)
    d.hold(a)
    assert effects(d.core.end_slice(a, 0.0)) == [ArmIdle(1.0)]
    for t in (0.1, 0.2):
        assert d.core.begin_slice(a) is True
        assert d.core.end_slice(a, t) == []  # the sweep is due at 1.0 already
    d.hold(b)
    assert effects(d.core.end_slice(b, 0.3)) == [ArmIdle(0.6)]  # earlier than 1.0
    assert d.core.idle_wake_at == 0.6


def test_idle_sweep_gives_back_exactly_the_sessions_unused_for_idle_release() -> None:
    d = Script()
    a, b, c, e = (d.session(idle_release=1.0), d.session(idle_release=1.0), d.session(), d.session(idle_release=1.0))
    ga, gb = d.hold(a), d.hold(b)
    d.hold(c)
    for s in (a, b, c):
        d.core.end_slice(s, 0.5 if s is b else 0.0)
    assert d.core.idle_sweep(0.9) == []
    assert d.core.idle_wake_at == 1.0
    assert d.core.idle_sweep(1.0) == [GiveBack(a, ga)]
    assert d.core.idle_wake_at == 1.5
    assert a.state == "releasing" and b.holding and c.holding and e.state == "idle"
    d.do(d.core.given_back(a, ga))
    assert d.core.idle_sweep(1.5) == [GiveBack(b, gb)]
    assert d.core.idle_wake_at == math.inf  # c has no idle release
    d.do(d.core.given_back(b, gb))
    assert no_id(d.take()) == [lock_released(a, ga), lock_released(b, gb)]
    assert effects(d.core.end_slice(a, 2.0)) == [ArmIdle(3.0)]  # armed anew once the sweep has nothing due


def test_idle_sweep_never_takes_the_lock_of_a_session_in_a_slice_or_entering() -> None:
    d = Script()
    a = d.session(idle_release=1.0)
    b = d.session(idle_release=1.0)
    d.hold(a)  # in a slice since t=0
    d.request(b)
    d.push(p.LockOk(session=b.id, grant=9))  # b holds, its slice has not looked yet
    assert d.core.idle_sweep(10.0) == []
    assert d.core.idle_wake_at == 11.0  # neither can go idle before 10 + its idle_release
    assert a.holding and b.holding and d.take() == []


def test_a_loop_of_slices_wakes_the_idle_sweep_once_per_idle_release_not_once_per_slice() -> None:
    """A bug: a sweep during a slice looked next at infinity, so the slice's end armed it again, and
    every slice's end woke the sync driver's idle thread, about 80 us between two kernels under Ray."""
    d = Script()
    s = d.session(idle_release=1.0)
    d.hold(s)
    armed, swept = 0, 0
    t = 0.0
    for _ in range(1000):  # 3.5 ms slices for 3.5 s; the idle thread sweeps whenever it is woken or due
        if any(isinstance(a, ArmIdle) for a in d.core.end_slice(s, t)):
            armed += 1
        assert d.core.begin_slice(s) is True
        t += 0.0035
        if armed > swept or t >= d.core.idle_wake_at:
            assert d.core.idle_sweep(t) == []  # mid-slice: never taken
            swept += 1
    assert armed == 1 and swept <= 4


def test_idle_sweep_never_takes_the_lock_of_a_slice_even_with_idle_release_zero() -> None:
    d = Script()
    s = d.session(idle_release=0.0)
    d.hold(s)
    assert d.core.idle_sweep(5.0) == []


# --- a lost lock -------------------------------------------------------------------


def test_a_connection_lost_during_a_slice_calls_on_lost_at_once_and_raises_lock_lost_once() -> None:
    d = Script()
    s = d.session()
    d.hold(s)
    sid = s.id
    [lost] = [a for a in d.lose("broken pipe") if isinstance(a, CallOnLost)]
    assert lost.session is s and lost.error.session == sid and lost.error.gpu == 0
    assert "connection to gpud was lost (broken pipe)" in str(lost.error)
    d.answer_reattach()
    with pytest.raises(LockLost) as exc:
        d.core.end_slice(s, 1.0)
    assert exc.value is lost.error
    d.hold(s)  # the next slice is a normal one
    assert d.core.end_slice(s, 2.0) == []


def test_a_connection_lost_between_slices_calls_on_lost_but_no_slice_raises() -> None:
    d = Script()
    s = d.session()
    d.keep(s)
    actions = d.lose()
    [lost] = [a for a in actions if isinstance(a, CallOnLost)]
    assert lost.session is s and not lost.error.in_use
    assert "kept between slices, so no work ran without it" in str(lost.error)  # not "ran unarbitrated"
    assert [a.text for a in actions if isinstance(a, Log) and a.level == Level.WARNING] == [
        f"lost connection to gpud at {PATH}: connection reset by peer"
    ]  # the lock itself is told at info: no harm was done
    d.answer_reattach()
    d.hold(s)
    assert d.core.end_slice(s, 1.0) == []


def test_a_connection_lost_during_acquire_makes_release_raise_lock_lost() -> None:
    d = Script()
    s = d.session()
    d.hold(s)  # acquire() is begin_slice + lock_step until HOLD
    assert [a for a in d.lose() if isinstance(a, CallOnLost)]
    with pytest.raises(LockLost):
        d.core.release(s)
    assert d.core.release(s) == []  # once
    assert d.take() == []


def test_a_revocation_during_a_slice_is_a_lost_lock() -> None:
    d = Script()
    s = d.session()
    g = d.hold(s)
    actions = d.push(p.Revoked(session=s.id, grant=g, reason=p.RevokeReason.DROP_TIMEOUT))
    [lost] = [a for a in actions if isinstance(a, CallOnLost)]
    assert lost.session is s and lost.error.session == s.id and WAKE in actions
    assert s.revocations == 1 and s.state == "idle"
    with pytest.raises(LockLost, match="revoked"):
        d.core.end_slice(s, 1.0)
    assert d.take() == []  # nothing to give back: gpud took it


def test_closing_the_client_while_holding_is_not_a_lost_lock() -> None:
    d = Script()
    s = d.session(on_drop=True, synchronize=True)
    d.hold(s)
    actions = d.core.close()
    assert not [a for a in actions if isinstance(a, CallOnLost)]
    assert d.core.end_slice(s, 1.0) == []
    assert s.closed and d.core.connection_lost("closed") == []


# --- re-attach after a reconnect ------------------------------------------------------


def test_a_reconnect_attaches_every_open_session_again() -> None:
    d = Script()
    a = d.session(0, priority=7)
    b = d.session(1, mem_limit=4 * GiB)
    c = d.session()
    d.core.detach(c)
    d.lose()
    d.take()
    attaches = d.reattach()
    assert set(attaches) == {a, b}
    assert no_id([attaches[a], attaches[b]]) == [
        p.Attach(id=0, gpu=0, priority=7, core_limit=100),
        p.Attach(id=0, gpu=1, core_limit=100, mem_limit=4 * GiB),
    ]
    assert d.core.reconnects == 0  # counted once every session has its answer
    d.push(d.attached(attaches[a]))
    assert d.core.reconnects == 0
    d.push(p.Error(id=attaches[b].id, code=p.ErrorCode.UNKNOWN_GPU, message="unknown GPU 1"))
    assert d.core.reconnects == 1 and b.attach_error is not None and a.id != 0


def test_attached_binds_the_new_session_id() -> None:
    d = Script()
    s = d.session()
    old = s.id
    d.lose()
    assert s.id == 0 and d.core.sessions == {}
    [attach] = d.reattach().values()
    assert WAKE in d.push(d.attached(attach, session=40))
    assert s.id == 40 and d.core.sessions == {40: s} and old not in d.core.sessions
    assert s.state == "idle" and s.mem_reported is None


def test_a_session_that_could_not_be_reattached_fails_its_slices_alone() -> None:
    d = Script()
    a = d.session(0)
    b = d.session(1)
    d.lose()
    attaches = d.reattach()
    d.push(d.attached(attaches[a]))
    d.push(p.Error(id=attaches[b].id, code=p.ErrorCode.UNKNOWN_GPU, message="GPU 1 is gone"))
    assert a.attach_error is None and b.attach_error is not None
    d.core.begin_slice(b)
    with pytest.raises(GpudError, match=r"GPU 1 could not be re-attached .*unknown_gpu: GPU 1 is gone"):
        d.core.lock_step(b, d.now)
    assert not b.entering
    d.hold(a)
    assert a.holding


def test_a_session_closed_while_its_reattach_is_in_flight_is_detached_when_attached() -> None:
    d = Script()
    s = d.session()
    d.lose()
    [attach] = d.reattach().values()
    assert d.core.detach(s) == 0  # no daemon id to detach yet
    d.push(d.attached(attach, session=50))
    assert no_id(d.take()) == [p.Detach(id=0, session=50)]
    assert 50 not in d.core.sessions and s not in d.core.all


def test_the_next_reconnect_tries_a_failed_session_again() -> None:
    d = Script()
    a = d.session(0)
    b = d.session(1)
    d.lose()
    attaches = d.reattach()
    d.push(d.attached(attaches[a]))
    d.push(p.Error(id=attaches[b].id, code=p.ErrorCode.UNKNOWN_GPU, message="GPU 1 is gone"))
    d.lose()
    attaches = d.reattach()
    assert set(attaches) == {a, b} and b.attach_error is None
    d.push(d.attached(attaches[b], session=60))
    assert b.id == 60
    d.hold(b)


# --- limits and memory -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("framework_hooks", "before", "after", "applied"),
    [
        (True, None, None, []),
        (True, None, 8 * GiB, [8 * GiB]),
        (True, 8 * GiB, 8 * GiB, [8 * GiB]),
        (True, 8 * GiB, 4 * GiB, [4 * GiB]),
        (True, 8 * GiB, None, [None]),
        (False, None, 8 * GiB, []),
        (False, 8 * GiB, None, []),
    ],
)
def test_limits_changed_applies_a_memory_limit_only_with_framework_hooks_and_one_set_or_changed(
    framework_hooks: bool, before: int | None, after: int | None, applied: list[int | None]
) -> None:
    d = Script()
    s = d.session(framework_hooks=framework_hooks, mem_limit=before)
    actions = d.push(p.LimitsChanged(session=s.id, core_limit=30, mem_limit=after))
    assert actions == [ApplyMemoryLimit(s, limit) for limit in applied]
    assert s.core_limit == 30 and s.mem_limit == after


def test_limits_changed_for_another_session_changes_nothing() -> None:
    d = Script()
    s = d.session(framework_hooks=True)
    assert d.push(p.LimitsChanged(session=s.id + 1, core_limit=30, mem_limit=GiB)) == []
    assert s.core_limit == 100 and s.mem_limit is None


def test_mem_limit_exceeded_makes_the_next_begin_slice_raise() -> None:
    d = Script()
    s = d.session()
    assert d.push(p.MemLimitExceeded(session=s.id, used_bytes=9 * GiB, limit_bytes=8 * GiB)) == []
    with pytest.raises(MemoryLimitExceeded) as exc:
        d.core.begin_slice(s)
    assert (exc.value.session, exc.value.used_bytes, exc.value.limit_bytes) == (s.id, 9 * GiB, 8 * GiB)
    assert not s.entering and d.take() == []


def test_memory_is_reported_the_first_time_then_only_after_a_move_of_16_mib() -> None:
    d = Script()
    s = d.session()
    d.keep(s)
    d.take()
    reported = []
    for used in (100 * MiB, 115 * MiB, 116 * MiB - 1, 116 * MiB, 101 * MiB, 100 * MiB, None):
        assert d.core.begin_slice(s)
        d.do(d.core.end_slice(s, 1.0, used))
        reported += [m.used_bytes for m in d.take()]
    assert reported == [100 * MiB, 116 * MiB, 100 * MiB]


def test_memory_is_not_reported_while_unattached_and_afresh_after_the_reattach() -> None:
    d = Script()
    s = d.session()
    d.hold(s)
    d.do(d.core.end_slice(s, 1.0, 100 * MiB))
    d.lose()
    d.take()
    assert d.core.report_memory(s, 300 * MiB) == []
    [attach] = d.reattach().values()
    assert d.core.report_memory(s, 300 * MiB) == []  # connected, re-attach on its way
    d.push(d.attached(attach))
    d.hold(s)
    d.do(d.core.end_slice(s, 2.0, 100 * MiB))  # unmoved since the last report, but a new session
    assert no_id(d.take()) == [p.MemUpdate(id=0, session=s.id, used_bytes=100 * MiB)]


# --- preemption: allocation pushes and the requests about allocations -----------------


def allocated(task_id: str = "job", gpus: list[int] | None = None) -> p.Allocated:
    gpus = [0] if gpus is None else gpus
    return p.Allocated(
        id=0,
        task_id=task_id,
        gpus=gpus,
        uuids=[f"GPU-{g}" for g in gpus],
        share=1.0,
        cpus=[],
        cuda_visible_devices=",".join(map(str, gpus)),
        tenant=None,
        priority=10,
        owner_pid=None,
    )


PUSHES = [
    p.Preempt(
        task_id="job",
        reason=p.PreemptReason.PRIORITY,
        recovery=p.Recovery.CHECKPOINT,
        gpus=[0],
        whole=True,
        grace_s=30.0,
        by="urgent",
    ),
    p.Preempt(
        task_id="job",
        reason=p.PreemptReason.ELASTIC,
        recovery=p.Recovery.SHRINK,
        gpus=[1],
        whole=False,
        grace_s=5.0,
        by="other",
    ),
    p.PreemptWithdrawn(task_id="job"),
    p.AllocRevoked(task_id="job", reason=p.PreemptReason.DRAIN, state=p.AllocState.SUSPENDED, gone=False),
    p.AllocRevoked(task_id="job", reason=p.PreemptReason.PRIORITY, state=p.AllocState.RUNNING, gone=True),
    p.AllocChanged(change="resumed", allocation=allocated()),
    p.AllocChanged(change="shrunk", allocation=allocated(gpus=[0])),
]


@pytest.mark.parametrize("push", PUSHES, ids=lambda m: type(m).__name__)
def test_an_allocation_push_goes_to_the_listeners_as_it_came_and_sends_nothing(push: msgspec.Struct) -> None:
    d = Script()
    d.take()
    actions = d.push(push)
    assert [a for a in actions if not isinstance(a, Log)] == [CallAllocationListeners(wire(push))]
    assert [a.level for a in actions if isinstance(a, Log)] == [Level.INFO]  # said once, for the log
    assert d.take() == []


def test_allocation_pushes_change_no_session_and_pass_while_a_slice_holds() -> None:
    d = Script()
    s = d.session()
    d.hold(s)
    for push in PUSHES:
        assert CallAllocationListeners(wire(push)) in d.push(push)
    assert state(s) == "holding" and s.in_slice and d.take() == []


@pytest.mark.parametrize(
    "msg",
    [p.Yield(id=0, task_id="job"), p.Protect(id=0, task_id="job", protected=False), p.Drain(id=0, gpu=1, on=True)],
    ids=lambda m: type(m).__name__,
)
def test_yield_protect_and_drain_are_answered_ok_like_any_request(msg: msgspec.Struct) -> None:
    d = Script()
    sent = decode(d.core.start(msg, w := Waiter("req")))
    assert no_id([sent]) == [msg]
    assert d.push(p.Ok(id=sent.id)) == [Resolve(w)]
    assert d.core.finish(sent.id) == p.Ok(id=sent.id)
    refused = decode(d.core.start(msg, w := Waiter("again")))
    assert d.push(p.Error(id=refused.id, code=p.ErrorCode.UNKNOWN_TASK, message="no task job")) == [Resolve(w)]
    with pytest.raises(ProtocolError, match="no task job") as exc:
        d.core.finish(refused.id)
    assert exc.value.code == p.ErrorCode.UNKNOWN_TASK and d.core.requests.pending == {}


def test_allocate_msg_carries_the_recovery_the_range_and_protection() -> None:
    old = allocate_msg("job", 0.5, 2, None, "first_fit", None, "spot", 100, 42)  # an existing caller's
    assert old.on_preempt == p.Recovery.TERMINATE and old.gpus_max is None and not old.protected
    assert old.priority_class == p.PriorityClass.SPOT and old.gpus == 0.5
    new = allocate_msg("job", 2, 0, [1], "best_fit", "t", 50, 0, None, on_preempt="suspend", gpus_max=4, protected=True)
    assert (new.on_preempt, new.gpus, new.gpus_max, new.protected) == (p.Recovery.SUSPEND, 2.0, 4, True)
    with pytest.raises(ValueError, match="'pause' is not a valid Recovery"):
        allocate_msg("job", 1, 0, None, "first_fit", None, None, 0, None, on_preempt="pause")


# --- size --------------------------------------------------------------------------


def policy(task_type: str = "x" * 10) -> p.SetPolicy:
    return p.SetPolicy(id=0, task_type=task_type)


def payload_bytes(msg: p.SetPolicy) -> int:
    """Its payload with an id below 128 (one msgpack byte, as every id of these short tests)."""
    return len(p.client_codec().encode(msgspec.structs.replace(msg, id=1))) - p.HEADER_BYTES


def test_a_request_over_max_frame_bytes_is_refused_and_nothing_is_pending() -> None:
    size = payload_bytes(policy())
    d = Script(max_frame_bytes=size - 1)
    d.take()
    with pytest.raises(ProtocolError, match=f"{size} bytes, over gpud's limit of {size - 1} bytes") as exc:
        d.core.start(policy(), Waiter("policy"))
    assert exc.value.code == p.ErrorCode.FRAME_TOO_LARGE
    assert d.core.requests.pending == {} and d.take() == []
    with pytest.raises(ProtocolError, match="^frame_too_large: "):
        d.core.send(policy())  # a message nobody waits for too


def test_a_request_exactly_at_max_frame_bytes_is_sent() -> None:
    size = payload_bytes(policy())
    d = Script(max_frame_bytes=size)
    send = d.core.start(policy(), Waiter("policy"))
    assert len(send.data) - p.HEADER_BYTES == size
    assert no_id([decode(send)]) == [policy()] and decode(send).id in d.core.requests.pending


# --- reconnect backoff -----------------------------------------------------------------


@pytest.mark.parametrize(("attempt", "ceiling"), [(0, 0.05), (1, 0.1), (2, 0.2), (5, 1.6), (6, 2.0), (7, 2.0)])
def test_reconnect_delay_is_between_half_and_all_of_a_doubling_ceiling(attempt: int, ceiling: float) -> None:
    assert reconnect_delay(attempt, 0.0) == pytest.approx(ceiling / 2)
    for draw in (0.0, 0.25, 0.5, 0.999999):
        assert ceiling / 2 - 1e-12 <= reconnect_delay(attempt, draw) <= ceiling


def test_reconnect_delay_jitters_with_the_draw() -> None:
    delays = {reconnect_delay(3, draw) for draw in (0.0, 0.1, 0.5, 0.9)}
    assert len(delays) == 4


@pytest.mark.parametrize("attempt", [10, 16, 17, 64, 10**6])
def test_reconnect_delay_never_exceeds_two_seconds(attempt: int) -> None:
    assert 1.0 <= reconnect_delay(attempt, 0.999999) <= 2.0


# --- purity -------------------------------------------------------------------------

CORE_DIR = Path(gpud_client.__file__).parent / "core"
FORBIDDEN = (
    "socket",
    "threading",
    "asyncio",
    "time",
    "random",
    "logging",
    "selectors",
    "subprocess",
    "os",
    "signal",
    "gpud_client.client",
    "gpud_client.aio",
    "gpud_client._sync_driver",
    "gpud_client._async_driver",
    "gpud_client.connection",
    "gpud_client.frameworks",
)


def imported_names(path: Path, package: str) -> list[str]:
    """Every module ``path`` imports anywhere in it (functions included), as absolute names; for
    ``from m import n`` both ``m`` and ``m.n``; ``__import__("m")`` / ``import_module("m")`` too."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                names.append(node.args[0].value)
    return names


def io_imports(directory: Path, package: str) -> list[str]:
    return [
        f"{path.name} imports {name}"
        for path in sorted(directory.glob("*.py"))
        for name in imported_names(path, package)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)
    ]


def test_the_client_core_imports_no_io_and_no_driver() -> None:
    modules = {path.name for path in CORE_DIR.glob("*.py")}
    assert {"__init__.py", "client.py", "requests.py", "session.py", "actions.py"} <= modules  # not vacuous
    assert io_imports(CORE_DIR, "gpud_client.core") == []


def test_the_import_check_finds_io_imports_anywhere_in_a_module(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("import math\nfrom gpud_client import protocol\nfrom . import actions\n")
    (tmp_path / "bad.py").write_text(
        "import os.path\n"
        "def later():\n"
        "    import time\n"
        "    from asyncio import sleep\n"
        "    from .. import client\n"
        "    from gpud_client import _sync_driver\n"
        "    return __import__('socket'), importlib.import_module('random')\n"
    )
    found = io_imports(tmp_path, "gpud_client.core")
    assert found == [
        "bad.py imports os.path",
        "bad.py imports time",
        "bad.py imports asyncio",
        "bad.py imports asyncio.sleep",
        "bad.py imports gpud_client.client",
        "bad.py imports gpud_client._sync_driver",
        "bad.py imports socket",
        "bad.py imports random",
    ]


# --- seeded random sequences ---------------------------------------------------------------

Mode = str  # what the application does with a session: out, entering, slice, acquire, unarb, closed


class World:
    """A random gpud and application around one ``ClientCore``, checking invariants after every event.

    gpud reads what the client sends at once, but its own messages reach the client later and in order
    (``inflight``), so every push races with what the client does meanwhile. It grants, refuses, drops
    and revokes when it likes, and sometimes names a stale grant. The application runs slices and
    acquires, gives up waiting, runs its hooks late and in any order, asks for leases and sessions and
    gives up on them; the connection breaks and comes back."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.core = ClientCore(PATH, unavailable_timeout=3.0, proceed_unarbitrated=self.rng.random() < 0.5)
        self.now = 0.0
        self.connected = False
        self.conn = 0  # +1 at every loss and every connect: answers are of the epoch they came in
        self.next_sid = self.next_grant = self.next_lease = 1
        self.mode: dict[SessionState, Mode] = {}
        self.kind: dict[SessionState, Mode] = {}  # what an entering session will run: slice or acquire
        self.lost_expected: set[SessionState] = set()
        self.mem_error: set[SessionState] = set()
        self.drops: dict[SessionState, int] = {}
        self.revocations: dict[SessionState, int] = {}
        self.used: set[int] = set()  # grants a slice ran under
        self.hooks: list[Hook] = []
        self.giving_back: int | None = None  # the grant whose GiveBack is being carried out
        self.callers: dict[int, tuple[Waiter, SessionState | None]] = {}  # rid -> its waiter, the session it attaches
        self.resolved: dict[int, int] = {}  # rid -> the epoch it was resolved in
        self.given_up: set[int] = set()
        self.reset_daemon()
        self.connect()
        for _ in range(3):
            self.open_session()
        while self.inflight:
            self.deliver()
        for rid in list(self.resolved):
            self.collect(rid)

    # --- gpud ----------------------------------------------------------------------------

    def reset_daemon(self) -> None:
        """gpud's view of the connection; a new one starts empty, and what was on its way is lost."""
        self.inflight: deque[msgspec.Struct] = deque()
        self.owned: set[int] = set()
        self.reattaches: set[int] = set()  # the core's own ATTACH ids
        self.queued: dict[int, int] = {}  # session -> its LOCK_REQUEST's id, not answered yet
        self.request_of: dict[int, int] = {}  # LOCK_REQUEST id -> session
        self.outstanding: set[int] = set()  # sessions whose LOCK_REQUEST's answer has not reached the client
        self.holder: dict[int, int] = {}  # session -> the grant gpud thinks it holds
        self.issued: dict[int, list[int]] = {}  # session -> its grants, in order
        self.released: set[int] = set()  # grants given back on this connection
        self.revoked: set[int] = set()  # grants whose REVOKED reached the client
        self.acquires: list[int] = []
        self.leases: set[str] = set()  # granted on this connection and not given back
        self.lease_of: dict[int, str] = {}  # ACQUIRE id -> its lease
        self.delivered: set[int] = set()  # ACQUIRE ids whose LEASE_RESULT reached the client

    def gpud_reads(self, msg: Any) -> None:
        """gpud reads what the client sent: checks it and answers (the answers are on their way)."""
        match msg:
            case p.Attach(id=rid):
                if rid in self.reattaches and self.rng.random() < 0.15:
                    self.inflight.append(p.Error(id=rid, code=p.ErrorCode.UNKNOWN_GPU, message="GPU 0 is gone"))
                    return
                sid, self.next_sid = self.next_sid, self.next_sid + 1
                self.owned.add(sid)
                self.inflight.append(
                    p.Attached(
                        id=rid,
                        session=sid,
                        gpu=0,
                        scheduler_on=True,
                        core_limit=100,
                        mem_limit=None,
                        memory_total_bytes=16 * GiB,
                    )
                )
            case p.Detach(id=rid, session=sid):
                assert sid in self.owned, f"DETACH of session {sid}, not attached on this connection"
                self.owned.discard(sid)
                self.queued.pop(sid, None)
                self.holder.pop(sid, None)
                self.inflight.append(p.Ok(id=rid))
            case p.LockRequest(id=rid, session=sid):
                assert sid in self.owned, f"LOCK_REQUEST for session {sid}, not attached on this connection"
                assert sid not in self.outstanding, f"a second LOCK_REQUEST of session {sid} while one is out"
                assert sid not in self.holder, f"LOCK_REQUEST of session {sid} while it holds the lock"
                self.queued[sid] = rid
                self.request_of[rid] = sid
                self.outstanding.add(sid)
            case p.LockReleased(session=sid, grant=g):
                assert g is not None and g in self.issued.get(sid, []), f"LOCK_RELEASED of {g}, not {sid}'s grant"
                assert g not in self.released, f"grant {g} released twice on one connection"
                assert g not in self.revoked, f"grant {g} released after its REVOKED arrived"
                pending = [h.grant for h in self.hooks if isinstance(h, GiveBack)]
                assert g not in pending or self.giving_back == g, f"grant {g} released before its synchronize ran"
                s = self.core.sessions[sid]
                if g in self.used and s.synchronize is not None:
                    assert self.giving_back == g, f"grant {g} was used and released without synchronize"
                self.released.add(g)
                if self.holder.get(sid) == g:
                    del self.holder[sid]
            case p.MemUpdate(session=sid):
                assert sid in self.owned, f"MEM_UPDATE of session {sid}, not attached on this connection"
            case p.Acquire(id=rid):
                self.acquires.append(rid)
            case p.Release(lease_id=lease, quiet=quiet):
                assert quiet and lease in self.leases, f"RELEASE of {lease}, not held on this connection"
                self.leases.discard(lease)
            case _:
                raise AssertionError(f"the client sent {msg}")

    def gpud_acts(self) -> None:
        """gpud does something of its own accord."""
        rng, r = self.rng, self.rng.random()
        if self.queued and r < 0.45:
            sid = rng.choice(sorted(self.queued))
            rid = self.queued.pop(sid)
            if rng.random() < 0.08:
                self.inflight.append(p.Error(id=rid, code=p.ErrorCode.LIMIT_REACHED, message="max_lock_queue"))
                return
            g, self.next_grant = self.next_grant, self.next_grant + 1
            self.holder[sid] = g
            self.issued.setdefault(sid, []).append(g)
            self.inflight.append(p.LockOk(session=sid, grant=g))
        elif self.holder and r < 0.7:
            sid = rng.choice(sorted(self.holder))
            self.inflight.append(p.DropLock(session=sid, grant=self.holder[sid], reason=p.DropReason.TQ))
        elif self.holder and r < 0.78:
            sid = rng.choice(sorted(self.holder))
            self.inflight.append(p.Revoked(session=sid, grant=self.holder.pop(sid), reason=p.RevokeReason.DROP_TIMEOUT))
        elif self.issued and r < 0.86:  # about a grant given back or taken already
            sid = rng.choice(sorted(self.issued))
            if old := [g for g in self.issued[sid] if g != self.holder.get(sid)]:
                g = rng.choice(old)
                self.inflight.append(
                    rng.choice(
                        [
                            p.DropLock(session=sid, grant=g, reason=p.DropReason.QUOTA),
                            p.Revoked(session=sid, grant=g, reason=p.RevokeReason.DROP_TIMEOUT),
                        ]
                    )
                )
        elif self.acquires and r < 0.95:
            rid = self.acquires.pop(0)
            if rng.random() < 0.7:
                lease, self.next_lease = f"L{self.next_lease}", self.next_lease + 1
                self.leases.add(lease)
                self.lease_of[rid] = lease
                self.inflight.append(lease_result(rid, lease))
            else:
                self.inflight.append(lease_result(rid, None, p.LeaseStatus.SKIPPED))
        elif self.owned:
            sid = rng.choice(sorted(self.owned))
            if rng.random() < 0.4:
                self.inflight.append(p.MemLimitExceeded(session=sid, used_bytes=2 * GiB, limit_bytes=GiB))
            else:
                self.inflight.append(p.LimitsChanged(session=sid, core_limit=50, mem_limit=rng.choice([None, GiB])))

    def deliver(self) -> None:
        """The next of gpud's messages reaches the client."""
        msg = wire(self.inflight.popleft())
        s = self.core.sessions.get(getattr(msg, "session", 0))
        busy = s is not None and (s.entering or s.in_slice)
        if s is not None and s.state in ("holding", "releasing") and s.grant == getattr(msg, "grant", None):
            if isinstance(msg, p.Revoked):
                self.revocations[s] = self.revocations.get(s, 0) + 1
                self.revoked.add(s.grant)
            elif isinstance(msg, p.DropLock) and s.state == "holding":
                self.drops[s] = self.drops.get(s, 0) + 1
        if isinstance(msg, p.MemLimitExceeded) and s is not None:
            self.mem_error.add(s)
        released = len(self.released)
        actions = self.carry_out(self.core.receive(msg, self.now))
        match msg:
            case p.LockOk(session=sid, grant=g):
                self.outstanding.discard(sid)
                if s is not None and not busy:
                    assert g in self.released and len(self.released) == released + 1, f"grant {g} kept by nobody"
                    assert not [a for a in actions if isinstance(a, GiveBack)], "a grant nobody used is synchronized"
            case p.Error(id=rid) if rid in self.request_of:
                self.outstanding.discard(self.request_of[rid])
            case p.LeaseResult(id=rid):
                self.delivered.add(rid)
            case _:
                pass

    # --- the application -------------------------------------------------------------------

    def carry_out(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            match a:
                case Send():
                    assert self.connected, f"{a.msg} sent while disconnected"
                    self.gpud_reads(decode(a))
                case Resolve(waiter=w):
                    [rid] = [rid for rid, (x, _) in self.callers.items() if x is w]
                    self.resolved[rid] = self.conn
                case CallOnLost(session=s):
                    if s.in_slice:
                        self.lost_expected.add(s)
                    self.hooks.append(a)
                case CallOnDrop() | GiveBack():
                    self.hooks.append(a)
                case ArmIdle(at=at):
                    assert at == self.core.idle_wake_at
                case _:
                    pass
        return actions

    def event(self) -> str:
        """One random event of those possible now; its name, for the trace."""
        live = [s for s, m in self.mode.items() if m != "closed"]
        events: list[tuple[float, str, Callable[[], None]]] = [
            (6.0 if self.inflight else 0.0, "deliver", self.deliver),
            (3.0 if self.connected else 0.0, "gpud acts", self.gpud_acts),
            (6.0 if live else 0.0, "session", lambda: self.use(self.rng.choice(live))),
            (2.0 if self.hooks else 0.0, "hook", self.run_hook),
            (1.0, "idle sweep", self.sweep),
            (2.0, "time", self.tick),
            (0.25 if self.connected else 2.0, "lost" if self.connected else "reconnect", self.lose_or_connect),
            (0.6 if self.connected else 0.0, "acquire lease", self.acquire_lease),
            (0.2 if self.connected and len(live) < 5 else 0.0, "open session", self.open_session),
            (1.0 if self.callers else 0.0, "caller", self.caller),
            (0.1 if "out" in self.mode.values() else 0.0, "close session", self.close_session),
        ]
        _, name, run = self.rng.choices(events, weights=[w for w, _, _ in events])[0]
        run()
        return name

    def use(self, s: SessionState) -> None:
        """The application's next step with ``s``: begin, look again, give up waiting, or end."""
        mode = self.mode[s]
        if mode == "out":
            self.begin(s, self.rng.choice(["slice", "slice", "acquire"]))
        elif mode == "entering":
            (self.step if self.rng.random() < 0.8 else self.cancel)(s)
        else:
            self.end(s)

    def begin(self, s: SessionState, kind: Mode) -> None:
        had_mem_error = s in self.mem_error
        self.mem_error.discard(s)
        try:
            held = self.core.begin_slice(s)
        except MemoryLimitExceeded:
            assert had_mem_error, "MemoryLimitExceeded nobody reported"
            return
        assert not had_mem_error, "a MEM_LIMIT_EXCEEDED was not raised at the next slice"
        self.kind[s] = kind
        self.mode[s] = "entering"
        if held:
            self.ran(s)
        else:
            self.step(s)

    def step(self, s: SessionState) -> None:
        try:
            result, actions = self.core.lock_step(s, self.now)
        except GpudError:
            self.mode[s] = "out"
            assert self.core.cancel_entry(s) == []  # what the driver does after the raise
            return
        self.carry_out(actions)
        if result == HOLD:
            self.ran(s)
        elif result == UNARBITRATED:
            self.mode[s] = "unarb"

    def ran(self, s: SessionState) -> None:
        assert s.holding
        self.mode[s] = self.kind[s]
        self.used.add(s.grant)

    def cancel(self, s: SessionState) -> None:
        self.mode[s] = "out"
        self.carry_out(self.core.cancel_entry(s))

    def end(self, s: SessionState) -> None:
        """The slice ends (an unarbitrated one without telling the core, as the drivers do)."""
        expected = s in self.lost_expected
        self.lost_expected.discard(s)
        mode, self.mode[s] = self.mode[s], "out"
        if mode == "unarb":
            return
        try:
            if mode == "acquire":
                actions = self.core.release(s)
            else:
                actions = self.core.end_slice(s, self.now, self.rng.choice([None, 0, 10 * MiB, 40 * MiB]))
        except LockLost:
            assert expected, "LockLost raised for a lock that was not lost in this slice"
            return
        assert not expected, "a lock lost during the slice was not reported at its end"
        self.carry_out(actions)

    def run_hook(self) -> None:
        """One hook the driver runs, late and in any order (each in a thread of its own)."""
        h = self.hooks.pop(self.rng.randrange(len(self.hooks)))
        match h:
            case CallOnDrop(session=s, grant=g):
                if self.rng.random() < 0.3 and self.mode.get(s) in ("acquire", "out"):
                    if self.mode[s] == "acquire":
                        self.end(s)  # on_drop calls release(), ending the acquire
                    else:
                        self.carry_out(self.core.release(s))  # on_drop gives back the lock kept between slices
                self.carry_out(self.core.drop_told(s, g))
            case GiveBack(session=s, grant=g):
                self.giving_back = g
                self.carry_out(self.core.given_back(s, g))
                self.giving_back = None
            case CallOnLost():
                pass

    def sweep(self) -> None:
        if self.rng.random() < 0.5 and self.core.idle_wake_at < math.inf:
            self.now = max(self.now, self.core.idle_wake_at)
        busy = {x for x, m in self.mode.items() if m in ("slice", "acquire", "entering")}
        for a in self.carry_out(self.core.idle_sweep(self.now)):
            assert not (isinstance(a, GiveBack) and a.session in busy), "the idle sweep took a busy lock"
            if isinstance(a, GiveBack):
                assert a.session.idle_release is not None
                assert a.session.last_used + a.session.idle_release <= self.now, "swept before idle_release"

    def tick(self) -> None:
        self.now += self.rng.uniform(0.0, 0.8)

    def lose_or_connect(self) -> None:
        self.conn += 1
        if self.connected:
            self.connected = False
            self.carry_out(self.core.connection_lost("connection reset by peer"))
            self.reset_daemon()
            return
        self.connected = True
        self.reset_daemon()
        hello = decode(self.core.hello("sim", {}))
        welcome = p.Welcome(id=hello.id, client_id=self.conn, version=p.PROTOCOL_VERSION, gpus=GPUS)
        actions = self.core.welcomed(wire(welcome))
        self.reattaches = {a.msg.id for a in actions if isinstance(a, Send)}  # type: ignore[attr-defined]
        reattached = [self.core.requests.pending[rid].session for rid in sorted(self.reattaches)]
        opened = [s for s, m in self.mode.items() if m != "closed"]
        assert set(reattached) == set(self.core.all) >= set(opened), "a reconnect must re-attach every open session"
        self.carry_out(actions)

    def connect(self) -> None:
        assert not self.connected
        self.lose_or_connect()

    def open_session(self) -> None:
        rng = self.rng
        s = new_session(
            idle_release=rng.choice([None, 0.5, 2.0]),
            on_drop=rng.random() < 0.5,
            synchronize=rng.random() < 0.5,
            framework_hooks=rng.random() < 0.5,
        )
        send = self.core.attach(s, w := Waiter("attach"))
        self.callers[send.msg.id] = (w, s)  # type: ignore[attr-defined]
        self.carry_out([send])

    def acquire_lease(self) -> None:
        send = self.core.start(acquire_msg(0, "ASR"), w := Waiter("lease"))
        self.callers[send.msg.id] = (w, None)  # type: ignore[attr-defined]
        self.carry_out([send])

    def close_session(self) -> None:
        s = self.rng.choice([x for x, m in self.mode.items() if m == "out"])
        self.mode[s] = "closed"
        if sid := self.core.detach(s):
            send = self.core.start(p.Detach(id=0, session=sid), w := Waiter("detach"))
            self.callers[send.msg.id] = (w, None)  # type: ignore[attr-defined]
            self.carry_out([send])

    def caller(self) -> None:
        """A caller takes its answer, or gives up. One answered before a reconnect only takes it: giving
        up then is the bug of test_an_attach_given_up_after_a_reconnect_detaches_the_sessions_current_id."""
        rid = self.rng.choice(sorted(self.callers))
        epoch = self.resolved.get(rid)
        reconnected_since = epoch is not None and epoch < self.conn - (0 if self.connected else 1)
        if epoch is not None and (reconnected_since or self.rng.random() < 0.5):
            self.collect(rid)
        else:
            self.give_up(rid)

    def collect(self, rid: int) -> None:
        """The caller of ``rid`` takes its answer."""
        _, s = self.callers.pop(rid)
        answered_here = self.resolved.pop(rid) == self.conn
        try:
            answer = self.core.finish(rid)
        except GpudError:
            return
        if s is not None:
            assert isinstance(answer, p.Attached) and s in self.core.all
            assert s.id == answer.session or not answered_here
            self.mode[s] = "out"

    def give_up(self, rid: int) -> None:
        """The caller of ``rid`` gives up (a timeout, a cancellation): what it was given goes back."""
        _, s = self.callers.pop(rid)
        req = self.core.requests.pending[rid]
        answer = req.answer
        here = self.resolved.pop(rid, None) == self.conn and self.connected
        self.carry_out(self.core.abandon(rid))
        self.given_up.add(rid)
        assert rid not in self.core.requests.pending
        if isinstance(answer, p.LeaseResult) and answer.acquired and here:
            assert answer.lease_id not in self.leases, "a lease given to a caller who gave up is kept"
        if isinstance(answer, p.Attached):
            assert s is not None and s.closed and s not in self.core.all and s not in self.core.sessions.values()
            assert not here or answer.session not in self.owned, "a session given to a caller who gave up is kept"

    def check(self) -> None:
        """What holds after every event."""
        core = self.core
        for s, mode in self.mode.items():
            assert s.in_slice == (mode in ("slice", "acquire")), f"in_slice {s.in_slice} in mode {mode}"
            assert s.entering == (mode == "entering"), f"entering {s.entering} in mode {mode}"
            if s.state in ("holding", "releasing"):
                assert self.connected and s.id in self.owned and not s.closed, "holds a lock on no connection"
                assert self.issued.get(s.id, [0])[-1] == s.grant, f"holds {s.grant}, not its current grant"
                assert s.grant not in self.released, f"holds grant {s.grant}, given back already"
                assert s.grant not in self.revoked, f"holds grant {s.grant}, revoked already"
            if s.holding and not (s.in_slice or s.entering):
                assert s.grant in self.used, f"grant {s.grant} is kept, and no slice used it"
                told = [h for h in self.hooks if isinstance(h, CallOnDrop) and h.grant == s.grant]
                assert s.drop_pending is None or told, f"grant {s.grant} was dropped and is kept by no slice"
            assert s.drops == self.drops.get(s, 0), "a DROP_LOCK for another grant was counted"
            assert s.revocations == self.revocations.get(s, 0), "a REVOKED for another grant was counted"
        for sid, s in core.sessions.items():
            assert s.id == sid and not s.closed and s in core.all, f"session {sid} is closed or not its own"
        if not self.connected:
            assert core.sessions == {} and core.lock_requests == {}, "sessions kept without a connection"
            assert core.requests.abandoned == {}, "given-up requests kept without a connection"
        own = [r for r in core.requests.pending.values() if r.waiter is None and r.answer is not None]
        assert not own, "an answered re-attach is left pending"
        for rid in self.given_up & self.delivered:
            if rid in self.lease_of:
                assert self.lease_of[rid] not in self.leases, "a lease whose caller gave up was not given back"


@pytest.mark.parametrize("seed", range(200))
def test_random_event_sequences_keep_the_invariants(seed: int) -> None:
    world = World(seed)
    trace: list[str] = []
    try:
        for _ in range(300):
            trace.append(f"t={world.now:.2f} {world.event()}")
            world.check()
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}\nlast events: {trace[-12:]}") from exc


def test_the_messages_before_an_oversized_frame_are_read_before_its_error() -> None:
    from gpud_client.connection import Inbox
    from gpud_client.errors import ProtocolError

    inbox = Inbox("/run/gpud/gpud.sock", p.client_codec())
    ok = p.daemon_codec().encode(p.Ok(id=7))
    inbox.feed(ok + (p.MAX_REPLY_BYTES + 1).to_bytes(4, "big") + b"\x00" * 16)
    assert inbox and inbox.pop() == p.Ok(id=7)
    with pytest.raises(ProtocolError, match="over the .*-byte limit") as caught:
        inbox.pop()
    assert caught.value.code == p.ErrorCode.FRAME_TOO_LARGE
    assert inbox  # the stream stays broken: a reader that looks again gets the error again


# --- allocations held again after a reconnect ------------------------------------------------


def allocated_for(ask: p.Allocate, gpus: list[int]) -> p.Allocated:
    return msgspec.structs.replace(allocated(ask.task_id, gpus), id=ask.id)


def test_a_reconnect_holds_the_clients_allocations_again_and_tells_of_one_gone() -> None:
    """After a lost connection the client says it still holds what it allocated (``existing``: never
    a new allocation), so gpud tells it of their preemption again; one gone meanwhile is told to the
    listeners as revoked."""
    d = Script()
    for task in ("train", "etl", "done"):
        ask = d.record(d.core.start(allocate_msg(task, 1, 0, None, "first_fit", None, 10, 5000, None), Waiter(task)))
        d.push(allocated_for(ask, [0]))
    free = d.record(d.core.start(p.Free(id=0, task_id="done"), Waiter("free")))
    d.push(p.Ok(id=free.id))
    d.lose()
    d.connect()
    again = [m for m in d.take() if isinstance(m, p.Allocate)]
    assert [(m.task_id, m.existing, m.wait_ms) for m in again] == [("train", True, 0), ("etl", True, 0)]
    assert d.push(allocated_for(again[0], [0])) == []
    actions = d.push(p.Error(id=again[1].id, code=p.ErrorCode.UNKNOWN_TASK, message="task 'etl' holds no allocation"))
    [told] = [a.push for a in actions if isinstance(a, CallAllocationListeners)]
    assert (told.task_id, told.reason, told.gone) == ("etl", p.PreemptReason.LOST, True)
    d.lose()
    d.connect()
    assert [m.task_id for m in d.take() if isinstance(m, p.Allocate)] == ["train"]
