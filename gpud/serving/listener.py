"""The listening socket and the daemon's task group: accept, timers, monitor.

``open_listener`` claims the socket path (a stale socket is removed, a live
one refused) or takes the one systemd passed; ``socket_origin`` names the one
served, for the logs (systemd's, never the configured path in its place).
``serve`` starts one timer per GPU, the allocations' timer, the monitor and the
accept loop, and reports readiness with ``task_status.started()``. Each
accepted connection is served by ``gpud.serving.connections``.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Callable
from typing import Literal

import structlog
import trio

from gpud.host.config import Config
from gpud.host.devices import sampler_for
from gpud.host.systemd import socket_name
from gpud.serving.connections import serve_connection
from gpud.serving.monitor import run_monitor
from gpud.serving.server import Daemon
from gpud.serving.timers import run_allocations_timer, run_timer

log = structlog.get_logger(__name__)
_ACCEPT_BACKOFF_S = 0.1  # after accept fails for want of descriptors or memory


_PROBE_TIMEOUT_S = 1.0  # a daemon that does not accept within this is taken as live, never unlinked


def _claim_socket_path(path: str) -> None:
    """Create the directory; remove a stale socket, refuse a live one or anything not a socket."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise RuntimeError(
            f"{path} exists and is not a socket: gpud will not remove it (remove it yourself, "
            f"or set socket to another path)"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("stale_socket_removed", socket=path)
        os.unlink(path)  # nobody listens: left behind by a daemon that died
    except (TimeoutError, BlockingIOError):  # its backlog is full: alive, but not accepting
        raise RuntimeError(
            f"a process listens on {path} but does not accept connections: another gpud? "
            f"(stop it first, or set socket to another path)"
        ) from None
    except OSError as exc:
        raise RuntimeError(f"cannot probe the socket {path}: {exc.strerror or exc}") from None
    else:
        raise RuntimeError(f"another daemon is listening on {path} (stop it first, or set socket to another path)")
    finally:
        probe.close()


SocketFrom = Literal["config", "systemd"]


def socket_origin(config: Config, inherited: socket.socket | None) -> tuple[str, SocketFrom]:
    """The socket served, as ``starting`` and ``ready`` name it: the one systemd passed (what it is
    bound to; ``config.socket`` is ignored then), or ``config.socket``."""
    if inherited is None:
        return config.socket, "config"
    return socket_name(inherited), "systemd"


class OwnSocket:
    """The socket path this daemon bound, removed at exit only if it is still ours
    (another daemon may have replaced it meanwhile)."""

    def __init__(self, path: str) -> None:
        self.path = path
        st = os.stat(path)
        self.identity = (st.st_dev, st.st_ino)

    def remove(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self.identity and stat.S_ISSOCK(st.st_mode):
            os.unlink(self.path)
        else:
            log.warning("socket_not_removed", socket=self.path, reason="it is no longer the socket gpud bound")


async def open_listener(
    config: Config, inherited: socket.socket | None = None
) -> tuple[trio.SocketListener, OwnSocket | None]:
    """The socket systemd passed us (it stays systemd's), or our own at ``config.socket``."""
    if inherited is not None:
        return trio.SocketListener(trio.socket.from_stdlib_socket(inherited)), None
    path = config.socket
    _claim_socket_path(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(path)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    own = OwnSocket(path)
    os.chmod(path, config.socket_mode)
    sock.listen(512)
    return trio.SocketListener(sock), own


async def accept_loop(
    daemon: Daemon, listener: trio.SocketListener, nursery: trio.Nursery, scope: str | None = None
) -> None:
    """Accept connections for ever (on a task's own socket: each of them that task's). Out of
    descriptors or memory: the clients already connected go on being served, and accepting resumes
    once there is room again."""
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            daemon.metrics.node.connections_refused.labels(errno.errorcode.get(exc.errno or 0, "accept")).inc()
            daemon.faults.often("accept_failed", error=str(exc))
            await trio.sleep(_ACCEPT_BACKOFF_S)
            continue
        nursery.start_soon(_serve_and_close, daemon, stream, scope)


async def _serve_and_close(daemon: Daemon, stream: trio.SocketStream, scope: str | None = None) -> None:
    try:
        await serve_connection(daemon, stream, scope)
    finally:
        await trio.aclose_forcefully(stream)


class TaskListener:
    """One task's own socket (OPEN_TASK_SOCKET), accepting in the daemon's task group until closed;
    closing removes the socket file if it is still the one bound."""

    def __init__(self, own: OwnSocket, cancel: trio.CancelScope) -> None:
        self.own = own
        self.cancel = cancel

    def close(self) -> None:
        self.cancel.cancel()
        self.own.remove()


def task_listen(daemon: Daemon, nursery: trio.Nursery) -> Callable[[str, str], TaskListener]:
    """How the task sockets part listens: bind ``path`` (a stale socket there is removed, a live one
    refused), open to every uid that can reach its directory, and accept as ``task_id``'s."""

    def listen(path: str, task_id: str) -> TaskListener:
        try:
            _claim_socket_path(path)
        except RuntimeError as exc:
            raise OSError(errno.EEXIST, str(exc)) from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o666)  # whoever reaches the directory: the directory is the gate
            sock.listen(512)
        except OSError:
            sock.close()
            raise
        own = OwnSocket(path)
        cancel = trio.CancelScope()
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

        async def accept() -> None:
            with cancel:
                try:
                    await accept_loop(daemon, listener, nursery, task_id)
                finally:
                    await trio.aclose_forcefully(listener)

        nursery.start_soon(accept)
        return TaskListener(own, cancel)

    return listen


async def serve(
    daemon: Daemon,
    listener: trio.SocketListener,
    *,
    socket_path: str | None = None,
    socket_from: SocketFrom = "config",
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``socket_path``, ``socket_from``: the socket ``ready`` names (``socket_origin``), else ``config.socket``."""
    try:
        async with trio.open_nursery() as nursery:
            daemon.task_sockets.listen = task_listen(daemon, nursery)
            await _serve_in(daemon, listener, nursery, socket_path, socket_from, task_status)
    finally:
        daemon.task_sockets.listen = None
        daemon.task_sockets.close_all()  # their files: a socket nobody serves is a stale one


async def _serve_in(
    daemon: Daemon,
    listener: trio.SocketListener,
    nursery: trio.Nursery,
    socket_path: str | None,
    socket_from: SocketFrom,
    task_status: trio.TaskStatus[None],
) -> None:
    for slot in daemon.slots:
        nursery.start_soon(run_timer, daemon, slot)
    nursery.start_soon(run_allocations_timer, daemon)
    nursery.start_soon(run_monitor, daemon, sampler_for(daemon.gpus))
    nursery.start_soon(accept_loop, daemon, listener, nursery)
    log.info(
        "ready",
        socket=daemon.config.socket if socket_path is None else socket_path,
        socket_from=socket_from,
        gpus=len(daemon.slots),
        max_connections=daemon.links.max_connections,
    )
    task_status.started()
