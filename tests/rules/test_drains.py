"""Drains: every signal starts an episode, every GPU VM's owner is told once with the
deadline and its fate, the deadline stops them, the requester hears when it is done."""

from __future__ import annotations

from datetime import timedelta

import pytest

from handlers.contracts.topics import TIMER
from handlers.core.tables import DRAINS
from samples.cluster import A100, RTX, node, node_maintenance, vm, vmi
from tests.support.harness import START, Harness

ALICE, BOB, OPS = "alice@example.com", "bob@example.com", "ops@example.com"


def az(*, spare_rtx: int = 1) -> Harness:
    """gpu-node-1 (2 RTX) runs three GPU VMs of different strategies and a CPU VM."""
    h = Harness()
    h.observe_all(
        node("gpu-node-1", gpus={RTX: 2, A100: 1}),
        node("gpu-node-2", gpus={RTX: spare_rtx} if spare_rtx else {}),
        vm("p", "always-1", project="proj-a", owner=ALICE, gpu=RTX),
        vmi("p", "always-1", node_name="gpu-node-1", gpu=RTX),
        vm("p", "always-2", project="proj-a", owner=ALICE, gpu=RTX),
        vmi("p", "always-2", node_name="gpu-node-1", gpu=RTX),
        vm("p", "rerun-1", project="proj-b", owner=BOB, run_strategy="RerunOnFailure", gpu=A100),
        vmi("p", "rerun-1", node_name="gpu-node-1", gpu=A100),
        vm("p", "cpu-1", project="proj-a", owner=ALICE),
        vmi("p", "cpu-1", node_name="gpu-node-1"),
    )
    return h


def drain(h: Harness, *, by: str = OPS, notice: int | None = 600, cordon_lands: bool = True) -> None:
    """An operator drains gpu-node-1; unless told otherwise the applier's cordon lands and
    the watch shows it, as in a cluster."""
    spec: dict[str, object] = {"node": "gpu-node-1", "reason": "firmware upgrade"}
    if notice is not None:
        spec["notice_seconds"] = notice
    h.intent("drain_node", spec, by=by, project=None)
    if cordon_lands:
        cordoned(h)


def cordoned(h: Harness) -> None:
    """The watch shows gpu-node-1 cordoned."""
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True, rv=2), "MODIFIED")


def fates(h: Harness) -> dict[str, str]:
    return {n.subject.name: n.details["outcome"] for n in h.notifications("drain_will_stop_gpu_vm")}


def test_drain_intent_cordons_and_announces_each_gpu_vm_once_with_deadline() -> None:
    h = az()
    drain(h)
    assert [c.type for c in h.commands()] == ["cordon_node"]
    announced = h.notifications("drain_will_stop_gpu_vm")
    assert sorted(n.subject.name for n in announced) == ["always-1", "always-2", "rerun-1"]
    assert all(n.deadline == START + timedelta(seconds=600) for n in announced)
    assert {n.subject.name: n.recipients for n in announced}["rerun-1"] == [BOB]
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True, rv=2), "MODIFIED")
    assert len(h.notifications("drain_will_stop_gpu_vm")) == 3


def test_non_gpu_vms_are_not_announced() -> None:
    h = az()
    drain(h)
    assert "cpu-1" not in fates(h)


def test_one_spare_card_for_two_restarting_vms_promises_neither() -> None:
    """Which of the two gets the card is the scheduler's choice: both are told the numbers."""
    h = az(spare_rtx=1)
    drain(h)
    assert fates(h) == {"always-1": "waits_for_gpu", "always-2": "waits_for_gpu",
                        "rerun-1": "needs_manual_start"}
    told = {n.subject.name: n for n in h.notifications("drain_will_stop_gpu_vm")}
    assert "1 card(s) of this class free now for 2 GPU VM(s) leaving node gpu-node-1 that restart by themselves" \
        in told["always-1"].message
    assert (told["always-1"].details["cards_free"], told["always-1"].details["restarting_gpu_vms"]) == (1, 2)


