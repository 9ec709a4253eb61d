"""The cuda backend against real processes: the real helper process, with the stand-in driver
(tests/fakecuda) on its PYTHONPATH, pausing trees of tests/programs/cuda_burner.py.

What the driver did is read from the stand-in's files: ``calls.log`` (every call, in order)
and ``<pid>.json`` (each context's state); what the kernel did from /proc. Tests wait on state
with ``eventually``; the one window of time (no progress while paused) is checked against the
stand-in's record that no kernel started, not against the clock alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpud_client.proctl.base import ControlError
from gpud_client.proctl.cuda import CudaBackend, CudaDriver, CudaError, Deadlines
from gpud_client.proctl.tree import ProcessTree, read_stat

ROOT = Path(__file__).resolve().parents[2]
FAKECUDA = ROOT / "tests" / "fakecuda"
BURNER = ROOT / "tests" / "programs" / "cuda_burner.py"
MiB = 2**20
T = TypeVar("T")


def eventually(probe: Callable[[], T], what: str, timeout_s: float = 10.0) -> T:
    """``probe()`` once it is true; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
    return value


def helper_env(fake: Path, *, bindings: bool = True) -> dict[str, str]:
    """The helper's environment: the stand-in's cuda.bindings on its path (unless ``bindings`` is
    false: cuda-bindings missing), and gpud_client."""
    paths = ([str(FAKECUDA)] if bindings else []) + [str(ROOT / "client")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "FAKE_CUDA_DIR": str(fake)}


def calls(fake: Path) -> list[dict[str, Any]]:
    try:
        text = (fake / "calls.log").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines()]


def context(fake: Path, pid: int) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((fake / f"{pid}.json").read_text())
    return state


def proc_state(pid: int) -> str:
    st = read_stat(pid)
    return st.state if st is not None else "gone"


class Program:
    """cuda_burner.py below a shell of its own, the tree's root (the root is not in the tree)."""

    def __init__(self, fake: Path, progress: Path, *args: str) -> None:
        self.progress = progress
        env = {**os.environ, "PYTHONPATH": str(FAKECUDA), "FAKE_CUDA_DIR": str(fake)}
        argv = [sys.executable, str(BURNER), str(progress), "--max-seconds", "60", *args]
        # "exit $?" after the command keeps the shell from exec'ing it: the shell stays the root
        self.root = subprocess.Popen(["sh", "-c", '"$@"; exit $?', "sh", *argv], env=env, start_new_session=True)
        self.tree = ProcessTree(self.root.pid)

    def lines(self) -> list[dict[str, Any]]:
        try:
            text = self.progress.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines()]

    def counts(self) -> dict[int, int]:
        """Kernels (or slices) done, per pid."""
        return {line["pid"]: line["n"] for line in self.lines()}

    def started(self, processes: int) -> dict[int, str]:
        """Wait until ``processes`` processes run and are in the tree; their kinds (cuda, plain)."""

        def ready() -> dict[int, str]:
            kinds = {line["pid"]: line["kind"] for line in self.lines()}
            return kinds if len(kinds) == processes and set(kinds) <= set(self.tree.pids()) else {}

        return eventually(ready, f"{processes} processes of the program")

    def wait_progress(self, pids: list[int], beyond: dict[int, int]) -> None:
        eventually(lambda: all(self.counts().get(p, 0) > beyond.get(p, 0) + 1 for p in pids), f"progress of {pids}")

    def kill(self) -> None:
        os.killpg(self.root.pid, signal.SIGKILL)  # stopped and locked processes die of it too
        self.root.wait()


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    d = tmp_path / "cuda"
    d.mkdir()
    return d


@pytest.fixture
def run_program(fake: Path, tmp_path: Path) -> Iterator[Callable[..., Program]]:
    started: list[Program] = []

    def run(*args: str) -> Program:
        program = Program(fake, tmp_path / f"progress-{len(started)}.jsonl", *args)
        started.append(program)
        return program

    try:
        yield run
    finally:
        for program in started:
            program.kill()


@pytest.fixture
def driver(fake: Path) -> Iterator[CudaDriver]:
    d = CudaDriver(env=helper_env(fake))
    try:
        yield d
    finally:
        d.close()


# --- probe and the helper ---------------------------------------------------------------------------


def test_probe_says_the_checkpoint_api_is_usable(driver: CudaDriver) -> None:
    assert driver.probe() is None


