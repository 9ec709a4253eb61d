"""Compute limits on a real NVIDIA GPU, with real CUDA kernels: the share a limited session gets, its
throughput against the same process alone, and how fast a lowered limit governs the GPU.

What is measured, against a real daemon started without ``--simulate`` (it discovers the GPU through
nvidia-ml-py and the driver; a fresh daemon per scenario, default 2 s window unless --window):
- first, that ``gpuctl status --json`` reports the GPU's real name, UUID and memory: the same as NVML
  read directly in this process; a simulated GPU or any difference stops the run;
- the kernel: one half-precision matrix product, its side chosen so that it takes 2-5 ms alone on
  this GPU (sides timed with CUDA events in a process of its own, the choice a pure function of the
  timings: ``gpu_workers.calibration_step``);
- single-25, single-50, single-75: one session limited to L %, serial mode;
- mix-25+75, mix-30+60: two limited sessions, serial mode;
- concurrent-50: a 50 % session beside an unlimited one, concurrent mode: both have kernels on the
  GPU at once (time-sliced between their contexts by the driver). Billed wall / 2, the 50 % session
  is never throttled (see quota_accuracy's concurrent-25), so this shows the driver's sharing as
  much as gpud; "vs alone" (throughput) is the figure that does not rest on the 1/k split;
- unlimited-alone: the same process alone and unlimited: the throughput the others are compared with;
- limit-update: a busy unlimited session is lowered to 20 % with ``gpuctl limit`` a quarter into a
  window (it has used 25 % > 20 %, so it is due to stop at once) and raised back, 3 times, then lowered
  for good. limit_update_ms (the headline) is the largest time from gpuctl returning to the end of
  the session's last kernel on the GPU before its next grant: from then on the GPU runs none of its
  work, so the new share holds (negative: before gpuctl had even exited). Also reported: the
  DROP_LOCK's arrival, and the share over the 5 windows after the last change.

How: every session is its own OS process (``bench/gpu_workers.py``): ``client.session(gpu,
core_limit=L, synchronize=torch.cuda.synchronize, mem_estimate=...)`` with the PyTorch memory hook,
and ``with session.slice():`` around one kernel launch plus a wait for the kernel two launches back,
so the GPU always has work queued. A kernel's GPU time is its pair of CUDA events, put on the shared
``time.monotonic_ns()`` clock by two anchors (a reference event synchronized between two clock reads,
before and after the work; drift corrected and reported), so the measured interval is aligned to the
daemon's compute windows as in ``bench/quota_accuracy.py`` (their origin from STATUS's uptime),
starts after a 2-3 window warm-up and covers exactly N windows (default 30).
- achieved = the session's kernel time in the interval / its length, a kernel straddling an edge
  clipped; where kernels of k sessions are in flight at once each gets 1/k of that time (the daemon
  bills so; in serial mode kernels of two sessions must never overlap, beyond the anchors'
  uncertainty, or the run aborts). error = achieved - target (pp).
- throughput = kernels completed per second (a straddling kernel by its fraction inside);
  slowdown = the unlimited-alone run's throughput / this one's, and "vs alone" its inverse: the
  share of a lone process's throughput, the way the nvshare-derived figures are measured (their
  "achieved" is 1 / slowdown: 27.0 / 56.0 / 77.3 % at 3.70 / 1.79 / 1.29x on a T4).
- idle = time the GPU sat idle between two kernels of one hold: host time the queue did not hide.

It never bends a figure: no kernel is dropped besides the declared warm-up, targets and reference
figures are only printed beside the measured ones, and nothing is simulated. On a machine with no
GPU (no NVML driver or device, no PyTorch, or PyTorch without CUDA) it says so in one line and exits
0 with ``{"gpu": null, "scenarios": [], "limit_update_ms": null, "nvml": null}`` (the last line with
--json). It starts its own daemons on temporary sockets; the GPU should have no other work meanwhile.

    .venv/bin/python bench/gpu_quota.py [--json] [--windows N] [--window S] [--only NAME[,NAME]] [--gpu INDEX]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import multiprocessing as mp
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client

from gpu_timeline import (
    NO_GPU,
    ROUNDING_NS,
    limit_change_figures,
    nvml_mismatches,
    on_one_clock,
    report,
    serial_overlap_ns,
    session_figures,
    table,
)
from gpu_workers import GpuWorkerSpec, calibrate, run_workers
from harness import progress
from quota_accuracy import BASELINE, LIMIT_NAME, LIMIT_UPDATE, NEVER, SCENARIOS, STOP_MARGIN_NS, UNLIMITED, Scenario
from quota_workers import MeasurementError, next_boundary, sleep_until, window_origin_ns

SHARE_SCENARIOS = ("single-25", "single-50", "single-75", "mix-25+75", "mix-30+60", "concurrent-50", BASELINE)
SERIAL_SLACK_NS = ROUNDING_NS  # elapsed_time's float32 rounding, beyond the anchors' own uncertainty


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    windows: int = 30
    window_s: float = 2.0
    window_given: bool = False
    warmup_windows: int = 2
    gpu: int = 0
    depth: int = 2
    limit_reps: int = 3
    after_windows: int = 5

    @property
    def window_ns(self) -> int:
        return round(self.window_s * 1e9)


# --- is there a GPU? ---------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def read_nvml(index: int) -> dict[str, Any] | str:
    """The GPU as NVML reports it, or why there is none."""
    try:
        nvml: Any = importlib.import_module("pynvml")
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded and friends
        return f"NVML: {exc}"
    try:
        count = nvml.nvmlDeviceGetCount()
        if count <= index:
            return "NVML sees no GPU" if count == 0 else f"NVML sees {count} GPU(s), none with index {index}"
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        return {
            "index": index,
            "name": _text(nvml.nvmlDeviceGetName(h)),
            "uuid": _text(nvml.nvmlDeviceGetUUID(h)),
            "memory_total_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).total),
            "driver": _text(nvml.nvmlSystemGetDriverVersion()),
            "other_processes": len(nvml.nvmlDeviceGetComputeRunningProcesses(h)),
        }
    finally:
        nvml.nvmlShutdown()


def torch_missing() -> str | None:
    """Why PyTorch cannot run kernels here, or None."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed"
    torch: Any = importlib.import_module("torch")
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA device"
    return None


