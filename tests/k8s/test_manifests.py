"""Every manifest in deploy/kubernetes against the schemas of each Kubernetes version it is for.

Each document of each YAML file there is validated with kubernetes-validate in strict mode (a field
the schema does not have is an error, at any depth), for every version the DRA driver supports
(``VERSIONS``: resource.k8s.io/v1 is 1.34's) from the file's own minimum up. A file says its
minimum in a comment line of its own, ``# gpud: kubernetes >= 1.36``; without one it is 1.34.
Custom resources (``CRDS``, by API group) are skipped with the reason: kubernetes-validate has only
Kubernetes' built-in schemas. Anything else without a schema fails.

The schemas check field names and types only: feature gates, CEL, cross-field rules and names of
other objects are the API server's (docs/kubernetes.md lists what is left unchecked).
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, major_minor

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.34", "1.35", "1.36", "1.37")  # the DRA driver's: resource.k8s.io/v1 from 1.34
MARKER = re.compile(r"^#\s*gpud:\s*kubernetes\s*>=\s*(\S+)\s*$")
CRDS = {
    "kueue.x-k8s.io": "Kueue's custom resources (ResourceFlavor, ClusterQueue, LocalQueue): kubernetes-validate "
    "has only Kubernetes' built-in schemas",
}


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def minimum_version(path: Path) -> str:
    """The file's ``# gpud: kubernetes >= X.Y`` (one at most), else the oldest supported version."""
    found = [m[1] for line in path.read_text().splitlines() if (m := MARKER.match(line.strip()))]
    if len(found) > 1:
        raise ValueError(f"{path.relative_to(ROOT)}: {len(found)} '# gpud: kubernetes >=' lines, one at most")
    if not found:
        return VERSIONS[0]
    if found[0] not in VERSIONS:
        raise ValueError(f"{path.relative_to(ROOT)}: kubernetes >= {found[0]}: not one of {', '.join(VERSIONS)}")
    return found[0]


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def documents(path: Path) -> list[dict[str, Any]]:
    try:
        return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path.relative_to(ROOT)} is not YAML: {exc}") from None


def api_group(doc: dict[str, Any]) -> str:
    group, _, _ = str(doc.get("apiVersion", "")).rpartition("/")
    return group


def cases() -> list[Any]:
    out = []
    for path in manifest_files():
        minimum = minimum_version(path)
        for index, doc in enumerate(documents(path)):
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            for version in VERSIONS:
                if version_key(version) >= version_key(minimum):
                    rel = path.relative_to(DEPLOY)
                    out.append(pytest.param(path, index, version, id=f"{rel}#{index}:{name}@{version}"))
    return out


def validate(doc: dict[str, Any], version: str, where: str) -> None:
    """Strict validation, failing with the file, the document, the field and the version named."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        field = ".".join(str(p) for p in exc.path) or "(the document)"
        pytest.fail(f"{where} is invalid for Kubernetes {version}: at {field}: {exc.message}", pytrace=False)
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{where}: {exc.message}; a custom resource's group belongs in CRDS", pytrace=False)


@pytest.mark.parametrize("path, index, version", cases())
def test_manifest_validates_strictly(path: Path, index: int, version: str) -> None:
    doc = documents(path)[index]
    if api_group(doc) in CRDS:
        pytest.skip(f"{doc['apiVersion']} {doc['kind']}: {CRDS[api_group(doc)]}")
    where = f"{path.relative_to(ROOT)} document {index} ({doc['kind']} {doc['metadata']['name']})"
    validate(doc, version, where)


def test_the_schemas_of_every_supported_version_are_there() -> None:
    """kubernetes-validate falls back to the newest schemas not newer than the version asked for:
    without a version's own, its manifests would be checked against an older one's."""
    have = {major_minor(v) for v in all_versions()}
    assert set(VERSIONS) <= have, f"kubernetes-validate lacks the schemas of {sorted(set(VERSIONS) - have)}"


def test_every_file_holds_named_documents_with_a_known_minimum() -> None:
    files = manifest_files()
    assert files, f"no manifests under {DEPLOY}"
    for path in files:
        minimum_version(path)  # raises on a marker that names no supported version
        docs = documents(path)
        assert docs, f"{path.relative_to(ROOT)} holds no document"
        for doc in docs:
            assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), f"{path}: {doc!r:.80}"
            assert doc.get("metadata", {}).get("name"), f"{path.relative_to(ROOT)}: a {doc['kind']} without a name"


def needs(node: Any, key: str = "") -> set[tuple[int, int]]:
    """The Kubernetes versions the fields of a document need beyond 1.34: consumable capacity
    (DRAConsumableCapacity: a device's allowMultipleAllocations and requestPolicy, a request's
    capacity) 1.36, the extended resource (DRAExtendedResource, GA: a DeviceClass's
    extendedResourceName, a container's gpud.io/gpu) 1.37."""
    found: set[tuple[int, int]] = set()
    if isinstance(node, dict):
        if "allowMultipleAllocations" in node or "requestPolicy" in node or (key == "exactly" and "capacity" in node):
            found.add((1, 36))
        if "extendedResourceName" in node or (key in ("limits", "requests") and "gpud.io/gpu" in node):
            found.add((1, 37))
        for k, v in node.items():
            found |= needs(v, k)
    elif isinstance(node, list):
        for v in node:
            found |= needs(v, key)
    return found


def test_the_version_markers_cover_what_the_documents_use() -> None:
    for path in manifest_files():
        minimum = version_key(minimum_version(path))
        for doc in documents(path):
            for version in needs(doc):
                assert minimum >= version, (
                    f"{path.relative_to(ROOT)}: {doc['kind']} {doc['metadata']['name']} needs Kubernetes "
                    f"{version[0]}.{version[1]}: mark the file '# gpud: kubernetes >= {version[0]}.{version[1]}'"
                )


@pytest.mark.parametrize(
    "field, value",
    [
        (("spec", "unknownField"), True),
        (("spec", "selectors", 0, "cel", "expresion"), 'device.driver == "gpu.gpud.io"'),
        (("spec", "extendedResourceName"), {"name": "gpud.io/gpu"}),
    ],
    ids=["unknown field", "misspelt field", "wrong type"],
)
def test_a_broken_document_fails(field: tuple[str | int, ...], value: Any) -> None:
    """The check above can fail: strict validation refuses a field the schema lacks, at any depth."""
    doc = copy.deepcopy(documents(DEPLOY / "deviceclass.yaml")[0])
    node: Any = doc
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    with pytest.raises(pytest.fail.Exception, match=r"deviceclass\.yaml document 0 .* is invalid for Kubernetes 1.37"):
        validate(doc, "1.37", "deploy/kubernetes/deviceclass.yaml document 0 (DeviceClass gpu.gpud.io)")


def test_a_custom_resource_outside_crds_fails() -> None:
    doc = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(pytest.fail.Exception, match="belongs in CRDS"):
        validate(doc, "1.37", "a Widget")


def all_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in manifest_files() for doc in documents(path)]


