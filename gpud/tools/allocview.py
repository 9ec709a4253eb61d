"""What `gpuctl allocs` prints: the allocations with their preemption state, the GPUs' shares,
the waiters and the GPUs being drained; and the table layout every gpuctl command shares.

Pure: it turns a reply into text and never talks to the daemon. Every value a peer sent goes
through ``printable`` (in ``table``) before it reaches a terminal.
"""

from __future__ import annotations

from gpud_client import protocol as p
from gpud_client.units import printable


def table(rows: list[list[str]], header: list[str]) -> str:
    """Columns padded to their widest cell, two spaces apart; no trailing blanks."""
    rows = [[printable(str(c)) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def cpuset(cpus: list[int]) -> str:
    return ",".join(map(str, cpus)) or "-"


def alloc_state(a: p.Allocated) -> str:
    """running, preempting with the seconds left of its grace, or suspended; how often preempted."""
    state = str(a.state)
    if a.state == p.AllocState.PREEMPTING and a.deadline_s is not None:
        state += f" ({a.deadline_s:.0f}s left)"
    if a.preemptions:
        state += f", preempted {a.preemptions}x"
    return state


def elastic(a: p.Allocated) -> str:
    """The whole-GPU range an elastic allocation is shrunk and grown in, else '-'."""
    if a.gpus_max is None:
        return "-"
    return f"{a.gpus_min if a.gpus_min is not None else '?'}..{a.gpus_max}"


def preemptible(a: p.Allocated) -> str:
    """yes, no, protected, or when it will be (inside its minimum runtime: ``in 240s``)."""
    if a.protected:
        return "protected"
    if a.preemptible:
        return "yes"
    return "no" if a.preemptible_in_s is None else f"in {a.preemptible_in_s:.0f}s"


ALLOC_HEADER = [
    "TASK",
    "GPUS",
    "SHARE",
    "CPUS",
    "TENANT",
    "PRIO",
    "OWNER",
    "STATE",
    "ON PREEMPT",
    "ELASTIC",
    "PREEMPTIBLE",
    "WHY",
]


def alloc_row(a: p.Allocated) -> list[str]:
    return [
        a.task_id,
        a.cuda_visible_devices or "-",
        f"{a.share:g}" if a.gpus else "-",
        cpuset(a.cpus),
        a.tenant or "-",
        str(a.priority),
        str(a.owner_pid or "-"),
        alloc_state(a),
        str(a.on_preempt),
        elastic(a),
        preemptible(a),
        a.why or "-",
    ]


def waiters_table(waiters: list[p.AllocWaiter]) -> str:
    rows = [[w.task_id, f"{w.gpus:g}", str(w.priority), f"{w.waited_s:.1f}s", w.why or "-"] for w in waiters]
    return table(rows, ["WAITING", "GPUS", "PRIO", "WAITED", "WHY"])


def render_allocs(reply: p.AllocationsReply) -> str:
    """The allocations (one row each, then a blank line), the GPUs, the drained GPUs, the CPU
    cores, those waiting and the tenants."""
    rows = [alloc_row(a) for a in reply.allocations]
    out = [table(rows, ALLOC_HEADER) if rows else "no allocations"]
    gpu_rows = [
        [str(g.index), f"{g.allocated:g}", f"{g.free:g}", ", ".join(f"{t}:{v:g}" for t, v in g.tasks.items()) or "-"]
        for g in reply.gpus
    ]
    out += ["", table(gpu_rows, ["GPU", "ALLOCATED", "FREE", "TASKS"])]
    if reply.draining:
        out += [f"draining: GPU {', '.join(map(str, reply.draining))} (no new allocations; theirs are preempted)"]
    out += [f"CPU cores: {reply.cpus_total - len(reply.cpus_free)} of {reply.cpus_total} allocated"]
    described = {w.task_id for w in reply.waiters}
    if rest := [t for t in reply.waiting if t not in described]:  # a daemon that says no more than the ids
        out += [f"waiting: {', '.join(rest)}"]
    for name, t in reply.tenants.items():
        out += [f"tenant {name}: {t.used:g} of {t.quota:g} GPUs (may borrow {t.borrow:g})"]
    if reply.waiters:
        out += ["", waiters_table(reply.waiters)]
    return "\n".join(out)
