"""gpuctl's side of preemption: ``alloc --on-preempt/--gpus MIN..MAX/--protected/--priority spot``,
``allocs`` with states, waiters and drained GPUs, ``status`` draining then drained, ``drain``,
``undrain``, ``protect`` and ``unprotect``.

The first tests need no daemon: bad usage is found before anything is sent, what would be sent is
caught at gpuctl's one sending call, and the tables are drawn from replies made here. The last
ones run gpuctl against a real daemon."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from gpud.core.shields import UNREACHABLE as UNREACHABLE_SHIELD
from gpud.tools import gpuctl as gpuctl_module
from gpud.tools.allocview import render_allocs
from gpud.tools.nodeview import render_status
from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p

from .test_gpuctl import ABSENT, gpuctl
from .waiting import eventually
from .wire import connect, expect

# --- bad usage: exit 2, nothing sent ------------------------------------------------------------

ALLOC = ["alloc", "--task", "t"]
UNREACHABLE = UNREACHABLE_SHIELD.why


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([*ALLOC, "--gpus", "0..4"], "argument --gpus: an elastic range needs MIN >= 1 whole GPU, got '0..4'"),
        ([*ALLOC, "--gpus", "4..2"], "argument --gpus: an elastic range needs MAX > MIN, got '4..2'"),
        ([*ALLOC, "--gpus", "2..2"], "MAX > MIN, got '2..2' (for exactly 2 GPU(s), give 2)"),
        ([*ALLOC, "--gpus", "1.5..3"], "argument --gpus: an elastic range is MIN..MAX whole GPUs, e.g. 1..4; got"),
        ([*ALLOC, "--gpus", "1..x"], "argument --gpus: an elastic range is MIN..MAX whole GPUs"),
        ([*ALLOC, "--gpus", "-1..2"], "argument --gpus: an elastic range is MIN..MAX whole GPUs"),
        ([*ALLOC, "--gpus", "1..2000"], "argument --gpus: an elastic range's MAX must be 1..1024 GPUs, got '1..2000'"),
        ([*ALLOC, "--on-preempt", "nap"], "argument --on-preempt: invalid choice: 'nap'"),
        ([*ALLOC, "--on-preempt", "shrink"], "argument --on-preempt: shrink gives back the GPUs an elastic"),
        ([*ALLOC, "--gpus", "0.5", "--on-preempt", "shrink"], "it needs --gpus MIN..MAX"),
        ([*ALLOC, "--priority", "urgent"], "must be 0..100 or production, high, normal, best-effort, spot; got"),
        ([*ALLOC, "--protected", "yes"], "unrecognized arguments: yes"),
        (["drain"], "the following arguments are required: GPU"),
        (["drain", "x/y"], "argument GPU: must be a GPU index 0..1023, gpu:N or a GPU's UUID, got 'x/y'"),
        (["undrain", "1024"], "argument GPU: must be a GPU index 0..1023"),
        (["protect"], "the following arguments are required: TASK"),
        (["protect", "a b"], "argument TASK: a task id may not contain a space"),
        (["unprotect", "x" * 300], "argument TASK: a task id must be at most 256 characters, got 300"),
    ],
)
def test_bad_input_is_usage_named_by_its_flag_before_connecting(args: list[str], needle: str) -> None:
    out = gpuctl(*args, "--socket", ABSENT)
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert needle in out.stderr, out.stderr
    assert "cannot connect" not in out.stderr
    out = gpuctl(*args, "--socket", ABSENT, "--json")
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    error = json.loads(out.stderr)["error"]
    assert error["code"] == "usage" and needle in error["message"], error


# --- what is sent --------------------------------------------------------------------------------


def allocated(msg: p.Allocate, **fields: Any) -> p.Allocated:
    gpus = list(range(int(msg.gpus_max or msg.gpus)))
    return p.Allocated(
        id=0,
        task_id=msg.task_id,
        gpus=gpus,
        uuids=[f"GPU-{i}" for i in gpus],
        share=1.0,
        cpus=[],
        cuda_visible_devices=",".join(map(str, gpus)),
        tenant=None,
        priority=0,
        owner_pid=None,
        on_preempt=msg.on_preempt,
        gpus_min=None if msg.gpus_max is None else int(msg.gpus),
        gpus_max=msg.gpus_max,
        protected=msg.protected,
        **fields,
    )


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[msgspec.Struct]:
    """What gpuctl sends, answered here: ALLOCATE by ALLOCATED (not preemptible: no one to tell), the rest by OK."""
    got: list[msgspec.Struct] = []

    def call(args: Any, msg: msgspec.Struct, timeout: float = 10.0) -> Any:
        got.append(msg)
        if isinstance(msg, p.Allocate):
            return allocated(msg, preemptible=False, why=UNREACHABLE)
        if isinstance(msg, p.Drain):
            return p.Drained(id=0, gpu=1, draining=msg.on, was_draining=not msg.on)
        return p.Ok(id=0)

    monkeypatch.setattr(gpuctl_module, "_call", call)
    return got


def test_alloc_sends_the_range_the_recovery_the_class_and_protected(sent: list[msgspec.Struct]) -> None:
    out = gpuctl(*ALLOC, "--gpus", "2..4", "--on-preempt", "shrink", "--priority", "spot", "--protected")
    assert out.returncode == 0, out.stderr
    [msg] = sent
    assert isinstance(msg, p.Allocate)
    assert (msg.gpus, msg.gpus_max, msg.on_preempt, msg.priority_class, msg.priority, msg.protected) == (
        2.0,
        4,
        p.Recovery.SHRINK,
        p.PriorityClass.SPOT,
        None,
        True,
    )
    assert "export CUDA_VISIBLE_DEVICES=0,1,2,3" in out.stdout.splitlines()
    assert out.stderr == ""  # protected: not being preemptible is what was asked


def test_alloc_without_the_new_flags_sends_what_it_did_before(sent: list[msgspec.Struct]) -> None:
    assert gpuctl(*ALLOC, "--gpus", "2", "--priority", "0").returncode == 0
    assert gpuctl(*ALLOC, "--gpus", "0.5", "--on-preempt", "checkpoint").returncode == 0
    plain, checkpoint = sent
    assert plain == p.Allocate(id=0, task_id="t", gpus=2.0, priority=0, notify=False)
    assert checkpoint == p.Allocate(id=0, task_id="t", gpus=0.5, on_preempt=p.Recovery.CHECKPOINT, notify=False)


@pytest.mark.parametrize("flags", [["--priority", "spot"], ["--priority", "0"], ["--on-preempt", "suspend"]])
def test_alloc_says_on_stderr_when_what_was_asked_cannot_happen(sent: list[msgspec.Struct], flags: list[str]) -> None:
    out = gpuctl(*ALLOC, *flags)
    assert out.returncode == 0 and out.stdout.startswith("export "), out
    assert out.stderr == (
        f"gpuctl: note: task t is not preemptible: {UNREACHABLE} (give --owner-pid, or run the task with gpuctl run)\n"
    )
    assert gpuctl(*ALLOC, "--priority", "normal").stderr == ""  # nothing asked of preemption: nothing said
    out = gpuctl(*ALLOC, *flags, "--json")  # stderr is for JSON errors alone: the answer says it
    assert out.stderr == "" and json.loads(out.stdout)["why"] == UNREACHABLE


@pytest.mark.parametrize(
    ("args", "msg", "line", "data"),
    [
        (
            ["drain", "1"],
            p.Drain(id=0, gpu=1, on=True),
            "GPU 1 draining: no new allocations there; its allocations are preempted with their recovery",
            {"ok": True, "gpu": 1, "draining": True, "changed": True},
        ),
        (
            ["undrain", "gpu:1"],
            p.Drain(id=0, gpu="gpu:1", on=False),
            "GPU 1 undrained: back in service",
            {"ok": True, "gpu": 1, "draining": False, "changed": True},
        ),
        (
            ["protect", "etl-1"],
            p.Protect(id=0, task_id="etl-1", protected=True),
            "task etl-1 protected: it is never preempted",
            {"ok": True, "task_id": "etl-1", "protected": True},
        ),
        (
            ["unprotect", "etl-1"],
            p.Protect(id=0, task_id="etl-1", protected=False),
            "task etl-1 no longer protected: its priority decides again whether it may be preempted",
            {"ok": True, "task_id": "etl-1", "protected": False},
        ),
    ],
)
def test_drain_and_protect_send_one_request_and_say_what_happened(
    sent: list[msgspec.Struct], args: list[str], msg: msgspec.Struct, line: str, data: dict[str, Any]
) -> None:
    out = gpuctl(*args)
    assert (out.returncode, out.stdout, out.stderr) == (0, line + "\n", "")
    out = gpuctl(*args, "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == data
    assert sent == [msg, msg]


# --- the tables ----------------------------------------------------------------------------------


def alloc(task: str, gpus: list[int], **fields: Any) -> p.Allocated:
    base: dict[str, Any] = dict(
        id=0,
        task_id=task,
        gpus=gpus,
        uuids=[f"GPU-{i}" for i in gpus],
        share=1.0,
        cpus=[],
        cuda_visible_devices=",".join(map(str, gpus)),
        tenant=None,
        priority=50,
        owner_pid=None,
    )
    return p.Allocated(**{**base, **fields})


def gpu_summary(index: int, tasks: dict[str, float]) -> p.GpuAllocationSummary:
    used = sum(tasks.values())
    return p.GpuAllocationSummary(index=index, uuid=f"GPU-{index}", allocated=used, free=1 - used, tasks=tasks)


REPLY = p.AllocationsReply(
    id=0,
    allocations=[
        alloc("train", [0], owner_pid=4242, priority=0, on_preempt=p.Recovery.CHECKPOINT, preemptions=2),
        alloc(
            "etl",
            [1],
            state=p.AllocState.PREEMPTING,
            deadline_s=12.4,
            why="preempted by big (priority)",
            on_preempt=p.Recovery.SUSPEND,
        ),
        alloc("park", [], state=p.AllocState.SUSPENDED, why="waits for GPU 1", on_preempt=p.Recovery.SUSPEND),
        alloc("el", [2, 3], gpus_min=1, gpus_max=3, on_preempt=p.Recovery.SHRINK),
        alloc("serve", [], priority=100, preemptible=False, why="production", cpus=[0, 1]),
        alloc("keep", [], protected=True, preemptible=False, why="protected", cpus=[2]),
    ],
    waiting=["big", "old"],
    waiters=[p.AllocWaiter(task_id="big", gpus=1.0, priority=75, waited_s=3.25, why="etl's grace runs (12s)")],
    draining=[3],
    gpus=[gpu_summary(0, {"train": 1.0}), gpu_summary(1, {"etl": 1.0}), gpu_summary(2, {"el": 1.0})],
    cpus_total=8,
    cpus_free=[3, 4, 5, 6, 7],
    tenants={},
)


def columns(header: str, row: str) -> dict[str, str]:
    """A table row's cells by the header's names (cells start where their heading starts)."""
    names = [n for n in header.split("  ") if n]
    starts = [header.index(n) for n in names]
    ends = [*starts[1:], None]
    return {n.strip(): row[s:e].strip() for n, s, e in zip(names, starts, ends)}


def test_allocs_shows_state_recovery_range_and_why() -> None:
    lines = render_allocs(REPLY).splitlines()
    header, *rows = lines[: 1 + len(REPLY.allocations)]
    got = {r.split()[0]: columns(header, r) for r in rows}
    wanted = ["STATE", "ON PREEMPT", "ELASTIC", "PREEMPTIBLE", "WHY"]
    assert {task: [cells[k] for k in wanted] for task, cells in got.items()} == {
        "train": ["running, preempted 2x", "checkpoint", "-", "yes", "-"],
        "etl": ["preempting (12s left)", "suspend", "-", "yes", "preempted by big (priority)"],
        "park": ["suspended", "suspend", "-", "yes", "waits for GPU 1"],
        "el": ["running", "shrink", "1..3", "yes", "-"],
        "serve": ["running", "terminate", "-", "no", "production"],
        "keep": ["running", "terminate", "-", "protected", "protected"],
    }
    assert [got["train"][k] for k in ["GPUS", "SHARE", "PRIO", "OWNER"]] == ["0", "1", "0", "4242"]
    assert [got["park"][k] for k in ["GPUS", "SHARE", "CPUS"]] == ["-", "-", "-"]


def test_allocs_keeps_its_layout_and_adds_drained_gpus_and_waiters() -> None:
    lines = render_allocs(REPLY).splitlines()
    n = len(REPLY.allocations)
    assert lines[n + 1] == "" and lines[n + 2].split() == ["GPU", "ALLOCATED", "FREE", "TASKS"]
    assert lines[n + 3].split()[:2] == ["0", "1"]
    rest = lines[n + 6 :]
    assert rest[:3] == [
        "draining: GPU 3 (no new allocations; theirs are preempted)",
        "CPU cores: 3 of 8 allocated",
        "waiting: old",  # named, but not described: a waiter as an older daemon lists it
    ]
    assert rest[3] == "" and rest[4].split()[:4] == ["WAITING", "GPUS", "PRIO", "WAITED"]
    assert columns(rest[4], rest[5]) == {
        "WAITING": "big",
        "GPUS": "1",
        "PRIO": "75",
        "WAITED": "3.2s",
        "WHY": "etl's grace runs (12s)",
    }
    assert len(rest) == 6


def test_allocs_of_an_idle_node_is_what_it_was() -> None:
    idle = p.AllocationsReply(
        id=0, allocations=[], waiting=[], gpus=[gpu_summary(0, {})], cpus_total=4, cpus_free=[0, 1, 2, 3], tenants={}
    )
    assert (
        render_allocs(idle)
        == "no allocations\n\nGPU  ALLOCATED  FREE  TASKS\n0    0          1     -\nCPU cores: 0 of 4 allocated"
    )


def gpu_status(index: int, **fields: Any) -> p.GpuStatus:
    return p.GpuStatus(
        index=index,
        uuid=f"GPU-{index}",
        name="Simulated GPU",
        memory_total_bytes=2**34,
        simulated=True,
        mode=p.Mode.AUTO,
        scheduler_on=True,
        tq_s=30.0,
        window_s=10.0,
        memory_capacity_bytes=2**34,
        memory_in_use_bytes=0,
        holders=[],
        queue=[],
        clients=0,
        grants=0,
        drops={},
        revocations=0,
        **fields,
    )


def test_status_marks_a_gpu_draining_then_drained() -> None:
    reply = p.StatusReply(
        id=0,
        version="test",
        uptime_s=1.0,
        gpus=[gpu_status(0), gpu_status(1, draining=True), gpu_status(2, draining=True, drained=True)],
    )
    _, header, *rows = render_status(reply).splitlines()
    assert [columns(header, r)["MODE"] for r in rows] == ["auto", "auto DRAINING", "auto DRAINED"]


# --- against a real daemon -----------------------------------------------------------------------


@pytest.fixture
def owner() -> Iterator[str]:
    """A process of this machine to own an allocation, so gpud has someone to signal (not this test)."""
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield str(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def run(daemon: DaemonProcess, *args: str) -> str:
    out = gpuctl(*args, "--socket", daemon.socket)
    assert out.returncode == 0, out.stderr
    return out.stdout


def as_json(daemon: DaemonProcess, *args: str) -> Any:
    return json.loads(run(daemon, *args, "--json"))


def mode_of(daemon: DaemonProcess, gpu: int) -> str:
    _, header, *rows = run(daemon, "status").splitlines()
    return columns(header, rows[gpu])["MODE"]


def test_drain_shows_draining_then_drained_and_undrain_ends_it(daemon: DaemonProcess) -> None:
    holder = connect(daemon, "holder")  # a live connection: someone to tell, so it may be preempted
    got = holder.call(p.Allocate(id=holder.next_id(), task_id="job", prefer=[1], priority_class=p.PriorityClass.SPOT))
    assert isinstance(got, p.Allocated) and got.gpus == [1]
    assert run(daemon, "drain", "1") == (
        "GPU 1 draining: no new allocations there; its allocations are preempted with their recovery\n"
    )
    notice = expect(holder, p.Preempt)
    assert (notice.task_id, notice.reason, notice.whole, notice.by) == ("job", p.PreemptReason.DRAIN, True, "drain")
    assert mode_of(daemon, 1) == "auto DRAINING" and mode_of(daemon, 0) == "auto"
    gpu1 = as_json(daemon, "status")["gpus"][1]
    assert (gpu1["draining"], gpu1["drained"]) == (True, False)
    allocs = as_json(daemon, "allocs")
    assert allocs["draining"] == [1]
    [job] = allocs["allocations"]
    assert job["state"] == "preempting" and 0 < job["deadline_s"] <= 30
    table = run(daemon, "allocs")
    assert "draining: GPU 1 " in table
    lines = table.splitlines()
    assert columns(lines[0], lines[1])["STATE"].startswith("preempting (")
    holder.call(p.Free(id=holder.next_id(), task_id="job"))
    eventually(lambda: mode_of(daemon, 1) == "auto DRAINED", "GPU 1 is drained once its allocation is gone")
    assert as_json(daemon, "status")["gpus"][1]["drained"] is True
    assert run(daemon, "undrain", "1") == "GPU 1 undrained: back in service\n"
    assert mode_of(daemon, 1) == "auto" and as_json(daemon, "allocs")["draining"] == []


def test_a_drain_that_changes_nothing_says_so(daemon: DaemonProcess) -> None:
    assert run(daemon, "undrain", "0") == "GPU 0 was not draining: nothing changed\n"
    assert as_json(daemon, "undrain", "0") == {"ok": True, "gpu": 0, "draining": False, "changed": False}
    assert run(daemon, "drain", "0").startswith("GPU 0 draining: ")
    assert run(daemon, "drain", "gpu:0") == "GPU 0 drains already: nothing changed\n"
    assert run(daemon, "undrain", "0") == "GPU 0 undrained: back in service\n"
    assert as_json(daemon, "allocs")["draining"] == []


def test_elastic_alloc_with_its_recovery_is_listed(daemon: DaemonProcess, owner: str) -> None:
    got = as_json(daemon, "alloc", "--task", "el", "--gpus", "1..2", "--on-preempt", "shrink", "--owner-pid", owner)
    assert (got["gpus_min"], got["gpus_max"], got["on_preempt"]) == (1, 2, "shrink")
    assert 1 <= len(got["gpus"]) <= 2
    lines = run(daemon, "allocs").splitlines()
    cells = columns(lines[0], lines[1])
    assert (cells["TASK"], cells["ON PREEMPT"], cells["ELASTIC"]) == ("el", "shrink", "1..2")


def test_a_one_shot_spot_alloc_is_not_preemptible_and_says_why(daemon: DaemonProcess) -> None:
    out = gpuctl("alloc", "--task", "spotty", "--priority", "spot", "--socket", daemon.socket)
    assert out.returncode == 0 and out.stdout.startswith("export "), out.stderr
    assert out.stderr.startswith("gpuctl: note: task spotty is not preemptible: no one to tell"), out.stderr
    [a] = as_json(daemon, "allocs")["allocations"]
    assert (a["priority"], a["preemptible"], a["why"]) == (0, False, UNREACHABLE)
    lines = run(daemon, "allocs").splitlines()
    cells = columns(lines[0], lines[1])
    assert cells["PREEMPTIBLE"] == "no" and cells["WHY"] == a["why"]


def test_the_answer_to_alloc_and_allocs_agree(daemon: DaemonProcess, owner: str) -> None:
    """One rule: what ALLOCATE answers is what ALLOCS says right after, for a one-shot gpuctl alloc
    (nobody to tell once it exits) and for one with an owner."""
    got = as_json(daemon, "alloc", "--task", "oneshot", "--gpus", "1", "--priority", "spot")
    listed = {a["task_id"]: a for a in as_json(daemon, "allocs")["allocations"]}
    assert (got["preemptible"], got["why"]) == (False, UNREACHABLE)
    assert (listed["oneshot"]["preemptible"], listed["oneshot"]["why"]) == (False, UNREACHABLE)
    got = as_json(daemon, "alloc", "--task", "owned", "--gpus", "1", "--priority", "spot", "--owner-pid", owner)
    listed = {a["task_id"]: a for a in as_json(daemon, "allocs")["allocations"]}
    assert (got["preemptible"], got["why"]) == (listed["owned"]["preemptible"], listed["owned"]["why"]) == (True, "")


def test_protect_and_unprotect(daemon: DaemonProcess, owner: str) -> None:
    run(daemon, "alloc", "--task", "keep", "--owner-pid", owner)
    assert run(daemon, "protect", "keep") == "task keep protected: it is never preempted\n"
    [a] = as_json(daemon, "allocs")["allocations"]
    assert (a["protected"], a["preemptible"]) == (True, False)
    lines = run(daemon, "allocs").splitlines()
    assert columns(lines[0], lines[1])["PREEMPTIBLE"] == "protected"
    assert run(daemon, "unprotect", "keep").startswith("task keep no longer protected")
    assert as_json(daemon, "allocs")["allocations"][0]["protected"] is False
    out = gpuctl("protect", "nobody", "--socket", daemon.socket)
    assert (out.returncode, out.stdout) == (1, "") and "unknown_task" in out.stderr, out.stderr
    guarded = as_json(daemon, "alloc", "--task", "guarded", "--protected", "--gpus", "1")
    assert guarded["protected"] is True


def test_waiters_are_listed_with_what_they_wait_for(daemon: DaemonProcess) -> None:
    run(daemon, "alloc", "--task", "hog", "--gpus", "2")  # one-shot: nobody to tell, never preempted
    waiter = connect(daemon, "waiter")
    waiter.send(p.Allocate(id=waiter.next_id(), task_id="late", wait_ms=60_000, priority_class=p.PriorityClass.HIGH))
    allocs = eventually(
        lambda: (a := as_json(daemon, "allocs"))["waiters"] and a,
        "the waiter is listed",
        why=lambda: run(daemon, "allocs"),
    )
    [w] = allocs["waiters"]
    assert (w["task_id"], w["gpus"], w["priority"]) == ("late", 1.0, 75) and w["why"]
    lines = run(daemon, "allocs").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("WAITING "))
    cells = columns(lines[at], lines[at + 1])
    assert (cells["WAITING"], cells["PRIO"], cells["WHY"]) == ("late", "75", w["why"])
    assert not any(line.startswith("waiting: ") for line in lines)
    run(daemon, "free", "--task", "hog")
    assert expect(waiter, p.Allocated).task_id == "late"
