"""Which containers hold a claim, and where their cgroups are: for taking turns and suspending.

The kubelet knows which containers of which pods hold a ResourceClaim; its pod resources API says so
(``List``: each pod's containers with their ``dynamic_resources``, the claims by name and namespace).
It does not say where their cgroups are, so the rest comes from the API server and the kernel:

1. the pods that hold the claim, by name, from pod resources (``claim_containers``);
2. each pod's uid and its containers' ids (``status.containerStatuses[].containerID``,
   ``runtime://<id>``), from the pod object (``container_ids``);
3. the pod's cgroup, found below the node's cgroup2 root by the kubelet's names for it, with either
   cgroup driver: ``kubepods-<qos>-pod<uid with _>.slice`` (systemd) or ``pod<uid>`` (cgroupfs), under
   ``kubepods.slice``/``kubepods`` and their QoS levels; and in it each container's (``find_cgroups``),
   by the runtime's names for the ids (``cri-containerd-<id>.scope``, ``crio-<id>.scope``,
   ``docker-<id>.scope`` or ``<id>``), or by the kernel's word before the API server has the ids: a
   container the claim's CDI spec was applied to starts with ``GPUD_TASK_ID=<its task>`` in its
   environment (``/proc/PID/environ`` of the first processes in its cgroup), so it is found as soon as
   its first process exists, not seconds later when the kubelet has reported its status.

A container that has not started has no cgroup yet; one that restarted has a new one: the set is
looked at again until the claim is unprepared. The names are pure (``is_pod_dir``,
``is_container_dir``, ``container_id``); the walk reads folder names only, and only below ``kubepods``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpud_client.proctl.hierarchy import MOUNTINFO, cgroup2_mount

_ID = re.compile(r"^[0-9a-f]{12,128}$")
QOS_DIRS = ("burstable", "besteffort", "guaranteed")
CONTAINER_PREFIXES = ("cri-containerd-", "crio-", "docker-", "cri-o-")


@dataclass(frozen=True, slots=True)
class ClaimHolder:
    """A container that holds the claim, as the kubelet names it."""

    namespace: str
    pod: str
    container: str


def claim_containers(pod_resources: Iterable[Any], namespace: str, claim: str) -> list[ClaimHolder]:
    """The containers that pod resources' ``List`` says hold ResourceClaim ``namespace/claim``."""
    found = []
    for pod in pod_resources:
        for ctr in pod.containers:
            if any(d.claim_name == claim and d.claim_namespace == namespace for d in ctr.dynamic_resources):
                found.append(ClaimHolder(pod.namespace, pod.name, ctr.name))
    return found


def container_id(status_id: str) -> str | None:
    """The runtime's id in a container status' ``containerID`` (``containerd://<hex>``), or None."""
    _, sep, cid = status_id.partition("://")
    return cid if sep and _ID.match(cid) else None


def container_ids(pod: dict[str, Any], names: Iterable[str]) -> dict[str, str]:
    """Container name -> runtime id, for those of ``names`` that run (or ran) in ``pod`` now."""
    want = set(names)
    status = pod.get("status") or {}
    ids = {}
    for kind in ("initContainerStatuses", "containerStatuses"):
        for s in status.get(kind) or []:
            cid = container_id(s.get("containerID") or "")
            if s.get("name") in want and cid is not None and "terminated" not in (s.get("state") or {}):
                ids[s["name"]] = cid
    return ids


def is_pod_dir(name: str, uid: str) -> bool:
    """The kubelet's cgroup of pod ``uid``, with either cgroup driver."""
    if name == f"pod{uid}":
        return True
    under = uid.replace("-", "_")
    return name.endswith(".slice") and name.startswith("kubepods") and name.endswith(f"-pod{under}.slice")


def is_container_dir(name: str, cid: str) -> bool:
    """The runtime's cgroup of container ``cid`` (a pod's child)."""
    if name == cid:
        return True
    return any(name == f"{prefix}{cid}.scope" or name == f"{prefix}{cid}" for prefix in CONTAINER_PREFIXES)


def _kubepods_level(name: str) -> bool:
    return name.startswith("kubepods") or name in QOS_DIRS


def find_pod(root: Path, uid: str, depth: int = 3) -> Path | None:
    """Pod ``uid``'s cgroup folder below ``root`` (the node's cgroup2 root), or None."""
    level = [root]
    for _ in range(depth):
        below = []
        for here in level:
            try:
                entries = list(os.scandir(here))
            except OSError:
                continue
            for e in entries:
                if not e.is_dir(follow_symlinks=False):
                    continue
                if is_pod_dir(e.name, uid):
                    return Path(e.path)
                if _kubepods_level(e.name):
                    below.append(Path(e.path))
        level = below
    return None


def find_cgroups(root: Path, uid: str, ids: Iterable[str], task_id: str) -> list[Path]:
    """The cgroup folders of pod ``uid``'s containers that hold the claim now: named by one of ``ids``,
    or whose processes started with the claim's ``GPUD_TASK_ID``."""
    pod = find_pod(root, uid)
    if pod is None:
        return []
    want = list(ids)
    marker = f"GPUD_TASK_ID={task_id}".encode()
    found = []
    try:
        entries = sorted(os.scandir(pod), key=lambda e: e.name)
    except OSError:
        return []
    for e in entries:
        if not e.is_dir(follow_symlinks=False):
            continue
        if any(is_container_dir(e.name, cid) for cid in want) or _marked(Path(e.path), marker):
            found.append(Path(e.path))
    return found


def _marked(folder: Path, marker: bytes, look: int = 4) -> bool:
    """One of the first processes in the cgroup started with ``marker`` in its environment."""
    try:
        pids = (folder / "cgroup.procs").read_text().split()[:look]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    return True
        except OSError:
            continue
    return False


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """Where the node's cgroup2 hierarchy is mounted (``point``) and which of its paths it shows (``shown``)."""

    point: Path
    shown: str

    @classmethod
    def here(cls) -> Hierarchy:
        with open(MOUNTINFO) as f:
            mount = cgroup2_mount(f.read())
        if mount is None:
            raise OSError("no cgroup v2 hierarchy is mounted on this node (/proc/self/mountinfo has no cgroup2)")
        return cls(Path(mount[0]), mount[1])

    def path_of(self, folder: Path) -> str:
        """``folder``'s path in the hierarchy, as gpud's ADOPT takes it."""
        rel = os.path.relpath(folder, self.point)
        if rel == "." or rel.startswith(".."):
            raise ValueError(f"{folder} is not below the cgroup2 mount {self.point}")
        return self.shown.rstrip("/") + "/" + rel
