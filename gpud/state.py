"""What the daemon's parts share: a client connection, a GPU slot, the clock, and
``Host``, the view of the daemon that the arbiter, the allocator and the views
are given. They depend on this module and never on ``gpud.server``, so imports
point one way: the server composes them.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import trio

from gpud.config import Config
from gpud.core.scheduler import Effect, GpuScheduler
from gpud.devices import Gpu
from gpud.faults import Faults
from gpud.metrics import Metrics


def now_us() -> int:
    return time.monotonic_ns() // 1000


@dataclass(eq=False)
class ClientLink:
    """The daemon's record of one connected client (the client library's end is ``gpud_client.Connection``)."""

    client_id: int
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]  # supplementary groups, from SO_PEERGROUPS
    fd: int  # -1: an in-process connection (a simulation): every message waits in ``pending``
    cancel: trio.CancelScope  # cancelled to drop the connection at once
    connected_at: int
    pending: deque[bytes] = field(default_factory=deque)  # bytes the writer task has not sent yet
    pending_bytes: int = 0  # in ``pending`` and in the writer's hands
    writing: bool = False  # the writer task holds bytes not yet on the socket
    writer_wake: trio.Event = field(default_factory=trio.Event)
    drained: trio.Event = field(default_factory=trio.Event)
    closing: bool = False
    name: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    greeted: bool = False
    sessions: dict[int, int] = field(default_factory=dict)  # session or lease -> gpu index
    protocol_errors: Counter[str] = field(default_factory=Counter)


@dataclass(eq=False)
class GpuSlot:
    gpu: Gpu
    scheduler: GpuScheduler
    wake: trio.Event = field(default_factory=trio.Event)
    armed_for: int | None = None  # the deadline the timer task sleeps toward
    healthy: bool = True


class Host(Protocol):
    """What a part of the shell may use of the daemon."""

    config: Config
    metrics: Metrics
    faults: Faults
    slots: list[GpuSlot]
    connections: dict[int, ClientLink]
    owners: dict[int, ClientLink]  # session or lease -> its connection
    started_at: int

    def send(self, conn: ClientLink, msg: msgspec.Struct) -> None: ...
    def carry_out(self, slot: GpuSlot, effects: list[Effect], now: int) -> None: ...
    def gpu_index(self, ref: int | str) -> int: ...
    def is_admin(self, conn: ClientLink) -> bool: ...
    def priority_ceiling(self, conn: ClientLink) -> int: ...
    def check_room(self, conn: ClientLink) -> None: ...
    def wake_allocator(self) -> None: ...
