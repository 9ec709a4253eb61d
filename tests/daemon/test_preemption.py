"""Taking allocations back through the protocol: the notice pushed to the holder, the grace, YIELD,
the revocation when the grace ends, suspend and resume, the resume flag after a checkpoint, no one
to tell, an owner told by a signal, drain, protection, a restart in the middle, a store that fails.

In-process (``tests/inprocess.py``): a real ``Daemon`` on a fake clock, its store on a real SQLite
file. The rules themselves (strategies, minimum runtime, elastic growth, quota reclaim) are tested
on the ledger in ``tests/core/test_preemption.py``.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator

import msgspec
import pytest
from inprocess import Node, Peer  # tests/ is on the path of its top-level modules

from gpud_client import protocol as p

GRACE_S = 10.0


@pytest.fixture
def node(nodes: Callable[..., Node]) -> Node:
    return nodes("1x16GiB", preemption_grace_s=GRACE_S, preemption_min_runtime_s=0)


def alloc(peer: Peer, task: str, **fields: object) -> p.Allocated:
    reply = peer.call(p.Allocate(id=0, task_id=task, **fields))  # type: ignore[arg-type]
    assert isinstance(reply, p.Allocated), reply
    return reply


def listing(peer: Peer) -> p.AllocationsReply:
    reply = peer.call(p.ListAllocations(id=0))
    assert isinstance(reply, p.AllocationsReply), reply
    return reply


def state_of(peer: Peer, task: str) -> p.Allocated:
    (a,) = [a for a in listing(peer).allocations if a.task_id == task]
    return a


def production_waits(node: Node, task: str = "prod") -> Peer:
    """An admin's production request that waits; it is not answered yet."""
    waiter = node.connect("prod", uid=0, gid=0)
    waiter.send(p.Allocate(id=7, task_id=task, gpus=1.0, priority_class=p.PriorityClass.PRODUCTION, wait_ms=600_000))
    assert waiter.received() == []
    return waiter


def test_a_victim_is_told_keeps_its_gpu_until_it_yields_and_the_waiter_then_gets_it(node: Node) -> None:
    victim = node.connect("victim")
    alloc(victim, "batch", gpus=1.0, priority_class=p.PriorityClass.BEST_EFFORT)
    waiter = production_waits(node)
    (notice,) = victim.pushes(p.Preempt)
    assert (notice.task_id, notice.reason, notice.recovery, notice.gpus, notice.whole, notice.by) == (
        "batch",
        p.PreemptReason.PRIORITY,
        p.Recovery.TERMINATE,
        [0],
        True,
        "prod",
    )
    assert notice.grace_s == GRACE_S
    node.advance_s(GRACE_S / 2)
    a = state_of(victim, "batch")  # its GPU is still its own: no device is held twice
    assert a.state == p.AllocState.PREEMPTING and 0 < a.deadline_s <= GRACE_S / 2 and a.why == "priority for prod"
    assert waiter.received() == []
    assert isinstance(victim.call(p.Yield(id=0, task_id="batch")), p.Ok)
    (granted,) = waiter.received()
    assert isinstance(granted, p.Allocated) and (granted.task_id, granted.gpus) == ("prod", [0])
    (revoked,) = victim.pushes(p.AllocRevoked)
    assert (revoked.task_id, revoked.gone, revoked.state) == ("batch", True, p.AllocState.RUNNING)
    assert [a.task_id for a in listing(victim).allocations] == ["prod"]
    assert node.sample("gpud_preemptions_total", {"reason": "priority", "strategy": "lowest_priority"}) == 1


def test_a_victim_that_never_leaves_is_revoked_when_its_grace_ends(node: Node) -> None:
    victim = node.connect("victim")
    alloc(victim, "batch", gpus=1.0, priority=10)
    waiter = production_waits(node)
    node.advance_s(GRACE_S - 0.001)
    assert waiter.received() == []  # the grace is the victim's to the end
    node.advance_s(0.001)
    (granted,) = waiter.received()
    assert isinstance(granted, p.Allocated) and granted.task_id == "prod"
    assert [r.gone for r in victim.pushes(p.AllocRevoked)] == [True]
    assert node.sample("gpud_preemption_grace_overruns_total", {"reason": "priority"}) == 1


