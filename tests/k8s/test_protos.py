"""The kubelet's APIs as gpud_k8s loads them (gpud_k8s/kubelet_api.py, gpud_k8s/proto): the full method
names gRPC sends and the field numbers on the wire, read back from the loaded descriptors and pinned to
the upstream files' (k8s.io/kubelet/pkg/apis: pluginregistration/v1, dra/v1, dra/v1beta1,
deviceplugin/v1beta1, podresources/v1). A change to a .proto file that would break talking to a real
kubelet or plugin fails here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor

from gpud_k8s import kubelet_api as k

SCALARS = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT64: "uint64",
}


def kind(field: Any) -> str:
    return str(field.message_type.name) if field.type == FieldDescriptor.TYPE_MESSAGE else SCALARS[field.type]


def spec(field: Any) -> str:
    """A field as the .proto file declares it: ``"4 repeated string"``, ``"1 map<string, Device>"``."""
    if field.is_repeated and field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return f"{field.number} map<{kind(key)}, {kind(value)}>"
    if field.is_repeated:
        return f"{field.number} repeated {kind(field)}"
    if field.type != FieldDescriptor.TYPE_MESSAGE and field.has_presence:
        return f"{field.number} optional {kind(field)}"
    return f"{field.number} {kind(field)}"


def fields(api: k.KubeletAPI, message: str) -> dict[str, str]:
    return {f.name: spec(f) for f in api.pb.DESCRIPTOR.message_types_by_name[message].fields}


METHODS = {
    # pluginregistration/v1: package pluginregistration (upstream: "This should have been v1.")
    "/pluginregistration.Registration/GetInfo": ("InfoRequest", "PluginInfo", False),
    "/pluginregistration.Registration/NotifyRegistrationStatus": (
        "RegistrationStatus",
        "RegistrationStatusResponse",
        False,
    ),
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources": (
        "NodePrepareResourcesRequest",
        "NodePrepareResourcesResponse",
        False,
    ),
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources": (
        "NodeUnprepareResourcesRequest",
        "NodeUnprepareResourcesResponse",
        False,
    ),
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources": (
        "NodePrepareResourcesRequest",
        "NodePrepareResourcesResponse",
        False,
    ),
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources": (
        "NodeUnprepareResourcesRequest",
        "NodeUnprepareResourcesResponse",
        False,
    ),
    # deviceplugin/v1beta1: package v1beta1
    "/v1beta1.Registration/Register": ("RegisterRequest", "Empty", False),
    "/v1beta1.DevicePlugin/GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
    "/v1beta1.DevicePlugin/ListAndWatch": ("Empty", "ListAndWatchResponse", True),
    "/v1beta1.DevicePlugin/GetPreferredAllocation": (
        "PreferredAllocationRequest",
        "PreferredAllocationResponse",
        False,
    ),
    "/v1beta1.DevicePlugin/Allocate": ("AllocateRequest", "AllocateResponse", False),
    "/v1beta1.DevicePlugin/PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    # podresources/v1: package v1
    "/v1.PodResourcesLister/List": ("ListPodResourcesRequest", "ListPodResourcesResponse", False),
    "/v1.PodResourcesLister/GetAllocatableResources": (
        "AllocatableResourcesRequest",
        "AllocatableResourcesResponse",
        False,
    ),
    "/v1.PodResourcesLister/Get": ("GetPodResourcesRequest", "GetPodResourcesResponse", False),
}


def test_apis_load_from_their_own_files() -> None:
    assert [(api.proto, api.package) for api in k.APIS] == [
        ("pluginregistration/v1/api.proto", "pluginregistration"),
        ("dra/v1/api.proto", "k8s.io.kubelet.pkg.apis.dra.v1"),
        ("dra/v1beta1/api.proto", "k8s.io.kubelet.pkg.apis.dra.v1beta1"),
        ("deviceplugin/v1beta1/api.proto", "v1beta1"),
        ("podresources/v1/api.proto", "v1"),
    ]
    for api in k.APIS:
        assert api.pb.DESCRIPTOR.name == api.proto  # each api.proto its own file in the descriptor pool
        assert (k.PROTO_ROOT / api.proto).is_file()
    # The top-level module names grpcio-tools gives them (dra.v1.api_pb2...) are not left behind.
    assert not {name for name in sys.modules if name.partition(".")[0] in {"dra", "deviceplugin", "podresources"}}
    assert "pluginregistration" not in sys.modules
    assert str(k.PROTO_ROOT) not in sys.path


def test_full_method_names() -> None:
    methods = {}
    for api in k.APIS:
        for service in api.pb.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                streams = (m.client_streaming, m.server_streaming)
                assert streams in {(False, False), (False, True)}
                methods[f"/{service.full_name}/{m.name}"] = (m.input_type.name, m.output_type.name, m.server_streaming)
    assert methods == METHODS
    assert k.dra_v1.method("DRAPlugin", "NodePrepareResources") == (
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
    )
    assert k.registration.method("Registration", "GetInfo") == "/pluginregistration.Registration/GetInfo"
    assert k.deviceplugin.method("Registration", "Register") == "/v1beta1.Registration/Register"
    assert k.podresources.method("PodResourcesLister", "List") == "/v1.PodResourcesLister/List"


class RecordingChannel:
    """Stands in for a channel: records the method paths a generated stub binds."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def _bind(self, path: str, *args: Any, **kwargs: Any) -> None:
        self.paths.append(path)

    unary_unary = unary_stream = stream_unary = stream_stream = _bind


