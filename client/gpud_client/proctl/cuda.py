"""The ``cuda`` backend: pause a process tree with the CUDA driver's checkpoint API, and park its
GPU memory in host memory.

``CudaDriver`` makes the driver calls through one long-lived helper process (``cuda_helper``),
one request at a time, each under a deadline: a call can hang in the driver for good, and a
hung helper is killed (SIGKILL, reaped) and replaced by a fresh one at the next call. A call
past its deadline, or a helper that dies during one, raises a fatal ControlError: the target's
state is then unknown.

``CudaBackend`` pauses each process of the tree by what the driver says of it. A process with
a CUDA context is locked: its new CUDA calls block, its submitted GPU work drains, its CPU
threads run on. A process without one, or whose GPU work does not drain within the lock's
timeout, is stopped with SIGSTOP instead (``SignalBackend``). It must never do both to one
process, and never call the driver on a process it stopped: the driver's calls hang on a
stopped target, which is why a process found already stopped is left alone. It keeps, per pid,
what it did (locked, parked, stopped) from a pause to the resume that undoes it; a call that
refuses (not enough memory) changes none of it.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import assert_never

import msgspec

from gpud_client.proctl.base import ControlError, Paused
from gpud_client.proctl.cuda_helper import (
    Answer,
    Checkpoint,
    GetState,
    HelperProcess,
    Lock,
    Probe,
    ProcessState,
    Request,
    Restore,
    Unlock,
    op_of,
)
from gpud_client.proctl.signals import SignalBackend
from gpud_client.proctl.tree import ProcessTree, read_stat

LOCK_TIMEOUT_MS = 1000
HOST_MEMORY_MARGIN = 0.10  # MemAvailable must exceed what parking moves by this much
MAX_SCANS = 100  # a tree still growing after this many looks is refused
_GONE_STATES = frozenset("ZX")
_STOPPED_STATES = frozenset("Tt")
MiB = 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class Deadlines:
    """How long each helper call may take, in seconds, before the helper is killed."""

    start_s: float = 30.0  # the interpreter, importing cuda-bindings, cuInit (the driver attach: seconds)
    probe_s: float = 10.0
    state_s: float = 5.0
    lock_extra_s: float = 2.0  # past the lock's own timeout_ms
    unlock_s: float = 5.0
    checkpoint_s: float = 120.0  # GPU memory moves at 1-7 GB/s: tens of seconds for a large GPU
    restore_s: float = 120.0

    def of(self, req: Request) -> float:
        match req:
            case Lock(timeout_ms=timeout_ms):
                return timeout_ms / 1000 + self.lock_extra_s
            case Probe():
                return self.probe_s
            case GetState():
                return self.state_s
            case Unlock():
                return self.unlock_s
            case Checkpoint():
                return self.checkpoint_s
            case Restore():
                return self.restore_s
            case _:
                assert_never(req)


class CudaError(ControlError):
    """The driver (or the helper, on its behalf) refused one call. ``code`` and ``name`` are the
    CUresult, None and "" when the driver could not be called at all."""

    def __init__(self, op: str, pid: int | None, answer: Answer) -> None:
        super().__init__(answer.error or f"{op} failed")
        self.op = op
        self.pid = pid
        self.code = answer.code
        self.name = answer.name


class CudaDriver:
    """The CUDA checkpoint calls, made by a helper process started at the first call.

    ``env`` is the helper's environment (this process's when None). Thread-safe: calls from
    several threads are sent one at a time."""

    def __init__(self, *, deadlines: Deadlines | None = None, env: Mapping[str, str] | None = None) -> None:
        self.deadlines = deadlines or Deadlines()
        self.env = env
        self._helper: HelperProcess | None = None
        self._mutex = threading.Lock()
        self._decoder = msgspec.json.Decoder(Answer)
        self._encoder = msgspec.json.Encoder()

    @property
    def helper_pid(self) -> int | None:
        """The running helper's pid (it is never part of a tree to pause)."""
        return self._helper.proc.pid if self._helper is not None else None

    def probe(self) -> str | None:
        """None when the checkpoint API can be used; else why not (no driver, an old driver,
        cuda-bindings missing), in words."""
        try:
            answer = self._call(Probe())
        except ControlError as e:
            return f"the CUDA driver helper failed: {e}"
        return None if answer.ok else answer.error

    def state(self, pid: int) -> ProcessState:
        answer = self._checked(GetState(pid=pid))
        assert answer.state is not None
        return answer.state

    def lock(self, pid: int, timeout_ms: int) -> None:
        """Lock: its CUDA calls block once its submitted work drained. Raises CudaError with
        name CUDA_ERROR_NOT_READY when the work did not drain in ``timeout_ms`` (left running)."""
        self._checked(Lock(pid=pid, timeout_ms=timeout_ms))

    def unlock(self, pid: int) -> None:
        self._checked(Unlock(pid=pid))

    def checkpoint(self, pid: int) -> None:
        """Move a locked process's GPU memory to host memory, releasing the GPU's."""
        self._checked(Checkpoint(pid=pid))

    def restore(self, pid: int) -> None:
        """Bring a checkpointed process's memory back to the GPU; it is then locked."""
        self._checked(Restore(pid=pid))

    def close(self) -> None:
        with self._mutex:
            if self._helper is not None:
                self._helper.close()
                self._helper = None

    def _checked(self, req: Request) -> Answer:
        answer = self._call(req)
        if not answer.ok:
            raise CudaError(op_of(req), getattr(req, "pid", None), answer)
        return answer

    def _call(self, req: Request) -> Answer:
        with self._mutex:
            helper = self._ready_helper()
            deadline_s = self.deadlines.of(req)
            try:
                helper.send(self._encoder.encode(req) + b"\n")
                line = helper.read_line(time.monotonic() + deadline_s)
                return self._decoder.decode(line)
            except TimeoutError:
                raise self._lost(f"passed its {deadline_s:g} s deadline", req) from None
            except (OSError, EOFError, msgspec.DecodeError, msgspec.ValidationError) as e:
                raise self._lost(f"lost its helper ({e})", req) from e

    def _ready_helper(self) -> HelperProcess:
        if self._helper is not None and self._helper.proc.poll() is not None:
            self._helper.kill()  # it died between calls, with nothing in flight: start afresh
            self._helper = None
        if self._helper is None:
            helper = HelperProcess(self.env)
            try:
                helper.read_line(time.monotonic() + self.deadlines.start_s)  # ready, or why not
            except TimeoutError:
                helper.kill()
                raise ControlError(
                    f"the CUDA driver helper did not start within {self.deadlines.start_s:g} s"
                ) from None
            except EOFError as e:
                helper.kill()
                raise ControlError(f"the CUDA driver helper exited as it started ({e})") from e
            self._helper = helper
        return self._helper

    def _lost(self, what: str, req: Request) -> ControlError:
        """Kill the helper after a call that did not come back; the error that says so."""
        assert self._helper is not None
        helper, self._helper = self._helper, None
        pid = getattr(req, "pid", None)
        status = helper.kill()
        target, unknown = (f" on pid {pid}", "; that process's state is unknown") if pid is not None else ("", "")
        return ControlError(
            f"CUDA driver call {op_of(req)}{target} {what}: its helper (pid {helper.proc.pid}, "
            f"exit status {status}) is gone{unknown}",
            fatal=True,
        )