def test_a_card_for_every_restarting_vm_promises_each_its_return() -> None:
    h = az(spare_rtx=2)
    drain(h)
    assert fates(h)["always-1"] == fates(h)["always-2"] == "returns_automatically"


def test_no_spare_card_means_waiting_for_a_gpu() -> None:
    h = az(spare_rtx=0)
    drain(h)
    assert fates(h)["always-1"] == "waits_for_gpu"


def test_cards_on_a_cordoned_or_unready_node_are_not_spare() -> None:
    h = az(spare_rtx=0)
    h.observe(node("gpu-node-3", gpus={RTX: 4}, unschedulable=True))
    h.observe(node("gpu-node-4", gpus={RTX: 4}, ready=False))
    drain(h)
    assert fates(h)["always-1"] == "waits_for_gpu"


def test_default_notice_comes_from_config() -> None:
    h = az()
    drain(h, notice=None)
    assert h.notifications("drain_will_stop_gpu_vm")[0].deadline == START + timedelta(seconds=900)


def test_only_operators_may_drain() -> None:
    h = az()
    drain(h, by=ALICE)
    assert h.commands() == []
    [rejected] = h.notifications("intent_rejected")
    assert rejected.recipients == [ALICE]
    assert rejected.details["reason"] == "alice@example.com may not drain nodes: only operators may"


def test_an_unknown_node_cannot_be_drained() -> None:
    h = Harness()
    h.intent("drain_node", {"node": "nope", "reason": "x"}, by=OPS, project=None)
    assert "unknown" in h.notifications("intent_rejected")[0].details["reason"]


def test_at_the_deadline_the_gpu_vms_left_are_stopped() -> None:
    h = az()
    drain(h)
    h.wait(599)
    assert h.tick() == []
    h.wait(1)
    [fired] = h.tick()
    stopped = sorted(c.target.name for c in fired.decision.commands)
    assert stopped == ["always-1", "always-2", "rerun-1"]
    assert all(c.type == "delete_vmi" and c.issued_at == START + timedelta(seconds=600)
               for c in fired.decision.commands)
    assert fired.decision.audit is not None and fired.decision.audit.input.topic == TIMER
    h.wait(60)
    assert h.tick() == []  # fires once


def test_a_deadline_before_the_cordon_lands_stops_nothing_until_it_does() -> None:
    """Stopped while the node still takes VMs, an Always VM would be started again right
    there — and left on the drained node as already stopped."""
    h = az()
    drain(h, cordon_lands=False)
    h.wait(600)
    [fired] = h.tick()
    assert fired.decision.commands == []
    episode = h.state.get(DRAINS, "gpu-node-1")
    assert episode is not None and episode.deadline_passed
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, rv=2), "MODIFIED")  # a heartbeat: still schedulable
    assert h.commands("delete_vmi") == []
    landed = h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True, rv=3), "MODIFIED")
    assert sorted(c.target.name for c in landed.decision.commands) == ["always-1", "always-2", "rerun-1"]
    assert {c.type for c in landed.decision.commands} == {"delete_vmi"}
    h.wait(60)
    assert h.tick() == [] and len(h.commands("delete_vmi")) == 3


def test_a_drained_node_that_is_gone_has_its_gpu_vmis_stopped_at_the_deadline() -> None:
    h = az()
    drain(h, cordon_lands=False)
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, rv=2), "DELETED")
    h.wait(600)
    [fired] = h.tick()
    assert sorted(c.target.name for c in fired.decision.commands) == ["always-1", "always-2", "rerun-1"]


def test_vms_stopped_by_their_owners_before_the_deadline_are_not_stopped_again() -> None:
    h = az()
    drain(h)
    h.observe(vmi("p", "rerun-1", node_name="gpu-node-1", phase="Succeeded", gpu=A100), "MODIFIED")
    h.wait(600)
    [fired] = h.tick()
    assert sorted(c.target.name for c in fired.decision.commands) == ["always-1", "always-2"]


