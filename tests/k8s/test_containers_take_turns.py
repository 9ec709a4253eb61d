"""End to end on this node: containers that know nothing of gpud take turns on a GPU by their claims'
shares, are suspended or evicted when taken back, and leave nothing behind when unprepared.

Real parts: gpud on one simulated GPU, the ``gpud-k8s`` process, the fake kubelet (DRA and pod resources
over gRPC on Unix sockets), the fake API server (pods, claims, evictions over HTTP), and, as the
"containers", real busy processes in real cgroups laid out as the kubelet and containerd lay them
(``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope``)
below a cgroup of the test's own. The test plays the container runtime: it starts each container with
the environment of the claim's CDI spec, as a runtime applies it. Whether a container ran is read from
the kernel (its cgroup's ``cpu.stat``), never from timing.

What is asserted holds on a loaded 2-core machine every time: the 25 % claim's containers get less
CPU time than the 75 % claim's, and each gets some; the exact shares are ``bench/k8s_prepare.py``'s.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_k8s.claims import DRIVER
from tests.integration.waiting import eventually
from tests.testcgroups import BURN, CgroupTree, usable

from .fake_apiserver import ThreadedFakeApiServer
from .fake_kubelet import Claim, KubeletThread
from .pods import Pod, cdi_env, pod_resources
from .rbac import beyond
from .test_driver import NODE, resource_claim

NO_CGROUPS = usable()
pytestmark = pytest.mark.skipif(NO_CGROUPS is not None, reason=f"no writable cgroup v2 here: {NO_CGROUPS}")
NS = "team-a"
GRACE_S = 3


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    t = CgroupTree()
    try:
        yield t
    finally:
        t.close()


def runs(daemon: DaemonProcess, task: str) -> p.RunProgramInfo | None:
    with Client(daemon.socket) as c:
        reply: p.RunsReply = c.call(p.ListRuns(id=0))
    return next((r for r in reply.runs if r.task_id == task), None)


class Scene:
    """gpud on one simulated GPU, the agent, and a pod per claim whose one container is a busy process that
    knows nothing of gpud, started (as a runtime would) with its claim's CDI edits once it is prepared."""

    def __init__(self, tree: CgroupTree, daemon_factory: Any, api: ThreadedFakeApiServer, kubelet: KubeletThread):
        self.tree, self.api, self.kubelet = tree, api, kubelet
        self.root = Path(tempfile.mkdtemp(prefix="turns-", dir="/tmp"))
        config = self.root / "gpud.toml"
        config.write_text(f"preemption_grace_s = {GRACE_S}\npreemption_min_runtime_s = 0\nreap_interval_s = 0\n")
        self.daemon: DaemonProcess = daemon_factory("--simulate", "1x16GiB", "--config", str(config))
        self.agent: subprocess.Popen[bytes] | None = None
        self.pods: list[Pod] = []
        self.env: dict[str, str] = {}  # more of the agent's environment, and of the containers'
        self.program = BURN  # what each container runs (Python, started once it is in its cgroup)

    def add(self, pod: Pod, cores: str, config: dict[str, Any]) -> Pod:
        made = self.api.put(pod.object())
        pod.uid, pod.container_id = made["metadata"]["uid"], uuid.uuid4().hex + uuid.uuid4().hex
        claim = resource_claim(pod.claim_uid, pod.claim, 0, cores=cores, memory="4Gi", config=config)
        claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod.name, "uid": pod.uid}]
        self.api.put(claim)
        self.pods.append(pod)
        asyncio.run(self.kubelet.set_pods(pod_resources(self.pods)))
        return pod

    def start_agent(self) -> None:
        argv = [
            sys.executable, "-m", "gpud_k8s.main", "--node-name", NODE, "--gpud-socket", self.daemon.socket,
            "--api-server", self.api.url, "--kubelet-dir", str(self.kubelet.paths.root),
            "--cdi-dir", str(self.root / "cdi"), "--claims-dir", str(self.root / "claims"),
            "--state-dir", str(self.root / "state"), "--shares", "on", "--allow-simulated", "--healthz", "",
            "--cgroup-root", str(self.tree.root), "--find-interval", "0.05",
        ]  # fmt: skip
        with open(self.root / "agent.log", "ab") as log:
            self.agent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})

    def stop_agent(self, sig: int = signal.SIGTERM) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(sig)
            try:
                self.agent.wait(30)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()

    @property
    def claims(self) -> list[Claim]:
        return [Claim(NS, pod.claim_uid, pod.claim) for pod in self.pods]

    def prepare(self) -> None:
        async def prepare() -> None:
            await self.kubelet.wait_for_dra_driver(DRIVER)
            outcome = await self.kubelet.prepare(DRIVER, self.claims)
            assert outcome.ok, outcome.error

        asyncio.run(prepare())
        for pod in self.pods:  # the runtime starts each container with its claim's CDI edits
            env = {**self.env, **cdi_env(self.root / "cdi" / f"gpud.io-claim_{pod.claim_uid}.json")}
            self.tree.spawn(pod.cgroup, self.program, env=env)
        for pod in self.pods:
            handed = lambda pod=pod: runs(self.daemon, f"k8s-{pod.claim_uid}")  # noqa: E731
            eventually(handed, f"{pod.name}'s container handed to gpud", timeout=60)

    def unprepare(self) -> None:
        async def unprepare() -> None:
            outcome = await self.kubelet.unprepare(DRIVER, self.claims)
            assert outcome.ok, outcome.error

        asyncio.run(unprepare())

    def cpu(self) -> dict[str, int]:
        return {pod.name: self.tree.cpu_usec(pod.cgroup) for pod in self.pods}

    def shares(self, seconds: float) -> dict[str, float]:
        """Each container's part of the CPU time they used between them, until they used ``seconds``."""
        start = self.cpu()
        used = lambda: {name: t - start[name] for name, t in self.cpu().items()}  # noqa: E731
        eventually(lambda: sum(used().values()) >= seconds * 1e6, f"{seconds} s of CPU time between them", timeout=120)
        got = used()
        shares = {name: t / sum(got.values()) for name, t in got.items()}
        print("shares:", {name: round(x, 3) for name, x in shares.items()})
        return shares

    def close(self) -> None:
        self.stop_agent()
        print((self.root / "agent.log").read_text()[-20000:] if (self.root / "agent.log").exists() else "")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def scene(
    tree: CgroupTree, daemon_factory: Any, apiserver: ThreadedFakeApiServer, fake_kubelet: KubeletThread
) -> Iterator[Scene]:
    s = Scene(tree, daemon_factory, apiserver, fake_kubelet)
    try:
        yield s
    finally:
        s.close()