def test_a_suspended_allocation_waits_for_its_gpu_and_resumes_with_it(node: Node) -> None:
    victim = node.connect("victim")
    before = alloc(victim, "train", gpus=1.0, priority=10, on_preempt=p.Recovery.SUSPEND)
    waiter = production_waits(node)
    assert [n.recovery for n in victim.pushes(p.Preempt)] == [p.Recovery.SUSPEND]
    victim.call(p.Yield(id=0, task_id="train"))
    (revoked,) = victim.pushes(p.AllocRevoked)
    assert (revoked.gone, revoked.state) == (False, p.AllocState.SUSPENDED)
    assert isinstance(waiter.received()[0], p.Allocated)
    suspended = state_of(victim, "train")
    assert (suspended.state, suspended.preemptions) == (p.AllocState.SUSPENDED, 1)
    waiter.call(p.Free(id=0, task_id="prod"))
    (resumed,) = victim.pushes(p.AllocChanged)
    assert resumed.change == "resumed" and resumed.allocation.gpus == before.gpus
    assert state_of(victim, "train").state == p.AllocState.RUNNING


def test_after_a_checkpoint_preemption_the_next_start_is_told_it_resumes(node: Node) -> None:
    victim = node.connect("victim")
    alloc(victim, "etl", gpus=1.0, priority=10, on_preempt=p.Recovery.CHECKPOINT)
    waiter = production_waits(node)
    victim.call(p.Free(id=0, task_id="etl"))  # it saved and ended: freeing is yielding
    assert isinstance(waiter.received()[0], p.Allocated)
    again = node.connect("victim")
    again.send(p.Allocate(id=3, task_id="etl", gpus=1.0, priority=10, on_preempt=p.Recovery.CHECKPOINT, wait_ms=60_000))
    waiter.call(p.Free(id=0, task_id="prod"))
    (resumed,) = again.received()
    assert isinstance(resumed, p.Allocated) and (resumed.resume, resumed.preemptions) == (True, 1)
    again.call(p.Free(id=0, task_id="etl"))  # it ended of itself: its next start begins afresh
    assert alloc(again, "etl", gpus=1.0, priority=10).resume is False


def test_a_waiter_that_gives_up_withdraws_the_notice(node: Node) -> None:
    victim = node.connect("victim")
    alloc(victim, "batch", gpus=1.0, priority=10)
    waiter = production_waits(node)
    assert len(victim.pushes(p.Preempt)) == 1
    node.close(waiter)
    assert [w.task_id for w in victim.pushes(p.PreemptWithdrawn)] == ["batch"]
    assert state_of(victim, "batch").state == p.AllocState.RUNNING
    production_waits(node, "prod-2")  # the victim rests a while (preemption_cooldown_s): no thrash
    assert victim.pushes(p.Preempt) == []


def test_an_allocation_no_one_can_be_told_about_is_not_taken_back(node: Node) -> None:
    once = node.connect("gpuctl")
    alloc(once, "one-shot", gpus=1.0, priority=0)
    node.close(once)  # a one-shot gpuctl alloc: no owner pid, no connection
    waiter = production_waits(node)
    node.advance_s(GRACE_S * 2)
    assert waiter.received() == []
    a = state_of(waiter, "one-shot")
    assert (a.preemptible, a.why) == (
        False,
        "no one to tell: no client holds it and it has no owner process gpud may signal",
    )


@pytest.fixture
def owner() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # until a signal ends it
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_with_no_client_to_tell_the_owner_process_is_sent_sigterm(node: Node, owner: subprocess.Popen[bytes]) -> None:
    once = node.connect("gpuctl")
    alloc(once, "script", gpus=1.0, priority=10, owner_pid=owner.pid)
    node.close(once)
    waiter = production_waits(node)
    assert owner.wait(timeout=30) == -signal.SIGTERM  # told as Kubernetes tells a pod
    node.advance_s(GRACE_S)
    assert isinstance(waiter.received()[0], p.Allocated)


