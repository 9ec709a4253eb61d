"""What one allocation-ledger operation costs among 10 allocations and among 20 000.

What is measured: the pure ledger (``gpud.core.ledger``), no daemon, no store. Two GPUs are filled
with N fractional allocations of 2/N of a GPU each (N = 20 000: the smallest fraction, 1/10000, so a
2-GPU node holds exactly that many), of priority 10, made at t = 0, each reachable. Then, at
t = 400 s (past the minimum runtime), each operation below runs many times, the ledger put back as
it was between runs (untimed), and its median time is reported in microseconds, with the ratio of
the two sizes. The target: every operation costs about the same at 20 000 as at 10, and well under
1 ms.

Operations ("shell" ones are what the daemon does per change: a checkpoint, the change, the
records to store; with a ledger that has no ``changed_records`` that is the full ``records(before)``
walk the daemon did before, so the script measures an older ledger too):
- allocate / release one fraction, bare and as the shell does it;
- checkpoint; rollback of a release; changed_records after a release;
- advance with nothing due; advance when a wait expires; advance when a notice's grace ends (the
  allocation is taken back and its waiter served);
- next_deadline while a waiter waits that no allocation can be taken back for;
- a request that does not fit and takes back one lower-priority allocation (allocate with a wait,
  then the advance that chooses its victim);
- a production request for a whole GPU, which takes back every allocation on one (N/2 of them): the
  advance that chooses them and tells the first batch (with an older ledger, that tells them all),
  and the next advance, which tells the next batch (where notices go in batches);
- get, notice_of, not_preemptible (``Ledger.shield``: why it may not be taken back now), waiting, allocations_page (4 from the middle), allocation_count;
- gc.collect(), a full collection, with the ledger and its N allocations alive (the process holds
  little else), and how many objects the garbage collector tracks per allocation (the count of
  ``gc.get_objects()`` after making them, less before, over N, each after a full collection).

It never bends a figure: every run is timed, the median is reported. Times are one process's wall
clock (``perf_counter_ns``) on whatever machine runs it; the ratios are what carries over.

    .venv/bin/python bench/ledger_ops.py [--json] [--sizes 10,20000] [--runs R]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpud.core.ledger import UNIT, GpuSpec, Ledger, Request

from harness import Run, progress  # bench/, on the path when run as a script

S = 1_000_000
NOW = 400 * S  # past the default minimum runtime (300 s) of allocations made at 0


@dataclass
class Node:
    led: Ledger
    share: int
    stored: dict[str, Any]  # the records last stored, for a ledger without ``changed_records``
    tracked: float = 0.0  # objects the garbage collector tracks per allocation

    def fraction(self, task: str, **kw: Any) -> Request:
        return Request(task, self.share, priority=10, owner_pid=100, **kw)


def build(n: int) -> Node:
    led = Ledger([GpuSpec(i, f"GPU-{i}") for i in range(2)], list(range(16)))
    share = 2 * UNIT // n
    gc.collect()
    gc.freeze()  # what exists now is out of the count (and of the collections): what is left is what the build made
    before = len(gc.get_objects())
    for i in range(n):
        t = f"t{i:06d}"
        led.allocate(Request(t, share, priority=10, owner_pid=100), 0)
        led.reachable.add(t)
    node = Node(led, share, led.records())
    if hasattr(led, "mark_stored"):
        led.mark_stored()
    gc.collect()
    node.tracked = (len(gc.get_objects()) - before) / n
    gc.unfreeze()
    return node


def store(node: Node) -> None:
    """What the shell does after a change: find what to store (and store nothing)."""
    led = node.led
    if hasattr(led, "changed_records"):
        led.changed_records()
        led.mark_stored()
    else:
        records = led.records(node.stored)
        [r for t, r in records.items() if node.stored.get(t) is not r]
        [t for t in node.stored if t not in records]
        node.stored = records


def timed(runs: int, setup: Callable[[], Any], op: Callable[[Any], Any], undo: Callable[[Any], Any]) -> float:
    """The median µs of ``op``, each run between an untimed ``setup`` and ``undo``."""
    times = []
    for _ in range(runs):
        arg = setup()
        t0 = time.perf_counter_ns()
        op(arg)
        times.append(time.perf_counter_ns() - t0)
        undo(arg)
    return statistics.median(times) / 1000


def measure(n: int, runs: int) -> dict[str, float]:
    node = build(n)
    led = node.led
    victim = "t000003"
    none: Callable[[], Any] = lambda: None  # noqa: E731
    skip: Callable[[Any], Any] = lambda _: None  # noqa: E731
    out: dict[str, float] = {}

    def again(_: Any) -> None:
        led.allocate(node.fraction(victim), 0)

    def refree(_: Any) -> None:
        led.release(victim, NOW)

    out["release"] = timed(runs, none, lambda _: led.release(victim, NOW), again)
    led.release(victim, NOW)
    out["allocate"] = timed(runs, none, lambda _: led.allocate(node.fraction(victim), 0), refree)
    led.allocate(node.fraction(victim), 0)

    def shell_release(_: Any) -> None:
        led.checkpoint()
        led.release(victim, NOW)
        store(node)

    def shell_allocate(_: Any) -> None:
        led.checkpoint()
        led.allocate(node.fraction(victim), 0)
        store(node)

    def again_stored(_: Any) -> None:
        again(_)
        store(node)

    def refree_stored(_: Any) -> None:
        refree(_)
        store(node)

    out["shell release"] = timed(runs, none, shell_release, again_stored)
    led.release(victim, NOW)
    store(node)
    out["shell allocate"] = timed(runs, none, shell_allocate, refree_stored)
    led.allocate(node.fraction(victim), 0)
    store(node)
    out["checkpoint"] = timed(runs, none, lambda _: led.checkpoint(), skip)

    def released() -> Any:
        cp = led.checkpoint()
        led.release(victim, NOW)
        return cp

    out["rollback a release"] = timed(runs, released, led.rollback, skip)
    if hasattr(led, "changed_records"):
        out["changed_records after a release"] = timed(runs, released, lambda _: led.changed_records(), led.rollback)
    out["advance, nothing due"] = timed(runs, none, lambda _: led.advance(NOW), skip)

    def low_waiter() -> Any:  # priority 0: there is nothing it may take back
        cp = led.checkpoint()
        led.allocate(Request("w", node.share, priority=0, wait_us=S), NOW)
        return cp

    out["advance, a wait expires"] = timed(runs, low_waiter, lambda _: led.advance(NOW + 2 * S), led.rollback)
    out["next_deadline, a waiter waits"] = timed(runs, low_waiter, lambda _: led.next_deadline(), led.rollback)

    def preempts(cp: Any) -> None:
        led.allocate(Request("w", node.share, priority=50, wait_us=10 * S), NOW)
        effects = led.advance(NOW)
        assert len(effects) == 1, effects  # one victim among them all

    out["a request that takes one back"] = timed(runs, led.checkpoint, preempts, led.rollback)

    def noticed() -> Any:
        cp = led.checkpoint()
        preempts(cp)
        return cp

    grace = led.preemption.grace_us
    out["advance, a notice's grace ends"] = timed(runs, noticed, lambda _: led.advance(NOW + grace), led.rollback)

    def production() -> Any:  # a whole GPU asked for: every allocation on one of the two is taken back
        cp = led.checkpoint()
        assert led.allocate(Request("p", UNIT, priority=100, wait_us=100 * S), NOW) is None
        return cp

    def first_batch() -> Any:
        cp = production()
        led.advance(NOW)
        return cp

    few = max(2, runs // 10)  # (each run tells up to 10 000 with an older ledger)
    out["a whole GPU taken back: choose, tell a batch"] = timed(
        few, production, lambda _: led.advance(NOW), led.rollback
    )
    out["a whole GPU taken back: the next batch"] = timed(
        few, first_batch, lambda _: led.advance(NOW + 1), led.rollback
    )
    out["next_deadline, nothing waits"] = timed(runs, none, lambda _: led.next_deadline(), skip)
    alloc = led.get(victim)
    assert alloc is not None
    out["get"] = timed(runs, none, lambda _: led.get(victim), skip)
    out["notice_of"] = timed(runs, none, lambda _: led.notice_of(victim), skip)
    if hasattr(led, "shield"):  # (the key is kept: an older ledger answered not_preemptible)
        out["not_preemptible"] = timed(runs, none, lambda _: led.shield(alloc, 0), skip)
    else:
        older: Any = led
        out["not_preemptible"] = timed(runs, none, lambda _: older.not_preemptible(alloc), skip)
    out["waiting"] = timed(runs, none, lambda _: led.waiting(), skip)
    if hasattr(led, "allocations_page"):
        middle = f"t{n // 2:06d}"  # 4 after it at either size: the same output, read from the middle
        out["allocations_page(4)"] = timed(runs, none, lambda _: led.allocations_page(middle, 4), skip)
        out["allocation_count"] = timed(runs, none, lambda _: led.allocation_count(), skip)
    out["gc.collect(), full"] = timed(max(3, runs // 10), none, lambda _: gc.collect(), skip)
    out["gc-tracked objects per allocation (a count)"] = node.tracked
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object, last")
    ap.add_argument("--sizes", default="10,20000", help="the two numbers of allocations, small first")
    ap.add_argument("--runs", type=int, default=101, help="runs per operation (the median is reported)")
    args = ap.parse_args(argv)
    small, large = (int(x) for x in args.sizes.split(","))
    run = Run()
    figures = {}
    for n in (small, large):
        progress(f"{n} allocations ...")
        figures[n] = measure(n, args.runs)
    ops = {
        op: {f"us_at_{small}": round(figures[small][op], 2), f"us_at_{large}": round(us, 2)}
        | {"ratio": round(us / max(figures[small][op], 1e-3), 1)}
        for op, us in figures[large].items()
    }
    result = {"sizes": [small, large], "runs": args.runs, "ops": ops, "machine": run.machine()}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'operation':<46} {'µs at ' + str(small):>12} {'µs at ' + str(large):>14} {'ratio':>7}")
    for op, row in ops.items():
        print(f"{op:<46} {row[f'us_at_{small}']:>12.1f} {row[f'us_at_{large}']:>14.1f} {row['ratio']:>7.1f}")
    print(f"(median of {args.runs} runs each; {result['machine']})", file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
