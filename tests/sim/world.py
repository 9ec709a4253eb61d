"""The simulated world's driver: the seed's generator, the fake clock and its trace, the daemon (built
and rebuilt on one state directory), the agenda of what clients and processes do later, the
daemon's timers, the steps, and the checks after every event.

The world is composed of parts, one per capability (``Part``), built in the order their invariants
are checked: ``Connections`` (clients, connections, requests and answers), ``Leases``, ``Locks``
(sessions and the GPU lock) with ``LockWaits`` (the order of grants and the bound on a wait) and
``Parking``, ``Preemption`` (taking allocations back, what nobody was told), ``Owners`` (owner
processes, the process table, gpud's signals, the reaper), ``Restarts`` (crashes, restarts, store
faults, what the store keeps) and ``Allocations`` (the ledger, waits, tenants, devices). Each part
registers the answers it judges, its steps and its agenda entries; the driver dispatches by name.

Time moves the way the shell's timers move it: to every scheduler and ledger deadline in order
(``tick_gpu``, ``tick_allocations``), to the reaper's rounds, and to the moments simulated clients
act. After every event (one request, one timer expiry, one client action, one crash) the judges
deferred to the event's end run, the event's grants are judged, and each part's ``check`` runs.
The driver keeps no rule of its own but these: the daemon counted no fault, and no timer's
deadline stays due (the timers act on it and make progress).

Everything random is drawn from the seed's generator, in the order the events call for it; a
part's constructor draws nothing but the configuration's own (the /proc hidden or not, how often
the store fails: in that order, after the configuration).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import random
import shutil
import tempfile
import traceback
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, NoReturn

from gpud.serving.server import Daemon
from gpud.serving.timers import tick_allocations, tick_gpu
from gpud_client import protocol as p

try:
    from inprocess import Node  # run by pytest: tests/ is on the path
except ImportError:  # python -m tests.sim.daemon_sim, from the repository root
    from tests.inprocess import Node

from .allocations import Allocations
from .connections import Connections
from .leases import Leases
from .lock_waits import LockWaits
from .locks import Locks
from .model import (
    DEFAULT_STEPS,
    MS,
    SIM_CPUS,
    START_US,
    TASK_TYPES,
    TRACE_LINES,
    Answer,
    Client,
    GpuModel,
    Part,
    SimFailure,
    describe_config,
    draw_config,
    fixed_cpus,
    quiet_logs,
    scratch_root,
    trace_line,
)
from .owners import Owners, kernel
from .parking import Parking
from .preemption import Preemption
from .restarts import Restarts

# Daemon bugs the checks let pass until they are fixed, each counted as "known bug: ..." in the
# stats; ``--strict`` (or ``run_seed(strict=True)``) fails on them instead.
# (The two the parking checks found first, a PARK before its ATTACHED and PARKs asked for a lease
# that leaves at once, are fixed: their checks now always fail; so are the two the owner checks
# found first, no SIGKILL at the grace's end and an owner that exited while gpud was down never
# reaped.)
KNOWN_BUGS: set[str] = set()
# ``--churn``: the steps' weights that change, so that the paths through a restart with owners that
# exited and pids that were reused (few in a default run) come up in a few hundred seeds.
CHURN = {"crash_daemon": 3, "owner_exits": 4, "pid_reuse": 4, "restart_daemon": 1, "allocate": 10}


class World:
    # Each step's name (a part's ``steps``) and its weight; the order is the draw's.
    STEPS: list[tuple[str, float]] = [
        ("advance", 30),
        ("connect", 3),
        ("attach", 6),
        ("lock_request", 14),
        ("release", 3),
        ("detach", 1.5),
        ("mem_update", 3),
        ("set_limits", 2.5),
        ("acquire", 9),
        ("release_lease", 1.5),
        ("allocate", 7),
        ("free", 4),
        ("admin", 3),
        ("query", 1.5),
        ("misc", 1.5),
        ("crash_client", 1.2),
        ("crash_daemon", 0.35),
        ("restart_daemon", 0.15),
        ("yield", 0.4),
        ("contend", 5),
        ("crash_preempting", 1.5),
        ("owner_exits", 1.2),
        ("pid_reuse", 0.6),
    ]

    def __init__(
        self, seed: int, steps: int = DEFAULT_STEPS, *, verbose: bool = False, strict: bool = False, churn: bool = False
    ) -> None:
        self.seed, self.steps, self.verbose, self.strict, self.churn = seed, steps, verbose, strict, churn
        self.rng = random.Random(seed)
        self.now = START_US
        self.step_no = 0
        self.events = 0
        # The last events as (step, time, format, arguments): formatted only when a report shows them.
        self.trace: deque[tuple[int, int, str, tuple[Any, ...]]] = deque(maxlen=TRACE_LINES)
        self.state_dir = tempfile.mkdtemp(prefix=f"gpud-sim-{seed}-", dir=scratch_root())
        self.config = draw_config(self.rng, self.state_dir)
        self.stats: Counter[str] = Counter()  # what happened, to see what the checks saw
        self.clients: list[Client] = []
        self.agenda: list[tuple[int, int, str, tuple[Any, ...]]] = []
        self._agenda_seq = itertools.count()
        self.broken = ""  # a failure found inside a call into the daemon
        self.faults: list[str] = []
        self.daemon_runs = 0
        self.deferred: list[Callable[[], None]] = []  # checks judged at the end of the event
        self.spins, self.last_due = 0, 0  # timer rounds at one instant (a deadline that stays due)
        self.woken = False  # the allocations' timer was woken: it ticks after this event
        self.booting = False  # a new daemon whose timers have not run yet (what fell due while it was down)
        self.grace_end = START_US  # nothing is granted before (the restart grace)
        self.gpus: list[GpuModel] = []
        # The parts, in the order their invariants are checked.
        self.conns = Connections(self)
        self.leases = Leases(self)
        self.locks = Locks(self)
        self.lock_waits = LockWaits(self)
        self.parking = Parking(self)
        self.preemption = Preemption(self)
        self.owners = Owners(self)  # (draws whether /proc hides everything)
        self.restarts = Restarts(self)  # (draws how often the store fails)
        self.allocs = Allocations(self)
        self.parts: list[Part] = [
            self.conns,
            self.leases,
            self.locks,
            self.lock_waits,
            self.parking,
            self.preemption,
            self.owners,
            self.restarts,
            self.allocs,
        ]
        self.answers: dict[str, Answer] = self._table(lambda part: part.answers())
        self.laters: dict[str, Callable[..., None]] = self._table(lambda part: part.laters())
        self.actions: dict[str, Callable[[], None]] = self._table(lambda part: part.steps())
        self.actions.update(advance=self.do_advance, admin=self.do_admin)
        assert set(self.actions) == {name for name, _ in self.STEPS}
        self.daemon: Daemon = self.build_daemon(grace_us=0)
        self.event("config: {}", describe_config(self.config, self.restarts.store_fail_p))

    def _table(self, of: Callable[[Part], dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            entries = of(part)
            assert not set(entries) & set(out), f"named twice: {sorted(set(entries) & set(out))}"
            out.update(entries)
        return out

    # --- plumbing ---------------------------------------------------------------------------

    def clock(self) -> int:
        return self.now

    def event(self, text: str, *args: Any) -> None:
        """One line of the trace: ``text.format(*args)``, a message argument shown by ``short``."""
        self.events += 1
        entry = (self.step_no, self.now, text, args)
        self.trace.append(entry)
        if self.verbose:
            print(trace_line(entry))

    def fail(self, message: str) -> NoReturn:
        raise SimFailure(message)

    def known_bug(self, name: str, what: str) -> None:
        """A daemon bug the checks let pass (``KNOWN_BUGS``) unless strict."""
        if self.strict or name not in KNOWN_BUGS:
            self.fail(f"{what} (known bug: {name})")
        self.stats[f"known bug: {name}"] += 1

    def describe_gpus(self) -> list[str]:
        lines = []
        with contextlib.suppress(Exception):
            for slot in self.daemon.slots:
                v = slot.scheduler.view(self.now)
                grace = max(0, self.grace_end - self.now)
                lines.append(
                    f"GPU {slot.gpu.index}: {v.mode.value}, scheduler {'on' if v.enabled else 'off'}, TQ {v.tq_us} us"
                    + (f", restart grace {grace} us left" if grace else "")
                    + f"; holders {[(h.session, h.grant, h.drop_pending and h.drop_pending.value) for h in v.holders]}"
                    + f"; queue {[(w.session, w.priority, 'throttled' if w.throttled else '') for w in v.queue]}"
                )
        return lines

    def build_daemon(self, grace_us: int) -> Daemon:
        """A daemon on this world's state directory, clock and process table (the in-process daemon of
        tests/inprocess.py), its random sources seeded, the calls the parts judge watched."""
        with fixed_cpus(SIM_CPUS), kernel(self.owners.table):
            d = Node(
                self.config.simulate or "1", config=self.config, clock=self.clock, restart_grace_us=grace_us
            ).daemon
        self.daemon_runs += 1
        # The two random sources of a daemon, made replayable: the "random" placement strategy and
        # the prefix of lease ids (which only has to differ between daemon runs).
        d.allocations.ledger.state.rng.seed(self.seed * 1000 + self.daemon_runs)
        d.leases._prefix = f"sim{self.seed}r{self.daemon_runs}"
        real_record = d.faults.record

        def record(where: str, exc: BaseException, **context: object) -> None:
            self.faults.append(f"fault in {where} ({context}):\n" + "".join(traceback.format_exception(exc)))
            real_record(where, exc, **context)

        d.faults.record = record  # type: ignore[method-assign]
        real_wake = d.allocations.wake

        def wake() -> None:  # the allocations' timer task wakes and ticks at once (after this event)
            self.woken = True
            real_wake()

        d.allocations.wake = wake
        self.woken = False
        self.grace_end = d.started_at + grace_us
        self.gpus = [
            GpuModel(
                s.gpu.index,
                s.gpu.memory_total_bytes,
                s.gpu.memory_total_bytes * (100 - self.config.memory_reserve_percent) // 100,
                self.config.mode,
                True,
                round(self.config.tq_s * 1e6),
            )
            for s in d.slots
        ]
        for part in self.parts:
            part.on_daemon(d)
        return d

    def later(self, at: int, what: str, *args: Any) -> None:
        """Plan ``what`` (a part's ``laters`` entry) for time ``at``."""
        heapq.heappush(self.agenda, (at, next(self._agenda_seq), what, args))

    def pick(self, items: list[Any]) -> Any:
        return self.rng.choice(items) if items else None

    # --- the daemon's timers and the clients' own time --------------------------------------------

    def next_due(self) -> int | None:
        d = self.daemon
        times = [t for t in (s.scheduler.next_deadline() for s in d.slots) if t is not None]
        ledger = d.allocations.next_deadline()  # the ledger's, or when a change the store refused is tried again
        if ledger is not None:
            times.append(ledger)
        if self.agenda:
            times.append(self.agenda[0][0])
        if self.woken:
            times.append(self.now)
        if self.owners.reap_us:
            times.append(self.owners.next_reap)
        return min(times, default=None)

    def advance(self, to: int) -> None:
        """Move time to ``to``, running every deadline on the way at its instant, as the
        shell's timer tasks do, and every client action planned before it."""
        while (due := self.next_due()) is not None and due <= to:
            self.now = max(self.now, due)
            self.run_due()
        self.now = max(self.now, to)

    def run_due(self) -> None:
        """Every timer due now (one event: the timers of one instant), then the clients'
        actions planned for now, one event each."""
        d, owners = self.daemon, self.owners
        fired = []
        for slot in d.slots:
            deadline = slot.scheduler.next_deadline()
            if deadline is not None and deadline <= self.now:
                fired.append(f"GPU {slot.gpu.index}")
                tick_gpu(d, slot, self.now)
                self.conns.deliver()
        deadline = d.allocations.next_deadline()
        reap = bool(owners.reap_us) and self.now >= owners.next_reap
        if self.woken or (deadline is not None and deadline <= self.now) or reap:
            # (a reaper's round that finds no owner dead and changes nothing is no event)
            busy = self.woken or (deadline is not None and deadline <= self.now) or d.allocations.owners.orphaned()
            writes = self.restarts.writes
            self.woken = False
            tick_allocations(d, self.now, reap=reap)
            if reap:
                owners.next_reap = self.now + owners.reap_us
            if busy or self.restarts.writes != writes:
                fired.append("allocations" + (" (reaper)" if reap else ""))
            else:
                owners.reaps_now = False
            self.booting = False
            self.conns.deliver()
        if fired:
            self.event("timers: {}", ", ".join(fired))
            self.after_event()
            deadline = d.allocations.next_deadline()
            if deadline is not None and deadline <= self.now and not d.allocations.reaping:
                self.fail(f"an allocation deadline {self.now - deadline} us old is due but was not acted on")
            self.spins = self.spins + 1 if self.now == self.last_due else 0
            self.last_due = self.now
            if self.spins > 1000:
                self.fail("the timers make no progress: their deadlines stay due")
        while self.agenda and self.agenda[0][0] <= self.now:
            _, _, what, args = heapq.heappop(self.agenda)
            self.laters[what](*args)

    # --- the steps ------------------------------------------------------------------------------------

    def run(self) -> None:
        names = [n for n, _ in self.STEPS]
        weights = [CHURN.get(n, w) if self.churn else w for n, w in self.STEPS]
        with quiet_logs():
            try:
                for _ in range(2):
                    self.conns.do_connect()
                for self.step_no in range(1, self.steps + 1):  # noqa: B020 - the step number is state the trace reads
                    step = self.rng.choices(names, weights)[0]
                    self.actions[step]()
                    if self.woken:  # the allocations' timer was woken: it runs now
                        self.advance(self.now)
                    if self.step_no % 50 == 0:
                        self.restarts.check_fresh_store()
                self.restarts.check_fresh_store()
                for a in [*self.allocs.acked.values(), *self.allocs.suspended.values()]:
                    self.preemption.retire(a)
            finally:
                with contextlib.suppress(Exception):
                    self.daemon.allocations.store.close()
                shutil.rmtree(self.state_dir, ignore_errors=True)

    def do_advance(self) -> None:
        r = self.rng
        gm = self.gpus[0]
        step = r.choice([0, 100, MS, 3 * MS, gm.tq_us // 2, gm.tq_us, self.locks.dt_us, 30 * MS, 150 * MS])
        self.advance(self.now + step)

    def do_admin(self) -> None:
        """An admin's request (mostly an admin's: anyone else is refused): mode, TQ, the scheduler
        switch, a policy, a drain or undrain, protection, a reset of the allocations."""
        conns, allocs, restarts = self.conns, self.allocs, self.restarts
        admins = [c for c in conns.connected() if c.admin]
        c = self.pick(admins) if admins and self.rng.random() < 0.85 else self.pick(conns.connected())
        if c is None:
            return
        r = self.rng
        gpu = r.choice([None, r.randrange(len(self.gpus))])
        off = [gm.index for gm in self.gpus if not gm.enabled]
        op = r.choices(["mode", "tq", "sched", "policy", "reset", "drain", "protect"], [4, 2, 2, 2, 0.4, 1.2, 1.2])[0]
        rid = c.rid()
        info: dict[str, Any] = {}
        if op == "mode":
            msg: Any = p.SetMode(id=rid, mode=r.choice(list(p.Mode)), gpu=gpu)
        elif op == "tq":
            msg = p.SetTq(id=rid, seconds=r.choice([0.005, 0.02, 0.1]), gpu=gpu)
        elif op == "sched":
            msg = p.SchedOn(id=rid, gpu=gpu) if off and r.random() < 0.8 else p.SchedOff(id=rid, gpu=gpu)
        elif op == "policy":
            msg = p.SetPolicy(
                id=rid,
                task_type=r.choice(TASK_TYPES),
                priority=r.choice([None, 40, 95]),
                max_wait_ms=r.choice([None, 0, 30]),
                queue_limit=r.choice([None, 1, 4]),
                hold_max_ms=r.choice([None, 20]),
                busy_policy=r.choice([None, *p.BusyPolicy]),
            )
        elif op == "drain":
            g = r.randrange(len(self.gpus))
            on = g not in allocs.draining if r.random() < 0.8 else r.random() < 0.5
            ref: int | str = g if r.random() < 0.7 else r.choice([f"gpu:{g}", self.daemon.slots[g].gpu.uuid])
            msg = p.Drain(id=rid, gpu=ref, on=on)
            info["gpu"] = g
            # Its notices (on), or grants on the GPU (off), may be read before the admin reads its OK.
            (allocs.drain_now if on else allocs.undrain_now).add(g)
        elif op == "protect":
            task = r.choice([*sorted(allocs.acked)[:4], *sorted(allocs.suspended)[:1], "never-allocated"])
            msg = p.Protect(id=rid, task_id=task, protected=r.random() < 0.7)
        else:
            msg = p.ResetAllocations(id=rid)
        kind = str(msg.__struct_config__.tag)
        cp, waiters, injected = (
            self.daemon.allocations.ledger.checkpoint(),
            dict(self.daemon.allocations.waiters),
            restarts.injected,
        )
        tasks = sorted(allocs.acked) + sorted(allocs.suspended)
        pend = conns.send(c, msg, kind, tasks=tasks, injected=injected, **info)
        conns.finish(c, pend)
        if pend.info.get("store_failed") or (kind == "RESET_ALLOCS" and restarts.injected > injected):
            allocs.check_rolled_back(cp, waiters, kind)
        self.after_event()

    # --- the checks ---------------------------------------------------------------------------------

    def after_event(self) -> None:
        deferred, self.deferred = self.deferred, []
        for judge in deferred:
            judge()
        self.lock_waits.note_grants()
        self.check()
        for part in self.parts:
            part.end_event()

    def check(self) -> None:
        """A failure found inside a call into the daemon, or a fault it counted, fails at once; then
        every part's invariants, in the parts' order."""
        if self.broken:
            self.fail(self.broken)
        if self.faults:
            self.fail("the daemon counted a fault:\n" + self.faults[0])
        for part in self.parts:
            part.check()
