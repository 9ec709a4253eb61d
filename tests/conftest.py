from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gpud.spawn import DaemonProcess


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    """A real gpud on two simulated GPUs, listening on a fresh socket."""
    d = DaemonProcess("--simulate", "2x16GiB").start()
    try:
        yield d
    finally:
        d.cleanup()


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., DaemonProcess]]:
    """Start daemons with custom flags; all are stopped at the end."""
    started: list[DaemonProcess] = []

    def start(*args: str) -> DaemonProcess:
        d = DaemonProcess(*args).start()
        started.append(d)
        return d

    try:
        yield start
    finally:
        for d in started:
            d.cleanup()
