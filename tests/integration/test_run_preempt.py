"""``gpuctl run`` when gpud takes the allocation back: real runs, real programs, a real daemon.

The daemon runs on simulated GPUs with a short ``preemption_grace_s`` and no
``preemption_min_runtime_s``, so a spot run is preempted as soon as a request of higher priority
waits. The programs are ``tests/programs/burner.py`` (counts, acts on SIGTERM) and
``tests/programs/checkpointer.py`` (checkpoints on its signal, resumes from it with GPUD_RESUME=1);
neither imports gpud. The last part checks the clients' allocation listeners, which the run is
built on, against the same daemon. Every wait is on state, with a deadline; the one bound asserted
on time is the brief's (the program gone within the grace + 1 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import AsyncClient, Client
from gpud_client import protocol as p
from gpud_client.runinfo import run_info

from .test_run import BURNER, Run, gone, stopped
from .waiting import eventually, eventually_async

CHECKPOINTER = str(Path(__file__).resolve().parents[1] / "programs" / "checkpointer.py")
URGENT = 50  # a priority above spot's 0
IGNORES_SIGTERM = (
    "import signal, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "open(sys.argv[1], 'w').write('start\\n')\n"
    "while True:\n"
    "    signal.pause()  # until SIGKILL\n"
)
Daemons = Callable[..., DaemonProcess]
Runs = Callable[..., Run]


def preempting(
    daemon_factory: Daemons, tmp_path: Path, gpus: str = "1", grace: float = 3.0, more: str = ""
) -> DaemonProcess:
    config = tmp_path / "gpud.toml"
    config.write_text(f"preemption_grace_s = {grace}\npreemption_min_runtime_s = 0\n{more}")
    return daemon_factory("--simulate", gpus, "--config", str(config))


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Runs]:
    started: list[Run] = []

    def start(d: DaemonProcess, name: str, *run_args: str, program: list[str] | None = None) -> Run:
        prog = program or [sys.executable, BURNER, str(tmp_path / f"{name}.txt")]
        r = Run(d.socket, tmp_path, name, ["--pause", "signal", "--priority", "spot", *run_args], prog)
        started.append(r)
        return r

    yield start
    for r in started:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.communicate()


def checkpointer(tmp_path: Path, name: str) -> tuple[list[str], Path]:
    log = tmp_path / f"{name}.log"
    return [sys.executable, CHECKPOINTER, str(log), str(tmp_path / f"{name}.state")], log


def lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def starts(path: Path) -> list[list[str]]:
    """The checkpointer's start lines: pid, CUDA_VISIBLE_DEVICES, GPUD_ON_PREEMPT, GPUD_PREEMPT_SIGNAL,
    GPUD_RESUME, GPUD_PREEMPT_GRACE_S."""
    return [line.split()[1:] for line in lines(path) if line.startswith("start ")]


def counted(path: Path) -> int:
    counts = [int(line.split()[1]) for line in lines(path) if line.startswith("count ")]
    return counts[-1] if counts else 0


def allocation(c: Client, task: str) -> p.Allocated | None:
    return next((a for a in c.allocations().allocations if a.task_id == task), None)


def run_state(c: Client, name: str) -> str | None:
    """What ``gpuctl clients`` shows as the run's state (its RUN column)."""
    for client in c.clients().clients:
        if client.name == name and (info := run_info(client, (client.sessions or [None])[0])) is not None:
            return info.state
    return None


# --- terminate ----------------------------------------------------------------------------------------


def test_terminate_ends_the_program_at_once_and_the_waiter_gets_the_gpu(
    daemon_factory: Daemons, runs: Runs, tmp_path: Path
) -> None:
    d = preempting(daemon_factory, tmp_path, grace=3.0)
    r = runs(d, "spot", "--gpus", "1", "--task", "spot-job")
    r.program_pid()
    with Client(d.socket, name="urgent") as c:
        t0 = time.monotonic()
        got = c.allocate("urgent", 1, priority=URGENT, wait_ms=30_000)  # granted once the run has freed it
        assert r.wait() == 3  # the program's own status: its SIGTERM handler ran
        assert time.monotonic() - t0 < 3.0 + 1.0
        assert got.gpus == [0] and allocation(c, "spot-job") is None
    assert "signal 15" in r.lines()
    assert "task spot-job was preempted by urgent (priority): ending the program within 3 s" in r.err


