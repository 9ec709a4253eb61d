"""The time-sliced lock through the protocol, in process on a fake clock.

A real ``Daemon`` (``tests/inprocess.py``) answers requests through the listener's own
``handle_payload``; time moves only when a test advances it, so a time quantum or a drop
timeout passes at once, and to the microsecond. A client under another uid or group is a
connection with those credentials faked (``tests/integration/test_lock.py`` keeps the real
ones the kernel reports).
"""

from __future__ import annotations

import grp
from collections.abc import Callable

from inprocess import Node, Peer

from gpud_client import protocol as p

NOBODY = 65534
Nodes = Callable[..., Node]


def attach(peer: Peer, gpu: int | str = 0) -> int:
    attached = peer.call(p.Attach(id=0, gpu=gpu))
    assert isinstance(attached, p.Attached), attached
    return int(attached.session)


def request(peer: Peer, session: int) -> None:
    assert peer.call(p.LockRequest(id=0, session=session)) is None  # answered by a LOCK_OK, now or later


def take_lock(peer: Peer, session: int) -> p.LockOk:
    request(peer, session)
    [ok] = peer.pushes(p.LockOk)
    assert ok.session == session
    return ok


def gpu_status(peer: Peer, gpu: int = 0) -> p.GpuStatus:
    status: p.GpuStatus = peer.call(p.Status(id=0)).gpus[gpu]
    return status


def queue(peer: Peer, gpu: int = 0) -> list[int]:
    return [w.session for w in gpu_status(peer, gpu).queue]


def test_fifo_grants_and_immediate_handoff(nodes: Nodes) -> None:
    node = nodes()
    a, b, c = (node.connect(n) for n in "abc")
    sa, sb, sc = attach(a), attach(b), attach(c)
    take_lock(a, sa)
    request(b, sb)
    assert queue(a) == [sb]
    request(c, sc)
    assert queue(a) == [sb, sc]
    st = gpu_status(a)
    assert [h.session for h in st.holders] == [sa]
    assert [w.session for w in st.queue] == [sb, sc]
    a.send(p.LockReleased(id=9, session=sa))
    assert [m.session for m in b.pushes(p.LockOk)] == [sb]
    assert c.received() == []
    b.send(p.LockReleased(id=10, session=sb))
    assert [m.session for m in c.pushes(p.LockOk)] == [sc]


def test_releasing_a_lock_not_held_is_refused_and_changes_nothing(nodes: Nodes) -> None:
    node = nodes()
    a, b = node.connect("a"), node.connect("b")
    sa, sb = attach(a), attach(b)
    ok = take_lock(a, sa)
    before = gpu_status(b)
    [err] = b.exchange(p.LockReleased(id=77, session=sb))
    assert isinstance(err, p.Error) and (err.id, err.code) == (77, p.ErrorCode.NOT_HOLDER)
    [err] = b.exchange(p.LockReleased(id=78, session=sa))  # someone else's session
    assert isinstance(err, p.Error) and err.code == p.ErrorCode.UNKNOWN_SESSION
    [err] = a.exchange(p.LockReleased(id=79, session=sa, grant=ok.grant + 5))
    assert isinstance(err, p.Error) and err.code == p.ErrorCode.STALE_GRANT
    after = gpu_status(b)
    assert [(h.session, h.grant) for h in after.holders] == [(sa, ok.grant)]
    assert (after.grants, after.queue) == (before.grants, before.queue)


def test_tq_drop_only_when_someone_waits(nodes: Nodes) -> None:
    node = nodes("1", tq_s=0.2)
    a, b = node.connect("a"), node.connect("b")
    sa, sb = attach(a), attach(b)
    ok = take_lock(a, sa)
    node.advance_s(0.4)
    assert a.received() == []  # alone past the TQ: no drop
    request(b, sb)
    assert a.received() == [p.DropLock(session=sa, grant=ok.grant, reason=p.DropReason.TQ)]
    a.send(p.LockReleased(id=9, session=sa, grant=ok.grant))
    assert [m.session for m in b.pushes(p.LockOk)] == [sb]


def test_ignoring_drop_lock_is_revoked_after_drop_timeout(nodes: Nodes) -> None:
    node = nodes("1", tq_s=0.1, drop_timeout_s=0.3)
    a, b = node.connect("a"), node.connect("b")
    sa, sb = attach(a), attach(b)
    ok = take_lock(a, sa)
    request(b, sb)
    node.advance_s(0.1)
    assert a.received() == [p.DropLock(session=sa, grant=ok.grant, reason=p.DropReason.TQ)]
    node.advance_s(0.3 - 1e-6)
    assert a.received() == [] and b.received() == []  # not a microsecond before the drop timeout
    node.advance(1)
    assert a.received() == [p.Revoked(session=sa, grant=ok.grant, reason=p.RevokeReason.DROP_TIMEOUT)]
    assert [m.session for m in b.pushes(p.LockOk)] == [sb]
    st = gpu_status(b)
    assert st.revocations == 1 and [h.session for h in st.holders] == [sb]
    [err] = a.exchange(p.LockReleased(id=5, session=sa))  # too late: it no longer holds
    assert isinstance(err, p.Error) and err.code == p.ErrorCode.NOT_HOLDER


