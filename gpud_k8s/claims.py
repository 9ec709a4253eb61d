"""A ResourceClaim read as gpud sees it: which of this node's GPUs it was given and how much of each,
its opaque configuration, and the one gpud allocation that enforces it. Pure: JSON in, a plan out.

The scheduler allocated the claim (``status.allocation.devices.results``): for gpud's driver, each
result names a device of this node's pool (``gpu-<index>``), and with consumable capacity the share
of it (``consumedCapacity``: ``cores`` 1..100, ``memory`` in bytes; ``shareID``). The plan is
one gpud allocation per claim, ``k8s-<claim uid>`` in the tenant of the claim's namespace:

- whole devices (no consumed capacity, or all of ``cores``): that many whole GPUs, exactly those;
- one shared device: that GPU, the share ``cores`` / 100 as the enforced compute ceiling, the
  consumed ``memory`` as the memory ceiling.

Several shared devices in one claim cannot be one gpud allocation (a fraction is of one GPU) and are
refused with a message that says so, as is anything else gpud cannot enforce as asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from gpud_client.protocol import PriorityClass, Recovery
from gpud_k8s.quantity import QuantityError, whole

DRIVER = "gpu.gpud.io"
CONFIG_API_VERSION = "gpu.gpud.io/v1alpha1"
CONFIG_KIND = "GpudClaimConfig"
TASK_PREFIX = "k8s-"
CORES = "cores"  # a device's compute, in percent: 1..100
MEMORY = "memory"  # a device's memory, in bytes
DEVICE_PREFIX = "gpu-"

Pause = Literal["none", "freeze", "cuda"]


class ClaimError(ValueError):
    """The claim asks for what gpud cannot give or enforce; the message says what and where."""


class ClaimConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    """gpud's opaque configuration of a claim (``spec.devices.config[].opaque.parameters``, or a
    DeviceClass's), kind ``GpudClaimConfig`` of ``gpu.gpud.io/v1alpha1``."""

    api_version: str = msgspec.field(name="apiVersion")
    kind: str
    priority_class: PriorityClass = PriorityClass.NORMAL
    recovery: Recovery = Recovery.TERMINATE
    pause: Pause = "freeze"  # how gpud pauses the claim's unmodified containers when time-sliced
    time_slice: bool = False  # gpud time-slices the claim's containers from the node (no library in them)


DEFAULT_CONFIG = ClaimConfig(api_version=CONFIG_API_VERSION, kind=CONFIG_KIND)


def read_config(parameters: object, where: str) -> ClaimConfig:
    """One opaque configuration, validated: a wrong kind, version, field or value is named."""
    if not isinstance(parameters, dict):
        raise ClaimError(f"{where}: the parameters must be an object of kind {CONFIG_KIND}")
    if parameters.get("apiVersion") != CONFIG_API_VERSION or parameters.get("kind") != CONFIG_KIND:
        raise ClaimError(
            f"{where}: apiVersion {parameters.get('apiVersion')!r}, kind {parameters.get('kind')!r}: "
            f"gpud reads apiVersion {CONFIG_API_VERSION!r}, kind {CONFIG_KIND!r}"
        )
    try:
        config = msgspec.convert(parameters, ClaimConfig)
    except msgspec.ValidationError as exc:
        raise ClaimError(f"{where}: {exc}") from None
    if config.recovery is Recovery.SHRINK:
        raise ClaimError(f"{where}: recovery 'shrink' is for elastic allocations, which a claim is not")
    if config.pause == "none" and (config.time_slice or config.recovery is Recovery.SUSPEND):
        what = "timeSlice" if config.time_slice else "recovery 'suspend'"
        raise ClaimError(f"{where}: {what} pauses the claim's containers, and pause is 'none' (use freeze or cuda)")
    return config


@dataclass(frozen=True, slots=True)
class DeviceShare:
    request: str
    gpu: int
    share_id: str | None
    cores: int  # percent of the GPU's compute: 100 for a whole one
    memory: int | None  # bytes; None: not limited (a whole GPU)

    @property
    def whole(self) -> bool:
        return self.cores == 100 and self.memory is None


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    uid: str
    namespace: str
    name: str
    devices: tuple[DeviceShare, ...]
    config: ClaimConfig
    pods: tuple[PodRef, ...]

    @property
    def task_id(self) -> str:
        return TASK_PREFIX + self.uid

    @property
    def gpus(self) -> list[int]:
        return [d.gpu for d in self.devices]

    @property
    def share(self) -> float:
        """What the gpud allocation asks for: whole GPUs, or the fraction of one."""
        if len(self.devices) == 1 and not self.devices[0].whole:
            return self.devices[0].cores / 100
        return float(len(self.devices))

    @property
    def memory(self) -> int | None:
        """The memory ceiling of a shared device (None: whole GPUs, not limited)."""
        return self.devices[0].memory if len(self.devices) == 1 else None


