"""The time-sliced lock end to end: a real daemon, real sockets, real processes."""

from __future__ import annotations

import grp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p

from .wire import (
    NOBODY,
    as_nobody,
    attach,
    connect,
    expect,
    gpu_status,
    nothing_arrives,
    request,
    take_lock,
    wait_queue,
)


def test_fifo_grants_and_immediate_handoff(daemon: DaemonProcess) -> None:
    a, b, c = (connect(daemon, n) for n in "abc")
    sa, sb, sc = attach(a), attach(b), attach(c)
    take_lock(a, sa)
    request(b, sb)
    wait_queue(a, [sb])
    request(c, sc)
    wait_queue(a, [sb, sc])
    st = gpu_status(a)
    assert [h.session for h in st.holders] == [sa]
    assert [w.session for w in st.queue] == [sb, sc]
    a.send(p.LockReleased(id=a.next_id(), session=sa))
    expect(b, p.LockOk)
    assert nothing_arrives(c)
    b.send(p.LockReleased(id=b.next_id(), session=sb))
    expect(c, p.LockOk)


def test_peer_credentials_come_from_the_kernel(daemon: DaemonProcess) -> None:
    conn = connect(daemon, "creds")
    reply = conn.call(p.ListClients(id=conn.next_id()))
    me = [c for c in reply.clients if c.name == "creds"]
    assert len(me) == 1
    assert (me[0].pid, me[0].uid, me[0].gid) == (os.getpid(), os.getuid(), os.getgid())


def test_releasing_a_lock_not_held_is_refused_and_changes_nothing(daemon: DaemonProcess) -> None:
    a, b = connect(daemon, "a"), connect(daemon, "b")
    sa, sb = attach(a), attach(b)
    ok = take_lock(a, sa)
    before = gpu_status(b)
    b.send(p.LockReleased(id=77, session=sb))
    err = expect(b, p.Error)
    assert (err.id, err.code) == (77, p.ErrorCode.NOT_HOLDER)
    b.send(p.LockReleased(id=78, session=sa))  # someone else's session
    assert expect(b, p.Error).code == p.ErrorCode.UNKNOWN_SESSION
    a.send(p.LockReleased(id=79, session=sa, grant=ok.grant + 5))
    assert expect(a, p.Error).code == p.ErrorCode.STALE_GRANT
    after = gpu_status(b)
    assert [(h.session, h.grant) for h in after.holders] == [(sa, ok.grant)]
    assert (after.grants, after.queue) == (before.grants, before.queue)


def test_tq_drop_only_when_someone_waits(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "1", "--tq", "0.2")
    a, b = connect(d, "a"), connect(d, "b")
    sa, sb = attach(a), attach(b)
    ok = take_lock(a, sa)
    assert nothing_arrives(a, 0.4)  # alone past the TQ: no drop
    request(b, sb)
    drop = expect(a, p.DropLock, timeout=2)
    assert (drop.session, drop.grant, drop.reason) == (sa, ok.grant, p.DropReason.TQ)
    a.send(p.LockReleased(id=a.next_id(), session=sa, grant=ok.grant))
    assert expect(b, p.LockOk).session == sb


def test_ignoring_drop_lock_is_revoked_after_drop_timeout(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "1", "--tq", "0.1", "--drop-timeout", "0.3")
    a, b = connect(d, "a"), connect(d, "b")
    sa, sb = attach(a), attach(b)
    ok = take_lock(a, sa)
    request(b, sb)
    t_drop = time.monotonic()
    expect(a, p.DropLock, timeout=2)
    revoked = expect(a, p.Revoked, timeout=2)
    assert time.monotonic() - t_drop >= 0.25
    assert (revoked.session, revoked.grant, revoked.reason) == (sa, ok.grant, p.RevokeReason.DROP_TIMEOUT)
    expect(b, p.LockOk)
    st = gpu_status(b)
    assert st.revocations == 1 and [h.session for h in st.holders] == [sb]
    a.send(p.LockReleased(id=5, session=sa))  # too late: it no longer holds
    assert expect(a, p.Error).code == p.ErrorCode.NOT_HOLDER