# --- the daemon ----------------------------------------------------------------------------


def gpuctl(path: str, *args: str) -> tuple[int, int, str]:
    """Run gpuctl: (launch, return) monotonic ns and its output."""
    t0 = time.monotonic_ns()
    out = subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", path, *args], capture_output=True, text=True, timeout=30
    )
    t1 = time.monotonic_ns()
    if out.returncode != 0:
        raise RuntimeError(f"gpuctl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return t0, t1, out.stdout


def daemon_flags(cfg: BenchConfig, mode: str) -> list[str]:
    return ["--mode", mode, "--log-level", "warning"] + (["--window", f"{cfg.window_s:g}"] if cfg.window_given else [])


def start_daemon(cfg: BenchConfig, mode: str) -> DaemonProcess:
    daemon = DaemonProcess(*daemon_flags(cfg, mode))  # no --simulate: NVML discovery
    daemon.start(timeout=60)
    return daemon


def the_daemons_gpu(gpus: list[dict[str, Any]], nvml: dict[str, Any]) -> dict[str, Any]:
    gpu = next((g for g in gpus if g.get("index") == nvml["index"]), {})
    wrong = nvml_mismatches(gpu, nvml)
    if wrong:
        raise MeasurementError(f"the daemon's GPU {nvml['index']} is not NVML's: {'; '.join(wrong)}")
    return gpu


def check_gpuctl_status(cfg: BenchConfig, nvml: dict[str, Any]) -> dict[str, Any]:
    daemon = start_daemon(cfg, "serial")
    try:
        _, _, text = gpuctl(daemon.socket, "status", "--json")
    finally:
        daemon.cleanup()
    gpu = the_daemons_gpu(json.loads(text)["gpus"], nvml)
    return {k: gpu[k] for k in ("name", "uuid", "memory_total_bytes", "simulated")}


# --- share scenarios -----------------------------------------------------------------------------


def run_scenario(ctx: Any, sc: Scenario, cfg: BenchConfig, nvml: dict[str, Any], size: int) -> dict[str, Any]:
    began, W = time.monotonic(), cfg.window_ns
    progress(
        f"{sc.name}: {sc.mode}, limits {'+'.join(map(str, sc.limits))}, {cfg.windows} windows of {cfg.window_s:g} s"
    )
    specs = [
        GpuWorkerSpec(
            name=f"{sc.name}-{'ab'[i]}", limit=limit, gpu=nvml["index"], uuid=nvml["uuid"], size=size, depth=cfg.depth
        )
        for i, limit in enumerate(sc.limits)
    ]
    stop = ctx.RawValue("q", NEVER)
    span: list[int] = []
    daemon = start_daemon(cfg, sc.mode)
    try:
        with Client(daemon.socket, name="bench-observer") as obs:
            the_daemons_gpu([msgspec.to_builtins(g) for g in obs.status().gpus], nvml)
            origin = window_origin_ns(obs)

        def go() -> None:
            span[:] = [next_boundary(origin, W, time.monotonic_ns() + cfg.warmup_windows * W)]
            span.append(span[0] + cfg.windows * W)
            stop.value = span[1] + STOP_MARGIN_NS

        reports, view = run_workers(ctx, daemon.socket, specs, stop, go, lambda: None)
        complaints = daemon.log().strip()
    finally:
        daemon.cleanup()
    if complaints:
        progress(f"  the daemon logged warnings:\n{complaints}")
    run = _figures(sc, specs, reports, view, span[0], span[1], W)
    return run | {
        "windows": cfg.windows,
        "window_s": cfg.window_s,
        "wall_s": round(time.monotonic() - began, 1),
        "daemon_warnings": len(complaints.splitlines()),
    }


def _figures(
    sc: Scenario,
    specs: list[GpuWorkerSpec],
    reports: list[dict[str, Any]],
    view: dict[str, Any],
    start: int,
    end: int,
    W: int,
) -> dict[str, Any]:
    timelines, clocks = zip(*(on_one_clock(r) for r in reports))
    worst = serial_overlap_ns(timelines)
    allowed = max(c.uncertainty_ns for c in clocks) * 2 + SERIAL_SLACK_NS
    if sc.mode == "serial" and worst > allowed:
        raise MeasurementError(
            f"{sc.name}: kernels of two sessions ran at once for {worst / 1e3:.1f} us on a "
            f"serial GPU (allowed {allowed / 1e3:.1f} us of clock uncertainty)"
        )
    sessions = session_figures(timelines, [r["grants"] for r in reports], sc.limits, start, end, W)
    for spec, s, r, clock in zip(specs, sessions, reports, clocks):
        v = view.get(spec.name)
        s |= {
            "quota_drops": sum(1 for t, why in r["drops"] if why == "quota" and start <= t < end),
            "drift_ppm": round(clock.drift_ppm, 3),
            "clock_uncertainty_us": clock.uncertainty_ns / 1e3,
            "memory_reserved_bytes": r["memory_reserved"],
            "daemon": None
            if v is None
            else {
                "grants": v.grants,
                "drops": dict(v.drops),
                "throttles": v.throttles,
                "budget_ms": v.budget_ms,
                "mem_used_bytes": v.mem_used_bytes,
                "recent_share_percent": v.recent_share_percent,
            },
        }
        progress(
            f"  session {s['session']} limit {s['limit']}: achieved {s['achieved']:.3f} %, "
            f"{s['kernels_per_s']:.1f} kernels/s"
        )
    return {"name": sc.name, "mode": sc.mode, "serial_overlap_us": worst / 1e3, "sessions": sessions}


# --- limit update ---------------------------------------------------------------------------------


def run_limit_update(ctx: Any, cfg: BenchConfig, nvml: dict[str, Any], size: int) -> dict[str, Any]:
    """Lower a busy unlimited session to 20 % a quarter into a window and raise it back, ``limit_reps`` times;
    lower it for good and measure the share over ``after_windows`` windows."""
    began, W = time.monotonic(), cfg.window_ns
    progress(
        f"{LIMIT_UPDATE}: serial, 100 -> 20 -> 100 % x {cfg.limit_reps}, then 20 % for {cfg.after_windows} windows"
    )
    spec = GpuWorkerSpec(
        name=LIMIT_NAME, limit=UNLIMITED, gpu=nvml["index"], uuid=nvml["uuid"], size=size, depth=cfg.depth
    )
    stop = ctx.RawValue("q", NEVER)
    changes: list[dict[str, int]] = []
    used_before: list[float] = []
    daemon = start_daemon(cfg, "serial")
    try:
        with Client(daemon.socket, name="bench-observer") as obs:
            origin = window_origin_ns(obs)

            def change_limits() -> None:
                changes[:], used_before[:] = _change_limits(daemon.socket, obs, origin, cfg, stop)

            reports, _ = run_workers(ctx, daemon.socket, [spec], stop, lambda: None, change_limits)
        complaints = daemon.log().strip()
    finally:
        daemon.cleanup()
    if complaints:
        progress(f"  the daemon logged warnings:\n{complaints}")
    tl, clock = on_one_clock(reports[0])
    after_start = changes[-1]["boundary"] + W
    result = limit_change_figures(
        changes, reports[0]["drops"], reports[0]["grants"], tl, (after_start, after_start + cfg.after_windows * W), W
    )
    result["flags"] = [
        f"change {i}: only {u} ms used before it (the drop was not due at once)"
        for i, u in enumerate(used_before)
        if u <= 0.2 * W / 1e6
    ]
    result |= {
        "used_before_ms": used_before,
        "drift_ppm": round(clock.drift_ppm, 3),
        "wall_s": round(time.monotonic() - began, 1),
    }
    progress(
        f"  gpuctl return -> last kernel ends: {result['samples_ms']} ms; "
        f"share after the change {result['after_change']['achieved']:.3f} %"
    )
    return result


def _change_limits(
    path: str,
    obs: Client,
    origin: int,
    cfg: BenchConfig,
    stop: Any,
) -> tuple[list[dict[str, int]], list[float]]:
    """While the session runs: the gpuctl calls, stamped, and what the session had used before each lowering.
    The first waits a full window, so that the session has been busy since the window began."""
    W = cfg.window_ns
    gpuctl(path, "status")  # warm the page cache for gpuctl's start-up
    changes, used_before = [], []
    for rep in range(cfg.limit_reps + 1):
        boundary = next_boundary(origin, W, time.monotonic_ns() + (W if rep == 0 else 10_000_000))
        sleep_until(boundary + W // 4)  # 25 % used > 20 %: the drop is due the moment the daemon reads it
        used_before.append(next(c.sessions[0].window_used_ms for c in obs.clients().clients if c.name == LIMIT_NAME))
        c = {"boundary": boundary}
        c["launch"], c["return"], _ = gpuctl(path, "limit", LIMIT_NAME, "--core", "20")
        changes.append(c)
        if rep == cfg.limit_reps:
            stop.value = boundary + (1 + cfg.after_windows) * W + STOP_MARGIN_NS
            break
        c["raise_launch"], c["raise_return"], _ = gpuctl(path, "limit", LIMIT_NAME, "--core", "100")
    return changes, used_before


# --- the run -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, list[str], bool]:
    ap = argparse.ArgumentParser(description="gpud's compute limits on a real NVIDIA GPU with real CUDA kernels.")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--windows", type=int, default=30, help="measured windows per scenario (default 30)")
    ap.add_argument("--window", type=float, help="the daemon's compute window in seconds (default: its own, 2)")
    names = [*SHARE_SCENARIOS, LIMIT_UPDATE]
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(names)}")
    ap.add_argument("--gpu", type=int, default=0, help="the GPU's index, as NVML and gpud number them (default 0)")
    args = ap.parse_args(argv)
    chosen = names if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(unknown)}; choose from {', '.join(names)}")
    if args.windows < 1:
        ap.error("--windows must be >= 1")
    cfg = BenchConfig(
        windows=args.windows,
        window_s=args.window if args.window is not None else 2.0,
        window_given=args.window is not None,
        gpu=args.gpu,
    )
    return cfg, chosen, args.json


