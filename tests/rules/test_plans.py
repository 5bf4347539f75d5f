"""Maintenance plans carried out by the engine: what a plan reads (the cluster-wide usage
rows), the operators' intents, the owners' notices and answers (docs/maintenance.md)."""

from __future__ import annotations

from typing import Any

from handlers.core.cluster import UsageVM
from handlers.core.tables import USAGE
from samples.cluster import A100, RTX, node, vm, vmi
from tests.support.harness import Harness

ALICE, BOB, OPS = "alice@example.com", "bob@example.com", "ops@example.com"
NS = "spx-proj-a"


def after(obj: dict[str, Any], choice: str) -> dict[str, Any]:
    """``obj`` (a VM) with its owner's choice after a planned maintenance."""
    obj["metadata"].setdefault("annotations", {})["vmstream.io/after-maintenance"] = choice
    return obj


def labelled(obj: dict[str, Any], **labels: str) -> dict[str, Any]:
    obj["metadata"]["labels"].update(labels)
    return obj


# ------------------------------------------------------------------ what a plan reads


def test_a_node_s_usage_row_carries_its_gpu_vms_and_its_labels() -> None:
    h = Harness()
    h.observe_all(labelled(node("gpu-node-1", gpus={RTX: 2, A100: 1}), rack="r1"),
                  after(vm(NS, "vm-1", project="proj-a", owner=ALICE, gpu=RTX), "same_node"),
                  vmi(NS, "vm-1", node_name="gpu-node-1", gpu=RTX),
                  vm(NS, "vm-2", project="proj-a", gpu=A100, run_strategy="Manual"),
                  vmi(NS, "vm-2", node_name="gpu-node-1", gpu=A100))
    usage = h.state.get(USAGE, "gpu-node-1")
    assert usage is not None
    assert usage.labels["rack"] == "r1"
    assert usage.vms == (
        UsageVM(f"vm/{NS}/vm-1", f"uid-vm-{NS}-vm-1", (RTX,), "Always", (ALICE,), "proj-a", "same_node"),
        UsageVM(f"vm/{NS}/vm-2", f"uid-vm-{NS}-vm-2", (A100,), "Manual", ("project:proj-a",), "proj-a", "elsewhere"),
    )


def test_an_unknown_after_maintenance_choice_is_elsewhere_and_a_change_reaches_the_usage_row() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}),
                  after(vm(NS, "vm-1", project="proj-a", owner=ALICE, gpu=RTX), "somewhere"),
                  vmi(NS, "vm-1", node_name="gpu-node-1", gpu=RTX))
    usage = h.state.get(USAGE, "gpu-node-1")
    assert usage is not None and [v.after_maintenance for v in usage.vms] == ["elsewhere"]
    h.observe(after(vm(NS, "vm-1", project="proj-a", owner=ALICE, gpu=RTX, rv=2), "stay_off"), "MODIFIED")
    usage = h.state.get(USAGE, "gpu-node-1")
    assert usage is not None and [v.after_maintenance for v in usage.vms] == ["stay_off"]