@pytest.mark.parametrize(
    ("api", "service"),
    [
        (k.registration, "Registration"),
        (k.dra_v1, "DRAPlugin"),
        (k.dra_v1beta1, "DRAPlugin"),
        (k.deviceplugin, "Registration"),
        (k.deviceplugin, "DevicePlugin"),
        (k.podresources, "PodResourcesLister"),
    ],
)
def test_stubs_call_the_full_method_names(api: k.KubeletAPI, service: str) -> None:
    channel = RecordingChannel()
    getattr(api.rpc, f"{service}Stub")(channel)
    prefix = f"/{api.service(service)}/"
    assert sorted(channel.paths) == sorted(m for m in METHODS if m.startswith(prefix))
    assert hasattr(api.rpc, f"{service}Servicer") and hasattr(api.rpc, f"add_{service}Servicer_to_server")


DRA_MESSAGES = {
    "Claim": {"namespace": "1 string", "uid": "2 string", "name": "3 string"},
    "NodePrepareResourcesRequest": {"claims": "1 repeated Claim"},
    "NodePrepareResourcesResponse": {"claims": "1 map<string, NodePrepareResourceResponse>"},
    "NodePrepareResourceResponse": {"devices": "1 repeated Device", "error": "2 string"},
    "Device": {
        "request_names": "1 repeated string",
        "pool_name": "2 string",
        "device_name": "3 string",
        "cdi_device_ids": "4 repeated string",
    },
    "NodeUnprepareResourcesRequest": {"claims": "1 repeated Claim"},
    "NodeUnprepareResourcesResponse": {"claims": "1 map<string, NodeUnprepareResourceResponse>"},
    "NodeUnprepareResourceResponse": {"error": "1 string"},
}


@pytest.mark.parametrize("api", [k.dra_v1, k.dra_v1beta1], ids=["v1", "v1beta1"])
def test_dra_fields(api: k.KubeletAPI) -> None:
    expected = {name: dict(spec) for name, spec in DRA_MESSAGES.items()}
    if api is k.dra_v1:
        expected["Device"]["share_id"] = "5 optional string"  # kubernetes/kubernetes#134520, v1 only
    assert {name: fields(api, name) for name in api.pb.DESCRIPTOR.message_types_by_name} == expected


