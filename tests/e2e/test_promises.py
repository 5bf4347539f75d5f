"""The promise end to end, on KubeVirt's own virt-controller and virt-api: no GPU VM is stopped
without its owner being told first, and every owner is told the true fate of their VM.

Same loop as ``test_loop.py``: API server + KubeVirt + Kafka + watch bridge + worker + applier.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from kubernetes import client

from handlers.contracts.ids import watch_event_id
from harness.localkubevirt import vm_subresource
from harness.running import Outputs
from samples.cluster import RTX
from streams.kube.subresources import EVACUATE_CANCEL_PATH, SUBRESOURCE_HEADERS
from tests.e2e.test_gpu_sets import own_domain
from tests.e2e.test_loop import (  # noqa: F401 (fixtures)
    ALICE,
    KUBEVIRT,
    LOOP_DEADLINE,
    NAMESPACE,
    OPS,
    Loop,
    loop,
)
from tests.support.waiting import eventually

pytestmark = [pytest.mark.kube, pytest.mark.kafka]


def not_before(at: str, then: str) -> bool:
    """RFC 3339 times compared as times (a fraction of a second sorts before "Z" as text)."""
    return datetime.fromisoformat(at.replace("Z", "+00:00")) >= datetime.fromisoformat(then.replace("Z", "+00:00"))


def bare_vm(loop: Loop, name: str, *, run_strategy: str = "Always", gpus: list[str] | None = None,
            labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> None:
    """A GPU VM as kubectl would create it, with the GPU rules and only the metadata given."""
    template: dict[str, Any] = {
        "domain": own_domain(gpus=gpus if gpus is not None else [RTX]), "evictionStrategy": "External",
        "volumes": [{"name": "containerdisk", "containerDisk": {"image": "quay.io/containerdisks/ubuntu:24.04"}}]}
    template["domain"]["devices"]["disks"] = [{"name": "containerdisk", "disk": {"bus": "virtio"}}]
    body: dict[str, Any] = {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels or {}, "annotations": annotations or {}},
        "spec": {"runStrategy": run_strategy, "template": {"spec": template}},
    }
    client.CustomObjectsApi(loop.api).create_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines", body)


def test_a_gpu_vm_with_neither_owner_nor_project_is_announced_to_the_operators_end_to_end(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 1})
    bare_vm(loop, "anon-1")
    loop.running_vmi("anon-1")
    loop.seen_by_worker("anon-1")
    refusal = loop.evict("anon-1")
    assert refusal.status == 429
    loop.outputs.wait_for(lambda o: o.notifications("drain_will_stop_gpu_vm"), what="the eviction notice")
    [told] = loop.outputs.notifications("drain_will_stop_gpu_vm")
    assert told["subject"]["name"] == "anon-1" and told["recipients"] == [OPS]


def cancel_eviction(loop: Loop, name: str, node: str) -> None:
    """``virtctl``'s evacuate-cancel: PUT the VMI's ``evacuate/cancel`` subresource on virt-api
    (EvacuateCancelHandler, pkg/virt-api/rest/evacuate_cancel.go), which removes
    ``status.evacuationNodeName`` if it still names ``node``."""
    loop.api.call_api(EVACUATE_CANCEL_PATH.format(namespace=NAMESPACE, name=name), "PUT",
                      body={"evacuationNodeName": node}, header_params=SUBRESOURCE_HEADERS,
                      auth_settings=["BearerToken"], _preload_content=False)


def seen_as_it_is(loop: Loop, name: str) -> None:
    """The worker has decided the watch event showing the VMI as the API server has it now:
    a mark virt-api just made has reached it through the watch bridge."""
    vmi = loop.get("virtualmachineinstances", name) or {}
    version = vmi["metadata"]["resourceVersion"]
    events = {watch_event_id("VirtualMachineInstance", NAMESPACE, name, version, type_)
              for type_ in ("MODIFIED", "RELISTED")}
    loop.outputs.wait_for(lambda o: events & {a["input"]["ref"] for a in o.seen["audit"]},
                          timeout=LOOP_DEADLINE, what=f"the worker to decide VMI {name} at version {version}")


def marked(loop: Loop, name: str) -> bool:
    status = (loop.get("virtualmachineinstances", name) or {}).get("status") or {}
    return bool(status.get("evacuationNodeName")) or any(
        c.get("type") == "EvictionRequested" and c.get("status") == "True" for c in status.get("conditions") or [])


def test_a_cancelled_eviction_is_retracted_and_a_later_one_gets_a_full_notice_end_to_end(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 1})
    loop.vm("ev-1", run_strategy="Always", gpu=RTX)
    first = loop.running_vmi("ev-1")
    loop.seen_by_worker("ev-1")

    assert loop.evict("ev-1").status == 429
    loop.outputs.wait_for(lambda o: o.notifications("drain_will_stop_gpu_vm"), what="the eviction notice")
    cancel_eviction(loop, "ev-1", "gpu-node-1")
    eventually(lambda: not marked(loop, "ev-1"), "KubeVirt to drop the mark and EvictionRequested",
               timeout=LOOP_DEADLINE)
    loop.outputs.wait_for(lambda o: o.notifications("drain_called_off"), what="the owner told it is off")
    [off] = loop.outputs.notifications("drain_called_off")
    assert off["subject"]["name"] == "ev-1" and off["recipients"] == [ALICE]

    # Past the first deadline the VM runs on: the stop is off.
    loop.agent.wait_passes(count=int(4 / loop.agent.interval))
    vmi = loop.get("virtualmachineinstances", "ev-1") or {}
    assert vmi["metadata"]["uid"] == first["metadata"]["uid"] and vmi["status"]["phase"] == "Running"
    assert loop.outputs.commands("delete_vmi") == []

    # Evicted again: a new notice, a full notice period, no stop with the mark.
    assert loop.evict("ev-1").status == 429
    loop.outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) == 2, what="a fresh notice")
    first_notice, second_notice = loop.outputs.notifications("drain_will_stop_gpu_vm")
    assert second_notice["notification_id"] != first_notice["notification_id"]
    loop.outputs.wait_for(lambda o: any(second_notice["notification_id"] in a["notifications"]
                                        for a in o.seen["audit"]), what="the notice's audit record")
    [announcing] = [a for a in loop.outputs.seen["audit"] if second_notice["notification_id"] in a["notifications"]]
    assert announcing["commands"] == []
    loop.outputs.wait_for(lambda o: o.commands("delete_vmi"), what="the stop at the new deadline",
                          timeout=LOOP_DEADLINE)
    [stop] = loop.outputs.commands("delete_vmi")
    assert not_before(stop["issued_at"], second_notice["deadline"])


def test_a_called_off_drain_cancels_the_eviction_marks_it_leaves_behind_end_to_end(loop: Loop) -> None:
    """kubectl drain evicts through the Eviction API and virt-api marks the VMI; the drain is
    called off, and KubeVirt would keep the mark: vmstream cancels it through virt-api's
    evacuate/cancel, and never stops the VM on it."""
    loop.node("gpu-node-1", gpus={RTX: 1})
    loop.vm("ev-1", run_strategy="Always", gpu=RTX)
    first = loop.running_vmi("ev-1")
    loop.seen_by_worker("ev-1")
    loop.intent("drain_node", {"node": "gpu-node-1", "reason": "BIOS update", "notice_seconds": 120}, by=OPS)
    loop.outputs.wait_for(lambda o: o.notifications("drain_will_stop_gpu_vm"), what="the drain notice")
    eventually(lambda: loop.cordoned("gpu-node-1"), "gpu-node-1 cordoned", timeout=LOOP_DEADLINE)
    assert loop.evict("ev-1").status == 429  # the evictions of a kubectl drain
    eventually(lambda: marked(loop, "ev-1"), "virt-api to mark the VMI", timeout=LOOP_DEADLINE)
    seen_as_it_is(loop, "ev-1")  # the drain is called off on a mark the worker knows of

    undrain = loop.intent("undrain_node", {"node": "gpu-node-1", "reason": "postponed"}, by=OPS)
    results = loop.result_of(undrain)
    assert sorted(r["type"] for r in results) == ["cancel_evacuation", "uncordon_node"]
    assert all(r["outcome"] == "applied" for r in results), results
    off = [n for n in loop.outputs.notifications("drain_called_off") if n["subject"]["kind"] == "VirtualMachine"]
    assert [n["recipients"] for n in off] == [[ALICE]] and "vmstream cancels that mark" in off[0]["message"]
    eventually(lambda: not marked(loop, "ev-1"), "the mark and EvictionRequested gone", timeout=LOOP_DEADLINE)

    # Longer than an eviction's notice (3 s here): the VM was not taken for evicted again.
    loop.agent.wait_passes(count=int(6 / loop.agent.interval))
    vmi = loop.get("virtualmachineinstances", "ev-1") or {}
    assert vmi["metadata"]["uid"] == first["metadata"]["uid"] and vmi["status"]["phase"] == "Running"
    assert loop.outputs.commands("delete_vmi") == []
    assert len(loop.outputs.notifications("drain_will_stop_gpu_vm")) == 1


def test_a_rerun_on_failure_vm_that_fails_during_the_notice_comes_back_and_one_that_succeeds_stays_off_end_to_end(
        loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 2})
    loop.vm("crash-1", run_strategy="RerunOnFailure", gpu=RTX)
    loop.vm("done-1", run_strategy="RerunOnFailure", gpu=RTX)
    crashed = loop.running_vmi("crash-1")
    loop.running_vmi("done-1")
    loop.node("gpu-node-2", gpus={RTX: 1})
    loop.seen_by_worker("crash-1")
    loop.seen_by_worker("done-1")
    loop.intent("drain_node", {"node": "gpu-node-1", "reason": "kernel", "notice_seconds": 120}, by=OPS)
    loop.outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) == 2, what="both told")
    eventually(lambda: loop.cordoned("gpu-node-1"), "gpu-node-1 cordoned", timeout=LOOP_DEADLINE)

    loop.agent.fail(NAMESPACE, "crash-1")  # the guest crashed: KubeVirt starts it again (RerunOnFailure)
    loop.agent.finish(NAMESPACE, "done-1")  # the guest shut down: it stays off
    back = loop.running_vmi("crash-1", other_than=crashed["metadata"]["uid"])
    assert back["status"]["nodeName"] == "gpu-node-2"
    loop.outputs.wait_for(lambda o: o.notifications("drain_completed"), what="drain_completed",
                          timeout=LOOP_DEADLINE)
    [done] = loop.outputs.notifications("drain_completed")
    assert done["details"]["observed"] == {"came_back": [f"vm/{NAMESPACE}/crash-1"], "waits_for_gpu": [],
                                           "off": [f"vm/{NAMESPACE}/done-1"]}
    assert loop.outputs.commands("delete_vmi") == []  # both left before the deadline


def test_a_manual_vm_whose_vmi_has_ended_can_be_restarted_end_to_end(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 1})
    loop.vm("man-1", run_strategy="Manual", gpu=RTX)
    vm_subresource(loop.api, NAMESPACE, "man-1", "start")
    first = loop.running_vmi("man-1")
    loop.agent.finish(NAMESPACE, "man-1")  # the guest shut itself down; Manual leaves the VMI there
    eventually(lambda: ((loop.get("virtualmachineinstances", "man-1") or {}).get("status") or {}).get("phase")
               == "Succeeded", "the VMI Succeeded", timeout=LOOP_DEADLINE)
    loop.outputs.wait_for(lambda o: any(a["input"]["key"] == f"VirtualMachineInstance/{NAMESPACE}/man-1"
                                        for a in o.seen["audit"]), what="the worker to observe it")
    loop.agent.wait_passes()
    restart = loop.intent("restart_vm", {"namespace": NAMESPACE, "name": "man-1"}, by=ALICE, project="proj-a")
    assert [r["outcome"] for r in loop.result_of(restart)] == ["applied"]
    loop.running_vmi("man-1", other_than=first["metadata"]["uid"])


def test_a_once_vm_is_told_how_its_gpu_change_takes_effect_end_to_end(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 1})
    loop.vm("once-1", run_strategy="Once")
    first = loop.running_vmi("once-1")
    loop.seen_by_worker("once-1")
    set_gpu = loop.intent("set_gpu", {"namespace": NAMESPACE, "name": "once-1",
                                      "gpu_class": "nvidia-rtx-pro-6000-bse"}, by=ALICE, project="proj-a")
    loop.result_of(set_gpu)
    loop.outputs.wait_for(lambda o: o.notifications("gpu_change_pending_restart"), what="the pending notice")
    [told] = loop.outputs.notifications("gpu_change_pending_restart")
    assert "after its next restart" not in told["message"] and "stopped and started again" in told["message"]
    # As told: KubeVirt refuses the restart; a stop and a start bring the GPU.
    refused = loop.intent("restart_vm", {"namespace": NAMESPACE, "name": "once-1"}, by=ALICE, project="proj-a")
    loop.outputs.wait_for(lambda o: o.audits(input__ref=refused), what="the restart's refusal")
    [audit] = loop.outputs.audits(input__ref=refused)
    assert audit["outcome"] == "rejected" and "Once" in audit["reason"]
    vm_subresource(loop.api, NAMESPACE, "once-1", "stop")
    eventually(lambda: loop.get("virtualmachineinstances", "once-1") is None, "the VMI gone", timeout=LOOP_DEADLINE)
    vm_subresource(loop.api, NAMESPACE, "once-1", "start")
    second = loop.running_vmi("once-1", other_than=first["metadata"]["uid"])
    assert second["spec"]["domain"]["devices"]["gpus"][0]["deviceName"] == RTX


BOB = "bob@example.com"


def owned_vm(loop: Loop, name: str, owner: str) -> None:
    bare_vm(loop, name, labels={"superphenix.net/projectID": "proj-a"}, annotations={"vmstream.io/owner": owner})


def delete_vm(loop: Loop, name: str) -> None:
    client.CustomObjectsApi(loop.api).delete_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines", name)
    eventually(lambda: loop.get("virtualmachines", name) is None and loop.get("virtualmachineinstances", name) is None,
               f"{name} and its VMI gone", timeout=LOOP_DEADLINE)


def bobs_own_notice(loop: Loop, vmi_uid: str) -> None:
    """Bob's VM of alice's VM's name is evicted: he is told, with a full notice of his own, and
    it is stopped at his deadline, not at alice's."""
    assert loop.evict("ev-1").status == 429
    loop.outputs.wait_for(lambda o: any(n["recipients"] == [BOB] for n in o.notifications("drain_will_stop_gpu_vm")),
                          what="bob's own notice", timeout=LOOP_DEADLINE)
    [bobs] = [n for n in loop.outputs.notifications("drain_will_stop_gpu_vm") if n["recipients"] == [BOB]]
    loop.outputs.wait_for(lambda o: any(bobs["notification_id"] in a["notifications"] for a in o.seen["audit"]),
                          what="the notice's audit record")
    [announcing] = [a for a in loop.outputs.seen["audit"] if bobs["notification_id"] in a["notifications"]]
    assert announcing["commands"] == []  # not stopped with the mark, on alice's deadline long past
    def stops_of_bob(o: Outputs) -> list[dict[str, Any]]:
        return [c for c in o.commands("delete_vmi") if c["target"].get("uid") == vmi_uid]

    loop.outputs.wait_for(lambda o: bool(stops_of_bob(o)), what="bob's VM stopped at his deadline",
                          timeout=LOOP_DEADLINE)
    [stop] = stops_of_bob(loop.outputs)
    assert not_before(stop["issued_at"], bobs["deadline"])


