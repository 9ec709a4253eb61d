"""Ray's fractional GPUs, enforced by gpud on every node (the optional extra ``gpud-client[ray]``).

Ray's ``num_gpus=0.25`` is bookkeeping only. Inside a Ray worker, a task or
actor wrapped here reads what Ray assigned it (the GPU ids and the amount, from
the runtime context), connects to *that node's* gpud, allocates that share of
that GPU for itself (owned by the worker process, so gpud reclaims it if the
worker dies) and attaches a session that belongs to the allocation: its core
limit is the fraction × 100 and its memory limit the fraction of the GPU's
memory, ceilings the task cannot raise. Its GPU work then runs in slices of the
time-sliced lock::

    @ray.remote(num_gpus=0.25)
    @gpud_task                       # the whole body is one slice, paused where it stands when gpud asks
    def embed(batch): ...

    @ray.remote(num_gpus=0.25)
    @gpud_task(slices="explicit")    # only the `with gpud_slice():` blocks
    def train(steps):
        for step in steps:
            with gpud_slice():
                ...

    @ray.remote(num_gpus=0.5)
    @gpud_actor                      # every method call is a slice; the session lives with the actor
    class Model: ...

    @ray.remote(num_gpus=0.25)
    @gpud_task(pause="signal")       # the body in a child process under gpud-run, paused whole between turns
    def render(scene): ...

A whole body (and a sync actor's call) is a ``PausableSlice``: when gpud asks the task to yield (its
budget is used, or its time quantum is up) the body is paused at its next Python bytecode, gives the
lock back and goes on at its next grant, so a task of any length keeps to its share instead of being
revoked for not answering. Ray runs tasks and sync actors' calls on the worker's main thread, which is
what can be paused so; a threaded or async actor's call answers at its end, as a ``gpud_slice()`` does.

A task's ``on_preempt`` says what happens when gpud takes its allocation back (``gpud_client.preempted``):
``terminate`` stops the body with ``TaskPreempted``, which Ray retries under ``retry_exceptions=[TaskPreempted]``;
``checkpoint`` first tells it to save (SIGUSR1, or ``preempted.requested()``), and its retry starts with
GPUD_RESUME=1; ``fail`` ends it with ``TaskPreemptedNoRetry``. Actors' allocations carry out none.

The node's gpud is found from the ``socket`` argument, else ``$GPUD_SOCKET`` as
the node's Ray was started with (workers inherit the raylet's environment),
else ``/run/gpud/gpud.sock``. A node without gpud fails the task with a clear
error (``on_missing="fail"``, the default) or runs it unarbitrated with a
warning (``on_missing="warn"``). ``setup_hook`` turns ``gpud_slice()`` on for
every task of a job through Ray's ``worker_process_setup_hook``. Everything here
runs in Ray's worker processes; the driver needs nothing but Ray.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

try:
    import ray
except ImportError as exc:  # the base client needs msgspec alone; this module needs Ray too
    raise ImportError(
        f"gpud_client.ray needs Ray: pip install './client[ray]' from a checkout of gpud ({exc})"
    ) from exc

from gpud_client import protocol as p
from gpud_client.client import Client, Session
from gpud_client.errors import GpudError, ProtocolError
from gpud_client.frameworks import torch_synchronize
from gpud_client.pausing import PausableSlice, Slices
from gpud_client.preempted import Preemption, check, signal_number
from gpud_client.ray_node import GpudNotOnNode as GpudNotOnNode  # re-exported: a task fails with it
from gpud_client.ray_node import Options, client_of
from gpud_client.units import parse_bytes

if TYPE_CHECKING:  # gpud_client.run is imported where pause= is used
    from gpud_client.run.pycall import Pause, Place

log = logging.getLogger("gpud_client.ray")
F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)


class Binding:
    """One task's (or actor's) place on its node's gpud: its allocation and its sessions. ``sessions`` is
    empty when the task has no GPU or the node has no gpud (on_missing="warn"): its slices then run
    unarbitrated. With ``pause`` (fractional): no session; ``place`` is where its run takes one."""

    def __init__(self, key: str, options: Options, pause: Pause | None = None) -> None:
        self.key = key
        self.options = options
        self.pause = pause
        self.client: Client | None = None
        self.task_id = ""
        self.sessions: list[Session] = []
        self.place: Place | None = None
        self.preemption: Preemption | None = None
        self.resume = False  # what ALLOCATED said: this start resumes
        self.grace_s: float | None = None  # and the daemon's grace

    def open(self, recover: bool = False) -> Binding:
        """``recover``: a task's, whose body is stopped or told to checkpoint when gpud preempts it."""
        ctx = ray.get_runtime_context()
        ids = sorted(int(i) for i in ctx.get_accelerator_ids().get("GPU", []))
        amount = float(ctx.get_assigned_resources().get("GPU", 0.0))  # type: ignore[no-untyped-call]
        if not ids or amount <= 0:
            return self  # no GPU: nothing to arbitrate
        self.client = client_of(self.options)
        if self.client is None:
            return self
        self.task_id = f"ray.{ctx.get_job_id()}.{self.key}"
        share = amount if amount < 1 else float(len(ids))
        try:
            self._free_earlier_attempt()
            if recover:  # listening from before the ALLOCATE: a notice may follow at once
                self.preemption = Preemption(
                    self.client,
                    self.task_id,
                    self.options.on_preempt,
                    checkpoint_signal=signal_number(self.options.checkpoint_signal, "gpud_task"),
                    run_name=f"ray-run:{os.getpid()}" if self.pause is not None else None,
                )
            allocated = self.client.allocate(
                self.task_id,
                gpus=share,
                prefer=list(ids),
                owner_pid=os.getpid(),
                wait_ms=round(self.options.wait_s * 1000),
                on_preempt=self.options.on_preempt if recover else "terminate",
            )
            self.resume, self.grace_s = allocated.resume, allocated.preemption_grace_s
            if sorted(allocated.gpus) != ids:
                raise GpudError(
                    f"gpud placed {self.task_id} on GPU {allocated.gpus}, not on the GPU {ids} Ray assigned: "
                    "gpud's ledger has other allocations there; Ray and gpud must own the same GPUs"
                )
            memory = self._memory_limit()
            if self.pause is not None and share < 1:  # whole GPUs are the task's alone: nothing to pause
                self.place = self._place(ids[0], share, memory)
            sliced = ids if self.place is None else []
            for local, gpu in enumerate(sliced):  # Ray makes the task's GPUs its CUDA devices 0, 1, ...
                self.sessions.append(
                    self.client.session(
                        gpu,
                        task_id=self.task_id,
                        priority=self.options.priority,
                        idle_release=self.options.idle_release,
                        mem_limit=memory,
                        mem_estimate=self._estimate(gpu, share),
                        framework_hooks=self.options.memory is not None,
                        synchronize=torch_synchronize(local),
                    )
                )
        except BaseException:
            self.close()
            raise
        how = f"paused whole by gpud-run --pause {self.pause}" if self.place else "in slices"
        log.info("gpud enforces %s: %.4g of GPU %s, %s", self.task_id, share, ids, how)
        return self

    def _free_earlier_attempt(self) -> None:
        """Ray runs one attempt of a task at a time, and a retry keeps the task id: an allocation under
        this id is a crashed attempt's, owned by a dead worker, and would be reaped under this one."""
        assert self.client is not None
        try:
            self.client.release_allocation(self.task_id)
        except ProtocolError as exc:
            if exc.code != p.ErrorCode.UNKNOWN_TASK:
                raise

    def _place(self, gpu: int, share: float, memory: int | None) -> Place:
        from gpud_client.run.pycall import Place

        assert self.client is not None and self.pause is not None
        estimate, name = self._estimate(gpu, share), f"ray-run:{os.getpid()}"
        place = Place(socket=self.client.path, gpu=gpu, task_id=self.task_id, pause=self.pause, name=name)
        return replace(place, mem_limit=memory, mem_estimate=estimate, priority=self.options.priority)

    def _memory_limit(self) -> int | None:
        memory = self.options.memory
        if memory is None or memory == "proportional":
            return None  # the allocation's share of the GPU's memory is the session's limit
        return parse_bytes(memory) if isinstance(memory, str) else memory

    def _estimate(self, gpu: int, share: float) -> int | None:
        """What admission counts for the session: its share of the GPU's memory."""
        assert self.client is not None
        total = next((g.memory_total_bytes for g in self.client.welcome.gpus if g.index == gpu), 0)
        return int(total * min(share, 1.0)) or None

    def slice(self) -> contextlib.AbstractContextManager[Any]:
        """Every session's slice, in GPU order (so two multi-GPU tasks never wait on each other). No
        generator for the usual one GPU: its entry and exit run between two kernels, billed."""
        if len(self.sessions) == 1:
            return self.sessions[0].slice()
        return Slices(self.sessions) if self.sessions else contextlib.nullcontext()

    def running(self) -> contextlib.AbstractContextManager[Any]:
        """A task's body runs in it: a preemption carried out (gpud_client.preempted), GPUD_RESUME=1 set."""
        return self.preemption.running(self.resume, self.grace_s) if self.preemption else contextlib.nullcontext()

    def body(self) -> PausableSlice:
        """A whole body (or a sync actor's call) as one slice that gpud may pause where it stands."""
        return PausableSlice(self.sessions)

    def close(self) -> None:
        """Detach the sessions and free the allocation (the daemon also reclaims it if the worker dies)."""
        sessions, self.sessions = self.sessions, []
        for s in sessions:
            s.close()
        if self.preemption is not None:
            self.preemption.close()
        if self.client is not None and self.task_id and not (self.preemption and self.preemption.yielded):
            try:
                self.client.release_allocation(self.task_id)
            except GpudError as exc:
                log.warning(
                    "could not free %s at once (gpud reclaims it when this worker exits): %s", self.task_id, exc
                )
        self.task_id = ""


