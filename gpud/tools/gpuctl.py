"""`gpuctl`: the command line of gpud. Tables for people, --json for scripts.

Finds the daemon like everything else does: --socket, else $GPUD_SOCKET, else
/run/gpud/gpud.sock. Every error names the problem and exits non-zero: 1 when the
daemon refused or is unreachable, 2 for bad usage. Bad usage is found before
anything is sent: each value is checked against the protocol's own types (so gpuctl
keeps no copy of a limit), and its message names the flag and the unit. With --json,
errors are JSON too: one line ``{"error": {"code": ..., "message": ...}}`` on stderr,
with the same exit codes (code "usage" for bad usage, "unavailable" when the daemon
cannot be reached, else the daemon's error code); stdout stays empty.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

import msgspec

from gpud.tools.allocview import render_allocs
from gpud.tools.nodeview import render_clients, render_leases, render_policies, render_status
from gpud.tools.top import run as run_top
from gpud_client import argtypes as at
from gpud_client import protocol as p
from gpud_client.argtypes import UsageError
from gpud_client.connection import Connection
from gpud_client.errors import DaemonUnavailable, GpudError, ProtocolError
from gpud_client.taskenv import allocation_env
from gpud_client.units import format_bytes

M = TypeVar("M", bound=msgspec.Struct)


class Failed(GpudError):
    """gpuctl's own refusal of an answer (exit 1), with a code for --json."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _ShowVersion(Exception):
    """--version was given: main prints the versions (as JSON with --json)."""


def _connect(args: argparse.Namespace) -> Connection:
    conn = Connection(args.socket)
    conn.hello("gpuctl")
    return conn


def _emit(args: argparse.Namespace, obj: msgspec.Struct, text: str, **extra: Any) -> None:
    if args.json:
        data = msgspec.to_builtins(obj)
        data.pop("id", None)
        data.pop("type", None)
        print(json.dumps({**data, **extra}, indent=2))
    else:
        print(text)


def _done(args: argparse.Namespace, what: str, **fields: Any) -> None:
    if args.json:
        print(json.dumps({"ok": True, **fields}))
    else:
        print(what)


# The flag (or argument) each request field comes from, for messages.
_FLAGS = {
    "task_id": "--task",
    "gpus": "--gpus",
    "cpus": "--cpus",
    "prefer": "--prefer",
    "strategy": "--strategy",
    "tenant": "--tenant",
    "priority": "--priority",
    "priority_class": "--priority",
    "wait_ms": "--wait",
    "owner_pid": "--owner-pid",
    "owner_any_uid": "--owner-any-uid",
    "seconds": "SECONDS",
    "gpu": "--gpu",
    "client": "CLIENT",
    "core_limit": "--core",
    "mem_limit": "--mem",
    "task_type": "TASK_TYPE",
    "max_wait_ms": "--max-wait",
    "queue_limit": "--queue-limit",
    "hold_max_ms": "--hold-max",
    "busy_policy": "--busy",
    "mode": "MODE",
    "on_preempt": "--on-preempt",
    "gpus_max": "--gpus",
    "protected": "--protected",
}


def _message(cls: type[M], **fields: Any) -> M:
    """The request as the protocol's own types check it, before anything is sent: a value they
    refuse is bad usage, named by its flag."""
    try:
        return msgspec.convert({"id": 0, **fields}, cls)
    except msgspec.ValidationError as exc:
        field = re.search(r"\$\.(\w+)", str(exc))
        name = field.group(1) if field else ""
        raise UsageError(f"argument {_FLAGS.get(name, name or 'value')}: {exc}") from None


def _call(args: argparse.Namespace, msg: msgspec.Struct, timeout: float = 10.0) -> Any:
    with _connect(args) as conn:
        return conn.call(msgspec.structs.replace(msg, id=conn.next_id()), timeout=timeout)


def _where(gpu: int | str | None) -> str:
    """The GPUs a change applies to, as a sentence names them: every GPU, GPU 1, or its UUID."""
    if gpu is None:
        return "every GPU"
    if isinstance(gpu, str) and not gpu.startswith("gpu:"):
        return gpu
    return f"GPU {gpu if isinstance(gpu, int) else gpu[4:]}"


def cmd_status(args: argparse.Namespace) -> None:
    reply = _call(args, p.Status(id=0))
    _emit(args, reply, render_status(reply))


