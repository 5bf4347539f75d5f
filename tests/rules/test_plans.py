"""Maintenance plans carried out by the engine: what a plan reads (the cluster-wide usage
rows), the operators' intents, the owners' notices and answers (docs/maintenance.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.contracts.messages import Notification
from handlers.core.cluster import UsageVM
from handlers.core.maintenance import GPUVM, MaintenanceRequest, OtherNode, PlannedNode, PlanRecord
from handlers.core.tables import DRAINS, PLANS, USAGE
from handlers.rules import plans
from handlers.rules.maintenance import plan_maintenance
from samples.cluster import A100, RTX, node, vm, vmi
from streams.common.codecs import decode_state, encode_state
from tests.support.harness import START, Harness

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


# ------------------------------------------------------------------ a plan accepted

DAY = 24 * 3600
HOUR = 3600
NS_B = "spx-proj-b"


def iso(at: datetime) -> str:
    return at.isoformat()


def az() -> Harness:
    """gpu-node-1 and gpu-node-2 (2 RTX each) run a GPU VM each; gpu-node-3 has 1 RTX spare.
    alice's vm-1 (Always) on gpu-node-1, bob's vm-2 (Always, back on its own node) and
    bob's vm-3 (Manual) on gpu-node-2."""
    h = Harness()
    h.observe_all(
        labelled(node("gpu-node-1", gpus={RTX: 2}), rack="r1"),
        labelled(node("gpu-node-2", gpus={RTX: 2}), rack="r1"),
        node("gpu-node-3", gpus={RTX: 1}),
        vm(NS, "vm-1", project="proj-a", owner=ALICE, gpu=RTX),
        vmi(NS, "vm-1", node_name="gpu-node-1", gpu=RTX),
        after(vm(NS_B, "vm-2", project="proj-b", owner=BOB, gpu=RTX), "same_node"),
        vmi(NS_B, "vm-2", node_name="gpu-node-2", gpu=RTX),
        vm(NS_B, "vm-3", project="proj-b", owner=BOB, gpu=RTX, run_strategy="Manual"),
        vmi(NS_B, "vm-3", node_name="gpu-node-2", gpu=RTX),
    )
    return h


def plan_spec(plan: str = "fw-2026-12", *, start: float = DAY, end: float = 3 * DAY, duration: float = HOUR,
              notice: float = DAY, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "plan": plan, "nodes": ["gpu-node-1", "gpu-node-2"],
        "earliest_start": iso(START + timedelta(seconds=start)), "latest_end": iso(START + timedelta(seconds=end)),
        "concurrency": 1, "node_duration_seconds": int(duration), "notice_seconds": int(notice),
        "reason": "firmware upgrade",
    }
    return {**spec, **overrides}


def make_plan(h: Harness, *, by: str = OPS, **overrides: Any) -> Any:
    return h.intent("plan_maintenance", plan_spec(**overrides), by=by, project=None)


def told(h: Harness, type_: str = "maintenance_planned") -> dict[str, Notification]:
    return {n.subject.name: n for n in h.notifications(type_) if n.subject.kind == "VirtualMachine"}


def refusal(h: Harness) -> str:
    reason: str = h.notifications("intent_rejected")[-1].details["reason"]
    return reason


def test_a_plan_tells_every_gpu_vm_s_owner_when_it_stops_and_what_becomes_of_it() -> None:
    h = az()
    result = make_plan(h)
    assert result.judgement.outcome == "accepted"
    notices = told(h)
    assert sorted(notices) == ["vm-1", "vm-2", "vm-3"]
    assert notices["vm-1"].recipients == [ALICE] and notices["vm-2"].recipients == [BOB]
    first, second = START + timedelta(days=1), START + timedelta(days=1, hours=1)
    assert notices["vm-1"].deadline == first and notices["vm-1"].details["node"] == "gpu-node-1"
    assert notices["vm-1"].details["fate"] == "lands_elsewhere"
    assert notices["vm-2"].deadline == second and notices["vm-2"].details["fate"] == "back_on_own_node"
    assert notices["vm-2"].details["back_at"] == iso(second + timedelta(hours=1))
    assert notices["vm-3"].details["fate"] == "stays_off"
    assert all(not n.details["outside_window"] for n in notices.values())
    assert "will be stopped at 2026-12-01 10:00:00 UTC" in notices["vm-1"].message
    [summary] = h.notifications("maintenance_progress")
    assert summary.recipients == [OPS] and summary.subject.name == "fw-2026-12"
    assert [n["node"] for n in summary.details["nodes"]] == ["gpu-node-1", "gpu-node-2"]
    record = h.state.get(PLANS, "fw-2026-12")
    assert record is not None and record.phases == {"gpu-node-1": "planned", "gpu-node-2": "planned"}
    assert h.commands() == []  # nothing is done before the slot