@pytest.mark.parametrize(
    ("driver_json", "bindings", "reason"),
    [
        ({"version": 12040}, True, r"the CUDA driver is CUDA 12\.4; the checkpoint API needs CUDA 12\.8 or newer"),
        ({"no_driver": True}, True, r"^no CUDA driver: RuntimeError: .*libcuda\.so\.1"),
        ({}, False, r"^cuda-bindings is not installed .*: pip install gpud-client\[cuda\]$"),
    ],
    ids=["old-driver", "no-driver", "no-cuda-bindings"],
)
def test_probe_says_why_the_checkpoint_api_is_not_usable(
    fake: Path, driver_json: dict[str, Any], bindings: bool, reason: str
) -> None:
    (fake / "driver.json").write_text(json.dumps(driver_json))
    d = CudaDriver(env=helper_env(fake, bindings=bindings))
    try:
        why = d.probe()
        assert why is not None and re.search(reason, why), why
        if not driver_json.get("version"):  # the driver cannot be called at all: every call says why
            with pytest.raises(CudaError, match=reason) as e:
                d.state(os.getpid())
            assert e.value.code is None and not e.value.fatal
    finally:
        d.close()


def test_the_helper_answers_a_bad_request_and_goes_on(fake: Path) -> None:
    helper = subprocess.Popen(
        [sys.executable, "-m", "gpud_client.proctl.cuda_helper"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=helper_env(fake),
    )
    out, _ = helper.communicate(b'not json\n{"op": "lock", "pid": 1}\n{"op": "probe"}\n', timeout=30)
    ready, bad, incomplete, probe = (json.loads(line) for line in out.splitlines())
    assert ready == {"ok": True}
    assert bad["ok"] is False and bad["error"].startswith("bad request: JSON is malformed")
    assert incomplete["ok"] is False and "timeout_ms" in incomplete["error"]
    assert probe == {"ok": True, "version": 12080, "supported": True}
    assert helper.returncode == 0


# --- pause and resume ----------------------------------------------------------------------------------


def test_pause_locks_a_context_process_and_stops_one_without_never_both(
    fake: Path, driver: CudaDriver, run_program: Callable[..., Program]
) -> None:
    program = run_program("--plain", "1")
    kinds = program.started(2)
    (cuda,) = [pid for pid, kind in kinds.items() if kind == "cuda"]
    (plain,) = [pid for pid, kind in kinds.items() if kind == "plain"]
    backend = CudaBackend(driver=driver)

    paused = backend.pause(program.tree)

    assert (paused.locked, paused.stopped, paused.fallbacks) == ([cuda], [plain], [])
    assert backend.held() == {cuda: "locked", plain: "stopped"}
    assert proc_state(plain) == "T" and proc_state(cuda) in "RS"  # a locked process's CPU threads run on
    assert context(fake, cuda)["state"] == "locked"
    log = calls(fake)
    assert {c["pid"] for c in log if c["op"] == "lock"} == {cuda}
    assert [c["result"] for c in log if c["pid"] == plain] == ["CUDA_ERROR_NOT_FOUND"]  # its one state query

    before = program.counts()
    backend.resume(program.tree)
    assert backend.held() == {}
    assert proc_state(plain) != "T" and context(fake, cuda)["state"] == "running"
    program.wait_progress([cuda, plain], before)


def test_a_paused_program_makes_no_progress_until_it_is_resumed(
    fake: Path, driver: CudaDriver, run_program: Callable[..., Program]
) -> None:
    program = run_program("--fork", "1")
    pids = sorted(program.started(2))
    backend = CudaBackend(driver=driver)

    paused = backend.pause(program.tree)
    assert sorted(paused.locked) == pids and paused.stopped == []
    # Each lock returned once its kernel had ended; the next launch blocks, so no kernel starts.
    kernels = {pid: context(fake, pid)["kernel_end"] for pid in pids}
    counts = program.counts()
    time.sleep(0.3)  # the window in which nothing may happen (30 kernels' time)
    assert {pid: context(fake, pid)["kernel_end"] for pid in pids} == kernels
    after = program.counts()
    assert all(after[pid] <= counts[pid] + 1 for pid in pids), (counts, after)  # the line of the drained kernel

    backend.resume(program.tree)
    program.wait_progress(pids, after)


def test_a_lock_that_cannot_drain_falls_back_to_sigstop_and_says_so(
    fake: Path, driver: CudaDriver, run_program: Callable[..., Program]
) -> None:
    program = run_program("--kernel-ms", "20000")
    (pid,) = program.started(1)
    eventually(lambda: context(fake, pid)["kernel_end"] > time.time() + 5, "a long kernel in flight")
    backend = CudaBackend(driver=driver, lock_timeout_ms=100)

    paused = backend.pause(program.tree)

    assert (paused.locked, paused.stopped) == ([], [pid])
    assert paused.fallbacks == [
        f"pid {pid}: its GPU work did not drain within 100 ms (CUDA_ERROR_NOT_READY); stopped with SIGSTOP instead"
    ]
    assert proc_state(pid) == "T" and context(fake, pid)["state"] == "running"  # the driver let go of it
    # its memory stays on the GPU, and a stopped process cannot be checkpointed: park says so
    with pytest.raises(ControlError, match=f"pid {pid} keeps its GPU memory") as refused:
        backend.park(program.tree)
    assert not refused.value.fatal and "checkpoint" not in [c["op"] for c in calls(fake)]
    backend.resume(program.tree)
    assert proc_state(pid) != "T" and backend.held() == {}


def test_a_process_forked_during_the_pause_is_caught(
    fake: Path, driver: CudaDriver, run_program: Callable[..., Program]
) -> None:
    class FirstLookMissesOne(ProcessTree):
        looks = 0

        def pids(self) -> list[int]:
            self.looks += 1
            found = super().pids()
            return found[:-1] if self.looks == 1 else found  # as if the last one forked after the look

    program = run_program("--fork", "1", "--plain", "1")
    kinds = program.started(3)
    tree = FirstLookMissesOne(program.root.pid)
    backend = CudaBackend(driver=driver)

    paused = backend.pause(tree)

    assert sorted(paused.locked + paused.stopped) == sorted(kinds) and tree.looks == 3
    assert sorted(paused.locked) == sorted(pid for pid, kind in kinds.items() if kind == "cuda")
    backend.resume(tree)


def test_a_process_already_stopped_is_left_alone(
    fake: Path, driver: CudaDriver, run_program: Callable[..., Program]
) -> None:
    program = run_program()
    (pid,) = program.started(1)
    os.kill(pid, signal.SIGSTOP)  # Ctrl-Z: a driver call on it would hang
    eventually(lambda: proc_state(pid) == "T", "the program stopped")
    backend = CudaBackend(driver=driver)

    paused = backend.pause(program.tree)

    assert (paused.locked, paused.stopped) == ([], [])
    assert paused.fallbacks == [f"pid {pid}: already stopped before the pause; left as it is"]
    assert [c for c in calls(fake) if c["pid"] == pid] == []
    backend.resume(program.tree)
    assert proc_state(pid) == "T"  # not ours to continue


def test_a_program_exiting_while_locked_does_not_make_resume_fail(
    fake: Path, driver: CudaDriver, run_program: Callable[..., Program]
) -> None:
    program = run_program("--fork", "1")
    pids = program.started(2)
    (parent,) = [pid for pid in pids if (st := read_stat(pid)) is not None and st.ppid == program.root.pid]
    (child,) = set(pids) - {parent}
    backend = CudaBackend(driver=driver)
    assert sorted(backend.pause(program.tree).locked) == sorted(pids)

    os.kill(child, signal.SIGKILL)
    eventually(lambda: proc_state(child) in ("Z", "gone"), "the child's end")
    before = program.counts()
    backend.resume(program.tree)

    assert backend.held() == {}
    assert [c["result"] for c in calls(fake) if c["op"] == "unlock" and c["pid"] == child] == ["CUDA_ERROR_NOT_FOUND"]
    program.wait_progress([parent], before)


# --- deadlines and a lost helper ----------------------------------------------------------------------


def test_a_hung_lock_reaches_its_deadline_and_the_helper_is_replaced(
    fake: Path, run_program: Callable[..., Program]
) -> None:
    program = run_program()
    (pid,) = program.started(1)
    (fake / "hang").write_text("lock\n")
    driver = CudaDriver(env=helper_env(fake), deadlines=Deadlines(lock_extra_s=0.3))
    backend = CudaBackend(driver=driver, lock_timeout_ms=100)
    try:
        assert driver.probe() is None
        hung = driver.helper_pid
        assert hung is not None

        with pytest.raises(ControlError, match=rf"^CUDA driver call lock on pid {pid} passed its 0\.4 s deadline") as e:
            backend.pause(program.tree)

        assert e.value.fatal
        assert driver.helper_pid is None and not os.path.exists(f"/proc/{hung}")  # killed and reaped
        (fake / "hang").unlink()
        assert driver.state(pid) == "running"
        assert driver.helper_pid not in (None, hung)
    finally:
        backend.close()


def test_a_helper_that_dies_in_a_call_is_fatal_and_one_that_died_idle_is_replaced(
    fake: Path, driver: CudaDriver
) -> None:
    (fake / "hang").write_text("state\n")
    assert driver.probe() is None
    helper = driver.helper_pid
    assert helper is not None

    def kill_it_in_the_call() -> None:
        eventually(lambda: any(c["op"] == "state" for c in calls(fake)), "the state call")
        os.kill(helper, signal.SIGKILL)

    killer = threading.Thread(target=kill_it_in_the_call)
    killer.start()
    with pytest.raises(ControlError, match=r"^CUDA driver call state on pid 4242 lost its helper") as e:
        driver.state(4242)
    killer.join()
    assert e.value.fatal and driver.helper_pid is None and not os.path.exists(f"/proc/{helper}")

    (fake / "hang").unlink()
    assert driver.probe() is None
    idle = driver.helper_pid
    assert idle is not None
    os.kill(idle, signal.SIGKILL)  # between calls: nothing was in flight
    eventually(lambda: proc_state(idle) == "Z", "the idle helper's end")
    with pytest.raises(CudaError, match="CUDA_ERROR_NOT_FOUND") as not_found:
        driver.state(4242)  # a fresh helper answers
    assert not_found.value.code == 500 and driver.helper_pid not in (None, idle)


# --- park and the memory checks ---------------------------------------------------------------------


def test_park_refuses_when_host_memory_is_short_and_checkpoints_otherwise(
    fake: Path, driver: CudaDriver, run_program: Callable[..., Program]
) -> None:
    program = run_program("--fork", "1", "--device-mib", "64")
    pids = sorted(program.started(2))
    memory = dict.fromkeys(pids, 2**60)  # more than any host has
    backend = CudaBackend(driver=driver, memory_of=memory.get)
    backend.pause(program.tree)

    with pytest.raises(ControlError, match=r"MemAvailable is [\d,]+ MiB, parking needs [\d,]+ MiB plus 10%") as e:
        backend.park(program.tree)
    assert not e.value.fatal
    assert [c for c in calls(fake) if c["op"] == "checkpoint"] == []
    assert backend.held() == dict.fromkeys(pids, "locked")

    memory.update(dict.fromkeys(pids, 64 * MiB))
    assert backend.park(program.tree) == 2 * 64 * MiB
    assert backend.held() == dict.fromkeys(pids, "parked")
    for pid in pids:
        assert context(fake, pid) | {"kernel_end": 0} == {
            "state": "checkpointed",
            "kernel_end": 0,
            "device_bytes": 0,
            "host_bytes": 64 * MiB,
        }

    mark = len(calls(fake))
    before = program.counts()
    backend.resume(program.tree)

    ops = [(c["op"], c["pid"]) for c in calls(fake)[mark:]]
    assert ops[:2] == [("restore", pid) for pid in pids] and sorted(ops[2:]) == [("unlock", pid) for pid in pids]
    assert all(context(fake, pid)["device_bytes"] == 64 * MiB for pid in pids)
    program.wait_progress(pids, before)


def test_resume_refuses_a_restore_the_gpu_has_no_room_for(
    fake: Path, driver: CudaDriver, run_program: Callable[..., Program]
) -> None:
    program = run_program()
    (pid,) = program.started(1)
    free = [10 * MiB]
    # as NVML reads it: a parked process holds nothing on the GPU, so its size is kept from the park
    backend = CudaBackend(
        driver=driver, gpu_free=lambda: free[0], memory_of=lambda pid: context(fake, pid)["device_bytes"]
    )
    backend.pause(program.tree)
    backend.park(program.tree)

    with pytest.raises(ControlError, match="the GPU has 10 MiB free, the parked processes need 64 MiB") as e:
        backend.resume(program.tree)
    assert not e.value.fatal
    assert backend.held() == {pid: "parked"} and context(fake, pid)["state"] == "checkpointed"
    assert [c for c in calls(fake) if c["op"] in ("restore", "unlock")] == []

    free[0] = 1024 * MiB
    backend.resume(program.tree)
    assert backend.held() == {} and context(fake, pid)["state"] == "running"


def test_a_failed_restore_is_fatal(fake: Path, driver: CudaDriver, run_program: Callable[..., Program]) -> None:
    program = run_program()
    (pid,) = program.started(1)
    backend = CudaBackend(driver=driver)
    backend.pause(program.tree)
    backend.park(program.tree)
    (fake / "fail").write_text("restore CUDA_ERROR_ILLEGAL_STATE\n")

    with pytest.raises(ControlError, match=rf"^restore of pid {pid} failed: .*CUDA_ERROR_ILLEGAL_STATE") as e:
        backend.resume(program.tree)

    assert e.value.fatal
    assert [c["op"] for c in calls(fake) if c["pid"] == pid][-1] == "restore"  # never unlocked