def cmd_clients(args: argparse.Namespace) -> None:
    with _connect(args) as conn:
        reply = conn.call(p.ListClients(id=conn.next_id()), timeout=10.0)
        try:
            programs: p.RunsReply | None = conn.call(p.ListRuns(id=conn.next_id()), timeout=10.0)
        except ProtocolError as exc:  # a gpud from before RUNS
            if exc.code != p.ErrorCode.UNKNOWN_TYPE:
                raise
            programs = None
    runs = [] if programs is None else [msgspec.to_builtins(r) for r in programs.runs]
    _emit(args, reply, render_clients(reply, programs), runs=runs)


def cmd_tq(args: argparse.Namespace) -> None:
    _call(args, _message(p.SetTq, seconds=args.seconds, gpu=args.gpu))
    _done(args, f"the time quantum is {args.seconds:g}s on {_where(args.gpu)}", tq_s=args.seconds, gpu=args.gpu)


def cmd_sched(args: argparse.Namespace) -> None:
    on = args.state == "on"
    _call(args, _message(p.SchedOn if on else p.SchedOff, gpu=args.gpu))
    what = "" if on else ": every request is granted at once"
    _done(args, f"the scheduler is {args.state} for {_where(args.gpu)}{what}", scheduler_on=on, gpu=args.gpu)


def cmd_mode(args: argparse.Namespace) -> None:
    _call(args, _message(p.SetMode, mode=args.mode, gpu=args.gpu))
    _done(args, f"{_where(args.gpu)} is in {args.mode} mode", mode=args.mode, gpu=args.gpu)


def cmd_leases(args: argparse.Namespace) -> None:
    reply = _call(args, p.ListLeases(id=0))
    _emit(args, reply, render_leases(reply))


def cmd_policy(args: argparse.Namespace) -> None:
    fields = {
        "priority": args.priority,
        "busy_policy": args.busy,
        "max_wait_ms": args.max_wait,
        "queue_limit": args.queue_limit,
        "hold_max_ms": args.hold_max,
    }
    changes = {k: v for k, v in fields.items() if v is not None}
    if changes and args.task_type is None:
        raise UsageError("name the task type whose policy to change, e.g. gpuctl policy ASR --max-wait 2000")
    change = _message(p.SetPolicy, task_type=args.task_type, **changes) if changes else None
    with _connect(args) as conn:
        if change is not None:
            conn.call(msgspec.structs.replace(change, id=conn.next_id()))
        reply = conn.call(p.ListPolicies(id=conn.next_id()))
    if args.task_type is not None and not changes and args.task_type not in reply.policies:
        raise Failed("unknown_task_type", f"no policy for task type {args.task_type!r} (it would use OTHER's)")
    if args.task_type is not None:
        reply = p.PoliciesReply(id=reply.id, policies={args.task_type: reply.policies[args.task_type]})
    _emit(args, reply, render_policies(reply))


def cmd_alloc(args: argparse.Namespace) -> None:
    if args.gpus == 0 and args.cpus == 0:
        raise UsageError(
            "argument --gpus: 0 asks for no GPU: add --cpus N for CPU cores alone, "
            "or ask for --gpus 1 or a fraction such as 0.5"
        )
    span: at.GpuRange | None = args.gpus if isinstance(args.gpus, at.GpuRange) else None
    if args.on_preempt == p.Recovery.SHRINK and span is None:
        raise UsageError(
            "argument --on-preempt: shrink gives back the GPUs an elastic allocation has above its "
            "minimum: it needs --gpus MIN..MAX",
            prog="gpuctl alloc",
        )
    priority: int | str | None = args.priority
    msg = _message(
        p.Allocate,
        task_id=args.task,
        gpus=args.gpus if span is None else span.min,
        gpus_max=None if span is None else span.max,
        on_preempt=args.on_preempt or p.Recovery.TERMINATE,
        protected=args.protected,
        cpus=args.cpus,
        prefer=args.prefer,
        strategy=args.strategy,
        tenant=args.tenant,
        priority=priority if isinstance(priority, int) else None,
        priority_class=priority if isinstance(priority, str) else None,
        wait_ms=args.wait_ms,
        owner_pid=args.owner_pid,
        owner_any_uid=args.owner_any_uid,
        notify=False,  # gpuctl does not stay to be told: the answer says who can be (the owner)
    )
    reply: p.Allocated = _call(args, msg, timeout=args.wait_ms / 1000 + 30)
    asked = args.on_preempt or span or priority in (p.PriorityClass.SPOT, p.SPOT_PRIORITY)
    if asked and not reply.preemptible and not args.protected and not args.json:
        # Asked to be preemptible and is not (gpud's word, as ALLOCS says it): stdout is for eval,
        # the note goes to stderr.
        hint = " (give --owner-pid, or run the task with gpuctl run)" if args.owner_pid is None else ""
        print(f"gpuctl: note: task {reply.task_id} is not preemptible: {reply.why}{hint}", file=sys.stderr)
    env = allocation_env(reply)
    if args.json:
        _emit(args, reply, "", env=env)
    else:
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))


