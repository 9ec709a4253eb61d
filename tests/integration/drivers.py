"""Both client libraries behind one awaitable surface, so a behaviour test is written once.

``Driver`` wraps a sync ``Client`` or an asyncio ``AsyncClient``; ``Sess`` wraps their
sessions. Called from the test's event loop, a sync client's blocking call runs in a worker
thread (``asyncio.to_thread``), so the loop goes on meanwhile; called from one of that client's
own hook threads, it runs right there, as it would in a sync program. Hooks are written once, as
plain functions or coroutine functions; the sync client runs a coroutine one to its end in the
hook's own thread (``asyncio.run``). A hook that must block until the test lets it go waits on a
``Gate``, which works from any thread and any loop.

Only what the tests reach through the surface is here: a test that has to reach into one
client's machinery (``_core``, ``_conn``) uses ``Driver.raw``.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

import msgspec

from gpud_client import AsyncClient, Client
from gpud_client import protocol as p

Kind = Literal["sync", "async"]
KINDS: list[Kind] = ["sync", "async"]


class Gate:
    """A latch that a hook waits on, from any thread or event loop, until the test opens it."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.reached = threading.Event()  # a hook is waiting at the gate

    def open(self) -> None:
        self._open.set()

    async def wait(self, timeout: float = 10.0) -> None:
        self.reached.set()
        if not await asyncio.to_thread(self._open.wait, timeout):
            raise AssertionError("the test never opened the gate")


class Driver:
    """One client of either kind, every call awaitable."""

    def __init__(self, kind: Kind, raw: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.kind = kind
        self.raw = raw
        self._loop = loop  # the test's loop: a sync call made from it goes to a worker thread

    @classmethod
    async def connect(cls, kind: Kind, socket: str, **options: Any) -> Driver:
        loop = asyncio.get_running_loop()
        if kind == "sync":
            return cls(kind, await asyncio.to_thread(Client, socket, **options), loop)
        return cls(kind, await AsyncClient.connect(socket, **options), loop)

    async def _do(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.kind == "async":
            return await fn(*args, **kwargs)
        if asyncio.get_running_loop() is self._loop:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)  # in one of the sync client's hook threads

    def hook(self, fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
        """``fn`` as this client calls hooks: a coroutine function runs to its end for the sync one."""
        if fn is None or self.kind == "async" or not inspect.iscoroutinefunction(fn):
            return fn
        coro_fn = fn

        def run_in_this_thread(*args: Any) -> None:
            asyncio.run(coro_fn(*args))

        return run_in_this_thread

    # --- the client's surface ---------------------------------------------------------

    @property
    def reconnects(self) -> int:
        return int(self.raw.reconnects)

    @property
    def client_id(self) -> int:
        return int(self.raw.client_id)

    @property
    def connected(self) -> bool:
        return (self.raw._conn if self.kind == "sync" else self.raw._wire) is not None

    async def session(self, gpu: int | str = 0, **options: Any) -> Sess:
        for name in ("on_drop", "synchronize", "on_lost"):
            if name in options:
                options[name] = self.hook(options[name])
        return Sess(self, await self._do(self.raw.session, gpu, **options))

    async def call(self, msg: msgspec.Struct, timeout: float | None = None) -> Any:
        return await self._do(self.raw.call, msg, timeout)

    async def status(self) -> p.StatusReply:
        return await self._do(self.raw.status)  # type: ignore[no-any-return]

    async def leases(self) -> p.LeasesReply:
        return await self._do(self.raw.leases)  # type: ignore[no-any-return]

    async def acquire(self, gpu: int | str = "gpu:0", task_type: str = "OTHER", **fields: Any) -> p.LeaseResult:
        return await self._do(self.raw.acquire, gpu, task_type, **fields)  # type: ignore[no-any-return]

    async def release_lease(self, lease_id: str) -> None:
        await self._do(self.raw.release_lease, lease_id)

    async def allocate(self, task_id: str, gpus: float = 1, **fields: Any) -> p.Allocated:
        return await self._do(self.raw.allocate, task_id, gpus, **fields)  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self._do(self.raw.close)

    async def __aenter__(self) -> Driver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Sess:
    """A session of either kind; its state (``holding``, ``grants``, ``state``, ...) reads through."""

    def __init__(self, driver: Driver, raw: Any) -> None:
        self.driver = driver
        self.raw = raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def set_hook(self, name: Literal["on_drop", "synchronize", "on_lost"], fn: Callable[..., Any]) -> None:
        setattr(self.raw, name, self.driver.hook(fn))

    @asynccontextmanager
    async def slice(self) -> AsyncIterator[Sess]:
        if self.driver.kind == "async":
            async with self.raw.slice():
                yield self
            return
        ctx = self.raw.slice()  # entered and left in worker threads, as a sync program would
        await self.driver._do(ctx.__enter__)
        try:
            yield self
        except BaseException as exc:
            if not await self.driver._do(ctx.__exit__, type(exc), exc, exc.__traceback__):
                raise
        else:
            await self.driver._do(ctx.__exit__, None, None, None)

    async def acquire(self) -> None:
        await self.driver._do(self.raw.acquire)

    async def release(self) -> None:
        await self.driver._do(self.raw.release)

    async def report_memory(self, used_bytes: int) -> None:
        await self.driver._do(self.raw.report_memory, used_bytes)

    async def close(self) -> None:
        await self.driver._do(self.raw.close)
