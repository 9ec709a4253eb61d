"""Framing and message decoding: pure, no sockets."""

from __future__ import annotations

import msgspec
import pytest

from gpud_client import protocol as p


def test_frames_roundtrip_across_arbitrary_chunking() -> None:
    enc = p.client_codec()
    msgs = [p.Hello(id=1, version=1, name="a"), p.LockRequest(id=2, session=7), p.Status(id=3)]
    data = b"".join(enc.encode(m) for m in msgs)
    dec, got = p.FrameDecoder(), []
    for i in range(0, len(data), 3):
        got += dec.feed(data[i : i + 3])
    assert [p.daemon_codec().decode(x) for x in got] == msgs
    assert dec.pending_bytes == 0


def test_an_oversized_length_is_refused_before_buffering() -> None:
    dec = p.FrameDecoder(max_frame=1024)
    with pytest.raises(p.FrameTooLarge) as err:
        dec.feed((1025).to_bytes(4, "big") + b"x" * 10)
    assert "1025 bytes" in str(err.value) and "1024-byte limit" in str(err.value)


def test_the_frame_length_is_big_endian() -> None:
    assert p.frame(b"abc") == b"\x00\x00\x00\x03abc"


@pytest.mark.parametrize(
    ("raw", "code", "needle", "rid"),
    [
        ({"type": "NOPE", "id": 4}, p.ErrorCode.UNKNOWN_TYPE, "NOPE", 4),
        ({"type": "LOCK_REQUEST", "id": 5, "session": "x"}, p.ErrorCode.INVALID, "$.session", 5),
        ({"type": "SET_TQ", "id": 6, "seconds": -1.0}, p.ErrorCode.INVALID, "$.seconds", 6),
        ({"type": "ATTACH", "id": 7, "gpu": 0, "priority": 101}, p.ErrorCode.INVALID, "$.priority", 7),
        ({"type": "LOCK_REQUEST", "id": 8}, p.ErrorCode.INVALID, "session", 8),
        ({"type": "STATUS", "id": 9, "extra": 1}, p.ErrorCode.INVALID, "extra", 9),
        ([1, 2, 3], p.ErrorCode.INVALID, "map", None),
        ({"type": "STATUS", "id": -1}, p.ErrorCode.INVALID, "$.id", None),
    ],
)
def test_bad_messages_are_described_with_the_field_and_the_request_id(
    raw: object, code: p.ErrorCode, needle: str, rid: int | None
) -> None:
    payload = msgspec.msgpack.encode(raw)
    with pytest.raises(msgspec.ValidationError) as err:
        p.daemon_codec().decode(payload)
    got_id, got_code, message = p.describe_bad_message(payload, err.value)
    assert (got_id, got_code) == (rid, code)
    assert needle in message


def test_a_payload_that_is_not_msgpack_is_a_bad_frame() -> None:
    payload = b"\xc1\xc1\xc1"
    with pytest.raises(msgspec.DecodeError) as err:
        p.daemon_codec().decode(payload)
    assert p.describe_bad_message(payload, err.value)[1] == p.ErrorCode.BAD_FRAME


def test_socket_path_is_flag_then_environment_then_default() -> None:
    assert p.resolve_socket_path("/x.sock", {"GPUD_SOCKET": "/y.sock"}) == "/x.sock"
    assert p.resolve_socket_path(None, {"GPUD_SOCKET": "/y.sock"}) == "/y.sock"
    assert p.resolve_socket_path(None, {}) == "/run/gpud/gpud.sock"


def test_the_client_package_imports_with_msgspec_alone() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('trio', 'structlog', 'prometheus_client', 'pynvml', 'gpud'):\n"
        "    sys.modules[m] = None\n"
        "import gpud_client\n"
        "from gpud_client import Client, Connection, protocol\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