SPOT = {"apiVersion": "gpu.gpud.io/v1alpha1", "kind": "GpudClaimConfig", "timeSlice": True, "priorityClass": "spot"}


def test_unmodified_containers_take_turns_by_their_claims_shares_and_are_suspended_or_evicted(scene: Scene) -> None:
    tree, api, daemon = scene.tree, scene.api, scene.daemon
    little = scene.add(Pod("little-pod", "little", str(uuid.uuid4()), NS, NODE), "25", dict(SPOT, recovery="suspend"))
    big = scene.add(Pod("big-pod", "big", str(uuid.uuid4()), NS, NODE), "75", dict(SPOT, recovery="terminate"))
    scene.start_agent()
    scene.prepare()

    # They take turns (one at a time: the GPU's lock), by their shares (25 %, 75 %).
    share = scene.shares(8)[little.name]
    assert 0.05 < share < 0.45, f"the 25 % claim's containers got {share:.0%} of the CPU time"

    # Taken back by a whole-GPU allocation of a higher class: the little one suspends at once (frozen,
    # its allocation suspended); the big one runs on for the grace, then its pod is evicted.
    with Client(daemon.socket, name="production") as admin:
        admin.allocate("urgent", gpus=1, priority="high", wait_ms=60_000)
        states = {a.task_id: a.state for a in admin.allocations().allocations}
        assert states[f"k8s-{little.claim_uid}"] == p.AllocState.SUSPENDED  # waiting for its devices
        assert tree.frozen(little.cgroup)
        evicted = lambda: (api.get("pods", NS, big.name) or {}).get("metadata", {}).get(  # noqa: E731
            "deletionTimestamp") or api.get("pods", NS, big.name) is None  # fmt: skip
        eventually(evicted, "the big pod evicted", timeout=60)
        assert api.get("pods", NS, little.name) is not None, "a suspended claim's pod is not evicted"
        eventually(lambda: tree.frozen(big.cgroup), "the big claim's containers frozen for good", timeout=60)
        # gone from the API server while its container still runs (the kubelet still names it): still frozen
        lists = api.count("list", "pods")
        eventually(lambda: api.count("list", "pods") >= lists + 2, "the node's pods listed again", timeout=60)
        assert api.get("pods", NS, big.name) is None and tree.frozen(big.cgroup)
        frozen_at = tree.cpu_usec(little.cgroup)
        admin.release_allocation("urgent")
    # resumed: the little one takes turns again (the big one's allocation is gone: it stays frozen)
    running = lambda: tree.cpu_usec(little.cgroup) > frozen_at + 200_000  # noqa: E731
    eventually(running, "the suspended claim running again", timeout=60)
    assert tree.frozen(big.cgroup)

    scene.unprepare()
    with Client(daemon.socket) as c:
        assert [a.task_id for a in c.allocations().allocations] == []
        assert [r.task_id for r in c.call(p.ListRuns(id=0)).runs if r.task_id] == []
    for pod in (little, big):
        assert not (scene.root / "claims" / pod.claim_uid).exists()
        assert not (scene.root / "cdi" / f"gpud.io-claim_{pod.claim_uid}.json").exists()
        assert not tree.wants_frozen(pod.cgroup), f"{pod.name}'s container left frozen"
    assert beyond(api.counts) == [], "every request is one the agent's ClusterRole allows"