def test_only_operators_may_plan_a_maintenance() -> None:
    h = az()
    make_plan(h, by=ALICE)
    assert "only operators may" in refusal(h)
    assert h.state.get(PLANS, "fw-2026-12") is None and told(h) == {}


def test_a_plan_naming_an_unknown_node_is_refused() -> None:
    h = az()
    make_plan(h, nodes=["gpu-node-1", "gpu-node-9"])
    assert refusal(h) == "node(s) gpu-node-9 unknown in AZ az1"


def test_a_selector_picks_the_nodes_by_their_labels_and_one_selecting_nothing_is_refused() -> None:
    h = az()
    make_plan(h, nodes=None, node_selector={"rack": "r1"})
    record = h.state.get(PLANS, "fw-2026-12")
    assert record is not None and sorted(record.phases) == ["gpu-node-1", "gpu-node-2"]
    make_plan(h, plan="other", nodes=None, node_selector={"kubernetes.io/hostname": "gpu-node-3"})
    other = h.state.get(PLANS, "other")
    assert other is not None and list(other.phases) == ["gpu-node-3"]
    make_plan(h, plan="none", nodes=None, node_selector={"rack": "r9"})
    assert refusal(h) == "no node of AZ az1 carries the labels rack=r9"


def test_a_plan_id_is_used_once() -> None:
    h = az()
    make_plan(h)
    make_plan(h, nodes=["gpu-node-3"])
    assert "exists already" in refusal(h)


def test_a_plan_of_more_gpu_vms_than_its_row_can_keep_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plans, "PLAN_VMS_MAX", 2)
    h = az()
    make_plan(h)
    assert refusal(h) == "the nodes hold 3 GPU VMs, more than one plan keeps (2): split them into several plans"
    make_plan(h, nodes=["gpu-node-2"])
    assert h.state.get(PLANS, "fw-2026-12") is not None


def test_the_largest_plan_kept_fits_a_changelog_record() -> None:
    """PLAN_VMS_MAX GPU VMs of long names, 8 to a node, in one row under the broker's 1 MB."""
    day = datetime(2026, 12, 1, tzinfo=UTC)
    nodes = tuple(PlannedNode(
        f"gpu-node-{i:04d}-{'x' * 40}", {"nvidia-rtx-pro-6000-bse": 8},
        tuple(GPUVM(f"uid-{i:04d}-{j}-{'u' * 30}", f"vm-{i}-{j}-{'n' * 40}", f"spx-project-{'p' * 40}",
                    f"owner-{i}-{j}@example.com", {"nvidia-rtx-pro-6000-bse": 1}, "Always", project=f"p-{'p' * 40}")
              for j in range(8)))
        for i in range(plans.PLAN_VMS_MAX // 8))
    request = MaintenanceRequest(nodes, (OtherNode("spare", {"nvidia-rtx-pro-6000-bse": 8}),), day,
                                 day + timedelta(days=60), 4, timedelta(hours=4), timedelta(days=7),
                                 day - timedelta(days=7))
    plan = plan_maintenance(request)
    record = PlanRecord("p" * 63, plan, "ops@example.com", "r" * 1024, "i" * 256,
                        {slot.node: "planned" for slot in plan.slots}, {vm.uid: 9 for vm in plan.vms},
                        recipients={vm.uid: (vm.owner,) for vm in plan.vms})
    assert len(encode_state(PLANS, record)) < 1_000_000


def test_a_plan_with_both_nodes_and_a_selector_or_a_window_ending_before_it_starts_is_refused() -> None:
    h = az()
    make_plan(h, node_selector={"rack": "r1"})
    assert "exactly one of nodes and node_selector" in refusal(h)
    make_plan(h, end=DAY / 2)
    assert "latest_end must be after earliest_start" in refusal(h)
    make_plan(h, plan="Not_A_Label")
    assert "DNS-1123" in refusal(h)


def test_a_window_too_short_is_no_refusal_the_plan_says_which_nodes_fall_outside() -> None:
    h = az()
    make_plan(h, end=DAY + HOUR)  # room for one node of the two
    notices = told(h)
    assert not notices["vm-1"].details["outside_window"]
    assert notices["vm-2"].details["outside_window"] and "outside the window" in notices["vm-2"].message
    [summary] = h.notifications("maintenance_progress")
    assert summary.details["outside_window"] == ["gpu-node-2"]


def test_a_vm_that_finds_no_card_is_said_to_wait_before_the_plan_starts_to_its_owner_and_the_operators() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 1}),
                  vm(NS, "vm-1", project="proj-a", owner=ALICE, gpu=RTX),
                  vmi(NS, "vm-1", node_name="gpu-node-1", gpu=RTX))
    h.intent("plan_maintenance", plan_spec(nodes=["gpu-node-1"]), by=OPS, project=None)
    notice = told(h)["vm-1"]
    assert notice.details["fate"] == "waits_for_card"
    assert notice.recipients == [ALICE, OPS]
    assert notice.at is not None and notice.deadline is not None and notice.at < notice.deadline


