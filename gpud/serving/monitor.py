"""Periodic observation: NVML probes, GPU health, and the per-GPU, per-tenant and per-session gauges.

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

import time
from collections.abc import Iterator, Mapping
from typing import Protocol, cast

import structlog
import trio

from gpud.core.health import GpuHealth, HealthyAgain, Probe, Unhealthy
from gpud.core.ledger import UNIT
from gpud.host.devices import Gpu, Reading
from gpud.host.metrics import session_labels
from gpud.kit.effects import Effects
from gpud.kit.state import ClientLink
from gpud.serving.server import Daemon
from gpud_client.proctl.tree import ProcessTree, read_stat
from gpud_client.runinfo import PID as RUN_PID

log = structlog.get_logger(__name__)
_DONE = object()


class Sampler(Protocol):
    """Reads one GPU, blocking (``gpud.host.devices.NvmlSampler``)."""

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
                now = self.daemon.now()
                due = self._tick(now)
                if now >= next_publish:
                    next_publish = now + _interval_us(self.daemon)
                    await self._publish()
                deadline = next_publish if due is None else min(next_publish, due)
                with trio.move_on_after(max(0.0, (deadline - self.daemon.now()) / 1e6)):
                    await self._wake.wait()

    def _tick(self, now: int) -> int | None:
        """Start the probes due, judge the ones out too long; returns when they next need it."""
        interval = _interval_us(self.daemon)
        try:
            self.health.set_interval(interval)
            self.effects.carry_out(self.health.advance(now), now)
            return self.health.next_deadline()
        except Exception as exc:  # this tick is skipped; the next one, an interval on, tries again
            self.daemon.faults.record("monitor", exc)
            return now + interval

    async def _publish(self) -> None:
        """Refresh the gauges, yielding to the loop between steps (``publish``); a step that
        fails skips the rest of this refresh, and the next one tries again."""
        try:
            rest = publish(self.daemon)  # its first step is done
            while rest is not None:
                await trio.lowlevel.checkpoint()
                if next(rest, _DONE) is _DONE:
                    break
        except Exception as exc:
            self.daemon.faults.record("monitor", exc)

    async def _probe(self, gpu: Gpu) -> None:
        assert self.sampler is not None
        try:
            reading = await trio.to_thread.run_sync(
                self.sampler.sample_gpu,
                gpu,
                abandon_on_cancel=True,
                limiter=self._limiter,
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
        slot.memory_used_bytes = r.memory_used_bytes
        m.memory_used.labels(r.index).set(r.memory_used_bytes)
        m.utilization.labels(r.index).set(r.utilization_ratio)
        daemon.allocations.observe_utilization(r.index, r.utilization_ratio, now)
        for sid, conn in list(daemon.links.owners.items()):
            used = process_memory(r.process_memory or {}, conn)
            if used is not None and conn.sessions.get(sid) == r.index and not daemon.leases.owns(sid):
                daemon.locks.report_memory(slot, sid, used, now)
                # At once, as the GPU's own gauges: the reading came between two refreshes.
                labels = session_labels(r.index, sid, conn.name, conn.pid)
                m.session_memory.labels(*labels).set(slot.scheduler.session(sid, now).mem_used or 0)


def process_memory(per_pid: Mapping[int, int], conn: ClientLink) -> int | None:
    """What a client's processes hold on the GPU: its own (the peer pid), or for a run (``gpuctl run``)
    its program's whole tree. The run names its program's pid (a HELLO label); it is believed only
    for a grandchild of the run (the run, its keeper, the program), so no client counts another's."""
    program = _run_program(conn)
    if program is None:
        return per_pid.get(conn.pid)
    tree = [program, *ProcessTree(program).pids()]
    held = [per_pid[pid] for pid in tree if pid in per_pid]
    return sum(held) if held else None


def _run_program(conn: ClientLink) -> int | None:
    text = conn.labels.get(RUN_PID, "")
    program = read_stat(int(text)) if text.isdigit() else None
    if program is None:
        return None
    keeper = read_stat(program.ppid)
    return program.pid if keeper is not None and keeper.ppid == conn.pid else None


# A refresh step: at most this many sessions, and no more than this long (a slow or loaded host),
# before the monitor yields to the loop. About 13 us a session: ~1 ms a step, which a request
# that comes meanwhile waits at most (bench/scale.py: the lock cycle's p99 and max at 10 000).
REFRESH_SESSIONS = 128
REFRESH_STEP_S = 0.001
_TIMED_AFTER = 32  # sessions a step does before its time counts: a few sessions are always done at once


def publish(daemon: Daemon, *, sessions: int | None = None, step_s: float | None = None) -> Iterator[None]:
    """Refresh the gauges that describe state rather than events, in steps bounded in sessions and
    time, so that 10 000 sessions never hold the event loop for long: the GPUs' gauges and the
    first step now, each further step when the returned iterator is advanced (the monitor yields
    to the loop in between; ``for _ in publish(daemon): pass`` does it all at once, and up to
    ``_TIMED_AFTER`` sessions are always done by the call alone). One pass over the sessions,
    whatever the number of GPUs.

    State changes between steps, and the gauges stay right: a session gone since the pass began
    is skipped (its series went with it, ``Metrics.forget_session``), one attached meanwhile waits
    for the next pass; a session's figures are read in the step that sets them, and a lifted
    memory limit loses its series. Last, a backstop: series of sessions no longer there are
    removed."""
    steps = _refresh(
        daemon, REFRESH_SESSIONS if sessions is None else sessions, REFRESH_STEP_S if step_s is None else step_s
    )
    next(steps, None)
    return steps


