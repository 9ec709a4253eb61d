"""Every benchmark's ``main`` runs to its end, the quickest way it has, and its ``--json`` carries the keys
that docs/benchmarks.md reads its figures from (and the machine record of bench/harness.py).

Only the shape is checked, never a figure: these runs are far too short to measure anything, and on
a loaded 2-core machine any figure may be anything. What is asserted of values holds however slow the
host is: what was asked for (sizes, scenarios, counts) is what is reported, every target has its
verdict, the daemon survived.

A benchmark's ``main(argv)`` runs in this process, its daemons then forked from it (tests/conftest.py),
but handoff.py runs as a script: its 64 worker processes are quick to start only from a forkserver that
preloaded what they import, and in this process the forkserver is the one the first test here started.
Some benchmarks are run elsewhere, longer or on their own: ``ELSEWHERE`` names where, and a test
checks that every script in bench/ with a ``__main__`` is run somewhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpud.main import SLOW_TURN_ENV

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MACHINE = {"cpus", "loadavg_1m_before", "loadavg_1m_after", "elapsed_s"}  # harness.Run.machine()

# The benchmarks run end to end by other tests, and the programs a benchmark runs as its workers (run
# with it).
ELSEWHERE = {
    "preempt": "tests/integration/test_preempt_quick.py",
    "run_share": "tests/integration/test_run_share_quick.py",
    "gpu_quota": "tests/test_bench_gpu_quota.py",  # without a GPU: one line, the empty JSON, exit 0
    "gpu_run": "tests/test_bench_gpu_run.py",
}
WORKERS = {"preempt_victim": "preempt", "run_programs": "run_share", "scale_allocs": "scale"}
RUN_HERE = {"ledger_ops", "quota_accuracy", "handoff", "alloc", "abuse", "arbiter_mix", "scale", "soak", "k8s_prepare"}

Run = Callable[..., dict[str, Any]]


@pytest.fixture
def run_main(
    load_bench: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Run:
    """``bench/NAME.py ARGS --json`` in this process: its exit status is 0 and its last line of output
    is the JSON object, which is returned, and from which its table is made as well (``readable``)."""
    # A worker process started by multiprocessing runs the main module again before its target: pytest's,
    # in a run without xdist (whose workers have none), hundreds of times over in arbiter_mix.py.
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__spec__", None, raising=False)
    monkeypatch.delattr(main, "__file__", raising=False)

    def run(name: str, *args: str) -> dict[str, Any]:
        module = load_bench(name)
        status = module.main([*args, "--json"])
        out = capsys.readouterr().out
        assert status == 0, out
        result: dict[str, Any] = json.loads(out.splitlines()[-1])
        readable(module, result)
        return result

    return run


def run_script(name: str, *args: str, timeout_s: float = 150) -> dict[str, Any]:
    """``bench/NAME.py ARGS --json`` as a process of its own, as a reader runs it."""
    out = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def readable(module: ModuleType, result: dict[str, Any]) -> None:
    """The table the script prints without --json is made from the result (as decoded from its JSON)."""
    if hasattr(module, "table"):
        assert module.table(result).strip()


def has(keys: Iterable[str], where: dict[str, Any]) -> None:
    missing = sorted(set(keys) - set(where))
    assert not missing, f"missing keys {missing}; there are {sorted(where)}"


def verdicts(result: dict[str, Any], *, named_as_targets: bool = True) -> None:
    """Every target has its verdict, a bool (under the target's own name, unless told otherwise)."""
    assert result["targets"] and all(isinstance(v, bool) for v in result["met"].values())
    assert not named_as_targets or set(result["met"]) >= set(result["targets"])


# --- the benchmarks -------------------------------------------------------------------------------


def test_ledger_ops_reports_every_operation_at_both_sizes(run_main: Run) -> None:
    r = run_main("ledger_ops", "--sizes", "10,100", "--runs", "3")
    assert (r["sizes"], r["runs"]) == ([10, 100], 3)
    has(MACHINE, r["machine"])
    documented = ["release", "allocate", "shell release", "shell allocate", "checkpoint", "get", "notice_of"]
    documented += ["not_preemptible", "waiting", "a whole GPU taken back: choose, tell a batch"]
    documented += ["a whole GPU taken back: the next batch", "gc.collect(), full"]
    has(documented, r["ops"])
    for op in r["ops"].values():
        assert set(op) == {"us_at_10", "us_at_100", "ratio"} and min(op.values()) >= 0


def test_quota_accuracy_prints_its_json_with_each_scenario_beside_the_lone_run(run_main: Run) -> None:
    r = run_main("quota_accuracy", "--windows", "1", "--window", "0.2", "--only", "single-25,unlimited-alone")
    has(["scenarios", "limit_update_ms", "baseline_achieved", "runs", "met_all", "targets", "config"], r)
    has(["host_cold_code_ns", *MACHINE], r)
    assert set(r["host_cold_code_ns"]) == {"before", "after"}
    assert [measured["name"] for measured in r["runs"]] == ["single-25", "unlimited-alone"]
    assert [e["name"] for e in r["scenarios"]] == ["single-25"]  # the lone run is what they are set against
    single = r["scenarios"][0]
    has(["target", "achieved", "error_pp", "tolerance_pp", "met", "slowdown", "gaps_in_holds_pp"], single)
    has(["error_with_gaps_counted_pp", "reference_achieved"], single)
    assert single["target"] == 25 and isinstance(single["met"], bool)
    if r["baseline_achieved"] > 0:  # in one short window a loaded host may give a session nothing at all
        has(["share_of_alone", "error_vs_alone_pp", "slowdown_vs_alone"], single)
    assert r["limit_update_ms"] is None and "limit_update" not in r  # not asked for
    assert r["config"]["windows"] == 1 and r["config"]["window_s"] == 0.2
    for measured in r["runs"]:
        for session in measured["sessions"]:
            has(["limit", "achieved", "window_share_min", "window_share_max", "daemon"], session)


def test_handoff_reports_both_harnesses_against_both_floors(load_bench: Callable[[str], ModuleType]) -> None:
    # Rounds enough that one client's late start (a loaded host) cannot leave the lock idle at every handoff.
    r = run_script("handoff", "--rounds", "400", "--warmup", "100", "--blocks", "1")
    keys = ["uncontended_cycle_us_p50", "uncontended_cycle_us_p99", "handoff_us_p50", "handoff_us_p99"]
    keys += ["handoff64_us_p50", "handoff64_us_p99", "p50_growth_64", "floor_cycle_us_p50", "floor_handoff_us_p50"]
    keys += ["handoff_ratio_p50", "handoff_ratio_p99", "cycle_ratio_p50", "idle_gaps", "samples"]
    for where in ("pair", "pair_two_cpus"):
        suffix = "_two_cpus" if where == "pair_two_cpus" else ""
        for server in ("", "floor_", "trio_floor_"):
            keys += [f"{server}{where}_{kind}_us_p{pct}" for kind in ("cycle", "handoff") for pct in (50, 99)]
        keys += [f"{where}_handoff_ratio_p{pct}" for pct in (50, 99)]
        keys += [f"{where}_handoff_ratio_trio_p{pct}" for pct in (50, 99)]
        keys += [f"{server}cpu_us_per_cycle{suffix}" for server in ("daemon_", "floor_", "trio_floor_")]
    has([*keys, *MACHINE, "targets", "met", "placements", "harnesses"], r)
    assert (r["clients"], r["clients64"], r["rounds"], r["blocks"]) == (2, 64, 400, 1)
    verdicts(r)
    readable(load_bench("handoff"), r)


def test_alloc_reports_both_sync_modes(run_main: Run) -> None:
    r = run_main("alloc", "--seconds", "0.5", "--warmup", "0.1", "--clients", "1")
    has(["cycles_per_s", "allocate_ms_p50", "allocate_ms_p99", "normal", "full", "seed_000_targets", *MACHINE], r)
    for sync in ("normal", "full"):
        has(["cycles_per_s", "allocate_ms_p50", "allocate_ms_p99", "samples"], r[sync])
        assert (r[sync]["state_sync"], r[sync]["clients"]) == (sync, 1)
    verdicts(r)


def test_abuse_leaves_the_daemon_alive_and_reports_before_and_after(run_main: Run) -> None:
    r = run_main("abuse", "--seconds", "1", "--settle", "0.5")
    keys = ["handoff_p50_ms_quiet", "handoff_p99_ms_quiet", "handoff_p50_ms_abuse", "handoff_p99_ms_abuse"]
    keys += ["errors_seen_by_good_clients", "daemon_alive", "rss_mb_before", "rss_mb_after", "metric_series_before"]
    keys += ["metric_series_after", "metric_series_growth_by_name", "longest_pause_ms", "handoffs", "attacks"]
    has([*keys, *MACHINE, "targets", "met"], r)
    assert r["daemon_alive"] is True and (r["seconds_per_phase"], r["settle_s"]) == (1, 0.5)
    verdicts(r, named_as_targets=False)
    assert len(r["met"]) == len(r["targets"])


def test_arbiter_mix_reports_each_mode_flock_and_the_lease_cycles(run_main: Run) -> None:
    r = run_main("arbiter_mix", "--quick", "--seconds", "1", "--cycle-seconds", "0.3")
    mix = ["asr_p50_ms", "asr_p95_ms", "asr_p95_ms_without_repair", "asr_p95_ms_with_repair", "nmt_p50_ms"]
    mix += ["nmt_p95_ms", "asr_acquire_p50_ms", "asr_acquire_p95_ms", "p95_ratio_with_repair"]
    mix += ["p95_ratio_with_repair_zero_over_zero", "asr_acquire_p95_ratio_with_repair", "repair_skip_rate"]
    has([*mix, "asr_acquire_p95_over_flock", "flock_asr_p95_ms", "serial", "flock", "auto_repair_x2"], r)
    has(mix, r["serial"])
    cycles = ["cycles_per_s", "cycles_per_s_bare", "cycles_per_s_log_warning", "cycles_per_s_bare_log_warning"]
    has([*cycles, "cycles_detail", "targets", "met", "workload", "code"], r)
    assert all(set(r[k]) == {"1", "8", "64"} for k in cycles)
    has(MACHINE, r["machine"])
    assert (r["workload"]["seconds_per_phase"], r["workload"]["cycle_seconds"]) == (1, 0.3)
    verdicts(r)


def test_scale_reports_each_size_and_the_queued_leases(run_main: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOW_TURN_ENV, "")  # main sets it for its daemons: unset again after
    args = ["--quick", "--only", "sessions", "--sizes", "10,20", "--cycles", "20", "--warmup", "2", "--queued", "5"]
    r = run_main("scale", *args, "--placement", "free")  # free: this process is not pinned to a CPU
    assert r["sizes"] == [10, 20] and r["queued_leases"] == 5 and r["turns_s"] == 1  # --quick's
    for n in ("10", "20"):
        keys = ["lock_us_p50", "lock_us_p99", "lease_us_p50", "lease_us_p99", "daemon_cpu_us_per_lock_cycle"]
        keys += ["status_ms", "clients_ms", "rss_mb", "lock_us_max_alone", "loop_turn_ms_max", "loop_turn_cpu_ms_max"]
        has(keys, r["by_size"][n])
        has([f"lock_us_p50_{n}", f"lease_us_p99_{n}", f"loop_turn_ms_max_{n}", f"lock_us_max_alone_{n}"], r)
    growth = [f"p50_growth_20_{kind}" for kind in ("lock", "lease")]
    growth += [f"{key}_drift_corrected" for key in growth]
    has([*growth, "rss_bytes_per_session", "rss_bytes_per_queued_lease", "queue_fill_s"], r)
    has(["queue_acquire_us_last_batch", "status_ms_1000", "clients_ms_1000", "targets", "met", "placement"], r)
    has(MACHINE, r["machine"])
    assert r["placement"]["name"] == "free" and r["placement"]["bench_cpus"] is None
    assert "allocs_n" not in r  # the allocations' part did not run (tests/test_bench_scale.py runs it)
    verdicts(r)


def test_soak_reports_every_kind_of_operation_and_the_idle_clients(run_main: Run) -> None:
    args = ["--seconds", "1", "--clients", "3", "--procs", "1", "--idle-seconds", "0.5", "--idle-clients", "1"]
    r = run_main("soak", *args)
    keys = ["ops", "ops_per_s", "errors", "p50_ms", "p99_ms", "per_op", "rss_start_mb", "rss_end_mb"]
    keys += ["rss_growth_percent", "idle_cpu_percent", "daemon_cpu_percent_load", "host_cpu_busy_percent_load"]
    has([*keys, "daemon_alive", "cpus", "loadavg_1m_before", "elapsed_s", "targets", "met"], r)
    assert set(r["per_op"]) == {"lock", "lease_acquire", "lease_release", "allocate", "free"}
    assert r["daemon_alive"] is True and (r["clients"], r["idle_clients"]) == (3, 1)
    verdicts(r)


def test_k8s_prepare_reports_each_kubelet_call_one_at_a_time_and_at_once(run_main: Run) -> None:
    pytest.importorskip("gpud_k8s.main", reason="gpud-k8s needs the k8s extra (grpcio, kubernetes_asyncio)")
    r = run_main("k8s_prepare", "--claims", "5", "--repeat", "3", "--gpus", "2", "--shares-seconds", "1")
    has(["prepare_one", "unprepare_one", "prepare_batch", "unprepare_batch", "batch_share", "config", "machine"], r)
    shares = r["shares"]
    if "skipped" not in shares:  # (no writable cgroup v2: said why)
        assert shares["targets"] == [0.25, 0.75] and abs(sum(shares["got"]) - 1) < 0.01
        assert shares["cpu_s"] >= 1 and shares["wall_s"] > 0 and shares["error_pp"] >= 0
    has(MACHINE, r["machine"])
    assert (r["config"]["claims"], r["config"]["repeat"], r["config"]["gpus"]) == (5, 3, 2)
    for key, n in (("prepare_one", 3), ("unprepare_one", 3), ("prepare_batch", 5), ("unprepare_batch", 5)):
        f = r[key]
        has(["p50_ms", "p99_ms", "max_ms", "n"], f)
        assert f["n"] == n and 0 < f["p50_ms"] <= f["p99_ms"] <= f["max_ms"]
    for key in ("prepare_batch", "unprepare_batch"):
        assert (r[key]["claims"], r[key]["calls"]) == (5, 5) and r[key]["wall_ms"] >= r[key]["max_ms"] - 0.1
    assert r["batch_share"] == {"cores": 33, "memory_bytes": 26 * 2**30 + 512 * 2**20, "claims_per_gpu": 3}
    for key in ("cpu_ms_per_claim_one", "cpu_ms_per_claim_batch"):
        assert set(r[key]) == {"agent", "gpud", "kubelet_and_api_server"} and min(r[key].values()) >= 0


# --- none is left out ----------------------------------------------------------------------------


def test_every_script_with_a_main_is_run_here_or_by_the_test_named() -> None:
    scripts = {path.stem for path in BENCH.glob("*.py") if 'if __name__ == "__main__":' in path.read_text()}
    assert scripts == RUN_HERE | set(ELSEWHERE) | set(WORKERS), "run a new benchmark here, or name its test"
    for name, test in ELSEWHERE.items():
        assert f'"{name}.py"' in (ROOT / test).read_text(), f"{test} does not run bench/{name}.py"
    for name, benchmark in WORKERS.items():
        assert benchmark in RUN_HERE | set(ELSEWHERE) and name in (BENCH / f"{benchmark}.py").read_text()


def test_ledger_ops_counts_what_its_build_made_whatever_else_dies_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The count of gc-tracked objects per allocation is of the ledger's own: objects of the process that
    die while the ledger is built (another part's garbage) do not make it negative."""
    monkeypatch.syspath_prepend(str(BENCH))
    import ledger_ops  # type: ignore[import-not-found]

    doomed = [[i] for i in range(5000)]  # tracked, alive when the build starts
    real = ledger_ops.Ledger.allocate

    def allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        doomed.clear()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ledger_ops.Ledger, "allocate", allocate)
    assert ledger_ops.build(10).tracked >= 0
