"""The daemon's caps on what clients can make it hold, in process on a fake clock: sessions per
connection, lock and lease queues, allocation waiters, and metric series that stay bounded.

A real ``Daemon`` (``tests/inprocess.py``) started with small caps answers requests through
the listener's own ``handle_payload``; a refusal by a cap is an ERROR limit_reached whose
message names the configuration key. The gauges are refreshed as the monitor refreshes them
(``Node.publish``) and read from the daemon's own registry, which is what its metrics
endpoint serves. The caps that the listener enforces on real sockets (connections, HELLO,
unread outboxes, descriptors) are tested in ``tests/integration/test_caps.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from inprocess import Node, Peer
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from gpud.host.config import PolicyConfig
from gpud_client import protocol as p

Nodes = Callable[..., Node]


def attach(peer: Peer, gpu: int = 0) -> int:
    attached = peer.call(p.Attach(id=0, gpu=gpu))
    assert isinstance(attached, p.Attached), attached
    return int(attached.session)


def refused(answer: Any, cap: str) -> None:
    assert isinstance(answer, p.Error), answer
    assert answer.code == p.ErrorCode.LIMIT_REACHED and f"({cap})" in answer.message, answer


def queue(peer: Peer, gpu: int = 0) -> list[int]:
    return [w.session for w in peer.call(p.Status(id=0)).gpus[gpu].queue]


# --- sessions, queues and waiters -------------------------------------------------------


def test_sessions_per_connection_are_capped(nodes: Nodes) -> None:
    node = nodes(max_sessions_per_connection=2)
    a = node.connect("a")
    attach(a, 0)
    second = attach(a, 1)
    for msg in (p.Attach(id=0, gpu=0), p.Acquire(id=0, gpu=1, task_type="ASR")):
        refused(a.call(msg), "max_sessions_per_connection")
    b = node.connect("b")
    attach(b, 0)  # the cap is per connection
    assert isinstance(a.call(p.Detach(id=0, session=second)), p.Ok)
    attach(a, 1)  # room again
    assert node.sample("gpud_limit_refusals_total", {"cap": "max_sessions_per_connection"}) == 2


def test_a_lock_request_over_max_lock_queue_is_refused_and_the_queue_goes_on(nodes: Nodes) -> None:
    node = nodes(mode=p.Mode.SERIAL, max_lock_queue=2)
    holder, w1, w2, w3 = (node.connect(n) for n in ("holder", "w1", "w2", "w3"))
    sh, s1, s2, s3 = (attach(c) for c in (holder, w1, w2, w3))
    holder.send(p.LockRequest(id=0, session=sh))
    [ok] = holder.pushes(p.LockOk)
    w1.send(p.LockRequest(id=0, session=s1))
    assert queue(holder) == [s1]
    w2.send(p.LockRequest(id=0, session=s2))
    assert queue(holder) == [s1, s2]
    [err] = w3.exchange(p.LockRequest(id=41, session=s3))
    refused(err, "max_lock_queue")
    assert err.id == 41
    st = w3.call(p.Status(id=0)).gpus[0]
    assert [(h.session, h.grant) for h in st.holders] == [(sh, ok.grant)]
    assert [w.session for w in st.queue] == [s1, s2]
    holder.send(p.LockReleased(id=0, session=sh, grant=ok.grant))
    assert [m.session for m in w1.pushes(p.LockOk)] == [s1]  # the handoff to the first waiter
    assert queue(holder) == [s2]
    w3.send(p.LockRequest(id=0, session=s3))  # room again
    assert queue(holder) == [s2, s3]
    assert node.sample("gpud_limit_refusals_total", {"cap": "max_lock_queue"}) == 1


BATCH = {"BATCH": PolicyConfig(priority=50, busy_policy=p.BusyPolicy.WAIT, max_wait_ms=60_000)}


def acquire(peer: Peer, task_type: str, **terms: Any) -> list[Any]:
    """Send an ACQUIRE (id 1 more than the last) and return what came back at once."""
    peer.ids += 1
    return peer.exchange(p.Acquire(id=peer.ids, gpu=0, task_type=task_type, **terms))


def waiting_leases(peer: Peer) -> int:
    return [x.state for x in peer.call(p.ListLeases(id=0)).leases].count("waiting")


def test_lease_terms_only_tighten_the_node_and_policy(nodes: Nodes) -> None:
    node = nodes(mode=p.Mode.SERIAL, policies=BATCH, lease_queue_limit=2)
    holder, probe, w1, w2 = (node.connect(n) for n in ("holder", "probe", "w1", "w2"))
    [held] = acquire(holder, "ASR")
    assert held.acquired
    [r] = acquire(probe, "BATCH", queue_limit=0)  # lowered below the node's 2: full with nobody waiting
    assert (r.status, r.reason) == (p.LeaseStatus.SKIPPED, p.LeaseReason.QUEUE_FULL)
    assert acquire(probe, "SEMANTIC_REPAIR", max_wait_ms=86_400_000) == []  # cut to the policy's 400 ms
    node.advance_s(0.4 - 1e-6)
    assert probe.received() == []
    node.advance(1)
    [r] = probe.received()
    assert (r.status, r.reason) == (p.LeaseStatus.SKIPPED, p.LeaseReason.TIMEOUT)
    assert r.queue_wait_ms < 5000
    assert acquire(w1, "BATCH") == []
    first = w1.ids
    assert waiting_leases(probe) == 1
    assert acquire(w2, "BATCH") == []  # only now, so that it waits behind w1
    assert waiting_leases(probe) == 2
    [r] = acquire(probe, "BATCH", queue_limit=50)  # raised above the node's 2: still 2
    assert (r.status, r.reason) == (p.LeaseStatus.SKIPPED, p.LeaseReason.QUEUE_FULL)
    assert probe.call(p.ListPolicies(id=0)).policies["BATCH"].queue_limit == 2
    assert holder.exchange(p.Release(id=99, lease_id=held.lease_id or "", quiet=True)) == []
    [got] = w1.received()
    assert got.id == first and got.acquired  # the waiters were not disturbed
    assert w2.received() == []


def test_allocation_waiters_are_capped(nodes: Nodes) -> None:
    node = nodes(max_allocation_waiters=1)
    a, w1, w2 = node.connect("a"), node.connect("w1"), node.connect("w2")
    assert isinstance(a.call(p.Allocate(id=0, task_id="everything", gpus=2)), p.Allocated)
    assert w1.exchange(p.Allocate(id=17, task_id="w1", gpus=1, wait_ms=60_000)) == []
    assert a.call(p.ListAllocations(id=0)).waiting == ["w1"]
    refused(w2.call(p.Allocate(id=0, task_id="w2", gpus=1, wait_ms=60_000)), "max_allocation_waiters")
    short = w2.call(p.Allocate(id=0, task_id="w3", gpus=1))  # one that does not wait is answered as before
    assert isinstance(short, p.Error) and short.code == p.ErrorCode.INSUFFICIENT
    assert isinstance(a.call(p.Free(id=0, task_id="everything")), p.Ok)
    [got] = w1.received()
    assert isinstance(got, p.Allocated) and (got.id, got.task_id) == (17, "w1")


# --- metrics ---------------------------------------------------------------------------


def sample_lines(node: Node) -> int:
    """The samples the metrics endpoint would serve now."""
    return sum(1 for line in generate_latest(node.registry).decode().splitlines() if line and not line.startswith("#"))


def pipelined(peer: Peer, msgs: Sequence[msgspec.Struct], answer: type) -> None:
    """Send in batches of 1000, then read each batch's answers in order."""
    for k in range(0, len(msgs), 1000):
        batch = msgs[k : k + 1000]
        for m in batch:
            peer.send(m)
        got = peer.received()
        assert [type(g) for g in got] == [answer] * len(batch)
        assert [g.id for g in got] == [m.id for m in batch]  # type: ignore[attr-defined]


