"""One GPU set per VM, end to end on KubeVirt's own control plane: a GPU from an instance
type (virt-controller stores it in a ControllerRevision and ``ApplyToVMI`` puts it into the
VMI), a GPU passed as a host device, a VM of two GPUs — and vmstream's capacity, drain notices
and pending restarts agree with the VMI KubeVirt made (docs/kubevirt.md).

Same loop as ``test_loop.py``: API server + KubeVirt + Kafka + watch bridge + worker + applier.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from samples.cluster import A100, PROJECT_LABEL, RTX
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

INSTANCETYPES = ("instancetype.kubevirt.io", "v1beta1", "virtualmachineclusterinstancetypes")
RTX_CLASS, A100_CLASS = "nvidia-rtx-pro-6000-bse", "nvidia-a100"


def create_vm(loop: Loop, name: str, *, template: dict[str, Any], spec: dict[str, Any] | None = None) -> None:
    """A VM of alice's with this template spec (and these spec fields besides), as kubectl would
    create it; the GPU rules' eviction strategy and CPU model set already."""
    template.setdefault("evictionStrategy", "External")
    template.setdefault("volumes", [{"name": "containerdisk",
                                     "containerDisk": {"image": "quay.io/containerdisks/ubuntu:24.04"}}])
    domain = template.setdefault("domain", {})
    domain.setdefault("devices", {}).setdefault("disks", [{"name": "containerdisk", "disk": {"bus": "virtio"}}])
    body = {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {PROJECT_LABEL: "proj-a"},
                     "annotations": {"vmstream.io/owner": ALICE}},
        "spec": {"runStrategy": "Always", **(spec or {}), "template": {"spec": template}},
    }
    client.CustomObjectsApi(loop.api).create_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines", body)


def own_domain(*, gpus: list[str] | None = None, host_devices: list[str] | None = None) -> dict[str, Any]:
    """A domain with its own CPU and memory, pinned as the GPU rules pin it."""
    devices: dict[str, Any] = {}
    if gpus:
        devices["gpus"] = [{"name": f"gpu-{i}", "deviceName": d} for i, d in enumerate(gpus)]
    if host_devices:
        devices["hostDevices"] = [{"name": f"hostdev-{i}", "deviceName": d} for i, d in enumerate(host_devices)]
    return {"cpu": {"sockets": 1, "cores": 2, "threads": 1, "model": "host-passthrough"},
            "memory": {"guest": "4Gi"}, "resources": {"requests": {"memory": "4Gi"}}, "devices": devices}


@contextlib.contextmanager
def cluster_instancetype(loop: Loop, name: str, spec: dict[str, Any]) -> Iterator[None]:
    custom = client.CustomObjectsApi(loop.api)
    custom.create_cluster_custom_object(*INSTANCETYPES, {
        "apiVersion": f"{INSTANCETYPES[0]}/{INSTANCETYPES[1]}", "kind": "VirtualMachineClusterInstancetype",
        "metadata": {"name": name}, "spec": spec})
    try:
        yield
    finally:
        with contextlib.suppress(ApiException):
            custom.delete_cluster_custom_object(*INSTANCETYPES, name)


def capacity(loop: Loop, gpu_class: str) -> tuple[int, int, int]:
    figures = loop.worker.page("/capacity")[gpu_class]
    return figures["total"], figures["used"], figures["free"]


def drained_notice(loop: Loop, node: str) -> dict[str, dict[str, Any]]:
    loop.intent("drain_node", {"node": node, "reason": "firmware", "notice_seconds": 3}, by=OPS)
    loop.outputs.wait_for(lambda o: o.notifications("drain_will_stop_gpu_vm"), what="the drain notice")
    return {n["subject"]["name"]: n for n in loop.outputs.notifications("drain_will_stop_gpu_vm")}


def test_a_vm_whose_gpu_comes_from_its_instancetype_is_seen_with_it_end_to_end(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 2})
    loop.node("gpu-node-2", gpus={RTX: 1})
    with cluster_instancetype(loop, "u1-gpu", {"cpu": {"guest": 2}, "memory": {"guest": "4Gi"},
                                               "gpus": [{"name": "gpu-0", "deviceName": RTX}]}):
        create_vm(loop, "it-1", spec={"instancetype": {"kind": "VirtualMachineClusterInstancetype", "name": "u1-gpu"}},
                  template={"domain": {"cpu": {"model": "host-passthrough"}}})
        vmi = loop.running_vmi("it-1")
        # virt-controller's ApplyToVMI put the instance type's GPU into the VMI.
        assert vmi["spec"]["domain"]["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": RTX}]
        vm = loop.get("virtualmachines", "it-1") or {}
        revision = eventually(lambda: ((loop.get("virtualmachines", "it-1") or {}).get("status", {})
                                       .get("instancetypeRef", {}).get("controllerRevisionRef", {}).get("name")),
                              "virt-controller to store the instance type", timeout=LOOP_DEADLINE)
        assert revision and "gpus" not in vm["spec"]["template"]["spec"]["domain"].get("devices", {})
        loop.seen_by_worker("it-1")
        loop.outputs.wait_for(lambda o: any(a["input"]["key"] == f"ControllerRevision/{NAMESPACE}/{revision}"
                                            for a in o.seen["audit"]), what="the worker to observe the revision")
        loop.worker.wait_until("/capacity", lambda c: (c[RTX_CLASS]["total"], c[RTX_CLASS]["used"]) == (3, 1),
                               timeout=LOOP_DEADLINE)

        told = drained_notice(loop, "gpu-node-1")
        assert told["it-1"]["details"]["outcome"] == "returns_automatically"
        assert [g["device_name"] for g in told["it-1"]["details"]["gpus"]] == [RTX]
        assert "without a GPU" not in told["it-1"]["message"]
        assert loop.outputs.notifications("gpu_change_pending_restart") == []  # not "no GPU after its restart"
        assert loop.worker.page("/pending") == []

        back = loop.running_vmi("it-1", not_on="gpu-node-1", other_than=vmi["metadata"]["uid"])
        assert back["status"]["nodeName"] == "gpu-node-2"
        assert back["spec"]["domain"]["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": RTX}]
        loop.outputs.wait_for(lambda o: o.notifications("drain_completed"), what="drain_completed",
                              timeout=LOOP_DEADLINE)
        [done] = loop.outputs.notifications("drain_completed")
        assert done["details"]["observed"]["came_back"] == [f"vm/{NAMESPACE}/it-1"]
        assert loop.outputs.notifications("gpu_change_pending_restart") == []


