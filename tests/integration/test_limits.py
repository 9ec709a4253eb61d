"""Compute and memory limits end to end: the shares real client processes get on a real daemon,
gpuctl limit and gpuctl mode (their parsing, output and usage errors), and the sync client's own
part (its memory probe, PyTorch's memory fraction, its errors). The rules checked through the
protocol (refused limits, the memory error at the next slice, who may change whose limits, modes,
preemption) are in tests/daemon/test_limits.py, in-process on a fake clock."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, ProtocolError
from gpud_client import protocol as p

from .waiting import eventually
from .wire import attach, connect, expect, gpu_status

# A worker that always has work: 3 ms "kernels" inside slices, forever.
WORKER = """
import sys, time
from gpud_client import Client
c = Client(sys.argv[1], name=sys.argv[2])
s = c.session(0, core_limit=int(sys.argv[3]), mem_estimate="1GiB", idle_release=None)
print("ready", flush=True)
while True:
    with s.slice():
        time.sleep(0.003)
"""


def worker(d: DaemonProcess, name: str, limit: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, d.socket, name, str(limit)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def session_info(d: DaemonProcess, name: str) -> p.SessionInfo:
    conn = connect(d, "observer")
    reply = conn.call(p.ListClients(id=conn.next_id()))
    conn.close()
    return [c for c in reply.clients if c.name == name][0].sessions[0]


def gpuctl(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture
def fast(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    """Serial GPU with a 0.5 s compute window, so limits show within seconds."""
    return daemon_factory("--simulate", "1x16GiB", "--mode", "serial", "--window", "0.5", "--share-windows", "4")


def test_a_limited_process_is_throttled_to_its_share(fast: DaemonProcess) -> None:
    proc = worker(fast, "limited", 20)
    try:
        time.sleep(3.2)  # not a wait: the share is measured over these six windows
        info = session_info(fast, "limited")
        assert info.core_limit == 20 and info.budget_ms == 100.0
        assert info.drops.get("quota", 0) >= 4
        assert 15 <= info.recent_share_percent <= 25, info
    finally:
        proc.kill()
        proc.wait()


def test_only_the_over_budget_process_is_throttled(daemon_factory: Callable[..., DaemonProcess]) -> None:
    fast = daemon_factory("--simulate", "1x16GiB", "--mode", "concurrent", "--window", "0.5", "--share-windows", "4")
    a, b = worker(fast, "small", 10), worker(fast, "big", 100)
    try:
        time.sleep(3.2)  # not a wait: the shares are measured over these six windows
        small, big = session_info(fast, "small"), session_info(fast, "big")
        assert small.drops.get("quota", 0) >= 3 and big.drops.get("quota", 0) == 0
        assert 5 <= small.recent_share_percent <= 15
        assert big.recent_share_percent >= 70  # it gets what the limited one may not use
    finally:
        for proc in (a, b):
            proc.kill()
            proc.wait()


def test_a_live_limit_change_governs_at_once_and_keeps_the_use(fast: DaemonProcess) -> None:
    proc = worker(fast, "trainer", 100)
    try:
        time.sleep(1.2)  # not a wait: two windows pass, and an unlimited process is never dropped
        assert session_info(fast, "trainer").drops.get("quota", 0) == 0
        out = gpuctl(fast, "limit", "trainer", "--core", "30", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["core_limit"] == 30
        info = session_info(fast, "trainer")
        assert info.core_limit == 30
        time.sleep(2.6)  # not a wait: the share is measured over the windows after the change
        info = session_info(fast, "trainer")
        assert info.drops.get("quota", 0) >= 4
        assert 25 <= info.recent_share_percent <= 40, info
        assert gpuctl(fast, "limit", "trainer", "--core", "100").returncode == 0
        # counted once the raise is in force: gpuctl may take seconds to start, and the 30 % limit throttles meanwhile
        drops = session_info(fast, "trainer").drops["quota"]
        time.sleep(2.6)  # not a wait: the last 4 windows, over which the share is measured, all after the raise
        info = session_info(fast, "trainer")
        assert info.recent_share_percent >= 85 and info.drops["quota"] <= drops + 1, info
    finally:
        proc.kill()
        proc.wait()


def test_bad_limits_are_refused_by_gpuctl_and_change_nothing(fast: DaemonProcess) -> None:
    """What gpuctl limit refuses itself, before it asks (malformed requests and what the daemon
    refuses are checked in-process, in tests/daemon/test_limits.py)."""
    a = connect(fast, "a")
    sa = attach(a)
    for args, needle in [
        (["limit", "a", "--core", "0"], "1..100"),
        (["limit", "a", "--core", "101"], "1..100"),
        (["limit", "a", "--mem=-1GiB"], "not a size"),
        (["limit", "a", "--mem", "8GB-ish"], "not a size"),
        (["limit", "a", "--mem", "8parsecs"], "unknown size unit"),
        (["limit", "a"], "nothing to change"),
    ]:
        out = gpuctl(fast, *args)
        assert out.returncode != 0 and needle in out.stderr, (args, out.stderr)
    info = session_info(fast, "a")
    assert (info.core_limit, info.mem_limit_bytes, info.session) == (100, None, sa)


def test_memory_sizes_in_gpuctl_are_parsed(fast: DaemonProcess) -> None:
    a = connect(fast, "a")
    attach(a)
    for size, value in [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("1048576", 2**20)]:
        assert gpuctl(fast, "limit", "a", "--mem", size).returncode == 0
        assert session_info(fast, "a").mem_limit_bytes == value
        assert expect(a, p.LimitsChanged).mem_limit == value


def test_memory_probe_reports_use_at_slice_end(daemon: DaemonProcess) -> None:
    use = [0]
    with Client(daemon.socket, name="probe") as c:
        s = c.session(0, memory_probe=lambda: use[0])
        use[0] = 5 * 2**30
        with s.slice():
            pass
        eventually(lambda: session_info(daemon, "probe").mem_used_bytes == 5 * 2**30, "the probed use is reported")


class FakeCuda:
    def __init__(self) -> None:
        self.fractions: list[tuple[float, int]] = []

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, dev: int) -> object:
        return type("Props", (), {"total_memory": 16 * 2**30})()

    def set_per_process_memory_fraction(self, fraction: float, dev: int) -> None:
        self.fractions.append((fraction, dev))

    def memory_reserved(self, dev: int) -> int:
        return 3 * 2**30


def test_pytorch_memory_fraction_follows_the_limit(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = type(sys)("torch")
    torch.cuda = FakeCuda()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    with Client(daemon.socket, name="torchy") as c:
        s = c.session(0, mem_limit="4GiB")
        assert torch.cuda.fractions == [(0.25, 0)]  # type: ignore[attr-defined]
        s.set_limits(mem_limit="8GiB")
        eventually(lambda: len(torch.cuda.fractions) >= 2, "the new fraction is set")  # type: ignore[attr-defined]
        assert torch.cuda.fractions[-1] == (0.5, 0)  # type: ignore[attr-defined]
        with s.slice():
            pass
        # torch's reserved memory reported
        eventually(lambda: session_info(daemon, "torchy").mem_used_bytes == 3 * 2**30, "torch's memory is reported")


class ThreadedCuda(FakeCuda):
    """CUDA's current device is per thread: a new thread starts on device 0."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def set_device(self, dev: int) -> None:
        self.local.device = dev

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)


