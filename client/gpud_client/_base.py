"""What both clients know of their connection, read from the core: one definition for both surfaces."""

from __future__ import annotations

from gpud_client import protocol as p
from gpud_client.core import ClientCore


class ClientBase:
    def __init__(
        self,
        path: str,
        *,
        name: str,
        labels: dict[str, str] | None,
        reconnect: bool,
        unavailable_timeout: float,
        proceed_unarbitrated: bool,
        request_timeout: float,
    ) -> None:
        self.path = path
        self.name = name
        self.labels = dict(labels or {})
        self.reconnect = reconnect
        self.request_timeout = request_timeout
        self._core = ClientCore(
            path, unavailable_timeout=unavailable_timeout, proceed_unarbitrated=proceed_unarbitrated
        )

    @property
    def welcome(self) -> p.Welcome:
        """The daemon's answer to HELLO on the current (or last) connection."""
        if self._core.welcome is None:
            raise AttributeError("this client never connected")
        return self._core.welcome

    @property
    def client_id(self) -> int:
        return self.welcome.client_id

    @property
    def scheduler_on(self) -> dict[int, bool]:
        return self._core.scheduler_on

    @property
    def reconnects(self) -> int:
        return self._core.reconnects

    @property
    def revoked_leases(self) -> set[str]:
        """Leases the daemon released by force (hold_max with forced release on)."""
        return self._core.revoked_leases

    @property
    def unavailable_timeout(self) -> float:
        return self._core.unavailable_timeout

    @property
    def proceed_unarbitrated(self) -> bool:
        return self._core.proceed_unarbitrated
