"""The I/O half of bench/preempt.py: its daemons, its victim processes, its gpud-run; it returns what
was recorded and computes nothing (bench/preempt.py does, in pure functions).

Each part gets a fresh daemon on simulated GPUs with its own TOML file (the grace, no minimum
runtime) on a temporary socket, removed at the end whatever happened. Nothing waits on time where a
process can say it is ready: the victims answer each command with one line, and the run's trace and
the program's progress file are read until they show what the next step needs (a deadline turns a
run that never shows it into a MeasurementError).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client

from quota_workers import MeasurementError
from run_share import first_t, parse_trace

BENCH = Path(__file__).resolve().parent
VICTIM = str(BENCH / "preempt_victim.py")
BURNER = str(BENCH.parent / "tests" / "programs" / "burner.py")
REPLY_S = 30.0  # the longest a victim may take to answer (its own waits are shorter)
SHOW_S = 15.0  # the longest the run's trace or the program may take to show the next step
POLL_S = 0.01


def start_daemon(gpus: int, grace_s: float) -> DaemonProcess:
    """A daemon on ``gpus`` simulated GPUs of 16 GiB: grace ``grace_s``, no minimum runtime."""
    workdir = tempfile.mkdtemp(prefix="gpud-", dir="/tmp")
    config = os.path.join(workdir, "gpud.toml")
    with open(config, "w") as f:
        f.write(f"preemption_grace_s = {float(grace_s)}\npreemption_min_runtime_s = 0.0\n")
    daemon = DaemonProcess("--simulate", f"{gpus}x16GiB", "--config", config, workdir=workdir)
    try:
        return daemon.start()
    except BaseException:
        daemon.cleanup()
        raise


class Victims:
    """``count`` victim processes (bench/preempt_victim.py) of one mode, each holding ``gpus``."""

    def __init__(self, socket: str, mode: str, count: int, gpus: float) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        for i in range(count):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, VICTIM, socket, f"{mode}-{i}", "--gpus", f"{gpus:g}", "--mode", mode],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    bufsize=1,
                )
            )
        for i in range(count):
            self.answer(i)  # each holds its allocation

    def answer(self, i: int) -> dict[str, Any]:
        """Victim ``i``'s next line (it writes one per command, so none waits in a buffer)."""
        proc = self.procs[i]
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], REPLY_S)[0]:
            raise MeasurementError(f"victim {i} did not answer within {REPLY_S:g} s")
        line = proc.stdout.readline()
        if not line:
            raise MeasurementError(f"victim {i} ended (exit {proc.wait()})")
        got: dict[str, Any] = json.loads(line)
        if "error" in got:
            raise MeasurementError(got["error"])
        return got

    def hold_all(self) -> list[dict[str, Any]]:
        """Every victim holds again; what each saw since its last answer."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("hold\n")
        return [self.answer(i) for i in range(len(self.procs))]

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def run_grant(
    *, mode: str, trials: int, gpus: int, victims: int, victim_gpus: float, grace_s: float
) -> list[tuple[int, int, float, list[dict[str, Any]]]]:
    """``trials`` production requests for 1 GPU on a node full of victims of ``mode``: for each, when
    it was asked and granted (ns), the daemon's ``waited_ms``, and what every victim saw meanwhile."""
    daemon = start_daemon(gpus, grace_s)
    crowd: Victims | None = None
    out = []
    try:
        crowd = Victims(daemon.socket, mode, victims, victim_gpus)
        with Client(daemon.socket, name="production") as prod:
            wait_ms = round(1000 * grace_s) + 10_000
            for _ in range(trials):
                t0 = time.monotonic_ns()
                got = prod.allocate("production", 1, priority="production", wait_ms=wait_ms)
                t1 = time.monotonic_ns()
                prod.release_allocation("production")
                out.append((t0, t1, got.waited_ms, crowd.hold_all()))
        return out
    finally:
        if crowd is not None:
            crowd.close()
        daemon.cleanup()


def eventually(check: Callable[[], bool], what: str, timeout_s: float = SHOW_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise MeasurementError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(POLL_S)


def read(path: str) -> str:
    """The file's whole lines (a process may be writing the next one); "" before it exists."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return ""
    return text[: text.rfind("\n") + 1]


def run_suspend(*, cycles: int, grace_s: float, run_s: float, hold_s: float, every_s: float) -> dict[str, Any]:
    """A burner under ``gpud-run --on-preempt suspend --pause signal``, suspended and resumed by a
    production request ``cycles`` times: each cycle's times (ns), the run's trace, the progress file."""
    daemon = start_daemon(1, grace_s)
    work = daemon.workdir
    trace, record, errors = (os.path.join(work, name) for name in ("trace.jsonl", "progress.txt", "run.err"))
    began = time.monotonic()
    run: subprocess.Popen[bytes] | None = None
    try:
        with open(errors, "wb") as err:
            command = [sys.executable, "-m", "gpud_client.run", "--socket", daemon.socket, "--gpus", "1"]
            command += ["--on-preempt", "suspend", "--pause", "signal", "--priority", "best-effort"]
            command += ["--task", "suspendee", "--trace", trace, "--"]
            command += [sys.executable, BURNER, record, "--every", f"{every_s:g}"]
            run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        eventually(lambda: read(record).count("\n") >= 3, "the program's start")
        times = []
        with Client(daemon.socket, name="production") as prod:
            for _ in range(cycles):
                time.sleep(run_s)  # the program runs meanwhile: progress to be kept
                t0 = time.monotonic_ns()
                prod.allocate("production", 1, priority="production", wait_ms=round(1000 * grace_s) + 10_000)
                t1 = time.monotonic_ns()
                time.sleep(hold_s)  # suspended meanwhile: it must not progress
                freed = time.monotonic_ns()
                prod.release_allocation("production")
                times.append({"t0": t0, "t1": t1, "freed": freed})
                eventually(partial(_resumed_and_ran, trace, record, freed), "the program's resume")
        run.send_signal(signal.SIGTERM)
        run.wait(10)
        return {
            "cycles": times,
            "trace": parse_trace(read(trace)),
            "progress": read(record),
            "wall_s": round(time.monotonic() - began, 1),
        }
    except (MeasurementError, subprocess.TimeoutExpired) as exc:
        raise MeasurementError(f"{exc}; gpud-run said: {read(errors).strip()[-500:]}") from None
    finally:
        if run is not None and run.poll() is None:
            run.kill()
            run.wait()
        daemon.cleanup()


def _resumed_and_ran(trace: str, record: str, after: int) -> bool:
    """The run resumed its program after ``after`` and the program stamped progress since."""
    resumed = first_t(parse_trace(read(trace)), "resume", after)
    if resumed is None:
        return False
    last = read(record).rsplit("\n", 2)
    return len(last) == 3 and _stamp(last[-2]) > resumed


def _stamp(line: str) -> int:
    parts = line.split()
    return round(float(parts[0]) * 1e9) if len(parts) == 2 and parts[0][:1].isdigit() else 0
