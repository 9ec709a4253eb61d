"""Leases (GpuArbiter) end to end: real daemon, real service processes, real metrics scrapes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, PermissionDenied, ProtocolError
from gpud_client import protocol as p

from .waiting import eventually
from .wire import connect, expect

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
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
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


def test_release_is_idempotent_and_others_leases_are_refused(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="a") as a, Client(daemon.socket, name="b") as b:
        r = a.acquire("gpu:0", task_type="TTS")
        assert r.acquired and r.lease_id
        with pytest.raises(PermissionDenied, match="belongs to client"):
            b.release_lease(r.lease_id)
        assert [le.lease_id for le in a.leases().leases] == [r.lease_id]
        a.release_lease(r.lease_id)
        a.release_lease(r.lease_id)  # idempotent
        b.release_lease("no-such-lease")
        assert a.leases().leases == []


def test_the_context_manager_releases_on_exceptions(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        with pytest.raises(RuntimeError):
            with c.lease("gpu:0", task_type="ASR") as r:
                assert r.acquired
                raise RuntimeError("inference failed")
        assert c.leases().leases == []
        with c.lease(0, task_type="ASR") as r2:
            assert r2.acquired and r2.queue_wait_ms == 0  # granted the instant it was read: it never queued


def test_each_busy_policy_answers_on_a_busy_gpu(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as holder, Client(daemon.socket) as c:
        with holder.lease("gpu:0", task_type="ASR"):
            for policy, status in [("WAIT", "SKIPPED"), ("SKIP", "SKIPPED"), ("FALLBACK_CPU", "FALLBACK_CPU")]:
                r = c.acquire("gpu:0", busy_policy=policy, max_wait_ms=0)
                assert (r.status, r.reason) == (status, "GPU_BUSY")
                r = c.acquire("gpu:0", busy_policy=policy, max_wait_ms=100)
                assert (r.status, r.reason) == (status, "TIMEOUT") and r.queue_wait_ms >= 99
                r = c.acquire("gpu:0", busy_policy=policy, queue_limit=0)
                assert (r.status, r.reason) == (status, "QUEUE_FULL")


def test_bad_acquires_are_refused_and_nothing_is_queued(daemon: DaemonProcess) -> None:
    conn = connect(daemon)
    for bad, needle in [
        ({"busy_policy": "PANIC"}, "$.busy_policy"),
        ({"priority": 101}, "$.priority"),
        ({"priority": -1}, "$.priority"),
        ({"max_wait_ms": -5}, "$.max_wait_ms"),
        ({"hold_max_ms": 0}, "$.hold_max_ms"),
        ({"task_type": ""}, "$.task_type"),
        ({"gpu": "gpu:9"}, "unknown GPU 'gpu:9'"),
        ({"gpu": "cuda0"}, "unknown GPU 'cuda0'"),
    ]:
        msg = {"type": "ACQUIRE", "id": 5, "gpu": "gpu:0", "task_type": "ASR", **bad}
        conn.send_raw(p.frame(msgspec.msgpack.encode(msg)))
        err = expect(conn, p.Error)
        assert err.id == 5 and needle in err.message, (bad, err)
    with Client(daemon.socket) as c:
        assert c.leases().leases == []
        with pytest.raises(ProtocolError, match="unknown_gpu"):
            c.acquire("gpu:3")


def test_policies_are_hot_updated(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        assert c.policies()["SEMANTIC_REPAIR"].max_wait_ms == 400
        out = subprocess.run(
            [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", daemon.socket, "policy", "SEMANTIC_REPAIR",
             "--max-wait", "0", "--busy", "FALLBACK_CPU", "--json"],
            capture_output=True, text=True, timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["policies"]["SEMANTIC_REPAIR"]["busy_policy"] == "FALLBACK_CPU"
        with c.lease("gpu:0", task_type="ASR"):
            r = c.acquire("gpu:0", task_type="SEMANTIC_REPAIR")
        assert (r.status, r.reason) == ("FALLBACK_CPU", "GPU_BUSY")
        c.set_policy("VAD", priority=60, busy_policy="SKIP", max_wait_ms=50)
        assert c.policies()["VAD"].priority == 60


def test_watchdog_logs_and_counts_and_can_force_release(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "1", "--metrics-addr", "127.0.0.1:0")
    with Client(d.socket) as c:
        r = c.acquire("gpu:0", task_type="ASR", hold_max_ms=100)
        eventually(lambda: '"lease_overdue"' in d.log(), "lease_overdue in the log", why=d.log)
        leases = c.leases().leases
        assert leases[0].overdue and leases[0].state == "holding"  # reported, not taken away
        c.release_lease(r.lease_id or "")
    assert sample(d, "gpud_arbiter_watchdog_exceeded_total", gpu="0", task_type="ASR") == 1


def test_forced_release_when_configured(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    path = str(tmp_path / "gpud.toml")
    with open(path, "w") as f:
        f.write(
            "lease_force_release = true\n"
            "[policies.ASR]\npriority = 90\nbusy_policy = 'WAIT'\nmax_wait_ms = 3000\nhold_max_ms = 100\n"
        )
    d = daemon_factory("--simulate", "1", "--config", path)
    with Client(d.socket) as c, Client(d.socket) as other:
        r = c.acquire("gpu:0", task_type="ASR")
        assert r.acquired
        r2 = other.acquire("gpu:0", task_type="NMT", max_wait_ms=2000)
        assert r2.acquired and 80 <= r2.queue_wait_ms < 1000
        eventually(lambda: r.lease_id in c.revoked_leases, "LEASE_REVOKED arrives")
        c.release_lease(r.lease_id or "")  # already gone: still fine


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
        with c.lease("gpu:0", task_type="ASR",
                     trace={"job_id": "job-7", "session_id": "s-1", "utterance_index": 4, "stage": "asr"}):
            pass
    lines = eventually(
        lambda: [e for e in map(json.loads, daemon.log().splitlines()) if e.get("event") == "lease"],
        "a lease line in the log", why=daemon.log,
    )
    assert len(lines) == 1
    line = lines[0]
    for key in ("job_id", "session_id", "utterance_index", "stage", "task_type", "gpu", "status", "wait_ms",
                "hold_ms", "reason", "lease_id"):
        assert key in line, key
    assert (line["job_id"], line["utterance_index"], line["status"]) == ("job-7", 4, "ACQUIRED")
