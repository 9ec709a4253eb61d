"""Latency of gpud's GPU lock: one client's cycle, and the handoff between clients.

What is measured, against a real daemon (``--simulate 1``) in its own process:
- uncontended cycle: one client alone; from sending LOCK_REQUEST to having
  sent LOCK_RELEASED after its LOCK_OK arrived (hold time zero);
- handoff: N clients on GPU 0, each looping {LOCK_REQUEST; wait for LOCK_OK;
  hold ~300 us, busy (spinning with sched_yield), so the others are queued;
  LOCK_RELEASED}. The handoff is the time from A's release (stamped just
  before sending LOCK_RELEASED) to B's grant (stamped once LOCK_OK is read and
  decoded). It is run with 2 clients (the headline figure) and 64 clients.

How: every client is its own OS process (multiprocessing, forkserver) using the
bare blocking ``gpud_client.connection.Connection`` (no reader thread), so the
figures are the daemon's and the socket path's. Each client stamps its events
with ``time.monotonic_ns()``, which on Linux is one clock for every process.
The lock is serial, so over time grants and releases must strictly alternate,
each release by the holder of the grant before it; the merged timeline is
checked for that before any handoff is computed, which validates the
measurement. A gap where the next holder had not even sent its request before
the release is an idle lock, not a handoff: it is counted and reported, never
mixed in. Warm-up cycles are discarded; percentiles are nearest-rank.

It must never bend a figure to meet a target: no sample is dropped but the
warm-up (idle gaps are no samples, and their number is printed), a broken
alternation or an unexpected message aborts the run, and the targets are only
reported beside the figures. It never touches a real GPU or
a system daemon: it starts its own on a temporary socket and removes it.

    .venv/bin/python bench/handoff.py [--json] [--rounds R] [--warmup W] [--hold-us US]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from multiprocessing.synchronize import Barrier
from typing import Any

from gpud.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import ProtocolError
from percentiles import percentile  # bench/, on the path when run as a script

# (t_request, t_grant, t_release, t_released), monotonic ns; plain ints so they pickle anywhere.
Cycle = tuple[int, int, int, int]

TARGETS = {"handoff_us_p50": 150.0, "handoff_us_p99": 2000.0, "p50_growth_64": 2.0}
MANY = 64
RECV_TIMEOUT_S = 30.0  # a worker that hears nothing this long means the daemon is stuck
START_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    rounds: int = 5000
    warmup: int = 200
    hold_us: int = 300


class MeasurementError(Exception):
    """The timeline contradicts a serial lock: the figures would be meaningless."""


# --- client side (runs in the worker processes) --------------------------------


def _wait_grant(conn: Connection, session: int) -> int:
    """Block until our LOCK_OK arrives; anything else about us is a failure."""
    while True:
        msg = conn.recv(RECV_TIMEOUT_S)
        match msg:
            case p.LockOk(session=sid, grant=grant) if sid == session:
                return grant
            case p.Error(code=code, message=message):
                raise ProtocolError(code, message)
            case p.DropLock() | p.Revoked():
                raise RuntimeError(f"unexpected {msg!r}: the hold is far below the time quantum")
            case p.SchedState():
                continue
        raise RuntimeError(f"unexpected message while waiting for LOCK_OK: {msg!r}")


def _hold_until(deadline_ns: int) -> None:
    # Busy, like a CUDA sync, rather than a sleep and its wake-up jitter. The
    # yield matters on a 2-core machine: a bare spin can keep the client that
    # just released off the CPU until after this hold ends, so it is not queued
    # and the lock goes idle (seen in about one run in two without the yield).
    while time.monotonic_ns() < deadline_ns:
        os.sched_yield()


def _run_cycles(conn: Connection, session: int, cycles: int, hold_ns: int) -> list[Cycle]:
    marks: list[Cycle] = []
    for _ in range(cycles):
        t_request = time.monotonic_ns()
        conn.send(p.LockRequest(id=conn.next_id(), session=session))
        grant = _wait_grant(conn, session)
        t_grant = time.monotonic_ns()
        _hold_until(t_grant + hold_ns)
        t_release = time.monotonic_ns()
        conn.send(p.LockReleased(id=conn.next_id(), session=session, grant=grant))
        marks.append((t_request, t_grant, t_release, time.monotonic_ns()))
    return marks


def lock_worker(path: str, name: str, cycles: int, hold_ns: int, start: Barrier, out: Pipe) -> None:
    """One client process: attach to GPU 0, wait for the others, cycle, report."""
    conn = Connection(path)
    try:
        conn.hello(name)
        attached: p.Attached = conn.call(p.Attach(id=conn.next_id(), gpu=0))
        start.wait(START_TIMEOUT_S)
        marks = _run_cycles(conn, attached.session, cycles, hold_ns)
    finally:
        conn.close()
    out.send(marks)
    out.close()


# --- parent side ---------------------------------------------------------------


def run_clients(ctx: Any, path: str, *, clients: int, cycles: int, hold_ns: int) -> list[list[Cycle]]:
    """Start ``clients`` worker processes, release them together, collect their cycles."""
    start = ctx.Barrier(clients + 1)
    procs, pipes = [], []
    try:
        for i in range(clients):
            ours, theirs = ctx.Pipe(duplex=False)
            args = (path, f"bench-{i}", cycles, hold_ns, start, theirs)
            proc = ctx.Process(target=lock_worker, args=args, name=f"bench-{i}", daemon=True)
            proc.start()
            theirs.close()  # so a dead worker shows up as EOF on ours
            procs.append(proc)
            pipes.append(ours)
        start.wait(START_TIMEOUT_S)
        return [_collect(pipe, proc) for pipe, proc in zip(pipes, procs)]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _collect(pipe: Pipe, proc: Any) -> list[Cycle]:
    try:
        marks: list[Cycle] = pipe.recv()
    except EOFError:
        raise RuntimeError(f"worker {proc.name} died without results (its traceback is above)") from None
    finally:
        pipe.close()
    return marks


def uncontended_cycles_us(marks: list[Cycle], warmup: int) -> list[float]:
    return [(released - request) / 1000 for request, _, _, released in marks[warmup:]]


def serial_holds(per_client: list[list[Cycle]], warmup: int) -> list[tuple[int, Cycle]]:
    """Every hold as (client, cycle) in grant order, checked to be serial.

    The lock has one holder, so each grant must come after the previous
    release; if not, the clocks or the daemon are broken and nothing measured
    here means anything. The first ``warmup`` holds are then dropped."""
    holds = sorted(((c, cycle) for c, marks in enumerate(per_client) for cycle in marks), key=lambda h: h[1][1])
    for (a, prev), (b, nxt) in zip(holds, holds[1:]):
        if nxt[1] <= prev[2]:
            raise MeasurementError(f"client {b} granted at {nxt[1]} ns before client {a} released at {prev[2]} ns")
    return holds[warmup:]


def handoffs_us(holds: list[tuple[int, Cycle]]) -> tuple[list[float], int]:
    """Release -> next grant, where the next holder had asked before the release.

    When it had not (it was still on its way, or the releaser got the lock
    back), the lock went idle: that gap is no handoff and is only counted."""
    samples: list[float] = []
    idle = 0
    for (_, prev), (_, nxt) in zip(holds, holds[1:]):
        if nxt[0] < prev[2]:
            samples.append((nxt[1] - prev[2]) / 1000)
        else:
            idle += 1
    return samples, idle




def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cycle_figures(ctx: Any, path: str, cfg: BenchConfig) -> dict[str, float]:
    _progress(f"uncontended: 1 client, {cfg.warmup} warm-up + {cfg.rounds} cycles")
    [alone] = run_clients(ctx, path, clients=1, cycles=cfg.warmup + cfg.rounds, hold_ns=0)
    cycle = uncontended_cycles_us(alone, cfg.warmup)
    return {"uncontended_cycle_us_p50": percentile(cycle, 50), "uncontended_cycle_us_p99": percentile(cycle, 99)}


def handoff_figures(ctx: Any, path: str, cfg: BenchConfig, *, clients: int, prefix: str) -> dict[str, float]:
    # Enough holds for warm-up plus `rounds` gaps between consecutive holds.
    per_client = math.ceil((cfg.warmup + cfg.rounds + 1) / clients)
    _progress(f"handoff: {clients} clients x {per_client} cycles, hold {cfg.hold_us} us")
    marks = run_clients(ctx, path, clients=clients, cycles=per_client, hold_ns=cfg.hold_us * 1000)
    samples, idle = handoffs_us(serial_holds(marks, cfg.warmup)[: cfg.rounds + 1])
    return {
        f"{prefix}_us_p50": percentile(samples, 50),
        f"{prefix}_us_p99": percentile(samples, 99),
        f"{prefix}_samples": len(samples),
        f"{prefix}_idle": idle,
    }


def measure(path: str, cfg: BenchConfig) -> dict[str, float]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gpud_client.connection"])
    figures = cycle_figures(ctx, path, cfg)
    figures |= handoff_figures(ctx, path, cfg, clients=2, prefix="handoff")
    figures |= handoff_figures(ctx, path, cfg, clients=MANY, prefix=f"handoff{MANY}")
    figures["p50_growth_64"] = figures[f"handoff{MANY}_us_p50"] / figures["handoff_us_p50"]
    return figures


def report(figures: dict[str, float], cfg: BenchConfig, *, load: float, elapsed_s: float) -> dict[str, Any]:
    met = {key: figures[key] <= limit for key, limit in TARGETS.items()}
    us = {key: round(value, 1) for key, value in figures.items() if "_us_" in key}
    return {
        "uncontended_cycle_us_p50": us["uncontended_cycle_us_p50"],
        "uncontended_cycle_us_p99": us["uncontended_cycle_us_p99"],
        "handoff_us_p50": us["handoff_us_p50"],
        "handoff_us_p99": us["handoff_us_p99"],
        "clients": 2,
        "rounds": cfg.rounds,
        f"handoff{MANY}_us_p50": us[f"handoff{MANY}_us_p50"],
        f"handoff{MANY}_us_p99": us[f"handoff{MANY}_us_p99"],
        f"clients{MANY}": MANY,
        "p50_growth_64": round(figures["p50_growth_64"], 2),
        # Gaps where the next holder had not asked yet: no handoff, left out.
        "idle_gaps": {"handoff": figures["handoff_idle"], f"handoff{MANY}": figures[f"handoff{MANY}_idle"]},
        "samples": {"handoff": figures["handoff_samples"], f"handoff{MANY}": figures[f"handoff{MANY}_samples"]},
        "hold_us": cfg.hold_us,
        "warmup": cfg.warmup,
        "cpus": os.cpu_count(),
        "loadavg_1m_before": round(load, 2),
        "elapsed_s": round(elapsed_s, 1),
        "targets": TARGETS,
        "met": met,
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        ("uncontended cycle p50", "uncontended_cycle_us_p50", "us"),
        ("uncontended cycle p99", "uncontended_cycle_us_p99", "us"),
        ("handoff p50, 2 clients", "handoff_us_p50", "us"),
        ("handoff p99, 2 clients", "handoff_us_p99", "us"),
        (f"handoff p50, {MANY} clients", f"handoff{MANY}_us_p50", "us"),
        (f"handoff p99, {MANY} clients", f"handoff{MANY}_us_p99", "us"),
        (f"p50 growth {MANY} vs 2", "p50_growth_64", "x"),
    ]
    lines = [f"{'figure':<26}{'measured':>12}{'target':>12}  met"]
    for label, key, unit in rows:
        target = f"<= {TARGETS[key]:g} {unit}" if key in TARGETS else ""
        met = ("yes" if result["met"][key] else "NO") if key in TARGETS else ""
        digits = 1 if unit == "us" else 2
        lines.append(f"{label:<26}{result[key]:>9.{digits}f} {unit:<2}{target:>12}  {met}".rstrip())
    idle, samples = result["idle_gaps"], result["samples"]
    lines.append(
        f"{result['rounds']} rounds after {result['warmup']} warm-up, hold {result['hold_us']} us; "
        f"handoff samples {samples['handoff']} / {samples[f'handoff{MANY}']} "
        f"(idle gaps left out: {idle['handoff']} / {idle[f'handoff{MANY}']})"
    )
    lines.append(
        f"{result['cpus']} CPUs, load {result['loadavg_1m_before']} before the run, took {result['elapsed_s']} s"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, bool]:
    ap = argparse.ArgumentParser(description="Latency of gpud's GPU lock: cycle and handoff.")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--rounds", type=int, default=BenchConfig.rounds, help="measured samples per figure")
    ap.add_argument("--warmup", type=int, default=BenchConfig.warmup, help="samples discarded first")
    ap.add_argument("--hold-us", type=int, default=BenchConfig.hold_us, help="spin time holding the lock")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.hold_us < 0:
        ap.error("--rounds must be >= 1, --warmup and --hold-us >= 0")
    return BenchConfig(rounds=args.rounds, warmup=args.warmup, hold_us=args.hold_us), args.json


def main(argv: list[str] | None = None) -> int:
    cfg, as_json = parse_args(argv)
    load, began = os.getloadavg()[0], time.monotonic()
    daemon = DaemonProcess("--simulate", "1", "--log-level", "warning").start()
    try:
        figures = measure(daemon.socket, cfg)
        complaints = daemon.log().strip()
    finally:
        daemon.cleanup()
    if complaints:
        _progress(f"the daemon logged warnings during the run:\n{complaints}")
    result = report(figures, cfg, load=load, elapsed_s=time.monotonic() - began)
    print(json.dumps(result) if as_json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
