"""The sync client library against a real daemon."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from gpud.spawn import DaemonProcess
from gpud_client import Client, DaemonUnavailable, ErrorCode, GpudError, ProtocolError
from gpud_client import protocol as p

from .wire import attach, connect, expect, gpu_status, nothing_arrives, request


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_the_lock_is_kept_between_slices(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="loop") as c:
        s = c.session(0, idle_release=None)
        for _ in range(20):
            with s.slice():
                assert s.holding
        assert s.holding and s.grants == 1
        st = gpu_status(connect(daemon))
        assert [h.name for h in st.holders] == ["loop"] and st.grants == 1


def test_an_unused_lock_is_released_after_idle_release(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        s = c.session(0, idle_release=0.2)
        with s.slice():
            pass
        t0 = time.monotonic()
        wait_for(lambda: not s.holding)
        assert time.monotonic() - t0 >= 0.15
        wait_for(lambda: gpu_status(connect(daemon)).holders == [])


def test_a_pending_drop_releases_at_slice_exit_with_callback_and_sync(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory("--simulate", "1", "--tq", "0.1")
    events: list[str] = []
    with Client(d.socket, name="trainer") as c:
        s = c.session(0, idle_release=None, on_drop=lambda r: events.append(f"drop:{r}"),
                      synchronize=lambda: events.append("sync"))
        other = connect(d, "other")
        so = attach(other)
        with s.slice():
            request(other, so)
            wait_for(lambda: s.drop_pending is not None)
            assert events == ["drop:tq"]  # told at once, while the slice still runs
            assert gpu_status(other).holders[0].name == "trainer"
        expect(other, p.LockOk)
        assert events == ["drop:tq", "sync"] and not s.holding and s.drops == 1


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
        wait_for(lambda: c._conn is None and not s.holding)
        daemon.start()
        wait_for(lambda: c.reconnects == 1)
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


def test_daemon_away_raises_after_unavailable_timeout(daemon: DaemonProcess) -> None:
    c = Client(daemon.socket, unavailable_timeout=0.3)
    try:
        s = c.session(0)
        daemon.stop()
        wait_for(lambda: c._conn is None)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="unreachable"):
            with s.slice():
                pass
        assert time.monotonic() - t0 >= 0.25
    finally:
        c.close()


def test_daemon_away_can_proceed_unarbitrated_when_asked(daemon: DaemonProcess) -> None:
    c = Client(daemon.socket, unavailable_timeout=0.1, proceed_unarbitrated=True)
    try:
        s = c.session(0)
        daemon.stop()
        wait_for(lambda: c._conn is None)
        ran = False
        with s.slice():
            ran = True
        assert ran and not s.holding
    finally:
        c.close()


def test_slices_do_not_nest_and_closed_sessions_refuse(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        s = c.session(0)
        with s.slice():
            with pytest.raises(GpudError, match="do not nest"):
                with s.slice():
                    pass
        s.close()
        with pytest.raises(GpudError, match="closed"):
            with s.slice():
                pass
        wait_for(lambda: gpu_status(connect(daemon)).holders == [])


def test_acquire_keeps_the_lock_until_release(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="pinned") as c:
        s = c.session(0, idle_release=0.1)
        s.acquire()
        time.sleep(0.4)  # well past idle_release
        assert s.holding
        assert [h.name for h in gpu_status(connect(daemon)).holders] == ["pinned"]
        s.release()
        assert not s.holding
        wait_for(lambda: gpu_status(connect(daemon)).holders == [])


def test_on_drop_may_release_itself_without_a_double_release(
    daemon_factory: Callable[..., DaemonProcess], caplog: pytest.LogCaptureFixture
) -> None:
    d = daemon_factory("--simulate", "1", "--tq", "0.1")
    syncs: list[int] = []
    with Client(d.socket) as c:
        s = c.session(0, idle_release=None, synchronize=lambda: syncs.append(1))
        s.on_drop = lambda reason: s.release()
        with s.slice():
            pass
        other = connect(d)
        so = attach(other)
        request(other, so)
        expect(other, p.LockOk, timeout=2)
        time.sleep(0.2)
        assert syncs == [1] and s.state == "idle"
        assert nothing_arrives(other)
        assert not [r for r in caplog.records if "not_holder" in r.getMessage()]


def test_closing_a_held_session_frees_the_lock(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        s = c.session(0, idle_release=None)
        with s.slice():
            s.close()
            assert not s.holding
        wait_for(lambda: gpu_status(connect(daemon)).holders == [])
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


def test_a_session_whose_gpu_is_gone_after_a_restart_says_so(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, unavailable_timeout=5) as c:
        keep, lost = c.session(0, idle_release=None), c.session(1, idle_release=None)
        daemon.stop()
        daemon.args = ["--simulate", "1"]
        daemon.start()
        wait_for(lambda: c.reconnects == 1)
        with keep.slice():
            assert keep.holding
        with pytest.raises(GpudError, match="could not be re-attached.*unknown GPU 1"):
            with lost.slice():
                pass
