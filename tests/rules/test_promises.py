"""The promise, case by case: no GPU VM is stopped without its owner being told first, and
every owner is told the true fate of their VM — as KubeVirt decides it (docs/kubevirt.md)."""

from __future__ import annotations

from typing import Any

from harness.scenarios import RTX, node, vm, vmi
from tests.support.harness import Harness

ALICE, BOB, OPS = "alice@example.com", "bob@example.com", "ops@example.com"
NS = "spx-proj-a"


def anonymous_gpu_vm(name: str = "anon-1", **kwargs: Any) -> dict[str, Any]:
    """A GPU VM made by hand with neither the owner annotation nor the project label."""
    obj = vm(NS, name, project="proj-a", gpu=RTX, **kwargs)
    obj["metadata"]["labels"] = {}
    return obj


# ------------------------------------------------------------------ everyone is told


def test_a_gpu_vm_with_neither_owner_nor_project_is_announced_to_the_operators() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), anonymous_gpu_vm(),
                  vmi(NS, "anon-1", node_name="gpu-node-1", gpu=RTX, eviction_requested=True))
    [told] = h.notifications("drain_will_stop_gpu_vm")
    assert told.recipients == [OPS]
    assert "no owner" in told.details["told_instead"]


def test_every_notice_about_an_unowned_gpu_vm_reaches_the_operators() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), anonymous_gpu_vm(gpu_rules=False),
                  vmi(NS, "anon-1", node_name="gpu-node-1"))
    assert [n.type for n in h.notifications()] == ["gpu_rules_applied", "gpu_change_pending_restart"]
    assert all(n.recipients == [OPS] for n in h.notifications())
