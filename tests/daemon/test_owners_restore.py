"""After a restart: what waited for a client that never comes back, and owners held again only
when they are the very process the store names.

In process, on a fake clock, the store on a real SQLite file; a crash is the store closed and a
new daemon started on the same file.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from inprocess import Node, Peer  # tests/ is on the path of its top-level modules

from gpud.core.owners import ProcessFacts
from gpud.host.owners import TaskOwners
from gpud.host.procs import KERNEL, Held, Signals, read_facts
from gpud_client import protocol as p

GRACE_S = 2.0
SETTINGS = {
    "preemption_grace_s": GRACE_S,
    "preemption_min_runtime_s": 0,
    "crash_grace_s": 5.0,
    "reap_interval_s": 0.5,
}


def restarted(first: Node) -> Node:
    first.daemon.allocations.store.close()  # gpud crashes: only the store is left
    again = Node("1x16GiB", state_dir=first.config.state_dir, **SETTINGS)
    again.fake.us = first.now()
    return again


def waits_with_a_victim(node: Node) -> Peer:
    victim = node.connect("victim")
    victim.call(p.Allocate(id=0, task_id="batch", gpus=1.0, priority=10))
    admin = node.connect("prod", uid=0, gid=0)
    admin.send(p.Allocate(id=0, task_id="prod", gpus=1.0, priority_class=p.PriorityClass.PRODUCTION, wait_ms=60_000))
    return admin


def tasks(node: Node) -> list[str]:
    return [a.task_id for a in node.connect("look").call(p.ListAllocations(id=0)).allocations]


def test_a_restored_wait_served_while_its_client_is_away_is_released_after_the_crash_grace(
    nodes: Callable[..., Node],
) -> None:
    first = nodes("1x16GiB", **SETTINGS)
    waits_with_a_victim(first)
    first.advance_s(GRACE_S / 2)
    again = restarted(first)
    try:
        again.advance_s(GRACE_S / 2)  # the victim's grace ends: the stored wait is served, nobody to answer
        assert tasks(again) == ["prod"]
        again.advance_s(SETTINGS["crash_grace_s"] - 0.5)
        assert tasks(again) == ["prod"]  # still within the grace: its client may yet ask again
        again.advance_s(1.0)
        assert tasks(again) == [] and "prod" not in again.stored()  # (batch: its preemption history)
    finally:
        again.close_store()


def test_a_restored_wait_whose_client_asks_again_is_kept(nodes: Callable[..., Node]) -> None:
    first = nodes("1x16GiB", **SETTINGS)
    waits_with_a_victim(first)
    first.advance_s(GRACE_S / 2)
    again = restarted(first)
    try:
        again.advance_s(GRACE_S / 2)
        back = again.connect("prod", uid=0, gid=0)
        got = back.call(p.Allocate(id=0, task_id="prod", gpus=1.0, priority_class=p.PriorityClass.PRODUCTION))
        assert isinstance(got, p.Allocated)
        again.advance_s(SETTINGS["crash_grace_s"] * 2)
        assert tasks(again) == ["prod"]
    finally:
        again.close_store()


def test_an_owner_is_held_again_only_when_it_is_the_process_the_store_names() -> None:
    with subprocess.Popen(["sleep", "60"]) as child:
        try:
            facts = read_facts(child.pid)
            assert facts is not None
            owners = TaskOwners(Signals(lambda sig, why: None))
            owners.restore("same", child.pid, 0, facts.start)
            owners.restore("reused", child.pid, 0, facts.start + 1)  # a later process with that pid
            owners.restore("other-uid", child.pid, 12345, None)  # an older record: its uid must match
            owners.restore("old-record", child.pid, 0, None)
            held = owners.owner("same")
            assert held is not None and held.alive() and owners.owner("old-record") is held
            assert owners.owner("reused") is None and owners.owner("other-uid") is None
        finally:
            child.kill()


class Table:
    """A process table of one: whatever pid is asked, its facts, held without a pidfd."""

    def __init__(self, facts: ProcessFacts) -> None:
        self.facts = facts
        self.sent: list[int] = []

    def read_facts(self, pid: int) -> ProcessFacts | None:
        return self.facts if pid == self.facts.pid else None

    ancestry = staticmethod(KERNEL.ancestry)
    caller = staticmethod(KERNEL.caller)
    dead = staticmethod(KERNEL.dead)

    def hold(self, pid: int, facts: ProcessFacts | None) -> Held | None:
        return Held(pid=pid, start=facts.start if facts else None, uid=facts.ruid if facts else None)


def test_without_a_pidfd_a_process_whose_start_time_changed_is_not_signalled() -> None:
    """Held by pid and start time (no pidfd to be had): the start time is read again right before
    the signal, and a process that has another is not this one."""
    with subprocess.Popen(["sleep", "60"]) as child:
        try:
            facts = read_facts(child.pid)
            assert facts is not None
            stale = Held(pid=child.pid, start=facts.start - 1, uid=0)
            assert not stale.alive() and not stale.send(15)
            assert child.poll() is None
            same = Held(pid=child.pid, start=facts.start, uid=0)
            assert same.alive() and same.send(15)
            assert child.wait(10) == -15
        finally:
            child.kill()
