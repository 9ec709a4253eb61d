"""The run's driver: carries ``RunCore``'s decisions out on a real program, a real gpud and a backend.

Threads, none of them deciding anything: the main thread reads events (typed, in
``core/run_events.py``) from one queue and carries out the core's actions in order;
a lock thread waits for the session's grant when the core asks for the lock; a
watcher waits for the program's end (the keeper's socket); the session's hooks
(DROP_LOCK, a lost lock, PARK) and the signals SIGINT, SIGTERM and SIGHUP only put
an event on the queue. So a pause, a park and a resume never overlap, and a
DROP_LOCK is answered as soon as the tree is paused: the queue wakes the main thread
at once. gpud's pushes about the run's allocation (``run/allocation.py``) come the
same way, from the client's reader; an ALLOCATE that waits for room again has a
thread of its own. A program started again (a checkpoint, a resize) gets a fresh
keeper.
"""

from __future__ import annotations

import os
import queue
import select
import signal
import sys
import threading
import time
from types import FrameType
from typing import IO, assert_never

from gpud_client import protocol as p
from gpud_client.client import Client, Session
from gpud_client.core import run_events as ev
from gpud_client.core.run import (
    Allocate,
    AnswerPark,
    EndProgram,
    Exit,
    Forward,
    Park,
    Pause,
    Release,
    ReportEscape,
    Request,
    Resume,
    RunAction,
    RunCore,
    Say,
    Start,
    UseAllocation,
    Yield,
)
from gpud_client.errors import GpudError, LockLost
from gpud_client.proctl.base import Backend, ControlError
from gpud_client.proctl.keeper import Keeper
from gpud_client.proctl.signals import Escape
from gpud_client.proctl.tree import ProcessTree
from gpud_client.run.allocation import PREEMPT_ENV, allocate_again, free, give_back, program_env
from gpud_client.run.contain import Containment
from gpud_client.run.options import RunOptions
from gpud_client.run.trace import Trace
from gpud_client.runinfo import STATE
from gpud_client.units import printable

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
TICK_S = 0.1  # how often a running program's activity is looked at (idle release, signal grace)


