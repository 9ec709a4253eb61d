"""The GPU processes of ``bench/gpu_quota.py``: the kernel, its calibration, the session processes.

Each is its own OS process (multiprocessing, forkserver) with its own CUDA
context. PyTorch is imported inside the entry points only, so this module
imports anywhere: the forkserver preloads it, and the tests read it on a
machine without torch. A kernel is one half-precision matrix product
(``torch.matmul`` into a preallocated output) on the default stream, timed by
a pair of CUDA events recorded around it.

A session process loads torch seeing only the daemon's GPU
(CUDA_VISIBLE_DEVICES set to its NVML UUID, checked against PyTorch's), warms
the product up (cuBLAS's handle and workspace), then attaches with
``synchronize=torch.cuda.synchronize`` (a lock goes back only once the GPU has
finished this process's kernels) and the PyTorch memory hook (torch is
imported and the device set before ``client.session``, so the client reports
``torch.cuda.memory_reserved()`` at every slice end). Its loop:
``with session.slice():`` launch one kernel, then wait for the kernel
``depth`` launches back, so the GPU always has the next kernel queued and the
host's time between kernels (the slice's exit and entry, reading events) hides
behind it. It stamps grants and DROP_LOCKs with ``time.monotonic_ns()`` as
``quota_workers`` does, and pins its events on that clock with two anchors
taken while the GPU is idle (the parent says when: ``go``, ``anchor``). It
decides nothing about what it measured: the parent does, with ``gpu_timeline``.
The parent's side of both protocols is here too (``calibrate``, ``run_workers``).
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

from gpud_client import Client

from gpu_timeline import Anchor, best_bracket
from quota_workers import MeasurementError, receive

ANCHOR_TRIES = 5
WARMUP_KERNELS = 3
TIMED_KERNELS = 10  # per calibration size; the median is taken
KERNEL_MS = (2.0, 5.0)  # one kernel's time on the GPU found, alone
LADDER = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
SIZE_STEP = 128  # matrix sides are multiples of this (tensor-core friendly)
MIN_SIZE = 256
CONTEXT_BYTES = 512 * 2**20  # a CUDA context's own memory, beyond what PyTorch's allocator holds
START_S = 180  # loading PyTorch and making a CUDA context
CALIBRATION_ROUNDS = 6


@dataclass(frozen=True, kw_only=True)
class GpuWorkerSpec:
    name: str
    limit: int
    gpu: int  # the daemon's index, which is NVML's
    uuid: str  # NVML's UUID of that GPU
    size: int  # the matrices' side
    depth: int = 2  # kernels in flight: one running, the next queued


def load_torch(uuid: str) -> Any:
    """PyTorch, seeing only the GPU NVML calls ``uuid`` (as its device 0). So every thread's current device is
    that GPU, the client's own threads included: a DROP_LOCK between slices runs ``synchronize`` on a thread
    of its own, and ``torch.cuda.synchronize()`` without a device syncs the calling thread's current one."""
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid  # before CUDA starts; CUDA takes UUIDs there
    return importlib.import_module("torch")


def match_device(uuids: Sequence[str | None], nvml_uuid: str) -> int:
    """PyTorch's index of the GPU NVML calls ``nvml_uuid``. A PyTorch too old to show UUIDs is trusted only
    when it sees one device: CUDA_VISIBLE_DEVICES named that one."""
    want = nvml_uuid.lower().removeprefix("gpu-")
    for i, u in enumerate(uuids):
        if u is not None and u.lower().removeprefix("gpu-") == want:
            return i
    if len(uuids) == 1 and uuids[0] is None:
        return 0
    raise LookupError(f"PyTorch sees no CUDA device with UUID {nvml_uuid} (it sees {len(uuids)}: {uuids})")


def cuda_device(torch: Any, uuid: str) -> int:
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    device = match_device([None if getattr(pr, "uuid", None) is None else str(pr.uuid) for pr in props], uuid)
    torch.cuda.set_device(device)
    return device


