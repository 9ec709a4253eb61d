"""The kubelet's gRPC APIs, loaded at start from gpud_k8s's own ``.proto`` files.

gpud-k8s speaks four of the kubelet's local gRPC APIs, all over Unix sockets under the kubelet's
root directory (``/var/lib/kubelet``):

- the plugin registration API (``pluginregistration``): a plugin serves ``Registration`` on a
  socket it creates in ``plugins_registry/``; the kubelet's plugin watcher calls ``GetInfo`` and
  then ``NotifyRegistrationStatus``;
- the DRA plugin API, versions ``v1`` and ``v1beta1``: a DRA driver's kubelet plugin serves
  ``DRAPlugin`` (``NodePrepareResources``, ``NodeUnprepareResources``) on the endpoint it named
  in ``GetInfo``, conventionally ``plugins/<driver>/dra.sock``;
- the device plugin API (``deviceplugin``, ``v1beta1``): the kubelet serves ``Registration`` on
  ``device-plugins/kubelet.sock``; a device plugin serves ``DevicePlugin`` on a socket of its own
  in ``device-plugins/`` and calls ``Register`` naming it;
- the pod resources API (``podresources``, ``v1``): the kubelet serves ``PodResourcesLister`` on
  ``pod-resources/kubelet.sock``.

The ``.proto`` files live in ``gpud_k8s/proto/<api>/<version>/api.proto``, written after the
upstream files in ``k8s.io/kubelet/pkg/apis`` (each names its source in a header) with the
upstream package, service and message names and field numbers, so the wire names are the
kubelet's: ``/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources``,
``/pluginregistration.Registration/GetInfo``, ``/v1beta1.Registration/Register``,
``/v1.PodResourcesLister/List``. Nothing is generated ahead of time: at import this module
compiles them with ``grpc.protos_and_services`` (grpcio-tools), with ``gpud_k8s/proto`` as the
include root and the relative names ``dra/v1/api.proto`` and so on. Every file is called
``api.proto``, and the folders keep them apart: each gets its own module (``dra.v1.api_pb2``
beside ``dra.v1beta1.api_pb2``) and its own file name in protobuf's descriptor pool. Those module
names would be top-level (``dra``, ``deviceplugin``, ``podresources``, ``pluginregistration``),
free for any other distribution to use too, so they exist only while the files load
(:func:`_load`): any module already holding one of those names is set aside and put back after,
and nothing of ours stays under them. The modules live on in the namespaces below.

Each API is one :class:`KubeletAPI`:

- :data:`registration`: ``pluginregistration.Registration`` (``PluginInfo``, ``InfoRequest``,
  ``RegistrationStatus``, ``RegistrationStatusResponse``);
- :data:`dra_v1`, :data:`dra_v1beta1`: ``DRAPlugin`` (``NodePrepareResourcesRequest``,
  ``Claim``, ``NodePrepareResourceResponse``, ``Device``...);
- :data:`deviceplugin`: ``v1beta1.Registration`` and ``v1beta1.DevicePlugin`` (``RegisterRequest``,
  ``DevicePluginOptions``, ``ListAndWatchResponse``, ``Device``, ``AllocateResponse``...);
- :data:`podresources`: ``v1.PodResourcesLister`` (``ListPodResourcesResponse``,
  ``PodResources``, ``ContainerResources``, ``DynamicResource``, ``ClaimResource``...).

``api.pb`` holds the message classes (what a ``*_pb2`` module holds) and ``api.rpc`` the gRPC
classes (what a ``*_pb2_grpc`` module holds: ``<Service>Stub``, ``<Service>Servicer``,
``add_<Service>Servicer_to_server``), for ``grpc`` and ``grpc.aio`` alike::

    from gpud_k8s import kubelet_api as k

    class DRA(k.dra_v1.rpc.DRAPluginServicer):
        async def NodePrepareResources(self, request, context):
            return k.dra_v1.pb.NodePrepareResourcesResponse(...)

    server = grpc.aio.server()
    k.dra_v1.rpc.add_DRAPluginServicer_to_server(DRA(), server)
    stub = k.deviceplugin.rpc.RegistrationStub(grpc.aio.insecure_channel(k.unix_target(path)))

gRPC and protobuf ship no type annotations, so ``pb`` and ``rpc`` are ``Any``: the boundary is
typed only this far. Besides the APIs the module holds the constants the kubelet uses: the plugin
types (:data:`DRA_PLUGIN`, :data:`DEVICE_PLUGIN`), the DRA service names a plugin lists as its
"supported versions" (:data:`DRA_V1_SERVICE` ``"v1.DRAPlugin"``, :data:`DRA_V1BETA1_SERVICE`
``"v1beta1.DRAPlugin"``), the device plugin API version (:data:`DEVICE_PLUGIN_VERSION`
``"v1beta1"``) and device health values, and the kubelet's default paths (:class:`KubeletPaths`,
:data:`KUBELET_PATHS`: root ``/var/lib/kubelet`` with ``plugins_registry/``, ``plugins/``,
``device-plugins/kubelet.sock``, ``pod-resources/kubelet.sock``).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

PROTO_ROOT = Path(__file__).resolve().parent / "proto"
"""The include root of the ``.proto`` files: each is ``<api>/<version>/api.proto`` under it."""


@dataclass(frozen=True)
class KubeletAPI:
    """One of the kubelet's gRPC APIs: its ``.proto`` file loaded, with its messages and services."""

    proto: str
    """The file, relative to :data:`PROTO_ROOT`: ``"dra/v1/api.proto"``."""
    package: str
    """The protobuf package, the prefix of every full name: ``"k8s.io.kubelet.pkg.apis.dra.v1"``."""
    pb: Any
    """The messages: what a generated ``api_pb2`` module holds (``pb.Claim``, ``pb.DESCRIPTOR``...)."""
    rpc: Any
    """The services: what a generated ``api_pb2_grpc`` module holds (``rpc.DRAPluginStub``,
    ``rpc.DRAPluginServicer``, ``rpc.add_DRAPluginServicer_to_server``...)."""

    def service(self, name: str) -> str:
        """A service's full name: ``dra_v1.service("DRAPlugin")`` is
        ``"k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"``."""
        return f"{self.package}.{name}" if self.package else name

    def method(self, service: str, method: str) -> str:
        """A method's full name as gRPC sends it: ``registration.method("Registration", "GetInfo")``
        is ``"/pluginregistration.Registration/GetInfo"``."""
        return f"/{self.service(service)}/{method}"