# ------------------------------------------------------------------ answers


def test_an_operator_moves_a_node_and_only_its_owners_are_told_again() -> None:
    h = az()
    make_plan(h)
    later = START + timedelta(days=2)
    h.intent("reschedule_maintenance", {"plan": "fw-2026-12", "node": "gpu-node-2", "start": iso(later)},
             by=OPS, project=None)
    changed = told(h, "maintenance_changed")
    assert sorted(changed) == ["vm-2", "vm-3"]  # bob's; alice's vm-1 keeps its notice
    assert changed["vm-2"].deadline == later and changed["vm-2"].message.startswith("Correction: ")
    assert changed["vm-2"].notification_id != told(h)["vm-2"].notification_id
    record = h.state.get(PLANS, "fw-2026-12")
    assert record is not None and record.plan.slot("gpu-node-2").start == later


def test_a_project_member_moves_only_their_own_vm() -> None:
    h = az()
    make_plan(h)
    earlier = iso(START + timedelta(hours=20))
    h.intent("reschedule_maintenance", {"plan": "fw-2026-12", "namespace": NS_B, "name": "vm-3", "start": earlier},
             by=ALICE, project="proj-a")
    assert "only its project's members and operators may" in refusal(h)
    h.intent("reschedule_maintenance", {"plan": "fw-2026-12", "namespace": NS_B, "name": "vm-3", "start": earlier},
             by=BOB, project="proj-b")
    assert sorted(told(h, "maintenance_changed")) == ["vm-3"]
    h.intent("reschedule_maintenance", {"plan": "fw-2026-12", "node": "gpu-node-1", "start": earlier},
             by=BOB, project="proj-b")
    assert "only operators may" in refusal(h)


def test_the_planner_s_refusal_is_the_intent_s_refusal() -> None:
    h = az()
    make_plan(h)
    too_soon = iso(START + timedelta(hours=2))  # less than the owners' day of notice
    result = h.intent("reschedule_maintenance", {"plan": "fw-2026-12", "node": "gpu-node-2", "start": too_soon},
                      by=OPS, project=None)
    assert result.judgement.outcome == "rejected"
    assert "would get less than their notice" in refusal(h)
    assert told(h, "maintenance_changed") == {}


def test_an_owner_ready_now_is_told_the_new_stop_and_the_vm_is_stopped() -> None:
    h = az()
    make_plan(h)
    h.wait(HOUR)
    h.intent("maintenance_ready", {"plan": "fw-2026-12", "namespace": NS_B, "name": "vm-3"}, by=BOB,
             project="proj-b")
    [changed] = told(h, "maintenance_changed").values()
    assert changed.subject.name == "vm-3" and changed.deadline == h.now
    h.tick()
    [stop] = h.commands("stop_vm")
    assert stop.target.name == "vm-3" and stop.issued_at == h.now
    h.wait(DAY)
    h.tick()
    assert [c.target.name for c in h.commands("stop_vm")] == ["vm-3"]  # once
    h.intent("maintenance_ready", {"plan": "fw-2026-12", "namespace": NS, "name": "vm-9"}, by=ALICE)
    assert "no GPU VM of maintenance plan" in refusal(h)


