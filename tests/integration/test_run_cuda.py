"""``gpuctl run`` with the ``cuda`` backend, against the stand-in driver (tests/fakecuda), and the
daemon's memory-driven park: a real daemon, real runs, real programs that import nothing of gpud.

The stand-in keeps each program's CUDA state in ``$FAKE_CUDA_DIR/<pid>.json`` and logs every
driver call to ``calls.log``; the programs (tests/programs/cuda_burner.py) block in their "CUDA
calls" while the driver holds them locked or checkpointed. Nothing here is timed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.proctl.tree import read_stat
from gpud_client.runinfo import BACKEND

from .waiting import eventually

TESTS = Path(__file__).resolve().parents[1]
BURNER = str(TESTS / "programs" / "cuda_burner.py")
GiB = 2**30


class CudaRun:
    def __init__(self, d: DaemonProcess, fake: Path, name: str, args: list[str], program: list[str]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "fakecuda"), env.get("PYTHONPATH", "")])
        env["FAKE_CUDA_DIR"] = str(fake)
        self.progress = fake / f"{name}.progress"
        self.trace = fake / f"{name}.trace"
        self.stderr = fake / f"{name}.stderr"
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpud_client.run", "--socket", d.socket, "--name", name, "--trace"]
                + [str(self.trace), *args, "--", sys.executable, BURNER, str(self.progress), *program],
                env=env,
                stderr=err,
            )
        self.name = name

    @property
    def err(self) -> str:
        return self.stderr.read_text()

    def why(self) -> str:
        """What the run said and did, for a failure's message."""
        trace = self.trace.read_text() if self.trace.exists() else ""
        return f"{self.name}'s stderr:\n{self.err}\n{self.name}'s trace:\n{trace}"

    def records(self) -> list[dict[str, Any]]:
        try:
            return [json.loads(x) for x in self.progress.read_text().splitlines()]
        except FileNotFoundError:
            return []

    def kernels(self) -> int:
        return sum(1 for r in self.records() if r["n"] > 0)

    def pid(self) -> int:
        started = eventually(lambda: [r["pid"] for r in self.records()], f"{self.name}'s program started", why=self.why)
        return int(started[0])

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout=timeout)


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    d = tmp_path / "fakecuda"
    d.mkdir()
    return d


@pytest.fixture
def cuda_runs(fake: Path) -> Iterator[Callable[..., CudaRun]]:
    started: list[CudaRun] = []

    def start(d: DaemonProcess, name: str, *args: str, program: tuple[str, ...] = ()) -> CudaRun:
        r = CudaRun(d, fake, name, list(args), list(program))
        started.append(r)
        return r

    yield start
    for r in started:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.wait()


def calls(fake: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in (fake / "calls.log").read_text().splitlines()]
    except FileNotFoundError:
        return []


def ops(fake: Path, pid: int) -> list[str]:
    return [c["op"] for c in calls(fake) if c.get("pid") == pid and c.get("result") == "CUDA_SUCCESS"]


def sessions(d: DaemonProcess) -> dict[str, tuple[p.ClientInfo, p.SessionInfo | None]]:
    with Client(d.socket, name="test") as c:
        reply: p.ClientsReply = c.call(p.ListClients(id=0))
    return {x.name: (x, x.sessions[0] if x.sessions else None) for x in reply.clients}


def holding(d: DaemonProcess, name: str) -> bool:
    s = sessions(d).get(name, (None, None))[1]
    return s is not None and s.state == "holding"


def test_a_pause_locks_the_program_before_lock_released_and_resumes_it_by_unlock_never_sigstop(
    daemon_factory: Callable[..., DaemonProcess], cuda_runs: Callable[..., CudaRun], fake: Path
) -> None:
    d = daemon_factory("--simulate", "1x16GiB", "--mode", "serial", "--tq", "30")
    r = cuda_runs(d, "cuda", "--pause", "auto", "--mem-estimate", "1GiB")
    pid = r.pid()
    eventually(lambda: holding(d, "cuda") and r.kernels() > 2, "the program runs")
    assert sessions(d)["cuda"][0].labels[BACKEND] == "cuda"  # auto took the driver, which has the API
    assert "pausing with the CUDA driver's checkpoint API (cuda)" in r.err  # and said so
    with Client(d.socket, name="lib") as c:
        s = c.session(0, priority=10, idle_release=None, mem_estimate="1GiB")
        with s.slice():  # granted only after the run's LOCK_RELEASED
            assert "lock" in ops(fake, pid), (calls(fake), r.why())  # the lock returned before LOCK_RELEASED
            assert "unlock" not in ops(fake, pid)
            st = read_stat(pid)
            assert st is not None and st.state not in "Tt"  # locked by the driver, never stopped
            before = r.kernels()
            assert json.loads((fake / f"{pid}.json").read_text())["state"] == "locked"
        s.release()
        eventually(lambda: r.kernels() > before + 2, "the program goes on after its unlock")
    assert ops(fake, pid)[-1:] == ["unlock"] or "unlock" in ops(fake, pid)
    assert "checkpoint" not in ops(fake, pid)  # memory fitted: nothing was parked


