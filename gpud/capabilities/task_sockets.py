"""OPEN_TASK_SOCKET, CLOSE_TASK_SOCKET: sockets of one task's own (docs/kubernetes.md).

An admin (gpud-k8s, for a ResourceClaim) has gpud listen on a socket whose every connection belongs
to one task: the connections are marked with the task (``ClientLink.scope``) and what they may ask is
``gpud.core.scopes``'. The socket's directory is the admin's: it must exist, be a directory (not a
link), be owned by root or gpud's uid and be writable by no one else, so that nobody else can put a
socket of their own in its place; the socket itself is ``socket_mode``-free (0666): whoever can reach
the directory (a container it is mounted into) may connect. The listening is done by the runtime
(``Listen``: bind, listen and accept in the daemon's task group); this part checks, keeps the record
and closes. Sockets live as long as gpud does: after a restart, the admin opens them again
(idempotently: the same task and path answer OK).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Protocol

import structlog

from gpud.core.errors import Refused
from gpud.kit.access import Access
from gpud.kit.links import Links
from gpud.kit.state import ClientLink, Handler
from gpud_client import protocol as p

log = structlog.get_logger(__name__)
MAX_TASK_SOCKETS = 4096  # a node with more claims than this has a bigger problem; refused by name


class Listening(Protocol):
    def close(self) -> None: ...


Listen = Callable[[str, str], Listening]  # (path, task id) -> what listens there, closed with close()


class TaskSockets:
    def __init__(self, links: Links, access: Access) -> None:
        self.links = links
        self.access = access
        self.listen: Listen | None = None  # set by the runtime once it serves (not in in-process tests)
        self.open: dict[str, tuple[str, Listening]] = {}  # task id -> (path, its listener)
        self.daemon_uid = os.getuid()

    def handlers(self) -> dict[type, Handler]:
        return {p.OpenTaskSocket: self.open_socket, p.CloseTaskSocket: self.close_socket}

    def open_socket(self, conn: ClientLink, msg: p.OpenTaskSocket, now: int) -> p.Ok:
        self.access.require_admin(conn, msg)
        path = os.path.normpath(msg.path)
        held = self.open.get(msg.task_id)
        if held is not None:
            if held[0] == path:
                return p.Ok(id=msg.id)
            raise Refused(
                p.ErrorCode.INVALID, f"task {msg.task_id!r} has its socket at {held[0]} already: close it first"
            )
        if any(other == path for other, _ in self.open.values()):
            raise Refused(p.ErrorCode.INVALID, f"{path} is another task's socket")
        if len(self.open) >= MAX_TASK_SOCKETS:
            raise Refused(p.ErrorCode.LIMIT_REACHED, f"gpud listens on {MAX_TASK_SOCKETS} task sockets already")
        self._check_directory(path)
        if self.listen is None:
            raise Refused(p.ErrorCode.INTERNAL, "this gpud serves no task sockets (it is not listening)")
        try:
            listening = self.listen(path, msg.task_id)
        except OSError as exc:
            raise Refused(p.ErrorCode.INVALID, f"cannot listen on {path}: {exc.strerror or exc}") from None
        self.open[msg.task_id] = (path, listening)
        log.info("task_socket_opened", task_id=msg.task_id, socket=path, by_pid=conn.pid)
        return p.Ok(id=msg.id)

    def close_socket(self, conn: ClientLink, msg: p.CloseTaskSocket, now: int) -> p.Ok:
        self.access.require_admin(conn, msg)
        self.close(msg.task_id, by_pid=conn.pid)
        return p.Ok(id=msg.id)

    def close(self, task_id: str, by_pid: int | None = None) -> None:
        held = self.open.pop(task_id, None)
        if held is None:
            return
        path, listening = held
        listening.close()
        closed = [c for c in list(self.links.connections.values()) if c.scope == task_id]
        for c in closed:
            self.links.drop(c, "task_socket_closed")
        log.info("task_socket_closed", task_id=task_id, socket=path, connections=len(closed), by_pid=by_pid)

    def close_all(self) -> None:
        for task_id in list(self.open):
            self.close(task_id)

    def _check_directory(self, path: str) -> None:
        """The socket's directory: an existing directory of root's or gpud's that nobody else may write."""
        if len(os.fsencode(path)) > 107:
            raise Refused(p.ErrorCode.INVALID, f"{path} is longer than a socket address holds (107 bytes)")
        parent = os.path.dirname(path)
        try:
            st = os.lstat(parent)
        except OSError as exc:
            raise Refused(p.ErrorCode.INVALID, f"the directory {parent} cannot be used: {exc.strerror}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise Refused(p.ErrorCode.INVALID, f"{parent} is not a directory (a link is not taken)")
        if st.st_uid not in (0, self.daemon_uid) or st.st_mode & 0o022:
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED,
                f"the directory {parent} must be owned by root or gpud's uid and writable by no one else "
                f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})",
            )
