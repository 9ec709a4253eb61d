"""An Airflow try's dealings with its worker's gpud (for ``gpud_client.airflow``, which re-exports the
public names): what a task asks (``GpuRequest``, checked when the DAG is parsed), its gpud task id,
the requests one try makes (connect, free an earlier try's record, allocate, release) and the
errors a try fails with, Airflow's own exceptions so that its retries apply or do not.

It never frees an id other than its own task instance's, and that only while this process owns it
(or at the start of a try, when an earlier try's record can only be a crashed one's).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import socket as _socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from gpud_client import protocol as p
from gpud_client.client import Client
from gpud_client.core.messages import allocate_msg
from gpud_client.errors import DaemonUnavailable, GpudError, ProtocolError
from gpud_client.preempted import TaskPreempted, TaskPreemptedNoRetry, check, signal_number

if TYPE_CHECKING:  # gpud_client.run is imported where pause= is used
    from gpud_client.run.pycall import Pause

log = logging.getLogger("gpud_client.airflow")
_MAX_ID = 256  # protocol.TaskId
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@/+=-]")
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f]")


class GpuResourcesUnavailable(GpudError, AirflowException):
    """gpud could not give the task what it asked for within ``wait`` (or is not on this worker).
    An AirflowException: the task fails and Airflow's retries apply."""


class GpuRequestInvalid(GpudError, AirflowFailException):
    """gpud refused the request itself (more GPUs or cores than the node has, an unknown tenant):
    retrying cannot help, so the task fails without retries."""


class GpuPreempted(TaskPreempted, AirflowException):
    """gpud took the task's allocation back (a higher priority's request, a drain) and the task
    stopped, as its ``on_preempt`` (terminate, checkpoint) asked: Airflow's retries apply."""


class GpuPreemptedNoRetry(TaskPreemptedNoRetry, AirflowFailException):
    """gpud took the task's allocation back and its ``on_preempt`` is "fail": no retries."""


@dataclass(frozen=True, kw_only=True)
class GpuRequest:
    """What a task asks of its node's gpud. Checked with the protocol's own types when the DAG is
    parsed, so a bad option is an import error of the DAG file, not a failed task."""

    gpus: float = 1  # whole GPUs (1, 2, ...) or a fraction of one (< 1)
    cpus: int = 0  # CPU cores, pinned
    wait: float = 0.0  # seconds to wait for room before failing the try
    priority: int | str | None = None  # 0-100 or production|high|normal|best-effort
    tenant: str | None = None
    strategy: str = "first_fit"  # first_fit|best_fit|round_robin|least_loaded|random
    prefer: tuple[int | str, ...] = field(default=())  # GPUs to try first
    socket: str | None = None  # None: $GPUD_SOCKET of the worker, else /run/gpud/gpud.sock
    pause: Pause | None = None  # a fractional task's code runs under gpud-run, paused whole between turns
    on_preempt: str = "terminate"  # terminate|checkpoint|fail: what the try does when gpud takes it back
    checkpoint_signal: int | str = signal.SIGUSR1  # told to the code to checkpoint (on_preempt="checkpoint")

    def __post_init__(self) -> None:
        check(self.on_preempt, "gpu_resources")
        object.__setattr__(self, "checkpoint_signal", signal_number(self.checkpoint_signal, "gpu_resources"))
        if not (0 < self.gpus < 1 or float(self.gpus).is_integer() and self.gpus >= 1):
            raise ValueError(f"gpu_resources: gpus must be whole GPUs or a fraction of one, not {self.gpus}")
        if self.pause is not None:
            from gpud_client.run.pycall import check_pause

            check_pause(self.pause, "gpu_resources", gpus=self.gpus)
        try:
            msgspec.convert(msgspec.to_builtins(self.message("check", None)), p.Allocate)
        except (msgspec.ValidationError, ValueError) as exc:
            raise ValueError(f"gpu_resources: {exc}") from None

    def message(self, task_id: str, owner_pid: int | None) -> p.Allocate:
        return allocate_msg(
            task_id,
            self.gpus,
            self.cpus,
            list(self.prefer),
            self.strategy,
            self.tenant,
            self.priority,
            round(self.wait * 1000),
            owner_pid,
            on_preempt=self.on_preempt,
        )