def test_a_vm_deleted_and_made_again_under_its_name_gets_its_own_notice_end_to_end(loop: Loop) -> None:
    """Alice's ev-1 is evicted and stopped, and comes back (Always); her ev-2's eviction is
    cancelled. She deletes ev-1, bob makes a VM of that name, and it is evicted in turn."""
    loop.node("gpu-node-1", gpus={RTX: 2})
    owned_vm(loop, "ev-1", ALICE)
    owned_vm(loop, "ev-2", ALICE)
    first = loop.running_vmi("ev-1")
    loop.running_vmi("ev-2")
    loop.seen_by_worker("ev-1")
    loop.seen_by_worker("ev-2")
    assert loop.evict("ev-2").status == 429
    cancel_eviction(loop, "ev-2", "gpu-node-1")
    assert loop.evict("ev-1").status == 429
    loop.outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) >= 1, what="alice's notices")
    loop.running_vmi("ev-1", other_than=first["metadata"]["uid"])  # stopped at her deadline, back
    delete_vm(loop, "ev-1")  # alice deletes her VM; bob makes one of the same name
    owned_vm(loop, "ev-1", BOB)
    bobs = loop.running_vmi("ev-1")
    loop.outputs.wait_for(lambda o: any(a["input"]["key"] == f"VirtualMachineInstance/{NAMESPACE}/ev-1"
                                        and not_before(a["at"], bobs["metadata"]["creationTimestamp"])
                                        for a in o.seen["audit"]), what="the worker to see bob's VMI")
    bobs_own_notice(loop, bobs["metadata"]["uid"])


