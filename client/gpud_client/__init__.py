"""gpud_client: the thin library processes use to share GPUs through gpud.

Imports only msgspec: inference processes link it.
"""

from gpud_client.client import Client, Session
from gpud_client.connection import Connection
from gpud_client.errors import DaemonUnavailable, GpudError, PermissionDenied, ProtocolError
from gpud_client.protocol import PROTOCOL_VERSION, DropReason, ErrorCode, resolve_socket_path

__all__ = [
    "PROTOCOL_VERSION",
    "Client",
    "Connection",
    "DaemonUnavailable",
    "DropReason",
    "ErrorCode",
    "GpudError",
    "PermissionDenied",
    "ProtocolError",
    "Session",
    "resolve_socket_path",
]
