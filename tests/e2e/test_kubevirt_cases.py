"""KubeVirt's cases end to end: what the owner is told must be what the lifecycle simulator
(following vm.go, docs/kubevirt.md) then does in the API server.

Same loop as ``test_loop.py``: API server + Kafka + watch bridge + worker + applier, with
:class:`~tests.support.kubevirt_sim.KubeVirtSimulator` playing virt-controller.
"""

from __future__ import annotations

from kubernetes import client

from harness.scenarios import RTX
from tests.e2e.test_loop import (  # noqa: F401 (fixtures)
    ALICE,
    KUBEVIRT,
    NAMESPACE,
    OPS,
    Loop,
    control_plane,
    eventually,
    loop,
)

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
    loop.simulator.wait_passes()
    assert loop.get("virtualmachineinstances", "rerun-1") is None


def test_an_eviction_is_told_to_that_vms_owner_and_cordons_nothing(loop: Loop) -> None:
    """evictionStrategy External: KubeVirt's webhook only sets status.evacuationNodeName."""
    loop.node("gpu-node-1", gpus={RTX: 2})
    loop.vm("evicted-1", run_strategy="Always", gpu=RTX)
    loop.vm("stays-1", run_strategy="Always", gpu=RTX)
    vmi = loop.running_vmi("evicted-1")
    loop.running_vmi("stays-1")
    loop.seen_by_worker("evicted-1")
    loop.seen_by_worker("stays-1")

    # What PodEvictionAdmitter.markVMI does (VMIs have no status subresource).
    client.CustomObjectsApi(loop.api).patch_namespaced_custom_object(
        *KUBEVIRT, NAMESPACE, "virtualmachineinstances", "evicted-1",
        [{"op": "add", "path": "/status/evacuationNodeName", "value": vmi["status"]["nodeName"]}],
        _content_type="application/json-patch+json")
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