def test_closed_connection_frees_lock_and_queue_place(nodes: Nodes) -> None:
    node = nodes()
    a, b, c = (node.connect(n) for n in "abc")
    sa, sb, sc = attach(a), attach(b), attach(c)
    take_lock(a, sa)
    request(b, sb)
    request(c, sc)
    assert queue(a) == [sb, sc]
    node.close(b)  # a waiter leaves
    assert queue(a) == [sc]
    node.close(a)  # the holder leaves
    assert [m.session for m in c.pushes(p.LockOk)] == [sc]


def test_scheduler_off_grants_everyone_and_tells_clients(nodes: Nodes) -> None:
    node = nodes()
    a, b, admin = node.connect("a"), node.connect("b"), node.connect("admin")
    sa, sb = attach(a), attach(b)
    take_lock(a, sa)
    node.advance_s(0.001)  # b's grant comes later than a's, as over a real connection
    request(b, sb)
    assert queue(admin) == [sb]
    assert isinstance(admin.call(p.SchedOff(id=0, gpu=0)), p.Ok)
    [ok, state] = b.received()
    assert isinstance(ok, p.LockOk) and ok.session == sb
    assert state == p.SchedState(gpu=0, on=False)
    assert a.received() == [p.SchedState(gpu=0, on=False)]
    st = gpu_status(admin)
    assert not st.scheduler_on and len(st.holders) == 2 and st.queue == []
    assert isinstance(admin.call(p.SchedOn(id=0)), p.Ok)
    assert a.received()[0] == p.SchedState(gpu=0, on=True)
    assert gpu_status(admin).scheduler_on


def test_set_tq_is_per_gpu_and_takes_effect_at_once(nodes: Nodes) -> None:
    node = nodes()
    a, b = node.connect("a"), node.connect("b")
    sa, sb = attach(a, gpu="gpu:1"), attach(b, gpu=1)
    take_lock(a, sa)
    request(b, sb)
    assert queue(b, gpu=1) == [sb]
    assert isinstance(a.call(p.SetTq(id=0, seconds=0.05, gpu=1)), p.Ok)
    node.advance_s(0.05)  # the new quantum, counted from the grant: not the old 30 s
    [drop] = a.pushes(p.DropLock)
    assert drop.reason == p.DropReason.TQ
    assert gpu_status(b, 0).tq_s == 30.0
    assert gpu_status(b, 1).tq_s == 0.05


def test_non_admin_cannot_change_tq_or_the_scheduler(nodes: Nodes) -> None:
    node = nodes()
    nobody = node.connect("nobody", uid=NOBODY, gid=NOBODY)
    codes = []
    for msg in (p.SetTq(id=1, seconds=1.0), p.SchedOff(id=2)):
        [err] = nobody.exchange(msg)
        assert isinstance(err, p.Error)
        codes.append(err.code)
    assert codes == [p.ErrorCode.PERMISSION_DENIED, p.ErrorCode.PERMISSION_DENIED]
    st = gpu_status(node.connect("root", uid=0, gid=0))
    assert st.tq_s == 30.0 and st.scheduler_on


def test_members_of_the_admin_group_may_change_the_tq(nodes: Nodes) -> None:
    group = grp.getgrgid(NOBODY).gr_name  # nogroup: nobody's primary group
    node = nodes("1", admin_group=group)
    operator = node.connect("operator", uid=NOBODY, gid=NOBODY)
    assert isinstance(operator.call(p.SetTq(id=0, seconds=3.0)), p.Ok)
    assert gpu_status(node.connect()).tq_s == 3.0


def test_a_parkable_session_hears_of_its_attach_before_any_park(nodes: Nodes) -> None:
    """Found by the simulation: ATTACH carried out the scheduler's effects before it answered, so a
    PARK for the new session (resident from its attach, in a waiter's way) came first, and the
    client dropped it as a push for a session it did not know yet."""
    node = nodes(gpus="1x10GiB", mode="serial", memory_reserve_percent=0)
    waiter, first, second = node.connect("waiter"), node.connect("first"), node.connect("second")
    six = 6 * 2**30
    s1 = first.call(p.Attach(id=0, gpu=0, mem_estimate=six, parkable=True)).session
    w = waiter.call(p.Attach(id=0, gpu=0, mem_estimate=six)).session
    assert waiter.call(p.LockRequest(id=0, session=w)) is None
    assert [x.session for x in first.pushes(p.Park)] == [s1]  # not answered yet: the waiter still waits
    got = second.exchange(p.Attach(id=7, gpu=0, mem_estimate=six, parkable=True))
    assert [type(m) for m in got] == [p.Attached, p.Park], got  # its memory is in the way too: asked, after
    assert got[1].session == got[0].session