def test_terminate_kills_a_program_that_ignores_sigterm_before_the_grace_ends(
    daemon_factory: Daemons, runs: Runs, tmp_path: Path
) -> None:
    d = preempting(daemon_factory, tmp_path, grace=2.0)
    started = tmp_path / "stubborn.txt"
    r = runs(d, "stubborn", "--gpus", "1", program=[sys.executable, "-c", IGNORES_SIGTERM, str(started)])
    eventually(lambda: lines(started) == ["start"], "the program started")
    with Client(d.socket, name="urgent") as c:
        t0 = time.monotonic()
        c.allocate("urgent", 1, priority=URGENT, wait_ms=30_000)
        assert r.wait() == 128 + signal.SIGKILL
        elapsed = time.monotonic() - t0
    assert 2.0 - 0.5 <= elapsed < 2.0 + 1.0, elapsed  # killed half a second before the daemon's grace ends
    assert "the program did not end within 2 s: killing it" in r.err


# --- checkpoint -------------------------------------------------------------------------------------------


def test_checkpoint_signals_the_program_waits_for_the_gpu_and_starts_it_again_resumed(
    daemon_factory: Daemons, runs: Runs, tmp_path: Path
) -> None:
    d = preempting(daemon_factory, tmp_path, grace=5.0)
    program, log = checkpointer(tmp_path, "ck")
    trace = tmp_path / "ck.trace"
    r = runs(
        d, "ck", "--gpus", "1", "--task", "ck-job", "--on-preempt", "checkpoint", "--trace", str(trace), program=program
    )
    eventually(lambda: counted(log) >= 3, "the program counts")
    with Client(d.socket, name="urgent") as c:
        c.allocate("urgent", 1, priority=URGENT, wait_ms=30_000)  # granted once it checkpointed and yielded
        saved = eventually(lambda: [x for x in lines(log) if x.startswith("checkpoint ")], "it checkpointed")
        eventually(lambda: "ck-job" in c.allocations().waiting, "the run waits for its allocation again")
        eventually(lambda: run_state(c, "ck") == "waiting-to-restart", "gpuctl clients shows it waits to restart")
        assert r.proc.poll() is None
        c.release_allocation("urgent")
        eventually(lambda: run_state(c, "ck") == "running", "and running once it started again")
    resumed = eventually(lambda: [x for x in lines(log) if x.startswith("resume ")], "it started again")
    assert resumed == [f"resume {saved[0].split()[1]}"]  # from its own checkpoint
    first, second = eventually(lambda: s if len(s := starts(log)) == 2 else None, "two starts")
    assert first[1:] == ["0", "checkpoint", "SIGUSR1", "-", "5"]  # the daemon's grace: how long it has to save
    assert second[1:] == ["0", "checkpoint", "SIGUSR1", "1", "5"]
    assert first[0] != second[0]  # a new process
    eventually(lambda: counted(log) > int(saved[0].split()[1]), "it counts on from its checkpoint")
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait() == 3
    assert r.err.count("waiting for its allocation again") == 1
    records = [json.loads(x) for x in lines(trace)]
    events = [x["event"] for x in records if "event" in x]
    did = [x["action"] for x in records if "action" in x]
    assert "preempt" in events and "reallocated" in events
    assert did.index("forward") < did.index("yield") < did.index("allocate") < did.index("useallocation")
    assert [x["resume"] for x in records if x.get("action") == "useallocation"] == [True]


# --- suspend ------------------------------------------------------------------------------------------------


def test_suspend_pauses_the_program_gives_the_gpu_and_resumes_it_with_its_progress(
    daemon_factory: Daemons, runs: Runs, tmp_path: Path
) -> None:
    d = preempting(daemon_factory, tmp_path, grace=5.0)
    r = runs(d, "sus", "--gpus", "1", "--task", "sus-job", "--on-preempt", "suspend")
    pid = r.program_pid()
    eventually(lambda: r.count() > 0, "the program counts")
    with Client(d.socket, name="urgent") as c:
        c.allocate("urgent", 1, priority=URGENT, wait_ms=30_000)  # granted once it is paused and yielded
        assert stopped(pid)
        held = allocation(c, "sus-job")
        assert held is not None and held.state == p.AllocState.SUSPENDED
        eventually(lambda: run_state(c, "sus") == "suspended", "gpuctl clients shows the run suspended")
        before = r.count()
        time.sleep(0.1)  # a window in which nothing may happen: it is suspended
        assert r.count() == before
        c.release_allocation("urgent")
    eventually(lambda: r.count() > before, "the same program goes on once its GPU is back")
    with Client(d.socket, name="watcher") as c:
        eventually(lambda: run_state(c, "sus") == "running", "gpuctl clients shows it running again")
    assert not stopped(pid) and [x.split()[:3] for x in r.lines() if x.startswith("start ")] == [
        ["start", str(pid), "0"]
    ]
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait() == 3


