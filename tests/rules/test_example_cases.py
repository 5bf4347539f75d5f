"""The shipped example of each KubeVirt case (examples/build.py) shows the right outputs
under ``simulate``: run strategies, an eviction, drains called off, RestartRequired."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from handlers.decide.engine import Engine
from streams.common.settings import load_settings
from streams.cli.simulating import Simulation

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


def outputs(name: str) -> list[tuple[str, dict[str, Any]]]:
    engine = Engine(load_settings(EXAMPLES / "config.yaml").rules())
    with open(EXAMPLES / f"{name}.jsonl", encoding="utf-8") as lines:
        return [(o["topic"], o["value"]) for o in map(json.loads, Simulation(engine).feed(lines))]


def commands(name: str) -> list[tuple[str, str]]:
    return [(v["type"], v["target"]["name"]) for t, v in outputs(name) if t == "vmstream.commands"]


def notifications(name: str, type_: str) -> list[dict[str, Any]]:
    return [v for t, v in outputs(name) if t == "vmstream.notifications" and v["type"] == type_]


def test_run_strategies_example() -> None:
    fates = {n["subject"]["name"]: n["details"]["outcome"]
             for n in notifications("run-strategies", "drain_will_stop_gpu_vm")}
    assert fates == {"run-always": "waits_for_gpu", "run-once": "waits_for_gpu", "run-legacy": "waits_for_gpu",
                     "run-rerun": "needs_manual_start", "run-manual": "needs_manual_start"}
    assert sorted(name for kind, name in commands("run-strategies") if kind == "delete_vmi") == [
        "run-always", "run-legacy", "run-manual", "run-once", "run-rerun"]
    [done] = notifications("run-strategies", "drain_completed")
    assert done["details"]["observed"] == {
        "came_back": ["vm/spx-proj-c/run-always", "vm/spx-proj-c/run-once"],
        "waits_for_gpu": ["vm/spx-proj-c/run-legacy"],
        "off": ["vm/spx-proj-c/run-manual", "vm/spx-proj-c/run-rerun"],
    }


def test_eviction_example_stops_its_one_vm_and_cordons_nothing() -> None:
    assert commands("eviction") == [("delete_vmi", "train-1")]
    [told] = notifications("eviction", "drain_will_stop_gpu_vm")
    assert told["subject"]["name"] == "train-1" and told["details"]["scope"] == "evictions"
    [done] = notifications("eviction", "drain_completed")
    assert done["details"]["observed"]["came_back"] == ["vm/spx-proj-a/train-1"]


def test_called_off_example_stops_nothing_and_undoes_only_its_own_cordons() -> None:
    assert commands("called-off") == [("cordon_node", "gpu-node-1"), ("uncordon_node", "gpu-node-1"),
                                      ("cordon_node", "gpu-node-2"), ("uncordon_node", "gpu-node-2"),
                                      ("cordon_node", "gpu-node-1")]
    off = notifications("called-off", "drain_called_off")
    to_owners = [n["subject"]["name"] for n in off if n["subject"]["kind"] == "VirtualMachine"]
    assert to_owners == ["batch-1", "train-1", "infer-1", "batch-1", "train-1"]
    assert [n["recipients"] for n in off if n["subject"]["kind"] == "Node"] == [["ops@example.com"]] * 3
    assert len(notifications("called-off", "drain_will_stop_gpu_vm")) == 5


def test_restart_required_example_tells_the_gpu_change_once() -> None:
    [told] = notifications("restart-required", "gpu_change_pending_restart")
    assert told["subject"]["name"] == "dev-1"
