"""Periodic observation: NVML samples and the per-GPU and per-session gauges.

NVML is read in a worker thread so a stalled driver never blocks scheduling.
Readings feed the metrics, mark GPUs healthy or not (an unhealthy GPU is
logged and shown, never fatal), and report each client process's GPU memory
(found by the peer pid from SO_PEERCRED) to its sessions: the daemon's own
check of memory limits, beside what clients report.
"""

from __future__ import annotations


import structlog
import trio

from gpud.core.ledger import UNIT
from gpud.devices import NvmlSampler, Reading
from gpud.metrics import session_labels
from gpud.server import Daemon


log = structlog.get_logger("gpud.monitor")


async def run_monitor(daemon: Daemon, sampler: NvmlSampler | None) -> None:
    m = daemon.metrics.node
    for slot in daemon.slots:
        g = slot.gpu
        m.gpu_info.labels(g.index, g.uuid, g.name).set(1)
        m.memory_total.labels(g.index).set(g.memory_total_bytes)
        m.gpu_healthy.labels(g.index).set(1)
    while True:
        try:
            readings = await trio.to_thread.run_sync(sampler.sample) if sampler else []
            apply_readings(daemon, readings)
            publish(daemon)
        except Exception as exc:  # this sample is skipped; the next one tries again
            daemon.faults.record("monitor", exc)
        await trio.sleep(daemon.config.monitor_interval_s)  # read each time: a reload changes it


def apply_readings(daemon: Daemon, readings: list[Reading]) -> None:
    m = daemon.metrics.node
    now = daemon.now()
    for r in readings:
        if not 0 <= r.index < len(daemon.slots):
            daemon.faults.often("nvml_reading_ignored", gpu=r.index, reason="no such GPU")
            continue
        slot = daemon.slots[r.index]
        if r.healthy != slot.healthy:
            slot.healthy = r.healthy
            if r.healthy:
                log.info("gpu_healthy_again", gpu=r.index)
            else:
                log.warning("gpu_unhealthy", gpu=r.index, error=r.error)
        m.gpu_healthy.labels(r.index).set(1 if r.healthy else 0)
        if not r.healthy:
            continue
        m.memory_used.labels(r.index).set(r.memory_used_bytes)
        m.utilization.labels(r.index).set(r.utilization_ratio)
        for sid, conn in list(daemon.owners.items()):
            used = (r.process_memory or {}).get(conn.pid)
            if used is not None and conn.sessions.get(sid) == r.index and not daemon.arbiter.owns(sid):
                daemon.carry_out(slot, slot.scheduler.report_memory(sid, used, now), now)


def publish(daemon: Daemon) -> None:
    """Refresh the gauges that describe state rather than events."""
    m = daemon.metrics.node
    now = daemon.now()
    daemon.settle_all(now)
    seen: set[tuple[str, ...]] = set()
    limited: set[tuple[str, ...]] = set()  # sessions with a memory limit: a lifted limit loses its series
    for slot in daemon.slots:
        gpu = slot.gpu.index
        view = slot.scheduler.view(now)
        m.holders.labels(gpu).set(len(view.holders))
        m.queue.labels(gpu).set(len(view.queue))
        if slot.gpu.simulated:
            m.utilization.labels(gpu).set(1.0 if view.holders else 0.0)
            m.memory_used.labels(gpu).set(view.memory_in_use_bytes if view.holders else 0)
        m.allocated.labels(gpu).set((UNIT - daemon.allocator.ledger.gpu_free(gpu)) / UNIT)
        for conn in list(daemon.connections.values()):
            for sid, g in list(conn.sessions.items()):
                if g != gpu or daemon.arbiter.owns(sid):
                    continue
                v = slot.scheduler.session(sid, now)
                labels: tuple[str, ...] = session_labels(gpu, sid, conn.name, conn.pid)
                seen.add(labels)
                m.session_core_limit.labels(*labels).set(v.core_limit / 100)
                m.session_window_used.labels(*labels).set(v.used_us / 1e6)
                m.session_throttled.labels(*labels).set(1 if v.throttled else 0)
                m.session_memory.labels(*labels).set(v.mem_used or 0)
                if v.mem_limit is not None:
                    limited.add(labels)
                    m.session_memory_limit.labels(*labels).set(v.mem_limit)
    for gauge in m.session_gauges:
        keep = limited if gauge is m.session_memory_limit else seen
        for labels in list(_label_sets(gauge)):  # a session's series go with it
            if labels not in keep:
                gauge.remove(*labels)
    m.allocations.set(len(daemon.allocator.ledger.allocations()))


def _label_sets(gauge: object) -> list[tuple[str, ...]]:
    return list(getattr(gauge, "_metrics", {}).keys())
