"""The promise, case by case: no GPU VM is stopped without its owner being told first, and
every owner is told the true fate of their VM — as KubeVirt decides it (docs/kubevirt.md)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from handlers.contracts.messages import Notification
from handlers.core.tables import DRAINS
from samples.cluster import RTX, node, node_maintenance, vm, vmi
from tests.support.harness import Harness

ALICE, BOB, OPS = "alice@example.com", "bob@example.com", "ops@example.com"
NS = "spx-proj-a"


def notice_given(notice: Notification) -> timedelta:
    """How long before its deadline a notice told its owner."""
    assert notice.deadline is not None and notice.at is not None
    return notice.deadline - notice.at


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


# ------------------------------------------------------------------ a cancelled eviction


def evicted_az(*names: str) -> Harness:
    """gpu-node-1 runs GPU VMs ``names`` (alice's, Always); KubeVirt marks each for eviction."""
    h = Harness()
    h.observe(node("gpu-node-1", gpus={RTX: 4}))
    for name in names:
        h.observe_all(vm(NS, name, project="proj-a", owner=ALICE, gpu=RTX),
                      vmi(NS, name, node_name="gpu-node-1", gpu=RTX))
    for name in names:
        mark(h, name)
    return h


def mark(h: Harness, name: str, marked: bool = True) -> None:
    h.observe(vmi(NS, name, node_name="gpu-node-1", gpu=RTX, eviction_requested=marked), "MODIFIED")


def stops(h: Harness) -> list[str]:
    return [c.target.name for c in h.commands("delete_vmi")]


def test_a_cancelled_eviction_is_retracted() -> None:
    h = evicted_az("ev-1")
    [notice] = h.notifications("drain_will_stop_gpu_vm")
    h.wait(300)
    mark(h, "ev-1", marked=False)  # evacuate/cancel: the mark and EvictionRequested are gone
    [off] = h.notifications("drain_called_off")
    assert off.subject.name == "ev-1" and off.recipients == [ALICE]
    assert "will not be stopped" in off.message
    assert h.state.get(DRAINS, "gpu-node-1") is None  # the episode is closed
    h.wait(900)
    h.tick()
    assert stops(h) == []


def test_a_later_eviction_after_a_cancel_starts_a_fresh_notice_with_a_full_notice_period() -> None:
    h = evicted_az("ev-1")
    [first] = h.notifications("drain_will_stop_gpu_vm")
    h.wait(300)
    mark(h, "ev-1", marked=False)
    h.wait(900)  # past the first deadline
    mark(h, "ev-1")  # evicted again
    assert stops(h) == []  # never a stop in the same decision as the mark
    [_, second] = h.notifications("drain_will_stop_gpu_vm")
    assert second.notification_id != first.notification_id
    assert second.deadline == h.now + notice_given(first)  # a full notice again
    h.wait(899)
    h.tick()
    assert stops(h) == []
    h.wait(1)
    h.tick()
    assert stops(h) == ["ev-1"]


def test_a_cancel_among_evictions_spares_only_that_vm_and_its_next_eviction_gets_its_own_full_notice() -> None:
    h = evicted_az("ev-1", "ev-2")
    h.wait(300)
    mark(h, "ev-2", marked=False)
    assert [n.subject.name for n in h.notifications("drain_called_off")] == ["ev-2"]
    h.wait(300)
    mark(h, "ev-2")  # evicted again, 600 s into ev-1's notice
    renotice = h.notifications("drain_will_stop_gpu_vm")[-1]
    assert renotice.subject.name == "ev-2"
    assert renotice.deadline is not None and (renotice.deadline - h.now).total_seconds() == 900
    h.wait(300)
    h.tick()
    assert stops(h) == ["ev-1"]  # at its own deadline
    h.wait(599)
    h.tick()
    assert stops(h) == ["ev-1"]
    h.wait(1)
    h.tick()
    assert stops(h) == ["ev-1", "ev-2"]


# ------------------------------------------------------------------ a called-off drain's marks


def maintained_and_evicted(h: Harness) -> None:
    """A NodeMaintenance drains gpu-node-1 and, as the node-maintenance operator does, evicts
    its pods: KubeVirt marks the GPU VMI (evictionStrategy External)."""
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), vm(NS, "ev-1", project="proj-a", owner=ALICE, gpu=RTX),
                  vmi(NS, "ev-1", node_name="gpu-node-1", gpu=RTX))
    h.observe(node_maintenance("nm-1", "gpu-node-1", "PSU"))
    h.observe(node("gpu-node-1", gpus={RTX: 2}, unschedulable=True, rv=2), "MODIFIED")
    mark(h, "ev-1")


