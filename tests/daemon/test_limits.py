"""Limits, modes and priorities through the protocol: refused limits change nothing, memory above
its limit is raised at the next slice, another client's limits need admin, modes change at run
time, a higher priority preempts the holder.

In-process (``tests/inprocess.py``): a real ``Daemon`` on a fake clock, requests through the
listener's ``handle_payload``, credentials faked (uid 65534 needs no root), and ``CoreClient``
for the client library's own rules (slices, the memory error, the limits it is told). The
shares that real processes get, gpuctl's parsing and the library's framework hooks are in
``tests/integration/test_limits.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from inprocess import CoreClient, Node, Peer  # tests/ is on the path of its top-level modules

from gpud_client import MemoryLimitExceeded, PermissionDenied
from gpud_client import protocol as p

GiB = 2**30
NOBODY = 65534


@pytest.fixture
def node(nodes: Callable[..., Node]) -> Node:
    return nodes()


@pytest.fixture
def fast(nodes: Callable[..., Node]) -> Node:
    """Serial GPU with a 0.5 s compute window, as the integration tests' measuring daemon."""
    return nodes("1x16GiB", mode=p.Mode.SERIAL, compute_window_s=0.5, share_windows=4)


def session_info(node: Node, name: str) -> p.SessionInfo:
    observer = node.connect("observer")
    reply = observer.call(p.ListClients(id=0))
    node.close(observer)
    return [c for c in reply.clients if c.name == name][0].sessions[0]


def lock(peer: Peer, session: int) -> p.LockOk:
    """LOCK_REQUEST, granted at once."""
    peer.send(p.LockRequest(id=0, session=session))
    [ok] = peer.received()
    assert isinstance(ok, p.LockOk) and ok.session == session, ok
    return ok


def test_bad_limits_are_refused_and_change_nothing(fast: Node) -> None:
    """Malformed requests, and what the daemon refuses of what gpuctl limit sends (gpuctl's own
    checks of its arguments are in the integration tests)."""
    a = fast.connect("a")
    sa = a.call(p.Attach(id=0, gpu=0)).session
    for bad in ({"core_limit": 0}, {"core_limit": 101}, {"core_limit": "half"}, {"mem_limit": -1}):
        assert a.feed(msgspec.msgpack.encode({"type": "SET_LIMITS", "id": 7, **bad}))
        [err] = a.received()
        assert err.code == p.ErrorCode.INVALID and "$." in err.message, err
    for bad in ({"core_limit": 0}, {"mem_estimate": -5}):
        assert a.feed(msgspec.msgpack.encode({"type": "ATTACH", "id": 8, "gpu": 0, **bad}))
        [err] = a.received()
        assert err.code == p.ErrorCode.INVALID, err
    gpuctl = fast.connect("gpuctl")
    err = gpuctl.call(p.SetLimits(id=0, client="nobody", core_limit=5))
    assert err.code == p.ErrorCode.UNKNOWN_CLIENT
    assert err.message == "no client 'nobody' is connected (see gpuctl clients)"
    err = gpuctl.call(p.SetLimits(id=0, client="a", core_limit=5, gpu=3))
    assert (err.code, err.message) == (p.ErrorCode.UNKNOWN_GPU, "unknown GPU 3 (this node has GPUs 0)")
    info = session_info(fast, "a")
    assert (info.core_limit, info.mem_limit_bytes, info.session) == (100, None, sa)
    assert a.received() == []  # no LIMITS_CHANGED


def test_memory_above_the_limit_raises_at_the_next_slice(node: Node) -> None:
    c = CoreClient(node, "greedy")
    s = c.attach(0, mem_estimate=GiB, mem_limit=2 * GiB)
    assert c.enter(s)
    c.report_memory(s, 3 * GiB)
    c.exit(s)
    assert s.mem_error is not None  # the memory error arrived
    with pytest.raises(MemoryLimitExceeded, match="above its limit of 2147483648 bytes") as err:
        c.enter(s)
    assert err.value.used_bytes == 3 * GiB
    assert c.enter(s)  # raised once; the next slice runs
    c.exit(s)
    info = session_info(node, "greedy")
    assert (info.mem_used_bytes, info.mem_violations) == (3 * GiB, 1)


def test_modes_change_at_run_time(node: Node) -> None:
    """The modes gpuctl mode sets (its output is in the integration tests)."""
    a, b, gpuctl = node.connect("a"), node.connect("b"), node.connect("gpuctl")
    sa = a.call(p.Attach(id=0, gpu=0, mem_estimate=GiB)).session
    sb = b.call(p.Attach(id=0, gpu=0, mem_estimate=GiB)).session
    assert isinstance(gpuctl.call(p.SetMode(id=0, mode=p.Mode.SERIAL, gpu=0)), p.Ok)
    lock(a, sa)
    b.send(p.LockRequest(id=0, session=sb))
    assert b.received() == []
    assert [w.session for w in a.call(p.Status(id=0)).gpus[0].queue] == [sb]
    assert isinstance(gpuctl.call(p.SetMode(id=0, mode=p.Mode.CONCURRENT)), p.Ok)
    [ok] = b.received()
    assert isinstance(ok, p.LockOk) and ok.session == sb
    st = a.call(p.Status(id=0)).gpus[0]
    assert st.mode == "concurrent" and len(st.holders) == 2
    assert st.memory_in_use_bytes == 2 * GiB


def test_priority_preempts_a_running_session(node: Node) -> None:
    low, high = node.connect("low"), node.connect("high")
    sl = low.call(p.Attach(id=0, gpu=0, priority=10)).session
    sh = high.call(p.Attach(id=0, gpu=0, priority=90)).session
    ok = lock(low, sl)
    high.send(p.LockRequest(id=0, session=sh))
    assert high.received() == []
    [drop] = low.received()
    assert isinstance(drop, p.DropLock) and (drop.grant, drop.reason) == (ok.grant, p.DropReason.PREEMPT)
    low.send(p.LockReleased(id=0, session=sl, grant=ok.grant))
    [granted] = high.received()
    assert isinstance(granted, p.LockOk) and granted.session == sh


def test_another_clients_limit_needs_admin(node: Node) -> None:
    victim = node.connect("victim")
    victim.call(p.Attach(id=0, gpu=0))
    c = CoreClient(node, "nobody", uid=NOBODY, gid=NOBODY)
    mine = c.attach(0, priority=0)
    with pytest.raises(PermissionDenied) as err:
        c.request(p.SetLimits(id=0, client="victim", core_limit=5))
    assert err.value.code == p.ErrorCode.PERMISSION_DENIED
    c.request(p.SetLimits(id=0, session=mine.id, core_limit=40))  # its own limits it may change
    assert mine.core_limit == 40
    assert session_info(node, "victim").core_limit == 100
