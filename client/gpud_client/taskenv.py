"""What a task on an allocation runs with, and the changes made in this process to run one.

``allocation_env`` is the one definition of the environment an allocation gives a task (gpuctl
prints it, the Airflow integration sets it); ``ProcessChanges`` records what a task's try changed
in this process (the environment, the CPU affinity, the SIGTERM handler) and puts it back.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from types import FrameType

from gpud_client import protocol as p


def allocation_env(allocated: p.Allocated, socket_path: str | None = None) -> dict[str, str]:
    """The devices, in gpud's order (NVML's, by PCI bus: CUDA's default order may differ), the share
    and the CPU cores; and the daemon's socket, for a task that opens sessions of its own."""
    env = {
        "CUDA_VISIBLE_DEVICES": allocated.cuda_visible_devices,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPUD_TASK_ID": allocated.task_id,
        "GPUD_GPU_SHARE": f"{allocated.share:g}",
        "GPUD_CPUS": ",".join(map(str, allocated.cpus)),
    }
    if socket_path is not None:
        env["GPUD_SOCKET"] = socket_path
    return env


class ProcessChanges:
    """What a task's try changed in this process, and how to put it back (``undo``, in order)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def on_sigterm(self, stop: Callable[[], BaseException]) -> None:
        """SIGTERM runs the handler it had, then raises ``stop()`` in the main thread."""
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except ValueError:  # pragma: no cover - not the main thread
            return

        def terminate(signum: int, frame: FrameType | None) -> None:
            if callable(previous):
                previous(signum, frame)
            raise stop()

        try:
            signal.signal(signal.SIGTERM, terminate)
        except ValueError:  # pragma: no cover - not the main thread
            return

        def put_back() -> None:
            signal.signal(signal.SIGTERM, previous)

        self._undo.append(put_back)

    def environment(self, values: dict[str, str]) -> None:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)

        def put_back() -> None:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        self._undo.append(put_back)

    def affinity(self, cpus: list[int]) -> None:
        if not cpus:
            return
        saved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        self._undo.append(lambda: os.sched_setaffinity(0, saved))

    def undo(self) -> None:
        """In the order of the changes (a SIGTERM handler set first is put back first)."""
        undo, self._undo = self._undo, []
        for step in undo:
            step()
