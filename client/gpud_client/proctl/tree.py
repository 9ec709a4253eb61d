"""A process tree as /proc shows it: the descendants of one root process.

The root is the run's keeper (``keeper.py``), a child subreaper: every process
the program starts, and every orphan among them, stays below it. The tree is
found again at each look, so processes started since the last one are in it.
``/proc/PID/task/TID/children`` is used where the kernel has it; elsewhere one
scan of ``/proc/*/stat``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Stat:
    pid: int
    ppid: int
    state: str  # R, S, D, T (stopped), t (traced), Z (zombie), X, I ...
    cpu_ticks: int  # utime + stime


def read_stat(pid: int) -> Stat | None:
    """The process's /proc/PID/stat, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name is in parentheses and may itself hold spaces or parentheses
    rest = data[data.rfind(b")") + 2 :].split()
    return Stat(pid, int(rest[1]), rest[0].decode(), int(rest[11]) + int(rest[12]))


def _children_files_work() -> bool:
    return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


class ProcessTree:
    """The descendants of ``root`` (the root itself is not part of the tree)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self._children_files = _children_files_work()

    def pids(self) -> list[int]:
        """Every live descendant of the root, parents before their children."""
        if self._children_files:
            return self._walk()
        return self._scan()

    def stats(self) -> list[Stat]:
        return [s for s in (read_stat(pid) for pid in self.pids()) if s is not None]

    def cpu_seconds(self) -> float:
        """The CPU time the tree's live processes have used (user and system)."""
        return sum(s.cpu_ticks for s in self.stats()) / CLK_TCK

    def _walk(self) -> list[int]:
        found: list[int] = []
        todo = [self.root]
        while todo:
            pid = todo.pop()
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except (FileNotFoundError, ProcessLookupError):
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        kids = [int(k) for k in f.read().split()]
                except (FileNotFoundError, ProcessLookupError):
                    continue
                found.extend(kids)
                todo.extend(kids)
        return found

    def _scan(self) -> list[int]:
        parents: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            st = read_stat(int(name))
            if st is not None:
                parents.setdefault(st.ppid, []).append(st.pid)
        found: list[int] = []
        todo = [self.root]
        while todo:
            kids = parents.get(todo.pop(), [])
            found.extend(kids)
            todo.extend(kids)
        return found
