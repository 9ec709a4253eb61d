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

``on_preempt=`` says what the try does when gpud takes its allocation back (``gpud_client.preempted``):
``terminate`` stops the task, ``checkpoint`` tells its code to save (``checkpoint_signal``, or
``preempted.requested()``); both fail the try with ``GpuPreempted`` for Airflow's retries, and a
checkpointed task's retry starts with GPUD_RESUME=1. ``fail`` fails it with ``GpuPreemptedNoRetry``.

This module never frees an id other than its own task instance's (and that only while this
process owns it, or at the start of a try), never keeps the allocation past the try, and never
leaves the environment, affinity or SIGTERM handler changed after it. One allocation per task:
a decorated function must not call another.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, overload

import msgspec

try:
    from airflow.sdk import BaseOperator, Context, get_current_context
except ImportError as exc:  # the base client needs msgspec alone; this module needs Airflow too
    raise ImportError(
        f"gpud_client.airflow needs Airflow: pip install './client[airflow]' from a checkout of gpud ({exc})"
    ) from exc

from gpud_client import protocol as p
from gpud_client.airflow_try import (
    GpuPreempted,
    GpuPreemptedNoRetry,
    GpuRequest,
    GpuRequestInvalid,
    GpuResourcesUnavailable,
    allocate,
    connect,
    free_earlier_try,
    gpud_task_id,
    release,
)
from gpud_client.preempted import Preemption
from gpud_client.taskenv import ProcessChanges, allocation_env

if TYPE_CHECKING:  # gpud_client.run is imported where pause= is used
    from gpud_client.run.pycall import Pause, Place

__all__ = [
    "XCOM_KEY",
    "GpuPreempted",
    "GpuPreemptedNoRetry",
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
_current: list[p.Allocated] = []  # this process's running try: one at a time
_ALLOCATION_ENV = "_GPUD_AIRFLOW_ALLOCATION"  # the try's allocation, in a paused function's child process


class Terminated(BaseException):
    """Raised in the task when Airflow sends SIGTERM, after the operator's ``on_kill``: the task
    stops and its allocation is freed. A BaseException, so ``except Exception`` cannot swallow it."""


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
def _holding(request: GpuRequest, context: Context, operator: Any = None) -> Iterator[p.Allocated]:
    """Allocate for the task instance of ``context`` for as long as the block runs (``operator``: a
    mixin's, whose command's process group a checkpoint is told to)."""
    ti = context["ti"]
    task_id = gpud_task_id(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
    client = connect(request, task_id, ti)
    preemption = Preemption(  # listening from before the ALLOCATE: a notice may follow at once
        client,
        task_id,
        request.on_preempt,
        checkpoint_signal=int(request.checkpoint_signal),
        errors=(GpuPreempted, GpuPreemptedNoRetry),
        deliver=None if request.pause or operator is None else functools.partial(_signal_command, operator),
        run_name=_run_name() if request.pause else None,
        chain_sigterm=True,  # Airflow's handler first: the operator's on_kill ends its command
    )
    stack = ProcessChanges()
    try:
        # Airflow's SIGTERM handler calls the operator's on_kill(); the task also stops, so this cleanup runs
        stack.on_sigterm(lambda: Terminated(f"SIGTERM from Airflow: task {task_id} stops and its GPUs are freed"))
        free_earlier_try(client, task_id)
        allocated = allocate(client, request, task_id)
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
        with preemption.running(allocated.resume, allocated.preemption_grace_s):  # GPUD_RESUME=1 after a checkpoint
            yield allocated
    finally:
        preemption.close()
        _current.clear()
        stack.undo()  # before the release: a second SIGTERM then cannot interrupt it
        release(client, task_id)
        client.close()


def _signal_command(operator: Any, signum: int) -> None:
    """A checkpoint signal to the command's process group (SubprocessHook starts it in a session)."""
    proc = getattr(getattr(operator, "subprocess_hook", None), "sub_process", None)
    if proc is not None and proc.returncode is None:
        os.killpg(proc.pid, signum)


def _run_name() -> str:
    return f"airflow-run:{os.getpid()}"


def _call_paused(request: GpuRequest, allocated: p.Allocated, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    from gpud_client.run.pycall import call_under_run

    # As Airflow's PythonVirtualenvOperator does for its child: Airflow, if the function imports it,
    # then leaves alone the database that the task process's environment names (blocked, unusable)
    env = {"PYTHON_OPERATORS_VIRTUAL_ENV_MODE": "1", _ALLOCATION_ENV: msgspec.json.encode(allocated).decode()}
    return call_under_run(_place(request, allocated), func, args, kwargs, pickler="dill", env=env)


def _place(request: GpuRequest, allocated: p.Allocated) -> Place:
    from gpud_client.run.pycall import Place  # a session on the task's GPU that belongs to its allocation

    socket, name, pause = p.resolve_socket_path(request.socket), _run_name(), request.pause
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
    on_preempt: str = "terminate",
    checkpoint_signal: int | str = "SIGUSR1",
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
    on_preempt: str = "terminate",
    checkpoint_signal: int | str = "SIGUSR1",
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
        on_preempt=on_preempt,
        checkpoint_signal=checkpoint_signal,
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
        on_preempt: str = "terminate",
        checkpoint_signal: int | str = "SIGUSR1",
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
            on_preempt=on_preempt,
            checkpoint_signal=checkpoint_signal,
        )
        if pause is not None and not hasattr(type(self), "subprocess_hook"):
            raise ValueError(
                f"{type(self).__name__}: pause= runs the operator's command under gpud-run, and it runs none "
                "through a subprocess_hook (BashOperator does); for a function use @gpu_resources(pause=...)"
            )
        super().__init__(**kwargs)
        self.gpu_request = request

    def execute(self, context: Context) -> Any:
        with _holding(self.gpu_request, context, self) as allocated:
            if self.gpu_request.pause is None:
                return super().execute(context)
            with _place(self.gpu_request, allocated).commands_of(getattr(self, "subprocess_hook")):  # noqa: B009
                return super().execute(context)
