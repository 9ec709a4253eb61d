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
    """The session held the GPU lock and lost it: the connection to gpud died, or gpud revoked
    the lock (a DROP_LOCK ignored too long).

    ``in_use``: a slice was running, so the work since then ran without arbitration; this is
    raised at the end of that slice, or by ``release()`` after ``acquire()``. A lock kept between
    slices (``in_use`` False) ran no work: ``on_lost`` is told, nothing is raised, and the next
    slice takes the lock afresh."""

    def __init__(self, session: int, gpu: int, why: str, in_use: bool = True) -> None:
        what = (
            "the work since then ran unarbitrated"
            if in_use
            else "it was kept between slices, so no work ran without it"
        )
        super().__init__(f"session {session} lost the GPU lock on GPU {gpu}: {why}; {what}")
        self.session = session
        self.gpu = gpu
        self.why = why
        self.in_use = in_use

    def __reduce__(self) -> tuple[type[LockLost], tuple[int, int, str, bool]]:
        return type(self), (self.session, self.gpu, self.why, self.in_use)


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