def _refresh(daemon: Daemon, per_step: int, step_s: float) -> Iterator[None]:
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
            daemon.allocations.observe_utilization(gpu, 1.0 if view.holders else 0.0, now)
            m.memory_used.labels(gpu).set(view.memory_in_use_bytes if view.holders else 0)
        m.allocated.labels(gpu).set((UNIT - daemon.allocations.ledger.gpu_free(gpu)) / UNIT)
        m.parked.labels(gpu).set(slot.scheduler.parked_bytes())
        m.draining.labels(gpu).set(1 if slot.draining else 0)
    suspended = daemon.allocations.ledger.suspended_count()
    m.allocations.set(daemon.allocations.ledger.allocation_count() - suspended)
    m.suspended.set(suspended)
    _publish_tenants(daemon)
    children = m.session_children
    limits = _series(m.session_memory_limit)
    done, began = 0, time.perf_counter()
    # Few objects that outlive a step (lists of references, no tuple per session): whatever
    # survives a collection is counted towards the next full one, which at 10 000 sessions
    # holds the loop far longer than a step.
    for conn in list(daemon.links.connections.values()):
        for sid in list(conn.sessions):
            if done >= per_step or (done >= _TIMED_AFTER and time.perf_counter() - began > step_s):
                yield
                done, began = 0, time.perf_counter()
                now = daemon.now()
                daemon.settle_all(now)  # this step's figures are up to its own now
            done += 1
            on = conn.sessions.get(sid)
            if on is None or conn.closing or daemon.leases.owns(sid):
                continue  # gone since the pass began (its series with it), or a lease
            v = daemon.slots[on].scheduler.session(sid, now)
            labels = session_labels(on, sid, conn.name, conn.pid)
            series = children.get(labels)
            if series is None:
                series = children[labels] = (
                    m.session_core_limit.labels(*labels),
                    m.session_window_used.labels(*labels),
                    m.session_throttled.labels(*labels),
                    m.session_memory.labels(*labels),
                    m.session_share.labels(*labels),
                )
            series[0].set(v.core_limit / 100)
            series[1].set(v.used_us / 1e6)
            series[2].set(1 if v.throttled else 0)
            series[3].set(v.mem_used or 0)
            series[4].set(v.recent_share_percent / 100)
            if v.mem_limit is not None:
                m.session_memory_limit.labels(*labels).set(v.mem_limit)
            elif labels in limits:
                m.session_memory_limit.remove(*labels)  # the limit was lifted
    # A backstop: a session's series go with it (``Metrics.forget_session``, also when its
    # connection's cleanup failed), so more sessions with series than sessions attached means
    # some were missed; only then are they looked for, in steps (the next pass finds any that
    # a session attached meanwhile, still without series, left uncounted).
    if len(children) <= len(daemon.links.owners) - len(daemon.leases.by_sid):
        return
    keyed: list[Mapping[tuple[str, ...], object]] = [children, *(_series(g) for g in m.session_gauges)]
    for series_of in keyed:
        for i, gone in enumerate(list(series_of)):
            if i and i % (4 * per_step) == 0:
                yield
            if gone in series_of and not _live(daemon, gone):
                m.forget_session(cast("tuple[str, str, str, str]", gone))


def _publish_tenants(daemon: Daemon) -> None:
    """Each configured tenant's quota, borrowing limit and use; a tenant a reload removed loses its series."""
    m = daemon.metrics.node
    tenants = daemon.config.tenants
    for name, t in tenants.items():
        m.tenant_quota.labels(name).set(t.gpus)
        m.tenant_borrow_limit.labels(name).set(t.borrow)
        m.tenant_allocated.labels(name).set(daemon.allocations.ledger.tenant_usage(name) / UNIT)
    for gauge in m.tenant_gauges:
        for (name,) in [k for k in _series(gauge) if k[0] not in tenants]:
            gauge.remove(name)


def _live(daemon: Daemon, labels: tuple[str, ...]) -> bool:
    """Whether these are the labels of a session that is still attached (now, not at the pass's start)."""
    gpu, sid = int(labels[0]), int(labels[1])
    conn = daemon.links.owners.get(sid)
    return (
        conn is not None
        and not conn.closing
        and conn.sessions.get(sid) == gpu
        and not daemon.leases.owns(sid)
        and session_labels(gpu, sid, conn.name, conn.pid) == labels
    )


def _series(gauge: object) -> dict[tuple[str, ...], object]:
    """A labelled gauge's series by label values (prometheus-client keeps them so)."""
    found: dict[tuple[str, ...], object] = getattr(gauge, "_metrics", {})
    return found
