"""Processes as the kernel shows them: facts from /proc, and processes held by pidfd.

gpud signals only a process it holds: one a client named, checked by ``gpud.core.owners``
against these facts, then held as a pidfd (``pidfd_open``), so that a pid reused after its
process died is never signalled: a pidfd names one process for good. Where no pidfd can be had
(descriptors exhausted, an old kernel), the process is held by its pid and start time, and the
start time is read again right before each signal.

Every signal goes through ``Held.send``, which says whether it was delivered; the caller logs
and counts it (``Signals`` does both). Nothing here decides whom to signal.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog

from gpud.core.owners import Caller, ProcessFacts

log = structlog.get_logger(__name__)
PF_KTHREAD = 0x00200000  # include/linux/sched.h: the flags field of /proc/PID/stat
DEPTH = 64


def read_facts(pid: int) -> ProcessFacts | None:
    """``pid`` as /proc shows it; None when there is no such process or /proc hides it."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return None
    try:
        fields = stat[stat.rindex(b")") + 2 :].split()
        uids = next(line for line in status.splitlines() if line.startswith(b"Uid:")).split()[1:4]
        return ProcessFacts(
            pid=pid,
            ppid=int(fields[1]),
            ruid=int(uids[0]),
            euid=int(uids[1]),
            suid=int(uids[2]),
            start=int(fields[19]),
            kthread=bool(int(fields[6]) & PF_KTHREAD),
        )
    except (ValueError, IndexError, StopIteration):
        return None


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def ancestry(pid: int, depth: int = DEPTH) -> list[int]:
    """``pid`` and its ancestors, nearest first, as far as /proc shows them (a hardened /proc
    that hides other users' processes gives just ``pid``)."""
    chain = [pid]
    while len(chain) < depth:
        facts = read_facts(chain[-1])
        if facts is None or facts.ppid <= 1 or facts.ppid in chain:
            break
        chain.append(facts.ppid)
    return chain


def caller(pid: int, uid: int) -> Caller:
    """The connecting process and its ancestors of its own uid (the shell that started it)."""
    lineage = [pid]
    for parent in ancestry(pid)[1:]:
        facts = read_facts(parent)
        if facts is None or facts.ruid != uid:
            break
        lineage.append(parent)
    return Caller(pid=pid, uid=uid, lineage=tuple(lineage))


@dataclass(eq=False)
class Held:
    """One process gpud may signal later: by pidfd, else by pid and start time."""

    pid: int
    start: int | None
    uid: int | None
    fd: int | None = None
    _gone: bool = field(default=False, repr=False)

    def alive(self) -> bool:
        if self._gone:
            return False
        if self.fd is not None:
            return not select.select([self.fd], [], [], 0)[0]  # a pidfd reads as ready once its process exited
        return self.start is not None and start_time(self.pid) == self.start

    def send(self, sig: int) -> bool:
        """Deliver ``sig`` to this very process; False when it is gone (never another process)."""
        if self._gone:
            return False
        try:
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, sig)
            elif self.start is not None and start_time(self.pid) == self.start:
                os.kill(self.pid, sig)  # just checked to be the process held (see the module's comment)
            else:
                return False
        except OSError:
            return False
        return True

    def close(self) -> None:
        self._gone = True
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def hold(pid: int, facts: ProcessFacts | None) -> Held | None:
    """Hold ``pid`` as the process ``facts`` describe; None when it is already gone (or, its
    facts unknown, when not even a pidfd can be had)."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError:
        fd = None  # no descriptor left, or no pidfd on this kernel: pid and start time
    start = start_time(pid)
    if facts is not None and start != facts.start:  # died and reused between the check and now
        if fd is not None:
            os.close(fd)
        return None
    if fd is None and start is None:
        return None
    return Held(pid=pid, start=start, uid=None if facts is None else facts.ruid, fd=fd)


def dead(held: Iterable[Held]) -> list[Held]:
    """Those of ``held`` whose process has exited: one poll over their pidfds."""
    by_fd: dict[int, Held] = {}
    out = []
    poller = select.poll()
    for h in held:
        if h.fd is None:
            if not h.alive():
                out.append(h)
        else:
            by_fd[h.fd] = h
            poller.register(h.fd, select.POLLIN)
    out += [by_fd[fd] for fd, _ in poller.poll(0)]
    return out


class Procs:
    """The kernel's word on processes, as one object: gpud's shell asks ``KERNEL``; a simulation
    passes a process table of its own with the same methods."""

    read_facts = staticmethod(read_facts)
    ancestry = staticmethod(ancestry)
    caller = staticmethod(caller)
    hold = staticmethod(hold)
    dead = staticmethod(dead)


KERNEL = Procs()


class Signals:
    """Sends a signal to a held process, and logs and counts every one (``count(signal, why)``)."""

    def __init__(self, count: Callable[[str, str], None]) -> None:
        self.count = count

    def send(self, held: Held, sig: signal.Signals, *, task_id: str, why: str) -> bool:
        delivered = held.send(sig)
        log.warning(
            "process_signalled",
            pid=held.pid,
            uid=held.uid,
            signal=sig.name,
            task_id=task_id,
            why=why,
            delivered=delivered,
        )
        if delivered:
            self.count(sig.name, why)
        return delivered
