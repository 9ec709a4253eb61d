"""The DAG tests/integration/test_airflow_preempt.py runs: a best-effort task preempted with a checkpoint.

``gpud_preempt_checkpoint``: one whole GPU at priority best-effort with ``on_preempt="checkpoint"``, from
the daemon that ``GPUD_TEST_PREEMPT_SOCKET`` names (the test's own; unset where the other tests' Airflow
parses this file). Its work is steps, the last one saved to ``{conf.out}/progress.json`` after each.
A fresh try steps until gpud's checkpoint signal (SIGUSR1) arrives, saves and returns; a try that
starts with GPUD_RESUME=1 goes on from the saved step and ends 3 steps later. Each try writes what it
started with to ``{conf.out}/train.{try}.json``, and what it saved when told to ``saved.{try}.json``.
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
from airflow.sdk import dag, get_current_context, task

from gpud_client import preempted
from gpud_client.airflow import current_allocation, gpu_resources

PREEMPT_SOCKET = os.environ.get("GPUD_TEST_PREEMPT_SOCKET")
DEADLINE_S = 90  # no try outlives this, even if its test died


def write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)  # whole or not at all: the test polls for it


@dag(schedule=None, catchup=False, default_args={"retries": 1, "retry_delay": timedelta(seconds=1)})
def gpud_preempt_checkpoint() -> None:
    @task
    @gpu_resources(gpus=1, priority="best-effort", on_preempt="checkpoint", wait=60, socket=PREEMPT_SOCKET)
    def train() -> dict[str, int]:
        ctx = get_current_context()
        out, attempt = Path(ctx["dag_run"].conf["out"]), ctx["ti"].try_number
        progress = out / "progress.json"
        resumed = os.environ.get("GPUD_RESUME") == "1"
        step = json.loads(progress.read_text())["step"] if resumed else 0
        told: list[int] = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: told.append(signum))  # gpud's checkpoint signal
        allocation = msgspec.to_builtins(current_allocation())
        keys = ("GPUD_ON_PREEMPT", "GPUD_PREEMPT_GRACE_S", "GPUD_PREEMPT_SIGNAL", "GPUD_RESUME")
        env = {k: os.environ.get(k) for k in keys}
        write(out / f"train.{attempt}.json", {"step": step, "env": env, "allocation": allocation})
        deadline, end = time.monotonic() + DEADLINE_S, step + 3 if resumed else None
        while step != end and time.monotonic() < deadline:  # the work: steps, until told to leave
            if told:
                write(out / f"saved.{attempt}.json", {"step": step, "requested": preempted.requested()})
                return {"step": step}
            step += 1
            write(progress, {"step": step})
            time.sleep(0.05)
        return {"step": step}

    train()


gpud_preempt_checkpoint()
