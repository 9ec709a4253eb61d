"""systemd glue in pure Python: sd_notify, socket activation, watchdog.

No libsystemd: READY/STATUS/WATCHDOG/STOPPING are datagrams to
``$NOTIFY_SOCKET`` (a path, or an abstract name starting with "@"), and an
activated socket is fd 3 when ``$LISTEN_PID`` is our pid. Everything here is
a no-op when systemd did not start us.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

SD_LISTEN_FDS_START = 3


_notify_socket: socket.socket | None = None  # opened once, so pings need no new descriptor


def open_notify_socket() -> None:
    """Open the datagram socket ``notify`` uses, while descriptors are free."""
    global _notify_socket
    if _notify_socket is None:
        try:
            _notify_socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        except OSError:
            pass


def notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send one sd_notify message; False when there is no notify socket."""
    env = os.environ if environ is None else environ
    path = env.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        if _notify_socket is not None:
            _notify_socket.sendto(message.encode(), address)
            return True
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(message.encode(), address)
    except OSError:
        return False
    return True


def listen_fds(environ: dict[str, str] | None = None) -> list[socket.socket]:
    """Sockets passed by socket activation (and the variables unset, as sd_listen_fds(1) does)."""
    env = os.environ if environ is None else environ
    try:
        pid, count = int(env.get("LISTEN_PID", "")), int(env.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    if pid != os.getpid() or count < 1:
        return []
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(var, None)
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))
    return socks


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """Half of WatchdogSec= when the watchdog is on for us, else None."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


def socket_name(sock: socket.socket) -> str:
    """What a passed socket is bound to, as logs show it: its path, ``@name`` for an abstract
    Unix socket, ``host:port`` for an IP one."""
    try:
        name = sock.getsockname()
    except OSError as exc:
        return f"fd {sock.fileno()} ({exc.strerror or exc})"
    if isinstance(name, bytes):  # Linux's abstract namespace
        return "@" + name[1:].decode(errors="replace") if name[:1] == b"\0" else name.decode(errors="replace")
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return str(name) or f"fd {sock.fileno()} (unnamed)"
