"""The unmodified programs that bench/run_share.py and bench/gpu_run.py run under ``gpud-run``.

They import nothing of gpud: each is a plain program that knows nothing of being paused, and
records its own progress on ``time.monotonic_ns()``, the clock every process of the machine shares
(gpud's and gpud-run's ``--trace`` included). Each runs until an absolute time on that clock
(``--until-ns``), so the benchmark knows when it ends before it starts it; a paused program simply
ends later. ``--stop-file P`` ends it earlier, once P exists: the benchmark learns only while the
program runs when it may stop (a program that starts in its first turn may take many turns to get
going). SIGTERM writes what was recorded and exits with 3 (a benchmark tearing down early).

- ``burn FILE``: burns one CPU in fixed chunks of pure-Python work and stamps its start and the end
  of every chunk with the time and the CPU time it has used (``time.process_time_ns()``: a stopped or
  preempted process uses none). FILE gets native int64 pairs (time, CPU time): the start, then the
  end of chunk 1, 2, ...; the work done by time t is the number of chunk stamps at or before t. It
  looks for the stop file every 64 chunks (one stat call in about 70 ms of work).
- ``idle``: sleeps until T and does nothing else (an idle program for idle release; no stop file:
  waking up to look would be activity).
- ``matmul FILE --size N [--hold-fraction F]``: PyTorch on the first visible CUDA
  device. Allocates F of the GPU's memory (to make parking move it), then multiplies two N x N
  half-precision matrices in a loop, one product always queued behind the one being waited for.
  Each product is timed by its own pair of CUDA events; once it is done its line is written:
  ``{"t": host_ns_when_seen_done, "ms": kernel_ms, "launch_us": host_us_to_launch_it}``. A launch
  that took long (a paused program's CUDA calls block) is marked by its ``launch_us``: its events
  may then enclose the pause, and the reader counts it at the median kernel time instead. The first
  line is ``{"start": ns, "bytes": held, "size": N}``, written once the setup is done.
- ``link``: PyTorch's pinned host memory to the GPU and back (1 GiB, best of 5, CUDA events): prints
  ``{"bytes", "h2d_gbps", "d2h_gbps"}``, the host link's bandwidth that parking moves memory over.

The work must stay the same whether the program runs alone or arbitrated, so nothing here adapts
to what it sees: no timing-dependent branch, no I/O while it works (burn) or one small line per
product (matmul, whose products take milliseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from array import array
from typing import Any

CHUNK = 20_000  # additions per chunk: about a millisecond of one core
LOOK_EVERY = 64  # chunks between two looks for the stop file
FOREVER = 2**62


def burn(path: str, until_ns: int, stop_file: str | None) -> int:
    clock, cpu = time.monotonic_ns, time.process_time_ns
    stamps = array("q", [clock(), cpu()])

    def write() -> None:
        with open(path, "wb") as f:
            stamps.tofile(f)

    def on_term(signum: int, frame: object) -> None:
        write()
        os._exit(3)

    signal.signal(signal.SIGTERM, on_term)
    extend, chunk, exists = stamps.extend, range(CHUNK), os.path.exists
    t, n = stamps[0], 0
    while t < until_ns:
        x = 0
        for i in chunk:
            x += i
        t = clock()
        extend((t, cpu()))
        n += 1
        if n % LOOK_EVERY == 0 and stop_file is not None and exists(stop_file):
            break
    write()
    return 0


def idle(until_ns: int) -> int:
    while (left := until_ns - time.monotonic_ns()) > 0:
        time.sleep(left / 1e9)
    return 0


def matmul(path: str, until_ns: int, stop_file: str | None, size: int, hold_fraction: float) -> int:
    import torch  # here: burn and idle run where there is no PyTorch

    clock, exists = time.monotonic_ns, os.path.exists
    out = open(path, "w", buffering=1)  # noqa: SIM115 - open until the process ends

    def on_term(signum: int, frame: object) -> None:
        out.close()
        os._exit(3)

    signal.signal(signal.SIGTERM, on_term)
    dev = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(dev).total_memory
    ballast = torch.empty(int(total * hold_fraction), dtype=torch.uint8, device=dev)
    ballast.fill_(1)  # touched: the memory is really the process's
    a = torch.randn(size, size, device=dev, dtype=torch.half)
    b = torch.randn(size, size, device=dev, dtype=torch.half)
    c = torch.empty(size, size, device=dev, dtype=torch.half)
    torch.matmul(a, b, out=c)  # cuBLAS's handle and workspace, before anything is timed
    torch.cuda.synchronize()
    out.write(json.dumps({"start": clock(), "bytes": torch.cuda.memory_reserved(dev), "size": size}) + "\n")
    pending: tuple[Any, Any, int] | None = None
    while True:
        t0 = clock()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.matmul(a, b, out=c)
        end.record()
        launch_us = (clock() - t0) // 1000
        if pending is not None:
            p_begin, p_end, p_launch = pending
            p_end.synchronize()
            out.write(json.dumps({"t": clock(), "ms": p_begin.elapsed_time(p_end), "launch_us": p_launch}) + "\n")
        pending = (begin, end, launch_us)
        if clock() >= until_ns or (stop_file is not None and exists(stop_file)):
            break
    torch.cuda.synchronize()
    del ballast
    out.close()
    return 0


def link(nbytes: int = 2**30, tries: int = 5) -> int:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best: dict[str, float] = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        for _ in range(tries):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best[name] = max(best.get(name, 0.0), nbytes / (begin.elapsed_time(end) / 1000) / 1e9)
    print(json.dumps({"bytes": nbytes, "h2d_gbps": round(best["h2d"], 2), "d2h_gbps": round(best["d2h"], 2)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The programs of bench/run_share.py and bench/gpu_run.py.")
    sub = ap.add_subparsers(dest="program", required=True)
    for name in ("burn", "idle", "matmul"):
        one = sub.add_parser(name)
        if name != "idle":
            one.add_argument("file")
            one.add_argument("--stop-file")
        one.add_argument("--until-ns", type=int, default=FOREVER, required=name == "idle")
        if name == "matmul":
            one.add_argument("--size", type=int, default=4096)
            one.add_argument("--hold-fraction", type=float, default=0.0)
    sub.add_parser("link")
    args = ap.parse_args(argv)
    if args.program == "burn":
        return burn(args.file, args.until_ns, args.stop_file)
    if args.program == "idle":
        return idle(args.until_ns)
    if args.program == "matmul":
        return matmul(args.file, args.until_ns, args.stop_file, args.size, args.hold_fraction)
    return link()


if __name__ == "__main__":
    sys.exit(main())