def test_a_vm_that_starts_again_by_itself_is_not_stopped_before_its_node_goes() -> None:
    """Stopped while its node still takes VMs, the scheduler could start it on that node again."""
    h = az()
    make_plan(h)
    h.wait(HOUR)
    h.intent("maintenance_ready", {"plan": "fw-2026-12", "namespace": NS, "name": "vm-1"}, by=ALICE)
    assert "vm-1 starts again by itself" in refusal(h) and "stopped with its node" in refusal(h)
    assert told(h, "maintenance_changed") == {}


def test_an_answer_to_an_unknown_plan_is_refused() -> None:
    h = az()
    h.intent("maintenance_ready", {"plan": "nope", "namespace": NS, "name": "vm-1"}, by=ALICE)
    assert refusal(h) == "no maintenance plan nope"


def test_a_cancelled_plan_tells_every_owner_it_is_off_and_takes_no_more_answers() -> None:
    h = az()
    make_plan(h)
    h.intent("cancel_maintenance", {"plan": "fw-2026-12", "reason": "vendor delay"}, by=ALICE, project=None)
    assert "only operators may" in refusal(h)
    h.intent("cancel_maintenance", {"plan": "fw-2026-12", "reason": "vendor delay"}, by=OPS, project=None)
    off = told(h, "maintenance_cancelled")
    assert sorted(off) == ["vm-1", "vm-2", "vm-3"] and off["vm-1"].recipients == [ALICE]
    assert "will not be stopped" in off["vm-1"].message
    progress = h.notifications("maintenance_progress")[-1]
    assert progress.details["cancelled"] == "vendor delay"
    h.intent("maintenance_ready", {"plan": "fw-2026-12", "namespace": NS, "name": "vm-1"}, by=ALICE)
    assert refusal(h) == "maintenance plan fw-2026-12 was cancelled"


# ------------------------------------------------------------------ carried out by the drains


def cordoned(h: Harness, name: str, *, rv: int = 2) -> None:
    h.observe(node(name, gpus={RTX: 2}, unschedulable=True, rv=rv), "MODIFIED")


def back(h: Harness, name: str, *, rv: int = 3) -> None:
    """The node is Ready and uncordoned again after its maintenance."""
    h.observe(labelled(node(name, gpus={RTX: 2}, rv=rv), rack="r1"), "MODIFIED")


def stops(h: Harness) -> list[str]:
    return [c.target.name for c in h.commands("delete_vmi")]


def phases(h: Harness) -> dict[str, str]:
    record = h.state.get(PLANS, "fw-2026-12")
    assert record is not None
    return dict(record.phases)


def drained_node_1(h: Harness) -> None:
    """gpu-node-1's slot: cordoned, vm-1 stopped, seen running again on gpu-node-3."""
    h.wait((START + timedelta(days=1) - h.now).total_seconds())
    h.tick()
    cordoned(h, "gpu-node-1")
    h.observe(vmi(NS, "vm-1", node_name="gpu-node-1", gpu=RTX), "DELETED")
    h.observe(vmi(NS, "vm-1", node_name="gpu-node-3", gpu=RTX))


def test_a_slot_s_start_drains_its_node_through_the_drain_machinery_without_telling_the_owners_again() -> None:
    h = az()
    make_plan(h)
    h.wait(DAY - 1)
    assert h.tick() == [] and h.commands() == []
    h.wait(1)
    h.tick()
    assert [(c.type, c.target.name) for c in h.commands()] == [("cordon_node", "gpu-node-1")]
    assert phases(h) == {"gpu-node-1": "draining", "gpu-node-2": "planned"}
    assert h.notifications("drain_will_stop_gpu_vm") == []  # told by the plan a day ahead
    episode = h.state.get(DRAINS, "gpu-node-1")
    assert episode is not None and episode.source == "plan" and episode.plan == "fw-2026-12"
    h.tick()
    assert stops(h) == []  # not before the cordon is seen
    cordoned(h, "gpu-node-1")
    assert stops(h) == ["vm-1"]


