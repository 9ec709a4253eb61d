"""A stand-in for nvidia-ml-py's pynvml, for tests only.

The GPUs are described by the JSON file named in $FAKE_NVML_STATE, read on
every call, so a test can change memory, utilisation, per-process memory, or
make a GPU fail while the daemon runs. In a GPU's entry:
- ``"lost": true``: its calls raise NVMLError("GPU is lost");
- ``"hang": true``: its calls block, re-reading the file every 20 ms, and go on
  once the flag is cleared (a hang that recovers);
- ``"hang": "forever"``: its calls block for good, as a call stuck in the driver
  does (the thread waits on a lock, holding no GIL), whatever the file says later.
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


def _state() -> dict[str, Any]:
    with open(os.environ["FAKE_NVML_STATE"]) as f:
        return json.load(f)


_HANG_POLL_S = 0.02


def _gpu(handle: int) -> dict[str, Any]:
    gpu = _state()["gpus"][handle]
    while gpu.get("hang"):
        if gpu["hang"] == "forever":
            threading.Event().wait()  # never set
        time.sleep(_HANG_POLL_S)  # a hung NVML call, until the test clears "hang" in the state file
        gpu = _state()["gpus"][handle]
    if gpu.get("lost"):
        raise NVMLError("GPU is lost")
    return gpu


def nvmlInit() -> None:
    if _state().get("no_driver"):
        raise NVMLError("Driver Not Loaded")


def nvmlDeviceGetCount() -> int:
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    return i


def nvmlDeviceGetName(h: int) -> str:
    return _gpu(h)["name"]


def nvmlDeviceGetUUID(h: int) -> str:
    return _gpu(h)["uuid"]


def nvmlDeviceGetPciInfo(h: int) -> SimpleNamespace:
    """A GPU's ``"pci"`` entry as its bus id (as NVML gives it: bytes); without one, NVML's error."""
    gpu = _gpu(h)
    if "pci" not in gpu:
        raise NVMLError("Not Supported")
    return SimpleNamespace(busId=gpu["pci"].encode())


def nvmlDeviceGetMemoryInfo(h: int) -> SimpleNamespace:
    g = _gpu(h)
    return SimpleNamespace(total=g["total"], used=g.get("used", 0), free=g["total"] - g.get("used", 0))


def nvmlDeviceGetUtilizationRates(h: int) -> SimpleNamespace:
    return SimpleNamespace(gpu=_gpu(h).get("util", 0), memory=0)


def nvmlDeviceGetComputeRunningProcesses(h: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(pid=int(pid), usedGpuMemory=used) for pid, used in _gpu(h).get("procs", {}).items()]
