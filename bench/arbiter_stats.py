"""Figures of bench/arbiter_mix.py from the records its worker processes sent back.

Pure functions of the records: no I/O, no clock. A record is ``(t_sched,
t_call, t_answer, t_release, status, reason, queue_wait_ms)`` (see
``arbiter_workers``). The client's hold [t_answer, t_release] lies inside the
daemon's (granted before the answer arrived, released after t_release), so
holds that overlap in serial mode, or whose declared memory exceeds what
``auto`` admits, mean the gate is broken and the figures meaningless: that
raises ``MeasurementError`` rather than being reported.

It never drops a sample except by the warm-up window, and a wait includes
every answer (a TIMEOUT's too), not only the acquired ones.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from percentiles import percentile  # bench/, on the path when run as a script

GIB = 2**30


class MeasurementError(Exception):
    """The holds contradict the gate's rules: nothing measured would mean anything."""


def _holds(records: dict[str, list[Any]]) -> list[tuple[int, int, str]]:
    return sorted((r[2], r[3], task) for task, rs in records.items() for r in rs if r[4] == "ACQUIRED")


def check_holds(records: dict[str, list[Any]], *, mode: str, mem_gib: dict[str, float], capacity: int) -> None:
    """Serial and flock: no two holds overlap. Auto: overlapping holds fit in ``capacity`` bytes."""
    events = sorted(
        [(end, 0, task) for _, end, task in _holds(records)] + [(start, 1, task) for start, _, task in _holds(records)]
    )  # at equal times an end comes first
    holders: Counter[str] = Counter()
    for t, kind, task in events:
        if kind == 0:
            holders[task] -= 1
            continue
        holders[task] += 1
        count = sum(holders.values())
        if count < 2:
            continue
        if mode != "auto":
            raise MeasurementError(f"{mode}: {dict(+holders)} hold at once at {t} ns")
        used = sum(round(mem_gib[k] * GIB) * n for k, n in holders.items())
        if used > capacity:
            raise MeasurementError(f"auto: {dict(+holders)} hold {used / GIB:.1f} GiB at once at {t} ns")


def busy_ratio(records: dict[str, list[Any]], lo: int, hi: int) -> float:
    """Share of [lo, hi) during which at least one lease (or the flock) was held."""
    busy, cur_start, cur_end = 0, None, None
    for start, end, _ in _holds(records):
        start, end = max(start, lo), min(end, hi)
        if end <= start:
            continue
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        busy += cur_end - cur_start
    return busy / (hi - lo)


def task_stats(records: list[Any]) -> dict[str, Any]:
    """Waits (the daemon's queue_wait_ms: 0 when granted at once; flock: time to get the lock), acquire as the
    client saw it (round trip included), lateness."""
    if not records:
        return {"n": 0}
    waits = [r[6] if r[6] is not None else (r[2] - r[1]) / 1e6 for r in records]
    seen = [(r[2] - r[1]) / 1e6 for r in records]
    late = [(r[1] - r[0]) / 1e6 for r in records]
    refused = [r for r in records if r[4] != "ACQUIRED"]
    return {
        "waits": waits,  # for the ratios; not reported
        "seen": seen,
        "n": len(records),
        "not_acquired": len(refused),
        "reasons": dict(Counter(f"{r[4]}:{r[5]}" for r in refused)),
        "wait_p50_ms": percentile(waits, 50),
        "wait_p95_ms": percentile(waits, 95),
        "wait_max_ms": max(waits),
        "acquire_p50_ms": percentile(seen, 50),
        "acquire_p95_ms": percentile(seen, 95),
        "late_p95_ms": percentile(late, 95),
        "late_max_ms": max(late),
    }


def phase_figures(
    phase: dict[str, Any], warmup: float, seconds: float, *, mode: str, mem_gib: dict[str, float], capacity: int
) -> dict[str, Any]:
    records = phase["records"]
    check_holds(records, mode=mode, mem_gib=mem_gib, capacity=capacity)
    lo, hi = phase["start_ns"] + round(warmup * 1e9), phase["start_ns"] + round(seconds * 1e9)
    out: dict[str, Any] = {task: task_stats([r for r in rs if lo <= r[0] < hi]) for task, rs in records.items()}
    out["busy_ratio"] = busy_ratio(records, lo, hi)
    out["daemon_warnings"] = len(phase["daemon_warnings"])
    out["loadavg_1m"] = phase["loadavg_1m"]
    return out


def _r(x: float) -> float:
    return round(x, 3)


