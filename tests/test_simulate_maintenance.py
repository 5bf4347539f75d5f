"""``vmstream simulate --maintenance``: the planner's plan, offline, as a what-if — the same
numbers as ``plan_maintenance`` on the same request, a bad request refused with its reason."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from handlers.contracts.messages import PlanMaintenanceSpec
from handlers.rules.maintenance import (
    GPUVM,
    MaintenanceRequest,
    OtherNode,
    PlannedNode,
    name_order_baseline,
    plan_maintenance,
)
from streams.cli.main import main
from streams.cli.planning import AZ, az_document, plan_json, spec_document, what_if
from tests.rules.test_maintenance import requests

PUBLISHED = datetime(2027, 1, 4, 8, 0, tzinfo=UTC)
START = PUBLISHED + timedelta(days=3)

# Two A100 nodes full, one L40S node, a spare node with one free A100 card and a CPU node.
AZ_FILE: dict[str, Any] = {"nodes": [
    {"name": "gpu-a", "labels": {"pool": "a100"}, "cards": {"a100": 2}, "vms": [
        {"namespace": "spx-p", "name": "train", "owner": "ana@example.com", "project": "p",
         "gpus": {"a100": 1}, "run_strategy": "Always"},
        {"namespace": "spx-p", "name": "notebook", "project": "p", "gpus": {"a100": 1},
         "run_strategy": "Manual"},
    ]},
    {"name": "gpu-b", "labels": {"pool": "a100"}, "cards": {"a100": 2}, "vms": [
        {"namespace": "spx-q", "name": "big", "owner": "bo@example.com", "gpus": {"a100": 2},
         "run_strategy": "Always"},
    ]},
    {"name": "gpu-c", "labels": {"pool": "l40s"}, "cards": {"l40s": 1}, "vms": [
        {"namespace": "spx-q", "name": "render", "owner": "bo@example.com", "gpus": {"l40s": 1},
         "run_strategy": "Always", "after_maintenance": "same_node"},
    ]},
    {"name": "spare", "cards": {"a100": 2}, "vms": [
        {"namespace": "spx-r", "name": "infer", "owner": "cy@example.com", "gpus": {"a100": 1}},
    ]},
    {"name": "cpu", "labels": {"pool": "a100"}, "schedulable": False},
]}
SPEC: dict[str, Any] = {
    "plan": "a100-firmware", "node_selector": {"pool": "a100"},
    "earliest_start": "2027-01-07T08:00:00Z", "latest_end": "2027-01-08T08:00:00Z",
    "concurrency": 1, "node_duration_seconds": 4 * 3600, "notice_seconds": 3 * 86400, "reason": "firmware",
}


def the_request() -> MaintenanceRequest:
    """AZ_FILE and SPEC as the planner's request, written by hand."""
    a = PlannedNode("gpu-a", {"a100": 2}, (
        GPUVM("spx-p/train", "train", "spx-p", "ana@example.com", {"a100": 1}, "Always", project="p"),
        GPUVM("spx-p/notebook", "notebook", "spx-p", "project:p", {"a100": 1}, "Manual", project="p"),
    ))
    b = PlannedNode("gpu-b", {"a100": 2}, (GPUVM("spx-q/big", "big", "spx-q", "bo@example.com", {"a100": 2}, "Always"),))
    cpu = PlannedNode("cpu", {}, ())
    return MaintenanceRequest(
        nodes=(a, b, cpu), others=(OtherNode("gpu-c", {}), OtherNode("spare", {"a100": 1})),
        earliest_start=START, latest_end=START + timedelta(days=1), concurrency=1,
        duration=timedelta(hours=4), notice=timedelta(days=3), published=PUBLISHED)


def write(tmp_path: Path, spec: Any, az: Any = AZ_FILE) -> tuple[str, str]:
    spec_path, az_path = tmp_path / "plan.json", tmp_path / "az.json"
    spec_path.write_text(json.dumps(spec))
    az_path.write_text(json.dumps(az))
    return str(spec_path), str(az_path)


def simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_what_if_prints_plan_maintenances_plan_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, az = write(tmp_path, SPEC)
    code, out, _ = simulate(capsys, "--maintenance", spec, "--az", az, "--at", "2027-01-04T08:00:00Z",
                            "--json", "--compare")
    assert code == 0
    document = json.loads(out)
    request = the_request()
    assert document["planned"] == plan_json(plan_maintenance(request))
    assert document["name_order"] == plan_json(name_order_baseline(request))
    assert document["plan"] == "a100-firmware"
    assert document["request"]["nodes"] == ["gpu-a", "gpu-b", "cpu"]
    totals = document["planned"]["totals"]
    assert totals["fates"] == {"lands_elsewhere": 2, "back_on_own_node": 0, "stays_off": 1, "waits_for_card": 0}
    assert totals["lead_min_seconds"] == 3 * 86400
    assert totals["duration_seconds"] == 12 * 3600
    assert [slot["node"] for slot in document["planned"]["slots"]] == ["cpu", "gpu-a", "gpu-b"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_the_what_if_of_any_request_is_the_planners_plan(request: MaintenanceRequest) -> None:
    """The AZ and the request written as the files the what-if reads give the plan
    plan_maintenance makes of the request itself, and the same baseline."""
    spec = PlanMaintenanceSpec.model_validate(spec_document(request))
    az = AZ.model_validate(json.loads(json.dumps(az_document(request))))
    result = what_if(spec, az, request.published, compare=True)
    assert result.baseline is not None
    assert plan_json(result.plan) == plan_json(plan_maintenance(request))
    assert plan_json(result.baseline) == plan_json(name_order_baseline(request))


def test_the_table_says_how_long_and_how_many_wait(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, az = write(tmp_path, SPEC)
    code, out, _ = simulate(capsys, "--maintenance", spec, "--az", az, "--at", "2027-01-04T08:00:00Z", "--compare")
    assert code == 0
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert rows["duration"][-4:] == ["12.0", "h", "12.0", "h"]
    assert rows["VMs waiting for a card"][-2:] == ["0", "0"]
    assert "spx-q/big" in out and "name order, one by one" in out


def test_a_whole_intent_is_read_and_published_at_its_requested_at(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    intent = {"type": "plan_maintenance", "intent_id": "plan-1", "requested_by": "ops@example.com",
              "requested_at": "2027-01-05T08:00:00Z", "spec": SPEC}
    spec, az = write(tmp_path, intent)
    code, out, _ = simulate(capsys, "--maintenance", spec, "--az", az, "--json")
    assert code == 0
    document = json.loads(out)
    assert document["request"]["published"] == "2027-01-05T08:00:00Z"
    assert document["request"]["first_start"] == "2027-01-08T08:00:00Z"  # the notice pushes the start
    assert document["planned"]["totals"]["nodes_outside_window"] != []


def _without(key: str) -> dict[str, Any]:
    return {k: v for k, v in SPEC.items() if k != key}


@pytest.mark.parametrize(("spec", "az", "says"), [
    ({**SPEC, "nodes": ["gpu-a"]}, AZ_FILE, "give exactly one of nodes and node_selector"),
    ({**_without("node_selector"), "nodes": ["gpu-z"]}, AZ_FILE, "gpu-z are not in the AZ"),
    ({**_without("node_selector"), "nodes": ["gpu-a", "gpu-a"]}, AZ_FILE, "a node is named once"),
    ({**SPEC, "node_selector": {"pool": "h100"}}, AZ_FILE, "no node of the AZ has the labels"),
    ({**SPEC, "concurrency": 0}, AZ_FILE, "concurrency"),
    ({**SPEC, "latest_end": "2027-01-06T08:00:00Z"}, AZ_FILE, "latest_end must be after earliest_start"),
    # The intent's own spec: a plan id and a reason are required, the id a DNS-1123 label.
    (_without("reason"), AZ_FILE, "reason: Field required"),
    (_without("plan"), AZ_FILE, "plan: Field required"),
    ({**SPEC, "plan": "A100_firmware"}, AZ_FILE, "plan: must be a DNS-1123 label"),
    ({**SPEC, "window": 3}, AZ_FILE, "window: Extra inputs are not permitted"),
    (_without("node_duration_seconds"), AZ_FILE, "node_duration_seconds: Field required"),
    ({"type": "drain_node", "spec": SPEC}, AZ_FILE, "not plan_maintenance"),
    (SPEC, {"nodes": [{"name": "gpu-a", "labels": {"pool": "a100"}, "cards": {"a100": 1}, "vms": [
        {"namespace": "n", "name": "v", "owner": "o@example.com", "gpus": {"a100": 2}}]}]},
     "the VMs on node gpu-a hold 2 a100 cards; it has 1"),
    (SPEC, {"nodes": [{"name": "gpu-a", "labels": {"pool": "a100"}, "cards": {"a100": 1}, "vms": [
        {"namespace": "n", "name": "v", "gpus": {"a100": 1}}]}]}, "neither an owner nor a project"),
])
def test_an_invalid_request_exits_2_with_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    spec: Any, az: Any, says: str) -> None:
    spec_path, az_path = write(tmp_path, spec, az)
    code, out, err = simulate(capsys, "--maintenance", spec_path, "--az", az_path, "--at", "2027-01-04T08:00:00Z")
    assert code == 2 and out == ""
    assert err.startswith("vmstream simulate: ") and says in err and len(err.splitlines()) == 1


def test_the_what_if_needs_its_az_and_its_options_need_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, _ = write(tmp_path, SPEC)
    code, _, err = simulate(capsys, "--maintenance", spec)
    assert code == 2 and "--maintenance needs the AZ" in err
    code, _, err = simulate(capsys, "--compare")
    assert code == 2 and "go with --maintenance" in err
    code, _, err = simulate(capsys, "--maintenance", str(tmp_path / "missing.json"), "--az", spec)
    assert code == 2 and "cannot be read" in err


def test_the_operators_guide_shows_what_the_what_if_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/operators.md's plan request and AZ give the output it shows (abridged there)."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "operators.md").read_text(encoding="utf-8")
    section = doc.split("## 6. Planning GPU node maintenance with the owners")[1].split("\n## ")[0]
    blocks = section.split("```")[1::2]  # the code blocks
    spec, az = [json.loads(block.removeprefix("json\n")) for block in blocks if block.startswith("json\n")][:2]
    shown = next(block for block in blocks if block.startswith("\nmaintenance plan "))
    spec_path, az_path = write(tmp_path, spec, az)
    code, out, _ = simulate(capsys, "--maintenance", spec_path, "--az", az_path, "--at", "2027-01-04T06:00:00Z",
                            "--compare")
    assert code == 0
    printed = out.splitlines()
    expected = [line for line in shown.strip("\n").splitlines() if line != "…"]
    assert [line for line in printed if line in expected] == expected
    intent = json.loads(next(block for block in blocks if '"type": "plan_maintenance"' in block).removeprefix("json\n"))
    assert intent["spec"] == spec
