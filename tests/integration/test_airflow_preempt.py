"""``on_preempt=`` in the Airflow integration: a task that gpud preempts checkpoints, is retried and resumes.

Real Airflow 3, served as test_airflow.py serves it (its fixtures, an Airflow of this module's own),
and a gpud of this module's own on one simulated GPU, where a best-effort allocation may be taken
back as soon as it is made (``preemption_min_runtime_s = 0``). Its socket reaches the DAG file
through ``GPUD_TEST_PREEMPT_SOCKET``, set before the Airflow starts (an autouse fixture of the
module comes first). The DAG is in ``airflow_dags/gpud_preempt_dags.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client

from . import test_airflow  # skips this module too where Airflow is not installed
from .test_airflow import Airflow, eventually, gpud_id, record
from .test_airflow_pause import parsed, xcom

airflow, af = test_airflow.airflow, test_airflow.af  # fixtures: an Airflow of this module's own
DAG = "gpud_preempt_checkpoint"


@pytest.fixture(scope="module", autouse=True)
def preempting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One GPU; never reaps, so every release is the wrapper's; a notice leaves 10 s, which a task that
    yields at once never waits out."""
    config = tmp_path_factory.mktemp("gpud-preempt") / "gpud.toml"
    config.write_text("reap_interval_s = 0\npreemption_grace_s = 10\npreemption_min_runtime_s = 0\n")
    daemon = DaemonProcess("--simulate", "1", "--config", str(config)).start()
    saved = os.environ.get("GPUD_TEST_PREEMPT_SOCKET")
    os.environ["GPUD_TEST_PREEMPT_SOCKET"] = daemon.socket  # the module's Airflow takes a copy of os.environ
    try:
        yield daemon
    finally:
        if saved is None:
            os.environ.pop("GPUD_TEST_PREEMPT_SOCKET", None)
        else:
            os.environ["GPUD_TEST_PREEMPT_SOCKET"] = saved
        daemon.stop()
        daemon.cleanup()


def step(out: Path) -> int:
    try:
        return int(json.loads((out / "progress.json").read_text())["step"])
    except FileNotFoundError:
        return 0


def test_a_preempted_task_checkpoints_is_retried_and_resumes_where_it_saved(
    af: Airflow, preempting: DaemonProcess, tmp_path: Path
) -> None:
    parsed(af, DAG)
    run = af.trigger(DAG, tmp_path)
    task_id = gpud_id(DAG, run, "train")
    first = record(tmp_path, "train", 1, af)
    assert first["step"] == 0 and first["allocation"]["resume"] is False, first
    assert first["env"] == {
        "GPUD_ON_PREEMPT": "checkpoint",
        "GPUD_PREEMPT_GRACE_S": "10",
        "GPUD_PREEMPT_SIGNAL": "SIGUSR1",
        "GPUD_RESUME": None,
    }
    eventually(lambda: step(tmp_path) >= 3, "the first try made progress", 45, af.diagnose)
    with Client(preempting.socket, name="production") as production:
        # granted once the task has saved, ended and yielded: long before the notice's 10 s run out
        production.allocate("production", gpus=1, priority="production", wait_ms=60_000)
        try:
            saved = record(tmp_path, "saved", 1, af)
            assert saved["requested"] is True and saved["step"] >= 3, saved  # told by the signal and by requested()
            eventually(  # the first try failed for a retry, which waits for the GPU at best-effort
                lambda: af.held(preempting)["waiting"] == [task_id], "the retry waits for the GPU", 45, af.diagnose
            )
        finally:
            production.release_allocation("production")
    assert af.wait_run(DAG, run) == "success"
    second = record(tmp_path, "train", 2, af)
    assert second["env"]["GPUD_RESUME"] == "1" and second["step"] == saved["step"], (saved, second)
    assert second["allocation"]["resume"] is True and second["allocation"]["preemptions"] == 1, second
    assert xcom(af, DAG, run, "train") == {"step": saved["step"] + 3}  # resumed where it saved, not from 0
    log = af.log(DAG, run, "train", 1)
    assert "GpuPreempted" in log and f"task {task_id} was preempted by production (priority)" in log, log[-3000:]
    assert "told to checkpoint (SIGUSR1)" in log, log[-3000:]
    assert af.held(preempting) == {"held": {}, "waiting": []}


def test_on_preempt_is_checked_where_the_dag_is_parsed(af: Airflow) -> None:
    code = r"""
import signal
from gpud_client.airflow import GpuRequest, gpu_resources

assert GpuRequest(on_preempt="checkpoint", checkpoint_signal="USR2").checkpoint_signal == signal.SIGUSR2
assert GpuRequest().message("t", 1).on_preempt == "terminate"
for make, said in [
    (lambda: GpuRequest(on_preempt="suspend"), "on_preempt must be one of 'terminate', 'checkpoint', 'fail'"),
    (lambda: gpu_resources(on_preempt="shrink"), "cannot suspend itself or restart on fewer GPUs"),
    (lambda: GpuRequest(on_preempt="checkpoint", checkpoint_signal="SIGKILL"), "SIGKILL cannot be handled"),
]:
    try:
        make()
    except ValueError as exc:
        assert said in str(exc), (said, exc)
    else:
        raise AssertionError(f"accepted: {said}")
"""
    answer = af.ask({"code": code})
    assert answer == "ok", answer[-3000:]