# --- per worker process ---------------------------------------------------------

_bindings: dict[str, Binding] = {}  # Ray task or actor id -> its binding
_defaults = Options()  # what setup_hook / enable() chose for this worker
# The binding of the task running in this thread, and of the actor this worker is: found without asking
# Ray's runtime context at every slice (tens of microseconds, billed as held time between kernels).
_running = threading.local()
_actor: list[Binding] = []


def _current_key() -> str:
    ctx = ray.get_runtime_context()
    actor = ctx.get_actor_id()
    return f"actor.{actor}" if actor else f"task.{ctx.get_task_id()}"


def current_binding() -> Binding:
    """The running task's (or actor's) binding; one is opened with this worker's defaults if the task
    was not wrapped (setup_hook mode). A task's binding is closed when it ends (wrapped) or when this
    worker runs its next task (not wrapped)."""
    found: Binding | None = getattr(_running, "binding", None) or (_actor[0] if _actor else None)
    if found is not None:
        return found
    key = _current_key()
    binding = _bindings.get(key)
    if binding is None:
        for old in [k for k in _bindings if k.startswith("task.") and k != key]:
            _bindings.pop(old).close()  # an unwrapped task of this worker that has ended
        binding = _bindings[key] = Binding(key, _defaults).open()
    return binding


