"""The DAGs tests/integration/test_airflow_pause.py runs: ``pause=`` on a BashOperator and on a callable.

``gpud_pause_bash``: a quarter-GPU BashOperator whose command runs under gpud-run; it writes its
shell's pid to ``{conf.out}/bash.pid``, burns CPU until the file ``conf.flag`` exists (the
test's doing) and prints its last line, the task's return value. ``gpud_pause_call``: a
half-GPU function run in a child process under gpud-run, which returns what it saw there, and a
quarter-GPU one that raises.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import dag, task

from gpud_client.airflow import GpuResourcesMixin, current_allocation, gpu_resources


class GpuBashOperator(GpuResourcesMixin, BashOperator):
    pass


def total(n: int) -> int:
    """A function of the DAG file's module, which the child imports from the DAG file."""
    return sum(range(n))


@dag(schedule=None, catchup=False, default_args={"retries": 0})
def gpud_pause_bash() -> None:
    GpuBashOperator(
        task_id="burn",
        gpus=0.25,
        pause="signal",
        bash_command='echo $$ > "{{ dag_run.conf["out"] }}/bash.pid"; '
        'while [ ! -e "{{ dag_run.conf["flag"] }}" ]; do :; done; '
        'echo "burnt $GPUD_TASK_ID on $CUDA_VISIBLE_DEVICES"',
    )


@dag(schedule=None, catchup=False, default_args={"retries": 0})
def gpud_pause_call() -> None:
    @task
    @gpu_resources(gpus=0.5, pause="signal")  # its child imports Airflow, at half speed: the import runs paused too
    def measure(n: int) -> dict[str, Any]:
        allocation = current_allocation()  # answers in the child as in the task's process
        return {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "task_id": allocation.task_id,
            "share": allocation.share,
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "sum": total(n),
        }

    @task
    @gpu_resources(gpus=0.25, pause="signal")
    def refuse() -> None:
        raise ValueError("batch 3 is corrupt")

    measure(1000)
    refuse()


gpud_pause_bash()
gpud_pause_call()
