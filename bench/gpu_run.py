"""``gpud-run --pause cuda`` on a real NVIDIA GPU: the share unmodified PyTorch programs get, how fast
the CUDA driver's checkpoint API pauses and resumes them, and how fast parking moves their memory.

What is measured, against a real daemon started without ``--simulate`` (it finds the GPU through
NVML), with programs that import nothing of gpud (``bench/run_programs.py matmul``: a loop of
half-precision matrix products, each timed by its own pair of CUDA events, its line written once
the host sees it done, on ``time.monotonic_ns()``, the clock of gpud-run's ``--trace`` too):
- the kernel: a product taking 2-5 ms alone on this GPU, its side chosen as bench/gpu_quota.py
  chooses it (``gpu_workers.calibrate``);
- mix-25+75, mix-30+60: two runs under ``gpud-run --pause cuda``, serial mode. Each starts unlimited
  (a program starts in its run's first turn, and loading PyTorch under a 25 % limit would take many
  windows), and once both programs are set up both limits are set (SET_LIMITS, as ``gpuctl limit``);
  after a warm-up the interval is aligned to the daemon's windows and covers exactly N of them.
  achieved = the program's own kernel time in the interval / its length (target |error| <= 1 pp);
  billed = the daemon's CLIENTS figure over the same windows (``--share-windows N``). A product
  whose launch took over 2 ms was launched across a pause (the lock blocks CUDA calls), so its events
  may enclose the pause: it counts at the median product time (``interrupted`` says how many);
- lock latency (every DROP_LOCK of the mixes): ``drop`` to the ``pause`` action (locked: the program's
  submitted kernels drained) and ``granted`` to the ``resume`` action (unlocked), p50 / p99 / max;
- park: two unlimited programs each holding ``--hold-fraction`` (0.6) of the GPU's memory, together
  more than the GPU, with ``--mem-estimate`` saying so and a time quantum of ``--park-tq`` s: each turn
  the one that waits is parked (checkpointed to host memory) so the other can be restored and run.
  Over ``--park-seconds`` after both started: turns per run, park time and GB/s (the ``park`` action
  of the trace carries the bytes moved, NVML's figure for the process), restore time and GB/s (the
  ``resume`` after a park: the restore and the unlock), and the switch (one run's DROP_LOCK to the
  other's resume: the GPU's time between the two programs). Both programs' images are in host memory
  for a moment (one is parked before the other is restored), so where host memory cannot hold two
  images each program holds less (``hold_limited_by_host_memory``);
- link: the host link's bandwidth measured with PyTorch pinned-memory copies (1 GiB, best of 5), in
  a process of its own, printed beside the park and restore figures.

On a machine without a GPU (no NVML driver or device, no PyTorch with CUDA, or no usable CUDA
checkpoint API: ``gpud_client.proctl.cuda.CudaDriver().probe()``) it says why in one line and exits 0;
with ``--json`` the last line is ``{"gpu": null, "why": ...}``. Otherwise the last line with ``--json``
is ``{"gpu": name, "why": null, "nvml", "kernel", "scenarios": [{"name", "limits", "windows",
"window_s", "wall_s", "runs": [{"run", "limit", "achieved_percent", "achieved_error_pp",
"billed_percent", "billed_error_pp", "tolerance_pp", "met", "kernels", "interrupted"}]}],
"lock_latency": {"drops", "drop_to_pause_ms", "grant_to_resume_ms"}, "park": {"seconds",
"hold_fraction", "hold_bytes", "hold_limited_by_host_memory", "turns", "parks", "park_bytes_p50",
"park_ms", "park_gbps", "restore_ms", "restore_gbps", "switch_ms", "wall_s"}, "link": {"bytes", "h2d_gbps", "d2h_gbps"}, "met_all", "targets", "config", "cpus",
"loadavg_1m_before", "loadavg_1m_after", "elapsed_s"}``; a part not run (``--only``) is null. Time
figures are ``{"p50", "p99", "max"}`` in ms, rates ``{"p50", "min", "max"}`` in GB/s (10^9 bytes/s).

It exits 1 only when the benchmark could not run. It starts its own daemons on temporary sockets;
the GPU should have no other work meanwhile. PyTorch is imported by the programs and by
``gpu_workers``' processes only, so this module imports anywhere.

    .venv/bin/python bench/gpu_run.py [--json] [--windows N] [--window S] [--only NAME[,NAME]] [--gpu INDEX]
        [--park-seconds S] [--park-tq S] [--hold-fraction F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from gpud_client import Client
from gpud_client import protocol as p

from gpu_quota import read_nvml, torch_missing
from gpu_workers import calibrate
from harness import Run, machine_line, progress
from percentiles import percentile
from quota_workers import MeasurementError, sleep_until, window_origin_ns
from run_share import PROGRAMS, Runs, interval, kind, pause_latencies, sessions_by_name, spread_ms, start_daemon

MIXES = {"mix-25+75": (25, 75), "mix-30+60": (30, 60)}
PARK, LINK = "park", "link"
TARGETS = {"abs_error_pp": 1.0}
SLOW_LAUNCH_US = 2000  # three CUDA calls take tens of us; one blocked by a lock takes the pause
START_S = 180.0  # loading PyTorch and making a CUDA context, in turns
MS, S = 1_000_000, 1_000_000_000


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    windows: int = 20
    window_s: float = 1.0
    warmup_windows: int = 2
    gpu: int = 0
    tq_s: float = 2.0  # while the mixes start unlimited: each gets a turn to load PyTorch
    park_seconds: float = 60.0
    park_tq_s: float = 2.0
    hold_fraction: float = 0.6

    @property
    def window_ns(self) -> int:
        return round(self.window_s * S)


# --- arithmetic on what the programs and traces recorded (pure) -----------------------------------


def read_kernels(text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A matmul program's file: its start line, and one line per product."""
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not lines or "start" not in lines[0]:
        raise MeasurementError("a matmul program wrote no start line: it never got set up")
    return lines[0], lines[1:]


