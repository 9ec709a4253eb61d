"""`gpuctl`: the command line of gpud. Tables for people, --json for scripts.

Finds the daemon like everything else does: --socket, else $GPUD_SOCKET, else
/run/gpud/gpud.sock. Every error names the problem and exits non-zero
(1: the daemon refused or is unreachable, 2: bad usage).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any, get_args

import msgspec

from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import GpudError
from gpud_client.units import format_bytes, parse_bytes, printable


def _connect(args: argparse.Namespace) -> Connection:
    conn = Connection(args.socket)
    conn.hello("gpuctl")
    return conn


def _gpu_ref(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def _table(rows: list[list[str]], header: list[str]) -> str:
    rows = [[printable(str(c)) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _who(name: str, pid: int, session: int) -> str:
    return f"{name or '?'}[{pid}]#{session}"


def _drops(drops: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(drops.items())) or "-"


def render_status(reply: p.StatusReply) -> str:
    rows = []
    for g in reply.gpus:
        holder = ", ".join(
            _who(h.name, h.pid, h.session) + f" {h.held_ms / 1000:.1f}s" + (f" (drop:{h.drop_pending})" if h.drop_pending else "")
            for h in g.holders
        )
        queue = ", ".join(_who(w.name, w.pid, w.session) + (" (throttled)" if w.throttled else "") for w in g.queue)
        rows.append(
            [
                str(g.index),
                g.name + (" (sim)" if g.simulated and "Simulated" not in g.name else ""),
                (g.mode if g.scheduler_on else "off") + ("" if g.healthy else " UNHEALTHY"),
                f"{g.tq_s:g}s",
                f"{format_bytes(g.memory_in_use_bytes)}/{format_bytes(g.memory_capacity_bytes)}",
                holder or "-",
                queue or "-",
                str(g.clients),
            ]
        )
    head = f"gpud {reply.version}, up {reply.uptime_s:.0f}s, {len(reply.gpus)} GPU(s)"
    return head + "\n" + _table(rows, ["GPU", "NAME", "MODE", "TQ", "MEMORY", "HOLDER", "QUEUE", "CLIENTS"])


def _limit(s: p.SessionInfo) -> str:
    return "-" if s.core_limit >= 100 else f"{s.core_limit}%"


def _memory(s: p.SessionInfo) -> str:
    used = "-" if s.mem_used_bytes is None else format_bytes(s.mem_used_bytes)
    limit = "-" if s.mem_limit_bytes is None else format_bytes(s.mem_limit_bytes)
    over = f" over:{s.mem_violations}" if s.mem_violations else ""
    return f"{used}/{limit}{over}"


def render_clients(reply: p.ClientsReply) -> str:
    rows = []
    for c in reply.clients:
        who = [str(c.client_id), c.name or "?", str(c.pid)]
        if not c.sessions:
            rows.append(who + ["-"] * 9)
        for s in c.sessions:
            state = s.state + (" throttled" if s.throttled else "")
            rows.append(
                who
                + [
                    f"{s.gpu}#{s.session}",
                    state,
                    _limit(s),
                    f"{s.window_share_percent:.1f}%",
                    f"{s.recent_share_percent:.1f}%",
                    _memory(s),
                    str(s.grants),
                    f"{s.wait_ms / 1000:.2f}s",
                    _drops(s.drops) + (f" revoked={s.revocations}" if s.revocations else ""),
                ]
            )
    header = ["CLIENT", "NAME", "PID", "GPU#SESSION", "STATE", "LIMIT", "WINDOW", "RECENT", "MEM USED/LIMIT",
              "GRANTS", "WAITED", "DROPS"]
    return _table(rows, header)


def render_leases(reply: p.LeasesReply) -> str:
    rows = []
    for le in sorted(reply.leases, key=lambda x: (x.gpu, x.state != "holding", -x.priority, -x.waited_ms)):
        trace = " ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(le.trace).items() if v is not None)
        rows.append(
            [
                str(le.gpu), le.lease_id, le.task_type, le.state + (" OVERDUE" if le.overdue else ""),
                str(le.priority), f"{le.name or '?'}[{le.pid}]", f"{le.waited_ms:.1f}ms",
                f"{le.held_ms:.1f}ms" if le.state == "holding" else "-", trace or "-",
            ]
        )
    header = ["GPU", "LEASE", "TASK", "STATE", "PRIO", "CLIENT", "WAITED", "HELD", "TRACE"]
    return _table(rows, header) if rows else "no leases"


def render_policies(reply: p.PoliciesReply) -> str:
    rows = [
        [name, str(pi.priority), str(pi.busy_policy), f"{pi.max_wait_ms}ms", str(pi.queue_limit), f"{pi.hold_max_ms}ms"]
        for name, pi in reply.policies.items()
    ]
    return _table(rows, ["TASK", "PRIORITY", "BUSY", "MAX WAIT", "QUEUE LIMIT", "HOLD MAX"])


def render_allocs(reply: p.AllocationsReply) -> str:
    rows = [
        [a.task_id, a.cuda_visible_devices or "-", f"{a.share:g}" if a.gpus else "-", _cpuset(a.cpus),
         a.tenant or "-", str(a.priority), str(a.owner_pid or "-")]
        for a in reply.allocations
    ]
    out = [_table(rows, ["TASK", "GPUS", "SHARE", "CPUS", "TENANT", "PRIO", "OWNER"]) if rows else "no allocations"]
    gpu_rows = [[str(g.index), f"{g.allocated:g}", f"{g.free:g}", ", ".join(f"{t}:{v:g}" for t, v in g.tasks.items()) or "-"]
                for g in reply.gpus]
    out += ["", _table(gpu_rows, ["GPU", "ALLOCATED", "FREE", "TASKS"])]
    out += [f"CPU cores: {reply.cpus_total - len(reply.cpus_free)} of {reply.cpus_total} allocated"]
    if reply.waiting:
        out += [f"waiting: {', '.join(reply.waiting)}"]
    for name, t in reply.tenants.items():
        out += [f"tenant {name}: {t.used:g} of {t.quota:g} GPUs (may borrow {t.borrow:g})"]
    return "\n".join(out)


def _cpuset(cpus: list[int]) -> str:
    return ",".join(map(str, cpus)) or "-"


def _emit(args: argparse.Namespace, obj: msgspec.Struct, text: str) -> None:
    if args.json:
        data = msgspec.to_builtins(obj)
        data.pop("id", None)
        data.pop("type", None)
        print(json.dumps(data, indent=2))
    else:
        print(text)


def cmd_status(args: argparse.Namespace) -> None:
    with _connect(args) as conn:
        reply = conn.call(p.Status(id=conn.next_id()))
    _emit(args, reply, render_status(reply))


def cmd_clients(args: argparse.Namespace) -> None:
    with _connect(args) as conn:
        reply = conn.call(p.ListClients(id=conn.next_id()))
    _emit(args, reply, render_clients(reply))


def _done(args: argparse.Namespace, what: str, **fields: Any) -> None:
    if args.json:
        print(json.dumps({"ok": True, **fields}))
    else:
        print(what)


def cmd_tq(args: argparse.Namespace) -> None:
    gpu = None if args.gpu is None else _gpu_ref(args.gpu)
    with _connect(args) as conn:
        conn.call(p.SetTq(id=conn.next_id(), seconds=args.seconds, gpu=gpu))
    where = "every GPU" if gpu is None else f"GPU {args.gpu}"
    _done(args, f"time quantum set to {args.seconds:g}s on {where}", tq_s=args.seconds, gpu=gpu)


def cmd_sched(args: argparse.Namespace) -> None:
    gpu = None if args.gpu is None else _gpu_ref(args.gpu)
    on = args.state == "on"
    with _connect(args) as conn:
        msg = p.SchedOn(id=conn.next_id(), gpu=gpu) if on else p.SchedOff(id=conn.next_id(), gpu=gpu)
        conn.call(msg)
    where = "every GPU" if gpu is None else f"GPU {args.gpu}"
    _done(args, f"scheduler {args.state} on {where}", scheduler_on=on, gpu=gpu)


def cmd_leases(args: argparse.Namespace) -> None:
    with _connect(args) as conn:
        reply = conn.call(p.ListLeases(id=conn.next_id()))
    _emit(args, reply, render_leases(reply))


def cmd_policy(args: argparse.Namespace) -> None:
    fields = {
        "priority": args.priority, "busy_policy": args.busy, "max_wait_ms": args.max_wait,
        "queue_limit": args.queue_limit, "hold_max_ms": args.hold_max,
    }
    changes = {k: v for k, v in fields.items() if v is not None}
    with _connect(args) as conn:
        if changes:
            if args.task_type is None:
                raise GpudError("name the task type whose policy to change, e.g. gpuctl policy ASR --max-wait 2000")
            conn.call(p.SetPolicy(id=conn.next_id(), task_type=args.task_type, **changes))
        reply = conn.call(p.ListPolicies(id=conn.next_id()))
    if args.task_type is not None and not changes and args.task_type not in reply.policies:
        raise GpudError(f"no policy for task type {args.task_type!r} (it would use OTHER's)")
    if args.task_type is not None:
        reply = p.PoliciesReply(id=reply.id, policies={args.task_type: reply.policies[args.task_type]})
    _emit(args, reply, render_policies(reply))


def cmd_alloc(args: argparse.Namespace) -> None:
    prefer = [_gpu_ref(x) for x in args.prefer.split(",")] if args.prefer else []
    priority: int | str | None = args.priority
    msg = p.Allocate(
        id=0, task_id=args.task, gpus=args.gpus, cpus=args.cpus, prefer=prefer, strategy=p.Strategy(args.strategy),
        tenant=args.tenant, priority=priority if isinstance(priority, int) else None,
        priority_class=p.PriorityClass(priority) if isinstance(priority, str) else None,
        wait_ms=round(args.wait * 1000), owner_pid=args.owner_pid,
    )
    with _connect(args) as conn:
        reply = conn.call(msgspec.structs.replace(msg, id=conn.next_id()), timeout=args.wait + 30)
    if args.json:
        _emit(args, reply, "")
        return
    env = {
        "CUDA_VISIBLE_DEVICES": reply.cuda_visible_devices,
        "GPUD_TASK_ID": reply.task_id,
        "GPUD_GPU_SHARE": f"{reply.share:g}",
        "GPUD_CPUS": _cpuset(reply.cpus) if reply.cpus else "",
    }
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))


def cmd_free(args: argparse.Namespace) -> None:
    with _connect(args) as conn:
        conn.call(p.Free(id=conn.next_id(), task_id=args.task))
    _done(args, f"freed the allocation of task {args.task}", task_id=args.task)


def cmd_allocs(args: argparse.Namespace) -> None:
    with _connect(args) as conn:
        reply = conn.call(p.ListAllocations(id=conn.next_id()))
    _emit(args, reply, render_allocs(reply))


def _priority_arg(text: str) -> int | str:
    if text in {c.value for c in p.PriorityClass}:
        return text
    try:
        return int(_priority(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"priority must be {_bounds(p.Priority)} or production, high, normal, best-effort; got {text!r}"
        ) from None


def _gpu_count(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GPUs: {text!r}") from None


def _bounds(limit: Any) -> str:
    meta = get_args(limit)[1]
    return f"{meta.ge}..{meta.le}"


def _limited(limit: Any, parse: Callable[[str], float], noun: str, name: str) -> Callable[[str], Any]:
    """An argparse type held to one of the protocol's limits, so gpuctl keeps no copy of them."""

    def check(text: str) -> Any:
        try:
            return msgspec.convert(parse(text), limit)
        except msgspec.ValidationError:
            raise argparse.ArgumentTypeError(f"{name} must be {_bounds(limit)}, got {text}") from None
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None

    return check


