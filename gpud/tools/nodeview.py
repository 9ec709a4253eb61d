"""What gpuctl shows of the node, for people: the GPUs (``status``), the clients with their sessions
and runs (``clients``), the leases and the lease policies. Renders the daemon's replies; reads and
changes nothing (the allocations' tables are ``allocview``'s).
"""

from __future__ import annotations

import msgspec

from gpud.tools.allocview import table as _table
from gpud.tools.top import gpu_memory, gpu_mode, reserve_note
from gpud_client import protocol as p
from gpud_client.runinfo import run_info
from gpud_client.units import format_bytes


def _who(name: str, pid: int, session: int) -> str:
    return f"{name or '?'}[{pid}]#{session}"


def _drops(drops: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(drops.items())) or "-"


def _drain_state(g: p.GpuStatus) -> str:
    """Draining until no allocation is left on it, then drained."""
    return " DRAINED" if g.drained else " DRAINING" if g.draining else ""


def render_status(reply: p.StatusReply) -> str:
    rows = []
    for g in reply.gpus:
        holder = ", ".join(
            _who(h.name, h.pid, h.session)
            + f" {h.held_ms / 1000:.1f}s"
            + (f" (drop:{h.drop_pending})" if h.drop_pending else "")
            for h in g.holders
        )
        queue = ", ".join(_who(w.name, w.pid, w.session) + (" (throttled)" if w.throttled else "") for w in g.queue)
        rows.append(
            [
                str(g.index),
                g.name + (" (sim)" if g.simulated and "Simulated" not in g.name else ""),
                gpu_mode(g) + ("" if g.healthy else " UNHEALTHY") + _drain_state(g),
                f"{g.tq_s:g}s",
                gpu_memory(g),
                holder or "-",
                queue or "-",
                str(g.clients),
            ]
        )
    head = f"gpud {reply.version}, up {reply.uptime_s:.0f}s, {len(reply.gpus)} GPU(s); {reserve_note(reply.gpus)}"
    return head + "\n" + _table(rows, ["GPU", "NAME", "MODE", "TQ", "MEMORY USED/USABLE", "HOLDER", "QUEUE", "CLIENTS"])


def _limit(s: p.SessionInfo) -> str:
    return "-" if s.core_limit >= 100 else f"{s.core_limit}%"


def _memory(s: p.SessionInfo) -> str:
    used = "-" if s.mem_used_bytes is None else format_bytes(s.mem_used_bytes)
    limit = "-" if s.mem_limit_bytes is None else format_bytes(s.mem_limit_bytes)
    over = f" over:{s.mem_violations}" if s.mem_violations else ""
    return f"{used}/{limit}{over}"


def render_clients(reply: p.ClientsReply, programs: p.RunsReply | None = None) -> str:
    """The clients and their sessions; runs in a table of their own, with what the kernel says of each
    program (``programs``: gpud's RUNS answer) beside the state its run asked for."""
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
    table = _table(
        rows,
        [
            "CLIENT",
            "NAME",
            "PID",
            "GPU#SESSION",
            "STATE",
            "LIMIT",
            "WINDOW",
            "RECENT",
            "MEM USED/LIMIT",
            "GRANTS",
            "WAITED",
            "DROPS",
        ],
    )
    sessions: list[tuple[p.ClientInfo, p.SessionInfo | None]] = []
    for c in reply.clients:
        sessions.extend((c, s) for s in c.sessions)
        if not c.sessions:
            sessions.append((c, None))
    kernel = {r.client_id: r for r in programs.runs} if programs is not None else {}
    runs = []
    for c, session in sessions:
        if (run := run_info(c, session)) is not None:
            says = _kernel_says(kernel.get(c.client_id), run.backend)
            runs.append([str(c.client_id), run.program_pid, *says, run.state, run.command])
    unclaimed = [r for r in programs.runs if r.client_id == 0] if programs is not None else []
    runs += [["-", str(r.pid), *_kernel_says(r, "?"), "unclaimed", "-"] for r in unclaimed]  # their runs are away
    if not runs:
        return table
    header = ["CLIENT", "PROGRAM PID", "BACKEND", "STATE", "ESCAPES", "RUN", "COMMAND"]
    return table + "\n\nRUNS\n" + _table(runs, header)


def _kernel_says(r: p.RunProgramInfo | None, backend: str) -> list[str]:
    """BACKEND, STATE (the kernel's word: a cgroup's frozen, or its tree's /proc states) and ESCAPES."""
    if r is None:
        return [backend, "?", "-"]
    state = f"{r.state} {r.stopped}/{r.processes}" if r.state == "partly_stopped" else r.state
    return [r.backend, state, str(r.escapes)]


def render_leases(reply: p.LeasesReply) -> str:
    rows = []
    for le in sorted(reply.leases, key=lambda x: (x.gpu, x.state != "holding", -x.priority, -x.waited_ms)):
        trace = " ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(le.trace).items() if v is not None)
        rows.append(
            [
                str(le.gpu),
                le.lease_id,
                le.task_type,
                le.state + (" OVERDUE" if le.overdue else ""),
                str(le.priority),
                f"{le.name or '?'}[{le.pid}]",
                f"{le.waited_ms:.1f}ms",
                f"{le.held_ms:.1f}ms" if le.state == "holding" else "-",
                trace or "-",
            ]
        )
    header = ["GPU", "LEASE", "TASK", "STATE", "PRIO", "CLIENT", "WAITED", "HELD", "TRACE"]
    return _table(rows, header) if rows else "no leases"


def render_policies(reply: p.PoliciesReply) -> str:
    rows = [
        [
            name,
            str(pi.priority),
            str(pi.busy_policy),
            f"{pi.max_wait_ms}ms",
            str(pi.queue_limit),
            f"{pi.hold_max_ms}ms",
            _reserved_for(pi),
        ]
        for name, pi in reply.policies.items()
    ]
    return _table(rows, ["TASK", "PRIORITY", "BUSY", "MAX WAIT", "QUEUE LIMIT", "HOLD MAX", "RESERVED FOR"])


def _reserved_for(pi: p.PolicyInfo) -> str:
    """Who besides admins may use a reserved policy: ``uid 1000,1001 gid 27``; ``-``: anyone."""
    who = [f"{kind} {','.join(map(str, ids))}" for kind, ids in (("uid", pi.uids), ("gid", pi.gids)) if ids]
    return " ".join(who) or "-"
