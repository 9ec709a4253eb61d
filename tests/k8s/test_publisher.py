"""The node's ResourceSlice kept true to a real gpud's GPUs, written to the fake API server through the real
Kubernetes client (gpud_k8s.publisher, gpud_k8s.kube)."""

from __future__ import annotations

import asyncio

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client.aio import AsyncClient
from gpud_k8s import kube as kube_api
from gpud_k8s.publisher import Publisher, SimulatedGpus
from gpud_k8s.slices import DRAINING, slice_name

from .fake_apiserver import ThreadedFakeApiServer

NODE = "node-a"


def run(coro_fn, daemon: DaemonProcess, apiserver: ThreadedFakeApiServer, **options: object) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        gpud = await AsyncClient.connect(daemon.socket, name="test")
        kube = kube_api.Kube(await kube_api.connect(host=apiserver.url))
        try:
            publisher = Publisher(kube, gpud, NODE, shared=True, allow_simulated=True, **options)  # type: ignore[arg-type]
            await coro_fn(publisher, gpud, kube)
        finally:
            await kube.close()
            await gpud.close()

    asyncio.run(body())


def test_the_slice_says_what_gpud_has_and_changes_only_with_it(
    daemon: DaemonProcess, apiserver: ThreadedFakeApiServer
) -> None:
    async def body(pub: Publisher, gpud: AsyncClient, kube: kube_api.Kube) -> None:
        await pub.start()
        assert await pub.publish_once()
        s = apiserver.get("resourceslices", None, slice_name(NODE))
        assert s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
        assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0", "gpu-1"]
        assert s["spec"]["devices"][0]["capacity"]["memory"]["value"] == "16Gi"
        writes = apiserver.count("create", "resourceslices") + apiserver.count("update", "resourceslices")
        assert not await pub.publish_once(), "nothing changed: nothing written"
        assert apiserver.count("create", "resourceslices") + apiserver.count("update", "resourceslices") == writes
        await gpud.drain(1)
        assert await pub.publish_once()
        s = apiserver.get("resourceslices", None, slice_name(NODE))
        assert s["spec"]["pool"]["generation"] == 2
        assert [t["key"] for t in s["spec"]["devices"][1].get("taints", [])] == [DRAINING]
        assert "taints" not in s["spec"]["devices"][0]

    run(body, daemon, apiserver)


def test_a_new_agent_goes_on_from_the_generation_there_and_removes_stale_slices(
    daemon: DaemonProcess, apiserver: ThreadedFakeApiServer
) -> None:
    stale = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-old"},
        "spec": {
            "driver": "gpu.gpud.io",
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
        },
    }
    other_node = dict(stale, metadata={"name": "node-b-old"}, spec=dict(stale["spec"], nodeName="node-b"))  # type: ignore[arg-type]

    async def first(pub: Publisher, gpud: AsyncClient, kube: kube_api.Kube) -> None:
        await pub.start()
        await pub.publish_once()
        await gpud.drain(0)
        await pub.publish_once()

    async def second(pub: Publisher, gpud: AsyncClient, kube: kube_api.Kube) -> None:
        apiserver.put(stale)
        apiserver.put(other_node)
        await pub.start()
        assert pub.generation == 2
        await gpud.drain(0, on=False)
        await pub.publish_once()
        assert apiserver.get("resourceslices", None, slice_name(NODE))["spec"]["pool"]["generation"] == 3
        names = sorted(o["metadata"]["name"] for o in apiserver.objects("resourceslices"))
        assert names == ["node-a-gpu.gpud.io", "node-b-old"], "this node's stale slice removed, no other node's"

    run(first, daemon, apiserver)
    run(second, daemon, apiserver)


def test_simulated_gpus_are_not_published_unless_asked_for(
    daemon: DaemonProcess, apiserver: ThreadedFakeApiServer
) -> None:
    async def body(pub: Publisher, gpud: AsyncClient, kube: kube_api.Kube) -> None:
        pub.allow_simulated = False
        with pytest.raises(SimulatedGpus, match="simulated GPUs"):
            await pub.publish_once()
        assert apiserver.objects("resourceslices") == []

    run(body, daemon, apiserver)