def p95_ratio(with_: list[float], without: list[float]) -> float | None:
    """p95(with) / p95(without). Both 0 (no request waited at the 95th percentile in either phase): 1.0, the
    flood changed nothing. Only the one without 0: None, no finite ratio (and no target met)."""
    a, b = percentile(with_, 95), percentile(without, 95)
    if b > 0:
        return a / b
    return 1.0 if a == 0 else None


def ratio_ci95(with_: list[float], without: list[float], *, resamples: int = 1000, seed: int = 0) -> list[float | None]:
    """Bootstrap 95 % interval of ``p95_ratio``: how far the run's ratio could be from chance (None: unbounded)."""
    rng = random.Random(seed)
    ratios = [
        p95_ratio(rng.choices(with_, k=len(with_)), rng.choices(without, k=len(without))) for _ in range(resamples)
    ]
    finite = sorted(r for r in ratios if r is not None)
    unbounded = len(ratios) - len(finite)  # sorted last, above every finite ratio
    ends = (int(0.025 * resamples), int(0.975 * resamples) - 1)
    return [_r(finite[i]) if i < len(finite) else None for i in ends] if unbounded < resamples else [None, None]


def mode_figures(without: dict[str, Any], with_: dict[str, Any]) -> dict[str, Any]:
    """One mode's figures: the phase with the flood against the one without."""
    out: dict[str, Any] = {}
    for task, key in (("ASR", "asr"), ("NMT", "nmt")):
        w0, w1 = without[task], with_[task]
        out[f"{key}_p50_ms"] = _r(w1["wait_p50_ms"])
        out[f"{key}_p95_ms"] = _r(w1["wait_p95_ms"])
        out[f"{key}_p50_ms_without_repair"] = _r(w0["wait_p50_ms"])
        out[f"{key}_p95_ms_without_repair"] = _r(w0["wait_p95_ms"])
        out[f"{key}_p95_ms_with_repair"] = _r(w1["wait_p95_ms"])
        out[f"{key}_max_ms_with_repair"] = _r(w1["wait_max_ms"])
        out[f"{key}_acquire_p50_ms"] = _r(w1["acquire_p50_ms"])
        out[f"{key}_acquire_p95_ms"] = _r(w1["acquire_p95_ms"])
        out[f"{key}_acquire_p50_ms_without_repair"] = _r(w0["acquire_p50_ms"])
        out[f"{key}_acquire_p95_ms_without_repair"] = _r(w0["acquire_p95_ms"])
        out[f"{key}_samples"] = {"without_repair": w0["n"], "with_repair": w1["n"]}
        out[f"{key}_not_acquired"] = {"without_repair": w0["not_acquired"], "with_repair": w1["not_acquired"]}
        late = {"without_repair": _r(w0["late_p95_ms"]), "with_repair": _r(w1["late_p95_ms"])}
        out[f"{key}_late_start_p95_ms"] = late  # the service itself was busy: not a lease wait
        ratio_key = "p95_ratio_with_repair" if task == "ASR" else "nmt_p95_ratio_with_repair"
        ratio = p95_ratio(w1["waits"], w0["waits"])
        out[ratio_key] = None if ratio is None else _r(ratio)
        out[f"{ratio_key}_zero_over_zero"] = w1["wait_p95_ms"] == 0 == w0["wait_p95_ms"]  # read as 1.0
        out[f"{ratio_key}_ci95"] = ratio_ci95(w1["waits"], w0["waits"])
        seen = p95_ratio(w1["seen"], w0["seen"])  # round trip included: the daemon's load shows here
        out[f"{key}_acquire_p95_ratio_with_repair"] = None if seen is None else _r(seen)
        out[f"{key}_p95_delta_ms"] = _r(w1["wait_p95_ms"] - w0["wait_p95_ms"])
    rep = with_["SEMANTIC_REPAIR"]
    out["repair_skip_rate"] = _r(rep["not_acquired"] / rep["n"])
    out["repair_acquires"] = rep["n"]
    out["repair_refusals"] = rep["reasons"]
    out["repair_wait_p50_ms"] = _r(rep["wait_p50_ms"])
    out["gpu_busy_ratio_without_repair"] = _r(without["busy_ratio"])
    out["gpu_busy_ratio_with_repair"] = _r(with_["busy_ratio"])
    out["daemon_warnings"] = without["daemon_warnings"] + with_["daemon_warnings"]
    out["loadavg_1m_after"] = {"without_repair": _r(without["loadavg_1m"]), "with_repair": _r(with_["loadavg_1m"])}
    return out
