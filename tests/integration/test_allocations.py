"""Allocations end to end: durability across kills, waits, reaping, tenants, the bridge to sessions."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import AsyncClient, Client, PermissionDenied, ProtocolError
from gpud_client import protocol as p

from .waiting import eventually
from .wire import as_nobody, connect, expect


def gpuctl(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, *args], capture_output=True, text=True, timeout=30
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
    assert answer["env"] == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "GPUD_TASK_ID": "etl-43",
                             "GPUD_GPU_SHARE": "0.5", "GPUD_CPUS": str(answer["cpus"][0])}


def test_asking_again_for_a_task_id_with_other_terms_is_refused(daemon: DaemonProcess) -> None:
    first = gpuctl(daemon, "alloc", "--task", "etl-1", "--gpus", "1", "--cpus", "1")
    assert first.returncode == 0, first.stderr
    again = gpuctl(daemon, "alloc", "--task", "etl-1", "--gpus", "1", "--cpus", "1", "--strategy", "least_loaded")
    assert (again.returncode, again.stdout) == (0, first.stdout)  # a retry: the same answer
    before = json.loads(gpuctl(daemon, "allocs", "--json").stdout)
    out = gpuctl(daemon, "alloc", "--task", "etl-1", "--gpus", "2", "--cpus", "1")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr.startswith("gpuctl: invalid: task 'etl-1' already holds 1 GPU and 1 CPU core; "
                                 "this request asks for 2 GPUs ("), out.stderr
    out = gpuctl(daemon, "alloc", "--task", "etl-1", "--gpus", "1", "--cpus", "1", "--priority", "high",
                 "--owner-pid", str(os.getpid()))
    assert out.returncode == 1 and "this request asks for priority 75 and owner pid" in out.stderr, out.stderr
    assert json.loads(gpuctl(daemon, "allocs", "--json").stdout) == before  # nothing changed


RECIPE = Path(__file__).resolve().parents[2] / "examples" / "alloc_recipe.sh"


@pytest.mark.parametrize("page", ["README.md", "docs/allocations.md"])
def test_the_docs_quote_the_recipe_as_it_is(page: str) -> None:
    """The README's allocation example and the allocations page quote the recipe these tests run."""
    assert f"```sh\n{RECIPE.read_text()}```\n" in (RECIPE.parents[1] / page).read_text()