def gpud_slice() -> contextlib.AbstractContextManager[Any]:
    """One unit of the running task's GPU work under gpud's lock: ``with gpud_slice(): ...``."""
    return current_binding().slice()


def current_sessions() -> list[Session]:
    """The running task's gpud sessions (one per GPU Ray assigned; none without gpud or GPU)."""
    return list(current_binding().sessions)


# The wrappers below are pickled by value when the user's code is (its module is __main__, and
# functools.wraps gives them its name), and a function pickled by value takes copies of the globals it
# names. So they only call module functions, which are pickled by reference and share this worker's
# state, never name _bindings themselves.


def gpud_task(
    fn: F | None = None,
    *,
    slices: Literal["body", "explicit"] = "body",
    pause: Pause | None = None,
    **options: Any,
) -> F | Callable[[F], F]:
    """Wrap a Ray task's function: enforced on its node's gpud while it runs; freed when it ends. ``pause``
    ("auto", "signal", "cuda"): a fractional body runs in a child process paused whole (docs/ray.md)."""
    if pause is not None:
        from gpud_client.run.pycall import check_pause

        check_pause(pause, "gpud_task", slices=slices)

    def wrap(func: F) -> F:
        chosen = replace(_defaults, **options)
        check(chosen.on_preempt, "gpud_task")
        signal_number(chosen.checkpoint_signal, "gpud_task")

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            return _run_task(func, chosen, slices == "body", args, kwargs, pause)

        return run  # type: ignore[return-value]

    return wrap if fn is None else wrap(fn)