def task_uid(task_id: str) -> str | None:
    """The claim uid of a task gpud-k8s made (None: not one of its tasks)."""
    return task_id[len(TASK_PREFIX) :] if task_id.startswith(TASK_PREFIX) else None


def device_name(gpu: int) -> str:
    return f"{DEVICE_PREFIX}{gpu}"


def plan(claim: dict[str, Any], node: str, driver: str = DRIVER) -> ClaimPlan:
    """The plan for ``claim`` (a ResourceClaim as the API server returns it) on ``node``."""
    meta = claim.get("metadata") or {}
    uid, namespace, name = meta.get("uid"), meta.get("namespace"), meta.get("name")
    if not (isinstance(uid, str) and uid and isinstance(namespace, str) and isinstance(name, str)):
        raise ClaimError("the claim has no metadata.uid, namespace and name")
    where = f"ResourceClaim {namespace}/{name}"
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"{where} is not allocated (status.allocation is empty)")
    results = [r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == driver]
    if not results:
        raise ClaimError(f"{where}: no device of driver {driver} in status.allocation.devices.results")
    devices = tuple(_device(r, node, where) for r in results)
    if len({d.gpu for d in devices}) != len(devices):
        raise ClaimError(f"{where}: a GPU is allocated to it twice ({sorted(d.gpu for d in devices)})")
    if len(devices) > 1 and not all(d.whole for d in devices):
        raise ClaimError(
            f"{where}: {len(devices)} devices of which some are shares: gpud enforces a share of one GPU, "
            "or whole GPUs; ask for one shared device per claim"
        )
    config = _config(allocation, claim, {r["request"] for r in results}, where, driver)
    pods = tuple(
        PodRef(namespace, str(ref.get("name")), str(ref.get("uid")))
        for ref in (claim.get("status") or {}).get("reservedFor") or []
        if ref.get("resource") == "pods" and not ref.get("apiGroup")
    )
    return ClaimPlan(uid, namespace, name, devices, config, pods)


def _device(result: dict[str, Any], node: str, where: str) -> DeviceShare:
    device, pool, request = result.get("device"), result.get("pool"), result.get("request", "")
    if pool != node:
        raise ClaimError(f"{where}: device {device} is of pool {pool!r}, not of this node {node!r}")
    if not isinstance(device, str) or not device.startswith(DEVICE_PREFIX) or not device[4:].isdigit():
        raise ClaimError(f"{where}: device {device!r} is not one of gpud's (gpu-<index>)")
    consumed = result.get("consumedCapacity") or {}
    unknown = sorted(set(consumed) - {CORES, MEMORY})
    if unknown:
        raise ClaimError(f"{where}: device {device}: unknown capacity {', '.join(unknown)} (gpud has cores, memory)")
    try:
        cores = whole(consumed.get(CORES, 100), f"{where}: device {device}: consumed cores")
        memory = whole(consumed[MEMORY], f"{where}: device {device}: consumed memory") if MEMORY in consumed else None
    except QuantityError as exc:
        raise ClaimError(str(exc)) from None
    if not 1 <= cores <= 100:
        raise ClaimError(f"{where}: device {device}: consumed cores {cores} is not within 1..100")
    if memory is not None and memory <= 0:
        raise ClaimError(f"{where}: device {device}: consumed memory {memory} is not above 0")
    return DeviceShare(str(request), int(device[4:]), result.get("shareID"), cores, memory)


def _config(
    allocation: dict[str, Any], claim: dict[str, Any], requests: set[str], where: str, driver: str
) -> ClaimConfig:
    """The configuration for the claim's requests of gpud's devices: the allocation's copy (the class's
    then the claim's: the last applies), or, not yet copied there, the claim's spec. One config for
    all the claim's requests: they are one allocation."""
    entries = (allocation.get("devices") or {}).get("config")
    if entries is None:
        entries = [
            dict(e, source="FromClaim") for e in ((claim.get("spec") or {}).get("devices") or {}).get("config") or []
        ]
    found: ClaimConfig | None = None
    for i, entry in enumerate(entries):
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != driver:
            continue
        applies = set(entry.get("requests") or [])
        if applies and not applies & (requests | {r.split("/")[0] for r in requests}):  # (a subrequest's parent)
            continue
        found = read_config(opaque.get("parameters"), f"{where}: config[{i}] ({entry.get('source', 'FromClaim')})")
    return found or DEFAULT_CONFIG
