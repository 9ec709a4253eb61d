"""How exactly ``gpud-run`` shares a GPU among unmodified programs: the share each program gets under a
compute limit, by the daemon's books and by the program's own progress; how fast a DROP_LOCK pauses
the program and gives the lock back; and what an idle run costs a busy one.

Every program is ``bench/run_programs.py burn``: pure-Python CPU work in fixed chunks, importing
nothing of gpud, stamping the end of every chunk with ``time.monotonic_ns()`` (the clock of every
process here, gpud's and gpud-run's ``--trace`` included). It runs under ``python -m gpud_client.run
--pause signal --core-limit L --trace FILE``: SIGSTOP and SIGCONT of its whole tree, in serial mode on
one simulated GPU (a fresh ``gpud --simulate 1x16GiB --mode serial`` per scenario). The "GPU" here is
this host's CPU: a program makes progress exactly while gpud-run lets it run.

Scenarios (``--only`` takes a comma-separated subset):
- single-25, single-50, single-75: one run at that ``--core-limit`` (target |error| <= 1.0 pp);
- mix-25+75, mix-30+60: two runs at once (target |error| <= 1.5 pp);
- idle-release: a busy unlimited run alone, then beside an idle run (``run_programs.py idle``, a
  program that only sleeps, under ``--idle-release 0.2``), with the daemon's time quantum at 1 s.

Figures:
- billed: the share of GPU time the daemon billed the run's session over the measured interval:
  ``recent_share_percent`` of CLIENTS, the daemon started with ``--share-windows N`` and read within
  the window after the interval, so that it covers exactly the interval's N windows (the daemon's
  books: grant to LOCK_RELEASED, its drop tail included);
- progress: the chunks the program finished in the interval / (its rate alone x the interval's
  length). Its rate alone is the same program run alone and unarbitrated (no gpud-run) for 3 s
  before the first scenario and after each; a scenario uses the mean of the two calibrations around
  it. A chunk straddling an edge of the interval counts on the side it ended: at most one chunk
  (about 1 ms of work) per edge;
- CPU: the CPU time the program used in the interval / the interval's length, from its own stamps:
  what it got, whatever the host's speed. The host's speed is ``speed``: its work per CPU second in
  the interval over its work per CPU second alone. progress = CPU x speed (within the few per cent
  of a CPU a lone program loses), so where progress and CPU differ, the host's speed moved (on a
  shared VM it does, by a third from one second to the next: ``calibration.drift_max_percent`` is
  the largest change between two calibrations), not gpud; ``host_busy_percent`` (every CPU, over the scenario; a
  program at L % adds L / cpus, the daemon and gpud-run a little) shows other work on the host;
- the interval: aligned to the daemon's compute windows (their origin from STATUS's uptime), starting
  2 windows after the last program started (1 with --quick) and covering exactly N windows. error =
  share - limit, in percentage points; each of billed, progress and CPU is held to the target;
- pause latency (over every DROP_LOCK of the mix scenarios, from the runs' ``--trace``): ``drop``
  (the session's hook saw the DROP_LOCK) to the ``pause`` action (the signal backend returns once
  /proc shows the whole tree stopped) and to the ``release`` action (stamped once LOCK_RELEASED has
  been sent), p50 / p99 / max, nearest rank (target p50 <= 2 ms);
- idle release: the neighbour's share over 10 s alone and over 10 s beside the idle run (both in one
  run of the neighbour; the second stretch starts once the idle run has given its first turn back,
  so its program's start-up is not counted), by progress and by CPU time; cost = alone - beside, in
  pp, beside the bound idle_release / TQ (the idle run should hold a turn for its idle release, the
  neighbour holds for TQ), and the idle run's hold per turn (``granted`` to ``release`` in its trace).

The window is 1 s by default, half the daemon's own: each turn costs a program a little time the
daemon bills (grant to SIGCONT, SIGSTOP to LOCK_RELEASED, 2-3 ms here), so with twice the turns of a
default deployment the figures count that cost double, never less; 0.5 s would count it four times
over and leave little of the 1 pp target to measure gpud by. 20 windows of 1 s keep a scenario to
about 25 s and the whole run to about 3 minutes, short enough to fall in a quiet spell of a shared
VM. ``--window`` changes it.

With ``--json`` the last line is one object:
``{"scenarios": [{"name", "limits", "windows", "window_s", "wall_s", "alone_per_s",
"host_busy_percent", "host_steal_percent", "runs": [{"run", "limit", "billed_percent",
"billed_error_pp", "progress_percent", "progress_error_pp", "cpu_percent", "cpu_error_pp",
"tolerance_pp", "billed_met", "progress_met", "cpu_met", "progress_window_min",
"progress_window_max", "cpu_window_min", "cpu_window_max", "speed_percent", "grants", "drops",
"throttles", "chunks"}, ...]}, ...], "pause_latency": {"drops", "drop_to_pause_ms": {"p50", "p99",
"max"}, "drop_to_release_ms": {...}, "target_p50_ms", "met"} | null, "idle_release": {"tq_s",
"idle_release_s", "phase_s", "neighbour_alone_percent", "neighbour_beside_idle_percent", "cost_pp",
"neighbour_alone_cpu_percent", "neighbour_beside_idle_cpu_percent", "cost_cpu_pp", "bound_pp",
"within_bound", "within_bound_cpu", "idle_turns", "idle_hold_ms": {"p50", "p99", "max"},
"neighbour_hold_ms": {...}, "daemon_idle_held_percent", "alone_per_s", "host_busy_percent",
"host_steal_percent", "wall_s"} | null, "calibration": {"seconds", "rates_per_s", "rates_per_cpu_s",
"cpu_percent", "drift_max_percent", "host_busy_percent"}, "met_all", "targets", "config", "cpus",
"loadavg_1m_before", "loadavg_1m_after", "elapsed_s"}``. What was not measured (``--only``) is
null (or absent from ``scenarios``); ``met_all`` covers the three shares and the pause latency.

It exits 0 whatever the figures say (a miss is reported, not failed), and 1 only when the benchmark
itself could not run (a daemon or a run that failed, a trace without what it needs). It never bends a
figure: nothing is dropped besides the declared warm-up. It starts its own daemons on temporary
sockets and removes them; it never touches a system gpud.

    .venv/bin/python bench/run_share.py [--json] [--windows N] [--window S] [--only NAME[,NAME]] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from bisect import bisect_right
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path
from typing import Any

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client

from harness import Run, machine_line, progress
from percentiles import percentile
from quota_workers import MeasurementError, next_boundary, sleep_until, window_origin_ns

PROGRAMS = str(Path(__file__).resolve().parent / "run_programs.py")
SHARE_SCENARIOS = {
    "single-25": (25,),
    "single-50": (50,),
    "single-75": (75,),
    "mix-25+75": (25, 75),
    "mix-30+60": (30, 60),
}
IDLE = "idle-release"
SIMULATED = ("--simulate", "1x16GiB")
TARGETS = {"single_abs_error_pp": 1.0, "mix_abs_error_pp": 1.5, "pause_p50_ms": 2.0}
MS = 1_000_000
S = 1_000_000_000


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    windows: int = 20
    window_s: float = 1.0
    warmup_windows: int = 2
    calibration_s: float = 3.0
    calibration_skip_s: float = 0.3  # the interpreter's first moments are not the program's rate
    start_allowance_s: float = 4.0  # launch to every program started (a second run waits a turn)
    tq_s: float = 1.0
    idle_release_s: float = 0.2
    phase_s: float = 10.0

    @property
    def window_ns(self) -> int:
        return round(self.window_s * S)


QUICK = BenchConfig(windows=3, window_s=0.5, warmup_windows=1, calibration_s=0.5, phase_s=1.5)


# --- arithmetic on what the programs and the traces recorded (pure) ----------------------


@dataclass(frozen=True)
class Record:
    """A burn program's record: its start and the end of every chunk, each with the time and the CPU
    time the program had used by then (ns)."""

    t: array[int]
    cpu: array[int]

    @classmethod
    def read(cls, data: bytes) -> Record:
        pairs = array("q")
        pairs.frombytes(data)
        if len(pairs) < 4:
            raise MeasurementError(f"a program recorded {len(pairs) // 2} stamps: it did no work")
        return cls(pairs[0::2], pairs[1::2])

    def chunks_by(self, t: int) -> int:
        """Chunks the program had finished at time ``t``."""
        return bisect_right(self.t, t, 1) - 1

    def cpu_by(self, t: int) -> int:
        """The CPU time it had used by its last stamp at or before ``t``."""
        return self.cpu[max(0, bisect_right(self.t, t) - 1)]


@dataclass(frozen=True)
class Alone:
    """The program alone, unarbitrated: chunks per second of time and per second of its CPU time (the
    host's speed), and the share of a CPU it got (below 100: other work took some)."""

    per_s: float
    per_cpu_s: float
    cpu_percent: float

    @classmethod
    def of(cls, rec: Record, skip_ns: int) -> Alone:
        """From chunk end to chunk end, after the first ``skip_ns`` (the interpreter's start-up)."""
        i = bisect_right(rec.t, rec.t[0] + skip_ns, 1)
        n, wall, cpu = len(rec.t) - 1 - i, rec.t[-1] - rec.t[i], rec.cpu[-1] - rec.cpu[i]
        if n < 1 or cpu <= 0:
            raise MeasurementError("the calibration run is too short to give a rate")
        return cls(n * S / wall, n * S / cpu, 100 * cpu / wall)

    @staticmethod
    def mean(a: Alone, b: Alone) -> Alone:
        return Alone(*(statistics.mean(pair) for pair in zip(astuple(a), astuple(b))))


def kind(rec: dict[str, Any]) -> str:
    """A ``gpud-run --trace`` line's name: its event (what happened) or its action (what the run did)."""
    return str(rec.get("event") or rec.get("action", ""))


def progress_percent(rec: Record, a: int, b: int, alone: Alone) -> float:
    """The work done in [a, b) as a share of what the program does alone in as long."""
    return 100 * (rec.chunks_by(b) - rec.chunks_by(a)) / (alone.per_s * (b - a) / S)


def cpu_percent(rec: Record, a: int, b: int) -> float:
    """The CPU time the program used in [a, b), as a share of one CPU."""
    return 100 * (rec.cpu_by(b) - rec.cpu_by(a)) / (b - a)


def speed_percent(rec: Record, a: int, b: int, alone: Alone) -> float | None:
    """Its work per CPU second in [a, b) over its work per CPU second alone: the host's speed then."""
    cpu = rec.cpu_by(b) - rec.cpu_by(a)
    return None if cpu <= 0 else 100 * (rec.chunks_by(b) - rec.chunks_by(a)) * S / cpu / alone.per_cpu_s


def interval(origin: int, window: int, last_start: int, warmup: int, windows: int) -> tuple[int, int]:
    """The measured interval: from the first window boundary ``warmup`` windows after the last program
    started, exactly ``windows`` windows long."""
    start = next_boundary(origin, window, last_start + warmup * window)
    return start, start + windows * window


def parse_trace(text: str) -> list[dict[str, Any]]:
    """A ``--trace`` file: one JSON object per line, in the order the run handled them."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def pause_latencies(trace: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """For every DROP_LOCK the run acted on: (pause - drop, release - drop) in ns. A drop that was
    not followed by a pause before the next grant or drop (the run was not holding) is skipped."""
    out = []
    for i, rec in enumerate(trace):
        if kind(rec) != "drop":
            continue
        paused = None
        for later in trace[i + 1 :]:
            if kind(later) in ("drop", "granted"):
                break
            if kind(later) == "pause" and paused is None:
                paused = later["t"]
            elif kind(later) == "release" and paused is not None:
                out.append((paused - rec["t"], later["t"] - rec["t"]))
                break
    return out


def holds(trace: list[dict[str, Any]], a: int = 0, b: int = 2**63) -> list[int]:
    """Every turn granted in [a, b): ``granted`` to the next ``release``, in ns."""
    out = []
    granted = None
    for rec in trace:
        if kind(rec) == "granted":
            granted = rec["t"]
        elif kind(rec) == "release" and granted is not None:
            if a <= granted < b:
                out.append(rec["t"] - granted)
            granted = None
    return out


def first_t(trace: list[dict[str, Any]], event: str, after: int = 0) -> int | None:
    return next((rec["t"] for rec in trace if kind(rec) == event and rec["t"] >= after), None)


def spread_ms(samples_ns: list[int]) -> dict[str, float] | None:
    """p50 / p99 / max in ms, nearest rank; None without samples."""
    if not samples_ns:
        return None
    ms = [x / MS for x in samples_ns]
    return {"p50": round(percentile(ms, 50), 3), "p99": round(percentile(ms, 99), 3), "max": round(max(ms), 3)}


def busy_percent(before: list[int], after: list[int]) -> dict[str, float]:
    """How busy every CPU of the host was between two reads of /proc/stat's ``cpu`` line (user, nice,
    system, idle, iowait, irq, softirq, steal): busy and stolen (by the hypervisor) in percent."""
    d = [b - a for a, b in zip(before, after)]
    total = sum(d[:8]) or 1
    return {"busy": round(100 * (total - d[3] - d[4]) / total, 1), "steal": round(100 * d[7] / total, 1)}


def drift_percent(rates: list[float]) -> float:
    """The largest change between two consecutive calibrations, in percent of the first."""
    return round(max((abs(b - a) / a * 100 for a, b in zip(rates, rates[1:])), default=0.0), 2)


# --- the processes ---------------------------------------------------------------------------


class Runs:
    """The gpud-run processes of one scenario, each with its trace and its program's record in the
    daemon's directory; killed (their programs with them: the keeper sees to it) if the scenario fails."""

    def __init__(self, daemon: DaemonProcess, pause: str = "signal") -> None:
        self.daemon, self.dir, self.pause = daemon, Path(daemon.workdir), pause
        self.stop_file = self.dir / "stop"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def launch(self, name: str, program: list[str], *opts: str) -> None:
        cmd = [sys.executable, "-m", "gpud_client.run", "--socket", self.daemon.socket, "--name", name]
        cmd += ["--pause", self.pause, "--trace", str(self.dir / f"{name}.trace"), *opts]
        with open(self.dir / f"{name}.err", "wb") as err:
            self.procs[name] = subprocess.Popen(
                [*cmd, "--", sys.executable, PROGRAMS, *program], stdout=err, stderr=err
            )

    def record(self, name: str) -> Path:
        return self.dir / f"{name}.rec"

    def trace(self, name: str) -> list[dict[str, Any]]:
        path = self.dir / f"{name}.trace"
        return parse_trace(path.read_text()) if path.exists() else []

    def wait_for(self, name: str, event: str, deadline_ns: int, after: int = 0) -> int:
        """When the run's trace first shows ``event`` (at or after ``after``)."""
        while (t := first_t(self.trace(name), event, after)) is None:
            self.check_alive(name)
            if time.monotonic_ns() > deadline_ns:
                raise MeasurementError(f"run {name}: no {event!r} in its trace in time")
            time.sleep(0.01)
        return t

    def finish(self, timeout_s: float) -> None:
        """Tell the programs to stop (each sees it in its next turn) and wait for every run to end."""
        self.stop_file.touch()
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            try:
                code = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise MeasurementError(f"run {name} did not end in time") from None
            if code != 0:
                raise MeasurementError(f"run {name} exited with {code}: {self._err(name)}")

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def check_alive(self, name: str) -> None:
        if self.procs[name].poll() is not None:
            raise MeasurementError(f"run {name} ended early ({self.procs[name].returncode}): {self._err(name)}")

    def _err(self, name: str) -> str:
        return (self.dir / f"{name}.err").read_text(errors="replace").strip()[-2000:]