def test_a_node_seen_back_is_told_to_its_plan_and_its_operator() -> None:
    h = az()
    make_plan(h)
    drained_node_1(h)
    [done] = h.notifications("drain_completed")
    assert done.recipients == [OPS]
    back(h, "gpu-node-1")
    assert phases(h)["gpu-node-1"] == "back"
    progress = h.notifications("maintenance_progress")[-1]
    assert progress.details["node"] == "gpu-node-1" and progress.details["left"] == ["gpu-node-2"]
    assert h.state.get(DRAINS, "gpu-node-1") is None


def test_vms_wanted_back_on_their_node_are_stopped_by_vmstream_and_started_when_it_is_back() -> None:
    h = az()
    make_plan(h)
    drained_node_1(h)
    back(h, "gpu-node-1")
    h.wait(HOUR)
    h.tick()
    assert [(c.type, c.target.name) for c in h.commands()][-2:] == [("stop_vm", "vm-2"), ("cordon_node", "gpu-node-2")]
    # virt-api's stop: runStrategy Halted, the VMI gone (KubeVirt does not start it elsewhere).
    h.observe(after(vm(NS_B, "vm-2", project="proj-b", owner=BOB, gpu=RTX, run_strategy="Halted", rv=2), "same_node"),
              "MODIFIED")
    h.observe(vmi(NS_B, "vm-2", node_name="gpu-node-2", gpu=RTX), "DELETED")
    assert h.commands("start_vm") == []
    cordoned(h, "gpu-node-2")
    h.observe(vmi(NS_B, "vm-3", node_name="gpu-node-2", gpu=RTX), "DELETED")
    assert h.notifications("drain_completed")[-1].subject.name == "gpu-node-2"
    assert h.commands("start_vm") == []  # not before the node is back
    back(h, "gpu-node-2")
    [start] = h.commands("start_vm")
    assert start.target.name == "vm-2" and start.target.uid == f"uid-vm-{NS_B}-vm-2"
    assert phases(h) == {"gpu-node-1": "back", "gpu-node-2": "back"}
    assert "every node of the plan is back" in h.notifications("maintenance_progress")[-1].message


def test_a_node_not_back_by_its_slot_s_end_holds_the_next_and_its_owners_are_told() -> None:
    h = az()
    make_plan(h)
    drained_node_1(h)
    h.wait(HOUR)  # gpu-node-2's slot; gpu-node-1 is still in maintenance
    h.tick()
    assert "gpu-node-2" not in [c.target.name for c in h.commands("cordon_node")]
    delayed = told(h, "maintenance_changed")
    assert sorted(delayed) == ["vm-2", "vm-3"] and delayed["vm-2"].details["waiting_for"] == ["gpu-node-1"]
    h.wait(600)
    h.tick()
    assert len(h.notifications("maintenance_changed")) == 2  # told once
    back(h, "gpu-node-1")
    assert [c.target.name for c in h.commands("cordon_node")] == ["gpu-node-1", "gpu-node-2"]
    assert phases(h)["gpu-node-2"] == "draining"


def test_a_plan_cancelled_while_a_node_drains_calls_that_drain_off() -> None:
    h = az()
    make_plan(h)
    h.wait(DAY)
    h.tick()
    h.intent("cancel_maintenance", {"plan": "fw-2026-12", "reason": "vendor delay"}, by=OPS, project=None)
    assert [c.target.name for c in h.commands("uncordon_node")] == ["gpu-node-1"]
    episode = h.state.get(DRAINS, "gpu-node-1")
    assert episode is not None and episode.called_off  # kept until the node is seen back
    [off] = [n for n in h.notifications("drain_called_off") if n.subject.kind == "VirtualMachine"]
    assert off.subject.name == "vm-1" and off.recipients == [ALICE]
    assert sorted(told(h, "maintenance_cancelled")) == ["vm-2", "vm-3"]  # gpu-node-2's, still to come
    back(h, "gpu-node-1")
    assert h.state.get(DRAINS, "gpu-node-1") is None and phases(h)["gpu-node-1"] == "back"
    h.wait(DAY)
    h.tick()
    assert h.commands("cordon_node") == [h.commands("cordon_node")[0]]  # nothing more starts


