"""ADOPT on a real daemon: cgroups gpud did not make (a claim's containers) frozen and thawed as a run's
program, with real processes in real cgroups (cgroup v2; skipped where it is not writable).

Whether a process ran is read from the kernel (its cgroup's ``cpu.stat``), never from timing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.host.cgroups import own_cgroup
from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.errors import ProtocolError
from tests.testcgroups import CgroupTree, usable

from .waiting import eventually

NO_CGROUPS = usable()
pytestmark = pytest.mark.skipif(NO_CGROUPS is not None, reason=f"no writable cgroup v2 here: {NO_CGROUPS}")
CTR = "kubepods.slice/pod-a/ctr-1"
CTR2 = "kubepods.slice/pod-a/ctr-2"


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    t = CgroupTree()
    try:
        yield t
    finally:
        t.close()


def refused(c: Client, msg: object, code: p.ErrorCode = p.ErrorCode.INVALID) -> str:
    with pytest.raises(ProtocolError) as info:
        c.call(msg)  # type: ignore[arg-type]
    assert info.value.code == code, info.value
    return str(info.value)


def runs_now(tree: CgroupTree, rel: str) -> bool:
    """The cgroup's processes use CPU time now (read twice from the kernel, some use between)."""
    before = tree.cpu_usec(rel)
    return bool(eventually(lambda: tree.cpu_usec(rel) > before + 20_000, f"{rel} uses CPU time", timeout=30))


def test_adopted_cgroups_freeze_and_thaw_as_a_runs_program_and_stay_as_the_kernel_has_them(
    daemon: DaemonProcess, tree: CgroupTree
) -> None:
    tree.spawn(CTR)
    tree.spawn(CTR2)
    with Client(daemon.socket, name="gpud-k8s-claim") as c:
        state: p.ProgramState = c.call(p.Adopt(id=0, task_id="k8s-1", cgroups=[tree.name(CTR), tree.name(CTR2)]))
        assert state.frozen is False
        frozen: p.ProgramState = c.call(p.Freeze(id=0), timeout=30)
        assert frozen.frozen and tree.frozen(CTR) and tree.frozen(CTR2)
        stopped_at = tree.cpu_usec(CTR)
        runs: p.RunsReply = c.call(p.ListRuns(id=0))
        (mine,) = [r for r in runs.runs if r.task_id == "k8s-1"]
        assert (mine.backend, mine.state, mine.processes, mine.pid) == ("adopted", "frozen", 2, 0)
        assert tree.cpu_usec(CTR) == stopped_at  # frozen: not one more microsecond
        thawed: p.ProgramState = c.call(p.Thaw(id=0))
        assert thawed.frozen is False and runs_now(tree, CTR)

        c.call(p.Freeze(id=0), timeout=30)
        state = c.call(p.Adopt(id=0, task_id="k8s-1", cgroups=[tree.name(CTR)]))  # ctr-2 handed back, thawed
        assert state.frozen and tree.frozen(CTR) and not tree.wants_frozen(CTR2)
    # the connection gone: gpud leaves what it was handed as the kernel has it (frozen), kills nothing
    assert tree.frozen(CTR) and tree.procs[0].poll() is None
    with Client(daemon.socket, name="again") as c:  # the agent again: hands it again, thaws it
        state = c.call(p.Adopt(id=0, task_id="k8s-1", cgroups=[tree.name(CTR)]))
        assert state.frozen
        c.call(p.Thaw(id=0))
        assert runs_now(tree, CTR)
        c.call(p.Adopt(id=0, task_id="k8s-1", cgroups=[]))  # all handed back
        runs = c.call(p.ListRuns(id=0))
        assert [r.state for r in runs.runs if r.task_id == "k8s-1"] == ["gone"]


def test_cgroups_that_would_freeze_gpud_init_or_another_claim_are_refused_by_name(
    tree: CgroupTree, daemon: DaemonProcess, tmp_path: Path
) -> None:
    tree.make(CTR)
    assert daemon.proc is not None
    (tree.make("gpud") / "cgroup.procs").write_text(str(daemon.proc.pid))  # gpud's own cgroup is in the tree now
    with open("/proc/1/cgroup") as f:
        init = own_cgroup(f.read())
    assert init is not None
    with Client(daemon.socket, name="a") as a, Client(daemon.socket, name="b") as b:
        adopt = lambda *paths: p.Adopt(id=0, task_id="k8s-2", cgroups=list(paths))  # noqa: E731
        assert "root of the cgroup2 hierarchy" in refused(a, adopt("/"))
        assert "holds gpud's own process" in refused(a, adopt(tree.name("gpud")))
        assert "holds gpud's own process" in refused(a, adopt(tree.hierarchy))  # an ancestor of gpud's
        assert "init" in refused(a, adopt(init)) if init != "/" else "root" in refused(a, adopt(init))
        assert "not a plain path" in refused(a, adopt(tree.name("kubepods.slice/../gpud")))
        assert "does not exist" in refused(a, adopt(tree.name("kubepods.slice/nope")))
        assert "gpud's own" in refused(a, adopt(tree.name(CTR), tree.name("gpud")))  # one bad: none adopted
        assert "not a plain path" in refused(a, adopt(tree.name("kubepods.slice//pod-a")))
        refused(a, p.Freeze(id=0))
        a.call(adopt(tree.name(CTR)))
        assert "another connection" in refused(b, adopt(tree.name(CTR)))
        assert "another connection" in refused(b, adopt(tree.name("kubepods.slice/pod-a")))  # holds a's
        refused(b, p.Freeze(id=0))  # b handed nothing
        assert not tree.wants_frozen(CTR)  # nothing refused changed anything
    # an admin in a cgroup of the tree (the agent's own pod) cannot have gpud freeze itself
    out = tmp_path / "caller.txt"
    code = (
        "import sys; sys.stdin.buffer.read(1)\n"
        "from gpud_client import Client, protocol as p\n"
        "from gpud_client.errors import ProtocolError\n"
        f"with Client({daemon.socket!r}) as c:\n"
        "    try:\n"
        f"        c.call(p.Adopt(id=0, task_id='k8s-9', cgroups=[{tree.hierarchy + '/agent'!r}]))\n"
        "        said = 'adopted'\n"
        "    except ProtocolError as exc:\n"
        "        said = str(exc)\n"
        f"open({str(out)!r}, 'w').write(said)\n"
    )
    tree.spawn("agent", code).wait(60)
    assert "holds the caller's process" in out.read_text()


def test_an_adopted_cgroup_that_is_gone_counts_as_frozen(daemon: DaemonProcess, tree: CgroupTree) -> None:
    tree.make(CTR)
    tree.spawn(CTR2)
    with Client(daemon.socket, name="c") as c:
        c.call(p.Adopt(id=0, task_id="k8s-3", cgroups=[tree.name(CTR), tree.name(CTR2)]))
        os.rmdir(tree.path(CTR))  # its container ended and the runtime removed it
        state: p.ProgramState = c.call(p.Freeze(id=0), timeout=30)
        assert state.frozen and tree.frozen(CTR2)