def test_a_vm_made_again_seen_only_in_a_relist_gets_its_own_notice_end_to_end(loop: Loop) -> None:
    """The watch bridge is away while alice's VM is deleted and bob's made: it relists bob's VM
    under the same key, and no DELETED of alice's is ever published."""
    assert loop.bridge is not None
    loop.node("gpu-node-1", gpus={RTX: 1})
    owned_vm(loop, "ev-1", ALICE)
    first = loop.running_vmi("ev-1")
    loop.seen_by_worker("ev-1")
    assert loop.evict("ev-1").status == 429
    loop.outputs.wait_for(lambda o: o.notifications("drain_will_stop_gpu_vm"), what="alice's notice")
    loop.bridge.stop()
    delete_vm(loop, "ev-1")
    owned_vm(loop, "ev-1", BOB)
    second = loop.running_vmi("ev-1", other_than=first["metadata"]["uid"])
    loop.bridge.start()
    loop.outputs.wait_for(lambda o: any(e for e in o.seen["audit"]
                                        if e["input"]["key"] == f"VirtualMachineInstance/{NAMESPACE}/ev-1"
                                        and not_before(e["at"], second["metadata"]["creationTimestamp"])),
                          what="the relist decided", timeout=LOOP_DEADLINE)
    bobs_own_notice(loop, second["metadata"]["uid"])