def start_daemon(*flags: str, timeout: float = 10.0) -> DaemonProcess:
    """A fresh daemon on a temporary socket; its directory holds the runs' traces and records."""
    daemon = DaemonProcess("--mode", "serial", "--log-level", "warning", *flags)
    try:
        return daemon.start(timeout)
    except BaseException:
        daemon.cleanup()
        raise


def calibrate(cfg: BenchConfig) -> tuple[Alone, float]:
    """The burn program alone, unarbitrated; and how busy the host's CPUs were meanwhile (one of two
    busy is 50 %: more is other work, which slows the program as gpud would)."""
    with tempfile.TemporaryDirectory(prefix="run-share-") as tmp:
        path = os.path.join(tmp, "alone.rec")
        before = cpu_times()
        until = time.monotonic_ns() + round((cfg.calibration_s + cfg.calibration_skip_s) * S)
        subprocess.run([sys.executable, PROGRAMS, "burn", path, "--until-ns", str(until)], check=True)
        busy = busy_percent(before, cpu_times())["busy"]
        return Alone.of(Record.read(Path(path).read_bytes()), round(cfg.calibration_skip_s * S)), busy


def cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def sessions_by_name(obs: Client) -> dict[str, Any]:
    return {c.name: c.sessions[0] for c in obs.clients().clients if c.sessions}


