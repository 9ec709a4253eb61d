"""The CUDA driver helper, ``python -m gpud_client.proctl.cuda_helper``, and the messages it speaks.

The cuda backend makes its checkpoint calls through this long-lived process, never in the run
itself: a call can hang in the driver for good (on a stopped target, behind an in-flight
checkpoint), and only a process can be killed out of one. It imports ``cuda.bindings.driver``
(the ``gpud-client[cuda]`` extra) and calls ``cuInit(0)`` once, since the driver attach costs
seconds and a call after it milliseconds. It then says it is ready (one answer, ok or the reason
it cannot call the driver), reads one request per line on stdin (JSON) and writes one answer per
line on stdout, in order, until stdin ends.

``HelperProcess`` is the run's end of the pipe (used by ``cuda.CudaDriver``): it starts the
helper and reads each answer by a deadline, so that a hung call can be ended with SIGKILL.

The helper never crashes on a driver that is missing, old or refusing: a failed import or cuInit, or a
call that raises, becomes an answer with ok false and the reason. It never writes anything but
answers on its stdout (what the driver or Python print goes to stderr).
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import IO, Annotated, Any, Literal, assert_never

import msgspec
from msgspec import Meta

MODULE = "gpud_client.proctl.cuda_helper"
MIN_DRIVER_VERSION = 12080  # CUDA 12.8: the first driver with the checkpoint API
MAX_LINE_BYTES = 65_536  # a request or an answer is a few hundred bytes
CHECKPOINT_FUNCTIONS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "CUcheckpointLockArgs",
)
INSTALL_HINT = "pip install gpud-client[cuda]"

Pid = Annotated[int, Meta(ge=1, le=4_194_304)]  # the kernel's largest pid_max
# 0 would mean "no timeout" to the driver; a lock must end by itself well before its deadline's kill
LockTimeoutMs = Annotated[int, Meta(ge=1, le=3_600_000)]
ProcessState = Literal["running", "locked", "checkpointed", "failed"]
# CUprocessState's values (CU_PROCESS_STATE_*); newer drivers add CHECKPOINTING 4 and RESTORING 5
STATES: dict[int, ProcessState] = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class _Request(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    pass


class Probe(_Request, frozen=True, kw_only=True, tag="probe"):
    """Whether the checkpoint API can be used: the driver's version and the bindings' functions."""


class GetState(_Request, frozen=True, kw_only=True, tag="state"):
    pid: Pid


class Lock(_Request, frozen=True, kw_only=True, tag="lock"):
    pid: Pid
    timeout_ms: LockTimeoutMs


class Unlock(_Request, frozen=True, kw_only=True, tag="unlock"):
    pid: Pid


class Checkpoint(_Request, frozen=True, kw_only=True, tag="checkpoint"):
    pid: Pid


class Restore(_Request, frozen=True, kw_only=True, tag="restore"):
    pid: Pid


Request = Probe | GetState | Lock | Unlock | Checkpoint | Restore


class Answer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One answer. Not ok: ``error`` says why; ``code`` and ``name`` are the CUresult when the
    driver returned one (none when the driver could not be called at all)."""

    ok: bool
    error: str = ""
    code: int | None = None
    name: str = ""
    state: ProcessState | None = None  # GetState
    version: int | None = None  # Probe: cuDriverGetVersion, 1000 * major + 10 * minor
    supported: bool | None = None  # Probe


def op_of(req: Request) -> str:
    return type(req).__struct_config__.tag  # type: ignore[return-value]


# --- the run's end of the pipe ---------------------------------------------------------------


