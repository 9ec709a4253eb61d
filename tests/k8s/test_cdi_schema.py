"""The CDI spec a prepared claim gets (kind gpud.io/claim, one device named by the claim's uid, its socket
directory mounted and two environment variables) against CDI's JSON schema and its library's rules
(``cdi.validate_cdi_spec``), and broken specs refused with a message that says where and why."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from .cdi import SCHEMA_DIR, CdiSpecError, validate_cdi_spec

UID = "3b9e6f0a-8c1d-4e52-a7b4-0f6c2d9e8a13"


def claim_spec() -> dict[str, Any]:
    """The spec of one claim, as docs/kubernetes.md describes it."""
    return {
        "cdiVersion": "0.6.0",
        "kind": "gpud.io/claim",
        "devices": [
            {
                "name": UID,
                "containerEdits": {
                    "env": ["GPUD_SOCKET=/run/gpud/gpud.sock", f"GPUD_TASK_ID=k8s-{UID}"],
                    "mounts": [
                        {
                            "hostPath": f"/run/gpud/claims/{UID}",
                            "containerPath": "/run/gpud",
                            "options": ["rbind", "rw", "nosuid", "nodev"],
                        }
                    ],
                },
            }
        ],
    }


def test_a_claims_spec_is_valid() -> None:
    validate_cdi_spec(claim_spec())


def test_the_spec_gpud_k8s_writes_is_valid() -> None:
    cdi = pytest.importorskip("gpud_k8s.cdi")
    spec = cdi.claim_spec(UID, f"/run/gpud/claims/{UID}")
    validate_cdi_spec(spec)
    assert spec["kind"] == "gpud.io/claim" and spec["devices"][0]["name"] == UID


def test_device_nodes_and_spec_level_edits_are_valid() -> None:
    spec = claim_spec()
    spec["devices"][0]["containerEdits"]["deviceNodes"] = [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidiactl"}]
    spec["containerEdits"] = {"env": ["GPUD_CLAIMS=1"]}
    spec["annotations"] = {"gpud.io/node": "gpu-node-1"}
    validate_cdi_spec(spec)


def test_the_schema_copy_is_upstreams() -> None:
    readme = (SCHEMA_DIR / "README.md").read_text()
    assert "cncf-tags/container-device-interface" in readme and "Apache License 2.0" in readme
    assert {p.name for p in SCHEMA_DIR.glob("*.json")} == {"schema.json", "defs.json"}


def drop(*path: str | int) -> Callable[[dict[str, Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        node: Any = spec
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return edit


def put(value: Any, *path: str | int) -> Callable[[dict[str, Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        node: Any = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


EDITS = "devices", 0, "containerEdits"
BROKEN = {
    "no kind": (drop("kind"), "at the spec: 'kind' is a required property"),
    "no version": (drop("cdiVersion"), "at the spec: 'cdiVersion' is a required property"),
    "no devices": (drop("devices"), "at the spec: 'devices' is a required property"),
    "devices not a list": (put({}, "devices"), "at devices: {} is not of type 'array'"),
    "a device without edits": (drop("devices", 0, "containerEdits"), "at devices[0]: 'containerEdits' is a required"),
    "a device without a name": (drop("devices", 0, "name"), "at devices[0]: 'name' is a required property"),
    "a mount without its container path": (
        drop(*EDITS, "mounts", 0, "containerPath"),
        "at devices[0].containerEdits.mounts[0]: 'containerPath' is a required property",
    ),
    "mount options as one string": (
        put("rbind,rw", *EDITS, "mounts", 0, "options"),
        "at devices[0].containerEdits.mounts[0].options: 'rbind,rw' is not of type 'array'",
    ),
    "env as one string": (
        put("GPUD_SOCKET=/run/gpud/gpud.sock", *EDITS, "env"),
        "at devices[0].containerEdits.env: 'GPUD_SOCKET=/run/gpud/gpud.sock' is not of type 'array'",
    ),
    "an env entry without =": (put(["GPUD_SOCKET"], *EDITS, "env"), "at devices[0].containerEdits.env[0]: "),
    "an env entry not a string": (put([7], *EDITS, "env"), "at devices[0].containerEdits.env[0]: 7 is not NAME"),
    "a device node without its path": (
        put([{"hostPath": "/dev/nvidia0"}], *EDITS, "deviceNodes"),
        "at devices[0].containerEdits.deviceNodes[0]: 'path' is a required property",
    ),
    "a spec-level mount without its container path": (
        put({"mounts": [{"hostPath": "/run/gpud"}]}, "containerEdits"),
        "at containerEdits.mounts[0]: 'containerPath' is a required property",
    ),
    "a kind without a class": (put("gpud.io", "kind"), "at kind: 'gpud.io' is not <vendor>/<class>"),
    "a kind with two slashes": (put("gpud.io/claim/x", "kind"), "at kind: 'gpud.io/claim/x' is not"),
    "a device name with a slash": (put("a/b", "devices", 0, "name"), "at devices[0].name: 'a/b' must start"),
    "a device named twice": (
        lambda spec: spec["devices"].append(copy.deepcopy(spec["devices"][0])),
        f"at devices[1].name: '{UID}' is named twice",
    ),
    "no device at all": (put([], "devices"), "at devices: a spec names at least one device"),
    "a version that is none": (put("latest", "cdiVersion"), "at cdiVersion: 'latest' is not a version"),
    "a version too old for a uid as a name": (
        put("0.4.0", "cdiVersion"),
        "at cdiVersion: 0.4.0 is too old for a device name that starts with a digit (devices[0].name), "
        "which needs 0.5.0",
    ),
}


@pytest.mark.parametrize("edit, message", BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_spec_is_refused_with_where_and_why(edit: Callable[[dict[str, Any]], None], message: str) -> None:
    spec = claim_spec()
    edit(spec)
    with pytest.raises(CdiSpecError) as caught:
        validate_cdi_spec(spec)
    assert str(caught.value).startswith("CDI spec invalid ")
    assert message in str(caught.value)
