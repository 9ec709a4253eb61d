"""A fake kubelet: the parts of the kubelet that gpud-k8s talks to, over real gRPC on real Unix sockets.

No kubelet can run in the tests, so this one stands in for it, written from the kubelet's own source
(kubernetes/kubernetes, the versions the gpud_k8s/proto headers name; the files below). It serves
and calls what the kubelet serves and calls, with the kubelet's rules and error messages, under a
kubelet root directory of the test's (:class:`gpud_k8s.kubelet_api.KubeletPaths`):

Plugin watcher and registration (``pkg/kubelet/pluginmanager``).
    ``pluginwatcher/plugin_watcher.go``: sockets in ``plugins_registry/`` and its subfolders are
    plugins; files that are not sockets, or whose names start with ``.``, are ignored; a socket
    that goes away is a plugin to deregister, a socket created again one to deregister and
    register anew. The kubelet learns of them from inotify (fsnotify); this fake polls the folder
    instead, every ``poll_interval`` (0.1 s), and tells a socket made again by its inode and
    modification time (ext4 hands a new socket the inode just freed; a chmod leaves the
    modification time alone), so a socket removed and made again within one clock tick of the
    file system, same inode, would go unnoticed. The poll also stands for the kubelet's reconciler
    loop (``reconciler/reconciler.go``, every second: deregistrations first, then registrations of
    sockets not registered with their current timestamp). ``operationexecutor/operation_generator.go``: one operation at a time per socket
    (the kubelet's goroutinemap), retried after a failure with exponential backoff (0.5 s doubling
    to 2 min 2 s); dial with 10 s to connect; ``GetInfo`` with 1 s; the handler for
    ``PluginInfo.type``, and when there is none ``NotifyRegistrationStatus(false, "RegisterPlugin
    error -- no handler registered for plugin type: ...")``; an empty endpoint means the
    registration socket itself; the handler validates (on failure ``NotifyRegistrationStatus(false,
    "RegisterPlugin error -- plugin validation failed with err: ...")`` and a retry later), the
    plugin joins the actual state, the handler registers it (on failure ``NotifyRegistrationStatus
    (false, "RegisterPlugin error -- plugin registration failed with err: ...")``, no retry), and
    then ``NotifyRegistrationStatus(true, "")``, each notification with 5 s to answer.

DRA (``pkg/kubelet/cm/dra``).
    ``plugin/dra_plugin_manager.go`` (the ``DRAPlugin`` handler): the supported versions are gRPC
    services; the kubelet takes the first of the plugin's list that it can call (it can call
    ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin``), so a plugin listing ``v1.DRAPlugin`` first gets
    v1 and one listing only ``v1beta1.DRAPlugin`` gets v1beta1; an empty list, or one with neither,
    is refused with the kubelet's messages; several plugins may register for one driver, but not
    twice on one endpoint; the plugin used is the newest connected one, else the newest; a
    deregistered plugin's connection is closed. ``plugin/dra_plugin.go``: each call with the
    plugin's timeout (45 s, ``defaultClientCallTimeout``), on the chosen service's stub.
    ``manager.go`` (``prepareResources``/``unprepareResources``): how a response is judged, as
    :class:`PrepareOutcome` says, with the kubelet's messages ("NodePrepareResources failed for
    ResourceClaim ...", "... skipped N ResourceClaims", "... returned result for unknown claim UID").

Device manager (``pkg/kubelet/cm/devicemanager``).
    ``manager.go``: at start every socket in ``device-plugins/`` is removed (not folders, not the
    checkpoint file) before ``kubelet.sock`` is created, so after a kubelet restart device plugins
    must register again; ``PluginConnected`` asks for ``GetDevicePluginOptions``; each
    ``ListAndWatch`` answer replaces the resource's devices, healthy or not; a disconnected
    plugin's devices all turn unhealthy and its endpoint is stopped; Allocate's checks and its "no
    containers return in allocation response". ``plugin/v1beta1/server.go``: ``Register`` checks the
    version (``v1beta1``) and that the resource name is an extended resource name, then connects
    to ``device-plugins/<endpoint>``; its errors go back as the RPC's (status UNKNOWN, as a Go error
    does) with the kubelet's messages. ``plugin/v1beta1/client.go``: dial with 10 s, then
    ``ListAndWatch`` until the stream ends, then disconnect. ``plugin/v1beta1/handler.go``: device
    plugins may also register through ``plugins_registry/`` (type ``DevicePlugin``), validated the
    same way; the kubelet writes a ``DEPRECATION`` file in ``device-plugins/``.

Pod resources (``pkg/kubelet/apis/podresources``).
    ``PodResourcesLister`` on ``pod-resources/kubelet.sock``: ``List``, ``Get`` (a missing pod is
    "pod NAME in namespace NS not found") and ``GetAllocatableResources`` (the device plugins'
    devices), from the pods the test sets (:meth:`FakeKubelet.set_pods`), as messages.

Restart (:meth:`FakeKubelet.restart`): everything stops as a kubelet process that exits would (no
deregistration calls, connections dropped, ``kubelet.sock`` and ``pod-resources/kubelet.sock``
removed) and starts afresh with no memory: ``device-plugins/`` sockets removed and ``kubelet.sock``
created again, ``plugins_registry/`` sockets left alone and found again, so every plugin registers
again.

Not done: the kubelet's API server side (ResourceSlices and their wiping, pods, node status and
capacity), checkpoints (the DRA manager's claim cache and the device manager's allocation record:
nothing is remembered across a restart, and allocations are not tracked, so the same device may be
allocated twice), choosing devices for a pod (:meth:`FakeKubelet.allocate` takes the device IDs, as
a test names them) and NUMA alignment, the DRA resource health stream, CSI plugins, the pod
resources API's rate limit and feature gates, the device endpoint's 5 minute grace period, and
re-dialing a DRA plugin: the connection is gRPC's own, reconnecting as gRPC does. Device
plugin calls have no timeout, as the kubelet's have none, except PreStartContainer (30 s). One
difference on purpose: when the ListAndWatch stream of a device plugin that was since replaced
(registered again for its resource) ends, the kubelet disconnects whichever plugin holds the
resource by then (``handler.go`` runClient); this fake disconnects only the one whose stream ended.

The kubelet is another process; :class:`KubeletThread` runs a :class:`FakeKubelet` in an event loop
and thread of its own, so a plugin under test keeps its own loop (asyncio or trio) and a plugin that
blocks its loop cannot also stall the kubelet. ``tests/k8s/conftest.py``'s ``fake_kubelet`` fixture
gives one, started on a fresh root.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from gpud_k8s import kubelet_api as k

log = logging.getLogger(__name__)
T = TypeVar("T")

# pluginmanager/operationexecutor/operation_generator.go
DIAL_TIMEOUT_S = 10.0
GET_INFO_TIMEOUT_S = 1.0
NOTIFY_TIMEOUT_S = 5.0
# pkg/util/goroutinemap/exponentialbackoff: initialDurationBeforeRetry, maxDurationBeforeRetry
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 122.0
# cm/dra/plugin: defaultClientCallTimeout
DRA_CALL_TIMEOUT_S = 45.0
# cm/devicemanager: the checkpoint file CleanupPluginDirectory keeps, and the dial timeout
DEVICE_MANAGER_CHECKPOINT = "kubelet_internal_checkpoint"
DEVICE_PLUGIN_DIAL_TIMEOUT_S = 10.0


class KubeletError(Exception):
    """An error the kubelet would report; the message is the kubelet's."""


