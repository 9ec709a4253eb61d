"""What gpud-k8s says to Prometheus, at ``GET /metrics`` beside ``/healthz`` (docs/metrics-and-logs.md).

Every series is bounded by what the node holds: the claims prepared on it (each claim's series go when
it is unprepared), a fixed set of outcomes and results. gpud's own series name a time-sliced claim too:
its turns are a session of the client ``k8s/<namespace>/<claim>`` (``gpud_session_*{client}``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CLAIM = ["namespace", "claim"]
EVICTION_OUTCOMES = ("evicted", "blocked", "gone", "failed")
PREPARE_RESULTS = ("ok", "failed")
# A prepare takes milliseconds here; seconds where the API server or gpud is slow (the kubelet waits 45 s).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 45.0)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.claim_info = Gauge(
            "gpud_k8s_claim_info",
            "Claims prepared on this node (value 1), with their gpud task and configuration.",
            [*CLAIM, "uid", "task_id", "time_slice", "recovery", "pause"],
            registry=r,
        )
        self.containers = Gauge(
            "gpud_k8s_claim_containers",
            "Containers found holding the claim (time-sliced or suspend claims).",
            CLAIM,
            registry=r,
        )
        self.paused = Gauge(
            "gpud_k8s_claim_paused", "1 while gpud holds the claim's containers paused.", CLAIM, registry=r
        )
        self.suspended = Gauge(
            "gpud_k8s_claim_suspended",
            "1 while the claim is suspended (given back by recovery suspend).",
            CLAIM,
            registry=r,
        )
        self.turns = Counter(
            "gpud_k8s_claim_turns",
            "Turns the claim's containers were given (the GPU's lock granted).",
            CLAIM,
            registry=r,
        )
        self.evictions = Counter(
            "gpud_k8s_pod_evictions", "Evictions asked of the API server, by outcome.", ["outcome"], registry=r
        )
        self.prepare = Histogram(
            "gpud_k8s_prepare_seconds",
            "NodePrepareResources, one claim, by result.",
            ["result"],
            buckets=BUCKETS,
            registry=r,
        )
        self.unprepare = Histogram(
            "gpud_k8s_unprepare_seconds",
            "NodeUnprepareResources, one claim, by result.",
            ["result"],
            buckets=BUCKETS,
            registry=r,
        )
        for outcome in EVICTION_OUTCOMES:
            self.evictions.labels(outcome)
        for result in PREPARE_RESULTS:
            self.prepare.labels(result)
            self.unprepare.labels(result)

    def claim(
        self, namespace: str, claim: str, *, uid: str, task_id: str, time_slice: bool, recovery: str, pause: str
    ) -> None:
        """A claim kept on this node: its series, at 0 until something happens."""
        self.claim_info.labels(namespace, claim, uid, task_id, str(time_slice).lower(), recovery, pause).set(1)
        for gauge in (self.containers, self.paused, self.suspended):
            gauge.labels(namespace, claim).set(0)
        self.turns.labels(namespace, claim)

    def forget(self, namespace: str, claim: str) -> None:
        """The claim is unprepared: its series go."""
        for labels in [k for k in _children(self.claim_info) if k[:2] == (namespace, claim)]:
            self.claim_info.remove(*labels)
        for metric in (self.containers, self.paused, self.suspended, self.turns):
            if (namespace, claim) in _children(metric):
                metric.remove(namespace, claim)


def _children(metric: Gauge | Counter) -> list[tuple[str, ...]]:
    """A labelled metric's children's labels (prometheus_client keeps them by their labels)."""
    return [tuple(labels) for labels in metric._metrics]
