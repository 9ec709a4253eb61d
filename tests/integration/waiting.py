"""Waiting on state in integration tests: poll a check until it holds, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def eventually(check: Callable[[], Any], what: str, timeout: float = 10.0, why: Callable[[], str] = str) -> Any:
    """``check()``'s first truthy result; fails naming ``what`` (and ``why()``) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}\n{why()}".rstrip())
        time.sleep(0.02)