def _run_task(
    func: Callable[..., Any], options: Options, whole: bool, args: Any, kwargs: Any, pause: Pause | None = None
) -> Any:
    key = _current_key()
    binding = _bindings[key] = _running.binding = Binding(key, options, pause).open(recover=True)
    try:
        with binding.running():
            if binding.place is not None:  # supervised from this thread: Ray's cancel ends the child's tree
                from gpud_client.run.pycall import call_under_run

                return call_under_run(binding.place, func, args, kwargs, pickler="ray.cloudpickle")
            if whole:
                with binding.body():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
    finally:
        _bindings.pop(key, None)
        _running.binding = None
        binding.close()


def gpud_actor(cls: C | None = None, **options: Any) -> C | Callable[[C], C]:
    """Wrap a Ray actor class: its session lives as long as the actor; each method call is a slice."""
    if "pause" in options:
        raise TypeError(
            "gpud_actor does not take pause=: an actor's state lives in its worker process, where its sync "
            "calls are paused already; pause= (a child process under gpud-run) is for gpud_task"
        )

    def wrap(klass: C) -> C:
        chosen = replace(_defaults, **options)
        init = klass.__init__  # type: ignore[misc]

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            _start_actor(self, init, chosen, args, kwargs)

        attrs: dict[str, Any] = {"__init__": __init__, "__module__": klass.__module__, "__doc__": klass.__doc__}
        for name, member in inspect.getmembers(klass, inspect.isfunction):
            if not name.startswith("_"):
                attrs[name] = _sliced_method(member)
        return type(klass.__name__, (klass,), attrs)  # type: ignore[return-value]

    return wrap if cls is None else wrap(cls)


def _start_actor(actor: Any, init: Callable[..., None], options: Options, args: Any, kwargs: Any) -> None:
    key = _current_key()
    binding = _bindings[key] = Binding(key, options).open()
    _actor[:] = [binding]  # a Ray worker process is one actor for its whole life
    atexit.register(binding.close)
    with binding.body():  # a constructor that loads a model is GPU work too
        init(actor, *args, **kwargs)


def _sliced_method(method: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def run_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await _in_slice_async(method, self, args, kwargs)

        return run_async

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with current_binding().body():
            return method(self, *args, **kwargs)

    return run


async def _in_slice_async(method: Callable[..., Any], actor: Any, args: Any, kwargs: Any) -> Any:
    ctx = current_binding().slice()
    await asyncio.to_thread(ctx.__enter__)  # waiting for the lock must not stop the actor's loop
    try:
        result = await method(actor, *args, **kwargs)
    except BaseException as exc:
        await asyncio.to_thread(ctx.__exit__, type(exc), exc, exc.__traceback__)
        raise
    await asyncio.to_thread(ctx.__exit__, None, None, None)
    return result


def enable(**options: Any) -> None:
    """Turn gpud on for every task this worker runs: ``gpud_slice()`` then works in any task, and a
    node without gpud is found (and, with on_missing="fail", refused) when the worker starts."""
    global _defaults
    _defaults = replace(_defaults, **options)
    client_of(_defaults)


def setup_hook() -> None:
    """For ``runtime_env={"worker_process_setup_hook": "gpud_client.ray.setup_hook"}``. Options come from
    the job's environment: GPUD_RAY_ON_MISSING (fail|warn), GPUD_RAY_MEMORY (proportional|off|a size)."""
    memory = os.environ.get("GPUD_RAY_MEMORY", "proportional")
    on_missing = os.environ.get("GPUD_RAY_ON_MISSING", "fail")
    if on_missing not in ("fail", "warn"):
        raise ValueError(f"GPUD_RAY_ON_MISSING must be fail or warn, not {on_missing!r}")
    enable(memory=None if memory == "off" else memory, on_missing=on_missing)