class PluginError(KubeletError):
    """A plugin handler refused a plugin (validation or registration)."""


class DRAError(KubeletError):
    """The DRA manager cannot call a driver."""


class DeviceManagerError(KubeletError):
    """The device manager refused a registration or an allocation."""


def go_quote(value: str | Iterable[str]) -> str:
    """Go's ``%q`` of a string or a string slice, as the kubelet's messages print them."""
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + " ".join(json.dumps(v) for v in value) + "]"


# k8s.io/apimachinery/pkg/util/validation: IsQualifiedName, IsDNS1123Subdomain
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _is_qualified_name(value: str) -> bool:
    prefix, slash, name = value.rpartition("/")
    if slash:
        if "/" in prefix or not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix):
            return False
    return 0 < len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))


def is_extended_resource_name(name: str) -> bool:
    """pkg/apis/core/v1/helper IsExtendedResourceName: not a native resource (those have no ``/``
    or contain ``kubernetes.io/``), no ``requests.`` prefix, and ``requests.<name>`` a qualified name."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    return _is_qualified_name("requests." + name)


class ClaimLike(Protocol):
    """A ResourceClaim as the DRA API names it (a ``Claim`` message of either version will do)."""

    @property
    def namespace(self) -> str: ...
    @property
    def uid(self) -> str: ...
    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class Claim:
    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class Notification:
    """One ``NotifyRegistrationStatus`` the plugin watcher sent (and the plugin answered)."""

    socket: Path
    plugin_registered: bool
    error: str


@dataclass(frozen=True)
class RegistrationFailure:
    """A registration operation that failed (and, until it succeeds, will be retried)."""

    socket: Path
    error: str


@dataclass
class DRAPlugin:
    """One registered plugin of a DRA driver (dra_plugin.go's DRAPlugin)."""

    driver: str
    endpoint: str
    chosen_service: str
    call_timeout: float
    channel: Any = field(repr=False)

    @property
    def api(self) -> k.KubeletAPI:
        return k.DRA_SERVICE_API[self.chosen_service]

    def connected(self) -> bool:
        return bool(self.channel.get_state(False) == grpc.ChannelConnectivity.READY)


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class ClaimResult:
    """A plugin's answer for one claim: its devices, or its error."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class PrepareOutcome:
    """What a NodePrepareResources or NodeUnprepareResources call came to.

    ``results`` is the plugin's answer per claim UID, as it gave it. ``error`` is the kubelet's
    verdict on the whole (manager.go): a result for a claim not asked about, a claim with an error
    (the first one met), or claims left out; ``None`` when the kubelet would go on with the pod."""

    service: str
    results: dict[str, ClaimResult]
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


class PluginHandler(Protocol):
    """pluginmanager/cache.PluginHandler."""

    def validate(self, name: str, endpoint: str, versions: list[str]) -> None: ...
    async def register(self, name: str, endpoint: str, versions: list[str]) -> None: ...
    async def deregister(self, name: str, endpoint: str) -> None: ...


@dataclass
class _Registered:
    """The plugin watcher's actual state of the world: one registered socket."""

    socket: Path
    stamp: tuple[int, int]
    handler: PluginHandler
    name: str
    endpoint: str


@dataclass
class _Backoff:
    failures: int = 0
    not_before: float = 0.0


class Changes:
    """A way to wait for a state to change, in one event loop: :meth:`changed` wakes every waiter, and
    :meth:`wait_for` checks its predicate again at each change (no polling, no sleeps)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def changed(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], T | None], timeout: float, what: str = "") -> T:
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {what or 'such state'} after {timeout} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), remaining)
        return value


class DRAPluginManager:
    """pkg/kubelet/cm/dra/plugin: the DRAPlugin handler and the store of DRA plugins, by driver."""

    def __init__(self, call_timeout: float, spawn: Callable[[Awaitable[Any]], None], changes: Changes) -> None:
        self.call_timeout = call_timeout
        self.store: dict[str, list[DRAPlugin]] = {}
        self._spawn = spawn
        self._changes = changes

    @staticmethod
    def choose_service(versions: Sequence[str]) -> str:
        """validateSupportedServices: the first service of the plugin's list that the kubelet supports."""
        if not versions:
            raise PluginError("empty list of supported gRPC services (aka supported versions)")
        for service in versions:
            if service in k.DRA_SERVICES:
                return service
        raise PluginError(
            f"none of services supported by the plugin ({go_quote(versions)}) "
            f"are supported by the kubelet ({go_quote(k.DRA_SERVICES)})"
        )

    def validate(self, name: str, endpoint: str, versions: list[str]) -> None:
        try:
            self.choose_service(versions)
        except PluginError as e:
            raise PluginError(
                f"invalid supported gRPC versions of DRA driver plugin {name} at endpoint {endpoint}: {e}"
            ) from None

    async def register(self, name: str, endpoint: str, versions: list[str]) -> None:
        try:
            chosen = self.choose_service(versions)
        except PluginError as e:
            raise PluginError(
                f"invalid supported gRPC versions of DRA driver plugin {name} at endpoint {endpoint}: {e}"
            ) from None
        plugins = self.store.setdefault(name, [])
        if any(p.endpoint == endpoint for p in plugins):
            raise PluginError(f"endpoint {endpoint} already registered for DRA driver plugin {name}")
        # The connection is made once; gRPC connects (and reconnects) on its own, asked to start now.
        channel = grpc.aio.insecure_channel(k.unix_target(endpoint))
        channel.get_state(True)
        plugins.append(DRAPlugin(name, endpoint, chosen, self.call_timeout, channel))
        log.info("DRA plugin registered: driver %s, endpoint %s, service %s", name, endpoint, chosen)
        self._changes.changed()

    async def deregister(self, name: str, endpoint: str) -> None:
        plugins = self.store.get(name, [])
        for plugin in [p for p in plugins if p.endpoint == endpoint]:
            plugins.remove(plugin)
            self._spawn(plugin.channel.close())
        if not plugins:
            self.store.pop(name, None)
        log.info("DRA plugin deregistered: driver %s, endpoint %s", name, endpoint)
        self._changes.changed()

    def get(self, driver: str) -> DRAPlugin:
        """GetPlugin: the newest connected plugin of the driver, else the newest."""
        if not driver:
            raise DRAError("DRA driver name is empty")
        plugins = self.store.get(driver)
        if not plugins:
            raise DRAError(f"DRA driver {driver} is not registered")
        for plugin in reversed(plugins):
            if plugin.connected():
                return plugin
        return plugins[-1]

    async def close(self) -> None:
        for plugins in self.store.values():
            for plugin in plugins:
                await plugin.channel.close()
        self.store.clear()


@dataclass
class DeviceEndpoint:
    """The device manager's view of one resource's device plugin (endpoint.go and the manager's maps)."""

    resource: str
    socket: Path
    options: Any
    stub: Any = field(repr=False)
    devices: dict[str, Any] = field(default_factory=dict)
    healthy: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)
    updates: int = 0
    stopped: bool = False