def test_a_called_off_drain_cancels_the_eviction_marks_it_leaves_behind() -> None:
    h = Harness()
    maintained_and_evicted(h)
    [notice] = h.notifications("drain_will_stop_gpu_vm")
    h.wait(60)
    h.observe(node_maintenance("nm-1", "gpu-node-1", "PSU"), "DELETED")
    [cancel] = h.commands("cancel_evacuation")
    assert (cancel.target.kind, cancel.target.name, cancel.evacuation_node) == (
        "VirtualMachineInstance", "ev-1", "gpu-node-1")
    [off] = [n for n in h.notifications("drain_called_off") if n.subject.kind == "VirtualMachine"]
    assert off.recipients == [ALICE] and "will not be stopped" in off.message
    assert "vmstream cancels that mark" in off.message
    # KubeVirt shows the mark a while longer: no new eviction, no stop, whenever.
    mark(h, "ev-1")
    h.wait(3600)
    h.tick()
    mark(h, "ev-1")
    assert stops(h) == [] and h.notifications("drain_will_stop_gpu_vm") == [notice]
    # The mark gone, a later eviction is a new one: told, with a full notice.
    mark(h, "ev-1", marked=False)
    assert h.state.get(DRAINS, "gpu-node-1") is None
    mark(h, "ev-1")
    assert stops(h) == []
    second = h.notifications("drain_will_stop_gpu_vm")[-1]
    assert second is not notice and second.deadline == h.now + notice_given(notice)


def test_a_mark_vmstream_could_not_cancel_never_stops_the_vm_and_the_owner_is_told_it_is_still_there() -> None:
    from handlers.rules.results import decide_result

    h = Harness()
    maintained_and_evicted(h)
    h.observe(node_maintenance("nm-1", "gpu-node-1", "PSU"), "DELETED")
    [cancel] = h.commands("cancel_evacuation")
    failed = decide_result(cancel, outcome="failed", now=h.now, error="Node \"gpu-node-1\" has NodeDrainTaintKey",
                           owner=ALICE)
    assert failed.notification is not None and failed.notification.recipients == [ALICE]
    assert "still marks VMI spx-proj-a/ev-1 for eviction from node gpu-node-1" in failed.notification.message
    assert "will not stop the VM on that mark" in failed.notification.message
    for _ in range(3):
        h.wait(1800)
        mark(h, "ev-1")
        h.tick()
    assert stops(h) == []


# ------------------------------------------------------------------ fates as KubeVirt decides them


def drained_rerun(*names: str) -> Harness:
    """gpu-node-1 runs RerunOnFailure GPU VMs ``names``; gpu-node-2 has cards; a drain is announced."""
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 4}), node("gpu-node-2", gpus={RTX: 4}))
    for name in names:
        h.observe_all(vm(NS, name, project="proj-a", owner=ALICE, gpu=RTX, run_strategy="RerunOnFailure"),
                      vmi(NS, name, node_name="gpu-node-1", gpu=RTX))
    h.intent("drain_node", {"node": "gpu-node-1", "reason": "kernel", "notice_seconds": 600}, by=OPS, project=None)
    h.observe(node("gpu-node-1", gpus={RTX: 4}, unschedulable=True, rv=2), "MODIFIED")
    return h


def test_a_rerun_on_failure_vm_whose_vmi_failed_during_the_notice_comes_back() -> None:
    h = drained_rerun("rerun-1")
    [notice] = h.notifications("drain_will_stop_gpu_vm")
    assert notice.details["outcome"] == "needs_manual_start"
    h.wait(60)
    h.observe(vmi(NS, "rerun-1", node_name="gpu-node-1", gpu=RTX, phase="Failed"), "MODIFIED")
    assert h.notifications("drain_completed") == []  # KubeVirt restarts a failed one: the tally waits
    h.observe(vmi(NS, "rerun-1", node_name="gpu-node-1", gpu=RTX, phase="Failed"), "DELETED")  # stopVMI
    assert h.notifications("drain_completed") == []  # its start request not seen yet: still waiting
    started = vm(NS, "rerun-1", project="proj-a", owner=ALICE, gpu=RTX, run_strategy="RerunOnFailure", rv=2)
    started["status"] = {"stateChangeRequests": [{"action": "Start"}]}  # addStartRequest
    h.observe(started, "MODIFIED")
    h.observe(vmi(NS, "rerun-1", node_name="gpu-node-2", gpu=RTX, generation=2))
    [done] = h.notifications("drain_completed")
    assert done.details["observed"]["came_back"] == [f"vm/{NS}/rerun-1"]


