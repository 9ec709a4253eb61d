"""Soak: 256 clients doing lock, lease and allocation cycles for 60 s, then 64 idle ones.

What is measured, against a real daemon (``--simulate 8x16GiB``, ``--log-level
warning``, metrics off, a config raising ``max_connections_per_uid`` to 1024 since
every client here shares one uid) in its own process, on its Unix socket only:
- load phase (``--seconds``, 60): ``--clients`` (256) connections, each its own
  ``gpud_client.Client`` in its own thread, spread over ``--procs`` (8) worker
  processes; a third each (client i does kind i mod 3):
  - lock: a session on one of GPUs 0-5 (about 14 per GPU; declaring no memory,
    so it runs alone: lock holders of a GPU are serial); ``session.acquire()``,
    hold 1 ms (a sleep), ``session.release()``;
  - lease: ``client.acquire(gpu 6 or 7, ASR/NMT/TTS/OTHER in turn, mem_estimate
    2 GiB (7 fit side by side), max_wait_ms 2000)``, hold 1 ms,
    ``client.release_lease(id)`` (waiting for its OK);
  - allocation: ``client.allocate(a new task id, a fraction of a GPU, prefer
    GPU 6 or 7)``, hold 1 ms, ``client.release_allocation(task id)``. The
    fraction is sized so that every allocation client's share fits on its GPU
    at once (0.9 / the clients per GPU, at most 0.25): none may be refused.
    (Allocations are only ledger entries: they do not queue with the leases.
    They stay off the lock GPUs, where they would cap a re-attached session.)
  Between cycles each client thinks 60-180 ms (uniform, seeded; ``--think-ms``),
  so the load is bounded: about 256 / 120 ms = 2100 cycles/s (~3500 ops/s)
  offered in all, a busy node. Why not more: these 256 Python clients run on the
  same 2 cores as the daemon and cost as much CPU per op as it does; at 20-80 ms
  the host is 90 % busy, lock holds stretch from 1.1 ms to ~6 ms waiting for CPU
  to deliver LOCK_OK and LOCK_RELEASED, and the figures measure the machine's
  starvation rather than gpud (docs/benchmarks.md gives both loads' figures).
  Clients start at random points of their first think time.
- an op is one round trip, timed in the client from the call to its return:
  ``lock`` = acquire() (LOCK_REQUEST -> LOCK_OK through the client's reader
  thread; includes real queueing behind the other holders of that GPU),
  ``lease_acquire`` = ACQUIRE -> LEASE_RESULT, ``lease_release`` = RELEASE ->
  OK, ``allocate`` = ALLOCATE -> ALLOCATED (after its SQLite commit), ``free`` =
  FREE -> OK. LOCK_RELEASED has no answer and is not an op. ``p99_ms`` is
  over every op of the whole load phase, warm-up included; per kind p50/p99
  and the p99 after warm-up are given beside it. Percentiles are nearest-rank.
  The figures include the client side (its reader thread, the GIL shared by
  the 32 clients of a process) on the same 2 cores as the daemon. To tell the
  two apart the JSON also has: each lock hold as the client saw it (acquire
  returned -> release returned) and the lock sessions' mean hold and wait per
  grant as the daemon counts them (CLIENTS, read at the end of the load), the
  daemon's own queue wait of each lease (``queue_wait_ms``), and the CPU time
  of the daemon and of the load clients per op and the host's busy percent.
- an error is any exception from the client library, any lease not ACQUIRED,
  any allocation refused, and any op not answered within 5 s (a watchdog
  thread per process counts it, adds a 5000 ms sample as a lower bound, and
  closes that client so the op ends). After an exception the client is
  replaced by a fresh one and goes on (an allocation client first frees the
  task its interrupted cycle may have left, best effort).
- the daemon's VmRSS (``/proc/PID/status``) after warm-up (5 s, or a quarter
  of a shorter run) and at the end of the load, clients still connected;
- idle phase: once the load clients have exited (their connections seen gone,
  by a probe client), ``--idle-clients`` (64) clients in one process each
  attach one session (GPUs 0-7 in turn) and do nothing; once the probe sees
  them all attached and has closed, after 1 s to settle, the daemon's
  utime+stime (``/proc/PID/stat``, all its threads; 10 ms ticks) over
  ``--idle-seconds`` (10) as a percent of one core.

It must never bend a figure to meet a target: no sample is dropped, the
targets are only printed beside the figures, and it exits 0 whether or not
they are met. Every loop is bounded in count and time; the daemon and its
directory are removed at the end, Ctrl-C and failures included.

    .venv/bin/python bench/soak.py [--json] [--seconds 60] [--clients 256]
                                   [--idle-seconds 10] [--idle-clients 64] [--procs 8]
                                   [--think-ms 60 180] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, ErrorCode, ProtocolError

from percentiles import percentile  # bench/, on the path when run as a script

SIMULATE = "8x16GiB"
# Lock sessions never share a GPU with the allocations: a session attached (or re-attached after an
# error) on a GPU where its uid holds a fractional allocation gets that share as its core ceiling.
LOCK_GPUS = (0, 1, 2, 3, 4, 5)
LEASE_GPUS = (6, 7)
ALLOC_GPUS = (6, 7)
GPUS = 8
KINDS = ("lock", "lease", "allocation")
OPS = ("lock", "lease_acquire", "lease_release", "allocate", "free")
LEASE_TYPES = ("ASR", "NMT", "TTS", "OTHER")
LEASE_MEM = "2GiB"  # 7 fit beside each other on a 16 GiB GPU less its 10 % reserve
LEASE_WAIT_MS = 2000
UNIT = 10_000  # the ledger's fixed point: one GPU
THINK_S = (0.060, 0.180)  # see the module comment: below what 2 cores carry with the clients on them
HOLD_S = 0.001
OP_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 10.0  # the library's own (its default): longer than OP_TIMEOUT_S, so the watchdog decides
ERROR_BACKOFF_S = 0.1
WATCH_EVERY_S = 0.1
KEPT_ERRORS = 10  # error messages kept per process
START_TIMEOUT_S = 120.0
GONE_TIMEOUT_S = 15.0
IDLE_SETTLE_S = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGETS = {"errors": 0, "rss_growth_percent": 10.0, "idle_cpu_percent": 1.0, "p99_ms": 10.0}


@dataclass(frozen=True, kw_only=True)
class Plan:
    seconds: float = 60.0
    clients: int = 256
    idle_seconds: float = 10.0
    idle_clients: int = 64
    procs: int = 8
    seed: int = 1
    think_s: tuple[float, float] = THINK_S

    @property
    def warmup_s(self) -> float:
        return min(5.0, self.seconds / 4)


@dataclass(frozen=True)
class Spec:
    """One load client: what it does and where."""

    index: int
    kind: str
    gpu: int
    share: float  # allocation clients only
    think_s: tuple[float, float]


class Abandoned(Exception):
    """The watchdog gave up on this client's op (already counted): start afresh."""