def cmd_free(args: argparse.Namespace) -> None:
    _call(args, _message(p.Free, task_id=args.task))
    _done(args, f"freed the allocation of task {args.task}", task_id=args.task)


def cmd_allocs(args: argparse.Namespace) -> None:
    with _connect(args) as conn:  # a page at a time, on one connection
        pages = [conn.call(p.ListAllocations(id=conn.next_id()), timeout=10.0)]
        while (after := pages[-1].next_after) is not None:
            pages.append(conn.call(p.ListAllocations(id=conn.next_id(), after=after), timeout=10.0))
    reply = p.join_pages(pages)
    _emit(args, reply, render_allocs(reply))


def cmd_drain(args: argparse.Namespace) -> None:
    reply = _call(args, _message(p.Drain, gpu=args.gpu, on=args.on))
    gpu, was = (reply.gpu, reply.was_draining) if isinstance(reply, p.Drained) else (args.gpu, not args.on)
    if was == args.on:  # gpud's word: nothing changed
        what = (
            f"GPU {gpu} drains already: nothing changed" if args.on else f"GPU {gpu} was not draining: nothing changed"
        )
    elif args.on:
        what = f"GPU {gpu} draining: no new allocations there; its allocations are preempted with their recovery"
    else:
        what = f"GPU {gpu} undrained: back in service"
    _done(args, what, gpu=gpu, draining=args.on, changed=was != args.on)


def cmd_protect(args: argparse.Namespace) -> None:
    _call(args, _message(p.Protect, task_id=args.task, protected=args.protected))
    what = (
        "protected: it is never preempted"
        if args.protected
        else "no longer protected: its priority decides again whether it may be preempted"
    )
    _done(args, f"task {args.task} {what}", task_id=args.task, protected=args.protected)


def cmd_top(args: argparse.Namespace) -> int:
    return run_top(args.socket, args.interval, as_json=args.json, count=args.count)


def cmd_limit(args: argparse.Namespace) -> None:
    if args.core is None and args.mem is None:
        raise UsageError("nothing to change: give --core PERCENT and/or --mem SIZE", prog="gpuctl limit")
    msg = _message(p.SetLimits, client=args.client, gpu=args.gpu, core_limit=args.core, mem_limit=args.mem)
    reply = _call(args, msg)
    what = ", ".join(
        x
        for x in (
            None if args.core is None else f"core {args.core}%",
            None if args.mem is None else ("memory unlimited" if args.mem == 0 else f"memory {format_bytes(args.mem)}"),
        )
        if x
    )
    _done(
        args,
        f"{what} for client {args.client}, session(s) {', '.join(map(str, reply.sessions))}",
        client=args.client,
        sessions=reply.sessions,
        core_limit=args.core,
        mem_limit=args.mem,
    )


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise _ShowVersion