def test_dra_versions_share_the_wire() -> None:
    """A v1 Device read as a v1beta1 one keeps every field v1beta1 has."""
    device = k.dra_v1.pb.Device(
        request_names=["gpu"], pool_name="node-a", device_name="gpu-0", cdi_device_ids=["gpu.gpud.io/gpu=gpu-0"]
    )
    old = k.dra_v1beta1.pb.Device.FromString(device.SerializeToString())
    assert (list(old.request_names), old.pool_name, old.device_name, list(old.cdi_device_ids)) == (
        ["gpu"],
        "node-a",
        "gpu-0",
        ["gpu.gpud.io/gpu=gpu-0"],
    )


def test_registration_fields() -> None:
    assert {name: fields(k.registration, name) for name in k.registration.pb.DESCRIPTOR.message_types_by_name} == {
        "PluginInfo": {
            "type": "1 string",
            "name": "2 string",
            "endpoint": "3 string",
            "supported_versions": "4 repeated string",
        },
        "RegistrationStatus": {"plugin_registered": "1 bool", "error": "2 string"},
        "RegistrationStatusResponse": {},
        "InfoRequest": {},
    }


def test_deviceplugin_fields() -> None:
    assert {name: fields(k.deviceplugin, name) for name in k.deviceplugin.pb.DESCRIPTOR.message_types_by_name} == {
        "DevicePluginOptions": {"pre_start_required": "1 bool", "get_preferred_allocation_available": "2 bool"},
        "RegisterRequest": {
            "version": "1 string",
            "endpoint": "2 string",
            "resource_name": "3 string",
            "options": "4 DevicePluginOptions",
        },
        "Empty": {},
        "ListAndWatchResponse": {"devices": "1 repeated Device"},
        "TopologyInfo": {"nodes": "1 repeated NUMANode"},
        "NUMANode": {"ID": "1 int64"},
        "Device": {"ID": "1 string", "health": "2 string", "topology": "3 TopologyInfo"},
        "PreStartContainerRequest": {"devices_ids": "1 repeated string"},
        "PreStartContainerResponse": {},
        "PreferredAllocationRequest": {"container_requests": "1 repeated ContainerPreferredAllocationRequest"},
        "ContainerPreferredAllocationRequest": {
            "available_deviceIDs": "1 repeated string",
            "must_include_deviceIDs": "2 repeated string",
            "allocation_size": "3 int32",
        },
        "PreferredAllocationResponse": {"container_responses": "1 repeated ContainerPreferredAllocationResponse"},
        "ContainerPreferredAllocationResponse": {"deviceIDs": "1 repeated string"},
        "AllocateRequest": {"container_requests": "1 repeated ContainerAllocateRequest"},
        "ContainerAllocateRequest": {"devices_ids": "1 repeated string"},
        "CDIDevice": {"name": "1 string"},
        "AllocateResponse": {"container_responses": "1 repeated ContainerAllocateResponse"},
        "ContainerAllocateResponse": {
            "envs": "1 map<string, string>",
            "mounts": "2 repeated Mount",
            "devices": "3 repeated DeviceSpec",
            "annotations": "4 map<string, string>",
            "cdi_devices": "5 repeated CDIDevice",
        },
        "Mount": {"container_path": "1 string", "host_path": "2 string", "read_only": "3 bool"},
        "DeviceSpec": {"container_path": "1 string", "host_path": "2 string", "permissions": "3 string"},
    }


