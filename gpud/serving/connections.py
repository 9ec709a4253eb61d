"""One client connection: a reader, a writer and a HELLO deadline, and what one frame does.

Each connection has a reader task (frames in, ``Daemon.handle``, answers out), a
writer task draining its outbox and a HELLO deadline, closed in ``finally``.
A connection refused by a cap is answered with one ERROR naming the cap.

Containment: peer errors are answered (and, for a broken frame, the connection
closed); any other exception while handling one client's bytes, exception
groups included, is logged once with its traceback, counted, and closes that
one connection. Only an inconsistent scheduler stops the daemon.

Fairness: a connection yields to the others after a few messages or a fraction
of a millisecond of work, whichever comes first, and stops reading while its
unsent answers are above the high-water mark; so a client that pipelines
thousands of requests or never reads delays nobody's LOCK_OK.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from typing import Any

import msgspec
import structlog
import trio

from gpud.core.errors import Inconsistent, LimitReached, Refused
from gpud.kit.state import ClientLink
from gpud.serving.server import Daemon
from gpud_client import protocol as p

log = structlog.get_logger(__name__)
_PEERCRED = struct.Struct("3i")
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
# A connection's turn: this many messages (or reads) or this much time, whichever comes first.
_TURN_MESSAGES = 16
_TURN_S = 0.0005
_READ_BYTES = 65536
_FLUSH_S = 1.0  # what a closing connection may take to flush its last answers
# A connection refused by a cap waits this long for its HELLO, at most this many at once (each
# holds a descriptor: well within main.FD_RESERVE); past that, it is refused without waiting.
_REFUSAL_WAIT_S = 1.0
_REFUSALS_WAITING = 16
_REFUSAL_DRAIN_READS = 4


def peer_credentials(sock: Any) -> tuple[int, int, int]:
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


def peer_groups(sock: Any) -> frozenset[int]:
    """The peer's supplementary groups as the kernel recorded them at connect (no /proc:
    the shipped unit hides other users' processes)."""
    for size in (64 * 4, 65536 * 4):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue
            return frozenset()
        return frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    return frozenset()


async def serve_connection(daemon: Daemon, stream: trio.SocketStream, task: str | None = None) -> None:
    """``task``: the task whose own socket it came in on (OPEN_TASK_SOCKET): the connection is that task's."""
    sock = stream.socket
    try:
        creds, groups = peer_credentials(sock), peer_groups(sock)
    except OSError:
        return  # gone before we could look
    refusal = daemon.links.admission_refusal(creds[1])
    if refusal is not None:
        await _refuse_connection(daemon, stream, creds, *refusal)
        return
    with trio.CancelScope() as scope:  # cancelled by Links.drop: closed at once
        conn = daemon.links.open(creds, groups, sock.fileno(), scope, task)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_write_loop, daemon, conn, stream)
                hello_deadline = trio.CancelScope()
                nursery.start_soon(_expect_hello, daemon, conn, hello_deadline)
                try:
                    await _read_loop(daemon, conn)
                finally:
                    hello_deadline.cancel()
                    daemon.close(conn)
                    conn.writer_wake.set()  # the writer flushes what is queued, then ends
                    nursery.cancel_scope.deadline = trio.current_time() + _FLUSH_S
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the peer went away mid-write
        except* Inconsistent:
            raise
        except* Exception as group:
            daemon.faults.record("connection", group, client=conn.client_id, pid=conn.pid)


async def _refuse_connection(
    daemon: Daemon, stream: trio.SocketStream, creds: tuple[int, int, int], cap: str, message: str
) -> None:
    """One ERROR naming the cap, then the close (in ``_serve_and_close``).

    The client's HELLO is waited for, a short bounded while and for a few refused connections
    at a time, so that the ERROR answers it by its id: an ERROR sent at once carries no id, and
    a client waiting for its HELLO's answer reads past it, into the reset that a close with its
    HELLO unread causes (or its HELLO, written after the close, fails with EPIPE), and says
    "connection reset". What came is read before the close, so the close resets nothing. (The
    clients also read an id-less ERROR before a close as its reason, for when this cannot wait.)
    The ERROR is one non-blocking write: a peer that never reads holds nothing past the wait."""
    daemon.metrics.node.connections_refused.labels(cap).inc()
    daemon.faults.often("connection_refused", pid=creds[0], uid=creds[1], reason=message)
    links = daemon.links
    rid = None
    if links.refusing < _REFUSALS_WAITING:
        links.refusing += 1
        try:
            with trio.move_on_after(_REFUSAL_WAIT_S):
                rid = _request_id(daemon, await stream.receive_some(_READ_BYTES))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # gone already: nobody to tell
        finally:
            links.refusing -= 1
    fd = stream.socket.fileno()
    try:
        os.write(fd, links.encode(p.Error(id=rid, code=p.ErrorCode.LIMIT_REACHED, message=message)))
        for _ in range(_REFUSAL_DRAIN_READS):  # whatever else came: the close then resets nothing
            if not os.read(fd, _READ_BYTES):
                break
    except OSError:  # BlockingIOError included: all read, or the peer is gone
        pass


def _request_id(daemon: Daemon, data: bytes) -> int | None:
    """The id of the first request in ``data`` (a refused connection's HELLO), if whole and valid."""
    try:
        payloads = p.FrameDecoder(daemon.config.max_frame_bytes).feed(data)
        rid = getattr(p.daemon_codec().decode(payloads[0]), "id", None) if payloads else None
    except (p.FrameTooLarge, msgspec.MsgspecError):
        return None
    return rid if isinstance(rid, int) else None


