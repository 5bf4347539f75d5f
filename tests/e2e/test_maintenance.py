"""GPU node maintenance planned with the VM owners, end to end (docs/maintenance.md, "Carried out").

Same loop as ``test_loop.py``: API server + KubeVirt's own virt-controller and virt-api +
Kafka + watch bridge + worker + applier, the node agent playing the scheduler, the kubelet
and virt-handler. An operator plans the maintenance of GPU nodes with ``plan_maintenance``;
the owners are told, answer, or the plan is called off.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client

from samples.cluster import RTX
from tests.e2e.test_loop import (  # noqa: F401 (fixtures)
    ALICE,
    LOOP_DEADLINE,
    NAMESPACE,
    OPS,
    Loop,
    loop,
)
from tests.support.kubevirt_schema import validate_vm
from tests.support.waiting import eventually

pytestmark = [pytest.mark.kube, pytest.mark.kafka]

BOB, CAROL, DAVE, ERIN = "bob@example.com", "carol@example.com", "dave@example.com", "erin@example.com"
MALLORY = "mallory@example.com"  # a tenant of another project
RTX_CLASS = "nvidia-rtx-pro-6000-bse"
AFTER = "vmstream.io/after-maintenance"


def parse(at: str) -> datetime:
    return datetime.fromisoformat(at.replace("Z", "+00:00"))


def gpu_vm(loop: Loop, name: str, *, run_strategy: str, owner: str, after: str | None = None) -> None:
    """A GPU VM of ``owner`` with its after-maintenance choice; as written, valid for KubeVirt."""
    loop.vm(name, run_strategy=run_strategy, gpu=RTX, owner=owner, annotations={AFTER: after} if after else None)
    vm = loop.get("virtualmachines", name)
    assert vm is not None
    validate_vm({k: v for k, v in vm.items() if k != "status"}, allow_unknown_fields=True)


def on_node(loop: Loop, node: str, *names: str) -> None:
    for name in names:
        assert loop.running_vmi(name)["status"]["nodeName"] == node, name


def rtx_cards(total: int, free: int) -> Any:
    return lambda c: (c[RTX_CLASS]["total"], c[RTX_CLASS]["free"]) == (total, free)


def plan(loop: Loop, plan_id: str, nodes: list[str], *, notice: int, duration: int) -> datetime:
    """The operator's plan, published now: returns the time it was asked, to the millisecond
    as the broker stamps records (no node goes before it plus the notice)."""
    now = datetime.now(UTC)
    asked = now.replace(microsecond=now.microsecond // 1000 * 1000)
    loop.intent("plan_maintenance", {
        "plan": plan_id, "nodes": nodes, "earliest_start": asked.isoformat(),
        "latest_end": (asked + timedelta(hours=1)).isoformat(), "concurrency": 1,
        "node_duration_seconds": duration, "notice_seconds": notice, "reason": "firmware upgrade"}, by=OPS)
    return asked


def told(loop: Loop, type_: str, count: int) -> dict[str, dict[str, Any]]:
    """The ``type_`` notices by VM name, once there are ``count``."""
    loop.outputs.wait_for(lambda o: len(o.notifications(type_)) >= count, timeout=LOOP_DEADLINE,
                          what=f"{count} {type_} notice(s)")
    notices = {n["subject"]["name"]: n for n in loop.outputs.notifications(type_)}
    assert len(notices) == count, sorted(notices)
    return notices


def arrival(loop: Loop, notification_id: str) -> datetime:
    """When the test read the notification off the topic: no later than it was there."""
    [at] = [at for at, topic, value in loop.outputs.arrivals
            if topic == "notifications" and value["notification_id"] == notification_id]
    return at


def stops_of(loop: Loop, name: str, since: datetime) -> list[datetime]:
    """Each time the VM was stopped: the stop commands vmstream issued for it, and its VMI's
    deletion as the node agent (virt-handler) saw it in the API server."""
    times = [parse(c["issued_at"]) for kind in ("stop_vm", "delete_vmi")
             for c in loop.outputs.commands(kind) if c["target"]["name"] == name]
    for line in loop.agent.history:
        at, _, what = line.partition(" node agent: ")
        if what.startswith(f"VMI {NAMESPACE}/{name} Succeeded") and "its VMI is deleted" in what:
            times.append(parse(at))
    return sorted(t for t in times if t >= since)


def progress(loop: Loop, episode: str) -> dict[str, Any]:
    """The operator's progress notice of the plan's ``episode`` (planned, back/<node>, cancelled)."""
    def find() -> dict[str, Any] | None:
        return next((n for n in loop.outputs.notifications("maintenance_progress") if episode_of(n) == episode), None)
    loop.outputs.wait_for(lambda o: find(), timeout=LOOP_DEADLINE, what=f"the operator's {episode} notice")
    found = find()
    assert found is not None
    return found


def episode_of(notice: dict[str, Any]) -> str:
    details = notice["details"]
    if "cancelled" in details:
        return "cancelled"
    if "started" in details:
        return f"back/{details['node']}"
    if "fates" in details:
        return "planned"
    return "?"


def issued(loop: Loop, type_: str, name: str) -> list[dict[str, Any]]:
    """The ``type_`` commands vmstream issued for the object ``name``, once there is one."""
    def of(o: Any) -> list[dict[str, Any]]:
        return [c for c in o.commands(type_) if c["target"]["name"] == name]
    loop.outputs.wait_for(of, timeout=LOOP_DEADLINE, what=f"{type_} {name}")
    return of(loop.outputs)


def intent_decided(loop: Loop, intent_id: str) -> dict[str, Any]:
    loop.outputs.wait_for(lambda o: o.audits(input__ref=intent_id), timeout=LOOP_DEADLINE,
                          what=f"the decision on {intent_id}")
    [audit] = loop.outputs.audits(input__ref=intent_id)
    return audit


def uncordon(loop: Loop, node: str) -> None:
    """The operator's own uncordon once the node's maintenance is done."""
    client.CoreV1Api(loop.api).patch_node(node, {"spec": {"unschedulable": None}})


# ----------------------------------------------------------------------------- carried out


def test_a_planned_pool_tells_every_owner_first_then_goes_node_by_node_end_to_end(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 4})
    gpu_vm(loop, "train-1", run_strategy="Always", owner=ALICE)  # elsewhere, the default
    gpu_vm(loop, "keep-1", run_strategy="Always", owner=BOB, after="same_node")
    gpu_vm(loop, "off-1", run_strategy="Always", owner=CAROL, after="stay_off")
    gpu_vm(loop, "batch-1", run_strategy="RerunOnFailure", owner=DAVE, after="elsewhere")
    on_node(loop, "gpu-node-1", "train-1", "keep-1", "off-1", "batch-1")
    loop.node("gpu-node-2", gpus={RTX: 1})
    gpu_vm(loop, "train-2", run_strategy="Always", owner=ERIN)
    on_node(loop, "gpu-node-2", "train-2")
    loop.node("gpu-spare", gpus={RTX: 2})  # the spare: free cards of the class
    first_vmis = {name: (loop.get("virtualmachineinstances", name) or {})["metadata"]["uid"]
                  for name in ("train-1", "keep-1", "off-1", "batch-1", "train-2")}
    for name in first_vmis:
        loop.seen_by_worker(name)
    loop.worker.wait_until("/capacity", rtx_cards(7, 2), timeout=LOOP_DEADLINE)

    asked = plan(loop, "fw", ["gpu-node-1", "gpu-node-2"], notice=15, duration=5)
    notices = told(loop, "maintenance_planned", 5)
    planned = progress(loop, "planned")
    assert planned["recipients"] == [OPS]
    slots = {slot["node"]: (parse(slot["start"]), parse(slot["end"])) for slot in planned["details"]["nodes"]}
    assert slots["gpu-node-1"][0] >= asked + timedelta(seconds=15)  # the notice
    assert slots["gpu-node-2"][0] >= slots["gpu-node-1"][1]  # one node at a time
    expected = {"train-1": (ALICE, "gpu-node-1", "lands_elsewhere"), "keep-1": (BOB, "gpu-node-1", "back_on_own_node"),
                "off-1": (CAROL, "gpu-node-1", "stays_off"), "batch-1": (DAVE, "gpu-node-1", "stays_off"),
                "train-2": (ERIN, "gpu-node-2", "lands_elsewhere")}
    assert {name: (n["recipients"], n["details"]["node"], n["details"]["fate"]) for name, n in notices.items()} == {
        name: ([owner], node, fate) for name, (owner, node, fate) in expected.items()}
    for name, notice in notices.items():
        assert parse(notice["details"]["stop"]) == slots[notice["details"]["node"]][0], name
    read_at = {name: arrival(loop, n["notification_id"]) for name, n in notices.items()}

    # At its slot, gpu-node-1 is cordoned and its VMs stopped; the Always VM lands on the spare.
    eventually(lambda: loop.cordoned("gpu-node-1"), "gpu-node-1 cordoned", timeout=LOOP_DEADLINE)
    [cordon] = issued(loop, "cordon_node", "gpu-node-1")
    back = loop.running_vmi("train-1", not_on="gpu-node-1")
    assert back["status"]["nodeName"] == "gpu-spare"
    assert back["spec"]["domain"]["devices"]["gpus"][0]["deviceName"] == RTX
    loop.stopped_for_good("off-1")
    loop.stopped_for_good("batch-1")
    loop.stopped_for_good("keep-1")
    loop.outputs.wait_for(lambda o: any(n["subject"]["name"] == "gpu-node-1"
                                        for n in o.notifications("drain_completed")),
                          timeout=LOOP_DEADLINE, what="gpu-node-1's drain completed")
    assert parse(cordon["issued_at"]) >= slots["gpu-node-1"][0]
    for name in ("train-1", "keep-1", "off-1", "batch-1"):
        stops = stops_of(loop, name, asked)
        assert stops, f"{name} was never stopped"
        assert read_at[name] < stops[0], (name, read_at[name], stops)  # told before anything of theirs stopped
        assert stops[0] >= slots["gpu-node-1"][0], (name, stops)  # at its slot, not before
    assert loop.outputs.notifications("drain_will_stop_gpu_vm") == []  # the plan told them, the drain did not

    # gpu-node-2's slot comes while gpu-node-1 is still in maintenance: it waits (concurrency 1).
    def held(o: Any) -> bool:
        return any(n["details"].get("delayed") for n in o.notifications("maintenance_changed"))
    loop.outputs.wait_for(held, timeout=LOOP_DEADLINE, what="gpu-node-2 held for gpu-node-1")
    [delayed] = [n for n in loop.outputs.notifications("maintenance_changed") if n["details"].get("delayed")]
    assert delayed["subject"]["name"] == "train-2" and delayed["recipients"] == [ERIN]
    assert delayed["details"]["waiting_for"] == ["gpu-node-1"]
    assert not loop.cordoned("gpu-node-2")
    assert (loop.get("virtualmachineinstances", "train-2") or {})["metadata"]["uid"] == first_vmis["train-2"]

    # The operator's maintenance done: gpu-node-1 uncordoned. keep-1 is started again on it,
    # off-1 stays off, the operator is told, and gpu-node-2 goes.
    uncordoned_at = datetime.now(UTC)
    uncordon(loop, "gpu-node-1")
    again = loop.running_vmi("keep-1", other_than=first_vmis["keep-1"])
    assert again["status"]["nodeName"] == "gpu-node-1"
    [start] = issued(loop, "start_vm", "keep-1")
    assert start["requested_by"] == OPS
    node_1_back = progress(loop, "back/gpu-node-1")
    assert node_1_back["recipients"] == [OPS]
    assert node_1_back["details"]["started"] == [f"vm/{NAMESPACE}/keep-1"]
    assert node_1_back["details"]["left"] == ["gpu-node-2"]
    eventually(lambda: loop.cordoned("gpu-node-2"), "gpu-node-2 cordoned", timeout=LOOP_DEADLINE)
    [cordon_2] = issued(loop, "cordon_node", "gpu-node-2")
    assert parse(cordon_2["issued_at"]) >= uncordoned_at  # only once gpu-node-1 is back
    moved = loop.running_vmi("train-2", not_on="gpu-node-2")
    assert moved["spec"]["domain"]["devices"]["gpus"][0]["deviceName"] == RTX
    assert read_at["train-2"] < stops_of(loop, "train-2", asked)[0]
    assert [c["target"]["name"] for c in loop.outputs.commands("start_vm")] == ["keep-1"]
    loop.outputs.wait_for(lambda o: any(n["subject"]["name"] == "gpu-node-2"
                                        for n in o.notifications("drain_completed")),
                          timeout=LOOP_DEADLINE, what="gpu-node-2's drain completed")
    uncordon(loop, "gpu-node-2")
    done = progress(loop, "back/gpu-node-2")
    assert done["details"]["left"] == [] and "every node of the plan is back" in done["message"]
    assert loop.get("virtualmachineinstances", "off-1") is None
    assert (loop.get("virtualmachines", "off-1") or {})["spec"]["runStrategy"] == "Halted"


# ----------------------------------------------------------------------------- answers


def planned_pair(loop: Loop, *, notice: int, duration: int) -> tuple[datetime, dict[str, dict[str, Any]]]:
    """gpu-node-1 with alice's train-1 (Always, elsewhere) and carol's off-1 (stay_off), a spare
    card elsewhere, and the operator's plan of gpu-node-1 told to both owners."""
    loop.node("gpu-node-1", gpus={RTX: 2})
    gpu_vm(loop, "train-1", run_strategy="Always", owner=ALICE)
    gpu_vm(loop, "off-1", run_strategy="Always", owner=CAROL, after="stay_off")
    on_node(loop, "gpu-node-1", "train-1", "off-1")
    loop.node("gpu-spare", gpus={RTX: 1})
    for name in ("train-1", "off-1"):
        loop.seen_by_worker(name)
    loop.worker.wait_until("/capacity", rtx_cards(3, 1), timeout=LOOP_DEADLINE)
    asked = plan(loop, "fw", ["gpu-node-1"], notice=notice, duration=duration)
    notices = told(loop, "maintenance_planned", 2)
    assert {name: n["recipients"] for name, n in notices.items()} == {"train-1": [ALICE], "off-1": [CAROL]}
    return asked, notices


