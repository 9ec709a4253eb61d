"""What the daemon's parts share: a client connection, a GPU slot, the clock, and
how a client's GPU reference resolves. The parts (``links``, ``effects``,
``locks``, ``leases``, ``allocations``, ``admin``, ``status``) depend on this module
and on each other's narrow pieces, never on ``gpud.serving.server``: imports point one
way, and the server composes them.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from gpud.core.errors import Refused
from gpud.core.gpus import GpuIdentity, resolve_gpu
from gpud.core.scheduler import GpuScheduler
from gpud.host.devices import Gpu
from gpud_client import protocol as p

Clock = Callable[[], int]  # integer microseconds
# A request handler: (its connection, the decoded message, now) -> the answer, or None (none now).
Handler = Callable[["ClientLink", Any, int], "msgspec.Struct | None"]
_GPU_REFS_KEPT = 256  # resolved GPU keys remembered (a client may send any number of spellings)


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
    sends: int = 0  # messages sent to it so far (the reader's hint that an answer may come back)
    writing: bool = False  # the writer task holds bytes not yet on the socket
    writer_wake: trio.Event = field(default_factory=trio.Event)
    drained: trio.Event = field(default_factory=trio.Event)
    closing: bool = False
    name: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    greeted: bool = False
    sessions: dict[int, int] = field(default_factory=dict)  # session or lease -> gpu index
    protocol_errors: Counter[str] = field(default_factory=Counter)
    # The task whose own socket it came in on (OPEN_TASK_SOCKET): it is that task's, whoever its peer
    # is, and never an admin (gpud.core.scopes says what it may ask).
    scope: str | None = None


@dataclass(eq=False)
class GpuSlot:
    gpu: Gpu
    scheduler: GpuScheduler
    wake: trio.Event = field(default_factory=trio.Event)
    armed_for: int | None = None  # the deadline the timer task sleeps toward
    healthy: bool = True
    memory_used_bytes: int | None = None  # NVML's last reading (every process's); None: simulated
    draining: bool = False  # an operator drains it: no new allocation, session or lease on it


class GpuRefs:
    """A client's GPU reference (an index, a UUID or its prefix) -> the slot's index."""

    def __init__(self, slots: list[GpuSlot]) -> None:
        self.slots = slots
        self._identities = [GpuIdentity(s.gpu.index, s.gpu.uuid) for s in slots]
        self._known: dict[int | str, int] = {}

    def index(self, ref: int | str) -> int:
        found = self._known.get(ref)
        if found is not None:
            return found
        try:
            index = resolve_gpu(ref, self._identities)
        except ValueError as exc:
            raise Refused(p.ErrorCode.UNKNOWN_GPU, str(exc)) from None
        if len(self._known) < _GPU_REFS_KEPT:  # services repeat the same key: resolve it once
            self._known[ref] = index
        return index

    def slot(self, ref: int | str) -> GpuSlot:
        return self.slots[self.index(ref)]

    def targets(self, ref: int | str | None) -> list[GpuSlot]:
        """Every GPU for None, else the one named."""
        return self.slots if ref is None else [self.slot(ref)]
