"""The processes of bench/arbiter_mix.py: inference services, the repair flood, lease cyclers.

Each ``*_worker`` runs in its own OS process (multiprocessing, forkserver) and
talks to the parent over one duplex pipe: it connects, answers "ready", waits
for ``(start_ns, end_ns)`` (``time.monotonic_ns()``, one clock for every
process on Linux), works, and sends back its records as plain tuples.

- A service (ASR, NMT) follows a seeded open-loop schedule of arrivals: one
  worker, one request at a time, as a service with one model instance does; a
  request whose arrival is already past when the previous one ends starts at
  once (its lateness is recorded, never hidden).
- The repair flood issues SEMANTIC_REPAIR requests back to back until the end.
- A GPU section is simulated: ``time.sleep(hold)`` while holding the lease (or
  the flock). Concurrent holders therefore never slow each other down, which
  a real GPU would do: only waits are measured here, not service times.
- The gate is gpud (``Client.lease``, the real user path, with the declared
  memory) or the baseline a team would write instead: ``fcntl.flock`` on one
  file, blocking for ASR/NMT, ``LOCK_NB`` polled until max_wait for the repair.

It never reads a real GPU and decides nothing about the lock: gpud or the
kernel's flock does.
"""

from __future__ import annotations

import fcntl
import os
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe

from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.connection import Connection

GIB = 2**30
# (t_sched, t_call, t_answer, t_release) ns; status; reason; the daemon's queue_wait_ms (None: flock)
Record = tuple[int, int, int, int, str, str | None, float | None]


@dataclass(frozen=True, kw_only=True)
class Stream:
    """One service's requests. ``rate_per_s`` None: back to back (the flood)."""

    task_type: str
    rate_per_s: float | None
    hold_ms: tuple[float, float]  # uniform
    mem_gib: float
    max_wait_ms: int  # the task type's default policy; used by the flock baseline only


@dataclass(frozen=True, kw_only=True)
class Gate:
    """gpud at ``socket``, or flock on ``lock_path`` (polled every ``poll_ms`` by SKIP tasks)."""

    kind: str  # "gpud" | "flock"
    socket: str = ""
    lock_path: str = ""
    poll_ms: float = 5.0


