"""The sync client's machinery: a driver of the client core with a reader thread.

Threads: the reader decodes what arrives and hands it to the core under the
client's lock; the idle thread gives back locks unused for ``idle_release``.
User hooks (``on_drop``, ``synchronize``, ``on_lost``) never run on the reader
nor under the lock: a slice's own end runs them in its thread, a push's run in
a thread of their own, so a slow hook delays no push and a hook may call the
client. Allocation listeners are the exception: they run on the reader (never
under the lock), so each sees an allocation's pushes in the order they came; a
listener must be short (hand the push on, e.g. to a queue), and must not wait
for an answer of this client, which only the reader could read. A write that fails shuts the socket; the reader then sees the end and
tells the core. Nothing here decides anything: ``gpud_client.core`` does.
What does not differ from the asyncio driver is ``_base``'s.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Self, TypeVar

import msgspec

from gpud_client import protocol as p
from gpud_client._base import AllocationListener, ClientBase, hook_failed, reader_failure, waiting
from gpud_client.connection import Connection
from gpud_client.core import HOLD, SessionState, reconnect_delay
from gpud_client.core.actions import CallAllocationListeners, CallOnDrop, CallOnLost, CallOnPark, GiveBack, Hook, Send
from gpud_client.errors import DaemonUnavailable, GpudError, LockLost, ProtocolError
from gpud_client.frameworks import read_memory

log = logging.getLogger("gpud_client")
# The hooks a session of this client takes: plain callables, run in a thread (see above).
DropHook = Callable[[p.DropReason], None]
SynchronizeHook = Callable[[], None]
LostHook = Callable[[LockLost], None]
ParkHook = Callable[[], None]
S = TypeVar("S", bound="SyncSessionBase")


class _Slice(Generic[S]):
    """``Session.slice``'s context: a class, not a generator, because a slice's entry and exit run
    between every two kernels while the lock is held, and every microsecond there is billed GPU time."""

    __slots__ = ("session", "arbitrated")

    def __init__(self, session: S) -> None:
        self.session = session
        self.arbitrated = False

    def __enter__(self) -> S:
        s = self.session
        self.arbitrated = s.client._enter_slice(s)
        return s

    def __exit__(self, *exc: object) -> None:
        if self.arbitrated:
            s = self.session
            s.client._exit_slice(s)


class SyncSessionBase(SessionState):
    """What a sync ``Session`` gets from its driver: its slices."""

    client: SyncDriver

    def slice(self) -> _Slice[Self]:
        """One unit of GPU work under the lock: ``with session.slice(): ...``."""
        return _Slice(self)


class SyncDriver(ClientBase):
    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)  # ClientBase's keyword options
        # One lock for the core. The slice paths take it bare (a C-level context manager, no Python
        # frames: that time is billed while the lock is kept between slices).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # slices waiting for a lock
        self._idle_cond = threading.Condition(self._lock)  # the idle thread, woken only for it
        self._send_lock = threading.Lock()
        self._closing = threading.Event()
        self._conn: Connection | None = None
        # Replaced, never changed in place: the reader iterates over the tuple it read.
        self._listeners: tuple[AllocationListener, ...] = ()
        self._open()
        self._reader = threading.Thread(target=self._read_loop, name="gpud-client-reader", daemon=True)
        self._reader.start()
        self._idle = threading.Thread(target=self._idle_loop, name="gpud-client-idle", daemon=True)
        self._idle.start()

    def _start(self) -> None:
        """Nothing: the constructor connected already (``Client(...)`` connects at once)."""

    def _request(self, start: Callable[[threading.Event], Send], what: str, wait: float) -> Any:
        done = threading.Event()
        with self._lock:
            send = start(done)
            conn = self._conn  # the connection it belongs to: never written to a later one
        rid: int = send.msg.id  # type: ignore[attr-defined]
        answered = False
        try:
            self._write(send.data, conn)  # outside the lock: the reader goes on meanwhile
            answered = done.wait(wait)
        finally:
            if not answered:  # timed out or interrupted: what it is given anyway goes back
                with self._lock:
                    self._carry_out(self._core.abandon(rid))
        if not answered:
            raise DaemonUnavailable(f"gpud did not answer {what} within {wait} s")
        with self._lock:
            return self._core.finish(rid)

    def _close(self) -> None:
        with self._lock:
            if self._core.closed:
                return
            self._carry_out(self._core.close())
            conn, self._conn = self._conn, None
            self._idle_cond.notify_all()
        self._closing.set()
        if conn is not None:
            conn.close()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)

    # --- slices ---------------------------------------------------------------

    def _enter_slice(self, s: SessionState) -> bool:
        """Block until ``s`` holds the lock. False: proceeding unarbitrated."""
        with self._lock:
            if self._core.begin_slice(s):
                return True  # the lock is kept between slices: no round trip, no wait
            try:
                step = self._look(s, time.monotonic())
                while waiting(step):
                    self._cond.wait(step)
                    step = self._look(s, time.monotonic())
            except BaseException:
                self._carry_out(self._core.cancel_entry(s))
                raise
            return step == HOLD

    def _exit_slice(self, s: SessionState) -> None:
        used = None if s.memory_probe is None else read_memory(s.memory_probe)
        with self._lock:
            actions = self._core.end_slice(s, time.monotonic(), used)
            if not actions:
                return  # the common case: the lock is kept, nothing to send
            hooks = self._carry_out(actions)
        if hooks:
            self._run_hooks(hooks)

    def _release(self, s: SessionState) -> None:
        with self._lock:
            hooks = self._carry_out(self._core.release(s))
        self._run_hooks(hooks)

    def _detach(self, s: SessionState) -> None:
        with self._lock:
            sid = self._core.detach(s)
            self._cond.notify_all()
        if sid:
            try:
                self._request(
                    lambda done: self._core.start(p.Detach(id=0, session=sid), done), "DETACH", self.request_timeout
                )
            except GpudError:
                pass  # gone with the connection either way

    def _post(self, msg: msgspec.Struct) -> None:
        """Send a message whose answer nobody waits for (nothing while unconnected)."""
        with self._lock:
            self._carry_out(self._core.send(msg))

    def _parked(self, s: SessionState, ok: bool, message: str) -> None:
        with self._lock:
            self._carry_out(self._core.parked(s, ok, message))

    def _report_memory(self, s: SessionState, used_bytes: int) -> None:
        with self._lock:
            self._carry_out(self._core.report_memory(s, used_bytes))

    # --- carrying out the core's actions (``ClientBase._carry_out``, under the lock) ----------

    def _send(self, data: bytes) -> None:
        self._write(data, self._conn)

    def _resolve(self, waiter: threading.Event) -> None:
        waiter.set()

    def _wake(self) -> None:
        self._cond.notify_all()

    def _arm_idle(self, at: float) -> None:
        self._idle_cond.notify()  # the idle thread reads when it is due from the core

    def _run_hooks(self, hooks: list[Hook]) -> None:
        """Run user hooks in this thread, without the lock, then tell the core."""
        for h in hooks:
            match h:
                case CallOnDrop(session=s, reason=reason, grant=grant):
                    _call(s.on_drop, reason)
                    with self._lock:
                        more = self._carry_out(self._core.drop_told(s, grant))
                    self._run_hooks(more)
                case GiveBack(session=s, grant=grant):
                    _call(s.synchronize)
                    with self._lock:
                        self._carry_out(self._core.given_back(s, grant))
                case CallOnLost(session=s, error=error):
                    _call(s.on_lost, error)
                case CallOnPark(session=s):
                    _call(s.on_park)
                case CallAllocationListeners(push=push):
                    self._tell_listeners(push)

    def _spawn_hooks(self, hooks: list[Hook]) -> None:
        threading.Thread(target=self._run_hooks, args=(hooks,), daemon=True).start()

    def _listened(self, result: object, listener: AllocationListener) -> None:
        pass  # a plain call: nothing more to run

    def _add_listener(self, listener: AllocationListener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def _remove_listener(self, listener: AllocationListener) -> None:
        with self._lock:
            mine = list(self._listeners)
            if listener in mine:
                mine.remove(listener)
            self._listeners = tuple(mine)

    def _write(self, data: bytes, conn: Connection | None) -> None:
        if conn is None:
            return  # the core knows: nothing is sent while unconnected
        with self._send_lock:
            try:
                conn.send_raw(data)
            except OSError:
                conn.shutdown()  # the reader sees the end and tells the core

    # --- the connection and the reader and idle threads ---------------------------

    def _open(self) -> None:
        """Connect and say HELLO; raises GpudError."""
        conn = Connection(self.path, timeout=self.request_timeout)
        try:
            with self._lock:
                hello = self._core.hello(self.name, self.labels)
            conn.send(hello.msg)
            try:
                reply = conn.recv(self.request_timeout)
            except TimeoutError:
                raise DaemonUnavailable(f"gpud at {self.path} did not answer HELLO") from None
            with self._lock:
                actions = self._core.welcomed(reply)
                self._conn = conn
                self._carry_out(actions)
        except BaseException:
            conn.close()
            raise

    def _read_loop(self) -> None:
        while True:
            conn = self._conn
            if conn is not None:
                try:
                    while True:
                        msg = conn.recv()
                        with self._lock:
                            hooks = self._carry_out(self._core.receive(msg, time.monotonic()))
                        if hooks:
                            self._dispatch(hooks)
                except Exception as exc:  # its end, a refusal, or a bug in the reader: start afresh
                    self._lost(conn, reader_failure(exc))
            if not self._reconnect():
                return

    def _lost(self, conn: Connection, why: str) -> None:
        with self._lock:
            hooks: list[Hook] = []
            if self._conn is conn:
                self._conn = None
                hooks = self._carry_out(self._core.connection_lost(why))
        conn.close()
        if hooks:
            self._spawn_hooks(hooks)

    def _reconnect(self) -> bool:
        """Reconnect with jittered backoff; the core re-attaches the sessions. False: stop."""
        attempt = 0
        while not self._core.closed and self.reconnect:
            try:
                self._open()
                return True
            except GpudError as exc:  # a refusal is said out loud; an absence is expected
                (log.warning if isinstance(exc, ProtocolError) else log.debug)("reconnecting to gpud failed: %s", exc)
            self._closing.wait(reconnect_delay(attempt, random.random()))
            attempt += 1
        return False

    def _idle_loop(self) -> None:
        """Give back locks that no slice has used for ``idle_release`` s."""
        while True:
            with self._lock:
                if self._core.closed:
                    return
                hooks = self._carry_out(self._core.idle_sweep(time.monotonic()))
                if not hooks:
                    wake = self._core.idle_wake_at
                    self._idle_cond.wait(None if wake == float("inf") else max(0.0, wake - time.monotonic()))
                    continue
            self._run_hooks(hooks)


def _call(hook: Callable[..., Any] | None, *args: Any) -> None:
    if hook is None:
        return
    try:
        hook(*args)
    except Exception:
        hook_failed("hook", hook)