def test_undrain_after_a_plan_s_drain_completed_still_tells_the_plan_when_the_node_is_back() -> None:
    h = az()
    make_plan(h)
    drained_node_1(h)
    h.intent("undrain_node", {"node": "gpu-node-1"}, by=OPS, project=None)
    assert [c.target.name for c in h.commands("uncordon_node")] == ["gpu-node-1"]
    assert phases(h)["gpu-node-1"] == "draining"
    back(h, "gpu-node-1")
    assert phases(h)["gpu-node-1"] == "back"


def test_a_plan_s_drain_called_off_midway_tells_the_plan_when_the_node_is_back_and_the_held_node_goes() -> None:
    h = az()
    make_plan(h)
    h.wait(DAY)
    h.tick()  # gpu-node-1 goes; its cordon is not seen yet
    h.wait(HOUR)
    h.tick()  # gpu-node-2's slot: held
    assert phases(h) == {"gpu-node-1": "draining", "gpu-node-2": "planned"}
    h.intent("undrain_node", {"node": "gpu-node-1"}, by=OPS, project=None)
    assert [c.target.name for c in h.commands("cordon_node")] == ["gpu-node-1"]
    back(h, "gpu-node-1")
    assert phases(h) == {"gpu-node-1": "back", "gpu-node-2": "draining"}
    assert [c.target.name for c in h.commands("cordon_node")] == ["gpu-node-1", "gpu-node-2"]


def newcomer(h: Harness, name: str = "vm-4", on: str = "gpu-node-2") -> None:
    """A GPU VM made after the plan, on a planned node."""
    h.observe_all(vm(NS, name, project="proj-a", owner=ALICE, gpu=RTX),
                  vmi(NS, name, node_name=on, gpu=RTX))


def test_a_gpu_vm_come_after_the_plan_is_told_at_a_slot_s_start_and_its_node_moved_for_its_full_notice() -> None:
    h = az()
    make_plan(h)
    h.wait(HOUR)
    newcomer(h)
    assert told(h).keys() == {"vm-1", "vm-2", "vm-3"}  # the plan learns of it when a slot starts
    h.wait((START + timedelta(days=1) - h.now).total_seconds())
    h.tick()  # gpu-node-1's slot: gpu-node-2's (an hour later) would give vm-4 an hour's notice
    [notice] = [n for n in h.notifications("maintenance_planned") if n.subject.name == "vm-4"]
    moved = START + timedelta(days=2)
    assert notice.recipients == [ALICE] and notice.deadline == moved and notice.details["came_after_plan"]
    changed = told(h, "maintenance_changed")
    assert sorted(changed) == ["vm-2", "vm-3"] and changed["vm-2"].deadline == moved
    h.tick()
    assert len([n for n in h.notifications("maintenance_planned") if n.subject.name == "vm-4"]) == 1  # once


def test_a_gpu_vm_come_after_the_plan_whose_node_cannot_move_is_told_and_the_operator_too() -> None:
    h = az()
    make_plan(h, end=DAY + 3 * HOUR)  # no room to move gpu-node-2 a day later
    newcomer(h)
    h.wait(DAY)
    h.tick()
    [notice] = [n for n in h.notifications("maintenance_planned") if n.subject.name == "vm-4"]
    assert notice.deadline == START + timedelta(days=1, hours=1)
    short = [n for n in h.notifications("maintenance_progress") if "not_moved" in n.details]
    assert short and short[0].recipients == [OPS] and "would leave the window" in short[0].details["not_moved"]
    assert told(h, "maintenance_changed") == {}


