"""The sync client against a real daemon: what only the threaded driver has (the behaviours both
clients share are in test_client_behaviour.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, DaemonUnavailable, ErrorCode, GpudError, ProtocolError
from gpud_client import protocol as p

from .waiting import eventually
from .wire import attach, connect, expect, gpu_status, request


def test_a_drop_between_slices_is_answered_at_once(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "1", "--tq", "0.1")
    with Client(d.socket) as c:
        s = c.session(0, idle_release=None)
        with s.slice():
            pass
        other = connect(d)
        so = attach(other)
        request(other, so)
        expect(other, p.LockOk, timeout=2)
        assert s.drops == 1 and not s.holding
        # the next slice waits its turn
        done = threading.Event()

        def work() -> None:
            with s.slice():
                done.set()

        t = threading.Thread(target=work)
        t.start()
        assert not done.wait(0.2)
        other.send(p.LockReleased(id=99, session=so))
        assert done.wait(2)
        t.join()


def test_refusals_raise_with_their_code(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        with pytest.raises(ProtocolError) as err:
            c.session("gpu:7")
        assert err.value.code == ErrorCode.UNKNOWN_GPU
        assert "unknown GPU 'gpu:7'" in str(err.value)


def test_no_daemon_raises_daemon_unavailable() -> None:
    with pytest.raises(DaemonUnavailable, match="cannot connect to gpud at /tmp/gpud-nowhere/s"):
        Client("/tmp/gpud-nowhere/s")


def test_reconnect_and_reattach_after_a_daemon_restart(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="survivor", unavailable_timeout=10) as c:
        s = c.session(1, idle_release=None)
        with s.slice():
            pass
        daemon.stop()
        eventually(lambda: c._conn is None and not s.holding, "the client sees the daemon gone")
        daemon.start()
        eventually(lambda: c.reconnects == 1, "the client reconnects")
        with s.slice():
            assert s.holding
        st = gpu_status(connect(daemon), 1)
        assert [h.name for h in st.holders] == ["survivor"]
        assert s.id != 0 and s.gpu == 1


def test_a_slice_begun_as_the_daemon_dies_waits_for_the_reconnect(daemon: DaemonProcess) -> None:
    """The LOCK_REQUEST goes out before the reader thread has seen the connection end:
    the slice waits for the reconnect (as if the reader had seen it first), never fails
    at once with a broken pipe."""
    with Client(daemon.socket, name="early", unavailable_timeout=20) as c:
        s = c.session(0, idle_release=None)
        with c._lock:  # the reader thread cannot handle the closed connection meanwhile
            daemon.stop(sig=9)
            restarted = threading.Thread(target=daemon.start)
            restarted.start()
            with s.slice():  # its request meets the dead socket; it waits for the new daemon
                assert s.holding
        restarted.join()
        assert c.reconnects == 1


def test_closing_a_held_session_frees_the_lock(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        s = c.session(0, idle_release=None)
        with s.slice():
            s.close()
            assert not s.holding
        eventually(lambda: gpu_status(connect(daemon)).holders == [], "the lock is free")
        assert gpu_status(connect(daemon)).clients == 0


def test_two_threads_cannot_share_one_sessions_slice(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        s = c.session(0, idle_release=None)
        inside = threading.Event()
        leave = threading.Event()
        errors: list[str] = []

        def first() -> None:
            with s.slice():
                inside.set()
                leave.wait(5)

        t = threading.Thread(target=first)
        t.start()
        assert inside.wait(5)
        try:
            with s.slice():
                pass
        except GpudError as exc:
            errors.append(str(exc))
        leave.set()
        t.join()
        assert errors and "do not nest" in errors[0]


def test_a_request_sent_as_the_connection_is_replaced_never_reaches_the_new_daemon(daemon: DaemonProcess) -> None:
    """A request is registered on one connection and written outside the client's lock; if the
    daemon restarted in between, the request fails with the old connection: written to the new
    one, an ACQUIRE would take a lease there that no caller knows of."""
    with Client(daemon.socket, name="racer", request_timeout=2) as c:
        write = c._write
        restarted = False

        def write_after_a_restart(data: bytes, conn: Any) -> None:
            nonlocal restarted
            if not restarted:
                restarted = True
                daemon.stop(sig=9)
                daemon.start()
                eventually(lambda: c.reconnects == 1, "the client reconnects")
            write(data, conn)

        c._write = write_after_a_restart  # type: ignore[method-assign]
        with pytest.raises(DaemonUnavailable):  # at once: it failed with its connection
            c.acquire("gpu:0", "ASR", max_wait_ms=5000)  # would outwait the restart grace on the new daemon
        c._write = write  # type: ignore[method-assign]
        assert restarted and c.leases().leases == []
        with c.lease("gpu:0", "ASR", max_wait_ms=5000) as r:
            assert r.acquired
