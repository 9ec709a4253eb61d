"""``bench/preempt.py --quick --json`` runs end to end and reports every figure under its key.

Here rather than beside the benchmark's pure parts (tests/test_bench_preempt.py): it starts real
daemons, victim processes and a ``gpud-run`` for about 30 s, which ``make test-fast`` does not wait
for. Only what must hold on any machine, however loaded, is asserted of the figures: a grace is never
cut short, and a suspended program keeps its progress; the targets are the benchmark's to report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SPREAD = {"n", "p50", "p95", "max"}
GRANT_KEYS = {"name", "mode", "trials", "victims_per_trial", "grace_s", "time_to_grant_ms", "daemon_waited_ms"}
GRANT_KEYS |= {"request_to_preempt_ms", "preempt_to_left_ms", "left_to_grant_ms", "overrun_ms", "target_ms", "met"}
CELL_KEYS = {"layout", "gpus", "allocations", "need_gpus", "strategy", "victims", "advance_us", "met"}
SUSPEND_KEYS = {"via", "cycles", "grace_s", "request_to_grant_ms", "preempt_to_paused_ms", "preempt_to_yield_ms"}
SUSPEND_KEYS |= {"freed_to_changed_ms", "freed_to_resume_ms", "freed_to_running_ms", "suspended_ms", "starts"}
SUSPEND_KEYS |= {"progress_continued", "still_while_suspended", "revoked_suspended", "parked_bytes", "met"}


def test_a_quick_run_reports_every_figure_under_its_key_and_exits_0() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "preempt.py"), "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert {"grant", "plan", "suspend", "gpu", "gpu_why", "gpu_note", "met_all", "targets", "config"} <= set(result)
    assert {"cpus", "loadavg_1m_before", "loadavg_1m_after", "elapsed_s"} <= set(result)
    assert [g["name"] for g in result["grant"]] == ["leave-free", "leave-yield", "stay"]
    for g in result["grant"]:
        assert GRANT_KEYS <= set(g)
        assert set(g["time_to_grant_ms"]) == SPREAD and g["trials"] == g["time_to_grant_ms"]["n"]
        assert g["victims_per_trial"] == [2]  # the two halves of one GPU make room for a whole one
    stay = result["grant"][2]
    assert stay["preempt_to_left_ms"] is None and stay["overrun_ms"]["p50"] >= 0  # never granted before the grace
    plan = result["plan"]
    assert len(plan["cells"]) == 5 * 2 * 4 and all(CELL_KEYS <= set(c) for c in plan["cells"])
    assert all(c["allocations"] == 1000 and c["victims"] >= 1 for c in plan["cells"])
    suspend = result["suspend"]
    assert SUSPEND_KEYS <= set(suspend) and suspend["cycles"] == 3
    assert (suspend["starts"], suspend["progress_continued"], suspend["still_while_suspended"]) == (1, True, True)
    assert suspend["revoked_suspended"] is True and suspend["parked_bytes"] is None
    if result["gpu"] is None:
        assert result["gpu_why"]
