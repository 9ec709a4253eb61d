"""Allocations through the protocol: retries and refusals, waits in priority order and their expiry,
dead owners' allocations reclaimed, tenants' quotas and rights, the ceilings a fractional allocation
puts on its sessions, and the outcome counter.

In-process (``tests/inprocess.py``): a real ``Daemon`` on a fake clock, its store on a real SQLite
file, requests through the listener's ``handle_payload``; credentials are faked (uid 65534 needs no
root), waits and reap intervals pass by moving the clock, and ``CoreClient`` raises an Error as the
client library does. Kills, restarts, gpuctl and the asyncio client are in
``tests/integration/test_allocations.py``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from inprocess import CoreClient, Node, Peer  # tests/ is on the path of its top-level modules
from structlog.testing import capture_logs

from gpud.host.config import TenantConfig
from gpud_client import PermissionDenied, ProtocolError
from gpud_client import protocol as p

GiB = 2**30
NOBODY = 65534


@pytest.fixture
def node(nodes: Callable[..., Node]) -> Node:
    return nodes()


def listing(peer: Peer) -> p.AllocationsReply:
    reply = peer.call(p.ListAllocations(id=0))
    assert isinstance(reply, p.AllocationsReply), reply
    return msgspec.structs.replace(reply, id=0)


def task_ids(peer: Peer) -> set[str]:
    return {a.task_id for a in listing(peer).allocations}


def test_asking_again_for_a_task_id_with_other_terms_is_refused(node: Node) -> None:
    """The requests gpuctl alloc sends: the same terms again are a retry, other terms are refused."""
    c = node.connect("gpuctl")
    first = c.call(p.Allocate(id=0, task_id="etl-1", gpus=1.0, cpus=1))
    assert isinstance(first, p.Allocated), first
    again = c.call(p.Allocate(id=0, task_id="etl-1", gpus=1.0, cpus=1, strategy=p.Strategy.LEAST_LOADED))
    assert msgspec.structs.replace(again, id=0) == msgspec.structs.replace(first, id=0)  # a retry: the same answer
    before = listing(c)
    err = c.call(p.Allocate(id=0, task_id="etl-1", gpus=2.0, cpus=1))
    assert (err.code, err.message) == (
        p.ErrorCode.INVALID,
        "task 'etl-1' already holds 1 GPU and 1 CPU core; "
        "this request asks for 2 GPUs (ask with the same terms, or free the task first)",
    )
    err = c.call(
        p.Allocate(id=0, task_id="etl-1", gpus=1.0, cpus=1, priority_class=p.PriorityClass.HIGH, owner_pid=os.getpid())
    )
    assert (err.code, err.message) == (
        p.ErrorCode.INVALID,
        "task 'etl-1' already holds 1 GPU, 1 CPU core, priority 50 and no owner pid; this request "
        f"asks for priority 75 and owner pid {os.getpid()} (ask with the same terms, or free the task first)",
    )
    assert listing(c) == before  # nothing changed


def test_waiters_are_served_in_priority_order(node: Node) -> None:
    c, low, high = node.connect("c"), node.connect("low"), node.connect("high")
    c.call(p.Allocate(id=0, task_id="a", gpus=1.0))
    c.call(p.Allocate(id=0, task_id="b", gpus=1.0))
    assert (
        low.call(p.Allocate(id=0, task_id="low", gpus=1.0, priority_class=p.PriorityClass.BEST_EFFORT, wait_ms=5000))
        is None
    )
    assert listing(c).waiting == ["low"]  # it came first
    node.advance_s(0.1)
    assert (
        high.call(p.Allocate(id=0, task_id="high", gpus=1.0, priority_class=p.PriorityClass.PRODUCTION, wait_ms=5000))
        is None
    )
    assert listing(c).waiting == ["high", "low"]
    node.advance_s(0.25)
    assert isinstance(c.call(p.Free(id=0, task_id="a")), p.Ok)
    [served] = high.received()
    assert (served.task_id, served.priority, served.waited_ms) == ("high", 100, 250.0)
    assert low.received() == []
    node.advance_s(0.05)
    c.call(p.Free(id=0, task_id="b"))
    [served] = low.received()
    assert (served.task_id, served.priority, served.waited_ms) == ("low", 10, 400.0)


def test_a_wait_expires_with_a_clear_answer(node: Node) -> None:
    c = node.connect("c")
    c.call(p.Allocate(id=0, task_id="all", gpus=2.0))
    assert c.call(p.Allocate(id=0, task_id="late", gpus=1.0, wait_ms=300)) is None
    node.advance(299_999)
    assert c.received() == [] and listing(c).waiting == ["late"]
    node.advance(1)
    [err] = c.received()
    assert err.code == p.ErrorCode.INSUFFICIENT
    assert err.message == (
        "task 'late': 1 whole GPU(s) asked, 0 entirely free now; nothing could be taken back: "
        "all: not of a lower priority than 50 (waited the full wait_ms)"
    )
    assert listing(c).waiting == []


def test_allocations_of_dead_owners_are_reclaimed(nodes: Callable[..., Node]) -> None:
    """Reaped once an interval (0.2 s, the first pass at the start): the owner is a real process."""
    node = nodes("1", reap_interval_s=0.2)
    owner = subprocess.Popen(["sleep", "60"])
    try:
        c = node.connect("c")
        c.call(p.Allocate(id=0, task_id="owned", gpus=1.0, owner_pid=owner.pid))
        c.call(p.Allocate(id=0, task_id="kept", gpus=0.0, cpus=1))
        with capture_logs() as logs:
            node.advance_s(0.5)  # three reap passes (0, 0.2 and 0.4 s): a live owner's allocation stays
            assert task_ids(c) == {"owned", "kept"}
            owner.kill()
            owner.wait()
            node.advance_s(0.099)
            assert task_ids(c) == {"owned", "kept"}  # no pass until 0.6 s
            node.advance_s(0.001)
            assert task_ids(c) == {"kept"}
        reaped = [e for e in logs if e["event"] == "allocations_reaped"]
        assert [(e["task_ids"], e["owner_pid"], e["count"]) for e in reaped] == [(["owned"], owner.pid, 1)]
        assert node.stored() == ["kept"]
    finally:
        owner.kill()
        owner.wait()


def test_a_fractional_allocation_is_enforced_on_its_sessions(node: Node) -> None:
    c = node.connect("ray-task")
    a = c.call(p.Allocate(id=0, task_id="ray-task-7", gpus=0.25))
    s = c.call(p.Attach(id=0, gpu=a.gpus[0]))  # no task id: matched by the allocating uid all the same
    assert (s.core_limit, s.mem_limit) == (25, 16 * GiB // 4)
    other_gpu = c.call(p.Attach(id=0, gpu=1 - a.gpus[0]))  # nothing allocated there: no limits
    assert (other_gpu.core_limit, other_gpu.mem_limit) == (100, None)
    t = c.call(p.Attach(id=0, gpu=a.gpus[0], task_id="ray-task-7"))
    assert (t.core_limit, t.mem_limit) == (25, 16 * GiB // 4)
    lower = c.call(p.Attach(id=0, gpu=a.gpus[0], task_id="ray-task-7", core_limit=10, mem_limit=GiB))
    assert (lower.core_limit, lower.mem_limit) == (10, GiB)  # it asked for less
    labelled = node.connect("labelled", hello=False)
    hello = p.Hello(id=0, version=p.PROTOCOL_VERSION, name="labelled", labels={"task_id": "ray-task-7"})
    assert isinstance(labelled.call(hello), p.Welcome)
    assert labelled.call(p.Attach(id=0, gpu=0)).core_limit == 25


def test_a_session_cannot_lift_its_own_allocations_ceiling_even_as_root(node: Node) -> None:
    """As root, an admin: the task a share caps must still not lift it itself; an admin lifts it
    from another connection (gpuctl limit)."""
    c = CoreClient(node, "capped", uid=0, gid=0)
    with subprocess.Popen(["sleep", "60"]) as child:  # its own child: an owner it may name
        a = c.request(p.Allocate(id=0, task_id="capped-task", gpus=0.25, owner_pid=child.pid))
        child.kill()
    s = c.attach(a.gpus[0], task_id="capped-task")
    with pytest.raises(PermissionDenied, match="ceiling of 25 %"):
        c.request(p.SetLimits(id=0, session=s.id, core_limit=100))
    with pytest.raises(PermissionDenied, match="ceiling of 25 %"):
        c.request(p.SetLimits(id=0, core_limit=50))  # all of the client's own sessions: the same
    assert s.core_limit == 25
    admin = CoreClient(node, "operator", uid=0, gid=0)
    assert admin.request(p.SetLimits(id=0, client="capped", core_limit=60)).sessions == [s.id]
    c.deliver()  # LIMITS_CHANGED
    assert s.core_limit == 60


@pytest.mark.parametrize(
    ("fields", "code", "message"),
    [
        ({"gpus": 3.0}, p.ErrorCode.INVALID, "3 GPUs asked, this node has 2"),
        (
            {"cpus": 100_000},
            p.ErrorCode.INVALID,
            f"100000 CPU cores asked, this node has {len(os.sched_getaffinity(0))}",
        ),
        ({"prefer": [5]}, p.ErrorCode.UNKNOWN_GPU, "unknown GPU 5 (this node has GPUs 0, 1) in prefer"),
        ({"tenant": "acme"}, p.ErrorCode.UNKNOWN_TENANT, "unknown tenant 'acme' (tenants: none configured)"),
    ],
)
def test_bad_allocations_are_refused_and_change_nothing(
    node: Node, fields: dict[str, Any], code: p.ErrorCode, message: str
) -> None:
    """What the daemon refuses of what gpuctl alloc sends (gpuctl's own checks are in the integration tests)."""
    c = node.connect("c")
    c.call(p.Allocate(id=0, task_id="keep", gpus=0.5))
    before = listing(c)
    err = c.call(p.Allocate(id=0, task_id="bad", **fields))
    assert (err.code, err.message) == (code, message)
    assert listing(c) == before
    assert node.stored() == ["keep"]


def test_unknown_strategy_is_refused_on_the_wire(node: Node) -> None:
    conn = node.connect("raw")
    assert conn.feed(msgspec.msgpack.encode({"type": "ALLOCATE", "id": 3, "task_id": "x", "strategy": "worst"}))
    [err] = conn.received()
    assert (err.id, err.code) == (3, p.ErrorCode.INVALID) and "$.strategy" in err.message, err
    assert task_ids(conn) == set()


def test_tenants_quota_and_freeing_another_tenants_task(nodes: Callable[..., Node]) -> None:
    node = nodes(
        "2",
        tenants={
            "vision": TenantConfig(gpus=1.0, borrow=0.0, uids=[0]),
            "speech": TenantConfig(gpus=1.0, uids=[NOBODY]),
        },
    )
    c = CoreClient(node, "root", uid=0, gid=0)
    c.request(p.Allocate(id=0, task_id="v1", gpus=1.0, tenant="vision"))
    with pytest.raises(ProtocolError, match="tenant 'vision' uses 1 of its 1 GPUs"):
        c.request(p.Allocate(id=0, task_id="v2", gpus=1.0, tenant="vision"))
    nobody = CoreClient(node, "nobody", uid=NOBODY, gid=NOBODY)
    with pytest.raises(PermissionDenied):
        nobody.request(p.Free(id=0, task_id="v1"))
    with pytest.raises(PermissionDenied):
        nobody.request(p.Allocate(id=0, task_id="x", gpus=1.0, tenant="vision"))
    nobody.request(p.Allocate(id=0, task_id="s1", gpus=1.0, tenant="speech"))
    nobody.request(p.Free(id=0, task_id="s1"))  # its own
    assert [a.task_id for a in c.request(p.ListAllocations(id=0)).allocations] == ["v1"]


def test_allocation_requests_are_counted_by_outcome(nodes: Callable[..., Node]) -> None:
    """gpud_allocation_requests_total{result}: it existed, documented nowhere and never counted."""
    node = nodes("1")
    c, waiter = node.connect("c"), node.connect("waiter")
    c.call(p.Allocate(id=0, task_id="a", gpus=1.0))
    c.call(p.Allocate(id=0, task_id="a", gpus=1.0))  # the same again: answered with what it holds
    assert c.call(p.Allocate(id=0, task_id="b", gpus=1.0)).code == p.ErrorCode.INSUFFICIENT
    assert waiter.call(p.Allocate(id=0, task_id="c", gpus=1.0, wait_ms=60_000)) is None
    assert listing(c).waiting == ["c"]
    c.call(p.Free(id=0, task_id="a"))
    assert [m.task_id for m in waiter.received()] == ["c"]
    results = {
        r: node.sample("gpud_allocation_requests_total", {"result": r}) for r in ("granted", "repeated", "insufficient")
    }
    assert results == {"granted": 2, "repeated": 1, "insufficient": 1}
