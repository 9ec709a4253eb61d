"""Waiting on state in integration tests: poll a check until it holds, never a bare sleep.

``eventually`` blocks the calling thread; ``eventually_async`` is the same wait for a coroutine
that must keep its asyncio loop running meanwhile (and may poll an async check). Both take
their deadline and their failure message from ``_tries``. A generous timeout costs nothing when
the state comes at once, and keeps a loaded machine from failing a test that is right."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any

POLL_S = 0.01


def _tries(what: str, timeout: float, why: Callable[[], str]) -> Iterator[None]:
    """One step per try; raises, naming ``what`` and ``why()``, once a try ends after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}\n{why()}".rstrip())


def eventually(check: Callable[[], Any], what: str, timeout: float = 10.0, why: Callable[[], str] = str) -> Any:
    """``check()``'s first truthy result; fails naming ``what`` (and ``why()``) after ``timeout`` s."""
    for _ in _tries(what, timeout, why):
        if result := check():
            return result
        time.sleep(POLL_S)
    raise AssertionError("unreachable")  # _tries never ends without raising


async def eventually_async(
    check: Callable[[], Any], what: str, timeout: float = 10.0, why: Callable[[], str] = str
) -> Any:
    """``eventually`` inside an asyncio loop: ``check`` may return an awaitable, which is awaited."""
    for _ in _tries(what, timeout, why):
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(POLL_S)
    raise AssertionError("unreachable")