def test_two_programs_over_the_gpus_memory_take_turns_each_parked_while_the_other_holds(
    daemon_factory: Callable[..., DaemonProcess], cuda_runs: Callable[..., CudaRun], fake: Path
) -> None:
    d = daemon_factory("--simulate", "1x16GiB", "--mode", "serial", "--tq", "0.3")
    a = cuda_runs(d, "a", "--pause", "cuda", "--mem-estimate", "10GiB")
    b = cuda_runs(d, "b", "--pause", "cuda", "--mem-estimate", "10GiB")
    pa, pb = a.pid(), b.pid()
    violations = []

    def sample() -> bool:
        now = sessions(d)
        sa, sb = now["a"][1], now["b"][1]
        assert sa is not None and sb is not None
        for me, other in ((sa, sb), (sb, sa)):
            if me.state == "holding" and not other.parked:
                violations.append((me, other))  # admitted beside the other's memory: over capacity
        return sa.parks >= 3 and sb.parks >= 3

    eventually(sample, "each parked three times", timeout=60, why=lambda: a.why() + b.why())
    assert violations == []
    assert a.kernels() > 0 and b.kernels() > 0
    for pid in (pa, pb):
        seq = [o for o in ops(fake, pid) if o in ("lock", "checkpoint", "restore", "unlock")]
        assert "checkpoint" in seq and "restore" in seq
        for i, o in enumerate(seq):  # a restore is always followed by its unlock, never the other way
            if o == "restore" and i + 1 < len(seq):  # (the last one's unlock may be on its way)
                assert seq[i + 1] == "unlock", seq
            if o == "unlock" and i > 0 and "checkpoint" in seq[:i]:
                assert seq[i - 1] in ("restore", "lock"), seq


def test_a_lock_that_cannot_drain_falls_back_to_sigstop_and_says_so(
    daemon_factory: Callable[..., DaemonProcess], cuda_runs: Callable[..., CudaRun], fake: Path
) -> None:
    d = daemon_factory("--simulate", "1x16GiB", "--mode", "serial", "--tq", "30")
    r = cuda_runs(d, "slow", "--pause", "cuda", "--lock-timeout", "100", program=("--kernel-ms", "3000"))
    pid = r.pid()
    eventually(lambda: holding(d, "slow"), "it holds")
    with Client(d.socket, name="lib") as c:
        s = c.session(0, priority=10, idle_release=None)
        with s.slice():
            st = read_stat(pid)
            assert st is not None and st.state in "Tt"  # its 3 s kernel did not drain in 100 ms
        s.release()
    r.proc.send_signal(signal.SIGTERM)
    r.wait()
    assert "did not drain within 100 ms" in r.err and "stopped with SIGSTOP instead" in r.err


def test_a_hung_driver_call_ends_the_program_with_a_clear_message(
    daemon_factory: Callable[..., DaemonProcess], cuda_runs: Callable[..., CudaRun], fake: Path
) -> None:
    d = daemon_factory("--simulate", "1x16GiB", "--mode", "serial", "--tq", "30")
    r = cuda_runs(d, "hung", "--pause", "cuda", "--lock-timeout", "100")
    pid = r.pid()
    eventually(lambda: holding(d, "hung"), "it holds")
    (fake / "hang").write_text("lock\n")
    with Client(d.socket, name="lib") as c:
        s = c.session(0, priority=10, idle_release=None)
        with s.slice():  # the run's session went with it: the lock is free
            assert r.wait() == 1
    assert "lock" in r.err and "never runs unarbitrated" in r.err
    st = read_stat(pid)
    assert st is None or st.state in "ZX"


def test_a_program_that_exits_while_locked_ends_the_run_with_its_status(
    daemon_factory: Callable[..., DaemonProcess], cuda_runs: Callable[..., CudaRun], fake: Path
) -> None:
    d = daemon_factory("--simulate", "1x16GiB", "--mode", "serial", "--tq", "30")
    r = cuda_runs(d, "quits", "--pause", "cuda")
    pid = r.pid()
    eventually(lambda: holding(d, "quits"), "it holds")
    with Client(d.socket, name="lib") as c:
        s = c.session(0, priority=10, idle_release=None)
        with s.slice():
            eventually(lambda: "lock" in ops(fake, pid), "the program is locked")
            os.kill(pid, signal.SIGKILL)
            assert r.wait() == 128 + signal.SIGKILL
    assert "Traceback" not in r.err


def test_a_run_killed_while_it_parks_ends_its_program_and_frees_the_gpu_for_the_next(
    daemon_factory: Callable[..., DaemonProcess], cuda_runs: Callable[..., CudaRun], fake: Path
) -> None:
    d = daemon_factory("--simulate", "1x16GiB", "--mode", "serial", "--tq", "30")
    a = cuda_runs(d, "a", "--pause", "cuda", "--mem-estimate", "10GiB")
    pa = a.pid()
    eventually(lambda: holding(d, "a"), "a holds")
    (fake / "hang").write_text("checkpoint\n")  # its park will never end
    b = cuda_runs(d, "b", "--pause", "cuda", "--mem-estimate", "10GiB", "--priority", "10")
    eventually(
        lambda: any(c["op"] == "checkpoint" and c.get("pid") == pa for c in calls(fake)) or _parking(a), "a parks"
    )
    helpers = _helpers_of(a.proc.pid)
    assert helpers  # its driver calls' helper, stuck in the checkpoint
    a.proc.kill()
    a.proc.wait()
    eventually(lambda: (st := read_stat(pa)) is None or st.state in "ZX", "a's program ended with its run")
    eventually(lambda: all(_gone(h) for h in helpers), "the hung helper ended with its run too")
    (fake / "hang").write_text("")
    eventually(lambda: holding(d, "b") and b.kernels() > 0, "b runs once a's session and memory are gone", why=b.why)


def _helpers_of(run_pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and (st := read_stat(int(name))) is not None and st.ppid == run_pid:
                if b"cuda_helper" in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
        except OSError:
            continue
    return found


def _gone(pid: int) -> bool:
    st = read_stat(pid)
    return st is None or st.state in "ZX"


def _parking(r: CudaRun) -> bool:
    return r.trace.exists() and '"event": "park"' in r.trace.read_text()
