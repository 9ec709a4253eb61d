"""bench/gpu_quota.py without a GPU: the arithmetic on recorded event timelines, the choice of the
kernel's size, the report, and the benchmark run as a real process on a machine with no GPU.

bench/ is no package: the modules are loaded from their files, with bench/ on sys.path for their
own imports (gpu_timeline imports quota_accuracy, quota_workers and percentiles). Timelines here
are built by hand in nanoseconds, with answers worked out on paper.
"""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MS = 1_000_000


@pytest.fixture
def tl(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("gpu_timeline")


@pytest.fixture
def workers(load_bench: Callable[[str], ModuleType], tl: ModuleType) -> ModuleType:
    return load_bench("gpu_workers")


def line(tl: ModuleType, *kernels: tuple[int, int]) -> Any:
    return tl.Timeline(array("q", [s for s, _ in kernels]), array("q", [e for _, e in kernels]))


# --- clocks ---------------------------------------------------------------------------------


def test_the_narrowest_bracket_anchors_the_clock_at_its_midpoint(tl: ModuleType) -> None:
    i, anchor = tl.best_bracket([(100, 180), (200, 221), (300, 350)])
    assert i == 1 and anchor == tl.Anchor(210, 11)


def test_two_anchors_map_event_offsets_onto_the_monotonic_clock_and_correct_drift(tl: ModuleType) -> None:
    # The GPU timer says 10 s passed where the host clock saw 10 s + 100 us: 10 ppm.
    first, last = tl.Anchor(5_000_000_000, 2_000), tl.Anchor(15_000_100_000, 3_000)
    clock = tl.EventClock.from_anchors(first, last, 10_000.0)
    assert clock.drift_ppm == pytest.approx(10.0)
    assert clock.to_ns(0.0) == 5_000_000_000
    assert clock.to_ns(5_000.0) == 10_000_050_000  # halfway, half the drift
    assert clock.uncertainty_ns == 5_000


def test_an_anchor_that_does_not_follow_the_first_voids_the_clock(tl: ModuleType) -> None:
    with pytest.raises(tl.MeasurementError, match="closing anchor"):
        tl.EventClock.from_anchors(tl.Anchor(10, 0), tl.Anchor(5, 0), 1.0)


def test_a_stream_overlapping_itself_by_rounding_is_closed_up_but_by_more_is_refused(tl: ModuleType) -> None:
    clock = tl.EventClock(0, 1.0, 0)
    # Kernel 1 starts 10 us before kernel 0 ends: float32 rounding of elapsed_time; one stream runs in order.
    t = tl.timeline(clock, [0.0, 2.99], [3.0, 3.0])
    assert list(t.starts) == [0, 3 * MS] and list(t.ends) == [3 * MS, 5_990_000]
    with pytest.raises(tl.MeasurementError, match="starts 1000000 ns before kernel 0 ends"):
        tl.timeline(clock, [0.0, 2.0], [3.0, 3.0])


def test_a_report_becomes_a_timeline_on_its_own_clock(tl: ModuleType) -> None:
    report = {
        "first": tl.Anchor(1_000 * MS, 0),
        "last": tl.Anchor(2_000 * MS, 0),
        "last_ms": 1_000.0,
        "start_ms": array("d", [10.0, 13.0]),
        "dur_ms": array("d", [3.0, 3.0]),
    }
    t, clock = tl.on_one_clock(report)
    assert list(t.starts) == [1_010 * MS, 1_013 * MS] and list(t.ends) == [1_013 * MS, 1_016 * MS]
    assert clock.drift_ppm == 0


# --- shares -----------------------------------------------------------------------------------


def test_serial_shares_clip_kernels_straddling_the_interval_and_window_edges(tl: ModuleType) -> None:
    # Interval [0, 3000) in windows of 1000. a: 300 + 400 + (100 | 100) + 500; b: 800 | 400.
    a = line(tl, (-200, 300), (300, 700), (900, 1100), (2500, 3200))
    b = line(tl, (1200, 2400))
    got = tl.session_figures([a, b], [[], [1150]], [50, 40], 0, 3000, 1000)
    assert got[0]["achieved"] == pytest.approx(100 * 1400 / 3000, abs=1e-3)
    assert got[0]["error_pp"] == pytest.approx(100 * 1400 / 3000 - 50, abs=1e-3)
    assert (got[0]["window_share_min"], got[0]["window_share_max"]) == (10.0, 80.0)
    assert got[1]["achieved"] == 40.0 and got[1]["error_pp"] == 0.0
    assert (got[1]["window_share_min"], got[1]["window_share_max"]) == (0.0, 80.0)
    assert got[0]["gpu_busy_percent"] == pytest.approx(100 * 2600 / 3000, abs=1e-3)
    assert got[0]["overlap_percent"] == 0.0
    assert got[0]["kernels"] == 4 and got[1]["grants"] == 1


def test_overlapping_concurrent_kernels_split_their_common_time_evenly(tl: ModuleType) -> None:
    a = line(tl, (0, 1000))
    b = line(tl, (500, 1500))
    sw = tl.sweep([a, b], [0, 2000])
    assert sw.per_bin == [[750.0, 750.0]]  # alone 500 each, 500 together at 1/2
    assert (sw.busy_ns, sw.overlap_ns) == (1500, 500)


def test_back_to_back_kernels_of_one_session_keep_it_in_flight_beside_a_long_one(tl: ModuleType) -> None:
    a = line(tl, (0, 1000))
    b = line(tl, (200, 400), (400, 600))  # b's second starts as its first ends: no gap, no double count
    sw = tl.sweep([a, b], [0, 500, 1000])
    assert sw.per_bin == [[350.0, 150.0], [450.0, 50.0]]
    assert sum(map(sum, sw.per_bin)) == sw.busy_ns == 1000
    three = tl.sweep([a, b, line(tl, (300, 500))], [0, 1000])
    # [200,300) a+b, [300,500) a+b+c, [500,600) a+b: a = 200 + 100 + 200/3 + 100 + 50 + 400
    assert three.per_bin[0][0] == pytest.approx(200 + 50 + 200 / 3 + 50 + 400)
    assert sum(three.per_bin[0]) == pytest.approx(1000)


def test_a_serial_overlap_is_the_longest_stretch_two_sessions_ran_at_once(tl: ModuleType) -> None:
    a = line(tl, (0, 100), (200, 300))
    assert tl.serial_overlap_ns([a, line(tl, (250, 400))]) == 50
    assert tl.serial_overlap_ns([a, line(tl, (300, 400), (100, 200))]) == 0  # touching is no overlap
    assert tl.serial_overlap_ns([a, line(tl, (20, 40))]) == 20  # inside another's kernel


def test_throughput_counts_a_straddling_kernel_by_its_part_inside(tl: ModuleType) -> None:
    t = line(tl, (900, 1100), (1100, 1300), (1900, 2300))
    assert tl.work_done(t, 1000, 2000) == pytest.approx(0.5 + 1 + 0.25)


def test_idle_within_holds_excludes_the_gaps_between_holds(tl: ModuleType) -> None:
    t = line(tl, (0, 100), (110, 200), (300, 400), (430, 500))
    # 10 idle in the first hold, a grant at 250 opens the second (100 between holds is not idle), then 30.
    assert tl.idle_in_holds_ns(t, [250], 0, 1000) == 40
    assert tl.idle_in_holds_ns(t, [250], 0, 105) == 5  # clipped to the interval
    assert tl.idle_in_holds_ns(t, [], 0, 1000) == 140


# --- limit changes -----------------------------------------------------------------------------


def _busy_then_throttled(tl: ModuleType) -> Any:
    # 5 ms kernels from 0 to 255 ms (the drop at 245 ms, two queued kernels drained), again from 275 ms
    # (raised at 262 ms) to 300 ms, and 200 ms of each window from 1000 ms on (20 % of 1 s windows).
    kernels = [(t, t + 5 * MS) for t in range(0, 255 * MS, 5 * MS)]
    kernels += [(t, t + 5 * MS) for t in range(275 * MS, 300 * MS, 5 * MS)]
    kernels += [(w + t, w + t + 5 * MS) for w in (1000 * MS, 2000 * MS) for t in range(0, 200 * MS, 5 * MS)]
    return line(tl, *kernels)


def test_a_lowered_limit_governs_when_the_sessions_last_kernel_ends(tl: ModuleType) -> None:
    change = {"launch": 240 * MS, "return": 260 * MS, "raise_launch": 262 * MS, "raise_return": 270 * MS}
    got = tl.limit_change_figures(
        [change],
        [(245 * MS, "quota")],
        [274 * MS, 1000 * MS, 2000 * MS],
        _busy_then_throttled(tl),
        (1000 * MS, 3000 * MS),
        1000 * MS,
    )
    assert got["samples_ms"] == [-5.0] and got["max_ms"] == -5.0  # 255 ms, 5 ms before gpuctl returned
    assert got["drop_samples_ms"] == [-15.0] and got["raise_samples_ms"] == [5.0]
    assert got["after_change"]["achieved"] == 20.0 and got["after_change"]["window_shares"] == [20.0, 20.0]
    assert got["met"] is True


def test_a_limit_change_without_a_quota_drop_voids_the_sample(tl: ModuleType) -> None:
    with pytest.raises(tl.MeasurementError, match="no DROP_LOCK"):
        tl.limit_change_figures(
            [{"launch": 240 * MS, "return": 260 * MS}],
            [(245 * MS, "tq")],
            [],
            _busy_then_throttled(tl),
            (1000 * MS, 2000 * MS),
            1000 * MS,
        )


# --- the kernel's size --------------------------------------------------------------------------


def test_calibration_takes_the_size_in_range_nearest_the_middle(workers: ModuleType) -> None:
    assert workers.calibration_step({1024: 0.3, 2048: 1.5, 3072: 3.4, 4096: 8.0}) == workers.Chosen(3072, 3.4)
    assert workers.calibration_step({2048: 2.1, 2560: 3.6, 3072: 4.9}) == workers.Chosen(2560, 3.6)


def test_with_nothing_in_range_it_tries_a_size_strictly_between_by_the_cube_law(workers: ModuleType) -> None:
    # 4096 at 9.8 ms is nearer 3.5 ms in log time: 4096 * cbrt(3.5 / 9.8) = 2906 -> 2944 (a multiple of 128).
    assert workers.calibration_step({2048: 1.2, 4096: 9.8}) == workers.Try(2944)
    # the cube law would go below 2048; the try stays above what is known to be too fast
    assert workers.calibration_step({2048: 1.99, 2304: 5.1}) == workers.Try(2176)
    assert isinstance(workers.calibration_step({2048: 1.99, 2100: 5.1}), workers.Fail)  # no multiple of 128 between


def test_all_too_slow_tries_smaller_until_the_smallest_size(workers: ModuleType) -> None:
    assert workers.calibration_step({1024: 40.0, 2048: 300.0}) == workers.Try(512)  # 1024 * cbrt(3.5/40) = 454
    failed = workers.calibration_step({256: 7.0, 1024: 40.0})
    assert isinstance(failed, workers.Fail) and "all too slow" in failed.reason


def test_all_too_fast_tries_larger_until_memory_stops_it(workers: ModuleType) -> None:
    assert workers.calibration_step({8192: 1.0}) == workers.Try(12416)  # 8192 * cbrt(3.5) = 12438
    failed = workers.calibration_step({8192: 0.4, 16384: 1.5}, max_size=16384)
    assert isinstance(failed, workers.Fail) and "all too fast" in failed.reason
    assert workers.calibration_step({8192: 0.1}, max_size=12288) == workers.Try(12288)


def test_timings_that_shrink_as_the_size_grows_are_refused(workers: ModuleType) -> None:
    failed = workers.calibration_step({2048: 6.0, 4096: 1.0})
    assert isinstance(failed, workers.Fail) and "do not grow" in failed.reason
    assert workers.monotone({1024: 0.2, 2048: 1.0}) and not workers.monotone({1024: 1.2, 2048: 1.0})
    assert workers.calibration_step({}) == workers.Fail("nothing measured")


@pytest.mark.parametrize("ms_at_8192", [0.3, 1.6, 12.0, 40.0])
def test_calibration_converges_on_a_gpu_whose_time_grows_as_the_cube(workers: ModuleType, ms_at_8192: float) -> None:
    """The parent's loop (gpu_workers.calibrate) against a GPU whose kernel time is a cube of the size plus a
    launch cost, from a fast H100-like one to a slow one: a 2-5 ms size within the loop's rounds."""

    def kernel_ms(n: int) -> float:
        return 0.01 + ms_at_8192 * (n / 8192) ** 3

    timings: dict[int, float] = {}
    for n in workers.LADDER:  # the ladder stops after the first size over 5 ms, as the worker does
        timings[n] = kernel_ms(n)
        if timings[n] > workers.KERNEL_MS[1]:
            break
    for _ in range(workers.CALIBRATION_ROUNDS):
        step = workers.calibration_step(timings)
        if isinstance(step, workers.Chosen):
            break
        assert isinstance(step, workers.Try) and step.size not in timings
        timings[step.size] = kernel_ms(step.size)
    step = workers.calibration_step(timings)
    assert isinstance(step, workers.Chosen) and 2.0 <= step.ms <= 5.0 and step.size % 128 == 0


def test_the_largest_size_keeps_three_matrices_within_an_eighth_of_memory(workers: ModuleType) -> None:
    assert workers.max_side(16 * 2**30) == 18816  # isqrt(16 GiB / 48) = 18918
    assert 3 * 2 * 18816**2 <= 16 * 2**30 / 8
    assert workers.max_side(80 * 2**30) == workers.LADDER[-1]


def test_the_cuda_device_is_found_by_nvml_uuid(workers: ModuleType) -> None:
    uuids = ["0b42632a-bc5c-f731-724b-6936a19c4b24", "58F4AAAA-0000-1111-2222-333344445555"]
    assert workers.match_device(uuids, "GPU-58f4aaaa-0000-1111-2222-333344445555") == 1
    assert workers.match_device([None], "GPU-x") == 0  # no UUIDs shown: the one device left visible
    with pytest.raises(LookupError, match="GPU-x"):
        workers.match_device([None, None], "GPU-x")  # which of two? no guess
    with pytest.raises(LookupError):
        workers.match_device(uuids, "GPU-ffff")


# --- the report -----------------------------------------------------------------------------------


def test_the_daemon_must_report_the_real_gpu_nvml_sees(tl: ModuleType) -> None:
    nvml = {"name": "Tesla T4", "uuid": "GPU-1", "memory_total_bytes": 15_843_721_216}
    assert tl.nvml_mismatches({**nvml, "simulated": False, "index": 0}, nvml) == []
    wrong = tl.nvml_mismatches({**nvml, "simulated": True, "memory_total_bytes": 16 * 2**30}, nvml)
    assert wrong[0] == "the daemon runs on a simulated GPU" and wrong[1].startswith("memory_total_bytes:")
    assert len(tl.nvml_mismatches({}, nvml)) == 4


def _session(limit: int, achieved: float, kps: float, session: str = "a") -> dict[str, Any]:
    return {
        "session": session,
        "limit": limit,
        "achieved": achieved,
        "error_pp": round(achieved - limit, 3) if limit < 100 else None,
        "kernels_per_s": kps,
        "idle_in_holds_pp": 0.01,
    }


def _result(tl: ModuleType) -> dict[str, Any]:
    runs = [
        {"name": "single-25", "mode": "serial", "sessions": [_session(25, 24.6, 70.0)]},
        {"name": "mix-25+75", "mode": "serial", "sessions": [_session(25, 24.5, 69.0), _session(75, 73.0, 207.0, "b")]},
        {
            "name": "concurrent-50",
            "mode": "concurrent",
            "sessions": [_session(50, 49.0, 120.0), _session(100, 51.0, 125.0, "b")],
        },
        {"name": "unlimited-alone", "mode": "serial", "sessions": [_session(100, 99.5, 280.0)]},
    ]
    nvml = {"name": "Tesla T4", "uuid": "GPU-1", "memory_total_bytes": 15_843_721_216, "index": 0, "driver": "x"}
    kernel = {"size": 4096, "ms": 3.4, "what": "fp16 matmul 4096x4096"}
    limit_update = {
        "max_ms": -12.5,
        "median_ms": -20.0,
        "drop_max_ms": -30.0,
        "target_ms": 100.0,
        "reference_ms": 5000.0,
        "met": True,
        "flags": [],
        "after_change": {"achieved": 19.8, "window_shares": [19.7, 19.9]},
    }
    result: dict[str, Any] = tl.report(nvml, kernel, runs, limit_update)
    return result


def test_the_report_compares_throughput_with_the_process_alone(tl: ModuleType) -> None:
    scenarios = _result(tl)["scenarios"]
    assert [e["name"] for e in scenarios] == ["single-25", "mix-25+75:a25", "mix-25+75:b75", "concurrent-50"]
    single = scenarios[0]
    assert single["slowdown"] == 4.0 and single["share_of_alone"] == 25.0
    assert (single["reference_achieved"], single["reference_slowdown"]) == (27.0, 3.7)
    assert single["met"] and single["tolerance_pp"] == 1.0
    assert not scenarios[2]["met"] and scenarios[2]["tolerance_pp"] == 1.5  # 73.0 for 75: 2 pp off
    assert scenarios[3]["unlimited_beside_achieved"] == 51.0


def test_the_json_leads_with_the_figures_asked_for_and_its_table_shows_them(tl: ModuleType) -> None:
    result = json.loads(json.dumps(_result(tl)))
    assert list(result)[:4] == ["gpu", "scenarios", "limit_update_ms", "nvml"]
    assert result["gpu"] == "Tesla T4" and result["limit_update_ms"] == -12.5
    assert result["nvml"] == {"name": "Tesla T4", "uuid": "GPU-1", "memory_total_bytes": 15_843_721_216}
    for e in result["scenarios"]:
        assert {"name", "target", "achieved", "error_pp", "slowdown"} <= set(e)
    assert result["met_all"] is False
    text = tl.table(result)
    assert "single-25" in text and "27.0 % (3.70x)" in text and "4.00x" in text and "-0.40 pp" in text
    assert "mix-25+75:b75" in text and "NO" in text.splitlines()[4]
    assert "unlimited, alone" in text and "max -12.5 ms" in text


# --- the benchmark as a process ------------------------------------------------------------------


def _gpu_here() -> bool:
    probe = (
        "import sys; sys.path.insert(0, 'bench'); import gpu_quota as g; n = g.read_nvml(0); "
        "print(not isinstance(n, str) and g.torch_missing() is None)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return out.stdout.strip() == "True"


def test_the_modules_import_without_torch_or_nvml() -> None:
    code = (
        "import sys; sys.path.insert(0, 'bench'); import gpu_quota, gpu_timeline, gpu_workers; "
        "print(sorted(m for m in ('torch', 'pynvml') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0_with_the_empty_json(tl: ModuleType) -> None:
    if _gpu_here():
        pytest.skip("this machine has a GPU and PyTorch with CUDA: the no-GPU path cannot be shown here")
    out = subprocess.run(
        [sys.executable, str(BENCH / "gpu_quota.py"), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and "no GPU" in lines[0], out.stdout
    assert json.loads(lines[-1]) == {"gpu": None, "scenarios": [], "limit_update_ms": None, "nvml": None}
    assert json.loads(lines[-1]) == tl.NO_GPU
    assert "Traceback" not in out.stderr
    plain = subprocess.run(
        [sys.executable, str(BENCH / "gpu_quota.py")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0 and plain.stdout.splitlines() == lines[:1]
