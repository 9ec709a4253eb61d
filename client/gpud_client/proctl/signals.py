"""The ``signal`` backend: SIGSTOP and SIGCONT of the whole process tree.

Works everywhere, for any program, with no driver: a stopped process runs no
code, so it makes no new GPU calls. It frees no GPU memory, and GPU work the
program had already queued runs on to its end (the GPU is not told), so the
next holder may share the GPU with that tail for as long as it lasts.

A pause stops every process of the tree, looks again for processes started
meanwhile until none is new, and returns once /proc shows every one of them
stopped (or gone): the program can no longer make progress when ``pause``
returns. ``resume`` continues exactly the processes the pause stopped.
"""

from __future__ import annotations

import os
import signal
import time

from gpud_client.proctl.base import ControlError, Paused
from gpud_client.proctl.tree import ProcessTree, read_stat

STOPPED_STATES = frozenset("TtZX")  # stopped, traced, zombie, dead: none of them runs
STOP_WAIT_S = 5.0  # a process that is not stopped by then is stuck in the kernel (state D)
_POLL_S = 0.0001


class SignalBackend:
    name = "signal"

    def __init__(self, *, stop_wait_s: float = STOP_WAIT_S) -> None:
        self.stop_wait_s = stop_wait_s
        self._stopped: list[int] = []

    @property
    def can_park(self) -> bool:
        return False

    def pause(self, tree: ProcessTree) -> Paused:
        stopped: list[int] = []
        seen: set[int] = set()
        while True:
            new = [pid for pid in tree.pids() if pid not in seen]
            if not new:
                break
            seen.update(new)
            stopped.extend(self.stop(new))
        self._stopped = stopped
        return Paused(stopped=list(stopped))

    def resume(self, tree: ProcessTree) -> None:
        pids, self._stopped = self._stopped, []
        self.cont(pids)

    def park(self, tree: ProcessTree) -> int:
        raise ControlError("the signal backend cannot park GPU memory (it needs the CUDA driver's checkpoint API)")

    def close(self) -> None:
        pass

    # --- the parts the cuda backend uses for processes without a CUDA context ----

    def stop(self, pids: list[int]) -> list[int]:
        """SIGSTOP ``pids`` and wait until each is stopped or gone; returns those that were signalled."""
        sent = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            sent.append(pid)
        deadline = time.monotonic() + self.stop_wait_s
        waiting = list(sent)
        while waiting:
            waiting = [pid for pid in waiting if not _stopped(pid)]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise ControlError(
                    f"process {waiting[0]} did not stop within {self.stop_wait_s} s of SIGSTOP "
                    "(stuck in an uninterruptible system call?)",
                    fatal=True,
                )
            time.sleep(_POLL_S)
        return sent

    def cont(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _stopped(pid: int) -> bool:
    st = read_stat(pid)
    return st is None or st.state in STOPPED_STATES
