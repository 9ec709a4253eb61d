"""The ``signal`` backend: SIGSTOP and SIGCONT of the whole process tree.

Works everywhere, for any program, with no driver: a stopped process runs no
code, so it makes no new GPU calls. It frees no GPU memory, and GPU work the
program had already queued runs on to its end (the GPU is not told), so the
next holder may share the GPU with that tail for as long as it lasts.

A pause stops every process of the tree, looks again for processes started
meanwhile until none is new, and returns once /proc shows every one of them
stopped (or gone): the program can no longer make progress when ``pause``
returns. ``resume`` continues exactly the processes the pause stopped.

A stopped process runs again on any SIGCONT of its uid, from anywhere. So while
the tree is paused a watcher (``watch_s``, a thread) looks at what it stopped:
a process that is no longer stopped, or that used CPU time after the first look
(the first look only takes the tail of a group stop, as its last threads stop),
escaped; it is stopped again at once and told to ``on_escape`` (the run counts
it, reports it to gpud and ends the program after too many). A process that
appeared in the tree meanwhile is stopped too, but is no escape: only a running
process forks, so it is a fork the stop caught in flight, or the child of a
process that escaped (and was counted). It
never continues a process, and stops watching before ``resume`` continues any.
Where gpud has a cgroup for the program, it freezes it instead (``cgroup.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpud_client.proctl.base import ControlError, Paused
from gpud_client.proctl.tree import CLK_TCK, ProcessTree, read_stat

STOPPED_STATES = frozenset("TtZX")  # stopped, traced, zombie, dead: none of them runs
STOP_WAIT_S = 5.0  # a process that is not stopped by then is stuck in the kernel (state D)
WATCH_S = 0.01  # how often a paused tree is looked at for escapes
ESCAPE_TICKS = 2  # CPU time a stopped process may gain between two looks (a group stop's tail)
RESCAN_EVERY = 10  # looks between two looks for processes new in the tree
_POLL_S = 0.0001
_RESEND_S = 0.002


@dataclass(frozen=True, slots=True)
class Escape:
    """A process of a paused tree seen running, stopped again (``fatal``: it could not be)."""

    pid: int
    why: str
    fatal: bool = False


class SignalBackend:
    name = "signal"

    def __init__(
        self,
        *,
        stop_wait_s: float = STOP_WAIT_S,
        watch_s: float = WATCH_S,
        on_escape: Callable[[Escape], None] | None = None,
    ) -> None:
        self.stop_wait_s = stop_wait_s
        self.watch_s = watch_s
        self.on_escape = on_escape  # None: not watched
        self._stopped: list[int] = []
        self._mutex = threading.Lock()  # a look of the watcher, or a resume: never both at once
        self._watcher: _Watcher | None = None

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
        if self.on_escape is not None:
            self._unwatch()
            self._watcher = _Watcher(self, tree, stopped)
            self._watcher.start()
        return Paused(stopped=list(stopped))

    def resume(self, tree: ProcessTree) -> None:
        self._unwatch()
        pids, self._stopped = self._stopped, []
        self.cont(pids)

    def park(self, tree: ProcessTree) -> int:
        raise ControlError("the signal backend cannot park GPU memory (it needs the CUDA driver's checkpoint API)")

    def close(self) -> None:
        self._unwatch()

    def _unwatch(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with self._mutex:  # a look in progress ends first: nothing is stopped after this
                watcher.done.set()

    # --- the parts the cuda backend uses for processes without a CUDA context ----

    def stop(self, pids: list[int]) -> list[int]:
        """SIGSTOP ``pids`` and wait until each is stopped or gone; returns those that were signalled.
        SIGSTOP is sent again while one runs: a SIGCONT from outside may come between."""
        sent = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            sent.append(pid)
        deadline = time.monotonic() + self.stop_wait_s
        resend = time.monotonic() + _RESEND_S
        waiting = list(sent)
        while waiting:
            waiting = [pid for pid in waiting if not _stopped(pid)]
            if not waiting:
                break
            if time.monotonic() > resend:
                resend = time.monotonic() + _RESEND_S
                for pid in waiting:
                    _signal(pid, signal.SIGSTOP)
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


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stopped(pid: int) -> bool:
    st = read_stat(pid)
    return st is None or st.state in STOPPED_STATES


class _Watcher(threading.Thread):
    """Looks at a paused tree every ``watch_s`` until told to stop (see the module's comment)."""

    def __init__(self, backend: SignalBackend, tree: ProcessTree, pids: list[int]) -> None:
        super().__init__(name="gpud-run-escapes", daemon=True)
        self.backend = backend
        self.tree = tree
        self.done = threading.Event()
        self.ticks = {pid: st.cpu_ticks for pid in pids if (st := read_stat(pid)) is not None}
        self.settled = False  # the first look takes the group stop's tail as the baseline

    def run(self) -> None:
        b = self.backend
        looks = 0
        while not self.done.wait(b.watch_s):
            looks += 1
            with b._mutex:
                if self.done.is_set():
                    return
                escapes = self.look(rescan=looks % RESCAN_EVERY == 0)
            for e in escapes:
                if b.on_escape is not None:
                    b.on_escape(e)
                if e.fatal:
                    return

    def look(self, *, rescan: bool) -> list[Escape]:
        found: list[Escape] = []
        for pid, before in list(self.ticks.items()):
            st = read_stat(pid)
            if st is None or st.state in "ZX":
                del self.ticks[pid]
            elif st.state not in STOPPED_STATES:
                found.append(self.stop_again(pid, f"it was running (state {st.state}) while paused"))
            elif self.settled and st.cpu_ticks - before >= ESCAPE_TICKS:
                ms = (st.cpu_ticks - before) * 1000 // CLK_TCK
                found.append(self.stop_again(pid, f"it used {ms} ms of CPU time while paused"))
            else:
                self.ticks[pid] = st.cpu_ticks
        self.settled = True
        if rescan:
            for pid in self.tree.pids():
                st = read_stat(pid)
                if pid not in self.ticks and st is not None and st.state not in "ZX":
                    late = self.stop_again(pid, "it started while the tree was paused")
                    self.backend._stopped.append(pid)
                    if late.fatal:
                        found.append(late)
        return found

    def stop_again(self, pid: int, why: str) -> Escape:
        try:
            self.backend.stop([pid])
        except ControlError as exc:
            return Escape(pid, f"{why}, and could not be stopped again: {exc}", fatal=True)
        st = read_stat(pid)
        self.ticks[pid] = st.cpu_ticks if st is not None else 0
        return Escape(pid, why)
