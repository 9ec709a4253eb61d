"""Airflow tasks get their GPUs and CPU cores from gpud: real Airflow 3, real gpud on simulated GPUs.

One Airflow serves the file, everything under a temporary AIRFLOW_HOME (SQLite): the scheduler
with the LocalExecutor, the DAG processor reading ``airflow_dags/`` and the API server's
execution API, which the task processes report to. Each try of a task runs in a process of its
own under Airflow's supervisor, as on a worker, so a killed task, SIGTERM and retries all go
through Airflow's own code. (``dag.test()`` runs every task inside the process that calls it: a
task killed there takes the test run with it and is never retried.) One helper process imports
Airflow once: it migrates the database, triggers the DAG runs through Airflow's ``trigger_dag`` and
runs the checks that need Airflow imported; states are read from Airflow's database.

gpud: ``GPUD_SOCKET`` of the Airflow processes is a daemon that never reaps dead owners, so every
release it shows is the wrapper's own; the SIGKILL test uses a second daemon that reaps within
0.2 s. The pytest process never imports Airflow (it configures logging and structlog globally).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("airflow") is None:
    pytest.skip(
        "Airflow is not installed: `pip install -e './client[airflow]'` (make test does); "
        "skipped only where Airflow cannot be installed",
        allow_module_level=True,
    )

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client

from . import waiting

DAGS = Path(__file__).resolve().parent / "airflow_dags"
FINISHED = {"success", "failed"}

# The helper: migrates the database as `airflow db migrate` does (the same code, in this process) and
# says "migrated"; then one JSON request per line in, a DAG run to trigger or code to run, and "ok" or
# the error's traceback out, each reply a JSON string on a line. Airflow logs to stdout, so the replies
# go to a copy of the original stdout and fd 1 becomes stderr.
HELPER = r"""
import json, os, sys, traceback
reply = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
from airflow.__main__ import main
sys.argv = ["airflow", "db", "migrate"]
main()
reply.write(json.dumps("migrated") + "\n")
from airflow.api.common.trigger_dag import trigger_dag
from airflow.utils.types import DagRunTriggeredByType
for line in sys.stdin:
    req = json.loads(line)
    try:
        if "code" in req:
            exec(req["code"], {})
        else:
            trigger_dag(req["dag_id"], run_id=req["run_id"], conf=req["conf"], triggered_by=DagRunTriggeredByType.TEST)
        reply.write(json.dumps("ok") + "\n")
    except Exception:
        reply.write(json.dumps(traceback.format_exc()) + "\n")
