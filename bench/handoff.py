"""Latency of gpud's GPU lock: one client's cycle, and the handoff between clients,
each beside the floor any Python daemon pays (a minimal relay, in the same run)
and, in the pair harness, beside the floor any daemon on trio pays.

What is measured, against a real daemon (``--simulate 1``) in its own process:
- uncontended cycle: one client alone; from sending LOCK_REQUEST to having
  sent LOCK_RELEASED after its LOCK_OK arrived (hold time zero);
- handoff: N clients on GPU 0, each looping {LOCK_REQUEST; wait for LOCK_OK;
  hold ~300 us, busy (spinning with sched_yield), so the others are queued;
  LOCK_RELEASED}. The handoff is the time from A's release (stamped just
  before sending LOCK_RELEASED) to B's grant (stamped once LOCK_OK is read and
  decoded). It is run with 2 clients (the headline figure) and 64 clients.
  These are the "processes" harness: one OS process per client, placed on
  CPUs by the kernel.
- the "pair" harness, the issue's own: one client process with two
  connections A and B. A cycle is A alone (as above); a handoff is A holding,
  B asking, 200 us later A releasing, and B's LOCK_OK read (A's LOCK_RELEASED
  send -> B's LOCK_OK receipt, as in bench/abuse.py). It is pinned, and run
  twice: the client and the server on one CPU (``pair_*``: the server runs
  while the client waits, so no wake-up crosses CPUs and what is left is the
  software's cost), and on two (``pair_two_cpus_*``: every message wakes the
  other CPU). Left to the kernel, a client and a server on this 2-CPU VM land
  either way and stay for seconds, which alone moves a round trip between ~12
  and ~70 us, so a ratio of two unpinned servers compares placements, not
  servers. ``daemon_cpu_us_per_cycle``: the daemon's utime + stime
  (/proc/PID/stat) over ``warmup + rounds`` pair cycles on it alone, divided by
  them.
- the floor (bench/floor.py): a minimal relay in Python (one process,
  ``selectors`` on non-blocking Unix sockets, the protocol's framing and its
  typed codec for every message, as gpud decodes and encodes them; HELLO ->
  WELCOME, ATTACH -> ATTACHED, LOCK_REQUEST -> LOCK_OK or the FIFO, the
  holder's LOCK_RELEASED -> LOCK_OK to the FIFO's head; nothing else: no
  checks beyond decoding, no errors, metrics or logs). The same client code,
  hold times and percentiles run against it in the same run: the cycle and the
  2-client handoff of the processes harness in ``--blocks`` blocks alternating
  with gpud's, and the pair harness in blocks of PAIR_BLOCK alternating with
  gpud's, so both see the same host. gpud / floor for p50 and p99 is reported
  beside a target of 3x.
- the trio floor (bench/floor.py, pair harness only): the same relay on trio,
  reading as gpud's listener does (one task per connection, ``os.read``, and
  ``trio.lowlevel.wait_readable`` as it does) and answering with
  ``os.write``. A trio wake-up (its run loop, a task switch) costs more than a
  ``select`` loop's, and gpud pays it too: gpud / trio floor
  (``*_ratio_trio_*``) is gpud's own cost, trio floor / floor the framework's.
  No target is set against it.

How: the clients run in OS processes of their own (multiprocessing, forkserver) on the
bare blocking ``gpud_client.connection.Connection`` (no reader thread), so the
figures are the daemon's and the socket path's. Each client stamps its events
with ``time.monotonic_ns()``, which on Linux is one clock for every process.
The lock is serial, so over time grants and releases must strictly alternate,
each release by the holder of the grant before it; the merged timeline is
checked for that before any handoff is computed, which validates the
measurement (the pair harness checks that B has been sent nothing before A
releases). A gap where the next holder had not even sent its request before
the release is an idle lock, not a handoff: it is counted and reported, never
mixed in. Warm-up cycles are discarded; percentiles are nearest-rank.

It must never bend a figure to meet a target: no sample is dropped but the
warm-up (idle gaps are no samples, and their number is printed), a broken
alternation or an unexpected message aborts the run, and the targets are only
reported beside the figures. It never touches a real GPU or
a system daemon: it starts its own on a temporary socket and removes it.

    .venv/bin/python bench/handoff.py [--json] [--rounds R] [--warmup W] [--hold-us US] [--blocks B]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import select
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from multiprocessing.synchronize import Barrier
from typing import Any

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import ProtocolError

from floor import relay_main, start_relay, trio_relay_main  # bench/, on the path when run as a script
from harness import Run, progress
from percentiles import percentile

# (t_request, t_grant, t_release, t_released), monotonic ns; plain ints so they pickle anywhere.
Cycle = tuple[int, int, int, int]

TARGETS = {
    "handoff_us_p50": 150.0,
    "handoff_us_p99": 2000.0,
    "p50_growth_64": 2.0,
    # gpud over the floor in each harness and placement, and the daemon's CPU per uncontended cycle
    **{
        f"{harness}_ratio_p{pct}": 3.0
        for harness in ("handoff", "pair_handoff", "pair_two_cpus_handoff")
        for pct in (50, 99)
    },
    "daemon_cpu_us_per_cycle": 40.0,
    "daemon_cpu_us_per_cycle_two_cpus": 40.0,
}
MANY = 64
QUEUED_NS = 200_000  # pair harness: B asks this long before A releases
PAIR_BLOCK = 100  # pair harness: iterations on one server before switching to the other
RECV_TIMEOUT_S = 30.0  # a worker that hears nothing this long means the daemon is stuck
START_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    rounds: int = 5000
    warmup: int = 200
    hold_us: int = 300
    blocks: int = 4  # processes harness: alternating gpud / floor blocks


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


def _greet(conn: Connection, name: str) -> int:
    conn.hello(name)
    attached: p.Attached = conn.call(p.Attach(id=conn.next_id(), gpu=0))
    return attached.session


def lock_worker(path: str, name: str, cycles: int, hold_ns: int, start: Barrier, out: Pipe) -> None:
    """One client process: attach to GPU 0, wait for the others, cycle, report."""
    with Connection(path) as conn:
        session = _greet(conn, name)
        start.wait(START_TIMEOUT_S)
        marks = _run_cycles(conn, session, cycles, hold_ns)
    out.send(marks)
    out.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process so far (resolution: one clock tick, 10 ms on Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Pair:
    """The issue's harness on one server: two connections A and B of one client process."""

    def __init__(self, stack: ExitStack, path: str) -> None:
        self.a, self.b = stack.enter_context(Connection(path)), stack.enter_context(Connection(path))
        self.sa, self.sb = _greet(self.a, "pair-a"), _greet(self.b, "pair-b")

    def cycle_ns(self) -> int:
        """A alone: LOCK_REQUEST sent -> LOCK_OK read -> LOCK_RELEASED sent."""
        a, sa = self.a, self.sa
        t_request = time.monotonic_ns()
        a.send(p.LockRequest(id=a.next_id(), session=sa))
        grant = _wait_grant(a, sa)
        a.send(p.LockReleased(id=a.next_id(), session=sa, grant=grant))
        return time.monotonic_ns() - t_request

    def handoff_ns(self) -> int:
        """A holds, B asks, QUEUED_NS later A releases: A's LOCK_RELEASED send -> B's LOCK_OK read."""
        a, sa, b, sb = self.a, self.sa, self.b, self.sb
        a.send(p.LockRequest(id=a.next_id(), session=sa))
        grant_a = _wait_grant(a, sa)
        b.send(p.LockRequest(id=b.next_id(), session=sb))
        _hold_until(time.monotonic_ns() + QUEUED_NS)
        if select.select([b.sock], [], [], 0)[0]:  # B is sent nothing but its LOCK_OK
            raise MeasurementError("B was sent something while A still held the lock: not a serial lock")
        t_release = time.monotonic_ns()
        a.send(p.LockReleased(id=a.next_id(), session=sa, grant=grant_a))
        grant_b = _wait_grant(b, sb)
        t_grant = time.monotonic_ns()
        b.send(p.LockReleased(id=b.next_id(), session=sb, grant=grant_b))
        return t_grant - t_release


