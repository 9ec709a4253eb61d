"""The run's driver: carries ``RunCore``'s decisions out on a real program, a real gpud and a backend.

Threads, none of them deciding anything: the main thread reads events from one
queue and carries out the core's actions in order; a lock thread waits for the
session's grant when the core asks for the lock; a watcher waits for the program's
end (the keeper's socket); the session's hooks (DROP_LOCK, a lost lock, PARK) and
the signals SIGINT, SIGTERM and SIGHUP only put an event on the queue. So a pause,
a park and a resume never overlap, and a DROP_LOCK is answered as soon as the
tree is paused: the queue wakes the main thread at once.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

from gpud_client import protocol as p
from gpud_client.client import Client, Session
from gpud_client.core.run import (
    AnswerPark,
    EndProgram,
    Exit,
    Forward,
    Park,
    Pause,
    Release,
    Request,
    Resume,
    RunAction,
    RunCore,
    Start,
)
from gpud_client.errors import DaemonUnavailable, GpudError, LockLost
from gpud_client.proctl.base import Backend, ControlError
from gpud_client.proctl.keeper import Keeper
from gpud_client.proctl.tree import ProcessTree
from gpud_client.run.options import RunOptions
from gpud_client.taskenv import allocation_env
from gpud_client.units import printable

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
TICK_S = 0.1  # how often a running program's activity is looked at (idle release, signal grace)
FOREVER_S = 365 * 86400.0  # how long a paused program waits for gpud to come back


@dataclass(frozen=True, slots=True)
class _Event:
    kind: str  # granted, grant_failed, drop, lost, park, exited, signal
    value: Any = None
    t_ns: int = field(default_factory=time.monotonic_ns)  # when it happened (the hook ran), for --trace


class Trace:
    """``--trace FILE``: one JSON line per event and per action carried out, with
    ``time.monotonic_ns()`` (one clock for every process of the machine): when a DROP_LOCK
    came, when the tree was paused, when LOCK_RELEASED went, parks and restores with their
    bytes. For operators diagnosing a run, and for bench/run_share.py and bench/gpu_run.py.

    Events are ``{"t", "event", ...}``: granted, drop, lost, park (gpud's PARK), signal, exited,
    grant_failed. Actions are ``{"t", "action", ...}`` with their fields: start, pause (why), resume,
    release, parked (ok, bytes), answerpark (ok, message), forward (signal), endprogram (why),
    exit (status, why)."""

    def __init__(self, path: str | None) -> None:
        self.out = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - closed by close()
        self.pending: list[dict[str, Any]] = []

    def event(self, what: str, t_ns: int | None = None, **fields: Any) -> None:
        """Something that happened (its time: when the hook ran), written at once."""
        if self.out is None:
            return
        record = {"t": time.monotonic_ns() if t_ns is None else t_ns, "event": what}
        record.update((k, v) for k, v in fields.items() if v is not None)
        self.out.write(json.dumps(record) + "\n")

    def did(self, action: RunAction, t_ns: int, moved: int | None) -> None:
        """An action carried out, stamped when it was done and written once the actions of that event
        are (``flush``): no file write between a pause and its LOCK_RELEASED."""
        fields = {k: getattr(action, k) for k in action.__dataclass_fields__}
        if isinstance(action, Park):  # the action is "parked", so that it differs from the PARK event
            record = {"t": t_ns, "action": "parked", "ok": moved is not None, "bytes": moved}
        else:
            record = {"t": t_ns, "action": type(action).__name__.lower(), **fields}
        self.pending.append(record)

    def flush(self) -> None:
        if self.out is not None and self.pending:
            self.out.write("".join(json.dumps(r) + "\n" for r in self.pending))
            self.pending.clear()

    def close(self) -> None:
        if self.out is not None:
            self.flush()
            self.out.close()


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
        self.events: queue.Queue[_Event] = queue.Queue()
        self.core = RunCore(idle_release=opts.idle_release, signal_grace=opts.signal_grace, arbitrated=False)
        self.client: Client | None = None
        self.session: Session | None = None
        self.keeper: Keeper | None = None
        self.tree: ProcessTree | None = None
        self.env: dict[str, str] = dict(os.environ)
        self.cpus: list[int] = []
        self.owned_task: str | None = None
        self._want_lock = threading.Semaphore(0)
        self._stopping = threading.Event()
        self._told_fallback = False

    def use(self, backend: Backend | None) -> None:
        """Pause the program with ``backend``; None: it is never paused (whole GPUs, or no gpud)."""
        self.backend = backend
        self.core.arbitrated = backend is not None
        self.core.can_park = backend is not None and backend.can_park

    def gpu_free(self) -> int | None:
        """Free memory on the run's GPU by gpud's NVML reading, for the claim before a restore;
        None: unknown (simulated GPUs, no session)."""
        if self.client is None or self.session is None:
            return None
        status: p.StatusReply = self.client.call(p.Status(id=0))
        gpu = next((g for g in status.gpus if g.index == self.session.gpu), None)
        if gpu is None or gpu.memory_used_bytes is None:
            return None
        return gpu.memory_total_bytes - gpu.memory_used_bytes

    def tree_memory(self) -> int | None:
        """What the program's tree holds on the GPU, as gpud measures it (NVML per process); None:
        unknown."""
        if self.client is None or self.session is None:
            return None
        reply: p.ClientsReply = self.client.call(p.ListClients(id=0))
        mine = (s for c in reply.clients for s in c.sessions if s.session == self.session.id)
        return next((s.mem_used_bytes for s in mine), None)

    def say(self, text: str) -> None:
        print(f"{self.prog}: {text}", file=self.err, flush=True)

    # --- the run ---------------------------------------------------------------------

    def run(self, keeper: Keeper, client: Client | None, allocated: p.Allocated | None) -> int:
        """Carry the run through to its end; the program's exit status (or the run's own). The
        keeper holds the program before its exec; the run owns ``allocated`` and frees it."""
        self.keeper, self.tree, self.client = keeper, ProcessTree(keeper.pid), client
        if allocated is not None:
            self.owned_task = allocated.task_id
            self.env.update(allocation_env(allocated, client.path if client else None))
            self.cpus = list(allocated.cpus)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED} if self.forward_signals else {}
        try:
            if client is not None and self.backend is not None:
                self._open_session(client, allocated)
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
            on_drop=lambda reason: self.events.put(_Event("drop", reason)),
            on_lost=lambda error: self.events.put(_Event("lost", error)),
            on_park=(lambda: self.events.put(_Event("park"))) if self.core.can_park else None,
        )
        if allocated is None:  # as an allocation names it: NVML's index, which is PCI bus order
            self.env["CUDA_VISIBLE_DEVICES"] = str(self.session.gpu)
            self.env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            self.env["GPUD_SOCKET"] = client.path
        threading.Thread(target=self._lock_loop, name="gpud-run-lock", daemon=True).start()

    def _loop(self) -> int:
        pending = self.core.begin(time.monotonic())
        next_tick = time.monotonic() + TICK_S
        while True:
            status = self._carry_out(pending)
            if status is not None:
                return status
            now = time.monotonic()
            try:
                ev = self.events.get(timeout=max(0.0, next_tick - now))
            except queue.Empty:
                now = time.monotonic()
                pending = self.core.tick(now, self._activity())
                next_tick = self.core.next_tick(now, TICK_S)
                continue
            pending = self._handle(ev, time.monotonic())

    def _handle(self, ev: _Event, now: float) -> list[RunAction]:
        core = self.core
        self.trace.event(ev.kind, ev.t_ns, value=ev.value if ev.kind in ("signal", "exited") else None)
        match ev.kind:
            case "granted":
                return core.granted(now)
            case "drop":
                return core.dropped(now)
            case "lost":
                return core.lost(now)
            case "park":
                return core.park_asked()
            case "signal":
                return core.signalled(ev.value, now)
            case "exited":
                return core.exited(ev.value)
            case "grant_failed":
                return core.failed(f"gpud refused the program's session: {ev.value}")
        raise AssertionError(ev.kind)

    def _activity(self) -> float | None:
        if self.core.idle_release is None or self.tree is None:
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
                    self.say(f"could not resume the program yet: {exc}; giving the turn back")
                    more = self.core.resume_refused()
                else:
                    more = self.core.failed(f"{exc}; the program was ended so that it never runs unarbitrated")
                actions = []  # what followed assumed the action worked
            if isinstance(more, int):
                return more
            actions = [*more, *actions]
        return None

    def _do(self, action: RunAction) -> list[RunAction] | int:
        self.core.last_park_bytes = None
        result = self._act(action)
        if self.trace.out is not None and not isinstance(action, Request):
            self.trace.did(action, time.monotonic_ns(), self.core.last_park_bytes)
        return result

    def _act(self, action: RunAction) -> list[RunAction] | int:
        keeper, tree, backend, session = self.keeper, self.tree, self.backend, self.session
        assert keeper is not None and tree is not None
        match action:
            case Start():
                try:
                    keeper.go(self.env, self.cpus)
                except OSError as exc:
                    self.say(str(exc.strerror))
                    return exc.errno or 1
                # only now: before, the keeper's answer to go is not the program's end
                threading.Thread(target=self._watch_program, name="gpud-run-program", daemon=True).start()
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
                self.core.last_park_bytes = moved
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
        return []

    # --- threads that only feed the queue -------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.events.put(_Event("signal", signum))

    def _lock_loop(self) -> None:
        session = self.session
        assert session is not None
        while True:
            self._want_lock.acquire()
            if self._stopping.is_set():
                return
            try:
                session.acquire()
            except GpudError as exc:
                if self._stopping.is_set():
                    return
                self.events.put(_Event("grant_failed", exc))
                return
            self.events.put(_Event("granted"))

    def _watch_program(self) -> None:
        keeper = self.keeper
        assert keeper is not None
        try:
            select.select([keeper.fileno()], [], [])
            status = keeper.exit_code()
        except (OSError, ValueError):
            return  # the run closed the keeper: it is ending anyway
        self.events.put(_Event("exited", status))

    def _close(self) -> None:
        self._stopping.set()
        self._want_lock.release()
        if self.keeper is not None:
            self.keeper.close()  # ends whatever is left of the tree
        if self.backend is not None:
            self.backend.close()
        self.trace.close()
        if self.client is not None:
            if self.session is not None:
                try:
                    self.session.close()
                except GpudError:
                    pass
            if self.owned_task is not None:
                try:
                    self.client.release_allocation(self.owned_task)
                except GpudError as exc:
                    self.say(f"could not free the allocation of task {self.owned_task}: {exc}")
            self.client.close()


def connect(opts: RunOptions, labels: dict[str, str], say: Callable[[str], None]) -> Client | None:
    """A client for the run; None when gpud is missing and ``--on-missing run`` allows it."""
    try:
        return Client(
            opts.socket,
            name=opts.name,
            labels=labels,
            unavailable_timeout=FOREVER_S,  # a paused program waits for gpud's return
        )
    except DaemonUnavailable as exc:
        if opts.on_missing != "run":
            raise
        say(f"{exc}; running the program without gpud (--on-missing run): nothing arbitrates it")
        return None
