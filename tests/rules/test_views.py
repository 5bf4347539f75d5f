"""The read API's answers (handlers/reads/views.py), computed from the state the rules leave."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from handlers.core.catalog import Catalog
from handlers.reads.plans import plan_list, plan_view
from handlers.reads.views import gpu_classes, project_view, vm_badge
from samples.cluster import A100, RTX, kubevirt_cr, node, vm, vmi
from tests.support.harness import START, Harness

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


# ------------------------------------------------------------------ maintenance plans


def planned() -> Harness:
    """tests/rules/test_plans.py's AZ and plan: alice's vm-1 (proj-a) on gpu-node-1, bob's
    vm-2 and vm-3 (proj-b) on gpu-node-2."""
    from tests.rules.test_plans import az as plan_az
    from tests.rules.test_plans import make_plan

    h = plan_az()
    assert make_plan(h).judgement.outcome == "accepted"
    return h


def test_an_operator_sees_every_plan_per_node_per_vm_and_per_owner() -> None:
    h = planned()
    [summary] = plan_list(h.state, project=None).plans
    assert (summary.plan, summary.reason, summary.requested_by) == ("fw-2026-12", "firmware upgrade", OPS)
    assert (summary.nodes, summary.vms, summary.waits_for_card, summary.cancelled) == (2, 3, 0, False)
    shown = plan_view(h.state, "fw-2026-12", project=None)
    assert shown is not None
    assert [(n.node, n.phase, n.vms, n.held) for n in shown.nodes] == [
        ("gpu-node-1", "planned", 1, False), ("gpu-node-2", "planned", 2, False)]
    first = START + timedelta(days=1)
    assert shown.nodes[0].start == first and shown.nodes[0].end == first + timedelta(hours=1)
    vms = {v.name: v for v in shown.vms}
    assert (vms["vm-1"].node, vms["vm-1"].stop, vms["vm-1"].fate, vms["vm-1"].project) == (
        "gpu-node-1", first, "lands_elsewhere", "proj-a")
    assert vms["vm-2"].fate == "back_on_own_node" and vms["vm-2"].back_at == first + timedelta(hours=2)
    assert vms["vm-3"].fate == "stays_off" and vms["vm-3"].back_at is None and vms["vm-3"].reason
    assert all(v.notices == 1 for v in shown.vms)
    assert vms["vm-1"].recipients == [ALICE] and vms["vm-2"].recipients == [BOB]
    assert [(o.owner, [v.name for v in o.vms]) for o in shown.owners] == [
        (ALICE, ["vm-1"]), (BOB, ["vm-2", "vm-3"])]
    assert plan_view(h.state, "no-such-plan", project=None) is None


def test_a_project_sees_only_its_own_vms_of_a_plan_and_not_a_plan_without_them() -> None:
    h = planned()
    mine = plan_view(h.state, "fw-2026-12", project="proj-a")
    assert mine is not None and mine.requested_by is None
    assert [v.name for v in mine.vms] == ["vm-1"]
    assert [n.node for n in mine.nodes] == ["gpu-node-1"]  # bob's node is not shown
    assert [o.owner for o in mine.owners] == [ALICE]
    [summary] = plan_list(h.state, project="proj-a").plans
    assert (summary.nodes, summary.vms, summary.requested_by) == (1, 1, None)
    theirs = plan_view(h.state, "fw-2026-12", project="proj-b")
    assert theirs is not None and sorted(v.name for v in theirs.vms) == ["vm-2", "vm-3"]
    assert ALICE not in theirs.model_dump_json()
    assert plan_view(h.state, "fw-2026-12", project="proj-c") is None  # none of its VMs: no such plan
    assert plan_list(h.state, project="proj-c").plans == []


def test_a_plan_shows_its_nodes_phase_and_the_answers_its_owners_gave() -> None:
    from tests.rules.test_plans import cordoned

    h = planned()
    h.intent("maintenance_ready", {"plan": "fw-2026-12", "namespace": "spx-proj-b", "name": "vm-3"}, by=BOB,
             project="proj-b")
    h.tick()
    h.wait(24 * 3600)
    h.tick()
    cordoned(h, "gpu-node-1")
    shown = plan_view(h.state, "fw-2026-12", project="proj-b")
    assert shown is not None
    vm3 = next(v for v in shown.vms if v.name == "vm-3")
    assert vm3.stopped_early and vm3.notices == 2 and vm3.stop == START  # "ready now": stopped at once
    operator = plan_view(h.state, "fw-2026-12", project=None)
    assert operator is not None and [(n.node, n.phase) for n in operator.nodes][0] == ("gpu-node-1", "draining")
