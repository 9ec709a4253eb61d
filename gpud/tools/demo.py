"""`python -m gpud.tools.demo` (`make demo`): four processes take turns on one GPU.

What it shows: a gpud on simulated GPUs with a short time quantum (2 s) and
drop timeout (1 s), and four client processes with different work patterns
contending for GPU 0. A trainer and a batch-inference loop always have work, so
each grant ends with a DROP_LOCK after the quantum and they yield at their next
slice boundary. A notebook works in bursts; its lock is given back early by
``idle_release`` while it thinks. A stubborn client sits in 4 s slices and
ignores DROP_LOCK, so the daemon revokes it after the drop timeout and passes
the lock on. While it runs, one line per half second says who holds GPU 0 and
who waits; at the end a table gives each client's share of GPU time, lock
waits and drops, as the daemon counted them.

How it works: this module is both the parent and the workers. The parent
starts the daemon (``DaemonProcess``), spawns ``python -m gpud.tools.demo --worker
KIND`` per pattern, and watches as an observer client that holds no session,
keeping the last CLIENTS figures of each worker. Kernels are sleeps. A worker
stops by itself after ``--seconds``, then prints its own counts as one JSON
line to a file in the daemon's temp dir.

It must never leave a process behind: the workers and the daemon are stopped
in ``finally``, on Ctrl-C and SIGTERM too.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, DropReason, GpudError, LockLost, Session
from gpud_client import protocol as p

GPU = 0
TQ_S = 2.0
DROP_TIMEOUT_S = 1.0
NOTEBOOK_IDLE_RELEASE_S = 0.5
RUN_S = 36.0
TICK_S = 0.5
STOP_GRACE_S = 0.3  # how long a worker's loop gets to notice its stop before its wait is abandoned
OVERRUN_S = 15.0  # the parent gives up on workers this long after their end
_UNSEEN = p.SessionInfo(
    session=0,
    gpu=GPU,
    state="idle",
    priority=0,
    grants=0,
    hold_ms=0,
    wait_ms=0,
    drops={},
    revocations=0,
    core_limit=100,
    budget_ms=None,
    window_used_ms=0,
    window_share_percent=0,
    recent_share_percent=0,
    throttled=False,
    throttles=0,
    mem_estimate_bytes=None,
    mem_used_bytes=None,
    mem_limit_bytes=None,
    mem_violations=0,
)


# --- the workers --------------------------------------------------------------


@dataclass(eq=False)
class _Work:
    """One worker's loop state. Kernels are sleeps that ``stop`` cuts short."""

    stop: threading.Event
    session: Session = field(init=False)
    slices: int = 0
    asked: int = 0  # give-backs a DROP_LOCK asked for
    unasked: int = 0  # give-backs nobody asked for (idle_release)
    lost: int = 0  # slices that ended with LockLost

    def run_slices(self, kernel_s: float, *, gap_s: float = 0.0, count: int | None = None) -> None:
        """Slices of ``kernel_s`` of GPU work, ``gap_s`` apart, until stopped or ``count`` done."""
        done = 0
        while not self.stop.is_set() and (count is None or done < count):
            try:
                with self.session.slice():
                    self.stop.wait(kernel_s)
            except LockLost:  # revoked mid-slice: the rest of it ran unarbitrated, and we are told
                self.lost += 1
            done += 1
            self.slices += 1
            if gap_s:
                self.stop.wait(gap_s)

    def before_give_back(self) -> None:
        """The session's synchronize hook: it runs before every LOCK_RELEASED."""
        if self.session.drop_pending is None:
            self.unasked += 1
        else:
            self.asked += 1


def _trainer(w: _Work) -> None:
    w.run_slices(0.050)


def _batch_infer(w: _Work) -> None:
    w.run_slices(0.010, gap_s=0.005)


def _notebook(w: _Work) -> None:
    while not w.stop.is_set():
        w.run_slices(0.020, gap_s=0.005, count=40)  # about 1 s of work
        w.stop.wait(3.0)  # thinking: no slices, the lock goes back after idle_release


def _stubborn(w: _Work) -> None:
    # One long slice ignores DROP_LOCK: the client library only gives the lock
    # back at slice exit, which comes after the daemon's drop timeout.
    while not w.stop.wait(3.0):
        w.run_slices(4.0, count=1)


