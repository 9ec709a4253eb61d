"""What a session of either client knows of itself. Data only; ``ClientCore`` changes it.

The drivers' ``Session`` and ``AsyncSession`` extend this with their methods;
the hooks (``on_drop``, ``synchronize``, ``on_lost``) are stored here so the
core can tell whether one is set, but only a driver ever calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from gpud_client import protocol as p
from gpud_client.errors import GpudError, LockLost, MemoryLimitExceeded

State = Literal["idle", "waiting", "holding", "releasing"]
MEM_REPORT_STEP = 16 * 2**20  # report memory when it moved at least this much


class SessionState:
    def __init__(
        self,
        gpu: int | str,
        *,
        priority: int,
        idle_release: float | None,
        core_limit: int,
        mem_limit: int | None,
        mem_estimate: int | None,
        memory_probe: Callable[[], int] | None,
        framework_hooks: bool,
        memory_cap: Callable[[int | None], None] | None = None,
        on_drop: Callable[[p.DropReason], Any] | None = None,
        synchronize: Callable[[], Any] | None = None,
        on_lost: Callable[[LockLost], Any] | None = None,
        task_id: str | None = None,
        on_park: Callable[[], Any] | None = None,
    ) -> None:
        self.gpu_ref = gpu
        self.task_id = task_id  # the fractional allocation it belongs to (its share caps the limits)
        self.priority = priority
        self.core_limit = core_limit
        self.mem_limit = mem_limit
        self.mem_estimate = mem_estimate
        self.framework_hooks = framework_hooks
        self.memory_probe = memory_probe
        self.memory_cap = memory_cap  # applies a new memory limit to the framework's allocator
        self.on_drop = on_drop
        self.synchronize = synchronize
        self.on_lost = on_lost
        self.on_park = on_park  # set: the session is parkable (ATTACH says so); see ``CallOnPark``
        self.mem_reported: int | None = None
        self.mem_error: MemoryLimitExceeded | None = None
        self.memory_total_bytes = 0
        self.idle_release = idle_release
        self.id = 0  # the daemon's session id; 0 while not attached; changes on re-attach
        self.gpu = -1
        self.state: State = "idle"
        self.grant = 0
        self.drop_pending: p.DropReason | None = None
        self.entering = False  # a slice() or acquire() waits for the lock
        self.in_slice = False  # a slice (or an acquire()) runs
        self.request_id = 0  # the LOCK_REQUEST waiting for its grant
        self.last_used = 0.0  # on the driver's clock
        self.unavailable_since: float | None = None  # a slice waits for gpud since then
        self.error: GpudError | None = None  # the daemon refused the LOCK_REQUEST: raised by the waiting slice
        self.lost: LockLost | None = None  # raised at the end of the running slice
        self.attach_error: GpudError | None = None  # the daemon refused to re-attach it after a reconnect
        self.closed = False
        # counters an application can read
        self.grants = 0
        self.drops = 0
        self.revocations = 0

    @property
    def holding(self) -> bool:
        return self.state == "holding"
