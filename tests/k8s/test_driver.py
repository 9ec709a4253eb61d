"""gpud's DRA driver end to end on this machine: a real gpud on simulated GPUs, the fake API server holding
the ResourceClaims, the fake kubelet registering the plugin and calling NodePrepareResources /
NodeUnprepareResources over real gRPC on real Unix sockets (gpud_k8s.plugin, gpud_k8s.driver)."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.aio import AsyncClient
from gpud_k8s import kube as kube_api
from gpud_k8s.claims import DRIVER
from gpud_k8s.driver import Driver
from gpud_k8s.plugin import KubeletPlugin
from gpud_k8s.prepared import Prepared, PreparedClaims

from .cdi import validate_cdi_spec
from .fake_apiserver import ThreadedFakeApiServer
from .fake_kubelet import Claim, KubeletThread
from .rbac import beyond

NODE = "node-a"
CONFIG = {"apiVersion": "gpu.gpud.io/v1alpha1", "kind": "GpudClaimConfig"}


def resource_claim(uid: str, name: str, gpu: int, *, cores: str | None = None, memory: str | None = None,
                   config: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": f"gpu-{gpu}"}
    request: dict[str, Any] = {"deviceClassName": "gpu.gpud.io"}
    if cores is not None:
        result["consumedCapacity"] = {"cores": cores, **({"memory": memory} if memory else {})}
        result["shareID"] = f"00000000-0000-4000-8000-{uid[-12:]:0>12}"
        request["capacity"] = {"requests": {"cores": cores, **({"memory": memory} if memory else {})}}
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}
    if config is not None:
        spec["devices"]["config"] = [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": config}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a", "uid": uid},
        "spec": spec,
        "status": {
            "allocation": {
                "devices": {"results": [result]},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": f"pod-{uid}"}],
        },
    }


@dataclass
class Node:
    gpud: DaemonProcess
    api: ThreadedFakeApiServer
    kubelet: KubeletThread
    root: Path  # state, CDI and claim directories (short: socket paths)

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def claims_dir(self) -> Path:
        return self.root / "claims"

    @property
    def state(self) -> PreparedClaims:
        return PreparedClaims(self.root / "state")

    def left_behind(self, uid: str) -> list[str]:
        """What a claim left: its allocation, socket directory, CDI spec, record."""
        found = []
        with Client(self.gpud.socket) as c:
            found += [a.task_id for a in c.allocations().allocations if a.task_id == f"k8s-{uid}"]
        found += [str(p) for p in (self.claims_dir / uid, self.cdi_dir / f"gpud.io-claim_{uid}.json") if p.exists()]
        found += [f"record {r.uid}" for r in self.state if r.uid == uid]
        return found


@pytest.fixture
def node(daemon: DaemonProcess, apiserver: ThreadedFakeApiServer, fake_kubelet: KubeletThread) -> Iterator[Node]:
    root = Path(tempfile.mkdtemp(prefix="k8s-", dir="/tmp"))
    try:
        yield Node(daemon, apiserver, fake_kubelet, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@asynccontextmanager
async def agent(node: Node) -> AsyncIterator[Driver]:
    """The agent's driver and kubelet plugin, registered with the fake kubelet."""
    gpud = await AsyncClient.connect(node.gpud.socket, name="gpud-k8s")
    kube = kube_api.Kube(await kube_api.connect(host=node.api.url))
    driver = Driver(NODE, gpud, kube, node.state, cdi_dir=node.cdi_dir, claims_dir=node.claims_dir)
    await driver.recover()
    plugin = KubeletPlugin(driver, node.kubelet.paths)
    await plugin.start()
    try:
        await node.kubelet.wait_for_dra_driver(DRIVER)
        yield driver
    finally:
        await plugin.stop(0)
        await kube.close()
        await gpud.close()


def test_a_share_is_prepared_enforced_and_unprepared_leaving_nothing(node: Node) -> None:
    uid = "0b9e4c1a-0000-4000-8000-000000000001"
    node.api.put(resource_claim(uid, "quarter", 1, cores="25", memory="4Gi"))
    claim = Claim("team-a", uid, "quarter")

    async def body() -> None:
        async with agent(node):
            outcome = await node.kubelet.prepare(DRIVER, [claim])
            assert outcome.ok, outcome.error
            (device,) = outcome.results[uid].devices
            assert (device.pool_name, device.device_name, device.request_names) == (NODE, "gpu-1", ("gpu",))
            assert device.cdi_device_ids == (f"gpud.io/claim={uid}",)
            assert device.share_id == f"00000000-0000-4000-8000-{uid[-12:]}"
            again = await node.kubelet.prepare(DRIVER, [claim])
            assert again.ok and again.results[uid].devices == outcome.results[uid].devices, "idempotent"

            spec = json.loads((node.cdi_dir / f"gpud.io-claim_{uid}.json").read_text())
            validate_cdi_spec(spec)
            edits = spec["devices"][0]["containerEdits"]
            assert f"GPUD_TASK_ID=k8s-{uid}" in edits["env"]
            assert edits["mounts"][0]["hostPath"] == str(node.claims_dir / uid)

            with Client(node.gpud.socket) as admin:
                (alloc,) = admin.allocations().allocations
                assert (alloc.task_id, alloc.gpus, alloc.share, alloc.tenant) == (f"k8s-{uid}", [1], 0.25, None)
                assert alloc.memory_bytes == 4 * 2**30
            # a process of the claim, knowing nothing but the socket: its share is its ceiling
            with Client(str(node.claims_dir / uid / "gpud.sock")) as container:
                attached = container.call(p.Attach(id=0, gpu=1))
                assert (attached.core_limit, attached.mem_limit) == (25, 4 * 2**30), (
                    "the claim's memory, not 1/4 of 16 GiB"
                )

            outcome = await node.kubelet.unprepare(DRIVER, [claim])
            assert outcome.ok, outcome.error
            assert node.left_behind(uid) == []
            assert (await node.kubelet.unprepare(DRIVER, [claim])).ok, "unknown: success"

    asyncio.run(body())


