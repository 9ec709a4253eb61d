"""The arithmetic of ``bench/gpu_quota.py``: event timelines to shares, and the report.

Pure: no torch, no NVML, no clock, no process. The session processes record
each kernel as two CUDA events; ``EventClock`` puts them on
``time.monotonic_ns()`` (the daemon's clock and every process's), from two
anchors: a reference event whose GPU timestamp lies between two clock reads
taken around its record and synchronize (the narrowest of a few tries; its
midpoint, ± half the bracket), once before and once after the work. Two
anchors give the scale as well, so a GPU timer drifting against the host
clock is corrected and reported (``drift_ppm``).

A session's kernels run on one stream, so they never overlap each other.
Kernels of different sessions overlap only in concurrent mode; there each
stretch of time is split evenly among the sessions with a kernel in flight
(``sweep``), which is how the daemon bills (wall time / k) and what fair
time-slicing gives. In serial mode any overlap beyond the clocks' uncertainty
makes the figures meaningless and aborts the scenario.

It must never bend a figure: nothing here drops a kernel, and a share is
always GPU time over the interval, kernels straddling its edges clipped.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from percentiles import percentile
from quota_accuracy import BASELINE, REFERENCE, REFERENCE_LIMIT_UPDATE_MS, SCENARIOS, TARGETS, UNLIMITED
from quota_workers import MeasurementError

NO_GPU: dict[str, Any] = {"gpu": None, "scenarios": [], "limit_update_ms": None, "nvml": None}
ROUNDING_NS = 50_000  # elapsed_time is float32 ms: 8 us steps after 2 minutes, 16 us after 4


# --- clocks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Anchor:
    mono_ns: int  # the reference event's timestamp on the monotonic clock
    half_width_ns: int  # ± this much


def best_bracket(brackets: Sequence[tuple[int, int]]) -> tuple[int, Anchor]:
    """The narrowest of (clock before record, clock after synchronize): its index and its anchor."""
    i = min(range(len(brackets)), key=lambda k: brackets[k][1] - brackets[k][0])
    t0, t1 = brackets[i]
    if t1 < t0:
        raise MeasurementError(f"a clock bracket ends before it starts: {t0} > {t1}")
    return i, Anchor((t0 + t1) // 2, (t1 - t0 + 1) // 2)


@dataclass(frozen=True)
class EventClock:
    """An event's offset from the first anchor's event (ms, CUDA's elapsed_time) on the monotonic clock."""

    origin_ns: int
    scale: float  # monotonic ns per GPU ns
    uncertainty_ns: int

    @classmethod
    def from_anchors(cls, first: Anchor, last: Anchor, last_ms: float) -> EventClock:
        if last_ms <= 0 or last.mono_ns <= first.mono_ns:
            raise MeasurementError(f"the closing anchor is not after the opening one ({last_ms} ms on the GPU)")
        scale = (last.mono_ns - first.mono_ns) / (last_ms * 1e6)
        return cls(first.mono_ns, scale, first.half_width_ns + last.half_width_ns)

    def to_ns(self, ms: float) -> int:
        return self.origin_ns + round(ms * 1e6 * self.scale)

    @property
    def drift_ppm(self) -> float:
        return (self.scale - 1) * 1e6


@dataclass(frozen=True)
class Timeline:
    """One session's kernels on the monotonic clock: sorted, never overlapping."""

    starts: array[int]
    ends: array[int]


def timeline(clock: EventClock, start_ms: Sequence[float], dur_ms: Sequence[float]) -> Timeline:
    """Kernel i starts ``start_ms[i]`` after the reference event and lasts ``dur_ms[i]`` (its own
    two events: a small elapsed_time, read at full precision, not the difference of two large ones)."""
    starts = array("q", (clock.to_ns(s) for s in start_ms))
    ends = array("q", (s + round(d * 1e6 * clock.scale) for s, d in zip(starts, dur_ms)))
    for i in range(1, len(starts)):
        if starts[i] < ends[i - 1]:
            # One stream runs its events in order: an earlier start is the rounding of elapsed_time's
            # float32 milliseconds (some us after minutes), unless it is more than that.
            if starts[i] < ends[i - 1] - ROUNDING_NS:
                raise MeasurementError(
                    f"kernel {i} of one stream starts {ends[i - 1] - starts[i]} ns before kernel {i - 1} ends"
                )
            starts[i] = ends[i - 1]
            ends[i] = max(ends[i], starts[i])
    return Timeline(starts, ends)


def on_one_clock(report: Mapping[str, Any]) -> tuple[Timeline, EventClock]:
    """A session process's report (``gpu_workers.session_worker``) as a timeline, and the clock that made it."""
    clock = EventClock.from_anchors(report["first"], report["last"], report["last_ms"])
    return timeline(clock, report["start_ms"], report["dur_ms"]), clock


# --- shares ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sweep:
    per_bin: list[list[float]]  # [bin][session]: GPU ns, each stretch split among the sessions in flight
    busy_ns: int  # some kernel in flight
    overlap_ns: int  # two or more in flight


def sweep(timelines: Sequence[Timeline], edges: Sequence[int]) -> Sweep:
    """Concurrency-weighted GPU time of each session in each bin ``[edges[j], edges[j+1])``."""
    a, b = edges[0], edges[-1]
    events: list[tuple[int, int, int]] = [(t, 1, -1) for t in edges[1:-1]]  # kind 0 end, 1 bin edge, 2 start
    for i, tl in enumerate(timelines):
        for s, e in zip(tl.starts, tl.ends):
            s, e = max(s, a), min(e, b)
            if s < e:
                events += [(s, 2, i), (e, 0, i)]
    events.sort()
    per_bin = [[0.0] * len(timelines) for _ in edges[1:]]
    active: dict[int, int] = {}  # session -> kernels in flight (one, unless a timeline overlaps itself)
    busy = overlap = 0
    last, j = a, 0
    for t, kind, i in events:
        if active and t > last:
            for k in active:
                per_bin[j][k] += (t - last) / len(active)
            busy += t - last
            overlap += (t - last) if len(active) > 1 else 0
        last = t
        if kind == 1:
            j += 1
        elif kind == 2:
            active[i] = active.get(i, 0) + 1
        elif active[i] == 1:
            del active[i]
        else:
            active[i] -= 1
    return Sweep(per_bin, busy, overlap)


def serial_overlap_ns(timelines: Sequence[Timeline]) -> int:
    """The longest stretch in which kernels of two sessions ran at once (0 on a serial GPU)."""
    spans = sorted((s, e, i) for i, tl in enumerate(timelines) for s, e in zip(tl.starts, tl.ends))
    worst, reach, owner = 0, -(2**63), -1
    for s, e, i in spans:
        if i != owner and s < reach:
            worst = max(worst, min(reach, e) - s)
        if e > reach:
            reach, owner = e, i
    return worst


def work_done(tl: Timeline, a: int, b: int) -> float:
    """Kernels completed in [a, b), a straddling kernel counted by the part of its own time inside."""
    return sum((min(e, b) - max(s, a)) / (e - s) for s, e in zip(tl.starts, tl.ends) if e > a and s < b and e > s)


def idle_in_holds_ns(tl: Timeline, grants: Sequence[int], a: int, b: int) -> int:
    """GPU idle between two kernels of one hold (no grant between them): host time the queue did not hide."""
    marks = sorted(grants)
    idle, g = 0, 0
    for i in range(1, len(tl.starts)):
        gap_from, gap_to = tl.ends[i - 1], tl.starts[i]
        while g < len(marks) and marks[g] <= gap_from:
            g += 1
        new_hold = g < len(marks) and marks[g] <= gap_to
        if not new_hold:
            idle += max(0, min(gap_to, b) - max(gap_from, a))
    return idle


def window_edges(start: int, end: int, window: int) -> list[int]:
    return list(range(start, end, window)) + [end]


def _pct(x: float) -> float:
    return round(x, 3)


def session_figures(
    timelines: Sequence[Timeline],
    grants: Sequence[Sequence[int]],
    limits: Sequence[int],
    start: int,
    end: int,
    window: int,
) -> list[dict[str, Any]]:
    """Each session's share of [start, end): GPU time, per window, throughput, idle within holds."""
    sw = sweep(timelines, window_edges(start, end, window))
    length = end - start
    out = []
    for i, (tl, limit) in enumerate(zip(timelines, limits)):
        gpu_ns = sum(row[i] for row in sw.per_bin)
        achieved = 100 * gpu_ns / length
        out.append(
            {
                "session": "abcdefgh"[i],
                "limit": limit,
                "achieved": _pct(achieved),
                "error_pp": _pct(achieved - limit) if limit < UNLIMITED else None,
                "window_share_min": _pct(min(100 * row[i] / window for row in sw.per_bin)),
                "window_share_max": _pct(max(100 * row[i] / window for row in sw.per_bin)),
                "kernels_per_s": round(work_done(tl, start, end) / (length / 1e9), 3),
                "kernels": sum(1 for s, e in zip(tl.starts, tl.ends) if e > start and s < end),
                "idle_in_holds_pp": _pct(100 * idle_in_holds_ns(tl, grants[i], start, end) / length),
                "grants": sum(1 for t in grants[i] if start <= t < end),
            }
        )
    for s in out:
        s["gpu_busy_percent"] = _pct(100 * sw.busy_ns / length)
        s["overlap_percent"] = _pct(100 * sw.overlap_ns / length)
    return out


def _first_at_or_after(times: Sequence[int], t: int) -> int | None:
    return min((x for x in times if x >= t), default=None)


def limit_change_figures(
    changes: Sequence[Mapping[str, int]],
    drops: Sequence[tuple[int, str]],
    grants: Sequence[int],
    tl: Timeline,
    after: tuple[int, int],
    window: int,
) -> dict[str, Any]:
    """How fast a lowered limit governs the GPU, per change ``{launch, return[, raise_launch, raise_return]}``
    (gpuctl's launch and return): the session's DROP_LOCK (quota) after the launch, and the end of its last
    kernel before its next grant: from then on the GPU runs none of its work, so the new share holds.
    Raising it again: gpuctl's return to the session's next kernel starting on the GPU."""
    quota = [t for t, why in drops if why == "quota"]
    stop_ms, drop_ms, resume_ms = [], [], []
    for i, c in enumerate(changes):
        t_drop = _first_at_or_after(quota, c["launch"])
        if t_drop is None:
            raise MeasurementError(f"change {i}: no DROP_LOCK (quota) after gpuctl limit --core 20")
        regrant = _first_at_or_after(grants, t_drop + 1)
        ran = [e for s, e in zip(tl.starts, tl.ends) if e > c["launch"] and (regrant is None or s < regrant)]
        if not ran:
            raise MeasurementError(f"change {i}: no kernel ran after gpuctl was launched")
        stop_ms.append(round((max(ran) - c["return"]) / 1e6, 3))
        drop_ms.append(round((t_drop - c["return"]) / 1e6, 3))
        if "raise_launch" in c:
            t_resume = _first_at_or_after(tl.starts, c["raise_launch"])
            if t_resume is None:
                raise MeasurementError(f"change {i}: no kernel after gpuctl limit --core 100")
            resume_ms.append(round((t_resume - c["raise_return"]) / 1e6, 3))
    shares = sweep([tl], window_edges(after[0], after[1], window)).per_bin
    length = after[1] - after[0]
    return {
        "samples_ms": stop_ms,
        "max_ms": max(stop_ms),
        "median_ms": percentile(stop_ms, 50),
        "drop_samples_ms": drop_ms,
        "drop_max_ms": max(drop_ms),
        "raise_samples_ms": resume_ms,
        "met": max(stop_ms) <= TARGETS["limit_update_ms"],
        "target_ms": TARGETS["limit_update_ms"],
        "reference_ms": REFERENCE_LIMIT_UPDATE_MS,
        "after_change": {
            "target": 20.0,
            "achieved": _pct(100 * sum(row[0] for row in shares) / length),
            "window_shares": [_pct(100 * row[0] / window) for row in shares],
        },
    }


# --- report -------------------------------------------------------------------------


def nvml_mismatches(daemon_gpu: Mapping[str, Any], nvml: Mapping[str, Any]) -> list[str]:
    """What ``gpuctl status --json`` says about the GPU and NVML read directly do not agree on."""
    out = [] if daemon_gpu.get("simulated") is False else ["the daemon runs on a simulated GPU"]
    for key in ("name", "uuid", "memory_total_bytes"):
        if daemon_gpu.get(key) != nvml[key]:
            out.append(f"{key}: gpuctl says {daemon_gpu.get(key)!r}, NVML {nvml[key]!r}")
    return out


def entries(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One entry per limited session of a share scenario: the figures the targets apply to."""
    limited = [s for s in run["sessions"] if s["limit"] < UNLIMITED]
    beside = [s["achieved"] for s in run["sessions"] if s["limit"] >= UNLIMITED]
    tolerance, ref = SCENARIOS[run["name"]].tolerance_pp, REFERENCE.get(run["name"])
    out = []
    for s in limited:
        e: dict[str, Any] = {
            "name": run["name"] if len(limited) == 1 else f"{run['name']}:{s['session']}{s['limit']}",
            "scenario": run["name"],
            "mode": run["mode"],
            "target": float(s["limit"]),
            "achieved": s["achieved"],
            "error_pp": s["error_pp"],
            "tolerance_pp": tolerance,
            "met": abs(s["error_pp"]) <= tolerance,
            "slowdown": None,
            "share_of_alone": None,
            "kernels_per_s": s["kernels_per_s"],
            "idle_in_holds_pp": s["idle_in_holds_pp"],
            "reference_achieved": ref[0] if ref else None,
            "reference_slowdown": ref[1] if ref else None,
        }
        if beside:
            e["unlimited_beside_achieved"] = beside[0]
        out.append(e)
    return out


def against_alone(scenarios: list[dict[str, Any]], alone_kernels_per_s: float) -> None:
    """Throughput against the same process alone and unlimited: slowdown and its inverse, the share of a lone
    process's throughput (how the nvshare-derived figures are measured: their "achieved" is 1 / slowdown)."""
    for e in scenarios:
        if e["kernels_per_s"] > 0:
            e["slowdown"] = round(alone_kernels_per_s / e["kernels_per_s"], 3)
            e["share_of_alone"] = _pct(100 * e["kernels_per_s"] / alone_kernels_per_s)


def report(
    nvml: Mapping[str, Any],
    kernel: Mapping[str, Any],
    runs: Sequence[Mapping[str, Any]],
    limit_update: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The result: the headline keys first (gpu, scenarios, limit_update_ms, nvml), then the detail."""
    scenarios = [e for run in runs for e in entries(run)]
    alone = next((r["sessions"][0] for r in runs if r["name"] == BASELINE), None)
    if alone is not None:
        against_alone(scenarios, alone["kernels_per_s"])
    return {
        "gpu": nvml["name"],
        "scenarios": scenarios,
        "limit_update_ms": None if limit_update is None else limit_update["max_ms"],
        "nvml": {k: nvml[k] for k in ("name", "uuid", "memory_total_bytes")},
        "kernel": dict(kernel),
        "alone": None if alone is None else {k: alone[k] for k in ("achieved", "kernels_per_s", "idle_in_holds_pp")},
        "limit_update": None if limit_update is None else dict(limit_update),
        "met_all": all(e["met"] for e in scenarios) and (limit_update is None or limit_update["met"]),
        "runs": list(runs),
    }


def _cell(x: float | None, fmt: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{unit}"


def table(result: Mapping[str, Any]) -> str:
    nvml, kernel = result["nvml"], result["kernel"]
    lines = [
        f"GPU {result['gpu']} ({nvml['uuid']}, {nvml['memory_total_bytes'] / 2**30:.1f} GiB); "
        f"kernel: {kernel['what']}, {kernel['ms']:.2f} ms alone",
        f"{'scenario':<22}{'target':>8}{'achieved':>10}{'error':>10}{'tol':>6}{'idle':>7}"
        f"{'vs alone':>10}{'slowdown':>10}  {'nvshare-derived':<16} met",
    ]
    for e in result["scenarios"]:
        ref = f"{e['reference_achieved']:.1f} % ({e['reference_slowdown']:.2f}x)" if e["reference_achieved"] else ""
        lines.append(
            f"{e['name']:<22}{e['target']:>6.1f} %{e['achieved']:>8.2f} %{e['error_pp']:>+7.2f} pp"
            f"{e['tolerance_pp']:>6.1f}{e['idle_in_holds_pp']:>7.2f}{_cell(e['share_of_alone'], '.2f', ' %'):>10}"
            f"{_cell(e['slowdown'], '.2f', 'x'):>10}  {ref:<16} {'yes' if e['met'] else 'NO'}"
        )
        if "unlimited_beside_achieved" in e:
            lines.append(f"{'  (unlimited beside)':<22}{'-':>8}{e['unlimited_beside_achieved']:>8.2f} %")
    a = result["alone"]
    if a is not None:
        lines.append(
            f"{'unlimited, alone':<22}{'-':>8}{a['achieved']:>8.2f} %{'':>16}{a['idle_in_holds_pp']:>7.2f}"
            f"{'100.00 %':>10}{'1.00x':>10}  ({a['kernels_per_s']:.1f} kernels/s)"
        )
    lu = result["limit_update"]
    if lu is not None:
        lines += [
            f"limit change 100 -> 20 %: gpuctl return -> the session's last kernel ends: max {lu['max_ms']:+.1f} ms, "
            f"median {lu['median_ms']:+.1f} ms (target <= {lu['target_ms']:g}; nvshare-derived "
            f"~{lu['reference_ms']:g} ms): {'yes' if lu['met'] else 'NO'}",
            f"  DROP_LOCK after gpuctl return: max {lu['drop_max_ms']:+.1f} ms; share over "
            f"{len(lu['after_change']['window_shares'])} windows after: {lu['after_change']['achieved']:.2f} %"
            + (f"; flags: {lu['flags']}" if lu.get("flags") else ""),
        ]
    lines.append(
        "achieved = the session's kernel time on the GPU (CUDA events, concurrency-weighted) / the "
        "interval; idle = GPU idle between two kernels of one hold (pp); vs alone = throughput / the "
        "same process's alone and unlimited; slowdown = its inverse"
    )
    return "\n".join(lines)
