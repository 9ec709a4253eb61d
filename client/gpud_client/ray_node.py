"""A Ray worker's way to its node's gpud (for ``gpud_client.ray``, which re-exports the public names):
the options a wrapped task or actor takes, and one client per daemon socket for the worker's life.

The node's gpud is found from the ``socket`` option, else ``$GPUD_SOCKET`` as the node's Ray was
started with (workers inherit the raylet's environment), else ``/run/gpud/gpud.sock``. A node
without it fails the task (``on_missing="fail"``) or lets it run unarbitrated with a warning.
It never opens a second client to one socket in a worker.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Literal

import ray

from gpud_client import protocol as p
from gpud_client.client import Client
from gpud_client.errors import DaemonUnavailable, GpudError

__all__ = ["GpudNotOnNode", "Memory", "Options"]

log = logging.getLogger("gpud_client.ray")
Memory = Literal["proportional"] | int | str | None
_lock = threading.Lock()
_clients: dict[str, Client] = {}


class GpudNotOnNode(GpudError):
    """The Ray node that runs the task has no reachable gpud, and ``on_missing`` is "fail"."""


@dataclass(frozen=True)
class Options:
    socket: str | None = None  # None: $GPUD_SOCKET of the worker (the node's), else the default path
    memory: Memory = "proportional"  # a size (no more than the share), or None: memory not enforced
    on_missing: Literal["fail", "warn"] = "fail"
    wait_s: float = 0.0  # how long the allocation may wait for room on gpud's ledger
    idle_release: float | None = 1.0  # a lock no slice used this long goes back between slices
    priority: int = 0
    on_preempt: str = "terminate"  # terminate|checkpoint|fail: a task's, when gpud takes its allocation back
    checkpoint_signal: int | str = "SIGUSR1"  # told to the body to checkpoint (gpud_client.preempted)


def client_of(options: Options) -> Client | None:
    """This worker's client of its node's gpud (one per socket path). None: none, and that is allowed."""
    path = p.resolve_socket_path(options.socket)
    with _lock:
        client = _clients.get(path)
        if client is not None:
            return client
        try:
            client = Client(path, name=_client_name(), labels=_labels())
        except DaemonUnavailable as exc:
            node = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            if options.on_missing == "fail":
                raise GpudNotOnNode(
                    f"no gpud on Ray node {node}: {exc}. Run gpud on every GPU node and start Ray there with "
                    "GPUD_SOCKET set if it listens elsewhere, or pass on_missing='warn' to run unarbitrated"
                ) from None
            log.warning("no gpud on Ray node %s (%s): running without GPU arbitration", node, exc)
            return None
        _clients[path] = client
        return client


def _client_name() -> str:
    return f"ray:{os.getpid()}"


def _labels() -> dict[str, str]:
    ctx = ray.get_runtime_context()
    return {"ray_job": ctx.get_job_id(), "ray_node": ctx.get_node_id()[:16]}
