"""``gpud_task(pause=...)``: a Ray task's body runs in a child process under gpud-run, paused whole.

Real Ray (logical GPUs) and real gpud on simulated GPUs, from test_ray.py's ``node``: the
bodies here are CPU busy loops with no slice in them, so only the run's SIGSTOP and SIGCONT
keep them to their share. The option's checks need neither Ray running nor gpud.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray cannot be installed on this platform (gpud-client[ray])")

from gpud.tools.spawn import DaemonProcess  # noqa: E402
from gpud_client import Client  # noqa: E402
from gpud_client import protocol as p  # noqa: E402
from gpud_client.ray import gpud_actor, gpud_task  # noqa: E402
from gpud_client.runinfo import COMMAND, PID  # noqa: E402

from . import test_ray  # noqa: E402
from .test_ray import RAY_WAIT_S, allocations  # noqa: E402
from .waiting import eventually  # noqa: E402

node = test_ray.node  # a fixture: this module's Ray and gpud


def run_clients(socket: str) -> list[p.ClientInfo]:
    with Client(socket, name="test-ray-pause") as c:
        reply: p.ClientsReply = c.call(p.ListClients(id=0))
    return [x for x in reply.clients if PID in x.labels]


def test_a_paused_body_keeps_near_its_share_beside_another_and_returns_its_result(node: DaemonProcess) -> None:
    """Two 0.25 tasks whose bodies burn CPU for 2.5 s: unpaused each would run all of it; stopped between
    turns each runs about a quarter, in a child of its Ray worker that gpuctl clients shows as a run."""

    def busy(seconds: float) -> dict[str, Any]:  # defined here: Ray's workers cannot import this module
        start, cpu = time.monotonic(), time.process_time()
        while time.monotonic() - start < seconds:
            pass
        return {"ran": (time.process_time() - cpu) / (time.monotonic() - start), "pid": os.getpid()}

    task = ray.remote(num_gpus=0.25, max_retries=0)(gpud_task(busy, pause="signal"))
    refs = [task.remote(2.5), task.remote(2.5)]
    runs = eventually(  # a run says HELLO before it attaches its session: wait for both
        lambda: len(r := run_clients(node.socket)) == 2 and all(c.sessions for c in r) and r,
        "two runs with their sessions",
        timeout=RAY_WAIT_S,
    )
    for run in runs:
        assert run.name.startswith("ray-run:") and "gpud_client.run.pycall" in run.labels[COMMAND], run
        (session,) = run.sessions
        assert session.core_ceiling == 25, session  # the task's allocation caps the run's session
    got = ray.get(refs)
    for g in got:
        assert 0.05 < g["ran"] < 0.5, got  # about a quarter each; unpaused, all of it
    assert {g["pid"] for g in got} == {int(r.labels[PID]) for r in runs}  # the bodies ran as the runs' programs
    eventually(lambda: allocations(node.socket) == {}, "the tasks' allocations are freed", timeout=RAY_WAIT_S)
    assert run_clients(node.socket) == []


def test_an_exception_in_a_paused_body_is_the_tasks(node: DaemonProcess) -> None:
    def body(n: int) -> None:
        raise KeyError(f"no shard {n}")

    task = ray.remote(num_gpus=0.25, max_retries=0)(gpud_task(body, pause="signal"))
    with pytest.raises(KeyError, match="no shard 7") as caught:
        ray.get(task.remote(7))
    assert "in the child process that gpud paused between turns" in str(caught.value), caught.value
    eventually(lambda: allocations(node.socket) == {}, "the task's allocation is freed", timeout=RAY_WAIT_S)


# --- the option, checked where the task is defined -----------------------------------------------------


def test_pause_must_name_a_backend() -> None:
    with pytest.raises(ValueError, match="gpud_task: pause must be one of 'auto', 'cuda', 'signal'.*not 'stop'"):
        gpud_task(print, pause="stop")  # type: ignore[arg-type]


def test_pause_and_explicit_slices_do_not_go_together() -> None:
    with pytest.raises(ValueError, match="slices='explicit' does not go with it"):
        gpud_task(slices="explicit", pause="signal")


def test_an_actor_refuses_pause() -> None:
    with pytest.raises(TypeError, match="gpud_actor does not take pause=.*gpud_task"):
        gpud_actor(pause="signal")
