# unasync: asyncio
"""The asyncio client: its public surface. The machinery is ``_async_driver``; the rules ``core``.
The sync client's surface, ``client.py``, is generated from this module (``client/tools/unasync.py``).

The same shape and rules as the sync ``Client``, with ``await`` where that one blocks::

    async with await AsyncClient.connect(name="trainer") as client:
        session = await client.session(0, core_limit=50)
        for batch in batches:
            async with session.slice():
                await step(batch)

``AsyncClient.connect`` is the way to get a client (it connects and says HELLO
before it returns); ``async with`` on the client, or ``await client.close()``,
ends it. A slice that already holds the lock does not even yield to the loop.
``on_drop``, ``synchronize`` and ``on_lost`` may be plain callables or
coroutine functions; a push's hooks run in a task of their own, so an
``on_drop`` may ``await session.release()`` or call the daemon. Work inside
slices should await (or run blocking GPU calls in a thread), else a DROP_LOCK
waits for the next await. A session runs one slice at a time, also across
tasks: a second task's ``slice()`` raises instead of sharing the lock unseen.

Cancellation. The protocol cannot withdraw a LOCK_REQUEST, so when the task
waiting in ``slice()`` or ``acquire()`` is cancelled the request stays queued
at the daemon; the next slice of the session waits for that same grant, and if
none waits when it arrives it is given back at once (no work ran under it). A
lease acquire cancelled or timed out is released when its grant comes, or at
once if the grant came just before.
"""
# unasync: sync
# """The synchronous client: its public surface. The machinery is ``_sync_driver``; the rules ``core``.
#
# ``with session.slice():`` wraps one unit of GPU work. It takes the GPU lock if
# the session does not hold it, and at exit gives it back only if a DROP_LOCK is
# pending; between slices the lock is kept, so a training loop pays no round trip
# per step. A DROP_LOCK between slices is answered at once, and a lock unused for
# ``idle_release`` seconds is given back early (nvshare's early release).
#
# When the daemon goes away the client reconnects (50 ms doubling to 2 s, each
# wait jittered) and re-attaches every session; a session whose GPU is gone fails
# alone. A slice started meanwhile waits up to ``unavailable_timeout`` seconds
# and then raises ``DaemonUnavailable`` or, with ``proceed_unarbitrated=True``,
# runs without the lock. A lock held when the connection died is lost:
# ``on_lost`` is called at once and ``LockLost`` raised at the end of the running
# slice (or by ``release()``). This surface is generated from the asyncio client's
# (``aio.py``), so the two have the same.
# """
# unasync: end

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from gpud_client import _async_driver as driver
from gpud_client import protocol as p
from gpud_client._base import AllocationListener, MemoryProbe
from gpud_client.core.messages import acquire_msg, acquire_timeout, allocate_msg, policy_msg, size
from gpud_client.frameworks import default_memory_cap, default_memory_probe


