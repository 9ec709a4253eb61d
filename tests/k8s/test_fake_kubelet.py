"""The fake kubelet (fake_kubelet.py) checked against toy plugins defined here: a DRA kubelet plugin (a
registration server and a DRA server answering fixed devices) and a device plugin (registering and
streaming two devices), over real gRPC on real Unix sockets.

Each test runs its plugins in an asyncio loop of its own (``asyncio.run``); the kubelet runs in its own
thread and loop (the ``fake_kubelet`` fixture). Waits are on state, through ``Changes``, never on time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpud_k8s import kubelet_api as k

from .fake_kubelet import (
    Changes,
    Claim,
    DeviceManagerError,
    DRAError,
    KubeletThread,
    Notification,
    go_quote,
    is_extended_resource_name,
)

DRIVER = "gpu.gpud.io"
RESOURCE = "gpud.io/gpu"
TIMEOUT = 30.0
V1, V1BETA1 = k.DRA_V1_SERVICE, k.DRA_V1BETA1_SERVICE


def run(body: Coroutine[Any, Any, None], timeout: float = 120.0) -> None:
    asyncio.run(asyncio.wait_for(body, timeout))


class ToyDRAPlugin:
    """A minimal DRA kubelet plugin: ``Registration`` on ``plugins_registry/<driver>-reg.sock``, and
    ``DRAPlugin`` (v1 and v1beta1 both, whatever it advertises, to see which one the kubelet calls) on
    ``plugins/<driver>/dra.sock``. Every claim gets the device gpu-0, except a claim named ``broken``
    (an error), ``forgotten`` (left out of the answer) and ``shared`` (a share ID, in v1)."""

    def __init__(
        self,
        paths: k.KubeletPaths,
        driver: str = DRIVER,
        *,
        versions: Sequence[str] = (V1, V1BETA1),
        plugin_type: str = k.DRA_PLUGIN,
        registration_socket: Path | None = None,
        endpoint: Path | None = None,
    ) -> None:
        self.driver = driver
        self.versions = list(versions)
        self.plugin_type = plugin_type
        self.registration_socket = registration_socket or paths.registration_socket(driver)
        self.endpoint = endpoint or paths.dra_socket(driver)
        self.statuses: list[tuple[bool, str]] = []  # NotifyRegistrationStatus, as received
        self.calls: list[tuple[str, str, list[str]]] = []  # (DRA service, method, claim UIDs)
        self.changes = Changes()
        self._servers: list[Any] = []

    async def start(self) -> ToyDRAPlugin:
        plugin = self

        class Registration(k.registration.rpc.RegistrationServicer):  # type: ignore[misc,name-defined]
            async def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
                return k.registration.pb.PluginInfo(
                    type=plugin.plugin_type,
                    name=plugin.driver,
                    endpoint=str(plugin.endpoint),
                    supported_versions=plugin.versions,
                )

            async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
                plugin.statuses.append((request.plugin_registered, request.error))
                plugin.changes.changed()
                return k.registration.pb.RegistrationStatusResponse()

        if not self.endpoint.exists():
            self.endpoint.parent.mkdir(parents=True, exist_ok=True)
            dra = grpc.aio.server()
            k.dra_v1.rpc.add_DRAPluginServicer_to_server(self._dra_servicer(V1), dra)
            k.dra_v1beta1.rpc.add_DRAPluginServicer_to_server(self._dra_servicer(V1BETA1), dra)
            dra.add_insecure_port(k.unix_target(self.endpoint))
            await dra.start()
            self._servers.append((dra, self.endpoint))
        registration = grpc.aio.server()
        k.registration.rpc.add_RegistrationServicer_to_server(Registration(), registration)
        registration.add_insecure_port(k.unix_target(self.registration_socket))
        await registration.start()
        self._servers.append((registration, self.registration_socket))
        return self

    def _dra_servicer(self, service: str) -> Any:
        plugin, api = self, k.DRA_SERVICE_API[service]

        class DRA(api.rpc.DRAPluginServicer):  # type: ignore[misc,name-defined]
            async def NodePrepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
                plugin.calls.append((service, "NodePrepareResources", [c.uid for c in request.claims]))
                answers = {}
                for claim in request.claims:
                    if claim.name == "forgotten":
                        continue
                    if claim.name == "broken":
                        answers[claim.uid] = api.pb.NodePrepareResourceResponse(error="gpu-0 is not available")
                        continue
                    device = api.pb.Device(
                        request_names=["gpu"],
                        pool_name="node-a",
                        device_name="gpu-0",
                        cdi_device_ids=[f"{plugin.driver}/gpu=gpu-0"],
                    )
                    if claim.name == "shared" and service == V1:
                        device.share_id = "share-1"
                    answers[claim.uid] = api.pb.NodePrepareResourceResponse(devices=[device])
                return api.pb.NodePrepareResourcesResponse(claims=answers)

            async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
                plugin.calls.append((service, "NodeUnprepareResources", [c.uid for c in request.claims]))
                answers = {c.uid: api.pb.NodeUnprepareResourceResponse() for c in request.claims}
                return api.pb.NodeUnprepareResourcesResponse(claims=answers)

        return DRA()

    async def wait_status(self, count: int = 1) -> tuple[bool, str]:
        """The ``count``-th NotifyRegistrationStatus received (waiting for it)."""
        await self.changes.wait_for(lambda: len(self.statuses) >= count, TIMEOUT, f"registration status {count}")
        return self.statuses[count - 1]

    async def stop(self) -> None:
        """Stop serving and remove the sockets, as a plugin that exits does."""
        for server, socket in reversed(self._servers):
            await server.stop(None)
            socket.unlink(missing_ok=True)
        self._servers.clear()


class ToyDevicePlugin:
    """A minimal device plugin: ``DevicePlugin`` on ``device-plugins/<socket>``, registered with the
    kubelet; ListAndWatch streams its devices (all healthy at first) and again at every change. Like
    real device plugins it watches its socket: when the kubelet removes it (a kubelet start) it
    serves again and registers again."""

    def __init__(
        self,
        paths: k.KubeletPaths,
        resource: str = RESOURCE,
        *,
        socket_name: str = "gpud-gpu.sock",
        devices: Sequence[str] = ("gpu-0", "gpu-1"),
    ) -> None:
        self.paths = paths
        self.resource = resource
        self.socket_name = socket_name
        self.socket = paths.device_plugins / socket_name
        self.health = dict.fromkeys(devices, k.HEALTHY)
        self.registrations = 0
        self.allocations: list[list[str]] = []
        self.changes = Changes()
        self._server: Any = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> ToyDevicePlugin:
        await self._serve()
        await self.register()
        self._watch = asyncio.create_task(self._watch_socket())
        return self

    async def _serve(self) -> None:
        plugin = self
        pb = k.deviceplugin.pb

        class DevicePlugin(k.deviceplugin.rpc.DevicePluginServicer):  # type: ignore[misc,name-defined]
            async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:  # noqa: N802
                return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

            async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
                while True:
                    devices = [pb.Device(ID=d, health=h) for d, h in plugin.health.items()]
                    sent = dict(plugin.health)
                    yield pb.ListAndWatchResponse(devices=devices)
                    await plugin.changes.wait_for(lambda: plugin.health != sent, 3600.0)  # noqa: B023

            async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:  # noqa: N802
                answers = []
                for r in request.container_requests:
                    chosen = list(r.must_include_deviceIDs)
                    chosen += [d for d in sorted(r.available_deviceIDs) if d not in chosen]
                    answers.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen[: r.allocation_size]))
                return pb.PreferredAllocationResponse(container_responses=answers)

            async def Allocate(self, request: Any, context: Any) -> Any:  # noqa: N802
                answers = []
                for r in request.container_requests:
                    ids = list(r.devices_ids)
                    plugin.allocations.append(ids)
                    answers.append(
                        pb.ContainerAllocateResponse(
                            envs={"GPUD_DEVICES": ",".join(ids)},
                            mounts=[pb.Mount(container_path="/opt/gpud", host_path="/opt/gpud", read_only=True)],
                            devices=[
                                pb.DeviceSpec(container_path="/dev/gpud", host_path="/dev/gpud", permissions="rw")
                            ],
                            annotations={"gpud.io/devices": ",".join(ids)},
                            cdi_devices=[pb.CDIDevice(name=f"{plugin.resource}={d}") for d in ids],
                        )
                    )
                return pb.AllocateResponse(container_responses=answers)

        self._server = grpc.aio.server()
        k.deviceplugin.rpc.add_DevicePluginServicer_to_server(DevicePlugin(), self._server)
        self._server.add_insecure_port(k.unix_target(self.socket))
        await self._server.start()

    async def register(self, *, version: str = k.DEVICE_PLUGIN_VERSION, resource: str | None = None) -> None:
        pb = k.deviceplugin.pb
        request = pb.RegisterRequest(
            version=version,
            endpoint=self.socket_name,
            resource_name=resource or self.resource,
            options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        async with grpc.aio.insecure_channel(k.unix_target(self.paths.kubelet_socket)) as channel:
            await k.deviceplugin.rpc.RegistrationStub(channel).Register(request, wait_for_ready=True, timeout=TIMEOUT)
        self.registrations += 1
        self.changes.changed()

    async def _watch_socket(self) -> None:
        # Device plugins watch device-plugins/ (fsnotify); this one looks at its socket every 50 ms.
        while True:
            await asyncio.sleep(0.05)
            if not self.socket.exists():
                await self._server.stop(None)
                await self._serve()
                await self.register()

    def set_health(self, device: str, health: str) -> None:
        self.health[device] = health
        self.changes.changed()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._server is not None:
            await self._server.stop(None)
        self.socket.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def started(*plugins: ToyDRAPlugin | ToyDevicePlugin) -> AsyncIterator[None]:
    try:
        for plugin in plugins:
            await plugin.start()
        yield
    finally:
        for plugin in plugins:
            await plugin.stop()


@pytest.mark.parametrize(
    ("versions", "chosen"),
    [
        ([V1, V1BETA1], V1),  # what the Kubernetes helper advertises: v1 wins
        ([V1BETA1], V1BETA1),  # an older plugin
        (["v2.DRAPlugin", V1BETA1, V1], V1BETA1),  # the first the kubelet knows, in the plugin's order
    ],
)
def test_dra_registration_chooses_the_service(fake_kubelet: KubeletThread, versions: list[str], chosen: str) -> None:
    async def body() -> None:
        toy = ToyDRAPlugin(fake_kubelet.paths, versions=versions)
        async with started(toy):
            assert await toy.wait_status() == (True, "")
            plugin = await fake_kubelet.wait_for_dra_driver(DRIVER)
            assert (plugin.driver, plugin.endpoint, plugin.chosen_service) == (DRIVER, str(toy.endpoint), chosen)
            outcome = await fake_kubelet.prepare(DRIVER, [Claim("default", "uid-1", "claim-1")])
            assert outcome.ok and outcome.service == chosen
            assert toy.calls == [(chosen, "NodePrepareResources", ["uid-1"])]
            notifications = fake_kubelet.read(lambda kl: list(kl.notifications))
            assert notifications == [Notification(toy.registration_socket, True, "")]

    run(body())


@pytest.mark.parametrize(
    ("plugin_type", "versions", "error"),
    [
        (
            k.DRA_PLUGIN,
            ["v2.DRAPlugin"],
            "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA driver "
            "plugin gpu.gpud.io at endpoint {endpoint}: none of services supported by the plugin "
            '(["v2.DRAPlugin"]) are supported by the kubelet (["v1.DRAPlugin" "v1beta1.DRAPlugin"])',
        ),
        (
            k.DRA_PLUGIN,
            [],
            "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA driver "
            "plugin gpu.gpud.io at endpoint {endpoint}: empty list of supported gRPC services (aka supported versions)",
        ),
        (
            k.CSI_PLUGIN,
            [V1],
            "RegisterPlugin error -- no handler registered for plugin type: CSIPlugin at socket {socket}",
        ),
    ],
    ids=["unknown-version", "no-version", "no-handler"],
)
def test_bad_registration_is_refused(
    fake_kubelet: KubeletThread, plugin_type: str, versions: list[str], error: str
) -> None:
    async def body() -> None:
        toy = ToyDRAPlugin(fake_kubelet.paths, versions=versions, plugin_type=plugin_type)
        expected = error.format(endpoint=toy.endpoint, socket=toy.registration_socket)
        async with started(toy):
            assert await toy.wait_status() == (False, expected)
            assert await toy.wait_status(2) == (False, expected)  # tried again, after a backoff
            assert fake_kubelet.read(lambda kl: kl.dra_plugins(DRIVER)) == []
            with pytest.raises(DRAError, match="DRA driver gpu.gpud.io is not registered"):
                await fake_kubelet.prepare(DRIVER, [Claim("default", "uid-1", "claim-1")])

    run(body())


def test_second_plugin_on_the_same_endpoint_is_refused(fake_kubelet: KubeletThread) -> None:
    async def body() -> None:
        first = ToyDRAPlugin(fake_kubelet.paths)
        second = ToyDRAPlugin(fake_kubelet.paths, registration_socket=fake_kubelet.paths.plugins_registry / "x.sock")
        async with started(first):
            assert await first.wait_status() == (True, "")
            async with started(second):
                expected = (
                    "RegisterPlugin error -- plugin registration failed with err: "
                    f"endpoint {first.endpoint} already registered for DRA driver plugin {DRIVER}"
                )
                assert await second.wait_status() == (False, expected)
                assert len(fake_kubelet.read(lambda kl: kl.dra_plugins(DRIVER))) == 1

    run(body())


def test_prepare_and_unprepare(fake_kubelet: KubeletThread) -> None:
    async def body() -> None:
        toy = ToyDRAPlugin(fake_kubelet.paths)
        async with started(toy):
            await fake_kubelet.wait_for_dra_driver(DRIVER)
            claims = [Claim("default", "uid-1", "claim-1"), Claim("gpus", "uid-2", "shared")]
            outcome = await fake_kubelet.prepare(DRIVER, claims)
            assert outcome.error is None and sorted(outcome.results) == ["uid-1", "uid-2"]
            (device,) = outcome.results["uid-1"].devices
            assert (device.request_names, device.pool_name, device.device_name, device.cdi_device_ids) == (
                ("gpu",),
                "node-a",
                "gpu-0",
                ("gpu.gpud.io/gpu=gpu-0",),
            )
            assert device.share_id is None and outcome.results["uid-2"].devices[0].share_id == "share-1"

            outcome = await fake_kubelet.prepare(DRIVER, [claims[0], Claim("default", "uid-3", "broken")])
            assert outcome.results["uid-3"].error == "gpu-0 is not available"
            assert outcome.error == "NodePrepareResources failed for ResourceClaim broken: gpu-0 is not available"
            outcome = await fake_kubelet.prepare(DRIVER, [claims[0], Claim("default", "uid-4", "forgotten")])
            assert outcome.error == "NodePrepareResources skipped 1 ResourceClaims"

            outcome = await fake_kubelet.unprepare(DRIVER, claims)
            assert outcome.ok and sorted(outcome.results) == ["uid-1", "uid-2"]
            assert toy.calls[-1] == (V1, "NodeUnprepareResources", ["uid-1", "uid-2"])
            with pytest.raises(DRAError, match="DRA driver other.gpud.io is not registered"):
                await fake_kubelet.unprepare("other.gpud.io", claims)

    run(body())


def test_dra_plugin_is_deregistered_when_its_socket_goes(fake_kubelet: KubeletThread) -> None:
    async def body() -> None:
        toy = ToyDRAPlugin(fake_kubelet.paths)
        async with started(toy):
            await toy.wait_status()
            await fake_kubelet.wait_for_dra_driver(DRIVER)
        await fake_kubelet.wait_for(lambda kl: not kl.dra_plugins(DRIVER), what="deregistration")
        with pytest.raises(DRAError, match="is not registered"):
            await fake_kubelet.prepare(DRIVER, [Claim("default", "uid-1", "claim-1")])
        async with started(toy):  # back again: registered again
            assert await toy.wait_status(2) == (True, "")
            assert (await fake_kubelet.prepare(DRIVER, [Claim("default", "uid-1", "claim-1")])).ok

    run(body())


def test_device_plugin(fake_kubelet: KubeletThread) -> None:
    async def body() -> None:
        toy = ToyDevicePlugin(fake_kubelet.paths)
        async with started(toy):
            endpoint = await fake_kubelet.wait_for_devices(RESOURCE, 2)
            assert endpoint.healthy == {"gpu-0", "gpu-1"} and endpoint.socket == toy.socket
            assert endpoint.options.get_preferred_allocation_available

            response = await fake_kubelet.allocate(RESOURCE, ["gpu-1"])
            (container,) = response.container_responses
            assert dict(container.envs) == {"GPUD_DEVICES": "gpu-1"}
            assert dict(container.annotations) == {"gpud.io/devices": "gpu-1"}
            assert [(m.container_path, m.host_path, m.read_only) for m in container.mounts] == [
                ("/opt/gpud", "/opt/gpud", True)
            ]
            assert [(d.container_path, d.permissions) for d in container.devices] == [("/dev/gpud", "rw")]
            assert [d.name for d in container.cdi_devices] == ["gpud.io/gpu=gpu-1"]
            assert toy.allocations == [["gpu-1"]]

            options = await fake_kubelet.acall(lambda kl: kl.get_device_plugin_options(RESOURCE))
            assert options.get_preferred_allocation_available and not options.pre_start_required
            preferred = await fake_kubelet.acall(
                lambda kl: kl.device_manager().get_preferred_allocation(RESOURCE, ["gpu-0", "gpu-1"], ["gpu-1"], 1)
            )
            assert preferred == ["gpu-1"]

            toy.set_health("gpu-1", k.UNHEALTHY)
            endpoint = await fake_kubelet.wait_for_devices(RESOURCE, 1)
            assert endpoint.unhealthy == {"gpu-1"}
            with pytest.raises(DeviceManagerError, match="not healthy"):
                await fake_kubelet.allocate(RESOURCE, ["gpu-1"])
            with pytest.raises(DeviceManagerError, match="cannot allocate unregistered device other.io/x"):
                await fake_kubelet.allocate("other.io/x", ["x"])
        # The plugin went away: its devices turn unhealthy, its endpoint stops.
        await fake_kubelet.wait_for(lambda kl: kl.device_manager().endpoints[RESOURCE].stopped, what="a stop")
        assert fake_kubelet.read(lambda kl: kl.device_manager().endpoints[RESOURCE].healthy) == set()

    run(body())


@pytest.mark.parametrize(
    ("version", "resource", "error"),
    [
        (
            "v1alpha1",
            RESOURCE,
            'requested API version "v1alpha1" is not supported by kubelet. Supported version is ["v1beta1"]',
        ),
        (k.DEVICE_PLUGIN_VERSION, "gpu", 'the ResourceName "gpu" is invalid'),
        (k.DEVICE_PLUGIN_VERSION, "kubernetes.io/gpu", 'the ResourceName "kubernetes.io/gpu" is invalid'),
        (k.DEVICE_PLUGIN_VERSION, "gpud.io/GPU_", 'the ResourceName "gpud.io/GPU_" is invalid'),
    ],
)
def test_device_plugin_registration_is_checked(
    fake_kubelet: KubeletThread, version: str, resource: str, error: str
) -> None:
    async def body() -> None:
        toy = ToyDevicePlugin(fake_kubelet.paths)
        await toy._serve()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await toy.register(version=version, resource=resource)
            assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNKNOWN, error)
            assert fake_kubelet.read(lambda kl: kl.device_manager().endpoints) == {}
        finally:
            await toy.stop()

    run(body())


@pytest.mark.parametrize(
    ("name", "versions", "error"),
    [
        (RESOURCE, [k.DEVICE_PLUGIN_VERSION], ""),
        (
            RESOURCE,
            ["v1alpha1"],
            'manager version, v1beta1, is not among plugin supported versions ["v1alpha1"]',
        ),
        ("gpu", [k.DEVICE_PLUGIN_VERSION], 'invalid name of device plugin socket: the ResourceName "gpu" is invalid'),
    ],
    ids=["ok", "bad-version", "bad-name"],
)
def test_device_plugin_through_the_plugin_watcher(
    fake_kubelet: KubeletThread, name: str, versions: list[str], error: str
) -> None:
    """The deprecated way: a DevicePlugin registration socket in plugins_registry/."""

    async def body() -> None:
        devices = ToyDevicePlugin(fake_kubelet.paths)
        await devices._serve()
        registrar = ToyDRAPlugin(
            fake_kubelet.paths,
            name,
            versions=versions,
            plugin_type=k.DEVICE_PLUGIN,
            registration_socket=fake_kubelet.paths.plugins_registry / "gpud-gpu-reg.sock",
            endpoint=devices.socket,
        )
        try:
            async with started(registrar):
                if not error:
                    assert await registrar.wait_status() == (True, "")
                    assert (await fake_kubelet.wait_for_devices(RESOURCE, 2)).socket == devices.socket
                else:
                    message = f"RegisterPlugin error -- plugin validation failed with err: {error}"
                    assert await registrar.wait_status() == (False, message)
            if not error:  # the registration socket gone: the device plugin is disconnected
                await fake_kubelet.wait_for(lambda kl: kl.device_manager().endpoints[RESOURCE].stopped)
        finally:
            await devices.stop()

    run(body())


def test_extended_resource_names() -> None:
    assert is_extended_resource_name("gpud.io/gpu") and is_extended_resource_name("example.com/foo-1.a_b")
    for name in ("gpu", "kubernetes.io/gpu", "requests.gpud.io/gpu", "gpud.io/", "Gpud.io/gpu", "a/b/c", "gpud.io/-x"):
        assert not is_extended_resource_name(name), name
    assert go_quote(["a", "b"]) == '["a" "b"]' and go_quote("a") == '"a"'


def test_kubelet_restart_makes_plugins_register_again(fake_kubelet: KubeletThread) -> None:
    async def body() -> None:
        dra, devices = ToyDRAPlugin(fake_kubelet.paths), ToyDevicePlugin(fake_kubelet.paths)
        async with started(dra, devices):
            assert await dra.wait_status() == (True, "")
            await fake_kubelet.wait_for_dra_driver(DRIVER)
            await fake_kubelet.wait_for_devices(RESOURCE, 2)

            await fake_kubelet.restart()
            assert fake_kubelet.read(lambda kl: kl.starts) == 2
            # The registration socket stays and is found again: GetInfo, NotifyRegistrationStatus again.
            assert dra.registration_socket.exists()
            assert await dra.wait_status(2) == (True, "")
            assert (await fake_kubelet.wait_for_dra_driver(DRIVER)).chosen_service == V1
            assert (await fake_kubelet.prepare(DRIVER, [Claim("default", "uid-1", "claim-1")])).ok
            # The device plugin's socket was removed by the new kubelet: it served and registered again.
            await devices.changes.wait_for(lambda: devices.registrations == 2, TIMEOUT, "a second registration")
            await fake_kubelet.wait_for_devices(RESOURCE, 2)
            assert (await fake_kubelet.allocate(RESOURCE, ["gpu-0"])).container_responses[0].envs["GPUD_DEVICES"] == (
                "gpu-0"
            )

    run(body())


def test_pod_resources(fake_kubelet: KubeletThread) -> None:
    pb = k.podresources.pb
    pod = pb.PodResources(
        name="trainer",
        namespace="ml",
        containers=[
            pb.ContainerResources(
                name="main",
                devices=[pb.ContainerDevices(resource_name=RESOURCE, device_ids=["gpu-0"])],
                dynamic_resources=[
                    pb.DynamicResource(
                        claim_name="gpu-claim",
                        claim_namespace="ml",
                        claim_resources=[
                            pb.ClaimResource(
                                cdi_devices=[pb.CDIDevice(name="gpu.gpud.io/gpu=gpu-1")],
                                driver_name=DRIVER,
                                pool_name="node-a",
                                device_name="gpu-1",
                            )
                        ],
                    )
                ],
            )
        ],
    )
    other = pb.PodResources(name="idle", namespace="default", containers=[pb.ContainerResources(name="c")])

    async def body() -> None:
        await fake_kubelet.set_pods([pod, other])
        async with started(ToyDevicePlugin(fake_kubelet.paths)):
            await fake_kubelet.wait_for_devices(RESOURCE, 2)
            target = k.unix_target(fake_kubelet.paths.pod_resources_socket)
            async with grpc.aio.insecure_channel(target) as channel:
                lister = k.podresources.rpc.PodResourcesListerStub(channel)
                listed = await lister.List(pb.ListPodResourcesRequest(), timeout=TIMEOUT)
                assert list(listed.pod_resources) == [pod, other]
                (claim,) = listed.pod_resources[0].containers[0].dynamic_resources
                assert (claim.claim_name, claim.claim_resources[0].device_name) == ("gpu-claim", "gpu-1")
                got = await lister.Get(
                    pb.GetPodResourcesRequest(pod_name="trainer", pod_namespace="ml"), timeout=TIMEOUT
                )
                assert got.pod_resources == pod
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await lister.Get(pb.GetPodResourcesRequest(pod_name="trainer", pod_namespace="default"))
                assert (missing.value.code(), missing.value.details()) == (
                    grpc.StatusCode.UNKNOWN,
                    "pod trainer in namespace default not found",
                )
                allocatable = await lister.GetAllocatableResources(pb.AllocatableResourcesRequest(), timeout=TIMEOUT)
                assert [(d.resource_name, list(d.device_ids)) for d in allocatable.devices] == [
                    (RESOURCE, ["gpu-0"]),
                    (RESOURCE, ["gpu-1"]),
                ]

    run(body())
