"""Configuration: file, environment and flags, and errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gpud.host.config import ConfigError, build, load, parse_metrics_addr, read_environment, read_file
from gpud_client.protocol import Mode


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gpud.toml"
    path.write_text(text)
    return str(path)


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'tq_s = 5.0\nmode = "serial"\nmemory_reserve_percent = 20\n')
    cfg = load(path, {"tq_s": 7.0}, {"GPUD_MODE": "concurrent", "GPUD_TQ_S": "6"})
    assert (cfg.tq_s, cfg.mode, cfg.memory_reserve_percent) == (7.0, "concurrent", 20)


def test_policies_from_the_file_override_the_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, '[policies.ASR]\npriority = 95\nbusy_policy = "WAIT"\nmax_wait_ms = 1000\n')
    policies = load(path, {}, {}).lease_policies()
    assert policies["ASR"].priority == 95 and policies["NMT"].priority == 80


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("tq_s = -1\n", "$.tq_s"),
        ('mode = "turbo"\n', "$.mode"),
        ("compute_window_s = 0.01\n", "$.compute_window_s"),
        ('[policies.ASR]\npriority = 500\nbusy_policy = "WAIT"\nmax_wait_ms = 1\n', "$.policies.ASR.priority"),
        ('[policies.ASR]\npriority = 5\nbusy_policy = "NAP"\nmax_wait_ms = 1\n', "$.policies.ASR.busy_policy"),
        ("tq = 5\n", "unknown key 'tq'"),
        ("tq_s = \n", "not valid TOML"),
    ],
)
def test_bad_file_values_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, text), {}, {})
    assert needle in str(err.value) and "gpud.toml" in str(err.value)


def test_bad_environment_values_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="GPUD_TQ_S='soon'"):
        read_environment({"GPUD_TQ_S": "soon"})
    assert read_environment({"GPUD_SOCKET": "/x.sock"}) == {"socket": "/x.sock"}


def test_a_missing_named_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_file(str(tmp_path / "nope.toml"))


def test_metrics_addresses() -> None:
    assert parse_metrics_addr("127.0.0.1:9402") == ("127.0.0.1", 9402)
    assert parse_metrics_addr("off") is None
    for bad in ("9402", "host:", "host:port", "h:99999"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_metrics_addr(bad)
    with pytest.raises(ConfigError):
        build({}, {}, {"metrics_addr": "nowhere"})


def test_the_daemon_refuses_to_start_on_a_bad_value(tmp_path: Path) -> None:
    path = write(tmp_path, "drop_tail_billing_percent = 150\n")
    out = subprocess.run(
        [sys.executable, "-m", "gpud.main", "--config", path, "--socket", "/tmp/gpud-never/s"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "$.drop_tail_billing_percent" in out.stderr and "<= 100" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "gpud.main", "--window", "0", "--socket", "/tmp/gpud-never/s"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "bad value for --window" in out.stderr


def test_a_reload_takes_only_the_settings_whose_loaded_value_changed() -> None:
    from gpud.core.quota import QuotaConfig
    from gpud.core.scheduler import SchedulerConfig
    from gpud.serving.server import take_changes

    loaded = SchedulerConfig(tq_us=30_000_000, mode=Mode.AUTO, quota=QuotaConfig(window_us=2_000_000))
    running = replace(loaded, tq_us=7_000_000, mode=Mode.SERIAL)  # gpuctl tq 7, gpuctl mode serial
    # The file changed nothing the running values differ in: they stay.
    again = replace(loaded, drop_timeout_us=5_000_000, quota=replace(loaded.quota, carryover_percent=50))
    kept = take_changes(running, loaded, again)
    assert (kept.tq_us, kept.mode, kept.drop_timeout_us, kept.quota.carryover_percent) == (
        7_000_000,
        Mode.SERIAL,
        5_000_000,
        50,
    )
    # The file changed the TQ: its new value wins; the mode stays.
    newer = replace(again, tq_us=12_000_000)
    taken = take_changes(kept, again, newer)
    assert (taken.tq_us, taken.mode) == (12_000_000, Mode.SERIAL)
    assert take_changes(running, loaded, loaded) is running
