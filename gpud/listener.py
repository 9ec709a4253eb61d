"""The listener and the timers: one task pair per connection, one timer per GPU.

Each connection has a reader task (frames in, ``Daemon.handle``, answers out)
and a writer task draining its outbox, closed in ``finally``; one timer task
per GPU sleeps until its scheduler's next deadline or until something changed.
Readiness is reported with ``task_status.started()``. Peer errors are
answered and, for a broken frame, the connection closed; any other exception
is logged with its traceback and closes that one connection only.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import msgspec
import structlog
import trio

from gpud.config import Config
from gpud.core.scheduler import Refused
from gpud.devices import sampler_for
from gpud.monitor import run_monitor
from gpud.server import Connection, Daemon, GpuSlot, now_us
from gpud_client import protocol as p

log = structlog.get_logger("gpud.server")
_PEERCRED = struct.Struct("3i")
# Reads that found data are not checkpoints (trio's receive_some yields after each one, a full
# scheduling round per request): a connection yields every this many reads in a row instead.
_FAIRNESS_READS = 16


def peer_credentials(sock: Any) -> tuple[int, int, int]:
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


async def serve_connection(daemon: Daemon, stream: trio.SocketStream) -> None:
    creds = peer_credentials(stream.socket)
    send, recv = trio.open_memory_channel[bytes](daemon.config.outbox_messages)
    with trio.CancelScope() as scope:
        conn = daemon.open(creds, stream.socket.fileno(), send, scope)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_write_loop, conn, stream, recv)
                try:
                    await _read_loop(daemon, conn)
                finally:
                    daemon.close(conn)
                    send.close()  # the writer flushes what is queued, then ends
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("connection_failed", client=conn.client_id, pid=conn.pid)
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()


async def _write_loop(conn: Connection, stream: trio.SocketStream, recv: trio.MemoryReceiveChannel[bytes]) -> None:
    async with recv:
        async for data in recv:
            chunks = [data]
            while True:  # batch whatever else is already queued into one write
                try:
                    chunks.append(recv.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            conn.queued -= len(chunks)
            conn.writing = True
            await stream.send_all(b"".join(chunks) if len(chunks) > 1 else data)
            conn.writing = False


async def _read_loop(daemon: Daemon, conn: Connection) -> None:
    codec = p.daemon_codec()
    frames = p.FrameDecoder(daemon.config.max_frame_bytes)
    counted = daemon.count_message
    fd, in_a_row = conn.fd, 0
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:  # all read: sleep until the client writes again
            in_a_row = 0
            await trio.lowlevel.wait_readable(fd)
            continue
        except OSError:  # reset by the peer: the same as its end of file
            return
        if not data:
            return
        in_a_row += 1
        if in_a_row % _FAIRNESS_READS == 0:  # a client that never pauses must not starve the others
            await trio.lowlevel.checkpoint()
        try:
            payloads = frames.feed(data)
        except p.FrameTooLarge as exc:
            daemon.send_error(conn, None, p.ErrorCode.FRAME_TOO_LARGE, str(exc))
            log.info("protocol_error", client=conn.client_id, code="frame_too_large", length=exc.length)
            return
        for payload in payloads:
            try:
                msg = codec.decode(payload)
            except msgspec.MsgspecError as exc:
                rid, code, message = p.describe_bad_message(payload, exc)
                daemon.send_error(conn, rid, code, message)
                log.info("protocol_error", client=conn.client_id, code=str(code), detail=message)
                if code == p.ErrorCode.BAD_FRAME:
                    return
                continue
            counted(type(msg))
            try:
                answer = daemon.handle(conn, msg)
            except Refused as exc:
                daemon.send_error(conn, msg.id, exc.code, exc.message)
                if exc.code == p.ErrorCode.VERSION:
                    return
                continue
            if answer is not None:
                daemon.send(conn, answer)


def _claim_socket_path(path: str) -> None:
    """Create the directory; remove a stale socket, refuse a live one."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
    else:
        raise RuntimeError(f"another daemon is listening on {path}")
    finally:
        probe.close()


async def open_listener(config: Config, inherited: socket.socket | None = None) -> trio.SocketListener:
    """The socket systemd passed us, or our own at ``config.socket``."""
    if inherited is not None:
        return trio.SocketListener(trio.socket.from_stdlib_socket(inherited))
    path = config.socket
    _claim_socket_path(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, config.socket_mode)
    sock.listen(512)
    return trio.SocketListener(sock)


async def run_timer(daemon: Daemon, slot: GpuSlot) -> None:
    """Sleep until the scheduler's next deadline or until something changed."""
    while True:
        slot.wake = trio.Event()
        deadline = slot.armed_for = slot.scheduler.next_deadline()
        if deadline is None:
            await slot.wake.wait()
        else:
            delay = (deadline - now_us()) / 1e6
            if delay > 0:
                with trio.move_on_after(delay):
                    await slot.wake.wait()
        now = now_us()
        daemon.carry_out(slot, slot.scheduler.advance(now), now)


async def run_allocator_timer(daemon: Daemon) -> None:
    """Expire allocation waits on time; reclaim allocations of dead owners."""
    interval = daemon.config.reap_interval_s
    next_reap = now_us() + round(interval * 1e6) if interval else None
    while True:
        daemon.allocator_wake = trio.Event()
        times = [t for t in (daemon.allocator.ledger.next_deadline(), next_reap) if t is not None]
        if times:
            with trio.move_on_after(max(0.0, (min(times) - now_us()) / 1e6)):
                await daemon.allocator_wake.wait()
        else:
            await daemon.allocator_wake.wait()
        now = now_us()
        daemon.allocator.advance(now)
        if next_reap is not None and now >= next_reap:
            daemon.allocator.reap(now)
            next_reap = now + round(interval * 1e6)


async def serve(
    daemon: Daemon, listener: trio.SocketListener, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    async with trio.open_nursery() as nursery:
        for slot in daemon.slots:
            nursery.start_soon(run_timer, daemon, slot)
        nursery.start_soon(run_allocator_timer, daemon)
        nursery.start_soon(run_monitor, daemon, sampler_for(daemon.gpus), daemon.config.monitor_interval_s)

        async def handler(stream: trio.SocketStream) -> None:
            await serve_connection(daemon, stream)

        await nursery.start(trio.serve_listeners, handler, [listener])
        log.info("ready", socket=daemon.config.socket, gpus=len(daemon.slots))
        task_status.started()