class Refusal(Exception):
    """The daemon answered, but not what a bounded, well-sized request must get."""


# --- the load clients (threads in worker processes) ---------------------------


class Recorder:
    """One process's samples: per op, latency (ms) and start (s after t0)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.lat = {op: array("d") for op in OPS}
        self.at = {op: array("d") for op in OPS}
        self.cycles: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()  # errors by what happened (a small, bounded set of keys)
        # Beside the ops: how long a lock client held (acquire returned -> release returned), and the
        # queue wait the daemon reported for each lease (ACQUIRE read -> decided).
        self.hold: array[float] = array("d")
        self.lease_wait: array[float] = array("d")
        self.messages: list[str] = []
        self.elsewhere = 0  # allocations placed off the preferred GPU (not an error; should not happen)
        self.cpu_s = 0.0  # this process's CPU time over the load
        self.lock = threading.Lock()

    def sample(self, op: str, start: float, ms: float) -> None:
        with self.lock:
            self.lat[op].append(ms)
            self.at[op].append(start - self.t0)

    def error(self, op: str, what: str, reason: str) -> None:
        with self.lock:
            self.errors[op] += 1
            self.reasons[f"{op}: {reason}"] += 1
            if len(self.messages) < KEPT_ERRORS:
                self.messages.append(f"{op}: {what}")


class LoadClient:
    """One connection and its loop of cycles; ``op`` is watched by the process's watchdog."""

    def __init__(self, path: str, spec: Spec, rec: Recorder, rng: random.Random) -> None:
        self.path, self.spec, self.rec, self.rng = path, spec, rec, rng
        self.client: Client | None = None
        self.session: Any = None
        self.state = threading.Lock()
        self.op: tuple[str, float] | None = None  # (op, monotonic start) while one is in flight
        self.abandoned = False
        self.last_op: str | None = None  # the op the cycle is at: an exception is counted against it
        self.tasks = 0
        self.unfreed: str | None = None  # a task whose allocation may exist and was not freed

    def connect(self) -> None:
        client = Client(self.path, name=f"soak-{self.spec.kind}-{self.spec.index}", request_timeout=REQUEST_TIMEOUT_S)
        try:
            if self.spec.kind == "lock":
                self.session = client.session(self.spec.gpu)
            if self.unfreed is not None:  # an op failed in the middle: free what it may have left (best effort)
                try:
                    client.release_allocation(self.unfreed)
                except ProtocolError as exc:
                    if exc.code != ErrorCode.UNKNOWN_TASK:
                        raise
                self.unfreed = None
        except BaseException:
            client.close()
            raise
        self.client = client

    def drop(self) -> None:
        client, self.client, self.session = self.client, None, None
        if client is not None:
            client.close()

    def timed(self, op: str, call: Callable[[], Any]) -> Any:
        start = time.monotonic()
        self.last_op = op
        with self.state:
            self.op, self.abandoned = (op, start), False
        try:
            result = call()
        except Exception:
            if self._finish():
                raise Abandoned(op) from None  # the watchdog closed the client under it: counted already
            raise
        if self._finish():
            raise Abandoned(op)
        self.rec.sample(op, start, (time.monotonic() - start) * 1000)
        return result

    def _finish(self) -> bool:
        """The op is over; whether the watchdog had given up on it."""
        with self.state:
            self.op, abandoned = None, self.abandoned
        return abandoned

    def watch(self, now: float) -> Client | None:
        """Called by the watchdog: the client to close if its op is overdue."""
        with self.state:
            if self.op is None or self.abandoned or now - self.op[1] < OP_TIMEOUT_S:
                return None
            op, start = self.op
            self.abandoned = True
        self.rec.sample(op, start, (now - start) * 1000)  # a lower bound
        self.rec.error(op, f"no answer within {OP_TIMEOUT_S} s", "timeout")
        return self.client

    def lock_cycle(self) -> None:
        s = self.session
        self.timed("lock", s.acquire)
        held = time.monotonic()
        time.sleep(HOLD_S)
        s.release()
        self.rec.hold.append((time.monotonic() - held) * 1000)

    def lease_cycle(self) -> None:
        c, gpu = self.client, self.spec.gpu
        assert c is not None
        task_type = LEASE_TYPES[self.tasks % len(LEASE_TYPES)]
        self.tasks += 1
        r = self.timed(
            "lease_acquire", lambda: c.acquire(gpu, task_type, max_wait_ms=LEASE_WAIT_MS, mem_estimate=LEASE_MEM)
        )
        if not r.acquired or r.lease_id is None:
            raise Refusal(f"lease on GPU {gpu} {r.status} ({r.reason})", f"{r.status} {r.reason} (GPU {gpu})")
        self.rec.lease_wait.append(r.queue_wait_ms)
        time.sleep(HOLD_S)
        self.timed("lease_release", lambda: c.release_lease(r.lease_id))

    def allocation_cycle(self) -> None:
        c, gpu, share = self.client, self.spec.gpu, self.spec.share
        assert c is not None
        task = f"soak-{self.spec.index}-{self.tasks}"
        self.tasks += 1
        self.unfreed = task
        a = self.timed("allocate", lambda: c.allocate(task, share, prefer=[gpu]))
        if a.gpus != [gpu]:
            with self.rec.lock:
                self.rec.elsewhere += 1
        time.sleep(HOLD_S)
        self.timed("free", lambda: c.release_allocation(task))
        self.unfreed = None

    def run(self, end: float) -> None:
        cycle = {"lock": self.lock_cycle, "lease": self.lease_cycle, "allocation": self.allocation_cycle}
        work = cycle[self.spec.kind]
        first = {"lock": "lock", "lease": "lease_acquire", "allocation": "allocate"}[self.spec.kind]
        think = self.spec.think_s
        time.sleep(self.rng.uniform(0, think[1]))
        for _ in range(math.ceil((end - time.monotonic()) / think[0]) + 1):  # the clock ends it first
            if time.monotonic() >= end:
                break
            self.last_op = None
            try:
                if self.client is None:
                    self.connect()
                work()
                with self.rec.lock:
                    self.rec.cycles[self.spec.kind] += 1
            except Abandoned:
                self.drop()
            except Refusal as exc:
                self.rec.error(first, str(exc.args[0]), str(exc.args[1]))
            except Exception as exc:  # noqa: BLE001 -- the client library's, or a bug here: counted either way
                op = self.last_op or "connect"
                code = getattr(exc, "code", None)
                self.rec.error(op, f"{type(exc).__name__}: {exc}", type(exc).__name__ + (f" {code}" if code else ""))
                self.drop()
                time.sleep(ERROR_BACKOFF_S)
            time.sleep(self.rng.uniform(*think))