def operands(torch: Any, size: int) -> tuple[Any, Any, Any]:
    a = torch.randn(size, size, device="cuda", dtype=torch.float16)
    b = torch.randn(size, size, device="cuda", dtype=torch.float16)
    return a, b, torch.empty(size, size, device="cuda", dtype=torch.float16)


def anchor(torch: Any) -> tuple[Any, Anchor]:
    """A reference event pinned on the monotonic clock: recorded on an idle GPU and synchronized between
    two clock reads; the narrowest of a few tries."""
    torch.cuda.synchronize()
    events, brackets = [], []
    for _ in range(ANCHOR_TRIES):
        ev = torch.cuda.Event(enable_timing=True)
        t0 = time.monotonic_ns()
        ev.record()
        ev.synchronize()
        brackets.append((t0, time.monotonic_ns()))
        events.append(ev)
    i, pinned = best_bracket(brackets)
    return events[i], pinned


# --- the kernel's size: pure -------------------------------------------------------------


@dataclass(frozen=True)
class Chosen:
    size: int
    ms: float


@dataclass(frozen=True)
class Try:
    size: int


@dataclass(frozen=True)
class Fail:
    reason: str


def _cube_estimate(n: int, ms: float, target_ms: float) -> int:
    """A matrix product's time grows as n^3: the side that should take ``target_ms``."""
    return max(SIZE_STEP, round(n * math.cbrt(target_ms / ms) / SIZE_STEP) * SIZE_STEP)