@contextlib.contextmanager
def host_devices_gate(loop: Loop) -> Iterator[None]:
    """KubeVirt's HostDevices feature gate (alpha, pkg/virt-config/featuregate/active.go): without
    it virt-api refuses a VM with hostDevices (validateHostDevicesWithPassthroughEnabled)."""
    custom = client.CustomObjectsApi(loop.api)
    cr = custom.get_namespaced_custom_object("kubevirt.io", "v1", "kubevirt", "kubevirts", "kubevirt")
    before = (((cr.get("spec") or {}).get("configuration") or {}).get("developerConfiguration") or {}).get(
        "featureGates") or []

    def gates(value: list[str]) -> None:
        custom.patch_namespaced_custom_object("kubevirt.io", "v1", "kubevirt", "kubevirts", "kubevirt", {
            "spec": {"configuration": {"developerConfiguration": {"featureGates": value}}}})

    gates(sorted({*before, "HostDevices"}))
    try:
        yield
    finally:
        gates(list(before))


def test_a_gpu_passed_as_a_host_device_counts_for_capacity_and_drains_end_to_end(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={A100: 1})
    loop.node("gpu-node-2", gpus={A100: 1})
    with host_devices_gate(loop):
        def created() -> bool:
            try:
                create_vm(loop, "host-1", template={"domain": own_domain(host_devices=[A100])})
            except ApiException as exc:  # virt-api reads the feature gate a moment later
                if exc.status == 422 and "feature gate" in str(exc.body):
                    return False
                raise
            return True
        eventually(created, "virt-api to admit hostDevices", timeout=LOOP_DEADLINE)
        vmi = loop.running_vmi("host-1")
        assert vmi["spec"]["domain"]["devices"]["hostDevices"] == [{"name": "hostdev-0", "deviceName": A100}]
        loop.seen_by_worker("host-1")
        loop.worker.wait_until("/capacity", lambda c: (c[A100_CLASS]["total"], c[A100_CLASS]["used"]) == (2, 1),
                               timeout=LOOP_DEADLINE)
        told = drained_notice(loop, vmi["status"]["nodeName"])
        assert told["host-1"]["recipients"] == [ALICE]
        assert [g["device_name"] for g in told["host-1"]["details"]["gpus"]] == [A100]
        assert told["host-1"]["details"]["outcome"] == "returns_automatically"
        back = loop.running_vmi("host-1", not_on=vmi["status"]["nodeName"], other_than=vmi["metadata"]["uid"])
        assert back["spec"]["domain"]["devices"]["hostDevices"][0]["deviceName"] == A100
        assert loop.outputs.notifications("gpu_change_pending_restart") == []


def test_a_two_gpu_vm_is_not_promised_a_return_on_one_free_card_on_each_of_two_nodes_end_to_end(
        loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 2})
    create_vm(loop, "big-1", template={"domain": own_domain(gpus=[RTX, RTX])})
    first = loop.running_vmi("big-1")
    assert first["status"]["nodeName"] == "gpu-node-1"
    loop.node("gpu-node-2", gpus={RTX: 1})
    loop.node("gpu-node-3", gpus={RTX: 1})
    loop.seen_by_worker("big-1")
    loop.worker.wait_until("/capacity", lambda c: (c[RTX_CLASS]["total"], c[RTX_CLASS]["free"]) == (4, 2),
                           timeout=LOOP_DEADLINE)

    told = drained_notice(loop, "gpu-node-1")
    assert told["big-1"]["details"]["outcome"] == "waits_for_gpu"
    assert "all on one node" in told["big-1"]["message"]
    # And so it is: KubeVirt starts it again, and its launcher pod fits on no node.
    loop.outputs.wait_for(lambda o: o.notifications("drain_completed"), what="drain_completed",
                          timeout=LOOP_DEADLINE)
    [done] = loop.outputs.notifications("drain_completed")
    assert done["details"]["observed"]["waits_for_gpu"] == [f"vm/{NAMESPACE}/big-1"]
    vmi = loop.get("virtualmachineinstances", "big-1") or {}
    assert vmi.get("status", {}).get("phase") != "Running"