# --- share scenarios ---------------------------------------------------------------------------


def run_share(name: str, limits: tuple[int, ...], cfg: BenchConfig) -> dict[str, Any]:
    """Run the scenario; what was recorded (the figures need the calibration after it)."""
    began, W = time.monotonic(), cfg.window_ns
    progress(f"{name}: limits {'+'.join(map(str, limits))}, {cfg.windows} windows of {cfg.window_s:g} s")
    daemon = start_daemon(*SIMULATED, "--window", f"{cfg.window_s:g}", "--share-windows", str(cfg.windows))
    runs = Runs(daemon)
    names = [f"{name}-{'ab'[i]}" for i in range(len(limits))]
    try:
        with Client(daemon.socket, name="bench-observer") as obs:
            origin = window_origin_ns(obs)
            launched = time.monotonic_ns()
            allowance = round(cfg.start_allowance_s * S)
            for run, limit in zip(names, limits):
                program = ["burn", str(runs.record(run)), "--stop-file", str(runs.stop_file)]
                runs.launch(run, program, "--core-limit", str(limit))
            started = [runs.wait_for(run, "start", launched + allowance) for run in names]
            start, end = interval(origin, W, max(started), cfg.warmup_windows, cfg.windows)
            sleep_until(start)
            cpu_before = cpu_times()
            sleep_until(end)
            host = busy_percent(cpu_before, cpu_times())
            sleep_until(end + W // 4)  # within the window after the interval: the last N windows are its own
            view = sessions_by_name(obs)
            runs.finish(2 * cfg.window_s + 30)
        missing = [run for run in names if run not in view]
        if missing:
            raise MeasurementError(f"{name}: no session of {missing} in CLIENTS at the interval's end")
        return {
            "name": name,
            "limits": limits,
            "start": start,
            "end": end,
            "sessions": [view[run] for run in names],
            "records": [Record.read(runs.record(run).read_bytes()) for run in names],
            "traces": [runs.trace(run) for run in names],
            "host": host,
            "wall_s": round(time.monotonic() - began, 1),
        }
    finally:
        runs.kill()
        daemon.cleanup()


def share_figures(raw: dict[str, Any], cfg: BenchConfig, alone: Alone) -> dict[str, Any]:
    """A scenario's figures, its programs' progress measured against ``alone``."""
    start, end, W = raw["start"], raw["end"], cfg.window_ns
    tolerance = TARGETS["single_abs_error_pp" if len(raw["limits"]) == 1 else "mix_abs_error_pp"]
    runs = []
    for i, (limit, view, rec) in enumerate(zip(raw["limits"], raw["sessions"], raw["records"])):
        billed = float(view.recent_share_percent)
        done, cpu = progress_percent(rec, start, end, alone), cpu_percent(rec, start, end)
        windows = range(start, end, W)
        per_window = [progress_percent(rec, a, a + W, alone) for a in windows]
        cpu_per_window = [cpu_percent(rec, a, a + W) for a in windows]
        speed = speed_percent(rec, start, end, alone)
        runs.append(
            {
                "run": "ab"[i],
                "limit": limit,
                "billed_percent": round(billed, 3),
                "billed_error_pp": round(billed - limit, 3),
                "progress_percent": round(done, 3),
                "progress_error_pp": round(done - limit, 3),
                "cpu_percent": round(cpu, 3),
                "cpu_error_pp": round(cpu - limit, 3),
                "tolerance_pp": tolerance,
                "billed_met": abs(billed - limit) <= tolerance,
                "progress_met": abs(done - limit) <= tolerance,
                "cpu_met": abs(cpu - limit) <= tolerance,
                "progress_window_min": round(min(per_window), 2),
                "progress_window_max": round(max(per_window), 2),
                "cpu_window_min": round(min(cpu_per_window), 2),
                "cpu_window_max": round(max(cpu_per_window), 2),
                "speed_percent": None if speed is None else round(speed, 2),
                "grants": view.grants,
                "drops": dict(view.drops),
                "throttles": view.throttles,
                "chunks": rec.chunks_by(end) - rec.chunks_by(start),
            }
        )
    return {
        "name": raw["name"],
        "limits": list(raw["limits"]),
        "windows": cfg.windows,
        "window_s": cfg.window_s,
        "wall_s": raw["wall_s"],
        "alone_per_s": round(alone.per_s, 1),
        "host_busy_percent": raw["host"]["busy"],
        "host_steal_percent": raw["host"]["steal"],
        "runs": runs,
    }


def pause_figures(samples: list[tuple[int, int]]) -> dict[str, Any] | None:
    """drop -> paused and drop -> released over ``samples`` (ns pairs); None without any."""
    to_pause = spread_ms([p for p, _ in samples])
    to_release = spread_ms([r for _, r in samples])
    if to_pause is None or to_release is None:
        return None
    target = TARGETS["pause_p50_ms"]
    return {
        "drops": len(samples),
        "drop_to_pause_ms": to_pause,
        "drop_to_release_ms": to_release,
        "target_p50_ms": target,
        "met": to_pause["p50"] <= target and to_release["p50"] <= target,
    }


# --- idle release ---------------------------------------------------------------------------------


def run_idle(cfg: BenchConfig) -> dict[str, Any]:
    """A busy unlimited run: ``phase_s`` alone, then as long beside an idle run (TQ = ``tq_s``)."""
    began = time.monotonic()
    progress(
        f"{IDLE}: a busy run, {cfg.phase_s:g} s alone then {cfg.phase_s:g} s beside an idle run "
        f"(--idle-release {cfg.idle_release_s:g}), TQ {cfg.tq_s:g} s"
    )
    daemon = start_daemon(*SIMULATED, "--window", f"{cfg.window_s:g}", "--tq", f"{cfg.tq_s:g}")
    runs = Runs(daemon)
    allowance, phase = round(cfg.start_allowance_s * S), round(cfg.phase_s * S)
    idle_allowance = allowance + round((cfg.tq_s + cfg.idle_release_s) * S)
    try:
        with Client(daemon.socket, name="bench-observer") as obs:
            launched, cpu_before = time.monotonic_ns(), cpu_times()
            runs.launch("busy", ["burn", str(runs.record("busy")), "--stop-file", str(runs.stop_file)])
            alone = runs.wait_for("busy", "start", launched + allowance) + S // 2
            sleep_until(alone + phase)
            until = time.monotonic_ns() + idle_allowance + phase + S  # the idle program cannot look for a stop file
            runs.launch("idle", ["idle", "--until-ns", str(until)], "--idle-release", f"{cfg.idle_release_s:g}")
            beside = runs.wait_for("idle", "release", until - phase - S)
            before = sessions_by_name(obs)
            sleep_until(beside + phase)
            after = sessions_by_name(obs)
            host = busy_percent(cpu_before, cpu_times())
            runs.finish(cfg.tq_s + (until - time.monotonic_ns()) / S + 30)
        return {
            "alone": (alone, alone + phase),
            "beside": (beside, beside + phase),
            "record": Record.read(runs.record("busy").read_bytes()),
            "idle_trace": runs.trace("idle"),
            "busy_trace": runs.trace("busy"),
            "idle_held_ms": after["idle"].hold_ms - before["idle"].hold_ms,
            "host": host,
            "wall_s": round(time.monotonic() - began, 1),
        }
    finally:
        runs.kill()
        daemon.cleanup()


def idle_figures(raw: dict[str, Any], cfg: BenchConfig, alone: Alone) -> dict[str, Any]:
    (a0, a1), (b0, b1), rec = raw["alone"], raw["beside"], raw["record"]
    on_its_own, with_idle = progress_percent(rec, a0, a1, alone), progress_percent(rec, b0, b1, alone)
    cpu_alone, cpu_beside = cpu_percent(rec, a0, a1), cpu_percent(rec, b0, b1)
    bound = 100 * cfg.idle_release_s / cfg.tq_s
    idle_holds = holds(raw["idle_trace"], b0, b1)
    return {
        "tq_s": cfg.tq_s,
        "idle_release_s": cfg.idle_release_s,
        "phase_s": cfg.phase_s,
        "neighbour_alone_percent": round(on_its_own, 2),
        "neighbour_beside_idle_percent": round(with_idle, 2),
        "cost_pp": round(on_its_own - with_idle, 2),
        "neighbour_alone_cpu_percent": round(cpu_alone, 2),
        "neighbour_beside_idle_cpu_percent": round(cpu_beside, 2),
        "cost_cpu_pp": round(cpu_alone - cpu_beside, 2),
        "bound_pp": round(bound, 2),
        "within_bound": on_its_own - with_idle <= bound,
        "within_bound_cpu": cpu_alone - cpu_beside <= bound,
        "idle_turns": len(idle_holds),
        "idle_hold_ms": spread_ms(idle_holds),
        "neighbour_hold_ms": spread_ms(holds(raw["busy_trace"], b0, b1)),
        "daemon_idle_held_percent": round(100 * raw["idle_held_ms"] * MS / (b1 - b0), 2),
        "alone_per_s": round(alone.per_s, 1),
        "host_busy_percent": raw["host"]["busy"],
        "host_steal_percent": raw["host"]["steal"],
        "wall_s": raw["wall_s"],
    }


# --- report -----------------------------------------------------------------------------------------


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'scenario':<11}{'run':>4}{'limit':>7}{'billed':>9}{'error':>9}{'progress':>10}{'error':>9}"
        f"{'per window':>14}{'CPU':>8}{'error':>9}{'per window':>13}{'speed':>7}{'tol':>5}{'host':>7}  met"
    ]
    for sc in result["scenarios"]:
        for r in sc["runs"]:
            speed = "-" if r["speed_percent"] is None else f"{r['speed_percent']:.0f} %"
            lines.append(
                f"{sc['name']:<11}{r['run']:>4}{r['limit']:>5} %{r['billed_percent']:>7.2f} %"
                f"{r['billed_error_pp']:>+6.2f} pp{r['progress_percent']:>8.2f} %{r['progress_error_pp']:>+6.2f} pp"
                f"{r['progress_window_min']:>7.0f}-{r['progress_window_max']:<5.0f}{r['cpu_percent']:>7.2f} %"
                f"{r['cpu_error_pp']:>+6.2f} pp{r['cpu_window_min']:>6.1f}-{r['cpu_window_max']:<5.1f}{speed:>7}"
                f"{r['tolerance_pp']:>5.1f}{sc['host_busy_percent']:>5.0f} %  "
                f"{' / '.join(_met(r[k]) for k in ('billed_met', 'progress_met', 'cpu_met'))}"
            )
    pl = result["pause_latency"]
    if pl:
        p, r = pl["drop_to_pause_ms"], pl["drop_to_release_ms"]
        lines.append(
            f"pause latency over {pl['drops']} drops of the mixes: drop -> paused p50 {p['p50']:.2f} / p99 "
            f"{p['p99']:.2f} / max {p['max']:.2f} ms; drop -> released p50 {r['p50']:.2f} / p99 {r['p99']:.2f} / "
            f"max {r['max']:.2f} ms (target p50 <= {pl['target_p50_ms']:g} ms): {_met(pl['met'])}"
        )
    ir = result["idle_release"]
    if ir:
        hold = ir["idle_hold_ms"] or {"p50": float("nan"), "max": float("nan")}
        lines.append(
            f"idle release (TQ {ir['tq_s']:g} s, --idle-release {ir['idle_release_s']:g} s): the busy run got "
            f"CPU {ir['neighbour_alone_cpu_percent']:.2f} % alone, {ir['neighbour_beside_idle_cpu_percent']:.2f} % "
            f"beside the idle run: cost {ir['cost_cpu_pp']:.2f} pp (progress {ir['neighbour_alone_percent']:.2f} -> "
            f"{ir['neighbour_beside_idle_percent']:.2f} %: {ir['cost_pp']:.2f} pp); bound idle_release / TQ = "
            f"{ir['bound_pp']:.1f} pp: {'within' if ir['within_bound_cpu'] else 'OVER'} (CPU), "
            f"{'within' if ir['within_bound'] else 'OVER'} (progress)"
        )
        lines.append(
            f"  the idle run: {ir['idle_turns']} turn(s) in {ir['phase_s']:g} s, held p50 {hold['p50']:.0f} / max "
            f"{hold['max']:.0f} ms per turn; the daemon billed it {ir['daemon_idle_held_percent']:.2f} % of that time"
        )
    cal, c = result["calibration"], result["config"]
    lines.append(
        "billed = the daemon's CLIENTS figure over the interval; progress = the program's work / its rate alone; "
        "CPU = the CPU time it used / the interval; speed = its work per CPU second / alone; error = share - "
        "limit; host = how busy all CPUs were, the programs' own share included; met = billed / progress / CPU"
    )
    lines.append(
        f"window {c['window_s']:g} s, {c['windows']} windows after {c['warmup_windows']}-{c['warmup_windows'] + 1} "
        f"warm-up; alone ({cal['seconds']:g} s each): {', '.join(f'{x:.0f}' for x in cal['rates_per_s'])} "
        f"chunks/s, {', '.join(f'{x:.0f}' for x in cal['rates_per_cpu_s'])} per CPU second, host busy "
        f"{', '.join(f'{x:.0f}' for x in cal['host_busy_percent'])} %; largest change between two: "
        f"{cal['drift_max_percent']:.2f} %"
    )
    lines.append(f"{machine_line(result)}; all met: {result['met_all']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, list[str], bool]:
    ap = argparse.ArgumentParser(description="Shares, pause latency and idle release of gpud-run (signal backend).")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--windows", type=int, help="measured windows per scenario (default 20)")
    ap.add_argument("--window", type=float, help="the daemons' compute window in seconds (default 1)")
    names = [*SHARE_SCENARIOS, IDLE]
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(names)}")
    ap.add_argument("--quick", action="store_true", help="a short run that only shows the benchmark works")
    args = ap.parse_args(argv)
    chosen = names if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(unknown)}; choose from {', '.join(names)}")
    cfg = QUICK if args.quick else BenchConfig()
    if args.windows is not None:
        if not 1 <= args.windows <= 1000:
            ap.error("--windows must be 1 to 1000 (the daemon's --share-windows)")
        cfg = replace(cfg, windows=args.windows)
    if args.window is not None:
        if args.window <= 0:
            ap.error("--window must be positive")
        cfg = replace(cfg, window_s=args.window)
    return cfg, chosen, args.json


