"""``gpuctl run`` with the ``signal`` backend: unmodified programs under a real daemon.

The programs are ``tests/programs/burner.py``: they burn CPU, count their own progress into a
file and import nothing of gpud. Each run is a real ``python -m gpud_client.run`` process with
its keeper and program below it. Nothing here is timed: shares are asserted within bounds that
hold on a loaded 2-core machine (the benchmark, bench/run_share.py, measures them closely), and
every wait is on state with a deadline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.proctl.tree import ProcessTree, read_stat
from gpud_client.runinfo import PID

from .waiting import eventually

BURNER = str(Path(__file__).resolve().parents[1] / "programs" / "burner.py")
Runs = Callable[..., "Run"]


class Run:
    """A ``gpud-run`` process and its program's progress file."""

    def __init__(self, socket: str, tmp: Path, name: str, run_args: list[str], program: list[str]) -> None:
        self.progress = tmp / f"{name}.txt"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpud_client.run", "--socket", socket, "--name", name, *run_args, "--", *program],
            stderr=subprocess.PIPE,
            text=True,
        )
        self.name = name
        self.err = ""

    def lines(self, path: Path | None = None) -> list[str]:
        try:
            return (path or self.progress).read_text().splitlines()
        except FileNotFoundError:
            return []

    def count(self, path: Path | None = None) -> int:
        counts = [int(line.split()[1]) for line in self.lines(path) if line[:1].isdigit()]
        return counts[-1] if counts else 0

    def program_pid(self) -> int:
        start = eventually(lambda: [x for x in self.lines() if x.startswith("start ")], f"{self.name} started")
        return int(start[0].split()[1])

    def wait(self, timeout: float = 30) -> int:
        try:
            _, self.err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.err = self.proc.communicate()
            raise AssertionError(f"run {self.name} did not end within {timeout} s: {self.err}") from None
        return self.proc.returncode


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    started: list[Run] = []

    def start(d: DaemonProcess, name: str, *run_args: str, program: list[str] | None = None) -> Run:
        prog = program or [sys.executable, BURNER, str(tmp_path / f"{name}.txt")]
        r = Run(d.socket, tmp_path, name, ["--pause", "signal", *run_args], prog)
        started.append(r)
        return r

    yield start
    for r in started:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.communicate()


def clients(d: DaemonProcess) -> p.ClientsReply:
    with Client(d.socket, name="test") as c:
        reply: p.ClientsReply = c.call(p.ListClients(id=0))
    return reply


def session_of(d: DaemonProcess, name: str) -> p.SessionInfo | None:
    for c in clients(d).clients:
        if c.name == name and c.sessions:
            return c.sessions[0]
    return None


def stopped(pid: int) -> bool:
    st = read_stat(pid)
    return st is not None and st.state in "Tt"


def gone(pid: int) -> bool:
    st = read_stat(pid)
    return st is None or st.state in "ZX"


# --- sharing --------------------------------------------------------------------------------------


def test_two_runs_at_25_and_75_percent_share_one_gpu_in_serial_mode(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs
) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial", "--window", "0.25", "--tq", "30")
    a = runs(d, "quarter", "--core-limit", "25")
    b = runs(d, "three-quarters", "--core-limit", "75")
    pa, pb = a.program_pid(), b.program_pid()
    # a paused program is stopped while the other holds, and makes no progress meanwhile
    seen_stopped = eventually(
        lambda: (s := session_of(d, "quarter")) is not None and s.state != "holding" and stopped(pa),
        "the 25 % program seen stopped while the other holds",
    )
    assert seen_stopped
    start_a, start_b = a.count(), b.count()
    eventually(lambda: (session_of(d, "quarter") or p.SessionInfo).grants >= 20, "20 turns of the 25 % run", 60)
    done_a, done_b = a.count() - start_a, b.count() - start_b
    share = done_a / (done_a + done_b)
    assert 0.15 < share < 0.35, f"the 25 % program did {share:.1%} of the work"
    sa, sb = session_of(d, "quarter"), session_of(d, "three-quarters")
    assert sa is not None and sb is not None
    assert 15 < sa.recent_share_percent < 35 and 60 < sb.recent_share_percent < 90, (sa, sb)
    assert not stopped(pa) or not stopped(pb)  # never both paused for long: one of them holds


