"""Ray's fractional GPUs enforced by gpud: two tasks at 0.25 and 0.75 of one GPU and an actor at 0.5.

Runs on a laptop: it starts gpud on two simulated GPUs (serial mode, 0.5 s
compute windows) on a private socket, and a local Ray instance that sees two
logical GPUs, with GPUD_SOCKET in its environment so every worker finds this
node's gpud. Ray places the 0.25 and 0.75 tasks on one GPU and the 0.5 actor on
the other. Their "kernels" are 2-5 ms sleeps that always have work; each one
records when its kernels ran, and the example prints each one's measured share
of its GPU's time over the measured windows (after a warm-up), beside the
fraction Ray gave it and the share gpud counted it as holding the lock (its
sessions' hold time, read from gpud at the start and the end of the measured
windows): the difference between the two is lock time that ran no kernel
(the task's loop, the slice's entry and exit, Ray's dispatch between calls)::

    python examples/ray_fractions.py [--windows 20] [--window 0.5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import ray

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client.ray import gpud_actor, gpud_slice, gpud_task

KERNEL_S = (0.002, 0.005)
WARMUP_WINDOWS = 3
ACTOR_KERNELS = 10  # per call: a call is one slice, and the time between two calls is held too


def kernel(rng: random.Random, log: list[tuple[float, float]]) -> None:
    """One "kernel": the GPU is busy for the time it asks for, from its start. Not timed by a second
    clock read: gpud pauses an actor's call at any bytecode, the one after the sleep too, and the
    pause would be counted as kernel time (a sleep's overshoot is counted as idle instead)."""
    seconds = rng.uniform(*KERNEL_S)
    t0 = time.monotonic()
    time.sleep(seconds)
    log.append((t0, t0 + seconds))


@ray.remote(num_gpus=0.25)
@gpud_task(slices="explicit")
def fractional_task(until: float, seed: int) -> tuple[int, list[tuple[float, float]]]:
    """Kernels back to back until ``until``, each one a slice of gpud's lock."""
    rng, log = random.Random(seed), []
    while time.monotonic() < until:
        with gpud_slice():
            kernel(rng, log)
    return os.getpid(), log


@ray.remote(num_gpus=0.5)
@gpud_actor
class FractionalActor:
    """Each call of ``step`` is one slice; the actor's session lives as long as the actor."""

    def __init__(self, seed: int) -> None:
        self.rng, self.log = random.Random(seed), []

    def step(self, kernels: int) -> None:
        for _ in range(kernels):
            kernel(self.rng, self.log)

    def kernels(self) -> tuple[int, list[tuple[float, float]]]:
        return os.getpid(), self.log


def share(log: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Percent of [t0, t1] that the kernels in ``log`` covered."""
    busy = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in log)
    return 100.0 * busy / (t1 - t0)


def hold_ms(gpud: Client) -> dict[int, float]:
    """Each client process's lock hold time so far, by pid (a Ray worker's client is named for it)."""
    return {c.pid: sum(s.hold_ms for s in c.sessions) for c in gpud.clients().clients}


def run(windows: int, window_s: float) -> dict[str, Any]:
    daemon = DaemonProcess("--simulate", "2", "--mode", "serial", "--window", str(window_s), "--tq", "0.5").start()
    os.environ["GPUD_SOCKET"] = daemon.socket  # the node's Ray, and so its workers, inherit it
    try:
        ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
        try:
            start = time.monotonic() + 1.0  # the workers start meanwhile
            t0 = start + WARMUP_WINDOWS * window_s
            t1 = t0 + windows * window_s
            # The tasks run one window past the measured ones, so gpud still holds their sessions when
            # their hold time is read at t1.
            quarter = fractional_task.options(num_gpus=0.25).remote(t1 + window_s, 1)
            three_quarters = fractional_task.options(num_gpus=0.75).remote(t1 + window_s, 2)
            actor = FractionalActor.remote(3)  # type: ignore[attr-defined]
            in_flight = [actor.step.remote(ACTOR_KERNELS) for _ in range(3)]
            # (when read, each process's hold so far): the lock's share is over the span between the
            # two reads, not t0..t1, which a loaded machine reads late
            held: list[tuple[float, dict[int, float]]] = []
            with Client(daemon.socket, name="example") as gpud:
                while time.monotonic() < t1:  # keep the actor busy: always a call queued
                    if not held and time.monotonic() >= t0:
                        held.append((time.monotonic(), hold_ms(gpud)))
                    ray.get(in_flight.pop(0))
                    in_flight.append(actor.step.remote(ACTOR_KERNELS))
                held.append((time.monotonic(), hold_ms(gpud)))
            ray.get(in_flight)
            logs = {"task-0.25": ray.get(quarter), "task-0.75": ray.get(three_quarters),
                    "actor-0.5": ray.get(actor.kernels.remote())}
        finally:
            ray.shutdown()
    finally:
        daemon.stop()
        daemon.cleanup()
    targets = {"task-0.25": 25.0, "task-0.75": 75.0, "actor-0.5": 50.0}
    (read0, first), (read1, last) = held[0], held[-1]
    read_ms = (read1 - read0) * 1000
    rows = []
    for name, (pid, log) in logs.items():
        achieved = share(log, t0, t1)
        lock = 100.0 * (last.get(pid, 0.0) - first.get(pid, 0.0)) / read_ms
        rows.append({"name": name, "target": targets[name], "achieved": round(achieved, 2),
                     "error_pp": round(achieved - targets[name], 2), "held_lock": round(lock, 2)})
    return {"windows": windows, "window_s": window_s, "scenarios": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=20, help="measured compute windows (default 20)")
    ap.add_argument("--window", type=float, default=0.5, help="gpud's compute window in seconds (default 0.5)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    result = run(args.windows, args.window)
    print(f"{'who':<12} {'Ray gave':>9} {'kernels':>9} {'error':>9} {'held lock':>10}")
    for row in result["scenarios"]:
        print(f"{row['name']:<12} {row['target']:>8.1f}% {row['achieved']:>8.2f}% {row['error_pp']:>+7.2f}pp"
              f" {row['held_lock']:>9.2f}%")
    print(f"over {args.windows} windows of {args.window:g} s after {WARMUP_WINDOWS} warm-up windows; "
          "kernels 2-5 ms that always have work")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