def watchdog(clients: list[LoadClient], threads: list[threading.Thread]) -> None:
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        for lc in clients:
            overdue = lc.watch(now)
            if overdue is not None:
                overdue.close()  # the op's call returns (or raises) and the loop starts afresh
        time.sleep(WATCH_EVERY_S)


def load_process(path: str, specs: list[Spec], seed: int, out: Pipe) -> None:
    """Connect every client, report ready, run from t0 to end, report the samples."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it terminates us
    rec = Recorder(0.0)
    clients = [LoadClient(path, s, rec, random.Random(seed * 100_003 + s.index)) for s in specs]
    try:
        for lc in clients:
            lc.connect()
        out.send(("ready", len(clients)))
        _, t0, end = out.recv()
        rec.t0 = t0
        time.sleep(max(0.0, t0 - time.monotonic()))
        cpu0 = os.times()
        threads = [threading.Thread(target=lc.run, args=(end,), daemon=True) for lc in clients]
        for t in threads:
            t.start()
        watcher = threading.Thread(target=watchdog, args=(clients, threads), daemon=True)
        watcher.start()
        for t in threads:
            t.join(max(0.0, end - time.monotonic()) + OP_TIMEOUT_S + 10)
        cpu1 = os.times()
        rec.cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        stuck = sum(t.is_alive() for t in threads)
        if stuck:
            rec.error("stuck", f"{stuck} client thread(s) still in a cycle long after the end", "stuck")
    except Exception:
        out.send(("failed", traceback.format_exc()))
        raise
    finally:
        for lc in clients:
            lc.drop()
    out.send(
        (
            "done",
            {
                "lat": rec.lat,
                "at": rec.at,
                "cycles": dict(rec.cycles),
                "errors": dict(rec.errors),
                "reasons": dict(rec.reasons),
                "hold": rec.hold,
                "lease_wait": rec.lease_wait,
                "messages": rec.messages,
                "elsewhere": rec.elsewhere,
                "cpu_s": rec.cpu_s,
            },
        )
    )
    out.close()


def idle_process(path: str, count: int, out: Pipe) -> None:
    """``count`` clients, each with one attached session it never uses, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    clients: list[Client] = []
    try:
        for i in range(count):
            c = Client(path, name=f"soak-idle-{i}", request_timeout=REQUEST_TIMEOUT_S)
            clients.append(c)
            c.session(i % GPUS)
        out.send(("ready", count))
        if out.poll(START_TIMEOUT_S + 600):
            out.recv()
    except Exception:
        out.send(("failed", traceback.format_exc()))
        raise
    finally:
        for c in clients:
            c.close()
    out.close()


