"""The cgroups gpud makes for runs' programs (``gpuctl run``), on the kernel's cgroup v2.

Where the v2 hierarchy is comes from /proc/self/mountinfo (at /sys/fs/cgroup, or in a hybrid
layout under it, e.g. /sys/fs/cgroup/unified), and the daemon's own cgroup from /proc/self/cgroup
(``0::/path``). The base is ``gpud-runs`` below the daemon's own cgroup (or a configured one); each
run's program gets ``run-KEY-PID-START`` in it: KEY tells this daemon's cgroups (its state
directory's) from another's on one host, and PID with its start time names the program for good.
Created and written by the daemon alone, so the program's user cannot write them; the kernel keeps
a process and its children, setsid'd and double-forked ones included, in its cgroup. A frozen
cgroup (``cgroup.freeze``) runs no code of its processes whatever signal they get (SIGCONT
included), and ``cgroup.kill`` ends every process in it at once.

The parsing is pure (``cgroup2_mount``, ``own_cgroup`` and ``directory``, shared with gpud-k8s in
``gpud_client.proctl.hierarchy``; ``events``, ``run_name``); the rest are
plain file operations that raise OSError. Nothing here decides whose program is moved, frozen or
killed (``gpud.capabilities.runs`` does, after ``gpud.core.owners`` has judged the pid), and it never
touches a cgroup outside its base.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import signal
from dataclasses import dataclass

from gpud_client.proctl.hierarchy import MOUNTINFO as MOUNTINFO
from gpud_client.proctl.hierarchy import cgroup2_mount as cgroup2_mount
from gpud_client.proctl.hierarchy import directory as directory
from gpud_client.proctl.hierarchy import own_cgroup as own_cgroup
from gpud_client.proctl.tree import ProcessTree, read_stat
from gpud_client.protocol import KernelState

OWN_CGROUP = "/proc/self/cgroup"
BASE_NAME = "gpud-runs"
MAX_PROCESSES = 1024  # read of one program's processes: a listing never holds the loop long
_RUN = re.compile(r"^run-([0-9a-f]{8})-(\d+)-(\d+)$")


class Unavailable(Exception):
    """No cgroup can be had for runs here; the message says why, for the run's user and the log."""