def test_drain_tells_every_allocation_on_the_gpu_and_refuses_new_work(node: Node) -> None:
    holder = node.connect("holder")
    alloc(holder, "prod-job", gpus=0.5, priority=0)
    admin = node.connect("admin", uid=0, gid=0)
    drained = admin.call(p.Drain(id=0, gpu=0))
    assert isinstance(drained, p.Drained) and (drained.gpu, drained.draining, drained.was_draining) == (0, True, False)
    (notice,) = holder.pushes(p.Preempt)
    assert (notice.reason, notice.by) == (p.PreemptReason.DRAIN, "drain")
    status = admin.call(p.Status(id=0)).gpus[0]
    assert (status.draining, status.drained) == (True, False)
    refused = admin.call(p.Allocate(id=0, task_id="new", gpus=0.25))
    assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.INSUFFICIENT
    refused = node.connect("other", uid=4321, gid=4321).call(p.Attach(id=0, gpu=0))  # no allocation of its own
    assert isinstance(refused, p.Error) and "being drained" in refused.message
    holder.call(p.Yield(id=0, task_id="prod-job"))
    status = admin.call(p.Status(id=0)).gpus[0]
    assert (status.draining, status.drained) == (True, True)
    admin.call(p.Drain(id=0, gpu=0, on=False))
    assert isinstance(admin.call(p.Allocate(id=0, task_id="new", gpus=0.25)), p.Allocated)


def test_protecting_needs_an_admin_and_keeps_the_allocation(node: Node) -> None:
    holder = node.connect("holder", uid=4321, gid=4321)
    alloc(holder, "keep", gpus=1.0, priority=10)
    refused = holder.call(p.Protect(id=0, task_id="keep"))
    assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.PERMISSION_DENIED
    admin = node.connect("admin", uid=0, gid=0)
    assert isinstance(admin.call(p.Protect(id=0, task_id="keep")), p.Ok)
    production_waits(node)
    assert holder.pushes(p.Preempt) == []
    assert (state_of(admin, "keep").preemptible, state_of(admin, "keep").why) == (False, "protected by an admin")


def test_a_restart_in_the_middle_of_a_preemption_resumes_where_it_was(nodes: Callable[..., Node]) -> None:
    first = nodes("1x16GiB", preemption_grace_s=GRACE_S, preemption_min_runtime_s=0)
    victim = first.connect("victim")
    alloc(victim, "batch", gpus=1.0, priority=10, on_preempt=p.Recovery.CHECKPOINT)
    production_waits(first)
    first.advance_s(GRACE_S / 2)
    first.daemon.allocations.store.close()  # gpud crashes: only the store is left
    again = Node("1x16GiB", state_dir=first.config.state_dir, preemption_grace_s=GRACE_S, preemption_min_runtime_s=0)
    try:
        again.fake.us = first.now()
        watcher = again.connect("watcher")
        a = state_of(watcher, "batch")
        assert a.state == p.AllocState.PREEMPTING and a.deadline_s == pytest.approx(GRACE_S / 2)
        assert [w.task_id for w in listing(watcher).waiters] == ["prod"]
        waiter = production_waits(again)  # its client asks again: the wait is its own again
        again.advance_s(GRACE_S / 2)
        (granted,) = waiter.received()
        assert isinstance(granted, p.Allocated) and granted.task_id == "prod"
        assert again.daemon.allocations.ledger.history_of("batch") == (1, True)
    finally:
        again.close_store()


def test_a_store_that_fails_at_the_grace_end_changes_nothing_until_it_works(node: Node) -> None:
    victim = node.connect("victim")
    alloc(victim, "batch", gpus=1.0, priority=10)
    waiter = production_waits(node)
    node.failing_writes = True
    node.advance_s(GRACE_S)
    assert waiter.received() == [] and state_of(victim, "batch").state == p.AllocState.PREEMPTING
    node.failing_writes = False
    node.advance_s(0.1)  # tried again a little later, not in a loop
    assert isinstance(waiter.received()[0], p.Allocated)


def test_a_store_of_schema_1_is_read(node: Node) -> None:
    holder = node.connect("holder")
    alloc(holder, "old", gpus=0.5)
    path = os.path.join(node.config.state_dir, "allocations.sqlite3")
    node.daemon.allocations.store.close()
    db = sqlite3.connect(path)
    (blob,) = db.execute("SELECT record FROM allocations").fetchone()
    record = msgspec.msgpack.decode(blob)
    old = {
        k: record[k]
        for k in ("task_id", "gpus", "share", "cpus", "tenant", "priority", "owner_pid", "created_us", "uid")
    }
    db.execute("UPDATE allocations SET record = ?", (msgspec.msgpack.encode(old),))
    db.execute("UPDATE meta SET value = '1' WHERE key = 'schema'")
    db.commit()
    db.close()
    again = Node("1x16GiB", state_dir=node.config.state_dir)
    try:
        a = state_of(again.connect("reader"), "old")
        assert (a.share, a.on_preempt, a.state) == (0.5, p.Recovery.TERMINATE, p.AllocState.RUNNING)
    finally:
        again.close_store()


