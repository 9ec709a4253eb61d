"""The CDI spec gpud-k8s writes for a prepared claim: its containers get the claim's own socket
directory and the environment that points the client library at it; the GPU itself comes from
NVIDIA's CDI devices where the node has them (``nvidia.com/gpu=<uuid>``), else from the device nodes
this spec names. Pure: what to write; the shell writes it (atomically) and removes it."""

from __future__ import annotations

from typing import Any

from gpud_k8s.claims import TASK_PREFIX

CDI_VERSION = "0.6.0"
VENDOR = "gpud.io"
CLASS = "claim"
KIND = f"{VENDOR}/{CLASS}"
CONTAINER_DIR = "/run/gpud"  # where a claim's directory appears in its containers
SOCKET_NAME = "gpud.sock"


def device_id(claim_uid: str) -> str:
    """The fully qualified CDI device name the kubelet hands the runtime: ``gpud.io/claim=<uid>``."""
    return f"{KIND}={claim_uid}"


def spec_file_name(claim_uid: str) -> str:
    return f"{VENDOR}-{CLASS}_{claim_uid}.json"


def claim_spec(claim_uid: str, host_dir: str, device_nodes: tuple[str, ...] = ()) -> dict[str, Any]:
    """The spec of one claim: its socket directory mounted (the directory, not the socket: a restart of
    gpud makes a new socket, which the mount shows), ``GPUD_SOCKET`` and ``GPUD_TASK_ID``; and the GPU's
    device nodes when no NVIDIA CDI device gives them."""
    edits: dict[str, Any] = {
        "env": [f"GPUD_SOCKET={CONTAINER_DIR}/{SOCKET_NAME}", f"GPUD_TASK_ID={TASK_PREFIX}{claim_uid}"],
        "mounts": [
            {"hostPath": host_dir, "containerPath": CONTAINER_DIR, "options": ["rbind", "rw", "nosuid", "nodev"]}
        ],
    }
    if device_nodes:
        edits["deviceNodes"] = [{"path": path} for path in device_nodes]
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": [{"name": claim_uid, "containerEdits": edits}]}