def test_a_run_beside_a_library_session_takes_turns(daemon_factory: Callable[..., DaemonProcess], runs: Runs) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial", "--tq", "0.2")
    r = runs(d, "run")
    pid = r.program_pid()
    with Client(d.socket, name="lib") as c:
        s = c.session(0, idle_release=None)
        for _ in range(3):
            with s.slice():
                assert stopped(pid), "the run's program runs while the library session holds"
                before = r.count()
                time.sleep(0.1)  # a window in which nothing may happen: there is no state to wait for
                assert r.count() == before
            s.release()
            eventually(lambda b=before: r.count() > b, "the program goes on after the library's turn")


def test_a_process_tree_is_paused_whole(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs, tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial", "--tq", "30")
    r = runs(d, "tree", program=[sys.executable, BURNER, str(tmp_path / "tree.txt"), "--children", "2"])
    r.program_pid()
    child_files = [tmp_path / "tree.txt.1", tmp_path / "tree.txt.2"]
    eventually(lambda: all(r.count(f) > 0 for f in child_files), "both children work")
    with Client(d.socket, name="lib") as c:
        s = c.session(0, idle_release=None, priority=10)
        with s.slice():  # a higher priority preempts the run at once
            pids = _program_tree(r)
            assert len(pids) >= 3 and all(stopped(x) for x in pids), [read_stat(x) for x in pids]
            counts = [r.count(f) for f in child_files]
            time.sleep(0.1)  # a window in which nothing may happen
            assert [r.count(f) for f in child_files] == counts


def _program_tree(r: Run) -> list[int]:
    program = r.program_pid()
    keeper = read_stat(program)
    assert keeper is not None
    return ProcessTree(keeper.ppid).pids()


# --- idle release -----------------------------------------------------------------------------------


def test_an_idle_program_gives_the_gpu_back_and_waits_behind_busy_sessions(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs, tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial", "--tq", "30")
    r = runs(
        d,
        "sleeper",
        "--idle-release",
        "0.3",
        program=[sys.executable, BURNER, str(tmp_path / "sleeper.txt"), "--sleep"],
    )
    r.program_pid()
    eventually(lambda: (s := session_of(d, "sleeper")) is not None and s.state == "holding", "the run holds")
    with Client(d.socket, name="busy") as c:
        s = c.session(0, idle_release=None)
        t0 = time.monotonic()
        with s.slice():  # granted long before the 30 s time quantum: the idle run gave it back
            waited = time.monotonic() - t0
            assert waited < 20
            eventually(  # it asks again at once, and waits behind the busy one
                lambda: (i := session_of(d, "sleeper")) is not None and i.state == "waiting", "the run waits again"
            )
    eventually(lambda: (s := session_of(d, "sleeper")) is not None and s.grants >= 2, "the run gets its turn again")


# --- signals and exit statuses ------------------------------------------------------------------


def test_a_signal_reaches_a_paused_program_which_acts_on_it(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs
) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial", "--tq", "30")
    with Client(d.socket, name="holder") as c:
        s = c.session(0, idle_release=None)
        s.acquire()  # the GPU is taken before the run starts: its program waits (held before exec)
        r = runs(d, "signalled")
        eventually(lambda: session_of(d, "signalled") is not None, "the run attached")
        r.proc.send_signal(signal.SIGTERM)
        assert r.wait() == 128 + signal.SIGTERM  # it never started: the run ends as signalled
        assert r.lines() == []
        # now one that has run and is paused when the signal comes
        r2 = runs(d, "paused")
        s.release()
        pid = r2.program_pid()
        s.acquire()
        eventually(lambda: stopped(pid), "the program is paused while the holder holds")
        r2.proc.send_signal(signal.SIGTERM)
        assert r2.wait() == 3  # the program's own handler ran: it was resumed to act on it
        assert f"signal {int(signal.SIGTERM)}" in r2.lines()
        s.release()


@pytest.mark.parametrize(("args", "status"), [(["--exit", "7", "--seconds", "0.2"], 7), (["--seconds", "0.2"], 0)])
def test_the_run_exits_with_the_programs_status(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs, tmp_path: Path, args: list[str], status: int
) -> None:
    d = daemon_factory("--simulate", "1")
    r = runs(d, "exits", program=[sys.executable, BURNER, str(tmp_path / "exits.txt"), *args])
    assert r.wait() == status
    eventually(lambda: session_of(d, "exits") is None, "its session is gone with it")


def test_a_program_killed_by_a_signal_gives_128_plus_n(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs
) -> None:
    d = daemon_factory("--simulate", "1")
    r = runs(d, "killed")
    os.kill(r.program_pid(), signal.SIGKILL)
    assert r.wait() == 128 + signal.SIGKILL


def test_a_run_killed_outright_leaves_no_program_running(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs, tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "1")
    r = runs(d, "victim", program=[sys.executable, BURNER, str(tmp_path / "victim.txt"), "--children", "2"])
    eventually(lambda: r.count(tmp_path / "victim.txt.2") > 0, "the tree works")
    pids = _program_tree(r)
    r.proc.kill()
    r.proc.wait()
    deadline = time.monotonic() + 1.0
    eventually(lambda: all(gone(x) for x in pids), "every process of the tree ended", timeout=5)
    assert time.monotonic() < deadline + 4  # the keeper acts at once; 1 s is the target, 5 s the bound here
    eventually(lambda: session_of(d, "victim") is None, "its session is gone")


def test_a_daemon_restart_keeps_the_program_paused_until_granted_again(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs
) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial")
    r = runs(d, "survivor")
    pid = r.program_pid()
    eventually(lambda: r.count() > 0, "the program works")
    d.stop(signal.SIGKILL)
    eventually(lambda: stopped(pid), "the program is paused while gpud is away")
    before = r.count()
    time.sleep(0.2)  # a window in which nothing may happen: gpud is away, the program stays paused
    assert r.count() == before and r.proc.poll() is None
    d.start()
    eventually(lambda: r.count() > before, "the program goes on once its session is granted again", 20)
    info = session_of(d, "survivor")
    assert info is not None and info.grants >= 1


# --- bad input --------------------------------------------------------------------------------------


def _run(*args: str, socket: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gpud_client.run", *(["--socket", socket] if socket else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--gpus", "1.5", "--", "true"], 2, "--gpus: must be a whole number of GPUs >= 1 or a fraction"),
        (["--gpu", "0", "--gpus", "0.5", "--", "true"], 2, "--gpu (a place on one GPU) and --gpus"),
        (["--cpus", "2", "--", "true"], 2, "--cpus belongs to an allocation"),
        (["--gpus", "1", "--core-limit", "50", "--", "true"], 2, "--core-limit is for a share of one GPU and does"),
        (["--pause", "gpu", "--", "true"], 2, "invalid choice: 'gpu'"),
        (["--pause", "cuda", "--", "true"], 1, "--pause cuda: the CUDA driver's checkpoint API is not available"),
        ([], 2, "give the program to run after --"),
        (["--", "no-such-command-here"], 127, "no-such-command-here: command not found"),
        (["--", "{noexec}"], 126, "noexec: permission denied (not executable)"),
        (["--", "{badformat}"], 126, "badformat: exec format error"),
        (["--", "/"], 126, "/: is a directory"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message_and_nothing_left(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, args: list[str], status: int, message: str
) -> None:
    d = daemon_factory("--simulate", "1")
    (tmp_path / "noexec").write_text("#!/bin/sh\n")  # not executable
    (tmp_path / "badformat").write_bytes(b"\x7fELF garbage")
    (tmp_path / "badformat").chmod(0o755)  # executable, but the kernel cannot run it
    args = [a.format(noexec=tmp_path / "noexec", badformat=tmp_path / "badformat") for a in args]
    done = _run(*args, socket=d.socket)
    assert done.returncode == status, done.stderr
    assert message.lower() in done.stderr.lower()
    with Client(d.socket, name="test") as c:
        assert [x.name for x in c.call(p.ListClients(id=0)).clients] == ["test"]
        assert c.allocations().allocations == []


def test_an_unknown_gpu_is_refused_and_nothing_is_left(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "2")
    done = _run("--pause", "signal", "--gpu", "7", "--", "true", socket=d.socket)
    assert done.returncode == 1 and "gpu" in done.stderr.lower() and "7" in done.stderr
    assert [x.name for x in clients(d).clients] == ["test"]


def test_no_daemon_is_a_clear_error_unless_on_missing_run(tmp_path: Path) -> None:
    sock = str(tmp_path / "none.sock")
    done = _run("--pause", "signal", "--", "true", socket=sock)
    assert done.returncode == 1 and "--on-missing run" in done.stderr
    out = tmp_path / "ran.txt"
    done = _run(
        "--on-missing", "run", "--", sys.executable, BURNER, str(out), "--seconds", "0.1", "--exit", "4", socket=sock
    )
    assert done.returncode == 4 and "nothing arbitrates it" in done.stderr
    assert "end" in out.read_text()


def test_a_trace_file_the_run_cannot_write_is_a_usage_error_before_the_program_runs(tmp_path: Path) -> None:
    """Not a traceback once the run has started: exit 2 naming --trace, and the program never ran (here it
    would have: gpud is away and --on-missing run lets it)."""
    ran = tmp_path / "ran"
    (tmp_path / "plain").write_text("")
    program = [sys.executable, "-c", f"open({str(ran)!r}, 'w')"]

    def run(trace: Path) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "gpud.tools.gpuctl", "run", "--socket", str(tmp_path / "none.sock")]
        argv += ["--on-missing", "run", "--pause", "signal", "--trace", str(trace), "--", *program]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    for trace, why in [
        (tmp_path / "no" / "dir" / "f", f"cannot create {tmp_path / 'no' / 'dir' / 'f'}: no directory"),
        (tmp_path, f"{tmp_path} is a directory: give a file to append to"),
        (
            tmp_path / "plain" / "f",
            f"cannot create {tmp_path / 'plain' / 'f'}: {tmp_path / 'plain'} is not a directory",
        ),
    ]:
        done = run(trace)
        assert done.returncode == 2, done.stderr
        usage, error = done.stderr.splitlines()
        assert usage.startswith("usage: gpuctl run") and error.startswith(f"gpuctl run: error: argument --trace: {why}")
        assert not ran.exists()
    done = run(tmp_path / "trace.jsonl")  # the program does run where the file can be written
    assert done.returncode == 0, done.stderr
    assert ran.exists() and (tmp_path / "trace.jsonl").read_text()


# --- allocations ------------------------------------------------------------------------------------


def test_a_fractional_allocation_caps_the_programs_session_and_is_freed(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs, tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "2")
    r = runs(d, "half", "--gpus", "0.5", "--task", "job-1")
    r.program_pid()
    info = eventually(lambda: session_of(d, "half"), "the run's session")
    assert info.core_ceiling == 50 and info.core_limit == 50
    start = r.lines()[0].split()
    assert start[2] == "0"  # CUDA_VISIBLE_DEVICES: the allocated GPU, by index in PCI bus order
    with Client(d.socket, name="test") as c:
        assert [a.task_id for a in c.allocations().allocations] == ["job-1"]
        r.proc.send_signal(signal.SIGTERM)
        assert r.wait() == 3
        eventually(lambda: c.allocations().allocations == [], "the allocation is freed with the run")


def test_whole_gpus_are_exclusive_and_never_paused(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs, tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "2")
    r = runs(
        d,
        "whole",
        "--gpus",
        "1",
        "--cpus",
        "1",
        program=[sys.executable, BURNER, str(tmp_path / "whole.txt"), "--seconds", "0.3"],
    )
    assert r.wait() == 0
    start = r.lines()[0].split()
    assert start[2] == "0" and start[3] != "-"  # the GPU and the CPU cores it was given


# --- what tools show ----------------------------------------------------------------------------------


def test_gpuctl_clients_shows_a_run_as_a_run(daemon_factory: Callable[..., DaemonProcess], runs: Runs) -> None:
    from gpud.tools.nodeview import render_clients
    from gpud.tools.top import frame

    d = daemon_factory("--simulate", "1", "--mode", "serial", "--tq", "30")
    r = runs(d, "shown")
    pid = r.program_pid()
    eventually(lambda: (s := session_of(d, "shown")) is not None and s.state == "holding", "it holds")
    reply = clients(d)
    run = next(c for c in reply.clients if c.name == "shown")
    assert run.labels[PID] == str(pid)
    text = render_clients(reply)
    assert "RUNS" in text and f"{pid}" in text and "signal" in text and "running" in text and "burner.py" in text
    with Client(d.socket, name="test") as c:
        status, leases = c.call(p.Status(id=0)), c.call(p.ListLeases(id=0))
    row = next(line for line in frame(status, reply, leases, None, styled=False) if line.strip().startswith("shown"))
    assert f" {pid} " in row and "run running" in row  # top: the program's pid and the run's state


# --- the client alone -------------------------------------------------------------------------------

ONLY_THE_CLIENT = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"gpud", "trio", "pynvml", "prometheus_client", "structlog", "ray", "airflow", "cuda"}:
            raise ImportError(f"{name} is not on a task host that has only the client")