# --- the parent ------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), None)
    if kb is None:
        raise RuntimeError(f"the daemon (pid {pid}) has exited")
    return kb / 1024


def cpu_s(pid: int) -> float:
    """utime + stime of the whole process (all threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def host_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    total = sum(ticks[:8])  # guest time is already in user
    return total - idle, total


def lock_sessions_seen_by_daemon(reply: Any) -> dict[str, float | int]:
    """From CLIENTS at the end of the load: the lock sessions' grants and mean hold and wait per grant."""
    infos = [s for c in reply.clients if c.name.startswith("soak-lock-") for s in c.sessions]
    grants = sum(s.grants for s in infos)
    return {
        "sessions": len(infos),
        "grants": grants,
        "hold_ms_mean": round(sum(s.hold_ms for s in infos) / grants, 3) if grants else 0.0,
        "wait_ms_mean": round(sum(s.wait_ms for s in infos) / grants, 3) if grants else 0.0,
        "drops": sum(sum(s.drops.values()) for s in infos),
        "revocations": sum(s.revocations for s in infos),
    }


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def plan_clients(plan: Plan) -> list[Spec]:
    kinds = [KINDS[i % len(KINDS)] for i in range(plan.clients)]
    n_alloc = kinds.count("allocation")
    per_gpu = max(1, math.ceil(n_alloc / len(ALLOC_GPUS)))
    share = min(UNIT // 4, UNIT * 9 // 10 // per_gpu) / UNIT
    seen: Counter[str] = Counter()
    specs = []
    for i, kind in enumerate(kinds):
        gpus = {"lock": LOCK_GPUS, "lease": LEASE_GPUS, "allocation": ALLOC_GPUS}[kind]
        gpu = gpus[seen[kind] % len(gpus)]
        specs.append(Spec(i, kind, gpu, share if kind == "allocation" else 0.0, plan.think_s))
        seen[kind] += 1
    return specs


def expect_reply(pipe: Pipe, what: str, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise RuntimeError(f"a worker sent nothing within {timeout:.0f} s ({what})")
    tag, body = pipe.recv()
    if tag == "failed":
        raise RuntimeError(f"a worker failed ({what}):\n{body}")
    return body


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def wait_for(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def run_load(ctx: Any, path: str, pid: int, plan: Plan, procs: list[Any]) -> dict[str, Any]:
    specs = plan_clients(plan)
    groups = [specs[i :: plan.procs] for i in range(plan.procs)]
    pipes = []
    for i, group in enumerate(g for g in groups if g):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=load_process, args=(path, group, plan.seed + i, theirs), daemon=True)
        proc.start()
        theirs.close()
        procs.append(proc)
        pipes.append(ours)
    for pipe in pipes:
        expect_reply(pipe, "connecting", START_TIMEOUT_S)
    _progress(f"load: {plan.clients} clients in {len(pipes)} processes connected; {plan.seconds:g} s")
    probe = Client(path, name="soak-probe", request_timeout=REQUEST_TIMEOUT_S)
    try:
        return _drive(pid, plan, pipes, procs, probe)
    finally:
        probe.close()


def _drive(pid: int, plan: Plan, pipes: list[Pipe], procs: list[Any], probe: Client) -> dict[str, Any]:
    """Start the load, read the daemon after warm-up and at the end, collect the samples."""
    t0 = time.monotonic() + 0.2
    end = t0 + plan.seconds
    for pipe in pipes:
        pipe.send(("go", t0, end))
    sleep_until(t0 + plan.warmup_s)
    rss_start, cpu_warm, host_warm = rss_mb(pid), cpu_s(pid), host_cpu()
    trend = [(round(plan.warmup_s, 1), round(rss_start, 2))]  # (s after t0, VmRSS MB), every 5 s
    for k in range(1, math.ceil(plan.seconds / 5) + 1):
        at = t0 + plan.warmup_s + 5 * k
        if at >= end:
            break
        sleep_until(at)
        trend.append((round(plan.warmup_s + 5 * k, 1), round(rss_mb(pid), 2)))
    sleep_until(end)
    rss_end, cpu_end, host_end = rss_mb(pid), cpu_s(pid), host_cpu()
    locks = lock_sessions_seen_by_daemon(probe.clients())
    results = [expect_reply(pipe, "results", OP_TIMEOUT_S + 60) for pipe in pipes]
    for proc in procs:
        proc.join(10)
    load_cpu = (cpu_end - cpu_warm) / (plan.seconds - plan.warmup_s) * 100
    host_busy = (host_end[0] - host_warm[0]) / max(1, host_end[1] - host_warm[1]) * 100
    return {
        "results": results,
        "rss_start": rss_start,
        "rss_end": rss_end,
        "trend": trend,
        "load_cpu": load_cpu,
        "host_busy": host_busy,
        "locks": locks,
    }


def after_load(path: str) -> dict[str, Any]:
    """With a probe client: every load connection gone, and what they left behind."""
    with Client(path, name="soak-probe", request_timeout=REQUEST_TIMEOUT_S) as probe:
        gone = wait_for(lambda: len(probe.clients().clients) == 1, GONE_TIMEOUT_S)
        left = probe.allocations()
        status = probe.status()
        return {
            "load_connections_gone": gone,
            "clients_left": len(probe.clients().clients) - 1,
            "allocations_left": len(left.allocations),
            "holders_left": sum(len(g.holders) for g in status.gpus),
            "waiters_left": sum(len(g.queue) for g in status.gpus),
        }


def run_idle(ctx: Any, path: str, pid: int, plan: Plan, procs: list[Any]) -> dict[str, Any]:
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=idle_process, args=(path, plan.idle_clients, theirs), daemon=True)
    proc.start()
    theirs.close()
    procs.append(proc)
    expect_reply(ours, "attaching idle clients", START_TIMEOUT_S)
    with Client(path, name="soak-probe", request_timeout=REQUEST_TIMEOUT_S) as probe:

        def attached() -> int:
            return sum(len(c.sessions) for c in probe.clients().clients if c.name.startswith("soak-idle-"))

        all_attached = wait_for(lambda: attached() == plan.idle_clients, GONE_TIMEOUT_S)
        sessions = attached()
    _progress(f"idle: {sessions} idle clients attached; measuring {plan.idle_seconds:g} s")
    time.sleep(IDLE_SETTLE_S)
    cpu0, t0 = cpu_s(pid), time.monotonic()
    time.sleep(plan.idle_seconds)
    cpu1, t1 = cpu_s(pid), time.monotonic()
    rss = rss_mb(pid)
    ours.send(("stop", None))
    proc.join(15)
    return {
        "idle_cpu_percent": (cpu1 - cpu0) / (t1 - t0) * 100,
        "idle_sessions_attached": sessions,
        "idle_all_attached": all_attached,
        "rss_after_idle_mb": rss,
    }


# --- figures ---------------------------------------------------------------------


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    at: dict[str, list[float]] = {op: [] for op in OPS}
    cycles: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    messages: list[str] = []
    hold: list[float] = []
    lease_wait: list[float] = []
    elsewhere = 0
    for r in results:
        reasons.update(r["reasons"])
        hold.extend(r["hold"])
        lease_wait.extend(r["lease_wait"])
        for op in OPS:
            lat[op].extend(r["lat"][op])
            at[op].extend(r["at"][op])
        cycles.update(r["cycles"])
        errors.update(r["errors"])
        messages.extend(r["messages"])
        elsewhere += r["elsewhere"]
    return {
        "lat": lat,
        "at": at,
        "cycles": cycles,
        "errors": errors,
        "reasons": reasons,
        "messages": messages,
        "hold": hold,
        "lease_wait": lease_wait,
        "elsewhere": elsewhere,
    }


def _pcts(samples: list[float]) -> dict[str, float | int | None]:
    if not samples:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "count": len(samples),
        "p50_ms": round(percentile(samples, 50), 3),
        "p99_ms": round(percentile(samples, 99), 3),
        "max_ms": round(max(samples), 3),
    }


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def where_the_time_goes(
    m: dict[str, Any], load: dict[str, Any], plan: Plan, *, ops: int, ops_after_warmup: int
) -> dict[str, Any]:
    """Client-side hold vs the daemon's, the daemon's lease queue wait, and CPU per op on each side."""
    clients_cpu_s = sum(r["cpu_s"] for r in load["results"])
    daemon_cpu_s = load["load_cpu"] / 100 * (plan.seconds - plan.warmup_s)  # after warm-up only
    return {
        "lock_hold_client": _pcts(m["hold"]),
        "lock_sessions_daemon": load["locks"],
        "lease_queue_wait_daemon": _pcts(m["lease_wait"]),
        "daemon_cpu_percent_load": round(load["load_cpu"], 1),
        "daemon_cpu_us_per_op": round(daemon_cpu_s * 1e6 / max(1, ops_after_warmup), 1),
        "clients_cpu_percent_load": round(clients_cpu_s / plan.seconds * 100, 1),
        "clients_cpu_us_per_op": round(clients_cpu_s * 1e6 / max(1, ops), 1),
        "host_cpu_busy_percent_load": round(load["host_busy"], 1),
    }


