"""Maintenance plans carried out by the engine: what a plan reads (the cluster-wide usage
rows), the operators' intents, the owners' notices and answers (docs/maintenance.md)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from handlers.contracts.messages import Notification
from handlers.core.cluster import UsageVM
from handlers.core.tables import PLANS, USAGE
from samples.cluster import A100, RTX, node, vm, vmi
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


def test_an_owner_ready_now_is_told_the_new_stop() -> None:
    h = az()
    make_plan(h)
    h.wait(HOUR)
    h.intent("maintenance_ready", {"plan": "fw-2026-12", "namespace": NS, "name": "vm-1"}, by=ALICE)
    [changed] = told(h, "maintenance_changed").values()
    assert changed.subject.name == "vm-1" and changed.deadline == h.now
    h.intent("maintenance_ready", {"plan": "fw-2026-12", "namespace": NS, "name": "vm-9"}, by=ALICE)
    assert "no GPU VM of maintenance plan" in refusal(h)


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
