"""What NVML says about a run's program: its GPU memory and whether it uses the GPU.

Optional: ``pynvml`` (nvidia-ml-py, in the ``cuda`` extra and installed with gpud)
is imported when a run starts, and a machine without it or without a driver simply
has no readings (``Nvml.open`` returns None): memory then comes from
``--mem-estimate`` and activity from the program's CPU time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class Nvml:
    def __init__(self, nvml: Any, index: int) -> None:
        self.nvml = nvml
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.busy = 0  # a count that moves whenever a sample shows the program on the GPU
        self._since = 0

    @classmethod
    def open(cls, index: int) -> Nvml | None:
        try:
            import pynvml  # type: ignore[import-untyped]

            pynvml.nvmlInit()
            return cls(pynvml, index)
        except Exception:  # no module, no driver, no such GPU: no readings
            return None

    def memory(self, pids: Iterable[int]) -> int | None:
        """The GPU memory the processes hold on this GPU, or None when NVML cannot say."""
        wanted = set(pids)
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:
            return None
        return sum(int(pr.usedGpuMemory or 0) for pr in procs if int(pr.pid) in wanted)

    def activity(self, pids: Iterable[int]) -> int | None:
        """A count that moves while the processes use the GPU (NVML's per-process samples)."""
        wanted = set(pids)
        try:
            samples = self.nvml.nvmlDeviceGetProcessUtilization(self.handle, self._since)
        except self.nvml.NVMLError_NotFound:
            return self.busy  # no sample since the last look: nobody used the GPU
        except Exception:
            return None
        self._since = max((int(s.timeStamp) for s in samples), default=self._since)
        if any(int(s.pid) in wanted and (s.smUtil or s.memUtil) for s in samples):
            self.busy += 1
        return self.busy

    def free(self) -> int | None:
        try:
            return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free)
        except Exception:
            return None