def versions() -> dict[str, str | int]:
    """gpuctl's (the gpud distribution's), gpud-client's and the wire protocol's."""
    import importlib.metadata  # here: only --version needs it, and it is slow to import

    def of(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return {"gpuctl": of("gpud"), "gpud": of("gpud"), "gpud_client": of("gpud-client"), "protocol": p.PROTOCOL_VERSION}


def build_parser() -> argparse.ArgumentParser:
    common = at.Parser(add_help=False)
    # SUPPRESS: an option given before or after the command both count.
    common.add_argument(
        "--socket", default=argparse.SUPPRESS, help="gpud socket (default: $GPUD_SOCKET or /run/gpud/gpud.sock)"
    )
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="machine-readable output; errors as JSON on stderr",
    )
    ap = at.Parser(prog="gpuctl", description="Inspect and steer gpud.", parents=[common])
    ap.add_argument("--version", action=_Version, help="print gpuctl's, gpud's and gpud-client's versions")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("status", parents=[common], help="per GPU: mode, TQ, holder, queue, clients").set_defaults(
        func=cmd_status
    )
    top = sub.add_parser("top", parents=[common], help="live view of GPUs, sessions and leases (q to quit)")
    top.add_argument("--interval", type=at.positive_seconds, default=1.0, metavar="SECONDS")
    top.add_argument("--count", type=at.count, metavar="N", help="stop after N refreshes (default: until q)")
    top.set_defaults(func=cmd_top)
    sub.add_parser("clients", parents=[common], help="connected clients and their sessions").set_defaults(
        func=cmd_clients
    )
    gpu_help = "index, gpu:N or UUID (default: every GPU)"
    tq = sub.add_parser("tq", parents=[common], help="set the time quantum (admin)")
    tq.add_argument("seconds", type=at.tq, metavar="SECONDS", help=f"{at.bounds(p.Seconds)} seconds")
    tq.add_argument("--gpu", type=at.gpu_arg, help=gpu_help)
    tq.set_defaults(func=cmd_tq)
    sched = sub.add_parser("sched", parents=[common], help="turn the scheduler on or off (admin)")
    sched.add_argument("state", choices=["on", "off"])
    sched.add_argument("--gpu", type=at.gpu_arg, help=gpu_help)
    sched.set_defaults(func=cmd_sched)
    mode = sub.add_parser("mode", parents=[common], help="serial, concurrent or auto admission (admin)")
    mode.add_argument("mode", choices=[m.value for m in p.Mode])
    mode.add_argument("--gpu", type=at.gpu_arg, help=gpu_help)
    mode.set_defaults(func=cmd_mode)
    limit = sub.add_parser("limit", parents=[common], help="a client's compute/memory limits (admin for others)")
    limit.add_argument("client", type=at.client_arg, metavar="CLIENT", help="client id or name (see gpuctl clients)")
    limit.add_argument(
        "--core", type=at.core_percent, metavar="PERCENT", help=f"{at.bounds(p.CoreLimit)} percent of GPU time"
    )
    limit.add_argument("--mem", type=at.size_arg, metavar="SIZE", help="e.g. 8GiB, 512MiB or bytes; 0 lifts it")
    limit.add_argument("--gpu", type=at.gpu_arg, help="only the session on this GPU")
    limit.set_defaults(func=cmd_limit)
    sub.add_parser(
        "run",
        add_help=False,
        help="run an unmodified program on a shared GPU: paused between its turns (gpuctl run --help)",
    )
    alloc = sub.add_parser("alloc", parents=[common], help="assign GPUs/CPU cores to a task; prints shell exports")
    alloc.add_argument(
        "--task",
        type=at.task_id,
        required=True,
        help="the task id (the same id with the same terms again: the same allocation)",
    )
    alloc.add_argument(
        "--gpus",
        type=at.gpus_or_range,
        default=1.0,
        help="whole number >= 1, or a fraction 0 < x < 1 of one GPU; 0 with --cpus (default 1); "
        "MIN..MAX whole GPUs (e.g. 1..4): elastic, preemption may shrink it to MIN",
    )
    alloc.add_argument("--cpus", type=at.cpus, default=0, help="CPU cores (default 0)")
    alloc.add_argument("--prefer", type=at.prefer_arg, default=[], help="GPUs to try first, e.g. 2,3")
    alloc.add_argument("--strategy", choices=[x.value for x in p.Strategy], default="first_fit")
    alloc.add_argument("--tenant", type=at.tenant)
    alloc.add_argument(
        "--priority",
        type=at.priority_arg,
        help=f"{at.bounds(p.Priority)} or {at.PRIORITY_CLASSES.replace(', ', '|')}: {p.PRODUCTION_PRIORITY} is never "
        f"preempted, {p.SPOT_PRIORITY + 1}..{p.PRODUCTION_PRIORITY - 1} may be after preemption_min_runtime_s, "
        f"{p.SPOT_PRIORITY} (spot) at any time",
    )
    alloc.add_argument(
        "--on-preempt",
        choices=[r.value for r in p.Recovery],
        help="what the holder does when preempted (default terminate; shrink needs --gpus MIN..MAX)",
    )
    alloc.add_argument("--protected", action="store_true", help="never preempted (admin)")
    alloc.add_argument(
        "--wait",
        dest="wait_ms",
        type=at.wait,
        default=0,
        metavar="SECONDS",
        help=f"wait up to this long for room ({at.bounds(p.Millis, 1000)} seconds)",
    )
    alloc.add_argument(
        "--owner-pid",
        type=at.owner_pid,
        metavar="PID",
        help="reclaim the allocation when this process dies, and tell it (SIGTERM) when it is preempted: "
        "one of yours, of your own session: this gpuctl's parent shell ($$), or a job it started ($!)",
    )
    alloc.add_argument(
        "--owner-any-uid",
        action="store_true",
        help="admin: --owner-pid may be another user's process (logged as owner_any_uid)",
    )
    alloc.set_defaults(func=cmd_alloc)
    free = sub.add_parser("free", parents=[common], help="release a task's allocation")
    free.add_argument("--task", type=at.task_id, required=True)
    free.set_defaults(func=cmd_free)
    sub.add_parser(
        "allocs", parents=[common], help="allocations and their preemption state, per-GPU shares, waiters, tenants"
    ).set_defaults(func=cmd_allocs)
    for name, on, what in (
        ("drain", True, "no new allocations on a GPU; its allocations are preempted (admin)"),
        ("undrain", False, "put a drained GPU back in service (admin)"),
    ):
        drain = sub.add_parser(name, parents=[common], help=what)
        drain.add_argument("gpu", type=at.gpu_arg, metavar="GPU", help="index, gpu:N or UUID")
        drain.set_defaults(func=cmd_drain, on=on)
    for name, on, what in (
        ("protect", True, "a task's allocation is never preempted (admin)"),
        ("unprotect", False, "a task's allocation is preemptible by its priority again (admin)"),
    ):
        protect = sub.add_parser(name, parents=[common], help=what)
        protect.add_argument("task", type=at.task_id, metavar="TASK", help="the task id (see gpuctl allocs)")
        protect.set_defaults(func=cmd_protect, protected=on)
    sub.add_parser("leases", parents=[common], help="lease holders and waiters").set_defaults(func=cmd_leases)
    pol = sub.add_parser("policy", parents=[common], help="show or hot-update lease policies (admin to change)")
    pol.add_argument(
        "task_type",
        type=at.task_type,
        nargs="?",
        metavar="TASK_TYPE",
        help="ASR, NMT, TTS, SEMANTIC_REPAIR, OTHER or any name",
    )
    pol.add_argument("--priority", type=at.priority, metavar=at.bounds(p.Priority))
    pol.add_argument("--busy", choices=[b.value for b in p.BusyPolicy], help="busy policy")
    pol.add_argument("--max-wait", type=at.max_wait, metavar="MS")
    pol.add_argument("--queue-limit", type=at.queue_limit, metavar="N")
    pol.add_argument("--hold-max", type=at.hold_max, metavar="MS")
    pol.set_defaults(func=cmd_policy)
    return ap


