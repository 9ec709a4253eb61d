"""A connection refused by a cap (connections in all, per uid) is told why, in words: one ERROR
naming the cap and its value before the close, shown by gpuctl, the bare ``Connection``, the sync
``Client`` and the asyncio ``AsyncClient`` as a ``ProtocolError`` — never as a lost connection,
whether the client's HELLO reaches the daemon before the refusal or only after the close.

Real daemons with caps of 2; every wait polls against a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, GpudError, ProtocolError
from gpud_client import protocol as p
from gpud_client._async_driver import Wire
from gpud_client.aio import AsyncClient
from gpud_client.connection import Connection

from .waiting import eventually, eventually_async
from .wire import connect

Factory = Callable[..., DaemonProcess]
CAPS = ["max_connections_per_uid", "max_connections"]


def full(factory: Factory, tmp_path: Path, cap: str) -> tuple[DaemonProcess, list[Connection]]:
    """A daemon whose ``cap`` is 2, and the two connections that fill it."""
    cfg = tmp_path / "gpud.toml"
    cfg.write_text(f"{cap} = 2\n")
    d = factory("--simulate", "1", "--config", str(cfg))
    held: list[Connection] = []

    def one_more() -> bool:
        try:
            held.append(connect(d, f"held{len(held)}"))
        except GpudError:
            pass  # the start-up probe's connection is not closed yet
        return len(held) == 2

    eventually(one_more, "two connections held", why=d.log)
    return d, held


def words(cap: str) -> str:
    """What the refusal says: the cap, its value, and the uid for the per-uid cap."""
    if cap == "max_connections_per_uid":
        return f"gpud refused the connection: uid {os.getuid()} already has 2 connections (max_connections_per_uid)"
    return "gpud refused the connection: it serves at most 2 connections (max_connections)"


def check(err: ProtocolError, cap: str) -> None:
    assert err.code == p.ErrorCode.LIMIT_REACHED, err
    assert words(cap) in err.message, err.message


def hung_up(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return any(events & select.POLLHUP for _, events in poller.poll(0))


@pytest.mark.parametrize("cap", CAPS)
def test_gpuctl_says_which_cap_refused_it(daemon_factory: Factory, tmp_path: Path, cap: str) -> None:
    d, held = full(daemon_factory, tmp_path, cap)
    out = subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(f"gpuctl: limit_reached: {words(cap)}"), out.stderr
    assert out.stderr.count("\n") == 1
    for c in held:
        assert isinstance(c.call(p.Status(id=c.next_id())), p.StatusReply)  # the others are served


@pytest.mark.parametrize("cap", CAPS)
def test_the_bare_connection_and_the_sync_client_raise_the_refusal(
    daemon_factory: Factory, tmp_path: Path, cap: str
) -> None:
    d, _ = full(daemon_factory, tmp_path, cap)
    with pytest.raises(ProtocolError) as refused:
        Connection(d.socket).hello("bare")
    check(refused.value, cap)
    with pytest.raises(ProtocolError) as refused:
        Client(d.socket, name="sync", reconnect=False)
    check(refused.value, cap)


@pytest.mark.parametrize("cap", CAPS)
def test_the_asyncio_client_raises_the_refusal(daemon_factory: Factory, tmp_path: Path, cap: str) -> None:
    d, _ = full(daemon_factory, tmp_path, cap)

    async def main() -> None:
        with pytest.raises(ProtocolError) as refused:
            await AsyncClient.connect(d.socket, name="aio", reconnect=False)
        check(refused.value, cap)

    asyncio.run(main())


def test_a_hello_sent_after_the_refusal_closed_the_connection_still_shows_it(
    daemon_factory: Factory, tmp_path: Path
) -> None:
    """The other order: the daemon gave up waiting for the HELLO and closed, so writing it fails
    (EPIPE); what the daemon said before the close is still there to read, and is shown."""
    cap = "max_connections_per_uid"
    d, _ = full(daemon_factory, tmp_path, cap)
    late = Connection(d.socket)
    eventually(lambda: hung_up(late.sock), "the daemon closed the silent connection")
    with pytest.raises(ProtocolError) as refused:
        late.hello("late")
    check(refused.value, cap)
    late.close()

    async def main() -> None:
        wire = await Wire.open(d.socket)
        sock = wire._writer.get_extra_info("socket")
        # the loop runs meanwhile: the ERROR and the end are read
        await eventually_async(lambda: hung_up(sock), "the daemon closed the silent connection")
        wire.write(p.client_codec().encode(p.Hello(id=1, version=p.PROTOCOL_VERSION, name="late")))
        with contextlib.suppress(OSError):
            await wire._writer.wait_closed()  # the write failed (EPIPE) and the transport is gone
        said = await wire.recv()
        wire.close()
        assert isinstance(said, p.Error) and said.id is None
        check(ProtocolError(said.code, said.message), cap)

    asyncio.run(main())


def test_refused_peers_that_never_speak_nor_read_hold_nothing(daemon_factory: Factory, tmp_path: Path) -> None:
    """More silent refused peers than the daemon keeps waiting for a HELLO: each gets its ERROR
    and is closed, and the held connections are served meanwhile."""
    cap = "max_connections_per_uid"
    d, held = full(daemon_factory, tmp_path, cap)
    silent = []
    for _ in range(40):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.socket)
        silent.append(s)
    for c in held:
        assert isinstance(c.call(p.Status(id=c.next_id())), p.StatusReply)
    eventually(lambda: all(hung_up(s) for s in silent), "every silent peer closed by the daemon", why=d.log)
    codec = p.client_codec()
    for s in silent:
        s.settimeout(5)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        s.close()
        (said,) = [codec.decode(f) for f in p.FrameDecoder(p.MAX_REPLY_BYTES).feed(data)]
        assert isinstance(said, p.Error) and said.id is None
        check(ProtocolError(said.code, said.message), cap)
    for c in held:
        assert isinstance(c.call(p.Status(id=c.next_id())), p.StatusReply)
        c.close()
