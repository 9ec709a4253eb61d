"""The pure helpers of bench/scale.py, bench/scale_allocs.py and bench/handoff.py: the daemons' TOML,
blocks, sizes, placements, the allocations' layout and windows; bench/floor.py's two relays, which must
speak the same protocol for their figures to compare; and scale.py's allocations run end to end, small,
for the shape of its JSON (never a figure).

bench/ is no package: the modules are loaded from their files, with bench/ on sys.path for their own
imports (scale imports handoff and scale_allocs, handoff imports floor and percentiles).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from gpud.host import config
from gpud_client import protocol as p
from gpud_client.connection import Connection

RECV_TIMEOUT_S = 10.0
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def scale(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    load_bench("handoff")
    load_bench("scale_allocs")
    return load_bench("scale")


@pytest.fixture
def allocs(scale: ModuleType) -> ModuleType:
    return sys.modules["scale_allocs"]


def test_the_daemon_config_is_one_gpud_accepts_with_the_caps_and_policies_asked(
    scale: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "gpud.toml"
    path.write_text(scale.daemon_toml(per_connection=1000, queued=10_000))
    cfg = config.build(config.read_file(str(path)), {}, {})
    assert cfg.max_sessions_per_connection == 1000
    policies = cfg.lease_policies()
    assert policies["SCALE_WAIT"].max_wait_ms == scale.DAY_MS
    assert policies["SCALE_WAIT"].queue_limit == 10_000
    assert policies["SCALE_HOLD"].hold_max_ms == scale.DAY_MS
    assert cfg.max_connections == config.Config().max_connections  # nothing else raised


def test_chunks_cover_the_total_in_blocks_of_at_most_size(scale: ModuleType) -> None:
    assert scale.chunks(2500, 1000) == [1000, 1000, 500]
    assert scale.chunks(10, 1000) == [10]
    assert scale.chunks(3000, 200) == [200] * 15
    assert scale.chunks(0, 1000) == []


def test_split_makes_equal_parts_the_larger_first(scale: ModuleType) -> None:
    handoff = sys.modules["handoff"]
    assert handoff.split(10, 3) == [4, 3, 3]
    assert handoff.split(5000, 4) == [1250] * 4
    assert sum(handoff.split(5001, 51)) == 5001


def test_sizes_must_be_positive_and_ascending(scale: ModuleType) -> None:
    assert scale.parse_sizes("10,1000,10000") == (10, 1000, 10_000)
    for bad in ("1000,10", "10,10", "0,10", "10,x"):
        with pytest.raises(ValueError):
            scale.parse_sizes(bad)


def test_placements_name_the_cpus_of_the_bench_and_the_daemons(scale: ModuleType) -> None:
    assert scale.placement_cpus("one-cpu", [2, 5]) == ({2}, {2})
    assert scale.placement_cpus("two-cpus", [2, 5]) == ({2}, {5})
    assert scale.placement_cpus("free", [2, 5]) is None
    with pytest.raises(ValueError, match="two-cpus"):
        scale.placement_cpus("two-cpus", [0])


def test_growth_is_the_later_figure_over_the_base(scale: ModuleType) -> None:
    figures = {"lock_us_p50_10": 50.0, "lock_us_p50_10000": 60.0}
    assert scale.growth(figures, "lock_us_p50_10", "lock_us_p50_10000") == pytest.approx(1.2)


@pytest.fixture
def floor(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("floor")


@pytest.mark.parametrize("main", ["relay_main", "trio_relay_main"])
def test_floors_queue_a_request_and_grant_it_on_release(floor: ModuleType, main: str, tmp_path: Path) -> None:
    path = str(tmp_path / "f.sock")
    proc, _ = floor.start_relay(multiprocessing.get_context("spawn"), getattr(floor, main), path, timeout_s=60.0)
    try:
        with Connection(path) as a, Connection(path) as b:
            assert a.hello("a").version == b.hello("b").version == p.PROTOCOL_VERSION
            sa = a.call(p.Attach(id=a.next_id(), gpu=0)).session
            sb = b.call(p.Attach(id=b.next_id(), gpu=0)).session
            a.send(p.LockRequest(id=a.next_id(), session=sa))
            granted = a.recv(RECV_TIMEOUT_S)
            assert isinstance(granted, p.LockOk) and granted.session == sa
            b.send(p.LockRequest(id=b.next_id(), session=sb))
            # Answers go out in the order requests are handled: B's ATTACHED coming first
            # shows its LOCK_REQUEST was queued, not granted.
            rid = b.next_id()
            b.send(p.Attach(id=rid, gpu=0))
            assert isinstance(reply := b.recv(RECV_TIMEOUT_S), p.Attached) and reply.id == rid
            a.send(p.LockReleased(id=a.next_id(), session=sa, grant=granted.grant))
            handed = b.recv(RECV_TIMEOUT_S)
            assert isinstance(handed, p.LockOk) and handed.session == sb
    finally:
        proc.terminate()
        proc.join()


def test_slow_turns_are_read_from_the_daemons_log(scale: ModuleType) -> None:
    log = "\n".join(
        [
            '{"event":"ready","level":"info"}',
            '{"turn_ms":2.5,"cpu_ms":2.4,"gc_ms":0.0,"threshold_ms":1.0,"event":"loop_turn_slow","level":"warning"}',
            '{"turn_ms":1.5,"cpu_ms":1.2,"gc_ms":0.3,"threshold_ms":1.0,"event":"loop_turn_slow","level":"warning"}',
            '{"turn_ms": broken "loop_turn_slow"',
        ]
    )
    assert scale.slow_turns(log) == [(2.5, 2.4, 0.0), (1.5, 1.2, 0.3)]
    assert scale.slow_turns("") == []


def test_the_allocations_daemon_config_is_one_gpud_accepts_with_the_caps_it_has(
    allocs: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "gpud.toml"
    fields = set(config.Config.__struct_fields__)
    path.write_text(allocs.allocs_toml(uid=os.getuid(), caps=20_100, fields=fields))
    cfg = config.build(config.read_file(str(path)), {}, {})
    assert cfg.priority_max_uids == {str(os.getuid()): 100}
    assert cfg.reap_interval_s == allocs.REAP_INTERVAL_S
    assert cfg.preemption_grace_s == allocs.GRACE_S
    for key in allocs.CAP_KEYS:
        assert key not in fields or getattr(cfg, key) == 20_100
    assert cfg.max_connections == config.Config().max_connections  # nothing else raised
    assert not any(key in allocs.allocs_toml(uid=0, caps=1, fields=set()) for key in allocs.CAP_KEYS)


def test_the_layout_fills_every_gpu_so_that_a_whole_gpu_must_be_taken_back(allocs: ModuleType) -> None:
    assert allocs.layout(10) == (True, (0, 0.999))  # production on GPU 1, the filler beside them
    assert allocs.layout(allocs.PER_GPU) == (True, None)
    assert allocs.layout(15_000) == (False, (1, 0.5))
    assert allocs.layout(2 * allocs.PER_GPU) == (False, None)
    for bad in (0, 2 * allocs.PER_GPU + 1):
        with pytest.raises(ValueError, match="do not fit"):
            allocs.layout(bad)


def test_a_window_takes_every_round_trip_under_way_in_it_and_those_a_stall_held_back(allocs: ModuleType) -> None:
    ms = 1_000_000
    samples = [(0, 0.5), (1 * ms, 50.0), (60 * ms, 1.0), (200 * ms, 1.0)]  # (sent ns, round trip ms)
    # The one sent before the window and answered in it counts, and stands for the 24 a client asking
    # every 2 ms would have sent while it waited (48, 46, ... 2 ms); the one sent after the window does not.
    figures = allocs.window(samples, 10 * ms, 100 * ms, gap_ms=2.0)
    assert figures == {"ms_p50": 24.0, "ms_p99": 50.0, "ms_max": 50.0, "samples": 2.0}
    # Those it stands for are only the ones that would have been sent by the window's end: 48 .. 32 ms.
    figures = allocs.window(samples, 10 * ms, 20 * ms, gap_ms=2.0)
    assert figures == {"ms_p50": 40.0, "ms_p99": 50.0, "ms_max": 50.0, "samples": 1.0}
    with pytest.raises(ValueError):
        allocs.window(samples, 300 * ms, 400 * ms)


def test_the_allocations_run_end_to_end_gives_every_figure(allocs: ModuleType) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick", "--only", "allocs", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    assert (r["allocs_n"], r["allocs_control_n"]) == (200, allocs.CONTROL)
    figures = [
        *("make_s", "make_us_per_alloc", "make_us_last_batch", "remake_s"),
        *("list_ms_p50", "list_ms_p99", "list_ms_max", "list_all_ms_p50", "list_pages"),
        *("reap_s", "reap_status_ms_p50", "reap_status_ms_p99", "reap_status_ms_max", "reap_status_samples"),
        *("preempt_first_ms", "preempt_last_ms", "preempt_victims"),
        *("preempt_status_ms_p50", "preempt_status_ms_p99", "preempt_status_ms_max", "preempt_status_samples"),
    ]
    turns = ["make_turn_ms_max", "list_turn_ms_max", "reap_turn_ms_max", "preempt_turn_ms_max"]  # None: none slow
    for name in figures + turns:
        for key in (f"allocs_{name}", f"allocs_{name}_control"):
            assert key in r, key
            assert (r[key] is None and name in turns) or r[key] >= 0, (key, r[key])
    assert r["allocs_preempt_victims"] >= 1 and r["allocs_reap_status_samples"] >= 1
    assert set(r["allocs_met"]) == set(r["allocs_targets"]) <= set(r)
    assert isinstance(r["allocs_paged"], bool)
    assert {"machine", "placement", "allocs_daemon", "allocs_settings"} <= set(r)
    assert "sizes" not in r  # the sessions' part did not run
