"""``gpud-run`` (and ``gpuctl run``): run an unmodified program under gpud.

The program runs on a shared GPU only while the run's session holds the lock; in
between its whole process tree is paused: frozen in a cgroup that gpud holds
(``cgroup``) where gpud has one, through the CUDA driver's checkpoint API (``cuda``:
lock and unlock, and park its memory in host memory when gpud needs it) where the
driver has it (the two together: lock, then freeze), or by SIGSTOP and SIGCONT
(``signal``, watched for escapes) elsewhere. See docs/run.md. ``main`` is the command
line; ``python -m gpud_client.run`` runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import IO

from gpud_client.argtypes import UsageError
from gpud_client.client import Client
from gpud_client.errors import DaemonUnavailable, GpudError
from gpud_client.proctl.base import Backend
from gpud_client.proctl.keeper import Keeper
from gpud_client.proctl.signals import SignalBackend
from gpud_client.run.allocation import Listener, allocate, connect, gpu_free, library_warnings_said, tree_memory
from gpud_client.run.contain import NoCgroup, contain
from gpud_client.run.options import CommandError, RunOptions, check_command, parse
from gpud_client.run.supervisor import Supervisor
from gpud_client.runinfo import run_labels

__all__ = ["RunOptions", "Supervisor", "main", "parse", "run_program"]


class _Fail(Exception):
    pass


def choose_backend(opts: RunOptions, sup: Supervisor) -> tuple[Backend, str]:
    """The backend ``--pause`` names for the GPU work (cuda or signal; gpud's cgroup comes later, with
    ``contain``), and why not cuda under ``auto``; ``auto`` says when it took cuda. Raises _Fail when
    ``cuda`` was asked for and the driver cannot do it."""
    if opts.pause == "signal":
        return SignalBackend(on_escape=sup.escaped), ""
    from gpud_client.proctl.cuda import CudaBackend, CudaDriver

    driver = CudaDriver()
    why_not = driver.probe()
    if why_not is None:
        if opts.pause != "cuda":
            sup.say("pausing with the CUDA driver's checkpoint API (cuda); SIGSTOP for processes without CUDA")
        cuda = CudaBackend(
            driver=driver,
            lock_timeout_ms=opts.lock_timeout_ms,
            gpu_free=lambda: gpu_free(sup.client, sup.session),
            tree_memory=lambda: tree_memory(sup.client, sup.session),
        )
        return cuda, ""
    driver.close()
    if opts.pause == "cuda":
        raise _Fail(f"--pause cuda: the CUDA driver's checkpoint API is not available: {why_not}")
    return SignalBackend(on_escape=sup.escaped), why_not  # said with what gpud's cgroup adds (_contain)


def _contain(
    client: Client | None, opts: RunOptions, pid: int, backend: Backend | None, why_not_cuda: str, sup: Supervisor
) -> Backend | None:
    """Hand the program to gpud (before it execs); the backend with gpud's cgroup where gpud has one.
    Says what ``auto`` took. Raises _Fail for ``--pause cgroup`` without a cgroup."""
    if client is None:
        return backend
    try:
        backend, sup.containment = contain(client, opts, pid, backend, sup.escaped)
    except NoCgroup as exc:
        raise _Fail(str(exc)) from None
    if backend is None or opts.pause not in ("auto", "cgroup"):
        return backend
    said = why_not_cuda and _has_gpu(client)
    cuda = f"; the CUDA checkpoint API is not available: {why_not_cuda}" if said else ""
    if sup.containment.in_cgroup:
        sup.say(f"pausing by freezing the program's cgroup in gpud ({backend.name}): SIGCONT cannot wake it{cuda}")
    elif backend.name == "signal":
        sup.say(f"pausing with SIGSTOP/SIGCONT (signal){cuda}; gpud has no cgroup for it: {sup.containment.why}")
    return backend


def _has_gpu(client: Client) -> bool:
    """Whether gpud serves a GPU of this machine rather than simulated ones: only there is it worth saying
    why ``auto`` did not take the CUDA checkpoint API (a missing binding: how to install it)."""
    try:
        return any(not g.simulated for g in client.status().gpus)
    except GpudError:  # unknown: say it
        return True


def main(argv: Sequence[str] | None = None, prog: str = "gpud-run") -> int:
    """The command line: the program's exit status, or the run's own (1: gpud refused or failed,
    2: bad usage, 126/127: the command cannot be executed / found)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts = parse(argv, prog)
    except UsageError as exc:
        print(f"{exc.usage}{exc.prog}: error: {exc.message}", file=sys.stderr)
        return 2
    try:
        with library_warnings_said(prog):
            return run_program(opts, prog=prog)
    except KeyboardInterrupt:  # before the program started (waiting for room, say): the keeper ends it
        return 128 + 2