def kernel_share(kernels: list[dict[str, Any]], a: int, b: int) -> tuple[float, int, int]:
    """(percent of [a, b) the program's products ran on the GPU, products seen done in it, how many of
    those were launched across a pause and so count at the median product time)."""
    clean = [k["ms"] for k in kernels if k["launch_us"] < SLOW_LAUNCH_US]
    if not clean:
        raise MeasurementError("no product was launched without a pause: no kernel time to go by")
    typical = statistics.median(clean)
    inside = [k for k in kernels if a <= k["t"] < b]
    interrupted = sum(1 for k in inside if k["launch_us"] >= SLOW_LAUNCH_US)
    ms = sum(k["ms"] if k["launch_us"] < SLOW_LAUNCH_US else typical for k in inside)
    return 100 * ms * MS / (b - a), len(inside), interrupted


def gbps(nbytes: int, ns: int) -> float:
    """Bytes over nanoseconds, in GB/s (10^9 bytes per second)."""
    return nbytes / ns  # bytes per ns is GB per s


def resume_latencies(trace: list[dict[str, Any]]) -> list[int]:
    """``granted`` to the ``resume`` that follows it (not a program's first start), in ns."""
    out = []
    for i, rec in enumerate(trace):
        if kind(rec) != "granted":
            continue
        for later in trace[i + 1 :]:
            if kind(later) in ("drop", "granted", "start"):
                break
            if kind(later) == "resume":
                out.append(later["t"] - rec["t"])
                break
    return out


