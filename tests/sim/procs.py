"""A process table for the whole-daemon simulation: the kernel's word on processes, faked.

gpud asks its ``TaskOwners.host`` (a ``gpud.host.procs.Procs``) what /proc says of a process, who
its ancestors are, the connecting process's lineage; it holds the processes it may signal and asks
which of those have exited. ``Table`` answers the same questions from processes the simulation
spawns, kills and whose pids it reuses, as the kernel would:

- a pid names the last process that had it; a process that exited keeps its pid until a new
  process takes it, with a later start time;
- a process whose parent exits is reparented to init (pid 1);
- a held process (``Held``, a pidfd) is that very process for good: a signal to one that exited
  is not delivered (``send`` answers False), never passed to the process that took its pid;
- ``hidden``: /proc shows nothing (read_facts is None, ancestry is just the pid), as for a daemon
  whose /proc is mounted with hidepid; a pidfd can still be had, a start time cannot.

Every signal delivered is logged and handed to ``on_signal`` before it acts (SIGKILL ends the
process), so the simulation judges it at that moment. Nothing here is one of gpud's rules: the
simulation's model says whom gpud may name and signal, and is checked against what gpud did.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpud.core.owners import Caller, ProcessFacts

DEPTH = 64  # how far up ancestry walks, as gpud.host.procs does
FIRST_PID = 300  # pids the table hands out start here (below: init, a kernel thread, the daemon)


@dataclass(eq=False)
class Proc:
    """One process, from its start to its exit (a reused pid is another ``Proc``)."""

    pid: int
    parent: Proc | None
    ruid: int
    euid: int
    suid: int
    start: int  # clock ticks after boot: later for a later process, so pid and start name it for good
    kthread: bool = False
    label: str = ""  # what it stands for, in the trace
    alive: bool = True
    died_at: int | None = None  # the simulated time it exited

    @property
    def ppid(self) -> int:
        return 0 if self.parent is None else self.parent.pid

    def facts(self) -> ProcessFacts:
        return ProcessFacts(self.pid, self.ppid, self.ruid, self.euid, self.suid, self.start, self.kthread)

    def __repr__(self) -> str:
        state = "" if self.alive else f", exited at {self.died_at}"
        uids = f"uid {self.ruid}" + ("" if self.ruid == self.euid == self.suid else f"/{self.euid}/{self.suid}")
        return f"pid {self.pid} ({self.label or 'process'}, {uids}, start {self.start}{state})"


@dataclass(eq=False)
class Held:
    """A process gpud holds (a pidfd): ``gpud.host.procs.Held``'s surface."""

    proc: Proc
    pid: int
    start: int | None
    uid: int | None
    table: Table = field(repr=False)
    closed: bool = False

    def alive(self) -> bool:
        return not self.closed and self.proc.alive

    def send(self, sig: int) -> bool:
        if not self.alive():
            return False
        self.table.deliver(self.proc, signal.Signals(sig))
        return True

    def close(self) -> None:
        self.closed = True


class Table:
    """The processes of one simulated host, with the methods of ``gpud.host.procs.Procs``."""

    def __init__(self, clock: Callable[[], int], *, hidden: bool = False, daemon_uid: int = 0) -> None:
        self.clock = clock
        self.hidden = hidden
        self.at: dict[int, Proc] = {}  # pid -> the last process that had it
        self._pids = itertools.count(FIRST_PID)
        self._ticks = itertools.count(100)
        self.log: list[tuple[int, int, int, str]] = []  # signals delivered: (time, pid, start, signal name)
        self.on_signal: Callable[[Proc, signal.Signals], None] | None = None
        self.init = self.spawn(None, 0, pid=1, label="init")
        self.kthread = self.spawn(None, 0, pid=2, kthread=True, label="kthreadd")
        self.daemon = self.spawn(self.init, daemon_uid, pid=FIRST_PID - 1, label="gpud")

    # --- the simulation's side: processes come and go ------------------------------------------

    def spawn(
        self,
        parent: Proc | None,
        uid: int,
        *,
        pid: int | None = None,
        euid: int | None = None,
        suid: int | None = None,
        kthread: bool = False,
        label: str = "",
    ) -> Proc:
        """A new process (at ``pid``: a reuse, only of a pid whose process exited)."""
        if pid is None:
            pid = next(self._pids)
        old = self.at.get(pid)
        assert old is None or not old.alive, f"pid {pid} is taken by {old}"
        euid = uid if euid is None else euid
        proc = Proc(pid, parent, uid, euid, uid if suid is None else suid, next(self._ticks), kthread, label)
        self.at[pid] = proc
        return proc

    def kill(self, proc: Proc) -> None:
        """``proc`` exits; its children are reparented to init."""
        if not proc.alive:
            return
        proc.alive, proc.died_at = False, self.clock()
        for child in self.at.values():
            if child.parent is proc and child.alive:
                child.parent = self.init

    def live(self, pid: int) -> Proc | None:
        proc = self.at.get(pid)
        return proc if proc is not None and proc.alive else None

    def children(self, proc: Proc) -> list[Proc]:
        return [c for c in self.at.values() if c.parent is proc and c.alive]

    def dead(self, held: Iterable[Held]) -> list[Held]:
        """Those of ``held`` whose process has exited (``Procs.dead``)."""
        return [h for h in held if not h.alive()]

    def deliver(self, proc: Proc, sig: signal.Signals) -> None:
        self.log.append((self.clock(), proc.pid, proc.start, sig.name))
        if self.on_signal is not None:
            self.on_signal(proc, sig)  # (which ends a SIGKILLed process itself, as the world's event)
        elif sig == signal.SIGKILL:
            self.kill(proc)

    # --- gpud's side: the methods of gpud.host.procs.Procs ------------------------------------

    def read_facts(self, pid: int) -> ProcessFacts | None:
        proc = None if self.hidden or pid <= 0 else self.live(pid)
        return None if proc is None else proc.facts()

    def ancestry(self, pid: int, depth: int = DEPTH) -> list[int]:
        chain = [pid]
        while len(chain) < depth:
            facts = self.read_facts(chain[-1])
            if facts is None or facts.ppid <= 1 or facts.ppid in chain:
                break
            chain.append(facts.ppid)
        return chain

    def caller(self, pid: int, uid: int) -> Caller:
        lineage = [pid]
        for parent in self.ancestry(pid)[1:]:
            facts = self.read_facts(parent)
            if facts is None or facts.ruid != uid:
                break
            lineage.append(parent)
        return Caller(pid=pid, uid=uid, lineage=tuple(lineage))

    def hold(self, pid: int, facts: ProcessFacts | None) -> Held | None:
        proc = self.live(pid)
        if proc is None or (facts is not None and facts.start != proc.start):
            return None
        start = None if self.hidden else proc.start  # (the real one reads it from /proc)
        return Held(proc, pid, start, None if facts is None else facts.ruid, self)