def report(
    plan: Plan, load: dict[str, Any], after: dict[str, Any], idle: dict[str, Any], extra: dict[str, Any]
) -> dict[str, Any]:
    """The listed keys first, then the details, the targets and whether each was met."""
    m = merge(load["results"])
    everything = [ms for op in OPS for ms in m["lat"][op]]
    warm = [ms for op in OPS for ms, t in zip(m["lat"][op], m["at"][op]) if t >= plan.warmup_s]
    errors = sum(m["errors"].values())
    p99 = percentile(everything, 99) if everything else math.inf
    growth = (load["rss_end"] - load["rss_start"]) / load["rss_start"] * 100
    idle_cpu = idle["idle_cpu_percent"]
    figures = {"errors": errors, "rss_growth_percent": growth, "idle_cpu_percent": idle_cpu, "p99_ms": p99}
    met = {key: figures[key] <= limit for key, limit in TARGETS.items()}
    return {
        "clients": plan.clients,
        "seconds": _number(plan.seconds),
        "ops": len(everything),
        "errors": errors,
        "p99_ms": round(p99, 3),
        "rss_start_mb": round(load["rss_start"], 2),
        "rss_end_mb": round(load["rss_end"], 2),
        "idle_cpu_percent": round(idle_cpu, 2),
        "rss_growth_percent": round(growth, 2),
        "p50_ms": round(percentile(everything, 50), 3) if everything else None,
        "p99_ms_after_warmup": round(percentile(warm, 99), 3) if warm else None,
        "ops_per_s": round(len(everything) / plan.seconds, 1),
        "per_op": {op: _pcts(m["lat"][op]) for op in OPS},
        "cycles": {kind: m["cycles"].get(kind, 0) for kind in KINDS},
        "errors_by_op": dict(m["errors"]),
        "errors_by_reason": dict(m["reasons"]),
        "error_messages": m["messages"][:KEPT_ERRORS],
        "allocations_off_preferred_gpu": m["elsewhere"],
        **where_the_time_goes(m, load, plan, ops=len(everything), ops_after_warmup=len(warm)),
        "rss_trend_mb": load["trend"],
        **after,
        "idle_clients": plan.idle_clients,
        "idle_seconds": _number(plan.idle_seconds),
        **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in idle.items() if k != "idle_cpu_percent"},
        "warmup_s": plan.warmup_s,
        "procs": plan.procs,
        "think_ms": [plan.think_s[0] * 1000, plan.think_s[1] * 1000],
        "hold_ms": HOLD_S * 1000,
        **extra,
        "targets": TARGETS,
        "met": met,
    }


