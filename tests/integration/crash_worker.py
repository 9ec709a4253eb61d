"""A client process for test_crash_restart: locks, leases and allocations in a loop, and what it believed.

``python crash_worker.py SOCKET OUT_FILE NAME SEED``. One sync ``Client`` (reconnect on, default
settings) shared by four threads: a lock cycle loop on each GPU (``session.acquire()`` … ``release()``),
a lease loop and an allocation loop. SIGTERM ends the loops; the allocation loop then frees everything it
may still hold, and the last line is ``done``.

Every line of OUT_FILE is ``<time.monotonic()> <event> …``, appended and flushed at once, so the test
reads it while the worker runs and after it is killed. CLOCK_MONOTONIC is the machine's, shared by all
processes, so the lines of all workers and the test's kill times are on one time line.

A belief interval is never shorter than the belief it records, so a check of mutual exclusion on them is
sound: it starts after ``acquire()`` returned (the process acts only after that) and ends just before
``release()`` is called, or at the first poll (every ~1 ms) that saw the session stop holding because the
connection died. A lease is held at most 15 ms, far less than a restart takes, so its interval simply
ends just before ``release_lease``. The worker never decides what is a failure beyond recording it: refusals are recorded
with their type and code, anything unexpected as ``error`` and any call slower than its deadline as ``slow``.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Literal, TextIO

from gpud_client import Client, DaemonUnavailable, ErrorCode, GpudError, LockLost, ProtocolError
from gpud_client.client import Session

HOLD_S = (0.002, 0.04)  # lock holds; some outlast the test's 50 ms TQ, so DROP_LOCKs come while held
# Some holds outlast a restart (~1 s), so a kill often finds a holder that must learn it lost the lock
# before the new daemon grants it to anyone: with short holds only, the hold would end first anyway.
LONG_HOLD_S = (0.3, 2.5)
LONG_HOLD_P = 0.06
LEASE_HOLD_S = (0.002, 0.015)
LEASE_MAX_WAIT_MS = (0, 100, 300)
ALLOC_GPUS = (0.25, 0.25, 0.25, 0.5)
ALLOC_WAIT_MS = (0, 0, 300, 1000, 2000)  # some requests wait, so waits are pending when the daemon dies
ALLOC_HELD_MAX = 3  # 4 workers x 3 x 0.25 > 2 GPUs: allocations are refused and wait
SLOW_S = 8.0  # beyond this past its own wait, a call hangs: the daemon is down ~1-3 s per kill
LOCK_SLOW_S = 20.0  # a lock request also queues behind the other workers' holds, long ones included
POLL_S = 0.001
STOP_JOIN_S = 10.0


class Recorder:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            self.out.write(f"{time.monotonic():.6f} {line}\n")
            self.out.flush()


def refusal(exc: GpudError) -> str:
    """How a refused call is recorded: the type, the code, the message on one line."""
    code = exc.code if isinstance(exc, ProtocolError) else "-"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__} {code} {text}"


class Worker:
    def __init__(self, client: Client, record: Recorder, name: str, seed: int) -> None:
        self.client = client
        self.record = record
        self.name = name
        self.seed = seed
        self.stop = threading.Event()

    def rng(self, role: str) -> random.Random:
        return random.Random(f"{self.seed}-{self.name}-{role}")

    def guarded(self, role: str, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except BaseException:  # recorded for the test, which fails on it
                self.record(f"error {role} " + repr(traceback.format_exc()))
            finally:
                self.record(f"ended {role}")

        return run

    def slow(self, role: str, op: str, took: float, allowed: float) -> None:
        if took > allowed:
            self.record(f"slow {role} {op} {took:.3f}")

    # --- locks ---------------------------------------------------------------

    def lock_loop(self, session: Session) -> None:
        gpu = session.gpu
        role = f"lock{gpu}"
        rng = self.rng(role)
        while not self.stop.is_set():
            asked = time.monotonic()
            try:
                session.acquire()  # waits out a reconnect (unavailable_timeout) by itself
            except GpudError as exc:
                self.record(f"error {role} acquire {refusal(exc)}")
                self.stop.wait(0.05)
                continue
            t0 = time.monotonic()
            self.slow(role, "acquire", t0 - asked, LOCK_SLOW_S)
            hold_until = t0 + rng.uniform(*(LONG_HOLD_S if rng.random() < LONG_HOLD_P else HOLD_S))
            while True:
                if session.state != "holding":
                    t1, end = time.monotonic(), "lost"
                    break
                now = time.monotonic()
                if now >= hold_until:
                    t1, end = now, "released"
                    break
                time.sleep(POLL_S)
            try:
                session.release()
            except LockLost:  # the loss the poll saw: release() says so and ends the open slice
                end = "lost"
            self.record(f"lock {gpu} {t0:.6f} {t1:.6f} {end}")
            self.stop.wait(rng.uniform(0, 0.02))

    # --- leases --------------------------------------------------------------

    def lease_loop(self) -> None:
        rng = self.rng("lease")
        while not self.stop.is_set():
            gpu = rng.choice((0, 1))
            max_wait_ms = rng.choice(LEASE_MAX_WAIT_MS)
            asked = time.monotonic()
            try:
                r = self.client.acquire(gpu, "OTHER", max_wait_ms=max_wait_ms, busy_policy="WAIT")
            except GpudError as exc:
                self.record(f"lease_refused {gpu} {refusal(exc)}")
                self.stop.wait(0.05)
                continue
            t0 = time.monotonic()
            self.slow("lease", "acquire", t0 - asked, max_wait_ms / 1000 + SLOW_S)
            if not r.acquired or r.lease_id is None:
                self.record(f"lease_result {gpu} {r.status} {r.reason}")
                self.stop.wait(rng.uniform(0, 0.02))
                continue
            time.sleep(rng.uniform(*LEASE_HOLD_S))
            t1 = time.monotonic()
            self.record(f"lease {gpu} {t0:.6f} {t1:.6f} {r.lease_id}")
            try:
                self.client.release_lease(r.lease_id)
            except GpudError as exc:  # the lease died with the connection
                self.record(f"lease_release_refused {gpu} {refusal(exc)}")
            self.stop.wait(rng.uniform(0, 0.02))

    # --- allocations ---------------------------------------------------------

    def alloc_loop(self) -> None:
        rng = self.rng("alloc")
        held: list[str] = []  # acknowledged, no free tried
        unsure: dict[str, bool] = {}  # to free; True: surely allocated (acked, no free attempt answered)
        n = 0
        while not self.stop.is_set():
            for task, sure in list(unsure.items()):
                if self.free(task, sure):
                    del unsure[task]
            if unsure:  # the daemon is away: no new requests until it is back
                self.stop.wait(0.05)
                continue
            if held and (len(held) >= ALLOC_HELD_MAX or rng.random() < 0.4):
                task = held.pop(rng.randrange(len(held)))
                if not self.free(task, True):
                    unsure[task] = False  # the free may have committed: unknown_task is fine now
            else:
                n += 1
                task = f"{self.name}-t{n}"
                outcome = self.allocate(task, rng.choice(ALLOC_GPUS), rng.choice(ALLOC_WAIT_MS))
                if outcome == "acked":
                    held.append(task)
                elif outcome == "uncertain":  # it may have committed before the daemon died
                    unsure[task] = False
            self.stop.wait(rng.uniform(0.005, 0.04))
        # stopping: give everything back, waiting out a restart if one is under way
        unsure.update((task, True) for task in held)
        deadline = time.monotonic() + 8
        while unsure and time.monotonic() < deadline:
            for task, sure in list(unsure.items()):
                if self.free(task, sure):
                    del unsure[task]
            if unsure:
                time.sleep(0.05)
        if unsure:
            self.record(f"error alloc not freed at stop: {sorted(unsure)}")

    def allocate(self, task: str, gpus: float, wait_ms: int) -> Literal["acked", "refused", "uncertain"]:
        """A refusal with no answer (the daemon died, or was not there) leaves it uncertain."""
        self.record(f"allocating {task} {gpus} {wait_ms}")
        asked = time.monotonic()
        try:
            a = self.client.allocate(task, gpus=gpus, wait_ms=wait_ms, owner_pid=None)
        except DaemonUnavailable as exc:
            self.record(f"uncertain {task} {refusal(exc)}")
            return "uncertain"
        except ProtocolError as exc:
            self.record(f"refused {task} {refusal(exc)}")
            return "refused"
        finally:
            self.slow("alloc", f"allocate:{task}", time.monotonic() - asked, wait_ms / 1000 + SLOW_S)
        self.record(f"acked {task} {a.task_id} {','.join(map(str, a.gpus))} {a.share}")
        return "acked"

    def free(self, task: str, sure: bool) -> bool:
        """True: the task is surely gone. False: the daemon went away; try again later."""
        self.record(f"freeing {task}")
        asked = time.monotonic()
        try:
            self.client.release_allocation(task)
        except DaemonUnavailable as exc:
            self.record(f"free_refused {task} {refusal(exc)}")
            return False
        except ProtocolError as exc:
            if exc.code != ErrorCode.UNKNOWN_TASK:
                self.record(f"free_refused {task} {refusal(exc)}")
                return False
            if sure:  # acknowledged and never freed, yet the daemon does not know it
                self.record(f"error alloc lost_allocation {task} {refusal(exc)}")
            self.record(f"freed {task} unknown")
            return True
        finally:
            self.slow("alloc", f"free:{task}", time.monotonic() - asked, SLOW_S)
        self.record(f"freed {task}")
        return True

    # --- reconnects ------------------------------------------------------------

    def watch_reconnects(self, sessions: list[Session]) -> None:
        seen = 0
        while not self.stop.wait(0.005):
            n = self.client.reconnects
            if n != seen:
                seen = n
                ids = " ".join(f"{s.gpu}:{s.id}" for s in sessions)  # bound before reconnects moved
                self.record(f"reconnected {n} {ids}")


def main() -> None:
    socket_path, out_path, name, seed = sys.argv[1:5]
    with open(out_path, "a", encoding="utf-8") as out:
        record = Recorder(out)
        client = Client(socket_path, name=name)
        worker = Worker(client, record, name, int(seed))
        signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
        sessions = [client.session(gpu) for gpu in (0, 1)]
        loops: dict[str, Callable[[], None]] = {
            "lock0": lambda: worker.lock_loop(sessions[0]),
            "lock1": lambda: worker.lock_loop(sessions[1]),
            "lease": worker.lease_loop,
            "alloc": worker.alloc_loop,
            "watch": lambda: worker.watch_reconnects(sessions),
        }
        threads = {
            role: threading.Thread(target=worker.guarded(role, loop), name=role, daemon=True)
            for role, loop in loops.items()
        }
        record(f"ready {' '.join(f'{s.gpu}:{s.id}' for s in sessions)}")
        for t in threads.values():
            t.start()
        while not worker.stop.wait(0.1):  # a timed wait, so the SIGTERM handler runs promptly
            pass
        record("stopping")
        deadline = time.monotonic() + STOP_JOIN_S
        for role, t in threads.items():
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                record(f"hung {role}")
        client.close()
        record("done")


if __name__ == "__main__":
    main()