@contextlib.contextmanager
def _import_root(root: Path, tops: set[str]) -> Iterator[None]:
    """Make the folders under ``root`` importable as the packages ``tops`` while the block runs,
    and leave ``sys.modules`` and ``sys.path`` as they were after.

    grpcio-tools turns ``dra/v1/api.proto`` into the module ``dra.v1.api_pb2``, found by a finder
    that looks the file up on ``sys.path`` and compiled with ``sys.path`` as the include path; the
    module's parents (``dra``, ``dra.v1``) have to import first. Another ``dra`` (an installed
    package, or one already imported) would take their place, so the top-level names are given
    here to namespace packages of our own folders, and whatever held them before is put back."""
    saved = {name: module for name, module in sys.modules.items() if name.partition(".")[0] in tops}
    for name in saved:
        del sys.modules[name]
    for top in tops:
        spec = importlib.machinery.ModuleSpec(top, None, is_package=True)
        spec.submodule_search_locations = [str(root / top)]
        package = types.ModuleType(top)
        package.__spec__ = spec
        package.__path__ = [str(root / top)]
        sys.modules[top] = package
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        for name in [name for name in sys.modules if name.partition(".")[0] in tops]:
            del sys.modules[name]
        sys.modules.update(saved)


def _load(*protos: str) -> list[KubeletAPI]:
    """Compile and load the ``.proto`` files (paths relative to :data:`PROTO_ROOT`)."""
    with _import_root(PROTO_ROOT, {proto.partition("/")[0] for proto in protos}):
        apis = []
        for proto in protos:
            pb, rpc = grpc.protos_and_services(proto)
            apis.append(KubeletAPI(proto=proto, package=pb.DESCRIPTOR.package, pb=pb, rpc=rpc))
        return apis


