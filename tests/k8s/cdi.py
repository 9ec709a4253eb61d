"""A CDI spec checked as a container runtime would take it: the Container Device Interface's JSON
schema (``cdi-schema/``, a copy of upstream's; its README names the source), then what the schema
leaves to CDI's Go library (``pkg/parser``, ``specs-go/version.go``), which containerd and CRI-O
run before they use a spec:

- ``kind`` is ``<vendor>/<class>``: each starts with a letter, ends with a letter or digit, and has
  letters, digits, ``_``, ``-`` and ``.`` between;
- each device's ``name`` starts and ends with a letter or digit, with ``:`` allowed between too;
- every ``env`` entry is ``NAME=value`` (upstream's schema leaves the entries unchecked);
- ``cdiVersion`` is a version and no older than the features the spec uses need (a device name
  that starts with a digit, such as a claim's uid, needs 0.5.0; annotations 0.6.0).

``validate_cdi_spec`` raises ``CdiSpecError`` naming where the spec is wrong and why.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

SCHEMA_DIR = Path(__file__).resolve().parent / "cdi-schema"
_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)$")
_ENV = re.compile(r"^[^=]+=")
EARLIEST = (0, 3, 0)  # the oldest version CDI's library accepts


class CdiSpecError(ValueError):
    """The spec is not one a container runtime would use; the message says where and why."""


@cache
def _validators() -> tuple[jsonschema.Draft7Validator, jsonschema.Draft7Validator]:
    """The spec's, and the spec-level containerEdits' (CDI has them; upstream's schema.json does not
    name them, so they would pass unchecked)."""
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    # schema.json refers to "defs.json#/definitions/...", relative to its own (absent) base URI.
    registry: Registry[Any] = Registry().with_resource("defs.json", Resource.from_contents(defs, DRAFT7))
    edits = {"$ref": "defs.json#/definitions/containerEdits"}
    return jsonschema.Draft7Validator(schema, registry=registry), jsonschema.Draft7Validator(edits, registry=registry)


def _where(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the spec"


def validate_cdi_spec(spec: dict[str, Any]) -> None:
    """Raise ``CdiSpecError`` unless ``spec`` is a CDI spec a runtime would use."""
    whole, edits = _validators()
    best = jsonschema.exceptions.best_match(whole.iter_errors(spec))
    if best is None and isinstance(spec, dict) and "containerEdits" in spec:
        best = jsonschema.exceptions.best_match(edits.iter_errors(spec["containerEdits"]))
        if best is not None:
            best.path.appendleft("containerEdits")
    if best is not None:
        raise CdiSpecError(f"CDI spec invalid at {_where(best.absolute_path)}: {best.message}")
    _check_names(spec)
    _check_version(spec)


def _check_names(spec: dict[str, Any]) -> None:
    vendor, sep, cls = spec["kind"].partition("/")
    if not sep or not _VENDOR_OR_CLASS.match(vendor) or not _VENDOR_OR_CLASS.match(cls):
        raise CdiSpecError(
            f"CDI spec invalid at kind: {spec['kind']!r} is not <vendor>/<class> (each starting with a letter, "
            "ending with a letter or digit, with letters, digits, '_', '-' and '.' between)"
        )
    if not spec["devices"]:
        raise CdiSpecError("CDI spec invalid at devices: a spec names at least one device")
    seen: set[str] = set()
    for i, device in enumerate(spec["devices"]):
        name = device["name"]
        if not _DEVICE_NAME.match(name):
            raise CdiSpecError(
                f"CDI spec invalid at devices[{i}].name: {name!r} must start and end with a letter or digit, "
                "with letters, digits, '_', '-', '.' and ':' between"
            )
        if name in seen:
            raise CdiSpecError(f"CDI spec invalid at devices[{i}].name: {name!r} is named twice")
        seen.add(name)
    for where, edits in _all_edits(spec):
        for j, entry in enumerate(edits.get("env", [])):
            if not isinstance(entry, str) or not _ENV.match(entry):
                raise CdiSpecError(f"CDI spec invalid at {where}.env[{j}]: {entry!r} is not NAME=value")


def _all_edits(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [(f"devices[{i}].containerEdits", d["containerEdits"]) for i, d in enumerate(spec["devices"])]
    if "containerEdits" in spec:
        out.append(("containerEdits", spec["containerEdits"]))
    return out


def _check_version(spec: dict[str, Any]) -> None:
    m = _VERSION.match(spec["cdiVersion"])
    if m is None:
        raise CdiSpecError(f"CDI spec invalid at cdiVersion: {spec['cdiVersion']!r} is not a version such as 0.6.0")
    version = (int(m[1]), int(m[2]), int(m[3]))
    if version < EARLIEST:
        raise CdiSpecError(f"CDI spec invalid at cdiVersion: {spec['cdiVersion']} is older than CDI's earliest, 0.3.0")
    needed, why = _required_version(spec)
    if version < needed:
        raise CdiSpecError(
            f"CDI spec invalid at cdiVersion: {spec['cdiVersion']} is too old for {why}, "
            f"which needs {'.'.join(map(str, needed))}"
        )


def _required_version(spec: dict[str, Any]) -> tuple[tuple[int, int, int], str]:
    """The newest version a feature of the spec needs, and that feature (specs-go/version.go)."""
    found: list[tuple[tuple[int, int, int], str]] = [(EARLIEST, "its contents")]
    edits = _all_edits(spec)
    for where, e in edits:
        if any(m.get("type") for m in e.get("mounts", [])):
            found.append(((0, 4, 0), f"a mount type ({where}.mounts)"))
        if any(n.get("hostPath") for n in e.get("deviceNodes", [])):
            found.append(((0, 5, 0), f"a device node's hostPath ({where}.deviceNodes)"))
        if "intelRdt" in e or e.get("additionalGids"):
            found.append(((0, 7, 0), f"intelRdt or additionalGids ({where})"))
        if e.get("netDevices") or {"schemata", "enableMonitoring"} & set(e.get("intelRdt") or {}):
            found.append(((1, 1, 0), f"netDevices or intelRdt's schemata and enableMonitoring ({where})"))
        if e.get("deviceCgroupRules"):
            found.append(((1, 2, 0), f"deviceCgroupRules ({where})"))
    for i, device in enumerate(spec["devices"]):
        if device["name"][:1].isdigit():
            found.append(((0, 5, 0), f"a device name that starts with a digit (devices[{i}].name)"))
        if device.get("annotations"):
            found.append(((0, 6, 0), f"annotations (devices[{i}].annotations)"))
    if spec.get("annotations"):
        found.append(((0, 6, 0), "annotations"))
    if "." in spec["kind"].partition("/")[2]:
        found.append(((0, 6, 0), f"a '.' in the kind's class ({spec['kind']!r})"))
    return max(found, key=lambda f: f[0])