def test_a_card_gone_since_the_plan_is_seen_at_a_slot_s_start_and_the_owners_it_changes_are_told_again() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 1}), node("gpu-node-2", gpus={RTX: 2}), node("gpu-node-3", gpus={RTX: 1}),
                  vm(NS, "vm-a", project="proj-a", owner=ALICE, gpu=RTX),
                  vmi(NS, "vm-a", node_name="gpu-node-1", gpu=RTX),
                  vm(NS_B, "vm-b", project="proj-b", owner=BOB, gpu=RTX),
                  vmi(NS_B, "vm-b", node_name="gpu-node-2", gpu=RTX),
                  vm(NS_B, "vm-c", project="proj-b", owner=BOB, gpu=RTX, run_strategy="Manual"),
                  vmi(NS_B, "vm-c", node_name="gpu-node-2", gpu=RTX))
    make_plan(h)
    assert {name: n.details["fate"] for name, n in told(h).items()} == {
        "vm-a": "lands_elsewhere", "vm-b": "lands_elsewhere", "vm-c": "stays_off"}
    h.wait(HOUR)
    h.observe(node("gpu-node-3", gpus={RTX: 1}, unschedulable=True, rv=2), "MODIFIED")  # its spare card gone
    h.wait((START + timedelta(days=1) - h.now).total_seconds())
    h.tick()
    changed = told(h, "maintenance_changed")
    # vm-a finds no card now and takes gpu-node-1's when it is back: vm-b then finds none either.
    assert sorted(changed) == ["vm-a", "vm-b"]  # vm-c's notice holds: it is not told again
    assert all(n.details["fate"] == "waits_for_card" and n.recipients[-1] == OPS for n in changed.values())
    assert changed["vm-a"].details["back_at"] == iso(START + timedelta(days=1, hours=1))
    h.tick()
    assert len(h.notifications("maintenance_changed")) == 2  # told once


def test_a_plan_row_and_a_usage_row_read_back_as_written() -> None:
    h = az()
    make_plan(h)
    record = h.state.get(PLANS, "fw-2026-12")
    usage = h.state.get(USAGE, "gpu-node-2")
    assert decode_state(PLANS, encode_state(PLANS, record)) == record
    assert decode_state(USAGE, encode_state(USAGE, usage)) == usage


# ------------------------------------------------------------------ properties

STRATEGIES = ("Always", "Once", "RerunOnFailure", "Manual")
CHOICES = ("elsewhere", "same_node", "stay_off")


@st.composite
def azs(draw: st.DrawFn) -> tuple[Harness, list[str]]:
    """An AZ of 1 to 3 planned nodes of 1 to 3 RTX each, each card held or not by a GPU VM of
    any run strategy and choice, and a spare node; and the planned nodes."""
    h = Harness()
    planned = [f"gpu-node-{i}" for i in range(1, draw(st.integers(1, 3)) + 1)]
    h.observe(node("spare", gpus={RTX: draw(st.integers(0, 2))}))
    for name in planned:
        cards = draw(st.integers(1, 3))
        h.observe(node(name, gpus={RTX: cards}))
        for i in range(draw(st.integers(0, cards))):
            vm_name = f"{name}-vm-{i}"
            h.observe(after(vm(NS, vm_name, project="proj-a", owner=ALICE, gpu=RTX,
                               run_strategy=draw(st.sampled_from(STRATEGIES))), draw(st.sampled_from(CHOICES))))
            h.observe(vmi(NS, vm_name, node_name=name, gpu=RTX))
    return h, planned


@settings(max_examples=25, deadline=None)
@given(made=azs(), concurrency=st.integers(1, 2), hours=st.integers(1, 3), move=st.integers(0, 48))
def test_every_planned_vm_is_told_once_as_planned_and_an_answer_re_tells_exactly_the_changed(
        made: tuple[Harness, list[str]], concurrency: int, hours: int, move: int) -> None:
    h, planned = made
    make_plan(h, nodes=planned, concurrency=concurrency, duration=hours * HOUR)
    record = h.state.get(PLANS, "fw-2026-12")
    assert record is not None
    notices = told(h)
    assert sorted(notices) == sorted(e.name for e in record.plan.vms)
    for entry in record.plan.vms:
        assert (notices[entry.name].deadline, notices[entry.name].details["fate"]) == (entry.stop, entry.fate)
    h.intent("reschedule_maintenance", {"plan": "fw-2026-12", "node": planned[-1],
                                        "start": iso(START + timedelta(days=1, hours=move))}, by=OPS, project=None)
    after_answer = h.state.get(PLANS, "fw-2026-12")
    assert after_answer is not None
    changed = sorted(told(h, "maintenance_changed"))
    if h.results[-1].judgement.outcome == "rejected":
        assert changed == [] and after_answer == record
    else:
        before = {e.uid: e.notice for e in record.plan.vms}
        assert changed == sorted(e.name for e in after_answer.plan.vms if e.notice != before[e.uid])