def refusal_told(loop: Loop, intent_id: str, asker: str) -> str:
    """The intent refused: its audit record's reason, told to the asker as refused intents are."""
    audit = intent_decided(loop, intent_id)
    assert audit["outcome"] == "rejected", audit
    loop.outputs.wait_for(lambda o: any(n["details"]["intent_id"] == intent_id for n in o.notifications("intent_rejected")),
                          timeout=LOOP_DEADLINE, what=f"the refusal of {intent_id} told")
    [notice] = [n for n in loop.outputs.notifications("intent_rejected") if n["details"]["intent_id"] == intent_id]
    assert notice["recipients"] == [asker] and notice["details"]["reason"] == audit["reason"]
    assert notice["notification_id"] in audit["notifications"]
    return str(audit["reason"])


def test_an_owner_moves_a_stop_the_plan_can_keep_and_is_refused_one_it_cannot_end_to_end(loop: Loop) -> None:
    asked, notices = planned_pair(loop, notice=600, duration=600)
    slot_start = parse(notices["off-1"]["details"]["stop"])
    assert slot_start >= asked + timedelta(seconds=600)

    # Carol wants off-1 (it stays off) stopped five minutes earlier: kept, only she is told again.
    earlier = (slot_start - timedelta(minutes=5)).isoformat()
    moved = loop.intent("reschedule_maintenance", {"plan": "fw", "namespace": NAMESPACE, "name": "off-1",
                                                   "start": earlier}, by=CAROL, project="proj-a")
    audit = intent_decided(loop, moved)
    assert audit["outcome"] == "accepted", audit
    loop.outputs.wait_for(lambda o: o.notifications("maintenance_changed"), timeout=LOOP_DEADLINE,
                          what="carol's corrected notice")
    [changed] = loop.outputs.notifications("maintenance_changed")
    assert changed["subject"]["name"] == "off-1" and changed["recipients"] == [CAROL]
    assert parse(changed["details"]["stop"]) == parse(earlier) and parse(changed["deadline"]) == parse(earlier)
    assert changed["details"]["fate"] == "stays_off" and changed["details"]["node"] == "gpu-node-1"
    assert audit["notifications"] == [changed["notification_id"]]  # alice is not told again

    # Alice wants train-1 stopped two hours later: its node would leave the window; refused.
    later = loop.intent("reschedule_maintenance", {"plan": "fw", "namespace": NAMESPACE, "name": "train-1",
                                                   "start": (asked + timedelta(hours=2)).isoformat()},
                        by=ALICE, project="proj-a")
    reason = refusal_told(loop, later, ALICE)
    assert "gpu-node-1 would leave the window" in reason, reason

    # A tenant of another project cannot move carol's VM.
    foreign = loop.intent("reschedule_maintenance", {"plan": "fw", "namespace": NAMESPACE, "name": "off-1",
                                                     "start": (slot_start - timedelta(minutes=8)).isoformat()},
                          by=MALLORY, project="proj-b")
    reason = refusal_told(loop, foreign, MALLORY)
    assert f"may not answer for VM {NAMESPACE}/off-1" in reason, reason
    assert len(loop.outputs.notifications("maintenance_changed")) == 1
    assert not loop.cordoned("gpu-node-1")
    assert loop.outputs.commands("stop_vm") == [] and loop.outputs.commands("delete_vmi") == []