@dataclass(frozen=True)
class Pattern:
    summary: str
    run: Callable[[_Work], None]
    idle_release: float = 1.0


PATTERNS: dict[str, Pattern] = {
    "trainer": Pattern("50 ms steps back to back", _trainer),
    "batch-infer": Pattern("10 ms slices, 5 ms gaps", _batch_infer),
    "notebook": Pattern("1 s bursts, 3 s thinking", _notebook, NOTEBOOK_IDLE_RELEASE_S),
    "stubborn": Pattern("4 s slices, ignores drops", _stubborn),
}


def _end_work(w: _Work, finished: threading.Event) -> None:
    """At the deadline: stop the loop; a slice still waiting for the lock is abandoned."""
    w.stop.set()
    if not finished.wait(STOP_GRACE_S):
        w.session.close()  # wakes the waiting slice with GpudError


def run_worker(kind: str, socket: str, seconds: float) -> int:
    """One client process: run ``kind``'s pattern for ``seconds``, then print its counts."""
    logging.basicConfig(level=logging.WARNING, format=f"{kind}: %(levelname)s %(message)s")
    pattern = PATTERNS[kind]
    work, finished = _Work(threading.Event()), threading.Event()
    with Client(socket, name=kind, labels={"demo": kind}) as client:
        work.session = client.session(GPU, idle_release=pattern.idle_release, synchronize=work.before_give_back)
        timer = threading.Timer(seconds, _end_work, (work, finished))
        timer.daemon = True
        timer.start()
        try:
            pattern.run(work)
        except GpudError:
            if not work.stop.is_set():
                raise
        finally:
            finished.set()
            timer.cancel()
            work.session.close()
    s = work.session
    counts = {"slices": work.slices, "grants": s.grants, "drops": s.drops, "revocations": s.revocations}
    print(
        json.dumps({"kind": kind, **counts, "asked": work.asked, "unasked": work.unasked, "lost": work.lost}),
        flush=True,
    )
    return 0


# --- the parent: processes ------------------------------------------------------


@dataclass(eq=False)
class _Child:
    kind: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def report(self) -> dict[str, Any] | None:
        """The worker's own counts (its last stdout line), or None if it wrote none."""
        lines = self.out.read_text(errors="replace").splitlines() if self.out.exists() else []
        try:
            data = json.loads(lines[-1]) if lines else None
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def stderr_tail(self, lines: int = 12) -> str:
        text = self.err.read_text(errors="replace") if self.err.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _spawn(kind: str, daemon: DaemonProcess, seconds: float) -> _Child:
    out, err = Path(daemon.workdir, f"{kind}.out"), Path(daemon.workdir, f"{kind}.err")
    cmd = [
        sys.executable,
        "-m",
        "gpud.tools.demo",
        "--worker",
        kind,
        "--socket",
        daemon.socket,
        "--seconds",
        f"{seconds:g}",
    ]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    return _Child(kind, proc, out, err)


def _stop(child: _Child) -> None:
    if child.proc.poll() is None:
        child.proc.terminate()
        try:
            child.proc.wait(3)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


# --- the parent: live view --------------------------------------------------------


class _Tracker:
    """The latest CLIENTS figures of each worker's session, kept after it is gone."""

    def __init__(self, t0: float, kinds: dict[int, str]) -> None:
        self.t0 = t0
        self.kinds = kinds  # pid -> pattern
        self.last: dict[str, p.SessionInfo] = {}
        self.last_at = t0

    def update(self, reply: p.ClientsReply, at: float) -> list[str]:
        """Record a snapshot; return notes on what changed since the previous one."""
        events = []
        for c in reply.clients:
            kind = self.kinds.get(c.pid)
            for s in c.sessions:
                if kind is None or s.gpu != GPU:
                    continue
                before = self.last.get(kind)
                if before is not None and s.revocations > before.revocations:
                    events.append(f"{kind} REVOKED after ignoring DROP_LOCK for {DROP_TIMEOUT_S:g} s")
                self.last[kind] = s
                self.last_at = at
        return events

    @property
    def wall_s(self) -> float:
        return self.last_at - self.t0