def pair_worker(servers: list[tuple[str, int]], cpus: set[int], rounds: int, warmup: int, out: Pipe) -> None:
    """One process on ``cpus``, two connections to each server. First each server's CPU over
    ``warmup + rounds`` cycles alone, one server after the other; then cycles, then handoffs, in
    blocks of PAIR_BLOCK alternating between the servers after a warm-up on each, so all see the
    same host."""
    os.sched_setaffinity(0, cpus)
    results: list[dict[str, Any]] = [{"cycle_ns": [], "handoff_ns": []} for _ in servers]
    with ExitStack() as stack:
        pairs = [Pair(stack, path) for path, _ in servers]
        for result, pair, (_, pid) in zip(results, pairs, servers):
            before = cpu_seconds(pid)
            for _ in range(warmup + rounds):
                pair.cycle_ns()
            result["cpu_s"], result["cpu_cycles"] = cpu_seconds(pid) - before, warmup + rounds
        for kind, step in (("cycle_ns", Pair.cycle_ns), ("handoff_ns", Pair.handoff_ns)):
            for pair in pairs:
                for _ in range(warmup):
                    step(pair)
            for block in split(rounds, math.ceil(rounds / PAIR_BLOCK)):
                for result, pair in zip(results, pairs):
                    result[kind] += [step(pair) for _ in range(block)]
    out.send(results)
    out.close()


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto ``cpus`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def placements() -> dict[str, tuple[set[int], set[int]]]:
    """(the client's CPUs, the server's CPUs): one CPU for both (the server runs when the client waits,
    no wake-up crosses CPUs: the software's cost), or one each (every message wakes the other CPU).
    Left to the kernel, a client and a server land either way and stay there for seconds; on this VM
    that alone moves a round trip between ~12 and ~70 us, so the figures compared are pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    out = {"pair": ({cpus[0]}, {cpus[0]})}
    if len(cpus) > 1:
        out["pair_two_cpus"] = ({cpus[0]}, {cpus[1]})
    return out


def split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` blocks as equal as can be, the larger first."""
    size, extra = divmod(total, parts)
    return [size + (i < extra) for i in range(parts)]


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


def _collect(pipe: Pipe, proc: Any) -> Any:
    try:
        marks = pipe.recv()
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


@dataclass(frozen=True)
class Server:
    """What a harness runs against: gpud or a floor relay."""

    path: str
    pid: int


def cycle_figures(ctx: Any, path: str, cfg: BenchConfig, *, rounds: int) -> list[float]:
    [alone] = run_clients(ctx, path, clients=1, cycles=cfg.warmup + rounds, hold_ns=0)
    return uncontended_cycles_us(alone, cfg.warmup)


def handoff_figures(ctx: Any, path: str, cfg: BenchConfig, *, clients: int, rounds: int) -> tuple[list[float], int]:
    # Enough holds for warm-up plus `rounds` gaps between consecutive holds.
    per_client = math.ceil((cfg.warmup + rounds + 1) / clients)
    marks = run_clients(ctx, path, clients=clients, cycles=per_client, hold_ns=cfg.hold_us * 1000)
    return handoffs_us(serial_holds(marks, cfg.warmup)[: rounds + 1])


def _percentiles(prefix: str, samples: list[float]) -> dict[str, float]:
    if not samples:  # every gap was idle: one client ran all its cycles before the other asked
        raise MeasurementError(f"no {prefix} sample: the lock was never handed over; run more --rounds")
    return {f"{prefix}_us_p50": percentile(samples, 50), f"{prefix}_us_p99": percentile(samples, 99)}


def processes_figures(ctx: Any, gpud: Server, floor: Server, cfg: BenchConfig) -> dict[str, float]:
    """The cycle and the 2-client handoff on gpud and on the floor, in ``cfg.blocks`` alternating
    blocks (each after its own warm-up), so that both see the same host; the samples are merged."""
    cycles: dict[str, list[float]] = {"gpud": [], "floor": []}
    handoffs: dict[str, list[float]] = {"gpud": [], "floor": []}
    idle = {"gpud": 0, "floor": 0}
    for i, rounds in enumerate(split(cfg.rounds, cfg.blocks)):
        for name, server in (("gpud", gpud), ("floor", floor)):
            progress(
                f"processes harness, {name}, block {i + 1}/{cfg.blocks}: 1 client x {cfg.warmup} + {rounds} "
                f"cycles, then 2 clients, {rounds} handoffs after {cfg.warmup}, hold {cfg.hold_us} us"
            )
            cycles[name] += cycle_figures(ctx, server.path, cfg, rounds=rounds)
            samples, gaps = handoff_figures(ctx, server.path, cfg, clients=2, rounds=rounds)
            handoffs[name] += samples
            idle[name] += gaps
    return {
        **_percentiles("uncontended_cycle", cycles["gpud"]),
        **_percentiles("floor_cycle", cycles["floor"]),
        **_percentiles("handoff", handoffs["gpud"]),
        **_percentiles("floor_handoff", handoffs["floor"]),
        "handoff_samples": len(handoffs["gpud"]),
        "handoff_idle": idle["gpud"],
        "floor_handoff_samples": len(handoffs["floor"]),
        "floor_handoff_idle": idle["floor"],
    }


def many_figures(ctx: Any, gpud: Server, cfg: BenchConfig) -> dict[str, float]:
    progress(f"processes harness, gpud: {MANY} clients, {cfg.rounds} handoffs after {cfg.warmup}")
    samples, idle = handoff_figures(ctx, gpud.path, cfg, clients=MANY, rounds=cfg.rounds)
    return {
        **_percentiles(f"handoff{MANY}", samples),
        f"handoff{MANY}_samples": len(samples),
        f"handoff{MANY}_idle": idle,
    }


def pair_figures(
    ctx: Any,
    gpud: Server,
    floor: Server,
    trio_floor: Server,
    cfg: BenchConfig,
    *,
    prefix: str,
    cpus: tuple[set[int], set[int]],
) -> dict[str, float]:
    """The issue's harness on gpud and both floors in one client process (see ``pair_worker``), pinned."""
    client, server = cpus
    progress(
        f"{prefix} harness: 1 process on CPU {sorted(client)}, the servers on {sorted(server)}, 2 connections "
        f"to each; {cfg.warmup} + {cfg.rounds} cycles each for CPU, then cycles and handoffs (B queued "
        f"{QUEUED_NS // 1000} us before) in alternating blocks"
    )
    everywhere = os.sched_getaffinity(0)
    ours, theirs = ctx.Pipe(duplex=False)
    servers = (gpud, floor, trio_floor)
    args = ([(s.path, s.pid) for s in servers], client, cfg.rounds, cfg.warmup, theirs)
    proc = ctx.Process(target=pair_worker, args=args, name=prefix, daemon=True)
    try:
        for s in servers:
            pin(s.pid, server)
        proc.start()
        theirs.close()
        results = _collect(ours, proc)
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join()
        for s in servers:
            pin(s.pid, everywhere)
    suffix = prefix.removeprefix("pair")
    named = (
        (prefix, f"daemon_cpu_us_per_cycle{suffix}"),
        (f"floor_{prefix}", f"floor_cpu_us_per_cycle{suffix}"),
        (f"trio_floor_{prefix}", f"trio_floor_cpu_us_per_cycle{suffix}"),
    )
    figures: dict[str, float] = {}
    for (name, cpu_key), r in zip(named, results):
        figures |= _percentiles(f"{name}_cycle", [ns / 1000 for ns in r["cycle_ns"]])
        figures |= _percentiles(f"{name}_handoff", [ns / 1000 for ns in r["handoff_ns"]])
        figures[cpu_key] = r["cpu_s"] / r["cpu_cycles"] * 1e6
    figures["cpu_cycles"] = results[0]["cpu_cycles"]
    for kind in ("cycle", "handoff"):
        for pct in (50, 99):
            gpud_us = figures[f"{prefix}_{kind}_us_p{pct}"]
            figures[f"{prefix}_{kind}_ratio_p{pct}"] = gpud_us / figures[f"floor_{prefix}_{kind}_us_p{pct}"]
            figures[f"{prefix}_{kind}_ratio_trio_p{pct}"] = gpud_us / figures[f"trio_floor_{prefix}_{kind}_us_p{pct}"]
    return figures


