"""Every Prometheus metric of the daemon, in one class on one registry.

Names follow Prometheus conventions (``gpud_`` prefix, base units). Labels
are bounded: gpu, task_type, status, reason; never a client, job or lease id.
The ``gpu`` label is the index, as dcgm-exporter's is, so the two can be
joined. The shell calls these methods as it carries out the core's effects;
the core itself never sees a metric.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Lease waits and holds of inference calls: from sub-millisecond to a minute.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        gt = ["gpu", "task_type"]
        self.acquire_total = Counter(
            "gpud_arbiter_acquire_total", "Lease acquires by their answer.", [*gt, "status"], registry=registry
        )
        self.queue_wait = Histogram(
            "gpud_arbiter_queue_wait_seconds", "Time from ACQUIRE to its answer.", gt,
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.hold = Histogram(
            "gpud_arbiter_hold_seconds", "Time a lease was held.", gt, buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.queue_length = Gauge(
            "gpud_arbiter_queue_length", "Leases waiting for the GPU now.", gt, registry=registry
        )
        self.timeouts = Counter(
            "gpud_arbiter_timeouts_total", "Leases still waiting at max_wait.", gt, registry=registry
        )
        self.queue_full = Counter(
            "gpud_arbiter_queue_full_total", "Leases refused because the queue was full.", gt, registry=registry
        )
        self.watchdog = Counter(
            "gpud_arbiter_watchdog_exceeded_total", "Leases held past hold_max.", gt, registry=registry
        )
        self.oom = Counter("gpud_gpu_oom_total", "Out-of-memory errors clients reported.", gt, registry=registry)
        self.lock_grants = Counter("gpud_lock_grants_total", "GPU lock grants to sessions.", ["gpu"], registry=registry)
        self.lock_drops = Counter(
            "gpud_lock_drops_total", "DROP_LOCK sent, by reason.", ["gpu", "reason"], registry=registry
        )
        self.lock_revocations = Counter(
            "gpud_lock_revocations_total", "Locks taken away without LOCK_RELEASED.", ["gpu", "reason"],
            registry=registry,
        )
