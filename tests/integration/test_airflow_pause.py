"""``pause=`` in the Airflow integration: a task's command or function runs under gpud-run, paused whole.

Real Airflow 3 and real gpud, as test_airflow.py serves them (its fixtures, an Airflow of this
module's own); the DAGs are in ``airflow_dags/gpud_pause_dags.py``. The option's checks run in
Airflow's helper process: the pytest process never imports Airflow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.runinfo import BACKEND, COMMAND, PID

from . import test_airflow  # skips this module too where Airflow is not installed
from .test_airflow import Airflow, eventually, gpud_id

airflow, af = test_airflow.airflow, test_airflow.af  # fixtures: an Airflow of this module's own


def parsed(af: Airflow, *dag_ids: str) -> None:
    """This module's DAGs parsed (the fixture waits only for test_airflow.py's)."""
    eventually(
        lambda: {r[0] for r in af.query("select dag_id from dag where not is_paused") or []} >= set(dag_ids),
        f"{', '.join(dag_ids)} parsed and unpaused",
        60,
        lambda: af.diagnose() + str(af.query("select stacktrace from import_error")),
    )


def xcom(af: Airflow, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
    rows = af.query(
        "select value from xcom where dag_id = ? and run_id = ? and task_id = ? and key = ?",
        dag_id,
        run_id,
        task_id,
        key,
    )
    assert rows, f"no XCom {key} of {dag_id} {run_id} {task_id}"
    return json.loads(rows[0][0])


def run_of(af: Airflow, pid: int) -> p.ClientInfo | None:
    with Client(af.gpud.socket, name="test-airflow-pause") as c:
        reply: p.ClientsReply = c.call(p.ListClients(id=0))
    return next((x for x in reply.clients if x.labels.get(PID) == str(pid) and x.sessions), None)


def test_a_bash_operator_runs_its_command_under_the_run_and_succeeds_with_its_output(
    af: Airflow, tmp_path: Path
) -> None:
    parsed(af, "gpud_pause_bash")
    flag = tmp_path / "go"
    run = af.trigger("gpud_pause_bash", tmp_path, flag=str(flag))
    pid_file = tmp_path / "bash.pid"
    pid = int(eventually(lambda: pid_file.exists() and pid_file.read_text().strip(), "bash started", 45, af.diagnose))
    shown = eventually(lambda: run_of(af, pid), "the run, shown with the command's pid")
    assert shown.labels[BACKEND] == "signal" and "bash -c" in shown.labels[COMMAND], shown.labels
    assert 'echo $$ > "' in shown.labels[COMMAND], shown.labels  # the rendered command
    (session,) = shown.sessions
    assert session.core_ceiling == 25, session  # the task's allocation caps the run's session
    table = subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", af.gpud.socket, "clients"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(pid) in table and "bash" in table, table
    eventually(lambda: (s := run_of(af, pid)) and s.sessions[0].grants >= 2, "paused and resumed at least once")
    flag.touch()
    assert af.wait_run("gpud_pause_bash", run) == "success"
    task_id = gpud_id("gpud_pause_bash", run, "burn")
    gpu = xcom(af, "gpud_pause_bash", run, "burn", "gpud_allocation")["gpus"][0]
    assert xcom(af, "gpud_pause_bash", run, "burn") == f"burnt {task_id} on {gpu}"
    assert af.held()["held"] == {}


def test_a_paused_function_returns_its_value_and_raises_its_exception(af: Airflow, tmp_path: Path) -> None:
    parsed(af, "gpud_pause_call")
    run = af.trigger("gpud_pause_call", tmp_path)
    assert af.wait_run("gpud_pause_call", run) == "failed"  # refuse() fails; measure() succeeds
    assert af.ti("gpud_pause_call", run, "measure") == ("success", 1)
    got = xcom(af, "gpud_pause_call", run, "measure")
    task_process = xcom(af, "gpud_pause_call", run, "measure", "gpud_allocation")["owner_pid"]
    assert task_process not in (got["pid"], got["ppid"]), got  # a child of the run's keeper
    assert got["task_id"] == gpud_id("gpud_pause_call", run, "measure") and got["share"] == 0.5, got
    assert got["sum"] == sum(range(1000)) and got["cuda"] in ("0", "1"), got
    log = af.log("gpud_pause_call", run, "refuse", 1)
    assert "ValueError: batch 3 is corrupt" in log and "in the child process that gpud paused" in log, log[-3000:]
    assert af.held()["held"] == {}


def test_pause_is_checked_where_the_dag_is_parsed(af: Airflow) -> None:
    code = r"""
from airflow.providers.standard.operators.bash import BashOperator
from airflow.providers.standard.operators.python import PythonOperator
from gpud_client.airflow import GpuRequest, GpuResourcesMixin, gpu_resources

class GpuBash(GpuResourcesMixin, BashOperator): pass
class GpuPython(GpuResourcesMixin, PythonOperator): pass

assert GpuBash(task_id="b", bash_command="true", gpus=0.5, pause="auto").gpu_request.pause == "auto"
for make, said in [
    (lambda: GpuRequest(gpus=0.25, pause="stop"), "pause must be one of 'auto', 'cuda', 'signal'"),
    (lambda: gpu_resources(gpus=2, pause="signal"), "with whole GPUs (gpus=2) the task has them to itself"),
    (lambda: GpuBash(task_id="b", bash_command="true", gpus=1, pause="signal"), "leave pause out"),
    (lambda: GpuPython(task_id="p", python_callable=print, gpus=0.5, pause="signal"), "GpuPython: pause= runs"),
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
