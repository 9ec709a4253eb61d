"""A run's side of gpud: its client, its allocation (asked for, asked for again after a checkpoint,
yielded and freed), what the program's environment says of it, and how gpud's pushes about it
reach the supervisor's queue.

Nothing here decides: ``RunCore`` does (``core/recovery.py``). The listener runs on the client's
reader thread, so it only puts the push on the queue; the ALLOCATE that waits for room again runs
in a thread of its own, so the supervisor's loop keeps serving signals while it waits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

from gpud_client import protocol as p
from gpud_client.client import Client, Session
from gpud_client.core.actions import AllocationPush
from gpud_client.core.run_events import Reallocated, ReallocationFailed, RunEvent, pushed
from gpud_client.errors import DaemonUnavailable, GpudError, ProtocolError
from gpud_client.run.options import RunOptions
from gpud_client.taskenv import allocation_env

FOREVER_S = 365 * 86400.0  # how long a paused program waits for gpud to come back
# How long one ALLOCATE waits when the run waits for ever (no --wait): asked again until granted.
WAIT_CHUNK_MS = 3_600_000
RETRY_S = 1.0  # between tries while gpud is away
PREEMPT_ENV = ("GPUD_ON_PREEMPT", "GPUD_PREEMPT_GRACE_S", "GPUD_PREEMPT_SIGNAL", "GPUD_RESUME")


def connect(opts: RunOptions, labels: dict[str, str], say: Callable[[str], None]) -> Client | None:
    """A client for the run; None when gpud is missing and ``--on-missing run`` allows it."""
    try:
        return Client(
            opts.socket,
            name=opts.name,
            labels=labels,
            unavailable_timeout=FOREVER_S,  # a paused program waits for gpud's return
        )
    except DaemonUnavailable as exc:
        if opts.on_missing != "run":
            raise
        say(f"{exc}; running the program without gpud (--on-missing run): nothing arbitrates it")
        return None


@contextmanager
def library_warnings_said(prog: str, err: IO[str] | None = None) -> Iterator[None]:
    """The client library's warnings (a lost connection, a refused re-attach) on the run's stderr as
    the run's own lines, ``prog: ...``, while the command runs: a command's output names who speaks.
    For the command line only: a host (Ray, Airflow) configures its own logging."""
    handler = logging.StreamHandler(err or sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prog}: %(message)s"))
    handler.setLevel(logging.WARNING)
    library = logging.getLogger("gpud_client")
    library.addHandler(handler)
    propagate, library.propagate = library.propagate, False
    try:
        yield
    finally:
        library.removeHandler(handler)
        library.propagate = propagate


def allocate(client: Client, opts: RunOptions, task_id: str, wait_ms: int) -> p.Allocated:
    """The run's ALLOCATE: owned by the run (its pid: killed, gpud reclaims it at once)."""
    assert opts.gpus is not None
    return client.allocate(
        task_id,
        opts.gpus,
        cpus=opts.cpus,
        tenant=opts.tenant,
        priority=opts.priority,
        wait_ms=wait_ms,
        owner_pid=os.getpid(),
        on_preempt=opts.on_preempt,
        gpus_max=opts.gpus_max,
    )


def program_env(opts: RunOptions, allocated: p.Allocated, *, resume: bool, socket_path: str | None) -> dict[str, str]:
    """What the program is told of its allocation: its devices and cores (``allocation_env``), what a
    preemption does to it and how long it then has (the daemon's grace), and whether this start resumes."""
    env = allocation_env(allocated, socket_path)
    env["GPUD_ON_PREEMPT"] = opts.on_preempt
    if allocated.preemption_grace_s is not None:
        env["GPUD_PREEMPT_GRACE_S"] = f"{allocated.preemption_grace_s:g}"
    if opts.on_preempt == p.Recovery.CHECKPOINT:
        env["GPUD_PREEMPT_SIGNAL"] = signal.Signals(opts.checkpoint_signal).name
    if resume:
        env["GPUD_RESUME"] = "1"
    return env


class Listener:
    """The client's allocation listener for one task: its pushes go on the queue as events. Added
    before the ALLOCATE, so that a PREEMPT that follows the grant at once is not missed."""

    def __init__(self, task_id: str, put: Callable[[RunEvent], None]) -> None:
        self.task_id = task_id
        self.put = put

    def __call__(self, push: AllocationPush) -> None:
        task = push.allocation.task_id if isinstance(push, p.AllocChanged) else push.task_id
        if task == self.task_id:
            self.put(pushed(push))


def allocate_again(
    client: Client, opts: RunOptions, task_id: str, put: Callable[[RunEvent], None], stopping: threading.Event
) -> None:
    """A thread's work: ALLOCATE ``task_id`` again, waiting up to ``--wait`` (without it, until
    granted); ``reallocated`` or ``reallocation_failed`` goes on the queue. Stops when the run does."""
    forever = opts.wait_ms == 0
    while not stopping.is_set():
        try:
            allocated = allocate(client, opts, task_id, WAIT_CHUNK_MS if forever else opts.wait_ms)
        except DaemonUnavailable as exc:
            if not forever:
                put(ReallocationFailed(f"task {task_id}: gpud went away while the run waited: {exc}"))
                return
            stopping.wait(RETRY_S)  # the client reconnects meanwhile
            continue
        except ProtocolError as exc:
            if forever and exc.code == p.ErrorCode.INSUFFICIENT:
                continue
            if not stopping.is_set():
                put(ReallocationFailed(f"gpud did not give task {task_id} its allocation again: {exc}"))
            return
        except GpudError as exc:
            if not stopping.is_set():
                put(ReallocationFailed(f"gpud did not give task {task_id} its allocation again: {exc}"))
            return
        put(Reallocated(allocated))
        return


def gpu_free(client: Client | None, session: Session | None) -> int | None:
    """Free memory on the run's GPU by gpud's NVML reading, for the claim before a restore;
    None: unknown (simulated GPUs, no session)."""
    if client is None or session is None:
        return None
    status: p.StatusReply = client.call(p.Status(id=0))
    gpu = next((g for g in status.gpus if g.index == session.gpu), None)
    if gpu is None or gpu.memory_used_bytes is None:
        return None
    return gpu.memory_total_bytes - gpu.memory_used_bytes


def tree_memory(client: Client | None, session: Session | None) -> int | None:
    """What the program's tree holds on the GPU, as gpud measures it (NVML per process); None:
    unknown."""
    if client is None or session is None:
        return None
    reply: p.ClientsReply = client.call(p.ListClients(id=0))
    mine = (s for c in reply.clients for s in c.sessions if s.session == session.id)
    return next((s.mem_used_bytes for s in mine), None)


def give_back(client: Client, task_id: str, say: Callable[[str], None]) -> None:
    """YIELD: the program did what the notice asked."""
    try:
        client.yield_allocation(task_id)
    except GpudError as exc:  # gone meanwhile (the grace ended): nothing is left to give back
        say(f"could not yield the allocation of task {task_id}: {exc}")


def free(client: Client, task_id: str, say: Callable[[str], None], *, gone: bool) -> None:
    """FREE at the run's end (also withdraws an ALLOCATE that waits); one gpud took back is not missed."""
    try:
        client.release_allocation(task_id)
    except ProtocolError as exc:
        if not (gone and exc.code == p.ErrorCode.UNKNOWN_TASK):
            say(f"could not free the allocation of task {task_id}: {exc}")
    except GpudError as exc:
        say(f"could not free the allocation of task {task_id}: {exc}")
