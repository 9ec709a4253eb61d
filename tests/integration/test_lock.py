"""The time-sliced lock end to end where only a real daemon will do: the kernel's peer
credentials and a holder killed by SIGKILL. The lock's rules through the protocol are
tested in process on a fake clock (``tests/daemon/test_lock.py``), a client under another
uid with its credentials faked there and forked for real in ``test_authority.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p

from .wire import attach, connect, expect, request, wait_queue


def test_peer_credentials_come_from_the_kernel(daemon: DaemonProcess) -> None:
    conn = connect(daemon, "creds")
    reply = conn.call(p.ListClients(id=conn.next_id()))
    me = [c for c in reply.clients if c.name == "creds"]
    assert len(me) == 1
    assert (me[0].pid, me[0].uid, me[0].gid) == (os.getpid(), os.getuid(), os.getgid())


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
    victim = subprocess.Popen([sys.executable, "-c", HOLDER, daemon.socket], stdout=subprocess.PIPE, text=True)
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
