"""The protocol's types keep their rules: keyword-only, frozen, limits named once.

msgspec passes ``frozen`` down to subclasses but not ``kw_only``, so a message
added without ``kw_only=True`` would quietly accept positional arguments. These
tests walk every Struct that protocol.py defines, so a new one that breaks a
rule fails here without anyone listing it. The last test checks against a real
daemon what WELCOME's ``max_frame_bytes`` promises.
"""

from __future__ import annotations

import inspect
import io
import socket
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p

STRUCTS: list[type[msgspec.Struct]] = sorted(
    (
        obj
        for obj in vars(p).values()
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == p.__name__
    ),
    key=lambda cls: cls.__name__,
)
MESSAGES: list[type[msgspec.Struct]] = [*p.ClientMessage.__args__, *p.DaemonMessage.__args__]  # type: ignore[attr-defined]


def _name(cls: type) -> str:
    return cls.__name__


def _accepts_positional(cls: type[msgspec.Struct]) -> bool:
    """Whether cls(x) gets past msgspec's positional check. Only msgspec's own message counts:
    a struct with two required fields also raises TypeError on cls(x), for the missing one."""
    try:
        cls(1)
    except TypeError as exc:
        return "positional" not in str(exc)
    return True


def _inline_limits(source: str) -> list[str]:
    """The names that write a limit in place (``Annotated``, ``Meta``) in code, not comments."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [t.string for t in tokens if t.type == tokenize.NAME and t.string in {"Annotated", "Meta"}]


def test_the_walk_finds_every_message_and_the_nested_structs() -> None:
    assert set(MESSAGES) <= set(STRUCTS)
    assert {p.GpuInfo, p.Trace, p.LeaseInfo, p.GpuStatus, p.SessionInfo} <= set(STRUCTS)


@pytest.mark.parametrize("cls", STRUCTS, ids=_name)
def test_every_struct_is_keyword_only(cls: type[msgspec.Struct]) -> None:
    assert not _accepts_positional(cls)


def test_the_keyword_only_check_catches_a_struct_without_it() -> None:
    class TwoRequired(msgspec.Struct, frozen=True):
        a: int
        b: int

    class AllDefaults(msgspec.Struct, frozen=True):
        a: int = 0

    assert _accepts_positional(TwoRequired) and _accepts_positional(AllDefaults)


@pytest.mark.parametrize("cls", MESSAGES, ids=_name)
def test_every_message_is_frozen(cls: type[msgspec.Struct]) -> None:
    assert cls.__struct_config__.frozen


@pytest.mark.parametrize("cls", STRUCTS, ids=_name)
def test_no_struct_writes_a_limit_inline(cls: type[msgspec.Struct]) -> None:
    assert _inline_limits(inspect.getsource(cls)) == [], "name the limit at the top of protocol.py"


def test_the_inline_check_catches_an_inline_limit_and_ignores_comments() -> None:
    inline = 'class X(_Msg, tag="X", frozen=True, kw_only=True):\n    n: Annotated[int, Meta(ge=0)] = 0\n'
    named = 'class X(_Msg, tag="X", frozen=True, kw_only=True):\n    n: Count = 0  # was Annotated[int, Meta(ge=0)]\n'
    assert _inline_limits(inline) == ["Annotated", "Meta"]
    assert _inline_limits(named) == []


def test_welcome_defaults_to_the_default_frame_limit() -> None:
    welcome = p.Welcome(id=1, client_id=1, version=p.PROTOCOL_VERSION, gpus=[])
    assert welcome.max_frame_bytes == p.MAX_FRAME_BYTES


# --- against a real daemon ---------------------------------------------------


def _read_frames(s: socket.socket, want: int) -> list[Any]:
    """The next ``want`` messages, or fewer if the daemon closes first."""
    frames, got = p.FrameDecoder(p.MAX_REPLY_BYTES), list[bytes]()
    while len(got) < want and (chunk := s.recv(65536)):
        got += frames.feed(chunk)
    codec = p.client_codec()
    return [codec.decode(x) for x in got]


def _payload_of(size: int) -> bytes:
    """A STATUS request padded with an unknown field to exactly ``size`` bytes."""
    base = len(msgspec.msgpack.encode({"type": "STATUS", "id": 2, "pad": "x" * 300}))
    payload = msgspec.msgpack.encode({"type": "STATUS", "id": 2, "pad": "x" * (300 + size - base)})
    assert len(payload) == size
    return payload


def test_welcome_tells_the_configured_frame_limit_and_it_is_exact(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    limit = 2048
    cfg = tmp_path / "gpud.toml"
    cfg.write_text(f"max_frame_bytes = {limit}\n")
    d = daemon_factory("--simulate", "1", "--config", str(cfg))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(d.socket)
        s.settimeout(5)
        s.sendall(p.client_codec().encode(p.Hello(id=1, version=p.PROTOCOL_VERSION)))
        (welcome,) = _read_frames(s, 1)
        assert isinstance(welcome, p.Welcome) and welcome.max_frame_bytes == limit
        # len(payload) == max_frame_bytes: read and answered (here: the pad field is refused).
        s.sendall(p.frame(_payload_of(limit)))
        (answer,) = _read_frames(s, 1)
        assert isinstance(answer, p.Error) and (answer.id, answer.code) == (2, p.ErrorCode.INVALID)
        # One byte more: refused unread, and the connection is closed.
        s.sendall(p.frame(_payload_of(limit + 1)))
        errors = _read_frames(s, 2)
        assert [e.code for e in errors] == [p.ErrorCode.FRAME_TOO_LARGE]
        assert f"{limit + 1} bytes is over the {limit}-byte limit" in errors[0].message


def test_a_client_ignores_answer_fields_a_newer_daemon_added_and_the_daemon_refuses_unknown_request_fields() -> None:
    welcome = {"type": "WELCOME", "id": 1, "client_id": 2, "version": 1, "gpus": [], "from_the_future": 1}
    decoded = p.client_codec().decode(msgspec.msgpack.encode(welcome))
    assert isinstance(decoded, p.Welcome) and decoded.max_frame_bytes == p.MAX_FRAME_BYTES
    hello = {"type": "HELLO", "id": 1, "version": 1, "from_the_future": 1}
    with pytest.raises(msgspec.ValidationError, match="from_the_future"):
        p.daemon_codec().decode(msgspec.msgpack.encode(hello))
