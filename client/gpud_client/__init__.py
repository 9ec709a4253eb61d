"""gpud_client: the thin library processes use to share GPUs through gpud.

Imports only msgspec: inference processes link it.
"""

from gpud_client.aio import AsyncClient, AsyncSession
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