def _live_line(t: float, g: p.GpuStatus, events: list[str]) -> str:
    holder = "(free)"
    if g.holders:
        h = g.holders[0]
        holder = f"{h.name}[{h.pid}] {h.held_ms / 1000:.1f}s"
        holder += f" (drop: {h.drop_pending})" if h.drop_pending else ""
    queue = " ".join(w.name for w in g.queue) or "-"
    note = "".join(f"  <- {e}" for e in events)
    return f"{t:5.1f}s  {holder:<36} {queue}{note}"


def _watch(observer: Client, children: list[_Child], t0: float, limit_s: float) -> _Tracker:
    """Print who holds the GPU every tick until every worker has exited."""
    tracker = _Tracker(t0, {c.proc.pid: c.kind for c in children})
    print(f"{'time':>6}  {'holder of GPU ' + str(GPU):<36} queue (first in line first)")
    next_at = time.monotonic()
    while any(c.proc.poll() is None for c in children):
        if time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"the workers were still running {limit_s:.0f} s after they started")
        status = observer.status()
        now = time.monotonic()
        events = tracker.update(observer.clients(), now)
        print(_live_line(now - t0, status.gpus[GPU], events), flush=True)
        next_at += TICK_S
        time.sleep(max(0.0, next_at - time.monotonic()))
    return tracker


# --- the parent: summary ------------------------------------------------------------


def _table(rows: list[list[str]], header: list[str], left: int) -> str:
    """Columns before ``left`` are left-aligned, the rest (figures) right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def cell(i: int, v: str) -> str:
        return v.ljust(widths[i]) if i < left else v.rjust(widths[i])

    return "\n".join("  ".join(cell(i, v) for i, v in enumerate(r)).rstrip() for r in [header, *rows])


def _drops(drops: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(drops.items())) or "-"


def _times(n: object) -> str:
    return "once" if n in (1, "1") else f"{n} times"


def _mine(report: dict[str, Any] | None, key: str) -> str:
    """A figure from the worker's own report; "?" if it wrote none."""
    return str(report.get(key, "?")) if report else "?"


def _row(kind: str, s: p.SessionInfo, wall_s: float, report: dict[str, Any] | None) -> list[str]:
    mean_wait = f"{s.wait_ms / s.grants:.0f} ms" if s.grants else "-"
    return [
        kind,
        PATTERNS[kind].summary,
        f"{s.hold_ms / 1000:.1f} s",
        f"{s.hold_ms / 10 / wall_s:.1f} %",
        str(s.grants),
        f"{s.wait_ms / 1000:.1f} s",
        mean_wait,
        _drops(s.drops),
        str(s.revocations),
        _mine(report, "unasked"),
        _mine(report, "slices"),
    ]


def _summary(tracker: _Tracker, reports: dict[str, dict[str, Any] | None]) -> list[str]:
    if not tracker.last:
        return [f"\nno worker was ever seen on GPU {GPU}"]
    wall = tracker.wall_s
    rows = [_row(k, tracker.last[k], wall, reports.get(k)) for k in PATTERNS if k in tracker.last]
    total = sum(s.hold_ms for s in tracker.last.values()) / 10 / wall
    header = [
        "client",
        "pattern",
        "held",
        "share",
        "grants",
        "waited",
        "wait/grant",
        "drops",
        "revoked",
        "unasked",
        "slices",
    ]
    rows.append(["total", "", "", f"{total:.1f} %", *[""] * 7])
    intro = [
        f"\nGPU {GPU} over the {wall:.1f} s run, as the daemon counted it; the last two columns are each "
        "worker's own count",
        "(unasked: times it gave the lock back without a DROP_LOCK, i.e. through idle_release).",
    ]
    return [*intro, _table(rows, header, left=2), "", *_story(tracker.last, reports, total)]


def _story(last: dict[str, p.SessionInfo], reports: dict[str, dict[str, Any] | None], total: float) -> list[str]:
    trainer, batch, stubborn = (last.get(k, _UNSEEN) for k in ("trainer", "batch-infer", "stubborn"))
    tq = DropReason.TQ
    lines = [
        f"The trainer and batch-infer always had work queued: of their {trainer.grants} and {batch.grants} "
        f"grants, {trainer.drops.get(tq, 0)} and {batch.drops.get(tq, 0)} got a DROP_LOCK after the {TQ_S:g} s "
        "quantum, and they gave the lock back at their next slice boundary.",
        f"The stubborn client ignored its drops inside 4 s slices and was revoked {_times(stubborn.revocations)}, "
        f"{DROP_TIMEOUT_S:g} s after a drop, so it held the GPU {TQ_S + DROP_TIMEOUT_S:g} s per turn and no more. "
        f"Its slice ended in LockLost {_times(_mine(reports.get('stubborn'), 'lost'))}, telling it the rest of the "
        "slice had run unarbitrated. "
        f"The notebook gave the lock back unasked {_times(_mine(reports.get('notebook'), 'unasked'))}, "
        f"{NOTEBOOK_IDLE_RELEASE_S:g} s after a burst, instead of holding it while it thought.",
        f"Shares add up to {total:.1f} %: the rest is hand-overs and moments with no holder.",
    ]
    return lines + _disagreements(last, reports)


