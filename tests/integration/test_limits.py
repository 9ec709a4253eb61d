"""Compute and memory limits end to end: a real daemon and real client processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, MemoryLimitExceeded, PermissionDenied, ProtocolError
from gpud_client import protocol as p

from .waiting import eventually
from .wire import as_nobody, attach, connect, expect, gpu_status, take_lock, wait_queue

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
    proc = subprocess.Popen([sys.executable, "-c", WORKER, d.socket, name, str(limit)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def session_info(d: DaemonProcess, name: str) -> p.SessionInfo:
    conn = connect(d, "observer")
    reply = conn.call(p.ListClients(id=conn.next_id()))
    conn.close()
    return [c for c in reply.clients if c.name == name][0].sessions[0]


def gpuctl(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, *args], capture_output=True, text=True, timeout=30
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
        drops = info.drops["quota"]
        assert gpuctl(fast, "limit", "trainer", "--core", "100").returncode == 0
        time.sleep(2.6)  # not a wait: the last 4 windows, over which the share is measured, all after the raise
        info = session_info(fast, "trainer")
        assert info.recent_share_percent >= 85 and info.drops["quota"] <= drops + 1, info
    finally:
        proc.kill()
        proc.wait()


def test_bad_limits_are_refused_and_change_nothing(fast: DaemonProcess) -> None:
    a = connect(fast, "a")
    sa = attach(a)
    for bad in ({"core_limit": 0}, {"core_limit": 101}, {"core_limit": "half"}, {"mem_limit": -1}):
        a.send_raw(p.frame(msgspec.msgpack.encode({"type": "SET_LIMITS", "id": 7, **bad})))
        err = expect(a, p.Error)
        assert err.code == p.ErrorCode.INVALID and "$." in err.message, err
    for bad in ({"core_limit": 0}, {"mem_estimate": -5}):
        a.send_raw(p.frame(msgspec.msgpack.encode({"type": "ATTACH", "id": 8, "gpu": 0, **bad})))
        assert expect(a, p.Error).code == p.ErrorCode.INVALID
    for args, needle in [
        (["limit", "a", "--core", "0"], "1..100"),
        (["limit", "a", "--core", "101"], "1..100"),
        (["limit", "a", "--mem=-1GiB"], "not a size"),
        (["limit", "a", "--mem", "8GB-ish"], "not a size"),
        (["limit", "a", "--mem", "8parsecs"], "unknown size unit"),
        (["limit", "nobody", "--core", "5"], "no client 'nobody'"),
        (["limit", "a", "--core", "5", "--gpu", "3"], "unknown GPU"),
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


def test_memory_above_the_limit_raises_at_the_next_slice(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="greedy") as c:
        s = c.session(0, mem_estimate="1GiB", mem_limit="2GiB", framework_hooks=False)
        with s.slice():
            s.report_memory(3 * 2**30)
        eventually(lambda: s.mem_error is not None, "the memory error arrives")
        with pytest.raises(MemoryLimitExceeded, match="above its limit of 2147483648 bytes") as err:
            with s.slice():
                pass
        assert err.value.used_bytes == 3 * 2**30
        with s.slice():  # raised once; the next slice runs
            pass
        info = session_info(daemon, "greedy")
        assert (info.mem_used_bytes, info.mem_violations) == (3 * 2**30, 1)


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


def test_modes_change_at_run_time(daemon: DaemonProcess) -> None:
    a, b = connect(daemon, "a"), connect(daemon, "b")
    sa = a.call(p.Attach(id=a.next_id(), gpu=0, mem_estimate=2**30)).session
    sb = b.call(p.Attach(id=b.next_id(), gpu=0, mem_estimate=2**30)).session
    assert gpuctl(daemon, "mode", "serial", "--gpu", "0").returncode == 0
    take_lock(a, sa)
    b.send(p.LockRequest(id=b.next_id(), session=sb))
    wait_queue(a, [sb])
    out = gpuctl(daemon, "mode", "concurrent", "--json")
    assert json.loads(out.stdout) == {"ok": True, "mode": "concurrent", "gpu": None}
    assert expect(b, p.LockOk).session == sb
    st = gpu_status(a)
    assert st.mode == "concurrent" and len(st.holders) == 2
    assert st.memory_in_use_bytes == 2 * 2**30
    out = gpuctl(daemon, "mode", "turbo")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_priority_preempts_a_running_session(daemon: DaemonProcess) -> None:
    low, high = connect(daemon, "low"), connect(daemon, "high")
    sl, sh = attach(low, priority=10), attach(high, priority=90)
    ok = take_lock(low, sl)
    high.send(p.LockRequest(id=high.next_id(), session=sh))
    drop = expect(low, p.DropLock)
    assert (drop.grant, drop.reason) == (ok.grant, p.DropReason.PREEMPT)
    low.send(p.LockReleased(id=low.next_id(), session=sl, grant=ok.grant))
    assert expect(high, p.LockOk).session == sh


def test_another_clients_limit_needs_admin(daemon: DaemonProcess) -> None:
    victim = connect(daemon, "victim")
    attach(victim)

    def ask() -> str:
        c = Client(daemon.socket, name="nobody")
        mine = c.session(0)
        try:
            c.set_limits("victim", core_limit=5)
            result = "allowed"
        except PermissionDenied as exc:
            result = exc.code
        mine.set_limits(core_limit=40)  # its own limits it may change
        return f"{result},{mine.core_limit}"

    assert as_nobody(daemon, ask) == "permission_denied,40"
    assert session_info(daemon, "victim").core_limit == 100


def test_limit_errors_in_the_client_library(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="x") as c:
        c.session(0)
        with pytest.raises(ProtocolError) as err:
            c.set_limits("nobody-here", core_limit=5)
        assert err.value.code == p.ErrorCode.UNKNOWN_CLIENT
        with pytest.raises(ValueError, match="not a size"):
            c.set_limits(mem_limit="lots")
