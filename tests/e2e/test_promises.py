"""The promise end to end, on KubeVirt's own virt-controller and virt-api: no GPU VM is stopped
without its owner being told first, and every owner is told the true fate of their VM.

Same loop as ``test_loop.py``: API server + KubeVirt + Kafka + watch bridge + worker + applier.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from harness.scenarios import RTX
from tests.e2e.test_gpu_sets import own_domain
from tests.e2e.test_loop import (  # noqa: F401 (fixtures)
    ALICE,
    KUBEVIRT,
    LOOP_DEADLINE,
    NAMESPACE,
    OPS,
    Loop,
    eventually,
    loop,
)

pytestmark = [pytest.mark.kube, pytest.mark.kafka]


def bare_vm(loop: Loop, name: str, *, run_strategy: str = "Always", gpus: list[str] | None = None,
            labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> None:
    """A GPU VM as kubectl would create it, with the GPU rules and only the metadata given."""
    template = {"domain": own_domain(gpus=gpus if gpus is not None else [RTX]), "evictionStrategy": "External",
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