def test_a_rerun_on_failure_vm_whose_vmi_succeeded_during_the_notice_stays_off() -> None:
    h = drained_rerun("rerun-1")
    h.wait(60)
    h.observe(vmi(NS, "rerun-1", node_name="gpu-node-1", gpu=RTX, phase="Succeeded"), "MODIFIED")
    [done] = h.notifications("drain_completed")
    assert done.details["observed"]["off"] == [f"vm/{NS}/rerun-1"]


def test_a_once_vm_is_told_how_its_gpu_change_takes_effect() -> None:
    """RestartVMRequestHandler refuses Once: no 'after its next restart' for it."""
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 1}),
                  vm(NS, "once-1", project="proj-a", owner=ALICE, run_strategy="Once"),
                  vmi(NS, "once-1", node_name="gpu-node-1"))
    h.intent("set_gpu", {"namespace": NS, "name": "once-1", "gpu_class": "nvidia-rtx-pro-6000-bse"})
    [told] = h.notifications("gpu_change_pending_restart")
    assert "after its next restart" not in told.message
    assert "stopped and started again" in told.message and told.details["restart_possible"] is False
    refused = h.intent("restart_vm", {"namespace": NS, "name": "once-1"})
    assert refused.decision.audit is not None
    assert "stop it and start it again" in (refused.decision.audit.reason or "")


def test_a_manual_vm_whose_vmi_has_ended_can_be_restarted() -> None:
    """virt-api restarts a Manual VM whose VMI ended and is still there: a stop request for
    that VMI and a start request (RestartVMRequestHandler; syncRunStrategy, Manual)."""
    h = Harness()
    h.observe_all(vm(NS, "man-1", project="proj-a", owner=ALICE, run_strategy="Manual"),
                  vmi(NS, "man-1", node_name="gpu-node-1", phase="Succeeded"))
    result = h.intent("restart_vm", {"namespace": NS, "name": "man-1"})
    assert [c.type for c in result.decision.commands] == ["restart_vm"]


# ------------------------------------------------------------------ identity is the uid


def made_again(name: str, owner: str, uid: str, **kwargs: Any) -> dict[str, Any]:
    obj = vm(NS, name, project="proj-a", owner=owner, gpu=RTX, **kwargs)
    obj["metadata"]["uid"] = uid
    return obj


def vmi_of(name: str, uid: str, *, marked: bool = False, node_name: str = "gpu-node-1") -> dict[str, Any]:
    obj = vmi(NS, name, node_name=node_name, gpu=RTX, eviction_requested=marked)
    obj["metadata"]["uid"] = uid
    return obj


def test_a_vm_deleted_and_made_again_under_its_name_gets_its_own_notice_and_a_full_notice_period() -> None:
    h = evicted_az("ev-1", "ev-2")  # ev-2 keeps the episode open
    alices = h.notifications("drain_will_stop_gpu_vm")[0]
    h.wait(600)
    h.observe(vmi(NS, "ev-1", node_name="gpu-node-1", gpu=RTX, eviction_requested=True), "DELETED")
    h.observe(vm(NS, "ev-1", project="proj-a", owner=ALICE, gpu=RTX), "DELETED")
    h.observe(made_again("ev-1", BOB, "uid-bobs-ev-1"))
    h.observe(vmi_of("ev-1", "uid-vmi-bobs", marked=True))  # on the same node, and evicted too
    bobs = h.notifications("drain_will_stop_gpu_vm")[-1]
    assert bobs.subject.name == "ev-1" and bobs.recipients == [BOB]
    assert bobs.deadline == h.now + notice_given(alices)  # a full notice of his own
    h.wait(300)  # alice's deadline
    h.tick()
    assert stops(h) == ["ev-2"]
    h.wait(600)
    h.tick()
    assert stops(h) == ["ev-2", "ev-1"]


def test_a_vm_made_again_seen_only_in_a_relist_is_a_new_vm_too() -> None:
    """The watch bridge was away: the relist shows bob's VM and VMI, and no DELETED of alice's."""
    h = evicted_az("ev-1")
    h.wait(600)
    h.observe(made_again("ev-1", BOB, "uid-bobs-ev-1"), "RELISTED")
    h.observe(vmi_of("ev-1", "uid-vmi-bobs", marked=True), "RELISTED")
    told = h.notifications("drain_will_stop_gpu_vm")
    assert [n.recipients for n in told] == [[ALICE], [BOB]]
    assert told[1].deadline == h.now + notice_given(told[0])
    h.wait(300)
    h.tick()
    assert stops(h) == []