def measure(ctx: Any, gpud: Server, floor: Server, trio_floor: Server, cfg: BenchConfig) -> dict[str, float]:
    figures = processes_figures(ctx, gpud, floor, cfg)
    figures |= many_figures(ctx, gpud, cfg)
    for prefix, cpus in placements().items():
        figures |= pair_figures(ctx, gpud, floor, trio_floor, cfg, prefix=prefix, cpus=cpus)
    figures["p50_growth_64"] = figures[f"handoff{MANY}_us_p50"] / figures["handoff_us_p50"]
    for kind, gpud_key, floor_key in (
        ("handoff", "handoff", "floor_handoff"),
        ("cycle", "uncontended_cycle", "floor_cycle"),
    ):
        for pct in (50, 99):
            figures[f"{kind}_ratio_p{pct}"] = figures[f"{gpud_key}_us_p{pct}"] / figures[f"{floor_key}_us_p{pct}"]
    return figures


HARNESSES = {
    "processes": "one OS process per client, each holding ~hold_us busy and asking again at once, placed by the "
    "kernel; the cycle and the 2-client handoff run on gpud and the floor in `blocks` alternating "
    "blocks, each after its own warm-up; keys uncontended_cycle_*, handoff_*, floor_cycle_*, "
    "floor_handoff_*, cycle_ratio_*, handoff_ratio_*, and handoff64_* (gpud only, one run)",
    "pair": "the issue's: one client process, two connections per server; a cycle is A alone, a handoff is A "
    "holding, B asking, 200 us later A releasing (A's LOCK_RELEASED send -> B's LOCK_OK read); cycles then "
    "handoffs in blocks of `pair_block` alternating between gpud, the floor and the trio floor. pair_*, "
    "floor_pair_* and trio_floor_pair_*: client and servers pinned to one CPU; pair_two_cpus_*, "
    "floor_pair_two_cpus_* and trio_floor_pair_two_cpus_*: the client on one CPU, the servers on the "
    "other; *_ratio_p* is gpud / floor, *_ratio_trio_p* gpud / trio floor",
    "cpu": "daemon_cpu_us_per_cycle / floor_cpu_us_per_cycle / trio_floor_cpu_us_per_cycle (_two_cpus): utime + "
    "stime (/proc/PID/stat, 10 ms ticks) over `cpu_cycles` pair-harness cycles on that server alone, "
    "contiguous, before its latency blocks",
    "floor": "a minimal Python relay in its own process: selectors, gpud's framing and typed codec, "
    "one FIFO and one holder, nothing else (bench/floor.py); the targets are against it",
    "trio_floor": "the same relay on trio (pair harness only): a trio socket listener, one task per connection "
    "reading as gpud's listener does (os.read, trio.lowlevel.wait_readable when nothing is expected), "
    "os.write to answer; gpud / trio floor is gpud's own cost, trio floor / floor trio's per-wakeup cost",
}


