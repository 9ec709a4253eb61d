"""What the agent's ClusterRole (deploy/kubernetes/rbac.yaml) allows, to hold its requests to: every
request the agent made of the fake API server in a test must be one the role allows."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "rbac.yaml"


def allowed() -> set[tuple[str, str]]:
    """(verb, resource) pairs the role grants (resource with its subresource: ``pods/eviction``)."""
    (role,) = [d for d in yaml.safe_load_all(RBAC.read_text()) if d and d.get("kind") == "ClusterRole"]
    return {(verb, resource) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}


def beyond(used: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The requests (verb, resource) the role does not allow; discovery and /version are everyone's."""
    grants = allowed()
    return sorted(x for x in set(used) if x[0] not in ("discovery", "version") and x not in grants)