def test_a_signal_to_a_suspended_run_reaches_its_program(daemon_factory: Daemons, runs: Runs, tmp_path: Path) -> None:
    d = preempting(daemon_factory, tmp_path, grace=5.0)
    r = runs(d, "sig", "--gpus", "1", "--task", "sig-job", "--on-preempt", "suspend")
    pid = r.program_pid()
    with Client(d.socket, name="urgent") as c:
        c.allocate("urgent", 1, priority=URGENT, wait_ms=30_000)
        assert stopped(pid)
        r.proc.send_signal(signal.SIGTERM)
        assert r.wait() == 3  # resumed to act on it: its handler ran
        assert "signal 15" in r.lines() and gone(pid)


# --- elastic allocations --------------------------------------------------------------------------------


def test_an_elastic_run_restarts_its_program_on_the_gpus_it_keeps_then_on_those_it_grows_into(
    daemon_factory: Daemons, runs: Runs, tmp_path: Path
) -> None:
    growth = "elastic_window_s = 0.2\nelastic_cooldown_s = 0.2\n"  # grows back soon after the GPU is free
    d = preempting(daemon_factory, tmp_path, gpus="2", grace=5.0, more=growth)
    program, log = checkpointer(tmp_path, "el")
    trace = tmp_path / "el.trace"
    r = runs(
        d, "el", "--gpus", "1..2", "--task", "el-job", "--on-preempt", "shrink", "--trace", str(trace), program=program
    )
    first = eventually(lambda: starts(log), "the program started")[0]
    assert first[1:] == ["0,1", "shrink", "-", "-", "5"]
    with Client(d.socket, name="urgent") as c:
        got = c.allocate("urgent", 1, priority=URGENT, wait_ms=30_000)  # granted once the run yielded one GPU
        kept = [g for g in (0, 1) if g not in got.gpus]
        second = eventually(lambda: s[1] if len(s := starts(log)) >= 2 else None, "started again")
        assert second[1:] == [",".join(map(str, kept)), "shrink", "-", "1", "5"] and second[0] != first[0]
        assert "signal 15" in lines(log)  # the first was ended with SIGTERM
        held = eventually(lambda: allocation(c, "el-job"), "its allocation")
        assert held.gpus == kept
        c.release_allocation("urgent")
    third = eventually(lambda: s[2] if len(s := starts(log)) >= 3 else None, "started again on both GPUs", 30)
    assert third[1:] == ["0,1", "shrink", "-", "1", "5"]
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait() == 3
    changes = [x.get("change") for x in map(json.loads, lines(trace)) if x.get("event") == "changed"]
    assert "grown" in changes


def test_an_elastic_run_that_keeps_its_program_yields_at_once(
    daemon_factory: Daemons, runs: Runs, tmp_path: Path
) -> None:
    d = preempting(daemon_factory, tmp_path, gpus="2", grace=30.0)
    program, log = checkpointer(tmp_path, "keep")
    r = runs(d, "keep", "--gpus", "1..2", "--on-preempt", "shrink", "--on-resize", "keep", program=program)
    eventually(lambda: counted(log) > 0, "the program counts")
    with Client(d.socket, name="urgent") as c:
        t0 = time.monotonic()
        c.allocate("urgent", 1, priority=URGENT, wait_ms=30_000)
        assert time.monotonic() - t0 < 15  # yielded, long before the 30 s grace
    before = counted(log)
    eventually(lambda: counted(log) > before, "the same program goes on")
    assert len(starts(log)) == 1 and r.proc.poll() is None
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait() == 3