def measure(cfg: BenchConfig, chosen: list[str]) -> dict[str, Any]:
    """Every chosen scenario, each between two calibrations; its progress measured against their mean."""
    calibrations = [calibrate(cfg)]

    def alone_around() -> Alone:
        calibrations.append(calibrate(cfg))
        return Alone.mean(calibrations[-2][0], calibrations[-1][0])

    scenarios, latencies, idle = [], [], None
    for name, limits in SHARE_SCENARIOS.items():
        if name in chosen:
            raw = run_share(name, limits, cfg)
            scenarios.append(share_figures(raw, cfg, alone_around()))
            if len(limits) > 1:
                latencies += [x for trace in raw["traces"] for x in pause_latencies(trace)]
            for f in scenarios[-1]["runs"]:
                progress(
                    f"  run {f['run']} limit {f['limit']}: billed {f['billed_percent']:.2f} %, "
                    f"progress {f['progress_percent']:.2f} %, CPU {f['cpu_percent']:.2f} %"
                )
    if IDLE in chosen:
        idle = idle_figures(run_idle(cfg), cfg, alone_around())
        progress(
            f"  busy run: CPU {idle['neighbour_alone_cpu_percent']:.2f} % alone, "
            f"{idle['neighbour_beside_idle_cpu_percent']:.2f} % beside the idle run: {idle['cost_cpu_pp']:.2f} pp "
            f"(bound {idle['bound_pp']:.1f})"
        )
    rates = [alone.per_s for alone, _ in calibrations]
    entries = [r for sc in scenarios for r in sc["runs"]]
    pauses = pause_figures(latencies)
    return {
        "scenarios": scenarios,
        "pause_latency": pauses,
        "idle_release": idle,
        "calibration": {
            "seconds": cfg.calibration_s,
            "rates_per_s": [round(x, 1) for x in rates],
            "rates_per_cpu_s": [round(alone.per_cpu_s, 1) for alone, _ in calibrations],
            "cpu_percent": [round(alone.cpu_percent, 1) for alone, _ in calibrations],
            "drift_max_percent": drift_percent(rates),
            "host_busy_percent": [busy for _, busy in calibrations],
        },
        "met_all": all(r["billed_met"] and r["progress_met"] and r["cpu_met"] for r in entries)
        and (pauses or {}).get("met", True),
        "targets": TARGETS,
        "config": asdict(cfg),
    }


def main(argv: list[str] | None = None) -> int:
    cfg, chosen, as_json = parse_args(argv)
    run = Run()
    try:
        result = measure(cfg, chosen)
    except (MeasurementError, RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        print(f"run_share: nothing reported: {exc}", file=sys.stderr)
        return 1
    result |= run.machine()
    print(json.dumps(result) if as_json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
