"""Bad input never crashes the daemon or disturbs another client's lock."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import msgspec
import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import DaemonUnavailable

from .wire import attach, connect, expect, gpu_status, take_lock


@pytest.fixture
def held(daemon: DaemonProcess) -> Iterator[tuple[DaemonProcess, Connection, int, int]]:
    """A daemon where another client holds GPU 0's lock throughout."""
    holder = connect(daemon, "holder")
    session = attach(holder)
    ok = take_lock(holder, session)
    yield daemon, holder, session, ok.grant
    holder.close()


def raw(d: DaemonProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(d.socket)
    s.settimeout(5)
    return s


def read_all(s: socket.socket) -> list[p.Error]:
    """Everything the daemon says until it closes the connection."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    codec = p.client_codec()
    return [codec.decode(x) for x in p.FrameDecoder().feed(data)]


def send_frame(s: socket.socket, obj: object) -> None:
    s.sendall(p.frame(msgspec.msgpack.encode(obj)))


def hello(s: socket.socket) -> None:
    send_frame(s, {"type": "HELLO", "id": 1, "version": p.PROTOCOL_VERSION})
    assert isinstance(read_one(s), p.Welcome)


def read_one(s: socket.socket) -> object:
    dec, got = p.FrameDecoder(), []
    while not got:
        chunk = s.recv(65536)
        assert chunk, "the daemon closed the connection"
        got = dec.feed(chunk)
    return p.client_codec().decode(got[0])


def still_fine(d: DaemonProcess, holder: Connection, session: int, grant: int) -> None:
    """The daemon serves a newcomer and the holder's lock is untouched."""
    other = connect(d, "bystander")
    st = gpu_status(other)
    assert [(h.session, h.grant) for h in st.holders] == [(session, grant)]
    assert st.revocations == 0 and st.drops == {}
    holder.send(p.LockReleased(id=holder.next_id(), session=session, grant=grant))
    holder.send(p.LockRequest(id=holder.next_id(), session=session))
    assert expect(holder, p.LockOk).session == session  # the holder's connection still works
    other.close()


def test_random_bytes_get_an_error_and_a_close(held: tuple[DaemonProcess, Connection, int, int]) -> None:
    d, holder, session, grant = held
    s = raw(d)
    s.sendall(os.urandom(4096))
    errors = read_all(s)
    assert len(errors) == 1 and isinstance(errors[0], p.Error)
    assert errors[0].code in (p.ErrorCode.FRAME_TOO_LARGE, p.ErrorCode.BAD_FRAME)
    still_fine(d, holder, session, grant)


def test_a_frame_that_is_not_msgpack_gets_bad_frame_and_a_close(
    held: tuple[DaemonProcess, Connection, int, int],
) -> None:
    d, holder, session, grant = held
    s = raw(d)
    s.sendall(p.frame(b"\xc1\xc1"))
    errors = read_all(s)
    assert [e.code for e in errors] == [p.ErrorCode.BAD_FRAME]
    still_fine(d, holder, session, grant)


def test_an_oversized_frame_is_refused_and_closed(held: tuple[DaemonProcess, Connection, int, int]) -> None:
    d, holder, session, grant = held
    s = raw(d)
    hello(s)
    s.sendall((10 * 2**20).to_bytes(4, "big") + b"\x00" * 1000)
    errors = read_all(s)
    assert [e.code for e in errors] == [p.ErrorCode.FRAME_TOO_LARGE]
    assert "10485760 bytes" in errors[0].message and "65536-byte limit" in errors[0].message
    still_fine(d, holder, session, grant)


@pytest.mark.parametrize(
    ("message", "code", "needle"),
    [
        ({"type": "FORMAT_DISK", "id": 3}, p.ErrorCode.UNKNOWN_TYPE, "FORMAT_DISK"),
        ({"type": "LOCK_REQUEST", "id": 3, "session": "one"}, p.ErrorCode.INVALID, "$.session"),
        ({"type": "ATTACH", "id": 3, "gpu": [0]}, p.ErrorCode.INVALID, "$.gpu"),
        ({"type": "SET_TQ", "id": 3, "seconds": -5.0}, p.ErrorCode.INVALID, "$.seconds"),
        ({"type": "ATTACH", "id": 3, "gpu": 0, "priority": 1000}, p.ErrorCode.INVALID, "$.priority"),
        ({"type": "ATTACH", "id": 3, "gpu": 9}, p.ErrorCode.UNKNOWN_GPU, "unknown GPU 9"),
        ({"type": "LOCK_REQUEST", "id": 3, "session": 424242}, p.ErrorCode.UNKNOWN_SESSION, "424242"),
        ({"type": "HELLO", "id": 3, "version": p.PROTOCOL_VERSION}, p.ErrorCode.INVALID, "already"),
    ],
)
def test_bad_requests_get_an_error_naming_the_problem_and_the_connection_stays(
    held: tuple[DaemonProcess, Connection, int, int], message: dict[str, object], code: p.ErrorCode, needle: str
) -> None:
    d, holder, session, grant = held
    s = raw(d)
    hello(s)
    send_frame(s, message)
    err = read_one(s)
    assert isinstance(err, p.Error)
    assert (err.id, err.code) == (3, code)
    assert needle in err.message
    send_frame(s, {"type": "STATUS", "id": 4})  # the same connection still serves
    assert isinstance(read_one(s), p.StatusReply)
    still_fine(d, holder, session, grant)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xa1\xff",  # a lone string that is not UTF-8
        b"\x81\xa4type\xa2\xc3\x28",  # a type that is not UTF-8
        b"\x83\xa4type\xa6ATTACH\xa2id\x03\xa3gpu\xa2\xc3\x28",  # a field that is not UTF-8
        b"\x91" * 50_000 + b"\xc0",  # nested too deeply to read
    ],
)
def test_unreadable_msgpack_is_a_peer_error_not_a_fault(
    held: tuple[DaemonProcess, Connection, int, int], payload: bytes
) -> None:
    d, holder, session, grant = held
    s = raw(d)
    hello(s)
    s.sendall(p.frame(payload))
    errors = read_all(s)
    assert [e.code for e in errors] == [p.ErrorCode.BAD_FRAME]
    assert '"fault"' not in d.log() and "Traceback" not in d.log()
    still_fine(d, holder, session, grant)


def test_a_request_before_hello_is_refused(held: tuple[DaemonProcess, Connection, int, int]) -> None:
    d, holder, session, grant = held
    s = raw(d)
    send_frame(s, {"type": "LOCK_RELEASED", "id": 9, "session": session})
    err = read_one(s)
    assert isinstance(err, p.Error)
    assert (err.id, err.code) == (9, p.ErrorCode.HELLO_REQUIRED)
    assert "HELLO" in err.message
    still_fine(d, holder, session, grant)


def test_a_wrong_protocol_version_is_refused_and_closed(held: tuple[DaemonProcess, Connection, int, int]) -> None:
    d, holder, session, grant = held
    s = raw(d)
    send_frame(s, {"type": "HELLO", "id": 1, "version": 999})
    errors = read_all(s)
    assert [e.code for e in errors] == [p.ErrorCode.VERSION]
    assert "999" in errors[0].message
    still_fine(d, holder, session, grant)


def test_no_daemon_is_a_clear_error(tmp_path: object) -> None:
    with pytest.raises(DaemonUnavailable, match="is gpud running"):
        Connection("/tmp/gpud-no-such-dir/gpud.sock")