def events(text: str) -> dict[str, int]:
    """cgroup.events (``populated 1``, ``frozen 0``) as a dict."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def daemon_key(state_dir: str) -> str:
    """Eight hex digits that tell one daemon's run cgroups (by its state directory) from another's."""
    return hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:8]


def run_name(key: str, pid: int, start: int) -> str:
    return f"run-{key}-{pid}-{start}"


def parse_run_name(name: str, key: str) -> tuple[int, int] | None:
    """(pid, start) of one of this daemon's run cgroups, or None for any other name."""
    m = _RUN.match(name)
    return (int(m[2]), int(m[3])) if m and m[1] == key else None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class RunCgroup:
    """One run's cgroup: ``path`` in the file system, ``name`` its path in the hierarchy."""

    path: str
    name: str

    def move(self, pid: int) -> None:
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def freeze(self, frozen: bool) -> None:
        _write(os.path.join(self.path, "cgroup.freeze"), "1" if frozen else "0")

    def events(self) -> dict[str, int] | None:
        """cgroup.events now; None when the cgroup is gone."""
        try:
            return events(_read(os.path.join(self.path, "cgroup.events")))
        except FileNotFoundError:
            return None

    def frozen(self) -> bool:
        ev = self.events()
        return ev is not None and ev.get("frozen") == 1

    def wants_frozen(self) -> bool:
        """cgroup.freeze is 1: frozen, or on its way (a process has not reached a point to stop at)."""
        try:
            return _read(os.path.join(self.path, "cgroup.freeze")).strip() == "1"
        except OSError:
            return False

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in _read(os.path.join(self.path, "cgroup.procs")).split()]
        except FileNotFoundError:
            return []

    def kill(self) -> int:
        """End every process in it (``cgroup.kill``; before Linux 5.14, frozen and SIGKILLed one by one);
        the processes it held."""
        pids = self.pids()
        kill_file = os.path.join(self.path, "cgroup.kill")
        if os.path.exists(kill_file):
            _write(kill_file, "1")
            return len(pids)
        self.freeze(True)  # a frozen process forks no more; SIGKILL ends it all the same
        # Pids read from the cgroup gpud made, and only gpud can move processes out of: a pid is
        # another process's only once its own was killed and reaped meanwhile (then it is gone).
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def remove(self) -> bool:
        """rmdir once it is empty; False while processes are still in it, True once it is gone."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            raise
        return True


class RunCgroups:
    """The base directory of the runs' cgroups (``probe`` finds or makes it)."""

    def __init__(self, base: str, hierarchy: str, key: str) -> None:
        self.base = base  # in the file system
        self.hierarchy = hierarchy  # the base's path in the cgroup hierarchy
        self.key = key

    @classmethod
    def probe(cls, setting: str, key: str, *, mountinfo: str = MOUNTINFO, own: str = OWN_CGROUP) -> RunCgroups:
        """The base for ``setting`` (``auto``: ``gpud-runs`` below the daemon's own cgroup; an absolute
        directory on the cgroup2 mount; ``off``), made if missing. Raises Unavailable naming why not."""
        if setting == "off":
            raise Unavailable("run cgroups are turned off (run_cgroups = off)")
        mount = cgroup2_mount(_read(mountinfo))
        if mount is None:
            raise Unavailable("no cgroup v2 hierarchy is mounted (/proc/self/mountinfo has no cgroup2)")
        if setting == "auto":
            mine = own_cgroup(_read(own))
            parent = None if mine is None else directory(mount, mine)
            if parent is None:
                raise Unavailable(f"gpud's own cgroup ({mine}) is not visible under {mount[0]}")
            base = os.path.join(parent, BASE_NAME)
        else:
            base = os.path.normpath(setting)
        point = mount[0].rstrip("/") or "/"
        if os.path.commonpath([point, base]) != point or base == point:
            raise Unavailable(f"run_cgroups = {setting!r} is not a cgroup below the cgroup2 mount {point}")
        hierarchy = mount[1].rstrip("/") + "/" + os.path.relpath(base, point)
        try:
            os.makedirs(base, exist_ok=True)
        except OSError as exc:
            raise Unavailable(
                f"cannot create {base}: {exc.strerror} (a read-only /sys/fs/cgroup: ProtectControlGroups=yes; "
                "see docs/running.md)"
            ) from None
        for needed, since in (("cgroup.freeze", "5.2"), ("cgroup.procs", "4.5")):
            if not os.path.exists(os.path.join(base, needed)):
                raise Unavailable(f"{base} has no {needed}: the kernel's cgroup v2 freezer needs Linux {since}")
        common = os.path.join(point, "cgroup.procs")  # the common ancestor of a user's process and the base
        if not os.access(common, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
            raise Unavailable(
                f"gpud cannot write {common}: moving another user's process into its cgroup needs write access "
                "to the common ancestor's cgroup.procs (root, or CAP_DAC_OVERRIDE: see docs/running.md)"
            )
        return cls(base, hierarchy, key)

    def cgroup(self, name: str) -> RunCgroup:
        return RunCgroup(os.path.join(self.base, name), f"{self.hierarchy}/{name}")

    def create(self, pid: int, start: int) -> RunCgroup:
        """The cgroup for the program ``pid`` that started at ``start`` (made; kept if it is there)."""
        cg = self.cgroup(run_name(self.key, pid, start))
        os.makedirs(cg.path, exist_ok=True)
        return cg

    def leftovers(self) -> list[tuple[RunCgroup, int, int]]:
        """This daemon's run cgroups that are there now (left by an earlier daemon), with the pid and
        start time of the program each was made for."""
        try:
            names = sorted(os.listdir(self.base))
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            named = parse_run_name(name, self.key)
            if named is not None and os.path.isdir(os.path.join(self.base, name)):
                found.append((self.cgroup(name), *named))
        return found

    def of(self, pid: int) -> RunCgroup | None:
        """The run cgroup of this daemon's that ``pid`` is in now, if any."""
        try:
            path = own_cgroup(_read(f"/proc/{pid}/cgroup"))
        except OSError:
            return None
        if path is None or not path.startswith(self.hierarchy + "/"):
            return None
        name = path[len(self.hierarchy) + 1 :]
        return self.cgroup(name) if parse_run_name(name, self.key) is not None else None


def program_state(cgroup: RunCgroup | None, pid: int, run: int | None) -> tuple[KernelState, int, int]:
    """What the kernel says of a run's program now: (state, its processes, those stopped or frozen).
    Its cgroup's ``frozen`` where it has one, else the /proc states of its tree: every process below
    its keeper when the keeper is the child of ``run`` (the run's pid), else below the program."""
    if cgroup is not None:
        ev = cgroup.events()
        pids = cgroup.pids()[:MAX_PROCESSES]
        if ev is None or not pids:
            return "gone", 0, 0
        if ev.get("frozen") == 1:
            return "frozen", len(pids), len(pids)
    else:
        me = read_stat(pid)
        if me is None:
            return "gone", 0, 0
        keeper = read_stat(me.ppid)
        below_keeper = keeper is not None and run is not None and keeper.ppid == run
        pids = (ProcessTree(me.ppid).pids() if below_keeper else [pid, *ProcessTree(pid).pids()])[:MAX_PROCESSES]
    states = [s.state for s in (read_stat(x) for x in pids) if s is not None and s.state not in "ZX"]
    if not states:
        return "gone", 0, 0
    stopped = sum(1 for s in states if s in "Tt")
    if stopped == len(states):
        return "stopped", len(states), stopped
    if cgroup is not None and cgroup.wants_frozen():
        return "freezing", len(states), stopped
    return ("partly_stopped" if stopped else "running"), len(states), stopped
