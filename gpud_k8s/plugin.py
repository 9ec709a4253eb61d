"""gpud's DRA kubelet plugin: registration with the kubelet, and the DRA service over ``Driver``.

It serves ``pluginregistration.Registration`` on ``plugins_registry/gpu.gpud.io-reg.sock`` (the
kubelet's plugin watcher finds it there: ``GetInfo`` answers type ``DRAPlugin``, the driver name, the
DRA endpoint and the services ``v1.DRAPlugin``, ``v1beta1.DRAPlugin``, v1 first) and
``DRAPlugin`` of both versions on ``plugins/gpu.gpud.io/dra.sock``. Each claim of a request is
prepared or unprepared on its own, concurrently; a claim that fails says why in its ``error`` and
does not fail the others (the kubelet retries it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import grpc
import structlog

from gpud_k8s import kubelet_api as k
from gpud_k8s.claims import DRIVER
from gpud_k8s.driver import Driver, PrepareFailed

log = structlog.get_logger(__name__)


_RegistrationServicer: Any = k.registration.rpc.RegistrationServicer  # (gRPC's classes are untyped)


class Registration(_RegistrationServicer):  # type: ignore[misc]
    def __init__(self, name: str, endpoint: str) -> None:
        self.name = name
        self.endpoint = endpoint
        self.registered = asyncio.Event()
        self.error = ""

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return k.registration.pb.PluginInfo(
            type=k.DRA_PLUGIN, name=self.name, endpoint=self.endpoint, supported_versions=list(k.DRA_SERVICES)
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        if request.plugin_registered:
            log.info("kubelet_registered", driver=self.name, endpoint=self.endpoint)
            self.error = ""
            self.registered.set()
        else:
            log.error("kubelet_registration_failed", driver=self.name, error=request.error)
            self.error = request.error
        return k.registration.pb.RegistrationStatusResponse()


def dra_servicer(api: Any, driver: Driver) -> Any:
    """The ``DRAPlugin`` service of one API version (v1 and v1beta1 have the same messages)."""

    class DRA(api.rpc.DRAPluginServicer):  # type: ignore[misc]
        async def NodePrepareResources(self, request: Any, context: Any) -> Any:
            results = await asyncio.gather(*(_prepare(api, driver, c) for c in request.claims))
            return api.pb.NodePrepareResourcesResponse(claims={c.uid: r for c, r in zip(request.claims, results)})

        async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
            results = await asyncio.gather(*(_unprepare(api, driver, c) for c in request.claims))
            return api.pb.NodeUnprepareResourcesResponse(claims={c.uid: r for c, r in zip(request.claims, results)})

    return DRA()


async def _prepare(api: Any, driver: Driver, claim: Any) -> Any:
    try:
        devices = await driver.prepare(claim.namespace, claim.uid, claim.name)
    except PrepareFailed as exc:
        log.warning("claim_prepare_failed", claim=f"{claim.namespace}/{claim.name}", uid=claim.uid, error=str(exc))
        return api.pb.NodePrepareResourceResponse(error=str(exc))
    except Exception as exc:  # a fault of ours: the kubelet retries; logged with its traceback
        log.exception("claim_prepare_fault", claim=f"{claim.namespace}/{claim.name}", uid=claim.uid)
        return api.pb.NodePrepareResourceResponse(error=f"gpud-k8s failed to prepare it: {exc}")
    out = []
    for d in devices:
        device = api.pb.Device(
            request_names=[d.request], pool_name=d.pool, device_name=d.device, cdi_device_ids=list(d.cdi_ids)
        )
        if d.share_id and "share_id" in api.pb.Device.DESCRIPTOR.fields_by_name:  # (v1 has it, v1beta1 not)
            device.share_id = d.share_id
        out.append(device)
    return api.pb.NodePrepareResourceResponse(devices=out)


async def _unprepare(api: Any, driver: Driver, claim: Any) -> Any:
    try:
        await driver.unprepare(claim.namespace, claim.uid, claim.name)
    except Exception as exc:
        log.exception("claim_unprepare_fault", claim=f"{claim.namespace}/{claim.name}", uid=claim.uid)
        return api.pb.NodeUnprepareResourceResponse(error=f"gpud-k8s failed to unprepare it: {exc}")
    return api.pb.NodeUnprepareResourceResponse()


class KubeletPlugin:
    """The two gRPC servers, on their sockets; ``start`` and ``stop``."""

    def __init__(self, driver: Driver, paths: k.KubeletPaths, name: str = DRIVER) -> None:
        self.driver = driver
        self.name = name
        self.dra_socket = paths.dra_socket(name)
        self.registration_socket = paths.registration_socket(name)
        self.registration = Registration(name, str(self.dra_socket))
        self._servers: list[Any] = []

    async def start(self) -> None:
        dra = grpc.aio.server()
        for api in (k.dra_v1, k.dra_v1beta1):
            api.rpc.add_DRAPluginServicer_to_server(dra_servicer(api, self.driver), dra)
        reg = grpc.aio.server()
        k.registration.rpc.add_RegistrationServicer_to_server(self.registration, reg)
        self.dra_socket.parent.mkdir(parents=True, exist_ok=True)
        self.registration_socket.parent.mkdir(parents=True, exist_ok=True)
        for server, path in ((dra, self.dra_socket), (reg, self.registration_socket)):
            _remove_stale(path)
            server.add_insecure_port(k.unix_target(path))
            await server.start()
            self._servers.append(server)
        # Registration last: the kubelet dials the DRA endpoint as soon as it registers the plugin.
        log.info(
            "kubelet_plugin_serving",
            driver=self.name,
            dra=str(self.dra_socket),
            registration=str(self.registration_socket),
        )

    async def stop(self, grace_s: float = 5.0) -> None:
        for server in reversed(self._servers):
            await server.stop(grace_s)
        self._servers.clear()
        for path in (self.registration_socket, self.dra_socket):
            _remove_stale(path)


def _remove_stale(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
