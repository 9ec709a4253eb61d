"""The device-plugin fallback end to end: a real gpud on simulated GPUs, its seats registered with the fake
kubelet's device manager over real gRPC, allocated to containers, kept registered across a kubelet
restart (gpud_k8s.deviceplugin)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.aio import AsyncClient
from gpud_k8s.deviceplugin import RESOURCE, SeatPlugin

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
            await plugin.stop()
            await gpud.close()

    try:
        asyncio.run(body())
    finally:
        shutil.rmtree(claims, ignore_errors=True)