@dataclass
class _DeviceClient:
    resource: str
    socket: Path
    channel: Any = field(repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class DeviceManager:
    """pkg/kubelet/cm/devicemanager: the Registration server on ``device-plugins/kubelet.sock`` and
    the endpoints of the device plugins that registered; also the (deprecated) DevicePlugin handler
    of the plugin watcher."""

    def __init__(self, directory: Path, dial_timeout: float, changes: Changes) -> None:
        self.directory = directory
        self.socket = directory / "kubelet.sock"
        self.dial_timeout = dial_timeout
        self.endpoints: dict[str, DeviceEndpoint] = {}
        self.registrations: list[Any] = []  # every RegisterRequest received, as received
        self._clients: dict[str, _DeviceClient] = {}
        self._streams: set[asyncio.Task[None]] = set()  # every client's ListAndWatch, replaced ones too
        self._server: Any = None
        self._changes = changes

    def cleanup_plugin_directory(self) -> None:
        """CleanupPluginDirectory: remove every socket but the checkpoint file; leave folders."""
        for entry in os.scandir(self.directory):
            if entry.name == DEVICE_MANAGER_CHECKPOINT:
                continue
            try:
                mode = os.stat(entry.path).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode) or not stat.S_ISSOCK(mode):
                continue
            os.unlink(entry.path)

    async def start(self) -> None:
        self.directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        self.cleanup_plugin_directory()
        (self.directory / "DEPRECATION").touch()  # handler.go GetPluginHandler
        manager = self

        class Registration(k.deviceplugin.rpc.RegistrationServicer):  # type: ignore[misc,name-defined]
            async def Register(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
                await manager.register_request(request, context)
                return k.deviceplugin.pb.Empty()

        self._server = grpc.aio.server()
        k.deviceplugin.rpc.add_RegistrationServicer_to_server(Registration(), self._server)
        self._server.add_insecure_port(k.unix_target(self.socket))
        await self._server.start()

    async def stop(self) -> None:
        clients = list(self._clients.items())
        for resource, client in clients:
            await self._disconnect(resource, client)
        tasks = list(self._streams)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        self.endpoints.clear()
        self._changes.changed()

    @staticmethod
    def version_compatible(*versions: str) -> bool:
        return any(v in k.DEVICE_PLUGIN_SUPPORTED_VERSIONS for v in versions)

    async def register_request(self, request: Any, context: Any) -> None:
        """server.go Register."""
        self.registrations.append(request)
        self._changes.changed()
        if not self.version_compatible(request.version):
            message = (
                f"requested API version {go_quote(request.version)} is not supported by kubelet. "
                f"Supported version is {go_quote(k.DEVICE_PLUGIN_SUPPORTED_VERSIONS)}"
            )
            await context.abort(grpc.StatusCode.UNKNOWN, message)
        if not is_extended_resource_name(request.resource_name):
            await context.abort(
                grpc.StatusCode.UNKNOWN, f"the ResourceName {go_quote(request.resource_name)} is invalid"
            )
        try:
            await self.connect(request.resource_name, self.directory / request.endpoint)
        except DeviceManagerError as e:
            error = str(e)
        else:
            return
        await context.abort(grpc.StatusCode.UNKNOWN, error)

    # The plugin watcher's DevicePlugin handler (plugin/v1beta1/handler.go).
    def validate(self, name: str, endpoint: str, versions: list[str]) -> None:
        if not self.version_compatible(*versions):
            raise PluginError(
                f"manager version, {k.DEVICE_PLUGIN_VERSION}, is not among plugin supported versions {go_quote(versions)}"
            )
        if not is_extended_resource_name(name):
            raise PluginError(f"invalid name of device plugin socket: the ResourceName {go_quote(name)} is invalid")

    async def register(self, name: str, endpoint: str, versions: list[str]) -> None:
        try:
            await self.connect(name, Path(endpoint))
        except DeviceManagerError as e:
            raise PluginError(str(e)) from None

    async def deregister(self, name: str, endpoint: str) -> None:
        client = self._clients.get(name)
        if client is not None:
            await self._disconnect(name, client)

    async def connect(self, resource: str, socket: Path) -> None:
        """connectClient: dial, PluginConnected (GetDevicePluginOptions), then ListAndWatch in the background."""
        channel = grpc.aio.insecure_channel(k.unix_target(socket))
        try:
            await asyncio.wait_for(channel.channel_ready(), self.dial_timeout)
        except TimeoutError:
            await channel.close()
            raise DeviceManagerError("failed to dial device plugin: context deadline exceeded") from None
        client = _DeviceClient(resource, socket, channel)
        self._clients[resource] = client
        stub = k.deviceplugin.rpc.DevicePluginStub(channel)
        try:
            options = await stub.GetDevicePluginOptions(k.deviceplugin.pb.Empty())
        except grpc.aio.AioRpcError as e:
            self._clients.pop(resource, None)
            await channel.close()
            raise DeviceManagerError(f"failed to get device plugin options: {e.details()}") from None
        self.endpoints[resource] = DeviceEndpoint(resource, socket, options, stub)
        client.task = asyncio.create_task(self._run(client, stub))
        self._streams.add(client.task)
        client.task.add_done_callback(self._streams.discard)
        log.info("device plugin connected: resource %s, socket %s", resource, socket)
        self._changes.changed()

    async def _run(self, client: _DeviceClient, stub: Any) -> None:
        """client.go Run: ListAndWatch until the stream ends; then the client is disconnected."""
        try:
            async for response in stub.ListAndWatch(k.deviceplugin.pb.Empty()):
                self._list_and_watch(client.resource, response)
        except grpc.aio.AioRpcError as e:
            log.info("ListAndWatch ended for %s: %s", client.resource, e.code())
        finally:
            if self._clients.get(client.resource) is client:
                await self._disconnect(client.resource, client)
            else:
                await client.channel.close()

    def _list_and_watch(self, resource: str, response: Any) -> None:
        """PluginListAndWatchReceiver / genericDeviceUpdateCallback."""
        endpoint = self.endpoints.get(resource)
        if endpoint is None:
            return
        endpoint.devices = {d.ID: d for d in response.devices}
        endpoint.healthy = {d.ID for d in response.devices if d.health == k.HEALTHY}
        endpoint.unhealthy = set(endpoint.devices) - endpoint.healthy
        endpoint.updates += 1
        self._changes.changed()

    async def _disconnect(self, resource: str, client: _DeviceClient) -> None:
        """disconnectClient and PluginDisconnected: every device unhealthy, the endpoint stopped."""
        if self._clients.get(resource) is client:
            del self._clients[resource]
        await client.channel.close()
        endpoint = self.endpoints.get(resource)
        if endpoint is not None and endpoint.socket == client.socket:
            endpoint.unhealthy |= endpoint.healthy
            endpoint.healthy = set()
            endpoint.stopped = True
        self._changes.changed()

    def endpoint(self, resource: str) -> DeviceEndpoint:
        endpoint = self.endpoints.get(resource)
        if endpoint is None:
            raise DeviceManagerError(f"cannot allocate unregistered device {resource}")
        return endpoint

    async def allocate(self, resource: str, device_ids: Sequence[str]) -> Any:
        """devicesToAllocate's checks for the devices named, then Allocate for one container."""
        endpoint = self.endpoint(resource)
        if not endpoint.healthy:
            raise DeviceManagerError(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
        if not set(device_ids) <= endpoint.healthy:
            unknown = sorted(set(device_ids) - endpoint.healthy)
            raise DeviceManagerError(f"devices {unknown} of {resource} are not healthy registered devices")
        if endpoint.stopped:
            raise DeviceManagerError(f"endpoint {resource} has been stopped")
        pb = k.deviceplugin.pb
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(device_ids))])
        response = await endpoint.stub.Allocate(request)
        if not response.container_responses:
            raise DeviceManagerError(f"no containers return in allocation response {response}")
        return response

    async def get_device_plugin_options(self, resource: str) -> Any:
        return await self.endpoint(resource).stub.GetDevicePluginOptions(k.deviceplugin.pb.Empty())

    async def get_preferred_allocation(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str] | None:
        """callGetPreferredAllocationIfAvailable: None when the plugin does not offer it."""
        endpoint = self.endpoint(resource)
        if not endpoint.options.get_preferred_allocation_available:
            return None
        pb = k.deviceplugin.pb
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size
                )
            ]
        )
        response = await endpoint.stub.GetPreferredAllocation(request)
        return list(response.container_responses[0].deviceIDs) if response.container_responses else []

    async def pre_start_container(self, resource: str, device_ids: Sequence[str]) -> None:
        """callPreStartContainerIfNeeded: only when the plugin asked for it, with 30 s."""
        endpoint = self.endpoint(resource)
        if endpoint.options.pre_start_required:
            request = k.deviceplugin.pb.PreStartContainerRequest(devices_ids=list(device_ids))
            await endpoint.stub.PreStartContainer(request, timeout=k.PRE_START_CONTAINER_TIMEOUT_S)


