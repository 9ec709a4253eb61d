"""What ``gpuctl run`` / ``gpud-run`` is given, checked before anything is asked of gpud.

Two ways to give the program a GPU: a place on one GPU like a session (``--gpu``,
``--core-limit``, ``--mem-limit``, ``--mem-estimate``, ``--priority``), or an
allocation as ``gpuctl alloc`` makes it (``--gpus``, ``--cpus``, ``--task``,
``--tenant``, ``--wait``), owned by the run, with what the run does when gpud takes it
back (``--on-preempt``, ``--checkpoint-signal``, ``--on-resize``). Options that belong to
the other way, or that would do nothing, are refused with the reason, and so is a ``--trace``
file the run could not append to (exit 2, before the program starts); so is a command that
cannot be found (exit 127) or executed (126).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpud_client import argtypes as at
from gpud_client import protocol as p
from gpud_client.argtypes import UsageError
from gpud_client.core.recovery import Resize

PAUSE_BACKENDS = ("auto", "cuda", "signal", "cgroup")
RECOVERIES = tuple(r.value for r in p.Recovery)
RESIZES = ("restart", "keep")
NOT_FOUND, NOT_EXECUTABLE = 127, 126


class CommandError(Exception):
    """The command cannot be run: ``status`` is the shell's (127 not found, 126 not executable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def default_task_id() -> str:
    """A run's task id: unguessable, so that no other uid can take it first and make the run fail."""
    return f"run-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"


@dataclass(frozen=True, slots=True)
class RunOptions:
    command: list[str]
    socket: str | None = None
    name: str = ""
    # a place on one GPU
    gpu: int | str = 0
    core_limit: int = 100
    mem_limit: int | None = None
    mem_estimate: int | None = None
    priority: int | str | None = None
    # an allocation (gpus not None)
    gpus: float | None = None  # with gpus_max: an elastic allocation's minimum
    gpus_max: int | None = None
    cpus: int = 0
    task: str | None = None
    tenant: str | None = None
    wait_ms: int = 0
    # when gpud takes the allocation back
    on_preempt: str = "terminate"
    checkpoint_signal: int = signal.SIGUSR1
    on_resize: Resize = "restart"
    # how
    pause: str = "auto"
    idle_release: float | None = None
    signal_grace: float = 5.0
    lock_timeout_ms: int = 1000
    max_escapes: int = 3  # the signal backend ends a program whose processes escaped a pause this often (0: never)
    on_missing: str = "error"
    trace: str | None = None

    @property
    def whole_gpus(self) -> bool:
        """An allocation of whole GPUs: the program has them to itself and is never paused."""
        return self.gpus is not None and self.gpus >= 1

    def task_id(self) -> str:
        return self.task or default_task_id()


_SESSION_ONLY = {"gpu": "--gpu"}
_ALLOCATION_ONLY = {
    "cpus": "--cpus",
    "tenant": "--tenant",
    "wait_ms": "--wait",
    "on_preempt": "--on-preempt",
    "checkpoint_signal": "--checkpoint-signal",
    "on_resize": "--on-resize",
}
_SHARED_GPU_ONLY = {
    "core_limit": "--core-limit",
    "mem_limit": "--mem-limit",
    "mem_estimate": "--mem-estimate",
    "idle_release": "--idle-release",
}


