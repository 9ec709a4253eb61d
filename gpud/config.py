"""Daemon configuration: one frozen, typed Config with every default.

Flags fill it in (``gpud.main``); the core only ever sees the numbers it needs.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from gpud_client.protocol import DEFAULT_SOCKET, MAX_FRAME_BYTES, Mode

LogLevel = Literal["debug", "info", "warning", "error"]


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    socket: str = DEFAULT_SOCKET
    socket_mode: Annotated[int, Meta(ge=0, le=0o777)] = 0o660
    # None: NVML, falling back to simulated GPUs; "2" or "2x80GiB": simulate.
    simulate: str | None = None
    tq_s: Annotated[float, Meta(gt=0, le=86400)] = 30.0
    drop_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    mode: Mode = Mode.AUTO
    memory_reserve_percent: Annotated[int, Meta(ge=0, le=90)] = 10
    # Compute limits. The defaults of carryover and drop tail were chosen by
    # bench/quota_accuracy.py (the smallest error); see the README.
    compute_window_s: Annotated[float, Meta(ge=0.1, le=60)] = 2.0
    quota_sample_interval_s: Annotated[float, Meta(ge=0.001, le=1)] = 0.05
    quota_carryover_percent: Annotated[int, Meta(ge=0, le=100)] = 100
    drop_tail_billing_percent: Annotated[int, Meta(ge=0, le=100)] = 100
    share_windows: Annotated[int, Meta(ge=1, le=1000)] = 10
    max_frame_bytes: Annotated[int, Meta(ge=1024, le=16 * 2**20)] = MAX_FRAME_BYTES
    # Pushes queued for a client that does not read; past this it is disconnected.
    outbox_messages: Annotated[int, Meta(ge=16, le=1_000_000)] = 4096
    log_level: LogLevel = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
