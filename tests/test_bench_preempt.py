"""bench/preempt.py: the arithmetic on what its victims, gpud-run's trace and the burner record, on
records built by hand (answers worked out on paper), its report, and the in-process planning on a
small ledger.

bench/ is no package: the module is loaded from its file, with bench/ on sys.path for its own imports
(preempt_plan, preempt_runs, harness, percentiles, run_share and theirs). Times are integer
nanoseconds on one clock, as the victims' and the trace's stamps are.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

MS = 1_000_000


@pytest.fixture
def pr(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("preempt")


# --- statistics --------------------------------------------------------------------------------------


def test_spread_is_nearest_rank_p50_p95_and_max(pr: ModuleType) -> None:
    assert pr.spread([float(x) for x in range(1, 101)]) == {"n": 100, "p50": 50.0, "p95": 95.0, "max": 100.0}
    assert pr.spread([3.14159, 1.0], digits=2) == {"n": 2, "p50": 1.0, "p95": 3.14, "max": 3.14}
    assert pr.spread([]) is None


# --- time to grant -----------------------------------------------------------------------------------


def victim(**seen: Any) -> dict[str, Any]:
    return {"held": 0, "gpus": [1], **seen}


LEFT = [
    victim(preempt_t=2 * MS, grace_s=2.0, whole=True, left_t=5 * MS),
    victim(preempt_t=3 * MS, grace_s=2.0, whole=True, left_t=4 * MS),
    victim(),  # on the other GPU: not told
    victim(),
]


def test_a_trial_whose_victims_left_times_the_grant_the_notice_and_the_slowest_leaving(pr: ModuleType) -> None:
    got = pr.trial_record(0, 9 * MS, 8.5, LEFT, "free")
    assert got == {
        "grant_ms": 9.0,
        "waited_ms": 8.5,
        "victims": 2,
        "notice_ms": 2.0,  # the first PREEMPT seen
        "leave_ms": 3.0,  # the first victim: 2 -> 5 ms
        "left_to_grant_ms": 4.0,  # the last one left at 5 ms
        "grace_s": 2.0,
    }


def test_a_trial_whose_victims_stayed_has_no_leaving_to_time(pr: ModuleType) -> None:
    stayed = [victim(preempt_t=1 * MS, grace_s=2.0, whole=True, revoked_t=2001 * MS, gone=True), victim()]
    got = pr.trial_record(0, 2003 * MS, 2002.0, stayed, "stay")
    assert (got["grant_ms"], got["victims"], got["leave_ms"], got["left_to_grant_ms"]) == (2003.0, 1, None, None)


@pytest.mark.parametrize(
    ("reports", "mode", "needle"),
    [
        ([victim(), victim()], "free", "no victim told to leave"),
        ([victim(preempt_t=1, grace_s=2.0, withdrawn_t=5)], "free", "withdrawn"),
        ([victim(preempt_t=1, grace_s=2.0)], "yield", "did not say it left"),
        ([victim(preempt_t=1, grace_s=2.0, revoked_t=9, gone=False)], "stay", "not revoked whole"),
        ([victim(preempt_t=1, grace_s=2.0, left_t=2)], "stay", "not revoked whole"),
    ],
)
def test_a_trial_that_contradicts_its_scenario_is_refused(
    pr: ModuleType, reports: list[dict[str, Any]], mode: str, needle: str
) -> None:
    with pytest.raises(pr.MeasurementError, match=needle):
        pr.trial_record(0, 10, 1.0, reports, mode)


def trial(grant_ms: float, **fields: Any) -> dict[str, Any]:
    base = {"waited_ms": grant_ms - 1, "victims": 2, "notice_ms": 0.5, "leave_ms": 1.0, "left_to_grant_ms": 0.5}
    return {"grant_ms": grant_ms, "grace_s": 2.0, **base, **fields}


def test_leaving_victims_meet_the_target_while_every_grant_is_under_a_second(pr: ModuleType) -> None:
    got = pr.grant_figures("leave-free", "free", [trial(5.0), trial(7.0), trial(999.0)], 2.0, 3.2)
    assert got["time_to_grant_ms"] == {"n": 3, "p50": 7.0, "p95": 999.0, "max": 999.0}
    assert got["daemon_waited_ms"]["p50"] == 6.0 and got["preempt_to_left_ms"]["max"] == 1.0
    assert (got["overrun_ms"], got["target_ms"], got["met"], got["victims_per_trial"]) == (None, 1000.0, True, [2])
    assert pr.grant_figures("leave-free", "free", [trial(5.0), trial(1000.0)], 2.0, 1.0)["met"] is False


def test_staying_victims_are_held_to_the_overrun_past_the_grace(pr: ModuleType) -> None:
    stay = [trial(g, leave_ms=None, left_to_grant_ms=None) for g in (2004.0, 2010.0, 2900.0)]
    got = pr.grant_figures("stay", "stay", stay, 2.0, 9.0)
    assert got["overrun_ms"] == {"n": 3, "p50": 10.0, "p95": 900.0, "max": 900.0}
    assert got["preempt_to_left_ms"] is None and got["left_to_grant_ms"] is None
    assert got["met"] is True
    late = [*stay, trial(3000.5, leave_ms=None, left_to_grant_ms=None)]
    assert pr.grant_figures("stay", "stay", late, 2.0, 9.0)["met"] is False  # 1000.5 ms past


# --- planning ------------------------------------------------------------------------------------------


def test_planning_cells_are_held_to_the_p95(pr: ModuleType) -> None:
    cells = [
        {"layout": "x", "gpus": 2, "allocations": 4, "need_gpus": 1.0, "strategy": "newest_first", "victims": 2}
        | {"samples_us": [100.0] * 19 + [5000.0]},  # the slowest of 20 is the p100, not the p95
        {"layout": "x", "gpus": 2, "allocations": 4, "need_gpus": 1.0, "strategy": "lowest_priority", "victims": 2}
        | {"samples_us": [100.0] * 18 + [5000.0] * 2},
    ]
    got = pr.plan_figures(cells, 20, 1.5)
    first, second = got["cells"]
    assert first["advance_us"] == {"n": 20, "p50": 100.0, "p95": 100.0, "max": 5000.0} and first["met"] is True
    assert second["advance_us"]["p95"] == 5000.0 and second["met"] is False
    assert "samples_us" not in first and got["met"] is False and got["target_p95_us"] == 1000.0


def test_the_ledger_plans_victims_for_every_strategy_from_the_same_state(
    pr: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = pr.preempt_plan
    monkeypatch.setattr(plan, "ALLOCATIONS", 16)  # 2 GPUs of eighths, 4 of the mixed layout, 16 whole
    monkeypatch.setattr(plan, "LAYOUTS", {k: plan.LAYOUTS[k] for k in ("eighths", "mixed", "whole")})
    cells = plan.measure(2)
    assert len(cells) == len(plan.LAYOUTS) * len(plan.NEEDS) * 4
    by = {(c["layout"], c["need_gpus"], c["strategy"]): c for c in cells}
    assert by["eighths", 1.0, "newest_first"]["victims"] == 8  # a whole GPU: all eight on one
    assert by["whole", 0.5, "minimum_waste"]["victims"] == 1
    assert all(len(c["samples_us"]) == 2 and c["gpus"] * len(plan.LAYOUTS[c["layout"]]) == 16 for c in cells)
    ledger, now = plan.build(plan.LAYOUTS["mixed"])
    before = sorted(a.task_id for a in ledger.allocations())
    plan.time_planning(ledger, now, plan.UNIT, plan.PreemptStrategy.MINIMUM_VICTIMS, 3)
    assert sorted(a.task_id for a in ledger.allocations()) == before and ledger.waiting() == []


# --- suspend and resume -----------------------------------------------------------------------------


def test_the_progress_file_gives_its_starts_and_stamps_and_only_whole_lines(pr: ModuleType) -> None:
    text = "start 42 0 -\n10.000000 3\n10.005000 8\nsignal 15\nend\n10.010000 1"
    assert pr.parse_progress(text) == (1, [(10_000_000_000, 3), (10_005_000_000, 8)])


def ev(t_ms: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": round(t_ms * MS), "event": event, **fields}


def act(t_ms: float, action: str, **fields: Any) -> dict[str, Any]:
    return {"t": round(t_ms * MS), "action": action, **fields}


TRACE = [
    act(0, "start"),
    ev(101, "preempt", recovery="suspend", whole=True, grace_s=2.0),
    act(102, "pause"),
    ev(104, "revoked", state="suspended", gone=False),
    act(105, "yield"),
    ev(402, "changed", change="resumed"),
    act(406, "resume"),  # stamped late: the program ran at 405 already
]
STAMPS = [(round(t * MS), n) for t, n in [(50, 40), (101.5, 90), (405, 91), (410, 95)]]
CYCLE = {"t0": 100 * MS, "t1": 106 * MS, "freed": 400 * MS}


def test_a_suspend_cycle_is_timed_from_the_trace_and_the_programs_stamps(pr: ModuleType) -> None:
    got = pr.cycle_record(TRACE, STAMPS, CYCLE)
    assert got == {
        "grant_ms": 6.0,
        "paused_ms": 1.0,
        "yield_ms": 4.0,
        "changed_ms": 2.0,
        "resume_ms": 6.0,
        "running_ms": 5.0,  # its first stamp after the ALLOC_CHANGED, before the resume's own stamp
        "suspended_ms": 300.0,
        "still": True,
        "went_on": True,
        "revoked_suspended": True,
    }


def test_a_program_that_ran_while_suspended_or_started_over_is_caught(pr: ModuleType) -> None:
    ran = pr.cycle_record(TRACE, [*STAMPS[:2], (200 * MS, 92), *STAMPS[2:]], CYCLE)
    assert ran["still"] is False
    restarted = pr.cycle_record(TRACE, [*STAMPS[:2], (405 * MS, 1), (410 * MS, 5)], CYCLE)
    assert restarted["went_on"] is False
    gone = [*TRACE[:3], ev(104, "revoked", state="running", gone=True), *TRACE[4:]]
    assert pr.cycle_record(gone, STAMPS, CYCLE)["revoked_suspended"] is False
    with pytest.raises(pr.MeasurementError, match="lacks"):
        pr.cycle_record(TRACE[:5], STAMPS, CYCLE)  # never resumed


def test_suspend_figures_are_met_only_when_every_check_holds(pr: ModuleType) -> None:
    cycle = pr.cycle_record(TRACE, STAMPS, CYCLE)
    got = pr.suspend_figures([cycle, cycle], 1, [40, 90, 91, 95], 2.0, 3.0)
    assert got["preempt_to_paused_ms"] == {"n": 2, "p50": 1.0, "p95": 1.0, "max": 1.0}
    assert got["freed_to_running_ms"]["max"] == 5.0 and got["parked_bytes"] is None
    assert (got["progress_continued"], got["still_while_suspended"], got["revoked_suspended"], got["met"]) == (
        True,
        True,
        True,
        True,
    )
    assert pr.suspend_figures([cycle], 2, [40, 90], 2.0, 3.0)["met"] is False  # started twice
    assert pr.suspend_figures([cycle], 1, [40, 90, 3], 2.0, 3.0)["progress_continued"] is False
    assert pr.suspend_figures([], 1, [], 2.0, 3.0)["met"] is False


# --- the report ------------------------------------------------------------------------------------------


def result(pr: ModuleType) -> dict[str, Any]:
    cycle = pr.cycle_record(TRACE, STAMPS, CYCLE)
    cells = [
        {"layout": "eighths", "gpus": 125, "allocations": 1000, "need_gpus": 1.0, "strategy": s, "victims": 8}
        | {"samples_us": [900.0, 1200.0]}
        for s in ("lowest_priority", "newest_first")
    ]
    grant = [
        pr.grant_figures("leave-free", "free", [trial(5.0)], 2.0, 1.0),
        pr.grant_figures("stay", "stay", [trial(2004.0, leave_ms=None, left_to_grant_ms=None)], 2.0, 3.0),
    ]
    return {
        "grant": grant,
        "plan": pr.plan_figures(cells, 2, 1.0),
        "suspend": pr.suspend_figures([cycle], 1, [40, 90, 91, 95], 2.0, 3.0),
        "gpu": None,
        "gpu_why": "NVML: NVML Shared Library Not Found",
        "gpu_note": pr.GPU_NOTE,
        "met_all": False,
        "targets": pr.TARGETS,
        "config": pr.asdict(pr.BenchConfig()),
        "cpus": 2,
        "loadavg_1m_before": 0.5,
        "loadavg_1m_after": 0.7,
        "elapsed_s": 60.0,
    }


def test_the_table_shows_each_figure_beside_its_target_and_whether_it_was_met(pr: ModuleType) -> None:
    lines = pr.table(result(pr)).splitlines()
    free = next(line for line in lines if line.startswith("leave-free"))
    assert "5.0 / 5.0 / 5.0" in free and "max < 1000 ms" in free and free.endswith("yes")
    stay = next(line for line in lines if line.startswith("stay"))
    assert "4.0 / 4.0 / 4.0" in stay and "max overrun <= 1000 ms" in stay and stay.endswith("yes")
    eighths = next(line for line in lines if line.startswith("eighths"))
    assert eighths.split()[:3] == ["eighths", "125", "1"] and eighths.count("1200 (8v) NO") == 2
    assert any("target p95 <= 1000 us" in line for line in lines)
    assert any("PREEMPT -> paused 1.00 / 1.00 / 1.00" in line for line in lines)
    assert any("started once, progress kept: yes" in line for line in lines)
    assert lines[-2].startswith("GPU: none (NVML: NVML Shared Library Not Found); the signal backend parks no")
    assert lines[-1] == "2 CPUs, load 0.5 before, 0.7 after, took 60.0 s; all met: False"


def test_a_part_left_out_is_left_out_of_the_table(pr: ModuleType) -> None:
    only_plan = result(pr) | {"grant": [], "suspend": None}
    text = pr.table(only_plan)
    assert "time to grant" not in text and "suspend and resume" not in text and "victim selection" in text


def test_arguments_choose_the_parts_the_repetitions_and_the_grace(pr: ModuleType) -> None:
    cfg, chosen, as_json = pr.parse_args([])
    assert (cfg, chosen, as_json) == (pr.BenchConfig(), ["grant", "plan", "suspend"], False)
    cfg, chosen, as_json = pr.parse_args(["--quick", "--json", "--only", "plan, suspend", "--grace", "1.5"])
    assert (cfg.leave_trials, cfg.grace_s, chosen, as_json) == (pr.QUICK.leave_trials, 1.5, ["plan", "suspend"], True)
    with pytest.raises(SystemExit):
        pr.parse_args(["--only", "grant,nap"])
    with pytest.raises(SystemExit):
        pr.parse_args(["--grace", "0"])
