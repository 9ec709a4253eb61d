"""Preemption: how fast a production request gets its GPU from best-effort holders, against the grace;
how long the ledger takes to choose victims among 1 000 allocations; and what suspending a program
under ``gpud-run --on-preempt suspend`` and resuming it costs.

Every figure is measured on this machine, on simulated GPUs (``gpud --simulate``), with real daemons
(``gpud.tools.spawn``) configured by a TOML file: ``preemption_grace_s`` (2 s by default, ``--grace``)
and ``preemption_min_runtime_s = 0``. All processes stamp ``time.monotonic_ns()``, one clock.

1. grant: 4 victims (``bench/preempt_victim.py``), each a client process holding 0.5 GPU of 2
   through ``gpud_client.Client`` at priority best-effort, owner pid its own, listening with
   ``add_allocation_listener``. A production client (this process) ALLOCATEs 1 whole GPU with a
   wait: the daemon tells the victims on one GPU to leave (PREEMPT). time to grant = the ALLOCATE's
   call to its answer. Scenarios:
   - leave-free, leave-yield: the victims FREE (or YIELD) as soon as PREEMPT comes; target: the
     largest time to grant under 1 s;
   - stay: the victims never answer; the grace ends and the daemon takes the allocations back;
     overrun = time to grant - grace; target: the largest overrun at most 1 s.
   Beside it: the daemon's own ``waited_ms``, request -> the first victim saw PREEMPT, PREEMPT -> the
   victim's FREE/YIELD answered (the slowest victim of a trial), its answer -> the grant. After each
   trial the production task is freed and the victims hold again (not timed).
2. plan: victim selection in-process (``bench/preempt_plan.py``): ``Ledger.advance`` planning the
   victims of one waiting production request (1 whole GPU, or half of one) on a node of 1 000
   allocations in five layouts (an 8-GPU node of 125 allocations per GPU, 40 GPUs of 25, 125 GPUs of
   eighths, 250 GPUs of 1/2 + 1/4 + 1/8 + 1/8, 1 000 whole GPUs), for each strategy; target: p95 <= 1 ms.
3. suspend: ``python -m gpud_client.run --gpus 1 --on-preempt suspend --pause signal --priority
   best-effort --trace FILE -- python tests/programs/burner.py PROGRESS`` on one simulated GPU,
   preempted by a production request, which holds the GPU a while (``hold_s``) and frees it; a few
   cycles in one run. From the run's ``--trace``: PREEMPT (the push reached the run) -> ``pause``
   (the signal backend returns once /proc shows the tree stopped) and -> ``yield`` (its YIELD
   answered: the allocation is suspended); devices freed (the production FREE sent) -> the
   ALLOC_CHANGED ``resumed`` reached the run, -> ``resume`` (stamped once SIGCONT was sent: on a
   busy host the program may run before the stamp) and -> the program running again (its first
   progress stamp after that ALLOC_CHANGED; it first ends the chunk of work the pause interrupted,
   about 1 ms). Checked: the program started once, its count of work went on from where it stopped
   (not restarted), it stamped nothing from the pause to the ALLOC_CHANGED, and ALLOC_REVOKED said
   ``suspended``. No timing target; the checks are its ``met``.
4. gpu: the signal backend parks no GPU memory, so a suspended program's memory stays on the GPU
   here; the parked-memory figure (park and restore GB/s, ``--pause cuda``) needs a GPU with the
   CUDA checkpoint API: ``bench/gpu_run.py``'s park scenario. ``gpu`` is NVML's name of GPU 0 or
   null (``gpu_why`` says why); nothing in this benchmark runs on it.

Times are ``{"n", "p50", "p95", "max"}``, nearest rank, in ms (plan: us). With ``--json`` the last
line is one object: ``{"grant": [{"name", "mode", "trials", "victims_per_trial", "grace_s",
"time_to_grant_ms", "daemon_waited_ms", "request_to_preempt_ms", "preempt_to_left_ms",
"left_to_grant_ms", "overrun_ms", "target_ms", "met", "wall_s"}, ...], "plan": {"allocations",
"runs", "target_p95_us", "cells": [{"layout", "gpus", "allocations", "need_gpus", "strategy",
"victims", "advance_us", "met"}, ...], "met", "wall_s"}, "suspend": {"via", "cycles", "grace_s",
"request_to_grant_ms", "preempt_to_paused_ms", "preempt_to_yield_ms", "freed_to_changed_ms",
"freed_to_resume_ms", "freed_to_running_ms", "suspended_ms", "starts", "progress_continued",
"still_while_suspended", "revoked_suspended", "parked_bytes", "met", "wall_s"}, "gpu", "gpu_why",
"gpu_note", "met_all", "targets", "config", "cpus", "loadavg_1m_before", "loadavg_1m_after",
"elapsed_s"}``. A figure that does not apply is null (``preempt_to_left_ms`` and
``left_to_grant_ms`` for stay, ``overrun_ms`` for the leave scenarios,
``parked_bytes`` on the signal backend); a part not run (``--only``) is null (or absent from
``grant``); ``met_all`` covers every part run.

``--quick`` shows the benchmark works in well under a minute: 5 trials of each leave scenario, 2 of
stay with a 1 s grace, 3 planning calls per cell, 3 suspend cycles. It exits 0 whatever the figures
say (a miss is reported, not failed), and 1 only when the benchmark itself could not run. It starts
its own daemons on temporary sockets and removes them; its I/O is in ``bench/preempt_runs.py``.

    .venv/bin/python bench/preempt.py [--json] [--quick] [--grace S] [--only grant,plan,suspend]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from gpud_client import GpudError

import preempt_plan
import preempt_runs
from gpu_quota import read_nvml
from harness import Run, machine_line, progress
from percentiles import percentile
from quota_workers import MeasurementError
from run_share import first_t, kind

LEAVE = {"leave-free": "free", "leave-yield": "yield"}
STAY = "stay"
PARTS = ("grant", "plan", "suspend")
TARGETS = {"leave_grant_max_ms": 1000.0, "stay_overrun_max_ms": 1000.0, "plan_p95_us": 1000.0}
GPU_NOTE = (
    "the signal backend parks no GPU memory: the parked-memory figure (park and restore GB/s, "
    "--pause cuda) needs a GPU with the CUDA checkpoint API, as bench/gpu_run.py's park scenario measures it"
)
MS = 1_000_000


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    grace_s: float = 2.0
    gpus: int = 2
    victims: int = 4
    victim_gpus: float = 0.5
    leave_trials: int = 30
    stay_trials: int = 10
    plan_runs: int = 40
    suspend_cycles: int = 10
    run_s: float = 0.3  # a suspend cycle: the program runs this long before the production request
    hold_s: float = 0.3  # and the production task holds the GPU this long before it frees it
    every_s: float = 0.005  # between two progress stamps of the burner


QUICK = BenchConfig(grace_s=1.0, leave_trials=5, stay_trials=2, plan_runs=3, suspend_cycles=3)


# --- arithmetic (pure) ------------------------------------------------------------------------------


def spread(samples: list[float], digits: int = 3) -> dict[str, float] | None:
    """n, p50, p95 and max (nearest rank), in the samples' unit; None without samples."""
    if not samples:
        return None
    return {
        "n": len(samples),
        "p50": round(percentile(samples, 50), digits),
        "p95": round(percentile(samples, 95), digits),
        "max": round(max(samples), digits),
    }


