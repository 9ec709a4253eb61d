"""A victim for bench/preempt.py: a client process holding a best-effort allocation, told to leave.

It holds ``TASK`` (``--gpus``, priority best-effort, owner pid its own pid, on_preempt terminate)
through ``gpud_client.Client`` and listens with ``add_allocation_listener``. The listener only
stamps each push (``time.monotonic_ns()``, the clock of every process of the machine) and puts it on
a queue, as the client asks (it runs on the client's reader thread); the main thread acts on it:

- ``--mode free``: on PREEMPT, FREE at once (``release_allocation``);
- ``--mode yield``: on PREEMPT, YIELD at once (``yield_allocation``);
- ``--mode stay``: never answers; the grace ends and ALLOC_REVOKED says the allocation is gone.

It talks to the benchmark in JSON lines: it writes ``{"held": t, "gpus": [...]}`` once it holds its
allocation; each ``hold`` line on stdin makes it hold again (after a preemption: once the revocation
came, for ``stay``) and answer ``{"held", "gpus"}`` with what happened since the last answer:
``preempt_t``, ``grace_s``, ``whole``, ``left_t`` (FREE or YIELD answered), ``revoked_t``, ``gone``,
``withdrawn_t``. EOF on stdin ends it. Any failure is one ``{"error": ...}`` line and exit 1.

    python bench/preempt_victim.py SOCKET TASK [--gpus G] [--mode free|yield|stay]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from typing import Any

from gpud_client import Client, GpudError
from gpud_client import protocol as p

REVOKE_WAIT_S = 15.0  # a stay victim waits this long for the grace's end before it gives up
HOLD_WAIT_MS = 10_000  # room is there when the benchmark says hold: the production task was freed


def say(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


class Victim:
    def __init__(self, client: Client, task: str, gpus: float, mode: str) -> None:
        self.client, self.task, self.gpus, self.mode = client, task, gpus, mode
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.seen: dict[str, Any] = {}  # what happened since the last answer
        client.add_allocation_listener(self.listen)

    def listen(self, push: Any) -> None:
        self.inbox.put((time.monotonic_ns(), push))  # the reader thread: nothing more here

    def hold(self) -> None:
        if "preempt_t" in self.seen and self.mode == "stay":
            self.wait_for_revocation()
        got = self.client.allocate(
            self.task, self.gpus, priority="best-effort", owner_pid=os.getpid(), wait_ms=HOLD_WAIT_MS
        )
        say({"held": time.monotonic_ns(), "gpus": got.gpus, **self.seen})
        self.seen = {}

    def wait_for_revocation(self) -> None:
        deadline = time.monotonic() + REVOKE_WAIT_S
        while "revoked_t" not in self.seen:
            t, item = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            if isinstance(item, str):
                raise RuntimeError(f"{item!r} came before the revocation of {self.task}")
            self.on_push(t, item)

    def on_push(self, t: int, push: Any) -> None:
        match push:
            case p.Preempt(task_id=self.task):
                self.seen |= {"preempt_t": t, "grace_s": push.grace_s, "whole": push.whole}
                if self.mode == "free":
                    self.client.release_allocation(self.task)
                elif self.mode == "yield":
                    self.client.yield_allocation(self.task)
                if self.mode != "stay":
                    self.seen["left_t"] = time.monotonic_ns()
            case p.AllocRevoked(task_id=self.task):
                self.seen |= {"revoked_t": t, "gone": push.gone}
            case p.PreemptWithdrawn(task_id=self.task):
                self.seen["withdrawn_t"] = t

    def serve(self) -> None:
        threading.Thread(target=self.read_commands, name="victim-stdin", daemon=True).start()
        self.hold()
        while True:
            t, item = self.inbox.get()
            if item == "quit":
                return
            if item == "hold":
                self.hold()
            elif not isinstance(item, str):
                self.on_push(t, item)

    def read_commands(self) -> None:
        for line in sys.stdin:
            self.inbox.put((time.monotonic_ns(), line.strip()))
        self.inbox.put((time.monotonic_ns(), "quit"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("socket")
    ap.add_argument("task")
    ap.add_argument("--gpus", type=float, default=0.5)
    ap.add_argument("--mode", choices=("free", "yield", "stay"), default="free")
    args = ap.parse_args()
    try:
        with Client(args.socket, name=f"victim-{args.task}") as client:
            Victim(client, args.task, args.gpus, args.mode).serve()
    except (GpudError, RuntimeError, queue.Empty) as exc:
        say({"error": f"victim {args.task}: {type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