def parks(trace: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Every park that worked: ``{"at", "bytes", "park_ns", "restore_ns"}`` (``at``: when it was done;
    no ``restore_ns`` if the run ended parked): from the ``park`` event (gpud's PARK) to the ``parked``
    action, which carries ``bytes``. A park worked when the ``answerpark`` after it says so; its restore
    is the run's next ``granted`` to ``resume`` (restore and unlock)."""
    out: list[dict[str, int]] = []
    asked: int | None = None
    done: dict[str, int] | None = None
    for rec in trace:
        event = kind(rec)
        if event == "park":
            asked = rec["t"]
        elif event == "parked" and asked is not None and rec.get("ok"):
            done = {"bytes": int(rec.get("bytes") or 0), "park_ns": rec["t"] - asked, "at": rec["t"]}
        elif event == "answerpark":
            if done is not None and rec.get("ok") is True:
                out.append(done)
            asked = done = None
        elif event == "granted" and out and "granted" not in out[-1]:
            out[-1]["granted"] = rec["t"]
        elif event == "resume" and out and "granted" in out[-1] and "restore_ns" not in out[-1]:
            out[-1]["restore_ns"] = rec["t"] - out[-1]["granted"]
    return [{k: v for k, v in x.items() if k != "granted"} for x in out]


def switches(trace: list[dict[str, Any]], other: list[dict[str, Any]], a: int, b: int) -> list[int]:
    """From each DROP_LOCK of one run in [a, b) to the other's next ``resume``: the GPU between them."""
    resumes = [r["t"] for r in other if kind(r) == "resume"]
    out = []
    for rec in trace:
        if kind(rec) == "drop" and a <= rec["t"] < b:
            nxt = next((t for t in resumes if t > rec["t"]), None)
            if nxt is not None:
                out.append(nxt - rec["t"])
    return out


def rates(values: list[float]) -> dict[str, float] | None:
    """p50 / min / max of GB/s figures; None without any."""
    if not values:
        return None
    return {"p50": round(percentile(values, 50), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def park_figures(traces: dict[str, list[dict[str, Any]]], a: int, b: int, cfg: BenchConfig) -> dict[str, Any]:
    """Turns and parks of the two runs in [a, b): a park by when it was done (with its restore, even
    if that came after b); one that moved 0 bytes (NVML could not say) has no rate."""
    ta, tb = traces.values()
    done = [x for t in (ta, tb) for x in parks(t) if a <= x["at"] < b]
    moved = [x for x in done if x["bytes"] > 0]
    restored = [x for x in moved if "restore_ns" in x]
    return {
        "seconds": cfg.park_seconds,
        "hold_fraction": cfg.hold_fraction,
        "turns": {n: sum(1 for r in t if kind(r) == "granted" and a <= r["t"] < b) for n, t in traces.items()},
        "parks": len(done),
        "park_bytes_p50": int(statistics.median(x["bytes"] for x in moved)) if moved else None,
        "park_ms": spread_ms([x["park_ns"] for x in done]),
        "park_gbps": rates([gbps(x["bytes"], x["park_ns"]) for x in moved]),
        "restore_ms": spread_ms([x["restore_ns"] for x in done if "restore_ns" in x]),
        "restore_gbps": rates([gbps(x["bytes"], x["restore_ns"]) for x in restored]),
        "switch_ms": spread_ms(switches(ta, tb, a, b) + switches(tb, ta, a, b)),
    }


# --- the GPU ---------------------------------------------------------------------------------------


def why_no_gpu(index: int) -> tuple[str | None, dict[str, Any]]:
    """(why nothing can be measured here, or None; the GPU as NVML sees it)."""
    nvml = read_nvml(index)
    if isinstance(nvml, str):
        return nvml, {}
    why = torch_missing()
    if why is not None:
        return f"{why}; NVML sees {nvml['name']}", nvml
    from gpud_client.proctl.cuda import CudaDriver

    driver = CudaDriver()
    try:
        why = driver.probe()
    finally:
        driver.close()
    if why is not None:
        return f"the CUDA checkpoint API cannot be used: {why}", nvml
    return None, nvml


def link_bandwidth(nvml: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=nvml["uuid"])
    out = subprocess.run(
        [sys.executable, PROGRAMS, "link"], capture_output=True, text=True, env=env, timeout=START_S, check=True
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def wait_set_up(runs: Runs, names: list[str], timeout_s: float) -> None:
    """Until every program has written its start line (PyTorch loaded, memory held, first product run)."""
    deadline = time.monotonic_ns() + round(timeout_s * S)
    for name in names:
        while not (runs.record(name).exists() and runs.record(name).read_text().strip()):
            runs.check_alive(name)
            if time.monotonic_ns() > deadline:
                raise MeasurementError(f"run {name}: its program was not set up within {timeout_s:g} s")
            time.sleep(0.1)


def run_mix(name: str, limits: tuple[int, ...], cfg: BenchConfig, size: int) -> dict[str, Any]:
    began, W = time.monotonic(), cfg.window_ns
    progress(f"{name}: limits {'+'.join(map(str, limits))}, {cfg.windows} windows of {cfg.window_s:g} s, cuda")
    flags = ["--window", f"{cfg.window_s:g}", "--share-windows", str(cfg.windows), "--tq", f"{cfg.tq_s:g}"]
    daemon = start_daemon(*flags, timeout=60)  # no --simulate: NVML discovery
    runs = Runs(daemon, pause="cuda")
    names = [f"{name}-{'ab'[i]}" for i in range(len(limits))]
    try:
        with Client(daemon.socket, name="bench-observer") as obs:
            for run in names:
                program = ["matmul", str(runs.record(run)), "--stop-file", str(runs.stop_file), "--size", str(size)]
                runs.launch(run, program, "--gpu", str(cfg.gpu))
            wait_set_up(runs, names, START_S)
            for run, limit in zip(names, limits):
                obs.call(p.SetLimits(id=0, client=run, core_limit=limit))
            origin = window_origin_ns(obs)
            start, end = interval(origin, W, time.monotonic_ns(), cfg.warmup_windows, cfg.windows)
            sleep_until(end + W // 4)
            view = sessions_by_name(obs)
            runs.finish(START_S)
        return {
            "name": name,
            "limits": limits,
            "start": start,
            "end": end,
            "sessions": [view[run] for run in names],
            "kernels": [read_kernels(runs.record(run).read_text())[1] for run in names],
            "traces": [runs.trace(run) for run in names],
            "wall_s": round(time.monotonic() - began, 1),
        }
    finally:
        runs.kill()
        daemon.cleanup()


def mix_figures(raw: dict[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    out = []
    for i, (limit, view, kernels) in enumerate(zip(raw["limits"], raw["sessions"], raw["kernels"])):
        achieved, n, interrupted = kernel_share(kernels, raw["start"], raw["end"])
        billed = float(view.recent_share_percent)
        out.append(
            {
                "run": "ab"[i],
                "limit": limit,
                "achieved_percent": round(achieved, 3),
                "achieved_error_pp": round(achieved - limit, 3),
                "billed_percent": round(billed, 3),
                "billed_error_pp": round(billed - limit, 3),
                "tolerance_pp": TARGETS["abs_error_pp"],
                "met": abs(achieved - limit) <= TARGETS["abs_error_pp"],
                "kernels": n,
                "interrupted": interrupted,
            }
        )
        progress(f"  run {'ab'[i]} limit {limit}: achieved {achieved:.2f} %, billed {billed:.2f} %")
    return {
        "name": raw["name"],
        "limits": list(raw["limits"]),
        "windows": cfg.windows,
        "window_s": cfg.window_s,
        "wall_s": raw["wall_s"],
        "runs": out,
    }


def park_hold(cfg: BenchConfig, gpu_bytes: int, host_available: int) -> tuple[int, bool]:
    """What each program holds on the GPU, and whether host memory made it less than asked. While one
    program is parked the other's park starts before that one is restored: both images are in host
    memory at once, and a park needs 10 % more than it moves (``CudaBackend.park``)."""
    hold = int(gpu_bytes * cfg.hold_fraction)
    fits = int(host_available / (2 * 1.1 + 0.1))  # and a little for everything else
    return (hold, False) if hold <= fits else (fits, True)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def run_park(cfg: BenchConfig, size: int, nvml: dict[str, Any]) -> dict[str, Any]:
    began = time.monotonic()
    hold, limited = park_hold(cfg, nvml["memory_total_bytes"], mem_available())
    progress(
        f"{PARK}: two programs holding {hold / 2**30:.1f} GiB each"
        + (" (less than asked: host memory must hold two parked images)" if limited else "")
        + f", TQ {cfg.park_tq_s:g} s, {cfg.park_seconds:g} s"
    )
    daemon = start_daemon("--tq", f"{cfg.park_tq_s:g}", timeout=60)
    runs = Runs(daemon, pause="cuda")
    names = ["park-a", "park-b"]
    try:
        for run in names:
            program = ["matmul", str(runs.record(run)), "--stop-file", str(runs.stop_file), "--size", str(size)]
            program += ["--hold-fraction", f"{hold / nvml['memory_total_bytes']:.4f}"]
            runs.launch(run, program, "--gpu", str(cfg.gpu), "--mem-estimate", str(hold))
        wait_set_up(runs, names, 2 * START_S)
        a = time.monotonic_ns()
        sleep_until(a + round(cfg.park_seconds * S))
        b = time.monotonic_ns()
        runs.finish(2 * START_S)
        figures = park_figures({run: runs.trace(run) for run in names}, a, b, cfg)
    finally:
        runs.kill()
        daemon.cleanup()
    figures |= {
        "hold_bytes": hold,
        "hold_limited_by_host_memory": limited,
        "wall_s": round(time.monotonic() - began, 1),
    }
    progress(f"  {figures['parks']} parks, turns {figures['turns']}, park {figures['park_gbps']} GB/s")
    return figures


def lock_figures(raws: list[dict[str, Any]]) -> dict[str, Any] | None:
    traces = [t for raw in raws for t in raw["traces"]]
    pauses = [d for t in traces for d, _ in pause_latencies(t)]
    if not pauses:
        return None
    return {
        "drops": len(pauses),
        "drop_to_pause_ms": spread_ms(pauses),
        "grant_to_resume_ms": spread_ms([x for t in traces for x in resume_latencies(t)]),
    }


# --- the run ---------------------------------------------------------------------------------------


def measure(cfg: BenchConfig, chosen: list[str], nvml: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gpud_client", "gpu_workers"])
    kernel = calibrate(ctx, nvml) if any(n in chosen for n in (*MIXES, PARK)) else None
    raws = [run_mix(n, limits, cfg, kernel["size"]) for n, limits in MIXES.items() if kernel and n in chosen]
    scenarios = [mix_figures(raw, cfg) for raw in raws]
    park = run_park(cfg, kernel["size"], nvml) if kernel and PARK in chosen else None
    return {
        "gpu": nvml["name"],
        "why": None,
        "nvml": nvml,
        "kernel": kernel,
        "scenarios": scenarios,
        "lock_latency": lock_figures(raws),
        "park": park,
        "link": link_bandwidth(nvml) if LINK in chosen else None,
        "met_all": all(r["met"] for sc in scenarios for r in sc["runs"]),
        "targets": TARGETS,
        "config": asdict(cfg),
    }


def _ms(x: dict[str, float] | None) -> str:
    return "-" if x is None else f"p50 {x['p50']:.1f} / p99 {x['p99']:.1f} / max {x['max']:.1f} ms"


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['gpu']}: gpud-run --pause cuda"]
    lines.append(f"{'scenario':<12}{'run':>4}{'limit':>7}{'achieved':>10}{'error':>10}{'billed':>9}{'error':>10}  met")
    for sc in result["scenarios"]:
        for r in sc["runs"]:
            lines.append(
                f"{sc['name']:<12}{r['run']:>4}{r['limit']:>6} %{r['achieved_percent']:>8.2f} %"
                f"{r['achieved_error_pp']:>+7.2f} pp{r['billed_percent']:>7.2f} %{r['billed_error_pp']:>+7.2f} pp  "
                f"{'yes' if r['met'] else 'NO'} ({r['interrupted']} of {r['kernels']} products launched across a pause)"
            )
    lock = result["lock_latency"]
    if lock:
        lines.append(f"lock (drop -> paused), {lock['drops']} drops: {_ms(lock['drop_to_pause_ms'])}")
        lines.append(f"unlock (grant -> resumed): {_ms(lock['grant_to_resume_ms'])}")
    park, link = result["park"], result["link"]
    if park:
        gb = park["park_bytes_p50"]
        lines.append(
            f"park: {park['parks']} parks of {'-' if gb is None else f'{gb / 1e9:.1f} GB'} in {park['seconds']:g} s, "
            f"turns {park['turns']}; park {_ms(park['park_ms'])}, {park['park_gbps']} GB/s; "
            f"restore {_ms(park['restore_ms'])}, {park['restore_gbps']} GB/s; switch {_ms(park['switch_ms'])}"
        )
    if link:
        lines.append(f"host link (pinned copies): {link['h2d_gbps']} GB/s to the GPU, {link['d2h_gbps']} GB/s back")
    lines.append(f"{machine_line(result)}; all met: {result['met_all']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, list[str], bool]:
    ap = argparse.ArgumentParser(description="gpud-run --pause cuda on a real NVIDIA GPU.")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--windows", type=int, default=20, help="measured windows per mix (default 20)")
    ap.add_argument("--window", type=float, default=1.0, help="the daemon's compute window in seconds (default 1)")
    names = [*MIXES, PARK, LINK]
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(names)}")
    ap.add_argument("--gpu", type=int, default=0, help="the GPU's index, as NVML and gpud number them (default 0)")
    ap.add_argument("--park-seconds", type=float, default=60.0, help="how long the two programs take turns (60)")
    ap.add_argument("--park-tq", type=float, default=2.0, help="the time quantum while they do (2)")
    ap.add_argument("--hold-fraction", type=float, default=0.6, help="of the GPU's memory, per program (0.6)")
    args = ap.parse_args(argv)
    chosen = names if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(unknown)}; choose from {', '.join(names)}")
    if not 1 <= args.windows <= 1000:
        ap.error("--windows must be 1 to 1000 (the daemon's --share-windows)")
    if not 0 <= args.hold_fraction < 1:
        ap.error("--hold-fraction must be at least 0 and below 1")
    cfg = BenchConfig(
        windows=args.windows,
        window_s=args.window,
        gpu=args.gpu,
        park_seconds=args.park_seconds,
        park_tq_s=args.park_tq,
        hold_fraction=args.hold_fraction,
    )
    return cfg, chosen, args.json


def main(argv: list[str] | None = None) -> int:
    cfg, chosen, as_json = parse_args(argv)
    why, nvml = why_no_gpu(cfg.gpu)
    if why is not None:
        print(f"gpu_run: no GPU to measure here ({why}); nothing measured", flush=True)
        if as_json:
            print(json.dumps({"gpu": None, "why": why}))
        return 0
    run = Run()
    try:
        result = measure(cfg, chosen, nvml) | run.machine()
    except (MeasurementError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"gpu_run: nothing reported: {exc}", file=sys.stderr)
        return 1
    print(table(result))
    if as_json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