# ----------------------------------------------------------------------------- called off


def test_a_plan_cancelled_before_its_first_slot_tells_every_owner_and_stops_nothing_end_to_end(loop: Loop) -> None:
    asked, notices = planned_pair(loop, notice=8, duration=5)
    first_vmis = {name: (loop.get("virtualmachineinstances", name) or {})["metadata"]["uid"] for name in notices}
    slot_start = parse(notices["train-1"]["details"]["stop"])
    cancel = loop.intent("cancel_maintenance", {"plan": "fw", "reason": "vendor postponed the firmware"}, by=OPS)
    assert intent_decided(loop, cancel)["outcome"] == "accepted"
    off = told(loop, "maintenance_cancelled", 2)
    assert {name: n["recipients"] for name, n in off.items()} == {"train-1": [ALICE], "off-1": [CAROL]}
    assert all(n["details"]["plan"] == "fw" and n["details"]["node"] == "gpu-node-1" for n in off.values())
    for name, n in off.items():
        assert arrival(loop, n["notification_id"]) < slot_start, name  # told before the slot
    cancelled = progress(loop, "cancelled")
    assert cancelled["recipients"] == [OPS] and cancelled["details"]["called_off"] == []

    # A witness: another plan, of the spare alone, whose slot starts 3 s after fw's would have.
    # Its cordon shows the worker's clock went past fw's slot.
    loop.intent("plan_maintenance", {
        "plan": "witness", "nodes": ["gpu-spare"], "earliest_start": (slot_start + timedelta(seconds=3)).isoformat(),
        "latest_end": (slot_start + timedelta(hours=1)).isoformat(), "concurrency": 1,
        "node_duration_seconds": 60, "notice_seconds": 0, "reason": "witness"}, by=OPS)
    eventually(lambda: loop.cordoned("gpu-spare"), "gpu-spare cordoned at the witness's slot", timeout=LOOP_DEADLINE)
    issued(loop, "cordon_node", "gpu-spare")
    assert not loop.cordoned("gpu-node-1")
    assert [c["target"]["name"] for c in loop.outputs.commands("cordon_node")] == ["gpu-spare"]
    assert loop.outputs.commands("stop_vm") == [] and loop.outputs.commands("delete_vmi") == []
    for name, uid in first_vmis.items():
        vmi = loop.get("virtualmachineinstances", name) or {}
        assert vmi["metadata"]["uid"] == uid and vmi["status"]["phase"] == "Running", name
    assert loop.outputs.notifications("maintenance_changed") == []
