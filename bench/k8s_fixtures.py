"""The node the Kubernetes benchmarks run on, and the ResourceClaims the scheduler allocated there.

``KubeNode`` starts, under one short folder in /tmp: a real gpud on simulated GPUs, the fake API server and
the fake kubelet of gpud-k8s's tests (``tests/k8s/fake_apiserver.py``, ``tests/k8s/fake_kubelet.py``), each
in a thread and event loop of its own in this process, and a real ``gpud-k8s`` process between them, started
as ``tests/k8s/test_agent_process.py`` starts it. It is ready once the kubelet registered the agent's DRA
plugin. ``claim`` builds a ResourceClaim as the scheduler leaves it: allocated on this node's pool, a share
of one GPU by consumable capacity (``cores`` and ``memory``), reserved for a pod.

The fakes are the only things of tests/ that bench/ reads: no other kubelet or API server can run here.
They are loaded from their files (``load_fake``), not imported as a package, so that bench/'s types never
reach into tests/. Nothing here touches a real kubelet, API server or GPU, and everything made is removed
when the node stops.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "k8s"
DRIVER = "gpu.gpud.io"  # gpud_k8s.claims.DRIVER (not imported: this module loads without the k8s extra)
NODE = "bench-node"
NAMESPACE = "bench"
GPU_MEMORY = 80 * 2**30  # each simulated GPU's
MEMORY_STEP = 256 * 2**20  # gpud_k8s.slices.MEMORY_STEP: a share's memory is a multiple of it
API_VERSION = "1.37"  # the fake API server's schemas
READY_S = 60.0  # from the agent's start to the kubelet's registration of its plugin, on a loaded host
T = TypeVar("T")


class NodeError(RuntimeError):
    """The node could not be started, or a call the kubelet made was refused; the message says which."""


def load_fake(name: str, folder: Path = FAKES) -> ModuleType:
    """``tests/k8s/<name>.py`` (or ``<folder>/<name>.py``), loaded from its file (its imports are
    absolute: gpud, gpud_k8s and third parties)."""
    module_name = f"_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # (dataclasses look their module up while it loads)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it to the plugin (the fake kubelet's ``ClaimLike``)."""

    namespace: str
    uid: str
    name: str


