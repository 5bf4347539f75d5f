"""The read API's answers (handlers/reads/views.py), computed from the state the rules leave."""

from __future__ import annotations

from typing import Any

from handlers.core.catalog import Catalog
from handlers.reads.views import gpu_classes, project_view, vm_badge
from samples.cluster import A100, RTX, kubevirt_cr, node, vm, vmi
from tests.support.harness import Harness

ALICE, BOB = "alice@example.com", "bob@example.com"
OPS = "ops@example.com"


def catalog(h: Harness) -> Catalog:
    return h.engine.catalog


def az(**vm_kwargs: Any) -> Harness:
    """Two GPU nodes; alice's w-1 runs without a GPU, bob's g-1 holds an RTX card."""
    h = Harness()
    h.observe_all(
        node("gpu-node-1", gpus={RTX: 2}),
        node("gpu-node-2", gpus={RTX: 1, A100: 1}),
        vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, **vm_kwargs),
        vmi("spx-proj-a", "w-1", node_name="gpu-node-1"),
        vm("spx-proj-b", "g-1", project="proj-b", owner=BOB, gpu=RTX, run_strategy="Always"),
        vmi("spx-proj-b", "g-1", node_name="gpu-node-1", gpu=RTX, cpu_model="host-passthrough"),
    )
    return h


def test_the_class_list_counts_cards_per_class_and_says_what_kubevirt_permits() -> None:
    h = az()
    listed = {c.name: c for c in gpu_classes(h.state, catalog(h), az="az1").classes}
    rtx, a100 = listed["nvidia-rtx-pro-6000-bse"], listed["nvidia-a100"]
    assert (rtx.total, rtx.in_use, rtx.free, rtx.permitted) == (3, 1, 2, True)
    assert rtx.display_name == "NVIDIA RTX PRO 6000 Blackwell Server Edition" and rtx.device_name == RTX
    assert (a100.total, a100.in_use, a100.free) == (1, 0, 1)
    cr = kubevirt_cr()
    cr["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"].pop()  # A100 no longer listed
    h.observe(cr)
    listed = {c.name: c for c in gpu_classes(h.state, catalog(h), az="az1").classes}
    assert listed["nvidia-a100"].permitted is False and listed["nvidia-rtx-pro-6000-bse"].permitted is True


def test_a_cordoned_node_takes_its_cards_out_of_free_but_not_of_total() -> None:
    h = az()
    h.observe(node("gpu-node-1", gpus={RTX: 2}, unschedulable=True, rv=2), "MODIFIED")
    rtx = next(c for c in gpu_classes(h.state, catalog(h), az="az1").classes if c.name == "nvidia-rtx-pro-6000-bse")
    assert (rtx.total, rtx.schedulable, rtx.in_use, rtx.free) == (3, 1, 0, 1)


def test_a_device_no_class_names_is_listed_by_its_device() -> None:
    h = az()
    h.observe(node("odd-node", gpus={"nvidia.com/SOMETHING_ELSE": 4}))
    odd = next(c for c in gpu_classes(h.state, catalog(h), az="az1").classes if c.undefined)
    assert (odd.name, odd.class_id, odd.total, odd.free) == ("nvidia.com/SOMETHING_ELSE", None, 4, 4)


def test_set_gpu_on_a_running_vm_shows_applies_after_restart_until_it_restarts() -> None:
    h = az()
    before = vm_badge(h.state, catalog(h), "spx-proj-a", "w-1")
    assert before is not None and before.waits_for is None and before.badge is None and before.gpus_now == []
    h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "w-1", "gpu_class": "nvidia-a100"})
    accepted = vm_badge(h.state, catalog(h), "spx-proj-a", "w-1")
    assert accepted is not None and accepted.waits_for == "restart" and accepted.owner_told
    h.observe(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=A100, rv=2), "MODIFIED")
    patched = vm_badge(h.state, catalog(h), "spx-proj-a", "w-1")
    assert patched is not None
    assert patched.badge == "(applies after restart)" and patched.running and patched.node == "gpu-node-1"
    assert patched.gpus_now == [] and [g.class_id for g in patched.gpus_after_restart] == ["nvidia-a100"]
    h.observe(vmi("spx-proj-a", "w-1", node_name="gpu-node-2", gpu=A100, generation=2), "MODIFIED")
    restarted = vm_badge(h.state, catalog(h), "spx-proj-a", "w-1")
    assert restarted is not None and restarted.waits_for is None
    assert [g.class_id for g in restarted.gpus_now] == ["nvidia-a100"] and restarted.node == "gpu-node-2"


def test_a_vm_waiting_for_a_card_says_so() -> None:
    h = az()
    h.observe(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=A100, rv=2,
                 printable_status="ErrorUnschedulable"), "MODIFIED")
    h.observe(vmi("spx-proj-a", "w-1", node_name=None, gpu=A100, phase="Pending", unschedulable=True,
                  generation=2), "MODIFIED")
    badge = vm_badge(h.state, catalog(h), "spx-proj-a", "w-1")
    assert badge is not None
    assert (badge.waits_for, badge.badge, badge.owner_told) == ("gpu", "(waiting for a free GPU)", True)


def test_an_unknown_vm_has_no_badge() -> None:
    h = az()
    assert vm_badge(h.state, catalog(h), "spx-proj-a", "nope") is None


def test_a_project_sees_its_waiting_vms_and_the_drains_that_warned_its_owners_only() -> None:
    h = az()
    h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "w-1", "gpu_class": "nvidia-a100"})
    h.intent("drain_node", {"node": "gpu-node-1", "reason": "firmware", "notice_seconds": 600}, by=OPS, project=None)
    tracked = list(h.state.tables["tracking"])
    mine = project_view(h.state, catalog(h), "proj-a", tracked=tracked)
    assert [(b.name, b.waits_for) for b in mine.pending] == [("w-1", "restart")]
    assert mine.drains == []  # w-1 holds no GPU on the node: nothing of proj-a is stopped
    theirs = project_view(h.state, catalog(h), "proj-b", tracked=tracked)
    assert theirs.pending == []
    [drain] = theirs.drains
    assert (drain.node, drain.reason, drain.deadline_passed) == ("gpu-node-1", "firmware", False)
    assert [(v.vm, v.outcome, v.stopped) for v in drain.vms] == [("vm/spx-proj-b/g-1", "returns_automatically", False)]
    assert project_view(h.state, catalog(h), "proj-c", tracked=tracked).model_dump() == {
        "project": "proj-c", "pending": [], "drains": []}
