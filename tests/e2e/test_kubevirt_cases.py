"""KubeVirt's cases end to end: what the owner is told must be what KubeVirt's own
virt-controller and virt-api then do (docs/kubevirt.md).

Same loop as ``test_loop.py``: API server + KubeVirt + Kafka + watch bridge + worker + applier.
"""

from __future__ import annotations

from kubernetes import client

from samples.cluster import RTX
from tests.e2e.test_loop import (  # noqa: F401 (fixtures)
    ALICE,
    KUBEVIRT,
    NAMESPACE,
    OPS,
    Loop,
    loop,
)
from tests.support.waiting import eventually

import pytest

pytestmark = [pytest.mark.kube, pytest.mark.kafka]


def test_a_drained_once_vm_comes_back_as_its_owner_was_told(loop: Loop) -> None:
    """vm.go: a Once VM whose VMI is deleted gets a new one; RerunOnFailure's stays off."""
    loop.node("gpu-node-1", gpus={RTX: 2})
    loop.vm("once-1", run_strategy="Once", gpu=RTX)
    loop.vm("rerun-1", run_strategy="RerunOnFailure", gpu=RTX)
    first = loop.running_vmi("once-1")
    loop.running_vmi("rerun-1")
    loop.node("gpu-node-2", gpus={RTX: 1})
    loop.seen_by_worker("once-1")
    loop.seen_by_worker("rerun-1")
    loop.outputs.wait_for(lambda o: any(a["input"]["key"] == "Node/gpu-node-2" for a in o.seen["audit"]),
                          timeout=90, what="the worker to observe gpu-node-2")

    loop.intent("drain_node", {"node": "gpu-node-1", "reason": "BIOS update", "notice_seconds": 3}, by=OPS)
    loop.outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) == 2, what="announcements")
    fates = {n["subject"]["name"]: n["details"]["outcome"] for n in loop.outputs.notifications("drain_will_stop_gpu_vm")}
    assert fates == {"once-1": "returns_automatically", "rerun-1": "needs_manual_start"}

    back = loop.running_vmi("once-1", not_on="gpu-node-1", other_than=first["metadata"]["uid"])
    assert back["status"]["nodeName"] == "gpu-node-2"
    eventually(lambda: loop.get("virtualmachineinstances", "rerun-1") is None, "rerun-1's VMI gone")
    loop.outputs.wait_for(lambda o: o.notifications("drain_completed"), what="drain_completed")
    [done] = loop.outputs.notifications("drain_completed")
    assert done["details"]["observed"] == {"came_back": [f"vm/{NAMESPACE}/once-1"], "waits_for_gpu": [],
                                           "off": [f"vm/{NAMESPACE}/rerun-1"]}
    loop.stopped_for_good("rerun-1")


def test_an_eviction_is_told_to_that_vms_owner_and_cordons_nothing(loop: Loop) -> None:
    """evictionStrategy External: virt-api's pod-eviction webhook refuses the eviction of the
    launcher pod and only marks the VMI (status.evacuationNodeName, PodEvictionAdmitter)."""
    loop.node("gpu-node-1", gpus={RTX: 2})
    loop.vm("evicted-1", run_strategy="Always", gpu=RTX)
    loop.vm("stays-1", run_strategy="Always", gpu=RTX)
    vmi = loop.running_vmi("evicted-1")
    loop.running_vmi("stays-1")
    loop.seen_by_worker("evicted-1")
    loop.seen_by_worker("stays-1")

    refusal = loop.evict("evicted-1")
    assert refusal.status == 429 and "evacuation" in str(refusal.body), refusal.body  # the pod stays
    marked = eventually(lambda: (loop.get("virtualmachineinstances", "evicted-1") or {}).get("status", {})
                        .get("evacuationNodeName"), "virt-api to mark the VMI")
    assert marked == vmi["status"]["nodeName"]
    loop.outputs.wait_for(lambda o: o.notifications("drain_will_stop_gpu_vm"), what="the eviction notice")
    [told] = loop.outputs.notifications("drain_will_stop_gpu_vm")
    assert told["subject"]["name"] == "evicted-1" and told["recipients"] == [ALICE]
    assert told["details"]["scope"] == "evictions" and told["deadline"]
    # The notice and its audit record sit on different topics: the reader may see one first.
    loop.outputs.wait_for(lambda o: any(told["notification_id"] in a["notifications"] for a in o.seen["audit"]),
                          what="the notice's audit record")
    [audit] = [a for a in loop.outputs.seen["audit"] if told["notification_id"] in a["notifications"]]
    assert audit["commands"] == []
    assert loop.outputs.commands("cordon_node") == []
    assert not loop.cordoned("gpu-node-1")


def test_kubectl_drain_through_the_eviction_api_tells_every_owner_then_stops_them(loop: Loop) -> None:
    """What ``kubectl drain`` does to a GPU node: it cordons the node, then asks the Eviction API
    to evict each pod on it. virt-api refuses each launcher pod's eviction (429) and marks its
    VMI (evictionStrategy External); vmstream tells each owner, stops the VMs at the deadline,
    and KubeVirt brings back the Always VM on the node with a free card."""
    loop.node("gpu-node-1", gpus={RTX: 2})
    loop.vm("train-1", run_strategy="Always", gpu=RTX)
    loop.vm("batch-1", run_strategy="RerunOnFailure", gpu=RTX)
    first = loop.running_vmi("train-1")
    loop.running_vmi("batch-1")
    loop.node("gpu-node-2", gpus={RTX: 1})
    loop.seen_by_worker("train-1")
    loop.seen_by_worker("batch-1")
    loop.worker.wait_until("/capacity", lambda c: (c["nvidia-rtx-pro-6000-bse"]["total"],
                                                   c["nvidia-rtx-pro-6000-bse"]["free"]) == (3, 1))

    client.CoreV1Api(loop.api).patch_node("gpu-node-1", {"spec": {"unschedulable": True}})  # kubectl drain: cordon
    for name in ("train-1", "batch-1"):  # kubectl drain: evict every pod
        refusal = loop.evict(name)
        assert refusal.status == 429 and "Eviction triggered evacuation" in str(refusal.body), refusal.body
    loop.outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) == 2, what="both owners told")
    told = {n["subject"]["name"]: n for n in loop.outputs.notifications("drain_will_stop_gpu_vm")}
    assert {name: n["details"]["outcome"] for name, n in told.items()} == {
        "train-1": "returns_automatically", "batch-1": "needs_manual_start"}
    assert all(n["recipients"] == [ALICE] and n["deadline"] and n["details"]["scope"] == "evictions"
               for n in told.values())

    back = loop.running_vmi("train-1", not_on="gpu-node-1", other_than=first["metadata"]["uid"])
    assert back["status"]["nodeName"] == "gpu-node-2"
    loop.stopped_for_good("batch-1")  # RerunOnFailure: its VMI deleted, not failed
    assert loop.outputs.commands("cordon_node") == []  # kubectl cordoned it
