"""The program side of the stand-in CUDA driver (tests/fakecuda/cuda/bindings/driver.py), for tests.

A program that "uses CUDA" makes a ``Context`` and ``launch``es kernels on it. The context is the
file ``$FAKE_CUDA_DIR/<pid>.json`` that the stand-in driver's checkpoint calls act on. A launch
first waits, polling every millisecond, while the driver holds the process locked or
checkpointed (as a real CUDA call blocks under the driver's lock), then records when its kernel
will end, so a lock knows how long to wait for it, and burns CPU for that long: the "GPU work"
is CPU time a test can see stop.

A context belongs to the process that made it, as a CUDA context does: a forked child must
make its own.
"""

from __future__ import annotations

import os
import time

from cuda.bindings.driver import pid_lock, read_state, state_path, write_state

_POLL_S = 0.001


class Context:
    def __init__(self, device_bytes: int = 0) -> None:
        self.pid = os.getpid()
        self.device_bytes = device_bytes
        with pid_lock(self.pid):
            write_state(
                self.pid, {"state": "running", "kernel_end": 0.0, "device_bytes": device_bytes, "host_bytes": 0}
            )

    def launch(self, seconds: float) -> None:
        """Run one kernel of ``seconds``; blocks first while the driver holds the process."""
        if os.getpid() != self.pid:
            raise RuntimeError("a CUDA context does not survive fork: make one in the child")
        while (end := self._start(seconds)) is None:
            time.sleep(_POLL_S)
        while time.time() < end:
            pass  # the kernel

    def _start(self, seconds: float) -> float | None:
        with pid_lock(self.pid):
            state = read_state(self.pid)
            if state is None:
                raise RuntimeError("the CUDA context is gone")
            if state["state"] == "failed":
                raise RuntimeError("the CUDA context failed in a checkpoint or restore")
            if state["state"] != "running":
                return None
            state["kernel_end"] = time.time() + seconds
            write_state(self.pid, state)
            end: float = state["kernel_end"]
            return end

    def close(self) -> None:
        state_path(self.pid).unlink(missing_ok=True)
