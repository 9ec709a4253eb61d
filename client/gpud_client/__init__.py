"""gpud_client: the thin library processes use to share GPUs through gpud.

Imports only msgspec: inference processes link it. The asyncio client is imported
when first named (``gpud_client.AsyncClient``): a process that never uses it, gpuctl
among them, does not pay for importing asyncio.
"""

from typing import TYPE_CHECKING, Any

from gpud_client.client import Client, Session
from gpud_client.connection import Connection
from gpud_client.errors import (
    DaemonUnavailable,
    GpudError,
    LockLost,
    MemoryLimitExceeded,
    PermissionDenied,
    ProtocolError,
)
from gpud_client.protocol import PROTOCOL_VERSION, DropReason, ErrorCode, Mode, resolve_socket_path
from gpud_client.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from gpud_client.aio import AsyncClient, AsyncSession


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "AsyncSession"):
        from gpud_client import aio

        return getattr(aio, name)
    raise AttributeError(f"module 'gpud_client' has no attribute {name!r}")


__all__ = [
    "PROTOCOL_VERSION",
    "AsyncClient",
    "AsyncSession",
    "Client",
    "Connection",
    "DaemonUnavailable",
    "DropReason",
    "ErrorCode",
    "GpudError",
    "LockLost",
    "MemoryLimitExceeded",
    "Mode",
    "PermissionDenied",
    "ProtocolError",
    "Session",
    "format_bytes",
    "parse_bytes",
    "resolve_socket_path",
]
