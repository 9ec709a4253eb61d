"""Periodic observation: NVML probes, GPU health, and the per-GPU and per-session gauges.

Each real GPU is read in a worker thread of its own (a probe), so a GPU whose
NVML call hangs delays neither the other GPUs' readings, nor the gauges, nor the
event loop. When to probe and when a GPU is unhealthy is decided by
``gpud.core.health``: never two probes of one GPU out at once (a hung driver
call holds one thread, not a growing pile); unhealthy once a probe has been out
for 1.5 monitor intervals or raised; healthy again when a probe returns. A probe
is abandoned when the monitor is cancelled, and trio's worker threads are daemon
threads, so shutdown never waits for a call that will not return.

Readings feed the metrics and report each client process's GPU memory (found by
the peer pid from SO_PEERCRED) to its sessions: the daemon's own check of memory
limits, beside what clients report. Health changes are logged once each,
set ``gpud_gpu_healthy`` and ``slot.healthy`` (shown by STATUS); an unhealthy
GPU is never fatal and keeps being scheduled.
"""

from __future__ import annotations

from typing import Protocol

import structlog
import trio

from gpud.core.health import GpuHealth, HealthyAgain, Probe, Unhealthy
from gpud.core.ledger import UNIT
from gpud.devices import Gpu, Reading
from gpud.effects import Effects
from gpud.metrics import session_labels
from gpud.server import Daemon


log = structlog.get_logger("gpud.monitor")


class Sampler(Protocol):
    """Reads one GPU, blocking (``gpud.devices.NvmlSampler``)."""

    @property
    def gpus(self) -> list[Gpu]: ...

    def sample_gpu(self, gpu: Gpu) -> Reading: ...


async def run_monitor(daemon: Daemon, sampler: Sampler | None) -> None:
    await Monitor(daemon, sampler).run()


def _interval_us(daemon: Daemon) -> int:
    return max(1, round(daemon.config.monitor_interval_s * 1_000_000))  # read each time: a reload changes it


