"""Every Prometheus metric of the daemon, in one class on one registry.

Names follow Prometheus conventions (``gpud_`` prefix, base units). Labels
are bounded: gpu, task_type, status, reason, tenant (configured tenants only);
never a client, job or lease id (but on the per-session gauges).
The ``gpu`` label is the index, as dcgm-exporter's is, so the two can be
joined. The shell calls these methods as it carries out the core's effects;
the core itself never sees a metric.

Every label value known in advance (GPUs, reasons, codes, message types, caps,
configured task types and tenants) gets its series at start (``prime``), as Prometheus
advises: series exist from the first scrape, and what clients send later adds
none (only the per-session gauges, which go with their sessions).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpud.host.cells import CounterCells, GaugeCells, HistogramCells
from gpud_client import protocol as p

# Label values of the daemon's own counters, created up front.
FAULT_PLACES = (
    "request",
    "connection",
    "close",
    "effect",
    "timer",
    "reaper",
    "allocator",
    "monitor",
    "watchdog",
    "reload",
    "runs",
)
CAPS = (
    "max_connections",
    "max_connections_per_uid",
    "max_sessions_per_connection",
    "max_lock_queue",
    "max_allocation_waiters",
    "max_allocations_per_uid",
    "max_allocation_waits_per_uid",
    "max_allocation_records_per_uid",
)
# Signals gpud sends to processes it holds, by signal and why (docs/security.md).
SIGNALS = ("SIGTERM", "SIGKILL")
SIGNAL_WHYS = ("preempt_notice", "preempt_grace_over")
DROPPED = ("too_slow", "peer_gone", "no_hello", "task_socket_closed")
# Why gpud takes an allocation back (``lost`` is the client library's word, never gpud's).
PREEMPT_REASONS = tuple(str(r) for r in p.PreemptReason if r != p.PreemptReason.LOST)
ALLOCATION_RESULTS = ("granted", "repeated", "insufficient", "withdrawn")
# A task told to leave after it was taken back this many times already (without ending in between)
# is counted in gpud_preemptions_repeated_total: the same work taken back again and again.
REPEATED_AFTER = 2

# Lease waits and holds of inference calls: from sub-millisecond to a minute.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Allocation waits: at once, or behind a victim's grace (30 s by default), up to an hour's queue.
_ALLOCATION_WAIT_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        gt = ["gpu", "task_type"]
        # Updated on every lease and lock cycle: cells (gpud.host.cells), not prometheus_client's locked metrics.
        self.acquire_total = CounterCells(
            "gpud_arbiter_acquire_total", "Lease acquires by their answer.", [*gt, "status"], registry
        )
        self.queue_wait = HistogramCells(
            "gpud_arbiter_queue_wait_seconds",
            "Time an ACQUIRE waited in the queue for its answer (0: at once).",
            gt,
            registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.hold = HistogramCells(
            "gpud_arbiter_hold_seconds", "Time a lease was held.", gt, registry, buckets=_LATENCY_BUCKETS
        )
        self.queue_length = GaugeCells("gpud_arbiter_queue_length", "Leases waiting for the GPU now.", gt, registry)
        self.timeouts = CounterCells("gpud_arbiter_timeouts_total", "Leases still waiting at max_wait.", gt, registry)
        self.queue_full = CounterCells(
            "gpud_arbiter_queue_full_total", "Leases refused because the queue was full.", gt, registry
        )
        self.watchdog = CounterCells("gpud_arbiter_watchdog_exceeded_total", "Leases held past hold_max.", gt, registry)
        self.oom = Counter("gpud_gpu_oom_total", "Out-of-memory errors clients reported.", gt, registry=registry)
        self.lock_grants = CounterCells("gpud_lock_grants_total", "GPU lock grants to sessions.", ["gpu"], registry)
        self.lock_drops = CounterCells(
            "gpud_lock_drops_total", "DROP_LOCK sent, by reason.", ["gpu", "reason"], registry
        )
        self.lock_revocations = CounterCells(
            "gpud_lock_revocations_total", "Locks taken away without LOCK_RELEASED.", ["gpu", "reason"], registry
        )
        self.node = NodeMetrics(registry)

    def prime(self, gpus: list[int]) -> None:
        """Create the series whose label values are known now (see the module comment)."""
        for gpu in gpus:
            self.lock_grants.labels(gpu)
            for drop in p.DropReason:
                self.lock_drops.labels(gpu, str(drop))
            for revoke in p.RevokeReason:
                self.lock_revocations.labels(gpu, str(revoke))
            for histogram in (self.node.lock_wait, self.node.lock_hold, self.node.drop_to_release):
                histogram.labels(gpu)
        n = self.node
        for kind in p.CLIENT_TYPES:
            n.messages.labels(kind)
        for code in p.ErrorCode:
            n.protocol_errors.labels(str(code))
        for where in FAULT_PLACES:
            n.faults.labels(where)
        for cap in CAPS:
            n.limit_refusals.labels(cap)
            n.connections_refused.labels(cap)
        for reason in DROPPED:
            n.connections_dropped.labels(reason)
        for sig in SIGNALS:
            for why in SIGNAL_WHYS:
                n.signals_sent.labels(sig, why)
        for result in ALLOCATION_RESULTS:
            n.allocation_requests.labels(result)
        for reason in PREEMPT_REASONS:
            n.preemption_overruns.labels(reason)
            n.preemptions_repeated.labels(reason)

    def prime_allocations(self, strategy: str, tenants: Iterable[str]) -> None:
        """The allocations' series whose labels come from the configuration (at start and at a reload):
        a first preemption or wait then moves a series from 0, which ``rate`` and ``increase`` see."""
        n = self.node
        for reason in PREEMPT_REASONS:
            n.preemptions.labels(reason, strategy)
        for tenant in ("", *tenants):
            n.allocation_wait.labels(tenant)


def session_labels(gpu: int, session: int, client: str, pid: int) -> tuple[str, str, str, str]:
    """The labels of one session's gauges (client is its name, ``?`` when it has none)."""
    return str(gpu), str(session), client or "?", str(pid)


