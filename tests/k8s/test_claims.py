"""A ResourceClaim read as gpud sees it (gpud_k8s.claims), the node's ResourceSlice (gpud_k8s.slices),
a claim's CDI spec (gpud_k8s.cdi) and Kubernetes quantities: pure, JSON in and out."""

from __future__ import annotations

import copy
from fractions import Fraction
from typing import Any

import kubernetes_validate
import pytest

from gpud_client.protocol import PriorityClass, Recovery
from gpud_k8s import quantity
from gpud_k8s.cdi import claim_spec, device_id
from gpud_k8s.claims import DEFAULT_CONFIG, ClaimError, plan, read_config, task_uid
from gpud_k8s.slices import DRAINING, UNHEALTHY, Gpu, resource_slice

NODE = "node-a"
CONFIG = {"apiVersion": "gpu.gpud.io/v1alpha1", "kind": "GpudClaimConfig"}


def claim(*results: dict[str, Any], config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "team-a", "uid": "0b9e-11"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpud.io"}}]}},
        "status": {
            "allocation": {"devices": {"results": list(results), **({"config": config} if config is not None else {})}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}],
        },
    }


def result(device: str = "gpu-1", **consumed: str) -> dict[str, Any]:
    r: dict[str, Any] = {"request": "gpu", "driver": "gpu.gpud.io", "pool": NODE, "device": device}
    if consumed:
        r["consumedCapacity"] = consumed
        r["shareID"] = "9b7c4a1e-2f7d-4c55-8e0a-3d1f6b2a9c10"
    return r


def test_quantities_are_read_exactly() -> None:
    assert quantity.parse("20Gi") == 20 * 2**30
    assert quantity.parse("500m") == Fraction(1, 2)
    assert quantity.parse("1.5G") == 1_500_000_000
    assert quantity.parse("1e3") == 1000
    assert quantity.whole("25", "cores") == 25
    with pytest.raises(quantity.QuantityError, match="not a whole number"):
        quantity.whole("500m", "cores")
    with pytest.raises(quantity.QuantityError, match="is not a quantity"):
        quantity.parse("20 GiB")
    assert quantity.binary(20 * 2**30) == "20Gi" and quantity.binary(1536) == "1536"


def test_a_share_of_one_gpu_is_a_fraction_with_its_memory_ceiling() -> None:
    p = plan(claim(result("gpu-1", cores="25", memory="20Gi")), NODE)
    assert (p.task_id, p.namespace, p.gpus, p.share, p.memory) == ("k8s-0b9e-11", "team-a", [1], 0.25, 20 * 2**30)
    assert p.config == DEFAULT_CONFIG and [pod.uid for pod in p.pods] == ["pod-1"]
    assert task_uid(p.task_id) == "0b9e-11" and task_uid("other") is None


def test_devices_without_capacity_are_whole_gpus() -> None:
    second = dict(result("gpu-0"), request="gpu")
    p = plan(claim(result("gpu-1"), second), NODE)
    assert p.share == 2.0 and sorted(p.gpus) == [0, 1] and p.memory is None


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ([result("gpu-1", cores="25"), result("gpu-0", cores="50")], "some are shares"),
        ([dict(result("gpu-1"), pool="node-b")], "not of this node"),
        ([result("tpu-1")], "not one of gpud's"),
        ([result("gpu-1", cores="0")], "not within 1..100"),
        ([result("gpu-1", cores="25", watts="100")], "unknown capacity watts"),
        ([result("gpu-1", cores="250m")], "not a whole number"),
        ([result("gpu-1"), result("gpu-1")], "allocated to it twice"),
        ([dict(result("gpu-1"), driver="other.example.com")], "no device of driver gpu.gpud.io"),
    ],
)
def test_what_gpud_cannot_enforce_is_refused_naming_it(results: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ClaimError, match=message) as info:
        plan(claim(*results), NODE)
    assert "ResourceClaim team-a/c" in str(info.value)


def test_an_unallocated_claim_is_refused() -> None:
    c = claim(result())
    del c["status"]["allocation"]
    with pytest.raises(ClaimError, match="is not allocated"):
        plan(c, NODE)


def test_the_opaque_config_is_read_for_the_claims_requests_the_last_one_applying() -> None:
    entries = [
        {"source": "FromClass", "opaque": {"driver": "gpu.gpud.io", "parameters": dict(CONFIG, recovery="fail")}},
        {"source": "FromClaim", "requests": ["other"], "opaque": {"driver": "gpu.gpud.io", "parameters": CONFIG}},
        {
            "source": "FromClaim",
            "requests": ["gpu"],
            "opaque": {
                "driver": "gpu.gpud.io",
                "parameters": dict(CONFIG, priorityClass="best-effort", recovery="suspend", timeSlice=True),
            },
        },
        {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"x": 1}}},
    ]
    config = plan(claim(result(), config=entries), NODE).config
    assert (config.priority_class, config.recovery, config.time_slice) == (
        PriorityClass.BEST_EFFORT,
        Recovery.SUSPEND,
        True,
    )