def claim(name: str, gpu: int, *, cores: int, memory: int, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ResourceClaim allocated on ``gpu-<gpu>`` of this node: ``cores`` percent of it and ``memory`` bytes,
    with gpud's opaque ``config`` (``GpudClaimConfig``'s fields) where given; a fresh uid."""
    uid = str(uuid.uuid4())
    capacity = {"cores": str(cores), "memory": str(memory)}
    request: dict[str, Any] = {"deviceClassName": DRIVER, "capacity": {"requests": capacity}}
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}
    if config is not None:
        parameters = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpudClaimConfig", **config}
        spec["devices"]["config"] = [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}]
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": f"gpu-{gpu}",
        "consumedCapacity": capacity,
        "shareID": str(uuid.uuid4()),
    }
    node_term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid},
        "spec": spec,
        "status": {
            "allocation": {"devices": {"results": [result]}, "nodeSelector": {"nodeSelectorTerms": [node_term]}},
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": str(uuid.uuid4())}],
        },
    }


def share_memory(per_gpu: int) -> int:
    """The memory of one of ``per_gpu`` equal shares of a GPU, in the steps the slice allows."""
    return GPU_MEMORY // per_gpu // MEMORY_STEP * MEMORY_STEP


class KubeNode:
    """gpud, the fake API server, the fake kubelet and a gpud-k8s process; ``with KubeNode(gpus) as node:``."""

    def __init__(self, gpus: int, *, gpud_args: tuple[str, ...] = (), agent_args: tuple[str, ...] = ()) -> None:
        self.gpus = gpus
        self.agent_args = agent_args
        self.root = Path(tempfile.mkdtemp(prefix="gpud-bench-k8s-", dir="/tmp"))  # short: socket paths
        self.gpud = DaemonProcess(
            "--simulate",
            f"{gpus}x{GPU_MEMORY // 2**30}GiB",
            "--log-level",
            "warning",
            *gpud_args,
            workdir=str(self.root / "gpud"),
        )
        self.api: Any = None  # the fakes' classes, loaded from tests/k8s
        self.kubelet: Any = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_log = self.root / "agent.log"

    def __enter__(self) -> KubeNode:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        (self.root / "gpud").mkdir()
        self.gpud.start(timeout=30)
        self.api = load_fake("fake_apiserver").ThreadedFakeApiServer(version=API_VERSION).start()
        self.kubelet = load_fake("fake_kubelet").KubeletThread(self.root / "kubelet")
        self.kubelet.start()
        argv = [
            sys.executable, "-m", "gpud_k8s.main", "--node-name", NODE, "--gpud-socket", self.gpud.socket,
            "--api-server", self.api.url, "--kubelet-dir", str(self.root / "kubelet"), "--cdi-dir",
            str(self.root / "cdi"), "--claims-dir", str(self.root / "claims"), "--state-dir", str(self.root / "state"),
            "--shares", "on", "--allow-simulated", "--healthz", "", *self.agent_args,
        ]  # fmt: skip
        with open(self.agent_log, "wb") as log:
            self.agent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait_registered()

    def _wait_registered(self) -> None:
        deadline = time.monotonic() + READY_S
        while not self.kubelet.read(lambda kl: bool(kl.dra_plugins(DRIVER))):
            assert self.agent is not None
            if self.agent.poll() is not None:
                raise NodeError(f"gpud-k8s exited with {self.agent.returncode}:\n{self.agent_output()}")
            if time.monotonic() > deadline:
                raise NodeError(
                    f"the kubelet registered no plugin of {DRIVER} in {READY_S:g} s:\n{self.agent_output()}"
                )
            time.sleep(0.05)

    def agent_output(self) -> str:
        return self.agent_log.read_text(errors="replace")[-4000:] if self.agent_log.exists() else ""

    def stop(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(30)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()
        for fake in (self.kubelet, self.api):
            if fake is not None:
                with contextlib.suppress(Exception):  # (stopping: what failed was reported already)
                    fake.close()
        self.gpud.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- while it runs

    def put(self, obj: dict[str, Any]) -> ClaimRef:
        """Store a ResourceClaim in the API server (validated as any write is); the kubelet's name for it."""
        self.api.put(obj)
        meta = obj["metadata"]
        return ClaimRef(meta["namespace"], meta["uid"], meta["name"])

    def in_kubelet(self, fn: Callable[[Any], Awaitable[T]], timeout: float = 300.0) -> T:
        """``await fn(kubelet)`` in the fake kubelet's event loop, as the kubelet itself would run it."""
        result: T = self.kubelet.call(fn, timeout)
        return result

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far by the agent, by gpud, and by this process (the fake kubelet and API server)."""
        assert self.agent is not None and self.gpud.proc is not None
        return {
            "agent": _process_cpu_s(self.agent.pid),
            "gpud": _process_cpu_s(self.gpud.proc.pid),
            "kubelet_and_api_server": time.process_time(),
        }

    def adopted(self) -> list[str]:
        """The tasks whose containers' cgroups gpud holds (ADOPT)."""
        with Connection(self.gpud.socket) as conn:
            conn.hello("bench-check")
            reply = conn.call(p.ListRuns(id=conn.next_id()))
        assert isinstance(reply, p.RunsReply), reply
        return [r.task_id for r in reply.runs if r.task_id]

    def allocations(self) -> list[str]:
        """The task ids gpud holds allocations for."""
        with Connection(self.gpud.socket) as conn:
            conn.hello("bench-check")
            reply = conn.call(p.ListAllocations(id=conn.next_id()))
        assert isinstance(reply, p.AllocationsReply), reply
        return [a.task_id for a in reply.allocations]


def _process_cpu_s(pid: int) -> float:
    """A process's user and system CPU seconds (/proc/PID/stat: utime and stime, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
