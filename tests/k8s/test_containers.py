"""Finding a claim's containers and their cgroups (``gpud_k8s.containers``, ``Keepers._seen``), on folder
trees laid out as the kubelet's two cgroup drivers and the runtimes lay them (plain folders: only names
and ``cgroup.procs`` are read), and on a real process's environment for the CDI marker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, cast

from gpud_k8s import kubelet_api as k
from gpud_k8s.claims import DRIVER
from gpud_k8s.containers import (
    Hierarchy,
    claim_containers,
    container_id,
    container_ids,
    find_cgroups,
    is_container_dir,
    is_pod_dir,
)
from gpud_k8s.keeping import Keeper, Keepers
from gpud_k8s.prepared import Prepared
from tests.integration.waiting import eventually

UID = "1f0e6a52-7c1b-4b8e-9d2a-3c4d5e6f7a8b"
CID = "4bd1" * 16


def test_the_kubelets_pod_cgroups_are_known_by_either_driver() -> None:
    under = UID.replace("-", "_")
    assert is_pod_dir(f"kubepods-burstable-pod{under}.slice", UID)
    assert is_pod_dir(f"kubepods-pod{under}.slice", UID)  # guaranteed
    assert is_pod_dir(f"pod{UID}", UID)  # cgroupfs
    assert not is_pod_dir(f"pod{UID}x", UID) and not is_pod_dir(f"other-pod{under}.slice", UID)
    for name in (CID, f"cri-containerd-{CID}.scope", f"crio-{CID}.scope", f"docker-{CID}.scope", f"crio-{CID}"):
        assert is_container_dir(name, CID), name
    assert not is_container_dir(f"cri-containerd-{CID}x.scope", CID)
    assert container_id(f"containerd://{CID}") == CID and container_id("garbage") is None
    assert container_id("containerd://not-hex") is None


def test_a_pods_running_containers_ids_come_from_its_status() -> None:
    pod = {
        "status": {
            "initContainerStatuses": [{"name": "init", "containerID": f"containerd://{'a' * 64}", "state": {}}],
            "containerStatuses": [
                {"name": "main", "containerID": f"containerd://{CID}", "state": {"running": {}}},
                {"name": "done", "containerID": f"containerd://{'b' * 64}", "state": {"terminated": {}}},
                {"name": "new", "state": {"waiting": {}}},  # not created yet: no id
            ],
        }
    }
    assert container_ids(pod, ["main", "done", "new", "sidecar"]) == {"main": CID}


def test_pod_resources_name_the_containers_that_hold_a_claim() -> None:
    pb = k.podresources.pb
    held = pb.DynamicResource(
        claim_name="c", claim_namespace="ns", claim_resources=[pb.ClaimResource(driver_name=DRIVER)]
    )
    other = pb.DynamicResource(claim_name="c", claim_namespace="elsewhere")
    listing = [
        pb.PodResources(
            name="p",
            namespace="ns",
            containers=[
                pb.ContainerResources(name="a", dynamic_resources=[held]),
                pb.ContainerResources(name="b", dynamic_resources=[other]),
            ],
        )
    ]
    assert [(h.pod, h.container) for h in claim_containers(listing, "ns", "c")] == [("p", "a")]


def layout(root: Path, systemd: bool) -> tuple[Path, Path]:
    """A pod with the claim's container and a sidecar, below ``root``; (the claim's folder, the sidecar's)."""
    under = UID.replace("-", "_")
    if systemd:
        pod = root / "kubepods.slice" / "kubepods-burstable.slice" / f"kubepods-burstable-pod{under}.slice"
        ctr, side = pod / f"cri-containerd-{CID}.scope", pod / f"cri-containerd-{'c' * 64}.scope"
    else:
        pod = root / "kubepods" / "besteffort" / f"pod{UID}"
        ctr, side = pod / CID, pod / ("c" * 64)
    for folder in (ctr, side, root / "system.slice" / "gpud.service"):
        folder.mkdir(parents=True)
    return ctr, side


def test_a_containers_cgroup_is_found_by_its_id_with_either_driver(tmp_path: Path) -> None:
    for systemd in (True, False):
        root = tmp_path / ("systemd" if systemd else "cgroupfs")
        ctr, _ = layout(root, systemd)
        assert find_cgroups(root, UID, [CID], "k8s-x") == [ctr]
        assert find_cgroups(root, UID, [], "k8s-x") == []  # no id yet, no marker
        assert find_cgroups(root, "another-uid", [CID], "k8s-x") == []
    assert Hierarchy(tmp_path, "/").path_of(tmp_path / "a" / "b") == "/a/b"
    assert Hierarchy(tmp_path, "/../..").path_of(tmp_path / "a") == "/../../a"  # as a cgroup namespace shows it


def test_a_container_is_found_by_its_cdi_environment_before_its_id_is_known(tmp_path: Path) -> None:
    ctr, side = layout(tmp_path, True)
    waits = "import signal; signal.pause()"  # until killed
    marked = subprocess.Popen([sys.executable, "-c", waits], env={"GPUD_TASK_ID": "k8s-x"})
    plain = subprocess.Popen([sys.executable, "-c", waits], env={"GPUD_TASK_ID": "k8s-y"})
    try:
        for proc in (marked, plain):  # (the kernel sets a process's environment late in its exec)
            eventually(lambda proc=proc: Path(f"/proc/{proc.pid}/environ").read_bytes(), "the environment set")
        (ctr / "cgroup.procs").write_text(f"{marked.pid}\n")
        (side / "cgroup.procs").write_text(f"{plain.pid}\n")
        assert find_cgroups(tmp_path, UID, [], "k8s-x") == [ctr]
        assert find_cgroups(tmp_path, UID, [], "k8s-y") == [side]
        assert find_cgroups(tmp_path, UID, [], "k8s-z") == []
    finally:
        for proc in (marked, plain):
            proc.kill()
            proc.wait()


def test_without_pod_resources_the_pods_that_name_the_claim_are_looked_in(tmp_path: Path) -> None:
    ctr, _ = layout(tmp_path, True)
    keepers = Keepers(
        node="node-a",
        gpud=cast(Any, None),  # (neither is reached: _seen reads what was listed)
        gpud_socket=None,
        kube=cast(Any, None),
        cgroup_root=tmp_path,
        hierarchy=Hierarchy(tmp_path, "/"),
        pod_resources=None,
    )
    rec = Prepared(uid="u", namespace="ns", name="claim-1", task_id="k8s-u", state="prepared")
    pod: dict[str, Any] = {
        "metadata": {"uid": UID, "name": "p", "namespace": "ns", "deletionTimestamp": "2026-12-02T08:00:00Z"},
        "spec": {"containers": [{"name": "main"}], "resourceClaims": [{"name": "gpu", "resourceClaimName": "claim-1"}]},
        "status": {"containerStatuses": [{"name": "main", "containerID": f"containerd://{CID}", "state": {}}]},
    }
    keepers.pods = {("ns", "p"): pod}
    seen = keepers._seen(Keeper(rec, keepers), None)
    assert seen.folders == (ctr,) and seen.terminating
    assert seen.cgroups == ("/" + str(ctr.relative_to(tmp_path)),)
    pod["spec"]["resourceClaims"] = []  # a pod that does not name the claim is not looked in
    assert keepers._seen(Keeper(rec, keepers), None).folders == ()
