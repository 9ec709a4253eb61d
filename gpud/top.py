"""`gpuctl top`: a live, refreshing per-GPU view, like htop for gpud.

Redraws with ANSI escapes (no curses: it works on any terminal and in a
pseudo-terminal under test). Keys are read in cbreak mode; q or Ctrl-C exits
and the terminal is always restored.
"""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from typing import TextIO

from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.units import format_bytes, printable

CLEAR = "\x1b[H\x1b[2J"
BOLD, DIM, RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"


def frame(status: p.StatusReply, clients: p.ClientsReply, leases: p.LeasesReply, width: int) -> list[str]:
    lines = [f"{BOLD}gpud {status.version}{RESET}  up {status.uptime_s:.0f}s  {len(status.gpus)} GPU(s)  "
             f"{len(clients.clients)} client(s)   {DIM}q to quit{RESET}", ""]
    sessions = [(c, s) for c in clients.clients for s in c.sessions]
    for g in status.gpus:
        mode = g.mode if g.scheduler_on else "off"
        health = "" if g.healthy else f"  {BOLD}UNHEALTHY{RESET}"
        lines.append(f"{BOLD}GPU {g.index}{RESET} {printable(g.name)}  mode {mode}  TQ {g.tq_s:g}s  "
                     f"memory {format_bytes(g.memory_in_use_bytes)}/{format_bytes(g.memory_capacity_bytes)}  "
                     f"grants {g.grants}{health}")
        held = {h.session for h in g.holders}
        rows = [(c, s) for c, s in sessions if s.gpu == g.index]
        if rows:
            lines.append(f"  {'CLIENT':<16} {'PID':>7} {'STATE':<18} {'LIMIT':>5} {'WINDOW':>7} {'RECENT':>7} "
                         f"{'MEMORY':>15} {'GRANTS':>6} {'DROPS':<12}")
        for c, s in rows:
            state = ("▶ " if s.session in held else "  ") + s.state + (" throttled" if s.throttled else "")
            limit = "-" if s.core_limit >= 100 else f"{s.core_limit}%"
            used = "-" if s.mem_used_bytes is None else format_bytes(s.mem_used_bytes)
            cap = "" if s.mem_limit_bytes is None else "/" + format_bytes(s.mem_limit_bytes)
            drops = ",".join(f"{k}={v}" for k, v in sorted(s.drops.items())) or "-"
            lines.append(f"  {printable(c.name)[:16] or '?':<16} {c.pid:>7} {state:<18} {limit:>5} {s.window_share_percent:>6.1f}% "
                         f"{s.recent_share_percent:>6.1f}% {used + cap:>15} {s.grants:>6} {drops:<12}")
        for le in (x for x in leases.leases if x.gpu == g.index):
            lines.append(f"  lease {printable(le.lease_id)} {printable(le.task_type)} {le.state} {printable(le.name)}[{le.pid}] "
                         f"held {le.held_ms:.0f}ms waited {le.waited_ms:.0f}ms")
        if g.queue:
            lines.append("  queue: " + ", ".join(f"{printable(w.name) or '?'}#{w.session}" + (" (throttled)" if w.throttled else "")
                                                 for w in g.queue))
        lines.append("")
    return [line[: width + 16] for line in lines]  # escapes do not take columns


def run(socket_path: str | None, interval: float, out: TextIO = sys.stdout) -> int:
    conn = Connection(socket_path)
    conn.hello("gpuctl-top")
    stdin = sys.stdin.fileno()
    saved = termios.tcgetattr(stdin) if os.isatty(stdin) else None
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
            width = (os.get_terminal_size(out.fileno()).columns if out.isatty() else 0) or 120  # 0: size unknown
            out.write(CLEAR + "\n".join(frame(status, clients, leases, width)) + "\n")
            out.flush()
            deadline = time.monotonic() + interval
            while (left := deadline - time.monotonic()) > 0:
                ready, _, _ = select.select([stdin], [], [], left)
                if ready and os.read(stdin, 32)[:1] in (b"q", b"Q", b"\x03"):
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
        out.write("\n")
        out.flush()
        conn.close()
