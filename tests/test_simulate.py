"""``vmstream simulate``: the contract of docs/contracts.md, deterministic to the byte."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from handlers.contracts.topics import RESIDENTS, TIMER
from handlers.decide.engine import Engine
from streams.common.settings import load_settings
from streams.cli.simulating import Simulation

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCENARIOS = sorted(p.stem for p in EXAMPLES.glob("*.jsonl"))


def simulate(name: str) -> list[str]:
    engine = Engine(load_settings(EXAMPLES / "config.yaml").rules())
    with open(EXAMPLES / f"{name}.jsonl", encoding="utf-8") as lines:
        return list(Simulation(engine).feed(lines))


def outputs(name: str, topic: str) -> list[dict[str, Any]]:
    return [json.loads(line)["value"] for line in simulate(name) if json.loads(line)["topic"] == topic]


def test_examples_are_what_the_builder_writes(tmp_path: Path) -> None:
    before = {p.name: p.read_text() for p in EXAMPLES.glob("*") if p.suffix in (".jsonl", ".yaml")}
    subprocess.run([sys.executable, str(EXAMPLES / "build.py")], check=True)
    after = {p.name: p.read_text() for p in EXAMPLES.glob("*") if p.suffix in (".jsonl", ".yaml")}
    assert after == before, "examples/ are stale: run python examples/build.py"


def test_the_cli_is_deterministic_to_the_byte() -> None:
    def run() -> bytes:
        return subprocess.run(
            [sys.executable, "-m", "streams.cli.main", "simulate", "--config", str(EXAMPLES / "config.yaml"),
             "--input", str(EXAMPLES / "drain.jsonl")],
            check=True, capture_output=True, cwd=ROOT,
        ).stdout

    first = run()
    assert first and first == run()


INTERNAL = {TIMER, RESIDENTS}  # audit sources that are not topics


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_line_is_audited_once(name: str) -> None:
    inputs = (EXAMPLES / f"{name}.jsonl").read_text().splitlines()
    audits = [a for a in outputs(name, "vmstream.audit") if a["input"]["topic"] not in INTERNAL]
    assert len(audits) == len(inputs)
    assert len({a["audit_id"] for a in audits}) == len(audits)


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_effect_is_named_by_exactly_one_audit_record(name: str) -> None:
    audits = outputs(name, "vmstream.audit")
    named = [i for a in audits for i in a["commands"] + a["notifications"]]
    issued = [c["command_id"] for c in outputs(name, "vmstream.commands")]
    issued += [n["notification_id"] for n in outputs(name, "vmstream.notifications")]
    assert sorted(named) == sorted(issued) and len(set(named)) == len(named)


def test_drain_scenario_tells_owners_then_stops_then_completes() -> None:
    kinds = [(json.loads(line)["topic"], json.loads(line)["value"].get("type")) for line in simulate("drain")]
    order = [k for k in kinds if k[0] != "vmstream.audit"]
    assert order == [
        ("vmstream.commands", "cordon_node"),
        ("vmstream.notifications", "drain_will_stop_gpu_vm"),
        ("vmstream.notifications", "drain_will_stop_gpu_vm"),
        ("vmstream.commands", "delete_vmi"),
        ("vmstream.commands", "delete_vmi"),
        ("vmstream.notifications", "drain_completed"),
    ]


def test_bad_input_scenario_dead_letters_and_rejects_and_goes_on() -> None:
    letters = outputs("bad-input", "vmstream.dlq")
    assert len(letters) == 3
    rejected = [n["details"]["reason"] for n in outputs("bad-input", "vmstream.notifications")
                if n["type"] == "intent_rejected"]
    assert len(rejected) == 6
    created = [c for c in outputs("bad-input", "vmstream.commands") if c["type"] == "create_vm"]
    assert len(created) == 1  # the good intent after the bad ones


def test_a_line_that_is_not_an_input_is_dead_lettered() -> None:
    engine = Engine(load_settings(EXAMPLES / "config.yaml").rules())
    out = [json.loads(line) for line in Simulation(engine).feed(['{"topic": "elsewhere"}'])]
    assert [o["topic"] for o in out] == ["vmstream.dlq", "vmstream.audit"]
    assert out[0]["value"]["source"] == {"topic": "simulate-input", "offset": 1}


@pytest.mark.parametrize("line", [
    '{"topic": "vmstream.k8s-events", "value": {"a": 1,}}',  # refused by both parsers
    '{"topic": "vmstream.k8s-events", "value": "\tx"}',  # a raw control character
    '{"topic": "vmstream.k8s-events", "value": "\\ud800"}',  # a lone surrogate: json reads it
    '{"topic": "vmstream.k8s-events", "value": {"n": NaN, "big": 123456789012345678901234567890}}',
    '[1, 2]',
])
def test_a_line_is_read_as_json_reads_it_and_refused_in_its_words(line: str) -> None:
    """simulate parses lines with pydantic-core for speed; what it reads and the dead letter
    of a line it cannot read are those of the ``json`` module."""
    from streams.cli.simulating import parse_line

    try:
        expected: object = json.loads(line)
    except ValueError as exc:
        expected = exc
    if isinstance(expected, ValueError):
        [letter, *_] = simulate_lines([line])
        assert json.loads(letter)["value"]["error"] == f"input line 1: {expected}"
    else:
        assert repr(parse_line(line)) == repr(expected)


def simulate_lines(lines: list[str]) -> list[str]:
    engine = Engine(load_settings(EXAMPLES / "config.yaml").rules())
    return list(Simulation(engine).feed(lines))


def test_a_maintenance_plan_s_slot_drains_its_node_in_simulate() -> None:
    """simulate fires a plan's slot (the timer's tick under ``maintenance/<plan>``) before the
    first input at or after it, and decides the node's ``go`` step right after."""
    from samples.cluster import RTX, iso, node, vm, vmi

    start = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)

    def event(n: int, obj: dict[str, Any], at: datetime, type_: str = "ADDED") -> str:
        metadata = obj["metadata"]
        key = "/".join(p for p in (obj["kind"], metadata.get("namespace"), metadata["name"]) if p)
        return json.dumps({"topic": "vmstream.k8s-events", "key": key, "value": {
            "event_id": f"ev-{n}", "type": type_, "kind": obj["kind"], "object": obj, "observed_at": iso(at)}})

    before = start - timedelta(days=2)
    plan = {"intent_id": "plan-1", "type": "plan_maintenance", "requested_by": "ops@example.com",
            "requested_at": iso(before), "spec": {
                "plan": "fw", "nodes": ["gpu-node-1"], "earliest_start": iso(start),
                "latest_end": iso(start + timedelta(days=1)), "node_duration_seconds": 3600,
                "notice_seconds": 86400, "reason": "firmware"}}
    lines = [
        event(1, node("gpu-node-1", gpus={RTX: 2}), before),
        event(2, node("gpu-node-2", gpus={RTX: 2}), before),
        event(3, vm("spx-proj-a", "vm-1", project="proj-a", owner="alice@example.com", gpu=RTX), before),
        event(4, vmi("spx-proj-a", "vm-1", node_name="gpu-node-1", gpu=RTX), before),
        json.dumps({"topic": "vmstream.intents", "key": "maintenance/fw", "value": plan}),
        event(5, node("gpu-node-1", gpus={RTX: 2}, unschedulable=True, rv=2), start, "MODIFIED"),
    ]
    out = [json.loads(line) for line in simulate_lines(lines)]
    notices = [o["value"] for o in out if o["topic"] == "vmstream.notifications"]
    assert [n["type"] for n in notices][:2] == ["maintenance_planned", "maintenance_progress"]
    commands = [(o["value"]["type"], o["value"]["target"]["name"]) for o in out if o["topic"] == "vmstream.commands"]
    assert commands == [("cordon_node", "gpu-node-1"), ("delete_vmi", "vm-1")]
    timer = [o["value"] for o in out if o["topic"] == "vmstream.audit" and o["value"]["input"]["topic"] == TIMER]
    assert [a["input"]["key"] for a in timer][0] == "maintenance/fw"