class AsyncSession(driver.AsyncSessionBase):
    """A process's place on one GPU. Create with ``await AsyncClient.session``."""

    client: AsyncClient

    def __init__(self, client: AsyncClient, gpu: int | str, **fields: Any) -> None:
        super().__init__(gpu, **fields)
        self.client = client

    async def acquire(self) -> None:
        """Take the lock and keep it until ``release``: an open-ended slice.

        Neither idle release nor a DROP_LOCK takes it away meanwhile (a drop is
        reported to ``on_drop``); ignoring drops past the daemon's drop timeout
        gets the lock revoked, and ``release`` then raises ``LockLost``."""
        await self.client._enter_slice(self)

    async def release(self) -> None:
        """End an ``acquire`` (or give back a lock kept between slices) now."""
        await self.client._release(self)

    async def parked(self, ok: bool, message: str = "") -> None:
        """Answer the daemon's PARK: the program's GPU memory is in host memory (``ok``), or why not."""
        await self.client._parked(self, ok, message)

    async def report_memory(self, used_bytes: int) -> None:
        """Tell the daemon how much GPU memory this session uses (MEM_UPDATE)."""
        await self.client._report_memory(self, used_bytes)

    async def set_limits(self, *, core_limit: int | None = None, mem_limit: int | str | None = None) -> None:
        """Change this session's own limits; the window's use is kept."""
        await self.client.call(p.SetLimits(id=0, session=self.id, core_limit=core_limit, mem_limit=size(mem_limit)))

    async def close(self) -> None:
        await self.client._detach(self)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncClient(driver.AsyncDriver):
    # unasync: asyncio
    """A connection to gpud shared by the sessions of one process. Get one with ``await
    AsyncClient.connect(...)``; constructed directly it is unconnected and refuses every call."""

    # unasync: sync
    # """A connection to gpud shared by the sessions of one process. Connects (and says HELLO) at once;
    # the first connect fails loudly (DaemonUnavailable)."""
    # unasync: end

    def __init__(
        self,
        socket: str | None = None,
        *,
        name: str = "",
        labels: dict[str, str] | None = None,
        reconnect: bool = True,
        unavailable_timeout: float = 10.0,
        proceed_unarbitrated: bool = False,
        request_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            p.resolve_socket_path(socket),
            name=name,
            labels=labels,
            reconnect=reconnect,
            unavailable_timeout=unavailable_timeout,
            proceed_unarbitrated=proceed_unarbitrated,
            request_timeout=request_timeout,
        )

    @classmethod
    async def connect(
        cls,
        socket: str | None = None,
        *,
        name: str = "",
        labels: dict[str, str] | None = None,
        reconnect: bool = True,
        unavailable_timeout: float = 10.0,
        proceed_unarbitrated: bool = False,
        request_timeout: float = 10.0,
    ) -> AsyncClient:
        """Connect and say HELLO; the first connect fails loudly (DaemonUnavailable)."""
        self = cls(
            socket,
            name=name,
            labels=labels,
            reconnect=reconnect,
            unavailable_timeout=unavailable_timeout,
            proceed_unarbitrated=proceed_unarbitrated,
            request_timeout=request_timeout,
        )
        await self._start()
        return self

    # --- requests -------------------------------------------------------------

    async def session(
        self,
        gpu: int | str = 0,
        *,
        priority: int = 0,
        idle_release: float | None = 1.0,
        on_drop: driver.DropHook | None = None,
        synchronize: driver.SynchronizeHook | None = None,
        on_lost: driver.LostHook | None = None,
        core_limit: int = 100,
        mem_limit: int | str | None = None,
        mem_estimate: int | str | None = None,
        memory_probe: MemoryProbe | None = None,
        framework_hooks: bool = True,
        task_id: str | None = None,
        on_park: driver.ParkHook | None = None,
    ) -> AsyncSession:
        """Attach to a GPU. ``core_limit``: percent of GPU time per window;
        ``mem_limit``/``mem_estimate``: bytes or sizes such as "8GiB".
        ``memory_probe`` is read at each slice's end and reported when it
        moved; with torch already imported, PyTorch's reserved memory is the
        default probe and ``mem_limit`` also caps PyTorch's allocator.
        ``on_lost`` is told at once when the session loses a lock it held (and says what it makes
        of it: the library then logs the loss at INFO, not as a warning). ``task_id``: the
        fractional allocation the session belongs to, whose share caps its limits. ``on_park``
        makes the session parkable (a supervisor of a program, ``gpuctl run``): it is told when
        the daemon needs the program's GPU memory while the session does not hold the lock, and
        answers with ``session.parked(ok, message)`` once the memory is in host memory (or not)."""
        s = AsyncSession(
            self,
            gpu,
            priority=priority,
            idle_release=idle_release,
            on_drop=on_drop,
            synchronize=synchronize,
            on_lost=on_lost,
            core_limit=core_limit,
            mem_limit=size(mem_limit),
            mem_estimate=size(mem_estimate),
            memory_probe=memory_probe or default_memory_probe(framework_hooks),
            framework_hooks=framework_hooks,
            memory_cap=default_memory_cap(framework_hooks),
            task_id=task_id,
            on_park=on_park,
        )
        await self._request(lambda done: self._core.attach(s, done), "ATTACH", self.request_timeout)
        return s

    async def call(self, msg: msgspec.Struct, timeout: float | None = None) -> Any:
        """Send a request and wait for its answer; an Error becomes an exception."""
        wait = self.request_timeout if timeout is None else timeout
        return await self._request(lambda done: self._core.start(msg, done), type(msg).__name__, wait)

    async def status(self) -> p.StatusReply:
        reply: p.StatusReply = await self.call(p.Status(id=0))
        return reply

    async def clients(self) -> p.ClientsReply:
        reply: p.ClientsReply = await self.call(p.ListClients(id=0))
        return reply

    async def set_tq(self, seconds: float, gpu: int | str | None = None) -> None:
        await self.call(p.SetTq(id=0, seconds=seconds, gpu=gpu))

    async def set_scheduler(self, on: bool, gpu: int | str | None = None) -> None:
        await self.call(p.SchedOn(id=0, gpu=gpu) if on else p.SchedOff(id=0, gpu=gpu))

    async def set_mode(self, mode: p.Mode | str, gpu: int | str | None = None) -> None:
        await self.call(p.SetMode(id=0, mode=p.Mode(mode), gpu=gpu))

    async def set_limits(
        self,
        client: int | str | None = None,
        *,
        core_limit: int | None = None,
        mem_limit: int | str | None = None,
        gpu: int | str | None = None,
    ) -> list[int]:
        """Change a client's limits (admin for another client's); the sessions changed."""
        msg = p.SetLimits(id=0, client=client, gpu=gpu, core_limit=core_limit, mem_limit=size(mem_limit))
        reply: p.LimitsSet = await self.call(msg)
        return reply.sessions

    @asynccontextmanager
    async def lease(
        self,
        gpu: int | str = "gpu:0",
        task_type: str = "OTHER",
        **fields: Any,
    ) -> AsyncIterator[p.LeaseResult]:
        """``with client.lease("gpu:0", task_type="ASR") as r:`` -- r.status is ACQUIRED, SKIPPED or
        FALLBACK_CPU; an acquired lease is released on exit, exceptions included."""
        result = await self.acquire(gpu, task_type, **fields)
        try:
            yield result
        finally:
            if result.acquired and result.lease_id is not None:
                await self.release_lease(result.lease_id, wait=False)

    async def acquire(
        self,
        gpu: int | str = "gpu:0",
        task_type: str = "OTHER",
        *,
        priority: int | None = None,
        max_wait_ms: int | None = None,
        hold_max_ms: int | None = None,
        queue_limit: int | None = None,
        busy_policy: p.BusyPolicy | str | None = None,
        mem_estimate: int | str | None = None,
        trace: p.Trace | dict[str, Any] | None = None,
    ) -> p.LeaseResult:
        """Ask for a lease; fields left out come from the task type's policy. Waits at most max_wait
        plus the request timeout; a grant that comes after the caller gave up is released at once."""
        msg = acquire_msg(
            gpu,
            task_type,
            priority=priority,
            max_wait_ms=max_wait_ms,
            hold_max_ms=hold_max_ms,
            queue_limit=queue_limit,
            busy_policy=busy_policy,
            mem_estimate=mem_estimate,
            trace=trace,
        )
        result: p.LeaseResult = await self.call(msg, timeout=acquire_timeout(msg, self.request_timeout))
        return result

    async def release_lease(self, lease_id: str, *, wait: bool = True) -> None:
        """Give a lease back. Idempotent; another client's lease is refused. ``wait=False`` does not wait
        for the OK (the connection keeps the order); ``lease()`` releases so: one round trip per lease."""
        if wait:
            await self.call(p.Release(id=0, lease_id=lease_id))
            return
        self._post(p.Release(id=0, lease_id=lease_id, quiet=True))

    async def report_oom(self, gpu: int | str = "gpu:0", task_type: str = "OTHER") -> None:
        """Count an out-of-memory error this process hit on ``gpu``."""
        await self.call(p.ReportOom(id=0, gpu=gpu, task_type=task_type))

    async def leases(self) -> p.LeasesReply:
        reply: p.LeasesReply = await self.call(p.ListLeases(id=0))
        return reply

    async def policies(self) -> dict[str, p.PolicyInfo]:
        reply: p.PoliciesReply = await self.call(p.ListPolicies(id=0))
        return reply.policies

    async def set_policy(self, task_type: str, **fields: Any) -> None:
        """Hot-update a task type's lease policy (admin)."""
        await self.call(policy_msg(task_type, fields))

    async def allocate(
        self,
        task_id: str,
        gpus: float = 1,
        *,
        cpus: int = 0,
        prefer: list[int | str] | None = None,
        strategy: p.Strategy | str = p.Strategy.FIRST_FIT,
        tenant: str | None = None,
        priority: int | p.PriorityClass | str | None = None,
        wait_ms: int = 0,
        owner_pid: int | None = None,
        on_preempt: p.Recovery | str = "terminate",
        gpus_max: int | None = None,
        protected: bool = False,
        memory_bytes: int | None = None,
    ) -> p.Allocated:
        """Assign GPUs and CPU cores to ``task_id`` (idempotent). Raises ProtocolError ``insufficient``
        when the node cannot hold it (after waiting up to ``wait_ms`` in the priority queue).
        ``on_preempt``: what this client does when gpud takes it back (a ``Recovery``; listen with
        ``add_allocation_listener``); ``gpus_max``: elastic, ``gpus`` whole GPUs at least and up to
        this many; ``protected`` (admin): never preempted; ``memory_bytes``: a fraction's memory
        ceiling for its sessions (default: its share of the GPU's memory)."""
        msg = allocate_msg(
            task_id,
            gpus,
            cpus,
            prefer,
            strategy,
            tenant,
            priority,
            wait_ms,
            owner_pid,
            on_preempt=on_preempt,
            gpus_max=gpus_max,
            protected=protected,
            memory_bytes=memory_bytes,
            notify=bool(self._listeners),  # told only if something listens: else its owner is signalled
        )
        reply: p.Allocated = await self.call(msg, timeout=wait_ms / 1000 + self.request_timeout)
        return reply

    async def yield_allocation(self, task_id: str) -> None:
        """YIELD: this holder did what gpud's PREEMPT asked (the program ended, was suspended, or let
        the named GPUs go); the devices go back now, not at the grace's end."""
        await self.call(p.Yield(id=0, task_id=task_id))

    async def protect(self, task_id: str, protected: bool = True) -> None:
        """Admin: the allocation of ``task_id`` is never preempted (or is preemptible again)."""
        await self.call(p.Protect(id=0, task_id=task_id, protected=protected))

    async def drain(self, gpu: int | str, on: bool = True) -> None:
        """Admin: no new grants on ``gpu`` and its allocations preempted with their recovery (``on``),
        or the GPU back in service."""
        await self.call(p.Drain(id=0, gpu=gpu, on=on))

    async def add_allocation_listener(self, listener: AllocationListener, /) -> None:
        # unasync: asyncio
        """Call ``listener(push)`` with each PREEMPT, PREEMPT_WITHDRAWN, ALLOC_REVOKED and ALLOC_CHANGED
        this connection gets, for any task. It is called in the client's reader task, in the order the
        pushes came; a coroutine function's coroutine runs as a task of its own. One that raises is
        logged; the reader goes on."""
        # unasync: sync
        # """Call ``listener(push)`` with each PREEMPT, PREEMPT_WITHDRAWN, ALLOC_REVOKED and ALLOC_CHANGED
        # this connection gets, for any task. It runs on the client's reader thread, in the order the
        # pushes came: keep it short (put the push on a queue) and never wait there for an answer of this
        # client. One that raises is logged; the reader goes on."""
        # unasync: end
        self._add_listener(listener)

    async def remove_allocation_listener(self, listener: AllocationListener, /) -> None:
        """Stop calling ``listener``; nothing happens if it was not added."""
        self._remove_listener(listener)

    async def release_allocation(self, task_id: str) -> None:
        await self.call(p.Free(id=0, task_id=task_id))

    async def allocations(self) -> p.AllocationsReply:
        """Every allocation, read a page at a time (see ``protocol.join_pages``)."""
        pages: list[p.AllocationsReply] = [await self.call(p.ListAllocations(id=0))]
        while (after := pages[-1].next_after) is not None:
            pages.append(await self.call(p.ListAllocations(id=0, after=after)))
        return p.join_pages(pages)

    async def reset_allocations(self) -> None:
        """Admin: release every allocation on the node."""
        await self.call(p.ResetAllocations(id=0))

    async def set_labels(self, labels: dict[str, str]) -> None:
        """The labels this client is known by from now on (``gpuctl clients`` shows them), kept for
        the HELLO of a reconnect; sent without waiting (nothing is sent while gpud is away)."""
        self.labels = dict(labels)
        self._post(p.Relabel(id=0, labels=self.labels))

    async def close(self) -> None:
        """Close the connection; the daemon frees every lock and session of it."""
        await self._close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
