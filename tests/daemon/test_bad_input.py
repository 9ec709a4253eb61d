"""Bad input never crashes the daemon or disturbs another client's lock: in process, on a fake clock.

A real ``Daemon`` (``tests/inprocess.py``) where another client holds GPU 0's lock
throughout. Payloads go through the listener's own ``handle_payload``; bytes that must be
framed first (random bytes, an oversized length prefix) go through its connection task,
``serve_connection``, over a socket pair, so its own framing and read loop judge them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from inprocess import Node, Peer
from structlog.testing import capture_logs

from gpud.host.metrics import FAULT_PLACES
from gpud_client import protocol as p

HELLO = {"type": "HELLO", "id": 1, "version": p.PROTOCOL_VERSION}


class Held:
    """A node where ``holder`` holds GPU 0's lock (its ``session``, its ``grant``)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.holder = node.connect("holder")
        self.session = int(self.holder.call(p.Attach(id=0, gpu=0)).session)
        self.holder.send(p.LockRequest(id=0, session=self.session))
        [ok] = self.holder.pushes(p.LockOk)
        self.grant = int(ok.grant)

    def still_fine(self) -> None:
        """The daemon serves a newcomer and the holder's lock is untouched."""
        other = self.node.connect("bystander")
        st = other.call(p.Status(id=0)).gpus[0]
        assert [(h.session, h.grant) for h in st.holders] == [(self.session, self.grant)]
        assert st.revocations == 0 and st.drops == {}
        self.holder.send(p.LockReleased(id=0, session=self.session, grant=self.grant))
        self.holder.send(p.LockRequest(id=0, session=self.session))
        assert [m.session for m in self.holder.pushes(p.LockOk)] == [self.session]  # its connection still works
        self.node.close(other)


@pytest.fixture
def held(nodes: Callable[..., Node]) -> Held:
    return Held(nodes())


def raw(node: Node) -> Peer:
    """A new connection that has said nothing yet."""
    return node.connect("raw", hello=False)


def feed(peer: Peer, obj: dict[str, Any] | bytes) -> list[Any]:
    """One payload (a map is encoded first) and everything that came back."""
    peer.feed(obj if isinstance(obj, bytes) else msgspec.msgpack.encode(obj))
    return peer.received()


def hello(peer: Peer) -> None:
    [welcome] = feed(peer, HELLO)
    assert isinstance(welcome, p.Welcome)


def test_random_bytes_get_an_error_and_a_close(held: Held) -> None:
    errors = held.node.serve_bytes(os.urandom(4096))
    assert len(errors) == 1 and isinstance(errors[0], p.Error)
    assert errors[0].code in (p.ErrorCode.FRAME_TOO_LARGE, p.ErrorCode.BAD_FRAME)
    held.still_fine()


def test_a_frame_that_is_not_msgpack_gets_bad_frame_and_a_close(held: Held) -> None:
    s = raw(held.node)
    errors = feed(s, b"\xc1\xc1")
    assert [e.code for e in errors] == [p.ErrorCode.BAD_FRAME]
    assert s.closed
    held.still_fine()


def test_an_oversized_frame_is_refused_and_closed(held: Held) -> None:
    greeting = p.frame(msgspec.msgpack.encode(HELLO))
    welcome, *errors = held.node.serve_bytes(greeting, (10 * 2**20).to_bytes(4, "big") + b"\x00" * 1000)
    assert isinstance(welcome, p.Welcome)
    assert [e.code for e in errors] == [p.ErrorCode.FRAME_TOO_LARGE]
    assert "10485760 bytes" in errors[0].message and "65536-byte limit" in errors[0].message
    held.still_fine()


def test_requests_before_an_oversized_frame_in_the_same_read_are_answered_first(held: Held) -> None:
    greeting = p.frame(msgspec.msgpack.encode(HELLO))
    status = p.frame(msgspec.msgpack.encode({"type": "STATUS", "id": 2}))
    oversized = (10 * 2**20).to_bytes(4, "big") + b"\x00" * 1000
    welcome, answer, *errors = held.node.serve_bytes(greeting + status + oversized)
    assert isinstance(welcome, p.Welcome) and isinstance(answer, p.StatusReply) and answer.id == 2
    assert [e.code for e in errors] == [p.ErrorCode.FRAME_TOO_LARGE]
    held.still_fine()


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
    held: Held, message: dict[str, object], code: p.ErrorCode, needle: str
) -> None:
    s = raw(held.node)
    hello(s)
    [err] = feed(s, message)
    assert isinstance(err, p.Error)
    assert (err.id, err.code) == (3, code)
    assert needle in err.message
    [status] = feed(s, {"type": "STATUS", "id": 4})  # the same connection still serves
    assert isinstance(status, p.StatusReply)
    held.still_fine()


@pytest.mark.parametrize(
    "payload",
    [
        b"\xa1\xff",  # a lone string that is not UTF-8
        b"\x81\xa4type\xa2\xc3\x28",  # a type that is not UTF-8
        b"\x83\xa4type\xa6ATTACH\xa2id\x03\xa3gpu\xa2\xc3\x28",  # a field that is not UTF-8
        b"\x91" * 50_000 + b"\xc0",  # nested too deeply to read
    ],
)
def test_unreadable_msgpack_is_a_peer_error_not_a_fault(held: Held, payload: bytes) -> None:
    s = raw(held.node)
    hello(s)
    with capture_logs() as logs:
        errors = feed(s, payload)
    assert [e.code for e in errors] == [p.ErrorCode.BAD_FRAME]
    assert s.closed
    assert [e for e in logs if e["event"] == "fault" or "exc_info" in e] == []
    assert [held.node.faults(where) for where in FAULT_PLACES] == [0] * len(FAULT_PLACES)
    held.still_fine()


def test_a_request_before_hello_is_refused(held: Held) -> None:
    s = raw(held.node)
    [err] = feed(s, {"type": "LOCK_RELEASED", "id": 9, "session": held.session})
    assert isinstance(err, p.Error)
    assert (err.id, err.code) == (9, p.ErrorCode.HELLO_REQUIRED)
    assert "HELLO" in err.message
    held.still_fine()


def test_a_wrong_protocol_version_is_refused_and_closed(held: Held) -> None:
    s = raw(held.node)
    errors = feed(s, {"type": "HELLO", "id": 1, "version": 999})
    assert [e.code for e in errors] == [p.ErrorCode.VERSION]
    assert "999" in errors[0].message
    assert s.closed
    held.still_fine()