def test_metric_series_stay_bounded(nodes: Nodes) -> None:
    node = nodes(mode=p.Mode.SERIAL)
    c = node.connect("many-types")
    [lease] = acquire(c, "ASR")
    assert lease.acquired  # GPU 0 is busy: every acquire below is answered at once
    pipelined(c, [p.Acquire(id=2, gpu=0, task_type="warm-up", max_wait_ms=0)], p.LeaseResult)
    pipelined(c, [p.ReportOom(id=3, gpu=0, task_type="warm-up")], p.Ok)
    node.publish()
    assert node.sample("gpud_gpu_holders", {"gpu": "0"}) == 1
    before = sample_lines(node)
    with capture_logs():  # 40 000 log lines, kept rather than rendered
        pipelined(
            c, [p.Acquire(id=10 + i, gpu=0, task_type=f"T{i}", max_wait_ms=0) for i in range(20_000)], p.LeaseResult
        )
        pipelined(c, [p.ReportOom(id=30_010 + i, gpu=0, task_type=f"T{i}") for i in range(20_000)], p.Ok)
    node.publish()
    assert sample_lines(node) - before <= 3
    assert node.sample("gpud_gpu_oom_total", {"gpu": "0", "task_type": "OTHER"}) == 20_001  # the policy they run under
    assert node.sample("gpud_arbiter_acquire_total", {"gpu": "0", "task_type": "OTHER", "status": "SKIPPED"}) == 20_001
    assert 'task_type="other"' not in generate_latest(node.registry).decode()  # one label for OTHER, not two

    s = node.connect("gauged")
    sid = attach(s, 1)
    s.call(p.SetLimits(id=0, session=sid, mem_limit=2**30))
    gauges = [
        "gpud_session_core_limit_ratio",
        "gpud_session_window_used_seconds",
        "gpud_session_throttled",
        "gpud_session_memory_bytes",
        "gpud_session_memory_limit_bytes",
    ]

    def session_sample(name: str) -> float | None:
        return series(node, name, session=str(sid))

    node.publish()
    assert all(session_sample(g) is not None for g in gauges)
    s.call(p.SetLimits(id=0, session=sid, mem_limit=0))  # lifted: no limit series
    node.publish()
    assert session_sample("gpud_session_memory_limit_bytes") is None
    assert session_sample("gpud_session_core_limit_ratio") == 1.0
    assert isinstance(s.call(p.Detach(id=0, session=sid)), p.Ok)
    node.publish()
    assert all(session_sample(g) is None for g in gauges)


def series(node: Node, name: str, **labels: str) -> float | None:
    """The value of the first sample of ``name`` whose labels include ``labels``; None if there is none."""
    for family in node.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