def gpud_task_id(dag_id: str, run_id: str, task_id: str, map_index: int | None = -1) -> str:
    """``{dag_id}.{run_id}.{task_id}.{map_index}`` (map_index -1: not mapped): the same for every try of a
    task instance, different for every DAG run, task and map index. Characters gpud does not take become
    ``_`` and an id over 256 characters is cut; either way ``@`` and 12 hex digits of a hash of the
    original end it, so two task instances never share an id."""
    raw = f"{dag_id}.{run_id}.{task_id}.{-1 if map_index is None else map_index}"
    clean = _UNSAFE.sub("_", raw)
    if clean == raw and len(raw) <= _MAX_ID:
        return raw
    digest = hashlib.sha256(raw.encode()).hexdigest()[:12]
    return f"{clean[: _MAX_ID - 13]}@{digest}"


def connect(request: GpuRequest, task_id: str, ti: Any) -> Client:
    labels = {
        "airflow_dag": ti.dag_id,
        "airflow_run": ti.run_id,
        "airflow_task": ti.task_id,
        "airflow_map_index": str(ti.map_index),
        "airflow_try": str(ti.try_number),
    }
    try:
        return Client(
            request.socket,
            name=f"airflow:{os.getpid()}",
            labels={k: _UNPRINTABLE.sub("?", v)[:128] for k, v in labels.items()},
        )
    except DaemonUnavailable as exc:
        raise GpuResourcesUnavailable(
            f"no gpud on Airflow worker {_socket.gethostname()} for {task_id}: {exc}. "
            "Run gpud on every GPU worker (or set GPUD_SOCKET for the worker)"
        ) from None


def free_earlier_try(client: Client, task_id: str) -> None:
    try:
        client.release_allocation(task_id)
    except ProtocolError as exc:
        if exc.code == p.ErrorCode.UNKNOWN_TASK:
            return
        where = _socket.gethostname()
        raise GpuRequestInvalid(f"gpud on {where} would not free {task_id} for a new try: {exc}") from None
    log.warning("freed %s, left by an earlier try of this task instance that did not end cleanly", task_id)


def allocate(client: Client, request: GpuRequest, task_id: str) -> p.Allocated:
    asked = f"{request.gpus:g} GPU(s)" + (f" and {request.cpus} CPU core(s)" if request.cpus else "")
    try:  # the message checked when the DAG was parsed, as it is: the wait plus a round trip
        allocated: p.Allocated = client.call(
            request.message(task_id, os.getpid()), timeout=request.wait + client.request_timeout
        )
        return allocated
    except ProtocolError as exc:
        where = f"gpud on {_socket.gethostname()} did not give {task_id} {asked}"
        if exc.code == p.ErrorCode.INSUFFICIENT:
            raise GpuResourcesUnavailable(f"{where} within {request.wait:g} s: {exc.message}") from None
        raise GpuRequestInvalid(f"{where}: {exc}") from None
    except DaemonUnavailable as exc:
        raise GpuResourcesUnavailable(f"gpud did not answer the allocation of {task_id} ({asked}): {exc}") from None


def release(client: Client, task_id: str) -> None:
    """Free the id only while this process owns it: if Airflow gave up on this try (a lost heartbeat)
    and started the next one on this node, that try freed this one's record and holds the id now.
    A wait still queued is withdrawn by the daemon when the connection closes."""
    try:
        held = next((a for a in client.allocations().allocations if a.task_id == task_id), None)
        if held is None:
            return  # never allocated (refused, or interrupted while waiting), or already reclaimed
        if held.owner_pid != os.getpid():
            log.warning("left %s alone: a later try (pid %s) holds it now", task_id, held.owner_pid)
            return
        client.release_allocation(task_id)
    except ProtocolError as exc:
        if exc.code != p.ErrorCode.UNKNOWN_TASK:
            log.warning("gpud refused to free %s: %s", task_id, exc)
    except GpudError as exc:
        log.warning(
            "could not free %s now (gpud reclaims it when this process exits, or the next try frees it): %s",
            task_id,
            exc,
        )
