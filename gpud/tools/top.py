"""`gpuctl top`: a live, refreshing per-GPU view, like htop for gpud.

On a terminal it redraws with ANSI escapes (no curses: it works on any terminal and in a
pseudo-terminal under test). Anywhere else (a pipe, a file, a log) it writes plain snapshots,
one after another, with no escape codes; with --json, one JSON object per line per refresh.
Keys are read in cbreak mode only when stdin is a terminal; q or Ctrl-C exits and the terminal
is always restored. --count N stops after N refreshes.
"""

from __future__ import annotations

import json
import os
import select
import sys
import termios
import time
import tty
from typing import Any, TextIO

import msgspec

from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.runinfo import run_info
from gpud_client.units import format_bytes, printable

CLEAR = "\x1b[H\x1b[2J"
BOLD, DIM, RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"


def gpu_mode(g: p.GpuStatus) -> str:
    """The mode, also while the scheduler is off (it applies again when it is back on)."""
    return str(g.mode) + ("" if g.scheduler_on else " (sched off)")


def gpu_memory(g: p.GpuStatus) -> str:
    """In use / usable, where usable is total less the reserve (named when there is one)."""
    used = f"{format_bytes(g.memory_in_use_bytes)}/{format_bytes(g.memory_capacity_bytes)}"
    return (
        used if g.memory_capacity_bytes == g.memory_total_bytes else f"{used} of {format_bytes(g.memory_total_bytes)}"
    )


def reserve_note(gpus: list[p.GpuStatus]) -> str:
    """What the usable memory is: total x (1 - reserve)."""
    reserves = {round(100 * (1 - g.memory_capacity_bytes / g.memory_total_bytes)) for g in gpus if g.memory_total_bytes}
    if not reserves or reserves == {0}:
        return "usable memory is the total (no reserve)"
    if len(reserves) == 1:
        return f"usable memory is total less the {reserves.pop()}% reserve"
    return "usable memory is total less each GPU's reserve"


def frame(
    status: p.StatusReply, clients: p.ClientsReply, leases: p.LeasesReply, width: int | None, *, styled: bool = True
) -> list[str]:
    """The screen's lines; ``styled``: with bold and dim escapes (a terminal), ``width``: cut to it."""
    b, d, r = (BOLD, DIM, RESET) if styled else ("", "", "")
    hint = f"   {d}q to quit{r}" if styled else ""
    lines = [
        f"{b}gpud {status.version}{r}  up {status.uptime_s:.0f}s  {len(status.gpus)} GPU(s)  "
        f"{len(clients.clients)} client(s)  {reserve_note(status.gpus)}{hint}",
        "",
    ]
    sessions = [(c, s) for c in clients.clients for s in c.sessions]
    for g in status.gpus:
        health = "" if g.healthy else f"  {b}UNHEALTHY{r}"
        lines.append(
            f"{b}GPU {g.index}{r} {printable(g.name)}  mode {gpu_mode(g)}  TQ {g.tq_s:g}s  "
            f"memory {gpu_memory(g)}  grants {g.grants}{health}"
        )
        held = {h.session for h in g.holders}
        rows = [(c, s) for c, s in sessions if s.gpu == g.index]
        if rows:
            lines.append(
                f"  {'CLIENT':<16} {'PID':>7} {'STATE':<18} {'LIMIT':>5} {'WINDOW':>7} {'RECENT':>7} "
                f"{'MEMORY':>15} {'GRANTS':>6} {'DROPS':<12}"
            )
        for c, s in rows:
            run = run_info(c, s)
            what = s.state if run is None else f"run {run.state}"
            state = ("▶ " if s.session in held else "  ") + what + (" throttled" if s.throttled else "")
            limit = "-" if s.core_limit >= 100 else f"{s.core_limit}%"
            used = "-" if s.mem_used_bytes is None else format_bytes(s.mem_used_bytes)
            cap = "" if s.mem_limit_bytes is None else "/" + format_bytes(s.mem_limit_bytes)
            drops = ",".join(f"{k}={v}" for k, v in sorted(s.drops.items())) or "-"
            lines.append(
                f"  {printable(c.name)[:16] or '?':<16} {run.program_pid if run else c.pid:>7} {state:<18} {limit:>5} {s.window_share_percent:>6.1f}% "
                f"{s.recent_share_percent:>6.1f}% {used + cap:>15} {s.grants:>6} {drops:<12}"
            )
        for le in (x for x in leases.leases if x.gpu == g.index):
            lines.append(
                f"  lease {printable(le.lease_id)} {printable(le.task_type)} {le.state} {printable(le.name)}[{le.pid}] "
                f"held {le.held_ms:.0f}ms waited {le.waited_ms:.0f}ms"
            )
        if g.queue:
            lines.append(
                "  queue: "
                + ", ".join(
                    f"{printable(w.name) or '?'}#{w.session}" + (" (throttled)" if w.throttled else "") for w in g.queue
                )
            )
        lines.append("")
    if width is None:
        return lines
    return [line[: width + (16 if styled else 0)] for line in lines]  # escapes do not take columns


