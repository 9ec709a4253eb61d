"""The whole daemon, simulated on fake time: many seeds of ``tests/sim/daemon_sim.py``.

Each seed builds a real daemon with its SQLite store, drives it in process with
simulated clients, client and daemon crashes and store failures, allocations taken back
(PREEMPT and its answers, drains, protection, crashes in the middle of a preemption),
owner processes in a faked process table (named, refused, signalled, exiting, their pids
reused, reaped), and checks every invariant after every event (see the module's
docstring). A failing seed is reported with its last events and the one command that
replays it exactly:

    .venv/bin/python -m tests.sim.daemon_sim --seed N

The default run covers seeds 0..63 (400 steps each); ``GPUD_SIM_SEEDS=N`` runs
seeds 0..N-1 instead, split into up to eight tests (``GPUD_SIM_SEEDS=320``: forty seeds
each). More seeds outside pytest:
``.venv/bin/python -m tests.sim.daemon_sim --seeds 2000``.
The per-scheduler simulation (tests/core/test_scheduler_sim.py) stays; this one
covers the shell around the schedulers too. A test of eight seeds or more also fails
when its seeds never exercised parking (asked, parked, refused, timed out, a grant
that waited for it), taking back (a notice, one carried out at its grace's end, a
drain) or owner processes (one refused, an owner told by SIGTERM, a dead owner's
allocation reaped): a check that never runs proves nothing. ``--stats`` prints the
thrash figures.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

try:
    from tests.sim.daemon_sim import DEFAULT_STEPS, run_seed
except ImportError:  # run by the pytest script: tests/ is on the path, the repository root is not
    from sim.daemon_sim import DEFAULT_STEPS, run_seed  # type: ignore[no-redef]

SEEDS = int(os.environ.get("GPUD_SIM_SEEDS", "64"))  # x DEFAULT_STEPS (400) steps: about 15 s on a 2-core machine
TESTS = 8
CHUNK = max(1, -(-SEEDS // TESTS))  # seeds per test, so a failure names its range and the rest still run
# What eight seeds always do (the default run: each test's seeds do each parking one at least 9 times,
# and give at least 10 notices, 4 carried out at the grace's end, 2 drains; refuse 20 owner pids, SIGTERM
# 2 owners, reap 7 dead owners' allocations).
EXERCISED_FROM = 8
EXERCISED = (
    "parks asked",
    "parks answered ok",
    "parks answered not ok (refused)",
    "parks timed out",
    "grants that waited for a park",
    "preempt notices",
    "preemptions carried out (grace over)",
    "GPUs drained",
    "owner pids refused",
    "owners signalled (SIGTERM)",
    "allocations reaped (owner exited)",
)


@pytest.mark.parametrize(
    "first", range(0, SEEDS, CHUNK), ids=lambda first: f"seeds{first}-{min(first + CHUNK, SEEDS) - 1}"
)
def test_the_daemon_keeps_every_invariant(first: int) -> None:
    outs = [run_seed(seed, DEFAULT_STEPS) for seed in range(first, min(first + CHUNK, SEEDS))]
    failed = [out for out in outs if not out.ok]
    if failed:
        others = ", ".join(str(out.seed) for out in failed[1:])
        pytest.fail(
            f"{len(failed)} seed(s) failed"
            + (f" (also {others})" if others else "")
            + "; the first:\n"
            + failed[0].report,
            pytrace=False,
        )
    stats = sum((out.stats for out in outs), Counter[str]())
    if len(outs) >= EXERCISED_FROM:
        missing = [name for name in EXERCISED if not stats[name]]
        assert not missing, f"seeds {first}-{first + len(outs) - 1} never did: {missing}"
