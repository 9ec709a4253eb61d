"""``gpud_task(on_preempt=...)``: a Ray task that gpud preempts is stopped, retried by Ray, and runs again.

Real Ray (one logical GPU) and a gpud of this module's own on one simulated GPU, where an allocation
below production may be taken back as soon as it is made (``preemption_min_runtime_s = 0``). The
node's Ray starts with that daemon's socket in its environment, as test_ray.py's does.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray cannot be installed on this platform (gpud-client[ray])")

from gpud.tools.spawn import DaemonProcess  # noqa: E402
from gpud_client import Client  # noqa: E402
from gpud_client.preempted import TaskPreempted  # noqa: E402
from gpud_client.ray import gpud_task  # noqa: E402

from .test_ray import RAY_WAIT_S  # noqa: E402
from .waiting import eventually  # noqa: E402

DEADLINE_S = 90  # no attempt outlives this, even if its test died


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """gpud on one simulated GPU that never reaps (every release is the wrapper's), and a local Ray node
    with one logical GPU that finds it."""
    config = tmp_path_factory.mktemp("gpud") / "gpud.toml"
    config.write_text("reap_interval_s = 0\npreemption_grace_s = 10\npreemption_min_runtime_s = 0\n")
    daemon = DaemonProcess("--simulate", "1", "--config", str(config)).start()
    saved = os.environ.get("GPUD_SOCKET")
    os.environ["GPUD_SOCKET"] = daemon.socket  # the Ray node, and so its workers, inherit it
    try:
        ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
        try:
            yield daemon
        finally:
            ray.shutdown()
    finally:
        if saved is None:
            os.environ.pop("GPUD_SOCKET", None)
        else:
            os.environ["GPUD_SOCKET"] = saved
        daemon.stop()
        daemon.cleanup()


def ledger(socket: str) -> dict[str, Any]:
    with Client(socket, name="test-ray-preempt") as c:
        reply = c.allocations()
    return {"held": [a.task_id for a in reply.allocations], "waiting": list(reply.waiting)}


def test_a_terminated_task_is_stopped_where_it_stands_and_ray_retries_it(node: DaemonProcess, tmp_path: Path) -> None:
    def work(out: str) -> dict[str, Any]:  # defined here: Ray's workers cannot import this module
        attempt = len(list(Path(out).glob("attempt.*"))) + 1
        env = {k: os.environ.get(k) for k in ("GPUD_ON_PREEMPT", "GPUD_PREEMPT_GRACE_S", "GPUD_RESUME")}
        Path(out, f"attempt.{attempt}").write_text(json.dumps({"pid": os.getpid(), "env": env}))
        if attempt == 1:
            try:
                time.sleep(DEADLINE_S)  # the work, until gpud's SIGTERM stops it where it stands
            except BaseException as exc:
                Path(out, "stopped.json").write_text(json.dumps({"type": type(exc).__name__, "said": str(exc)}))
                raise
        return {"attempt": attempt, "env": env}

    task = ray.remote(num_gpus=1, max_retries=1, retry_exceptions=[TaskPreempted])(
        gpud_task(work, on_preempt="terminate", wait_s=60)
    )
    ref = task.remote(str(tmp_path))
    (held,) = eventually(
        lambda: (tmp_path / "attempt.1").exists() and ledger(node.socket)["held"], "the first attempt runs", RAY_WAIT_S
    )
    assert held.startswith("ray.") and ".task." in held, held
    with Client(node.socket, name="production") as production:
        production.allocate("production", gpus=1, priority="production", wait_ms=60_000)  # once the task yielded
        try:
            stopped = json.loads((tmp_path / "stopped.json").read_text())
            assert stopped["type"] == "Stopped", stopped  # a BaseException: `except Exception` lets it by
            assert f"task {held} was preempted by production (priority)" in stopped["said"], stopped
            assert "stopped (on_preempt terminate)" in stopped["said"], stopped
            eventually(lambda: ledger(node.socket)["waiting"] == [held], "Ray's retry waits for the GPU", RAY_WAIT_S)
        finally:
            production.release_allocation("production")
    got = ray.get(ref, timeout=RAY_WAIT_S)  # a second attempt: the first ended with TaskPreempted
    assert got["attempt"] == 2 and got["env"] == {
        "GPUD_ON_PREEMPT": "terminate",
        "GPUD_PREEMPT_GRACE_S": "10",
        "GPUD_RESUME": None,
    }, got
    assert ledger(node.socket) == {"held": [], "waiting": []}


def test_on_preempt_is_checked_where_the_task_is_defined() -> None:
    with pytest.raises(ValueError, match="gpud_task: on_preempt must be one of .* not 'suspend': the task's own"):
        gpud_task(print, on_preempt="suspend")
    with pytest.raises(ValueError, match="gpud_task: checkpoint_signal 'SIGNOPE' names no signal"):
        gpud_task(print, on_preempt="checkpoint", checkpoint_signal="SIGNOPE")
