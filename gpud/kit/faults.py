"""Faults the daemon survives: logged once with their traceback, counted, contained.

A fault is an exception nobody planned for: a bug met by one client's bytes,
one effect, one store record or one timer tick. ``Faults.record`` logs it with
its traceback and counts it under ``gpud_faults_total{where}``; the caller then
closes that one connection or skips that one record, and the daemon goes on.
Repeated events of one kind (refused connections, accept errors) are logged at
most once a second, with the count of those not logged.
"""

from __future__ import annotations

import time

import structlog

from gpud.host.metrics import Metrics

log = structlog.get_logger(__name__)
_QUIET_S = 1.0


class Faults:
    def __init__(self, metrics: Metrics) -> None:
        self._counter = metrics.node.faults
        self._last_logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def record(self, where: str, exc: BaseException, **context: object) -> None:
        """One fault: its traceback in the log, one count for ``where``."""
        self._counter.labels(where).inc()
        log.error("fault", where=where, error=f"{type(exc).__name__}: {exc}", exc_info=exc, **context)

    def often(self, event: str, **context: object) -> None:
        """An event that may come in floods: logged at most once a second."""
        now = time.monotonic()
        if now - self._last_logged.get(event, -_QUIET_S) < _QUIET_S:
            self._unlogged[event] = self._unlogged.get(event, 0) + 1
            return
        self._last_logged[event] = now
        log.warning(event, not_logged_since_last=self._unlogged.pop(event, 0), **context)