def test_a_vm_made_again_during_a_node_drain_is_announced_to_its_owner_with_a_full_notice() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), vm(NS, "x-1", project="proj-a", owner=ALICE, gpu=RTX),
                  vmi(NS, "x-1", node_name="gpu-node-1", gpu=RTX))
    h.intent("drain_node", {"node": "gpu-node-1", "reason": "kernel", "notice_seconds": 900}, by=OPS, project=None)
    h.wait(600)
    h.observe(made_again("x-1", BOB, "uid-bobs-x-1"), "RELISTED")
    h.observe(vmi_of("x-1", "uid-vmi-bobs"), "RELISTED")
    told = h.notifications("drain_will_stop_gpu_vm")
    assert [n.recipients for n in told] == [[ALICE], [BOB]]
    assert told[1].deadline == h.now + notice_given(told[0])
    h.observe(node("gpu-node-1", gpus={RTX: 2}, unschedulable=True, rv=2), "MODIFIED")  # the cordon lands
    h.wait(300)  # alice's deadline
    h.tick()
    assert stops(h) == []
    h.wait(600)
    h.tick()
    assert stops(h) == ["x-1"]


def test_a_stop_names_the_vmi_it_was_told_of_by_uid() -> None:
    """At alice's deadline the worker may not have seen bob's VM yet (the bridge away): its stop
    names alice's VMI by uid, and the applier leaves any other VMI of that name alone."""
    h = evicted_az("ev-1")
    h.wait(900)
    h.tick()
    [stop] = h.commands("delete_vmi")
    assert stop.target.uid == f"uid-vmi-{NS}-ev-1-1"


# ------------------------------------------------------------------ a notice that became false


def test_a_gpu_removed_while_a_drain_waits_for_a_card_corrects_the_notice() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 1}), vm(NS, "a-1", project="proj-a", owner=ALICE, gpu=RTX),
                  vmi(NS, "a-1", node_name="gpu-node-1", gpu=RTX))
    h.intent("drain_node", {"node": "gpu-node-1", "reason": "kernel", "notice_seconds": 600}, by=OPS, project=None)
    [waits] = h.notifications("drain_will_stop_gpu_vm")
    assert waits.details["outcome"] == "waits_for_gpu"
    h.wait(60)
    h.observe(vm(NS, "a-1", project="proj-a", owner=ALICE, rv=2), "MODIFIED")  # its GPU removed (kubectl)
    [_, corrected] = h.notifications("drain_will_stop_gpu_vm")
    assert corrected.notification_id != waits.notification_id and corrected.recipients == [ALICE]
    assert corrected.message.startswith("Correction: ")
    assert "it will start again by itself (run strategy Always), without a GPU" in corrected.message
    assert corrected.details["outcome"] == "returns_automatically" and corrected.details["gpus"] == []
    assert corrected.details["corrects"]["outcome"] == "waits_for_gpu"
    assert corrected.deadline == waits.deadline


# ------------------------------------------------------------------ promises never exceed the cards


def three_nodes(h: Harness, *, spare: int = 1) -> None:
    """gpu-node-1 and gpu-node-2 run one Always GPU VM each; gpu-node-3 has ``spare`` free cards."""
    h.observe_all(node("gpu-node-1", gpus={RTX: 1}), node("gpu-node-2", gpus={RTX: 1}),
                  node("gpu-node-3", gpus={RTX: spare}))
    for name, where in (("a-1", "gpu-node-1"), ("b-1", "gpu-node-2")):
        h.observe_all(vm(NS, name, project="proj-a", owner=ALICE if name == "a-1" else BOB, gpu=RTX),
                      vmi(NS, name, node_name=where, gpu=RTX))


def drain_of(h: Harness, name: str, notice: int) -> None:
    h.intent("drain_node", {"node": name, "reason": "kernel", "notice_seconds": notice}, by=OPS, project=None)
    h.observe(node(name, gpus={RTX: 1}, unschedulable=True, rv=2), "MODIFIED")


def outcomes(h: Harness) -> list[tuple[str, str]]:
    return [(n.subject.name, n.details["outcome"]) for n in h.notifications("drain_will_stop_gpu_vm")]