def schedule(stream: Stream, seed: int, seconds: float) -> list[tuple[int, int]]:
    """Poisson arrivals: (offset ns from the start, hold ns), the same for every run with one seed."""
    assert stream.rate_per_s is not None
    rng = random.Random(f"{seed}:{stream.task_type}:arrivals")
    out: list[tuple[int, int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(stream.rate_per_s)
        if t >= seconds:
            return out
        out.append((round(t * 1e9), round(rng.uniform(*stream.hold_ms) * 1e6)))


def _sleep_until(t_ns: int) -> None:
    delay = (t_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)


class _GpudSection:
    def __init__(self, gate: Gate, stream: Stream, name: str) -> None:
        self.client = Client(gate.socket, name=name)
        self.stream = stream
        self.mem = round(stream.mem_gib * GIB)

    def run(self, index: int, hold_ns: int) -> tuple[int, int, int, str, str | None, float | None]:
        task = self.stream.task_type
        trace = {"job_id": "arbiter-mix", "utterance_index": index, "stage": task}
        t_call = time.monotonic_ns()
        with self.client.lease("gpu:0", task, mem_estimate=self.mem, trace=trace) as r:
            t_answer = time.monotonic_ns()
            t_release = 0
            if r.acquired:
                time.sleep(hold_ns / 1e9)
                t_release = time.monotonic_ns()  # the lease's RELEASE is sent right after
        reason = None if r.reason is None else str(r.reason)
        return t_call, t_answer, t_release, str(r.status), reason, r.queue_wait_ms

    def close(self) -> None:
        self.client.close()


class _FlockSection:
    """What a team writes instead: one lock file per GPU, flock around the GPU call."""

    def __init__(self, gate: Gate, stream: Stream, name: str) -> None:
        self.fd = os.open(gate.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        self.skip = stream.task_type == "SEMANTIC_REPAIR"
        self.max_wait_ns = stream.max_wait_ms * 1_000_000
        self.poll_s = gate.poll_ms / 1000

    def _take(self) -> bool:
        if not self.skip:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            return True
        deadline = time.monotonic_ns() + self.max_wait_ns
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic_ns() >= deadline:
                    return False
                time.sleep(self.poll_s)

    def run(self, index: int, hold_ns: int) -> tuple[int, int, int, str, str | None, float | None]:
        t_call = time.monotonic_ns()
        got = self._take()
        t_answer = time.monotonic_ns()
        if not got:
            return t_call, t_answer, 0, "SKIPPED", "TIMEOUT", None
        try:
            time.sleep(hold_ns / 1e9)
            t_release = time.monotonic_ns()
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        return t_call, t_answer, t_release, "ACQUIRED", None, None

    def close(self) -> None:
        os.close(self.fd)


def _section(gate: Gate, stream: Stream, name: str) -> _GpudSection | _FlockSection:
    return _GpudSection(gate, stream, name) if gate.kind == "gpud" else _FlockSection(gate, stream, name)


def service_worker(gate: Gate, stream: Stream, arrivals: list[tuple[int, int]], pipe: Pipe) -> None:
    """An inference service: one request at a time, on the seeded schedule."""
    section = _section(gate, stream, stream.task_type.lower())
    try:
        pipe.send("ready")
        start_ns, _ = pipe.recv()
        records: list[Record] = []
        for index, (offset, hold_ns) in enumerate(arrivals):
            t_sched = start_ns + offset
            _sleep_until(t_sched)
            records.append((t_sched, *section.run(index, hold_ns)))
    finally:
        section.close()
    pipe.send(records)


def flood_worker(gate: Gate, stream: Stream, seed: int, worker: int, pipe: Pipe) -> None:
    """The repair flood: one request after another until the end."""
    rng = random.Random(f"{seed}:{stream.task_type}:{worker}:holds")
    section = _section(gate, stream, f"{stream.task_type.lower()}-{worker}")
    try:
        pipe.send("ready")
        start_ns, end_ns = pipe.recv()
        _sleep_until(start_ns)
        records: list[Record] = []
        index = 0
        while (now := time.monotonic_ns()) < end_ns:
            hold_ns = round(rng.uniform(*stream.hold_ms) * 1e6)
            records.append((now, *section.run(index, hold_ns)))
            index += 1
    finally:
        section.close()
    pipe.send(records)


def cycle_worker(socket: str, bare: bool, queue_limit: int, pipe: Pipe) -> None:
    """Acquire + release as fast as possible (hold zero): cycles done by the end, refusals, CPU seconds used.

    Client library: ``with client.lease(...)`` (one round trip: the release is
    sent without waiting for its OK). Bare: ACQUIRE and RELEASE each waited for."""
    if bare:
        conn = Connection(socket)
        conn.hello("cycler")
    else:
        client = Client(socket, name="cycler")
    pipe.send("ready")
    start_ns, end_ns = pipe.recv()
    _sleep_until(start_ns)
    cpu0 = time.process_time()  # every thread of this process: the reader thread too
    cycles = skipped = 0
    while True:
        if bare:
            r = conn.call(p.Acquire(id=conn.next_id(), gpu="gpu:0", task_type="OTHER", queue_limit=queue_limit))
            if r.acquired:
                conn.call(p.Release(id=conn.next_id(), lease_id=r.lease_id))
        else:  # the idiomatic user path: the context manager, which releases without waiting for OK
            with client.lease("gpu:0", "OTHER", queue_limit=queue_limit) as r:
                pass
        if time.monotonic_ns() > end_ns:
            break
        if r.acquired:
            cycles += 1
        else:
            skipped += 1
    cpu = time.process_time() - cpu0
    (conn if bare else client).close()
    pipe.send((cycles, skipped, cpu))