def test_closed_connection_frees_lock_and_queue_place(daemon: DaemonProcess) -> None:
    a, b, c = (connect(daemon, n) for n in "abc")
    sa, sb, sc = attach(a), attach(b), attach(c)
    take_lock(a, sa)
    request(b, sb)
    wait_queue(a, [sb])
    request(c, sc)
    wait_queue(a, [sb, sc])
    b.close()  # a waiter leaves
    wait_queue(a, [sc])
    a.close()  # the holder leaves
    expect(c, p.LockOk)


HOLDER = """
import sys, time
from gpud_client import Client
c = Client(sys.argv[1], name="victim")
s = c.session(0)
s.acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_sigkilled_holder_hands_over_within_50ms(daemon: DaemonProcess) -> None:
    victim = subprocess.Popen(
        [sys.executable, "-c", HOLDER, daemon.socket], stdout=subprocess.PIPE, text=True
    )
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "held"
        waiter = connect(daemon, "waiter")
        sw = attach(waiter)
        request(waiter, sw)
        wait_queue(waiter, [sw])
        killed_at = time.monotonic_ns()
        os.kill(victim.pid, signal.SIGKILL)
        expect(waiter, p.LockOk, timeout=5)
        waited_ms = (time.monotonic_ns() - killed_at) / 1e6
        assert waited_ms < 50, f"LOCK_OK {waited_ms:.1f} ms after the kill"
    finally:
        victim.kill()
        victim.wait()


def test_scheduler_off_grants_everyone_and_tells_clients(daemon: DaemonProcess) -> None:
    a, b, admin = connect(daemon, "a"), connect(daemon, "b"), connect(daemon, "admin")
    sa, sb = attach(a), attach(b)
    take_lock(a, sa)
    request(b, sb)
    wait_queue(admin, [sb])
    admin.call(p.SchedOff(id=admin.next_id(), gpu=0))
    assert expect(b, p.LockOk).session == sb
    assert expect(b, p.SchedState) == p.SchedState(gpu=0, on=False)
    assert expect(a, p.SchedState).on is False
    st = gpu_status(admin)
    assert not st.scheduler_on and len(st.holders) == 2 and st.queue == []
    admin.call(p.SchedOn(id=admin.next_id()))
    assert expect(a, p.SchedState).on is True
    assert gpu_status(admin).scheduler_on


def test_set_tq_is_per_gpu_and_takes_effect_at_once(daemon: DaemonProcess) -> None:
    a, b = connect(daemon, "a"), connect(daemon, "b")
    sa, sb = attach(a, gpu="gpu:1"), attach(b, gpu=1)
    take_lock(a, sa)
    request(b, sb)
    wait_queue(b, [sb], gpu=1)
    a.call(p.SetTq(id=a.next_id(), seconds=0.05, gpu=1))
    assert expect(a, p.DropLock, timeout=2).reason == p.DropReason.TQ
    assert gpu_status(b, 0).tq_s == 30.0
    assert gpu_status(b, 1).tq_s == 0.05


def test_non_admin_cannot_change_tq_or_the_scheduler(daemon: DaemonProcess) -> None:
    def ask() -> str:
        conn = connect(daemon, "nobody")
        codes = []
        for msg in (p.SetTq(id=1, seconds=1.0), p.SchedOff(id=2)):
            conn.send(msg)
            codes.append(expect(conn, p.Error).code)
        return ",".join(codes)

    assert as_nobody(daemon, ask) == "permission_denied,permission_denied"
    admin = connect(daemon, "root")
    st = gpu_status(admin)
    assert st.tq_s == 30.0 and st.scheduler_on


def test_members_of_the_admin_group_may_change_the_tq(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    group = grp.getgrgid(NOBODY).gr_name  # nogroup: nobody's primary group
    cfg = tmp_path / "gpud.toml"
    cfg.write_text(f'admin_group = "{group}"\n')
    d = daemon_factory("--simulate", "1", "--config", str(cfg))

    def ask() -> str:
        conn = connect(d, "operator")
        conn.call(p.SetTq(id=conn.next_id(), seconds=3.0))
        return "ok"

    assert as_nobody(d, ask) == "ok"
    assert gpu_status(connect(d)).tq_s == 3.0