def test_two_drains_a_few_seconds_apart_do_not_both_promise_the_one_free_card() -> None:
    h = Harness()
    three_nodes(h)
    drain_of(h, "gpu-node-1", 600)
    h.wait(5)
    drain_of(h, "gpu-node-2", 600)
    assert outcomes(h) == [("a-1", "returns_automatically"), ("b-1", "waits_for_gpu")]
    second = h.notifications("drain_will_stop_gpu_vm")[-1]
    assert "and 1 more leaving other drained nodes no later" in second.message


def test_a_promise_is_corrected_when_the_cards_it_counted_are_taken() -> None:
    h = Harness()
    three_nodes(h)
    drain_of(h, "gpu-node-1", 600)
    assert outcomes(h) == [("a-1", "returns_automatically")]
    h.wait(30)
    h.observe_all(vm(NS, "c-1", project="proj-a", owner=BOB, gpu=RTX),  # someone else's VM takes the card
                  vmi(NS, "c-1", node_name="gpu-node-3", gpu=RTX))
    assert outcomes(h) == [("a-1", "returns_automatically"), ("a-1", "waits_for_gpu")]
    corrected = h.notifications("drain_will_stop_gpu_vm")[-1]
    assert corrected.message.startswith("Correction: ") and corrected.recipients == [ALICE]
    assert "0 card(s) of this class free now" in corrected.message


def test_a_later_drain_stopping_its_vms_first_takes_the_promise_back() -> None:
    """Its VM is back in the race for the card before the first drain's: the first is corrected."""
    h = Harness()
    three_nodes(h)
    drain_of(h, "gpu-node-1", 600)
    h.wait(5)
    drain_of(h, "gpu-node-2", 60)
    assert outcomes(h) == [("a-1", "returns_automatically"), ("b-1", "returns_automatically"),
                           ("a-1", "waits_for_gpu")]


def test_promises_across_drains_never_exceed_the_cards() -> None:
    """However many drains, each promise is backed by cards no earlier drain counted."""
    h = Harness()
    h.observe(node("spare", gpus={RTX: 2}))
    for i in range(4):
        h.observe_all(node(f"n-{i}", gpus={RTX: 1}), vm(NS, f"v-{i}", project="proj-a", owner=ALICE, gpu=RTX),
                      vmi(NS, f"v-{i}", node_name=f"n-{i}", gpu=RTX))
    for i in range(4):
        drain_of(h, f"n-{i}", 600 - i)  # each later drain stops first
        h.wait(2)
    latest: dict[str, str] = {}
    for name, outcome in outcomes(h):
        latest[name] = outcome
    assert sum(outcome == "returns_automatically" for outcome in latest.values()) <= 2


def deleting(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["deletionTimestamp"] = "2026-11-30T10:10:00Z"
    return obj


def test_a_vmi_the_drain_stops_that_fails_on_its_way_out_is_no_failure_kubevirt_restarts() -> None:
    """The launcher pod gone first, KubeVirt marks the VMI being deleted Failed; it adds no start
    request for it (syncRunStrategy acts only on a VMI not being deleted): a RerunOnFailure VM
    stays off, a Once VM comes back (its VMI deleted: startVMI)."""
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 4}), node("gpu-node-2", gpus={RTX: 4}))
    for name, strategy in (("rerun-1", "RerunOnFailure"), ("once-1", "Once")):
        h.observe_all(vm(NS, name, project="proj-a", owner=ALICE, gpu=RTX, run_strategy=strategy),
                      vmi(NS, name, node_name="gpu-node-1", gpu=RTX))
    drain(h, "gpu-node-1", notice=60)
    h.wait(60)
    h.tick()
    for name in ("rerun-1", "once-1"):
        h.observe(deleting(vmi(NS, name, node_name="gpu-node-1", gpu=RTX, phase="Failed")), "MODIFIED")
        h.observe(deleting(vmi(NS, name, node_name="gpu-node-1", gpu=RTX, phase="Failed")), "DELETED")
    assert h.notifications("drain_completed") == []  # the Once VM comes back: wait for it
    h.observe(vmi(NS, "once-1", node_name="gpu-node-2", gpu=RTX, generation=2))
    [done] = h.notifications("drain_completed")
    assert done.details["observed"]["came_back"] == [f"vm/{NS}/once-1"]
    assert done.details["observed"]["off"] == [f"vm/{NS}/rerun-1"]


def drain(h: Harness, node_name: str, *, notice: int) -> None:
    h.intent("drain_node", {"node": node_name, "reason": "kernel", "notice_seconds": notice}, by=OPS, project=None)
    h.observe(node(node_name, gpus={RTX: 4}, unschedulable=True, rv=2), "MODIFIED")