registration, dra_v1, dra_v1beta1, deviceplugin, podresources = _load(
    "pluginregistration/v1/api.proto",
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
)
APIS: tuple[KubeletAPI, ...] = (registration, dra_v1, dra_v1beta1, deviceplugin, podresources)

# Plugin types, as a plugin names its own in PluginInfo.type (pluginregistration/v1/constants.go).
CSI_PLUGIN = "CSIPlugin"
DRA_PLUGIN = "DRAPlugin"
DEVICE_PLUGIN = "DevicePlugin"

# The DRA services a DRA plugin lists in PluginInfo.supported_versions, "<gRPC package's last
# part>.<service>" (dra/v1/types.go, dra/v1beta1/types.go), and those the kubelet can call, most
# recent first (pkg/kubelet/cm/dra/plugin: servicesSupportedByKubelet).
DRA_V1_SERVICE = "v1.DRAPlugin"
DRA_V1BETA1_SERVICE = "v1beta1.DRAPlugin"
DRA_SERVICES: tuple[str, ...] = (DRA_V1_SERVICE, DRA_V1BETA1_SERVICE)
DRA_SERVICE_API: dict[str, KubeletAPI] = {DRA_V1_SERVICE: dra_v1, DRA_V1BETA1_SERVICE: dra_v1beta1}

# The device plugin API (deviceplugin/v1beta1/constants.go): the version a device plugin sends in
# RegisterRequest.version, the ones the kubelet accepts, and the values of Device.health.
DEVICE_PLUGIN_VERSION = "v1beta1"
DEVICE_PLUGIN_SUPPORTED_VERSIONS: tuple[str, ...] = (DEVICE_PLUGIN_VERSION,)
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
PRE_START_CONTAINER_TIMEOUT_S = 30.0
"""How long the kubelet waits for PreStartContainer (KubeletPreStartContainerRPCTimeoutInSecs)."""

KUBELET_ROOT = Path("/var/lib/kubelet")


@dataclass(frozen=True)
class KubeletPaths:
    """Where the kubelet and its plugins put their sockets, under a kubelet root directory (the
    kubelet's ``--root-dir``, ``/var/lib/kubelet`` by default)."""

    root: Path = KUBELET_ROOT

    @property
    def plugins_registry(self) -> Path:
        """Where plugins put their registration sockets; the kubelet's plugin watcher watches it."""
        return self.root / "plugins_registry"

    @property
    def plugins(self) -> Path:
        """Where plugins keep their own files, one folder each (``plugins/<driver>/``)."""
        return self.root / "plugins"

    @property
    def device_plugins(self) -> Path:
        """The device plugin directory: the kubelet's socket and the device plugins' own."""
        return self.root / "device-plugins"

    @property
    def kubelet_socket(self) -> Path:
        """The kubelet's device plugin ``Registration`` service."""
        return self.device_plugins / "kubelet.sock"

    @property
    def pod_resources_socket(self) -> Path:
        """The kubelet's ``PodResourcesLister`` service."""
        return self.root / "pod-resources" / "kubelet.sock"

    def registration_socket(self, driver: str) -> Path:
        """A DRA driver's registration socket, as the Kubernetes DRA kubelet plugin helper names it
        (k8s.io/dynamic-resource-allocation/kubeletplugin: ``<driver>-reg.sock``)."""
        return self.plugins_registry / f"{driver}-reg.sock"

    def dra_socket(self, driver: str) -> Path:
        """A DRA driver's ``DRAPlugin`` endpoint, as the same helper names it (``plugins/<driver>/dra.sock``)."""
        return self.plugins / driver / "dra.sock"


KUBELET_PATHS = KubeletPaths()
PLUGINS_REGISTRY_DIR = KUBELET_PATHS.plugins_registry
PLUGINS_DIR = KUBELET_PATHS.plugins
DEVICE_PLUGINS_DIR = KUBELET_PATHS.device_plugins
KUBELET_SOCKET = KUBELET_PATHS.kubelet_socket
POD_RESOURCES_SOCKET = KUBELET_PATHS.pod_resources_socket


def unix_target(path: str | Path) -> str:
    """The gRPC target for a Unix socket: ``unix:`` and the absolute path."""
    return f"unix:{Path(path).absolute()}"