def test_podresources_fields() -> None:
    assert {name: fields(k.podresources, name) for name in k.podresources.pb.DESCRIPTOR.message_types_by_name} == {
        "AllocatableResourcesRequest": {},
        "AllocatableResourcesResponse": {
            "devices": "1 repeated ContainerDevices",
            "cpu_ids": "2 repeated int64",
            "memory": "3 repeated ContainerMemory",
        },
        "ListPodResourcesRequest": {},
        "ListPodResourcesResponse": {"pod_resources": "1 repeated PodResources"},
        "PodResources": {"name": "1 string", "namespace": "2 string", "containers": "3 repeated ContainerResources"},
        "ContainerResources": {
            "name": "1 string",
            "devices": "2 repeated ContainerDevices",
            "cpu_ids": "3 repeated int64",
            "memory": "4 repeated ContainerMemory",
            "dynamic_resources": "5 repeated DynamicResource",
        },
        "ContainerMemory": {"memory_type": "1 string", "size": "2 uint64", "topology": "3 TopologyInfo"},
        "ContainerDevices": {
            "resource_name": "1 string",
            "device_ids": "2 repeated string",
            "topology": "3 TopologyInfo",
        },
        "TopologyInfo": {"nodes": "1 repeated NUMANode"},
        "NUMANode": {"ID": "1 int64"},
        # Field 1 (class_name) was removed in Kubernetes 1.31; its number stays unused.
        "DynamicResource": {
            "claim_name": "2 string",
            "claim_namespace": "3 string",
            "claim_resources": "4 repeated ClaimResource",
        },
        "ClaimResource": {
            "cdi_devices": "1 repeated CDIDevice",
            "driver_name": "2 string",
            "pool_name": "3 string",
            "device_name": "4 string",
            "share_id": "5 optional string",
        },
        "CDIDevice": {"name": "1 string"},
        "GetPodResourcesRequest": {"pod_name": "1 string", "pod_namespace": "2 string"},
        "GetPodResourcesResponse": {"pod_resources": "1 PodResources"},
    }


def test_constants() -> None:
    assert (k.CSI_PLUGIN, k.DRA_PLUGIN, k.DEVICE_PLUGIN) == ("CSIPlugin", "DRAPlugin", "DevicePlugin")
    assert k.DRA_SERVICES == ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    for service, api in k.DRA_SERVICE_API.items():
        # "<last part of the gRPC package>.<service>", as dra/v1/types.go's DRAPluginService
        assert service == f"{api.package.rpartition('.')[2]}.DRAPlugin"
    assert (k.DEVICE_PLUGIN_VERSION, k.DEVICE_PLUGIN_SUPPORTED_VERSIONS) == ("v1beta1", ("v1beta1",))
    assert (k.HEALTHY, k.UNHEALTHY) == ("Healthy", "Unhealthy")
    assert k.KUBELET_ROOT == Path("/var/lib/kubelet")
    assert k.PLUGINS_REGISTRY_DIR == Path("/var/lib/kubelet/plugins_registry")
    assert k.PLUGINS_DIR == Path("/var/lib/kubelet/plugins")
    assert k.DEVICE_PLUGINS_DIR == Path("/var/lib/kubelet/device-plugins")
    assert k.KUBELET_SOCKET == Path("/var/lib/kubelet/device-plugins/kubelet.sock")
    assert k.POD_RESOURCES_SOCKET == Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    paths = k.KubeletPaths(Path("/tmp/root"))
    assert paths.registration_socket("gpu.gpud.io") == Path("/tmp/root/plugins_registry/gpu.gpud.io-reg.sock")
    assert paths.dra_socket("gpu.gpud.io") == Path("/tmp/root/plugins/gpu.gpud.io/dra.sock")
    assert k.unix_target("/run/x.sock") == "unix:/run/x.sock"


@pytest.mark.parametrize("api", k.APIS, ids=lambda api: api.proto)
def test_proto_files_name_their_upstream(api: k.KubeletAPI) -> None:
    header = (k.PROTO_ROOT / api.proto).read_text().split("syntax =")[0]
    assert f"staging/src/k8s.io/kubelet/pkg/apis/{api.proto}" in header
    assert "written for gpud after the upstream file".lower() in header.lower().replace("\n//", "")
    assert "gogo.proto" not in (k.PROTO_ROOT / api.proto).read_text()
