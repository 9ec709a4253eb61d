"""A simulated processor-sharing GPU for the benchmarks: k kernels in flight each progress at 1/k.

How it works: one process owns the device. Each client has its own pipe; it
sends the work of one kernel (nanoseconds of full-device time) and blocks
until the device answers that the kernel has completed, like a launch followed
by a synchronize. The device runs in real time and is event driven: at every
arrival and every completion it recomputes when the next in-flight kernel
completes and sleeps until then or until the next arrival (``select`` with a
microsecond timeout; the process asks Linux for a 1 us timer slack).

Service is exact in virtual time. An arrival is stamped when the device reads
it. If the device wakes late, every completion is placed at the instant it was
due and the kernels left are served at their new rate from that instant on;
only the completion notice is late (as a sync's latency on a real GPU is), and
the client's next kernel arrives that much later. Every stretch of constant
occupancy is logged as ``(t0, t1, clients in flight)``, so a client's GPU time
over any interval is exact: the sum of each overlap / k (partial kernels are
clipped by the service they actually received, not by completion time).

What it models, and nothing more: time sharing of one device among the kernels
in flight, with no memory, no context-switch cost and no preemption grain. It
never reads a real GPU and never decides anything about locks: gpud does that.
"""

from __future__ import annotations

import ctypes
import select
import struct
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

Segment = tuple[float, float, tuple[int, ...]]  # (t0 ns, t1 ns, clients in flight)

_WORK = struct.Struct("q")
_DONE = struct.Struct("d")
_PR_SET_TIMERSLACK = 29


def _tight_timer_slack() -> None:
    """Ask for 1 us of timer slack (default 50 us) so completions are timely."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the default slack only delays completion notices


class _Device:
    def __init__(self) -> None:
        self.remaining: dict[int, float] = {}  # client -> work left, ns of full-device time
        self.last = float(time.monotonic_ns())
        self.log: list[Segment] = []
        self.done: list[tuple[int, float]] = []  # completions to notify: (client, instant)

    def next_completion(self) -> float | None:
        if not self.remaining:
            return None
        return self.last + min(self.remaining.values()) * len(self.remaining)

    def advance(self, now: float) -> None:
        """Serve every kernel in flight up to ``now``, completions in their exact order."""
        while self.remaining:
            due = self.next_completion()
            assert due is not None
            if due > now:
                break
            self._serve(due)
            for client in [c for c, left in self.remaining.items() if left <= 1e-6]:
                del self.remaining[client]
                self.done.append((client, due))
        if self.remaining and now > self.last:
            self._serve(now)
        self.last = max(self.last, now)

    def _serve(self, until: float) -> None:
        span = until - self.last
        members = tuple(sorted(self.remaining))
        for c in members:
            self.remaining[c] -= span / len(members)
        prev = self.log[-1] if self.log else None
        if prev is not None and prev[2] == members and prev[1] == self.last:
            self.log[-1] = (prev[0], until, members)
        else:
            self.log.append((self.last, until, members))
        self.last = until

    def arrive(self, client: int, work_ns: int, now: float) -> None:
        if client in self.remaining:
            raise RuntimeError(f"client {client} submitted a kernel while its previous one was in flight")
        self.remaining[client] = float(max(1, work_ns))


def serve(pipes: list[Pipe], control: Pipe) -> None:
    """The device process: serve kernels until ``control`` says stop, then send the log."""
    _tight_timer_slack()
    dev = _Device()
    by_fd = {pipe.fileno(): i for i, pipe in enumerate(pipes)}
    open_fds = set(by_fd) | {control.fileno()}
    while True:
        due = dev.next_completion()
        timeout = None if due is None else max(0.0, (due - time.monotonic_ns()) / 1e9)
        readable, _, _ = select.select(sorted(open_fds), [], [], timeout)
        now = float(time.monotonic_ns())
        dev.advance(now)
        for client, at in dev.done:
            pipes[client].send_bytes(_DONE.pack(at))
        dev.done.clear()
        for fd in readable:
            if fd == control.fileno():
                control.recv()  # "stop"
                control.send(dev.log)
                return
            try:
                data = pipes[by_fd[fd]].recv_bytes()
            except EOFError:
                open_fds.discard(fd)  # that client is gone; its kernel, if any, runs out
                continue
            dev.arrive(by_fd[fd], _WORK.unpack(data)[0], now)


class Kernels:
    """A client's handle on the device (lives in the client process)."""

    def __init__(self, pipe: Pipe) -> None:
        self.pipe = pipe

    def run(self, work_ns: int) -> float:
        """Launch one kernel of ``work_ns`` and wait for it; returns its completion instant (ns)."""
        self.pipe.send_bytes(_WORK.pack(work_ns))
        done: float = _DONE.unpack(self.pipe.recv_bytes())[0]
        return done


@dataclass
class SimGpu:
    """The parent's handle: start the device process, hand out client ends, stop and read the log."""

    process: Any
    control: Pipe
    client_ends: list[Pipe]

    @classmethod
    def start(cls, ctx: Any, clients: int) -> SimGpu:
        device_ends, client_ends = [], []
        for _ in range(clients):
            a, b = ctx.Pipe(duplex=True)
            device_ends.append(a)
            client_ends.append(b)
        control, device_control = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=serve, args=(device_ends, device_control), name="simgpu", daemon=True)
        proc.start()
        for pipe in device_ends:  # the device process has its own copies now
            pipe.close()
        device_control.close()
        return cls(proc, control, client_ends)

    def stop(self, timeout: float = 10.0) -> list[Segment]:
        self.control.send("stop")
        if not self.control.poll(timeout):
            raise RuntimeError("the simulated GPU did not answer stop")
        log: list[Segment] = self.control.recv()
        self.process.join(5)
        return log

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


def gpu_time_ns(log: list[Segment], client: int, start: float, end: float) -> float:
    """Service ``client`` received within [start, end): each overlap / k."""
    total = 0.0
    for t0, t1, members in log:
        if client in members:
            overlap = min(t1, end) - max(t0, start)
            if overlap > 0:
                total += overlap / len(members)
    return total


def busy_ns(log: list[Segment], start: float, end: float) -> float:
    """Time within [start, end) with at least one kernel in flight."""
    return sum(max(0.0, min(t1, end) - max(t0, start)) for t0, t1, members in log if members)