sys.meta_path.insert(0, Block())
import gpud_client.run, gpud_client.proctl.cuda, gpud_client.runinfo
from gpud_client.run import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_task_host_with_only_the_client_can_run_programs(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "1")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            ONLY_THE_CLIENT,
            "--socket",
            d.socket,
            "--",
            sys.executable,
            "-c",
            "raise SystemExit(5)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 5, done.stderr
    # auto says what it took (gpud's cgroup where the daemon has one, else SIGSTOP); on simulated GPUs
    # it has no CUDA to speak of, so no word of the missing binding
    assert "pausing" in done.stderr and "CUDA" not in done.stderr


def test_gpuctl_run_is_the_same_command(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "1")
    argv = [sys.executable, "-m", "gpud.tools.gpuctl", "run", "--socket", d.socket, "--pause", "signal", "--"]
    done = subprocess.run(
        [*argv, sys.executable, "-c", "raise SystemExit(6)"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 6, done.stderr
    usage = subprocess.run([*argv[:4], "--gpus", "2.5", "--", "true"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: gpuctl run")


FAKE_GPU = {"name": "Fake", "uuid": "GPU-fake", "total": 16 * 2**30, "procs": {}}


def nvml_daemon(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> DaemonProcess:
    """A daemon on one GPU of the NVML stand-in (tests/fakenvml), not on simulated GPUs: its state is
    ``tmp_path / "nvml.json"``."""
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"gpus": [FAKE_GPU]}))
    fakenvml = str(Path(__file__).resolve().parents[1] / "fakenvml")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([fakenvml, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_NVML_STATE", str(state))
    config = tmp_path / "gpud.toml"
    config.write_text("monitor_interval_s = 0.1\n")
    return daemon_factory("--config", str(config))


def test_the_programs_gpu_memory_is_reported_from_nvml(
    daemon_factory: Callable[..., DaemonProcess], runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpud reads NVML's per-process memory (here tests/fakenvml) for the run's program's tree."""
    state, gpu = tmp_path / "nvml.json", dict(FAKE_GPU)
    d = nvml_daemon(daemon_factory, tmp_path, monkeypatch)
    r = runs(d, "measured")
    pid = r.program_pid()
    gpu["procs"] = {str(pid): 3 * 2**30}
    state.write_text(json.dumps({"gpus": [gpu]}))
    eventually(lambda: (s := session_of(d, "measured")) is not None and s.mem_used_bytes == 3 * 2**30, "reported")


# --- what the run says of the CUDA binding ---------------------------------------------------------------

INSTALL_HINT = "pip install gpud-client[cuda]"
no_binding = pytest.mark.skipif(importlib.util.find_spec("cuda") is not None, reason="the CUDA binding is installed")


@no_binding
def test_without_a_gpu_the_run_says_nothing_of_the_cuda_binding(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    done = _run("--", "true", socket=str(tmp_path / "none.sock"))
    assert done.returncode == 1
    assert done.stderr.startswith("gpud-run: cannot connect to gpud at ") and len(done.stderr.splitlines()) == 1
    d = daemon_factory("--simulate", "1")
    done = _run("--", "true", socket=d.socket)
    assert done.returncode == 0, done.stderr
    assert "pausing" in done.stderr and "CUDA" not in done.stderr and INSTALL_HINT not in done.stderr


@no_binding
def test_with_a_gpu_auto_says_the_cuda_binding_is_missing_and_how_to_install_it(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = nvml_daemon(daemon_factory, tmp_path, monkeypatch)
    done = _run("--", "true", socket=d.socket)
    assert done.returncode == 0, done.stderr
    assert "the CUDA checkpoint API is not available: cuda-bindings is not installed" in done.stderr
    assert INSTALL_HINT in done.stderr


@no_binding
def test_cuda_asked_for_without_the_binding_is_refused_with_the_hint_gpu_or_not(tmp_path: Path) -> None:
    done = _run("--pause", "cuda", "--", "true", socket=str(tmp_path / "none.sock"))
    assert done.returncode == 1
    assert done.stderr.startswith("gpud-run: --pause cuda: the CUDA driver's checkpoint API is not available: ")
    assert done.stderr.endswith(f": {INSTALL_HINT}\n") and len(done.stderr.splitlines()) == 1


def test_a_run_never_mistakes_the_keepers_answer_to_go_for_the_programs_end(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    """The program's watcher used to start before the program did, and took the keeper's "started"
    for the program's end half of the time: the run then waited for ever. Five runs in a row."""
    d = daemon_factory("--simulate", "1")
    for i in range(5):
        done = _run("--pause", "signal", "--", sys.executable, "-c", f"raise SystemExit({i})", socket=d.socket)
        assert done.returncode == i, done.stderr


def test_joining_an_allocation_that_is_not_there_is_refused(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "2")
    done = _run("--pause", "signal", "--gpu", "0", "--task", "typo", "--", "true", socket=d.socket)
    assert done.returncode == 1 and "--task typo: gpud has no allocation of that task" in done.stderr
    with Client(d.socket, name="test") as c:
        c.allocate("job-2", 0.5, prefer=[1])
        done = _run("--pause", "signal", "--gpu", "0", "--task", "job-2", "--", "true", socket=d.socket)
        assert done.returncode == 1 and "its allocation is on GPU [1], not on GPU 0" in done.stderr
        done = _run("--pause", "signal", "--gpu", "1", "--task", "job-2", "--", "true", socket=d.socket)
        assert done.returncode == 0, done.stderr
        assert [a.task_id for a in c.allocations().allocations] == ["job-2"]  # joined, not freed: not the run's


def test_gpud_counts_a_runs_program_tree_only_for_its_own_grandchild() -> None:
    """A run names its program's pid in HELLO; gpud believes it only for a grandchild of the run's
    own process (run, keeper, program), so a client cannot count another process's memory."""
    import trio

    from gpud.kit.state import ClientLink
    from gpud.serving.monitor import process_memory
    from gpud_client.proctl.keeper import Keeper

    keeper = Keeper.start([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        program = keeper.program_pid

        def link(run_pid: int, named: int) -> ClientLink:
            conn = ClientLink(1, run_pid, 0, 0, frozenset(), -1, trio.CancelScope(), 0)
            conn.labels = {PID: str(named)}
            return conn

        readings = {program: 5, os.getpid(): 1, 1: 7}
        assert process_memory(readings, link(os.getpid(), program)) == 5  # the test process ran the keeper
        assert process_memory(readings, link(os.getpid(), 1)) == 1  # not its grandchild: its own only
        assert process_memory({1: 7}, link(os.getpid(), 1)) is None
    finally:
        keeper.close()
