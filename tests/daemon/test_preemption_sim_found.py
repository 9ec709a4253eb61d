"""Preemption bugs the whole-daemon simulation (``tests/sim/daemon_sim.py``) found, each replayed
as the few steps that show it, so each stays fixed.

In-process (``tests/inprocess.py``): a real ``Daemon`` on a fake clock, its store on a real SQLite
file; a crash is the store closed and a new ``Node`` on the same state directory. Each docstring
names a seed of the simulation that fails without the fix
(``.venv/bin/python -m tests.sim.daemon_sim --seed N``).
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from inprocess import Node  # tests/ is on the path of its top-level modules

from gpud.capabilities.allocations import STORE_RETRY_US
from gpud_client import protocol as p

from .test_preemption import alloc, production_waits

GRACE_S = 10.0
SETTINGS = {"preemption_grace_s": GRACE_S, "preemption_min_runtime_s": 0}


def test_a_suspended_allocation_keeps_its_preemption_count_and_resume_flag_across_a_crash(
    nodes: Callable[..., Node],
) -> None:
    """Seed 0: the store kept one (preemptions, resume) pair per task and wrote the history's for a
    suspended one, (0, False): after a crash the allocation resumed as if never preempted, and its
    program started afresh instead of from its checkpoint."""
    first = nodes("1x16GiB", **SETTINGS)
    victim = first.connect("victim")
    terms = {"gpus": 1.0, "priority": 10, "on_preempt": p.Recovery.SUSPEND}
    alloc(victim, "train", **terms)
    waiter = production_waits(first)
    assert isinstance(victim.call(p.Yield(id=0, task_id="train")), p.Ok)
    assert isinstance(waiter.received()[0], p.Allocated)
    first.daemon.allocations.store.close()  # gpud crashes: only the store is left
    again = Node("1x16GiB", state_dir=first.config.state_dir, **SETTINGS)
    try:
        again.fake.us = first.now()
        holder = again.connect("victim")
        held = alloc(holder, "train", **terms)  # its runner asks again: the holder once more
        assert (held.state, held.preemptions, held.resume) == (p.AllocState.SUSPENDED, 1, True)
        prod = again.connect("prod", uid=0, gid=0)
        assert isinstance(prod.call(p.Free(id=0, task_id="prod")), p.Ok)
        (resumed,) = holder.pushes(p.AllocChanged)
        assert resumed.change == "resumed"
        assert (resumed.allocation.preemptions, resumed.allocation.resume) == (1, True)
    finally:
        again.close_store()


def test_a_holder_back_on_a_draining_gpu_wakes_the_timer_that_tells_it_to_leave(nodes: Callable[..., Node]) -> None:
    """Seed 55: an allocation nobody could be told about (its holder gone) gets no drain notice; when
    its runner came back the notice waited for some other deadline of the allocations' timer, which
    with nothing else to do slept on: the drain never finished."""
    node = nodes("1x16GiB", **SETTINGS)
    holder = node.connect("holder")
    alloc(holder, "job", gpus=1.0, priority=10)
    node.close(holder)
    admin = node.connect("admin", uid=0, gid=0)
    assert isinstance(admin.call(p.Drain(id=0, gpu=0)), p.Drained)
    assert node.next_deadline() is None  # no one to tell, nothing to wait for
    node.daemon.allocations_wake = trio.Event()  # the timer task sleeps on this until woken
    back = node.connect("holder")
    assert alloc(back, "job", gpus=1.0, priority=10).state == p.AllocState.RUNNING
    assert node.daemon.allocations_wake.is_set()  # it runs at once, not at the next unrelated deadline
    node.tick()
    (notice,) = back.pushes(p.Preempt)
    assert (notice.task_id, notice.reason) == ("job", p.PreemptReason.DRAIN)


def test_a_wait_given_up_while_the_store_fails_tells_its_victims_and_is_stored_later(
    nodes: Callable[..., Node],
) -> None:
    """Seed 57: a waiter's connection closed while the store refused the write; the ledger withdrew
    the notices anyway but nobody told their holders (they went on leaving for nothing, and a YIELD
    was refused), and the store kept the wait until some other change was written."""
    node = nodes("1x16GiB", **SETTINGS)
    victim = node.connect("victim")
    alloc(victim, "batch", gpus=1.0, priority=10)
    waiter = production_waits(node)
    assert len(victim.pushes(p.Preempt)) == 1
    assert "prod" in node.stored()
    node.failing_writes = True
    node.close(waiter)
    assert [w.task_id for w in victim.pushes(p.PreemptWithdrawn)] == ["batch"]
    assert node.daemon.allocations.ledger.notice_of("batch") is None
    node.failing_writes = False
    node.advance(STORE_RETRY_US)  # the allocations' timer tries the write again
    assert node.stored() == ["batch"]


def test_a_task_id_whose_wait_expired_belongs_to_whoever_asks_for_it_next(nodes: Callable[..., Node]) -> None:
    """Seed 2: the uid of a wait that expired (or of an allocation taken back, whose
    preemption history is kept) stayed recorded as the task id's owner; the next uid to wait for that
    task id got the allocation stored under the first one's uid, and could not free it, while the
    first could."""
    node = nodes("1x16GiB", **SETTINGS)
    holder = node.connect("holder")
    alloc(holder, "full", gpus=1.0)
    first = node.connect("first", uid=4321, gid=4321)
    assert first.call(p.Allocate(id=0, task_id="job", gpus=1.0, wait_ms=100)) is None
    node.advance_s(0.1)
    (expired,) = first.received()
    assert isinstance(expired, p.Error) and expired.code == p.ErrorCode.INSUFFICIENT
    second = node.connect("second", uid=5555, gid=5555)
    assert second.call(p.Allocate(id=0, task_id="job", gpus=1.0, wait_ms=60_000)) is None
    assert isinstance(holder.call(p.Free(id=0, task_id="full")), p.Ok)
    (granted,) = second.received()
    assert isinstance(granted, p.Allocated) and granted.task_id == "job"
    refused = first.call(p.Free(id=0, task_id="job"))
    assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.PERMISSION_DENIED
    assert isinstance(second.call(p.Free(id=0, task_id="job")), p.Ok)


def test_a_gpu_kept_for_a_waiter_that_gives_up_goes_to_the_next_waiter_at_once(nodes: Callable[..., Node]) -> None:
    """Seed 143: a GPU a victim gave back is kept for the waiter it was taken for; when that waiter gave
    up, the GPU was open again but nothing served the next waiter, which went on waiting (and took
    another allocation back) though it fit."""
    node = nodes("2x16GiB", **SETTINGS)
    first, second = node.connect("first"), node.connect("second")
    assert alloc(first, "v1", gpus=1.0, priority=10).gpus == [0]
    assert alloc(second, "v2", gpus=1.0, priority=10).gpus == [1]
    big = node.connect("big", uid=0, gid=0)
    big.send(p.Allocate(id=7, task_id="big", gpus=2.0, priority_class=p.PriorityClass.PRODUCTION, wait_ms=600_000))
    assert [n.task_id for n in first.pushes(p.Preempt) + second.pushes(p.Preempt)] == ["v1", "v2"]
    assert isinstance(first.call(p.Yield(id=0, task_id="v1")), p.Ok)  # GPU 0 is kept for "big"
    small = node.connect("small")
    assert small.call(p.Allocate(id=0, task_id="small", gpus=0.5, wait_ms=600_000)) is None
    node.close(big)  # it gives up: GPU 0 is no one's
    (granted,) = small.received()
    assert isinstance(granted, p.Allocated) and (granted.task_id, granted.gpus) == ("small", [0])
    assert [w.task_id for w in second.pushes(p.PreemptWithdrawn)] == ["v2"]


def test_suspended_allocations_survive_a_crash_whatever_the_cap_on_waits(nodes: Callable[..., Node]) -> None:
    """Seed 56: at start-up every stored wait counted against max_allocation_waiters, suspended
    allocations too (which are no request, and are suspended beyond the cap): one over it was set
    aside, an acknowledged allocation lost across the crash."""
    settings = {**SETTINGS, "max_allocation_waiters": 1}
    first = nodes("2x16GiB", **settings)
    holders = [first.connect("one"), first.connect("two")]
    for peer, task in zip(holders, ["one", "two"], strict=True):
        alloc(peer, task, gpus=1.0, priority=10, on_preempt=p.Recovery.SUSPEND)
    big = first.connect("big", uid=0, gid=0)
    big.send(p.Allocate(id=7, task_id="big", gpus=2.0, priority_class=p.PriorityClass.PRODUCTION, wait_ms=600_000))
    for peer, task in zip(holders, ["one", "two"], strict=True):
        assert isinstance(peer.call(p.Yield(id=0, task_id=task)), p.Ok)
    assert isinstance(big.received()[0], p.Allocated)
    first.daemon.allocations.store.close()  # gpud crashes: only the store is left
    again = Node("2x16GiB", state_dir=first.config.state_dir, **settings)
    try:
        reply = again.connect("watcher").call(p.ListAllocations(id=0))
        states = {a.task_id: a.state for a in reply.allocations}
        assert states == {"big": p.AllocState.RUNNING, "one": p.AllocState.SUSPENDED, "two": p.AllocState.SUSPENDED}
    finally:
        again.close_store()
