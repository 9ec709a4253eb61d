"""This node's ResourceSlice kept true to gpud's GPUs: published at start, again whenever what it says
changes (a GPU drained or put back, found unhealthy or well again), each time with the pool's
generation one higher, so the scheduler takes the newest. gpud is asked its STATUS every
``interval_s``; the slice is written only when it would differ."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import structlog

from gpud_client import protocol as p
from gpud_k8s.claims import DRIVER
from gpud_k8s.slices import Gpu, resource_slice, slice_name

log = structlog.get_logger(__name__)


class SliceApi(Protocol):
    async def get_slice(self, name: str) -> dict[str, Any] | None: ...
    async def put_slice(self, obj: dict[str, Any]) -> None: ...
    async def delete_slices(self, node: str, keep: str | None = None) -> None: ...


class Gpud(Protocol):
    async def call(self, msg: Any, timeout: float | None = None) -> Any: ...


class SimulatedGpus(Exception):
    pass


def gpus_of(status: p.StatusReply, *, allow_simulated: bool) -> list[Gpu]:
    """gpud's GPUs as the slice shows them; simulated ones only when allowed (a test, a demo), never by
    mistake on a real node whose NVML failed."""
    if not allow_simulated and any(g.simulated for g in status.gpus):
        raise SimulatedGpus(
            "gpud runs on simulated GPUs (no NVIDIA driver found): nothing is published "
            "(--allow-simulated publishes them, for tests and demos)"
        )
    return [
        Gpu(g.index, g.uuid, g.name, g.memory_total_bytes, g.pci_bus_id, healthy=g.healthy, draining=g.draining)
        for g in status.gpus
    ]


class Publisher:
    def __init__(
        self,
        kube: SliceApi,
        gpud: Gpud,
        node: str,
        *,
        shared: bool,
        node_uid: str | None = None,
        allow_simulated: bool = False,
        interval_s: float = 5.0,
        driver: str = DRIVER,
    ) -> None:
        self.kube = kube
        self.gpud = gpud
        self.node = node
        self.shared = shared
        self.node_uid = node_uid
        self.allow_simulated = allow_simulated
        self.interval_s = interval_s
        self.driver = driver
        self.generation = 0
        self.published: list[Gpu] | None = None
        self.poke = asyncio.Event()  # publish now (a drain was asked for)

    async def start(self) -> None:
        """The generation goes on from the slice an earlier agent published; other slices of this node
        and driver (another name) are removed."""
        name = slice_name(self.node, self.driver)
        current = await self.kube.get_slice(name)
        if current is not None:
            self.generation = int(((current.get("spec") or {}).get("pool") or {}).get("generation") or 0)
        await self.kube.delete_slices(self.node, keep=name)

    async def publish_once(self) -> bool:
        """Publish if what the slice would say changed; whether it did."""
        status: p.StatusReply = await self.gpud.call(p.Status(id=0))
        gpus = gpus_of(status, allow_simulated=self.allow_simulated)
        if gpus == self.published:
            return False
        self.generation += 1
        obj = resource_slice(
            self.node, gpus, self.generation, shared=self.shared, node_uid=self.node_uid, driver=self.driver
        )
        await self.kube.put_slice(obj)
        self.published = gpus
        log.info(
            "slice_published",
            node=self.node,
            generation=self.generation,
            gpus=len(gpus),
            shared=self.shared,
            tainted=[g.index for g in gpus if g.draining or not g.healthy],
        )
        return True

    async def run(self) -> None:
        while True:
            try:
                await self.publish_once()
            except SimulatedGpus as exc:
                log.error("slice_not_published", reason=str(exc))
            except Exception as exc:  # gpud or the API server away: tried again at the next turn
                log.warning("slice_publish_failed", error=str(exc))
            self.poke.clear()
            try:
                await asyncio.wait_for(self.poke.wait(), self.interval_s)
            except TimeoutError:
                pass
