"""The device-plugin fallback end to end: a real gpud on simulated GPUs, its seats registered with the fake
kubelet's device manager over real gRPC, allocated to containers, kept registered across a kubelet
restart (gpud_k8s.deviceplugin)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.aio import AsyncClient
from gpud_k8s import kube as kube_api
from gpud_k8s import kubelet_api as k
from gpud_k8s.deviceplugin import RESOURCE, SeatPlugin
from tests.integration.waiting import eventually_async

from .fake_apiserver import ThreadedFakeApiServer
from .fake_kubelet import KubeletThread


def test_seats_are_shares_of_a_gpu_that_containers_get_through_their_socket(
    daemon: DaemonProcess, fake_kubelet: KubeletThread
) -> None:
    claims = Path(tempfile.mkdtemp(prefix="seats-", dir="/tmp"))

    async def body() -> None:
        gpud = await AsyncClient.connect(daemon.socket, name="gpud-k8s")
        plugin = SeatPlugin(gpud, fake_kubelet.paths, claims, 4, interval_s=0.05)
        try:
            await plugin.make_seats()
            await plugin.make_seats()  # again (a restart of the agent): the same seats
            with Client(daemon.socket) as admin:
                allocs = admin.allocations().allocations
            assert sorted(a.task_id for a in allocs) == [f"k8s-seat-{g}-{n}" for g in (0, 1) for n in range(4)]
            assert {a.share for a in allocs} == {0.25}
            await plugin.start()
            endpoint = await fake_kubelet.wait_for_devices(RESOURCE, 8)
            assert "gpu-1-seat-3" in endpoint.healthy

            answer = await fake_kubelet.allocate(RESOURCE, ["gpu-1-seat-2"])
            (container,) = answer.container_responses
            assert container.envs["GPUD_TASK_ID"] == "k8s-seat-1-2"
            assert container.envs["GPUD_SOCKET"] == "/run/gpud/gpud.sock"
            assert container.envs["NVIDIA_VISIBLE_DEVICES"] == plugin.uuids[1]
            (mount,) = container.mounts
            assert (mount.container_path, mount.host_path) == ("/run/gpud", str(claims / "seat-1-2"))
            with Client(str(claims / "seat-1-2" / "gpud.sock")) as c:  # a container of that seat
                assert c.call(p.Attach(id=0, gpu=1)).core_limit == 25
            with pytest.raises(grpc.aio.AioRpcError, match="a container takes one seat"):
                await fake_kubelet.allocate(RESOURCE, ["gpu-0-seat-0", "gpu-0-seat-1"])

            watch = asyncio.create_task(plugin.watch_gpus())
            await gpud.drain(0)  # a drained GPU's seats take no new container
            await fake_kubelet.wait_for(lambda kl: len(kl.devices.endpoints[RESOURCE].unhealthy) == 4 or None)
            await gpud.drain(0, on=False)

            keep = asyncio.create_task(plugin.keep_registered(poll_s=0.05))
            await fake_kubelet.restart()  # its sockets removed, kubelet.sock made anew: registered again
            await fake_kubelet.wait_for_devices(RESOURCE, 8)
            for task in (watch, keep):
                task.cancel()
            await asyncio.gather(watch, keep, return_exceptions=True)
        finally:
            await plugin.close()
            await gpud.close()

    try:
        asyncio.run(body())
    finally:
        shutil.rmtree(claims, ignore_errors=True)


def test_a_seat_taken_back_has_its_pod_evicted_and_is_made_again_once_its_gpu_is_back(
    daemon_factory: Any, fake_kubelet: KubeletThread, apiserver: ThreadedFakeApiServer, tmp_path: Path
) -> None:
    config = tmp_path / "gpud.toml"
    config.write_text("preemption_grace_s = 1\npreemption_min_runtime_s = 0\nreap_interval_s = 0\n")
    daemon = daemon_factory("--simulate", "2x16GiB", "--config", str(config))
    claims = Path(tempfile.mkdtemp(prefix="seats-", dir="/tmp"))
    apiserver.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "trainer", "namespace": "team-a"},
            "spec": {"nodeName": "node-a", "containers": [{"name": "main", "image": "trainer:1"}]},
            "status": {"phase": "Running"},
        }
    )
    pb = k.podresources.pb
    held = pb.ContainerDevices(resource_name=RESOURCE, device_ids=["gpu-0-seat-1"])
    pod = pb.PodResources(
        name="trainer", namespace="team-a", containers=[pb.ContainerResources(name="main", devices=[held])]
    )

    async def body() -> None:
        gpud = await AsyncClient.connect(daemon.socket, name="gpud-k8s")
        kube = kube_api.Kube(await kube_api.connect(host=apiserver.url))
        plugin = SeatPlugin(gpud, fake_kubelet.paths, claims, 2, interval_s=0.05, kube=kube)
        await gpud.add_allocation_listener(plugin.push)
        await fake_kubelet.set_pods([pod])
        watch: asyncio.Task[None] | None = None
        try:
            await plugin.make_seats()
            assert await plugin.holders() == {"k8s-seat-0-1": ("team-a", "trainer")}
            watch = asyncio.create_task(plugin.watch_gpus())
            await gpud.drain(0)  # its seats taken back: the pod on seat 1 is evicted at the grace's end
            await apiserver.wait_for(lambda: (apiserver.get("pods", "team-a", "trainer") or {}).get("metadata", {}).get(
                "deletionTimestamp") or apiserver.get("pods", "team-a", "trainer") is None)  # fmt: skip
            with Client(daemon.socket) as admin:
                assert [a.task_id for a in admin.allocations().allocations if a.gpus == [0]] == []
            await gpud.drain(0, on=False)  # back in service: its seats are made again

            async def all_seats() -> bool:
                return len((await gpud.allocations()).allocations) == 4

            await eventually_async(all_seats, "the seats made again", timeout=30)
        finally:
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
            await plugin.close()
            await kube.close()
            await gpud.close()

    try:
        asyncio.run(body())
    finally:
        shutil.rmtree(claims, ignore_errors=True)
