"""Owner processes in the simulated world: the process table (``procs.py``, the daemon's kernel),
the owner an ALLOCATE names, gpud's signals to owners, owners that exit, pids reused, the reaper.

Each client is a process (under a login shell of its uid, sometimes), with children; init, a
kernel thread and a process standing for gpud itself are there too (as is, in some seeds, a /proc
that hides everything). An ALLOCATE names an ``owner_pid`` now and then (``notify`` off more often
then, so that gpud signals the owner rather than pushing PREEMPT): the client's own process, its
child or shell, a sibling, a setuid child, another uid's process, another login session of its uid,
init, gpud, a kernel thread, a process that exited, a pid that a new process took, a pid nobody
has; an admin adds ``owner_any_uid`` (and so, refused, does anyone else). Owners exit (a client's
crash takes its process, sometimes its children), exit on gpud's SIGTERM now and then, and a dead
owner's pid is taken by a new process (of its uid, often). The reaper runs every
``reap_interval_s`` (drawn; 0 in some seeds: never).

The invariants (``check``, ``judge_signal``; the refusals are ``Allocations.allocate_refusal``'s):
- an ALLOCATE naming an owner is refused (permission_denied, naming why) exactly when the rules
  say (``owner_refusal``: never init, gpud or a kernel thread; the caller's uid is the target's
  real or saved uid unless an admin says owner_any_uid; the caller, an ancestor of its uid or a
  descendant of one of those; where /proc shows nothing, only the caller);
- the daemon holds exactly the process each task was allocated for (after a restart too, never a
  process that took its pid), and the store keeps its start time;
- every signal is delivered, at that moment, to the held owner (pid and start) of an allocation of
  the signal's task, of its uid (unless an admin named it with owner_any_uid), never to init, gpud
  or a kernel thread: SIGTERM for a whole notice nobody holds, SIGKILL at that notice's end;
- an allocation whose owner exited is released within ``reap_interval_s`` (its wait answered).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpud.capabilities.allocations import part as allocations_module
from gpud.host.owners import TaskOwners
from gpud.host.procs import Signals

from .model import ADMIN_UID, MS, USERS, Client, Part
from .procs import Proc, Table

if TYPE_CHECKING:
    from gpud.serving.server import Daemon

    from .world import World

# What an ALLOCATE names as its owner process, and how often (see ``Owners.draw_owner``).
OWNER_WEIGHTS = [
    ("own", 6), ("child", 4), ("grandchild", 0.5), ("shell", 1), ("sibling", 1), ("setuid child", 0.5),
    ("dropped child", 0.5), ("another uid", 2), ("another session", 1), ("init", 0.4), ("gpud", 0.4),
    ("kernel thread", 0.4), ("exited", 1), ("reused", 1), ("nobody", 0.4),
]  # fmt: skip
OWNER_KINDS = [k for k, _ in OWNER_WEIGHTS]


@dataclass(eq=False)
class OwnerM:
    """A task's owner process as the model knows it: the process its ALLOCATE named (None: none), whether
    the daemon holds it now (from the claim on; after a restart only if it still runs), whether the
    daemon counts the task reachable through it (as of the last time it asked: ``Allocations._reach``),
    and the notice whose SIGTERM it got from this daemon (``Allocations.signalled``)."""

    proc: Proc | None = None
    any_uid: bool = False  # named by an admin with owner_any_uid
    held: bool = False
    reach: bool = False
    termed: int | None = None  # the issue time of the notice it got SIGTERM for
    killed: int | None = None  # when it got SIGKILL
    orphan_at: int | None = None  # a restarted daemon found it gone (or its pid another's): reaped next

    def reapable(self) -> bool:
        """Its process exited, and the daemon knows: it held it, or found it gone at a restart."""
        return self.proc is not None and not self.proc.alive and (self.held or self.orphan_at is not None)

    def alive(self) -> bool:
        """The daemon holds it and it runs."""
        return self.held and self.proc is not None and self.proc.alive


@contextlib.contextmanager
def kernel(table: Table) -> Iterator[None]:
    """The daemon builds its ``TaskOwners`` at construction, and re-holds the owners of the records
    it restores right there: give it ``table`` as its kernel (``TaskOwners.host``), and the pid of
    the table's gpud process as its own."""

    def owners(signals: Signals) -> TaskOwners:
        o = TaskOwners(signals, table)  # type: ignore[arg-type]  # the Procs surface, duck-typed
        o.daemon_pid = table.daemon.pid
        return o

    real = allocations_module.TaskOwners
    allocations_module.TaskOwners = owners  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        allocations_module.TaskOwners = real  # type: ignore[misc]