def report(figures: dict[str, float], cfg: BenchConfig, machine: dict[str, Any]) -> dict[str, Any]:
    met = {key: figures[key] <= limit for key, limit in TARGETS.items() if key in figures}
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
        "idle_gaps": {k: figures[f"{k}_idle"] for k in ("handoff", f"handoff{MANY}", "floor_handoff")},
        "samples": {k: figures[f"{k}_samples"] for k in ("handoff", f"handoff{MANY}", "floor_handoff")},
        "hold_us": cfg.hold_us,
        "warmup": cfg.warmup,
        **{k: v for k, v in us.items() if k.startswith(("floor_", "trio_floor_", "pair_", "daemon_cpu"))},
        **{
            k: round(v, 2)
            for k, v in figures.items()
            if k.endswith(("_ratio_p50", "_ratio_p99", "_ratio_trio_p50", "_ratio_trio_p99"))
        },
        "pair_queued_us": QUEUED_NS // 1000,
        "blocks": cfg.blocks,
        "pair_block": PAIR_BLOCK,
        "cpu_cycles": figures["cpu_cycles"],
        "placements": {k: {"client_cpus": sorted(c), "server_cpus": sorted(s)} for k, (c, s) in placements().items()},
        "harnesses": HARNESSES,
        **machine,
        "targets": TARGETS,
        "met": met,
    }