def find(kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for _, d in all_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_gpud_reads_the_configuration_the_daemonset_gives_it(tmp_path: Path) -> None:
    """The ConfigMap's gpud.toml, and the GPUD_* environment of the gpud container, as gpud loads them."""
    from gpud.host import config

    toml = find("ConfigMap", "gpud-config")["data"]["gpud.toml"]
    tomllib.loads(toml)
    (tmp_path / "gpud.toml").write_text(toml)
    containers = {c["name"]: c for c in find("DaemonSet", "gpud")["spec"]["template"]["spec"]["containers"]}
    env = {e["name"]: e["value"] for e in containers["gpud"].get("env", []) if e["name"].startswith("GPUD_")}
    loaded = config.load(str(tmp_path / "gpud.toml"), {}, environ=env)
    assert loaded.socket == "/run/gpud/gpud.sock" and loaded.state_dir == "/var/lib/gpud"
    assert containers["gpud"]["command"] == ["gpud", "--config", "/etc/gpud/gpud.toml"]


def test_the_daemonset_mounts_what_the_agent_and_gpud_need() -> None:
    spec = find("DaemonSet", "gpud")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounted = {
        c["name"]: {host[m["name"]]: m.get("readOnly", False) for m in c["volumeMounts"] if m["name"] in host}
        for c in spec["containers"]
    }
    assert mounted["gpud-k8s"] == {
        "/run/gpud": False,
        "/var/lib/kubelet/plugins_registry": False,
        "/var/lib/kubelet/plugins/gpu.gpud.io": False,
        "/var/lib/kubelet/device-plugins": False,
        "/var/lib/kubelet/pod-resources": True,
        "/var/run/cdi": False,
        "/sys/fs/cgroup": True,
    }
    assert mounted["gpud"] == {"/run/gpud": False, "/var/lib/gpud": False, "/sys/fs/cgroup": False}
    assert spec["hostPID"] is True and spec["automountServiceAccountToken"] is False
    for c in spec["containers"]:
        assert c["securityContext"]["privileged"] is False and c["securityContext"]["allowPrivilegeEscalation"] is False
    token = [m for c in spec["containers"] for m in c["volumeMounts"] if m["name"] == "kube-api-access"]
    assert len(token) == 1, "the API token goes to gpud-k8s alone"


def test_the_cluster_role_grants_exactly_what_the_agent_uses() -> None:
    """Each grant is a call of gpud_k8s/kube.py's (named beside it); the end-to-end tests check the other way,
    that every request the agent makes is granted (tests/k8s/rbac.py)."""
    rules = {
        (group, resource): sorted(rule["verbs"])
        for rule in find("ClusterRole", "gpud-k8s")["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert rules == {
        ("resource.k8s.io", "resourceclaims"): ["get"],  # get_claim
        ("resource.k8s.io", "resourceclaims/status"): ["patch"],  # set_claim_condition
        ("resource.k8s.io", "resourceslices"): ["create", "delete", "get", "list", "update"],  # the slice's calls
        ("", "pods"): ["list"],  # list_node_pods
        ("", "pods/eviction"): ["create"],  # evict
        ("", "nodes"): ["get"],  # node_uid
    }


def opaque_configs(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        if node.get("driver") == "gpu.gpud.io" and "parameters" in node:
            return [node["parameters"]]
        return [c for v in node.values() for c in opaque_configs(v)]
    if isinstance(node, list):
        return [c for v in node for c in opaque_configs(v)]
    return []


def test_the_driver_reads_every_opaque_config() -> None:
    """kubernetes-validate cannot look into an opaque config (a RawExtension): the driver's own reader can."""
    from gpud_k8s.claims import read_config

    found = [(path, params) for path, doc in all_documents() for params in opaque_configs(doc)]
    assert found, "no example passes a GpudClaimConfig"
    for path, params in found:
        read_config(params, str(path.relative_to(ROOT)))