def table(r: dict[str, Any]) -> str:
    rows = [
        ("errors", "errors", "", "= 0"),
        ("op p99, all kinds", "p99_ms", "ms", "<= 10 ms"),
        ("daemon RSS growth", "rss_growth_percent", "%", "<= 10 %"),
        ("daemon idle CPU", "idle_cpu_percent", "%", "<= 1 %"),
    ]
    lines = [f"{'figure':<24}{'measured':>12}{'target':>12}  met"]
    for label, key, unit, target in rows:
        lines.append(f"{label:<24}{r[key]:>9.6g} {unit:<2}{target:>12}  {'yes' if r['met'][key] else 'NO'}")
    lines.append(f"{'daemon RSS start / end':<24}{r['rss_start_mb']:>9.1f} / {r['rss_end_mb']:.1f} MB")
    lines.append(f"{'op':<16}{'count':>9}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for op, f in r["per_op"].items():
        if f["count"]:
            lines.append(f"{op:<16}{f['count']:>9}{f['p50_ms']:>10.3f}{f['p99_ms']:>10.3f}{f['max_ms']:>10.1f}")
    lines.append(
        f"{r['clients']} clients x {r['seconds']} s: {r['ops']} ops ({r['ops_per_s']}/s), cycles {r['cycles']}; "
        f"p99 after {r['warmup_s']:g} s warm-up {r['p99_ms_after_warmup']} ms; daemon CPU under load "
        f"{r['daemon_cpu_percent_load']} % of a core, host CPUs {r['host_cpu_busy_percent_load']} % busy"
    )
    hold, daemon_view, lw = r["lock_hold_client"], r["lock_sessions_daemon"], r["lease_queue_wait_daemon"]
    lines.append(
        f"lock hold (client) p50 {hold['p50_ms']} / p99 {hold['p99_ms']} ms; per grant (daemon) hold "
        f"{daemon_view['hold_ms_mean']} ms, wait {daemon_view['wait_ms_mean']} ms; "
        f"lease queue wait (daemon) p50 {lw['p50_ms']} / p99 {lw['p99_ms']} ms"
    )
    lines.append(
        f"idle: {r['idle_sessions_attached']} sessions for {r['idle_seconds']} s; after the load: "
        f"{r['clients_left']} clients, {r['allocations_left']} allocations, {r['holders_left']} holders left"
    )
    if r["error_messages"]:
        lines.append("first errors: " + "; ".join(r["error_messages"]))
    lines.append(f"{r['cpus']} CPUs, load {r['loadavg_1m_before']} before the run, took {r['elapsed_s']} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[Plan, bool]:
    ap = argparse.ArgumentParser(description="Soak gpud with lock, lease and allocation cycles, then idle clients.")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--seconds", type=float, default=Plan.seconds, help="length of the load phase")
    ap.add_argument("--clients", type=int, default=Plan.clients, help="load connections (a third of each kind)")
    ap.add_argument("--idle-seconds", type=float, default=Plan.idle_seconds, help="length of the idle phase")
    ap.add_argument("--idle-clients", type=int, default=Plan.idle_clients, help="idle attached clients")
    ap.add_argument("--procs", type=int, default=Plan.procs, help="worker processes the load clients share")
    ap.add_argument("--seed", type=int, default=Plan.seed)
    ap.add_argument(
        "--think-ms",
        type=float,
        nargs=2,
        default=[THINK_S[0] * 1000, THINK_S[1] * 1000],
        metavar=("MIN", "MAX"),
        help="think time between a client's cycles, uniform",
    )
    a = ap.parse_args(argv)
    if a.seconds <= 0 or a.idle_seconds <= 0 or a.clients < len(KINDS) or a.idle_clients < 1 or a.procs < 1:
        ap.error("--seconds and --idle-seconds must be > 0, --clients >= 3, --idle-clients and --procs >= 1")
    if not 1 <= a.think_ms[0] <= a.think_ms[1] <= 60_000:
        ap.error("--think-ms needs 1 <= MIN <= MAX <= 60000")
    procs = min(a.procs, a.clients)
    plan = Plan(
        seconds=a.seconds,
        clients=a.clients,
        idle_seconds=a.idle_seconds,
        idle_clients=a.idle_clients,
        procs=procs,
        seed=a.seed,
        think_s=(a.think_ms[0] / 1000, a.think_ms[1] / 1000),
    )
    return plan, a.json


def daemon_warnings(log: str) -> dict[str, int]:
    events: Counter[str] = Counter()
    for line in log.splitlines():
        try:
            events[str(json.loads(line).get("event", "?"))] += 1
        except (ValueError, AttributeError):
            events["(not json)"] += 1
    return dict(events)


def main(argv: list[str] | None = None) -> int:
    plan, as_json = parse_args(argv)
    load_before, began = os.getloadavg()[0], time.monotonic()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gpud_client"])
    workdir = tempfile.mkdtemp(prefix="gpud-soak-", dir="/tmp")  # removed by daemon.cleanup()
    config = os.path.join(workdir, "soak.toml")
    daemon = DaemonProcess("--simulate", SIMULATE, "--log-level", "warning", "--config", config, workdir=workdir)
    procs: list[Any] = []
    try:
        with open(config, "w") as f:
            f.write("max_connections_per_uid = 1024\n")  # every client here has our uid
        daemon.start()
        assert daemon.proc is not None
        pid = daemon.proc.pid
        load = run_load(ctx, daemon.socket, pid, plan, procs)
        after = after_load(daemon.socket)
        idle = run_idle(ctx, daemon.socket, pid, plan, procs)
        alive = daemon.proc.poll() is None
        log = daemon.log().strip()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        daemon.cleanup()
    if log:
        lines = log.splitlines()
        _progress(f"the daemon logged {len(lines)} warning line(s); the first:\n" + "\n".join(lines[:10]))
    extra = {
        "daemon_alive": alive,
        "daemon_warnings": daemon_warnings(log),
        "cpus": os.cpu_count(),
        "loadavg_1m_before": round(load_before, 2),
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    result = report(plan, load, after, idle, extra)
    print(table(result))
    if as_json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        _progress("interrupted: the workers and the daemon are stopped, its directory removed")
        sys.exit(130)