# --- bad usage --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "1", "--on-preempt", "shrink"], "--on-preempt shrink needs an elastic allocation"),
        (["--gpus", "0.5", "--on-preempt", "shrink"], "not --gpus 0.5"),
        (["--gpus", "1", "--checkpoint-signal", "USR2"], "--checkpoint-signal goes with --on-preempt checkpoint"),
        (["--gpus", "1", "--on-preempt", "checkpoint", "--checkpoint-signal", "KILL"], "SIGKILL cannot be caught"),
        (["--gpus", "1", "--on-preempt", "checkpoint", "--checkpoint-signal", "NOPE"], "not a signal: 'NOPE'"),
        (["--gpus", "1", "--on-resize", "keep"], "--on-resize does nothing without an elastic allocation"),
        (["--on-preempt", "suspend"], "--on-preempt belongs to an allocation"),
        (
            ["--gpus", "1..2", "--core-limit", "50"],
            "--core-limit is for a share of one GPU and does nothing with whole GPUs (--gpus 1..2)",
        ),
        (["--gpus", "2..1"], "an elastic range needs MAX > MIN"),
        (["--gpus", "1", "--on-preempt", "pause"], "invalid choice: 'pause'"),
    ],
)
def test_bad_preemption_options_are_refused_and_nothing_is_allocated(
    daemon_factory: Daemons, tmp_path: Path, args: list[str], message: str
) -> None:
    import subprocess

    d = preempting(daemon_factory, tmp_path)
    argv = [sys.executable, "-m", "gpud_client.run", "--socket", d.socket, *args, "--", "true"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    with Client(d.socket, name="test") as c:
        assert c.allocations().allocations == [] and [x.name for x in c.clients().clients] == ["test"]


# --- the clients' allocation listeners ---------------------------------------------------------------------


def test_the_sync_clients_listeners_hear_the_preemption_and_one_that_raises_breaks_nothing(
    daemon_factory: Daemons, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = preempting(daemon_factory, tmp_path, grace=30.0)
    heard: list[Any] = []
    later: list[Any] = []

    def broken(push: Any) -> None:
        raise RuntimeError("a listener's own bug")

    with Client(d.socket, name="holder") as c, Client(d.socket, name="urgent") as u:
        c.add_allocation_listener(broken)
        c.add_allocation_listener(heard.append)
        c.allocate("low", 1, priority="spot", on_preempt="suspend")
        waiter = threading.Thread(target=u.allocate, args=("high", 1), kwargs={"priority": URGENT, "wait_ms": 30_000})
        with caplog.at_level(logging.ERROR, logger="gpud_client"):
            waiter.start()
            push = eventually(lambda: heard[0] if heard else None, "the PREEMPT heard")
            assert isinstance(push, p.Preempt) and push.task_id == "low" and push.by == "high" and push.whole
            assert push.recovery == p.Recovery.SUSPEND and push.grace_s == 30.0
            c.remove_allocation_listener(heard.append)
            c.add_allocation_listener(later.append)
            c.yield_allocation("low")  # suspended: the devices go back now, not in 30 s
            waiter.join(timeout=30)
            assert not waiter.is_alive()
            revoked = eventually(lambda: later[0] if later else None, "the ALLOC_REVOKED heard")
        assert revoked == p.AllocRevoked(
            task_id="low", reason=p.PreemptReason.PRIORITY, state=p.AllocState.SUSPENDED, gone=False
        )
        assert heard == [push]  # removed: it heard nothing more
        assert "a listener's own bug" in caplog.text
        u.release_allocation("high")
        resumed = eventually(lambda: later[1] if len(later) > 1 else None, "the ALLOC_CHANGED heard")
        assert isinstance(resumed, p.AllocChanged) and resumed.change == "resumed"
        assert resumed.allocation.task_id == "low"


def test_the_asyncio_clients_listeners_run_in_its_loop_coroutines_included(
    daemon_factory: Daemons, tmp_path: Path
) -> None:
    d = preempting(daemon_factory, tmp_path, grace=30.0)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        heard: list[Any] = []
        awaited: list[Any] = []

        def plain(push: Any) -> None:
            assert asyncio.get_running_loop() is loop
            heard.append(push)

        async def coroutine(push: Any) -> None:  # run as a task of its own
            awaited.append(push)

        async with await AsyncClient.connect(d.socket, name="holder") as c:
            async with await AsyncClient.connect(d.socket, name="urgent") as u:
                await c.add_allocation_listener(plain)
                await c.add_allocation_listener(coroutine)
                await c.allocate("low", 1, priority="spot", on_preempt="terminate")
                waiter = asyncio.ensure_future(u.allocate("high", 1, priority=URGENT, wait_ms=30_000))
                await eventually_async(lambda: heard, "the PREEMPT heard")
                await c.yield_allocation("low")
                got = await waiter
                assert got.task_id == "high"
                await eventually_async(lambda: len(awaited) == 2, "both pushes awaited")
                await c.remove_allocation_listener(plain)
                await c.remove_allocation_listener(plain)  # not there: nothing happens
        assert [type(m) for m in heard] == [p.Preempt, p.AllocRevoked] and heard == awaited
        assert heard[1].gone and heard[1].task_id == "low"

    asyncio.run(scenario())
