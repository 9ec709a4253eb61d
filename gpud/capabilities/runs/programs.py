"""Runs' programs (``gpuctl run``): CONTAIN, FREEZE, THAW, ESCAPED, RUNS, and their cgroups' lives.

A run hands gpud its program's pid (CONTAIN), believed only as the kernel says: ``check_program``
(the run's own descendant, of its uid; never init, never gpud) on /proc, then held by pidfd. Where
cgroup v2 can be had (``gpud.host.cgroups``) the program is moved, before its exec, into a cgroup of
the daemon's that its user cannot write; the run has gpud FREEZE it (answered once cgroup.events
says ``frozen 1``) and THAW it.

Why freezing is asked for rather than tied to LOCK_RELEASED and LOCK_OK: the run must lock the GPU
work through the CUDA driver before the freeze and unlock it after the thaw (the driver's calls hang
on a frozen process), resumes a paused program for a signal's grace, and pauses a suspended one that
holds no lock. So the run says when, as for every backend, and gpud does it where the run's user
cannot undo it. A run that thaws its own program runs it unarbitrated, as a process started outside
gpud would: the cgroup stops everyone else (SIGCONT, setsid, double forks), not the run.

A run's cgroup is the daemon's, and outlives the run's connection:
- the run gone (its process exited, by its pidfd): killed whole (cgroup.kill), removed once empty;
- the connection gone but the run alive (it reconnects): left as the kernel has it, unclaimed; held
  again when the run says HELLO (its program still its descendant) or CONTAINs it again; killed once
  ``crash_grace_s`` passes unclaimed;
- the daemon stopping: left as it is. A daemon that starts finds its own leftovers (by its key) and
  keeps them as they are, unclaimed: a frozen program stays frozen until its run is granted again.

Cgroups an admin hands gpud (ADOPT: a Kubernetes claim's containers, ``adopted``) are a connection's
program too, frozen and thawed alike; being the container runtime's, they are never killed, moved or
removed, and a connection that goes leaves them as the kernel has them.

It never moves, freezes or kills a process the checks did not allow, never touches a cgroup that is
not its own or handed to it, and never holds the loop on the kernel: a freeze not done at once is waited for by the
housekeeping task (``run``), which also reclaims and removes cgroups.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import trio

from gpud.capabilities.runs.adopted import all_frozen, judge, set_frozen
from gpud.capabilities.runs.adopted import state as adopted_state
from gpud.core.errors import Refused
from gpud.core.owners import check_program
from gpud.host.cgroups import RunCgroup, RunCgroups, Unavailable, daemon_key, program_state
from gpud.host.config import Config
from gpud.host.metrics import Metrics
from gpud.host.procs import Held, ancestry, caller, hold, read_facts
from gpud.kit.access import Access
from gpud.kit.faults import Faults
from gpud.kit.links import Links
from gpud.kit.state import ClientLink, Clock, Handler
from gpud_client import protocol as p

log = structlog.get_logger(__name__)
FREEZE_POLL_S = 0.0005  # while a freeze is not done yet
RECLAIM_POLL_S = 0.05  # while a cgroup waits to be reclaimed or removed


@dataclass(eq=False)
class Program:
    pid: int
    held: Held | None
    pause: str  # the run's own process control beside the cgroup (cuda, signal, none)
    cgroup: RunCgroup | None
    conn: ClientLink | None = None
    run: Held | None = None  # the run's own process: its end is the program's
    unclaimed_since: int | None = None
    adopted: tuple[RunCgroup, ...] = ()  # cgroups an admin handed (ADOPT), not gpud's own
    task_id: str = ""  # whose the adopted cgroups are

    @property
    def is_adopted(self) -> bool:
        return self.pid == 0

    @property
    def backend(self) -> str:
        if self.is_adopted:
            return "adopted"
        if self.cgroup is None:
            return self.pause or "signal"
        return f"{self.pause}+cgroup" if self.pause not in ("", "signal", "none") else "cgroup"


@dataclass(eq=False)
class _Freezing:
    conn: ClientLink
    rid: int
    program: Program
    since: int
    deadline: int


class Runs:
    def __init__(
        self,
        links: Links,
        metrics: Metrics,
        faults: Faults,
        access: Access,
        config: Callable[[], Config],
        clock: Clock,
        stopping: Callable[[], bool],
    ) -> None:
        self.links = links
        self.metrics = metrics.node
        self.faults = faults
        self.access = access
        self.config = config
        self.now = clock
        self.stopping = stopping
        self.daemon_pid = os.getpid()
        self.by_conn: dict[int, Program] = {}
        self.unclaimed: list[Program] = []
        self.removing: list[RunCgroup] = []
        self.freezing: list[_Freezing] = []
        self.escapes: dict[int, int] = {}  # client id -> escapes its run reported
        self.cgroups: RunCgroups | None = None
        self.why_not = ""
        self._probed = False
        self._wake: trio.Event | None = None
        for backend in ("cgroup", "signal", "adopted"):
            self.metrics.runs.labels(backend)
        for reason in ("run_gone", "unclaimed", "replaced"):
            self.metrics.run_kills.labels(reason)

    def handlers(self) -> dict[type, Handler]:
        return {
            p.Contain: self.contain,
            p.Freeze: self.freeze,
            p.Thaw: self.thaw,
            p.Escaped: self.escaped,
            p.ListRuns: self.list_runs,
            p.Adopt: self.adopt,
        }

    # --- start: the base, and what an earlier daemon left ----------------------------

    def probe(self) -> None:
        """Find (or make) the base once; say why not in the log when there is none."""
        if self._probed:
            return
        self._probed = True
        config = self.config()
        try:
            self.cgroups = RunCgroups.probe(config.run_cgroups, daemon_key(config.state_dir))
        except (Unavailable, OSError) as exc:
            self.why_not = str(exc)
            log.info("run_cgroups_unavailable", why=self.why_not, fallback="runs pause with SIGSTOP (signal)")
            return
        log.info("run_cgroups", base=self.cgroups.base)

    def adopt_leftovers(self, now: int) -> None:
        """Keep every cgroup an earlier daemon of this state directory left, as the kernel has it,
        unclaimed: its run claims it again, or it is killed once the grace passes."""
        if self.cgroups is None:
            return
        for cgroup, pid, start in self.cgroups.leftovers():
            facts = read_facts(pid)
            held = hold(pid, facts) if facts is not None and facts.start == start else None
            prog = Program(pid, held, "", cgroup, unclaimed_since=now)
            self.unclaimed.append(prog)
            self._count(prog, 1)
            log.info("run_cgroup_left_over", cgroup=cgroup.name, pid=pid, processes=len(cgroup.pids()))

    # --- requests -----------------------------------------------------------------

    def contain(self, conn: ClientLink, msg: p.Contain, now: int) -> p.Contained:
        prog = self.by_conn.get(conn.client_id)
        if prog is not None and prog.pid == msg.pid and prog.held is not None and prog.held.alive():
            return self._contained(msg.id, prog)
        facts = read_facts(msg.pid)
        lineage = ancestry(msg.pid) if facts is not None else [msg.pid]
        check_program(msg.pid, facts, lineage, caller(conn.pid, conn.uid), daemon_pid=self.daemon_pid)
        assert facts is not None  # check_program refuses a process it cannot read
        self.probe()
        if self.cgroups is not None:  # already in one of ours: held again, as the kernel has it
            found = self.cgroups.of(msg.pid)
            if found is not None:
                return self._claim(conn, msg, found)
        held = hold(msg.pid, facts)
        if held is None:
            raise Refused(p.ErrorCode.PERMISSION_DENIED, f"program pid {msg.pid} exited before gpud could hold it")
        cgroup, why = None, ""
        if msg.cgroup:
            cgroup, why = self._move(msg.pid, facts.start, held)
        if prog is not None:
            self._end(prog, "replaced")
        prog = Program(msg.pid, held, msg.pause, cgroup)
        self._count(prog, 1)
        self._attach(conn, prog)
        log.info("run_contained", client=conn.client_id, pid=msg.pid, backend=prog.backend, cgroup=_name(prog), why=why)
        return self._contained(msg.id, prog, why)

    def _move(self, pid: int, start: int, held: Held) -> tuple[RunCgroup | None, str]:
        if self.cgroups is None:
            return None, self.why_not
        cgroup = None
        try:
            cgroup = self.cgroups.create(pid, start)
            cgroup.move(pid)
        except OSError as exc:
            if cgroup is not None:
                cgroup.remove()
            return None, f"gpud could not move pid {pid} into {self.cgroups.base}: {exc.strerror or exc}"
        if not held.alive():  # its pid may now name another process: leave that one as it is
            cgroup.remove()
            raise Refused(p.ErrorCode.PERMISSION_DENIED, f"program pid {pid} exited while gpud moved it")
        return cgroup, ""

    def _claim(self, conn: ClientLink, msg: p.Contain, cgroup: RunCgroup) -> p.Contained:
        """``msg.pid`` is in a cgroup of ours already: its run's again (a reconnect, a restart), or refused."""
        prog = next((x for x in [*self.by_conn.values(), *self.unclaimed] if _name(x) == cgroup.name), None)
        if prog is not None and prog.conn is not None and prog.conn is not conn:
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED,
                f"program pid {msg.pid} is in the cgroup of another run (client {prog.conn.client_id})",
            )
        if prog is None:  # a cgroup of ours that no record names: taken as a leftover
            prog = Program(msg.pid, None, msg.pause, cgroup)
            self._count(prog, 1)
        else:
            self._unclaim(prog)
        prog.pause = msg.pause or prog.pause
        old = self.by_conn.get(conn.client_id)
        if old is not None and old is not prog:
            self._end(old, "replaced")
        self._attach(conn, prog)
        log.info("run_claimed", client=conn.client_id, pid=msg.pid, cgroup=cgroup.name, frozen=cgroup.frozen())
        return self._contained(msg.id, prog)

    def adopt(self, conn: ClientLink, msg: p.Adopt, now: int) -> p.ProgramState:
        self.access.require_admin(conn, msg)
        prog = self.by_conn.get(conn.client_id)
        if prog is not None and not prog.is_adopted:
            raise Refused(
                p.ErrorCode.INVALID,
                "this connection's program is a run's (CONTAIN): hand cgroups on a connection of their own",
            )
        self.probe()
        taken = [cg.name for x in self.by_conn.values() if x is not prog for cg in x.adopted]
        base = self.cgroups.hierarchy if self.cgroups is not None else None
        cgroups = judge(msg.cgroups, caller_pid=conn.pid, runs_base=base, taken=taken)
        if prog is None:
            prog = Program(0, None, "", None, task_id=msg.task_id)
            self._count(prog, 1)
            self._attach(conn, prog)
        kept = {cg.name for cg in cgroups}
        let_go = [cg for cg in prog.adopted if cg.name not in kept]
        prog.adopted, prog.task_id = tuple(cgroups), msg.task_id
        try:
            set_frozen(let_go, False)  # handed back as they were before gpud had them
        except OSError as exc:
            self.faults.record("runs", exc, client=conn.client_id)
        log.info(
            "cgroups_adopted", client=conn.client_id, task_id=msg.task_id, cgroups=sorted(kept), let_go=len(let_go)
        )
        return p.ProgramState(id=msg.id, frozen=bool(cgroups) and all_frozen(cgroups))

    def freeze(self, conn: ClientLink, msg: p.Freeze, now: int) -> p.ProgramState | None:
        prog = self._in_cgroup(conn)
        self._write_freeze(prog, True)
        if self._frozen(prog):
            self.metrics.run_freeze.observe(0)
            return p.ProgramState(id=msg.id, frozen=True)
        timeout = round(self.config().run_freeze_timeout_s * 1e6)
        self.freezing.append(_Freezing(conn, msg.id, prog, now, now + timeout))
        self._kick()
        return None  # answered by the housekeeping task once the kernel says frozen

    def thaw(self, conn: ClientLink, msg: p.Thaw, now: int) -> p.ProgramState:
        prog = self._in_cgroup(conn)
        self.freezing = [f for f in self.freezing if f.conn is not conn]
        self._write_freeze(prog, False)
        return p.ProgramState(id=msg.id, frozen=prog.cgroup.frozen() if prog.cgroup is not None else False)

    def escaped(self, conn: ClientLink, msg: p.Escaped, now: int) -> p.Ok:
        count = self.escapes[conn.client_id] = self.escapes.get(conn.client_id, 0) + 1
        self.metrics.run_escapes.inc()
        prog = self.by_conn.get(conn.client_id)
        program = prog.pid if prog else None
        log.warning("run_escape", client=conn.client_id, pid=msg.pid, program=program, escapes=count)
        return p.Ok(id=msg.id)

    def list_runs(self, conn: ClientLink, msg: p.ListRuns, now: int) -> p.RunsReply:
        progs = [*self.by_conn.values(), *self.unclaimed]
        runs = [self._info(x) for x in progs]
        shown = {x.conn.client_id for x in progs if x.conn is not None}
        runs += [
            p.RunProgramInfo(
                client_id=cid, pid=0, backend="signal", cgroup="", state="unknown", processes=0, stopped=0, escapes=n
            )
            for cid, n in self.escapes.items()
            if cid not in shown
        ]
        return p.RunsReply(id=msg.id, runs=runs)

    # --- connections ----------------------------------------------------------------

    def greeted(self, conn: ClientLink) -> None:
        """A HELLO: an unclaimed program that is this connection's descendant is its run's again."""
        if not self.unclaimed or conn.client_id in self.by_conn:
            return
        try:
            self._claim_on_hello(conn)
        except Exception as exc:  # the HELLO is answered all the same; CONTAIN can still claim it
            self.faults.record("runs", exc, client=conn.client_id)

    def _claim_on_hello(self, conn: ClientLink) -> None:
        """Only a run's own HELLO claims: the connecting process is the parent of the program's keeper
        (the program, or an orphan the keeper took in, is its grandchild), not any ancestor."""
        who = caller(conn.pid, conn.uid)
        for prog in list(self.unclaimed):
            for pid in [prog.pid, *(prog.cgroup.pids()[:16] if prog.cgroup else [])]:
                lineage = ancestry(pid, 3)
                if len(lineage) < 3 or lineage[2] != conn.pid:
                    continue
                try:
                    check_program(pid, read_facts(pid), lineage, who, daemon_pid=self.daemon_pid)
                except Refused:
                    continue
                self._unclaim(prog)
                self._attach(conn, prog)
                log.info("run_claimed", client=conn.client_id, pid=pid, cgroup=_name(prog), on="hello")
                return

    def connection_closed(self, conn: ClientLink, now: int) -> None:
        self.freezing = [f for f in self.freezing if f.conn is not conn]
        self.escapes.pop(conn.client_id, None)
        prog = self.by_conn.pop(conn.client_id, None)
        if prog is None:
            return
        prog.conn = None
        if prog.adopted:  # the runtime's: left as the kernel has them, for their agent to hand again
            log.info("cgroups_left", task_id=prog.task_id, cgroups=len(prog.adopted), frozen=all_frozen(prog.adopted))
        if prog.cgroup is None or self.stopping():  # a stopping daemon leaves every cgroup as it is
            self._forget(prog)
            return
        if not prog.cgroup.pids():  # the program ended with its run: nothing to keep
            self._end(prog, "run_gone")
            return
        prog.unclaimed_since = now
        self.unclaimed.append(prog)
        self._kick()

    # --- housekeeping -----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start (the base, the leftovers: before the first HELLO, which may claim one), then answer
        freezes as they finish, reclaim and remove."""
        self.probe()
        self.adopt_leftovers(self.now())
        task_status.started()
        try:
            while True:
                self._wake = trio.Event()
                try:
                    delay = self.tick(self.now())
                except Exception as exc:  # this tick is skipped; the next one tries again
                    self.faults.record("runs", exc)
                    delay = 1.0
                if delay is None:
                    await self._wake.wait()
                else:
                    with trio.move_on_after(delay):
                        await self._wake.wait()
        finally:  # gpud stops: what holds a process stays as the kernel has it; an empty one goes
            for cgroup in [*self.removing, *(x.cgroup for x in [*self.by_conn.values(), *self.unclaimed])]:
                if cgroup is not None and not cgroup.pids():
                    _removed(cgroup)

    def tick(self, now: int) -> float | None:
        """One round; the seconds until the next one is due (None: only when woken)."""
        waiting = []
        for f in self.freezing:
            waited_ms = (now - f.since) / 1000
            if self._frozen(f.program):
                self.metrics.run_freeze.observe(waited_ms / 1000)
                self.links.send(f.conn, p.ProgramState(id=f.rid, frozen=True, waited_ms=waited_ms))
            elif now >= f.deadline:
                log.warning("run_freeze_overdue", client=f.conn.client_id, pid=f.program.pid, waited_ms=waited_ms)
                self.links.send(f.conn, p.ProgramState(id=f.rid, frozen=False, waited_ms=waited_ms))
            else:
                waiting.append(f)
        self.freezing = waiting
        grace = round(self.config().crash_grace_s * 1e6)
        for prog in list(self.unclaimed) if not self.stopping() else []:
            since = prog.unclaimed_since if prog.unclaimed_since is not None else now
            if prog.run is not None and not prog.run.alive():
                self._end(prog, "run_gone")
            elif now - since >= grace:
                self._end(prog, "unclaimed")
        self.removing = [cg for cg in self.removing if not _removed(cg)]
        if self.freezing:
            return FREEZE_POLL_S
        return RECLAIM_POLL_S if self.unclaimed or self.removing else None

    # --- the parts --------------------------------------------------------------------

    def _attach(self, conn: ClientLink, prog: Program) -> None:
        prog.conn = conn
        if prog.run is not None:
            prog.run.close()
        prog.run = hold(conn.pid, read_facts(conn.pid))
        self.by_conn[conn.client_id] = prog
        prog.unclaimed_since = None

    def _unclaim(self, prog: Program) -> None:
        if prog in self.unclaimed:
            self.unclaimed.remove(prog)

    def _end(self, prog: Program, reason: str) -> None:
        """The program may not go on: its cgroup is killed whole and removed once empty."""
        self._unclaim(prog)
        if prog.conn is not None and self.by_conn.get(prog.conn.client_id) is prog:
            del self.by_conn[prog.conn.client_id]
        if prog.cgroup is not None:
            try:
                killed = prog.cgroup.kill() if prog.cgroup.pids() else 0  # an empty one is only removed
            except FileNotFoundError:
                killed = 0
            if killed:
                self.metrics.run_kills.labels(reason).inc()
                log.warning("run_cgroup_killed", cgroup=prog.cgroup.name, pid=prog.pid, processes=killed, reason=reason)
            self.removing.append(prog.cgroup)
            self._kick()
        self._forget(prog)

    def _forget(self, prog: Program) -> None:
        self._count(prog, -1)
        for held in (prog.held, prog.run):
            if held is not None:
                held.close()
        prog.held = prog.run = None

    def _count(self, prog: Program, step: int) -> None:
        backend = "adopted" if prog.is_adopted else "cgroup" if prog.cgroup is not None else "signal"
        self.metrics.runs.labels(backend).inc(step)

    def _in_cgroup(self, conn: ClientLink) -> Program:
        prog = self.by_conn.get(conn.client_id)
        if prog is None or (prog.cgroup is None and not prog.is_adopted):
            raise Refused(
                p.ErrorCode.INVALID,
                "this connection has handed gpud no program in a cgroup: CONTAIN it first (with cgroup), or ADOPT cgroups",
            )
        return prog

    def _frozen(self, prog: Program) -> bool:
        """The kernel says the program is frozen: its cgroup, or every adopted one (or gone)."""
        if prog.cgroup is not None:
            return prog.cgroup.frozen()
        return prog.is_adopted and all_frozen(prog.adopted)

    def _write_freeze(self, prog: Program, frozen: bool) -> None:
        cgroups = (prog.cgroup,) if prog.cgroup is not None else prog.adopted
        try:
            if prog.cgroup is not None:
                prog.cgroup.freeze(frozen)
            else:
                set_frozen(prog.adopted, frozen)
        except OSError as exc:
            names = ", ".join(cg.name for cg in cgroups)
            raise Refused(p.ErrorCode.INVALID, f"cannot write cgroup.freeze of {names}: {exc.strerror}") from None

    def _contained(self, rid: int, prog: Program, why: str = "") -> p.Contained:
        backend: p.ProgramBackend = "cgroup" if prog.cgroup is not None else "signal"
        frozen = prog.cgroup.frozen() if prog.cgroup is not None else False
        return p.Contained(id=rid, pid=prog.pid, backend=backend, cgroup=_name(prog), frozen=frozen, why=why)

    def _info(self, prog: Program) -> p.RunProgramInfo:
        run = prog.conn.pid if prog.conn is not None else None
        if prog.is_adopted:
            state, processes, stopped = adopted_state(prog.adopted)
        else:
            state, processes, stopped = program_state(prog.cgroup, prog.pid, run)
        cid = prog.conn.client_id if prog.conn is not None else 0
        return p.RunProgramInfo(
            client_id=cid, pid=prog.pid, backend=prog.backend, cgroup=_name(prog), state=state,
            processes=processes, stopped=stopped, escapes=self.escapes.get(cid, 0), task_id=prog.task_id,
        )  # fmt: skip

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()


def _removed(cgroup: RunCgroup) -> bool:
    try:
        return cgroup.remove()
    except OSError:
        return False  # tried again at the next round


def _name(prog: Program) -> str:
    if prog.adopted:
        return " ".join(cg.name for cg in prog.adopted)
    return prog.cgroup.name if prog.cgroup is not None else ""