def _met_cell(result: dict[str, Any], key: str, unit: str) -> tuple[str, str]:
    if key not in result["met"]:
        return "", ""
    return f"<= {TARGETS[key]:g} {unit}", "yes" if result["met"][key] else "NO"


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
        target, met = _met_cell(result, key, unit)
        digits = 1 if unit == "us" else 2
        lines.append(f"{label:<26}{result[key]:>9.{digits}f} {unit:<2}{target:>12}  {met}".rstrip())
    idle, samples = result["idle_gaps"], result["samples"]
    lines.append(
        f"{result['rounds']} rounds after {result['warmup']} warm-up, hold {result['hold_us']} us; "
        f"handoff samples {samples['handoff']} / {samples[f'handoff{MANY}']} "
        f"(idle gaps left out: {idle['handoff']} / {idle[f'handoff{MANY}']})"
    )
    lines += ["", *_against_the_floors(result)]
    lines.append(
        f"processes: one OS process per client, placed by the kernel, {result['blocks']} alternating blocks "
        f"per server; pair: one process, two connections per server, B queued {result['pair_queued_us']} "
        f"us before A releases, blocks of {result['pair_block']}; CPU over {result['cpu_cycles']} cycles"
    )
    lines.append(
        f"{result['cpus']} CPUs, load {result['loadavg_1m_before']} before the run, "
        f"{result['loadavg_1m_after']} after, took {result['elapsed_s']} s"
    )
    return "\n".join(lines)


