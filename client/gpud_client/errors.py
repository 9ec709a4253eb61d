"""Exceptions the client raises. Each message says what went wrong."""

from __future__ import annotations

from gpud_client.protocol import ErrorCode


class GpudError(Exception):
    """Base class of every gpud client error.

    Every one pickles with its fields (``__reduce__`` gives its constructor's arguments), so an error
    raised in a Ray worker or an Airflow task reaches the driver as itself and ``except`` catches it."""


class DaemonUnavailable(GpudError):
    """gpud cannot be reached, or the connection to it was lost."""


class ProtocolError(GpudError):
    """gpud refused a request; ``code`` is one of ``ErrorCode``."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else code
        self.message = message

    def __reduce__(self) -> tuple[type[ProtocolError], tuple[str, str]]:
        return type(self), (str(self.code), self.message)


class PermissionDenied(ProtocolError):
    """The request needs admin rights the caller does not have."""


def error_from(code: ErrorCode | str, message: str) -> ProtocolError:
    """The exception for an Error answer from the daemon."""
    if code == ErrorCode.PERMISSION_DENIED:
        return PermissionDenied(code, message)
    return ProtocolError(code, message)


class LockLost(GpudError):
    """The session held the GPU lock and lost it while the application still used it: the
    connection to gpud died, or gpud revoked the lock (a DROP_LOCK ignored too long).

    The work since then ran without arbitration. ``on_lost`` is called at once; this is raised
    at the end of the running slice, or by ``release()`` after ``acquire()``."""

    def __init__(self, session: int, gpu: int, why: str) -> None:
        super().__init__(f"session {session} lost the GPU lock on GPU {gpu}: {why}; the work since then ran unarbitrated")
        self.session = session
        self.gpu = gpu
        self.why = why

    def __reduce__(self) -> tuple[type[LockLost], tuple[int, int, str]]:
        return type(self), (self.session, self.gpu, self.why)


class MemoryLimitExceeded(GpudError):
    """The session's reported GPU memory went above its limit.

    Raised in the application at its next ``slice()``; the daemon counts it."""

    def __init__(self, session: int, used_bytes: int, limit_bytes: int) -> None:
        super().__init__(
            f"session {session} uses {used_bytes} bytes of GPU memory, above its limit of {limit_bytes} bytes"
        )
        self.session = session
        self.used_bytes = used_bytes
        self.limit_bytes = limit_bytes

    def __reduce__(self) -> tuple[type[MemoryLimitExceeded], tuple[int, int, int]]:
        return type(self), (self.session, self.used_bytes, self.limit_bytes)
