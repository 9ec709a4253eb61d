"""The asyncio client: one connection, one reader task, sessions.

The same shape and rules as the sync ``Client`` (``gpud_client.client``), with
``await`` where that one blocks::

    async with await AsyncClient.connect(name="trainer") as client:
        session = await client.session(0, core_limit=50)
        for batch in batches:
            async with session.slice():
                await step(batch)

``AsyncClient.connect`` is the only way to get a client (it connects and says
HELLO before it returns); ``async with`` on the client, or ``await
client.close()``, ends it. ``async with session.slice():`` takes the lock if
the session does not hold it and gives it back at exit only if a DROP_LOCK is
pending; between slices the lock is kept, so a slice that already holds it
does not even yield to the event loop. A DROP_LOCK between slices is answered
at once, and a lock unused for ``idle_release`` seconds is given back early by
a timer on the loop. ``on_drop`` and ``synchronize`` may be plain callables or
coroutine functions; a coroutine ``on_drop`` runs in a task of its own (so it
may ``await session.release()`` or call the daemon) and a drop between slices
is answered when it has finished.

Everything runs on the loop's thread, so the state needs no lock: the reader
task decodes frames and dispatches them (an answer resolves the future of the
request with its id; a push changes its session), and every change wakes the
waiters through one ``asyncio.Event`` that is replaced at each notification.
So a client belongs to the loop it was connected on, and it hears the daemon
only while that loop runs: work inside slices should await (or run blocking
GPU calls in a thread), else a DROP_LOCK waits for the next await. A session
runs one slice at a time, also across tasks: a second task's ``slice()``
raises instead of sharing the lock unseen; concurrent tasks take a session
each.

When the daemon goes away the reader task reconnects with backoff (50 ms
doubling to 2 s) and re-attaches every session; the locks died with the
daemon. A slice started meanwhile waits up to ``unavailable_timeout`` seconds
and then raises ``DaemonUnavailable`` or, with ``proceed_unarbitrated=True``,
runs without the lock. That is the documented choice, as in the sync client.

Cancellation. The protocol cannot withdraw a LOCK_REQUEST, so when the task
waiting in ``slice()`` or ``acquire()`` is cancelled the request stays queued
at the daemon. The next slice of the session waits for that same grant; if no
slice is waiting when it arrives, it is given back at once (LOCK_RELEASED
without ``synchronize``: no work ran under it). The same holds when the grant
arrived but the task was cancelled before it resumed. A cancelled task never
loses a later slice its grant nor leaves the lock held with nobody to use it.

This module must never block the loop (no blocking socket, no sleep, no
thread), let a hook's exception reach the reader task, or leave a session
"releasing" when a task is cancelled in ``synchronize``: the LOCK_RELEASED is
sent from a ``finally``. It imports only the standard library and msgspec.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from gpud_client import protocol as p
from gpud_client.errors import DaemonUnavailable, GpudError, MemoryLimitExceeded, ProtocolError, error_from
from gpud_client._requests import (
    SessionFields,
    acquire_msg,
    acquire_timeout,
    allocate_msg,
    apply_limits,
    attach_msg,
    bind,
    granted,
    memory_to_report,
    policy_msg,
    revoked,
    size,
)
from gpud_client.connection import Inbox, unreachable

log = logging.getLogger("gpud_client")
DropHook = Callable[[p.DropReason], Awaitable[None] | None]
SyncHook = Callable[[], Awaitable[None] | None]
_BACKOFF_START_S = 0.05
_BACKOFF_MAX_S = 2.0
_CONNECT_TIMEOUT_S = 5.0
_READ_BYTES = 65536


class _Wire:
    """One connection: the stream, its framing and its codec."""

    def __init__(self, path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.path = path
        self._reader = reader
        self._writer = writer
        self._codec = p.client_codec()
        self._inbox = Inbox(path, self._codec)
        self._backlog: deque[Any] = deque()  # messages call() read past, for recv()
        self._ids = itertools.count(1)

    @classmethod
    async def open(cls, path: str) -> _Wire:
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(path)
        except OSError as exc:  # TimeoutError included
            raise unreachable(path, exc.strerror or str(exc) or "timed out") from None
        return cls(path, reader, writer)

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, msg: msgspec.Struct) -> None:
        if self._writer.is_closing():
            raise DaemonUnavailable(f"lost connection to gpud at {self.path}")
        self._writer.write(self._codec.encode(msg))

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except OSError as exc:
            raise DaemonUnavailable(f"lost connection to gpud at {self.path}: {exc}") from None

    async def recv(self) -> Any:
        """The next message from the daemon. Raises DaemonUnavailable on EOF."""
        if self._backlog:
            return self._backlog.popleft()
        return await self._recv()

    async def _recv(self) -> Any:
        while not self._inbox:
            try:
                data = await self._reader.read(_READ_BYTES)
            except OSError as exc:
                raise DaemonUnavailable(f"lost connection to gpud at {self.path}: {exc}") from None
            self._inbox.feed(data)
        return self._inbox.pop()

    async def call(self, msg: msgspec.Struct, timeout: float) -> Any:
        """Send a request and read up to its answer, keeping what came first
        for ``recv``. Only while no reader task reads this wire (HELLO, re-attach)."""
        rid = self.next_id()
        self.send(msgspec.structs.replace(msg, id=rid))
        try:
            async with asyncio.timeout(timeout):
                while True:
                    reply = await self._recv()
                    if getattr(reply, "id", None) == rid:
                        break
                    self._backlog.append(reply)
        except TimeoutError:
            raise DaemonUnavailable(f"gpud did not answer {type(msg).__name__} within {timeout} s") from None
        if isinstance(reply, p.Error):
            raise error_from(reply.code, reply.message)
        return reply

    def close(self) -> None:
        self._writer.close()


class AsyncSession(SessionFields):
    """A process's place on one GPU. Create with ``await AsyncClient.session``."""

    def __init__(
        self,
        client: AsyncClient,
        gpu: int | str,
        *,
        priority: int,
        idle_release: float | None,
        on_drop: DropHook | None,
        synchronize: SyncHook | None,
        core_limit: int = 100,
        mem_limit: int | None = None,
        mem_estimate: int | None = None,
        memory_probe: Callable[[], int] | None = None,
        framework_hooks: bool = True,
    ) -> None:
        super().__init__(
            gpu, priority=priority, idle_release=idle_release, core_limit=core_limit, mem_limit=mem_limit,
            mem_estimate=mem_estimate, memory_probe=memory_probe, framework_hooks=framework_hooks,
        )
        self.client = client
        self.on_drop = on_drop
        self.synchronize = synchronize
        self.entering = False  # a slice() or acquire() waits for the lock
        self.idle_timer: asyncio.TimerHandle | None = None

    @asynccontextmanager
    async def slice(self) -> AsyncIterator[AsyncSession]:
        """One unit of GPU work under the lock."""
        arbitrated = await self.client._enter_slice(self)
        try:
            yield self
        finally:
            if arbitrated:
                await self.client._exit_slice(self)

    async def acquire(self) -> None:
        """Take the lock and keep it until ``release``: an open-ended slice.

        Neither idle release nor a DROP_LOCK takes it away meanwhile (a drop is
        reported to ``on_drop``); ignoring drops past the daemon's drop timeout
        gets the lock revoked."""
        await self.client._enter_slice(self)

    async def release(self) -> None:
        """End an ``acquire`` (or give back a lock kept between slices) now."""
        await self.client._release(self)

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


