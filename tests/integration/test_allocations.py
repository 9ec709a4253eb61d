"""Allocations end to end on a real daemon: durability across a SIGKILL and a restart, gpuctl alloc
(its exports, its JSON, its own refusals), the shell recipe and the asyncio client. The rules
checked through the protocol (retries, waits, reaping, tenants, ceilings, refusals, the outcome
counter) are in tests/daemon/test_allocations.py, in-process on a fake clock."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import AsyncClient, Client, ProtocolError
from gpud_client import protocol as p


def gpuctl(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_every_acknowledged_allocation_survives_a_sigkill(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "4x16GiB")
    acknowledged = {}
    with Client(d.socket) as c:
        for i in range(40):
            a = c.allocate(f"task-{i}", gpus=0.1 if i % 2 else 0.05)
            acknowledged[a.task_id] = (a.gpus, a.share)
        c.release_allocation("task-3")
        del acknowledged["task-3"]
    d.stop(sig=signal.SIGKILL)  # right after the last acknowledgement
    d.start()
    with Client(d.socket) as c:
        got = {a.task_id: (a.gpus, a.share) for a in c.allocations().allocations}
    assert got == acknowledged


def test_a_restart_restores_allocations_and_their_accounting(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "2x16GiB")
    with Client(d.socket) as c:
        c.allocate("whole", gpus=1, cpus=1)
        c.allocate("frac", gpus=0.5)
    d.stop()
    d.start()
    with Client(d.socket) as c:
        reply = c.allocations()
        assert [g.allocated for g in reply.gpus] == [1.0, 0.5]
        assert len(reply.cpus_free) == reply.cpus_total - 1
        with pytest.raises(ProtocolError) as err:
            c.allocate("more", gpus=1)
        assert err.value.code == "insufficient" and "entirely free" in err.value.message
        assert c.allocate("whole", gpus=1, cpus=1).gpus == [0]  # idempotent across the restart


def test_gpuctl_alloc_prints_exports_a_shell_can_eval(daemon: DaemonProcess) -> None:
    script = f"""
set -e
vars=$({sys.executable} -m gpud.tools.gpuctl --socket {daemon.socket} alloc --task etl-42 --gpus 1) || exit 1
eval "$vars"
echo "$CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER $GPUD_TASK_ID $GPUD_GPU_SHARE"
{sys.executable} -m gpud.tools.gpuctl --socket {daemon.socket} free --task etl-42
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "0 PCI_BUS_ID etl-42 1"
    assert "freed" in out.stdout
    assert json.loads(gpuctl(daemon, "allocs", "--json").stdout)["allocations"] == []


def test_gpuctl_alloc_json_carries_the_same_environment(daemon: DaemonProcess) -> None:
    out = gpuctl(daemon, "alloc", "--task", "etl-43", "--gpus", "0.5", "--cpus", "1", "--json")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["env"] == {
        "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPUD_TASK_ID": "etl-43",
        "GPUD_GPU_SHARE": "0.5",
        "GPUD_CPUS": str(answer["cpus"][0]),
    }


def test_bad_allocations_are_refused_by_gpuctl_and_change_nothing(daemon: DaemonProcess) -> None:
    """What gpuctl alloc refuses itself, before it asks (what the daemon refuses is checked in-process,
    in tests/daemon/test_allocations.py)."""
    with Client(daemon.socket) as c:
        c.allocate("keep", gpus=0.5)
    with Client(daemon.socket) as c:  # listed as any client sees it: its holder has gone
        before = c.allocations()
    for args, needle in [
        (["--gpus", "0"], "argument --gpus: 0 asks for no GPU"),
        (["--gpus=-1"], "argument --gpus: must be a whole number of GPUs >= 1 or a fraction 0 < x < 1"),
        (["--gpus", "1.5"], "argument --gpus: must be a whole number of GPUs >= 1"),
        (["--gpus", "0.00001"], "finer than 1/10000"),
    ]:
        out = gpuctl(daemon, "alloc", "--task", "bad", *args)
        assert out.returncode != 0 and needle in out.stderr, (args, out.stderr)
        assert out.stdout == ""  # nothing for eval to run
    with Client(daemon.socket) as c:
        after = c.allocations()
    assert msgspec.structs.replace(after, id=0) == msgspec.structs.replace(before, id=0)


