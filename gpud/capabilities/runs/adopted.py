"""ADOPT: cgroups gpud did not make, handed by an admin to freeze and thaw as a run's program.

gpud-k8s hands gpud the cgroups of a Kubernetes claim's containers (docs/kubernetes.md#taking-turns):
their container runtime made them, so gpud never kills, moves or removes them, and a connection that
goes leaves them as the kernel has them (its agent, started again, hands them again). Each path is
judged by ``gpud.core.adoption`` on what the kernel says now: where gpud's cgroup2 mount shows it, and
the processes in it and below it (none may be gpud, the caller or init); then it must be a directory
of the hierarchy (not a link) with a freezer. Paths are as gpud's own mount shows the hierarchy (in a
cgroup namespace its root may read ``/../..``), which is how gpud-k8s, in the same pod, reads them too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from gpud.core.adoption import plain, refusal
from gpud.core.errors import Refused
from gpud.host.cgroups import MOUNTINFO, RunCgroup, cgroup2_mount
from gpud_client import protocol as p

MAX_BELOW = 256  # cgroups below one handed: a container has a few; more is no container's


def relative(mount_root: str, path: str) -> str | None:
    """``path`` (in the hierarchy) below the mount's root: "" for the root itself, None when not below it."""
    root = mount_root.rstrip("/")
    if path == (root or "/"):
        return ""
    return path[len(root) + 1 :] if path.startswith(root + "/") else None


def judge(paths: Iterable[str], *, caller_pid: int, runs_base: str | None, taken: Iterable[str]) -> list[RunCgroup]:
    """The cgroups at ``paths`` (hierarchy paths), each checked; Refused (INVALID, naming the path and
    why) for the first that may not be adopted."""
    with open(MOUNTINFO) as f:
        mount = cgroup2_mount(f.read())
    if mount is None:
        raise Refused(p.ErrorCode.INVALID, "no cgroup v2 hierarchy is mounted here: gpud cannot freeze cgroups")
    held, me = list(taken), os.getpid()
    found: list[RunCgroup] = []
    for path in paths:
        rel = relative(mount[1], path)
        where = os.path.join(mount[0], rel) if rel else mount[0]
        why: str | None = None
        pids: list[int] = []
        if rel and plain(rel):
            why = _not_a_cgroup(path, where)
            if why is None:
                pids, complete = _processes_below(where)
                if not complete:
                    why = f"cgroup {path} has more than {MAX_BELOW} cgroups below it: no container's"
        why = why or refusal(path, rel, pids, gpud_pid=me, caller_pid=caller_pid, runs_base=runs_base, taken=held)
        if why is not None:
            raise Refused(p.ErrorCode.INVALID, why)
        if all(x.name != path for x in found):
            found.append(RunCgroup(where, path))
    return found


def _processes_below(folder: str) -> tuple[list[int], bool]:
    """Every process in the cgroup at ``folder`` and below it; False when there are too many cgroups."""
    pids: list[int] = []
    for n, (here, _, _) in enumerate(os.walk(folder)):
        if n > MAX_BELOW:
            return pids, False
        try:
            with open(os.path.join(here, "cgroup.procs")) as f:
                pids += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return pids, True


def _not_a_cgroup(path: str, where: str) -> str | None:
    try:
        st = os.lstat(where)
    except FileNotFoundError:
        return f"cgroup {path} does not exist ({where})"
    except OSError as exc:
        return f"cgroup {path}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"cgroup {path} is not a directory ({where})"
    if not os.path.exists(os.path.join(where, "cgroup.freeze")):
        return f"cgroup {path} has no cgroup.freeze (the cgroup v2 freezer needs Linux 5.2)"
    return None


def all_frozen(cgroups: Iterable[RunCgroup]) -> bool:
    """Every one is frozen, or gone (nothing of a container that ended can run)."""
    for cg in cgroups:
        ev = cg.events()
        if ev is not None and ev.get("frozen") != 1:
            return False
    return True


def set_frozen(cgroups: Iterable[RunCgroup], frozen: bool) -> None:
    """Write the freeze to each; one gone meanwhile is skipped. Raises OSError for any other failure."""
    for cg in cgroups:
        try:
            cg.freeze(frozen)
        except FileNotFoundError:
            continue


def state(cgroups: Iterable[RunCgroup]) -> tuple[p.KernelState, int, int]:
    """What the kernel says of adopted cgroups together: (state, their processes, those frozen)."""
    processes = frozen = 0
    freezing = False
    for cg in cgroups:
        ev = cg.events()
        if ev is None:
            continue
        n = len(cg.pids())
        processes += n
        if ev.get("frozen") == 1:
            frozen += n
        elif cg.wants_frozen():
            freezing = True
    if processes == 0:
        return "gone", 0, 0
    if frozen == processes:
        return "frozen", processes, frozen
    return ("freezing" if freezing else "running"), processes, frozen
