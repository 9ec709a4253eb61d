"""GPU discovery: NVML when a driver answers, simulated GPUs otherwise.

The NVML module is injected (``nvml=``) so tests can pass a stand-in; the
daemon passes the real ``pynvml`` from nvidia-ml-py. A missing library or
driver is not fatal: the daemon runs on simulated GPUs and says so.
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import structlog

from gpud.core.gpus import parse_simulate
from gpud_client.units import printable

log = structlog.get_logger(__name__)
DEFAULT_SIMULATION = "2x80GiB"


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    simulated: bool
    pci_bus_id: str | None = None  # NVML's (domain:bus:device.function); None: simulated, or NVML did not say


def simulated_gpus(spec: str) -> list[Gpu]:
    count, memory = parse_simulate(spec)
    gib = memory / 2**30
    size = f"{gib:g}GiB" if gib >= 1 else f"{memory // 2**20}MiB"
    return [
        Gpu(
            index=i,
            # Stable across restarts, so clients and dashboards can key on it.
            uuid="GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"gpud-simulated/{i}")),
            name=f"Simulated GPU {size}",
            memory_total_bytes=memory,
            simulated=True,
        )
        for i in range(count)
    ]


def _text(value: Any) -> str:
    """A string NVML returned, made safe to show and log: decoded, control characters escaped, bounded."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return printable(text)[:96]


def nvml_gpus(nvml: Any) -> list[Gpu]:
    """Read every device from an initialised-or-not NVML module."""
    nvml.nvmlInit()
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        gpus.append(
            Gpu(
                index=i,
                uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                name=_text(nvml.nvmlDeviceGetName(h)),
                memory_total_bytes=int(mem.total),
                simulated=False,
                pci_bus_id=_pci_bus_id(nvml, h),
            )
        )
    return gpus


def _pci_bus_id(nvml: Any, handle: Any) -> str | None:
    """The GPU's PCI address as NVML gives it (``00000000:17:00.0``), or None where it does not."""
    try:
        info = nvml.nvmlDeviceGetPciInfo(handle)
    except Exception:  # NVMLError: an older driver, a GPU that does not say; the address is only shown
        return None
    bus_id = getattr(info, "busId", None)
    return (_text(bus_id) or None) if bus_id is not None else None


def _import_nvml() -> ModuleType | None:
    try:
        import pynvml  # type: ignore[import-untyped]
    except ImportError:
        return None
    module: ModuleType = pynvml
    return module


def discover(simulate: str | None = None, *, nvml: Any = None) -> list[Gpu]:
    """GPUs to schedule. ``simulate`` forces simulation; otherwise NVML, and
    simulation with a warning when NVML is missing or sees no GPU."""
    if simulate:
        gpus = simulated_gpus(simulate)
        log.info("gpus_simulated", count=len(gpus), memory_bytes=gpus[0].memory_total_bytes)
        return gpus
    module = nvml if nvml is not None else _import_nvml()
    reason = "nvidia-ml-py is not installed"
    if module is not None:
        try:
            gpus = nvml_gpus(module)
        except Exception as exc:  # NVMLError and friends: no driver, no library
            reason = f"NVML unavailable: {exc}"
        else:
            if gpus:
                log.info("gpus_discovered", count=len(gpus), names=[g.name for g in gpus])
                return gpus
            reason = "NVML reports no GPU"
    gpus = simulated_gpus(DEFAULT_SIMULATION)
    log.warning("gpus_simulated_fallback", reason=reason, count=len(gpus), spec=DEFAULT_SIMULATION)
    return gpus


@dataclass(frozen=True, slots=True)
class Reading:
    """One GPU at one moment, as NVML saw it."""

    index: int
    healthy: bool
    memory_used_bytes: int = 0
    utilization_ratio: float = 0.0
    process_memory: dict[int, int] | None = None  # pid -> bytes
    error: str | None = None


class NvmlSampler:
    """Reads utilisation, memory and per-process memory of real GPUs.

    Blocking, and a sick GPU's calls may never return: the daemon reads each GPU
    with ``sample_gpu`` in a worker thread of its own (see ``gpud.serving.monitor``),
    never on its event loop. A GPU whose calls fail is reported unhealthy."""

    def __init__(self, nvml: Any, gpus: list[Gpu]) -> None:
        self.nvml = nvml
        self.gpus = [g for g in gpus if not g.simulated]

    def sample_gpu(self, gpu: Gpu) -> Reading:
        """One GPU's reading; an NVML error is an unhealthy reading, not an exception."""
        try:
            h = self.nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            mem = self.nvml.nvmlDeviceGetMemoryInfo(h)
            util = self.nvml.nvmlDeviceGetUtilizationRates(h)
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
            per_pid = {int(pr.pid): int(pr.usedGpuMemory or 0) for pr in procs}
            return Reading(gpu.index, True, int(mem.used), float(util.gpu) / 100, per_pid)
        except Exception as exc:  # NVMLError_GpuIsLost and friends
            return Reading(gpu.index, False, error=_text(exc) or type(exc).__name__)

    def sample(self) -> list[Reading]:
        """Every GPU in turn: one hung GPU stalls them all (the monitor uses ``sample_gpu``)."""
        return [self.sample_gpu(g) for g in self.gpus]


def sampler_for(gpus: list[Gpu], nvml: Any = None) -> NvmlSampler | None:
    """A sampler when some GPU is real, else None (simulated GPUs need none)."""
    if all(g.simulated for g in gpus):
        return None
    module = nvml if nvml is not None else _import_nvml()
    return None if module is None else NvmlSampler(module, gpus)