def test_turns_go_on_across_a_restart_of_the_agent_and_of_gpud(scene: Scene) -> None:
    """After each restart the containers are arbitrated again, by their shares: run unarbitrated, each would
    have a core of its own here and half of the CPU time between them."""
    a = scene.add(Pod("a-pod", "a", str(uuid.uuid4()), NS, NODE), "25", dict(SPOT))
    b = scene.add(Pod("b-pod", "b", str(uuid.uuid4()), NS, NODE), "75", dict(SPOT))
    scene.start_agent()
    scene.prepare()
    assert 0.05 < scene.shares(6)[a.name] < 0.45

    scene.stop_agent(signal.SIGKILL)  # mid-turn: one container may be left running, the other frozen
    scene.start_agent()
    assert 0.05 < scene.shares(6)[a.name] < 0.45, "taking turns again after the agent's restart"

    scene.daemon.stop()  # gpud away: the containers stay as the kernel has them
    scene.daemon.start()  # its allocations restored, held again by the agent; the cgroups handed again
    assert 0.05 < scene.shares(6)[a.name] < 0.45, "taking turns again after gpud's restart"
    with Client(scene.daemon.socket) as c:
        adopted = {r.task_id for r in c.call(p.ListRuns(id=0)).runs if r.task_id}
    assert adopted == {f"k8s-{a.claim_uid}", f"k8s-{b.claim_uid}"}
    scene.unprepare()
    assert not scene.tree.wants_frozen(a.cgroup) and not scene.tree.wants_frozen(b.cgroup)


