"""Two Ray nodes on this machine, each started with its own gpud's socket in its environment.

A task Ray places on either node is enforced by that node's daemon, and each daemon lists only its
node's tasks. Its own module, so the single-node Ray instance of test_ray.py is gone before this
cluster starts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray cannot be installed on this platform (gpud-client[ray])")

from ray.cluster_utils import Cluster  # noqa: E402

from gpud.tools.spawn import DaemonProcess  # noqa: E402
from gpud_client import Client  # noqa: E402
from gpud_client.ray import current_sessions, gpud_task  # noqa: E402

from .test_ray import allocations  # noqa: E402
from .waiting import eventually  # noqa: E402

# --- two nodes --------------------------------------------------------------------------------------


@ray.remote(num_gpus=0.5, max_retries=0)
@gpud_task
def report_and_hold(flag: str) -> dict[str, Any]:
    (session,) = current_sessions()
    info = {
        "socket": os.environ.get("GPUD_SOCKET"),
        "session": session.id,
        "core_limit": session.core_limit,
        "node": ray.get_runtime_context().get_node_id(),
    }
    Path(flag + "." + info["node"]).write_text(json.dumps(info))
    while not os.path.exists(flag):  # the task's work, as long as the test wants (another process's flag)
        time.sleep(0.01)
    return info


def test_two_nodes_each_enforced_by_its_own_gpud(tmp_path: Path) -> None:
    """Two Ray nodes on this machine, each started with its own gpud's socket: a task Ray places on
    either node is enforced by that node's daemon, which lists only that node's tasks."""
    a = DaemonProcess("--simulate", "1").start()
    b = DaemonProcess("--simulate", "1").start()
    cluster: Cluster | None = None
    try:
        # One CPU a node: one task runs on each, and Ray starts no more idle workers than that.
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "num_gpus": 1,
                "resources": {"node_a": 1},
                "env_vars": {"GPUD_SOCKET": a.socket},
                "include_dashboard": False,
            },
        )
        cluster.add_node(num_cpus=1, num_gpus=1, resources={"node_b": 1}, env_vars={"GPUD_SOCKET": b.socket})
        ray.init(address=cluster.address, log_to_driver=False, logging_level="warning")
        try:
            flag = str(tmp_path / "go")
            refs = [
                report_and_hold.options(resources={"node_a": 0.01}).remote(flag),
                report_and_hold.options(resources={"node_b": 0.01}).remote(flag),
            ]
            eventually(lambda: len(list(tmp_path.glob("go.*"))) == 2, "both tasks run", timeout=60)
            on_a, on_b = (allocations(d.socket) for d in (a, b))
            assert len(on_a) == 1 and len(on_b) == 1 and on_a.keys() != on_b.keys()
            reports = [json.loads(p.read_text()) for p in tmp_path.glob("go.*")]
            by_socket = {r["socket"]: r for r in reports}
            assert all(r["core_limit"] == 50 for r in reports)
            # Each daemon knows only its node's task, by its session. (Not "holds the lock": at 0.5 the
            # waiting body uses its budget in a second and is paused until the next window.)
            for d in (a, b):
                with Client(d.socket) as c:
                    ray_clients = [x for x in c.clients().clients if x.name.startswith("ray:")]
                assert [[s.session for s in x.sessions] for x in ray_clients] == [[by_socket[d.socket]["session"]]]
            Path(flag).touch()
            assert {r["socket"] for r in ray.get(refs)} == {a.socket, b.socket}
            eventually(lambda: allocations(a.socket) == {} and allocations(b.socket) == {}, "both freed")
        finally:
            ray.shutdown()
    finally:
        if cluster is not None:
            cluster.shutdown()
        for d in (a, b):
            d.stop()
            d.cleanup()
