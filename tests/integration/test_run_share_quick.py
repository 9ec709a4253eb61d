"""``bench/run_share.py --quick --json`` runs end to end and reports every figure under its key.

Here rather than beside the benchmark's pure parts (tests/test_bench_run_share.py): it starts real
daemons and real runs for about 40 s, which ``make test-fast`` does not wait for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCENARIO_KEYS = {"name", "limits", "windows", "window_s", "wall_s", "alone_per_s", "host_busy_percent", "runs"}
RUN_KEYS = {"run", "limit", "billed_percent", "billed_error_pp", "progress_percent", "progress_error_pp"}
RUN_KEYS |= {"cpu_percent", "cpu_error_pp", "speed_percent", "tolerance_pp", "billed_met", "progress_met", "cpu_met"}
RUN_KEYS |= {"grants", "drops", "chunks"}
IDLE_KEYS = {"tq_s", "idle_release_s", "neighbour_alone_percent", "neighbour_beside_idle_percent", "cost_pp"}
IDLE_KEYS |= {"neighbour_alone_cpu_percent", "neighbour_beside_idle_cpu_percent", "cost_cpu_pp", "bound_pp"}
IDLE_KEYS |= {"within_bound", "within_bound_cpu", "idle_turns", "idle_hold_ms", "daemon_idle_held_percent"}


def test_a_quick_run_reports_every_figure_under_its_key_and_exits_0() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run_share.py"), "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert {"scenarios", "pause_latency", "idle_release", "calibration", "met_all", "targets", "config"} <= set(result)
    assert {"cpus", "loadavg_1m_before", "loadavg_1m_after", "elapsed_s"} <= set(result)
    assert [sc["name"] for sc in result["scenarios"]] == [
        "single-25",
        "single-50",
        "single-75",
        "mix-25+75",
        "mix-30+60",
    ]
    for sc in result["scenarios"]:
        assert SCENARIO_KEYS <= set(sc)
        assert [r["limit"] for r in sc["runs"]] == sc["limits"]
        for run in sc["runs"]:
            assert RUN_KEYS <= set(run)
    assert {"drops", "drop_to_pause_ms", "drop_to_release_ms", "target_p50_ms", "met"} <= set(result["pause_latency"])
    assert set(result["pause_latency"]["drop_to_pause_ms"]) == {"p50", "p99", "max"}
    assert IDLE_KEYS <= set(result["idle_release"])
    calibration = {"seconds", "rates_per_s", "rates_per_cpu_s", "cpu_percent", "drift_max_percent", "host_busy_percent"}
    assert calibration <= set(result["calibration"])
    assert len(result["calibration"]["rates_per_s"]) == 7  # before the first scenario and after each