def test_a_pod_being_deleted_has_its_containers_thawed_for_its_sigterm(
    tree: CgroupTree, daemon_factory: Any, fake_kubelet: KubeletThread
) -> None:
    """Kubernetes' own preemption (or a rollout) deletes the pod: its containers get SIGTERM and are
    thawed for good to act on it within the pod's termination grace; its turns end there."""
    api = ThreadedFakeApiServer(version="1.37", kubelet=False).start()  # the pod stays, being deleted
    scene = Scene(tree, daemon_factory, api, fake_kubelet)
    try:
        a = scene.add(Pod("a-pod", "a", str(uuid.uuid4()), NS, NODE), "50", dict(SPOT))
        b = scene.add(Pod("b-pod", "b", str(uuid.uuid4()), NS, NODE), "50", dict(SPOT))
        scene.start_agent()
        scene.prepare()
        scene.shares(1)  # taking turns
        request = urllib.request.Request(f"{api.url}/api/v1/namespaces/{NS}/pods/{a.name}", method="DELETE")
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200
        assert (api.get("pods", NS, a.name) or {}).get("metadata", {}).get("deletionTimestamp")
        eventually(lambda: not tree.wants_frozen(a.cgroup), "the deleted pod's container thawed", timeout=60)
        lists = api.count("list", "pods")
        eventually(lambda: api.count("list", "pods") >= lists + 2, "the node's pods listed again", timeout=60)
        b_ran = tree.cpu_usec(b.cgroup)

        def thawed_while_b_runs() -> bool:  # thawed for good: the other claim's turns no longer pause it
            assert not tree.wants_frozen(a.cgroup)
            return tree.cpu_usec(b.cgroup) > b_ran + 500_000

        eventually(thawed_while_b_runs, "b's container running half a second", timeout=60)
    finally:
        scene.close()
        api.close()


def test_with_pause_cuda_the_drivers_lock_comes_before_the_freeze(scene: Scene) -> None:
    """``pause: cuda``: the containers' CUDA work is locked through the driver's checkpoint API (the stand-in
    of tests/fakecuda, its calls logged) before gpud freezes them, as for ``gpuctl run --pause cuda``."""
    fake = scene.root / "fakecuda"
    fake.mkdir()
    tests = Path(__file__).resolve().parents[1]
    scene.env = {"PYTHONPATH": str(tests / "fakecuda"), "FAKE_CUDA_DIR": str(fake)}
    burner, progress = str(tests / "programs" / "cuda_burner.py"), scene.root / "progress"
    scene.program = (
        "import runpy, sys; sys.stdin.buffer.read(1)\n"
        f"sys.argv = [{burner!r}, {str(progress)!r}, '--max-seconds', '120']\n"
        f"runpy.run_path({burner!r}, run_name='__main__')\n"
    )
    cuda = dict(SPOT, pause="cuda")
    a = scene.add(Pod("a-pod", "a", str(uuid.uuid4()), NS, NODE), "50", cuda)
    scene.add(Pod("b-pod", "b", str(uuid.uuid4()), NS, NODE), "50", cuda)
    scene.start_agent()
    scene.prepare()
    scene.shares(2)
    pid = int((scene.tree.path(a.cgroup) / "cgroup.procs").read_text().split()[0])

    def calls(op: str) -> list[dict[str, object]]:
        lines = (fake / "calls.log").read_text().splitlines() if (fake / "calls.log").exists() else []
        return [c for c in map(json.loads, lines) if c["op"] == op and c["pid"] == pid]

    eventually(lambda: [c for c in calls("lock") if c["result"] == "CUDA_SUCCESS"], "a's CUDA work locked", timeout=60)
    eventually(lambda: calls("unlock"), "and unlocked for its turn", timeout=60)

    def frozen_and_locked() -> bool:
        if not scene.tree.frozen(a.cgroup):
            return False
        state = json.loads((fake / f"{pid}.json").read_text())["state"]
        return state == "locked" and scene.tree.frozen(a.cgroup)

    eventually(frozen_and_locked, "a frozen with its CUDA work locked", timeout=60)
