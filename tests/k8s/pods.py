"""Pods whose containers know nothing of gpud, as the kubelet, the API server and the container runtime
see them, for the end-to-end tests of time-sliced claims and bench/k8s_prepare.py's shares: the pod
object, the kubelet's pod resources, the container's cgroup (as the kubelet's systemd driver and
containerd name it) and the environment a runtime gives it from the claim's CDI spec.

Absolute imports only: bench/k8s_fixtures.py loads this file by its path."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpud_k8s import kubelet_api as k
from gpud_k8s.claims import DRIVER


@dataclass
class Pod:
    name: str
    claim: str
    claim_uid: str
    namespace: str
    node: str
    uid: str = ""  # the API server's, once created
    container_id: str = ""

    @property
    def cgroup(self) -> str:
        """Its one container's cgroup below the node's cgroup root."""
        under = self.uid.replace("-", "_")
        return (
            "kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{under}.slice/cri-containerd-{self.container_id}.scope"
        )

    def object(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "nodeName": self.node,
                "containers": [{"name": "main", "image": "trainer:1", "resources": {"claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": self.claim}],
            },
            "status": {"phase": "Running"},
        }


def pod_resources(pods: list[Pod], device: str = "gpu-0") -> list[Any]:
    """What the kubelet's pod resources ``List`` says of the pods: their container holds its claim."""
    pb = k.podresources.pb
    return [
        pb.PodResources(
            name=pod.name,
            namespace=pod.namespace,
            containers=[
                pb.ContainerResources(
                    name="main",
                    dynamic_resources=[
                        pb.DynamicResource(
                            claim_name=pod.claim,
                            claim_namespace=pod.namespace,
                            claim_resources=[
                                pb.ClaimResource(driver_name=DRIVER, pool_name=pod.node, device_name=device)
                            ],
                        )
                    ],
                )
            ],
        )
        for pod in pods
    ]


def cdi_env(spec_file: Path) -> dict[str, str]:
    """What a container runtime puts in a container's environment for the claim's CDI device."""
    spec = json.loads(spec_file.read_text())
    env = dict(kv.split("=", 1) for kv in spec["devices"][0]["containerEdits"]["env"])
    return {"PATH": "/usr/bin:/bin", **env}