_priority = _limited(p.Priority, int, "a whole number", "priority")
_core_percent = _limited(p.CoreLimit, int, "a whole percentage", "core limit")
_max_wait = _limited(p.Millis, int, "a whole number of milliseconds", "milliseconds")
_hold_max = _limited(p.HoldMaxMs, int, "a whole number of milliseconds", "milliseconds")


def cmd_top(args: argparse.Namespace) -> None:
    from gpud.top import run

    raise SystemExit(run(args.socket, args.interval))


def cmd_mode(args: argparse.Namespace) -> None:
    gpu = None if args.gpu is None else _gpu_ref(args.gpu)
    with _connect(args) as conn:
        conn.call(p.SetMode(id=conn.next_id(), mode=p.Mode(args.mode), gpu=gpu))
    where = "every GPU" if gpu is None else f"GPU {args.gpu}"
    _done(args, f"mode {args.mode} on {where}", mode=args.mode, gpu=gpu)


def cmd_limit(args: argparse.Namespace) -> None:
    if args.core is None and args.mem is None:
        raise GpudError("nothing to change: give --core PERCENT and/or --mem SIZE")
    client: int | str = int(args.client) if args.client.isdigit() else args.client
    gpu = None if args.gpu is None else _gpu_ref(args.gpu)
    with _connect(args) as conn:
        reply = conn.call(
            p.SetLimits(id=conn.next_id(), client=client, gpu=gpu, core_limit=args.core, mem_limit=args.mem)
        )
    what = ", ".join(
        x for x in (
            None if args.core is None else f"core {args.core}%",
            None if args.mem is None else ("memory unlimited" if args.mem == 0 else f"memory {format_bytes(args.mem)}"),
        ) if x
    )
    _done(args, f"{what} for client {args.client}, session(s) {', '.join(map(str, reply.sessions))}",
          client=client, sessions=reply.sessions, core_limit=args.core, mem_limit=args.mem)