def test_drain_completed_reports_what_became_of_each_vm_as_observed() -> None:
    """Not the prediction: always-1 came back, always-2 waits for a card, rerun-1 is off."""
    h = az(spare_rtx=1)
    drain(h)
    h.wait(600)
    h.tick()
    for name, device in (("always-1", RTX), ("always-2", RTX), ("rerun-1", A100)):
        h.observe(vmi("p", name, node_name="gpu-node-1", phase="Succeeded", gpu=device), "DELETED")
    # No GPU VMI is left, but what became of the two Always VMs is not seen yet.
    assert h.notifications("drain_completed") == []
    h.observe(vmi("p", "always-2", node_name=None, phase="Scheduling", gpu=RTX, generation=2, unschedulable=True))
    # Placed on gpu-node-2 (its pod ready, virt-controller's Scheduled) is not running again yet.
    h.observe(vmi("p", "always-1", node_name="gpu-node-2", phase="Scheduled", gpu=RTX, generation=2))
    assert h.notifications("drain_completed") == []
    h.observe(vmi("p", "always-1", node_name="gpu-node-2", gpu=RTX, generation=2))
    [done] = h.notifications("drain_completed")
    assert done.recipients == [OPS]
    assert done.details["gpu_vms"] == 3
    assert done.details["stopped_at_deadline"] == ["vm/p/always-1", "vm/p/always-2", "vm/p/rerun-1"]
    assert done.details["observed"] == {"came_back": ["vm/p/always-1"], "waits_for_gpu": ["vm/p/always-2"],
                                        "off": ["vm/p/rerun-1"]}
    assert "now 1 running again on another node, 1 waiting for a GPU, 1 off" in done.message
    assert done.details["announced_outcomes"]["waits_for_gpu"] == ["vm/p/always-1", "vm/p/always-2"]


def test_a_drain_of_a_node_without_gpu_vms_completes_at_once() -> None:
    h = Harness()
    h.observe(node("cpu-node", gpus={}))
    h.intent("drain_node", {"node": "cpu-node", "reason": "kernel"}, by=OPS, project=None)
    [done] = h.notifications("drain_completed")
    assert done.details["gpu_vms"] == 0


def test_a_node_maintenance_starts_the_same_announcements() -> None:
    h = az()
    h.observe(node_maintenance("nm-1", "gpu-node-1", "PSU replacement"))
    assert sorted(fates(h)) == ["always-1", "always-2", "rerun-1"]
    assert h.notifications("drain_will_stop_gpu_vm")[0].details["drain_source"] == "maintenance"
    assert [c.type for c in h.commands()] == ["cordon_node"]
    h.observe(node_maintenance("nm-1", "gpu-node-1", "PSU replacement"), "MODIFIED")
    assert len(h.notifications("drain_will_stop_gpu_vm")) == 3


def test_a_cordon_alone_stops_nothing() -> None:
    h = az()
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True, rv=2), "MODIFIED")
    assert h.state.get(DRAINS, "gpu-node-1") is None
    h.wait(3600)
    assert h.tick() == []
    assert h.commands() == [] and h.notifications("drain_will_stop_gpu_vm") == []


def test_cordoning_a_node_without_gpu_vms_is_not_a_drain_episode() -> None:
    h = Harness()
    h.observe(node("cpu-node", gpus={}))
    h.observe(node("cpu-node", gpus={}, unschedulable=True, rv=2), "MODIFIED")
    assert h.state.get(DRAINS, "cpu-node") is None


def evict(h: Harness, name: str = "always-1", device: str = RTX) -> None:
    h.observe(vmi("p", name, node_name="gpu-node-1", gpu=device, eviction_requested=True), "MODIFIED")


