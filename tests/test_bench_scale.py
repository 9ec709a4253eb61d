"""The pure helpers of bench/scale.py and bench/handoff.py: the daemon's TOML, blocks, sizes, placements;
and bench/floor.py's two relays, which must speak the same protocol for their figures to compare.

bench/ is no package: the modules are loaded from their files, with bench/ on
sys.path for their own imports (scale imports handoff, handoff imports floor and percentiles).
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from gpud.host import config
from gpud_client import protocol as p
from gpud_client.connection import Connection

RECV_TIMEOUT_S = 10.0


@pytest.fixture
def scale(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    load_bench("handoff")
    return load_bench("scale")


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
