"""bench/run_share.py: the arithmetic on what its programs and gpud-run's traces record, on records
built by hand (answers worked out on paper), and the benchmark run once, short, as a real process.

bench/ is no package: the module is loaded from its file, with bench/ on sys.path for its own imports
(harness, percentiles, quota_workers). Times are integer nanoseconds on one clock, as the programs'
``time.monotonic_ns()`` and the traces' ``t`` are.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
MS, S = 1_000_000, 1_000_000_000


@pytest.fixture
def rs(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("run_share")


def record(rs: ModuleType, start: int, *ends: int, cpu: list[int] | None = None) -> Any:
    """A burn record with its CPU time: by default, as if it ran the whole time since its start."""
    t = [start, *ends]
    used = cpu if cpu is not None else [x - start for x in t]
    return rs.Record.read(array("q", [v for pair in zip(t, used) for v in pair]).tobytes())


def ev(t: int, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


# --- progress -----------------------------------------------------------------------------------


def test_work_done_by_a_time_counts_the_chunks_ended_at_or_before_it(rs: ModuleType) -> None:
    r = record(rs, 0, 10, 20, 30, 40)
    assert [r.chunks_by(t) for t in (-5, 0, 9, 10, 11, 40, 99)] == [0, 0, 0, 1, 1, 4, 4]
    assert record(rs, 10, 10, 20).chunks_by(10) == 1  # the start stamp is no chunk


def test_cpu_time_by_a_time_is_the_last_stamps(rs: ModuleType) -> None:
    r = record(rs, 100, 110, 120, cpu=[5, 15, 25])
    assert [r.cpu_by(t) for t in (50, 100, 109, 110, 500)] == [5, 5, 5, 15, 25]


def test_progress_is_the_work_in_the_interval_over_what_the_program_does_alone_in_as_long(rs: ModuleType) -> None:
    # A chunk every ms while it runs, paused from 100 to 400 ms: 200 chunks in [0, 500 ms).
    ends = [t * MS for t in range(1, 101)] + [t * MS for t in range(401, 501)]
    cpu = [0] + [t * MS for t in range(1, 101)] + [(t - 300) * MS for t in range(401, 501)]
    r = record(rs, 0, *ends, cpu=cpu)
    alone = rs.Alone(per_s=1000.0, per_cpu_s=1000.0, cpu_percent=100.0)
    assert rs.progress_percent(r, 0, 500 * MS, alone) == pytest.approx(40.0)
    assert rs.progress_percent(r, 100 * MS, 400 * MS, alone) == 0.0
    assert rs.cpu_percent(r, 0, 500 * MS) == pytest.approx(40.0)  # it used the CPU 200 ms of 500
    assert rs.speed_percent(r, 0, 500 * MS, alone) == pytest.approx(100.0)
    twice = rs.Alone(per_s=2000.0, per_cpu_s=2000.0, cpu_percent=100.0)  # alone it goes twice as fast
    assert rs.progress_percent(r, 0, 500 * MS, twice) == pytest.approx(20.0)
    assert rs.cpu_percent(r, 0, 500 * MS) == pytest.approx(40.0)  # what it got does not depend on that
    assert rs.speed_percent(r, 0, 500 * MS, twice) == pytest.approx(50.0)
    assert rs.speed_percent(r, 150 * MS, 350 * MS, twice) is None  # no CPU used: no speed


def test_the_rate_alone_leaves_the_start_up_out(rs: ModuleType) -> None:
    # Slow for the first 300 ms (a chunk per 10 ms), then a chunk per ms until 1300 ms, on the CPU 80 % of it.
    ends = [t * 10 * MS for t in range(1, 31)] + [300 * MS + t * MS for t in range(1, 1001)]
    r = record(rs, 0, *ends, cpu=[0] + [round(0.8 * x) for x in ends])
    alone = rs.Alone.of(r, 300 * MS)
    assert alone.per_s == pytest.approx(1000.0)
    assert alone.per_cpu_s == pytest.approx(1250.0) and alone.cpu_percent == pytest.approx(80.0)
    assert rs.Alone.of(r, 0).per_s < 1000.0
    assert rs.Alone.mean(alone, rs.Alone(500.0, 750.0, 100.0)) == rs.Alone(750.0, 1000.0, 90.0)


def test_a_record_without_chunks_or_a_calibration_too_short_is_refused(rs: ModuleType) -> None:
    with pytest.raises(rs.MeasurementError, match="did no work"):
        rs.Record.read(array("q", [5, 0]).tobytes())
    with pytest.raises(rs.MeasurementError, match="too short"):
        rs.Alone.of(record(rs, 0, 10, 20), 15)
    r = record(rs, 1, 2, 3, cpu=[7, 8, 9])
    assert (list(r.t), list(r.cpu)) == ([1, 2, 3], [7, 8, 9])


def test_the_interval_starts_on_a_window_boundary_after_the_warm_up(rs: ModuleType) -> None:
    # Windows of 500 from 100: the last program started at 1234; 2 windows later is 2234 -> 2600.
    assert rs.interval(100, 500, 1234, 2, 4) == (2600, 4600)
    assert rs.interval(100, 500, 1100, 2, 1) == (2100, 2600)  # on a boundary already: that one


# --- traces ---------------------------------------------------------------------------------------


TRACE = [
    ev(0, "granted"),
    ev(1 * MS, "start"),
    ev(100 * MS, "drop"),
    ev(101 * MS, "pause", detail="the daemon asked for the lock (DROP_LOCK)"),
    ev(103 * MS, "release"),
    ev(300 * MS, "granted"),
    ev(300 * MS + 200_000, "resume"),
    ev(400 * MS, "drop"),  # acted on: pause and release follow
    ev(400 * MS + 500_000, "pause"),
    ev(401 * MS, "release"),
    ev(402 * MS, "drop"),  # a second DROP_LOCK while not holding: nothing follows it
    ev(600 * MS, "granted"),
    ev(600 * MS + 300_000, "resume"),
    ev(900 * MS, "exited", value=0),
]


def test_every_drop_acted_on_gives_its_pause_and_release_latency(rs: ModuleType) -> None:
    assert rs.pause_latencies(TRACE) == [(1 * MS, 3 * MS), (500_000, 1 * MS)]


def test_a_pause_without_a_release_before_the_next_grant_gives_no_sample(rs: ModuleType) -> None:
    trace = [ev(0, "drop"), ev(1 * MS, "pause"), ev(5 * MS, "granted"), ev(6 * MS, "release")]
    assert rs.pause_latencies(trace) == []


def test_holds_run_from_each_grant_to_its_release_and_are_counted_by_when_they_began(rs: ModuleType) -> None:
    assert rs.holds(TRACE) == [103 * MS, 101 * MS]  # the last turn was never given back
    assert rs.holds(TRACE, 200 * MS, 500 * MS) == [101 * MS]
    assert rs.first_t(TRACE, "resume") == 300 * MS + 200_000
    assert rs.first_t(TRACE, "resume", after=400 * MS) == 600 * MS + 300_000
    assert rs.first_t(TRACE, "park") is None


def test_a_trace_file_is_read_line_by_line_in_its_order(rs: ModuleType) -> None:
    text = "".join(json.dumps(r) + "\n" for r in TRACE[:3]) + "\n"
    assert rs.parse_trace(text) == TRACE[:3]


def test_latency_figures_are_nearest_rank_in_ms(rs: ModuleType) -> None:
    got = rs.spread_ms([x * MS for x in range(1, 101)])
    assert got == {"p50": 50.0, "p99": 99.0, "max": 100.0}
    assert rs.spread_ms([]) is None
    pauses = rs.pause_figures([(1 * MS, 3 * MS), (500_000, 1 * MS)])
    assert pauses["drops"] == 2 and pauses["drop_to_pause_ms"]["p50"] == 0.5
    assert pauses["met"] is True  # p50 of the releases: 1 ms
    assert rs.pause_figures([(1 * MS, 3 * MS)])["met"] is False
    assert rs.pause_figures([]) is None


# --- the host ------------------------------------------------------------------------------------


def test_host_figures_come_from_two_reads_of_proc_stat(rs: ModuleType) -> None:
    before = [100, 0, 50, 800, 50, 0, 0, 0]
    after = [250, 0, 100, 950, 50, 0, 0, 50]  # 400 ticks: 200 user+system, 150 idle, 50 stolen
    assert rs.busy_percent(before, after) == {"busy": 62.5, "steal": 12.5}
    assert len(rs.cpu_times()) == 8


def test_drift_is_the_largest_change_between_consecutive_calibrations(rs: ModuleType) -> None:
    assert rs.drift_percent([1000.0, 1010.0, 960.0]) == pytest.approx(4.95, abs=0.01)
    assert rs.drift_percent([1000.0]) == 0.0


# --- a scenario's figures -------------------------------------------------------------------------


def test_a_scenario_reports_the_bill_the_progress_and_the_cpu_time_against_the_limit(rs: ModuleType) -> None:
    cfg = rs.BenchConfig(windows=2, window_s=1.0)
    # 300 chunks a window, one per ms of CPU, at 1000 chunks/s alone: 30 %; the daemon billed 25.4 %
    # for a limit of 25, and the program used the CPU for 25 % of each window (the host ran fast).
    ends = [w * S + t * MS for w in range(3) for t in range(1, 301)]
    cpu = [0] + [w * 250 * MS + round(t * MS * 250 / 300) for w in range(3) for t in range(1, 301)]
    view = SimpleNamespace(recent_share_percent=25.4, grants=2, drops={"quota": 2}, throttles=2)
    raw = {
        "name": "single-25",
        "limits": (25,),
        "start": 0,
        "end": 2 * S,
        "sessions": [view],
        "records": [record(rs, 0, *ends, cpu=cpu)],
        "host": {"busy": 40.0, "steal": 0.5},
        "wall_s": 9.0,
    }
    got = rs.share_figures(raw, cfg, rs.Alone(per_s=1000.0, per_cpu_s=1000.0, cpu_percent=100.0))
    run = got["runs"][0]
    assert run["billed_percent"] == 25.4 and run["billed_error_pp"] == pytest.approx(0.4)
    assert run["progress_percent"] == pytest.approx(30.0) and run["progress_error_pp"] == pytest.approx(5.0)
    assert run["cpu_percent"] == pytest.approx(25.0) and run["cpu_error_pp"] == pytest.approx(0.0)
    assert run["speed_percent"] == pytest.approx(120.0)
    assert (run["billed_met"], run["progress_met"], run["cpu_met"], run["tolerance_pp"]) == (True, False, True, 1.0)
    assert (run["progress_window_min"], run["progress_window_max"], run["chunks"]) == (30.0, 30.0, 600)
    assert (run["cpu_window_min"], run["cpu_window_max"]) == (25.0, 25.0)
    assert got["host_busy_percent"] == 40.0 and got["alone_per_s"] == 1000.0


def test_the_idle_runs_cost_is_the_neighbours_share_alone_less_its_share_beside_it(rs: ModuleType) -> None:
    cfg = rs.BenchConfig(tq_s=1.0, idle_release_s=0.2, phase_s=2.0)
    # The neighbour: every ms of [0, 2 s) alone, then from 3 s on 800 ms in each second.
    beside = [3 * S + k * S + t * MS for k in range(2) for t in range(1, 801)]
    ends = [t * MS for t in range(1, 2001)] + beside
    cpu = [0] + [t * MS for t in range(1, 2001)] + [2 * S + i * MS for i in range(1, 1601)]
    idle = [ev(3 * S + 800 * MS, "granted"), ev(3 * S + 1000 * MS, "release")]
    idle += [ev(4 * S + 800 * MS, "granted"), ev(4 * S + 990 * MS, "release")]
    raw = {
        "alone": (0, 2 * S),
        "beside": (3 * S, 5 * S),
        "record": record(rs, 0, *ends, cpu=cpu),
        "idle_trace": idle,
        "busy_trace": [],
        "idle_held_ms": 390.0,
        "host": {"busy": 55.0, "steal": 0.0},
        "wall_s": 8.0,
    }
    got = rs.idle_figures(raw, cfg, rs.Alone(per_s=1000.0, per_cpu_s=1000.0, cpu_percent=100.0))
    assert (got["neighbour_alone_percent"], got["neighbour_beside_idle_percent"]) == (100.0, 80.0)
    assert (got["neighbour_alone_cpu_percent"], got["neighbour_beside_idle_cpu_percent"]) == (100.0, 80.0)
    assert got["cost_pp"] == got["cost_cpu_pp"] == 20.0 and got["bound_pp"] == 20.0
    assert got["within_bound"] is True and got["within_bound_cpu"] is True
    assert got["idle_turns"] == 2 and got["idle_hold_ms"] == {"p50": 190.0, "p99": 200.0, "max": 200.0}
    assert got["daemon_idle_held_percent"] == 19.5 and got["neighbour_hold_ms"] is None


# --- the benchmark as a process ------------------------------------------------------------------