class FakeKubelet:
    """The fake kubelet, in the event loop it is started in. See the module's docstring."""

    def __init__(
        self,
        root: Path,
        *,
        poll_interval: float = 0.1,
        dra_call_timeout: float = DRA_CALL_TIMEOUT_S,
        dial_timeout: float = DIAL_TIMEOUT_S,
        get_info_timeout: float = GET_INFO_TIMEOUT_S,
        notify_timeout: float = NOTIFY_TIMEOUT_S,
    ) -> None:
        self.paths = k.KubeletPaths(Path(root))
        self.poll_interval = poll_interval
        self.dra_call_timeout = dra_call_timeout
        self.dial_timeout = dial_timeout
        self.get_info_timeout = get_info_timeout
        self.notify_timeout = notify_timeout
        self.starts = 0
        self.pods: list[Any] = []  # podresources.pb.PodResources messages, as List answers them
        self.notifications: list[Notification] = []  # across restarts, in order
        self.failures: list[RegistrationFailure] = []  # across restarts, in order
        self._changes: Changes | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._reset()

    def _reset(self) -> None:
        self._desired: dict[Path, tuple[int, int]] = {}
        self._actual: dict[Path, _Registered] = {}
        self._operations: dict[Path, asyncio.Task[None]] = {}
        self._backoff: dict[Path, _Backoff] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._pod_resources: Any = None
        self.dra: DRAPluginManager | None = None
        self.devices: DeviceManager | None = None

    @property
    def changes(self) -> Changes:
        if self._changes is None:
            raise RuntimeError("the fake kubelet is not started")
        return self._changes

    def _spawn(self, awaitable: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(awaitable)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- start, stop, restart

    async def start(self) -> None:
        if self._changes is None:
            self._changes = Changes()
        for folder in (self.paths.root, self.paths.plugins_registry, self.paths.plugins):
            folder.mkdir(mode=0o750, parents=True, exist_ok=True)
        self.dra = DRAPluginManager(self.dra_call_timeout, self._spawn, self.changes)
        self.devices = DeviceManager(self.paths.device_plugins, DEVICE_PLUGIN_DIAL_TIMEOUT_S, self.changes)
        await self.devices.start()
        await self._start_pod_resources()
        self._watcher = asyncio.create_task(self._watch())
        self.starts += 1
        log.info("fake kubelet started (%d) at %s", self.starts, self.paths.root)
        self.changes.changed()

    async def stop(self) -> None:
        """Stop as a kubelet process that exits: no deregistration, connections dropped."""
        tasks = [t for t in (self._watcher, *self._operations.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.dra is not None:
            await self.dra.close()
        if self.devices is not None:
            await self.devices.stop()
        if self._pod_resources is not None:
            await self._pod_resources.stop(None)
        with contextlib.suppress(FileNotFoundError):
            self.paths.pod_resources_socket.unlink()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._reset()
        if self._changes is not None:
            self._changes.changed()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    # --- the plugin watcher and the reconciler

    def _scan(self) -> dict[Path, tuple[int, int]]:
        found: dict[Path, tuple[int, int]] = {}
        for folder, _, files in os.walk(self.paths.plugins_registry):
            for name in files:
                if name.startswith("."):
                    continue
                path = Path(folder) / name
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if stat.S_ISSOCK(st.st_mode):
                    found[path] = (st.st_ino, st.st_mtime_ns)  # a socket made again: a new time (chmod: none)
        return found

    async def _watch(self) -> None:
        while True:
            self._desired = self._scan()
            await self._reconcile()
            await asyncio.sleep(self.poll_interval)

    async def _reconcile(self) -> None:
        for socket, plugin in list(self._actual.items()):
            if self._desired.get(socket) != plugin.stamp and socket not in self._operations:
                del self._actual[socket]
                await plugin.handler.deregister(plugin.name, plugin.endpoint)
                self.changes.changed()
        now = time.monotonic()
        for socket, stamp in self._desired.items():
            registered = self._actual.get(socket)
            if registered is not None and registered.stamp == stamp:
                continue
            if socket in self._operations or now < self._backoff.get(socket, _Backoff()).not_before:
                continue
            self._operations[socket] = asyncio.create_task(self._register_operation(socket, stamp))

    async def _register_operation(self, socket: Path, stamp: tuple[int, int]) -> None:
        try:
            await self._register(socket, stamp)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            backoff = self._backoff.setdefault(socket, _Backoff())
            delay = min(BACKOFF_INITIAL_S * 2**backoff.failures, BACKOFF_MAX_S)
            backoff.failures += 1
            backoff.not_before = time.monotonic() + delay
            self.failures.append(RegistrationFailure(socket, str(e)))
            log.info("registration of %s failed (retry in %.1f s): %s", socket, delay, e)
        else:
            self._backoff.pop(socket, None)
        finally:
            self._operations.pop(socket, None)
            self.changes.changed()

    async def _register(self, socket: Path, stamp: tuple[int, int]) -> None:
        """operation_generator.go GenerateRegisterPluginFunc."""
        channel = grpc.aio.insecure_channel(k.unix_target(socket))
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), self.dial_timeout)
            except TimeoutError:
                raise KubeletError(
                    f"RegisterPlugin error -- dial failed at socket {socket}, err: failed to dial socket {socket}, "
                    "err: context deadline exceeded"
                ) from None
            stub = k.registration.rpc.RegistrationStub(channel)
            try:
                info = await stub.GetInfo(k.registration.pb.InfoRequest(), timeout=self.get_info_timeout)
            except grpc.aio.AioRpcError as e:
                raise KubeletError(
                    f"RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {socket}, "
                    f"err: {e.details()}"
                ) from None
            handler = self._handler(info.type)
            if handler is None:
                message = (
                    f"RegisterPlugin error -- no handler registered for plugin type: {info.type} at socket {socket}"
                )
                await self._notify(stub, socket, False, message)
                raise KubeletError(message)
            endpoint = info.endpoint or str(socket)
            versions = list(info.supported_versions)
            try:
                handler.validate(info.name, endpoint, versions)
            except PluginError as e:
                await self._notify(
                    stub, socket, False, f"RegisterPlugin error -- plugin validation failed with err: {e}"
                )
                raise KubeletError("RegisterPlugin error -- pluginHandler.ValidatePluginFunc failed") from None
            # In the actual state before the handler registers it, so that a socket removed
            # meanwhile is deregistered.
            self._actual[socket] = _Registered(socket, stamp, handler, info.name, endpoint)
            try:
                await handler.register(info.name, endpoint, versions)
            except PluginError as e:
                message = f"RegisterPlugin error -- plugin registration failed with err: {e}"
                await self._notify(stub, socket, False, message)
                raise KubeletError(message) from None
            await self._notify(stub, socket, True, "")
        finally:
            await channel.close()

    def _handler(self, plugin_type: str) -> PluginHandler | None:
        if plugin_type == k.DRA_PLUGIN:
            return self.dra
        if plugin_type == k.DEVICE_PLUGIN:
            return self.devices
        return None  # CSIPlugin and the rest: no handler here

    async def _notify(self, stub: Any, socket: Path, registered: bool, error: str) -> None:
        status = k.registration.pb.RegistrationStatus(plugin_registered=registered, error=error)
        try:
            await stub.NotifyRegistrationStatus(status, timeout=self.notify_timeout)
        except grpc.aio.AioRpcError as e:
            raise KubeletError(
                f"RegisterPlugin error -- failed to send registration status at socket {socket}, err: {e.details()}"
            ) from None
        self.notifications.append(Notification(socket, registered, error))
        self.changes.changed()

    # --- DRA

    def dra_plugins(self, driver: str) -> list[DRAPlugin]:
        """The plugins registered for a driver, oldest first."""
        return list(self.dra.store.get(driver, [])) if self.dra is not None else []

    def dra_plugin(self, driver: str) -> DRAPlugin:
        """The plugin the kubelet would call for a driver; DRAError when there is none."""
        if self.dra is None:
            raise DRAError(f"DRA driver {driver} is not registered")
        return self.dra.get(driver)

    async def wait_for_dra_driver(self, driver: str, timeout: float = 30.0) -> DRAPlugin:
        def ready() -> DRAPlugin | None:
            plugins = self.dra_plugins(driver)
            return plugins[-1] if plugins else None

        return await self.changes.wait_for(ready, timeout, f"DRA driver {driver}")

    async def prepare(self, driver: str, claims: Sequence[ClaimLike]) -> PrepareOutcome:
        """NodePrepareResources on the driver's plugin, judged as the DRA manager judges it."""
        plugin = self.dra_plugin(driver)
        pb = plugin.api.pb
        request = pb.NodePrepareResourcesRequest(claims=[_claim(pb, c) for c in claims])
        stub = plugin.api.rpc.DRAPluginStub(plugin.channel)
        response = await stub.NodePrepareResources(request, timeout=plugin.call_timeout)
        results = {
            uid: ClaimResult(tuple(_device(d) for d in r.devices), r.error) for uid, r in response.claims.items()
        }
        return PrepareOutcome(plugin.chosen_service, results, _verdict("NodePrepareResources", claims, results))

    async def unprepare(self, driver: str, claims: Sequence[ClaimLike]) -> PrepareOutcome:
        """NodeUnprepareResources on the driver's plugin, judged as the DRA manager judges it."""
        plugin = self.dra_plugin(driver)
        pb = plugin.api.pb
        request = pb.NodeUnprepareResourcesRequest(claims=[_claim(pb, c) for c in claims])
        stub = plugin.api.rpc.DRAPluginStub(plugin.channel)
        response = await stub.NodeUnprepareResources(request, timeout=plugin.call_timeout)
        results = {uid: ClaimResult((), r.error) for uid, r in response.claims.items()}
        return PrepareOutcome(plugin.chosen_service, results, _verdict("NodeUnprepareResources", claims, results))

    # --- the device manager

    def device_manager(self) -> DeviceManager:
        if self.devices is None:
            raise RuntimeError("the fake kubelet is not started")
        return self.devices

    async def wait_for_devices(self, resource: str, count: int, timeout: float = 30.0) -> DeviceEndpoint:
        """Wait until a connected device plugin for ``resource`` reported ``count`` healthy devices."""

        def ready() -> DeviceEndpoint | None:
            endpoint = self.devices.endpoints.get(resource) if self.devices is not None else None
            if endpoint is not None and not endpoint.stopped and len(endpoint.healthy) == count:
                return endpoint
            return None

        return await self.changes.wait_for(ready, timeout, f"{count} healthy devices of {resource}")

    async def allocate(self, resource: str, device_ids: Sequence[str]) -> Any:
        return await self.device_manager().allocate(resource, device_ids)

    async def get_device_plugin_options(self, resource: str) -> Any:
        return await self.device_manager().get_device_plugin_options(resource)

    # --- pod resources

    def set_pods(self, pods: Iterable[Any]) -> None:
        """The pods ``PodResourcesLister`` reports: ``podresources.pb.PodResources`` messages."""
        self.pods = list(pods)

    async def _start_pod_resources(self) -> None:
        kubelet = self
        pb = k.podresources.pb

        class Lister(k.podresources.rpc.PodResourcesListerServicer):  # type: ignore[misc,name-defined]
            async def List(self, request: Any, context: Any) -> Any:  # noqa: N802
                return pb.ListPodResourcesResponse(pod_resources=kubelet.pods)

            async def Get(self, request: Any, context: Any) -> Any:  # noqa: N802
                for pod in kubelet.pods:
                    if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                        return pb.GetPodResourcesResponse(pod_resources=pod)
                await context.abort(
                    grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
                )

            async def GetAllocatableResources(self, request: Any, context: Any) -> Any:  # noqa: N802
                devices = []
                manager = kubelet.devices
                for resource, endpoint in sorted(manager.endpoints.items() if manager is not None else ()):
                    for device_id, device in sorted(endpoint.devices.items()):
                        topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=n.ID) for n in device.topology.nodes])
                        devices.append(
                            pb.ContainerDevices(resource_name=resource, device_ids=[device_id], topology=topology)
                        )
                return pb.AllocatableResourcesResponse(devices=devices)

        socket = self.paths.pod_resources_socket
        socket.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            socket.unlink()
        self._pod_resources = grpc.aio.server()
        k.podresources.rpc.add_PodResourcesListerServicer_to_server(Lister(), self._pod_resources)
        self._pod_resources.add_insecure_port(k.unix_target(socket))
        await self._pod_resources.start()