def test_a_config_not_yet_copied_into_the_allocation_is_read_from_the_spec() -> None:
    c = claim(result())
    c["spec"]["devices"]["config"] = [{"opaque": {"driver": "gpu.gpud.io", "parameters": dict(CONFIG, pause="cuda")}}]
    assert plan(c, NODE).config.pause == "cuda"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"apiVersion": "gpu.gpud.io/v1", "kind": "GpudClaimConfig"}, "gpud reads apiVersion 'gpu.gpud.io/v1alpha1'"),
        (dict(CONFIG, priorityClass="urgent"), r"\$.priorityClass"),
        (dict(CONFIG, recovery="shrink"), "elastic"),
        (dict(CONFIG, timeslice=True), "unknown field `timeslice`"),
        ([1, 2], "must be an object"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(parameters: object, message: str) -> None:
    with pytest.raises(ClaimError, match=message):
        read_config(parameters, "ResourceClaim team-a/c: config[0]")


def test_the_slice_offers_shares_where_the_cluster_has_them_and_taints_what_must_take_nothing_new() -> None:
    gpus = [
        Gpu(0, "GPU-aaa", "NVIDIA H100", 80 * 2**30 + 5, "0000:17:00.0"),
        Gpu(1, "GPU-bbb", "NVIDIA H100", 80 * 2**30, draining=True, healthy=False),
    ]
    s = resource_slice(NODE, gpus, 3, shared=True, node_uid="n-1")
    assert s["spec"]["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    d0, d1 = s["spec"]["devices"]
    assert d0["name"] == "gpu-0" and d0["allowMultipleAllocations"] is True
    assert d0["attributes"]["pciBusID"] == {"string": "0000:17:00.0"}
    assert d0["capacity"]["memory"]["value"] == "80Gi", "rounded down to the step"
    assert d0["capacity"]["cores"]["requestPolicy"]["validRange"] == {"min": "1", "max": "100", "step": "1"}
    assert [t["key"] for t in d1["taints"]] == [DRAINING, UNHEALTHY]
    whole = resource_slice(NODE, gpus[:1], 1, shared=False)
    (d,) = whole["spec"]["devices"]
    assert "allowMultipleAllocations" not in d and "requestPolicy" not in d["capacity"]["cores"]
    assert "ownerReferences" not in whole["metadata"]


def test_a_claims_cdi_spec_mounts_its_socket_directory_and_says_where_it_is() -> None:
    spec = claim_spec("0b9e-11", "/run/gpud/claims/0b9e-11", ("/dev/nvidia1",))
    (dev,) = spec["devices"]
    assert (
        spec["kind"] == "gpud.io/claim" and dev["name"] == "0b9e-11" and device_id("0b9e-11") == "gpud.io/claim=0b9e-11"
    )
    edits = dev["containerEdits"]
    assert edits["env"] == ["GPUD_SOCKET=/run/gpud/gpud.sock", "GPUD_TASK_ID=k8s-0b9e-11"]
    assert edits["mounts"][0]["hostPath"] == "/run/gpud/claims/0b9e-11"
    assert edits["deviceNodes"] == [{"path": "/dev/nvidia1"}]
    assert "deviceNodes" not in claim_spec("u", "/d")["devices"][0]["containerEdits"]


def test_reading_a_claim_changes_nothing_in_it() -> None:
    c = claim(result("gpu-1", cores="25", memory="20Gi"))
    before = copy.deepcopy(c)
    plan(c, NODE)
    assert c == before


@pytest.mark.parametrize("version", ["1.34.0", "1.35.0", "1.36.0", "1.37.0"])
def test_the_slice_is_valid_for_every_supported_kubernetes(version: str) -> None:
    gpus = [Gpu(0, "GPU-aaa", "NVIDIA H100", 80 * 2**30, "0000:17:00.0", draining=True), Gpu(1, "GPU-b", "H100", 2**34)]
    kubernetes_validate.validate(resource_slice(NODE, gpus, 1, shared=False, node_uid="n-1"), version, strict=True)
    if version >= "1.36.0":  # consumable capacity: on by default from 1.36
        kubernetes_validate.validate(resource_slice(NODE, gpus, 1, shared=True), version, strict=True)
