"""One daemon per state directory: ``gpud.lock`` in it, held with flock(2).

The lock is held for the daemon's whole life and released by the kernel when
the process ends, however it ends, so a crashed daemon never blocks its
successor. The file holds the running daemon's pid while it runs and is
emptied at a clean exit: a start that finds a pid in it follows a crash (or a
SIGKILL), which is when the restart grace applies.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass

LOCK_NAME = "gpud.lock"


@dataclass
class StateLock:
    path: str
    fd: int
    crashed_pid: int | None  # the pid a previous daemon left behind: it did not exit cleanly

    def release(self, *, clean: bool) -> None:
        """At exit. ``clean``: every write is done, so the next start needs no grace."""
        try:
            if clean:
                os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)


def acquire(state_dir: str) -> StateLock:
    """Take the state directory, or raise RuntimeError naming the daemon that has it."""
    try:
        os.makedirs(state_dir, mode=0o750, exist_ok=True)
        path = os.path.join(state_dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    except OSError as exc:
        raise RuntimeError(
            f"cannot use the state directory {state_dir}: {exc.strerror or exc} "
            f"(it must be writable by uid {os.getuid()}; or set state_dir)"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        who = f"gpud pid {holder}" if holder else "another gpud"
        raise RuntimeError(
            f"{who} is already running with the state directory {state_dir}; stop it first, "
            f"or give this one another state_dir (and socket)"
        ) from None
    crashed = _read_pid(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateLock(path, fd, crashed)


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None
