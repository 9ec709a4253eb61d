"""Leases (GpuArbiter) under an inference mix: ASR/NMT waits with and without a repair flood, against flock.

What is measured, against real daemons (a fresh ``gpud --simulate 1x16GiB
--mode M`` per phase, default log level) and real OS processes:
- An ASR and an NMT service, each one process issuing leases on a seeded
  Poisson schedule (the same schedule in every phase), one request at a time
  (one model instance); a request due while the previous one runs starts late
  and its lateness is reported, not counted as lease wait. ASR 25/s holding
  8-15 ms, NMT 25/s holding 5-10 ms: the GPU is held about 48 % of the time
  without the flood (offered load, printed; measured busy ratio beside it).
- The flood: SEMANTIC_REPAIR processes (default 1) issuing requests back to
  back with the default policy (priority 20, SKIP, max_wait 400 ms), holding
  20-40 ms when acquired. Repair SKIP rate = SKIPPED / all repair acquires.
- Declared memory: ASR 3 GiB, NMT 2 GiB, repair 6 GiB on a 16 GiB GPU (14.4
  GiB admissible with the default 10 % reserve). In ``auto`` mode (gpud's
  default, the headline) leases that fit are admitted side by side; in
  ``serial`` mode (the seed's MVP) one at a time. Both are run and reported;
  ``auto_repair_x2`` runs the flood with twice the repair processes, whose
  memory then no longer fits beside ASR (a stress variant, also reported,
  against the same ``auto`` phase without repair).
- "Lease wait" is the ``queue_wait_ms`` the daemon answered: the time the
  request spent queued, from the daemon reading it to the scheduler granting
  or refusing it (0 for a lease granted at once). When no ASR request waits
  at the 95th percentile with or without the flood, the p95 ratio is 1.0 (the
  flood changed nothing) and ``p95_ratio_with_repair_zero_over_zero`` says
  so; if only the phase without the flood has a zero p95, the ratio is null
  in the JSON ("inf" in the table) and fails. The time the client saw
  ``acquire`` take (round trip included, so the daemon's load shows) is
  reported beside it, with its own with/without-flood p95 ratio.
- Baseline: the same processes with the GPU section under
  ``fcntl.flock(LOCK_EX)`` on a temp file (repair: ``LOCK_EX|LOCK_NB`` polled
  every 5 ms up to 400 ms, then skipped). Its wait is the time to get the lock.
  "Well below flock" is read as: gpud's ASR acquire p95 as the client saw it
  (the conservative figure) at most half of flock's ASR p95.
- Lease cycles per second (acquire + release, hold zero, task type OTHER,
  queue_limit max(8, clients) on a daemon whose lease_queue_limit is the
  largest client count, so none is refused) with 1, 8
  and 64 client processes for a fixed time: through ``with client.lease()``
  (the headline ``cycles_per_s``: one round trip, the release sent without
  waiting for its OK) and the bare ``Connection`` (ACQUIRE and RELEASE both
  waited for); at the daemon's default log level (one info line per
  acquire) and again at ``--log-level warning``; with the CPU time the daemon
  and the clients spent per cycle, to show where the time goes.

The GPU is simulated: a GPU section is a sleep while holding the lease, so
concurrent holders do not slow each other as on a real GPU; only waits are
measured. Samples in the first ``--warmup`` seconds are dropped; percentiles
are nearest-rank; the p95 ratios carry a seeded bootstrap 95 % interval, so a
verdict on a ratio of sub-millisecond figures can be told from chance. Client
stamps are ``time.monotonic_ns()``, one clock for all processes; they bound the
daemon's holds, so the run aborts if holds overlap in serial mode or under
flock, or exceed the admissible memory in auto mode. The code the daemons run
(commit, path, digest) is recorded and checked again at the end.

It must never bend a figure to meet a target: no sample is dropped but the
warm-up, late starts are reported, the targets are only printed beside the
figures, and both modes are reported whichever is worse. It never touches a
real GPU or a system daemon: it starts its own on temporary sockets.

    .venv/bin/python bench/arbiter_mix.py [--json] [--seconds S] [--seed N]
        [--repair-procs N] [--quick] [--cycle-seconds S]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import gpud
import gpud_client
from gpud.tools.spawn import DaemonProcess

from arbiter_stats import MeasurementError, mode_figures, phase_figures
from arbiter_workers import Gate, Stream, cycle_worker, flood_worker, schedule, service_worker
from harness import Run, machine_line, progress

ASR = Stream(task_type="ASR", rate_per_s=25.0, hold_ms=(8.0, 15.0), mem_gib=3.0, max_wait_ms=3000)
NMT = Stream(task_type="NMT", rate_per_s=25.0, hold_ms=(5.0, 10.0), mem_gib=2.0, max_wait_ms=3000)
REPAIR = Stream(task_type="SEMANTIC_REPAIR", rate_per_s=None, hold_ms=(20.0, 40.0), mem_gib=6.0, max_wait_ms=400)
GPU = "1x16GiB"
ADMISSIBLE_BYTES = 16 * 2**30 * (100 - 10) // 100  # gpud's default memory reserve: 10 %
CLIENT_COUNTS = (1, 8, 64)
TARGETS = {"p95_ratio_with_repair": 1.10, "asr_acquire_p95_over_flock": 0.5, "cycles_per_s_8": 5000.0}
START_DELAY_S = 0.3
HANDSHAKE_S = 120.0


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    seconds: float = 25.0
    warmup: float = 1.0
    seed: int = 1
    repair_procs: int = 1
    flock_poll_ms: float = 5.0
    cycle_seconds: float = 5.0


# --- running processes ----------------------------------------------------------


def _run_workers(ctx: Any, jobs: list[tuple[Any, tuple[Any, ...]]], seconds: float) -> list[Any]:
    """Start every job, wait for all to be ready, give them one start and end time, collect."""
    procs, pipes = [], []
    try:
        for target, args in jobs:
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=target, args=(*args, theirs), daemon=True)
            proc.start()
            theirs.close()  # a dead worker shows up as EOF on ours
            procs.append(proc)
            pipes.append(ours)
        for pipe in pipes:
            if not pipe.poll(HANDSHAKE_S) or pipe.recv() != "ready":
                raise RuntimeError("a worker did not get ready (its traceback is above)")
        start = time.monotonic_ns() + round(START_DELAY_S * 1e9)
        for pipe in pipes:
            pipe.send((start, start + round(seconds * 1e9)))
        results = []
        for pipe in pipes:
            if not pipe.poll(seconds + HANDSHAKE_S):
                raise RuntimeError("a worker did not report (its traceback is above)")
            results.append(pipe.recv())
        return [start, *results]
    except EOFError:
        raise RuntimeError("a worker died (its traceback is above)") from None
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def run_mix(ctx: Any, gate: Gate, cfg: BenchConfig, *, repair_procs: int) -> dict[str, Any]:
    """One phase: ASR and NMT on their schedules, plus ``repair_procs`` flooders."""
    jobs: list[tuple[Any, tuple[Any, ...]]] = [
        (service_worker, (gate, s, schedule(s, cfg.seed, cfg.seconds))) for s in (ASR, NMT)
    ]
    jobs += [(flood_worker, (gate, REPAIR, cfg.seed, i)) for i in range(repair_procs)]
    start, asr, nmt, *floods = _run_workers(ctx, jobs, cfg.seconds)
    return {
        "start_ns": start,
        "records": {"ASR": asr, "NMT": nmt, "SEMANTIC_REPAIR": [r for f in floods for r in f]},
    }


def _daemon_warnings(daemon: DaemonProcess) -> list[str]:
    """The daemon's warnings and errors (JSON lines), shown on stderr and counted in the figures."""
    complaints = []
    for line in daemon.log().splitlines():
        try:
            level = json.loads(line).get("level")
        except (ValueError, AttributeError):
            level = "unparsed"  # a traceback or a stray print: worth seeing
        if level not in ("debug", "info"):
            complaints.append(line)
    for line in complaints[:20]:
        progress(f"gpud said: {line}")
    return complaints


