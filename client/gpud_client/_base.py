"""What the two clients' drivers share: their state read from the core, and what they do alike with
a thread or a task: carry out the core's actions, take one look for a slice waiting for its lock,
hand a push to the allocation listeners, say why a reader lost its connection or a hook failed.

A driver supplies the few things that do differ (``_send``, ``_resolve``, ``_wake``, ``_arm_idle``,
``_spawn_hooks``, ``_listened``). This module must never block or wait, and runs no session hook:
a hook is returned to the driver, which runs it off the reader and outside its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from gpud_client import protocol as p
from gpud_client.core import HOLD, UNARBITRATED, ClientCore, SessionState
from gpud_client.core.actions import (
    Action,
    AllocationPush,
    ApplyMemoryLimit,
    ArmIdle,
    CallAllocationListeners,
    CallOnDrop,
    CallOnLost,
    CallOnPark,
    GiveBack,
    Hook,
    Log,
    Resolve,
    Send,
    Wake,
)
from gpud_client.core.slices import Step
from gpud_client.errors import GpudError
from gpud_client.frameworks import cap_memory

log = logging.getLogger("gpud_client")
AllocationListener = Callable[[AllocationPush], Any]
MemoryProbe = Callable[[], int]  # a session's GPU memory in use, in bytes


class ClientBase:
    _listeners: Sequence[AllocationListener]  # each driver keeps them its own way (a thread may add one)

    def __init__(
        self,
        path: str,
        *,
        name: str,
        labels: dict[str, str] | None,
        reconnect: bool,
        unavailable_timeout: float,
        proceed_unarbitrated: bool,
        request_timeout: float,
    ) -> None:
        self.path = path
        self.name = name
        self.labels = dict(labels or {})
        self.reconnect = reconnect
        self.request_timeout = request_timeout
        self._core = ClientCore(
            path, unavailable_timeout=unavailable_timeout, proceed_unarbitrated=proceed_unarbitrated
        )

    @property
    def welcome(self) -> p.Welcome:
        """The daemon's answer to HELLO on the current (or last) connection."""
        if self._core.welcome is None:
            raise AttributeError("this client never connected")
        return self._core.welcome

    @property
    def client_id(self) -> int:
        return self.welcome.client_id

    @property
    def scheduler_on(self) -> dict[int, bool]:
        return self._core.scheduler_on

    @property
    def reconnects(self) -> int:
        return self._core.reconnects

    @property
    def revoked_leases(self) -> set[str]:
        """Leases the daemon released by force (hold_max with forced release on)."""
        return self._core.revoked_leases

    @property
    def unavailable_timeout(self) -> float:
        return self._core.unavailable_timeout

    @property
    def proceed_unarbitrated(self) -> bool:
        return self._core.proceed_unarbitrated

    # --- what each driver does its own way --------------------------------------

    def _send(self, data: bytes) -> None:
        """Write to the current connection, if any; a write that fails ends it (the reader tells the core)."""
        raise NotImplementedError

    def _resolve(self, waiter: Any) -> None:
        """Wake the caller waiting on ``waiter`` for its answer."""
        raise NotImplementedError

    def _wake(self) -> None:
        """Wake the slices waiting for a lock; each looks again."""
        raise NotImplementedError

    def _arm_idle(self, at: float) -> None:
        """Have the idle sweep run by ``at`` (the driver's clock)."""
        raise NotImplementedError

    def _spawn_hooks(self, hooks: list[Hook]) -> None:
        """Run the sessions' hooks off the reader: in a thread, or a task, of their own."""
        raise NotImplementedError

    def _listened(self, result: object, listener: AllocationListener) -> None:
        """What an allocation listener returned: the asyncio driver runs an awaitable to its end."""
        raise NotImplementedError

    # --- carrying out the core's actions --------------------------------------

    def _carry_out(self, actions: list[Action]) -> list[Hook]:
        """Sends, wake-ups and logs now (under the sync driver's lock); the hooks are returned, to be run
        outside it."""
        hooks: list[Hook] = []
        for a in actions:
            match a:
                case Send(data=data):
                    self._send(data)
                case Resolve(waiter=waiter):
                    self._resolve(waiter)
                case Wake():
                    self._wake()
                case ArmIdle(at=at):
                    self._arm_idle(at)
                case ApplyMemoryLimit(session=s, limit=limit):
                    (s.memory_cap or cap_memory)(limit)
                case Log(level=level, text=text):
                    log.log(level, text)
                case CallOnDrop() | GiveBack() | CallOnLost() | CallOnPark() | CallAllocationListeners():
                    hooks.append(a)
        return hooks

    def _look(self, s: SessionState, now: float) -> Step:
        """One look of a slice at its lock, its actions carried out: HOLD, UNARBITRATED, or how long to
        wait (see ``waiting``)."""
        step, actions = self._core.lock_step(s, now)
        self._carry_out(actions)
        return step

    def _dispatch(self, hooks: list[Hook]) -> None:
        """On the reader: allocation pushes go to the listeners here, in the order they came; the
        sessions' hooks run off the reader."""
        rest: list[Hook] = []
        for h in hooks:
            if isinstance(h, CallAllocationListeners):
                self._tell_listeners(h.push)
            else:
                rest.append(h)
        if rest:
            self._spawn_hooks(rest)

    def _tell_listeners(self, push: AllocationPush) -> None:
        """Hand ``push`` to every allocation listener in turn, here; one that raises is logged."""
        for listener in tuple(self._listeners):
            try:
                result = listener(push)
            except Exception:
                hook_failed("allocation listener", listener)
            else:
                self._listened(result, listener)


def waiting(step: Step) -> TypeGuard[float | None]:
    """A look says the slice waits, this long (None: until woken); else it holds the lock or runs
    unarbitrated."""
    return step != HOLD and step != UNARBITRATED


def reader_failure(exc: Exception) -> str:
    """Why a reader lost its connection: the stream's end or a refusal, said as it is, or a bug in the
    reader, logged with its traceback (the reader starts afresh: a bug must not leave the client deaf)."""
    if isinstance(exc, GpudError):
        return str(exc)
    log.error("gpud client reader failed", exc_info=exc)
    return f"client reader failed: {exc!r}"


def hook_failed(what: str, hook: object) -> None:
    """A user hook raised: logged with its traceback (call from its ``except``), never raised further."""
    log.exception("gpud client %s %s failed", what, getattr(hook, "__qualname__", hook))