def test_a_gpu_removed_while_a_drain_waits_for_a_card_corrects_the_notice_end_to_end(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 1})
    loop.vm("a-1", run_strategy="Always", gpu=RTX)
    loop.running_vmi("a-1")
    loop.seen_by_worker("a-1")
    loop.intent("drain_node", {"node": "gpu-node-1", "reason": "kernel", "notice_seconds": 120}, by=OPS)
    loop.outputs.wait_for(lambda o: o.notifications("drain_will_stop_gpu_vm"), what="the notice")
    [waits] = loop.outputs.notifications("drain_will_stop_gpu_vm")
    assert waits["details"]["outcome"] == "waits_for_gpu"
    remove = loop.intent("set_gpu", {"namespace": NAMESPACE, "name": "a-1", "gpu_class": None}, by=ALICE,
                         project="proj-a")
    assert [r["outcome"] for r in loop.result_of(remove)] in (["applied"], ["conflict_retried"])
    loop.outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) == 2, what="the correction",
                          timeout=LOOP_DEADLINE)
    corrected = loop.outputs.notifications("drain_will_stop_gpu_vm")[1]
    assert corrected["message"].startswith("Correction: ") and "without a GPU" in corrected["message"]
    assert corrected["details"]["outcome"] == "returns_automatically" and corrected["recipients"] == [ALICE]


