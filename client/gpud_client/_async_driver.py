"""The asyncio client's machinery: a driver of the client core with a reader task.

Everything runs on the loop's thread, so the core needs no lock: the reader
task decodes frames and hands them to the core, and every change wakes the
waiters through one ``asyncio.Event`` that is replaced at each notification.
So a client belongs to the loop it was connected on, and hears the daemon only
while that loop runs. User hooks may be plain callables or coroutine functions;
a push's hooks run in a task of their own (never in the reader), a slice's own
end awaits them. Allocation listeners are called in the reader task, in the order
the pushes came; one that returns an awaitable has it run as a task of its own.
The idle sweep is one timer handle on the loop. What does not differ from the
sync driver is ``_base``'s.

This module must never block the loop (no blocking socket, no sleep, no
thread), let a hook's exception reach the reader task, or leave a lock
"releasing" when a task is cancelled in ``synchronize``: the core is told from
a ``finally``. Nothing here decides anything: ``gpud_client.core`` does.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Self

import msgspec

from gpud_client import protocol as p
from gpud_client._base import AllocationListener, ClientBase, hook_failed, reader_failure, waiting
from gpud_client.connection import Inbox, unreachable
from gpud_client.core import HOLD, SessionState, reconnect_delay
from gpud_client.core.actions import CallAllocationListeners, CallOnDrop, CallOnLost, CallOnPark, GiveBack, Hook, Send
from gpud_client.errors import DaemonUnavailable, GpudError, LockLost, ProtocolError
from gpud_client.frameworks import read_memory

log = logging.getLogger("gpud_client")
# The hooks a session of this client takes: plain callables or coroutine functions (see above).
DropHook = Callable[[p.DropReason], Awaitable[None] | None]
SynchronizeHook = Callable[[], Awaitable[None] | None]
LostHook = Callable[[LockLost], Awaitable[None] | None]
ParkHook = Callable[[], Any]
CONNECT_TIMEOUT_S = 5.0
READ_BYTES = 65536


class _Reader(asyncio.StreamReader):
    """A stream whose failure reads as its end, after what arrived before it: asyncio's own
    raises the failure at once, and a write that fails (EPIPE: the daemon refused the connection
    and closed) would hide the ERROR that says why, already read."""

    lost: BaseException | None = None

    def set_exception(self, exc: BaseException) -> None:
        self.lost = exc
        self.feed_eof()


class Wire:
    """One connection: the stream and its framing."""

    def __init__(self, path: str, reader: _Reader, writer: asyncio.StreamWriter) -> None:
        self.path = path
        self._reader = reader
        self._writer = writer
        self._inbox = Inbox(path, p.client_codec())

    @classmethod
    async def open(cls, path: str) -> Wire:
        loop = asyncio.get_running_loop()
        reader = _Reader(limit=READ_BYTES, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                transport, _ = await loop.create_unix_connection(lambda: protocol, path)
        except OSError as exc:  # TimeoutError included
            raise unreachable(path, exc.strerror or str(exc) or "timed out") from None
        return cls(path, reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    def write(self, data: bytes) -> None:
        if not self._writer.is_closing():  # else the reader sees the end and tells the core
            self._writer.write(data)

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except OSError as exc:
            raise DaemonUnavailable(f"lost connection to gpud at {self.path}: {exc}") from None

    async def recv(self) -> Any:
        """The next message from the daemon. Raises DaemonUnavailable on EOF."""
        while not self._inbox:
            try:
                data = await self._reader.read(READ_BYTES)
            except OSError as exc:
                raise DaemonUnavailable(f"lost connection to gpud at {self.path}: {exc}") from None
            if not data and self._reader.lost is not None:
                raise DaemonUnavailable(f"lost connection to gpud at {self.path}: {self._reader.lost}")
            self._inbox.feed(data)
        return self._inbox.pop()

    def close(self) -> None:
        self._writer.close()


class AsyncSessionBase(SessionState):
    """What an ``AsyncSession`` gets from its driver: its slices."""

    client: AsyncDriver

    @asynccontextmanager
    async def slice(self) -> AsyncIterator[Self]:
        """One unit of GPU work under the lock: ``async with session.slice(): ...``."""
        arbitrated = await self.client._enter_slice(self)
        try:
            yield self
        finally:
            if arbitrated:
                await self.client._exit_slice(self)


class AsyncDriver(ClientBase):
    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)  # ClientBase's keyword options
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Future[Any]] = set()  # hooks in flight
        self._wire: Wire | None = None
        self._reader: asyncio.Task[None] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._listeners: list[AllocationListener] = []

    async def _start(self) -> None:
        await self._open()
        self._reader = asyncio.create_task(self._read_loop(), name="gpud-client-reader")

    async def _request(self, start: Callable[[asyncio.Future[None]], Send], what: str, wait: float) -> Any:
        if self._reader is None and not self._core.closed:
            raise GpudError("this client is not connected: get one with `await AsyncClient.connect(...)`")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        send = start(done)
        rid: int = send.msg.id  # type: ignore[attr-defined]
        wire = self._wire
        try:
            async with asyncio.timeout(wait):
                if wire is not None:
                    wire.write(send.data)
                    await wire.drain()
                await done
        except TimeoutError:
            self._carry_out(self._core.abandon(rid))  # what it is given anyway goes back
            raise DaemonUnavailable(f"gpud did not answer {what} within {wait} s") from None
        except BaseException:  # cancelled, or the connection failed under drain()
            self._carry_out(self._core.abandon(rid))
            raise
        return self._core.finish(rid)

    async def _close(self) -> None:
        if self._core.closed:
            return
        self._carry_out(self._core.close())
        wire, self._wire = self._wire, None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if wire is not None:
            wire.close()
        tasks = [t for t in (self._reader, *self._tasks) if t is not None and t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- slices ---------------------------------------------------------------

    async def _enter_slice(self, s: SessionState) -> bool:
        """Wait until ``s`` holds the lock. False: proceeding unarbitrated."""
        if self._core.begin_slice(s):
            return True  # the lock is kept between slices: not even a yield to the loop
        try:
            step = self._look(s, self._now())
            while waiting(step):
                await self._wait_change(step)
                step = self._look(s, self._now())
        except BaseException:
            self._carry_out(self._core.cancel_entry(s))
            raise
        return step == HOLD

    async def _exit_slice(self, s: SessionState) -> None:
        used = None if s.memory_probe is None else read_memory(s.memory_probe)
        actions = self._core.end_slice(s, self._now(), used)
        if actions and (hooks := self._carry_out(actions)):
            await self._run_hooks(hooks)

    async def _release(self, s: SessionState) -> None:
        await self._run_hooks(self._carry_out(self._core.release(s)))

    async def _detach(self, s: SessionState) -> None:
        sid = self._core.detach(s)
        self._wake()
        if sid:
            try:
                det = p.Detach(id=0, session=sid)
                await self._request(lambda done: self._core.start(det, done), "DETACH", self.request_timeout)
            except GpudError:
                pass  # gone with the connection either way

    def _post(self, msg: msgspec.Struct) -> None:
        """Send a message whose answer nobody waits for (nothing while unconnected)."""
        self._carry_out(self._core.send(msg))

    async def _parked(self, s: SessionState, ok: bool, message: str) -> None:
        self._carry_out(self._core.parked(s, ok, message))

    async def _report_memory(self, s: SessionState, used_bytes: int) -> None:
        self._carry_out(self._core.report_memory(s, used_bytes))
        if self._wire is not None:
            try:
                async with asyncio.timeout(self.request_timeout):
                    await self._wire.drain()
            except TimeoutError:
                raise DaemonUnavailable(f"gpud did not read MEM_UPDATE within {self.request_timeout} s") from None

    # --- carrying out the core's actions (``ClientBase._carry_out``) -------------------------

    def _send(self, data: bytes) -> None:
        if self._wire is not None:
            self._wire.write(data)

    def _resolve(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    async def _run_hooks(self, hooks: list[Hook]) -> None:
        """Run user hooks (awaiting coroutine ones), then tell the core."""
        for h in hooks:
            match h:
                case CallOnDrop(session=s, reason=reason, grant=grant):
                    await _call(s.on_drop, reason)
                    await self._run_hooks(self._carry_out(self._core.drop_told(s, grant)))
                case GiveBack(session=s, grant=grant):
                    try:
                        await _call(s.synchronize)
                    finally:  # also when cancelled: the lock must not stay with nobody to use it
                        self._carry_out(self._core.given_back(s, grant))
                case CallOnLost(session=s, error=error):
                    await _call(s.on_lost, error)
                case CallOnPark(session=s):
                    await _call(s.on_park)
                case CallAllocationListeners(push=push):
                    self._tell_listeners(push)

    def _listened(self, result: object, listener: AllocationListener) -> None:
        if inspect.isawaitable(result):  # a coroutine listener: run to its end in a task of its own
            task = asyncio.ensure_future(_awaited(result, listener))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _add_listener(self, listener: AllocationListener) -> None:
        self._listeners.append(listener)

    def _remove_listener(self, listener: AllocationListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _spawn_hooks(self, hooks: list[Hook]) -> None:
        task = asyncio.ensure_future(self._run_hooks(hooks))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _wake(self) -> None:
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

    # --- idle release: one timer handle ---------------------------------------

    def _arm_idle(self, at: float) -> None:
        if self._idle_timer is not None:
            if self._idle_timer.when() <= at:
                return
            self._idle_timer.cancel()
        self._idle_timer = asyncio.get_running_loop().call_at(at, self._idle_due)

    def _idle_due(self) -> None:
        self._idle_timer = None
        hooks = self._carry_out(self._core.idle_sweep(self._now()))
        if hooks:
            self._spawn_hooks(hooks)
        if self._core.idle_wake_at != math.inf:
            self._arm_idle(self._core.idle_wake_at)

    # --- the connection and the reader task ------------------------------------

    async def _open(self) -> None:
        """Connect and say HELLO; raises GpudError."""
        wire = await Wire.open(self.path)
        try:
            hello = self._core.hello(self.name, self.labels)
            wire.write(hello.data)
            try:
                async with asyncio.timeout(self.request_timeout):
                    reply = await wire.recv()
            except TimeoutError:
                raise DaemonUnavailable(f"gpud at {self.path} did not answer HELLO") from None
            actions = self._core.welcomed(reply)
        except BaseException:
            wire.close()
            raise
        self._wire = wire
        self._carry_out(actions)

    async def _read_loop(self) -> None:
        while True:
            wire = self._wire
            if wire is not None:
                try:
                    while True:
                        msg = await wire.recv()
                        hooks = self._carry_out(self._core.receive(msg, self._now()))
                        if hooks:
                            self._dispatch(hooks)
                except Exception as exc:  # its end, a refusal, or a bug in the reader: start afresh
                    self._lost(wire, reader_failure(exc))
            if not await self._reconnect():
                return

    def _lost(self, wire: Wire, why: str) -> None:
        if self._wire is wire:
            self._wire = None
            hooks = self._carry_out(self._core.connection_lost(why))
            if hooks:
                self._spawn_hooks(hooks)
        wire.close()

    async def _reconnect(self) -> bool:
        """Reconnect with jittered backoff; the core re-attaches the sessions. False: stop."""
        attempt = 0
        while not self._core.closed and self.reconnect:
            try:
                await self._open()
                return True
            except GpudError as exc:  # a refusal is said out loud; an absence is expected
                (log.warning if isinstance(exc, ProtocolError) else log.debug)("reconnecting to gpud failed: %s", exc)
            await asyncio.sleep(reconnect_delay(attempt, random.random()))
            attempt += 1
        return False


async def _call(hook: Callable[..., Awaitable[None] | None] | None, *args: Any) -> None:
    """Run a hook, awaiting it if it is a coroutine function's; its failure is logged, never raised."""
    if hook is None:
        return
    try:
        result = hook(*args)
        if result is not None and inspect.isawaitable(result):
            await result
    except Exception:
        hook_failed("hook", hook)


async def _awaited(result: Awaitable[Any], listener: object) -> None:
    """What a coroutine listener returned, run to its end in a task of its own; a failure is logged."""
    try:
        await result
    except Exception:
        hook_failed("allocation listener", listener)
