"""Which cgroups an admin may hand gpud to freeze (ADOPT; docs/kubernetes.md#taking-turns).

gpud-k8s hands gpud the cgroups of a claim's containers, which the container runtime made, not gpud.
A path is a claim like any a client sends: judged here on what the kernel says (read by the shell),
before gpud writes a freeze into it. Freezing the wrong cgroup would stop gpud itself, the agent that
would thaw it, or the whole node, so each of these is refused by name:

- a path spelled other than it is (empty, ``.`` or ``..`` components below the mount's root), or one
  the cgroup2 mount does not show;
- the root of the hierarchy (every process of the node);
- a cgroup that holds, itself or below it, gpud's own process, the caller's or init (pid 1): judged by
  the processes the kernel lists in it (``cgroup.procs``, the whole subtree), not by comparing path
  names, which a cgroup namespace shows relative to its own root;
- one inside gpud's base for runs' cgroups (those are runs' programs, frozen by their runs);
- one that overlaps a cgroup another connection handed already (two owners would thaw each other's
  freezes).

Pure: what the shell read in, a reason or None out.
"""

from __future__ import annotations

from collections.abc import Iterable


def is_within(path: str, other: str) -> bool:
    """``path`` is ``other`` or below it (absolute paths, without trailing slashes)."""
    return other == "/" or path == other or path.startswith(other + "/")


def plain(rel: str) -> bool:
    """A path below a mount's root (no leading slash) spelled as it is."""
    return all(x not in ("", ".", "..") for x in rel.split("/"))


def refusal(
    path: str,
    rel: str | None,
    pids: Iterable[int],
    *,
    gpud_pid: int,
    caller_pid: int,
    runs_base: str | None = None,
    taken: Iterable[str] = (),
) -> str | None:
    """Why the cgroup at hierarchy path ``path`` may not be adopted; None when it may. ``rel``: its path
    below the cgroup2 mount's root (None: the mount does not show it; "" the root itself); ``pids``:
    every process in it and below it, as the kernel lists them."""
    if rel is None:
        return f"cgroup {path!r} is not shown by gpud's cgroup2 mount"
    if rel == "":
        return f"cgroup {path} is the root of the cgroup2 hierarchy: freezing it would freeze every process"
    if not plain(rel):
        return f"cgroup {path!r} is not a plain path in the cgroup2 hierarchy"
    held = set(pids)
    for whose, what, pid in (
        ("gpud's own process", "gpud", gpud_pid),
        ("the caller's process", "the caller", caller_pid),
        ("init", "the node", 1),
    ):
        if pid in held:
            return f"cgroup {path} holds {whose} (pid {pid}): freezing it would freeze {what}"
    if runs_base is not None and is_within(path, runs_base):
        return f"cgroup {path} is in gpud's base for runs' programs ({runs_base}): a run freezes those"
    for other in taken:
        if is_within(path, other) or is_within(other, path):
            return f"cgroup {path} overlaps {other}, which another connection handed gpud already"
    return None