def test_a_limit_change_caps_the_device_the_session_was_made_on(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = type(sys)("torch")
    torch.cuda = cuda = ThreadedCuda()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    cuda.set_device(1)  # the application works on its second device
    with Client(daemon.socket, name="second-device") as c:
        s = c.session(0, mem_limit="4GiB")
        s.set_limits(mem_limit="8GiB")  # applied on the client's reader thread, whose device is 0
        eventually(lambda: len(cuda.fractions) >= 2, "the new fraction is set")
    assert cuda.fractions == [(0.25, 1), (0.5, 1)]


def test_gpuctl_mode_prints_the_change_and_refuses_an_unknown_mode(daemon: DaemonProcess) -> None:
    """gpuctl mode's output and its usage error (what a change of mode does to sessions is checked
    in-process, in tests/daemon/test_limits.py)."""
    assert gpuctl(daemon, "mode", "serial", "--gpu", "0").returncode == 0
    out = gpuctl(daemon, "mode", "concurrent", "--json")
    assert json.loads(out.stdout) == {"ok": True, "mode": "concurrent", "gpu": None}
    conn = connect(daemon)
    assert [gpu_status(conn, g).mode for g in (0, 1)] == ["concurrent", "concurrent"]
    out = gpuctl(daemon, "mode", "turbo")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_limit_errors_in_the_client_library(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="x") as c:
        c.session(0)
        with pytest.raises(ProtocolError) as err:
            c.set_limits("nobody-here", core_limit=5)
        assert err.value.code == p.ErrorCode.UNKNOWN_CLIENT
        with pytest.raises(ValueError, match="not a size"):
            c.set_limits(mem_limit="lots")