class Supervisor:
    def __init__(
        self, opts: RunOptions, *, prog: str, err: IO[str] | None = None, forward_signals: bool = True
    ) -> None:
        self.opts = opts
        self.forward_signals = forward_signals
        self.trace = Trace(opts.trace)
        self.backend: Backend | None = None  # None: never paused (whole GPUs, no daemon)
        self.prog = prog
        self.err = err or sys.stderr
        self.events: queue.Queue[tuple[int, ev.RunEvent]] = queue.Queue()  # when it happened (for --trace), what
        self.core = self._new_core(arbitrated=False, can_park=False)
        self.client: Client | None = None
        self.containment: Containment | None = None  # the program handed to gpud (CONTAIN)
        self.session: Session | None = None
        self.keeper: Keeper | None = None
        self.tree: ProcessTree | None = None
        self.env: dict[str, str] = dict(os.environ)
        self.cpus: list[int] = []
        self.owned_task: str | None = None
        self.program_ran = False  # the keeper's program has been let go: a start needs a fresh keeper
        self._want_lock = threading.Semaphore(0)
        self._stopping = threading.Event()
        self._told_fallback = False
        self._park_moved: int | None = None  # what the last park moved, for --trace

    def _new_core(self, *, arbitrated: bool, can_park: bool) -> RunCore:
        opts = self.opts
        return RunCore(
            idle_release=opts.idle_release,
            signal_grace=opts.signal_grace,
            can_park=can_park,
            arbitrated=arbitrated,
            recovery=opts.on_preempt,
            on_resize=opts.on_resize,
            checkpoint_signal=opts.checkpoint_signal,
            max_escapes=opts.max_escapes,
        )

    def use(self, backend: Backend | None, *, arbitrated: bool | None = None) -> None:
        """Before the run: pause the program with ``backend`` (None: never paused); ``arbitrated`` (default:
        with a backend): only while a session holds the lock. Whole GPUs have one only to be suspended."""
        self.backend = backend
        arbitrated = backend is not None if arbitrated is None else arbitrated and backend is not None
        self.core = self._new_core(arbitrated=arbitrated, can_park=backend is not None and backend.can_park)

    def say(self, text: str) -> None:
        print(f"{self.prog}: {text}", file=self.err, flush=True)

    # --- the run ---------------------------------------------------------------------

    def run(self, keeper: Keeper, client: Client | None, allocated: p.Allocated | None) -> int:
        """Carry the run through to its end; the program's exit status (or the run's own). The
        keeper holds the program before its exec; the run owns ``allocated`` and frees it."""
        self.keeper, self.tree, self.client = keeper, ProcessTree(keeper.pid), client
        if allocated is not None:
            self.owned_task = allocated.task_id
            self.core.use_allocation(allocated)
            self._use_allocation(allocated, resume=allocated.resume)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED} if self.forward_signals else {}
        try:
            if client is not None and self.core.config.arbitrated:
                self._open_session(client, allocated)
                threading.Thread(target=self._lock_loop, name="gpud-run-lock", daemon=True).start()
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._close()

    def _open_session(self, client: Client, allocated: p.Allocated | None) -> None:
        opts = self.opts
        gpu: int | str = allocated.gpus[0] if allocated is not None else opts.gpu
        self.session = client.session(
            gpu,
            priority=opts.priority if isinstance(opts.priority, int) else 0,
            idle_release=None,  # the run's own rule decides (RunCore), on the program's activity
            core_limit=opts.core_limit,
            mem_limit=opts.mem_limit,
            mem_estimate=opts.mem_estimate,
            memory_probe=lambda: 0,
            framework_hooks=False,
            task_id=allocated.task_id if allocated is not None else opts.task,
            on_drop=lambda reason: self.post(ev.Dropped(reason)),
            on_lost=lambda error: self.post(ev.Lost(error.why)),
            on_park=(lambda: self.post(ev.ParkAsked())) if self.core.config.can_park else None,
        )
        if allocated is None:  # as an allocation names it: NVML's index, which is PCI bus order
            self.env["CUDA_VISIBLE_DEVICES"] = str(self.session.gpu)
            self.env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            self.env["GPUD_SOCKET"] = client.path

    def _use_allocation(self, allocated: p.Allocated, *, resume: bool) -> None:
        """The next start runs on ``allocated``: its environment and CPU cores."""
        for key in PREEMPT_ENV:
            self.env.pop(key, None)  # never inherited: this run says what holds for its program
        path = self.client.path if self.client is not None else None
        self.env.update(program_env(self.opts, allocated, resume=resume, socket_path=path))
        self.cpus = list(allocated.cpus)

    def escaped(self, escape: Escape) -> None:
        """The signal backend's watcher caught a process of the paused tree running (its thread)."""
        self.post(ev.Escaped(escape.pid, escape.why, escape.fatal))

    def post(self, event: ev.RunEvent) -> None:
        """An event for the run's loop, from any thread (the allocation listener's, say), stamped now."""
        self.events.put((time.monotonic_ns(), event))

    def _loop(self) -> int:
        pending = self.core.begin(time.monotonic())
        next_tick = time.monotonic() + TICK_S
        while True:
            status = self._carry_out(pending)
            if status is not None:
                return status
            self._show()
            now = time.monotonic()
            try:
                t_ns, event = self.events.get(timeout=max(0.0, next_tick - now))
            except queue.Empty:
                now = time.monotonic()
                pending = self.core.tick(now, self._activity())
                next_tick = self.core.next_tick(now, TICK_S)
                continue
            self.trace.event(event.name, t_ns, **event.trace())
            pending = self._handle(event, time.monotonic())

    def _handle(self, event: ev.RunEvent, now: float) -> list[RunAction]:
        core = self.core
        match event:
            case ev.Granted(session=session):  # one closed since (a restart on another allocation) is not the run's
                return core.granted(now) if session is self.session else []
            case ev.Dropped():
                return core.dropped(now)
            case ev.Lost(why=why):
                return core.lost(now, why)
            case ev.ParkAsked():
                return core.park_asked()
            case ev.Signalled(signum=signum):
                return core.signalled(signum, now)
            case ev.Exited(status=status):
                return core.exited(status)
            case ev.Escaped(pid=pid, why=why, fatal=fatal):
                return core.escaped(pid, why, fatal=fatal)
            case ev.GrantFailed(why=why):
                return core.failed(f"gpud refused the program's session: {why}")
            case ev.Preempted(push=push):
                return core.preempted(push, now)
            case ev.Withdrawn():
                return core.withdrawn(now)
            case ev.Revoked(push=revoked):
                return core.revoked(revoked, now)
            case ev.Changed(push=changed):
                return core.changed(changed, now)
            case ev.Reallocated(allocation=allocation):
                return core.reallocated(allocation, now)
            case ev.ReallocationFailed(why=why):
                return core.reallocation_failed(why)
            case _:
                assert_never(event)

    def _show(self) -> None:
        """gpud shows what the run is doing (its ``run.state`` label) from the run's own word."""
        shown = self.core.shown()
        if self.client is not None and self.client.labels.get(STATE) != shown:
            self.client.set_labels({**self.client.labels, STATE: shown})

    def _activity(self) -> float | None:
        if self.core.config.idle_release is None or self.tree is None:
            return None
        return self.tree.cpu_seconds()

    # --- carrying out the core's actions ----------------------------------------------

    def _carry_out(self, actions: list[RunAction]) -> int | None:
        try:
            return self._carry_out_all(actions)
        finally:
            self.trace.flush()

    def _carry_out_all(self, actions: list[RunAction]) -> int | None:
        while actions:
            action, actions = actions[0], actions[1:]
            try:
                more = self._do(action)
            except ControlError as exc:
                if not exc.fatal and isinstance(action, Resume):
                    more = self.core.resume_refused(str(exc))
                else:
                    more = self.core.failed(f"{exc}; the program was ended so that it never runs unarbitrated")
                actions = []  # what followed assumed the action worked
            if isinstance(more, int):
                return more
            actions = [*more, *actions]
        return None

    def _do(self, action: RunAction) -> list[RunAction] | int:
        self._park_moved = None
        result = self._act(action)
        if self.trace.out is not None:
            self.trace.did(action, time.monotonic_ns(), self._park_moved)
        return result

    def _act(self, action: RunAction) -> list[RunAction] | int:
        keeper, tree, backend, session = self.keeper, self.tree, self.backend, self.session
        assert keeper is not None and tree is not None
        match action:
            case Start():
                return self._start()
            case Pause():
                assert backend is not None
                paused = backend.pause(tree)
                if paused.fallbacks and not self._told_fallback:
                    self._told_fallback = True
                    self.say(f"{paused.fallbacks[0]} (said once)")
            case Resume():
                assert backend is not None
                backend.resume(tree)
            case Release():
                assert session is not None
                try:
                    session.release()
                except LockLost:
                    pass  # revoked meanwhile: it is asked for again all the same
            case Request():
                self._want_lock.release()
            case Park():
                assert backend is not None
                try:
                    moved = backend.park(tree)
                except ControlError as exc:
                    if exc.fatal:
                        raise
                    return self.core.park_done(False, str(exc))
                self._park_moved = moved
                return self.core.park_done(True, f"{moved} bytes to host memory")
            case AnswerPark(ok=ok, message=message):
                assert session is not None
                session.parked(ok, printable(message)[:512])
            case Forward(signal=signum):
                try:
                    os.killpg(keeper.program_pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
            case EndProgram(why=why):
                self.say(why)
                keeper.close()
            case Exit(status=status):
                return status
            case Yield():
                assert self.client is not None and self.owned_task is not None
                give_back(self.client, self.owned_task, self.say)
            case Allocate():
                assert self.client is not None and self.owned_task is not None
                args = (self.client, self.opts, self.owned_task, self.post, self._stopping)
                threading.Thread(target=allocate_again, args=args, name="gpud-run-allocate", daemon=True).start()
            case ReportEscape(pid=pid, escapes=escapes):
                if self.containment is not None:
                    self.containment.escaped(pid, escapes)
            case UseAllocation(allocation=allocated, resume=resume):
                self._use_allocation(allocated, resume=resume)
                if self.session is not None:  # a fraction's session: on the GPU of its allocation now
                    self._close_session()
                    assert self.client is not None
                    self._open_session(self.client, allocated)
            case Say(text=text):
                self.say(text)
        return []

    def _start(self) -> list[RunAction] | int:
        """Let the program go; one that ran before starts afresh under a new keeper."""
        if self.program_ran:
            assert self.keeper is not None
            self.keeper.close()
            try:
                self.keeper = Keeper.start(self.opts.command)
            except OSError as exc:
                self.say(f"could not start the program again: {exc}")
                return 1
            self.tree = ProcessTree(self.keeper.pid)
            if self.containment is not None:  # the new program is gpud's to hold, in a cgroup as the last was
                self.containment.contain(self.keeper.program_pid)
        assert self.keeper is not None
        self.program_ran = True
        try:
            self.keeper.go(self.env, self.cpus)
        except OSError as exc:
            self.say(str(exc.strerror))
            return exc.errno or 1
        # only now: before, the keeper's answer to go is not the program's end
        threading.Thread(target=self._watch_program, name="gpud-run-program", daemon=True).start()
        return []

    # --- threads that only feed the queue -------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.post(ev.Signalled(signum))

    def _lock_loop(self) -> None:
        while True:
            self._want_lock.acquire()
            if self._stopping.is_set():
                return
            session = self.session  # the current one: a fraction's restart may have moved it
            if session is None:
                continue
            try:
                session.acquire()
            except GpudError as exc:
                if self._stopping.is_set():
                    return
                if session is not self.session:
                    continue  # closed for a restart on another allocation: the next request is the new one's
                self.post(ev.GrantFailed(str(exc)))
                return
            self.post(ev.Granted(session))

    def _watch_program(self) -> None:
        keeper = self.keeper
        assert keeper is not None
        try:
            select.select([keeper.fileno()], [], [])
            status = keeper.exit_code()
        except (OSError, ValueError):
            return  # the run closed the keeper: it is ending anyway
        self.post(ev.Exited(status))

    def _close(self) -> None:
        self._stopping.set()
        self._want_lock.release()
        if self.keeper is not None:
            self.keeper.close()  # ends whatever is left of the tree
        if self.backend is not None:
            self.backend.close()
        self.trace.close()
        if self.client is not None:
            self._close_session()
            if self.owned_task is not None:  # also withdraws an ALLOCATE that waits for room again
                free(self.client, self.owned_task, self.say, gone=self.core.gone)
            self.client.close()

    def _close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                session.close()
            except GpudError:
                pass
