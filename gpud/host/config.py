"""Daemon configuration: one frozen, typed Config with every default.

Sources, later ones winning: the defaults here, the TOML file (``--config``,
default /etc/gpud/gpud.toml when it exists), ``GPUD_<KEY>`` environment
variables, then command-line flags. A bad value stops start-up with a
``ConfigError`` naming the source, the key and what was expected.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gpud.core.leases import DEFAULT_HOLD_MAX_MS, DEFAULT_POLICIES, DEFAULT_QUEUE_LIMIT, LeasePolicy
from gpud_client.protocol import (
    DEFAULT_SOCKET,
    MAX_FRAME_BYTES,
    NORMAL_PRIORITY,
    BusyPolicy,
    FrameBytes,
    Gpus,
    HoldMaxMs,
    Millis,
    Mode,
    PreemptStrategy,
    Priority,
    QueueLimit,
    Seconds,
)

DEFAULT_CONFIG_PATH = "/etc/gpud/gpud.toml"
DEFAULT_METRICS_ADDR = "127.0.0.1:9402"
LogLevel = Literal["debug", "info", "warning", "error"]
Percent = Annotated[int, Meta(ge=0, le=100)]
Cap = Annotated[int, Meta(ge=1, le=1_000_000)]  # how many connections, sessions or waiters


class ConfigError(Exception):
    """A configuration value is wrong; the message names where and which."""


class PolicyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    priority: Priority
    busy_policy: BusyPolicy
    max_wait_ms: Millis
    queue_limit: QueueLimit | None = None
    hold_max_ms: HoldMaxMs | None = None
    uids: list[int] = []  # with gids: the only non-admins who may use this task type; none listed: anyone,
    gids: list[int] = []  # at no higher a priority than each may declare


class TenantConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gpus: Gpus  # quota, in GPUs (fractions allowed)
    borrow: Gpus = 0.0  # the most it may borrow of others' idle quota
    uids: list[int] = []  # who may allocate as this tenant; none listed: anyone
    gids: list[int] = []


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    socket: str = DEFAULT_SOCKET
    socket_mode: Annotated[int, Meta(ge=0, le=0o777)] = 0o660
    # None: NVML, falling back to simulated GPUs; "2" or "2x80GiB": simulate.
    simulate: str | None = None
    tq_s: Seconds = 30.0  # the bounds of SET_TQ
    drop_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    # A PARK (gpuctl run: move a paused program's GPU memory to host memory) unanswered this long
    # counts as refused. Checkpoints move a few GB a second: 120 s covers a whole large GPU.
    park_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 120.0
    # gpuctl run: the cgroups gpud makes for runs' programs (docs/run.md): "auto" (gpud-runs below
    # gpud's own cgroup), "off", or the absolute directory of a cgroup on the cgroup2 mount.
    run_cgroups: Annotated[str, Meta(pattern=r"^(auto|off|/[^\x00]*)$", max_length=4096)] = "auto"
    # A FREEZE the kernel has not finished (cgroup.events frozen 1) within this long is answered as failed.
    run_freeze_timeout_s: Annotated[float, Meta(gt=0, le=60)] = 5.0
    mode: Mode = Mode.AUTO
    memory_reserve_percent: Annotated[int, Meta(ge=0, le=90)] = 10
    # Compute limits. The defaults of carryover and drop tail were chosen by
    # bench/quota_accuracy.py (the smallest error); see docs/benchmarks.md.
    compute_window_s: Annotated[float, Meta(ge=0.1, le=60)] = 2.0
    quota_sample_interval_s: Annotated[float, Meta(ge=0.001, le=1)] = 0.05
    quota_carryover_percent: Percent = 100
    drop_tail_billing_percent: Percent = 100
    share_windows: Annotated[int, Meta(ge=1, le=1000)] = 10
    # Leases (GpuArbiter)
    lease_queue_limit: QueueLimit = DEFAULT_QUEUE_LIMIT
    lease_hold_max_ms: HoldMaxMs = DEFAULT_HOLD_MAX_MS
    lease_force_release: bool = False
    policies: dict[str, PolicyConfig] = {}
    # Allocations
    state_dir: str = "/var/lib/gpud"
    state_sync: Literal["normal", "full"] = "normal"
    reap_interval_s: Annotated[float, Meta(ge=0, le=3600)] = 5.0  # 0: never reclaim dead owners' allocations
    # After a start that follows a crash: no lock or lease is granted for this long, so a
    # process that held one when gpud died learns it (its connection closed) first.
    restart_grace_s: Annotated[float, Meta(ge=0, le=60)] = 1.0
    tenants: dict[str, TenantConfig] = {}
    # Taking allocations back (docs/preemption.md)
    preemption: bool = True  # False: waiting requests never take anything back (drain still does)
    preemption_strategy: PreemptStrategy = PreemptStrategy.LOWEST_PRIORITY
    preemption_grace_s: Annotated[float, Meta(ge=0, le=86400)] = 30.0
    preemption_min_runtime_s: Annotated[float, Meta(ge=0, le=7 * 86400)] = 300.0
    # A victim whose notice was withdrawn (its waiter gave up) is not chosen again for this long.
    preemption_cooldown_s: Annotated[float, Meta(ge=0, le=86400)] = 60.0
    elastic_cooldown_s: Annotated[float, Meta(ge=0, le=86400)] = 60.0  # at most one growth per allocation this often
    elastic_window_s: Annotated[float, Meta(ge=0, le=86400)] = 30.0  # GPUs free this long before one grows
    # Grow only while an elastic allocation's GPUs are busy (NVML utilisation at or above this through
    # the window); give its extras back when they idle below it through the window. 0: off.
    elastic_busy_percent: Annotated[int, Meta(ge=0, le=100)] = 0
    # Operations
    monitor_interval_s: Annotated[float, Meta(ge=0.05, le=3600)] = 1.0  # NVML samples and gauges
    admin_group: str = "gpud-admin"  # members may change limits, modes, policies; "" for none
    metrics_addr: str = DEFAULT_METRICS_ADDR  # HOST:PORT, or "off"
    max_frame_bytes: FrameBytes = MAX_FRAME_BYTES  # told to clients in WELCOME
    # Caps on what clients can make the daemon hold (see docs/security.md).
    max_connections: Cap = 1024  # lowered to what RLIMIT_NOFILE allows
    max_connections_per_uid: Cap = 256
    hello_timeout_s: Annotated[float, Meta(ge=0.1, le=3600)] = 5.0  # a connection silent this long is closed
    max_sessions_per_connection: Cap = 256  # sessions and leases
    max_lock_queue: Cap = 1024  # waiting LOCK_REQUESTs per GPU
    max_allocation_waiters: Annotated[int, Meta(ge=0, le=1_000_000)] = 256
    # What one uid can make the daemon hold: allocations (running or suspended), waits, and every
    # record the store keeps for it (those two and the preemption history of its task ids).
    max_allocations_per_uid: Annotated[int, Meta(ge=1, le=1_000_000)] = 1024
    max_allocation_waits_per_uid: Annotated[int, Meta(ge=0, le=1_000_000)] = 32
    max_allocation_records_per_uid: Annotated[int, Meta(ge=1, le=1_000_000)] = 2048
    # After a restart, a wait restored from the store and served while its client is away is
    # released if no client asks for it again within this long.
    crash_grace_s: Annotated[float, Meta(ge=0, le=86400)] = 60.0
    # A connection's unsent answers and pushes: above the high-water mark the daemon stops
    # reading its requests; past the limit (a client that never reads) it is disconnected.
    outbox_high_water_bytes: Annotated[int, Meta(ge=64 * 1024, le=2**30)] = 2**20
    outbox_limit_bytes: Annotated[int, Meta(ge=64 * 1024, le=2**31)] = 16 * 2**20
    # Priorities a non-admin may declare for its sessions, leases and allocations (lease terms
    # are also cut to their task type's policy).
    priority_max: Priority = NORMAL_PRIORITY
    priority_max_uids: dict[str, Priority] = {}  # "1000" = 80: by uid
    priority_max_groups: dict[str, Priority] = {}  # "inference" = 90: by group name (the highest of the peer's)
    log_level: LogLevel = "info"
    log_format: Literal["auto", "json", "console"] = "auto"

    def lease_policies(self) -> dict[str, LeasePolicy]:
        """The built-in task-type policies with the configured ones on top."""
        merged = dict(DEFAULT_POLICIES)
        for name, pc in self.policies.items():
            merged[name] = LeasePolicy(
                pc.priority,
                pc.busy_policy,
                pc.max_wait_ms,
                pc.queue_limit,
                pc.hold_max_ms,
                frozenset(pc.uids),
                frozenset(pc.gids),
            )
        return merged


FIELDS = set(Config.__struct_fields__)


def parse_metrics_addr(value: str) -> tuple[str, int] | None:
    """'127.0.0.1:9402' -> (host, port); 'off' or '' -> None."""
    if value.strip().lower() in ("", "off", "none", "false"):
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"metrics_addr must be HOST:PORT or off, got {value!r}")
    return host.strip("[]"), int(port)


def read_file(path: str | None) -> dict[str, Any]:
    """The TOML file's table; {} when no file was named and the default is absent."""
    if path is None:
        if not os.path.exists(DEFAULT_CONFIG_PATH):
            return {}
        path = DEFAULT_CONFIG_PATH
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} in {path} (known keys: {', '.join(sorted(FIELDS))})")
    _check(data, f"config file {path}")
    return data