class NodeMetrics:
    """GPU, lock, session, allocation and daemon metrics (issue: operations)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        g = ["gpu"]
        self.gpu_info = Gauge(
            "gpud_gpu_info", "GPUs this daemon schedules (value 1).", ["gpu", "UUID", "name"], registry=registry
        )
        self.gpu_healthy = Gauge("gpud_gpu_healthy", "1 while NVML answers for the GPU.", g, registry=registry)
        self.memory_total = Gauge("gpud_gpu_memory_total_bytes", "GPU memory.", g, registry=registry)
        self.memory_used = Gauge(
            "gpud_gpu_memory_used_bytes", "GPU memory in use (NVML; simulated: reported).", g, registry=registry
        )
        self.utilization = Gauge(
            "gpud_gpu_utilization_ratio", "GPU utilisation (NVML; simulated: held or not).", g, registry=registry
        )
        self.holders = Gauge("gpud_gpu_holders", "Sessions and leases holding the GPU.", g, registry=registry)
        self.queue = Gauge("gpud_gpu_queue_length", "Sessions and leases waiting for the GPU.", g, registry=registry)
        self.lock_wait = HistogramCells(
            "gpud_lock_wait_seconds", "LOCK_REQUEST to LOCK_OK.", g, registry, buckets=_LATENCY_BUCKETS
        )
        self.lock_hold = HistogramCells(
            "gpud_lock_hold_seconds", "LOCK_OK to LOCK_RELEASED.", g, registry, buckets=_LATENCY_BUCKETS
        )
        self.drop_to_release = HistogramCells(
            "gpud_lock_drop_to_release_seconds", "DROP_LOCK to LOCK_RELEASED.", g, registry, buckets=_LATENCY_BUCKETS
        )
        s = ["gpu", "session", "client", "pid"]
        self.session_core_limit = Gauge(
            "gpud_session_core_limit_ratio", "Compute limit (1 = unlimited).", s, registry=registry
        )
        self.session_window_used = Gauge(
            "gpud_session_window_used_seconds", "GPU time billed this window.", s, registry=registry
        )
        self.session_throttled = Gauge(
            "gpud_session_throttled", "1 while throttled until the next window.", s, registry=registry
        )
        self.session_memory = Gauge("gpud_session_memory_bytes", "Reported GPU memory use.", s, registry=registry)
        self.session_memory_limit = Gauge(
            "gpud_session_memory_limit_bytes", "Memory limit (absent: none).", s, registry=registry
        )
        self.session_share = Gauge(
            "gpud_session_share_ratio",
            "Share of the GPU's time billed to the session over its last finished windows (share_windows).",
            s,
            registry=registry,
        )
        self.allocated = Gauge(
            "gpud_gpu_allocated_ratio", "Share of the GPU held by allocations.", g, registry=registry
        )
        self.allocations = Gauge("gpud_allocations", "Allocations held.", registry=registry)
        self.allocation_requests = Counter(
            "gpud_allocation_requests_total", "Allocation requests by result.", ["result"], registry=registry
        )
        self.preemptions = Counter(
            "gpud_preemptions_total",
            "Allocations told to leave, by reason and the node's strategy.",
            ["reason", "strategy"],
            registry=registry,
        )
        self.preemption_overruns = Counter(
            "gpud_preemption_grace_overruns_total",
            "Preempted allocations that had not left when their grace ended, by reason.",
            ["reason"],
            registry=registry,
        )
        self.preemptions_repeated = Counter(
            "gpud_preemptions_repeated_total",
            "Allocations told to leave whose task had been taken back twice or more already, without ending in"
            " between (the same work taken back again and again), by reason.",
            ["reason"],
            registry=registry,
        )
        self.allocations_grown = Counter(
            "gpud_allocations_grown_total",
            "Elastic allocations grown onto free GPUs (one per growth).",
            registry=registry,
        )
        self.allocation_wait = Histogram(
            "gpud_allocation_wait_seconds",
            "Allocation request to grant (0: at once), by tenant (empty: none); a wait restored at start is not timed.",
            ["tenant"],
            buckets=_ALLOCATION_WAIT_BUCKETS,
            registry=registry,
        )
        self.suspended = Gauge(
            "gpud_allocations_suspended", "Allocations suspended, waiting for their GPUs.", registry=registry
        )
        # Tenants are configured, so bounded; the monitor publishes them with the GPUs' gauges.
        t = ["tenant"]
        self.tenant_quota = Gauge("gpud_tenant_quota_gpus", "A tenant's quota, in GPUs.", t, registry=registry)
        self.tenant_borrow_limit = Gauge(
            "gpud_tenant_borrow_limit_gpus",
            "The most a tenant may borrow of others' idle quota, in GPUs.",
            t,
            registry=registry,
        )
        self.tenant_allocated = Gauge(
            "gpud_tenant_allocated_gpus",
            "GPUs a tenant's allocations hold (fractions add up; suspended ones hold none).",
            t,
            registry=registry,
        )
        self.tenant_gauges = (self.tenant_quota, self.tenant_borrow_limit, self.tenant_allocated)
        self.parked = Gauge(
            "gpud_parked_bytes", "GPU memory of paused programs parked in host memory.", g, registry=registry
        )
        self.draining = Gauge("gpud_gpu_draining", "1 while an operator drains the GPU.", g, registry=registry)
        self.clients = Gauge("gpud_clients", "Connected clients.", registry=registry)
        self.messages = CounterCells("gpud_messages_total", "Messages received, by type.", ["type"], registry)
        self.protocol_errors = Counter(
            "gpud_protocol_errors_total", "Errors answered, by code.", ["code"], registry=registry
        )
        self.faults = Counter(
            "gpud_faults_total",
            "Unexpected errors contained (one connection, record or tick).",
            ["where"],
            registry=registry,
        )
        self.connections_refused = Counter(
            "gpud_connections_refused_total", "Connections refused at accept, by cap.", ["reason"], registry=registry
        )
        self.connections_dropped = Counter(
            "gpud_connections_dropped_total", "Connections closed by the daemon.", ["reason"], registry=registry
        )
        self.limit_refusals = Counter(
            "gpud_limit_refusals_total", "Requests refused by a cap, by the cap's name.", ["cap"], registry=registry
        )
        self.session_gauges = (
            self.session_core_limit,
            self.session_window_used,
            self.session_throttled,
            self.session_memory,
            self.session_share,
            self.session_memory_limit,
        )
        # A session's bound series of all but the memory limit, looked up once: labels() costs more than set()
        self.session_children: dict[tuple[str, ...], tuple[Any, Any, Any, Any, Any]] = {}
        self.store_records_set_aside = Counter(
            "gpud_store_records_set_aside_total", "Stored allocations that could not be restored.", registry=registry
        )
        self.store_failures = Counter(
            "gpud_store_failures_total", "Changes refused because the store could not record them.", registry=registry
        )
        self.signals_sent = Counter(
            "gpud_signals_sent_total",
            "Signals gpud delivered to a process it holds (an allocation's owner), by signal and why.",
            ["signal", "why"],
            registry=registry,
        )
        self.owner_refusals = Counter(
            "gpud_owner_refusals_total",
            "Owner pids refused because the caller may not name that process.",
            registry=registry,
        )

        # gpuctl run: the programs gpud holds for runs (gpud.capabilities.runs, docs/run.md)
        self.runs = Gauge(
            "gpud_runs", "Runs' programs gpud holds, by backend (cgroup: in a cgroup of gpud's).", ["backend"],
            registry=registry,
        )  # fmt: skip
        self.run_escapes = Counter(
            "gpud_run_escapes_total",
            "Processes of paused runs' programs caught running (continued from outside), as their runs reported.",
            registry=registry,
        )
        self.run_kills = Counter(
            "gpud_run_cgroup_kills_total", "Run cgroups ended whole (cgroup.kill), by reason.", ["reason"],
            registry=registry,
        )  # fmt: skip
        self.run_freeze = Histogram(
            "gpud_run_freeze_seconds", "FREEZE to the kernel's frozen 1 in cgroup.events.",
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 1, 5), registry=registry,
        )  # fmt: skip

    def forget_session(self, labels: tuple[str, str, str, str]) -> None:
        """A session's series go with it, at once (the monitor refreshes the others)."""
        self.session_children.pop(labels, None)
        for gauge in self.session_gauges:
            try:
                gauge.remove(*labels)
            except KeyError:
                pass  # not published yet, or that gauge never had it