class Monitor:
    """Starts the probes the health rules ask for, carries out their verdicts, refreshes the gauges."""

    def __init__(self, daemon: Daemon, sampler: Sampler | None) -> None:
        self.daemon = daemon
        self.sampler = sampler
        self._gpus = {g.index: g for g in sampler.gpus} if sampler is not None else {}
        self.health = GpuHealth(self._gpus, interval_us=_interval_us(daemon), now=daemon.now())
        # At most one thread per GPU is ever out; a limiter of our own keeps hung ones
        # from holding tokens of trio's default limiter, which other work shares.
        self._limiter = trio.CapacityLimiter(max(1, len(self._gpus)))
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.effects = Effects(daemon.faults)  # this monitor's own: its probes run in its nursery
        self.effects.on(Probe, self._start_probe)
        self.effects.on(Unhealthy, self._unhealthy)
        self.effects.on(HealthyAgain, self._healthy_again)

    async def run(self) -> None:
        m = self.daemon.metrics.node
        for slot in self.daemon.slots:
            g = slot.gpu
            m.gpu_info.labels(g.index, g.uuid, g.name).set(1)
            m.memory_total.labels(g.index).set(g.memory_total_bytes)
            m.gpu_healthy.labels(g.index).set(1 if slot.healthy else 0)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            next_publish = self.daemon.now()
            while True:
                self._wake = trio.Event()
                deadline, next_publish = self._tick(next_publish)
                with trio.move_on_after(max(0.0, (deadline - self.daemon.now()) / 1e6)):
                    await self._wake.wait()

    def _tick(self, next_publish: int) -> tuple[int, int]:
        """Start the probes due, judge the ones out too long, refresh the gauges when
        due; returns when to wake next and when to refresh next."""
        now = self.daemon.now()
        interval = _interval_us(self.daemon)
        try:
            self.health.set_interval(interval)
            self.effects.carry_out(self.health.advance(now), now)
            due = self.health.next_deadline()
        except Exception as exc:  # this tick is skipped; the next one, an interval on, tries again
            self.daemon.faults.record("monitor", exc)
            due = now + interval
        if now >= next_publish:
            next_publish = now + interval
            try:
                publish(self.daemon)
            except Exception as exc:  # this refresh is skipped; the next one tries again
                self.daemon.faults.record("monitor", exc)
        return (next_publish if due is None else min(next_publish, due)), next_publish

    async def _probe(self, gpu: Gpu) -> None:
        assert self.sampler is not None
        try:
            reading = await trio.to_thread.run_sync(
                self.sampler.sample_gpu, gpu, abandon_on_cancel=True, limiter=self._limiter,
                thread_name=f"gpud nvml gpu {gpu.index}",
            )
        except Exception as exc:  # a sampler that raises: this GPU's call failed
            reading = Reading(gpu.index, False, error=f"{type(exc).__name__}: {exc}")
        error = None if reading.healthy else (reading.error or "NVML error")
        try:
            now = self.daemon.now()
            self.effects.carry_out(self.health.finished(gpu.index, now, error), now)
            if reading.healthy:
                apply_readings(self.daemon, [reading])
        except Exception as exc:  # this reading is skipped; the next one tries again
            self.daemon.faults.record("monitor", exc, gpu=gpu.index)
        self._wake.set()  # its next probe may be due before the monitor's sleep ends

    def _start_probe(self, e: Probe, now: int) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._probe, self._gpus[e.gpu])

    def _unhealthy(self, e: Unhealthy, now: int) -> None:
        _show_health(self.daemon, e.gpu, False)
        extra = {} if e.hung_us is None else {"hung_ms": e.hung_us // 1000}
        log.warning("gpu_unhealthy", gpu=e.gpu, reason=e.reason, **extra)

    def _healthy_again(self, e: HealthyAgain, now: int) -> None:
        _show_health(self.daemon, e.gpu, True)
        log.info("gpu_healthy_again", gpu=e.gpu, unhealthy_ms=e.unhealthy_us // 1000)


def _show_health(daemon: Daemon, index: int, healthy: bool) -> None:
    if 0 <= index < len(daemon.slots):
        daemon.slots[index].healthy = healthy
        daemon.metrics.node.gpu_healthy.labels(index).set(1 if healthy else 0)


def apply_readings(daemon: Daemon, readings: list[Reading]) -> None:
    """Gauges and per-process memory from healthy readings, at once (health itself
    is the health rules' to decide: see ``Monitor._unhealthy`` and ``_healthy_again``)."""
    m = daemon.metrics.node
    now = daemon.now()
    for r in readings:
        if not 0 <= r.index < len(daemon.slots):
            daemon.faults.often("nvml_reading_ignored", gpu=r.index, reason="no such GPU")
            continue
        if not r.healthy:
            continue
        slot = daemon.slots[r.index]
        m.memory_used.labels(r.index).set(r.memory_used_bytes)
        m.utilization.labels(r.index).set(r.utilization_ratio)
        for sid, conn in list(daemon.links.owners.items()):
            used = (r.process_memory or {}).get(conn.pid)
            if used is not None and conn.sessions.get(sid) == r.index and not daemon.arbiter.owns(sid):
                daemon.locks.report_memory(slot, sid, used, now)
                # At once, as the GPU's own gauges: the reading came between two refreshes.
                labels = session_labels(r.index, sid, conn.name, conn.pid)
                m.session_memory.labels(*labels).set(slot.scheduler.session(sid, now).mem_used or 0)


def publish(daemon: Daemon) -> None:
    """Refresh the gauges that describe state rather than events: one pass over the sessions,
    whatever the number of GPUs, and only the series of sessions gone since are removed."""
    m = daemon.metrics.node
    now = daemon.now()
    daemon.settle_all(now)
    for slot in daemon.slots:
        gpu = slot.gpu.index
        view = slot.scheduler.view(now)
        m.holders.labels(gpu).set(len(view.holders))
        m.queue.labels(gpu).set(len(view.queue))
        if slot.gpu.simulated:
            m.utilization.labels(gpu).set(1.0 if view.holders else 0.0)
            m.memory_used.labels(gpu).set(view.memory_in_use_bytes if view.holders else 0)
        m.allocated.labels(gpu).set((UNIT - daemon.allocator.ledger.gpu_free(gpu)) / UNIT)
    seen: set[tuple[str, ...]] = set()
    limited: set[tuple[str, ...]] = set()  # sessions with a memory limit: a lifted limit loses its series
    children = m.session_children
    for conn in list(daemon.links.connections.values()):
        for sid, gpu in list(conn.sessions.items()):
            if daemon.arbiter.owns(sid):
                continue
            v = daemon.slots[gpu].scheduler.session(sid, now)
            labels: tuple[str, ...] = session_labels(gpu, sid, conn.name, conn.pid)
            seen.add(labels)
            series = children.get(labels)
            if series is None:
                series = children[labels] = (
                    m.session_core_limit.labels(*labels), m.session_window_used.labels(*labels),
                    m.session_throttled.labels(*labels), m.session_memory.labels(*labels),
                )
            series[0].set(v.core_limit / 100)
            series[1].set(v.used_us / 1e6)
            series[2].set(1 if v.throttled else 0)
            series[3].set(v.mem_used or 0)
            if v.mem_limit is not None:
                limited.add(labels)
                m.session_memory_limit.labels(*labels).set(v.mem_limit)
    for gone in [labels for labels in children if labels not in seen]:
        del children[gone]
    for gauge in m.session_gauges:
        keep = limited if gauge is m.session_memory_limit else seen
        for labels in _label_sets(gauge):  # a session's series go with it
            if labels not in keep:
                gauge.remove(*labels)
    m.allocations.set(len(daemon.allocator.ledger.allocations()))


def _label_sets(gauge: object) -> list[tuple[str, ...]]:
    return list(getattr(gauge, "_metrics", {}).keys())
