"""A slice around a whole body that gpud may pause where it stands (sync client, main thread).

``with session.slice():`` around a body that runs for minutes cannot answer a
DROP_LOCK until the body ends: a session with a compute limit uses its budget,
is asked to yield, and is revoked after the daemon's ``drop_timeout_s``. A
``PausableSlice`` answers instead: when a DROP_LOCK comes for one of its
sessions, the body is paused at the main thread's next Python bytecode (the
hook thread asks with ``_thread.interrupt_main``, so no OS signal interrupts a
system call), the slice ends there (``synchronize``, LOCK_RELEASED), waits for
its next grant and goes on. The body keeps to its share as a loop of short
slices does, and nothing in it changes.

What it must never do: pause inside the client's own code (the client's lock
is held there: it looks again 5 ms later), or hold a signal that is not its
own: ``PAUSE_SIGNAL`` (SIGUSR2) is taken only while the body runs, a SIGUSR2
sent from outside meanwhile goes to the handler the program had (or ends the
program as the default does), and the program's handler is put back at the
end. Only the main thread can be paused so: elsewhere the slice is a plain one.
A body stuck in one C call longer than ``drop_timeout_s`` is still revoked
(``LockLost`` at the end), and a pause that finds the lock lost, or gpud gone,
raises that error in the body where it was paused, as the end of a slice would.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from gpud_client import protocol as p
from gpud_client.client import Session

PAUSE_SIGNAL = signal.SIGUSR2
RETRY_S = 0.005  # the main thread was inside the client: look again this much later

Handler = Callable[[int, FrameType | None], Any] | int | None


class Slices:
    """``with Slices(sessions):`` one slice of every session, entered in the given order (GPU order,
    so two multi-GPU tasks never wait on each other) and ended in reverse."""

    def __init__(self, sessions: Sequence[Session]) -> None:
        self.sessions = list(sessions)
        self.slices = [s.slice() for s in self.sessions]

    def __enter__(self) -> Slices:
        self._enter_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit_all()

    def _enter_all(self) -> None:
        entered = []
        try:
            for sl in self.slices:
                sl.__enter__()
                entered.append(sl)
        except BaseException:
            for sl in reversed(entered):
                sl.__exit__(None, None, None)
            raise

    def _exit_all(self) -> None:
        """Every slice ends, even when one raises; the first error is raised after."""
        error: BaseException | None = None
        for sl in reversed(self.slices):
            try:
                sl.__exit__(None, None, None)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error


class PausableSlice(Slices):
    """``with PausableSlice(sessions):`` the slices of ``Slices``, which gpud may pause between two
    bytecodes of the main thread."""

    def __init__(self, sessions: Sequence[Session]) -> None:
        super().__init__(sessions)
        self.pauses = 0  # how often the body was paused
        self._asked = threading.Event()  # a pause was asked for: the next PAUSE_SIGNAL is ours
        self._pausing = False
        self._active = False
        self._previous: Handler = None
        self._hooks: list[Callable[[p.DropReason], Any] | None] = []

    def __enter__(self) -> PausableSlice:
        self._enter_all()
        if threading.current_thread() is not threading.main_thread() or not self.sessions:
            return self  # a plain slice: a drop is answered at the end
        try:
            self._previous = signal.signal(PAUSE_SIGNAL, self._on_signal)
        except BaseException:
            self._exit_all()
            raise
        self._hooks = [s.on_drop for s in self.sessions]
        for s, hook in zip(self.sessions, self._hooks):
            s.on_drop = self._told(hook)
        self._active = True
        if any(s.drop_pending is not None for s in self.sessions):
            self._ask()  # a drop that came with the grant, before its hook was ours
        return self

    def __exit__(self, *exc: object) -> None:
        if self._active:
            self._active = False
            for s, hook in zip(self.sessions, self._hooks):
                s.on_drop = hook
            signal.signal(PAUSE_SIGNAL, self._previous)
        self._exit_all()

    # --- the pause ---------------------------------------------------------------

    def _told(self, hook: Callable[[p.DropReason], Any] | None) -> Callable[[p.DropReason], None]:
        def on_drop(reason: p.DropReason) -> None:  # on a hook thread of the client
            if hook is not None:
                hook(reason)
            self._ask()

        return on_drop

    def _ask(self) -> None:
        if self._active:
            self._asked.set()
            _thread.interrupt_main(PAUSE_SIGNAL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._asked.is_set():
            _pass_on(self._previous, signum, frame)  # not ours: sent from outside
            return
        self._asked.clear()
        if not self._active:
            return
        if self._pausing or any(s.client._lock._is_owned() for s in self.sessions):  # type: ignore[attr-defined]
            # Inside a pause (a handler runs between any two bytecodes, its own too) or inside the
            # client: never pause there, and never forget the request either.
            threading.Timer(RETRY_S, self._ask).start()
            return
        self._pausing = True
        try:
            while any(s.drop_pending is not None for s in self.sessions):  # none: answered meanwhile
                self.pauses += 1
                self._exit_all()  # gives back the locks asked for; keeps the rest
                self._enter_all()  # waits for the next grant, which a new drop may follow at once
        finally:
            self._pausing = False


def _pass_on(previous: Handler, signum: int, frame: FrameType | None) -> None:
    """A PAUSE_SIGNAL from outside gets what it would have got without us."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