def test_two_drains_do_not_both_promise_the_one_free_card_and_a_promise_is_corrected_when_it_is_taken_end_to_end(
        loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 1})
    loop.vm("a-1", run_strategy="Always", gpu=RTX)
    loop.running_vmi("a-1")
    loop.node("gpu-node-2", gpus={RTX: 1})
    loop.vm("b-1", run_strategy="Always", gpu=RTX)
    assert loop.running_vmi("b-1")["status"]["nodeName"] == "gpu-node-2"
    loop.node("gpu-node-3", gpus={RTX: 1})
    loop.seen_by_worker("a-1")
    loop.seen_by_worker("b-1")
    loop.worker.wait_until("/capacity", lambda c: (c["nvidia-rtx-pro-6000-bse"]["total"],
                                                   c["nvidia-rtx-pro-6000-bse"]["free"]) == (3, 1))

    loop.intent("drain_node", {"node": "gpu-node-1", "reason": "kernel", "notice_seconds": 120}, by=OPS)
    loop.outputs.wait_for(lambda o: o.notifications("drain_will_stop_gpu_vm"), what="the first drain's notice")
    loop.agent.wait_passes(count=int(3 / loop.agent.interval))  # a few seconds apart
    loop.intent("drain_node", {"node": "gpu-node-2", "reason": "kernel", "notice_seconds": 120}, by=OPS)
    loop.outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) == 2, what="the second's")
    told = [(n["subject"]["name"], n["details"]["outcome"]) for n in loop.outputs.notifications("drain_will_stop_gpu_vm")]
    assert told == [("a-1", "returns_automatically"), ("b-1", "waits_for_gpu")]

    # The card a-1 was promised is taken: a VM started meanwhile lands on gpu-node-3.
    loop.vm("c-1", run_strategy="Always", gpu=RTX)
    assert loop.running_vmi("c-1")["status"]["nodeName"] == "gpu-node-3"
    loop.outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) == 3, what="the correction",
                          timeout=LOOP_DEADLINE)
    corrected = loop.outputs.notifications("drain_will_stop_gpu_vm")[2]
    assert corrected["subject"]["name"] == "a-1" and corrected["details"]["outcome"] == "waits_for_gpu"
    assert corrected["message"].startswith("Correction: ") and corrected["recipients"] == [ALICE]