def snapshot(status: p.StatusReply, clients: p.ClientsReply, leases: p.LeasesReply) -> dict[str, Any]:
    """One refresh as JSON: STATUS's fields, with the clients and the leases beside them."""
    return {
        "version": status.version,
        "uptime_s": status.uptime_s,
        "gpus": msgspec.to_builtins(status.gpus),
        "clients": msgspec.to_builtins(clients.clients),
        "leases": msgspec.to_builtins(leases.leases),
    }


def run(
    socket_path: str | None,
    interval: float,
    *,
    as_json: bool = False,
    count: int | None = None,
    out: TextIO = sys.stdout,
) -> int:
    conn = Connection(socket_path)
    conn.hello("gpuctl-top")
    live = not as_json and out.isatty()  # redraw in place only on a terminal
    stdin = sys.stdin.fileno()
    saved = termios.tcgetattr(stdin) if os.isatty(stdin) else None
    shown = 0
    try:
        if saved is not None:
            tty.setcbreak(stdin)
            attrs = termios.tcgetattr(stdin)
            attrs[3] &= ~termios.ISIG  # Ctrl-C arrives as a key, even where SIGINT is ignored
            termios.tcsetattr(stdin, termios.TCSANOW, attrs)
        while True:
            status = conn.call(p.Status(id=conn.next_id()))
            clients = conn.call(p.ListClients(id=conn.next_id()))
            leases = conn.call(p.ListLeases(id=conn.next_id()))
            if as_json:
                out.write(json.dumps(snapshot(status, clients, leases)) + "\n")
            elif live:
                width = os.get_terminal_size(out.fileno()).columns or 120  # 0: size unknown
                out.write(CLEAR + "\n".join(frame(status, clients, leases, width)) + "\n")
            else:
                out.write("\n".join(frame(status, clients, leases, None, styled=False)) + "\n")
            out.flush()
            shown += 1
            if count is not None and shown >= count:
                return 0
            if _wait_for_quit(stdin if saved is not None else None, interval):
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
        if live:
            out.write("\n")
            out.flush()
        conn.close()


def _wait_for_quit(keys: int | None, interval: float) -> bool:
    """Wait for the next refresh; True if q or Ctrl-C was typed meanwhile (``keys``: a terminal)."""
    deadline = time.monotonic() + interval
    while (left := deadline - time.monotonic()) > 0:
        if keys is None:
            time.sleep(left)  # nothing to read: a pipe or /dev/null would be "ready" at once, forever
            continue
        ready, _, _ = select.select([keys], [], [], left)
        if ready and os.read(keys, 32)[:1] in (b"q", b"Q", b"\x03"):
            return True
    return False
