from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gpud.tools.spawn import DaemonProcess

# Daemons start forked from a process that imported gpud once: hundreds of starts, each
# without an interpreter's start-up and gpud's imports (gpud/tools/spawn.py).
DaemonProcess.preload = True
TESTS = Path(__file__).parent
TIERS = {
    "core": "core",
    "client": "core",
    "integration": "integration",
    "k8s": "integration",  # gpud-k8s: real gRPC over Unix sockets, a fake kubelet and API server
    "test_daemon_sim.py": "sim",
    "test_fuzz_handling.py": "sim",  # long seeded or generated runs
    "test_demo.py": "integration",  # the demo's own daemon and client processes
    "test_bench_mains.py": "integration",  # every benchmark's quick run: real daemons and clients
}
# Files whose tests run on one worker together when the suite runs in parallel (make test):
# each starts Ray clusters, and two at once would only slow each other down.
TOGETHER = {"test_ray.py": "ray", "test_ray_nodes.py": "ray", "test_ray_pause.py": "ray", "test_ray_preempt.py": "ray"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test's tier, by where it lives: tests/core and tests/client are ``core``, tests/integration
    and the demo ``integration``, the whole-daemon simulation and the request fuzz ``sim``, the rest
    of tests/ ``inprocess``. And its group for ``pytest -n N --dist loadgroup``: its file (a module's
    fixtures are made once), or a group of files that must not run at the same time."""
    for item in items:
        parts = Path(str(item.fspath)).relative_to(TESTS).parts
        item.add_marker(TIERS.get(parts[0], TIERS.get(parts[-1], "inprocess")))
        item.add_marker(pytest.mark.xdist_group(TOGETHER.get(parts[-1], "/".join(parts))))


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


BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def load_bench(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Import a bench/ script as a module, with bench/ on sys.path for its own imports;
    both are undone after the test."""
    monkeypatch.syspath_prepend(str(BENCH))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return load