def gpud_phase(ctx: Any, cfg: BenchConfig, mode: str, repair_procs: int) -> dict[str, Any]:
    progress(f"gpud --mode {mode}: ASR + NMT + {repair_procs} repair process(es), {cfg.seconds:g} s")
    daemon = DaemonProcess("--simulate", GPU, "--mode", mode).start()
    try:
        phase = run_mix(ctx, Gate(kind="gpud", socket=daemon.socket), cfg, repair_procs=repair_procs)
        phase["daemon_warnings"] = _daemon_warnings(daemon)
        phase["loadavg_1m"] = os.getloadavg()[0]
    finally:
        daemon.cleanup()
    return phase


def flock_phase(ctx: Any, cfg: BenchConfig, repair_procs: int) -> dict[str, Any]:
    progress(f"flock baseline: ASR + NMT + {repair_procs} repair process(es), {cfg.seconds:g} s")
    with tempfile.TemporaryDirectory(prefix="arbiter-flock-") as tmp:
        gate = Gate(kind="flock", lock_path=os.path.join(tmp, "gpu0.lock"), poll_ms=cfg.flock_poll_ms)
        phase = run_mix(ctx, gate, cfg, repair_procs=repair_procs)
    phase["daemon_warnings"] = []
    phase["loadavg_1m"] = os.getloadavg()[0]
    return phase


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cycles(ctx: Any, cfg: BenchConfig, *, log_flags: tuple[str, ...]) -> dict[str, Any]:
    """cycles/s per client count, client library and bare protocol, on one daemon."""
    out: dict[str, Any] = {"client": {}, "bare": {}}
    daemon = DaemonProcess("--simulate", GPU, *log_flags)
    config = os.path.join(daemon.workdir, "gpud.toml")
    with open(config, "w") as f:  # a client's queue_limit can only lower the node's: raise the node's
        f.write(f"lease_queue_limit = {max(8, *CLIENT_COUNTS)}\n")
    daemon.args += ["--config", config]
    daemon.start()
    try:
        assert daemon.proc is not None
        for n in CLIENT_COUNTS:
            for path in ("client", "bare"):
                level = " ".join(log_flags) or "default log level (info)"
                progress(f"cycles: {n} {path} client(s), {cfg.cycle_seconds:g} s, {level}")
                cpu0 = _cpu_seconds(daemon.proc.pid)
                jobs = [(cycle_worker, (daemon.socket, path == "bare", max(8, n)))] * n
                _, *counts = _run_workers(ctx, jobs, cfg.cycle_seconds)
                cpu = _cpu_seconds(daemon.proc.pid) - cpu0  # includes the workers' connect and close
                done = sum(c for c, _, _ in counts)
                out[path][str(n)] = {
                    "cycles_per_s": round(done / cfg.cycle_seconds),
                    "skipped": sum(s for _, s, _ in counts),
                    "daemon_cpu_us_per_cycle": round(cpu / max(done, 1) * 1e6),
                    "client_cpu_us_per_cycle": round(sum(c for _, _, c in counts) / max(done, 1) * 1e6),
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                }
        out["daemon_warnings"] = len(_daemon_warnings(daemon))
    finally:
        daemon.cleanup()
    return out