def _against_the_floors(result: dict[str, Any]) -> list[str]:
    """gpud beside the floor (the targets' ratio) and, in the pair harness, beside the trio floor."""
    lines = [
        "gpud against the floor (a minimal Python relay) and the trio floor (the same on trio), same run, "
        "same client code (us)",
        f"{'harness':<16}{'figure':<14}{'gpud':>9}{'floor':>9}{'ratio':>8}{'trio floor':>12}{'gpud / trio':>13}"
        f"{'target':>10}  met",
    ]
    compared: list[tuple[str, str, str, str, str, str | None]] = [
        ("processes", "uncontended_cycle", "floor_cycle", "cycle", "cycle", None),
        ("processes", "handoff", "floor_handoff", "handoff", "handoff, 2", None),
    ]
    compared += [
        (
            f"pair, {'1 CPU' if name == 'pair' else '2 CPUs'}",
            f"{name}_{kind}",
            f"floor_{name}_{kind}",
            f"{name}_{kind}",
            kind,
            f"trio_floor_{name}_{kind}",
        )
        for name in placements()
        for kind in ("cycle", "handoff")
    ]
    for harness, gpud, floor, ratio, label, trio in compared:
        for pct in (50, 99):
            key = f"{ratio}_ratio_p{pct}"
            target, met = _met_cell(result, key, "x")
            trio_cells = (
                f"{result[f'{trio}_us_p{pct}']:>12.1f}{result[f'{ratio}_ratio_trio_p{pct}']:>12.2f}x"
                if trio
                else " " * 25
            )
            lines.append(
                f"{harness:<16}{label + f' p{pct}':<14}{result[f'{gpud}_us_p{pct}']:>9.1f}"
                f"{result[f'{floor}_us_p{pct}']:>9.1f}{result[key]:>7.2f}x{trio_cells}{target:>10}  "
                f"{met}".rstrip()
            )
    for suffix, where in (("", "1 CPU"), ("_two_cpus", "2 CPUs")):
        key = f"daemon_cpu_us_per_cycle{suffix}"
        if key in result:
            target, met = _met_cell(result, key, "us")
            lines.append(
                f"daemon CPU per uncontended cycle (pair, {where}): {result[key]:.1f} us (the floor's: "
                f"{result[f'floor_cpu_us_per_cycle{suffix}']:.1f} us, the trio floor's: "
                f"{result[f'trio_floor_cpu_us_per_cycle{suffix}']:.1f} us), target {target}: {met}"
            )
    return lines


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, bool]:
    ap = argparse.ArgumentParser(description="Latency of gpud's GPU lock: cycle and handoff.")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--rounds", type=int, default=BenchConfig.rounds, help="measured samples per figure")
    ap.add_argument("--warmup", type=int, default=BenchConfig.warmup, help="samples discarded first")
    ap.add_argument("--hold-us", type=int, default=BenchConfig.hold_us, help="spin time holding the lock")
    ap.add_argument(
        "--blocks",
        type=int,
        default=BenchConfig.blocks,
        help="alternating gpud / floor blocks in the processes harness",
    )
    args = ap.parse_args(argv)
    if args.blocks < 1 or args.rounds < args.blocks or args.warmup < 0 or args.hold_us < 0:
        ap.error("--blocks must be >= 1, --rounds >= --blocks, --warmup and --hold-us >= 0")
    cfg = BenchConfig(rounds=args.rounds, warmup=args.warmup, hold_us=args.hold_us, blocks=args.blocks)
    return cfg, args.json