def build_parser(prog: str) -> argparse.ArgumentParser:
    ap = at.Parser(
        prog=prog,
        description="Run an unmodified program under gpud: it runs on a shared GPU only while its turn "
        "lasts, paused (its whole process tree) in between.",
        usage=f"{prog} [OPTIONS] -- CMD [ARGS...]",
    )
    ap.add_argument("--socket", help="gpud's socket (default: $GPUD_SOCKET or /run/gpud/gpud.sock)")
    ap.add_argument("--name", type=at.tenant, help="the name gpuctl clients shows (default: run:CMD)")
    one = ap.add_argument_group("a place on one GPU, like a session")
    one.add_argument("--gpu", type=at.gpu_arg, help="the GPU: index, gpu:N or UUID (default 0)")
    one.add_argument("--core-limit", type=at.core_percent, metavar="PERCENT", help="percent of GPU time")
    one.add_argument("--mem-limit", type=at.size_arg, metavar="SIZE", help="e.g. 8GiB")
    one.add_argument("--mem-estimate", type=at.size_arg, metavar="SIZE", help="GPU memory admission counts")
    one.add_argument("--priority", type=at.priority_arg, help=f"{at.bounds(p.Priority)} (or a class, allocations)")
    alloc = ap.add_argument_group("an allocation, owned by the run and freed when it ends")
    alloc.add_argument(
        "--gpus",
        type=at.gpus_or_range,
        help="whole number >= 1 (exclusive), a fraction of one GPU, or MIN..MAX whole GPUs (elastic)",
    )
    alloc.add_argument("--cpus", type=at.cpus, help="CPU cores")
    alloc.add_argument(
        "--task",
        type=at.task_id,
        help="the task id (default run-HOST-PID-RANDOM); without --gpus: the session belongs to this task's "
        "existing fractional allocation, whose share caps it",
    )
    alloc.add_argument("--tenant", type=at.tenant)
    alloc.add_argument("--wait", dest="wait_ms", type=at.wait, metavar="SECONDS", help="wait up to this long for room")
    pre = ap.add_argument_group("when gpud takes the allocation back (docs/run.md)")
    pre.add_argument(
        "--on-preempt",
        choices=RECOVERIES,
        help="terminate (default): SIGTERM, SIGKILL at the grace's end; checkpoint: signal, wait, start again "
        "with GPUD_RESUME=1; suspend: pause until the devices are back; shrink: elastic only; fail: end, exit 1",
    )
    pre.add_argument(
        "--checkpoint-signal", type=signal_arg, metavar="SIG", help="checkpoint: the signal to send (USR1)"
    )
    pre.add_argument(
        "--on-resize",
        choices=RESIZES,
        help="elastic: restart (default) the program on its new GPUs, or keep it running as it is",
    )
    how = ap.add_argument_group("how the program is paused")
    how.add_argument(
        "--pause",
        choices=PAUSE_BACKENDS,
        default="auto",
        help="auto (default): gpud freezes the program's cgroup where it has one, with the CUDA driver's checkpoint "
        "API where the driver has it; cgroup: the same, but fail without a cgroup; cuda: the driver's API alone; "
        "signal: SIGSTOP/SIGCONT alone",
    )
    how.add_argument(
        "--max-escapes",
        type=escapes_arg,
        default=3,
        metavar="N",
        help="signal: end the program when its processes have run while paused (SIGCONT from outside) N times; "
        "0: never (3)",
    )
    how.add_argument(
        "--idle-release",
        type=at.positive_seconds,
        metavar="SECONDS",
        help="give the GPU back after this long without activity (default: never)",
    )
    how.add_argument(
        "--signal-grace",
        type=at.positive_seconds,
        default=5.0,
        metavar="SECONDS",
        help="a paused program resumed to receive a signal runs at most this long before it waits again (5)",
    )
    how.add_argument(
        "--lock-timeout",
        dest="lock_timeout_ms",
        type=at.max_wait,
        default=1000,
        metavar="MS",
        help="cuda: how long a pause waits for submitted GPU work before falling back to SIGSTOP (1000)",
    )
    how.add_argument(
        "--on-missing",
        choices=("error", "run"),
        default="error",
        help="no gpud at start: fail (default), or run the program unarbitrated with a warning",
    )
    how.add_argument(
        "--trace",
        type=trace_file,
        metavar="FILE",
        help="append one JSON line per event (DROP_LOCK, pause, release, grant, resume, park) with its time",
    )
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    return ap


def parse(argv: Sequence[str], prog: str = "gpud-run") -> RunOptions:
    """The options, or UsageError naming what is wrong (exit 2); the command is checked separately
    (``check_command``)."""
    ap = build_parser(prog)
    args = ap.parse_args(list(argv))
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("give the program to run after --, e.g. -- python train.py", ap.format_usage(), prog)
    given = {k for k, v in vars(args).items() if v is not None and k != "command"} - {
        "pause",
        "signal_grace",
        "lock_timeout_ms",
        "max_escapes",
        "on_missing",
        "trace",
    }

    def refuse(message: str) -> UsageError:
        return UsageError(message, ap.format_usage(), prog)

    elastic = isinstance(args.gpus, at.GpuRange)
    if args.gpus is not None:
        if "gpu" in given:
            raise refuse("--gpu (a place on one GPU) and --gpus (an allocation) do not go together: pick one")
        if args.gpus == 0:
            raise refuse("argument --gpus: a run needs a GPU: a whole number >= 1 or a fraction 0 < x < 1")
        _check_recovery(args, elastic, refuse)
        if elastic or args.gpus >= 1:
            useless = [flag for key, flag in _SHARED_GPU_ONLY.items() if key in given]
            if useless:
                are, do = ("is", "does") if len(useless) == 1 else ("are", "do")
                raise refuse(
                    f"{_listed(useless)} {are} for a share of one GPU and {do} nothing with whole GPUs "
                    f"(--gpus {_shown(args.gpus)}): the program has them to itself and is never paused"
                )
    else:
        alloc_only = [flag for key, flag in _ALLOCATION_ONLY.items() if key in given]
        if alloc_only:
            belong = "belongs" if len(alloc_only) == 1 else "belong"
            raise refuse(f"{_listed(alloc_only)} {belong} to an allocation: add --gpus N or a fraction such as 0.5")
        if isinstance(args.priority, str):
            raise refuse(f"argument --priority: a class ({args.priority}) is for allocations (--gpus); give a number")
    return RunOptions(
        command=command,
        socket=args.socket,
        name=args.name or f"run:{os.path.basename(command[0])}"[:128],
        gpu=0 if args.gpu is None else args.gpu,
        core_limit=100 if args.core_limit is None else args.core_limit,
        mem_limit=args.mem_limit,
        mem_estimate=args.mem_estimate,
        priority=args.priority,
        gpus=float(args.gpus.min) if elastic else args.gpus,
        gpus_max=args.gpus.max if elastic else None,
        cpus=args.cpus or 0,
        task=args.task or (default_task_id() if args.gpus is not None else None),
        tenant=args.tenant,
        wait_ms=args.wait_ms or 0,
        on_preempt=args.on_preempt or "terminate",
        checkpoint_signal=signal.SIGUSR1 if args.checkpoint_signal is None else args.checkpoint_signal,
        on_resize=args.on_resize or "restart",
        pause=args.pause,
        idle_release=args.idle_release,
        signal_grace=args.signal_grace,
        lock_timeout_ms=args.lock_timeout_ms,
        max_escapes=args.max_escapes,
        on_missing=args.on_missing,
        trace=args.trace,
    )


