"""Airflow tasks get their GPUs and CPU cores from the worker node's gpud (the extra ``gpud-client[airflow]``).

A TaskFlow task takes the decorator under ``@task``; a classic operator takes the mixin::

    @task(retries=2)
    @gpu_resources(gpus=1, cpus=4, wait=600)
    def train(): ...                            # current_allocation() inside

    class GpuBashOperator(GpuResourcesMixin, BashOperator): ...
    GpuBashOperator(task_id="fit", bash_command="python fit.py", gpus=0.25)
    GpuBashOperator(task_id="infer", bash_command="python infer.py", gpus=0.25, pause="signal")  # see below

In the task's own process, around the operator's execution, a try:

1. frees what an earlier try of the same task instance left under its id (Airflow runs one
   try at a time, so such a record belongs to a try that crashed), then allocates from the
   node's gpud as ``{dag_id}.{run_id}.{task_id}.{map_index}`` (see ``gpud_task_id``), owned by
   this process, so gpud reclaims it if the process is killed outright;
2. sets ``CUDA_VISIBLE_DEVICES`` (with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, the order of gpud's
   indices), ``GPUD_TASK_ID``, ``GPUD_GPU_SHARE``, ``GPUD_CPUS`` and ``GPUD_SOCKET`` in
   ``os.environ`` (subprocesses inherit them), pins its thread to the
   allocated cores, pushes the answer to XCom (key ``gpud_allocation``) and keeps it for
   ``current_allocation()``;
3. runs the task, then frees the allocation and puts the environment and the affinity back,
   on every way out: return, exception, ``execution_timeout`` and SIGTERM from Airflow (which
   calls ``on_kill`` and, here, also raises ``Terminated`` so the task stops and this cleanup runs).

Not enough room within ``wait``: the task fails with ``GpuResourcesUnavailable`` (the
daemon's words for what was short), so Airflow's retries apply; a request this node can never
hold fails with ``GpuRequestInvalid``, without retries. A fractional allocation also caps the
gpud sessions the task (or its children) opens on that GPU: the daemon matches them by pid.

``pause=`` (fractional tasks) runs the operator's command (its ``subprocess_hook``) or the function (a
child process, ``gpud_client.run.pycall``) under ``gpud-run --gpu G --task ID``, paused between turns.

This module never frees an id other than its own task instance's (and that only while this
process owns it, or at the start of a try), never keeps the allocation past the try, and never
leaves the environment, affinity or SIGTERM handler changed after it. One allocation per task:
a decorated function must not call another.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import socket as _socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, overload

import msgspec

try:
    from airflow.sdk import BaseOperator, Context, get_current_context
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
except ImportError as exc:  # the base client needs msgspec alone; this module needs Airflow too
    raise ImportError(
        f"gpud_client.airflow needs Airflow: pip install './client[airflow]' from a checkout of gpud ({exc})"
    ) from exc

from gpud_client import protocol as p
from gpud_client.client import Client
from gpud_client.core.messages import allocate_msg
from gpud_client.errors import DaemonUnavailable, GpudError, ProtocolError
from gpud_client.taskenv import ProcessChanges, allocation_env

if TYPE_CHECKING:  # gpud_client.run is imported where pause= is used
    from gpud_client.run.pycall import Pause, Place

__all__ = [
    "XCOM_KEY",
    "GpuRequest",
    "GpuRequestInvalid",
    "GpuResourcesMixin",
    "GpuResourcesUnavailable",
    "Terminated",
    "current_allocation",
    "gpu_resources",
    "gpud_task_id",
]

log = logging.getLogger("gpud_client.airflow")
F = TypeVar("F", bound=Callable[..., Any])
XCOM_KEY = "gpud_allocation"
_MAX_ID = 256  # protocol.TaskId
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@/+=-]")
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f]")
_current: list[p.Allocated] = []  # this process's running try: one at a time
_ALLOCATION_ENV = "_GPUD_AIRFLOW_ALLOCATION"  # the try's allocation, in a paused function's child process


class GpuResourcesUnavailable(GpudError, AirflowException):
    """gpud could not give the task what it asked for within ``wait`` (or is not on this worker).
    An AirflowException: the task fails and Airflow's retries apply."""


