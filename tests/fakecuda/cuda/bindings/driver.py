"""A stand-in for NVIDIA's ``cuda.bindings.driver`` (cuda-bindings), for tests only.

It has the names gpud's CUDA helper uses, in the raw binding style (every function returns a
tuple whose first item is a ``CUresult``), and plays the checkpoint calls against files in
the directory named by $FAKE_CUDA_DIR, read on every call:

- ``<pid>.json``, one per process that "has a CUDA context", written by the program side
  (``fakecuda_app.Context``): {"state": "running" | "locked" | "checkpointed" | "failed",
  "kernel_end": time.time() at which its in-flight kernel ends, "device_bytes", "host_bytes"}.
  Both sides change it holding an flock of ``<pid>.lock`` and write it atomically (temp file and
  os.replace), so neither reads half a file nor loses the other's change. A pid with no file, or
  whose process has exited, has no context: its calls return CUDA_ERROR_NOT_FOUND.
- ``calls.log``: every call appended as one JSON line {t (time.time()), op, pid, result}; a call
  that hangs is logged with result "hang" as it starts.
- ``hang``: op names, one per line: those calls block for ever (a call stuck in the driver).
- ``fail``: op names, one per line, each optionally followed by a CUresult name: those calls
  return that error (CUDA_ERROR_INVALID_VALUE when none is named) and change nothing.
- ``driver.json``: {"version": 12040} plays an older driver (its checkpoint calls then raise, as
  the real bindings do for a function the driver lacks); {"no_driver": true}: cuInit raises, as
  the real bindings do when libcuda.so.1 cannot be loaded.

Op names: init, version, state, lock, unlock, checkpoint, restore. As with the real driver, the
checkpoint calls return CUDA_ERROR_NOT_INITIALIZED before cuInit. A lock takes the process's
API lock at once (the program's next launch blocks), then waits, polling, for its in-flight
kernel to end; at its timeout it lets go, leaves the process running and returns NOT_READY.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_POLL_S = 0.002
_initialized = False


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUprocessState(enum.IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3


class CUcheckpointLockArgs:
    def __init__(self) -> None:
        self.timeoutMs = 0  # 0: no timeout
        self.reserved0 = 0
        self.reserved1 = [0] * 7


class CUcheckpointCheckpointArgs:
    def __init__(self) -> None:
        self.reserved = [0] * 8


class CUcheckpointRestoreArgs:
    def __init__(self) -> None:
        self.gpuPairs: list[Any] = []
        self.gpuPairsCount = 0
        self.reserved = [0] * 8


class CUcheckpointUnlockArgs:
    def __init__(self) -> None:
        self.reserved = [0] * 8


_STATE_VALUES = {s.name.removeprefix("CU_PROCESS_STATE_").lower(): s for s in CUprocessState}


# --- the files, shared with the program side (fakecuda_app) ----------------------------------------


def fake_dir() -> Path:
    return Path(os.environ["FAKE_CUDA_DIR"])


def state_path(pid: int) -> Path:
    return fake_dir() / f"{pid}.json"


@contextlib.contextmanager
def pid_lock(pid: int) -> Iterator[None]:
    """Hold the flock that every read-modify-write of ``<pid>.json`` takes."""
    fd = os.open(fake_dir() / f"{pid}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_state(pid: int) -> dict[str, Any] | None:
    try:
        with open(state_path(pid)) as f:
            state: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        return None
    return state


def write_state(pid: int, state: dict[str, Any]) -> None:
    path = state_path(pid)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


# --- hazards on demand -------------------------------------------------------------------------------


def _lines(name: str) -> list[list[str]]:
    try:
        text = (fake_dir() / name).read_text()
    except FileNotFoundError:
        return []
    return [line.split() for line in text.splitlines() if line.strip()]


def _driver_config() -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads((fake_dir() / "driver.json").read_text())
    except FileNotFoundError:
        return {}
    return config


def _log(op: str, pid: int | None, result: str, **more: Any) -> None:
    line = json.dumps({"t": time.time(), "op": op, "pid": pid, "result": result, **more}) + "\n"
    fd = os.open(fake_dir() / "calls.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write with O_APPEND: lines never interleave
    finally:
        os.close(fd)


def _hazard(op: str, pid: int | None) -> CUresult | None:
    """Block for good if ``op`` is listed in ``hang``; the error to return if it is in ``fail``."""
    if any(words[0] == op for words in _lines("hang")):
        _log(op, pid, "hang")
        threading.Event().wait()  # never set: a call stuck in the driver
    for words in _lines("fail"):
        if words[0] == op:
            return CUresult[words[1]] if len(words) > 1 else CUresult.CUDA_ERROR_INVALID_VALUE
    return None


def _done(op: str, pid: int | None, result: CUresult) -> tuple[CUresult]:
    _log(op, pid, result.name)
    return (result,)


def _checkpoint_api(name: str) -> None:
    if _driver_config().get("version", 12080) < 12080:
        raise RuntimeError(f'Function "{name}" not found')


# --- the driver API ----------------------------------------------------------------------------------


def cuInit(flags: int) -> tuple[CUresult]:
    global _initialized
    if _driver_config().get("no_driver"):
        _log("init", None, "no driver")
        raise RuntimeError('Failure finding "libcuda.so.1": the NVIDIA driver is not installed')
    failure = _hazard("init", None)
    if failure is not None:
        return _done("init", None, failure)
    _initialized = True
    return _done("init", None, CUresult.CUDA_SUCCESS)


def cuDriverGetVersion() -> tuple[CUresult, int]:
    failure = _hazard("version", None)
    if failure is not None:
        return _done("version", None, failure)[0], 0
    _log("version", None, "CUDA_SUCCESS")
    return CUresult.CUDA_SUCCESS, int(_driver_config().get("version", 12080))


def cuCheckpointProcessGetState(pid: int) -> tuple[CUresult, CUprocessState]:
    _checkpoint_api("cuCheckpointProcessGetState")
    running = CUprocessState.CU_PROCESS_STATE_RUNNING
    result = _precheck("state", pid)
    if result is not None:
        return _done("state", pid, result)[0], running
    state = read_state(pid)
    assert state is not None  # _precheck saw it
    _log("state", pid, "CUDA_SUCCESS", state=state["state"])
    return CUresult.CUDA_SUCCESS, _STATE_VALUES[state["state"]]


def _precheck(op: str, pid: int) -> CUresult | None:
    """What a call returns before it looks at the process: a hazard, no cuInit, no context."""
    failure = _hazard(op, pid)
    if failure is not None:
        return failure
    if not _initialized:
        return CUresult.CUDA_ERROR_NOT_INITIALIZED
    if read_state(pid) is None or not _alive(pid):
        return CUresult.CUDA_ERROR_NOT_FOUND
    return None


def _transition(pid: int, before: str, after: str, carry: tuple[str, str] | None = None) -> CUresult:
    """``before`` -> ``after`` (else ILLEGAL_STATE), moving ``carry``'s bytes from one figure to the other."""
    with pid_lock(pid):
        state = read_state(pid)
        if state is None:
            return CUresult.CUDA_ERROR_NOT_FOUND
        if state["state"] != before:
            return CUresult.CUDA_ERROR_ILLEGAL_STATE
        state["state"] = after
        if carry is not None:
            source, target = carry
            state[target], state[source] = state[target] + state[source], 0
        write_state(pid, state)
    return CUresult.CUDA_SUCCESS


