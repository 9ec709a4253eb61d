"""The device-plugin fallback, for clusters without DRA: ``gpud.io/gpu-seat``, N equal seats per GPU.

The device plugin API cannot carry fractions (units of one resource that land on different GPUs
cannot be refused) and is not told which pod it allocates for, so gpud offers seats: each GPU is cut
into ``seats`` equal shares, each made at start as one gpud allocation ``k8s-seat-<gpu>-<n>`` of
``1/seats`` of that GPU with a socket of its own (``<claims dir>/seat-<gpu>-<n>/gpud.sock``).
A container that asks for ``gpud.io/gpu-seat: 1`` gets a seat's socket directory at ``/run/gpud``,
``GPUD_SOCKET``, ``GPUD_TASK_ID`` and the GPU (NVIDIA's CDI device where the node has one, else
``NVIDIA_VISIBLE_DEVICES``); its sessions get the seat's share as their ceiling. One seat per
container: a container asking for more is refused, naming why.

The plugin registers with the kubelet (``v1beta1.Registration/Register`` on
``device-plugins/kubelet.sock``), serves ``DevicePlugin`` on ``device-plugins/gpud-seats.sock``,
streams the seats in ``ListAndWatch`` (a drained or unhealthy GPU's seats ``Unhealthy``), and
registers again whenever the kubelet's socket is made anew (the kubelet removes every plugin socket
when it starts).

Which pod holds a seat the kubelet's pod resources API says (``List``: each container's devices by
resource name and id; ``holders``). When gpud takes a seat back (a drain), the pod that holds it is
evicted through the Eviction API at the end of the grace, as a claim's is (``gpud_k8s.keeping``), and
once its GPU is back in service the seat is made again in gpud.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import structlog

from gpud_client import protocol as p
from gpud_client.errors import ProtocolError
from gpud_k8s import kubelet_api as k
from gpud_k8s.cdi import CONTAINER_DIR, SOCKET_NAME
from gpud_k8s.evictions import Evictor, evict_pods

log = structlog.get_logger(__name__)
RESOURCE = "gpud.io/gpu-seat"
SOCKET = "gpud-seats.sock"
SEAT_PREFIX = "k8s-seat-"


def seat_id(gpu: int, n: int) -> str:
    return f"gpu-{gpu}-seat-{n}"


def seat_task(gpu: int, n: int) -> str:
    return f"{SEAT_PREFIX}{gpu}-{n}"


def parse_seat(device_id: str) -> tuple[int, int] | None:
    parts = device_id.split("-")
    if len(parts) == 4 and parts[0] == "gpu" and parts[2] == "seat" and parts[1].isdigit() and parts[3].isdigit():
        return int(parts[1]), int(parts[3])
    return None


_DevicePluginServicer: Any = k.deviceplugin.rpc.DevicePluginServicer  # (gRPC's classes are untyped)


class SeatPlugin(_DevicePluginServicer):  # type: ignore[misc]
    def __init__(
        self,
        gpud: Any,
        paths: k.KubeletPaths,
        claims_dir: Path,
        seats: int,
        *,
        nvidia: Callable[[str], str | None] = lambda uuid: None,
        interval_s: float = 5.0,
        kube: Evictor | None = None,
    ) -> None:
        if not 1 <= seats <= 64:
            raise ValueError(f"seats per GPU must be within 1..64, not {seats}")
        self.gpud = gpud
        self.paths = paths
        self.claims_dir = claims_dir
        self.seats = seats
        self.nvidia = nvidia
        self.interval_s = interval_s
        self.uuids: dict[int, str] = {}
        self.health: dict[int, bool] = {}  # gpu -> its seats are healthy
        self.changed = asyncio.Event()
        self.kube = kube  # None: no API server to evict through (said when one would be)
        self.evictions: dict[str, asyncio.Task[None]] = {}  # seat task -> its eviction, waiting or under way
        self._channel: Any = None
        self._server: Any = None

    @property
    def socket(self) -> Path:
        return self.paths.device_plugins / SOCKET

    def seat_dir(self, gpu: int, n: int) -> Path:
        return self.claims_dir / f"seat-{gpu}-{n}"

    # --- gpud's side -------------------------------------------------------------

    async def make_seats(self) -> None:
        """Each GPU's seats as gpud allocations, each with its socket (idempotent: the same terms again)."""
        status: p.StatusReply = await self.gpud.call(p.Status(id=0))
        for g in status.gpus:
            self.uuids[g.index] = g.uuid
            self.health[g.index] = g.healthy and not g.draining
            await self._make(g.index, range(self.seats))
        log.info("seats_made", gpus=len(status.gpus), seats=self.seats)

    async def _make(self, g: int, seats: Iterable[int]) -> None:
        """Seats ``seats`` of GPU ``g`` in gpud, each with its socket."""
        for n in seats:
            task = seat_task(g, n)
            share = 1.0 if self.seats == 1 else round(1 / self.seats, 6)
            msg = p.Allocate(id=0, task_id=task, gpus=share, prefer=[g], strategy=p.Strategy.ONLY, notify=True)
            try:
                await self.gpud.call(msg)
            except ProtocolError as exc:
                raise RuntimeError(f"gpud did not make seat {n} of GPU {g} ({task}): {exc}") from None
            d = self.seat_dir(g, n)
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chmod(d, 0o755)
            await self.gpud.call(p.OpenTaskSocket(id=0, task_id=task, path=str(d / SOCKET_NAME)))

    async def watch_gpus(self) -> None:
        """The seats' health follows gpud's GPUs (drained or unhealthy: Unhealthy)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                status: p.StatusReply = await self.gpud.call(p.Status(id=0))
            except Exception as exc:
                log.warning("seats_health_unknown", error=str(exc))
                continue
            health = {g.index: g.healthy and not g.draining for g in status.gpus}
            if health != self.health:
                self.health = health
                self.changed.set()
            try:
                await self.make_missing(health)
            except Exception as exc:  # tried again next round
                log.warning("seats_not_made", error=str(exc))

    async def make_missing(self, health: dict[int, bool]) -> None:
        """The seats gpud took back (a drain), made again once their GPU is in service."""
        listing: p.AllocationsReply = await self.gpud.allocations()
        held = {a.task_id for a in listing.allocations}
        for gpu, ok in sorted(health.items()):
            missing = [n for n in range(self.seats) if seat_task(gpu, n) not in held]
            if ok and missing:
                await self._make(gpu, missing)
                log.info("seats_made_again", gpu=gpu, seats=missing)

    # --- which pods hold seats, and taking them back ------------------------------------

    async def holders(self) -> dict[str, tuple[str, str]]:
        """Seat task -> (namespace, pod) that holds it, as the kubelet's pod resources API says now."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(k.unix_target(self.paths.pod_resources_socket))
        stub = k.podresources.rpc.PodResourcesListerStub(self._channel)
        reply = await stub.List(k.podresources.pb.ListPodResourcesRequest(), timeout=5.0)
        found = {}
        for pod in reply.pod_resources:
            for ctr in pod.containers:
                for dev in ctr.devices:
                    if dev.resource_name != RESOURCE:
                        continue
                    for device_id in dev.device_ids:
                        seat = parse_seat(device_id)
                        if seat is not None:
                            found[seat_task(*seat)] = (pod.namespace, pod.name)
        return found

    def push(self, msg: Any) -> None:
        """gpud's pushes about the seats (the agent's connection holds them): a seat taken back has its pod
        evicted when the grace ends, or at once when the seat is gone; a withdrawn notice cancels it."""
        task = msg.allocation.task_id if isinstance(msg, p.AllocChanged) else getattr(msg, "task_id", "")
        if not task.startswith(SEAT_PREFIX):
            return
        match msg:
            case p.Preempt(grace_s=grace_s) if task not in self.evictions:
                self.evictions[task] = asyncio.ensure_future(self._evict(task, grace_s, "gpud took the seat back"))
            case p.PreemptWithdrawn():
                waiting = self.evictions.pop(task, None)
                if waiting is not None:
                    waiting.cancel()
            case p.AllocRevoked(gone=True) if task not in self.evictions:
                self.evictions[task] = asyncio.ensure_future(self._evict(task, 0, "gpud took the seat back"))

    async def _evict(self, task: str, after_s: float, why: str) -> None:
        try:
            await asyncio.sleep(after_s)
            holder = (await self.holders()).get(task)
            if holder is None:
                return
            if self.kube is None:
                log.warning("seat_not_evicted", seat=task, pod=f"{holder[0]}/{holder[1]}", why="no API server")
                return
            await evict_pods(self.kube, holder[0], [(holder[1], None)], f"seat {task}", why)
        except Exception as exc:
            log.warning("seat_eviction_failed", seat=task, error=str(exc))
        finally:
            self.evictions.pop(task, None)

    # --- the kubelet's side ----------------------------------------------------------

    def devices(self) -> list[Any]:
        return [
            k.deviceplugin.pb.Device(ID=seat_id(g, n), health=k.HEALTHY if ok else k.UNHEALTHY)
            for g, ok in sorted(self.health.items())
            for n in range(self.seats)
        ]

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return k.deviceplugin.pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        while True:
            self.changed.clear()
            yield k.deviceplugin.pb.ListAndWatchResponse(devices=self.devices())
            await self.changed.wait()

    async def Allocate(self, request: Any, context: Any) -> Any:
        responses = []
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            if len(ids) != 1:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{RESOURCE}: a container takes one seat (it asked for {len(ids)}): one seat is one share of one GPU",
                )
            seat = parse_seat(ids[0])
            if seat is None or seat[0] not in self.uuids or not 0 <= seat[1] < self.seats:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{RESOURCE}: {ids[0]!r} is not one of gpud's seats"
                )
            assert seat is not None
            gpu, n = seat
            uuid = self.uuids[gpu]
            envs = {"GPUD_SOCKET": f"{CONTAINER_DIR}/{SOCKET_NAME}", "GPUD_TASK_ID": seat_task(gpu, n)}
            cdi = self.nvidia(uuid)
            if cdi is None:
                envs["NVIDIA_VISIBLE_DEVICES"] = uuid
            responses.append(
                k.deviceplugin.pb.ContainerAllocateResponse(
                    envs=envs,
                    mounts=[
                        k.deviceplugin.pb.Mount(
                            container_path=CONTAINER_DIR, host_path=str(self.seat_dir(gpu, n)), read_only=False
                        )
                    ],
                    cdi_devices=[k.deviceplugin.pb.CDIDevice(name=cdi)] if cdi is not None else [],
                )
            )
        return k.deviceplugin.pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return k.deviceplugin.pb.PreStartContainerResponse()

    # --- serving and registering -------------------------------------------------------

    async def start(self) -> None:
        self.paths.device_plugins.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        self._server = grpc.aio.server()
        k.deviceplugin.rpc.add_DevicePluginServicer_to_server(self, self._server)
        self._server.add_insecure_port(k.unix_target(self.socket))
        await self._server.start()
        await self.register()

    async def register(self) -> None:
        async with grpc.aio.insecure_channel(k.unix_target(self.paths.kubelet_socket)) as channel:
            stub = k.deviceplugin.rpc.RegistrationStub(channel)
            await stub.Register(
                k.deviceplugin.pb.RegisterRequest(
                    version=k.DEVICE_PLUGIN_VERSION,
                    endpoint=SOCKET,
                    resource_name=RESOURCE,
                    options=k.deviceplugin.pb.DevicePluginOptions(),
                ),
                timeout=10,
            )
        log.info("device_plugin_registered", resource=RESOURCE, seats=self.seats, gpus=len(self.uuids))

    async def keep_registered(self, poll_s: float = 1.0) -> None:
        """Register again when the kubelet restarts: its socket is made anew (and ours removed)."""
        seen = _identity(self.paths.kubelet_socket)
        while True:
            await asyncio.sleep(poll_s)
            now = _identity(self.paths.kubelet_socket)
            if now is None or now == seen:
                continue
            try:
                if not self.socket.exists():  # the kubelet removed it at its start: serve anew
                    await self.stop()
                    await self.start()
                else:
                    await self.register()
                seen = now
            except Exception as exc:
                log.warning("device_plugin_register_failed", error=str(exc))

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(1)
            self._server = None

    async def close(self) -> None:
        await self.stop()
        for waiting in self.evictions.values():
            waiting.cancel()
        if self._channel is not None:
            await self._channel.close()


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns
