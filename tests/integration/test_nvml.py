"""A daemon on "real" GPUs through a stand-in NVML module: discovery, sampling,
per-process memory as the daemon's own check, unhealthy GPUs (lost, hung, hung
for ever), metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, MemoryLimitExceeded

from .waiting import eventually

FAKE = str(Path(__file__).resolve().parent.parent / "fakenvml")
GIB = 2**30
INTERVAL_S = 0.1  # monitor_interval_s of these daemons
# The hang test's: a hung GPU is shown within 2.5 intervals of the hang (worst case), and the
# half interval left must cover polling and a loaded machine's scheduling delays.
HANG_INTERVAL_S = 0.2
Update = Callable[[dict[str, object]], None]


@pytest.fixture
def nvml_daemon(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Update]]:
    with _nvml_daemon(tmp_path) as started:
        yield started


@contextmanager
def _nvml_daemon(tmp_path: Path, interval_s: float = INTERVAL_S) -> Iterator[tuple[DaemonProcess, Update]]:
    state = tmp_path / "nvml.json"
    gpus = [
        {"name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-aaaa", "total": 40 * GIB, "used": GIB, "util": 35},
        {"name": "NVIDIA L4", "uuid": "GPU-bbbb", "total": 24 * GIB, "used": 0, "util": 0},
    ]
    state.write_text(json.dumps({"gpus": gpus}))

    def update(change: dict[str, object]) -> None:
        data = json.loads(state.read_text())
        for index, fields in change.items():
            data["gpus"][int(index)].update(fields)
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, state)

    old = {k: os.environ.get(k) for k in ("PYTHONPATH", "FAKE_NVML_STATE")}
    os.environ["PYTHONPATH"] = FAKE + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["FAKE_NVML_STATE"] = str(state)
    cfg = tmp_path / "gpud.toml"
    cfg.write_text(f"monitor_interval_s = {interval_s}\n")
    try:
        d = DaemonProcess("--config", str(cfg), "--metrics-addr", "127.0.0.1:0").start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield d, update
    finally:
        d.cleanup()


def metric(d: DaemonProcess, metric_name: str, **labels: str) -> float:
    port = re.search(r'"port": ?(\d+)', d.log())
    assert port, d.log()
    with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric_name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no {metric_name}{labels}")


def metric_is(d: DaemonProcess, metric_name: str, value: float, **labels: str) -> bool:
    """Whether the daemon exports ``value`` for this sample; one not exported yet is not it yet."""
    try:
        return metric(d, metric_name, **labels) == value
    except AssertionError:  # no such sample, or the metrics port is not logged yet
        return False


def test_real_gpus_are_discovered_and_sampled(nvml_daemon: tuple[DaemonProcess, Callable[..., None]]) -> None:
    d, _ = nvml_daemon
    with Client(d.socket) as c:
        st = c.status()
        assert [(g.name, g.uuid, g.simulated) for g in st.gpus] == [
            ("NVIDIA A100-SXM4-40GB", "GPU-aaaa", False),
            ("NVIDIA L4", "GPU-bbbb", False),
        ]
    eventually(lambda: metric_is(d, "gpud_gpu_utilization_ratio", 0.35, gpu="0"), "GPU 0 sampled", why=d.log)
    assert metric(d, "gpud_gpu_memory_used_bytes", gpu="0") == GIB
    assert metric(d, "gpud_gpu_memory_total_bytes", gpu="1") == 24 * GIB
    assert metric(d, "gpud_gpu_info", gpu="1", UUID="GPU-bbbb", name="NVIDIA L4") == 1


def test_per_process_memory_is_the_daemons_own_check(nvml_daemon: tuple[DaemonProcess, Callable[..., None]]) -> None:
    d, update = nvml_daemon
    with Client(d.socket, name="greedy") as c:
        s = c.session(0, mem_estimate="1GiB", mem_limit="4GiB", framework_hooks=False)
        update({"0": {"procs": {str(os.getpid()): 6 * GIB}}})  # NVML sees more than the limit
        eventually(lambda: c.clients().clients[0].sessions[0].mem_used_bytes == 6 * GIB, "NVML's use is read")
        eventually(lambda: s.mem_error is not None, "the memory error arrives")
        with pytest.raises(MemoryLimitExceeded):
            with s.slice():
                pass
        assert metric(d, "gpud_session_memory_bytes", gpu="0", client="greedy") == 6 * GIB


def test_a_lost_gpu_is_unhealthy_not_fatal(nvml_daemon: tuple[DaemonProcess, Callable[..., None]]) -> None:
    d, update = nvml_daemon
    update({"1": {"lost": True}})
    with Client(d.socket) as c:
        eventually(lambda: not c.status().gpus[1].healthy, "GPU 1 unhealthy")
        assert c.status().gpus[0].healthy
        s = c.session(0)
        with s.slice():
            assert s.holding  # the other GPU is served as usual
    assert metric(d, "gpud_gpu_healthy", gpu="1") == 0
    assert [e["reason"] for e in events(d, "gpu_unhealthy")] == ["GPU is lost"]
    update({"1": {"lost": False}})
    with Client(d.socket) as c:
        eventually(lambda: c.status().gpus[1].healthy, "GPU 1 healthy again")
    assert metric(d, "gpud_gpu_healthy", gpu="1") == 1
    assert [e["gpu"] for e in events(d, "gpu_healthy_again")] == [1]


def test_a_hung_gpu_is_unhealthy_within_three_intervals_and_nothing_else_waits(tmp_path: Path) -> None:
    with _nvml_daemon(tmp_path, HANG_INTERVAL_S) as (d, update), Client(d.socket, name="trainer") as c:
        s0 = c.session(0, framework_hooks=False)
        sample_gpu0 = _sampler_of_gpu0(c, update, os.getpid())
        sample_gpu0(1)  # sampling has begun; GPU 1 was just read: the worst moment for a hang to begin
        update({"1": {"hang": True}})
        began = time.monotonic()
        eventually(lambda: not c.status().gpus[1].healthy, "GPU 1 unhealthy")
        took = time.monotonic() - began
        print(
            f"\nhung GPU shown unhealthy {took * 1000:.0f} ms after its hang began "
            f"({took / HANG_INTERVAL_S:.2f} monitor intervals)"
        )
        assert took < 3 * HANG_INTERVAL_S
        assert c.status().gpus[0].healthy and metric(d, "gpud_gpu_healthy", gpu="1") == 0
        threads = _threads(d)
        for gib in range(2, 8):  # GPU 0 is sampled on, one interval or more apart
            sample_gpu0(gib)
        assert _threads(d) <= threads + 1, "a probe thread per interval piles up behind the hung call"
        for gpu, session in ((0, s0), (1, c.session(1, framework_hooks=False))):
            began = time.monotonic()
            with session.slice():
                assert session.holding
            assert time.monotonic() - began < 0.5, f"a lock on GPU {gpu} waited for the hung GPU"
        assert c.status().gpus[1].healthy is False  # still hung
        [event] = events(d, "gpu_unhealthy")
        assert event["gpu"] == 1 and str(event["reason"]).startswith("its NVML call has not returned for ")
        update({"1": {"hang": False}})
        eventually(lambda: c.status().gpus[1].healthy, "GPU 1 healthy again")
        assert metric(d, "gpud_gpu_healthy", gpu="1") == 1
        assert [e["gpu"] for e in events(d, "gpu_healthy_again")] == [1]


def test_sigterm_exits_at_once_while_nvml_calls_hang_for_ever(tmp_path: Path) -> None:
    with _nvml_daemon(tmp_path) as (d, update):
        update({"0": {"hang": "forever"}, "1": {"hang": "forever"}})
        with Client(d.socket) as c:
            eventually(lambda: not any(g.healthy for g in c.status().gpus), "both GPUs unhealthy")
        assert d.proc is not None
        began = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(timeout=10)
        took = time.monotonic() - began
        print(f"\nSIGTERM to exit with two probes hung for ever: {took * 1000:.0f} ms")
        assert code == 0, d.log()
        assert took < 2.0 + 1.0  # the 2 s asked for, with a margin for a loaded machine
        assert '"shutdown"' in d.log()


def _sampler_of_gpu0(c: Client, update: Update, pid: int) -> Callable[[int], None]:
    """Set this process's memory on GPU 0 in NVML and wait until the daemon has read it:
    proof that GPU 0 was sampled after the change."""

    def sample(gib: int) -> None:
        update({"0": {"procs": {str(pid): gib * GIB}}})
        eventually(lambda: c.clients().clients[0].sessions[0].mem_used_bytes == gib * GIB, f"{gib} GiB read")

    return sample


def _threads(d: DaemonProcess) -> int:
    assert d.proc is not None
    return len(os.listdir(f"/proc/{d.proc.pid}/task"))


def events(d: DaemonProcess, name: str) -> list[dict[str, object]]:
    out = []
    for line in d.log().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == name:
            out.append(entry)
    return out


def test_daemon_metrics_are_scraped(nvml_daemon: tuple[DaemonProcess, Callable[..., None]]) -> None:
    d, _ = nvml_daemon
    with Client(d.socket, name="trainer") as c:
        s = c.session(0, core_limit=40, idle_release=None)
        with s.slice():
            pass
        s.release()
        c.call(__import__("gpud_client").protocol.Attach(id=0, gpu=0, priority=5))
        eventually(
            lambda: metric_is(d, "gpud_session_core_limit_ratio", 0.4, gpu="0", client="trainer"),
            "the session's core limit is exported",
        )
        assert metric(d, "gpud_clients") >= 1
        assert metric(d, "gpud_messages_total", type="LOCK_REQUEST") == 1
        assert metric(d, "gpud_lock_grants_total", gpu="0") == 1
        assert metric(d, "gpud_lock_wait_seconds_count", gpu="0") == 1
        assert metric(d, "gpud_lock_hold_seconds_count", gpu="0") == 1
        try:
            c.session(7)
        except Exception:
            pass
        assert metric(d, "gpud_protocol_errors_total", code="unknown_gpu") == 1
