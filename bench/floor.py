"""The floors bench/handoff.py sets gpud against: two minimal lock relays, each in its own process.

Both speak just enough of gpud's protocol for its clients, with its framing
(``p.FrameDecoder``) and its typed codec (``p.daemon_codec()``) for every
message: HELLO -> WELCOME, ATTACH -> ATTACHED, LOCK_REQUEST -> LOCK_OK or the
FIFO, the holder's LOCK_RELEASED -> LOCK_OK to the FIFO's head. The rules live
once, in ``_Floor``; the relays differ only in how bytes come and go:

- ``Relay``, the floor: ``selectors`` on non-blocking Unix sockets, one loop.
  What any Python daemon must pay for a socket round trip and a decode/encode.
- ``TrioRelay``, the trio floor: a trio socket listener, one task per
  connection reading with ``os.read`` and awaiting ``trio.lowlevel.wait_readable``
  when a read finds nothing or nothing was sent it (gpud's own read loop, ``gpud/serving/listener.py``),
  and writing with ``os.write`` on the socket's descriptor, as gpud does. What
  any daemon on trio must pay: gpud over it is gpud's own cost, and the trio
  floor over the floor is trio's per-wakeup cost.

Neither may do anything else: no checks beyond decoding, no errors, no
metrics, no logs, no fairness turns. Whatever is added here is added to the
floor and hides that much of gpud's cost.
"""

from __future__ import annotations

import itertools
import os
import selectors
import socket
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection as Pipe
from typing import Any, Generic, Protocol, TypeVar

import trio

from gpud_client import protocol as p

READ_BYTES = 65536  # as gpud's listener


class _Attached(Protocol):
    sessions: list[int]


PeerT = TypeVar("PeerT", bound=_Attached)


class _Floor(Generic[PeerT]):
    """The lock both relays keep: one holder, one FIFO of waiters; sessions, client ids and
    grants drawn from one counter. Subclasses move the bytes (``_send``)."""

    def __init__(self) -> None:
        self.codec = p.daemon_codec()
        self.owner: dict[int, PeerT] = {}
        self.waiting: deque[int] = deque()
        self.holder: int | None = None
        self.ids = itertools.count(1)

    def _send(self, peer: PeerT, msg: Any) -> None:
        raise NotImplementedError

    def _handle(self, peer: PeerT, msg: Any) -> None:
        match msg:
            case p.LockRequest(session=sid):
                if self.holder is None:
                    self._grant(sid)
                else:
                    self.waiting.append(sid)
            case p.LockReleased(session=sid) if sid == self.holder:
                self.holder = None
                if self.waiting:
                    self._grant(self.waiting.popleft())
            case p.Hello(id=rid):
                gpu = p.GpuInfo(
                    index=0, uuid="relay-0", name="floor relay", memory_total_bytes=0, simulated=True, scheduler_on=True
                )
                self._send(peer, p.Welcome(id=rid, client_id=next(self.ids), version=p.PROTOCOL_VERSION, gpus=[gpu]))
            case p.Attach(id=rid):
                sid = next(self.ids)
                self.owner[sid] = peer
                peer.sessions.append(sid)
                self._send(
                    peer,
                    p.Attached(
                        id=rid,
                        session=sid,
                        gpu=0,
                        scheduler_on=True,
                        core_limit=100,
                        mem_limit=None,
                        memory_total_bytes=0,
                    ),
                )

    def _grant(self, sid: int) -> None:
        self.holder = sid
        self._send(self.owner[sid], p.LockOk(session=sid, grant=next(self.ids)))

    def _forget(self, peer: PeerT) -> None:
        """A closed connection's sessions leave the FIFO; its hold passes to the next."""
        gone = set(peer.sessions)
        for sid in gone:
            del self.owner[sid]
        self.waiting = deque(sid for sid in self.waiting if sid not in gone)
        if self.holder in gone:
            self.holder = None
            if self.waiting:
                self._grant(self.waiting.popleft())


# --- the floor: selectors --------------------------------------------------------


class _Peer:
    __slots__ = ("sock", "frames", "unsent", "sessions")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = p.FrameDecoder()
        self.unsent = b""
        self.sessions: list[int] = []