class Owners(Part):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        # The processes of this host; the daemon's kernel. Its /proc hides everything in some seeds.
        self.table = Table(world.clock, hidden=self.rng.random() < 0.08, daemon_uid=ADMIN_UID)
        self.table.on_signal = self.judge_signal
        self.reap_us = round(self.config.reap_interval_s * 1e6)
        self.next_reap = self.now  # the allocations' timer reaps when it starts, then every reap_interval_s
        self.reaps_now = False  # the reaper ran in this event
        self.signalling: tuple[str, str] | None = None  # (task id, why) of the signal gpud sends now

    def steps(self) -> dict[str, Callable[[], None]]:
        return {"owner_exits": self.do_owner_exits, "pid_reuse": self.do_pid_reuse}

    def laters(self) -> dict[str, Callable[..., None]]:
        return {"owner_exits": self.later_owner_exits, "owner_killed": self.later_owner_killed}

    def on_daemon(self, d: Daemon) -> None:
        assert d.allocations.owners.host is self.table
        self.next_reap = self.now
        signals = d.allocations.owners.signals
        real_send = signals.send

        def send(held: Any, sig: signal.Signals, *, task_id: str, why: str) -> bool:
            self.signalling = (task_id, why)  # what judge_signal is told, should the table deliver it
            try:
                return real_send(held, sig, task_id=task_id, why=why)
            finally:
                self.signalling = None

        signals.send = send  # type: ignore[method-assign]
        real_reap = d.allocations.reap

        def reap(now: int) -> None:
            self.reaps_now = True
            real_reap(now)

        d.allocations.reap = reap  # type: ignore[method-assign]

    # --- gpud's signals ----------------------------------------------------------------------------

    def judge_signal(self, proc: Proc, sig: signal.Signals) -> None:
        """A signal the table delivers now (``Table.on_signal``): judged at this moment, before it acts."""
        task, why = self.signalling or ("?", "?")
        self.event("gpud sends {} to {} for {} ({})", sig.name, proc, task, why)
        self.stats[f"owners signalled ({sig.name})"] += 1
        wrong = self.signal_wrong(proc, sig, task, why)
        if wrong:  # (raised inside the daemon, which may contain it: check() raises it again)
            self.world.broken = f"gpud sent {sig.name} to {proc} for task {task} ({why}): {wrong}"
            self.fail(self.world.broken)
        grace_us = self.world.preemption.grace_us
        if sig == signal.SIGTERM and self.rng.random() < 0.5:  # it leaves as asked, after a while
            self.later(self.now + self.rng.randrange(0, 2 * max(1, grace_us)), "owner_exits", proc)
        elif sig == signal.SIGKILL:  # it ends now: a client's own process takes its connection along
            self.later(self.now, "owner_killed", proc)

    def signal_wrong(self, proc: Proc, sig: signal.Signals, task: str, why: str) -> str:
        """What is wrong with ``sig`` reaching ``proc`` now for ``task`` ("" if nothing)."""
        t, allocs = self.table, self.world.allocs
        if self.signalling is None:
            return "a signal not sent through TaskOwners.signal"
        if proc.pid <= 1 or proc is t.daemon or proc.kthread:
            return "init, gpud itself and kernel threads are never signalled"
        if t.at.get(proc.pid) is not proc:
            return "its pid is another process's now"
        a = allocs.acked.get(task) or allocs.suspended.get(task)
        if a is None:
            return "the task holds no allocation"
        o = a.owner
        if o.proc is not proc or not o.held:
            return f"the process the task was allocated for is {o.proc}" + ("" if o.held else ", not held since")
        if a.uid not in (proc.ruid, proc.suid) and not o.any_uid:
            return f"it is not a process of uid {a.uid}, whose allocation it is (and no admin said owner_any_uid)"
        if sig == signal.SIGTERM:
            ln = self.daemon.allocations.ledger.notice_of(task)
            if why != "preempt_notice" or ln is None or not ln.whole or ln.issued != self.now:
                return f"a SIGTERM goes with a notice to leave whole, given now (the ledger's: {ln})"
            if a.holder is not None:
                return "a connection holds the allocation: it is told by PREEMPT"
            o.termed = ln.issued
        elif sig == signal.SIGKILL:
            n = a.notice
            if why != "preempt_grace_over" or n is None or not n.whole or o.termed != n.issued:
                return f"a SIGKILL ends the notice whose SIGTERM the owner got (one for {o.termed}; the notice: {n})"
            if self.now < n.deadline and task not in self.world.preemption.yields_now:
                return f"{n.deadline - self.now} us before the notice's grace ends"
            o.killed = self.now
        else:
            return "gpud sends its owners SIGTERM and SIGKILL only"
        return ""

    # --- owners the model knows ----------------------------------------------------------------------

    def owners_m(self) -> dict[str, OwnerM]:
        """The owner of every task the model knows: allocations, suspended ones, waits, restored waits."""
        allocs = self.world.allocs
        out = {t: a.owner for t, a in [*allocs.acked.items(), *allocs.suspended.items()]}
        for q in self.all_pending("ALLOCATE"):
            if q.deadline is not None:
                out.setdefault(q.msg.task_id, q.info["owner"])
        for t, g in allocs.ghosts.items():
            out.setdefault(t, g.owner)
        return out

    def rehold(self) -> None:
        """A new daemon holds again the owners of what it restored that still run, and nothing else; the
        signals it sent before are forgotten; an allocation is reachable through its owner if it runs."""
        allocs = self.world.allocs
        for t, o in self.owners_m().items():
            o.termed = o.killed = None
            o.held = o.proc is not None and o.proc.alive and not self.table.hidden
            gone = o.proc is not None and not o.proc.alive
            # (where /proc hides everything, a live process at the dead owner's pid cannot be told apart)
            o.orphan_at = self.now if gone and not (self.table.hidden and self.table.live(o.proc.pid)) else None
            o.reach = o.held and (t in allocs.acked or t in allocs.suspended)

    def owner_refusal(self, c: Client, pid: int, *, any_uid: bool) -> str:
        """What the refusal of ``pid`` as the owner of a new task of ``c`` says ("": none), by the
        rules of docs/security.md, read off the process table: never init, gpud or a kernel thread;
        where /proc shows nothing, only the caller itself; the caller's uid must be the target's real
        or saved uid (unless an admin says owner_any_uid); the target must be the caller, an ancestor
        of its uid, or a descendant of one of those."""
        t = self.table
        target = t.live(pid)
        if any_uid and not c.admin:
            return "owner_any_uid needs admin rights"
        if pid <= 1:
            return "is init"
        if pid == t.daemon.pid:
            return "is gpud itself"
        if target is not None and target.kthread and not t.hidden:
            return "is a kernel thread"
        if target is None or t.hidden:
            return "" if pid == c.pid else "cannot read that process's credentials"
        if any_uid:
            return ""
        if c.uid not in (target.ruid, target.suid):
            return f"belongs to uid {target.ruid}, not to you"
        assert c.proc is not None
        lineage, up = [c.proc], c.proc.parent
        while up is not None and up.pid > 1 and up.ruid == c.uid:
            lineage.append(up)
            up = up.parent
        up = target
        while up is not None and up.pid > 1:
            if up in lineage:
                return ""
            up = up.parent
        return "is not yours to name"

    def claimed(self, c: Client, pid: int) -> Proc:
        """The process an owner pid the rules accept names: the caller itself where /proc shows nothing."""
        proc = c.proc if self.table.hidden else self.table.live(pid)
        assert proc is not None and proc.pid == pid
        return proc

    def draw_owner(self, c: Client) -> tuple[int, bool]:
        """An owner pid for a new task of ``c``, and whether it says owner_any_uid: mostly its own process
        or one of its lineage, else something the rules refuse (or take only from an admin)."""
        t, r = self.table, self.rng
        assert c.proc is not None
        kind = r.choices(OWNER_KINDS, [w for _, w in OWNER_WEIGHTS])[0]
        self.stats[f"owner pids drawn: {kind}"] += 1
        any_uid = r.random() < (0.4 if c.admin else 0.03)
        if kind == "own":
            return c.pid, any_uid and r.random() < 0.2
        if kind in ("child", "setuid child", "dropped child", "grandchild"):
            kids = [k for k in t.children(c.proc) if k.ruid == c.uid]
            if kind == "child" and kids and r.random() < 0.6:
                return r.choice(kids).pid, False
            parent = r.choice(kids) if kind == "grandchild" and kids else c.proc
            ruid, euid, suid = {"setuid child": (c.uid, 0, 0), "dropped child": (0, c.uid, 0)}.get(kind, (c.uid,) * 3)
            child = t.spawn(parent, ruid, euid=euid, suid=suid, label=f"{kind} of client {c.cid}")
            return child.pid, any_uid
        if kind in ("shell", "sibling"):
            if c.shell is None or not c.shell.alive:
                return c.pid, False
            if kind == "shell":
                return c.shell.pid, False
            return t.spawn(c.shell, c.uid, label=f"sibling of client {c.cid}").pid, False
        if kind in ("another uid", "another session"):
            uid = c.uid if kind == "another session" else r.choice([u for u in (0, *USERS) if u != c.uid])
            theirs = [x.proc for x in self.clients if x is not c and x.uid == uid and x.proc and x.proc.alive]
            if theirs and r.random() < 0.5:
                return r.choice(theirs).pid, any_uid
            return t.spawn(t.init, uid, label=f"a process of uid {uid}").pid, any_uid
        if kind == "exited":
            gone = sorted(x.pid for x in t.at.values() if not x.alive)
            if gone:
                return r.choice(gone), any_uid
            child = t.spawn(c.proc, c.uid, label=f"child of client {c.cid}")
            self.exits(child, "a short-lived child")
            return child.pid, any_uid
        if kind == "reused":
            return self.reuse(r.choice([x for x in t.at.values() if not x.alive] or [None])).pid, any_uid
        return {"init": 1, "gpud": t.daemon.pid, "kernel thread": t.kthread.pid}.get(kind, 999_999), any_uid

    # --- processes come and go ---------------------------------------------------------------------

    def start(self, c: Client) -> None:
        """A new client's program: started from a login shell of its uid, sometimes (else by init: a
        service), and its first process."""
        if self.rng.random() < 0.6:
            c.shell = self.table.spawn(self.table.init, c.uid, label=f"shell of client {c.cid}")
        self.respawn(c)

    def respawn(self, c: Client) -> None:
        """A new process of the client's program (its first, or after a crash)."""
        shell = c.shell if c.shell is not None and c.shell.alive else self.table.init
        c.proc = self.table.spawn(shell, c.uid, label=f"client {c.cid}")
        c.alive, c.pid = True, c.proc.pid

    def reuse(self, old: Proc | None) -> Proc:
        """A new process takes the pid of ``old``, which exited (None: a child that exits at once first);
        of the same uid mostly, started by a live client's process or by init."""
        t, r = self.table, self.rng
        if old is None:
            old = t.spawn(t.init, r.choice([0, *USERS]), label="a short-lived process")
            self.exits(old, "it was short-lived")
        uid = old.ruid if r.random() < 0.7 else r.choice([0, *USERS])
        parents = [x.proc for x in self.clients if x.proc is not None and x.proc.alive and x.uid == uid]
        parent = r.choice(parents) if parents and r.random() < 0.6 else t.init
        new = t.spawn(parent, uid, pid=old.pid, label=f"pid reused (was {old.label or 'a process'})")
        self.event("a new process takes the pid of {}: {}", old, new)
        self.stats["pids reused"] += 1
        return new

    def exits(self, proc: Proc | None, why: str) -> None:
        """``proc`` exits (a dead owner's allocations are the reaper's from now on)."""
        if proc is None or not proc.alive:
            return
        self.table.kill(proc)
        self.event("{} exits ({})", proc, why)
        if any(o.proc is proc and o.held for o in self.owners_m().values()):
            self.stats["owner processes exited"] += 1
        c = next((x for x in self.clients if x.proc is proc), None)
        if c is not None:  # a client's own process: its connection ends with it
            c.alive = False
            if c.conn is not None:
                self.world.conns.lose_connection(c, f"its process exited ({why})", crashed=True)

    def crashed(self, c: Client) -> None:
        """A client crashed: its process exits, and with it, sometimes, its whole process group."""
        c.alive = False
        self.exits(c.proc, "its client crashed")
        if self.rng.random() < 0.3:  # the whole process group
            for child in self.table.children(c.proc):
                self.exits(child, "its parent's group was killed")

    def ended(self, proc: Proc, why: str) -> None:
        """``proc`` exits, as one event; a client's own process is started again, sometimes."""
        if not proc.alive:
            return
        self.exits(proc, why)
        self.after_event()
        c = next((x for x in self.clients if x.proc is proc), None)
        if c is not None and self.rng.random() < 0.5:
            self.later(self.now + self.rng.randrange(MS, 100 * MS), "reconnect", c.cid)
            self.respawn(c)

    def later_owner_exits(self, proc: Proc) -> None:
        self.ended(proc, "it left on SIGTERM")

    def later_owner_killed(self, proc: Proc) -> None:
        self.ended(proc, "SIGKILL from gpud at its grace's end")

    def do_owner_exits(self) -> None:
        """An owner process exits: a held one mostly (a client's own: it crashed), else a client's child."""
        procs = [o.proc for o in self.owners_m().values() if o.held and o.proc is not None and o.proc.alive]
        procs += [k for c in self.clients if c.proc is not None for k in self.table.children(c.proc)][:2]
        proc = self.pick(list(dict.fromkeys(procs)))
        if proc is None:
            return self.world.do_advance()
        self.ended(proc, "it ended")

    def do_pid_reuse(self) -> None:
        """A new process takes the pid of one that exited (an owner's, mostly)."""
        owners = [o.proc for o in self.owners_m().values() if o.proc is not None]
        dead = [x for x in dict.fromkeys(owners) if not x.alive and self.table.at[x.pid] is x]
        dead = dead or [x for x in self.table.at.values() if not x.alive]
        self.reuse(self.pick(dead))
        self.after_event()

    # --- the checks ---------------------------------------------------------------------------------

    def check(self) -> None:
        """The daemon holds exactly the owner processes the model says (the very processes the tasks were
        allocated for: never one that took a pid since), and an allocation whose owner exited is gone
        within reap_interval_s of its exit."""
        allocs, store = self.world.allocs, self.world.restarts
        owners = self.daemon.allocations.owners
        got = {t: h.proc for t, h in owners._held.items()}
        want = {t: o.proc for t, o in self.owners_m().items() if o.held}
        if got != want and not store.behind():
            t = next(t for t in sorted(set(got) | set(want)) if got.get(t) is not want.get(t))
            o = self.owners_m().get(t)
            self.fail(
                f"the daemon holds {got.get(t)} as the owner of {t}; the process it was allocated for is "
                f"{o and o.proc}, " + ("which it holds" if o and o.held else "not held (exited, or gone from its pid)")
            )
        if not self.table.hidden and not store.behind():
            starts = store.stored_starts()
            for t, a in [*allocs.acked.items(), *allocs.suspended.items()]:
                if a.owner.held and a.owner.proc is not None and starts.get(t) != a.owner.proc.start:
                    self.fail(f"the store keeps the start time {starts.get(t)} for {t}'s owner {a.owner.proc}")
        if not self.reap_us:
            return
        for a in [*allocs.acked.values(), *allocs.suspended.values()]:
            proc = a.owner.proc
            if proc is None or not a.owner.reapable():
                continue
            assert proc.died_at is not None
            known = max(proc.died_at, a.owner.orphan_at or 0)  # (gone while gpud was down: since its start)
            if self.now > known + self.reap_us:
                self.fail(
                    f"{a.task_id}'s owner {proc} exited {(self.now - proc.died_at) / 1e3:.3f} ms ago, "
                    f"reap_interval_s is {self.config.reap_interval_s}: its allocation is still there"
                )
