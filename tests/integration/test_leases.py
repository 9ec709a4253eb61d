"""Leases (GpuArbiter) end to end: a real daemon, real service processes and a killed holder, the
sync client's lease context manager, metrics scraped over HTTP and the daemon's log lines. The
rules checked through the protocol (releases, busy policies, refused acquires, policy updates,
the watchdog, the forced release) are in tests/daemon/test_leases.py, in-process on a fake clock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client

from .waiting import eventually

# A service that loops over leases of one task type and writes one JSON line per
# acquire: status, reason, the daemon's queue wait and its own observed latency.
SERVICE = """
import json, sys, time
from gpud_client import Client
path, task, seconds, hold_ms = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
c = Client(path, name=task.lower())
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.monotonic()
    with c.lease("gpu:0", task_type=task, trace={"job_id": "j1", "stage": task}) as r:
        latency = (time.monotonic() - t0) * 1000
        if r.acquired:
            time.sleep(hold_ms / 1000)
    print(json.dumps({"status": r.status, "reason": r.reason, "wait": r.queue_wait_ms, "latency": latency}),
          flush=True)
    time.sleep(0.002)  # the service's own work between two utterances, not a wait
"""


def start_service(d: DaemonProcess, task: str, seconds: float, hold_ms: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE, d.socket, task, str(seconds), str(hold_ms)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def results(proc: subprocess.Popen[str]) -> list[dict[str, object]]:
    out, _ = proc.communicate(timeout=60)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_asr_nmt_and_repair_on_a_busy_gpu(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "1x16GiB", "--mode", "serial")
    services = {
        "ASR": start_service(d, "ASR", 3.0, 30),
        "NMT": start_service(d, "NMT", 3.0, 20),
        "SEMANTIC_REPAIR": start_service(d, "SEMANTIC_REPAIR", 3.0, 30),
    }
    for proc in services.values():
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    got = {task: results(proc) for task, proc in services.items()}
    asr, nmt, repair = got["ASR"], got["NMT"], got["SEMANTIC_REPAIR"]
    assert asr and nmt and repair
    # ASR and NMT always get the GPU, and never wait behind a queued repair:
    # at most one GPU section (the holder's) plus a little.
    assert all(r["status"] == "ACQUIRED" for r in asr + nmt)
    assert max(float(r["wait"]) for r in asr) < 120, max(float(r["wait"]) for r in asr)
    # The repair answers SKIPPED quickly when the GPU stays busy: within its 400 ms max wait.
    skipped = [r for r in repair if r["status"] == "SKIPPED"]
    assert skipped, "the repair was never skipped on a busy GPU"
    assert all(r["reason"] in ("TIMEOUT", "QUEUE_FULL") for r in skipped)
    assert max(float(r["latency"]) for r in skipped) < 400 + 150


HOLDER = """
import sys, time
from gpud_client import Client
c = Client(sys.argv[1], name="doomed")
r = c.acquire("gpu:0", task_type="ASR")
print(r.status, flush=True)
time.sleep(60)
"""


def test_a_killed_holder_frees_its_lease_at_once(daemon: DaemonProcess) -> None:
    victim = subprocess.Popen([sys.executable, "-c", HOLDER, daemon.socket], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "ACQUIRED"
        with Client(daemon.socket, name="next") as c:
            killed_at = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            r = c.acquire("gpu:0", task_type="NMT", max_wait_ms=2000)
            assert r.acquired
            assert time.monotonic() - killed_at < 0.5
            assert r.queue_wait_ms < 500
    finally:
        victim.kill()
        victim.wait()


def test_the_context_manager_releases_on_exceptions(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        with pytest.raises(RuntimeError):
            with c.lease("gpu:0", task_type="ASR") as r:
                assert r.acquired
                raise RuntimeError("inference failed")
        assert c.leases().leases == []
        with c.lease(0, task_type="ASR") as r2:
            assert r2.acquired and r2.queue_wait_ms == 0  # granted the instant it was read: it never queued


def scrape(d: DaemonProcess) -> str:
    ports = [e["port"] for e in map(json.loads, d.log().splitlines()) if e.get("event") == "metrics_listening"]
    assert ports, d.log()
    with urllib.request.urlopen(f"http://127.0.0.1:{ports[-1]}/metrics", timeout=5) as resp:
        return resp.read().decode()


def sample(d: DaemonProcess, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(scrape(d)):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name}{labels}")


def test_metrics_are_scraped_over_http(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "1", "--metrics-addr", "127.0.0.1:0")
    with Client(d.socket) as c, Client(d.socket) as other:
        with c.lease("gpu:0", task_type="ASR"):
            assert other.acquire("gpu:0", task_type="SEMANTIC_REPAIR", max_wait_ms=0).reason == "GPU_BUSY"
            assert other.acquire("gpu:0", task_type="SEMANTIC_REPAIR", max_wait_ms=20).reason == "TIMEOUT"
            assert other.acquire("gpu:0", task_type="NMT", queue_limit=0).reason == "QUEUE_FULL"
            time.sleep(0.02)  # not a wait: the lease is held at least 20 ms (hold_seconds_sum below)
        c.report_oom("gpu:0", "ASR")
    assert sample(d, "gpud_arbiter_acquire_total", gpu="0", task_type="ASR", status="ACQUIRED") == 1
    assert sample(d, "gpud_arbiter_acquire_total", gpu="0", task_type="SEMANTIC_REPAIR", status="SKIPPED") == 2
    assert sample(d, "gpud_arbiter_timeouts_total", gpu="0", task_type="SEMANTIC_REPAIR") == 1
    assert sample(d, "gpud_arbiter_queue_full_total", gpu="0", task_type="NMT") == 1
    assert sample(d, "gpud_arbiter_hold_seconds_count", gpu="0", task_type="ASR") == 1
    assert sample(d, "gpud_arbiter_hold_seconds_sum", gpu="0", task_type="ASR") >= 0.02
    assert sample(d, "gpud_arbiter_queue_wait_seconds_count", gpu="0", task_type="SEMANTIC_REPAIR") == 2
    assert sample(d, "gpud_arbiter_queue_length", gpu="0", task_type="SEMANTIC_REPAIR") == 0
    assert sample(d, "gpud_gpu_oom_total", gpu="0", task_type="ASR") == 1


def test_one_log_line_per_acquire_with_its_trace(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        with c.lease(
            "gpu:0",
            task_type="ASR",
            trace={"job_id": "job-7", "session_id": "s-1", "utterance_index": 4, "stage": "asr"},
        ):
            pass
    lines = eventually(
        lambda: [e for e in map(json.loads, daemon.log().splitlines()) if e.get("event") == "lease"],
        "a lease line in the log",
        why=daemon.log,
    )
    assert len(lines) == 1
    line = lines[0]
    for key in (
        "job_id",
        "session_id",
        "utterance_index",
        "stage",
        "task_type",
        "gpu",
        "status",
        "wait_ms",
        "hold_ms",
        "reason",
        "lease_id",
    ):
        assert key in line, key
    assert (line["job_id"], line["utterance_index"], line["status"]) == ("job-7", 4, "ACQUIRED")
