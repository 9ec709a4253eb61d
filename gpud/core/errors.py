"""The core's refusals and its one fault. A refusal changes nothing; an inconsistency stops the daemon.

Every core module raises these; the shell answers a ``Refused`` with an Error naming its code and
message, and lets an ``Inconsistent`` end the daemon (systemd restarts it).
"""

from __future__ import annotations

from gpud_client.protocol import ErrorCode


class Inconsistent(Exception):
    """The scheduler's records contradict each other: a bug; the daemon must stop."""


class Refused(Exception):
    """A well-formed call the rules do not allow. Nothing was changed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LimitReached(Refused):
    """Refused by one of the daemon's caps, named by its configuration key."""

    def __init__(self, cap: str, message: str) -> None:
        super().__init__(ErrorCode.LIMIT_REACHED, f"{message} ({cap})")
        self.cap = cap