def calibration_step(
    timings: Mapping[int, float],
    *,
    lo_ms: float = KERNEL_MS[0],
    hi_ms: float = KERNEL_MS[1],
    min_size: int = MIN_SIZE,
    max_size: int = LADDER[-1],
) -> Chosen | Try | Fail:
    """From measured (side -> median ms): the side to use, the next side to measure, or why none fits.

    In range: the one nearest the middle (the smaller on a tie). Otherwise the next try comes from
    the cube law off the measurement nearest the middle (in log time), kept strictly between the
    largest side too fast and the smallest too slow: that assumes the time grows with the side,
    and timings that do not are refused rather than guessed around."""
    if not timings:
        return Fail("nothing measured")
    mid = (lo_ms + hi_ms) / 2
    inside = sorted((abs(ms - mid), n) for n, ms in timings.items() if lo_ms <= ms <= hi_ms)
    if inside:
        n = inside[0][1]
        return Chosen(n, timings[n])
    fast = [n for n, ms in timings.items() if ms < lo_ms]
    slow = [n for n, ms in timings.items() if ms > hi_ms]
    below = max(fast) if fast else min_size - 1
    above = min(slow) if slow else max_size + 1
    if below >= above:
        return Fail(f"timings do not grow with size: {below} takes {timings[below]} ms, {above} {timings[above]} ms")
    if not fast and above <= min_size:
        return Fail(f"all too slow: even {above}x{above} takes {timings[above]:.2f} ms (> {hi_ms:g})")
    if not slow and below >= max_size:
        return Fail(f"all too fast: {below}x{below} takes {timings[below]:.2f} ms (< {lo_ms:g}); no larger fits")
    ref = min(timings, key=lambda n: abs(math.log(max(timings[n], 1e-6) / mid)))
    guess = _cube_estimate(ref, timings[ref], mid)
    low = max(min_size, (below // SIZE_STEP + 1) * SIZE_STEP)  # strictly above the last one too fast
    high = min(max_size, (above - 1) // SIZE_STEP * SIZE_STEP)  # strictly below the first one too slow
    if low > high:
        return Fail(
            f"no side between {below} ({timings[below]:.2f} ms) and {above} ({timings[above]:.2f} ms) "
            f"in steps of {SIZE_STEP}"
        )
    return Try(min(max(guess, low), high))


def max_side(memory_total_bytes: int) -> int:
    """The largest side whose three half-precision matrices take at most 1/8 of the GPU's memory."""
    return min(LADDER[-1], math.isqrt(memory_total_bytes // 48) // SIZE_STEP * SIZE_STEP)


def monotone(timings: Mapping[int, float]) -> bool:
    ordered = [timings[n] for n in sorted(timings)]
    return all(x <= y for x, y in zip(ordered, ordered[1:]))


# --- calibration ---------------------------------------------------------------------


def median_kernel_ms(torch: Any, size: int) -> float:
    """One kernel of this side alone on the GPU: the median of TIMED_KERNELS, queued back to back
    (each start event runs once the kernel before has ended, so each pair times one kernel)."""
    a, b, c = operands(torch, size)
    for _ in range(WARMUP_KERNELS):
        torch.matmul(a, b, out=c)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(TIMED_KERNELS)]
    torch.cuda.synchronize()
    for start, end in pairs:
        start.record()
        torch.matmul(a, b, out=c)
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in pairs)
    del a, b, c
    torch.cuda.empty_cache()
    return float(ms)


def calibration_worker(uuid: str, out: Pipe) -> None:
    """Answers each list of sides with their timings (up to the first one over KERNEL_MS's top); None ends it."""
    torch = load_torch(uuid)
    cuda_device(torch, uuid)
    out.send({"torch": str(torch.__version__), "cuda": str(torch.version.cuda)})
    while (sizes := out.recv()) is not None:
        timings: dict[int, float] = {}
        for size in sizes:
            timings[size] = median_kernel_ms(torch, size)
            if timings[size] > KERNEL_MS[1]:
                break  # larger ones are slower still, and may not fit
        out.send(timings)


# --- the session processes ----------------------------------------------------------


def _settle(ref: Any, pair: tuple[Any, Any], start_ms: array[float], dur_ms: array[float]) -> None:
    start, end = pair
    end.synchronize()
    start_ms.append(ref.elapsed_time(start))
    dur_ms.append(start.elapsed_time(end))


def session_worker(path: str, spec: GpuWorkerSpec, stop: Any, out: Pipe) -> None:
    """One session: attach, anchor, say ready; on go run kernels in slices until ``stop``; give the lock back,
    say stopped; on anchor, anchor again and report; close when told."""
    torch = load_torch(spec.uuid)
    cuda_device(torch, spec.uuid)
    a, b, c = operands(torch, spec.size)
    for _ in range(WARMUP_KERNELS):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    drops: list[tuple[int, str]] = []
    client = Client(path, name=spec.name)
    try:
        session = client.session(
            spec.gpu,
            core_limit=spec.limit,
            idle_release=None,
            synchronize=torch.cuda.synchronize,
            mem_estimate=int(torch.cuda.memory_reserved()) + CONTEXT_BYTES,
            on_drop=lambda reason: drops.append((time.monotonic_ns(), str(reason))),
        )
        ref, first = anchor(torch)
        event = torch.cuda.Event
        start_ms, dur_ms, grants = array("d"), array("d"), array("q")
        in_flight: deque[tuple[Any, Any]] = deque()
        clock = time.monotonic_ns
        out.send("ready")
        out.recv()  # go
        while True:
            granted = session.grants
            with session.slice():
                t0 = clock()
                if session.grants != granted:
                    grants.append(t0)
                pair = (event(enable_timing=True), event(enable_timing=True))
                pair[0].record()
                torch.matmul(a, b, out=c)
                pair[1].record()
                in_flight.append(pair)
                if len(in_flight) > spec.depth:
                    _settle(ref, in_flight.popleft(), start_ms, dur_ms)
            if t0 >= stop.value:
                break
        session.release()  # the other sessions may finish their last kernel
        while in_flight:
            _settle(ref, in_flight.popleft(), start_ms, dur_ms)
        out.send("stopped")
        out.recv()  # anchor: every session has stopped, the GPU is idle
        last_ref, last = anchor(torch)
        out.send(
            {
                "first": first,
                "last": last,
                "last_ms": ref.elapsed_time(last_ref),
                "start_ms": start_ms,
                "dur_ms": dur_ms,
                "grants": grants,
                "drops": list(drops),
                "client_grants": session.grants,
                "client_drops": session.drops,
                "memory_reserved": int(torch.cuda.memory_reserved()),
            }
        )
        out.recv()  # close: the parent has read the daemon's figures
    finally:
        client.close()


def start_worker(ctx: Any, target: Any, args: tuple[Any, ...], name: str) -> tuple[Any, Pipe]:
    ours, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=target, args=(*args, theirs), name=name, daemon=True)
    proc.start()
    theirs.close()  # so a dead worker shows up as EOF on ours
    return proc, ours


# --- the parent's side ---------------------------------------------------------------------


def calibrate(ctx: Any, nvml: dict[str, Any]) -> dict[str, Any]:
    """The kernel: sides timed alone in a process of their own, the side chosen by ``calibration_step``."""
    max_size = max_side(nvml["memory_total_bytes"])
    proc, pipe = start_worker(ctx, calibration_worker, (nvml["uuid"],), "calibration")
    try:
        versions = receive(pipe, proc, START_S)
        pipe.send([n for n in LADDER if n <= max_size])
        timings: dict[int, float] = receive(pipe, proc, 300)
        tries = 0
        while True:
            print(
                f"calibration: {', '.join(f'{n}: {ms:.3f} ms' for n, ms in sorted(timings.items()))}",
                file=sys.stderr,
                flush=True,
            )
            match calibration_step(timings, max_size=max_size):
                case Chosen(size=size, ms=ms):
                    return {
                        "size": size,
                        "ms": ms,
                        "what": f"fp16 matmul {size}x{size}",
                        "timings_ms": timings,
                        "monotone": monotone(timings),
                        **versions,
                    }
                case Try(size=size) if tries < CALIBRATION_ROUNDS:
                    tries += 1
                    pipe.send([size])
                    timings |= receive(pipe, proc, 300)
                case Try():
                    raise MeasurementError(f"no 2-5 ms kernel found in {CALIBRATION_ROUNDS} tries: {timings}")
                case Fail(reason=reason):
                    raise MeasurementError(f"no matrix side gives a 2-5 ms kernel on this GPU: {reason}")
    finally:
        try:
            pipe.send(None)  # done: the process frees its context
        except OSError:
            pass  # it is gone already
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join()


def run_workers(
    ctx: Any,
    path: str,
    specs: list[GpuWorkerSpec],
    stop: Any,
    go: Callable[[], None],
    until: Callable[[], None],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The parent's side: start the sessions one at a time (each anchors on an idle GPU), call ``go()`` once all
    are ready and ``until()`` while they run; wait until all have stopped, have each anchor in turn, and return
    their reports and the daemon's view of each session (read before they close)."""
    workers: list[tuple[Any, Pipe]] = []
    try:
        for spec in specs:
            workers.append(start_worker(ctx, session_worker, (path, spec, stop), spec.name))
            if receive(workers[-1][1], workers[-1][0], START_S) != "ready":
                raise RuntimeError(f"worker {spec.name} did not say ready")
        go()
        for _, pipe in workers:
            pipe.send("go")
        until()
        for proc, pipe in workers:
            if receive(pipe, proc, max(0, (stop.value - time.monotonic_ns()) / 1e9) + 60) != "stopped":
                raise RuntimeError(f"worker {proc.name} did not say stopped")
        reports = []
        for proc, pipe in workers:
            pipe.send("anchor")
            reports.append(receive(pipe, proc, 60))
        with Client(path, name="bench-view") as obs:
            view = {c.name: c.sessions[0] for c in obs.clients().clients if c.sessions}
        for _, pipe in workers:
            pipe.send("close")
        return reports, view
    finally:
        for proc, _ in workers:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