def _size_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a count: {text!r}")
    return int(text)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"seconds must be > 0 and <= 86400, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: an option given before or after the command both count.
    common.add_argument(
        "--socket", default=argparse.SUPPRESS, help="gpud socket (default: $GPUD_SOCKET or /run/gpud/gpud.sock)"
    )
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    ap = argparse.ArgumentParser(prog="gpuctl", description="Inspect and steer gpud.", parents=[common])
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("status", parents=[common], help="per GPU: mode, TQ, holder, queue, clients").set_defaults(
        func=cmd_status
    )
    top = sub.add_parser("top", parents=[common], help="live view of GPUs, sessions and leases (q to quit)")
    top.add_argument("--interval", type=_positive_seconds, default=1.0, metavar="SECONDS")
    top.set_defaults(func=cmd_top)
    sub.add_parser("clients", parents=[common], help="connected clients and their sessions").set_defaults(
        func=cmd_clients
    )
    tq = sub.add_parser("tq", parents=[common], help="set the time quantum (admin)")
    tq.add_argument("seconds", type=_positive_seconds)
    tq.add_argument("--gpu", help="index, gpu:N or UUID (default: every GPU)")
    tq.set_defaults(func=cmd_tq)
    sched = sub.add_parser("sched", parents=[common], help="turn the scheduler on or off (admin)")
    sched.add_argument("state", choices=["on", "off"])
    sched.add_argument("--gpu", help="index, gpu:N or UUID (default: every GPU)")
    sched.set_defaults(func=cmd_sched)
    mode = sub.add_parser("mode", parents=[common], help="serial, concurrent or auto admission (admin)")
    mode.add_argument("mode", choices=[m.value for m in p.Mode])
    mode.add_argument("--gpu", help="index, gpu:N or UUID (default: every GPU)")
    mode.set_defaults(func=cmd_mode)
    limit = sub.add_parser("limit", parents=[common], help="a client's compute/memory limits (admin for others)")
    limit.add_argument("client", help="client id or name (see gpuctl clients)")
    limit.add_argument(
        "--core", type=_core_percent, metavar="PERCENT", help=f"{_bounds(p.CoreLimit)} percent of GPU time"
    )
    limit.add_argument("--mem", type=_size_arg, metavar="SIZE", help="e.g. 8GiB, 512MiB or bytes; 0 lifts it")
    limit.add_argument("--gpu", help="only the session on this GPU")
    limit.set_defaults(func=cmd_limit)
    alloc = sub.add_parser("alloc", parents=[common], help="assign GPUs/CPU cores to a task; prints shell exports")
    alloc.add_argument("--task", required=True, help="the task id (the same id again: the same allocation)")
    alloc.add_argument("--gpus", type=_gpu_count, default=1.0, help="whole number >= 1, or a fraction < 1 (default 1)")
    alloc.add_argument("--cpus", type=_count, default=0, help="CPU cores (default 0)")
    alloc.add_argument("--prefer", help="GPUs to try first, e.g. 2,3")
    alloc.add_argument("--strategy", choices=[x.value for x in p.Strategy], default="first_fit")
    alloc.add_argument("--tenant")
    alloc.add_argument(
        "--priority", type=_priority_arg, help=f"{_bounds(p.Priority)} or production|high|normal|best-effort"
    )
    alloc.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="wait this long for room")
    alloc.add_argument("--owner-pid", type=int, help="reclaim the allocation when this process dies")
    alloc.set_defaults(func=cmd_alloc)
    free = sub.add_parser("free", parents=[common], help="release a task's allocation")
    free.add_argument("--task", required=True)
    free.set_defaults(func=cmd_free)
    sub.add_parser("allocs", parents=[common], help="allocations, per-GPU shares, CPU cores, tenants").set_defaults(
        func=cmd_allocs
    )
    sub.add_parser("leases", parents=[common], help="lease holders and waiters").set_defaults(func=cmd_leases)
    pol = sub.add_parser("policy", parents=[common], help="show or hot-update lease policies (admin to change)")
    pol.add_argument("task_type", nargs="?", help="ASR, NMT, TTS, SEMANTIC_REPAIR, OTHER or any name")
    pol.add_argument("--priority", type=_priority, metavar=_bounds(p.Priority))
    pol.add_argument("--busy", choices=[b.value for b in p.BusyPolicy], help="busy policy")
    pol.add_argument("--max-wait", type=_max_wait, metavar="MS")
    pol.add_argument("--queue-limit", type=_count, metavar="N")
    pol.add_argument("--hold-max", type=_hold_max, metavar="MS")
    pol.set_defaults(func=cmd_policy)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.socket = getattr(args, "socket", None)
    args.json = getattr(args, "json", False)
    try:
        args.func(args)
    except GpudError as exc:
        print(f"gpuctl: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
