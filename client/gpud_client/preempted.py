"""What an integration (Airflow, Ray) does on its task's own process when gpud takes the task's
allocation back: the recovery its ``on_preempt`` names.

The integration allocates in the task's process, so gpud's PREEMPT comes to its client. A
``Preemption`` listens there from before the ALLOCATE (the reader thread only puts the pushes for
its task on a queue) and acts once the task's code runs (``with preemption.running(resume):``,
entered on the main thread), from a thread of its own:

- terminate, fail: SIGTERM to the main thread, whose handler (installed for the try) raises
  ``Stopped`` there, a BaseException that ``except Exception`` does not swallow: the code stops where
  it stands and its ``finally`` blocks run. With ``chain_sigterm`` the handler the try had runs
  first (Airflow's: the operator's ``on_kill`` ends its command). Still running at the grace's end
  (less ``KILL_MARGIN_S``): SIGKILL to this process.
- checkpoint: the checkpoint signal (SIGUSR1 by default) to the main thread (a handler of the
  code's own gets it; the default action, ending the process, is kept off), to ``deliver`` (a
  command's process group) and to the program of the paused run ``run_name``; ``requested()`` turns
  true. The code saves and ends, by returning or raising. Still running at the grace's end: raised
  as for terminate, and SIGKILL once gpud has taken the devices.
- ALLOC_REVOKED ``gone`` while the code runs: SIGKILL, whatever the recovery: the devices are no
  longer the task's. PREEMPT_WITHDRAWN stops the escalation; a signal sent cannot be taken back.

When the code has ended: YIELD (the devices go back now), and the try ends with the integration's
error for a retry (terminate, checkpoint) or for none (fail), whatever the code returned or
raised; a normal return stands only when the notice was withdrawn. The task's next allocation says
``resume`` after a checkpoint: ``running(resume, grace_s)`` sets GPUD_RESUME=1, with GPUD_PREEMPT_GRACE_S, GPUD_ON_PREEMPT and
GPUD_PREEMPT_SIGNAL, in ``os.environ`` for the try. suspend and shrink are refused (``check``): the
task's process holds the allocation and cannot pause itself whole, nor restart on fewer GPUs;
``gpuctl run --on-preempt suspend`` does both.

It never signals a process but this one and those the integration names, never acts on another
task's notice, and leaves no listener, handler, thread or variable behind the try.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from gpud_client import protocol as p
from gpud_client.client import Client
from gpud_client.core.actions import AllocationPush
from gpud_client.core.recovery import KILL_MARGIN_S, notice_line
from gpud_client.errors import GpudError
from gpud_client.runinfo import PID

__all__ = [
    "RECOVERIES",
    "Preemption",
    "Stopped",
    "TaskPreempted",
    "TaskPreemptedNoRetry",
    "check",
    "requested",
    "signal_number",
]

log = logging.getLogger("gpud_client.preempted")
RECOVERIES = ("terminate", "checkpoint", "fail")  # what an integration carries out on its own process
_ENV = ("GPUD_ON_PREEMPT", "GPUD_PREEMPT_GRACE_S", "GPUD_PREEMPT_SIGNAL", "GPUD_RESUME")
_running: list[Preemption] = []  # the try that runs in this process now


class _Preempted(GpudError):
    def __init__(self, task_id: str, message: str) -> None:
        super().__init__(message)
        self.task_id = task_id

    def __reduce__(self) -> tuple[type[_Preempted], tuple[str, str]]:
        return type(self), (self.task_id, str(self))


class Stopped(BaseException):
    """Raised in the task's main thread to stop it where it stands; the try then ends with the
    integration's error. A BaseException, so ``except Exception`` in the task cannot swallow it."""


class TaskPreempted(_Preempted):
    """gpud took the task's allocation back and the task stopped (on_preempt terminate or
    checkpoint): retry it. A checkpointed task's retry starts with GPUD_RESUME=1."""


class TaskPreemptedNoRetry(_Preempted):
    """gpud took the task's allocation back and the task fails (on_preempt fail): not to be retried.
    Not a ``TaskPreempted``, so ``retry_exceptions=[TaskPreempted]`` leaves it alone."""


def check(on_preempt: str, where: str) -> p.Recovery:
    """``on_preempt`` as a Recovery an integration carries out; ValueError naming ``where``."""
    if on_preempt not in RECOVERIES:
        raise ValueError(
            f"{where}: on_preempt must be one of {', '.join(map(repr, RECOVERIES))}, not {on_preempt!r}"
            + (
                ": the task's own process holds the allocation and cannot suspend itself or restart on fewer "
                "GPUs; run the program with `gpuctl run --on-preempt ...` for that"
                if on_preempt in ("suspend", "shrink")
                else ""
            )
        )
    return p.Recovery(on_preempt)


