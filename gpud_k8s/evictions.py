"""Evicting pods through the Eviction API (``policy/v1``), so that the API server keeps their disruption
budgets: for a claim gpud took back with a recovery other than suspend (``gpud_k8s.keeping``) and for a
seat of the device-plugin fallback (``gpud_k8s.deviceplugin``). A budget that allows no disruption now
(429) is asked again every ``EVICT_RETRY_S`` until the pod is evicted or gone, or the caller gives up
(cancels)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)
EVICT_RETRY_S = 5.0  # an eviction a disruption budget refused is asked again after this


class Evictor(Protocol):
    async def evict(self, namespace: str, name: str, uid: str | None = None) -> str: ...


async def evict_pods(
    kube: Evictor,
    namespace: str,
    pods: list[tuple[str, str | None]],
    what: str,
    why: str,
    counted: Callable[[str], None] = lambda outcome: None,
) -> None:
    """Evict each pod ``(name, uid)`` through the Eviction API, asking again every ``EVICT_RETRY_S`` while a
    disruption budget refuses it (or the API server cannot be reached), until each is evicted or gone.
    ``counted``: told each answer's outcome (evicted, blocked, gone, failed)."""
    log.warning("pods_evicting", what=what, why=why, pods=[name for name, _ in pods])
    left = list(pods)
    while left:
        blocked = []
        for name, uid in left:
            try:
                outcome = await kube.evict(namespace, name, uid)
            except Exception as exc:  # the API server away: asked again
                log.warning("pod_eviction_failed", what=what, pod=f"{namespace}/{name}", error=str(exc))
                outcome = "failed"
            log.info("pod_eviction", what=what, pod=f"{namespace}/{name}", outcome=outcome)
            counted(outcome)
            if outcome in ("blocked", "failed"):
                blocked.append((name, uid))
        left = blocked
        if left:
            await asyncio.sleep(EVICT_RETRY_S)
