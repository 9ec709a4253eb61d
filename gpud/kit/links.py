"""The connection registry and the send path.

``Links`` knows every connected client (``ClientLink``), which connection owns
each session and lease id, and the connection caps; it admits connections and
forgets them. ``send`` is the one way a message reaches a client: straight to
an idle connection's non-blocking socket from the task that decided it (a
grant reaches the next holder without a trip through a writer task), the rest
to the connection's outbox, counted in bytes, so a push to a slow client never
blocks anyone else. Past ``outbox_limit_bytes`` unread, the client is
disconnected (logged once).
"""

from __future__ import annotations

import itertools
import os
from collections import Counter

import msgspec
import structlog
import trio

from gpud.core.errors import LimitReached, Refused
from gpud.host.config import Config
from gpud.host.metrics import Metrics
from gpud.kit.state import ClientLink, Clock
from gpud_client import protocol as p

log = structlog.get_logger(__name__)


class Links:
    def __init__(self, config: Config, metrics: Metrics, clock: Clock) -> None:
        self.config = config
        self.metrics = metrics
        self.now = clock
        self.connections: dict[int, ClientLink] = {}
        self.owners: dict[int, ClientLink] = {}  # session or lease id -> its connection
        self.per_uid: Counter[int] = Counter()  # open connections by peer uid
        self.descriptor_room = 1_000_000  # connections the open-file limit leaves room for (set at start)
        self.refusing = 0  # refused connections kept a moment for their HELLO (see gpud.serving.listener)
        self._client_ids = itertools.count(1)
        self._codec = p.daemon_codec()
        self._message_counts: dict[type, object] = {}

    # --- the send path ---------------------------------------------------------

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._codec.encode(msg)

    def send(self, conn: ClientLink, msg: msgspec.Struct) -> None:
        if conn.closing:
            return
        conn.sends += 1
        data = self._codec.encode(msg)
        if conn.fd >= 0 and not conn.writing and not conn.pending:
            try:
                sent = os.write(conn.fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:  # the peer is gone; its reader sees EOF and cleans up
                self.drop(conn, "peer_gone")
                return
            if sent == len(data):
                return
            data = data[sent:]
        if conn.pending_bytes > self.config.outbox_limit_bytes:
            log.warning(
                "client_too_slow",
                client=conn.client_id,
                pid=conn.pid,
                unread_bytes=conn.pending_bytes,
                limit_bytes=self.config.outbox_limit_bytes,
            )
            self.drop(conn, "too_slow")
            return
        conn.pending.append(data)
        conn.pending_bytes += len(data)
        conn.writer_wake.set()

    def send_error(self, conn: ClientLink, rid: int | None, code: p.ErrorCode, message: str) -> None:
        self.metrics.node.protocol_errors.labels(str(code)).inc()
        self.send(conn, p.Error(id=rid, code=code, message=message))

    def broadcast(self, msg: msgspec.Struct) -> None:
        """To every greeted client."""
        for conn in list(self.connections.values()):
            if conn.greeted:
                self.send(conn, msg)

    def drop(self, conn: ClientLink, reason: str) -> None:
        """Close a connection from outside its own task: once, whatever called it."""
        if conn.closing:
            return
        conn.closing = True
        conn.cancel.cancel()
        self.metrics.node.connections_dropped.labels(reason).inc()

    def count_message(self, kind: type) -> None:
        cell = self._message_counts.get(kind)
        if cell is None:
            cell = self._message_counts[kind] = self.metrics.node.messages.labels(kind.__struct_config__.tag)  # type: ignore[attr-defined]
        cell.value += 1  # type: ignore[attr-defined]

    # --- who is connected ------------------------------------------------------

    @property
    def max_connections(self) -> int:
        """The configured cap, lowered to what the open-file limit leaves room for."""
        return min(self.config.max_connections, self.descriptor_room)

    def admission_refusal(self, uid: int) -> tuple[str, str] | None:
        """(cap, message) when a new connection from ``uid`` is refused, else None. The message
        names the cap and its value; the client shows it as the reason."""
        if len(self.connections) >= self.max_connections:
            lowered = ", all the open-file limit allows" if self.max_connections < self.config.max_connections else ""
            return "max_connections", (
                f"gpud refused the connection: it serves at most {self.max_connections} connections{lowered} "
                "(max_connections); try again later"
            )
        cap = self.config.max_connections_per_uid
        if self.per_uid[uid] >= cap:
            return "max_connections_per_uid", (
                f"gpud refused the connection: uid {uid} already has {cap} connections (max_connections_per_uid)"
            )
        return None

    def open(
        self,
        creds: tuple[int, int, int],
        groups: frozenset[int],
        fd: int,
        cancel: trio.CancelScope,
        scope: str | None = None,
    ) -> ClientLink:
        pid, uid, gid = creds
        conn = ClientLink(next(self._client_ids), pid, uid, gid, groups, fd, cancel, self.now(), scope=scope)
        self.connections[conn.client_id] = conn
        self.per_uid[uid] += 1
        self.metrics.node.clients.set(len(self.connections))
        return conn

    def forget(self, conn: ClientLink) -> None:
        """Out of the registry (its sessions are the capabilities' to free first)."""
        conn.closing = True
        if self.connections.pop(conn.client_id, None) is not None:
            self.per_uid[conn.uid] -= 1
            if self.per_uid[conn.uid] <= 0:
                del self.per_uid[conn.uid]
        self.metrics.node.clients.set(len(self.connections))

    def own(self, conn: ClientLink, sid: int, gpu: int) -> None:
        """``sid`` (a session or a lease on ``gpu``) belongs to ``conn`` from now on."""
        conn.sessions[sid] = gpu
        self.owners[sid] = conn

    def disown(self, conn: ClientLink, sid: int) -> None:
        conn.sessions.pop(sid, None)
        self.owners.pop(sid, None)

    def check_room(self, conn: ClientLink) -> None:
        """Refuse one more session or lease on a connection that has its cap of them."""
        cap = self.config.max_sessions_per_connection
        if len(conn.sessions) >= cap:
            raise LimitReached("max_sessions_per_connection", f"this connection has {cap} sessions and leases open")

    def find_client(self, ref: int | str) -> ClientLink:
        """A greeted client by id or by name (a name must be unique)."""
        if isinstance(ref, int):
            found = [c for c in self.connections.values() if c.client_id == ref and c.greeted]
        else:
            found = [c for c in self.connections.values() if c.name == ref and c.greeted]
        if not found:
            raise Refused(p.ErrorCode.UNKNOWN_CLIENT, f"no client {ref!r} is connected (see gpuctl clients)")
        if len(found) > 1:
            ids = ", ".join(str(c.client_id) for c in found)
            raise Refused(p.ErrorCode.INVALID, f"{len(found)} clients are named {ref!r}: use a client id ({ids})")
        return found[0]