def signal_arg(text: str) -> int:
    """A signal a program can catch, by name (USR1, SIGUSR1) or number."""
    name = text.strip().upper()
    try:
        sig = (
            signal.Signals(int(name))
            if name.isdigit()
            else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        )
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a signal: {text!r} (e.g. USR1, SIGUSR2, 10)") from None
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise argparse.ArgumentTypeError(f"{sig.name} cannot be caught: the program could not checkpoint on it")
    return int(sig)


def escapes_arg(text: str) -> int:
    """--max-escapes: a whole number, 0 (never end the program for escaping) up to the protocol's bound."""
    if not text.isdigit() or int(text) > 2**31:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def trace_file(text: str) -> str:
    """--trace FILE: a file the run can append to, checked before anything starts, so that a typo is bad
    usage rather than a traceback. The run makes the file when it starts, not here."""
    why = _unwritable(text)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


def _unwritable(path: str) -> str:
    """Why the run could not append to ``path`` (empty: it can), as far as this process can tell."""
    if not path:
        return "give a file to append to"
    if os.path.isdir(path):
        return f"{path} is a directory: give a file to append to"
    if os.path.exists(path):
        return "" if os.access(path, os.W_OK) else f"cannot write {path}: permission denied"
    parent = os.path.dirname(path) or "."
    try:
        mode = os.stat(parent).st_mode
    except FileNotFoundError:
        return f"cannot create {path}: no directory {parent}"
    except NotADirectoryError:  # a file as a directory on the way
        return f"cannot create {path}: {parent} is not a directory"
    except OSError as exc:  # a directory on the way that this user cannot search
        return f"cannot create {path}: {(exc.strerror or 'cannot look').lower()} ({parent})"
    if not stat.S_ISDIR(mode):
        return f"cannot create {path}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path}: permission denied in {parent}"
    return ""


def _listed(flags: list[str]) -> str:
    return flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]}"


def _shown(gpus: float | at.GpuRange) -> str:
    return f"{gpus.min}..{gpus.max}" if isinstance(gpus, at.GpuRange) else f"{gpus:g}"


def _check_recovery(args: argparse.Namespace, elastic: bool, refuse: Callable[[str], UsageError]) -> None:
    """What the run does when gpud takes the allocation back must fit the allocation."""
    recovery = args.on_preempt or "terminate"
    if args.checkpoint_signal is not None and recovery != "checkpoint":
        raise refuse("--checkpoint-signal goes with --on-preempt checkpoint (the signal that asks for a checkpoint)")
    if recovery == "shrink" and not elastic:
        raise refuse(
            f"--on-preempt shrink needs an elastic allocation (--gpus MIN..MAX), not --gpus {_shown(args.gpus)}: "
            "only the GPUs above its minimum can be given back"
        )
    if args.on_resize is not None and not elastic:
        raise refuse(
            f"--on-resize does nothing without an elastic allocation (--gpus MIN..MAX), not --gpus {_shown(args.gpus)}"
        )


def check_command(command: list[str], path: str | None = None) -> str:
    """The executable ``command[0]`` names, or CommandError as a shell would say it."""
    name = command[0]
    if "/" in name:
        if not os.path.exists(name):
            raise CommandError(NOT_FOUND, f"{name}: no such file")
        found = name
    else:
        found = shutil.which(name, path=path) or ""
        if not found:
            if shutil.which(name, mode=os.F_OK, path=path):
                raise CommandError(NOT_EXECUTABLE, f"{name}: permission denied (not executable)")
            raise CommandError(NOT_FOUND, f"{name}: command not found")
    if os.path.isdir(found):
        raise CommandError(NOT_EXECUTABLE, f"{name}: is a directory")
    if not os.access(found, os.X_OK):
        raise CommandError(NOT_EXECUTABLE, f"{name}: permission denied (not executable)")
    return found
