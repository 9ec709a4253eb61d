"""Processes known by the kernel's word, on a real daemon: what a socket user may make gpud signal.

An owner pid is a claim: gpud takes it only when the kernel says the caller could signal that
process itself (its own uid, of its own lineage), holds it by pidfd, and signals nothing else.
Each attack here is one a hostile local user tried (a client under uid 65534, forked by the
test as in ``test_authority``): naming a root process, init, or gpud itself as the owner of an
allocation that will be preempted; naming another user's shell to cap their sessions; a pid
the kernel reused. The targets are checked untouched after the preemption. Then the per-uid
caps: the request past a cap is refused, named, and changes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p

from .test_authority import Line, outcome, run_as, user
from .test_caps import sample
from .waiting import eventually
from .wire import NOBODY, connect

Factory = Callable[..., DaemonProcess]
SETTINGS = {"preemption_grace_s": 1, "preemption_min_runtime_s": 0, "reap_interval_s": 3600}


def start(factory: Factory, tmp_path: Path, **settings: Any) -> DaemonProcess:
    cfg = tmp_path / "gpud.toml"
    cfg.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {**SETTINGS, **settings}.items()))
    return factory("--simulate", "2x16GiB", "--metrics-addr", "127.0.0.1:0", "--config", str(cfg))


def sleeper() -> subprocess.Popen[bytes]:
    """A root process that ignores SIGTERM: only a SIGKILL would end it."""
    return subprocess.Popen(
        ["python3", "-c", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.pause()"]
    )


def spot(task: str, owner: int, gpus: float = 2) -> p.Allocate:
    return p.Allocate(id=0, task_id=task, gpus=gpus, priority_class=p.PriorityClass.SPOT, owner_pid=owner, notify=False)


def signalled(d: DaemonProcess) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    return [e for e in events if e.get("event") == "process_signalled"]


def production(d: DaemonProcess, task: str = "prod") -> list[str]:
    conn = connect(d, "admin")
    try:
        return outcome(
            conn, p.Allocate(id=0, task_id=task, gpus=2, priority_class=p.PriorityClass.PRODUCTION, wait_ms=20_000)
        )
    finally:
        conn.close()


def test_another_uids_process_init_and_gpud_are_refused_and_never_signalled(
    daemon_factory: Factory, tmp_path: Path
) -> None:
    d = start(daemon_factory, tmp_path)
    victim = sleeper()
    assert d.proc is not None
    try:

        def attack(line: Line) -> list[list[str]]:
            conn = connect(d, "attacker")
            return [outcome(conn, spot(f"v{i}", pid)) for i, pid in enumerate((victim.pid, 1, d.proc.pid))]  # type: ignore[union-attr]

        refused = run_as(d, attack)
        assert [code for code, _ in refused] == ["permission_denied"] * 3, refused
        assert "belongs to uid 0, not to you (uid 65534)" in refused[0][1]
        assert "is init" in refused[1][1]
        assert "is gpud itself" in refused[2][1]
        admin = connect(d, "admin")
        assert admin.call(p.ListAllocations(id=admin.next_id())).allocations == []  # nothing was changed
        # not even an admin names init or gpud, with the explicit option or without
        for pid in (1, d.proc.pid):
            code, message = outcome(admin, p.Allocate(id=0, task_id="x", gpus=1, owner_pid=pid, owner_any_uid=True))
            assert code == "permission_denied" and ("init" in message or "gpud itself" in message)
        assert production(d) == ["ok", ""]
        assert victim.poll() is None and d.proc.poll() is None  # untouched
        assert signalled(d) == [] and sample(d, "gpud_signals_sent_total", signal="SIGTERM", why="preempt_notice") == 0
        assert sample(d, "gpud_owner_refusals_total") == 5
    finally:
        victim.kill()
        victim.wait()


def test_a_spot_allocation_is_taken_back_from_its_own_owner_only(daemon_factory: Factory, tmp_path: Path) -> None:
    """The owner a user may name (its own child) is told by SIGTERM, logged and counted; a root
    process beside it is untouched."""
    d = start(daemon_factory, tmp_path)
    bystander = sleeper()

    def own_child(line: Line) -> int:
        child = subprocess.Popen(["sleep", "300"])
        conn = connect(d, "spot")
        assert outcome(conn, spot("mine", child.pid)) == ["ok", ""]
        line.say(child.pid)
        line.hear()  # the test preempted it
        return child.wait()

    try:
        with user(d, own_child) as line:
            child_pid = line.hear()
            assert production(d) == ["ok", ""]
            line.say("preempted")
            assert line.result() == -signal.SIGTERM
        events = [(e["pid"], e["uid"], e["signal"], e["task_id"], e["why"]) for e in signalled(d)]
        assert events[0] == (child_pid, NOBODY, "SIGTERM", "mine", "preempt_notice")
        assert events[1:] in ([], [(child_pid, NOBODY, "SIGKILL", "mine", "preempt_grace_over")])  # (as it exits)
        assert sample(d, "gpud_signals_sent_total", signal="SIGTERM", why="preempt_notice") == 1
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_another_users_shell_cannot_be_capped_by_a_squat(daemon_factory: Factory, tmp_path: Path) -> None:
    d = start(daemon_factory, tmp_path)

    def squat(line: Line) -> list[str]:
        return outcome(connect(d, "squatter"), p.Allocate(id=0, task_id="squat", gpus=0.01, owner_pid=os.getppid()))

    code, message = run_as(d, squat)  # the test process, root's: its sessions would be capped at 1 %
    assert code == "permission_denied" and "uid 0" in message
    conn = connect(d, "root-session")
    attached = conn.call(p.Attach(id=conn.next_id(), gpu=0))
    assert isinstance(attached, p.Attached) and attached.core_limit == 100


def test_a_pid_the_kernel_reused_is_never_signalled(daemon_factory: Factory, tmp_path: Path) -> None:
    """The owner dies and its pid goes to a new process (the kernel's ns_last_pid makes it so)
    before the reaper sees it; a preemption then signals nobody: the newcomer is not the process
    gpud holds (the attempt is logged, not delivered)."""
    try:
        with open("/proc/sys/kernel/ns_last_pid", "r+") as f:
            f.read()
    except OSError:
        pytest.skip("needs root and a writable /proc/sys/kernel/ns_last_pid to make the kernel reuse a pid")
    d = start(daemon_factory, tmp_path)
    owner = subprocess.Popen(["sleep", "300"])
    conn = connect(d, "spot")
    assert outcome(conn, spot("reused", owner.pid)) == ["ok", ""]
    owner.kill()
    owner.wait()
    newcomer = None
    for _ in range(50):  # another process may take the pid first: try again
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(owner.pid - 1))
        newcomer = sleeper()
        if newcomer.pid == owner.pid:
            break
        newcomer.kill()
        newcomer.wait()
    assert newcomer is not None and newcomer.pid == owner.pid, "the kernel did not hand the pid out again"
    try:
        assert production(d) == ["ok", ""]  # the victim is told through its pidfd: that process is gone
        assert newcomer.poll() is None
        assert [(e["pid"], e["delivered"]) for e in signalled(d)] == [(owner.pid, False)]
        assert sample(d, "gpud_signals_sent_total", signal="SIGTERM", why="preempt_notice") == 0
    finally:
        newcomer.kill()
        newcomer.wait()


@pytest.mark.parametrize("cap", ["max_allocations_per_uid", "max_allocation_records_per_uid"])
def test_the_allocation_past_a_uids_cap_is_refused_and_nothing_else_changes(
    daemon_factory: Factory, tmp_path: Path, cap: str
) -> None:
    d = start(daemon_factory, tmp_path, **{cap: 3})

    def fill(line: Line) -> list[list[str]]:
        conn = connect(d, "filler")
        return [outcome(conn, p.Allocate(id=0, task_id=f"t{i}", gpus=0.1)) for i in range(4)]

    got = run_as(d, fill)
    assert got[:3] == [["ok", ""]] * 3 and got[3][0] == "limit_reached" and f"({cap})" in got[3][1], got
    admin = connect(d, "admin")
    listed = admin.call(p.ListAllocations(id=admin.next_id()))
    assert sorted(a.task_id for a in listed.allocations) == ["t0", "t1", "t2"] and listed.total == 3
    assert outcome(admin, p.Allocate(id=0, task_id="root-task", gpus=0.1)) == ["ok", ""]  # another uid is not moved
    assert sample(d, "gpud_limit_refusals_total", cap=cap) == 1
    assert outcome(admin, p.Free(id=0, task_id="t0")) == ["ok", ""]
    again = run_as(d, lambda line: outcome(connect(d, "filler"), p.Allocate(id=0, task_id="t3", gpus=0.1)))
    assert again == ["ok", ""]


def test_waits_past_a_uids_cap_are_refused(daemon_factory: Factory, tmp_path: Path) -> None:
    d = start(daemon_factory, tmp_path, max_allocation_waits_per_uid=1)
    admin = connect(d, "admin")
    assert outcome(admin, p.Allocate(id=0, task_id="full", gpus=2)) == ["ok", ""]

    def wait_twice(line: Line) -> list[str]:
        first, look = connect(d, "waiter-1"), connect(d, "looker")
        first.send(p.Allocate(id=first.next_id(), task_id="w1", gpus=1, wait_ms=30_000))
        eventually(lambda: "w1" in look.call(p.ListAllocations(id=look.next_id())).waiting, "the first wait is queued")
        return outcome(connect(d, "waiter-2"), p.Allocate(id=0, task_id="w2", gpus=1, wait_ms=30_000))

    code, message = run_as(d, wait_twice)
    assert code == "limit_reached" and "(max_allocation_waits_per_uid)" in message