class HelperProcess:
    """The run's end: one helper process, and the lines it answers, each by a deadline."""

    def __init__(self, env: Mapping[str, str] | None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())},
            start_new_session=True,  # a Ctrl-C at the terminal must not interrupt a driver call
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin = self.proc.stdin
        self._fd = self.proc.stdout.fileno()
        self._poll = select.poll()  # not select.select: it fails for a descriptor past 1023
        self._poll.register(self._fd, select.POLLIN)
        self._buf = bytearray()

    def send(self, line: bytes) -> None:
        self._stdin.write(line)  # one small request at a time: the pipe never fills
        self._stdin.flush()

    def read_line(self, deadline: float) -> bytes:
        """The next answer line; raises TimeoutError past ``deadline``, EOFError if the helper ended."""
        while (end := self._buf.find(b"\n")) < 0:
            if len(self._buf) > MAX_LINE_BYTES:
                raise EOFError(f"an answer longer than {MAX_LINE_BYTES} bytes")
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(math.ceil(left * 1000)):
                raise TimeoutError
            chunk = os.read(self._fd, 65_536)
            if not chunk:
                raise EOFError("end of its answers")
            self._buf += chunk
        line = bytes(self._buf[: end + 1])
        del self._buf[: end + 1]
        return line

    def kill(self) -> int:
        """SIGKILL and reap it; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        status = self.proc.wait()
        self._close_pipes()
        return status

    def close(self, wait_s: float = 1.0) -> None:
        """Let it end at the end of its requests; killed if it does not (stuck in the driver)."""
        try:
            self._stdin.close()
            self.proc.wait(wait_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


# --- the helper process ------------------------------------------------------------------------


def _load() -> tuple[Any, str]:
    """The driver module after cuInit, or None and why it cannot be used."""
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:
        return None, f"cuda-bindings is not installed ({e}): {INSTALL_HINT}"
    try:
        result = driver.cuInit(0)
    except Exception as e:  # the bindings raise when libcuda.so.1 cannot be loaded
        return None, f"no CUDA driver: {type(e).__name__}: {e}"
    if int(result[0]) != 0:
        return None, f"no CUDA driver: cuInit failed with {_name(result[0])}"
    return driver, ""


def _name(code: Any) -> str:
    return str(getattr(code, "name", code))


def _failed(code: Any, what: str) -> Answer:
    return Answer(ok=False, error=f"{what} failed with {_name(code)}", code=int(code), name=_name(code))


def _probe(driver: Any) -> Answer:
    missing = [name for name in CHECKPOINT_FUNCTIONS if not hasattr(driver, name)]
    if missing:
        why = f"cuda-bindings lacks {', '.join(missing)} (too old): pip install -U gpud-client[cuda]"
        return Answer(ok=False, error=why, supported=False)
    err, version = driver.cuDriverGetVersion()
    if int(err) != 0:
        return _failed(err, "cuDriverGetVersion")
    version = int(version)
    if version < MIN_DRIVER_VERSION:
        why = f"the CUDA driver is {_cuda(version)}; the checkpoint API needs {_cuda(MIN_DRIVER_VERSION)} or newer"
        return Answer(ok=False, error=why, version=version, supported=False)
    return Answer(ok=True, version=version, supported=True)


def _cuda(version: int) -> str:
    return f"CUDA {version // 1000}.{version % 1000 // 10}"


def _call(driver: Any, req: Request) -> Answer:
    """One request against the driver; what each op calls, and how its result reads."""
    match req:
        case Probe():
            return _probe(driver)
        case GetState(pid=pid):
            err, state = driver.cuCheckpointProcessGetState(pid)
            if int(err) != 0:
                return _failed(err, f"cuCheckpointProcessGetState({pid})")
            if int(state) not in STATES:
                return Answer(ok=False, error=f"pid {pid} is in CUDA process state {int(state)}, unknown to gpud")
            return Answer(ok=True, state=STATES[int(state)])
        case Lock(pid=pid, timeout_ms=timeout_ms):
            args = driver.CUcheckpointLockArgs()
            args.timeoutMs = timeout_ms
            result = driver.cuCheckpointProcessLock(pid, args)
        case Unlock(pid=pid):
            result = driver.cuCheckpointProcessUnlock(pid, None)
        case Checkpoint(pid=pid):
            result = driver.cuCheckpointProcessCheckpoint(pid, None)
        case Restore(pid=pid):
            result = driver.cuCheckpointProcessRestore(pid, None)
        case _:
            assert_never(req)
    if int(result[0]) != 0:
        return _failed(result[0], f"{op_of(req)} of pid {pid}")
    return Answer(ok=True)


def answer(driver: Any, unusable: str, req: Request) -> Answer:
    if driver is None:
        return Answer(ok=False, error=unusable)
    try:
        return _call(driver, req)
    except Exception as e:  # e.g. a function the driver lacks: the bindings raise RuntimeError
        return Answer(ok=False, error=f"{op_of(req)}: {type(e).__name__}: {e}")


def _answers_channel() -> IO[bytes]:
    """Our stdout, kept for answers alone; fd 1 and sys.stdout then point at stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "wb")


def _requests(stdin: IO[bytes]) -> Any:
    """Each request line, or a bytes object too long to be one (its rest is skipped)."""
    while line := stdin.readline(MAX_LINE_BYTES + 1):
        if len(line) > MAX_LINE_BYTES:
            while (rest := stdin.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield line


PARENT_ENV = "GPUD_CUDA_HELPER_PARENT"


def _die_with_the_run() -> None:
    """A call hung in the driver must not outlive the run that made it: SIGKILL when the run goes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if str(os.getppid()) != os.environ.get(PARENT_ENV, str(os.getppid())):
        os._exit(1)  # the run went before the request took hold


def main() -> int:
    _die_with_the_run()
    out = _answers_channel()
    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(Request)
    driver, unusable = _load()

    def send(a: Answer) -> None:
        out.write(encoder.encode(a) + b"\n")
        out.flush()

    send(Answer(ok=driver is not None, error=unusable))  # ready
    for line in _requests(sys.stdin.buffer):
        if line is None:
            send(Answer(ok=False, error=f"bad request: longer than {MAX_LINE_BYTES} bytes"))
            continue
        try:
            req = decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            send(Answer(ok=False, error=f"bad request: {e}"))
            continue
        send(answer(driver, unusable, req))
    return 0


if __name__ == "__main__":
    sys.exit(main())
