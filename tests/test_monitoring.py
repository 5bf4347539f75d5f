"""deploy/components/monitoring: promtool checks the alerting rules and runs their unit tests
(every alert firing and not firing), and every query of the rules and of the Grafana
dashboard names only series vmstream exports. promtool is built from the Go module proxy
(tools/monitoring/build.sh, ``make parts``); tests/kube/test_monitoring.py dry-runs the
objects against prometheus-operator's CRDs."""

from __future__ import annotations

import json
import re
import shutil
import runpy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import streams.cli.main  # noqa: F401 — every process's families, as the command imports them
import streams.serve.api  # noqa: F401
import streams.worker.app  # noqa: F401
from harness.monitoring import promtool
from streams.common import metrics

ROOT = Path(__file__).resolve().parents[1]
COMPONENT = ROOT / "deploy" / "components" / "monitoring"
RULE = COMPONENT / "prometheusrule.yaml"
DASHBOARD = COMPONENT / "dashboard.json"
UNIT_TESTS = ROOT / "tests" / "monitoring" / "alerts.test.yaml"
SERIES = re.compile(r"\b(vmstream_[a-z0-9_]+)")
# What Prometheus itself adds to every target, and PromQL's own words.
NOT_OURS = {"up"}


def rule_groups() -> dict[str, Any]:
    rule = yaml.safe_load(RULE.read_text())
    assert rule["kind"] == "PrometheusRule"
    return {"groups": rule["spec"]["groups"]}


def alerts() -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in rule_groups()["groups"] for r in g["rules"] if "alert" in r}


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PrometheusRule's groups as a Prometheus rules file, beside the unit tests."""
    directory = tmp_path_factory.mktemp("rules")
    (directory / "rules.yaml").write_text(yaml.safe_dump(rule_groups(), sort_keys=False))
    shutil.copy(UNIT_TESTS, directory / "alerts.test.yaml")
    return directory


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool()), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)


def exported() -> set[str]:
    return {name for process in metrics.PROCESSES for name in metrics.series_names(process)}


def test_promtool_finds_the_rules_valid(rules_dir: Path) -> None:
    result = run_promtool("check", "rules", "rules.yaml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests_pass(rules_dir: Path) -> None:
    result = run_promtool("test", "rules", "alerts.test.yaml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    for name in alerts():
        assert any(c["alertname"] == name and c["exp_alerts"] for c in cases), f"{name} never fires"
        assert any(c["alertname"] == name and not c["exp_alerts"] for c in cases), f"{name} is never quiet"


def test_the_unit_tests_fail_when_an_alert_would_not_fire(rules_dir: Path, tmp_path: Path) -> None:
    """The tests can fail: with the drain alert's grace raised past the test's window they do."""
    groups = rule_groups()
    for group in groups["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "VmstreamDrainPastDeadline":
                rule["expr"] = rule["expr"].replace("> 300", "> 3000")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups, sort_keys=False))
    shutil.copy(UNIT_TESTS, tmp_path / "alerts.test.yaml")
    result = run_promtool("test", "rules", "alerts.test.yaml", cwd=tmp_path)
    assert result.returncode != 0 and "VmstreamDrainPastDeadline" in result.stdout + result.stderr


def dashboard_queries(board: dict[str, Any]) -> list[str]:
    queries = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    queries += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return queries


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_query_names_only_series_vmstream_exports(source: str) -> None:
    queries = list(alerts().values()) if source == "rules" else dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert queries
    known = exported()
    for query in queries:
        named = set(SERIES.findall(query))
        assert named or set(re.findall(r"\b\w+\b", query)) & NOT_OURS, query
        assert named <= known, (query, named - known)


def test_the_dashboard_shows_capacity_and_drains() -> None:
    board = json.loads(DASHBOARD.read_text())
    queries = " ".join(dashboard_queries(board))
    for series in ("vmstream_gpus_free", "vmstream_gpus_used", "vmstream_vms_waiting_for_gpu",
                   "vmstream_drain_deadline_timestamp_seconds", "vmstream_drain_vms_left"):
        assert series in queries
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace", "class"}
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))


def test_the_dashboard_is_what_its_generator_writes() -> None:
    generator = runpy.run_path(str(ROOT / "tools" / "monitoring" / "dashboard.py"))
    assert json.loads(DASHBOARD.read_text()) == generator["dashboard"](), "run python tools/monitoring/dashboard.py"
