"""bench/gpu_run.py without a GPU: the arithmetic on what its PyTorch programs and gpud-run's traces
record, on records built by hand, and the benchmark run as a real process on a machine with no GPU.

bench/ is no package: the module is loaded from its file, with bench/ on sys.path for its own imports
(gpu_quota, gpu_workers, run_share and theirs). Times are integer nanoseconds on one clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
MS, S = 1_000_000, 1_000_000_000
GB = 10**9


@pytest.fixture
def gr(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("gpu_run")


def ev(t: int, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


def product(t_ms: float, ms: float, launch_us: int = 20) -> dict[str, Any]:
    return {"t": round(t_ms * MS), "ms": ms, "launch_us": launch_us}


# --- kernel time -----------------------------------------------------------------------------------


def test_the_achieved_share_is_the_programs_own_kernel_time_in_the_interval(gr: ModuleType) -> None:
    # 3 ms products seen done every 4 ms from 4 ms to 400 ms: 99 of them in [0, 400 ms), the one seen
    # at 400 ms belongs to the next interval. 297 ms of 400.
    kernels = [product(4 * k, 3.0) for k in range(1, 101)]
    share, n, interrupted = gr.kernel_share(kernels, 0, 400 * MS)
    assert (share, n, interrupted) == (pytest.approx(74.25), 99, 0)


def test_a_product_launched_across_a_pause_counts_at_the_median_product_time(gr: ModuleType) -> None:
    # Its events enclose a 500 ms pause; its launch took the pause too.
    kernels = [product(10, 3.0), product(20, 3.0), product(600, 503.0, launch_us=500_000), product(610, 3.0)]
    share, n, interrupted = gr.kernel_share(kernels, 0, 1000 * MS)
    assert (share, n, interrupted) == (pytest.approx(1.2), 4, 1)


def test_without_a_clean_product_there_is_no_kernel_time_to_go_by(gr: ModuleType) -> None:
    with pytest.raises(gr.MeasurementError, match="no product"):
        gr.kernel_share([product(10, 9.0, launch_us=9000)], 0, S)


def test_a_program_file_leads_with_its_start_line(gr: ModuleType) -> None:
    text = json.dumps({"start": 5, "bytes": 1024, "size": 8192}) + "\n" + json.dumps(product(1, 3.0)) + "\n"
    start, kernels = gr.read_kernels(text)
    assert start["size"] == 8192 and kernels == [product(1, 3.0)]
    with pytest.raises(gr.MeasurementError, match="no start line"):
        gr.read_kernels(json.dumps(product(1, 3.0)))


# --- lock, unlock, park and restore ----------------------------------------------------------------


def test_gigabytes_per_second_are_bytes_over_nanoseconds(gr: ModuleType) -> None:
    assert gr.gbps(48 * GB, 4 * S) == 12.0
    assert gr.rates([12.0, 10.0, 14.0]) == {"p50": 12.0, "min": 10.0, "max": 14.0}
    assert gr.rates([]) is None


def test_a_resume_after_a_grant_is_an_unlock_but_a_first_start_is_not(gr: ModuleType) -> None:
    trace = [ev(0, "granted"), ev(2 * MS, "start"), ev(50 * MS, "drop"), ev(51 * MS, "pause")]
    trace += [ev(52 * MS, "release"), ev(90 * MS, "granted"), ev(91 * MS, "resume")]
    assert gr.resume_latencies(trace) == [1 * MS]


PARKING = [
    ev(0, "granted"),
    ev(1 * MS, "start"),
    ev(2 * S, "drop"),
    ev(2 * S + 8 * MS, "pause", detail="the daemon asked for the lock (DROP_LOCK)"),
    ev(2 * S + 9 * MS, "release"),
    ev(2 * S + 10 * MS, "park"),  # PARK came
    ev(6 * S + 10 * MS, "parked", ok=True, bytes=48 * GB),  # parked: 48 GB in 4 s
    ev(6 * S + 11 * MS, "answerpark", ok=True),
    ev(8 * S, "granted"),
    ev(11 * S, "resume"),  # restored (3 s) and unlocked
    ev(13 * S, "drop"),
    ev(13 * S + 5 * MS, "pause"),
    ev(13 * S + 6 * MS, "release"),
    ev(13 * S + 7 * MS, "park"),
    ev(13 * S + 9 * MS, "parked", ok=False),  # a park the driver refused: answered false
    ev(13 * S + 10 * MS, "answerpark", ok=False),
    ev(14 * S, "park"),  # asked while already parked: answered at once, nothing moved
    ev(14 * S + 1 * MS, "answerpark", ok=True),
]


def test_a_park_is_timed_from_park_to_parked_and_its_restore_from_the_next_grant_to_resume(gr: ModuleType) -> None:
    assert gr.parks(PARKING) == [{"at": 6 * S + 10 * MS, "bytes": 48 * GB, "park_ns": 4 * S, "restore_ns": 3 * S}]


def test_a_switch_runs_from_one_runs_drop_to_the_others_resume(gr: ModuleType) -> None:
    other = [ev(1 * S, "resume"), ev(6 * S + 500 * MS, "resume"), ev(20 * S, "resume")]
    assert gr.switches(PARKING, other, 0, 10 * S) == [4 * S + 500 * MS]  # the drop at 13 s is outside
    assert gr.switches(PARKING, other, 0, 20 * S) == [4 * S + 500 * MS, 7 * S]


def test_park_figures_count_turns_parks_and_rates_over_both_runs(gr: ModuleType) -> None:
    cfg = gr.BenchConfig(park_seconds=20.0, hold_fraction=0.6)
    other = [ev(2 * S + 20 * MS, "granted"), ev(6 * S + 20 * MS, "resume")]
    got = gr.park_figures({"park-a": PARKING, "park-b": other}, 0, 20 * S, cfg)
    assert got["turns"] == {"park-a": 2, "park-b": 1} and got["parks"] == 1
    assert got["park_bytes_p50"] == 48 * GB
    assert got["park_ms"] == {"p50": 4000.0, "p99": 4000.0, "max": 4000.0}
    assert got["park_gbps"] == {"p50": 12.0, "min": 12.0, "max": 12.0}
    assert got["restore_gbps"] == {"p50": 16.0, "min": 16.0, "max": 16.0}
    assert got["switch_ms"]["p50"] == 4020.0  # a's drop at 2 s to b's resume at 6.02 s
    late = gr.park_figures({"park-a": PARKING, "park-b": other}, 7 * S, 20 * S, cfg)
    assert late["parks"] == 0 and late["park_gbps"] is None and late["turns"] == {"park-a": 1, "park-b": 0}


def test_each_program_holds_its_share_of_the_gpu_unless_host_memory_cannot_take_two_images(gr: ModuleType) -> None:
    cfg = gr.BenchConfig(hold_fraction=0.6)
    assert gr.park_hold(cfg, 80 * GB, 130 * GB) == (48 * GB, False)  # two images of 48 GB fit in 130 GB
    hold, limited = gr.park_hold(cfg, 141 * GB, 130 * GB)  # two of 84.6 GB do not
    assert limited and 2 * hold * 1.1 < 130 * GB and hold == int(130 * GB / 2.3)


def test_lock_figures_take_every_drop_of_the_mixes(gr: ModuleType) -> None:
    trace = [ev(0, "granted"), ev(1 * MS, "start"), ev(10 * MS, "drop"), ev(14 * MS, "pause")]
    trace += [ev(15 * MS, "release"), ev(30 * MS, "granted"), ev(30 * MS + 400_000, "resume")]
    got = gr.lock_figures([{"traces": [trace, trace]}])
    assert got["drops"] == 2 and got["drop_to_pause_ms"]["p50"] == 4.0
    assert got["grant_to_resume_ms"]["max"] == 0.4
    assert gr.lock_figures([{"traces": [[ev(0, "granted")]]}]) is None


# --- the benchmark as a process ------------------------------------------------------------------


def _gpu_here() -> bool:
    probe = "import sys; sys.path.insert(0, 'bench'); import gpu_run as g; print(g.why_no_gpu(0)[0] is None)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return out.stdout.strip() == "True"


def test_the_module_imports_without_torch() -> None:
    code = "import sys; sys.path.insert(0, 'bench'); import gpu_run; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_without_a_gpu_it_says_why_in_one_line_and_exits_0_with_a_null_gpu() -> None:
    if _gpu_here():
        pytest.skip("this machine has a GPU, PyTorch with CUDA and the checkpoint API: the benchmark would run")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_run.py"), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and "no GPU" in lines[0], out.stdout
    result = json.loads(lines[-1])
    assert result["gpu"] is None and isinstance(result["why"], str) and result["why"] in lines[0]
    assert "Traceback" not in out.stderr
