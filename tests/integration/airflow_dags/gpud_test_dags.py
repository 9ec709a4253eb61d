"""The DAGs tests/integration/test_airflow.py runs through a real Airflow scheduler.

Every task writes what it was given (pid, try, environment, affinity, allocation, XCom) to
``{conf.out}/{name}.{try}.json`` and then does what ``conf.then`` says: ``done``, ``fail``,
``flag`` (wait for the file ``conf.flag``), ``sleep`` (until killed) or ``kill_first_try``
(SIGKILL itself on try 1). The gpud sockets come from the Airflow processes' environment:
``GPUD_SOCKET`` is a daemon that never reaps, so every release seen there is the wrapper's;
``GPUD_TEST_REAPING_SOCKET`` reaps dead owners within a fraction of a second.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import dag, get_current_context, task

from gpud_client import Client, PermissionDenied
from gpud_client.airflow import XCOM_KEY, GpuResourcesMixin, current_allocation, gpu_resources

REAPING = os.environ.get("GPUD_TEST_REAPING_SOCKET")
DEADLINE_S = 90  # no test task outlives this, even if its test died


def record(name: str, **extra: Any) -> dict[str, Any]:
    ctx = get_current_context()
    ti = ctx["ti"]
    data = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "try": ti.try_number,
        "run_id": ti.run_id,
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "task_env": os.environ.get("GPUD_TASK_ID"),
        "order": os.environ.get("CUDA_DEVICE_ORDER"),
        "affinity": sorted(os.sched_getaffinity(0)),
        **extra,
    }
    out = Path(ctx["dag_run"].conf["out"])
    tmp = out / f".{name}.{ti.try_number}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(out / f"{name}.{ti.try_number}.json")  # whole or not at all: the test polls for it
    return data


def allocated(name: str, **extra: Any) -> dict[str, Any]:
    ti = get_current_context()["ti"]
    pushed = ti.xcom_pull(task_ids=ti.task_id, key=XCOM_KEY, map_indexes=ti.map_index)
    return record(name, allocation=msgspec.to_builtins(current_allocation()), xcom=pushed, **extra)


def then() -> None:
    ctx = get_current_context()
    conf, ti = ctx["dag_run"].conf, ctx["ti"]
    what = conf.get("then", "done")
    deadline = time.monotonic() + DEADLINE_S
    if what == "fail":
        raise RuntimeError("this task was asked to fail")
    if what == "kill_first_try" and ti.try_number == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    # The task's work, not a wait on the test: until the test's flag file exists ("flag"), or until
    # the task is killed or timed out ("sleep"), another process's doing either way.
    while what in ("flag", "sleep") and time.monotonic() < deadline:
        if what == "flag" and os.path.exists(conf["flag"]):
            return
        time.sleep(0.05)


ARGS: dict[str, Any] = {"retries": 0}


@dag(schedule=None, catchup=False, default_args=ARGS, max_active_runs=8)
def gpud_one_gpu() -> None:
    @task
    @gpu_resources(gpus=1, cpus=1, wait=60)
    def hold() -> None:
        allocated("hold")
        then()

    hold()


@dag(schedule=None, catchup=False, default_args={"retries": 1, "retry_delay": timedelta(seconds=1)})
def gpud_retry() -> None:
    @task
    @gpu_resources(gpus=1)
    def crash_then_work() -> None:
        allocated("crash")
        then()

    crash_then_work()


@dag(schedule=None, catchup=False, default_args=ARGS)
def gpud_reaped() -> None:
    @task
    @gpu_resources(gpus=1, socket=REAPING)
    def hold() -> None:
        allocated("reaped")
        then()

    hold()


@dag(schedule=None, catchup=False, default_args=ARGS)
def gpud_fraction() -> None:
    @task
    @gpu_resources(gpus=0.25)
    def limited() -> None:
        gpu = current_allocation().gpus[0]
        with Client(name="fraction-probe") as client:  # GPUD_SOCKET: the daemon of the allocation
            session = client.session(gpu)
            try:
                session.set_limits(core_limit=100)
                refused = ""
            except PermissionDenied as exc:
                refused = str(exc)
            allocated(
                "fraction",
                core_limit=session.core_limit,
                mem_limit=session.mem_limit,
                memory_total=session.memory_total_bytes,
                refused=refused,
            )
            session.close()

    limited()


@dag(schedule=None, catchup=False, default_args=ARGS)
def gpud_timeout() -> None:
    @task(execution_timeout=timedelta(seconds=1))
    @gpu_resources(gpus=1)
    def overrun() -> None:
        allocated("overrun")
        then()

    overrun()


RETRY_SOON: dict[str, Any] = {"retries": 2, "retry_delay": timedelta(seconds=1)}


@dag(schedule=None, catchup=False, default_args=RETRY_SOON)  # retries that must not happen
def gpud_too_big() -> None:
    @task
    @gpu_resources(gpus=3)
    def three() -> None:
        record("too_big")

    three()


@dag(schedule=None, catchup=False, default_args=RETRY_SOON)  # retries that must happen
def gpud_short_wait() -> None:
    @task
    @gpu_resources(gpus=1, wait=0.5)
    def impatient() -> None:
        record("impatient")

    impatient()


class GpuBashOperator(GpuResourcesMixin, BashOperator):
    pass


@dag(schedule=None, catchup=False, default_args=ARGS)
def gpud_classic() -> None:
    @task
    def inner_call() -> None:
        """A decorated function called inside a task: the environment and affinity are back after it."""
        before = {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "affinity": sorted(os.sched_getaffinity(0))}

        @gpu_resources(gpus=1, cpus=1)
        def inside() -> dict[str, Any]:
            return {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "affinity": sorted(os.sched_getaffinity(0))}

        during = inside()
        after = {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "affinity": sorted(os.sched_getaffinity(0))}
        record("inner", before=before, during=during, after=after)

    @task
    @gpu_resources(gpus=0.5)
    def part(i: int) -> None:
        allocated(f"part{i}")

    echo = GpuBashOperator(
        task_id="echo",
        gpus=1,
        cpus=1,
        bash_command='echo "$CUDA_VISIBLE_DEVICES $GPUD_TASK_ID $GPUD_CPUS" > "{{ dag_run.conf["out"] }}/bash.txt"',
    )
    inner_call() >> echo >> part.expand(i=[0, 1])


gpud_one_gpu()
gpud_retry()
gpud_reaped()
gpud_fraction()
gpud_timeout()
gpud_too_big()
gpud_short_wait()
gpud_classic()