def _claim(pb: Any, claim: ClaimLike) -> Any:
    return pb.Claim(namespace=claim.namespace, uid=claim.uid, name=claim.name)


def _device(d: Any) -> PreparedDevice:
    share_id = d.share_id if "share_id" in d.DESCRIPTOR.fields_by_name and d.HasField("share_id") else None
    return PreparedDevice(tuple(d.request_names), d.pool_name, d.device_name, tuple(d.cdi_device_ids), share_id)


def _verdict(call: str, claims: Sequence[ClaimLike], results: dict[str, ClaimResult]) -> str | None:
    """manager.go: how the DRA manager judges a NodePrepareResources/NodeUnprepareResources response."""
    names = {c.uid: c.name for c in claims}
    for uid, result in results.items():
        if uid not in names:
            return f"{call} returned result for unknown claim UID {uid}"
        if result.error:
            return f"{call} failed for ResourceClaim {names[uid]}: {result.error}"
    unfinished = len(claims) - len(results)
    if unfinished:
        return f"{call} skipped {unfinished} ResourceClaims"
    return None


class KubeletThread:
    """A :class:`FakeKubelet` in an event loop and thread of its own, as a kubelet is a process of its own.

    :meth:`call` runs the coroutine function ``fn(kubelet)`` there and waits for it (from any thread
    but the kubelet's, a trio test's included: wrap it in ``trio.to_thread.run_sync``); :meth:`acall`
    does the same from another asyncio loop without blocking it, which a test needs when the plugin
    the kubelet calls is served from that loop. :meth:`read` and :meth:`aread` run a plain function
    there (to read the kubelet's state). The other methods are :meth:`acall` shorthands::

        plugin = await kubelet.wait_for_dra_driver("gpu.gpud.io")
        outcome = await kubelet.prepare("gpu.gpud.io", [Claim("default", "uid-1", "claim-1")])
        options = await kubelet.acall(lambda kl: kl.get_device_plugin_options("gpud.io/gpu"))
        notifications = kubelet.read(lambda kl: list(kl.notifications))
    """

    def __init__(self, root: Path, **options: Any) -> None:
        self.kubelet = FakeKubelet(root, **options)
        self.paths = self.kubelet.paths
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="fake-kubelet", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def start(self, timeout: float = 30.0) -> KubeletThread:
        self._thread.start()
        self.call(lambda kl: kl.start(), timeout)
        return self

    def close(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            try:
                self.call(lambda kl: kl.stop(), timeout)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout)

    def _submit(self, fn: Callable[[FakeKubelet], Awaitable[T]]) -> Future[T]:
        async def run() -> T:
            return await fn(self.kubelet)

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    def _submit_plain(self, fn: Callable[[FakeKubelet], T]) -> Future[T]:
        async def run() -> T:
            return fn(self.kubelet)

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    def call(self, fn: Callable[[FakeKubelet], Awaitable[T]], timeout: float = 60.0) -> T:
        """Run ``fn(kubelet)`` in the kubelet's loop; block until it is done."""
        return self._submit(fn).result(timeout)

    async def acall(self, fn: Callable[[FakeKubelet], Awaitable[T]]) -> T:
        """Run ``fn(kubelet)`` in the kubelet's loop; await it from another asyncio loop."""
        return await asyncio.wrap_future(self._submit(fn))

    def read(self, fn: Callable[[FakeKubelet], T], timeout: float = 60.0) -> T:
        """Run the plain function ``fn(kubelet)`` in the kubelet's loop, to read its state (copy
        what is returned: the kubelet goes on changing it) or change it; block until it is done. It
        waits only for the kubelet's loop, never for a plugin's, so even a test's loop may call it."""
        return self._submit_plain(fn).result(timeout)

    async def aread(self, fn: Callable[[FakeKubelet], T]) -> T:
        """:meth:`read`, awaited from another asyncio loop."""
        return await asyncio.wrap_future(self._submit_plain(fn))

    async def restart(self) -> None:
        await self.acall(lambda kl: kl.restart())

    async def wait_for_dra_driver(self, driver: str, timeout: float = 30.0) -> DRAPlugin:
        return await self.acall(lambda kl: kl.wait_for_dra_driver(driver, timeout))

    async def prepare(self, driver: str, claims: Sequence[ClaimLike]) -> PrepareOutcome:
        return await self.acall(lambda kl: kl.prepare(driver, claims))

    async def unprepare(self, driver: str, claims: Sequence[ClaimLike]) -> PrepareOutcome:
        return await self.acall(lambda kl: kl.unprepare(driver, claims))

    async def wait_for_devices(self, resource: str, count: int, timeout: float = 30.0) -> DeviceEndpoint:
        return await self.acall(lambda kl: kl.wait_for_devices(resource, count, timeout))

    async def allocate(self, resource: str, device_ids: Sequence[str]) -> Any:
        return await self.acall(lambda kl: kl.allocate(resource, device_ids))

    async def set_pods(self, pods: Iterable[Any]) -> None:
        pods = list(pods)
        await self.aread(lambda kl: kl.set_pods(pods))

    async def wait_for(self, predicate: Callable[[FakeKubelet], T | None], timeout: float = 30.0, what: str = "") -> T:
        """Wait until ``predicate(kubelet)``, evaluated in the kubelet's loop at each change, is true; its value."""
        return await self.acall(lambda kl: kl.changes.wait_for(lambda: predicate(kl), timeout, what))
