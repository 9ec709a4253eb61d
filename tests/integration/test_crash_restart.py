"""The daemon is killed with SIGKILL at random moments under load and restarted at once, as systemd would.

Client processes (crash_worker.py, each with its own sync Client, reconnect on) cycle the lock on GPU 0
and GPU 1, take leases and allocate and free unique task ids, some with a wait, and record what they
believed on the shared monotonic clock. The test kills the daemon at seeded random moments, restarts it
on the same socket and state directory, and after every restart checks, waiting on state with deadlines:

- every worker reconnected, and the daemon lists the sessions it re-attached;
- every allocation whose ALLOCATED answer a worker got is listed with the same devices, nothing freed or
  refused is, nothing nobody asked for is, and no wait of a dead connection is still waiting;
- every worker is granted the lock on both GPUs again.

At the end, across all workers' records: per GPU no two holders' belief intervals overlap (serial mode:
a process that held the lock when the daemon died learns it lost it before anyone else is granted), every
worker worked after the last restart, reconnected exactly once per kill, stopped cleanly and saw nothing
but clean refusals (DaemonUnavailable, or an answer such as ``insufficient``). A failure names the seed;
``GPUD_CRASH_SEED=N`` repeats its choices (the timing of a real machine is not repeatable).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client

from . import waiting

WORKER = Path(__file__).with_name("crash_worker.py")
WORKERS = 4
KILLS = 5
KILL_GAP_S = (0.3, 1.5)  # load after the sessions are back, before the next kill
DAEMON_ARGS = ("--simulate", "2x16GiB", "--mode", "serial", "--tq", "0.05", "--drop-timeout", "10")
EXPECTED_CODES = {"insufficient", "shutting_down"}  # answers a worker may get besides DaemonUnavailable
RECONNECT_S = 15.0  # backoff tops out at 2 s; the daemon starts in ~1 s on 2 busy cores
REGRANT_S = 15.0  # after the restart grace (1 s by default), a queue of a few holders at most


@dataclass(frozen=True)
class Interval:
    gpu: int
    holder: str  # worker/lock or worker/lease: distinct holders as the daemon sees them
    t0: float
    t1: float
    end: str


@dataclass
class WorkerLog:
    """One worker's records, parsed. Only whole lines count: the file is read while it is written."""

    name: str
    intervals: list[Interval] = field(default_factory=list)
    allocating: set[str] = field(default_factory=set)
    acked: dict[str, tuple[list[int], float]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # a ProtocolError answer: surely not allocated
    uncertain: set[str] = field(default_factory=set)  # no answer: the daemon died or was away
    waits_cut: set[str] = field(default_factory=set)  # uncertain, in flight with a wait_ms when the daemon died
    wait_ms: dict[str, int] = field(default_factory=dict)
    freeing: set[str] = field(default_factory=set)
    freed: set[str] = field(default_factory=set)
    answers_at: list[float] = field(default_factory=list)  # allocation and lease answers
    reconnects: list[tuple[float, int, dict[int, int]]] = field(default_factory=list)
    unavailable_at: list[float] = field(default_factory=list)  # DaemonUnavailable refusals
    problems: list[str] = field(default_factory=list)
    ready: bool = False
    done: bool = False


def parse(name: str, text: str) -> WorkerLog:
    log = WorkerLog(name)
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        t_text, event, *rest = line.split()
        t = float(t_text)
        match event:
            case "lock" | "lease":
                holder = f"{name}/{event}"
                log.intervals.append(Interval(int(rest[0]), holder, float(rest[1]), float(rest[2]), rest[3]))
                if event == "lease":
                    log.answers_at.append(t)
            case "allocating":
                log.allocating.add(rest[0])
                log.wait_ms[rest[0]] = int(rest[2])
            case "acked":
                log.acked[rest[0]] = ([int(g) for g in rest[2].split(",")], float(rest[3]))
                log.answers_at.append(t)
            case "refused":
                log.refused[rest[0]] = rest[2]
                log.answers_at.append(t)
            case "uncertain":
                log.uncertain.add(rest[0])
                if "lost connection" in line and log.wait_ms.get(rest[0]):
                    log.waits_cut.add(rest[0])
            case "freeing":
                log.freeing.add(rest[0])
            case "freed":
                log.freed.add(rest[0])
            case "lease_result":
                log.answers_at.append(t)
            case "reconnected":
                ids = {int(g): int(sid) for g, sid in (pair.split(":") for pair in rest[1:])}
                log.reconnects.append((t, int(rest[0]), ids))
            case "ready":
                log.ready = True
            case "done":
                log.done = True
            case "error" | "slow" | "hung":
                log.problems.append(line.strip())
        if event in ("uncertain", "refused", "lease_refused", "free_refused", "lease_release_refused"):
            kind, code, *message = rest[1:]  # after the task id or the GPU
            if kind == "DaemonUnavailable":
                log.unavailable_at.append(t)
                if "did not answer" in " ".join(message):
                    log.problems.append(f"hang: {line.strip()}")
            elif code not in EXPECTED_CODES:
                log.problems.append(f"unexpected refusal: {line.strip()}")
    return log


def overlaps(intervals: Iterable[Interval]) -> list[tuple[Interval, Interval]]:
    """Pairs of different holders' intervals on one GPU that share a moment."""
    found = []
    by_gpu: dict[int, list[Interval]] = {}
    for i in intervals:
        by_gpu.setdefault(i.gpu, []).append(i)
    for ivs in by_gpu.values():
        ivs.sort(key=lambda i: i.t0)
        for n, a in enumerate(ivs):
            for b in ivs[n + 1 :]:
                if b.t0 >= a.t1:
                    break
                if b.holder != a.holder:
                    found.append((a, b))
    return found


class CrashHarness:
    """One daemon at a time on a fixed socket and state directory, and the worker processes."""

    def __init__(self, out: Path, seed: int) -> None:
        self.out = out
        self.seed = seed
        self.rng = random.Random(seed)
        self.workdir = tempfile.mkdtemp(prefix="gpud-crash-", dir="/tmp")  # a short socket path
        self.state_dir = os.path.join(self.workdir, "state")
        self.daemon: DaemonProcess | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.t_base = time.monotonic()
        self.kills: list[float] = []
        self.restarts: list[float] = []

    @property
    def socket(self) -> str:
        return os.path.join(self.workdir, "gpud.sock")

    # --- the daemon ----------------------------------------------------------

    def start_daemon(self) -> None:
        # A new DaemonProcess each time, as a service manager would start a new process.
        self.daemon = DaemonProcess(*DAEMON_ARGS, "--state-dir", self.state_dir, workdir=self.workdir)
        try:
            self.daemon.start()
        except RuntimeError as exc:  # it exited or never listened: its log is in the message
            self.fail(f"the daemon did not come back: {exc}")
        self.restarts.append(time.monotonic())

    def kill_daemon(self) -> None:
        assert self.daemon is not None and self.daemon.proc is not None
        self.kills.append(time.monotonic())
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait()
        self.daemon.proc = None

    def observer(self) -> Client:
        return Client(self.socket, name="crash-observer", reconnect=False)

    # --- workers -------------------------------------------------------------

    def start_workers(self, n: int) -> None:
        for i in range(n):
            name = f"w{i}"
            err = open(self.out / f"{name}.stderr", "wb")
            self.workers[name] = subprocess.Popen(
                [sys.executable, str(WORKER), self.socket, str(self.out / f"{name}.log"), name, str(self.seed)],
                stdout=err,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
            err.close()

    def logs(self) -> dict[str, WorkerLog]:
        out = {}
        for name in self.workers:
            path = self.out / f"{name}.log"
            out[name] = parse(name, path.read_text() if path.exists() else "")
        return out

    def stop_workers(self, timeout: float = 20.0) -> None:
        for proc in self.workers.values():
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, proc in self.workers.items():
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fail(f"worker {name} did not stop within {timeout} s of SIGTERM")
            if code != 0:
                self.fail(f"worker {name} exited with {code}:\n{(self.out / f'{name}.stderr').read_text()[-3000:]}")

    def cleanup(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if self.daemon is not None:
            if os.path.exists(self.daemon.log_path):
                shutil.copy(self.daemon.log_path, self.out / "gpud.log")
            self.daemon.cleanup()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # --- waiting and failing -------------------------------------------------

    def at(self, t: float) -> str:
        return f"{t - self.t_base:.3f}"

    def fail(self, what: str) -> NoReturn:
        raise AssertionError(self.report(what))

    def report(self, what: str) -> str:
        """``what``, with the seed, the kill times and the daemon's and failed workers' last lines."""
        lines = (self.daemon.log() if self.daemon is not None else "").splitlines()
        # every daemon's warnings and errors (the log file is shared by all of them), then its last lines
        notable = [line for line in lines if '"level":"info"' not in line and '"level":"debug"' not in line]
        tail = "\n".join(notable[-20:] + ["..."] + lines[-8:])
        for name, proc in self.workers.items():
            if proc.poll() not in (None, 0):
                tail += (
                    f"\nworker {name} exited with {proc.returncode}:\n"
                    + ((self.out / f"{name}.stderr").read_text(errors="replace")[-1500:])
                )
        return (
            f"{what}\n(seed {self.seed}: GPUD_CRASH_SEED={self.seed} repeats its choices; times in s since start;"
            f" kills at {[self.at(t) for t in self.kills]}, daemon up at {[self.at(t) for t in self.restarts]};"
            f" worker records and gpud.log in {self.out})\ndaemon log:\n{tail}"
        )

    def eventually(self, check: Callable[[], str | None], what: str, timeout: float) -> None:
        """Wait until ``check`` returns None; what it returned last, and the report, is the failure."""
        last: list[str | None] = [None]

        def holds() -> bool:
            last[0] = check()
            return last[0] is None

        waiting.eventually(holds, what, timeout, why=lambda: self.report(f"{last[0]}"))

    # --- the checks after each restart ---------------------------------------

    def sessions_back(self, since: float) -> str | None:
        logs = self.logs()
        with self.observer() as c:
            listed = {ci.pid: {s.session: s.gpu for s in ci.sessions} for ci in c.clients().clients}
        for name, log in logs.items():
            after = [r for r in log.reconnects if r[0] > since]
            if not after:
                return f"worker {name} has not reconnected since the kill"
            pid = self.workers[name].pid
            _, _, ids = after[-1]
            if any(sid == 0 or listed.get(pid, {}).get(sid) != gpu for gpu, sid in ids.items()):
                return f"worker {name} (pid {pid}) re-attached {ids} but the daemon lists {listed.get(pid)}"
        return None

    def check_allocations(self) -> None:
        """The daemon's listing against what the workers were told, read before and after it."""
        before = self.logs().values()
        with self.observer() as c:
            listing = c.allocations()
        after = self.logs().values()
        present = {a.task_id: (a.gpus, a.share) for a in listing.allocations}
        acked = {t: v for log in before for t, v in log.acked.items()}
        freeing = set().union(*(log.freeing for log in after))
        freed = set().union(*(log.freed for log in before))
        refused = set().union(*(log.refused for log in before))
        asked = set().union(*(log.allocating for log in after))
        answered = set(acked) | refused | set().union(*(log.uncertain for log in before))
        failures = []
        if missing := sorted(t for t in acked if t not in freeing and t not in present):
            failures.append(f"acknowledged allocations are gone after the restart: {missing}")
        if moved := {t: (acked[t], present[t]) for t in acked if t in present and present[t] != acked[t]}:
            failures.append(f"allocations came back on other devices (acked, listed): {moved}")
        if back := sorted(freed & set(present)):
            failures.append(f"freed allocations came back: {back}")
        if came := sorted(refused & set(present)):
            failures.append(f"refused allocations are listed: {came}")
        if strangers := sorted(set(present) - asked):
            failures.append(f"allocations nobody asked for are listed: {strangers}")
        if stale := sorted(t for t in listing.waiting if t in answered or t not in asked):
            failures.append(f"waits already answered or refused are still waiting: {stale}")
        if failures:
            self.fail("\n".join(failures))

    def regranted(self, since: float) -> str | None:
        for name, log in self.logs().items():
            gpus = {i.gpu for i in log.intervals if i.holder.endswith("/lock") and i.t0 > since}
            if gpus != {0, 1}:
                return f"worker {name} got the lock again only on GPUs {sorted(gpus)} since the restart"
        return None

    def after_restart(self) -> None:
        since_kill, since_up = self.kills[-1] if self.kills else 0.0, self.restarts[-1]
        self.eventually(lambda: self.sessions_back(since_kill), "every worker's sessions are back", RECONNECT_S)
        self.check_allocations()
        self.eventually(lambda: self.regranted(since_up), "every GPU is granted again", REGRANT_S)

    # --- the checks at the end -------------------------------------------------

    def check_end(self) -> None:
        """Everything at once, so one failure does not hide another."""
        logs = self.logs()
        failures = []
        both = overlaps(i for log in logs.values() for i in log.intervals)
        if both:
            lines = [
                f"GPU {a.gpu}: {a.holder} [{self.at(a.t0)}, {self.at(a.t1)}] {a.end} and "
                f"{b.holder} [{self.at(b.t0)}, {self.at(b.t1)}] {b.end}"
                for a, b in both[:20]
            ]
            failures.append(f"{len(both)} pairs of holders believed they held one GPU at once:\n" + "\n".join(lines))
        if problems := [f"{name}: {p}" for name, log in logs.items() for p in log.problems]:
            failures.append("workers saw errors, hangs or unexpected refusals:\n" + "\n".join(problems[:40]))
        if not_done := [name for name, log in logs.items() if not log.done]:
            failures.append(f"workers did not end cleanly: {not_done}")
        for name, log in logs.items():
            if [n for _, n, _ in log.reconnects] != list(range(1, KILLS + 1)):
                failures.append(f"worker {name} reconnected {[n for _, n, _ in log.reconnects]} for {KILLS} kills")
            if not any(t > self.restarts[-1] for t in log.answers_at):
                failures.append(f"worker {name} got no allocation or lease answer after the last restart")
            # DaemonUnavailable only while a daemon was away: from a kill to the worker's reconnect after it
            windows = [(k, min((t for t, _, _ in log.reconnects if t > k), default=k)) for k in self.kills]
            if stray := [self.at(t) for t in log.unavailable_at if not any(k <= t <= r + 1.0 for k, r in windows)]:
                failures.append(f"worker {name} was refused DaemonUnavailable while the daemon was up, at {stray}")
        with self.observer() as c:
            listing = c.allocations()
        if listing.allocations or listing.waiting:
            failures.append(
                f"after every worker freed its tasks the daemon still lists "
                f"{[a.task_id for a in listing.allocations]}, waiting {listing.waiting}"
            )
        assert self.daemon is not None
        if faults := [line for line in self.daemon.log().splitlines() if '"fault"' in line or "Traceback" in line]:
            failures.append("the daemon logged faults:\n" + "\n".join(faults[:10]))
        if failures:
            self.fail("\n\n".join(failures))

    def summary(self) -> str:
        logs = self.logs().values()
        ivs = [i for log in logs for i in log.intervals]
        locks = [i for i in ivs if i.holder.endswith("/lock")]
        learned = [i.t1 - k for i in locks for k in self.kills if i.end == "lost" and i.t0 <= k <= i.t1]
        return (
            f"seed {self.seed}: {len(self.kills)} kills, {len(locks)} lock holds "
            f"({sum(i.end == 'lost' for i in locks)} lost to a kill, learned within "
            f"{max(learned, default=0) * 1000:.1f} ms of it), "
            f"{len(ivs) - len(locks)} leases, {sum(len(log.acked) for log in logs)} allocations acked, "
            f"{sum(len(log.refused) for log in logs)} refused, "
            f"{sum(len(log.uncertain) for log in logs)} unanswered "
            f"({sum(len(log.waits_cut) for log in logs)} with a wait_ms, in flight at a kill), "
            f"{sum(len(log.unavailable_at) for log in logs)} DaemonUnavailable refusals"
        )


def test_sigkill_and_restart_under_load_keep_allocations_sessions_and_exclusion(tmp_path: Path) -> None:
    seed = int(os.environ.get("GPUD_CRASH_SEED") or random.SystemRandom().randrange(2**32))
    print(f"crash-restart seed {seed} (GPUD_CRASH_SEED={seed} repeats its choices)")
    h = CrashHarness(tmp_path, seed)
    try:
        h.start_daemon()
        h.start_workers(WORKERS)
        h.eventually(
            lambda: None if all(log.ready for log in h.logs().values()) else "workers not ready",
            "the workers are ready",
            20,
        )
        h.eventually(lambda: h.regranted(h.restarts[-1]), "every GPU is granted", REGRANT_S)
        for _ in range(KILLS):
            time.sleep(h.rng.uniform(*KILL_GAP_S))  # not a wait: load runs until the (random) moment of the kill
            h.kill_daemon()
            h.start_daemon()
            h.after_restart()
        time.sleep(h.rng.uniform(*KILL_GAP_S))  # not a wait: load after the last restart, before the end
        h.stop_workers()
        h.check_end()
        print(h.summary())
    finally:
        h.cleanup()