def _fail(as_json: bool, code: str, message: str, status: int, text: str) -> int:
    if as_json:
        print(json.dumps({"error": {"code": code, "message": message}}), file=sys.stderr)
    else:
        print(text, file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # its own parser: everything after -- is the program's
        from gpud_client.run import main as run_main

        return run_main(argv[1:], prog="gpuctl run")
    as_json = "--json" in argv  # known before parsing: a usage error is answered in JSON too
    try:
        args = build_parser().parse_args(argv)
        args.socket = getattr(args, "socket", None)
        args.json = getattr(args, "json", False)
        return int(args.func(args) or 0)
    except _ShowVersion:
        v = versions()
        print(
            json.dumps(v)
            if as_json
            else f"gpuctl {v['gpuctl']} (gpud {v['gpud']}), gpud-client {v['gpud_client']}, protocol {v['protocol']}"
        )
        return 0
    except UsageError as exc:
        return _fail(as_json, "usage", exc.message, 2, f"{exc.usage}{exc.prog}: error: {exc.message}")
    except ProtocolError as exc:
        return _fail(as_json, str(exc.code), exc.message, 1, f"gpuctl: {exc}")
    except DaemonUnavailable as exc:
        return _fail(as_json, "unavailable", str(exc), 1, f"gpuctl: {exc}")
    except Failed as exc:
        return _fail(as_json, exc.code, str(exc), 1, f"gpuctl: {exc}")
    except GpudError as exc:
        return _fail(as_json, "error", str(exc), 1, f"gpuctl: {exc}")
    except TimeoutError as exc:
        return _fail(as_json, "timeout", str(exc), 1, f"gpuctl: {exc}")
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (| head): no second error when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
