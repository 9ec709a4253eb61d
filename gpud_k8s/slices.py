"""This node's GPUs as gpud's driver publishes them: one ResourceSlice, one device per physical GPU.

Each device carries the GPU's attributes (``uuid``, ``index``, ``product``, ``pciBusID``) and its
capacity: ``cores`` (percent of its compute, 100) and ``memory`` (bytes). Where the cluster shares a
device by capacity (Kubernetes 1.36 and later: ``allowMultipleAllocations`` with a ``requestPolicy``),
a request takes ``cores`` 1..100 in steps of 1 and ``memory`` in steps of ``MEMORY_STEP``, and one
that states neither takes the whole GPU (the defaults are all of both). Elsewhere each device is
a whole GPU. A GPU an operator drains, or that NVML reports unhealthy, carries a taint, so the
scheduler places nothing new on it (``NoSchedule``); what runs there stays. Pure: facts in, JSON out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpud_k8s.claims import CORES, DRIVER, MEMORY, device_name
from gpud_k8s.quantity import binary

MEMORY_STEP = 256 * 2**20  # a share's memory is a multiple of this
DRAINING = f"{DRIVER}/draining"  # taint keys
UNHEALTHY = f"{DRIVER}/unhealthy"


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str
    product: str
    memory_bytes: int
    pci_bus_id: str | None = None
    healthy: bool = True
    draining: bool = False


def slice_name(node: str, driver: str = DRIVER) -> str:
    return f"{node}-{driver}"


def resource_slice(
    node: str,
    gpus: list[Gpu],
    generation: int,
    *,
    shared: bool,
    node_uid: str | None = None,
    driver: str = DRIVER,
) -> dict[str, Any]:
    """The node's one ResourceSlice (pool ``node``, ``generation``: one more at each change)."""
    meta: dict[str, Any] = {"name": slice_name(node, driver)}
    if node_uid is not None:  # gone with its node
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [device(g, shared=shared) for g in gpus],
        },
    }


def device(gpu: Gpu, *, shared: bool) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "uuid": {"string": gpu.uuid},
        "index": {"int": gpu.index},
        "product": {"string": gpu.product},
    }
    if gpu.pci_bus_id:
        attributes["pciBusID"] = {"string": gpu.pci_bus_id}
    memory = gpu.memory_bytes - gpu.memory_bytes % MEMORY_STEP if shared else gpu.memory_bytes
    cores: dict[str, Any] = {"value": "100"}
    mem: dict[str, Any] = {"value": binary(memory)}
    out: dict[str, Any] = {
        "name": device_name(gpu.index),
        "attributes": attributes,
        "capacity": {CORES: cores, MEMORY: mem},
    }
    if shared:
        cores["requestPolicy"] = {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}
        mem["requestPolicy"] = {
            "default": binary(memory),
            "validRange": {"min": binary(MEMORY_STEP), "max": binary(memory), "step": binary(MEMORY_STEP)},
        }
        out["allowMultipleAllocations"] = True
    taints = []
    if gpu.draining:
        taints.append({"key": DRAINING, "value": "true", "effect": "NoSchedule"})
    if not gpu.healthy:
        taints.append({"key": UNHEALTHY, "value": "true", "effect": "NoSchedule"})
    if taints:
        out["taints"] = taints
    return out
