"""Request/answer bookkeeping of one client, without I/O.

Ids come from one counter for the client's whole life, never one per
connection: an answer can only ever match the request that was sent with its
id, so a request abandoned before a reconnect cannot swallow a later one's
answer. A request stays here until its caller collects the answer
(``finish``) or gives up (``abandon``); both happen under the driver's lock, as
does the answer's arrival, so "the answer came just as the caller gave up" is
one ordered case: a lease or a session that was granted to a caller who is no
longer there is given back at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from gpud_client import protocol as p
from gpud_client.core.actions import Action, Resolve, Send
from gpud_client.errors import DaemonUnavailable, GpudError, ProtocolError, error_from

if TYPE_CHECKING:
    from gpud_client.core.session import SessionState


@dataclass(slots=True)
class Request:
    msg: msgspec.Struct
    waiter: Any  # the driver's: an Event, a Future; None for the core's own (re-attach)
    session: SessionState | None = None  # an ATTACH's session
    answer: Any = None  # the daemon's message, or the GpudError it failed with; None: not yet


class Requests:
    def __init__(self, max_frame_bytes: int = p.MAX_FRAME_BYTES) -> None:
        self._codec = p.client_codec()
        self._ids = itertools.count(1)
        self.max_frame_bytes = max_frame_bytes
        self.pending: dict[int, Request] = {}
        # Given up on before their answer: a late grant is given back (lease) or detached (session).
        # Emptied when the connection is lost: what they would have held died with it.
        self.abandoned: dict[int, Request] = {}

    def encode(self, msg: msgspec.Struct) -> Send:
        """The message with a fresh id, encoded; refused here if the daemon would refuse its size."""
        msg = msgspec.structs.replace(msg, id=next(self._ids))
        data = self._codec.encode(msg)
        if len(data) - p.HEADER_BYTES > self.max_frame_bytes:
            raise ProtocolError(
                p.ErrorCode.FRAME_TOO_LARGE,
                f"the {type(msg).__name__} request is {len(data) - p.HEADER_BYTES} bytes, over gpud's limit of "
                f"{self.max_frame_bytes} bytes (max_frame_bytes); it was not sent",
            )
        return Send(msg, data)

    def start(self, msg: msgspec.Struct, waiter: Any, session: SessionState | None = None) -> Send:
        send = self.encode(msg)
        self.pending[send.msg.id] = Request(send.msg, waiter, session)  # type: ignore[attr-defined]
        return send

    def answer(self, rid: int, msg: Any) -> Request | None:
        """Record an answer; the request it answers, if its caller still waits for it."""
        req = self.pending.get(rid)
        if req is not None:
            req.answer = msg
        return req

    def late(self, rid: int) -> Request | None:
        """The request given up on that this answer is for, if any."""
        return self.abandoned.pop(rid, None)

    def finish(self, rid: int) -> Any:
        """The answer of ``rid`` for its caller; an Error or a failure is raised."""
        req = self.pending.pop(rid)
        answer = req.answer
        if isinstance(answer, GpudError):
            raise answer
        if isinstance(answer, p.Error):
            raise error_from(answer.code, answer.message)
        return answer

    def abandon(self, rid: int) -> Request | None:
        """The caller gave up (timeout, cancellation). The request if it was answered already: what it
        was given must be given back now. Unanswered, it is remembered for its late answer."""
        req = self.pending.pop(rid, None)
        if req is None:
            return None
        if req.answer is not None:
            return req
        if isinstance(req.msg, (p.Acquire, p.Attach)):
            self.abandoned[rid] = req
        return None

    def fail_all(self, error: GpudError) -> list[Action]:
        """Every request waiting for an answer fails with ``error``: the connection is gone."""
        actions: list[Action] = []
        for req in self.pending.values():
            if req.answer is None:
                req.answer = error
                if req.waiter is not None:
                    actions.append(Resolve(req.waiter))
        self.pending = {rid: req for rid, req in self.pending.items() if req.waiter is not None}
        self.abandoned.clear()
        return actions


def unavailable(path: str, why: str) -> DaemonUnavailable:
    return DaemonUnavailable(f"lost connection to gpud at {path}: {why}")