def run_program(
    opts: RunOptions, *, prog: str = "gpud-run", err: IO[str] | None = None, forward_signals: bool = True
) -> int:
    """Run ``opts.command`` under gpud as ``gpud-run`` does, from Python (the Ray and Airflow
    integrations): returns its exit status. ``forward_signals`` needs the main thread; without it,
    the caller ends the run by ending the program."""
    try:
        sup = Supervisor(opts, prog=prog, err=err, forward_signals=forward_signals)
    except OSError as exc:  # opening --trace's file: parse checked it, but it changed since, or parse was skipped
        why = (exc.strerror or str(exc)).lower()
        print(f"{prog}: error: argument --trace: cannot append to {opts.trace}: {why}", file=err or sys.stderr)
        return 2
    try:
        check_command(opts.command)
    except CommandError as exc:
        sup.say(str(exc))
        return exc.status
    exclusive = opts.whole_gpus
    suspends = opts.on_preempt == "suspend"  # whole GPUs too: a backend pauses the program, no lock
    try:
        backend, why_not_cuda = (None, "") if exclusive and not suspends else choose_backend(opts, sup)
    except _Fail as exc:
        sup.say(str(exc))
        return 1
    keeper = Keeper.start(opts.command)
    client = allocated = None
    try:
        client = connect(
            opts, run_labels(opts.command, keeper.program_pid, backend.name if backend else "none"), sup.say
        )
        if client is not None and opts.gpus is not None:
            task_id = opts.task_id()
            client.add_allocation_listener(Listener(task_id, sup.post))
            allocated = allocate(client, opts, task_id, opts.wait_ms)
        if client is not None and opts.gpus is None and opts.task is not None:
            _check_joined(client, opts)
        backend = _contain(client, opts, keeper.program_pid, backend, why_not_cuda, sup)
    except DaemonUnavailable as exc:
        sup.say(f"{exc} (start gpud, or give --on-missing run to run the program without it)")
        return _abandon(keeper, client, backend)
    except _Fail as exc:
        sup.say(str(exc))
        return _abandon(keeper, client, backend)
    except GpudError as exc:
        sup.say(f"gpud refused the allocation: {exc}")
        return _abandon(keeper, client, backend)
    sup.use(backend if client is not None else None, arbitrated=not exclusive)
    if backend is not None and sup.backend is None:
        backend.close()
    try:
        return sup.run(keeper, client, allocated)
    except GpudError as exc:
        sup.say(str(exc))
        return 1


def _check_joined(client: Client, opts: RunOptions) -> None:
    """``--task`` without ``--gpus``: the task's allocation must be there, on the run's GPU; a typo would
    otherwise run the program uncapped."""
    held = next((a for a in client.allocations().allocations if a.task_id == opts.task), None)
    if held is None:
        raise _Fail(
            f"--task {opts.task}: gpud has no allocation of that task to join (gpuctl allocs lists them; "
            "give --gpus to make one with the run)"
        )
    if isinstance(opts.gpu, int) and opts.gpu not in held.gpus:
        raise _Fail(f"--task {opts.task}: its allocation is on GPU {held.gpus}, not on GPU {opts.gpu} (--gpu)")


def _abandon(keeper: Keeper, client: object, backend: Backend | None) -> int:
    keeper.close()
    if backend is not None:
        backend.close()
    close = getattr(client, "close", None)
    if close is not None:
        close()
    return 1
