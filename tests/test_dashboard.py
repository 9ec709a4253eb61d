"""The Prometheus rules (deploy/prometheus/gpud-rules.yml) and the Grafana dashboard
(deploy/grafana/gpud.json) read only series that exist, and have the shape their tools expect.

Pure: the files are parsed here, and every series they name must be one gpud exports (a fresh
``Metrics`` registry lists them) or one a rule records. ``promtool check rules`` runs where promtool
is installed (CI installs it: there a missing promtool fails). What the queries return on a running
node is tests/integration/test_prometheus.py's to show: it evaluates every rule and every query
``monitoring.dashboard_queries`` finds here, against a real Prometheus scraping a real gpud.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from monitoring import (  # tests/ is on the path of its top-level modules
    ROOT,
    RULES,
    alerting_rules,
    dashboard,
    dashboard_queries,
    every_expr,
    exported_series,
    need,
    panels,
    recording_rules,
    rule_groups,
    rules_with_for,
    series_names,
)

ROWS = ["Node at a glance", "Locks and limits", "Leases", "Allocations and tenants", "Take-back"]
ROWS += ["Kubernetes (by namespace and claim)"]
VARIABLES = {"datasource", "instance", "gpu", "namespace", "k8s_namespace"}
SEVERITIES = {"critical", "warning", "info"}
DURATION = re.compile(r"^\d+[smhd]$")
RECORDED = re.compile(r"^[a-z_]+:gpud_[a-z0-9_]+:[a-z0-9_]+$")


def all_values(board: dict[str, Any]) -> dict[str, str]:
    """Each template variable at its "All" (or, for the data source, its name)."""
    return {v["name"]: v.get("allValue") or "prometheus" for v in board["templating"]["list"]}


def test_the_series_names_of_promql_are_found_and_nothing_else() -> None:
    expr = (
        'sum by (instance, gpu) (rate(gpud_lock_wait_seconds_bucket{gpu=~"0|1", le!="+Inf"}[5m] offset 1m))'
        ' / on(gpu) group_left(UUID, modelName) label_replace(gpu:info:labels, "x", "$1", "name", "(.+)")'
        " > 0.5 and up == bool 1e3 unless absent(gpud_clients)"
    )
    assert series_names(expr) == {"gpud_lock_wait_seconds_bucket", "gpu:info:labels", "up", "gpud_clients"}


def test_promtool_checks_the_rules_file_and_the_test_copy(tmp_path: Path) -> None:
    promtool = need("promtool")
    copy_ = tmp_path / "rules.yml"
    copy_.write_text(rules_with_for("0s"))
    for path in (RULES, copy_):
        out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"SUCCESS: {len(recording_rules()) + len(alerting_rules())} rules found" in out.stdout


def test_the_test_copy_changes_only_for() -> None:
    original = RULES.read_text().splitlines()
    changed = rules_with_for("0s").splitlines()
    diff = [(a, b) for a, b in zip(original, changed) if a != b]
    assert len(original) == len(changed) and len(diff) == len(alerting_rules())
    assert all(a.strip().startswith("for:") and b.strip() == "for: 0s" for a, b in diff)


def test_every_rule_reads_only_series_gpud_exports_or_a_rule_records() -> None:
    exported = exported_series()
    recorded_all = set(recording_rules())
    for group in rule_groups():
        recorded_before: set[str] = set()  # a recording rule may read what its own group recorded before it
        for rule in group["rules"]:
            known = exported | (recorded_all if "alert" in rule else recorded_before)
            names = series_names(rule["expr"])
            assert names, rule
            assert names <= known, f"{rule.get('record') or rule.get('alert')}: unknown {sorted(names - known)}"
            if "record" in rule:
                recorded_before.add(rule["record"])


def test_recorded_names_are_level_metric_operations_and_unique() -> None:
    names = [r["record"] for g in rule_groups() for r in g["rules"] if "record" in r]
    assert len(names) == len(set(names))
    assert [n for n in names if not RECORDED.match(n)] == []


def test_every_alert_has_a_for_a_severity_and_words_for_the_operator() -> None:
    alerts = alerting_rules()
    assert {"GpudDown", "GpudGpuUnhealthy", "GpudGpuDrainingTooLong", "GpudPreemptionGraceOverruns"} <= set(alerts)
    assert {"GpudPreemptionThrash", "GpudTenantOverQuota", "GpudStoreFailures", "GpudSessionOverComputeLimit"} <= set(
        alerts
    )
    for name, rule in alerts.items():
        assert DURATION.match(str(rule["for"])), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_every_rule_is_named_in_the_docs() -> None:
    page = (ROOT / "docs" / "metrics-and-logs.md").read_text()
    assert [name for name in [*recording_rules(), *alerting_rules()] if f"`{name}`" not in page] == []


def test_the_dashboard_is_current_grafana_json_with_a_row_per_capability() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39 and board["uid"] and board["title"]
    assert {v["name"] for v in board["templating"]["list"]} == VARIABLES
    queried = [v for v in board["templating"]["list"] if v["type"] == "query"]
    assert queried and all(v["query"] == v["definition"] for v in queried)  # what is checked is what runs
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == ROWS
    every = panels(board)
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in every:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] >= 1, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] in ("row", "text"):
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"] == p["datasource"] and t["expr"].strip() for t in p["targets"]), p["title"]


def test_every_dashboard_query_names_only_series_that_exist() -> None:
    board = dashboard()
    known = exported_series() | set(recording_rules())
    queries = dashboard_queries(all_values(board), board)
    # Every expr in the file is one of these: the integration test, which evaluates them all, misses none.
    assert len([q for q in queries if q.label is None]) == len(every_expr(board))
    for q in queries:
        names = series_names(q.expr)
        assert names and names <= known, f"{q.where}: {q.expr} names {sorted(names - known)}"


def test_a_panel_naming_a_series_that_does_not_exist_is_caught() -> None:
    board = copy.deepcopy(dashboard())
    panel = next(p for p in board["panels"] if p["type"] == "timeseries")
    panel["targets"][0]["expr"] = 'gpud_gpu_allocated_ratios{instance=~"$instance"}'
    known = exported_series() | set(recording_rules())
    unknown = [q for q in dashboard_queries(all_values(board), board) if not series_names(q.expr) <= known]
    assert [q.where for q in unknown] == [panel["title"]]
    panel["targets"][0]["expr"] = "gpud_clients{node=~'$node'}"
    with pytest.raises(KeyError, match=r"\$node"):
        dashboard_queries(all_values(board), board)


def test_the_kubernetes_row_is_built_on_the_tenant_series_and_the_agents_of_the_chosen_namespaces() -> None:
    board = dashboard()
    rows = [p for p in board["panels"]]
    start = next(i for i, p in enumerate(rows) if p["type"] == "row" and p["title"] == ROWS[-1])
    k8s = [p for p in rows[start + 1 :] if p["type"] not in ("row", "text")]
    recorded = recording_rules()
    tenants = agents = 0
    for target in (t for p in k8s for t in p["targets"]):
        names = series_names(target["expr"])
        read = names | {n for r in names & set(recorded) for n in series_names(recorded[r])}
        if all("tenant" in name for name in names):  # gpud's tenants, the chosen ones
            tenants += 1
            assert 'tenant=~"$namespace"' in target["expr"]
        else:  # gpud-k8s's own series; those of claims, by the claims' namespaces chosen
            agents += 1
            assert all("gpud_k8s_" in name for name in read), target["expr"]
            if any(n.startswith(("namespace:", "claim:", "gpud_k8s_claim")) for n in names):
                assert 'namespace=~"$k8s_namespace"' in target["expr"], target["expr"]
    assert tenants >= 3 and agents >= 5