RECIPE = Path(__file__).resolve().parents[2] / "examples" / "alloc_recipe.sh"


@pytest.mark.parametrize("page", ["README.md", "docs/allocations.md"])
def test_the_docs_quote_the_recipe_as_it_is(page: str) -> None:
    """The README's allocation example and the allocations page quote the recipe these tests run."""
    assert f"```sh\n{RECIPE.read_text()}```\n" in (RECIPE.parents[1] / page).read_text()


def run_recipe(d: DaemonProcess, task: str, *command: str) -> subprocess.CompletedProcess[str]:
    """The recipe as written, with this venv's gpuctl first on the PATH and the daemon's socket."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GPUD_SOCKET": d.socket,
    }
    return subprocess.run(["bash", str(RECIPE), task, *command], capture_output=True, text=True, timeout=60, env=env)


SHOW = (
    "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['CUDA_DEVICE_ORDER'], "
    "os.environ['GPUD_CPUS'], sorted(os.sched_getaffinity(0)))"
)


def test_the_recipe_runs_the_command_on_its_devices_and_frees_them(daemon: DaemonProcess) -> None:
    out = run_recipe(daemon, "etl-7", sys.executable, "-c", SHOW)
    assert out.returncode == 0, out.stderr
    cuda, order, cpus, affinity = out.stdout.split(" ", 3)
    assert (cuda, order) == ("0", "PCI_BUS_ID")
    assert affinity.strip() == f"[{int(cpus)}]"  # taskset -c "$GPUD_CPUS"
    assert json.loads(gpuctl(daemon, "allocs", "--json").stdout)["allocations"] == []
    out = run_recipe(daemon, "etl-8", "sh", "-c", "exit 3")
    assert out.returncode == 3  # the command's status, and freed all the same
    assert json.loads(gpuctl(daemon, "allocs", "--json").stdout)["allocations"] == []


def test_the_recipe_stops_when_the_node_is_full(daemon: DaemonProcess, tmp_path: Path) -> None:
    with Client(daemon.socket) as c:
        c.allocate("hog", gpus=2)
    ran = tmp_path / "ran"
    out = run_recipe(daemon, "etl-9", "touch", str(ran))
    assert out.returncode != 0 and "insufficient" in out.stderr, out.stderr
    assert not ran.exists()  # never on every GPU with CUDA_VISIBLE_DEVICES unset
    assert [a["task_id"] for a in json.loads(gpuctl(daemon, "allocs", "--json").stdout)["allocations"]] == ["hog"]


def test_the_asyncio_client_allocates_too(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket) as c:
            a = await c.allocate("async-task", gpus=0.5, cpus=1, strategy="best_fit")
            assert a.share == 0.5 and len(a.cpus) == 1
            assert [x.task_id for x in (await c.allocations()).allocations] == ["async-task"]
            await c.release_allocation("async-task")
            assert (await c.allocations()).allocations == []

    asyncio.run(main())


def test_a_fractions_memory_ceiling_survives_a_restart_and_caps_its_sessions(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory("--simulate", "2x16GiB")
    with Client(d.socket) as c:
        assert c.allocate("mem", gpus=0.25, prefer=[1], memory_bytes=3 * 2**30).memory_bytes == 3 * 2**30
        assert c.allocate("share", gpus=0.25).memory_bytes == 4 * 2**30, "none asked: its share of the GPU's"
    d.stop(signal.SIGKILL)
    d.start()
    with Client(d.socket) as c:
        alloc = {a.task_id: a for a in c.allocations().allocations}["mem"]
        assert alloc.memory_bytes == 3 * 2**30
        attached = c.call(p.Attach(id=0, gpu=1, task_id="mem"))
        assert (attached.core_limit, attached.mem_limit) == (25, 3 * 2**30)
