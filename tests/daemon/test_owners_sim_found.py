"""Owner bugs the whole-daemon simulation found (``python -m tests.sim.daemon_sim``), each kept
here as a plain test on the in-process daemon: the seeds that showed them are in each docstring.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable

from inprocess import Node  # tests/ is on the path of its top-level modules

from gpud.host.owners import TaskOwners
from gpud.host.procs import Signals, read_facts
from gpud_client import protocol as p

GRACE_S = 1.0
SETTINGS = {"preemption_grace_s": GRACE_S, "preemption_min_runtime_s": 0, "reap_interval_s": 0.5}
STUBBORN = [
    sys.executable,
    "-c",
    "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); signal.pause()",
]


def test_an_owner_that_ignores_sigterm_is_sigkilled_when_the_grace_ends(nodes: Callable[..., Node]) -> None:
    """Seed 2 (--strict): the change was stored before it was carried out, and storing it let the
    owner go, so the SIGKILL found no process to send to."""
    node = nodes("1x16GiB", **SETTINGS)
    with subprocess.Popen(STUBBORN, stdout=subprocess.PIPE) as owner:
        try:
            assert owner.stdout is not None and owner.stdout.readline() == b"ready\n"  # SIGTERM ignored from now on
            once = node.connect("gpuctl")
            once.call(p.Allocate(id=0, task_id="script", gpus=1.0, priority=10, owner_pid=owner.pid, notify=False))
            node.close(once)
            node.connect("prod", uid=0, gid=0).send(
                p.Allocate(id=0, task_id="prod", gpus=1.0, priority_class=p.PriorityClass.PRODUCTION, wait_ms=60_000)
            )
            node.advance_s(GRACE_S)
            assert owner.wait(timeout=30) == -signal.SIGKILL
        finally:
            owner.kill()


def test_an_owner_that_exited_while_gpud_was_down_is_reaped_after_the_restart(nodes: Callable[..., Node]) -> None:
    """Seeds 11 and 522: a restarted gpud found the owner gone and did not hold it, and the reaper
    only looked at processes it held: the allocation stayed for good."""
    first = nodes("1x16GiB", **SETTINGS)
    with subprocess.Popen(["sleep", "60"]) as owner:
        first.connect("runner").call(p.Allocate(id=0, task_id="orphan", gpus=0.5, owner_pid=owner.pid))
        first.daemon.allocations.store.close()  # gpud crashes
        owner.kill()
        owner.wait()
    again = Node("1x16GiB", state_dir=first.config.state_dir, **SETTINGS)
    try:
        again.fake.us = first.now()
        again.advance_s(SETTINGS["reap_interval_s"])
        look = again.connect("look").call(p.ListAllocations(id=0))
        assert look.allocations == [] and "orphan" not in again.stored()
    finally:
        again.close_store()


def test_a_restored_owners_start_time_is_kept_while_it_is_not_held() -> None:
    """Seed 289 (--churn): a record rewritten after a restart that could not hold its owner lost the
    owner's start time, and the next restart took any process of the uid at that pid for it."""
    with subprocess.Popen(["sleep", "60"]) as gone:
        facts = read_facts(gone.pid)
        assert facts is not None
        gone.kill()
        gone.wait()
    owners = TaskOwners(Signals(lambda sig, why: None))
    owners.restore("t", gone.pid, 0, facts.start)
    assert owners.owner("t") is None and owners.start_of("t") == facts.start
    assert owners.orphaned() == ["t"]