class AsyncClient:
    """A connection to gpud shared by the sessions of one process.

    Get one with ``await AsyncClient.connect(...)``; constructing it directly
    gives an unconnected client that refuses every call."""

    welcome: p.Welcome

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
        self.path = p.resolve_socket_path(socket)
        self.name = name
        self.labels = dict(labels or {})
        self.reconnect = reconnect
        self.unavailable_timeout = unavailable_timeout
        self.proceed_unarbitrated = proceed_unarbitrated
        self.request_timeout = request_timeout
        self._changed = asyncio.Event()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._abandoned: set[int] = set()  # ACQUIREs nobody waits for any more
        self.revoked_leases: set[str] = set()
        self._lock_requests: dict[int, AsyncSession] = {}  # LOCK_REQUEST id -> session
        self._sessions: dict[int, AsyncSession] = {}  # daemon session id -> session
        self._all: list[AsyncSession] = []
        self._tasks: set[asyncio.Future[Any]] = set()  # hooks and give-backs in flight
        self._closed = False
        self._wire: _Wire | None = None
        self._reader: asyncio.Task[None] | None = None
        self.scheduler_on: dict[int, bool] = {}
        self.reconnects = 0

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
            socket, name=name, labels=labels, reconnect=reconnect, unavailable_timeout=unavailable_timeout,
            proceed_unarbitrated=proceed_unarbitrated, request_timeout=request_timeout,
        )
        wire = await _Wire.open(self.path)
        try:
            self._welcomed(await wire.call(self._hello_msg(), request_timeout))
        except BaseException:
            wire.close()
            raise
        self._wire = wire
        self._reader = asyncio.create_task(self._read_loop(), name="gpud-client-reader")
        return self

    # --- public API -----------------------------------------------------------

    @property
    def client_id(self) -> int:
        return self.welcome.client_id

    async def session(
        self,
        gpu: int | str = 0,
        *,
        priority: int = 0,
        idle_release: float | None = 1.0,
        on_drop: DropHook | None = None,
        synchronize: SyncHook | None = None,
        core_limit: int = 100,
        mem_limit: int | str | None = None,
        mem_estimate: int | str | None = None,
        memory_probe: Callable[[], int] | None = None,
        framework_hooks: bool = True,
    ) -> AsyncSession:
        """Attach to a GPU. ``core_limit``: percent of GPU time per window;
        ``mem_limit``/``mem_estimate``: bytes or sizes such as "8GiB".
        ``memory_probe`` is read at each slice's end and reported when it
        moved; with torch already imported, PyTorch's reserved memory is the
        default probe and ``mem_limit`` also caps PyTorch's allocator."""
        s = AsyncSession(
            self, gpu, priority=priority, idle_release=idle_release, on_drop=on_drop, synchronize=synchronize,
            core_limit=core_limit, mem_limit=size(mem_limit), mem_estimate=size(mem_estimate),
            memory_probe=memory_probe, framework_hooks=framework_hooks,
        )
        wire = self._wire
        reply: p.Attached = await self.call(attach_msg(s))
        if self._wire is not wire:  # lost (and maybe re-attached the others) while the answer was on its way
            raise DaemonUnavailable(f"lost connection to gpud at {self.path} while attaching")
        self._bind(s, reply)
        self._all.append(s)
        return s

    async def call(self, msg: msgspec.Struct, timeout: float | None = None) -> Any:
        """Send a request and wait for its answer; an Error becomes an exception."""
        wire = self._require_wire()
        rid = wire.next_id()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        wait = self.request_timeout if timeout is None else timeout
        done = False
        try:
            wire.send(msgspec.structs.replace(msg, id=rid))
            async with asyncio.timeout(wait):
                await wire.drain()
                reply = await fut
            done = True
        except TimeoutError:
            raise DaemonUnavailable(f"gpud did not answer {type(msg).__name__} within {wait} s") from None
        finally:
            if not done and isinstance(msg, p.Acquire):
                self._abandoned.add(rid)  # a grant that comes later is given straight back
            self._pending.pop(rid, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved, also when we were cancelled after it was set
        if isinstance(reply, p.Error):
            raise error_from(reply.code, reply.message)
        return reply

    # --- leases (GpuArbiter) ---------------------------------------------------

    @asynccontextmanager
    async def lease(self, gpu: int | str = "gpu:0", task_type: str = "OTHER", **fields: Any) -> AsyncIterator[p.LeaseResult]:
        """``async with client.lease("gpu:0", task_type="ASR") as r:`` -- an
        acquired lease is released on exit, exceptions and cancellation included."""
        result = await self.acquire(gpu, task_type, **fields)
        try:
            yield result
        finally:
            if result.acquired and result.lease_id is not None and self._wire is not None:
                # not waiting for the OK: the connection keeps the order; one round trip per lease
                self._wire.send(p.Release(id=self._wire.next_id(), lease_id=result.lease_id, quiet=True))

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
        """Ask for a lease; fields left out come from the task type's policy.
        If the caller is cancelled while it waits, a grant that still comes is
        released at once."""
        msg = acquire_msg(
            gpu, task_type, priority=priority, max_wait_ms=max_wait_ms, hold_max_ms=hold_max_ms,
            queue_limit=queue_limit, busy_policy=busy_policy, mem_estimate=mem_estimate, trace=trace,
        )
        wait = acquire_timeout(msg, self.request_timeout)
        result: p.LeaseResult = await self.call(msg, timeout=wait)
        return result

    async def release_lease(self, lease_id: str) -> None:
        """Give a lease back. Idempotent; another client's lease is refused."""
        await self.call(p.Release(id=0, lease_id=lease_id))

    async def report_oom(self, gpu: int | str = "gpu:0", task_type: str = "OTHER") -> None:
        await self.call(p.ReportOom(id=0, gpu=gpu, task_type=task_type))

    async def leases(self) -> p.LeasesReply:
        reply: p.LeasesReply = await self.call(p.ListLeases(id=0))
        return reply

    async def policies(self) -> dict[str, p.PolicyInfo]:
        reply: p.PoliciesReply = await self.call(p.ListPolicies(id=0))
        return reply.policies

    async def set_policy(self, task_type: str, **fields: Any) -> None:
        await self.call(policy_msg(task_type, fields))

    # --- allocations ---------------------------------------------------------

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
    ) -> p.Allocated:
        """Assign GPUs and CPU cores to ``task_id`` (idempotent). Raises
        ProtocolError with code ``insufficient`` when the node cannot hold it
        (after waiting up to ``wait_ms`` in the priority queue)."""
        msg = allocate_msg(task_id, gpus, cpus, prefer, strategy, tenant, priority, wait_ms, owner_pid)
        reply: p.Allocated = await self.call(msg, timeout=wait_ms / 1000 + self.request_timeout)
        return reply

    async def release_allocation(self, task_id: str) -> None:
        await self.call(p.Free(id=0, task_id=task_id))

    async def allocations(self) -> p.AllocationsReply:
        reply: p.AllocationsReply = await self.call(p.ListAllocations(id=0))
        return reply

    async def reset_allocations(self) -> None:
        """Admin: release every allocation on the node."""
        await self.call(p.ResetAllocations(id=0))

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
        reply: p.LimitsSet = await self.call(
            p.SetLimits(id=0, client=client, gpu=gpu, core_limit=core_limit, mem_limit=size(mem_limit))
        )
        return reply.sessions

    async def close(self) -> None:
        """Close the connection; the daemon frees every lock and session of it."""
        if self._closed:
            return
        self._closed = True
        wire, self._wire = self._wire, None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(GpudError("the client is closed"))
        self._pending.clear()
        for s in self._all:
            self._disarm_idle(s)
        self._notify()
        if wire is not None:
            wire.close()
        tasks = [t for t in (self._reader, *self._tasks) if t is not None and t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- sessions -----------------------------------------------------------

    async def _enter_slice(self, s: AsyncSession) -> bool:
        if s.closed:
            raise GpudError("this session is closed")
        if s.in_slice or s.entering:
            raise GpudError("slices of one session do not nest (an acquire() counts as one; one slice at a time)")
        if s.mem_error is not None:
            err, s.mem_error = s.mem_error, None
            raise err
        s.entering = True
        try:
            arbitrated = await self._acquire(s)
        except BaseException:
            s.entering = False
            if s.state == "holding" and not s.in_slice:
                self._hand_back(s)  # granted to a task that is no longer there to use it
            raise
        s.entering = False
        s.in_slice = arbitrated
        return arbitrated

    async def _exit_slice(self, s: AsyncSession) -> None:
        if s.memory_probe is not None and (used := memory_to_report(s)) is not None:
            try:
                self._send_memory(s, used)
            except DaemonUnavailable:
                pass  # reported again after the re-attach, at a later slice's end
        s.in_slice = False
        if s.closed:
            return
        s.last_used = self._now()
        if s.state == "holding" and s.drop_pending is not None:
            s.state = "releasing"
            await self._give_back(s)
        else:
            self._arm_idle(s)

    async def _acquire(self, s: AsyncSession) -> bool:
        """Wait until ``s`` holds the lock. False: proceeding unarbitrated."""
        deadline: float | None = None
        while True:
            if s.error is not None:
                err, s.error = s.error, None
                raise err
            if s.state == "holding":
                return True
            if self._closed or s.closed:
                raise GpudError("the client or session is closed")
            wire = self._wire
            if wire is None or s.id == 0:
                deadline = deadline or self._now() + self.unavailable_timeout
                left = deadline - self._now()
                if left <= 0:
                    if self.proceed_unarbitrated:
                        log.warning("gpud unavailable: running a slice without the GPU lock")
                        return False
                    raise DaemonUnavailable(f"gpud at {self.path} has been unreachable for {self.unavailable_timeout} s")
                await self._wait_change(left)
                continue
            if s.state == "idle":
                # Only a refusal answers a LOCK_REQUEST (an Error with this id);
                # the grant comes as a LOCK_OK push. A "waiting" session's
                # request is still queued (maybe by a cancelled slice): wait for it.
                rid = wire.next_id()
                try:
                    wire.send(p.LockRequest(id=rid, session=s.id))
                except DaemonUnavailable:
                    pass  # the reader sees the loss, resets the session and wakes us
                else:
                    s.state, s.request_id = "waiting", rid
                    self._lock_requests[rid] = s
            await self._wait_change()

    async def _release(self, s: AsyncSession) -> None:
        s.in_slice = False
        if s.state != "holding":
            return
        s.state = "releasing"
        await self._give_back(s)

    async def _give_back(self, s: AsyncSession) -> None:
        """Synchronize, then LOCK_RELEASED. Called with s.state == 'releasing'."""
        try:
            if s.synchronize is not None:
                try:
                    await _settle(s.synchronize())
                except Exception:
                    log.exception("synchronize hook failed; releasing the GPU lock anyway")
        finally:  # also when cancelled: the lock must not stay with nobody to use it
            if s.state == "releasing":  # else revoked or reconnected meanwhile
                self._hand_back(s)

    def _hand_back(self, s: AsyncSession) -> None:
        """LOCK_RELEASED now, without synchronize."""
        wire = self._wire
        s.state, s.drop_pending = "idle", None
        self._disarm_idle(s)
        self._notify()
        if wire is not None and s.id:
            try:
                wire.send(p.LockReleased(id=wire.next_id(), session=s.id, grant=s.grant))
            except DaemonUnavailable:
                pass  # the reader reconnects; the lock died with the connection

    def _release_if_unused(self, s: AsyncSession, grant: int) -> None:
        """Answer a DROP_LOCK for ``grant`` at once when no slice uses the lock."""
        if s.state != "holding" or s.grant != grant or s.drop_pending is None or s.in_slice or s.entering:
            return
        if s.synchronize is None:
            self._hand_back(s)
        else:
            s.state = "releasing"
            self._spawn(self._give_back(s))

    async def _detach(self, s: AsyncSession) -> None:
        if s.closed:
            return
        s.closed = True
        sid, s.id = s.id, 0
        s.state, s.drop_pending = "idle", None
        self._disarm_idle(s)
        self._sessions.pop(sid, None)
        if s in self._all:
            self._all.remove(s)
        self._notify()
        if sid and self._wire is not None:
            try:
                await self.call(p.Detach(id=0, session=sid))
            except GpudError:
                pass  # gone with the connection either way

    async def _report_memory(self, s: AsyncSession, used_bytes: int) -> None:
        wire = self._wire
        self._send_memory(s, used_bytes)
        if wire is not None:
            try:
                async with asyncio.timeout(self.request_timeout):
                    await wire.drain()
            except TimeoutError:
                raise DaemonUnavailable(f"gpud did not read MEM_UPDATE within {self.request_timeout} s") from None

    def _send_memory(self, s: AsyncSession, used_bytes: int) -> None:
        wire = self._wire
        if wire is None or not s.id:
            return  # reported again after the re-attach, at the next slice's end
        s.mem_reported = used_bytes
        wire.send(p.MemUpdate(id=wire.next_id(), session=s.id, used_bytes=used_bytes))

    def _hello_msg(self) -> p.Hello:
        return p.Hello(id=0, version=p.PROTOCOL_VERSION, name=self.name, labels=self.labels)



    def _bind(self, s: AsyncSession, reply: p.Attached) -> None:
        bind(s, reply)
        self._sessions[s.id] = s
        self.scheduler_on[reply.gpu] = reply.scheduler_on

    # --- idle release: one timer handle per session holding between slices ------

    def _arm_idle(self, s: AsyncSession) -> None:
        """Due at last_used + idle_release; a later slice moves it lazily, at expiry."""
        if s.idle_release is None or s.idle_timer is not None or s.state != "holding":
            return
        loop = asyncio.get_running_loop()
        s.idle_timer = loop.call_at(s.last_used + s.idle_release, self._idle_due, s)

    @staticmethod
    def _disarm_idle(s: AsyncSession) -> None:
        if s.idle_timer is not None:
            s.idle_timer.cancel()
            s.idle_timer = None

    def _idle_due(self, s: AsyncSession) -> None:
        s.idle_timer = None
        if s.state != "holding" or s.in_slice or s.entering or s.closed or s.idle_release is None:
            return  # the next slice's end (or grant) arms it again
        if self._now() < s.last_used + s.idle_release:
            self._arm_idle(s)
            return
        s.state = "releasing"
        self._spawn(self._give_back(s))

    # --- the reader task ------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _notify(self) -> None:
        """Wake every waiter; each re-checks its condition."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float | None = None) -> None:
        changed = self._changed
        try:
            async with asyncio.timeout(timeout):
                await changed.wait()
        except TimeoutError:
            pass

    def _spawn(self, aw: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _require_wire(self) -> _Wire:
        if self._closed:
            raise GpudError("the client is closed")
        if self._reader is None:
            raise GpudError("this client is not connected: get one with `await AsyncClient.connect(...)`")
        if self._wire is None:
            raise DaemonUnavailable(f"not connected to gpud at {self.path} (reconnecting)")
        return self._wire

    def _welcomed(self, welcome: p.Welcome) -> None:
        self.welcome = welcome
        self.scheduler_on = {g.index: g.scheduler_on for g in welcome.gpus}

    async def _read_loop(self) -> None:
        while True:
            wire = self._wire
            if wire is not None:
                try:
                    while True:
                        msg = await wire.recv()
                        self._dispatch(msg)
                except GpudError as exc:
                    self._lost(wire, exc)
                except Exception as exc:  # a bug here must not leave the client deaf: start afresh
                    log.exception("gpud client reader failed")
                    self._lost(wire, GpudError(f"client reader failed: {exc!r}"))
            if not await self._reconnect():
                return

    def _dispatch(self, msg: Any) -> None:
        match msg:
            case p.LeaseResult(id=rid) if rid in self._abandoned:
                self._abandoned.discard(rid)
                if msg.acquired and msg.lease_id is not None and self._wire is not None:
                    self._wire.send(p.Release(id=self._wire.next_id(), lease_id=msg.lease_id))
            case p.LeaseRevoked(lease_id=lease_id, reason=reason):
                log.warning("gpud released lease %s by force (%s)", lease_id, reason)
                self.revoked_leases.add(lease_id)
            case p.LockOk(session=sid, grant=g):
                s = self._sessions.get(sid)
                if s is not None:
                    self._lock_requests.pop(s.request_id, None)
                    granted(s, g, self._now())
                    if not (s.entering or s.in_slice):
                        self._hand_back(s)  # the slice that asked was cancelled
            case p.DropLock(session=sid, grant=g, reason=reason):
                s = self._sessions.get(sid)
                if s is not None and s.state == "holding" and s.grant == g:
                    s.drops += 1
                    s.drop_pending = reason
                    self._tell_drop(s, g, reason)
            case p.Revoked(session=sid, grant=g, reason=reason):
                s = self._sessions.get(sid)
                if s is not None:
                    revoked(s, g, reason)
            case p.LimitsChanged(session=sid, core_limit=core, mem_limit=mem):
                s = self._sessions.get(sid)
                if s is not None:
                    apply_limits(s, core, mem)
            case p.MemLimitExceeded(session=sid, used_bytes=used, limit_bytes=limit):
                s = self._sessions.get(sid)
                if s is not None:
                    s.mem_error = MemoryLimitExceeded(sid, used, limit)
            case p.Goodbye(reason=reason):
                log.info("gpud is shutting down (%s); reconnecting when it is back", reason)
            case p.SchedState(gpu=gpu, on=on):
                self.scheduler_on[gpu] = on
            case p.Error(id=rid) if rid is not None and rid in self._lock_requests:
                sess = self._lock_requests.pop(rid)
                sess.error = error_from(msg.code, msg.message)
                if sess.state == "waiting":
                    sess.state = "idle"
            case p.Error(id=rid) if rid is not None and rid in self._pending:
                self._resolve(rid, msg)
            case p.Error():
                log.warning("gpud reported %s: %s", msg.code, msg.message)
            case _ if getattr(msg, "id", None) in self._pending:
                self._resolve(msg.id, msg)
        self._notify()

    def _resolve(self, rid: int, reply: Any) -> None:
        fut = self._pending.pop(rid)
        if not fut.done():
            fut.set_result(reply)

    def _tell_drop(self, s: AsyncSession, grant: int, reason: p.DropReason) -> None:
        """Call on_drop; a coroutine runs in a task and the drop is answered after it."""
        result: Awaitable[None] | None = None
        if s.on_drop is not None:
            try:
                result = s.on_drop(reason)
            except Exception:
                log.exception("on_drop callback failed")
        if result is None or not inspect.isawaitable(result):
            self._release_if_unused(s, grant)
            return
        task = asyncio.ensure_future(result)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: self._drop_hook_done(t, s, grant))

    def _drop_hook_done(self, task: asyncio.Future[Any], s: AsyncSession, grant: int) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("on_drop callback failed", exc_info=exc)
        self._release_if_unused(s, grant)

    def _lost(self, wire: _Wire, exc: GpudError) -> None:
        if self._wire is wire:
            self._wire = None
        self._lock_requests.clear()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(DaemonUnavailable(f"lost connection to gpud at {self.path}: {exc}"))
        self._pending.clear()
        for s in self._sessions.values():
            s.state, s.drop_pending, s.id = "idle", None, 0
            self._disarm_idle(s)
        self._sessions.clear()
        self._notify()
        wire.close()
        if not self._closed:
            log.warning("lost connection to gpud: %s", exc)

    async def _reconnect(self) -> bool:
        """Reconnect with backoff and re-attach every session. False: stop."""
        delay = _BACKOFF_START_S
        while not self._closed and self.reconnect:
            wire: _Wire | None = None
            try:
                wire = await _Wire.open(self.path)
                welcome: p.Welcome = await wire.call(self._hello_msg(), self.request_timeout)
                attached = [(s, await wire.call(attach_msg(s), self.request_timeout)) for s in list(self._all)]
            except GpudError as exc:
                if wire is not None:
                    wire.close()
                # A refusal (a GPU gone after the restart, say) is retried like
                # an absence, as the sync client does; but it is said out loud.
                (log.warning if isinstance(exc, ProtocolError) else log.debug)(
                    "reconnecting to gpud at %s failed: %s", self.path, exc
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            except BaseException:  # cancelled by close()
                if wire is not None:
                    wire.close()
                raise
            self._welcomed(welcome)
            for s, reply in attached:
                if s.closed:  # closed while we re-attached it: detach it again, unanswered
                    wire.send(p.Detach(id=wire.next_id(), session=reply.session))
                else:
                    self._bind(s, reply)
            self._wire = wire
            self.reconnects += 1
            self._notify()
            log.info("reconnected to gpud at %s; %d session(s) re-attached", self.path, len(attached))
            return True
        return False


async def _settle(result: Awaitable[None] | None) -> None:
    """Await what a hook returned, if it is awaitable (a coroutine function's call)."""
    if result is not None and inspect.isawaitable(result):
        await result