# --- the report -------------------------------------------------------------------


def measure(cfg: BenchConfig) -> dict[str, Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gpud_client", "arbiter_workers"])
    mem = {s.task_type: s.mem_gib for s in (ASR, NMT, REPAIR)}

    def figures(phase: dict[str, Any], mode: str) -> dict[str, Any]:
        return phase_figures(phase, cfg.warmup, cfg.seconds, mode=mode, mem_gib=mem, capacity=ADMISSIBLE_BYTES)

    runs: dict[str, Any] = {}
    for mode in ("auto", "serial"):
        runs[mode] = tuple(figures(gpud_phase(ctx, cfg, mode, n), mode) for n in (0, cfg.repair_procs))
    runs["flock"] = tuple(figures(flock_phase(ctx, cfg, n), "flock") for n in (0, cfg.repair_procs))
    runs["auto_repair_x2"] = (runs["auto"][0], figures(gpud_phase(ctx, cfg, "auto", 2 * cfg.repair_procs), "auto"))
    runs["cycles"] = cycles(ctx, cfg, log_flags=())
    runs["cycles_log_warning"] = cycles(ctx, cfg, log_flags=("--log-level", "warning"))
    return runs


def code_version() -> dict[str, str]:
    """What the daemons run: where gpud is imported from, its commit if that is a git tree, and a digest
    of every .py file of gpud and gpud_client (compared after the run: another hand may edit the tree)."""
    digest = hashlib.sha256()
    for pkg in (gpud, gpud_client):
        root = Path(pkg.__file__ or "").parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    where = str(Path(gpud.__file__ or "").parent.parent)
    try:
        git = ["git", "-C", where]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "gpud", "client"], capture_output=True, text=True, check=True
        ).stdout.strip()
        label = commit.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        label = "not a git tree"
    return {"commit": label, "path": where, "sha256": digest.hexdigest()[:16]}


