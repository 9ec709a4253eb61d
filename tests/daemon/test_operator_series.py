"""The series the Prometheus rules and the Grafana dashboard (deploy/) are built on, beyond the GPUs'
and the locks': tenants' quota, borrowing limit and use, the time from an allocation request to its
grant, a task taken back again and again, elastic growth, a session's achieved share of its GPU.

In-process (``tests/inprocess.py``): a real ``Daemon`` on a fake clock; the gauges refreshed as the
monitor refreshes them (``Node.publish``). The rules themselves are checked against a real Prometheus
in tests/integration/test_prometheus.py.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from inprocess import Node, Peer  # tests/ is on the path of its top-level modules
from prometheus_client.samples import Sample

from gpud.host.config import TenantConfig
from gpud_client import protocol as p

TENANTS = {"team-a": TenantConfig(gpus=1, borrow=1), "team-b": TenantConfig(gpus=1)}


PRODUCTION_WAITS = p.Allocate(id=7, task_id="prod", gpus=1.0, priority_class=p.PriorityClass.PRODUCTION, wait_ms=60_000)


def alloc(peer: Peer, task: str, **fields: object) -> p.Allocated:
    reply = peer.call(p.Allocate(id=0, task_id=task, **fields))  # type: ignore[arg-type]
    assert isinstance(reply, p.Allocated), reply
    return reply


def test_each_tenants_quota_borrowing_limit_and_use_are_gauges_that_go_with_the_tenant(
    nodes: Callable[..., Node],
) -> None:
    node = nodes("2x16GiB", tenants=TENANTS)
    a = node.connect("a")
    alloc(a, "a-1", gpus=1.0, tenant="team-a")
    alloc(a, "a-2", gpus=0.5, tenant="team-a")  # half a GPU of team-b's idle quota, borrowed
    node.publish()
    assert node.sample("gpud_tenant_allocated_gpus", {"tenant": "team-a"}) == 1.5
    assert node.sample("gpud_tenant_quota_gpus", {"tenant": "team-a"}) == 1
    assert node.sample("gpud_tenant_borrow_limit_gpus", {"tenant": "team-a"}) == 1
    assert node.sample("gpud_tenant_allocated_gpus", {"tenant": "team-b"}) == 0
    assert node.sample("gpud_tenant_borrow_limit_gpus", {"tenant": "team-b"}) == 0
    a.call(p.Free(id=0, task_id="a-2"))
    node.publish()
    assert node.sample("gpud_tenant_allocated_gpus", {"tenant": "team-a"}) == 1
    # A reload that removes a tenant removes its series at the next refresh; the others stay.
    node.daemon.reload(msgspec.structs.replace(node.config, tenants={"team-a": TENANTS["team-a"]}), node.now())
    node.publish()
    for name in ("gpud_tenant_quota_gpus", "gpud_tenant_borrow_limit_gpus", "gpud_tenant_allocated_gpus"):
        assert node.sample(name, {"tenant": "team-b"}) is None
        assert node.sample(name, {"tenant": "team-a"}) is not None


def test_the_time_from_request_to_grant_is_observed_by_tenant(nodes: Callable[..., Node]) -> None:
    node = nodes("1x16GiB", tenants=TENANTS)
    # Primed: every configured tenant's (and no tenant's) histogram exists before any request.
    for tenant in ("", "team-a", "team-b"):
        assert node.sample("gpud_allocation_wait_seconds_count", {"tenant": tenant}) == 0
    holder, waiter = node.connect("holder"), node.connect("waiter")
    alloc(holder, "first", gpus=1.0, tenant="team-a")
    assert waiter.call(p.Allocate(id=0, task_id="second", gpus=1.0, wait_ms=60_000)) is None
    node.advance_s(3)
    holder.call(p.Free(id=0, task_id="first"))
    (granted,) = waiter.received()
    assert isinstance(granted, p.Allocated) and granted.task_id == "second"
    assert node.sample("gpud_allocation_wait_seconds_count", {"tenant": "team-a"}) == 1
    assert node.sample("gpud_allocation_wait_seconds_sum", {"tenant": "team-a"}) == 0  # at once
    assert node.sample("gpud_allocation_wait_seconds_count", {"tenant": ""}) == 1
    assert node.sample("gpud_allocation_wait_seconds_sum", {"tenant": ""}) == 3
    assert node.sample("gpud_allocation_wait_seconds_bucket", {"tenant": "", "le": "2.5"}) == 0
    assert node.sample("gpud_allocation_wait_seconds_bucket", {"tenant": "", "le": "5.0"}) == 1
    alloc(waiter, "second", gpus=1.0)  # the same task again: repeated, no second observation
    assert node.sample("gpud_allocation_wait_seconds_count", {"tenant": ""}) == 1
    assert node.sample("gpud_allocation_requests_total", {"result": "repeated"}) == 1


def test_a_task_told_to_leave_a_third_time_is_counted_as_repeated(nodes: Callable[..., Node]) -> None:
    node = nodes("1x16GiB", preemption_grace_s=10, preemption_min_runtime_s=0)
    victim, admin = node.connect("victim"), node.connect("prod", uid=0, gid=0)
    assert node.sample("gpud_preemptions_repeated_total", {"reason": "priority"}) == 0  # primed
    assert node.sample("gpud_preemption_grace_overruns_total", {"reason": "priority"}) == 0
    assert node.sample("gpud_preemptions_total", {"reason": "priority", "strategy": "lowest_priority"}) == 0
    repeated = []
    for _ in range(3):
        alloc(victim, "batch", gpus=1.0, priority=10)
        admin.send(PRODUCTION_WAITS)
        (notice,) = victim.pushes(p.Preempt)
        assert notice.task_id == "batch"
        repeated.append(node.sample("gpud_preemptions_repeated_total", {"reason": "priority"}))
        victim.call(p.Yield(id=0, task_id="batch"))
        assert [m.task_id for m in admin.received()] == ["prod"]
        admin.call(p.Free(id=0, task_id="prod"))
    assert repeated == [0, 0, 1]  # taken back twice already when told the third time
    assert node.sample("gpud_preemptions_total", {"reason": "priority", "strategy": "lowest_priority"}) == 3
    # Ending normally forgets the history: told again, it is no repeat.
    alloc(victim, "batch", gpus=1.0, priority=10)
    victim.call(p.Free(id=0, task_id="batch"))
    alloc(victim, "batch", gpus=1.0, priority=10)
    admin.send(PRODUCTION_WAITS)
    assert len(victim.pushes(p.Preempt)) == 1
    assert node.sample("gpud_preemptions_repeated_total", {"reason": "priority"}) == 1


def test_each_elastic_growth_is_counted(nodes: Callable[..., Node]) -> None:
    node = nodes("2x16GiB", elastic_window_s=5, elastic_cooldown_s=0)
    holder = node.connect("holder")
    alloc(holder, "other", gpus=1.0, prefer=[1])
    assert alloc(holder, "elastic", gpus=1.0, gpus_max=2, priority=10).gpus == [0]
    assert node.sample("gpud_allocations_grown_total") == 0
    holder.call(p.Free(id=0, task_id="other"))
    node.advance_s(5)
    (grown,) = holder.pushes(p.AllocChanged)
    assert (grown.change, grown.allocation.gpus) == ("grown", [0, 1])
    assert node.sample("gpud_allocations_grown_total") == 1


def test_a_sessions_achieved_share_is_a_gauge_that_goes_with_the_session(nodes: Callable[..., Node]) -> None:
    node = nodes("2x16GiB", compute_window_s=1.0)
    peer = node.connect("trainer")
    busy = peer.call(p.Attach(id=0, gpu=0, core_limit=100))
    idle = peer.call(p.Attach(id=0, gpu=1, core_limit=40))
    assert isinstance(busy, p.Attached) and isinstance(idle, p.Attached)
    peer.send(p.LockRequest(id=0, session=busy.session))
    assert [m.session for m in peer.pushes(p.LockOk)] == [busy.session]
    node.advance_s(4.5)  # four whole windows, the lock held through them
    node.publish()
    labels = {"gpu": "0", "session": str(busy.session), "client": "trainer"}
    share = [s for s in _samples(node, "gpud_session_share_ratio") if labels.items() <= s.labels.items()]
    assert [s.value for s in share] == [1.0]
    idle_labels = {"gpu": "1", "session": str(idle.session)}
    (idle_share,) = [s for s in _samples(node, "gpud_session_share_ratio") if idle_labels.items() <= s.labels.items()]
    assert idle_share.value == 0
    node.close(peer)
    assert _samples(node, "gpud_session_share_ratio") == []


def _samples(node: Node, name: str) -> list[Sample]:
    return [s for family in node.registry.collect() for s in family.samples if s.name == name]