async def _expect_hello(daemon: Daemon, conn: ClientLink, scope: trio.CancelScope) -> None:
    with scope:
        await trio.sleep(daemon.config.hello_timeout_s)
        if not conn.greeted:
            message = f"no HELLO within {daemon.config.hello_timeout_s:g} s (hello_timeout_s): closing"
            daemon.links.send_error(conn, None, p.ErrorCode.HELLO_REQUIRED, message)
            daemon.links.drop(conn, "no_hello")


async def _write_loop(daemon: Daemon, conn: ClientLink, stream: trio.SocketStream) -> None:
    while True:
        if not conn.pending:
            if conn.closing:
                return
            conn.writer_wake = trio.Event()
            await conn.writer_wake.wait()
            continue
        data = conn.pending[0] if len(conn.pending) == 1 else b"".join(conn.pending)
        conn.pending.clear()
        conn.writing = True
        await stream.send_all(data)
        conn.writing = False
        conn.pending_bytes -= len(data)
        if conn.pending_bytes <= daemon.config.outbox_high_water_bytes // 2:
            conn.drained.set()


async def _read_loop(daemon: Daemon, conn: ClientLink) -> None:
    codec = p.daemon_codec()
    frames = p.FrameDecoder(daemon.config.max_frame_bytes)
    fd = conn.fd
    work, turn_began = 0, time.perf_counter()
    expect_more = True  # read again before waiting: the client may have written meanwhile
    while not conn.closing:
        if not expect_more:
            await trio.lowlevel.wait_readable(fd)
            work, turn_began = 0, time.perf_counter()
        try:
            data = os.read(fd, _READ_BYTES)
        except BlockingIOError:  # all read: sleep until the client writes again
            expect_more = False
            continue
        except OSError:  # reset by the peer: the same as its end of file
            return
        if not data:
            return
        # A client that was just sent something (its LOCK_OK, its lease) often answers at once
        # (its release): read again, which finds that without a trio round. One that was sent
        # nothing (it released, and the grant went to another) has nothing to say: wait, rather
        # than pay a read into EAGAIN before sleeping.
        sends_before = conn.sends
        too_large = None
        try:
            payloads = frames.feed(data)
        except p.FrameTooLarge as exc:  # the requests before it are answered first
            payloads, too_large = exc.payloads, exc
        work += 1  # the read itself is a unit of work
        for payload in payloads:
            if work >= _TURN_MESSAGES or time.perf_counter() - turn_began > _TURN_S:
                await trio.lowlevel.checkpoint()  # a client that never pauses must not starve the others
                work, turn_began = 0, time.perf_counter()
            if conn.closing:
                return
            if conn.pending_bytes > daemon.config.outbox_high_water_bytes:
                await _wait_drained(conn)  # answers pile up unread: read no more until they go
                work, turn_began = 0, time.perf_counter()
            if not handle_payload(daemon, conn, payload, codec):
                return
            work += 1
        if too_large is not None:
            protocol_error(daemon, conn, None, p.ErrorCode.FRAME_TOO_LARGE, str(too_large))
            return
        if work >= _TURN_MESSAGES or time.perf_counter() - turn_began > _TURN_S:
            await trio.lowlevel.checkpoint()
            work, turn_began = 0, time.perf_counter()
        expect_more = conn.sends != sends_before or len(data) == _READ_BYTES


async def _wait_drained(conn: ClientLink) -> None:
    conn.drained = trio.Event()
    await conn.drained.wait()


def handle_payload(daemon: Daemon, conn: ClientLink, payload: bytes, codec: p.Codec) -> bool:
    """One frame from a client: decode, handle, answer. False: close the connection.

    Whatever goes wrong stays with this connection: a peer's mistake is answered
    with an Error; an unexpected exception is logged with its traceback, counted,
    answered with an ``internal`` Error, and closes the connection. A scheduler
    whose records no longer agree after such a fault stops the daemon."""
    try:
        msg = codec.decode(payload)
    except msgspec.MsgspecError as exc:
        rid, code, message = p.describe_bad_message(payload, exc)
        protocol_error(daemon, conn, rid, code, message)
        return code != p.ErrorCode.BAD_FRAME
    daemon.links.count_message(type(msg))
    try:
        answer = daemon.handle(conn, msg)
    except Refused as exc:
        if isinstance(exc, LimitReached):
            daemon.metrics.node.limit_refusals.labels(exc.cap).inc()
        daemon.links.send_error(conn, msg.id, exc.code, exc.message)
        return exc.code != p.ErrorCode.VERSION
    except Exception as exc:
        tag = msg.__struct_config__.tag
        daemon.faults.record("request", exc, client=conn.client_id, pid=conn.pid, type=tag)
        daemon.links.send_error(
            conn,
            msg.id,
            p.ErrorCode.INTERNAL,
            f"gpud failed to handle {tag}; this connection is closed (the daemon log has the cause)",
        )
        daemon.check_schedulers()
        return False
    if answer is not None:
        daemon.links.send(conn, answer)
    daemon.effects.run_after_answer()
    return True


def protocol_error(daemon: Daemon, conn: ClientLink, rid: int | None, code: p.ErrorCode, message: str) -> None:
    """Answer a peer's mistake; log the first of the connection, count them all."""
    daemon.links.send_error(conn, rid, code, message)
    if not conn.protocol_errors:
        log.info("protocol_error", client=conn.client_id, pid=conn.pid, code=str(code), detail=message[:200])
    conn.protocol_errors[str(code)] += 1
