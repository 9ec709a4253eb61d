"""gpud's rules and dashboard against a real Prometheus scraping a real gpud.

One Prometheus (its own directory, a free loopback port, scrape and rule evaluation every second)
scrapes one gpud on two GPUs of the stand-in NVML (tests/fakenvml: a GPU can be lost), a stand-in
dcgm-exporter page (two GPUs by the same UUIDs, with dcgm-exporter's labels), and a gpud-k8s process
(job ``gpud-k8s``: its /metrics) that serves a gpud of its own on a simulated GPU through the fake
kubelet and API server of tests/k8s, with one time-sliced claim prepared. A short load exercises
each capability: two sessions with compute limits contending for GPU 0, leases granted, skipped and
timed out on GPU 1, allocations in a tenant, and one preemption whose victim yields. Then, through
Prometheus' HTTP API: every recording rule and every dashboard query returns a series with a plausible
value, every rule evaluates without error, and no alert is active. Last, each alert's condition is
made to hold (a victim that overruns its grace, the same task taken back a third time, a tenant
borrowing and then over its lowered quota, a GPU lost, a session above its memory limit and one
above its compute limit, a GPU drained, a claim the agent refuses to prepare, the daemon and the agent
stopped) and its alert fires. The alerts run from a
copy of the rules whose ``for:`` is 0s (``monitoring.rules_with_for``): nothing else is changed.

Every wait polls Prometheus or the daemon for a state (``eventually``), never sleeps for one.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from monitoring import (  # tests/ is on the path of its top-level modules
    AGENT_JOB,
    JOB,
    alerting_rules,
    dashboard_queries,
    need,
    recording_rules,
    rules_with_for,
)

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_k8s.claims import DRIVER
from tests.k8s.fake_apiserver import ThreadedFakeApiServer
from tests.k8s.fake_kubelet import Claim, KubeletThread
from tests.k8s.test_driver import NODE, resource_claim

from .waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
FAKE_NVML = str(ROOT / "tests" / "fakenvml")
GIB = 2**30
WAIT_S = 60.0  # for Prometheus to see a state: a scrape and an evaluation a second, on a loaded machine
GPUS = [
    {"name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-aaaa", "total": 40 * GIB, "used": 3 * GIB, "util": 35},
    {"name": "NVIDIA L4", "uuid": "GPU-bbbb", "total": 24 * GIB, "used": GIB, "util": 80},
]
TENANTS = """
[tenants.team-a]
gpus = {a}
borrow = {a}
[tenants.team-b]
gpus = 1
"""
CONFIG = """
monitor_interval_s = 0.2
compute_window_s = 0.2
share_windows = 1000
preemption_grace_s = 1
preemption_min_runtime_s = 0
"""
# dcgm-exporter's page for the same two GPUs (its label names; utilisation in percent).
DCGM = "".join(
    f'DCGM_FI_DEV_GPU_UTIL{{gpu="{i}",UUID="{g["uuid"]}",device="nvidia{i}",modelName="{g["name"]}",'
    f'Hostname="node-1"}} {util}\n'
    for i, (g, util) in enumerate(zip(GPUS, (2, 80)))
)
# docs/metrics-and-logs.md's join: GPUs gpud has allocated that dcgm-exporter sees (nearly) idle.
DCGM_JOIN = "gpu:gpud_gpu_allocated:ratio > 0 and on(UUID) DCGM_FI_DEV_GPU_UTIL < 5"

# What a plausible value is for each recorded series (NaN, a quantile with no observation, aside).
SHARE = (0.0, 1.0)
NON_NEGATIVE = (0.0, math.inf)
PLAUSIBLE: dict[str, tuple[float, float]] = {
    "gpu:gpud_gpu_info:labels": (1.0, 1.0),
    "gpu:gpud_gpu_allocated:ratio": SHARE,
    "gpu:gpud_gpu_utilization:ratio": SHARE,
    "gpu:gpud_gpu_memory_used:ratio": SHARE,
    "gpu:gpud_gpu_queue:length": NON_NEGATIVE,
    "gpu:gpud_gpu_holders:count": NON_NEGATIVE,
    "gpu:gpud_lock_wait_seconds:p50_rate5m": (0.0, WAIT_S),
    "gpu:gpud_lock_wait_seconds:p99_rate5m": (0.0, WAIT_S),
    "gpu:gpud_lock_drops:rate5m": NON_NEGATIVE,
    "gpu:gpud_session_throttled:sum": NON_NEGATIVE,
    "client:gpud_session_compute_limit_error:ratio": (-1.0, 1.0),
    "task_type:gpud_arbiter_acquires:rate5m": NON_NEGATIVE,
    "task_type:gpud_arbiter_skips:rate5m": NON_NEGATIVE,
    "task_type:gpud_arbiter_skipped:ratio_rate5m": SHARE,
    "task_type:gpud_arbiter_timeouts:rate5m": NON_NEGATIVE,
    "gpu_task_type:gpud_arbiter_queue_wait_seconds:p99_rate5m": (0.0, WAIT_S),
    "tenant:gpud_tenant_quota_used:ratio": SHARE,  # nobody borrows while the node is healthy
    "tenant:gpud_tenant_borrowed:gpus": (0.0, 0.0),
    "tenant:gpud_allocation_wait_seconds:p99_rate5m": (0.0, WAIT_S),
    "instance:gpud_allocation_wait_seconds:p99_rate5m": (0.0, WAIT_S),
    "result:gpud_allocation_requests:rate5m": NON_NEGATIVE,
    "instance:gpud_allocations_suspended:ratio": SHARE,
    "reason:gpud_preemptions:rate5m": NON_NEGATIVE,
    "instance:gpud_preemptions_per_grant:ratio_rate5m": NON_NEGATIVE,
    "reason:gpud_preemption_grace_overruns:increase1h": (0.0, 0.0),
    "reason:gpud_preemptions_repeated:increase1h": (0.0, 0.0),
    "instance:gpud_elastic_changes:increase1h": (0.0, 0.0),
}
# gpud-k8s's records (read without the gpud instance: some are by namespace, across the cluster).
K8S_PLAUSIBLE: dict[str, tuple[float, float]] = {
    "namespace:gpud_k8s_claims:count": (1.0, 1.0),
    "namespace:gpud_k8s_claims_suspended:count": (0.0, 0.0),
    "claim:gpud_k8s_claim_turns:rate5m": NON_NEGATIVE,
    "instance:gpud_k8s_prepare_seconds:p99_rate5m": (0.0, WAIT_S),
    "instance:gpud_k8s_prepare_failures:rate5m": (0.0, 0.0),
    "outcome:gpud_k8s_pod_evictions:rate5m": (0.0, 0.0),
}
TIME_SLICED = {"apiVersion": "gpu.gpud.io/v1alpha1", "kind": "GpudClaimConfig", "timeSlice": True}
# Made to hold in test_each_alert_fires_when_its_condition_holds, in that order; GpudDown last.
FIRED = [
    "GpudPreemptionGraceOverruns",
    "GpudPreemptionThrash",
    "GpudTenantBorrowing",
    "GpudTenantOverQuota",
    "GpudGpuUnhealthy",
    "GpudSessionOverMemoryLimit",
    "GpudSessionOverComputeLimit",
    "GpudGpuDrainingTooLong",
    "GpudK8sPrepareFailing",
]
# Conditions this test does not make (a failing store, faults, elastic flapping, no target at all):
# they must stay quiet while the others fire.
QUIET = ["GpudStoreFailures", "GpudStoreRecordsSetAside", "GpudFaults", "GpudElasticScalingRunaway", "GpudAbsent"]
QUIET += ["GpudK8sEvictionBlocked"]
DOWN = ["GpudDown", "GpudK8sAgentDown"]  # last: the daemon and the agent stopped


class Prometheus:
    """A Prometheus server of this test's own, and its HTTP API."""

    def __init__(self, workdir: Path, targets: dict[str, str], rules: str) -> None:
        self.workdir = workdir
        workdir.mkdir()
        (workdir / "rules.yml").write_text(rules)
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{addr}']\n" for job, addr in targets.items()
        )
        (workdir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - rules.yml\nscrape_configs:\n{jobs}"
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    need("prometheus"),
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def why(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited with {self.proc.returncode}:\n{self.why()}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query's series: (labels, value)."""
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.get("/api/v1/rules")["groups"] for r in g["rules"]]

    def alert_states(self) -> dict[str, str]:
        return {r["name"]: r["state"] for r in self.rules() if r["type"] == "alerting"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_prometheus(workdir: Path, targets: dict[str, str], rules: str) -> Prometheus:
    """A ready Prometheus; started again on another port if another process took the free one first."""
    for attempt in range(3):
        prom = Prometheus(workdir / f"prom-{attempt}", targets, rules)
        try:
            eventually(prom.ready, "prometheus ready", timeout=WAIT_S, why=prom.why)
            return prom
        except AssertionError:
            prom.stop()
            if "address already in use" not in prom.why():
                raise
    raise AssertionError("no free port for prometheus in three tries")


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve_dcgm_page(stack: ExitStack) -> str:
    """dcgm-exporter's /metrics for the fake GPUs, on a free loopback port: its address."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = DCGM.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stack.callback(server.server_close)
    stack.callback(server.shutdown)
    return f"127.0.0.1:{server.server_address[1]}"


@dataclass
class Node:
    """The daemon, its clients and what the load left held, for the tests to read and change."""

    d: DaemonProcess
    prom: Prometheus
    instance: str  # the gpud target's instance label
    agent: Agent
    workdir: Path
    clients: dict[str, Client]
    sessions: dict[str, Any]
    notices: queue.Queue[object]
    pool: ThreadPoolExecutor
    update_nvml: Callable[[dict[str, object]], None]

    def why(self) -> str:
        agent = (self.workdir / "agent.log").read_text(errors="replace")[-3000:]
        return f"--- gpud ---\n{self.d.log()[-4000:]}\n--- gpud-k8s ---\n{agent}\n--- prometheus ---\n{self.prom.why()}"


@dataclass
class Agent:
    """gpud-k8s, with a gpud of its own and the fake kubelet and API server: its /metrics, a target."""

    instance: str
    proc: subprocess.Popen[bytes]
    api: ThreadedFakeApiServer
    kubelet: KubeletThread

    def prepare(self, name: str, config: dict[str, object]) -> bool:
        """A claim of half the GPU in namespace ``ml`` (no tenant of gpud's) put and prepared; whether it was."""
        claim = resource_claim(str(uuid.uuid4()), name, 0, cores="50", memory="4Gi", config=config)
        claim["metadata"]["namespace"] = "ml"
        self.api.put(claim)

        async def prepare() -> bool:
            await self.kubelet.wait_for_dra_driver(DRIVER)
            outcome = await self.kubelet.prepare(DRIVER, [Claim("ml", claim["metadata"]["uid"], name)])
            return outcome.ok

        return asyncio.run(prepare())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start_agent(stack: ExitStack, workdir: Path) -> Agent:
    gpud = DaemonProcess("--simulate", "1x16GiB", workdir=str(workdir / "agent-gpud"))
    (workdir / "agent-gpud").mkdir()
    gpud.start(timeout=30)
    stack.callback(gpud.cleanup)
    api = ThreadedFakeApiServer(version="1.37").start()
    stack.callback(api.close)
    kubelet = KubeletThread(workdir / "kubelet")
    kubelet.start()
    stack.callback(kubelet.close)
    port = free_port()
    argv = [
        sys.executable, "-m", "gpud_k8s.main", "--node-name", NODE, "--gpud-socket", gpud.socket,
        "--api-server", api.url, "--kubelet-dir", str(workdir / "kubelet"), "--cdi-dir", str(workdir / "cdi"),
        "--claims-dir", str(workdir / "claims"), "--state-dir", str(workdir / "agent"), "--shares", "on",
        "--allow-simulated", "--healthz", f"127.0.0.1:{port}",
    ]  # fmt: skip
    with open(workdir / "agent.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    agent = Agent(f"127.0.0.1:{port}", proc, api, kubelet)
    stack.callback(agent.stop)
    return agent


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    need("prometheus")
    workdir = Path(tempfile.mkdtemp(prefix="gpud-prom-", dir="/tmp"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, True)
        n = _start(stack, workdir)
        _load(n)
        yield n


def _start(stack: ExitStack, workdir: Path) -> Node:
    state = workdir / "nvml.json"
    state.write_text(json.dumps({"gpus": GPUS}))

    def update_nvml(change: dict[str, object]) -> None:
        data = json.loads(state.read_text())
        for index, fields in change.items():
            data["gpus"][int(index)].update(fields)
        state.with_suffix(".tmp").write_text(json.dumps(data))
        os.replace(state.with_suffix(".tmp"), state)

    config = workdir / "gpud.toml"
    config.write_text(CONFIG + TENANTS.format(a=1))
    env = {"PYTHONPATH": FAKE_NVML + os.pathsep + os.environ.get("PYTHONPATH", ""), "FAKE_NVML_STATE": str(state)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        d = DaemonProcess("--config", str(config), "--metrics-addr", "127.0.0.1:0").start(timeout=30)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    stack.callback(d.cleanup)
    (listening,) = [e for e in map(json.loads, d.log().splitlines()) if e.get("event") == "metrics_listening"]
    instance = f"127.0.0.1:{listening['port']}"
    agent = _start_agent(stack, workdir)
    targets = {JOB: instance, "dcgm": serve_dcgm_page(stack), AGENT_JOB: agent.instance}
    prom = start_prometheus(workdir, targets, rules_with_for("0s"))
    stack.callback(prom.stop)
    # Its first scrape of gpud, before any load: every counter's rise from then on is seen.
    eventually(lambda: prom.query(f'up{{job="{JOB}"}} == 1'), "gpud scraped", timeout=WAIT_S, why=prom.why)
    pool = ThreadPoolExecutor(4)
    stack.callback(pool.shutdown, wait=False, cancel_futures=True)
    clients = {name: stack.enter_context(Client(d.socket, name=name)) for name in ("trainer", "notebook", "holder")}
    clients |= {name: stack.enter_context(Client(d.socket, name=name)) for name in ("pipeline", "runner", "batch")}
    clients["prod"] = stack.enter_context(Client(d.socket, name="prod"))
    notices: queue.Queue[object] = queue.Queue()
    clients["batch"].add_allocation_listener(notices.put)
    return Node(d, prom, instance, agent, workdir, clients, {}, notices, pool, update_nvml)


def _load(n: Node) -> None:
    """Each capability once, the way a healthy node sees it."""
    c = n.clients
    # Locks with limits: two limited sessions contend for GPU 0 (one with a memory limit too).
    n.sessions["trainer"] = c["trainer"].session(0, core_limit=50, framework_hooks=False)
    n.sessions["notebook"] = c["notebook"].session(0, core_limit=30, mem_limit="8GiB", framework_hooks=False)

    def work(s: Any) -> None:
        for _ in range(40):
            with s.slice():
                pass  # the lock taken (or kept) and given back when a drop is pending: one GPU section

    for f in [n.pool.submit(work, n.sessions["trainer"]), n.pool.submit(work, n.sessions["notebook"])]:
        f.result(timeout=WAIT_S)
    # Leases on GPU 1: one holds 20 GiB of its 24, so a second cannot be admitted beside it.
    pipe = c["pipeline"]
    held = pipe.acquire("gpu:1", "ASR", mem_estimate="20GiB")
    assert held.acquired, held
    skipped = pipe.acquire("gpu:1", "SEMANTIC_REPAIR", mem_estimate="20GiB")
    timed_out = pipe.acquire("gpu:1", "OTHER", mem_estimate="20GiB", max_wait_ms=100)
    fallback = pipe.acquire("gpu:1", "TTS", mem_estimate="20GiB", max_wait_ms=0, busy_policy="FALLBACK_CPU")
    assert [r.status for r in (skipped, timed_out, fallback)] == ["SKIPPED", "SKIPPED", "FALLBACK_CPU"]
    assert timed_out.reason == "TIMEOUT"
    assert held.lease_id is not None
    pipe.release_lease(held.lease_id)
    for _ in range(5):
        with pipe.lease("gpu:1", "ASR") as r:
            assert r.acquired
    # A session keeps GPU 1 (unlimited: no compute-limit error of its own until its limit is lowered).
    n.sessions["holder"] = c["holder"].session(1, idle_release=None, framework_hooks=False)
    n.sessions["holder"].acquire()
    # Allocations: half a GPU in tenant team-a; a low-priority task taken back once, and it yields.
    assert c["runner"].allocate("a-1", 0.5, tenant="team-a").gpus == [0]
    preempt(n, overrun=False)
    # Kubernetes: a time-sliced claim prepared by gpud-k8s (on its own gpud).
    assert n.agent.prepare("trainer", TIME_SLICED)


def preempt(n: Node, *, overrun: bool) -> None:
    """``batch`` (priority 10) gets GPU 1; a production request waits for it; ``batch`` is told to leave
    and yields (or stays until its grace of 1 s ends); the request is granted; then it frees."""
    batch, prod = n.clients["batch"], n.clients["prod"]
    assert batch.allocate("batch", 1, priority=10).gpus == [1]
    waiter = n.pool.submit(prod.allocate, "prod", 1, priority="production", wait_ms=60_000)
    notice = n.notices.get(timeout=WAIT_S)
    assert isinstance(notice, p.Preempt) and notice.task_id == "batch", notice
    if not overrun:
        batch.yield_allocation("batch")
    assert waiter.result(timeout=WAIT_S).gpus == [1]
    revoked = n.notices.get(timeout=WAIT_S)
    assert isinstance(revoked, p.AllocRevoked) and revoked.gone, revoked
    prod.release_allocation("prod")


def answered(prom: Prometheus, expr: str) -> list[tuple[dict[str, str], float]]:
    """The query's series once one has a number: a quantile or rate over a window that has not seen
    two scrapes since the load yet is NaN, and an evaluation later it is not."""
    got = prom.query(expr)
    return got if any(not math.isnan(v) for _, v in got) else []


def plausible(values: list[float], lo: float, hi: float) -> bool:
    """At least one value, every one in [lo, hi] or NaN (a quantile of a window with no observation)."""
    finite = [v for v in values if not math.isnan(v)]
    return bool(finite) and all(lo <= v <= hi for v in finite)


def test_every_recording_rule_returns_a_plausible_series(node: Node) -> None:
    assert set(PLAUSIBLE) | set(K8S_PLAUSIBLE) == set(recording_rules()), "every record needs its plausible range"
    for name, (lo, hi) in [*PLAUSIBLE.items(), *K8S_PLAUSIBLE.items()]:
        got = eventually(
            partial(answered, node.prom, f'{name}{{instance="{node.instance}"}}' if name in PLAUSIBLE else name),
            f"{name} recorded",
            timeout=WAIT_S,
            why=node.why,
        )
        assert plausible([v for _, v in got], lo, hi), (name, got)
    # Per-GPU records carry dcgm-exporter's label names, with the GPUs' own values.
    info = node.prom.query("gpu:gpud_gpu_info:labels")
    assert sorted((m["gpu"], m["UUID"], m["modelName"]) for m, _ in info) == [
        ("0", "GPU-aaaa", "NVIDIA A100-SXM4-40GB"),
        ("1", "GPU-bbbb", "NVIDIA L4"),
    ]
    shares = node.prom.query("gpu:gpud_gpu_allocated:ratio")
    assert sorted((m["UUID"], v) for m, v in shares) == [("GPU-aaaa", 0.5), ("GPU-bbbb", 0.0)]


def test_the_records_join_dcgm_exporters_series_on_uuid(node: Node) -> None:
    matched = eventually(
        lambda: node.prom.query("gpu:gpud_gpu_info:labels and on(UUID, modelName) DCGM_FI_DEV_GPU_UTIL"),
        "both GPUs matched",
        timeout=WAIT_S,
        why=node.why,
    )
    assert sorted(m["UUID"] for m, _ in matched) == ["GPU-aaaa", "GPU-bbbb"]
    docs = (ROOT / "docs" / "metrics-and-logs.md").read_text()
    assert DCGM_JOIN in docs
    # GPU 0 holds half a GPU of allocations while dcgm-exporter sees it 2 % busy; GPU 1 is busy.
    idle = eventually(lambda: node.prom.query(DCGM_JOIN), "the join answers", timeout=WAIT_S, why=node.why)
    assert [(m["UUID"], v) for m, v in idle] == [("GPU-aaaa", 0.5)]


def test_every_dashboard_query_returns_a_plausible_series(node: Node) -> None:
    values = {"instance": node.instance, "gpu": ".*", "namespace": ".*", "k8s_namespace": ".*"}
    values["datasource"] = "prometheus"
    queries = dashboard_queries(values)
    assert len(queries) > 40
    for q in queries:
        got = eventually(partial(answered, node.prom, q.expr), f"{q.where}: {q.expr}", timeout=WAIT_S, why=node.why)
        if q.label is not None:  # a variable's label_values: its label is there to list
            assert all(q.label in m for m, _ in got), (q, got)
        lo = -1.0 if "error" in q.expr else 0.0
        assert plausible([v for _, v in got], lo, math.inf), (q, got)


def test_every_rule_evaluates_and_no_alert_is_active_on_a_healthy_node(node: Node) -> None:
    def evaluated() -> list[dict[str, Any]] | None:
        rules = node.prom.rules()
        return rules if all(r["health"] == "ok" for r in rules) else None

    rules = eventually(evaluated, "every rule evaluated", timeout=WAIT_S, why=lambda: str(node.prom.rules()))
    assert len(rules) == len(recording_rules()) + len(alerting_rules())
    assert all(not r.get("lastError") for r in rules)
    assert set(FIRED) | set(QUIET) | set(DOWN) == set(alerting_rules())
    assert {name: s for name, s in node.prom.alert_states().items() if s != "inactive"} == {}


def test_each_alert_fires_when_its_condition_holds(node: Node) -> None:
    c = node.clients
    preempt(node, overrun=True)  # batch's second take-back: it stays, and is revoked at its grace's end
    preempt(node, overrun=False)  # the third: the same task taken back again and again
    assert c["runner"].allocate("a-2", 1, tenant="team-a").gpus == [1]  # team-b's idle quota, borrowed
    # team-a's quota and borrowing lowered to half a GPU in all: it holds 1.5 (1 once the drain below
    # has taken a-1 back), above both.
    (node.workdir / "gpud.toml").write_text(CONFIG + TENANTS.format(a=0.25))
    assert node.d.proc is not None
    node.d.proc.send_signal(signal.SIGHUP)
    node.update_nvml({"1": {"lost": True}})
    node.sessions["notebook"].report_memory(12 * GIB)  # its limit is 8 GiB
    node.sessions["holder"].set_limits(core_limit=20)  # it had all of GPU 1 through its last windows
    c["prod"].drain(0)
    bad = {"apiVersion": "gpu.gpud.io/v1alpha1", "kind": "GpudClaimConfig", "priorityClass": "urgent"}
    assert not node.agent.prepare("refused", bad)  # its config is wrong: the agent refuses it

    def firing() -> bool:
        states = node.prom.alert_states()
        return all(states[a] in ("pending", "firing") for a in FIRED)

    eventually(
        firing, "every alert whose condition holds fires", timeout=WAIT_S, why=lambda: str(node.prom.alert_states())
    )
    states = node.prom.alert_states()
    assert {a: states[a] for a in QUIET + DOWN} == dict.fromkeys(QUIET + DOWN, "inactive")
    node.d.stop()
    node.agent.stop()
    eventually(
        lambda: all(node.prom.alert_states()[a] in ("pending", "firing") for a in DOWN),
        "GpudDown and GpudK8sAgentDown fire",
        timeout=WAIT_S,
        why=lambda: str(node.prom.alert_states()),
    )
