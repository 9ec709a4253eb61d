"""Where the cgroup v2 hierarchy is, in the file system, and which cgroup a process is in: pure parsing
of ``/proc/self/mountinfo`` and ``/proc/PID/cgroup``, for gpud (its runs' cgroups) and gpud-k8s (a
claim's containers).

The v2 hierarchy is at /sys/fs/cgroup, or in a hybrid layout under it (e.g. /sys/fs/cgroup/unified); a
mount may show only part of the hierarchy (a container's), so a cgroup's path in the hierarchy and its
folder differ by the mount's root.
"""

from __future__ import annotations

import os
import re

MOUNTINFO = "/proc/self/mountinfo"
_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape."""
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), field)


def cgroup2_mount(mountinfo: str) -> tuple[str, str] | None:
    """(mount point, root of the hierarchy it shows) of the first cgroup2 mount in ``mountinfo``."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split() or right.split()[0] != "cgroup2":
            continue
        return _unescape(fields[4]), _unescape(fields[3])
    return None


def own_cgroup(proc_cgroup: str) -> str | None:
    """The v2 cgroup path in a /proc/PID/cgroup text (its ``0::/path`` line), or None."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            path = line[3:].strip()
            return path.removesuffix(" (deleted)") if path.startswith("/") else None
    return None


def directory(mount: tuple[str, str], path: str) -> str | None:
    """Where cgroup ``path`` of the hierarchy is in the file system, or None when the mount
    (showing only the part below its root) does not show it."""
    point, root = mount
    root = root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    rest = path[len(root) :].strip("/")
    return os.path.join(point, rest) if rest else point
