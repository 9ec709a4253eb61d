"""A blocking connection to gpud: connect, HELLO, send and receive messages.

The sync ``Client`` runs one of these under its reader thread; benchmarks and
tools that want the bare protocol use it directly. Errors are ``GpudError``
subclasses that say what went wrong and where.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections import deque
from typing import Any

import msgspec

from gpud_client import protocol as p
from gpud_client.errors import DaemonUnavailable, GpudError, ProtocolError, error_from


def unreachable(path: str, reason: str) -> DaemonUnavailable:
    """The error of a connect that failed, with a hint when the socket is not even there."""
    hint = "" if os.path.exists(path) else " (no such socket: is gpud running? see --socket / $GPUD_SOCKET)"
    return DaemonUnavailable(f"cannot connect to gpud at {path}: {reason}{hint}")


class Inbox:
    """The receiving half of a client connection, without I/O: bytes in, messages out.

    Shared by the blocking ``Connection`` and the asyncio client; the errors are
    the ones a client raises (end of stream, oversized frame, undecodable message)."""

    def __init__(self, path: str, codec: p.Codec) -> None:
        self.path = path
        self._codec = codec
        self._frames = p.FrameDecoder(p.MAX_REPLY_BYTES)  # answers may be far larger than requests
        self._ready: deque[bytes] = deque()
        self._broken: ProtocolError | None = None  # an oversized frame, raised once what came before it is read

    def __bool__(self) -> bool:
        """A whole message is waiting (or the error that ends the stream)."""
        return bool(self._ready) or self._broken is not None

    def feed(self, data: bytes) -> None:
        """What one read returned; b"" is the daemon closing the connection."""
        if not data:
            raise DaemonUnavailable(f"gpud at {self.path} closed the connection")
        if self._broken is not None:
            return  # nothing after an oversized frame can be read as frames
        try:
            self._ready.extend(self._frames.feed(data))
        except p.FrameTooLarge as exc:  # the whole messages before it are still delivered
            self._ready.extend(exc.payloads)
            self._broken = ProtocolError(p.ErrorCode.FRAME_TOO_LARGE, str(exc))

    def pop(self) -> Any:
        """The next whole message, decoded (only when one is waiting); after the last message before an
        oversized frame, that frame's error."""
        if not self._ready and self._broken is not None:
            raise self._broken
        try:
            return self._codec.decode(self._ready.popleft())
        except msgspec.MsgspecError as exc:
            raise ProtocolError(p.ErrorCode.INVALID, f"undecodable message from gpud: {exc}") from None


class Connection:
    """One Unix-socket connection speaking the framed protocol, blocking."""

    def __init__(self, path: str | None = None, *, timeout: float | None = 5.0) -> None:
        self.path = p.resolve_socket_path(path)
        self._codec = p.client_codec()
        self._inbox = Inbox(self.path, self._codec)
        self._backlog: deque[Any] = deque()  # messages call() read past, for recv()
        self._ids = itertools.count(1)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(self.path)
        except OSError as exc:  # refused, missing, timed out
            self.sock.close()
            raise unreachable(self.path, exc.strerror or str(exc)) from None
        self.sock.settimeout(None)
        self._timeout: float | None = None

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, msg: msgspec.Struct) -> None:
        try:
            self.sock.sendall(self._codec.encode(msg))
        except OSError as exc:
            # The daemon may have said why it closed before we wrote (a refused connection).
            said = self._last_words(len(self._backlog))
            if said is not None:
                raise said from None
            raise DaemonUnavailable(f"lost connection to gpud at {self.path}: {exc}") from None

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float | None = None) -> Any:
        """The next message from the daemon. Raises DaemonUnavailable on EOF."""
        if self._backlog:
            return self._backlog.popleft()
        return self._recv(timeout)

    def _recv(self, timeout: float | None) -> Any:
        while not self._inbox:
            try:
                if timeout != self._timeout:  # one syscall saved per read
                    self.sock.settimeout(timeout)
                    self._timeout = timeout
                data = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError(f"no message from gpud within {timeout} s") from None
            except OSError as exc:
                raise DaemonUnavailable(f"lost connection to gpud at {self.path}: {exc}") from None
            self._inbox.feed(data)
        return self._inbox.pop()

    def call(self, msg: msgspec.Struct, timeout: float | None = 10.0) -> Any:
        """Send a request and wait for its answer. Messages that arrive first
        are kept for ``recv``. Only for a connection no other thread reads.

        A connection that ends before the answer, after an ERROR without a request id (a refusal
        by a cap, a missed HELLO deadline), raises that ERROR: it is why the daemon closed."""
        since = len(self._backlog)
        self.send(msg)
        rid = getattr(msg, "id")  # noqa: B009 - any request Struct: the base type names no field
        while True:
            try:
                reply = self._recv(timeout)
            except DaemonUnavailable:
                said = self._last_words(since)
                if said is not None:
                    raise said from None
                raise
            if getattr(reply, "id", None) != rid:
                self._backlog.append(reply)
                continue
            if isinstance(reply, p.Error):
                raise ProtocolError(reply.code, reply.message)
            return reply

    def _last_words(self, since: int) -> ProtocolError | None:
        """The last ERROR without a request id that the daemon sent before closing: among the
        messages kept since ``since``, and what is still unread (read without waiting)."""
        try:
            while data := self.sock.recv(65536, socket.MSG_DONTWAIT):
                self._inbox.feed(data)
        except (OSError, GpudError):  # all read, reset, or garbled: what was whole is kept
            pass
        try:
            while self._inbox:
                self._backlog.append(self._inbox.pop())
        except GpudError:
            pass
        for said in reversed(list(self._backlog)[since:]):
            if isinstance(said, p.Error) and said.id is None:
                return error_from(said.code, said.message)
        return None

    def hello(self, name: str = "", labels: dict[str, str] | None = None) -> p.Welcome:
        welcome: p.Welcome = self.call(
            p.Hello(id=self.next_id(), version=p.PROTOCOL_VERSION, name=name, labels=labels or {})
        )
        return welcome

    def shutdown(self) -> None:
        """End the stream both ways (a reader blocked on it wakes) without freeing the socket."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()
        self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