"""
# After SIGTERM the services stop their work at once (the scheduler its executor, the API server its
# server), then spend seconds collecting their heaps as their interpreters exit: not waited for.
STOP_GRACE_S = 2.0


def eventually(check: Callable[[], Any], what: str, timeout: float = 30.0, why: Callable[[], str] = str) -> Any:
    return waiting.eventually(check, what, timeout, why)  # Airflow's steps take seconds


class Airflow:
    """The running Airflow and the two gpud daemons its tasks allocate from."""

    def __init__(self, home: Path, env: dict[str, str], gpud: DaemonProcess, reaping: DaemonProcess) -> None:
        self.home, self.env = home, env
        self.gpud, self.reaping = gpud, reaping
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.helper: subprocess.Popen[str] | None = None
        self.flags: list[Path] = []

    def start_helper(self) -> None:
        """Starts the helper, which has migrated the database when this returns."""
        with open(self.home / "helper.log", "wb") as log:
            self.helper = subprocess.Popen(
                [sys.executable, "-c", HELPER],
                env=self.env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        answer = self.answer()
        assert answer == "migrated", f"migrating Airflow's database: {answer}"

    def ask(self, request: dict[str, Any]) -> str:
        """The helper's answer to one request: "ok" or the error's traceback."""
        assert self.helper is not None and self.helper.stdin is not None
        self.helper.stdin.write(json.dumps(request) + "\n")
        self.helper.stdin.flush()
        return self.answer()

    def answer(self) -> str:
        assert self.helper is not None and self.helper.stdout is not None
        line = self.helper.stdout.readline()
        return str(json.loads(line)) if line else f"the helper ended:\n{self.tail('helper')}"

    def start(self, name: str, *args: str) -> None:
        with open(self.home / f"{name}.log", "wb") as out:  # the child keeps its own copy of the file
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "airflow", *args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def stop(self) -> None:
        """Ends every process at once: SIGTERM, then SIGKILL to what still runs after STOP_GRACE_S. Each
        service is a process group of its own, so its workers go with it."""
        procs: list[subprocess.Popen[Any]] = [*self.procs.values()]
        if self.helper is not None:
            self.helper.stdin.close()  # type: ignore[union-attr]  # it ends at the end of its input
            procs.append(self.helper)
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # --- Airflow's side ------------------------------------------------------------------------

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]] | None:
        """Read Airflow's database; None while a writer holds it."""
        try:
            with sqlite3.connect(f"file:{self.home / 'airflow.db'}?mode=ro", uri=True, timeout=1) as db:
                return db.execute(sql, args).fetchall()
        except sqlite3.OperationalError:
            return None

    def trigger(self, dag_id: str, out: Path, **conf: Any) -> str:
        run_id = f"t_{uuid.uuid4().hex[:10]}"
        if "flag" in conf:
            self.flags.append(Path(conf["flag"]))
        answer = self.ask({"dag_id": dag_id, "run_id": run_id, "conf": {"out": str(out), **conf}})
        assert answer == "ok", f"triggering {dag_id}: {answer}"
        return run_id

    def run_state(self, dag_id: str, run_id: str) -> str | None:
        rows = self.query("select state from dag_run where dag_id = ? and run_id = ?", dag_id, run_id)
        return rows[0][0] if rows else None

    def ti(self, dag_id: str, run_id: str, task_id: str) -> tuple[str, int] | None:
        """(state, try_number) of an unmapped task instance."""
        rows = self.query(
            "select state, try_number from task_instance where dag_id = ? and run_id = ? "
            "and task_id = ? and map_index = -1",
            dag_id,
            run_id,
            task_id,
        )
        return (rows[0][0], rows[0][1]) if rows and rows[0][0] else None

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 45.0) -> str:
        return str(
            eventually(
                lambda: (s := self.run_state(dag_id, run_id)) in FINISHED and s,
                f"DAG run {dag_id} {run_id} finished",
                timeout,
                self.diagnose,
            )
        )

    def log(self, dag_id: str, run_id: str, task_id: str, attempt: int) -> str:
        path = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        return (path / f"attempt={attempt}.log").read_text()

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.home / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def diagnose(self) -> str:
        return "\n".join(f"--- {name}\n{self.tail(name)}" for name in ("scheduler", "dag-processor", "helper"))

    # --- gpud's side ---------------------------------------------------------------------------

    def held(self, daemon: DaemonProcess | None = None) -> dict[str, Any]:
        with Client((daemon or self.gpud).socket, name="test-airflow") as c:
            reply = c.allocations()
        return {"held": {a.task_id: a for a in reply.allocations}, "waiting": list(reply.waiting)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    state = tmp_path_factory.mktemp("gpud-airflow")
    (state / "noreap.toml").write_text("reap_interval_s = 0\n")
    (state / "reap.toml").write_text("reap_interval_s = 0.2\n")
    gpud = DaemonProcess("--simulate", "2", "--config", str(state / "noreap.toml")).start()
    reaping = DaemonProcess("--simulate", "2", "--config", str(state / "reap.toml")).start()
    home = state / "home"
    home.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "6",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__API_AUTH__JWT_SECRET": uuid.uuid4().hex,
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",  # parsed once: the DAGs do not change
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.2",
            # The supervisor can miss its task's exit until its next heartbeat: 1 s instead of 5 s.
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
            "GPUD_SOCKET": gpud.socket,
            "GPUD_TEST_REAPING_SOCKET": reaping.socket,
        }
    )
    af = Airflow(home, env, gpud, reaping)
    try:
        af.start_helper()
        af.start("api-server", "api-server", "--apps", "execution", "--host", "127.0.0.1", "--port", str(port))
        af.start("scheduler", "scheduler", "--skip-serve-logs")  # the tests read the task logs' files
        af.start("dag-processor", "dag-processor")
        dags = {
            "gpud_one_gpu",
            "gpud_retry",
            "gpud_reaped",
            "gpud_fraction",
            "gpud_too_big",
            "gpud_short_wait",
            "gpud_classic",
            "gpud_timeout",
        }
        eventually(
            lambda: {r[0] for r in af.query("select dag_id from dag where not is_paused") or []} >= dags,
            "the DAGs parsed and unpaused",
            60,
            lambda: af.diagnose() + str(af.query("select stacktrace from import_error")),
        )
        eventually(
            lambda: af.query("select 1 from job where job_type = 'SchedulerJob' and state = 'running'"),
            "the scheduler running",
            60,
            af.diagnose,
        )
        eventually(
            lambda: _answers(f"http://127.0.0.1:{port}/execution/health"),
            "the execution API",
            60,
            lambda: af.tail("api-server"),
        )
        yield af
    finally:
        af.stop()
        gpud.cleanup()
        reaping.cleanup()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture
def af(airflow: Airflow) -> Iterator[Airflow]:
    """The module's Airflow; a test that fails still lets its waiting tasks end."""
    try:
        yield airflow
    finally:
        for flag in airflow.flags:
            flag.touch()
        airflow.flags.clear()


def record(out: Path, name: str, attempt: int = 1, af: Airflow | None = None, timeout: float = 45.0) -> Any:
    path = out / f"{name}.{attempt}.json"
    eventually(path.exists, f"the task wrote {path.name}", timeout, af.diagnose if af else str)
    return json.loads(path.read_text())


def gpud_id(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    return f"{dag_id}.{run_id}.{task_id}.{map_index}"  # the documented format


def pushed(allocation: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in allocation.items() if k not in ("id", "type")}


# --- the scenarios ------------------------------------------------------------------------------


def test_two_tasks_get_different_gpus_and_see_them(af: Airflow, tmp_path: Path) -> None:
    runs = {}
    for i in range(2):
        out = tmp_path / f"run{i}"
        out.mkdir()
        runs[af.trigger("gpud_one_gpu", out, then="flag", flag=str(tmp_path / "go"))] = out
    got = {run: record(out, "hold", af=af) for run, out in runs.items()}
    for run, r in got.items():
        alloc = r["allocation"]
        assert alloc["task_id"] == r["task_env"] == gpud_id("gpud_one_gpu", run, "hold")
        assert r["cuda"] == alloc["cuda_visible_devices"] == str(alloc["gpus"][0]) and r["order"] == "PCI_BUS_ID"
        assert alloc["owner_pid"] == r["pid"] and r["affinity"] == alloc["cpus"] and len(alloc["cpus"]) == 1
        assert r["xcom"] == pushed(alloc)
    assert sorted(r["cuda"] for r in got.values()) == ["0", "1"]
    assert sorted(r["affinity"][0] for r in got.values()) == [0, 1]
    table = subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", af.gpud.socket, "allocs"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for run in runs:  # gpuctl allocs names the DAG run and the task
        assert gpud_id("gpud_one_gpu", run, "hold") in table, table
    (tmp_path / "go").touch()
    assert all(af.wait_run("gpud_one_gpu", run) == "success" for run in runs)
    assert af.held()["held"] == {}


def test_a_third_task_waits_and_runs_when_one_ends(af: Airflow, tmp_path: Path) -> None:
    runs = {}
    for i in range(3):
        out = tmp_path / f"run{i}"
        out.mkdir()
        runs[af.trigger("gpud_one_gpu", out, then="flag", flag=str(out / "go"))] = out
    ids = {gpud_id("gpud_one_gpu", run, "hold"): run for run in runs}

    def two_hold_one_waits() -> dict[str, Any] | None:
        ledger = af.held()
        return ledger if len(ledger["held"]) == 2 and len(ledger["waiting"]) == 1 else None

    ledger = eventually(two_hold_one_waits, "two tasks hold the two GPUs and the third waits", 45, af.diagnose)
    (third,) = [ids[t] for t in ledger["waiting"]]
    assert af.ti("gpud_one_gpu", third, "hold") == ("running", 1)  # Airflow started it; gpud holds it back
    first = next(run for run in runs if run != third)
    gpu = record(runs[first], "hold")["allocation"]["gpus"]
    (runs[first] / "go").touch()
    assert af.wait_run("gpud_one_gpu", first) == "success"
    late = record(runs[third], "hold", af=af)
    assert late["allocation"]["gpus"] == gpu and late["cuda"] == str(gpu[0])
    assert late["allocation"]["waited_ms"] > 0
    for out in runs.values():
        (out / "go").touch()
    assert all(af.wait_run("gpud_one_gpu", run) == "success" for run in runs)
    assert af.held() == {"held": {}, "waiting": []}


def test_a_failing_task_releases_its_gpus(af: Airflow, tmp_path: Path) -> None:
    run = af.trigger("gpud_one_gpu", tmp_path, then="fail")
    assert record(tmp_path, "hold", af=af)["allocation"]["gpus"]
    assert af.wait_run("gpud_one_gpu", run) == "failed"
    assert "this task was asked to fail" in af.log("gpud_one_gpu", run, "hold", 1)
    assert af.held()["held"] == {}  # this daemon never reaps: the task freed it


def test_sigterm_from_airflow_releases_the_gpus(af: Airflow, tmp_path: Path) -> None:
    """SIGTERM to the task's supervisor, as a worker being shut down gets it: Airflow forwards it to the
    task, whose on_kill runs, and the wrapper stops the task and frees its allocation."""
    run = af.trigger("gpud_one_gpu", tmp_path, then="sleep")
    got = record(tmp_path, "hold", af=af)
    assert list(af.held()["held"]) == [gpud_id("gpud_one_gpu", run, "hold")]
    os.kill(got["ppid"], signal.SIGTERM)
    assert af.wait_run("gpud_one_gpu", run) == "failed"
    assert af.held()["held"] == {}  # never reaped: freed by the task itself
    assert "SIGTERM from Airflow: task gpud_one_gpu" in af.log("gpud_one_gpu", run, "hold", 1)


def test_a_task_past_its_execution_timeout_releases_its_gpus(af: Airflow, tmp_path: Path) -> None:
    run = af.trigger("gpud_timeout", tmp_path, then="sleep")
    assert record(tmp_path, "overrun", af=af)["allocation"]["gpus"]
    assert af.wait_run("gpud_timeout", run) == "failed"
    assert "AirflowTaskTimeout" in af.log("gpud_timeout", run, "overrun", 1)
    assert af.held()["held"] == {}


def test_a_task_killed_outright_has_its_allocation_reaped(af: Airflow, tmp_path: Path) -> None:
    run = af.trigger("gpud_reaped", tmp_path, then="sleep")
    got = record(tmp_path, "reaped", af=af)
    held = af.held(af.reaping)["held"]
    assert held[gpud_id("gpud_reaped", run, "hold")].owner_pid == got["pid"]
    os.kill(got["pid"], signal.SIGKILL)
    eventually(lambda: af.held(af.reaping)["held"] == {}, "the daemon reclaimed the killed task's allocation", 10)
    assert af.wait_run("gpud_reaped", run) == "failed"


def test_a_retry_after_a_crash_gets_a_working_allocation_and_nothing_leaks(af: Airflow, tmp_path: Path) -> None:
    run = af.trigger("gpud_retry", tmp_path, then="kill_first_try")
    first, second = record(tmp_path, "crash", 1, af), record(tmp_path, "crash", 2, af)
    assert first["task_env"] == second["task_env"] == gpud_id("gpud_retry", run, "crash_then_work")  # stable
    assert first["allocation"]["owner_pid"] == first["pid"]
    assert second["allocation"]["owner_pid"] == second["pid"] != first["pid"]  # its own, not the dead try's
    assert af.wait_run("gpud_retry", run) == "success"
    assert "left by an earlier try" in af.log("gpud_retry", run, "crash_then_work", 2)
    assert af.held()["held"] == {}  # this daemon never reaps: the crashed try's record did not outlive the run


def test_a_fractional_task_gets_its_share_as_limits(af: Airflow, tmp_path: Path) -> None:
    run = af.trigger("gpud_fraction", tmp_path)
    got = record(tmp_path, "fraction", af=af)
    assert got["allocation"]["share"] == 0.25
    assert got["core_limit"] == 25 and got["mem_limit"] == got["memory_total"] // 4, got
    assert "permission_denied" in got["refused"], got  # a ceiling the task cannot raise
    assert af.wait_run("gpud_fraction", run) == "success"
    assert af.held()["held"] == {}


def test_asking_for_more_than_the_node_has_fails_at_once_without_retries(af: Airflow, tmp_path: Path) -> None:
    run = af.trigger("gpud_too_big", tmp_path)
    assert af.wait_run("gpud_too_big", run) == "failed"
    assert af.ti("gpud_too_big", run, "three") == ("failed", 1)  # retries=2, none taken: they cannot help
    log = af.log("gpud_too_big", run, "three", 1)
    assert "GpuRequestInvalid" in log and "3 GPUs asked, this node has 2" in log, log[-3000:]
    assert gpud_id("gpud_too_big", run, "three") in log
    assert not (tmp_path / "too_big.1.json").exists()  # the task's code never ran


def test_a_task_short_of_gpus_fails_naming_what_was_short_and_its_retry_runs(af: Airflow, tmp_path: Path) -> None:
    with Client(af.gpud.socket, name="blocker") as blocker:
        blocker.allocate("blocker", gpus=2)
        try:
            run = af.trigger("gpud_short_wait", tmp_path)
            eventually(
                lambda: af.ti("gpud_short_wait", run, "impatient") == ("up_for_retry", 1),
                "the first try failed and waits for its retry",
                45,
                af.diagnose,
            )
        finally:
            blocker.release_allocation("blocker")
    log = af.log("gpud_short_wait", run, "impatient", 1)
    assert "GpuResourcesUnavailable" in log and "within 0.5 s" in log, log[-3000:]
    assert "1 whole GPU(s) asked, 0 entirely free" in log, log[-3000:]
    assert af.wait_run("gpud_short_wait", run) == "success"
    assert any((tmp_path / f"impatient.{n}.json").exists() for n in (2, 3))
    assert af.held()["held"] == {}


def test_classic_operator_mapped_tasks_and_the_environment_put_back(af: Airflow, tmp_path: Path) -> None:
    run = af.trigger("gpud_classic", tmp_path)
    assert af.wait_run("gpud_classic", run) == "success"
    inner = record(tmp_path, "inner")
    assert inner["during"]["cuda"] in ("0", "1") and len(inner["during"]["affinity"]) == 1
    assert inner["after"] == inner["before"] and inner["before"]["cuda"] is None  # put back after the call
    cuda, task, cpus = (tmp_path / "bash.txt").read_text().split()  # what BashOperator's bash saw
    assert cuda in ("0", "1") and task == gpud_id("gpud_classic", run, "echo") and cpus in ("0", "1")
    parts = [record(tmp_path, f"part{i}") for i in (0, 1)]
    assert [p["task_env"] for p in parts] == [gpud_id("gpud_classic", run, "part", i) for i in (0, 1)]
    assert all(p["allocation"]["share"] == 0.5 for p in parts)
    assert af.held()["held"] == {}


def test_task_ids_and_options_are_checked_where_the_dag_is_parsed(af: Airflow) -> None:
    """In the helper, a process with Airflow imported: importing gpud_client.airflow imports Airflow,
    which this process must not."""
    code = r"""
from gpud_client.airflow import GpuRequest, gpud_task_id
run = "manual__2026-11-24T00:31:20+00:00"
assert gpud_task_id("etl", run, "fit", 3) == f"etl.{run}.fit.3"
odd = gpud_task_id("etl", "my run #1", "fit")
assert odd.startswith("etl.my_run__1.fit.-1@") and odd != gpud_task_id("etl", "my run #2", "fit"), odd
long = gpud_task_id("d" * 300, "r", "t")
assert len(long) == 256 and long != gpud_task_id("d" * 301, "r", "t")
for bad, said in [({"gpus": 1.5}, "whole GPUs or a fraction"), ({"strategy": "nope"}, "Strategy"),
                  ({"priority": "urgent"}, "PriorityClass"), ({"cpus": -1}, "cpus")]:
    try:
        GpuRequest(**bad)
    except ValueError as exc:
        assert said in str(exc), (bad, exc)
    else:
        raise AssertionError(f"accepted {bad}")
"""
    answer = af.ask({"code": code})
    assert answer == "ok", answer[-3000:]