def measure(cfg: BenchConfig, chosen: list[str], nvml: dict[str, Any]) -> dict[str, Any]:
    began = time.monotonic()
    if nvml["other_processes"]:
        progress(f"warning: {nvml['other_processes']} other process(es) use this GPU: they will bend the figures")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gpud_client", "gpu_workers"])
    daemon_says = check_gpuctl_status(cfg, nvml)
    progress(f"gpuctl status --json agrees with NVML: {daemon_says['name']} {daemon_says['uuid']}")
    kernel = calibrate(ctx, nvml)
    runs = [run_scenario(ctx, SCENARIOS[n], cfg, nvml, kernel["size"]) for n in SHARE_SCENARIOS if n in chosen]
    limit_update = run_limit_update(ctx, cfg, nvml, kernel["size"]) if LIMIT_UPDATE in chosen else None
    return report(nvml, kernel, runs, limit_update) | {
        "gpuctl_status": daemon_says,
        "nvml_driver": nvml["driver"],
        "config": asdict(cfg),
        "elapsed_s": round(time.monotonic() - began, 1),
    }


def no_gpu(reason: str, as_json: bool) -> int:
    """One line, and the empty report: a machine without a GPU is no failure (CI runs this)."""
    print(f"gpu_quota: no GPU to measure here ({reason}); nothing measured", flush=True)
    if as_json:
        print(json.dumps(NO_GPU))
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg, chosen, as_json = parse_args(argv)
    nvml = read_nvml(cfg.gpu)
    if isinstance(nvml, str):
        return no_gpu(nvml, as_json)
    reason = torch_missing()
    if reason is not None:
        return no_gpu(f"{reason}; NVML sees {nvml['name']}", as_json)
    try:
        result = measure(cfg, chosen, nvml)
    except (MeasurementError, RuntimeError) as exc:  # RuntimeError: a worker or daemon that died or went silent
        print(f"gpu_quota: nothing reported: {exc}", file=sys.stderr)
        return 1
    print(table(result))
    if as_json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