class Relay(_Floor[_Peer]):
    """selectors on non-blocking Unix sockets, one loop for every connection."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ)

    def serve_forever(self) -> None:
        while True:
            for key, events in self.sel.select():
                peer = key.data
                if peer is None:
                    sock, _ = self.listener.accept()
                    sock.setblocking(False)
                    self.sel.register(sock, selectors.EVENT_READ, _Peer(sock))
                    continue
                if events & selectors.EVENT_WRITE:
                    self._flush(peer)
                if events & selectors.EVENT_READ:
                    self._read(peer)

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(peer)
            return
        for payload in peer.frames.feed(data):
            self._handle(peer, self.codec.decode(payload))

    def _send(self, peer: _Peer, msg: Any) -> None:
        data = self.codec.encode(msg)
        if not peer.unsent:
            try:
                sent = peer.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                return  # gone: its read sees the end
            if sent == len(data):
                return
            data = data[sent:]
            self.sel.modify(peer.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)
        peer.unsent += data

    def _flush(self, peer: _Peer) -> None:
        try:
            sent = peer.sock.send(peer.unsent)
        except BlockingIOError:
            return
        except OSError:
            sent = len(peer.unsent)
        peer.unsent = peer.unsent[sent:]
        if not peer.unsent:
            self.sel.modify(peer.sock, selectors.EVENT_READ, peer)

    def _close(self, peer: _Peer) -> None:
        self.sel.unregister(peer.sock)
        peer.sock.close()
        self._forget(peer)


def relay_main(path: str, ready: Pipe) -> None:
    relay = Relay(path)
    ready.send(os.getpid())
    ready.close()
    relay.serve_forever()


# --- the trio floor: gpud's read loop, nothing else --------------------------------


class _TrioPeer:
    __slots__ = ("fd", "unsent", "sessions", "sends")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.unsent = b""
        self.sessions: list[int] = []
        self.sends = 0  # messages sent to it: the read loop's hint, as gpud's


class TrioRelay(_Floor[_TrioPeer]):
    """A trio socket listener, one task per connection; a short write (none in the bench: its
    messages are tens of bytes) is finished by a task of its own, as the selectors relay's
    EVENT_WRITE does."""

    async def serve(self, path: str, ready: Pipe) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        sock.listen(128)
        listener = trio.SocketListener(sock)
        ready.send(os.getpid())
        ready.close()
        async with trio.open_nursery() as self.nursery:
            while True:
                self.nursery.start_soon(self._serve_and_close, await listener.accept())

    async def _serve_and_close(self, stream: trio.SocketStream) -> None:
        peer = _TrioPeer(stream.socket.fileno())
        try:
            await self._read_loop(peer)
        finally:
            peer.unsent = b""  # a pending flush ends rather than write to a reused descriptor
            self._forget(peer)
            await trio.aclose_forcefully(stream)

    async def _read_loop(self, peer: _TrioPeer) -> None:
        frames, fd = p.FrameDecoder(), peer.fd
        expect_more = True
        while True:
            if not expect_more:
                await trio.lowlevel.wait_readable(fd)
            try:
                data = os.read(fd, READ_BYTES)
            except BlockingIOError:  # all read: sleep until the client writes again
                expect_more = False
                continue
            except OSError:  # reset by the peer: the same as its end of file
                return
            if not data:
                return
            sends_before = peer.sends
            for payload in frames.feed(data):
                self._handle(peer, self.codec.decode(payload))
            expect_more = peer.sends != sends_before or len(data) == READ_BYTES

    def _send(self, peer: _TrioPeer, msg: Any) -> None:
        peer.sends += 1
        data = self.codec.encode(msg)
        if not peer.unsent:
            try:
                sent = os.write(peer.fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:
                return  # gone: its read sees the end
            if sent == len(data):
                return
            data = data[sent:]
            self.nursery.start_soon(self._flush, peer)
        peer.unsent += data

    async def _flush(self, peer: _TrioPeer) -> None:
        while peer.unsent:
            try:
                await trio.lowlevel.wait_writable(peer.fd)
                sent = os.write(peer.fd, peer.unsent)
            except BlockingIOError:
                continue
            except (OSError, trio.ClosedResourceError):
                return  # gone: its read sees the end
            peer.unsent = peer.unsent[sent:]


def trio_relay_main(path: str, ready: Pipe) -> None:
    trio.run(TrioRelay().serve, path, ready)


# --- starting one ------------------------------------------------------------------


def start_relay(ctx: Any, main: Callable[[str, Pipe], None], path: str, *, timeout_s: float) -> tuple[Any, int]:
    """``main`` (``relay_main`` or ``trio_relay_main``) in a process of its own, listening on
    ``path`` once this returns: (the process, its pid)."""
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=main, args=(path, theirs), name=main.__name__.removesuffix("_main"), daemon=True)
    proc.start()
    theirs.close()
    try:
        if not ours.poll(timeout_s):
            proc.terminate()
            raise RuntimeError(f"{proc.name} did not start within {timeout_s:g} s")
        pid: int = ours.recv()
    except EOFError:
        raise RuntimeError(f"{proc.name} died before listening (its traceback is above)") from None
    finally:
        ours.close()
    return proc, pid
