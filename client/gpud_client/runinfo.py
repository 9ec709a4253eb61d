"""How a run (``gpuctl run``) describes itself to gpud, and how tools show it.

A run says HELLO with these labels; ``gpuctl clients`` and ``gpuctl top`` read
them back to show a run as a run: its program's pid, command and backend, and
its state as the run says it (``run.state``, sent again at each change: a
suspended run, one that checkpoints or waits to restart, is not "running"
for lack of a session); from a run that does not say it, the state is
guessed from its session. Tiny on purpose: gpuctl imports it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from gpud_client import protocol as p
from gpud_client.units import printable

COMMAND, PID, BACKEND, STATE = "run.command", "run.pid", "run.backend", "run.state"


def run_labels(command: list[str], program_pid: int, backend: str) -> dict[str, str]:
    line = printable(shlex.join(command))
    return {
        COMMAND: line if len(line) <= 128 else line[:125] + "...",
        PID: str(program_pid),
        BACKEND: backend,
    }


@dataclass(frozen=True, slots=True)
class RunInfo:
    program_pid: str
    command: str
    backend: str
    state: str  # RunShown: starting, running, paused, parked, suspended, waiting-to-restart...


def run_info(client: p.ClientInfo, session: p.SessionInfo | None) -> RunInfo | None:
    """The run behind a client, or None when the client is not a run."""
    labels = client.labels
    if PID not in labels:
        return None
    if STATE in labels:  # the run's own word (``RunCore.shown``): suspended, waiting to restart...
        state = labels[STATE]
    elif session is None:
        state = "running"  # whole GPUs: never paused, no session
    elif session.state == "holding":
        state = "running"
    elif session.parked:
        state = "parked"
    elif session.grants == 0:
        state = "starting"
    else:
        state = "paused"
    return RunInfo(labels[PID], labels.get(COMMAND, "?"), labels.get(BACKEND, "?"), state)