def run_recipe(d: DaemonProcess, task: str, *command: str) -> subprocess.CompletedProcess[str]:
    """The recipe as written, with this venv's gpuctl first on the PATH and the daemon's socket."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "GPUD_SOCKET": d.socket}
    return subprocess.run(["bash", str(RECIPE), task, *command], capture_output=True, text=True, timeout=60, env=env)


SHOW = ("import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['CUDA_DEVICE_ORDER'], "
        "os.environ['GPUD_CPUS'], sorted(os.sched_getaffinity(0)))")


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


def test_waiters_are_served_in_priority_order(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        c.allocate("a", gpus=1)
        c.allocate("b", gpus=1)
        results: dict[str, p.Allocated] = {}

        def wait(task: str, priority: str) -> None:
            with Client(daemon.socket) as w:
                results[task] = w.allocate(task, gpus=1, priority=priority, wait_ms=5000)

        low = threading.Thread(target=wait, args=("low", "best-effort"))
        low.start()
        eventually(lambda: c.allocations().waiting == ["low"], "low waits")  # it came first
        high = threading.Thread(target=wait, args=("high", "production"))
        high.start()
        eventually(lambda: c.allocations().waiting == ["high", "low"], "high waits before low")
        c.release_allocation("a")
        high.join(5)
        assert "high" in results and "low" not in results
        assert results["high"].priority == 100 and results["high"].waited_ms > 0
        c.release_allocation("b")
        low.join(5)
        assert results["low"].priority == 10


def test_a_wait_expires_with_a_clear_answer(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        c.allocate("all", gpus=2)
        t0 = time.monotonic()
        with pytest.raises(ProtocolError) as err:
            c.allocate("late", gpus=1, wait_ms=300)
        assert err.value.code == "insufficient" and "waited the full wait_ms" in err.value.message
        assert time.monotonic() - t0 >= 0.28
        assert c.allocations().waiting == []


def test_allocations_of_dead_owners_are_reclaimed(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    cfg = tmp_path / "gpud.toml"
    cfg.write_text("reap_interval_s = 0.2\n")
    d = daemon_factory("--simulate", "1", "--config", str(cfg))
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with Client(d.socket) as c:
            c.allocate("owned", gpus=1, owner_pid=owner.pid)
            c.allocate("kept", gpus=0, cpus=1)
            time.sleep(0.5)  # not a wait: two reap passes run meanwhile, and a live owner's allocation stays
            assert {a.task_id for a in c.allocations().allocations} == {"owned", "kept"}
            owner.kill()
            owner.wait()
            eventually(lambda: "owned" not in {a.task_id for a in c.allocations().allocations}, "owned is reaped")
        assert '"allocation_reaped"' in d.log()
    finally:
        owner.kill()
        owner.wait()


def test_a_fractional_allocation_is_enforced_on_its_sessions(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, name="ray-task") as c:
        a = c.allocate("ray-task-7", gpus=0.25)
        s = c.session(a.gpus[0])  # no task id: matched by the allocating uid all the same
        assert (s.core_limit, s.mem_limit) == (25, 16 * 2**30 // 4)
        other_gpu = c.session(1 - a.gpus[0], framework_hooks=False)  # nothing allocated there: no limits
        assert (other_gpu.core_limit, other_gpu.mem_limit) == (100, None)
        t = c.call(p.Attach(id=0, gpu=a.gpus[0], task_id="ray-task-7"))
        assert (t.core_limit, t.mem_limit) == (25, 16 * 2**30 // 4)
        lower = c.call(p.Attach(id=0, gpu=a.gpus[0], task_id="ray-task-7", core_limit=10, mem_limit=2**30))
        assert (lower.core_limit, lower.mem_limit) == (10, 2**30)  # it asked for less
    with Client(daemon.socket, name="labelled", labels={"task_id": "ray-task-7"}) as c2:
        s2 = c2.session(0, framework_hooks=False)
        assert s2.core_limit == 25


def test_a_session_cannot_lift_its_own_allocations_ceiling_even_as_root(daemon: DaemonProcess) -> None:
    """These tests run as root, an admin: the task a share caps must still not lift it itself; an
    admin lifts it from another connection (gpuctl limit)."""
    with Client(daemon.socket, name="capped") as c:
        a = c.allocate("capped-task", gpus=0.25, owner_pid=os.getpid())
        s = c.session(a.gpus[0], task_id="capped-task", framework_hooks=False)
        with pytest.raises(PermissionDenied, match="ceiling of 25 %"):
            s.set_limits(core_limit=100)
        with pytest.raises(PermissionDenied, match="ceiling of 25 %"):
            c.set_limits(core_limit=50)  # all of the client's own sessions: the same
        assert s.core_limit == 25
        with Client(daemon.socket, name="operator") as admin:
            assert admin.set_limits("capped", core_limit=60) == [s.id]
        eventually(lambda: s.core_limit == 60, "LIMITS_CHANGED is pushed")
        assert s.core_limit == 60


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "0"], "argument --gpus: 0 asks for no GPU"),
        (["--gpus=-1"], "argument --gpus: must be a whole number of GPUs >= 1 or a fraction 0 < x < 1"),
        (["--gpus", "1.5"], "argument --gpus: must be a whole number of GPUs >= 1"),
        (["--gpus", "3"], "this node has 2"),
        (["--gpus", "1", "--cpus", "100000"], "CPU cores asked"),
        (["--gpus", "1", "--prefer", "5"], "unknown GPU 5"),
        (["--gpus", "1", "--tenant", "acme"], "unknown tenant 'acme'"),
        (["--gpus", "0.00001"], "finer than 1/10000"),
    ],
)
def test_bad_allocations_are_refused_and_change_nothing(daemon: DaemonProcess, args: list[str], needle: str) -> None:
    with Client(daemon.socket) as c:
        c.allocate("keep", gpus=0.5)
        before = c.allocations()
    out = gpuctl(daemon, "alloc", "--task", "bad", *args)
    assert out.returncode != 0 and needle in out.stderr, out.stderr
    assert out.stdout == ""  # nothing for eval to run
    with Client(daemon.socket) as c:
        after = c.allocations()
    assert msgspec.structs.replace(after, id=0) == msgspec.structs.replace(before, id=0)


def test_unknown_strategy_is_refused_on_the_wire(daemon: DaemonProcess) -> None:
    conn = connect(daemon)
    conn.send_raw(p.frame(msgspec.msgpack.encode({"type": "ALLOCATE", "id": 3, "task_id": "x", "strategy": "worst"})))
    err = expect(conn, p.Error)
    assert err.code == "invalid" and "$.strategy" in err.message


def test_tenants_quota_and_freeing_another_tenants_task(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    cfg = tmp_path / "gpud.toml"
    cfg.write_text("[tenants.vision]\ngpus = 1\nborrow = 0\nuids = [0]\n[tenants.speech]\ngpus = 1\nuids = [65534]\n")
    d = daemon_factory("--simulate", "2", "--config", str(cfg))
    with Client(d.socket) as c:
        c.allocate("v1", gpus=1, tenant="vision")
        with pytest.raises(ProtocolError, match="tenant 'vision' uses 1 of its 1 GPUs"):
            c.allocate("v2", gpus=1, tenant="vision")
    def ask() -> str:
        with Client(d.socket) as nobody:
            answers = []
            try:
                nobody.release_allocation("v1")
                answers.append("freed")
            except PermissionDenied as exc:
                answers.append(str(exc.code))
            try:
                nobody.allocate("x", gpus=1, tenant="vision")
                answers.append("allocated")
            except PermissionDenied as exc:
                answers.append(str(exc.code))
            nobody.allocate("s1", gpus=1, tenant="speech")
            nobody.release_allocation("s1")  # its own
            answers.append("own-ok")
        return ",".join(answers)

    assert as_nobody(d, ask) == "permission_denied,permission_denied,own-ok"
    with Client(d.socket) as c:
        assert [a.task_id for a in c.allocations().allocations] == ["v1"]


def test_the_asyncio_client_allocates_too(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket) as c:
            a = await c.allocate("async-task", gpus=0.5, cpus=1, strategy="best_fit")
            assert a.share == 0.5 and len(a.cpus) == 1
            assert [x.task_id for x in (await c.allocations()).allocations] == ["async-task"]
            await c.release_allocation("async-task")
            assert (await c.allocations()).allocations == []

    asyncio.run(main())


def test_allocation_requests_are_counted_by_outcome(daemon_factory: Callable[..., DaemonProcess]) -> None:
    """gpud_allocation_requests_total{result}: it existed, documented nowhere and never counted."""
    from .test_caps import sample

    d = daemon_factory("--simulate", "1", "--metrics-addr", "127.0.0.1:0")
    with Client(d.socket) as c, Client(d.socket) as waiter:
        c.allocate("a", gpus=1)
        c.allocate("a", gpus=1)  # the same again: answered with what it holds
        with pytest.raises(ProtocolError, match="insufficient"):
            c.allocate("b", gpus=1)
        served: list[p.Allocated] = []
        t = threading.Thread(target=lambda: served.append(waiter.allocate("c", gpus=1, wait_ms=60_000)))
        t.start()
        eventually(lambda: "c" in c.allocations().waiting, "c waits")
        c.release_allocation("a")
        t.join(30)
        assert served and served[0].task_id == "c"
    results = {r: sample(d, "gpud_allocation_requests_total", result=r) for r in ("granted", "repeated", "insufficient")}
    assert results == {"granted": 2, "repeated": 1, "insufficient": 1}