class _Held(enum.Enum):
    LOCKED = "locked"
    PARKED = "parked"  # locked and checkpointed
    STOPPED = "stopped"  # SIGSTOP


def _unknown(pid: int) -> int | None:
    return None


class CudaBackend:
    """Pause, park and resume a tree through the CUDA checkpoint API (see the module's comment).

    ``gpu_free``: the GPU's free memory in bytes now (None: unknown), checked before a restore.
    ``memory_of``: the bytes a pid held on the GPU before it was parked (None: unknown); or
    ``tree_memory``: what the whole tree holds (gpud's reading of a run's program), when known."""

    name = "cuda"

    def __init__(
        self,
        *,
        driver: CudaDriver | None = None,
        signals: SignalBackend | None = None,
        lock_timeout_ms: int = LOCK_TIMEOUT_MS,
        gpu_free: Callable[[], int | None] | None = None,
        memory_of: Callable[[int], int | None] = _unknown,
        tree_memory: Callable[[], int | None] | None = None,
    ) -> None:
        self.driver = driver or CudaDriver()
        self.signals = signals or SignalBackend()
        self.lock_timeout_ms = lock_timeout_ms
        self._parked_bytes: dict[int, int] = {}  # what each parked pid held on the GPU when parked
        self.gpu_free = gpu_free
        self.memory_of = memory_of
        self.tree_memory = tree_memory
        self._held: dict[int, _Held] = {}
        self._undrained: set[int] = set()  # has a context, but was stopped: its memory cannot be parked

    @property
    def can_park(self) -> bool:
        return True

    def held(self) -> dict[int, str]:
        """A snapshot: what this backend holds each pid in (locked, parked, stopped)."""
        return {pid: h.value for pid, h in self._held.items()}

    def pause(self, tree: ProcessTree) -> Paused:
        """Lock or stop every process of the tree, looking again until no new one appears. One
        that raises leaves what it did recorded, so ``resume`` undoes it."""
        done = Paused()
        seen = set(self._held)
        for _ in range(MAX_SCANS):
            new = [pid for pid in tree.pids() if pid not in seen and pid != self.driver.helper_pid]
            if not new:
                return done
            seen.update(new)
            for pid in new:
                self._pause_one(pid, done)
        raise ControlError(f"the tree kept gaining processes through {MAX_SCANS} looks; what was paused stays so")

    def _pause_one(self, pid: int, done: Paused) -> None:
        st = read_stat(pid)
        if st is None or st.state in _GONE_STATES:
            return
        if st.state in _STOPPED_STATES:  # a driver call on it would hang; it runs no code anyway
            done.fallbacks.append(f"pid {pid}: already stopped before the pause; left as it is")
            return
        try:
            state = self.driver.state(pid)
        except CudaError as e:
            if e.code is None:
                raise  # the driver itself cannot be called
            if not _gone(pid):
                self._stop(pid, done)  # no CUDA context
            return
        match state:
            case "running":
                self._lock(pid, done)
            case "locked" | "checkpointed":  # by an earlier controller: ours to undo now
                self._held[pid] = _Held.LOCKED if state == "locked" else _Held.PARKED
                done.locked.append(pid)
                done.fallbacks.append(f"pid {pid}: was already {state}; adopted as it is")
            case "failed":
                raise ControlError(f"pid {pid} is in the CUDA FAILED state: its GPU state is lost", fatal=True)
            case _:
                assert_never(state)

    def _lock(self, pid: int, done: Paused) -> None:
        try:
            self.driver.lock(pid, self.lock_timeout_ms)
        except CudaError as e:
            if _gone(pid):
                return
            if e.name == "CUDA_ERROR_NOT_READY":  # the driver left it running, its memory on the GPU
                why = f"its GPU work did not drain within {self.lock_timeout_ms} ms"
                self._undrained.add(pid)
            elif e.name == "CUDA_ERROR_NOT_FOUND":
                why = "its CUDA context went away"
            else:
                raise ControlError(f"could not lock pid {pid}: {e}") from e
            if self._stop(pid, done):
                done.fallbacks.append(f"pid {pid}: {why} ({e.name}); stopped with SIGSTOP instead")
            return
        self._held[pid] = _Held.LOCKED
        done.locked.append(pid)

    def _stop(self, pid: int, done: Paused) -> bool:
        for stopped in self.signals.stop([pid]):
            self._held[stopped] = _Held.STOPPED
            done.stopped.append(stopped)
        return pid in self._held

    def park(self, tree: ProcessTree) -> int:
        """Checkpoint every locked pid; the bytes moved (by ``memory_of``; 0 if unknown).
        Refuses, checkpointing nothing, when MemAvailable does not exceed that plus 10 %."""
        kept = sorted(pid for pid in self._undrained if self._held.get(pid) is _Held.STOPPED and not _gone(pid))
        if kept:
            raise ControlError(
                f"pid {kept[0]} keeps its GPU memory: its work did not drain within the lock's timeout, so it "
                "was stopped with SIGSTOP, and a stopped process cannot be checkpointed; nothing was parked"
            )
        locked = [pid for pid, h in self._held.items() if h is _Held.LOCKED]
        sizes = self._sizes(locked)  # read before: NVML shows nothing of a parked process
        need = sum(sizes.values())
        available = _mem_available()
        if available <= need * (1 + HOST_MEMORY_MARGIN):
            raise ControlError(
                f"host memory is short: MemAvailable is {available / MiB:,.0f} MiB, parking needs "
                f"{need / MiB:,.0f} MiB plus {HOST_MEMORY_MARGIN:.0%}; nothing was parked"
            )
        moved = 0
        for pid in locked:
            size = sizes[pid]
            try:
                self.driver.checkpoint(pid)
            except CudaError as e:
                if _gone(pid):
                    del self._held[pid]
                    continue
                raise ControlError(f"checkpoint of pid {pid} failed: {e}; its GPU state is unknown", fatal=True) from e
            self._held[pid] = _Held.PARKED
            self._parked_bytes[pid] = size
            moved += size
        return moved

    def resume(self, tree: ProcessTree) -> None:
        """Restore the parked pids, then unlock every locked one, then SIGCONT the stopped ones.
        Refuses, changing nothing, when the GPU has less free memory than the parked pids need."""
        parked = [pid for pid, h in self._held.items() if h is _Held.PARKED]
        self._claim_gpu_memory(parked)
        for pid in parked:  # all restored before any is unlocked: no rank runs while one is missing
            if self._undo(pid, "restore", self.driver.restore):
                self._held[pid] = _Held.LOCKED
            self._parked_bytes.pop(pid, None)
        for pid in [pid for pid, h in self._held.items() if h is _Held.LOCKED]:
            if self._undo(pid, "unlock", self.driver.unlock):
                del self._held[pid]
        stopped = [pid for pid, h in self._held.items() if h is _Held.STOPPED]
        self.signals.cont(stopped)
        for pid in stopped:
            del self._held[pid]
        self._undrained.clear()

    def _claim_gpu_memory(self, parked: list[int]) -> None:
        """Refuse a restore that cannot fit: a restore failing for memory loses the process for
        good. A check, not a reservation: memory taken between it and the restore still fails it."""
        if not parked or self.gpu_free is None:
            return
        free = self.gpu_free()
        need = sum(self._parked_bytes.get(pid, 0) for pid in parked)
        if free is not None and free < need:
            raise ControlError(
                f"the GPU has {free / MiB:,.0f} MiB free, the parked processes need {need / MiB:,.0f} MiB; "
                "they stay parked"
            )

    def _undo(self, pid: int, what: str, call: Callable[[int], None]) -> bool:
        """One restore or unlock; False (and forgotten) when the process had exited."""
        try:
            call(pid)
        except CudaError as e:
            if _gone(pid):
                del self._held[pid]
                return False
            raise ControlError(f"{what} of pid {pid} failed: {e}; the process cannot go on", fatal=True) from e
        return True

    def close(self) -> None:
        self.driver.close()

    def _sizes(self, pids: list[int]) -> dict[int, int]:
        """What each pid holds on the GPU: ``memory_of`` per pid, or ``tree_memory``'s total counted
        on the first (what the claim before a restore adds up is the same)."""
        if self.tree_memory is None:
            return {pid: self.memory_of(pid) or 0 for pid in pids}
        total = (self.tree_memory() or 0) if pids else 0
        return {pid: total if i == 0 else 0 for i, pid in enumerate(pids)}


def _gone(pid: int) -> bool:
    st = read_stat(pid)
    return st is None or st.state in _GONE_STATES


def _mem_available(path: str = "/proc/meminfo") -> int:
    with open(path) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ControlError(f"{path} has no MemAvailable line")