def test_an_eviction_concerns_that_one_vm_only() -> None:
    """evictionStrategy External: tell its owner, stop it at the deadline; no cordon, no other VM."""
    h = az(spare_rtx=1)
    evict(h)
    episode = h.state.get(DRAINS, "gpu-node-1")
    assert episode is not None
    assert (episode.source, episode.scope) == ("eviction", "evictions")
    [told] = h.notifications("drain_will_stop_gpu_vm")
    assert told.subject.name == "always-1" and told.recipients == [ALICE]
    assert told.deadline == START + timedelta(seconds=900)
    assert told.details["outcome"] == "returns_automatically"  # the one card is for it alone
    assert "KubeVirt was asked to evict GPU VM p/always-1 from node gpu-node-1" in told.message
    assert h.commands() == []
    h.wait(900)
    [fired] = h.tick()
    assert [(c.type, c.target.name) for c in fired.decision.commands] == [("delete_vmi", "always-1")]
    assert h.commands("cordon_node") == []


def test_an_evicted_vm_its_owner_stops_first_is_not_stopped_again() -> None:
    h = az()
    evict(h)
    h.observe(vmi("p", "always-1", node_name="gpu-node-1", phase="Succeeded", gpu=RTX), "MODIFIED")
    h.wait(900)
    h.tick()
    assert h.commands("delete_vmi") == []


def test_a_vm_evicted_after_the_first_deadline_gets_its_own_notice() -> None:
    h = az(spare_rtx=2)
    evict(h)
    h.wait(900)
    h.tick()
    h.wait(10)
    evict(h, "rerun-1", A100)
    told = {n.subject.name: n for n in h.notifications("drain_will_stop_gpu_vm")}
    assert told["rerun-1"].deadline == START + timedelta(seconds=1810)
    assert [c.target.name for c in h.commands("delete_vmi")] == ["always-1"]
    h.wait(900)
    h.tick()
    assert [c.target.name for c in h.commands("delete_vmi")] == ["always-1", "rerun-1"]


def test_a_drain_of_a_node_with_an_eviction_under_way_widens_it_to_the_whole_node() -> None:
    h = az()
    evict(h)
    drain(h)
    assert sorted(fates(h)) == ["always-1", "always-2", "rerun-1"]
    assert len(h.commands("cordon_node")) == 1
    episode = h.state.get(DRAINS, "gpu-node-1")
    assert episode is not None
    assert (episode.scope, episode.source) == ("node", "intent")


def test_a_gpu_vm_arriving_during_the_drain_is_announced_too() -> None:
    h = az()
    drain(h)
    h.observe(vm("p", "late-1", project="proj-a", owner=ALICE, gpu=RTX))
    h.observe(vmi("p", "late-1", node_name="gpu-node-1", gpu=RTX))
    assert "late-1" in fates(h)


def test_undrain_calls_the_drain_off_tells_every_warned_owner_and_undoes_its_cordon() -> None:
    h = az()
    drain(h)
    h.wait(60)
    h.intent("undrain_node", {"node": "gpu-node-1", "reason": "postponed"}, by=OPS, project=None)
    assert [c.type for c in h.commands()] == ["cordon_node", "uncordon_node"]
    assert h.state.get(DRAINS, "gpu-node-1") is None
    off = {n.subject.name: n for n in h.notifications("drain_called_off")}
    assert sorted(off) == ["always-1", "always-2", "gpu-node-1", "rerun-1"]
    assert off["rerun-1"].recipients == [BOB] and off["always-1"].recipients == [ALICE]
    assert "will not be stopped" in off["always-1"].message
    tally = off["gpu-node-1"]
    assert tally.recipients == [OPS]
    assert tally.details["told_it_is_off"] == ["vm/p/always-1", "vm/p/always-2", "vm/p/rerun-1"]
    assert tally.details["uncordoned"] is True
    h.wait(600)
    assert h.tick() == []
    assert h.commands("delete_vmi") == []


def test_undrain_leaves_a_cordon_that_was_not_vmstreams() -> None:
    h = az()
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True, rv=2), "MODIFIED")
    drain(h)
    assert h.commands("cordon_node") == []
    h.intent("undrain_node", {"node": "gpu-node-1"}, by=OPS, project=None)
    assert h.commands("uncordon_node") == []
    [tally] = [n for n in h.notifications("drain_called_off") if n.subject.kind == "Node"]
    assert tally.details["uncordoned"] is False