def _offered_load() -> float:
    return sum(s.rate_per_s * sum(s.hold_ms) / 2 / 1000 for s in (ASR, NMT) if s.rate_per_s)


def _flock_keys(flock: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "asr_p50_ms",
        "asr_p95_ms",
        "nmt_p50_ms",
        "nmt_p95_ms",
        "asr_p95_ms_without_repair",
        "nmt_p95_ms_without_repair",
        "p95_ratio_with_repair",
        "repair_skip_rate",
        "gpu_busy_ratio_with_repair",
    )
    return {f"flock_{k}": flock[k] for k in keys}


def _versus_flock(mode: dict[str, Any], flock: dict[str, Any]) -> dict[str, Any]:
    """gpud's ASR acquire as the client saw it (round trip included) against the time to get the flock."""
    over = round(mode["asr_acquire_p95_ms"] / flock["asr_p95_ms"], 3)
    return mode | _flock_keys(flock) | {"asr_acquire_p95_over_flock": over}


def _at_most(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound  # None: no finite ratio (nothing waited without the flood)


def _met(r: dict[str, Any]) -> dict[str, bool]:
    ratio, flock, cps = (TARGETS[k] for k in ("p95_ratio_with_repair", "asr_acquire_p95_over_flock", "cycles_per_s_8"))
    return {
        "p95_ratio_with_repair": _at_most(r["p95_ratio_with_repair"], ratio),
        "p95_ratio_with_repair_serial": _at_most(r["serial"]["p95_ratio_with_repair"], ratio),
        "asr_acquire_p95_over_flock": r["asr_acquire_p95_over_flock"] <= flock,
        "asr_acquire_p95_over_flock_serial": r["serial"]["asr_acquire_p95_over_flock"] <= flock,
        "cycles_per_s_8": r["cycles_per_s"]["8"] >= cps,
    }


def report(runs: dict[str, Any], cfg: BenchConfig, machine: dict[str, Any], *, code: tuple[dict[str, str], ...]) -> Any:
    flock = mode_figures(*runs["flock"])
    result: dict[str, Any] = {"mode": "auto", **_versus_flock(mode_figures(*runs["auto"]), flock)}
    result["serial"] = _versus_flock(mode_figures(*runs["serial"]), flock)
    result["flock"] = flock
    result["auto_repair_x2"] = mode_figures(*runs["auto_repair_x2"]) | {"repair_procs": 2 * cfg.repair_procs}
    for key, run, path in (
        ("cycles_per_s", "cycles", "client"),
        ("cycles_per_s_bare", "cycles", "bare"),
        ("cycles_per_s_log_warning", "cycles_log_warning", "client"),
        ("cycles_per_s_bare_log_warning", "cycles_log_warning", "bare"),
    ):
        result[key] = {n: v["cycles_per_s"] for n, v in runs[run][path].items()}
    result["cycles_detail"] = {k: runs[k] for k in ("cycles", "cycles_log_warning")}
    result["targets"] = TARGETS
    result["met"] = _met(result)
    result["workload"] = {
        "gpu": GPU,
        "streams": [asdict(s) for s in (ASR, NMT, REPAIR)],
        "offered_load_asr_nmt": round(_offered_load(), 3),
        "repair_procs": cfg.repair_procs,
        "flock_poll_ms": cfg.flock_poll_ms,
        "seconds_per_phase": cfg.seconds,
        "warmup_s": cfg.warmup,
        "seed": cfg.seed,
        "cycle_seconds": cfg.cycle_seconds,
        "daemon_log_level": "info",
    }
    result["machine"] = machine
    result["code"] = code[0] | {"changed_during_run": code[0]["sha256"] != code[1]["sha256"]}
    return result


_WAIT_ROWS = [
    ("ASR wait p50 / p95, no repair", "asr_p50_ms_without_repair", "asr_p95_ms_without_repair"),
    ("ASR wait p50 / p95, repair flood", "asr_p50_ms", "asr_p95_ms"),
    ("NMT wait p50 / p95, no repair", "nmt_p50_ms_without_repair", "nmt_p95_ms_without_repair"),
    ("NMT wait p50 / p95, repair flood", "nmt_p50_ms", "nmt_p95_ms"),
    (
        "ASR acquire (client) p50/p95, no repair",
        "asr_acquire_p50_ms_without_repair",
        "asr_acquire_p95_ms_without_repair",
    ),
    ("ASR acquire (client) p50/p95, flood", "asr_acquire_p50_ms", "asr_acquire_p95_ms"),
]
_RATIO_ROWS = [
    ("ASR p95 ratio with/without repair", "p95_ratio_with_repair"),
    ("NMT p95 ratio with/without repair", "nmt_p95_ratio_with_repair"),
    ("ASR acquire (client) p95 ratio", "asr_acquire_p95_ratio_with_repair"),
    ("repair SKIP rate", "repair_skip_rate"),
    ("GPU busy ratio, no repair", "gpu_busy_ratio_without_repair"),
    ("GPU busy ratio, repair flood", "gpu_busy_ratio_with_repair"),
]
_CYCLE_ROWS = [
    ("Client library, default log (headline)", "cycles_per_s"),
    ("bare Connection, default log", "cycles_per_s_bare"),
    ("Client library, --log-level warning", "cycles_per_s_log_warning"),
    ("bare Connection, --log-level warning", "cycles_per_s_bare_log_warning"),
]


def _target_rows(r: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    t, met, s = r["targets"], r["met"], r["serial"]
    ratio, flock = t["p95_ratio_with_repair"], t["asr_acquire_p95_over_flock"]
    return [
        (f"ASR p95 ratio <= {ratio} (auto)", r["p95_ratio_with_repair"], met["p95_ratio_with_repair"]),
        (f"ASR p95 ratio <= {ratio} (serial)", s["p95_ratio_with_repair"], met["p95_ratio_with_repair_serial"]),
        (
            f"ASR acquire p95 / flock p95 <= {flock} (auto)",
            r["asr_acquire_p95_over_flock"],
            met["asr_acquire_p95_over_flock"],
        ),
        (
            f"ASR acquire p95 / flock p95 <= {flock} (serial)",
            s["asr_acquire_p95_over_flock"],
            met["asr_acquire_p95_over_flock_serial"],
        ),
        (f"cycles/s with 8 clients >= {t['cycles_per_s_8']:g}", r["cycles_per_s"]["8"], met["cycles_per_s_8"]),
    ]


def _num(x: float | None, digits: int) -> str:
    return "inf" if x is None else f"{x:.{digits}f}"  # None: no finite ratio (null in the JSON)


def table(r: dict[str, Any]) -> str:
    columns = (r, r["serial"], r["auto_repair_x2"], r["flock"])
    lines = [f"{'(ms)':<42}" + "".join(f"{h:>17}" for h in ("gpud auto", "gpud serial", "auto, 2x repair", "flock"))]
    for label, k50, k95 in _WAIT_ROWS:
        lines.append(f"{label:<42}" + "".join(f"{f'{d[k50]:.2f} / {d[k95]:.2f}':>17}" for d in columns))
    for task in ("asr", "nmt"):  # the service was still busy with the previous request: not a lease wait
        cells = [
            f"{d[f'{task}_late_start_p95_ms']['without_repair']:.1f} / "
            f"{d[f'{task}_late_start_p95_ms']['with_repair']:.1f}"
            for d in columns
        ]
        lines.append(f"{task.upper() + ' start late p95, no repair / flood':<42}" + "".join(f"{c:>17}" for c in cells))
    for label, key in _RATIO_ROWS:
        lines.append(f"{label:<42}" + "".join(f"{_num(d[key], 3):>17}" for d in columns))
        if r.get(f"{key}_zero_over_zero"):
            lines.append(f"{'  (no wait at p95 in either phase: 0/0)':<42}")
        if f"{key}_ci95" in r:
            cells = [f"{_num(d[key + '_ci95'][0], 2)}-{_num(d[key + '_ci95'][1], 2)}" for d in columns]
            lines.append(f"{'  bootstrap 95 % interval':<42}" + "".join(f"{c:>17}" for c in cells))
    lines += ["", f"{'lease cycles/s':<42}" + "".join(f"{n + ' clients':>14}" for n in r["cycles_per_s"])]
    for label, key in _CYCLE_ROWS:
        lines.append(f"{label:<42}" + "".join(f"{v:>14}" for v in r[key].values()))
    lines.append("")
    for label, value, ok in _target_rows(r):
        lines.append(
            f"{label:<48}{_num(value, 3) if isinstance(value, float | None) else value:>12}  "
            f"{'met' if ok else 'NOT MET'}"
        )
    w, m = r["workload"], r["machine"]
    lines.append(
        f"offered ASR+NMT load {w['offered_load_asr_nmt']}, {w['repair_procs']} repair process(es), "
        f"{w['seconds_per_phase']:g} s per phase after {w['warmup_s']:g} s warm-up, seed {w['seed']}"
    )
    lines.append(
        f"{machine_line(m)}; gpud {r['code']['commit']} ({r['code']['path']}, {r['code']['sha256']})"
        + (" (gpud's code CHANGED during the run)" if r["code"]["changed_during_run"] else "")
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, bool]:
    ap = argparse.ArgumentParser(description="gpud leases under an ASR/NMT/repair mix, against flock; lease cycles/s.")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--seconds", type=float, default=BenchConfig.seconds, help="length of each mix phase")
    ap.add_argument("--seed", type=int, default=BenchConfig.seed, help="seeds arrivals and hold times")
    ap.add_argument("--repair-procs", type=int, default=BenchConfig.repair_procs, help="repair flood processes")
    ap.add_argument("--quick", action="store_true", help="short phases: a smoke run, not figures")
    ap.add_argument(
        "--cycle-seconds",
        type=float,
        help=f"length of each lease-cycles run ({BenchConfig.cycle_seconds:g}; 1.5 quick)",
    )
    args = ap.parse_args(argv)
    cfg = BenchConfig(seconds=args.seconds, seed=args.seed, repair_procs=args.repair_procs)
    if args.quick:
        cfg = replace(cfg, seconds=min(cfg.seconds, 4.0), warmup=0.5, cycle_seconds=1.5)
    if args.cycle_seconds is not None:
        cfg = replace(cfg, cycle_seconds=args.cycle_seconds)
    if cfg.seconds <= cfg.warmup or cfg.repair_procs < 1 or cfg.cycle_seconds <= 0:
        ap.error(f"--seconds must exceed the {cfg.warmup:g} s warm-up, --repair-procs be >= 1 and --cycle-seconds > 0")
    return cfg, args.json


def main(argv: list[str] | None = None) -> int:
    cfg, as_json = parse_args(argv)
    run, before = Run(), code_version()
    try:
        runs = measure(cfg)
    except MeasurementError as exc:
        progress(f"measurement invalid: {exc}")
        return 1
    after = code_version()
    if after["sha256"] != before["sha256"]:
        progress(f"gpud's code changed during the run ({before} -> {after}): the phases ran different code")
    result = report(runs, cfg, run.machine(), code=(before, after))
    print(json.dumps(result) if as_json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
