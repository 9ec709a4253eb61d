"""Small helpers for talking the raw protocol to a real daemon in tests."""

from __future__ import annotations

from typing import Any

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection

from .waiting import eventually


def connect(d: DaemonProcess, name: str = "test") -> Connection:
    conn = Connection(d.socket)
    conn.hello(name)
    return conn


def attach(conn: Connection, gpu: int | str = 0, priority: int = 0) -> int:
    reply = conn.call(p.Attach(id=conn.next_id(), gpu=gpu, priority=priority))
    assert isinstance(reply, p.Attached)
    return reply.session


def request(conn: Connection, session: int) -> None:
    conn.send(p.LockRequest(id=conn.next_id(), session=session))


def expect(conn: Connection, kind: type, timeout: float = 5.0) -> Any:
    msg = conn.recv(timeout)
    assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
    return msg


def take_lock(conn: Connection, session: int) -> p.LockOk:
    request(conn, session)
    ok: p.LockOk = expect(conn, p.LockOk)
    assert ok.session == session
    return ok


def gpu_status(conn: Connection, gpu: int = 0) -> p.GpuStatus:
    reply = conn.call(p.Status(id=conn.next_id()))
    status: p.GpuStatus = reply.gpus[gpu]
    return status


def nothing_arrives(conn: Connection, within: float = 0.2) -> bool:
    try:
        msg = conn.recv(within)
    except TimeoutError:
        return True
    raise AssertionError(f"unexpected message {msg!r}")


def wait_queue(conn: Connection, expected: list[int], gpu: int = 0, timeout: float = 10.0) -> None:
    """Poll STATUS until GPU ``gpu``'s queue is ``expected`` (no blind sleeps)."""
    got: list[int] = []

    def queued() -> bool:
        got[:] = [w.session for w in gpu_status(conn, gpu).queue]
        return got == expected

    eventually(queued, f"GPU {gpu}'s queue is {expected}", timeout, why=lambda: f"it is {got}")


NOBODY = 65534