def test_undrain_after_the_deadline_tells_only_the_owners_whose_vm_was_not_stopped() -> None:
    h = az()
    drain(h)
    h.observe(vmi("p", "rerun-1", node_name="gpu-node-1", phase="Succeeded", gpu=A100), "MODIFIED")
    h.wait(600)
    h.tick()
    h.intent("undrain_node", {"node": "gpu-node-1"}, by=OPS, project=None)
    vms = sorted(n.subject.name for n in h.notifications("drain_called_off") if n.subject.kind != "Node")
    assert vms == ["rerun-1"]


def test_undrain_of_a_node_not_being_drained_is_rejected() -> None:
    h = az()
    h.intent("undrain_node", {"node": "gpu-node-1"}, by=OPS, project=None)
    assert h.notifications("intent_rejected")[0].details["reason"] == "node gpu-node-1 is not being drained"


def test_uncordoning_after_a_cordon_calls_the_drain_off() -> None:
    h = az()
    drain(h, cordon_lands=False)
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, rv=1), "MODIFIED")  # before the cordon lands
    assert h.state.get(DRAINS, "gpu-node-1") is not None
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True, rv=2), "MODIFIED")
    h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, rv=3), "MODIFIED")
    assert h.state.get(DRAINS, "gpu-node-1") is None
    assert len([n for n in h.notifications("drain_called_off") if n.subject.kind != "Node"]) == 3
    assert h.commands("uncordon_node") == []  # someone else uncordoned it already
    h.wait(600)
    assert h.tick() == [] and h.commands("delete_vmi") == []


def test_deleting_the_node_maintenance_calls_its_drain_off() -> None:
    h = az()
    h.observe(node_maintenance("nm-1", "gpu-node-1", "PSU"))
    h.observe(node_maintenance("nm-1", "gpu-node-1", "PSU"), "DELETED")
    assert h.state.get(DRAINS, "gpu-node-1") is None
    assert [c.type for c in h.commands()] == ["cordon_node", "uncordon_node"]
    [tally] = [n for n in h.notifications("drain_called_off") if n.subject.kind == "Node"]
    assert tally.recipients == [OPS] and "NodeMaintenance nm-1 was deleted" in tally.message
    h.wait(900)
    assert h.tick() == []


@pytest.mark.parametrize("second", ["maintenance", "cordon", "intent", "eviction"])
def test_a_second_signal_joins_the_episode(second: str) -> None:
    h = az()
    drain(h)
    if second == "maintenance":
        h.observe(node_maintenance("nm-1", "gpu-node-1", "again"))
    elif second == "cordon":
        h.observe(node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True, rv=2), "MODIFIED")
    elif second == "eviction":
        evict(h)
    else:
        h.intent("drain_node", {"node": "gpu-node-1", "reason": "again"}, by=OPS, project=None)
    assert len(h.notifications("drain_will_stop_gpu_vm")) == 3
    assert len(h.commands("cordon_node")) == 1


def test_a_restarting_vm_whose_vm_says_it_waits_for_a_card_is_reported_waiting() -> None:
    h = az(spare_rtx=0)
    drain(h)
    h.wait(600)
    h.tick()
    for name, device in (("always-1", RTX), ("always-2", RTX), ("rerun-1", A100)):
        h.observe(vmi("p", name, node_name="gpu-node-1", phase="Succeeded", gpu=device), "DELETED")
    h.observe(vm("p", "always-1", project="proj-a", owner=ALICE, gpu=RTX, rv=2,
                 printable_status="ErrorUnschedulable"), "MODIFIED")
    assert h.notifications("drain_completed") == []  # always-2 has not been seen again yet
    h.observe(vm("p", "always-2", project="proj-a", owner=ALICE, gpu=RTX, rv=2,
                 printable_status="ErrorUnschedulable"), "MODIFIED")
    [done] = h.notifications("drain_completed")
    assert done.details["observed"]["waits_for_gpu"] == ["vm/p/always-1", "vm/p/always-2"]