def test_a_whole_gpu_and_a_bad_config_side_by_side(node: Node) -> None:
    whole, bad = "0b9e4c1a-0000-4000-8000-000000000002", "0b9e4c1a-0000-4000-8000-000000000003"
    node.api.put(resource_claim(whole, "whole", 0, config=dict(CONFIG, priorityClass="high", recovery="checkpoint")))
    node.api.put(resource_claim(bad, "bad", 1, cores="50", config=dict(CONFIG, priorityClass="urgent")))

    async def body() -> None:
        async with agent(node):
            outcome = await node.kubelet.prepare(DRIVER, [Claim("team-a", whole, "whole"), Claim("team-a", bad, "bad")])
            assert not outcome.ok and outcome.results[whole].error == ""
            assert "ResourceClaim team-a/bad" in outcome.results[bad].error
            assert "$.priorityClass" in outcome.results[bad].error
            assert node.left_behind(bad) == [], "refused: nothing made"
            with Client(node.gpud.socket) as admin:
                (alloc,) = admin.allocations().allocations
            assert (alloc.gpus, alloc.share, alloc.priority, alloc.on_preempt) == (
                [0],
                1.0,
                p.PRIORITY_OF_CLASS["high"],
                "checkpoint",
            )
            # the claim's own status says why, on its device of this node (the kubelet's event says it too)
            (entry,) = node.api.get("resourceclaims", "team-a", "bad")["status"]["devices"]
            (ready,) = entry["conditions"]
            assert (entry["driver"], entry["pool"], entry["device"]) == (DRIVER, NODE, "gpu-1")
            assert entry["shareID"] == f"00000000-0000-4000-8000-{bad[-12:]}"
            assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "ClaimConfigInvalid")
            assert "$.priorityClass" in ready["message"]
            assert "devices" not in node.api.get("resourceclaims", "team-a", "whole")["status"], "said only of failures"

            assert beyond(node.api.counts) == [], "every request is one the agent's ClusterRole allows"

    asyncio.run(body())


def test_a_claim_gpud_could_not_serve_says_so_in_its_status_until_a_prepare_succeeds(node: Node) -> None:
    uid = "0b9e4c1a-0000-4000-8000-000000000005"
    node.api.put(resource_claim(uid, "later", 0, cores="50", memory="2Gi"))
    claim = Claim("team-a", uid, "later")

    async def body() -> None:
        async with agent(node):
            with Client(node.gpud.socket, name="batch") as admin:
                admin.allocate("batch", gpus=1, prefer=[0], strategy="only")  # GPU 0 is full
                outcome = await node.kubelet.prepare(DRIVER, [claim])
                assert not outcome.ok and "gpud refused it" in outcome.results[uid].error
                (entry,) = node.api.get("resourceclaims", "team-a", "later")["status"]["devices"]
                assert [(c["status"], c["reason"]) for c in entry["conditions"]] == [("False", "PrepareFailed")]
                admin.release_allocation("batch")
            outcome = await node.kubelet.prepare(DRIVER, [claim])
            assert outcome.ok, outcome.error
            (entry,) = node.api.get("resourceclaims", "team-a", "later")["status"]["devices"]
            assert [(c["status"], c["reason"]) for c in entry["conditions"]] == [("True", "Prepared")]
            assert beyond(node.api.counts) == [], "every request is one the agent's ClusterRole allows"

    asyncio.run(body())


def test_a_claim_made_again_under_its_name_or_gone_is_refused(node: Node) -> None:
    uid = "0b9e4c1a-0000-4000-8000-000000000004"
    node.api.put(resource_claim("0b9e4c1a-0000-4000-8000-0000000000ff", "renamed", 0))

    async def body() -> None:
        async with agent(node):
            outcome = await node.kubelet.prepare(
                DRIVER, [Claim("team-a", uid, "renamed"), Claim("team-a", uid + "x", "gone")]
            )
            assert "deleted and made again" in outcome.results[uid].error
            assert "not found" in outcome.results[uid + "x"].error

    asyncio.run(body())


def test_what_a_crash_left_half_made_is_undone_and_prepared_claims_get_their_socket_back(node: Node) -> None:
    done, half = "0b9e4c1a-0000-4000-8000-000000000005", "0b9e4c1a-0000-4000-8000-000000000006"
    node.api.put(resource_claim(done, "done", 0, cores="50"))

    async def body() -> None:
        async with agent(node):
            assert (await node.kubelet.prepare(DRIVER, [Claim("team-a", done, "done")])).ok
        # a crash between the record and the kubelet's answer: the allocation made, the record "preparing"
        with Client(node.gpud.socket) as admin:
            admin.allocate(f"k8s-{half}", gpus=0.25, prefer=[1])
        node.state.put(
            Prepared(
                uid=half,
                namespace="team-a",
                name="half",
                task_id=f"k8s-{half}",
                state="preparing",
                socket_dir=str(node.claims_dir / half),
                cdi_file=str(node.cdi_dir / f"gpud.io-claim_{half}.json"),
            )  # fmt: skip
        )
        node.gpud.stop()  # and gpud restarted: the prepared claim's socket is gone with it
        node.gpud.start()
        async with agent(node):
            assert node.left_behind(half) == []
            with Client(str(node.claims_dir / done / "gpud.sock")) as container:
                assert container.call(p.Attach(id=0, gpu=0)).core_limit == 50

    asyncio.run(body())
