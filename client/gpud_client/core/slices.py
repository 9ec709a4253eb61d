"""The slice rules of the client core: taking, keeping and giving back a session's lock. No I/O.

``ClientCore`` is built on these; they read the connection's state and send
through it. A slice claims the session before it waits (one slice at a time),
keeps the lock at its end unless a DROP_LOCK is pending, and a lock nobody
uses for ``idle_release`` is given back by the sweep. A slice's wait for gpud
is bounded by ``unavailable_timeout`` from the latest loss.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from gpud_client import protocol as p
from gpud_client.core.actions import WAKE, Action, ArmIdle, GiveBack, Level, Log
from gpud_client.core.requests import Requests
from gpud_client.core.session import MEM_REPORT_STEP, SessionState
from gpud_client.errors import DaemonUnavailable, GpudError

HOLD: Literal["hold"] = "hold"  # lock_step: the session holds the lock
UNARBITRATED: Literal["unarbitrated"] = "unarbitrated"  # lock_step: gpud is away; run without the lock
Step = float | None | Literal["hold", "unarbitrated"]  # else: wait this long (None: until woken)
NO_ACTIONS: list[Action] = []  # returned on hot paths; never appended to


class SliceRules:
    """The rules of a session's slices; the state they read is ``ClientCore``'s."""

    path: str
    unavailable_timeout: float
    proceed_unarbitrated: bool
    requests: Requests
    connected: bool
    closed: bool
    sessions: dict[int, SessionState]
    all: list[SessionState]
    lock_requests: dict[int, SessionState]
    idle_wake_at: float

    def send(self, msg: Any) -> list[Action]:
        """A message that is not waited for; nothing when not connected."""
        return [self.requests.encode(msg)] if self.connected else NO_ACTIONS

    def _hand_back(self, s: SessionState) -> list[Action]:
        """LOCK_RELEASED now, without synchronize."""
        s.state, s.drop_pending = "idle", None
        return [*self.send(p.LockReleased(id=0, session=s.id, grant=s.grant)), WAKE]

    # --- slices ---------------------------------------------------------------

    def begin_slice(self, s: SessionState) -> bool:
        """A slice (or acquire) starts. True: it holds the lock already (kept between slices)."""
        if s.closed:
            raise GpudError("this session is closed")
        if s.in_slice or s.entering:
            raise GpudError("slices of one session do not nest (an acquire() counts as one; one slice at a time)")
        if s.mem_error is not None:
            err, s.mem_error = s.mem_error, None
            raise err
        if s.state == "holding":
            s.in_slice = True
            return True
        s.entering, s.unavailable_since = True, None
        return False

    def lock_step(self, s: SessionState, now: float) -> tuple[Step, list[Action]]:
        """One look at a slice waiting for the lock: HOLD, UNARBITRATED, or how long to wait."""
        if s.error is not None:
            err, s.error, s.entering = s.error, None, False
            raise err
        if s.state == "holding":
            s.entering, s.in_slice = False, True
            return HOLD, NO_ACTIONS
        if self.closed or s.closed:
            s.entering = False
            raise GpudError("the client or session is closed")
        if self.connected and s.id == 0 and s.attach_error is not None:
            s.entering = False
            raise s.attach_error
        if not self.connected or s.id == 0:
            s.unavailable_since = now if s.unavailable_since is None else s.unavailable_since
            left = s.unavailable_since + self.unavailable_timeout - now
            if left > 0:
                return left, NO_ACTIONS
            s.entering = False
            if self.proceed_unarbitrated:
                return UNARBITRATED, [Log(Level.WARNING, "gpud unavailable: running a slice without the GPU lock")]
            raise DaemonUnavailable(f"gpud at {self.path} has been unreachable for {self.unavailable_timeout} s")
        s.unavailable_since = None  # the next loss gets the whole unavailable_timeout again
        if s.state != "idle":
            return None, NO_ACTIONS  # "waiting": our request (maybe a cancelled slice's) is still queued
        # Only a refusal answers a LOCK_REQUEST (an Error with its id); the grant comes as LOCK_OK.
        send = self.requests.encode(p.LockRequest(id=0, session=s.id))
        s.state, s.request_id = "waiting", send.msg.id  # type: ignore[attr-defined]
        self.lock_requests[s.request_id] = s
        return None, [send]

    def cancel_entry(self, s: SessionState) -> list[Action]:
        """The slice waiting for the lock gave up (cancelled, interrupted). A grant already here goes back
        now; a request still queued is answered when its grant comes."""
        if not s.entering:
            return NO_ACTIONS
        s.entering = False
        return self._hand_back(s) if s.state == "holding" and not s.in_slice else NO_ACTIONS

    def end_slice(self, s: SessionState, now: float, used: int | None = None) -> list[Action]:
        """A slice ended; ``used``: what the memory probe read. Raises LockLost if it lost the lock."""
        s.in_slice = False
        if s.lost is not None:
            err, s.lost = s.lost, None
            raise err
        if s.closed:
            return NO_ACTIONS
        actions: list[Action] = NO_ACTIONS
        if used is not None and (s.mem_reported is None or abs(used - s.mem_reported) >= MEM_REPORT_STEP):
            actions = self.report_memory(s, used)
        s.last_used = now
        if s.state == "holding" and s.drop_pending is not None:
            s.state = "releasing"
            return [*actions, GiveBack(s, s.grant)]
        if s.idle_release is not None and now + s.idle_release < self.idle_wake_at:
            self.idle_wake_at = now + s.idle_release  # the sweep looks then (and sets it anew)
            return [*actions, ArmIdle(self.idle_wake_at)]
        return actions

    def release(self, s: SessionState) -> list[Action]:
        """``release()``: end an acquire, or give back a lock kept between slices."""
        s.in_slice = False
        if s.lost is not None:
            err, s.lost = s.lost, None
            raise err
        if s.state != "holding":
            return NO_ACTIONS
        s.state = "releasing"
        return [GiveBack(s, s.grant)]

    def given_back(self, s: SessionState, grant: int) -> list[Action]:
        """``synchronize`` ran: LOCK_RELEASED, unless the lock went meanwhile (revoked, connection lost)."""
        if s.state != "releasing" or s.grant != grant:
            return NO_ACTIONS
        return self._hand_back(s)

    def report_memory(self, s: SessionState, used: int) -> list[Action]:
        if not self.connected or not s.id:
            return NO_ACTIONS  # reported again after the re-attach, at the next slice's end
        s.mem_reported = used
        return self.send(p.MemUpdate(id=0, session=s.id, used_bytes=used))

    def detach(self, s: SessionState) -> int:
        """The session closes; the daemon session id to DETACH (0: none)."""
        if s.closed:
            return 0
        s.closed = True
        sid, s.id = s.id, 0
        s.state, s.drop_pending, s.in_slice, s.entering = "idle", None, False, False
        self.sessions.pop(sid, None)
        if s in self.all:
            self.all.remove(s)
        return sid if self.connected else 0

    def idle_sweep(self, now: float) -> list[Action]:
        """Give back locks no slice has used for ``idle_release``; ``idle_wake_at``: when to look next.

        A lock in use by a slice cannot go idle before ``now + idle_release``, so the sweep looks again
        then: were it to wait for the slice's end to arm it, every slice's end would wake the driver's
        idle thread, whose turn at the interpreter lands between two kernels and is billed as GPU time."""
        actions: list[Action] = []
        wake = math.inf
        for s in self.sessions.values():
            if s.state != "holding" or s.idle_release is None:
                continue
            if s.in_slice or s.entering:  # never idle while in use
                wake = min(wake, now + s.idle_release)
                continue
            at = s.last_used + s.idle_release
            if at <= now:
                s.state = "releasing"
                actions.append(GiveBack(s, s.grant))
            else:
                wake = min(wake, at)
        self.idle_wake_at = wake
        return actions