def read_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """GPUD_<KEY> for every scalar key (GPUD_SOCKET is the socket path)."""
    out: dict[str, Any] = {}
    for key in FIELDS - {"policies"}:
        raw = environ.get(f"GPUD_{key.upper()}")
        if raw is None:
            continue
        try:
            out[key] = msgspec.convert({key: raw}, Config, strict=False).__getattribute__(key)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"bad value for GPUD_{key.upper()}={raw!r}: {exc}") from None
    return out


def build(file_values: dict[str, Any], env_values: dict[str, Any], flag_values: dict[str, Any]) -> Config:
    merged = {**file_values, **env_values, **flag_values}
    config = _check(merged, "configuration")
    parse_metrics_addr(config.metrics_addr)
    bad = [uid for uid in config.priority_max_uids if not uid.isdigit()]
    if bad:
        raise ConfigError(f"bad key in priority_max_uids: {bad[0]!r} is not a numeric uid")
    return config


def load(path: str | None, flag_values: dict[str, Any], environ: Mapping[str, str] | None = None) -> Config:
    return build(read_file(path), read_environment(os.environ if environ is None else environ), flag_values)


def _check(values: dict[str, Any], source: str) -> Config:
    policies = values.get("policies")
    if isinstance(policies, dict):  # checked one by one, so the error names the task type
        for name, table in policies.items():
            try:
                msgspec.convert(table, PolicyConfig)
            except msgspec.ValidationError as exc:
                where = str(exc).replace("`$", f"`$.policies.{name}")
                raise ConfigError(f"bad value in {source}: {where}") from None
    try:
        return msgspec.convert(values, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad value in {source}: {exc}") from None
