"""The session processes of the quota benchmark, and the arithmetic of windows and shares.

A worker is one OS process with one gpud session: it attaches, says "ready",
then loops ``with session.slice(): one kernel`` until the shared stop time, so
it always has work, stamping with ``time.monotonic_ns()`` every kernel's start
and end, every grant (the first kernel after a LOCK_OK) and every DROP_LOCK
(the on_drop callback, with its reason). It sends those stamps to the parent
and closes its client when the parent says so (after the parent has read the
daemon's own figures). It never decides anything about what it measured:
that is the parent's job (``quota_accuracy.py``).
"""

from __future__ import annotations

import itertools
import os
import random
import time
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

from gpud_client import Client

from simgpu import Kernels


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    name: str
    limit: int
    seed: int
    kernel: str  # sleep | spin | device
    lo_ns: int
    hi_ns: int


KERNELS_DRAWN = 100_000  # about 6 minutes of work at 3.5 ms each; a longer run goes round them again


class MeasurementError(Exception):
    """The timeline contradicts the mode: the figures would be meaningless."""


# --- the session processes -----------------------------------------------------


def _kernel_runner(kind: str, device: Pipe | None) -> Any:
    if kind == "device":
        assert device is not None
        return Kernels(device).run
    if kind == "spin":

        def spin(work_ns: int) -> None:
            end = time.monotonic_ns() + work_ns
            while time.monotonic_ns() < end:
                os.sched_yield()  # 2-CPU machines: let the daemon's timer run

        return spin
    return lambda work_ns: time.sleep(work_ns / 1e9)


def session_worker(path: str, spec: WorkerSpec, stop: Any, device: Pipe | None, out: Pipe) -> None:
    """One session: attach, say ready, run kernels in slices until ``stop``, report, close when told."""
    drops: list[tuple[int, str]] = []
    client = Client(path, name=spec.name)
    try:
        session = client.session(
            0,
            core_limit=spec.limit,
            mem_estimate="1GiB",
            idle_release=None,
            framework_hooks=False,
            on_drop=lambda reason: drops.append((time.monotonic_ns(), str(reason))),
        )
        run = _kernel_runner(spec.kernel, device)
        rng = random.Random(spec.seed)
        # Drawn before the loop: between two kernels the lock is held and billed, so the loop does
        # no more than stamp, store and look at the stop time (the client's slice exit and entry
        # are what is measured there).
        works = array("q", (rng.randint(spec.lo_ns, spec.hi_ns) for _ in range(KERNELS_DRAWN)))
        starts, ends, grants = array("q"), array("q"), array("q")
        clock = time.monotonic_ns
        out.send("ready")
        for work in itertools.cycle(works):
            granted = session.grants
            with session.slice():
                t0 = clock()
                if session.grants != granted:
                    grants.append(t0)
                run(work)
                t1 = clock()
            starts.append(t0)
            ends.append(t1)
            if t1 >= stop.value:
                break
        out.send(
            {
                "starts": starts,
                "ends": ends,
                "grants": grants,
                "drops": list(drops),
                "client_grants": session.grants,
                "client_drops": session.drops,
            }
        )
        out.recv()  # the parent has read the daemon's figures
    finally:
        client.close()


def start_worker(ctx: Any, path: str, spec: WorkerSpec, stop: Any, device: Pipe | None) -> tuple[Any, Pipe]:
    ours, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=session_worker, args=(path, spec, stop, device, theirs), name=spec.name, daemon=True)
    proc.start()
    theirs.close()  # so a dead worker shows up as EOF on ours
    return proc, ours


def receive(pipe: Pipe, proc: Any, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise RuntimeError(f"worker {proc.name} said nothing for {timeout:.0f} s")
    try:
        return pipe.recv()
    except EOFError:
        raise RuntimeError(f"worker {proc.name} died (its traceback is above)") from None


# --- the host ---------------------------------------------------------------------


def cold_code_ns(rounds: int = 200, busy_ns: int = 3_000_000) -> int:
    """How long this host takes for two list operations right after 3 ms of other work (median ns).

    Warm, they take about 250 ns. On a virtual machine whose neighbours evict this CPU's caches
    meanwhile they take longer, growing with the length of the work before: 4-6 us for 3 ms on
    the benchmark's 2-core VM during a noisy spell. The lines a session runs between two kernels
    pay the same, and that is what the "gaps" column counts: the figure is printed beside the
    results so that a noisy host can be told from a regression."""
    clock = time.monotonic_ns
    samples = []
    for _ in range(rounds):
        end = clock() + busy_ns
        while clock() < end:
            pass
        t1 = clock()
        x = [t1]
        x.append(t1)
        samples.append(clock() - t1)
    return sorted(samples)[len(samples) // 2]


# --- time, windows and shares ------------------------------------------------------


def window_origin_ns(obs: Client) -> int:
    """The daemon's first window start (its scheduler's birth), from STATUS's uptime (ms resolution)."""
    best: tuple[int, int] | None = None
    for _ in range(5):
        t0 = time.monotonic_ns()
        uptime_s = obs.status().uptime_s
        t1 = time.monotonic_ns()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, (t0 + t1) // 2 - round(uptime_s * 1e9))
    assert best is not None
    return best[1]


def next_boundary(origin: int, window: int, t: int) -> int:
    return origin + -(-(t - origin) // window) * window


def sleep_until(t_ns: int) -> None:
    left = t_ns - time.monotonic_ns()
    if left > 0:
        time.sleep(left / 1e9)


def clipped_ns(starts: array[int], ends: array[int], a: int, b: int) -> int:
    return sum(max(0, min(e, b) - max(s, a)) for s, e in zip(starts, ends) if e > a and s < b)


def gaps_in_holds_ns(r: dict[str, Any], a: int, b: int) -> int:
    """Time between two kernels of one hold (no grant in between): the lock is held, no kernel runs."""
    grants = set(r["grants"])
    starts, ends = r["starts"], r["ends"]
    return sum(
        max(0, min(starts[i + 1], b) - max(ends[i], a))
        for i in range(len(starts) - 1)
        if starts[i + 1] not in grants and starts[i + 1] > a and ends[i] < b
    )


def check_serial(reports: list[dict[str, Any]]) -> None:
    """On a serial GPU the kernels of all sessions never overlap."""
    spans = sorted((s, e, i) for i, r in enumerate(reports) for s, e in zip(r["starts"], r["ends"]))
    for (_, e0, i0), (s1, _, i1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise MeasurementError(f"session {i1} ran a kernel at {s1} ns while session {i0} ran until {e0} ns")
