"""Deterministic simulation of the whole daemon: one seed, one world, every invariant after every event.

A real ``Daemon`` (schedulers, arbiter, allocator, its SQLite store in a temporary
directory) is driven in process: no sockets, no trio run, a fake clock in integer
microseconds that only the simulation moves. A ``random.Random(seed)`` draws the
configuration (GPUs, mode, TQ, drop_timeout, park_timeout, compute window, lease
policies, tenants, small caps, restart grace, how often the store fails; preemption on or
off, its strategy, a grace, minimum runtime and cooldowns of milliseconds) and then every
step: clients connect (some before HELLO), attach sessions (some parkable, as ``gpuctl
run`` does), request and release the lock, answer PARK (or not), report memory, change
limits, take leases (and abandon them), allocate (every priority class from spot 0 to
production 100, each recovery, elastic ranges, protected), free and wait (requests that may
take others' allocations back), yield, run admin operations (mode, TQ, scheduler on/off,
policies, reset, drain and undrain, protect), query, crash; owner processes are named,
signalled, exit and have their pids reused; the daemon itself crashes, often while a
preemption runs, or restarts gracefully (GOODBYE); the store's ``write`` fails now and then.

The world is one driver and one part per capability, each with its model, its steps, the
answers it judges and its invariants (each module's docstring states them):

- ``world.py``: the driver: the seed's generator, the clock and the trace, the daemon, the
  agenda, the timers, the steps, ``check`` calling each part's invariants after every event;
- ``connections.py``: clients and their connections, every request and reply, queries;
- ``locks.py``: sessions and the GPU lock, the admins' mode, TQ and switch, memory, billing;
- ``lock_waits.py``: the order of grants and the bound on a lock wait;
- ``parking.py``: PARK and PARKED;
- ``leases.py``: ACQUIRE and RELEASE;
- ``allocations.py``: the ledger, waits, tenants, devices, fractional allocations' ceilings;
- ``preemption.py``: taking allocations back (notices, drains, protection, elastic changes)
  and what changed for an allocation nobody holds;
- ``owners.py`` (with ``procs.py``, the process table): owner processes, gpud's signals, the
  reaper;
- ``restarts.py``: crashes, restarts, store faults, what the store keeps;
- ``model.py``: what they share (a client, its requests, a GPU, the configuration, ``Part``).

Each rule is one ``check_*`` method (or one ``expect`` in the ``answer_*`` handler of
a request), so an experiment can switch one off and see another fire.

A failure prints the seed, the step, the last events, the GPUs' state and the one
command that replays it exactly::

    .venv/bin/python -m tests.sim.daemon_sim --seed N [--steps S] [--verbose]
    .venv/bin/python -m tests.sim.daemon_sim --seeds N [--stats]   # seeds 0..N-1
    .venv/bin/python -m tests.sim.daemon_sim --seeds N --strict    # the known daemon bugs fail too
    .venv/bin/python -m tests.sim.daemon_sim --seeds N --churn     # owners exit, pids are reused, gpud
                                                                   # crashes, all far more often (CHURN)

Determinism: everything random comes from the seed; the ledger's generator and the
arbiter's lease id prefix (the daemon's two random sources) are set from it; the
daemon sees 4 CPU cores whatever the machine has; the model never iterates a set of
strings, so hash randomisation changes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

from .model import DEFAULT_STEPS, START_US, SimFailure, scratch_root, trace_line
from .world import CHURN, KNOWN_BUGS, World

__all__ = ["CHURN", "DEFAULT_STEPS", "KNOWN_BUGS", "Outcome", "SimFailure", "World", "main", "run_seed", "scratch_root"]


@dataclass
class Outcome:
    seed: int
    ok: bool
    report: str
    events: int
    seconds: float
    stats: Counter[str] = field(default_factory=Counter)
    victims: list[tuple[int, int, int, int]] = field(default_factory=list)  # see Preemption.victims


def thrash(victims: list[tuple[int, int, int, int]]) -> str:
    """The thrash figures: PREEMPT notices per victim (an allocation told to leave at least once), per
    victim per simulated hour of its life, withdrawn; and the most one victim got against its bound
    (the simulated time / preemption_cooldown + 2 that fails a seed)."""
    if not victims:
        return "thrash: no allocation was told to leave"
    notices = sum(v[0] for v in victims)
    withdrawn = sum(v[1] for v in victims)
    hours = sum(v[2] for v in victims) / 3.6e9
    most = max(victims, key=lambda v: (v[0] / v[3], v[0]))
    return (
        f"thrash: {len(victims)} victims got {notices} PREEMPT notices ({notices / len(victims):.2f} each, at most "
        f"{max(v[0] for v in victims)}), {withdrawn} withdrawn ({withdrawn / notices:.0%}); "
        f"{notices / hours:.0f} per victim per simulated hour of its life; the closest to its bound: "
        f"{most[0]} of {most[3]}"
    )


def command(seed: int, steps: int, *, churn: bool = False) -> str:
    extra = ("" if steps == DEFAULT_STEPS else f" --steps {steps}") + (" --churn" if churn else "")
    return f".venv/bin/python -m tests.sim.daemon_sim --seed {seed}{extra}"


def run_seed(
    seed: int, steps: int = DEFAULT_STEPS, *, verbose: bool = False, strict: bool = False, churn: bool = False
) -> Outcome:
    began = time.perf_counter()
    world = World(seed, steps, verbose=verbose, strict=strict, churn=churn)
    victims = world.preemption.victims
    try:
        world.run()
    except Exception as exc:  # a broken invariant, or an exception out of the daemon
        what = str(exc) if isinstance(exc, SimFailure) else "".join(traceback.format_exception(exc))
        report = "\n".join(
            [
                f"daemon_sim: seed {seed} failed at step {world.step_no} "
                f"(t={(world.now - START_US) / 1000:.3f} ms, event {world.events}): {what}",
                f"last {len(world.trace)} events:",
                *("  " + trace_line(entry) for entry in world.trace),
                "the GPUs then:",
                *("  " + line for line in world.describe_gpus()),
                f"reproduce: {command(seed, steps, churn=churn)}",
            ]
        )
        return Outcome(seed, False, report, world.events, time.perf_counter() - began, world.stats, victims)
    return Outcome(seed, True, "", world.events, time.perf_counter() - began, world.stats, victims)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.daemon_sim", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--seed", type=int, help="run this one seed")
    which.add_argument("--seeds", type=int, default=100, help="run seeds 0..N-1 (default 100)")
    parser.add_argument("--first", type=int, default=0, help="with --seeds: start at this seed")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps per seed (default {DEFAULT_STEPS})")
    parser.add_argument("--verbose", action="store_true", help="print every event")
    parser.add_argument("--stats", action="store_true", help="print what happened, summed over the seeds")
    parser.add_argument("--strict", action="store_true", help="fail on the known daemon bugs too (KNOWN_BUGS)")
    parser.add_argument("--churn", action="store_true", help="owners exit, pids are reused, gpud crashes: often")
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else list(range(args.first, args.first + args.seeds))
    began = time.perf_counter()
    failed: list[Outcome] = []
    events = 0
    stats: Counter[str] = Counter()
    victims: list[tuple[int, int, int, int]] = []
    for seed in seeds:
        out = run_seed(seed, args.steps, verbose=args.verbose, strict=args.strict, churn=args.churn)
        events += out.events
        stats += out.stats
        victims += out.victims
        if not out.ok:
            failed.append(out)
            if len(failed) <= 3:
                print(out.report, file=sys.stderr)
                print(file=sys.stderr)
    took = time.perf_counter() - began
    if args.stats:
        for name, count in sorted(stats.items()):
            print(f"{count:>9}  {name}")
    print(thrash(victims))
    print(
        f"{len(seeds)} seed(s) x {args.steps} steps: {len(seeds) - len(failed)} passed, {len(failed)} failed; "
        f"{events} events in {took:.1f} s"
    )
    if failed:
        print("failing seeds: " + " ".join(str(o.seed) for o in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
