"""Run strategies as KubeVirt acts on them: what a drain tells the owner after it deletes
the VMI, and the free cards every VM that comes back competes for (docs/kubevirt.md). The
table the rules follow is checked against KubeVirt's own virt-controller in
tests/kube/test_kubevirt_run_strategies.py."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.core.cluster import effective_run_strategy
from handlers.rules.drains import restarts_by_itself
from samples.cluster import A100, RTX, node, vm, vmi
from tests.support.harness import Harness

ALICE, OPS = "alice@example.com", "ops@example.com"
STRATEGIES = ["Always", "RerunOnFailure", "Manual", "Halted", "Once"]


def drained(*vms: tuple[str, dict[str, Any], str], spare: dict[str, int]) -> Harness:
    """gpu-node-1 runs ``vms`` (name, vm() keyword arguments, device); gpu-node-2 has ``spare``."""
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 8, A100: 8}), node("gpu-node-2", gpus=spare))
    for name, kwargs, device in vms:
        h.observe(vm("p", name, project="proj-a", owner=ALICE, gpu=device, **kwargs))
        h.observe(vmi("p", name, node_name="gpu-node-1", gpu=device))
    h.intent("drain_node", {"node": "gpu-node-1", "reason": "kernel", "notice_seconds": 60}, by=OPS, project=None)
    h.observe(node("gpu-node-1", gpus={RTX: 8, A100: 8}, unschedulable=True, rv=2), "MODIFIED")  # the cordon lands
    return h


def told(h: Harness) -> dict[str, Any]:
    return {n.subject.name: n for n in h.notifications("drain_will_stop_gpu_vm")}


@pytest.mark.parametrize(("spec", "outcome"), [
    ({"run_strategy": "Always"}, "returns_automatically"),
    ({"run_strategy": "Once"}, "returns_automatically"),  # vm.go: vmi == nil → startVMI
    ({"run_strategy": "RerunOnFailure"}, "needs_manual_start"),
    ({"run_strategy": "Manual"}, "needs_manual_start"),
    ({"run_strategy": "Halted"}, "needs_manual_start"),
    ({"run_strategy": None, "running": True}, "returns_automatically"),
    ({"run_strategy": None, "running": False}, "needs_manual_start"),
    ({"run_strategy": None}, "needs_manual_start"),  # neither field: Halted
])
def test_the_owner_is_told_what_kubevirt_does_once_the_vmi_is_deleted(spec: dict[str, Any], outcome: str) -> None:
    h = drained(("v-1", spec, RTX), spare={RTX: 4})
    [notice] = h.notifications("drain_will_stop_gpu_vm")
    assert notice.details["outcome"] == outcome
    assert notice.details["restarts_by_itself"] is (outcome == "returns_automatically")
    h.wait(60)
    [fired] = h.tick()
    assert [(c.type, c.target.name) for c in fired.decision.commands] == [("delete_vmi", "v-1")]


def test_a_vm_without_either_field_is_halted_as_in_kubevirt() -> None:
    assert effective_run_strategy({}) == "Halted"
    assert effective_run_strategy({"running": False}) == "Halted"
    assert effective_run_strategy({"running": True}) == "Always"


def test_a_once_vm_competes_for_the_free_cards_like_an_always_vm() -> None:
    h = drained(("a-1", {"run_strategy": "Always"}, RTX), ("o-1", {"run_strategy": "Once"}, RTX), spare={RTX: 1})
    notices = told(h)
    assert notices["a-1"].details["outcome"] == notices["o-1"].details["outcome"] == "waits_for_gpu"
    assert notices["o-1"].details["restarting_gpu_vms"] == 2


def test_vms_that_stay_off_do_not_compete_for_cards() -> None:
    h = drained(("a-1", {"run_strategy": "Always"}, RTX), ("m-1", {"run_strategy": "Manual"}, RTX),
                ("r-1", {"run_strategy": "RerunOnFailure"}, RTX), spare={RTX: 1})
    assert told(h)["a-1"].details["outcome"] == "returns_automatically"
    assert "1 card(s) of this class free now for 1 GPU VM(s)" in told(h)["a-1"].message


@settings(max_examples=60, deadline=None)
@given(
    vms=st.lists(st.tuples(st.sampled_from(STRATEGIES), st.sampled_from([RTX, A100])), min_size=1, max_size=6),
    spare=st.dictionaries(st.sampled_from([RTX, A100]), st.integers(min_value=1, max_value=4), max_size=2),
)
def test_no_class_is_promised_more_returns_than_it_has_free_cards(
    vms: list[tuple[str, str]], spare: dict[str, int]
) -> None:
    """Invariant: per class, VMs told 'starts again on another node' ≤ free cards; every VM
    that restarts by itself is told it does, every other one that it stays off."""
    h = drained(*((f"v-{i}", {"run_strategy": s}, d) for i, (s, d) in enumerate(vms)), spare=spare)
    notices = told(h)
    promised: Counter[str] = Counter()
    for i, (strategy, device) in enumerate(vms):
        outcome = notices[f"v-{i}"].details["outcome"]
        if restarts_by_itself(strategy):
            assert outcome in ("returns_automatically", "waits_for_gpu")
            promised[device] += outcome == "returns_automatically"
            said = "start again by itself" in notices[f"v-{i}"].message
            assert said is (outcome == "returns_automatically")
        else:
            assert outcome == "needs_manual_start"
    for device, count in promised.items():
        assert count <= spare.get(device, 0)


@settings(max_examples=40, deadline=None)
@given(
    strategies=st.lists(st.sampled_from(STRATEGIES), min_size=1, max_size=5),
    spare=st.integers(min_value=0, max_value=3),
)
def test_drain_completed_tallies_what_kubevirt_then_did(strategies: list[str], spare: int) -> None:
    """Whatever the strategies and cards: after the deadline KubeVirt acts as vm.go says
    (RESTARTS_AFTER_DELETION), the scheduler fills the spare cards in some order, and
    drain_completed reports exactly that — not what was announced."""
    h = drained(*((f"v-{i}", {"run_strategy": s}, RTX) for i, s in enumerate(strategies)), spare={RTX: spare})
    h.wait(60)
    h.tick()
    expected: dict[str, list[str]] = {"came_back": [], "waits_for_gpu": [], "off": []}
    free = spare
    for i, strategy in reversed(list(enumerate(strategies))):  # not the announcement's order
        name = f"v-{i}"
        h.observe(vmi("p", name, node_name="gpu-node-1", phase="Succeeded", gpu=RTX), "DELETED")
        if not restarts_by_itself(strategy):
            expected["off"].append(f"vm/p/{name}")
        elif free:
            free -= 1
            h.observe(vmi("p", name, node_name="gpu-node-2", gpu=RTX, generation=2))
            expected["came_back"].append(f"vm/p/{name}")
        else:
            h.observe(vmi("p", name, node_name=None, phase="Scheduling", gpu=RTX, generation=2, unschedulable=True))
            expected["waits_for_gpu"].append(f"vm/p/{name}")
    [done] = h.notifications("drain_completed")
    assert done.details["observed"] == {fate: sorted(keys) for fate, keys in expected.items()}