def signal_number(sig: int | str, where: str) -> int:
    """A checkpoint signal the code can handle, by number or name (``SIGUSR1``, ``USR1``); ValueError."""
    try:
        number = signal.Signals(sig) if isinstance(sig, int) else signal.Signals[f"SIG{str(sig).removeprefix('SIG')}"]
    except (KeyError, ValueError):
        raise ValueError(f"{where}: checkpoint_signal {sig!r} names no signal") from None
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{where}: checkpoint_signal {number.name} cannot be handled, so the code could not save")
    if number == signal.SIGTERM:
        raise ValueError(f"{where}: checkpoint_signal SIGTERM is what stops the task; choose another (SIGUSR1)")
    return int(number)


def requested() -> bool:
    """Whether gpud asked the running task of this process to leave: poll it to checkpoint (save,
    then return or raise). False where no task runs under an integration (a paused run's child)."""
    return bool(_running) and _running[-1].notice is not None


class Preemption:
    """Carries out ``recovery`` for ``task_id``'s allocation, held on ``client``. Listens from its
    construction; acts inside ``running()``; ``close()`` stops listening if it was never run."""

    def __init__(
        self,
        client: Client,
        task_id: str,
        recovery: p.Recovery | str,
        *,
        checkpoint_signal: int = signal.SIGUSR1,
        errors: tuple[type[TaskPreempted], type[TaskPreemptedNoRetry]] = (TaskPreempted, TaskPreemptedNoRetry),
        deliver: Callable[[int], None] | None = None,
        run_name: str | None = None,
        chain_sigterm: bool = False,
    ) -> None:
        self.client, self.task_id, self.recovery = client, task_id, p.Recovery(recovery)
        self.checkpoint_signal, self.errors = checkpoint_signal, errors
        self.deliver, self.run_name, self.chain_sigterm = deliver, run_name, chain_sigterm
        self.notice: p.Preempt | None = None
        self.withdrawn = self.gone = self.ended = self.raised = self.yielded = False
        self._lock = threading.Lock()
        self._pushes: queue.SimpleQueue[AllocationPush | None] = queue.SimpleQueue()
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        self._main: int | None = None  # the main thread's id, while its handlers are ours
        self._previous: dict[int, Any] = {}
        self._env: dict[str, str | None] = {}
        client.add_allocation_listener(self._listen)

    def _listen(self, push: AllocationPush) -> None:  # on the client's reader: never blocks
        task = push.allocation.task_id if isinstance(push, p.AllocChanged) else push.task_id
        if task == self.task_id:
            self._pushes.put(push)

    def close(self) -> None:
        self.client.remove_allocation_listener(self._listen)

    # --- the try -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self, resume: bool = False, grace_s: float | None = None) -> Iterator[Preemption]:
        """The task's code runs in this block: on the main thread, with the signals' handlers, the
        environment (``grace_s``: the daemon's grace, as ALLOCATED says it) and the preemption's
        thread; at its end the outcome (see the module's comment)."""
        self._enter(resume, grace_s)
        try:
            yield self
        except BaseException as exc:
            self._exit()
            if isinstance(exc, _Preempted) or self.notice is None:
                raise
            raise self.error() from exc
        self._exit()
        if self.notice is not None and not self.withdrawn:
            raise self.error()

    def _enter(self, resume: bool, grace_s: float | None) -> None:
        env = {"GPUD_ON_PREEMPT": str(self.recovery)}
        if grace_s is not None:
            env["GPUD_PREEMPT_GRACE_S"] = f"{grace_s:g}"
        if self.recovery == p.Recovery.CHECKPOINT:
            env["GPUD_PREEMPT_SIGNAL"] = signal.Signals(self.checkpoint_signal).name
        if resume:
            env["GPUD_RESUME"] = "1"
        self._env = {k: os.environ.get(k) for k in _ENV}
        for k in _ENV:
            os.environ.pop(k, None)
        os.environ.update(env)
        if threading.current_thread() is threading.main_thread():
            self._main = threading.get_ident()
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
            if self.recovery == p.Recovery.CHECKPOINT:
                sig = self.checkpoint_signal
                self._previous[sig] = signal.signal(sig, self._on_checkpoint_signal)
        else:
            log.warning("task %s does not run on the main thread: a preemption can only kill it", self.task_id)
        _running.append(self)
        self._thread = threading.Thread(target=self._work, name="gpud-preemption", daemon=True)
        self._thread.start()

    def _exit(self) -> None:
        with self._lock:
            self.ended = True
        self.close()
        self._pushes.put(None)
        if self._thread is not None:
            self._thread.join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._main = None
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with contextlib.suppress(ValueError):
            _running.remove(self)
        if self.notice is not None and not self.withdrawn and not self.gone:
            try:
                self.client.yield_allocation(self.task_id)
                self.yielded = True
            except GpudError as exc:  # the integration's FREE follows, which counts as done too
                log.warning("could not yield %s after its preemption: %s", self.task_id, exc)

    def error(self) -> _Preempted:
        """The try's outcome after a notice: the integration's error, retryable but for fail."""
        n = self.notice
        said = notice_line(n) if n is not None else f"task {self.task_id} was preempted"
        if self.recovery == p.Recovery.FAIL:
            return self.errors[1](self.task_id, f"gpud: {said}; the task fails (on_preempt fail), without retries")
        if self.recovery == p.Recovery.CHECKPOINT:
            sig = signal.Signals(self.checkpoint_signal).name
            then = f"the task was told to checkpoint ({sig}) and stopped; its retry resumes (GPUD_RESUME=1)"
        else:
            then = "the task was stopped (on_preempt terminate); its retry starts it afresh"
        return self.errors[0](self.task_id, f"gpud: {said}: {then}")

    # --- on the main thread ----------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signal.SIGTERM)
        if not self.raised or self.ended:  # not ours: as before the try
            if callable(previous):
                previous(signum, frame)
            elif previous in (signal.SIG_DFL, None):
                raise SystemExit(128 + signum)
            return
        if self.chain_sigterm and callable(previous):
            with contextlib.suppress(BaseException):  # its own stop (Airflow's Terminated) gives way to ours
                previous(signum, frame)
        raise Stopped(str(self.error()))

    def _on_checkpoint_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        if callable(previous):  # a handler the code set before the try; otherwise requested() tells it
            previous(signum, frame)

    # --- on the preemption's thread ----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            try:
                push = self._pushes.get(timeout=timeout)
            except queue.Empty:
                with self._lock:
                    self._at_deadline()
                continue
            if push is None:
                return
            with self._lock:
                self._act(push)

    def _act(self, push: AllocationPush) -> None:
        if self.ended:
            return
        match push:
            case p.Preempt(whole=True) if self.notice is None:
                self.notice = push
                self._deadline = time.monotonic() + max(0.0, push.grace_s - KILL_MARGIN_S)
                log.warning(
                    "%s: carrying out on_preempt %s within %g s", notice_line(push), self.recovery, push.grace_s
                )
                if self.recovery == p.Recovery.CHECKPOINT:
                    self._checkpoint()
                else:
                    self._raise()
            case p.PreemptWithdrawn():
                self.withdrawn, self._deadline = True, None
            case p.AllocRevoked(gone=True):
                self.gone = True
                self._kill(f"gpud took the devices of task {self.task_id} back ({push.reason}) while it ran")

    def _at_deadline(self) -> None:
        self._deadline = None
        if self.ended or self.withdrawn:
            return
        if not self.raised:  # a checkpoint not done within the grace: stopped now
            self._raise()
            self._deadline = time.monotonic() + 2 * KILL_MARGIN_S
            return
        self._kill(f"task {self.task_id} did not end within its preemption grace")

    def _raise(self) -> None:
        self.raised = True
        if self._main is not None:
            signal.pthread_kill(self._main, signal.SIGTERM)

    def _checkpoint(self) -> None:
        sig = self.checkpoint_signal
        if self._main is not None:
            signal.pthread_kill(self._main, sig)
        try:
            if self.deliver is not None:
                self.deliver(sig)
            if self.run_name is not None:
                for pid in _run_programs(self.client, self.run_name):
                    os.kill(pid, sig)
        except (OSError, GpudError) as exc:
            log.warning("could not send %s to task %s's program: %s", signal.Signals(sig).name, self.task_id, exc)

    def _kill(self, why: str) -> None:
        log.error("%s: killing its process (%d)", why, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


def _run_programs(client: Client, name: str) -> list[int]:
    """The programs of the runs called ``name`` (a paused run shows its program's pid)."""
    return [int(c.labels[PID]) for c in client.clients().clients if c.name == name and PID in c.labels]