def start_floor(ctx: Any, floor_main: Callable[[str, Pipe], None], workdir: str, started: list[Any]) -> Server:
    """A floor relay in its own process (added to ``started``), listening in ``workdir`` once this returns."""
    path = os.path.join(workdir, f"{floor_main.__name__}.sock")
    proc, pid = start_relay(ctx, floor_main, path, timeout_s=START_TIMEOUT_S)
    started.append(proc)
    return Server(path, pid)


def main(argv: list[str] | None = None) -> int:
    cfg, as_json = parse_args(argv)
    run = Run()
    ctx = mp.get_context("forkserver")
    # Each worker runs this script again before its target (multiprocessing does so with the main
    # module): with its imports preloaded, that costs a worker the script's own lines, not gpud's imports.
    ctx.set_forkserver_preload(["gpud_client.connection", "gpud.tools.spawn", "floor"])
    daemon = DaemonProcess("--simulate", "1", "--log-level", "warning").start()
    workdir = tempfile.mkdtemp(prefix="relay-", dir="/tmp")  # short: socket paths are limited to ~108 bytes
    relays: list[Any] = []
    try:
        floor, trio_floor = (
            start_floor(ctx, floor_main, workdir, relays) for floor_main in (relay_main, trio_relay_main)
        )
        assert daemon.proc is not None
        figures = measure(ctx, Server(daemon.socket, daemon.proc.pid), floor, trio_floor, cfg)
        complaints = daemon.log().strip()
    except MeasurementError as exc:
        progress(f"measurement invalid: {exc}")
        return 1
    finally:
        daemon.cleanup()
        for proc in relays:
            proc.terminate()
            proc.join()
        shutil.rmtree(workdir, ignore_errors=True)
    if complaints:
        progress(f"the daemon logged warnings during the run:\n{complaints}")
    result = report(figures, cfg, run.machine())
    print(json.dumps(result) if as_json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