def _move(op: str, pid: int, before: str, after: str, carry: tuple[str, str] | None = None) -> tuple[CUresult]:
    result = _precheck(op, pid)
    if result is None:
        result = _transition(pid, before, after, carry)
    return _done(op, pid, result)


def cuCheckpointProcessLock(pid: int, args: CUcheckpointLockArgs | None) -> tuple[CUresult]:
    _checkpoint_api("cuCheckpointProcessLock")
    timeout_s = (args.timeoutMs if args is not None else 0) / 1000
    result = _precheck("lock", pid)
    if result is None:
        result = _transition(pid, "running", "locked")  # the API lock: the next launch blocks
    if result != CUresult.CUDA_SUCCESS:
        return _done("lock", pid, result)
    state = read_state(pid)
    kernel_end = state["kernel_end"] if state is not None else 0.0
    give_up = time.time() + timeout_s if timeout_s else float("inf")
    while time.time() < kernel_end:  # the in-flight kernel drains; no new one starts
        if time.time() >= give_up:
            _transition(pid, "locked", "running")
            return _done("lock", pid, CUresult.CUDA_ERROR_NOT_READY)
        if not _alive(pid):
            return _done("lock", pid, CUresult.CUDA_ERROR_NOT_FOUND)
        time.sleep(_POLL_S)
    return _done("lock", pid, CUresult.CUDA_SUCCESS)


def cuCheckpointProcessUnlock(pid: int, args: CUcheckpointUnlockArgs | None) -> tuple[CUresult]:
    _checkpoint_api("cuCheckpointProcessUnlock")
    return _move("unlock", pid, "locked", "running")


def cuCheckpointProcessCheckpoint(pid: int, args: CUcheckpointCheckpointArgs | None) -> tuple[CUresult]:
    _checkpoint_api("cuCheckpointProcessCheckpoint")
    return _move("checkpoint", pid, "locked", "checkpointed", ("device_bytes", "host_bytes"))


def cuCheckpointProcessRestore(pid: int, args: CUcheckpointRestoreArgs | None) -> tuple[CUresult]:
    _checkpoint_api("cuCheckpointProcessRestore")
    return _move("restore", pid, "checkpointed", "locked", ("host_bytes", "device_bytes"))
