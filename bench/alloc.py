"""Durable allocation throughput and latency through the real daemon.

What is measured: allocate + release cycles of a fractional GPU (0.25, so the
ledger does real placement work) against a real gpud (``--simulate 4``) whose
ledger lives in SQLite in a fresh state directory. Every cycle is two
committed transactions: the daemon answers ALLOCATED only after the commit of
the allocation, and OK only after the commit of the release.

How: C client processes (default 4), each on the bare blocking
``Connection``, loop ALLOCATE(task) -> ALLOCATED, FREE(task) -> OK for a fixed
time after a warm-up. An allocate's latency is from sending ALLOCATE to having
read ALLOCATED, stamped with ``time.monotonic_ns()``. cycles/s = all completed
cycles / the measured time. Run once with ``state_sync = "normal"`` (the
default: survives any crash of the daemon process) and once with ``"full"``
(an fsync per change: survives a power cut), and both are reported.

What preemption costs a request: the cycles' own allocations are of the default
priority (normal: another request could take them back only at a higher
priority, and none asks here), and with ``--preemptible-around N`` another
client holds N spot allocations of 0.01 GPU each through both runs, so that
every request is made among allocations any higher priority may take back at
once. Nobody waits in either case, so nothing is taken back: run it with 0 (the
default) and with, say, 64, side by side; the figures should not differ beyond
the runs' own spread (each run's JSON says ``preemptible_around``).

It never bends a figure: no sample is dropped besides the warm-up, and the
targets are only printed beside the figures. It never touches a real GPU or a
system daemon: it starts its own on a temporary socket and state directory.

    .venv/bin/python bench/alloc.py [--json] [--seconds S] [--clients C] [--preemptible-around N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection

from harness import Run, progress  # bench/, on the path when run as a script
from percentiles import percentile

TARGETS = {"cycles_per_s": 1000.0, "allocate_ms_p99": 5.0}
SEED_000 = {"allocate_ms": 100.0, "requests_per_minute": 200.0}  # the source design's own targets


def worker(socket_path: str, index: int, warmup_s: float, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    conn = Connection(socket_path)
    conn.hello(f"bench-{index}")
    latencies: list[float] = []
    cycles = 0
    start = time.monotonic() + warmup_s
    end = start + seconds
    n = 0
    while True:
        now = time.monotonic()
        if now >= end:
            break
        task = f"bench-{index}-{n}"
        n += 1
        t0 = time.monotonic_ns()
        reply = conn.call(p.Allocate(id=conn.next_id(), task_id=task, gpus=0.25))
        t1 = time.monotonic_ns()
        assert isinstance(reply, p.Allocated), reply
        conn.call(p.Free(id=conn.next_id(), task_id=task))
        if now >= start:
            latencies.append((t1 - t0) / 1e6)
            cycles += 1
    conn.close()
    out.put((cycles, latencies))


def hold_around(socket_path: str, count: int) -> Connection:
    """``count`` spot allocations of 0.01 GPU, held by a connection of their own (that listens)."""
    conn = Connection(socket_path)
    conn.hello("bench-around")
    for i in range(count):
        reply = conn.call(
            p.Allocate(id=conn.next_id(), task_id=f"around-{i}", gpus=0.01, priority_class=p.PriorityClass.SPOT)
        )
        assert isinstance(reply, p.Allocated), reply
    return conn


def run(sync: str, clients: int, seconds: float, warmup: float, around: int = 0) -> dict[str, object]:
    work = tempfile.mkdtemp(prefix="gpud-bench-alloc-", dir="/tmp")
    cfg = Path(work, "gpud.toml")
    cfg.write_text(f'state_sync = "{sync}"\nreap_interval_s = 0\n')
    d = DaemonProcess("--simulate", "4", "--log-level", "warning", "--config", str(cfg), workdir=work).start()
    try:
        holder = hold_around(d.socket, around) if around else None
        ctx = mp.get_context("forkserver")
        out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        procs = [ctx.Process(target=worker, args=(d.socket, i, warmup, seconds, out)) for i in range(clients)]
        for proc in procs:
            proc.start()
        results = [out.get(timeout=seconds + warmup + 120) for _ in procs]
        for proc in procs:
            proc.join()
        if holder is not None:
            for i in range(around):
                assert isinstance(holder.call(p.Free(id=holder.next_id(), task_id=f"around-{i}")), p.Ok)
            holder.close()
        with Connection(d.socket) as conn:
            conn.hello("check")
            left = conn.call(p.ListAllocations(id=conn.next_id())).allocations
        assert left == [], "every allocation was released"
    finally:
        d.cleanup()
    cycles = sum(c for c, _ in results)
    lat = [x for _, ls in results for x in ls]
    return {
        "state_sync": sync,
        "clients": clients,
        "cycles_per_s": round(cycles / seconds, 1),
        "allocate_ms_p50": round(percentile(lat, 50), 3),
        "allocate_ms_p99": round(percentile(lat, 99), 3),
        "allocate_ms_max": round(max(lat), 3),
        "samples": len(lat),
        "preemptible_around": around,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object, last")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured time per run (default 10)")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    ap.add_argument(
        "--preemptible-around",
        type=int,
        default=0,
        metavar="N",
        help="spot allocations of 0.01 GPU held by another client through each run (default 0)",
    )
    args = ap.parse_args(argv)
    if not 0 <= args.preemptible_around <= 100:
        ap.error("--preemptible-around: 0 to 100 (0.01 GPU each, beside the cycles' own)")
    this_run = Run()  # the load before the run, not after it
    progress(f"state_sync=normal: {args.clients} clients x {args.seconds:g}s")
    normal = run("normal", args.clients, args.seconds, args.warmup, args.preemptible_around)
    progress("state_sync=full")
    full = run("full", args.clients, args.seconds, args.warmup, args.preemptible_around)
    result = {
        "cycles_per_s": normal["cycles_per_s"],
        "allocate_ms_p50": normal["allocate_ms_p50"],
        "allocate_ms_p99": normal["allocate_ms_p99"],
        "normal": normal,
        "full": full,
        "targets": TARGETS,
        "met": {
            "cycles_per_s": float(normal["cycles_per_s"]) >= TARGETS["cycles_per_s"],  # type: ignore[arg-type]
            "allocate_ms_p99": float(normal["allocate_ms_p99"]) <= TARGETS["allocate_ms_p99"],  # type: ignore[arg-type]
        },
        "seed_000_targets": SEED_000,
        **this_run.machine(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    rows = [
        ("durable cycles/s (alloc+free)", f"{normal['cycles_per_s']}", f"{full['cycles_per_s']}", ">= 1000", "200/min"),
        ("allocate p50 ms", f"{normal['allocate_ms_p50']}", f"{full['allocate_ms_p50']}", "", ""),
        ("allocate p99 ms", f"{normal['allocate_ms_p99']}", f"{full['allocate_ms_p99']}", "<= 5", "< 100"),
    ]
    print(f"{'figure':<32}{'sync=normal':>12}{'sync=full':>12}{'target':>10}{'seed 000':>10}")
    for row in rows:
        print(f"{row[0]:<32}{row[1]:>12}{row[2]:>12}{row[3]:>10}{row[4]:>10}")
    print(f"{args.clients} client processes, {args.seconds:g}s each, 4 simulated GPUs, share 0.25 per allocation")
    if args.preemptible_around:
        print(f"among {args.preemptible_around} spot allocations of 0.01 GPU held by another client")
    return 0


if __name__ == "__main__":
    sys.exit(main())
