"""One daemon per state directory: ``gpud.lock`` in it, held with flock(2).

The lock is held for the daemon's whole life and released by the kernel when
the process ends, however it ends, so a crashed daemon never blocks its
successor. The file's one line names the daemon that holds it and what it
knows of a crash, so that the next start can tell whether one happened:

- ``PID starting``: a start that has not served yet. Had it died, no client
  was ever granted anything by it, so it is no crash. A failed start (a bad
  option, a port taken, a store gpud cannot use) leaves this behind.
- ``PID starting after_crash=OLD``: the same, started after daemon OLD
  crashed while serving; the mark is carried until a start serves.
- ``PID serving``: from just before the first connection is accepted; a
  start that finds it follows a crash (or a SIGKILL), which is when the
  restart grace applies. A bare ``PID`` (an older gpud's) reads the same.
- empty: the last daemon stopped cleanly.

Each change is one write of the whole line, padded to a fixed size, so a
daemon killed at any moment leaves one of these lines and never half of two.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass

LOCK_NAME = "gpud.lock"
_LINE_BYTES = 64  # every line is padded to this, so a write replaces the whole of the last one
_AFTER_CRASH = "after_crash="


@dataclass
class StateLock:
    path: str
    fd: int
    crashed_pid: int | None  # the pid of a daemon that crashed while serving, not stopped cleanly since

    def mark_serving(self) -> None:
        """From now on a death of this daemon is a crash: clients may hold what it granted. It
        answers for an earlier crash too (its restart grace is running), so that mark goes."""
        _write(self.path, self.fd, f"{os.getpid()} serving")

    def release(self, *, clean: bool) -> None:
        """At exit. ``clean``: every write is done, so the next start needs no grace. Otherwise the
        line stays as it is: ``serving`` (a crash), or a start's (no crash of its own)."""
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
        holder = _read(fd)[:1]
        os.close(fd)
        who = f"gpud pid {holder[0]}" if holder and holder[0].isdigit() else "another gpud"
        raise RuntimeError(
            f"{who} is already running with the state directory {state_dir}; stop it first, "
            f"or give this one another state_dir (and socket)"
        ) from None
    crashed = _crashed_pid(_read(fd))
    try:
        _write(path, fd, f"{os.getpid()} starting" + (f" {_AFTER_CRASH}{crashed}" if crashed is not None else ""))
    except RuntimeError:
        os.close(fd)
        raise
    return StateLock(path, fd, crashed)


def _crashed_pid(words: list[str]) -> int | None:
    """The daemon that crashed while serving, by the words of the line a previous daemon left."""
    if not words or not words[0].isdigit():
        return None
    if len(words) == 1 or words[1] == "serving":
        return int(words[0])
    carried = [w.removeprefix(_AFTER_CRASH) for w in words[2:] if w.startswith(_AFTER_CRASH)]
    return int(carried[0]) if carried and carried[0].isdigit() else None


def _read(fd: int) -> list[str]:
    """The words of the file's first line: the one gpud writes."""
    return os.pread(fd, 256, 0).decode(errors="replace").split("\n", 1)[0].split()


def _write(path: str, fd: int, line: str) -> None:
    try:
        os.pwrite(fd, (line.ljust(_LINE_BYTES - 1) + "\n").encode(), 0)
        os.ftruncate(fd, _LINE_BYTES)  # whatever else a longer file held after it
    except OSError as exc:
        raise RuntimeError(f"cannot write {path}: {exc.strerror or exc}") from None
