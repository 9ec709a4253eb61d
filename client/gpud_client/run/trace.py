"""``--trace FILE``: what a run did and when, one JSON line each, for operators and benchmarks.

Lines are stamped with ``time.monotonic_ns()`` (one clock for every process of the machine). An
event is written at once; the actions one event led to are written together once they are done
(``flush``), so no file write falls between a pause and its LOCK_RELEASED.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gpud_client.core.run import Park, Request, RunAction, UseAllocation


class Trace:
    """``--trace FILE``: one JSON line per event and per action carried out.

    Events are ``{"t", "event", ...}``: granted, drop, lost, park (gpud's PARK), signal, exited,
    grant_failed; and of the allocation: preempt (reason, recovery, gpus, whole, grace_s, by),
    withdrawn, revoked (reason, state, gone), changed (change, gpus), reallocated (gpus, resume),
    reallocation_failed. Actions are ``{"t", "action", ...}`` with their fields: start, pause (why),
    resume, release, parked (ok, bytes), answerpark (ok, message), forward (signal), endprogram (why),
    exit (status, why), yield, allocate, useallocation (gpus, resume), say (text)."""

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
        are (``flush``)."""
        if isinstance(action, Request):
            return
        if isinstance(action, Park):  # the action is "parked", so that it differs from the PARK event
            record = {"t": t_ns, "action": "parked", "ok": moved is not None, "bytes": moved}
        elif isinstance(action, UseAllocation):
            record = {"t": t_ns, "action": "useallocation", "gpus": action.allocation.gpus, "resume": action.resume}
        else:
            fields = {k: getattr(action, k) for k in action.__dataclass_fields__}
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