def trial_record(t0: int, t1: int, waited_ms: float, reports: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """One production request: asked at ``t0``, granted at ``t1`` (ns), and what its victims said
    (their answers to ``hold``; those without ``preempt_t`` were not told to leave)."""
    told = [r for r in reports if "preempt_t" in r]
    if not told:
        raise MeasurementError("the production request was granted with no victim told to leave")
    if any("withdrawn_t" in r for r in told):
        raise MeasurementError("a notice was withdrawn: the production request gave up")
    left = [r["left_t"] for r in told if "left_t" in r]
    if mode == STAY:
        if left or not all(r.get("gone") for r in told):
            raise MeasurementError("a victim that never answers was not revoked whole at the grace's end")
    elif len(left) != len(told):
        raise MeasurementError("a victim told to leave did not say it left")
    return {
        "grant_ms": (t1 - t0) / MS,
        "waited_ms": waited_ms,
        "victims": len(told),
        "notice_ms": (min(r["preempt_t"] for r in told) - t0) / MS,
        "leave_ms": max((r["left_t"] - r["preempt_t"]) / MS for r in told) if left else None,
        "left_to_grant_ms": (t1 - max(left)) / MS if left else None,
        "grace_s": min(r["grace_s"] for r in told),
    }


def grant_figures(name: str, mode: str, trials: list[dict[str, Any]], grace_s: float, wall_s: float) -> dict[str, Any]:
    """A scenario's figures over its trials, against its target."""
    grants = [t["grant_ms"] for t in trials]

    def of(key: str) -> dict[str, float] | None:
        return spread([t[key] for t in trials if t[key] is not None])

    overrun = spread([g - 1000 * grace_s for g in grants]) if mode == STAY else None
    if mode == STAY:
        target = TARGETS["stay_overrun_max_ms"]
        met = overrun is not None and overrun["max"] <= target
    else:
        target = TARGETS["leave_grant_max_ms"]
        met = bool(grants) and max(grants) < target
    return {
        "name": name,
        "mode": mode,
        "trials": len(trials),
        "victims_per_trial": sorted({t["victims"] for t in trials}),
        "grace_s": grace_s,
        "time_to_grant_ms": spread(grants),
        "daemon_waited_ms": of("waited_ms"),
        "request_to_preempt_ms": of("notice_ms"),
        "preempt_to_left_ms": of("leave_ms"),
        "left_to_grant_ms": of("left_to_grant_ms"),
        "overrun_ms": overrun,
        "target_ms": target,
        "met": met,
        "wall_s": wall_s,
    }


def plan_figures(cells: list[dict[str, Any]], runs: int, wall_s: float) -> dict[str, Any]:
    """preempt_plan's samples as figures, each cell against the target."""
    target = TARGETS["plan_p95_us"]
    out = []
    for cell in cells:
        advance = spread(cell["samples_us"], 1)
        figures = {k: v for k, v in cell.items() if k != "samples_us"}
        out.append(figures | {"advance_us": advance, "met": advance is not None and advance["p95"] <= target})
    return {
        "allocations": preempt_plan.ALLOCATIONS,
        "runs": runs,
        "target_p95_us": target,
        "cells": out,
        "met": all(c["met"] for c in out),
        "wall_s": wall_s,
    }


def parse_progress(text: str) -> tuple[int, list[tuple[int, int]]]:
    """burner.py's progress file: how often it started, and its ``(time ns, count)`` stamps (only
    whole lines: the file may be read while the program writes)."""
    starts, stamps = 0, []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        parts = line.split()
        if parts and parts[0] == "start":
            starts += 1
        elif len(parts) == 2 and parts[0][:1].isdigit() and parts[1].isdigit():  # not "signal N"
            stamps.append((round(float(parts[0]) * 1e9), int(parts[1])))
    return starts, stamps


def cycle_record(trace: list[dict[str, Any]], stamps: list[tuple[int, int]], cycle: dict[str, int]) -> dict[str, Any]:
    """One suspend cycle: the production request at ``t0``, granted at ``t1``, freed at ``freed`` (ns);
    what the run's trace and the program's stamps say of it. An action is stamped once done (the
    ``resume`` after its SIGCONT, which the program may already use), so the program counts as
    suspended from the ``pause`` to the ALLOC_CHANGED that let the run resume it."""
    t0, t1, freed = cycle["t0"], cycle["t1"], cycle["freed"]
    preempt = first_t(trace, "preempt", t0)
    paused = first_t(trace, "pause", preempt or t0)
    yielded = first_t(trace, "yield", preempt or t0)
    changed = first_t(trace, "changed", freed)
    resumed = first_t(trace, "resume", changed or freed)
    if preempt is None or paused is None or yielded is None or changed is None or resumed is None:
        raise MeasurementError(f"the run's trace lacks a preempt, pause, yield, changed or resume after {t0}")
    revoked = next((r for r in trace if kind(r) == "revoked" and r["t"] >= preempt), {})
    before = [c for t, c in stamps if t < paused]
    after = [(t, c) for t, c in stamps if t > changed]
    if not before or not after:
        raise MeasurementError("the program stamped no progress before the pause or after the resume")
    return {
        "grant_ms": (t1 - t0) / MS,
        "paused_ms": (paused - preempt) / MS,
        "yield_ms": (yielded - preempt) / MS,
        "changed_ms": (changed - freed) / MS,
        "resume_ms": (resumed - freed) / MS,
        "running_ms": (after[0][0] - freed) / MS,
        "suspended_ms": (changed - paused) / MS,
        "still": not any(paused < t < changed for t, _ in stamps),
        "went_on": after[0][1] >= before[-1],
        "revoked_suspended": revoked.get("state") == "suspended" and revoked.get("gone") is False,
    }


def suspend_figures(
    cycles: list[dict[str, Any]], starts: int, counts: list[int], grace_s: float, wall_s: float
) -> dict[str, Any]:
    """The suspend cycles' figures; ``counts``: every count the program stamped, in order."""

    def of(key: str) -> dict[str, float] | None:
        return spread([c[key] for c in cycles])

    continued = starts == 1 and all(c["went_on"] for c in cycles) and counts == sorted(counts)
    still = all(c["still"] for c in cycles)
    revoked = all(c["revoked_suspended"] for c in cycles)
    return {
        "via": "gpud-run",
        "cycles": len(cycles),
        "grace_s": grace_s,
        "request_to_grant_ms": of("grant_ms"),
        "preempt_to_paused_ms": of("paused_ms"),
        "preempt_to_yield_ms": of("yield_ms"),
        "freed_to_changed_ms": of("changed_ms"),
        "freed_to_resume_ms": of("resume_ms"),
        "freed_to_running_ms": of("running_ms"),
        "suspended_ms": of("suspended_ms"),
        "starts": starts,
        "progress_continued": continued,
        "still_while_suspended": still,
        "revoked_suspended": revoked,
        "parked_bytes": None,
        "met": bool(cycles) and continued and still and revoked,
        "wall_s": wall_s,
    }


# --- the parts --------------------------------------------------------------------------------------


def measure_grant(cfg: BenchConfig) -> list[dict[str, Any]]:
    out = []
    for name, mode in [*LEAVE.items(), (STAY, STAY)]:
        trials = cfg.stay_trials if mode == STAY else cfg.leave_trials
        progress(
            f"{name}: {trials} production requests for 1 GPU, {cfg.victims} victims of {cfg.victim_gpus:g} GPU "
            f"({mode}), grace {cfg.grace_s:g} s"
        )
        began = time.monotonic()
        raw = preempt_runs.run_grant(
            mode=mode,
            trials=trials,
            gpus=cfg.gpus,
            victims=cfg.victims,
            victim_gpus=cfg.victim_gpus,
            grace_s=cfg.grace_s,
        )
        records = [trial_record(*r, mode) for r in raw]
        out.append(grant_figures(name, mode, records, cfg.grace_s, round(time.monotonic() - began, 1)))
        g = out[-1]["time_to_grant_ms"]
        progress(f"  time to grant p50 {g['p50']:.1f} / p95 {g['p95']:.1f} / max {g['max']:.1f} ms")
    return out


def measure_plan(cfg: BenchConfig) -> dict[str, Any]:
    progress(f"plan: Ledger.advance with 1000 allocations, {cfg.plan_runs} runs per layout, need and strategy")
    began = time.monotonic()
    cells = preempt_plan.measure(cfg.plan_runs)
    return plan_figures(cells, cfg.plan_runs, round(time.monotonic() - began, 1))


def measure_suspend(cfg: BenchConfig) -> dict[str, Any]:
    progress(f"suspend: gpud-run --on-preempt suspend --pause signal, {cfg.suspend_cycles} cycles")
    raw = preempt_runs.run_suspend(
        cycles=cfg.suspend_cycles, grace_s=cfg.grace_s, run_s=cfg.run_s, hold_s=cfg.hold_s, every_s=cfg.every_s
    )
    starts, stamps = parse_progress(raw["progress"])
    cycles = [cycle_record(raw["trace"], stamps, c) for c in raw["cycles"]]
    return suspend_figures(cycles, starts, [c for _, c in stamps], cfg.grace_s, raw["wall_s"])


def gpu_present() -> tuple[str | None, str | None]:
    """NVML's name of GPU 0, or why there is none."""
    nvml = read_nvml(0)
    return (None, nvml) if isinstance(nvml, str) else (str(nvml["name"]), None)


def measure(cfg: BenchConfig, chosen: list[str]) -> dict[str, Any]:
    grant = measure_grant(cfg) if "grant" in chosen else []
    plan = measure_plan(cfg) if "plan" in chosen else None
    suspend = measure_suspend(cfg) if "suspend" in chosen else None
    gpu, why = gpu_present()
    met = [g["met"] for g in grant] + [part["met"] for part in (plan, suspend) if part is not None]
    return {
        "grant": grant,
        "plan": plan,
        "suspend": suspend,
        "gpu": gpu,
        "gpu_why": why,
        "gpu_note": GPU_NOTE,
        "met_all": all(met),
        "targets": TARGETS,
        "config": asdict(cfg),
    }


# --- report -----------------------------------------------------------------------------------------


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def _ms(f: dict[str, float] | None, fmt: str = ".1f") -> str:
    return "-" if f is None else f"{f['p50']:{fmt}} / {f['p95']:{fmt}} / {f['max']:{fmt}}"


def table(result: dict[str, Any]) -> str:
    lines: list[str] = []
    c = result["config"]
    if result["grant"]:
        lines.append(
            f"time to grant a production request for 1 GPU ({c['victims']} victims of {c['victim_gpus']:g} GPU on "
            f"{c['gpus']} simulated GPUs, grace {c['grace_s']:g} s), ms p50 / p95 / max:"
        )
        heads = ["time to grant", "daemon waited", "request -> PREEMPT", "PREEMPT -> left", "overrun past grace"]
        lines.append(f"{'scenario':<12}{'trials':>7}{'victims':>8}  " + "".join(f"{h:<27}" for h in heads) + "target")
        for g in result["grant"]:
            target = f"max < {g['target_ms']:g} ms" if g["mode"] != STAY else f"max overrun <= {g['target_ms']:g} ms"
            cells = [_ms(g["time_to_grant_ms"]), _ms(g["daemon_waited_ms"]), _ms(g["request_to_preempt_ms"], ".2f")]
            cells += [_ms(g["preempt_to_left_ms"], ".2f"), _ms(g["overrun_ms"])]
            lines.append(
                f"{g['name']:<12}{g['trials']:>7}{'/'.join(map(str, g['victims_per_trial'])):>8}  "
                + "".join(f"{c:<27}" for c in cells)
                + f"{target}: {_met(g['met'])}"
            )
    plan = result["plan"]
    if plan:
        strategies = list(dict.fromkeys(cell["strategy"] for cell in plan["cells"]))
        lines.append(
            f"victim selection: Ledger.advance planning one production request among {plan['allocations']} "
            f"allocations, {plan['runs']} runs each, us p50 / p95 (target p95 <= {plan['target_p95_us']:g} us):"
        )
        lines.append(f"{'layout':<9}{'gpus':>5}{'need':>6}  " + "".join(f"{s:<26}" for s in strategies))
        rows: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
        for cell in plan["cells"]:
            rows.setdefault((cell["layout"], cell["gpus"], cell["need_gpus"]), []).append(cell)
        for (layout, gpus, need), row in rows.items():
            shown = [
                f"{x['advance_us']['p50']:.0f} / {x['advance_us']['p95']:.0f} ({x['victims']}v) {_met(x['met'])}"
                for x in row
            ]
            lines.append(f"{layout:<9}{gpus:>5}{need:>6g}  " + "".join(f"{s:<26}" for s in shown))
    sus = result["suspend"]
    if sus:
        lines.append(
            f"suspend and resume ({sus['via']} --on-preempt suspend --pause signal, burner.py), {sus['cycles']} "
            "cycles, ms p50 / p95 / max:"
        )
        lines.append(
            f"  request -> grant {_ms(sus['request_to_grant_ms'])}; PREEMPT -> paused "
            f"{_ms(sus['preempt_to_paused_ms'], '.2f')}; PREEMPT -> YIELD answered {_ms(sus['preempt_to_yield_ms'], '.2f')}"
        )
        lines.append(
            f"  devices freed -> ALLOC_CHANGED resumed {_ms(sus['freed_to_changed_ms'], '.2f')}; -> SIGCONT sent "
            f"{_ms(sus['freed_to_resume_ms'], '.2f')}; -> program running "
            f"{_ms(sus['freed_to_running_ms'], '.2f')}; suspended for {_ms(sus['suspended_ms'])}"
        )
        lines.append(
            f"  started once, progress kept: {_met(sus['progress_continued'])}; no progress while suspended: "
            f"{_met(sus['still_while_suspended'])}; ALLOC_REVOKED said suspended: {_met(sus['revoked_suspended'])}"
        )
    gpu = result["gpu"] or f"none ({result['gpu_why']})"
    lines.append(f"GPU: {gpu}; {result['gpu_note']}")
    lines.append(f"{machine_line(result)}; all met: {result['met_all']}")
    return "\n".join(line.rstrip() for line in lines)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, list[str], bool]:
    ap = argparse.ArgumentParser(description="Preemption: time to grant, victim selection, suspend and resume.")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions: shows the benchmark works")
    ap.add_argument("--grace", type=float, help="the daemons' preemption_grace_s (default 2)")
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(PARTS)}")
    args = ap.parse_args(argv)
    chosen = list(PARTS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in PARTS]
    if unknown:
        ap.error(f"unknown part(s): {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    cfg = QUICK if args.quick else BenchConfig()
    if args.grace is not None:
        if not 0.1 <= args.grace <= 60:
            ap.error("--grace must be 0.1 to 60 seconds")
        cfg = replace(cfg, grace_s=args.grace)
    return cfg, chosen, args.json


def main(argv: list[str] | None = None) -> int:
    cfg, chosen, as_json = parse_args(argv)
    run = Run()
    try:
        result = measure(cfg, chosen)
    except (MeasurementError, RuntimeError, OSError, subprocess.SubprocessError, GpudError) as exc:
        print(f"preempt: nothing reported: {exc}", file=sys.stderr)
        return 1
    result |= run.machine()
    print(json.dumps(result) if as_json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
