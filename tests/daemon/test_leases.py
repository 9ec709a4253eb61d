"""Leases (GpuArbiter) through the protocol: whose lease may be released, the busy policies' answers,
refused acquires, policies changed at run time, the hold watchdog and the forced release.

In-process (``tests/inprocess.py``): a real ``Daemon`` on a fake clock, requests through the
listener's ``handle_payload``, the client library's own messages (``acquire_msg``) and, through
``CoreClient``, its errors. A max wait or a hold limit passes by moving the clock, so the waits
the daemon reports are exact. Real service processes, a killed holder, gpuctl, the metrics
endpoint and the daemon's log lines are in ``tests/integration/test_leases.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from inprocess import CoreClient, Node  # tests/ is on the path of its top-level modules
from structlog.testing import capture_logs

from gpud.host.config import PolicyConfig
from gpud_client import PermissionDenied, ProtocolError
from gpud_client import protocol as p
from gpud_client.core.messages import acquire_msg, policy_msg


@pytest.fixture
def node(nodes: Callable[..., Node]) -> Node:
    return nodes()


def leases(c: CoreClient) -> list[p.LeaseInfo]:
    reply: p.LeasesReply = c.request(p.ListLeases(id=0))
    return reply.leases


def test_release_is_idempotent_and_others_leases_are_refused(node: Node) -> None:
    a, b = CoreClient(node, "a"), CoreClient(node, "b")
    r = a.request(acquire_msg("gpu:0", "TTS"))
    assert r.acquired and r.lease_id
    with pytest.raises(PermissionDenied, match="belongs to client"):
        b.request(p.Release(id=0, lease_id=r.lease_id))
    assert [le.lease_id for le in leases(a)] == [r.lease_id]
    a.request(p.Release(id=0, lease_id=r.lease_id))
    a.request(p.Release(id=0, lease_id=r.lease_id))  # idempotent
    b.request(p.Release(id=0, lease_id="no-such-lease"))
    assert leases(a) == []


def test_each_busy_policy_answers_on_a_busy_gpu(node: Node) -> None:
    holder, c = CoreClient(node, "holder"), node.connect("c")
    assert holder.request(acquire_msg("gpu:0", "ASR")).acquired
    for policy, status in [("WAIT", "SKIPPED"), ("SKIP", "SKIPPED"), ("FALLBACK_CPU", "FALLBACK_CPU")]:
        r = c.call(acquire_msg("gpu:0", "OTHER", busy_policy=policy, max_wait_ms=0))
        assert (r.status, r.reason) == (status, "GPU_BUSY")
        assert c.call(acquire_msg("gpu:0", "OTHER", busy_policy=policy, max_wait_ms=100)) is None
        node.advance_s(0.1)
        [r] = c.received()
        assert (r.status, r.reason, r.queue_wait_ms) == (status, "TIMEOUT", 100.0)
        r = c.call(acquire_msg("gpu:0", "OTHER", busy_policy=policy, queue_limit=0))
        assert (r.status, r.reason) == (status, "QUEUE_FULL")


def test_bad_acquires_are_refused_and_nothing_is_queued(node: Node) -> None:
    conn = node.connect("raw")
    for bad, needle in [
        ({"busy_policy": "PANIC"}, "$.busy_policy"),
        ({"priority": 101}, "$.priority"),
        ({"priority": -1}, "$.priority"),
        ({"max_wait_ms": -5}, "$.max_wait_ms"),
        ({"hold_max_ms": 0}, "$.hold_max_ms"),
        ({"task_type": ""}, "$.task_type"),
        ({"gpu": "gpu:9"}, "unknown GPU 'gpu:9'"),
        ({"gpu": "cuda0"}, "unknown GPU 'cuda0'"),
    ]:
        msg = {"type": "ACQUIRE", "id": 5, "gpu": "gpu:0", "task_type": "ASR", **bad}
        assert conn.feed(msgspec.msgpack.encode(msg))
        [err] = conn.received()
        assert isinstance(err, p.Error) and err.id == 5 and needle in err.message, (bad, err)
    c = CoreClient(node, "c")
    assert leases(c) == []
    with pytest.raises(ProtocolError, match="unknown_gpu"):
        c.request(acquire_msg("gpu:3", "OTHER"))


def test_policies_are_hot_updated(node: Node) -> None:
    c = CoreClient(node, "c")
    assert c.request(p.ListPolicies(id=0)).policies["SEMANTIC_REPAIR"].max_wait_ms == 400
    # what gpuctl policy SEMANTIC_REPAIR --max-wait 0 --busy FALLBACK_CPU sends, and the answer it prints
    c.request(p.SetPolicy(id=0, task_type="SEMANTIC_REPAIR", busy_policy=p.BusyPolicy.FALLBACK_CPU, max_wait_ms=0))
    repair = c.request(p.ListPolicies(id=0)).policies["SEMANTIC_REPAIR"]
    assert (repair.busy_policy, repair.max_wait_ms) == ("FALLBACK_CPU", 0)
    held = c.request(acquire_msg("gpu:0", "ASR"))
    r = c.request(acquire_msg("gpu:0", "SEMANTIC_REPAIR"))
    c.request(p.Release(id=0, lease_id=held.lease_id))
    assert (r.status, r.reason) == ("FALLBACK_CPU", "GPU_BUSY")
    c.request(policy_msg("VAD", {"priority": 60, "busy_policy": "SKIP", "max_wait_ms": 50}))
    assert c.request(p.ListPolicies(id=0)).policies["VAD"].priority == 60


def test_watchdog_logs_and_counts_and_can_force_release(nodes: Callable[..., Node]) -> None:
    node = nodes("1")
    c = CoreClient(node, "c")
    r = c.request(acquire_msg("gpu:0", "ASR", hold_max_ms=100))
    with capture_logs() as logs:
        node.advance(99_999)
        assert not [e for e in logs if e["event"] == "lease_overdue"]
        node.advance(1)
    [overdue] = [e for e in logs if e["event"] == "lease_overdue"]
    assert (overdue["lease_id"], overdue["held_ms"], overdue["forced_release"]) == (r.lease_id, 100.0, False)
    [lease] = leases(c)
    assert lease.overdue and lease.state == "holding"  # reported, not taken away
    c.request(p.Release(id=0, lease_id=r.lease_id))
    assert node.sample("gpud_arbiter_watchdog_exceeded_total", {"gpu": "0", "task_type": "ASR"}) == 1


def test_forced_release_when_configured(nodes: Callable[..., Node]) -> None:
    asr = PolicyConfig(priority=90, busy_policy=p.BusyPolicy.WAIT, max_wait_ms=3000, hold_max_ms=100)
    node = nodes("1", lease_force_release=True, policies={"ASR": asr})
    c, other = CoreClient(node, "c"), node.connect("other")
    r = c.request(acquire_msg("gpu:0", "ASR"))
    assert r.acquired
    assert other.call(acquire_msg("gpu:0", "NMT", max_wait_ms=2000)) is None
    node.advance(99_999)
    assert other.received() == []
    node.advance(1)
    [r2] = other.received()
    assert r2.acquired and r2.queue_wait_ms == 100.0
    c.deliver()
    assert c.core.revoked_leases == {r.lease_id}  # LEASE_REVOKED arrived
    c.request(p.Release(id=0, lease_id=r.lease_id))  # already gone: still fine
