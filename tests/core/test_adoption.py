"""Which cgroups an admin may hand gpud to freeze (``gpud.core.adoption``): what the kernel says in,
reasons out."""

from __future__ import annotations

from gpud.core.adoption import is_within, plain, refusal

POD = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice"
CTR = f"{POD}/cri-containerd-abc.scope"
GPUD, AGENT = 4000, 4100


def why(path: str, pids: tuple[int, ...] = (7, 8), **changes: object) -> str | None:
    facts: dict = {"gpud_pid": GPUD, "caller_pid": AGENT, "runs_base": "/system.slice/gpud.service/gpud-runs"}
    facts.update(changes)
    rel = changes.pop("rel", path[1:]) if "rel" in changes else path[1:]
    facts.pop("rel", None)
    return refusal(path, rel, pids, **facts)


def test_a_containers_cgroup_may_be_adopted() -> None:
    assert why(CTR) is None
    assert why(POD) is None
    assert why(CTR, taken=[f"{POD}/cri-containerd-other.scope"]) is None
    # in a cgroup namespace the mount shows the hierarchy from "/../.." : the part below it is judged
    assert refusal("/../../kubepods.slice/x", "kubepods.slice/x", [], gpud_pid=GPUD, caller_pid=AGENT) is None


def test_paths_spelled_other_than_they_are_or_not_shown_are_refused() -> None:
    assert "root" in str(why("/", rel=""))
    for bad in ("/kubepods.slice/", "/a//b", "/a/./b", "/a/../system.slice"):
        assert "not a plain path" in str(why(bad)), bad
    assert "not shown" in str(why("/elsewhere", rel=None))


def test_what_holds_gpud_the_caller_or_init_is_refused_by_its_processes() -> None:
    assert "gpud's own process (pid 4000)" in str(why("/system.slice", pids=(1000, GPUD)))
    assert "the caller's process" in str(why("/kubepods.slice", pids=(AGENT,)))  # the agent's own pod
    assert "init (pid 1)" in str(why("/init.scope", pids=(1,)))
    assert why("/system.slice/other.service", pids=(5000,)) is None


def test_runs_cgroups_and_another_connections_are_refused() -> None:
    assert "runs' programs" in str(why("/system.slice/gpud.service/gpud-runs/run-x"))
    assert "another connection" in str(why(CTR, taken=[CTR]))
    assert "another connection" in str(why(POD, taken=[CTR]))  # holds it
    assert "another connection" in str(why(CTR, taken=[POD]))  # inside it


def test_within_is_by_whole_components_and_plain_is_as_spelled() -> None:
    assert is_within("/a/b", "/a") and is_within("/a", "/a") and is_within("/a", "/")
    assert not is_within("/ab", "/a") and not is_within("/a", "/a/b")
    assert plain("a/b") and not plain("a/../b") and not plain("") and not plain("a/")