def _disagreements(last: dict[str, p.SessionInfo], reports: dict[str, dict[str, Any] | None]) -> list[str]:
    """Where a worker saw fewer drops or revocations than the daemon sent: worth a look.

    More is fine: the daemon's last snapshot can be up to a tick older than the worker's exit."""
    out = []
    for kind, s in last.items():
        mine = reports.get(kind) or {}
        for key, sent in (("drops", sum(s.drops.values())), ("revocations", s.revocations)):
            if key in mine and mine[key] < sent:
                out.append(f"note: the daemon sent {kind} {sent} {key}, but it saw only {mine[key]}")
    return out


# --- the parent ------------------------------------------------------------------


def _header(observer: Client, daemon: DaemonProcess, seconds: float) -> str:
    gpu = observer.welcome.gpus[GPU]
    lines = [
        f"gpud demo: a daemon on {len(observer.welcome.gpus)} simulated GPUs, socket {daemon.socket}",
        f"{len(PATTERNS)} client processes share GPU {GPU} ({gpu.name}) for {seconds:g} s; "
        f"time quantum {TQ_S:g} s, drop timeout {DROP_TIMEOUT_S:g} s",
    ]
    lines += [f"  {kind:<12} {pat.summary}" for kind, pat in PATTERNS.items()]
    return "\n".join(lines) + "\n"


def _failures(children: list[_Child]) -> list[str]:
    out = []
    for c in children:
        if c.proc.returncode != 0 or c.report() is None:
            out.append(f"worker {c.kind} failed (exit code {c.proc.returncode}):\n{c.stderr_tail()}")
    return out


def run_demo(seconds: float) -> int:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    daemon = DaemonProcess("--simulate", "2x80GiB", "--tq", f"{TQ_S:g}", "--drop-timeout", f"{DROP_TIMEOUT_S:g}")
    children: list[_Child] = []
    try:
        daemon.start()
        with Client(daemon.socket, name="demo", reconnect=False) as observer:
            print(_header(observer, daemon, seconds), flush=True)
            t0 = time.monotonic()
            for kind in PATTERNS:  # one by one: a Ctrl-C meanwhile must not lose a started child
                children.append(_spawn(kind, daemon, seconds))
            tracker = _watch(observer, children, t0, seconds + OVERRUN_S)
        reports = {c.kind: c.report() for c in children}
        print("\n".join(_summary(tracker, reports)))
        failures = _failures(children)
        if failures:
            print("", *failures, sep="\n", file=sys.stderr)
        return 1 if failures else 0
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the workers and the daemon", file=sys.stderr)
        return 130
    except (GpudError, RuntimeError) as exc:
        print(
            f"demo failed: {exc}",
            *_failures([c for c in children if c.proc.poll() is not None]),
            sep="\n",
            file=sys.stderr,
        )
        print("daemon log (tail):\n" + "\n".join(daemon.log().splitlines()[-10:]), file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        for c in children:
            _stop(c)
        daemon.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gpud.tools.demo", description="Processes sharing one GPU through gpud."
    )
    ap.add_argument("--seconds", type=float, default=RUN_S, help=f"how long the clients run (default {RUN_S:g})")
    ap.add_argument("--worker", choices=sorted(PATTERNS), help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not 0 < args.seconds <= 600:
        ap.error(f"--seconds must be > 0 and <= 600, got {args.seconds:g}")
    if args.worker:
        if not args.socket:
            ap.error("--worker needs --socket")
        return run_worker(args.worker, args.socket, args.seconds)
    return run_demo(args.seconds)


if __name__ == "__main__":
    sys.exit(main())
