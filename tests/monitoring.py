"""gpud's Prometheus rules and Grafana dashboard as data, for the tests that check them.

Shared by tests/test_dashboard.py (pure: the files' shape, and every series they name is one gpud
exports or a rule records) and tests/integration/test_prometheus.py (a real Prometheus scraping a
real gpud evaluates every rule and every query ``dashboard_queries`` returns). Both read the queries
through this one module, so the integration test evaluates exactly what the dashboard holds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gpud.host.metrics import Metrics
from gpud_k8s.metrics import AgentMetrics

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "gpud-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gpud.json"
JOB = "gpud"  # the scrape job the alerts on a missing daemon name (the rules file's header says so)
AGENT_JOB = "gpud-k8s"  # gpud-k8s's job (its /metrics)


def need(binary: str) -> str:
    """The path of ``binary``; a test without it is skipped, but fails where CI=true (so CI never skips)."""
    path = shutil.which(binary)
    if path is None:
        why = f"{binary} is not on PATH (Debian: apt-get install prometheus; .ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}, and CI=true: CI must run this test")
        pytest.skip(why)
    return path


# --- the rules ---------------------------------------------------------------------------------


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


def recording_rules() -> dict[str, str]:
    """Recorded name -> its expression, in the file's order."""
    return {r["record"]: r["expr"] for g in rule_groups() for r in g["rules"] if "record" in r}


def alerting_rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


FOR = re.compile(r"^(\s+for:\s*)\S+\s*$", re.M)


def rules_with_for(value: str) -> str:
    """The rules file with every alert's ``for:`` set to ``value``, nothing else changed."""
    text = RULES.read_text()
    changed, n = FOR.subn(lambda m: m.group(1) + value, text)
    if n != len(alerting_rules()):
        raise ValueError(
            f"{n} for: lines for {len(alerting_rules())} alerts: every alert must have one, on its own line"
        )
    return changed


# --- the dashboard -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    where: str  # the panel's title, or the template variable's name
    expr: str  # PromQL, template variables substituted
    label: str | None = None  # a variable's query: the label whose values it lists


def dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    out: list[dict[str, Any]] = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$", re.S)


def substitute(expr: str, values: dict[str, str]) -> str:
    """``$name`` and ``${name}`` replaced as Grafana would; a variable not in ``values`` is an error."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"template variable ${name} has no value here (in {expr!r})")
        return values[name]

    return VARIABLE.sub(one, expr)


def dashboard_queries(values: dict[str, str], board: dict[str, Any] | None = None) -> list[Query]:
    """Every query of the dashboard with ``values`` for its template variables: each panel target's
    ``expr``, and each query variable's ``label_values(series, label)`` as its series selector."""
    board = board or dashboard()
    out: list[Query] = []
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        found = LABEL_VALUES.match(var["definition"])
        if found is None:
            raise ValueError(f"variable {var['name']}: only label_values(series, label) is understood")
        out.append(Query(f"${var['name']}", substitute(found.group(1), values), found.group(2)))
    for panel in panels(board):
        for target in panel.get("targets", []):
            out.append(Query(panel["title"], substitute(target["expr"], values)))
    return out


def every_expr(node: object) -> list[str]:
    """Every ``expr`` string anywhere in a JSON document (to check nothing escapes ``dashboard_queries``)."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k == "expr" and isinstance(v, str)]
        return found + [e for v in node.values() for e in every_expr(v)]
    if isinstance(node, list):
        return [e for v in node for e in every_expr(v)]
    return []


# --- series names in PromQL --------------------------------------------------------------------

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAME = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:]|\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"inf", "nan", "Inf", "NaN"}


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, keywords, labels, strings or durations)."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _LABEL_LISTS.sub("", text)
    return {n for n in _NAME.findall(text) if n not in _KEYWORDS}


def exported_series() -> set[str]:
    """Every sample name gpud and gpud-k8s can export (from fresh registries), and Prometheus' own ``up``."""
    names = {"up"}
    for family in _registry().collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        else:
            names.add(family.name)
    return names


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Metrics(registry)
    AgentMetrics(registry)  # gpud-k8s's (its job: gpud-k8s)
    return registry
