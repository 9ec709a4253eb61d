"""``gpud_client.run.pycall``: a Python call as the program of a run, on an allocation the caller holds.

Real gpud, real runs (``--pause signal``), plain pickle: the called functions are this module's,
which the child imports by name from the caller's ``sys.path``. The Ray and Airflow integrations'
use of it is tested in test_ray_pause.py and test_airflow_pause.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.run import parse
from gpud_client.run.pycall import CallFailed, Place, call_under_run, check_pause
from gpud_client.runinfo import COMMAND, PID

from .waiting import eventually


@pytest.fixture
def place(daemon: DaemonProcess) -> Iterator[Place]:
    """A run's place on GPU 1, in a half-GPU allocation this process holds."""
    with Client(daemon.socket, name="holder") as c:
        c.allocate("job-1", gpus=0.5, prefer=[1])
        yield Place(socket=daemon.socket, gpu=1, task_id="job-1", pause="signal", name="pycall-test")


def what_the_child_sees(x: int, *, y: int, flag: str) -> dict[str, Any]:
    while not os.path.exists(flag):  # the test's doing: it looks at the run meanwhile
        time.sleep(0.01)
    return {
        "sum": x + y,
        "pid": os.getpid(),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "marker": os.environ.get("PYCALL_TEST_MARKER"),
    }


def raise_value_error() -> None:
    raise ValueError("shard 3 is corrupt")


def exit_outright() -> None:
    os._exit(7)


def return_a_lock() -> Any:
    return threading.Lock()


def test_the_call_runs_in_a_child_under_the_run_and_returns_its_value(
    place: Place, daemon: DaemonProcess, tmp_path: Path
) -> None:
    flag = tmp_path / "go"
    got: dict[str, Any] = {}
    kwargs = {"y": 3, "flag": str(flag)}
    env = {"PYCALL_TEST_MARKER": "m"}
    caller = threading.Thread(  # any thread may call: the run takes no signal handler
        target=lambda: got.update(call_under_run(place, what_the_child_sees, (2,), kwargs, pickler="pickle", env=env))
    )
    caller.start()
    try:
        with Client(daemon.socket, name="test") as c:
            run = eventually(
                lambda: next(
                    (x for x in c.call(p.ListClients(id=0)).clients if x.name == "pycall-test" and x.sessions), None
                ),
                "the run and its session",
            )
            (session,) = run.sessions
            assert session.gpu == 1 and session.core_ceiling == 50, session  # the allocation caps it
            assert "gpud_client.run.pycall" in run.labels[COMMAND], run.labels
    finally:
        flag.touch()
        caller.join()
    assert got["sum"] == 5 and got["pid"] == int(run.labels[PID]) != os.getpid(), got
    assert got["cuda"] == "1" and got["marker"] == "m", got  # the run's GPU; env set in the child
    with Client(daemon.socket, name="test") as c:
        assert [a.task_id for a in c.allocations().allocations] == ["job-1"]  # the caller's, not the run's to free


def test_the_calls_exception_is_raised_with_the_childs_traceback(place: Place) -> None:
    with pytest.raises(ValueError, match="shard 3 is corrupt") as caught:
        call_under_run(place, raise_value_error, pickler="pickle")
    (note,) = caught.value.__notes__
    assert "in the child process" in note and "raise_value_error" in note, note


def test_a_child_that_ends_without_a_result_is_call_failed(place: Place) -> None:
    with pytest.raises(CallFailed, match="ended with status 7 and no result") as caught:
        call_under_run(place, exit_outright, pickler="pickle")
    assert caught.value.status == 7


def test_a_result_that_cannot_be_pickled_back_is_call_failed(place: Place) -> None:
    with pytest.raises(CallFailed, match="result could not be pickled back"):
        call_under_run(place, return_a_lock, pickler="pickle")


def test_a_run_that_gpud_refuses_is_call_failed_with_its_words(place: Place) -> None:
    nowhere = Place(socket=place.socket, gpu=7, task_id="job-1", pause="signal")
    with pytest.raises(CallFailed, match="status 1 and no result: gpud-run: .*7"):
        call_under_run(nowhere, raise_value_error, pickler="pickle")


def test_a_function_of_a_module_loaded_from_a_file_unpickles_in_the_child(place: Place, tmp_path: Path) -> None:
    """As Airflow loads a DAG file: under a name no sys.path entry has. The child loads it from its file."""
    source = tmp_path / "dag_file.py"
    source.write_text("import os\ndef helper(n):\n    return n * 2, os.getpid()\n")
    spec = importlib.util.spec_from_file_location("unusual_prefix_0123_dag_file", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        doubled, pid = call_under_run(place, module.helper, (21,), pickler="pickle")
    finally:
        del sys.modules[spec.name]
    assert doubled == 42 and pid != os.getpid()


# --- without gpud ---------------------------------------------------------------------------------


def test_a_place_is_a_run_on_the_allocation_as_gpud_run_parses_it() -> None:
    place = Place(
        socket="/s.sock", gpu=2, task_id="ray.01.task.ab", pause="cuda", name="n", mem_limit=2**30, priority=7
    )
    command = place.command(["bash", "-c", "echo hi"])
    assert command[:3] == [sys.executable, "-m", "gpud_client.run"]
    opts = parse(command[3:])
    assert (opts.socket, opts.gpu, opts.task, opts.pause, opts.name) == ("/s.sock", 2, "ray.01.task.ab", "cuda", "n")
    assert (opts.gpus, opts.mem_limit, opts.priority, opts.command) == (None, 2**30, 7, ["bash", "-c", "echo hi"])


@pytest.mark.parametrize("pause", [None, "auto", "cuda", "signal", "cgroup"])
def test_a_pause_backend_or_none_is_accepted(pause: str | None) -> None:
    check_pause(pause, "here")


@pytest.mark.parametrize("pause", ["sigstop", "", 1, True])
def test_anything_else_is_refused_naming_the_choices(pause: object) -> None:
    with pytest.raises(ValueError, match=r"here: pause must be one of 'auto', 'cuda', 'signal', 'cgroup' \(or None"):
        check_pause(pause, "here")


def test_the_module_imports_without_ray_dill_or_airflow() -> None:
    code = (
        "import sys\n"
        "for m in ('ray', 'dill', 'airflow', 'cloudpickle'):\n"
        "    sys.modules[m] = None\n"
        "import gpud_client.run.pycall\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