class GpuRequestInvalid(GpudError, AirflowFailException):
    """gpud refused the request itself (more GPUs or cores than the node has, an unknown tenant):
    retrying cannot help, so the task fails without retries."""


class Terminated(BaseException):
    """Raised in the task when Airflow sends SIGTERM, after the operator's ``on_kill``: the task
    stops and its allocation is freed. A BaseException, so ``except Exception`` cannot swallow it."""


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

    def __post_init__(self) -> None:
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


def current_allocation() -> p.Allocated:
    """The running task's allocation (task_id, gpus, uuids, share, cpus, cuda_visible_devices, ...)."""
    if not _current and _ALLOCATION_ENV in os.environ:  # a paused function's child process
        _current.append(msgspec.json.decode(os.environ[_ALLOCATION_ENV], type=p.Allocated))
    if not _current:
        raise RuntimeError(
            "no gpud allocation: call current_allocation() inside a task run with "
            "@gpu_resources or a GpuResourcesMixin operator"
        )
    return _current[-1]


# --- one try ------------------------------------------------------------------------------------


@contextmanager
def _holding(request: GpuRequest, context: Context) -> Iterator[p.Allocated]:
    """Allocate for the task instance of ``context`` for as long as the block runs."""
    ti = context["ti"]
    task_id = gpud_task_id(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
    client = _connect(request, task_id, ti)
    stack = ProcessChanges()
    try:
        # Airflow's SIGTERM handler calls the operator's on_kill(); the task also stops, so this cleanup runs
        stack.on_sigterm(lambda: Terminated(f"SIGTERM from Airflow: task {task_id} stops and its GPUs are freed"))
        _free_earlier_try(client, task_id)
        allocated = _allocate(client, request, task_id)
        stack.environment(allocation_env(allocated, client.path))
        stack.affinity(allocated.cpus)
        _current.append(allocated)
        log.info(
            "gpud gave %s GPU %s (share %g) and CPU cores %s, waited %.0f ms",
            task_id,
            allocated.gpus,
            allocated.share,
            allocated.cpus or "-",
            allocated.waited_ms,
        )
        ti.xcom_push(key=XCOM_KEY, value=_as_dict(allocated))
        yield allocated
    finally:
        _current.clear()
        stack.undo()  # before the release: a second SIGTERM then cannot interrupt it
        _release(client, task_id)
        client.close()


def _connect(request: GpuRequest, task_id: str, ti: Any) -> Client:
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


def _free_earlier_try(client: Client, task_id: str) -> None:
    try:
        client.release_allocation(task_id)
    except ProtocolError as exc:
        if exc.code == p.ErrorCode.UNKNOWN_TASK:
            return
        where = _socket.gethostname()
        raise GpuRequestInvalid(f"gpud on {where} would not free {task_id} for a new try: {exc}") from None
    log.warning("freed %s, left by an earlier try of this task instance that did not end cleanly", task_id)


def _allocate(client: Client, request: GpuRequest, task_id: str) -> p.Allocated:
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


def _release(client: Client, task_id: str) -> None:
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


def _call_paused(request: GpuRequest, allocated: p.Allocated, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    from gpud_client.run.pycall import call_under_run

    # As Airflow's PythonVirtualenvOperator does for its child: Airflow, if the function imports it,
    # then leaves alone the database that the task process's environment names (blocked, unusable)
    env = {"PYTHON_OPERATORS_VIRTUAL_ENV_MODE": "1", _ALLOCATION_ENV: msgspec.json.encode(allocated).decode()}
    return call_under_run(_place(request, allocated), func, args, kwargs, pickler="dill", env=env)


def _place(request: GpuRequest, allocated: p.Allocated) -> Place:
    from gpud_client.run.pycall import Place  # a session on the task's GPU that belongs to its allocation

    socket, name, pause = p.resolve_socket_path(request.socket), f"airflow-run:{os.getpid()}", request.pause
    assert pause is not None
    return Place(socket=socket, gpu=allocated.gpus[0], task_id=allocated.task_id, pause=pause, name=name)


def _as_dict(allocated: p.Allocated) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(allocated)
    data.pop("id", None)
    data.pop("type", None)
    return data


# --- the two ways in ----------------------------------------------------------------------------


@overload
def gpu_resources(fn: F, /) -> F: ...


@overload
def gpu_resources(
    fn: None = None,
    /,
    *,
    gpus: float = 1,
    cpus: int = 0,
    wait: float = 0.0,
    priority: int | str | None = None,
    tenant: str | None = None,
    strategy: str = "first_fit",
    prefer: list[int | str] | None = None,
    socket: str | None = None,
    pause: Pause | None = None,
) -> Callable[[F], F]: ...


def gpu_resources(
    fn: F | None = None,
    /,
    *,
    gpus: float = 1,
    cpus: int = 0,
    wait: float = 0.0,
    priority: int | str | None = None,
    tenant: str | None = None,
    strategy: str = "first_fit",
    prefer: list[int | str] | None = None,
    socket: str | None = None,
    pause: Pause | None = None,
) -> F | Callable[[F], F]:
    """Wrap a TaskFlow task's function (put ``@task`` above it): it runs holding its allocation. With
    ``pause``, in a child process under gpud-run: its arguments and result must pickle (dill)."""
    request = GpuRequest(
        gpus=gpus,
        cpus=cpus,
        wait=wait,
        priority=priority,
        tenant=tenant,
        strategy=strategy,
        prefer=tuple(prefer or ()),
        socket=socket,
        pause=pause,
    )

    def wrap(func: F) -> F:
        @functools.wraps(func)  # keeps the signature: @task injects context arguments by name
        def run(*args: Any, **kwargs: Any) -> Any:
            with _holding(request, get_current_context()) as allocated:
                if request.pause is not None:
                    return _call_paused(request, allocated, func, args, kwargs)
                return func(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap if fn is None else wrap(fn)


class GpuResourcesMixin(BaseOperator):
    """Put it first among an operator's bases: ``class GpuBashOperator(GpuResourcesMixin, BashOperator)``.
    The operator then takes gpu_resources' options as keyword arguments, and its ``execute`` runs
    holding the allocation. A BaseOperator itself, so that Airflow's operator metaclass handles its
    ``__init__`` (defaults from ``default_args``, XComArg dependencies) as it does any operator's.
    Templated fields are rendered before ``execute``: they cannot name the GPUs, the environment can.
    ``pause`` runs the command of an operator with a ``subprocess_hook`` (BashOperator) under gpud-run."""

    gpu_request: GpuRequest

    def __init__(
        self,
        *,
        gpus: float = 1,
        cpus: int = 0,
        wait: float = 0.0,
        priority: int | str | None = None,
        tenant: str | None = None,
        strategy: str = "first_fit",
        prefer: list[int | str] | None = None,
        socket: str | None = None,
        pause: Pause | None = None,
        **kwargs: Any,
    ) -> None:
        request = GpuRequest(
            gpus=gpus,
            cpus=cpus,
            wait=wait,
            priority=priority,
            tenant=tenant,
            strategy=strategy,
            prefer=tuple(prefer or ()),
            socket=socket,
            pause=pause,
        )
        if pause is not None and not hasattr(type(self), "subprocess_hook"):
            raise ValueError(
                f"{type(self).__name__}: pause= runs the operator's command under gpud-run, and it runs none "
                "through a subprocess_hook (BashOperator does); for a function use @gpu_resources(pause=...)"
            )
        super().__init__(**kwargs)
        self.gpu_request = request

    def execute(self, context: Context) -> Any:
        with _holding(self.gpu_request, context) as allocated:
            if self.gpu_request.pause is None:
                return super().execute(context)
            with _place(self.gpu_request, allocated).commands_of(getattr(self, "subprocess_hook")):  # noqa: B009
                return super().execute(context)