def test_a_suspended_allocation_is_its_owners_to_free_and_to_hold_again(node: Node) -> None:
    victim = node.connect("victim", uid=4321, gid=4321)
    alloc(victim, "train", gpus=1.0, priority=10, on_preempt=p.Recovery.SUSPEND)
    waiter = production_waits(node)
    victim.call(p.Yield(id=0, task_id="train"))
    assert isinstance(waiter.received()[0], p.Allocated)
    stranger = node.connect("stranger", uid=5555, gid=5555)
    taken = stranger.call(p.Allocate(id=0, task_id="train", gpus=1.0, priority=10, on_preempt=p.Recovery.SUSPEND))
    assert isinstance(taken, p.Error) and taken.code == p.ErrorCode.PERMISSION_DENIED
    again = node.connect("victim", uid=4321, gid=4321)  # its run after a reconnect: the holder again
    held = alloc(again, "train", gpus=1.0, priority=10, on_preempt=p.Recovery.SUSPEND)
    assert held.state == p.AllocState.SUSPENDED
    assert isinstance(again.call(p.Free(id=0, task_id="train")), p.Ok)  # it gives up: nothing waits any more
    waiter.call(p.Free(id=0, task_id="prod"))
    assert again.pushes(p.AllocChanged) == [] and listing(again).allocations == []


def test_a_holder_that_does_not_listen_has_its_owner_signalled_instead(
    node: Node, owner: subprocess.Popen[bytes]
) -> None:
    """A client that allocated without listening for PREEMPT (``notify`` false: the client library says
    so when it has no allocation listener) would let the grace run out with its program still on
    the GPU: its owner process is told by SIGTERM, as with no client at all."""
    deaf = node.connect("actor")
    alloc(deaf, "actor-1", gpus=1.0, priority=10, owner_pid=owner.pid, notify=False)
    production_waits(node)
    assert owner.wait(timeout=30) == -signal.SIGTERM
    assert deaf.pushes(p.Preempt) == []


def test_an_elastic_allocation_on_idle_gpus_is_told_to_give_its_extras_back(nodes: Callable[..., Node]) -> None:
    """With ``elastic_busy_percent`` the monitor's readings pace elastic allocations: a simulated GPU
    nobody holds the lock of reads idle, so after the window the extras are asked back."""
    node = nodes("2x16GiB", elastic_busy_percent=50, elastic_window_s=5, elastic_cooldown_s=0)
    holder = node.connect("holder")
    assert alloc(holder, "elastic", gpus=1.0, gpus_max=2, priority=10).gpus == [0, 1]
    node.publish()  # the monitor's reading: no lock held, 0 % busy
    node.advance_s(4.9)
    assert holder.pushes(p.Preempt) == []
    node.advance_s(0.1)
    (notice,) = holder.pushes(p.Preempt)
    assert (notice.gpus, notice.whole, notice.by, notice.reason) == ([1], False, "idle", p.PreemptReason.ELASTIC)
    holder.call(p.Yield(id=0, task_id="elastic"))
    (shrunk,) = holder.pushes(p.AllocChanged)
    assert (shrunk.change, shrunk.allocation.gpus) == ("shrunk", [0])


def test_unprotecting_lets_a_waiter_take_it_back_at_once(node: Node) -> None:
    holder = node.connect("holder", uid=4321, gid=4321)
    alloc(holder, "keep", gpus=1.0, priority=10)
    admin = node.connect("admin", uid=0, gid=0)
    admin.call(p.Protect(id=0, task_id="keep"))
    production_waits(node)
    assert holder.pushes(p.Preempt) == []
    admin.call(p.Protect(id=0, task_id="keep", protected=False))
    assert [n.task_id for n in holder.pushes(p.Preempt)] == ["keep"]  # not at some later tick
