"""A GPU VM made with kubectl gets the GPU rules, end to end: API server → watch bridge →
worker → applier → API server, with KubeVirt's own virt-controller and virt-api.

Same loop as ``test_loop.py``. The VM is created as kubectl would (the device alone); the
worker patches it once, under the field manager ``vmstream``; the events the patch itself
causes (the VM's, its VMI's) plan nothing more; its owner is told once.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from handlers.contracts import ids
from handlers.rules.gpus import rule_gaps
from samples.cluster import RTX
from tests.e2e.test_loop import (  # noqa: F401 (fixtures)
    ALICE,
    NAMESPACE,
    Loop,
    loop,
)
from tests.support.kubevirt_schema import validate_vm
from tests.support.waiting import eventually

pytestmark = [pytest.mark.kube, pytest.mark.kafka]


def decided(loop: Loop, vm: dict[str, Any]) -> None:
    """The worker has decided the watch event showing this version of the VM."""
    refs = {ids.watch_event_id("VirtualMachine", NAMESPACE, vm["metadata"]["name"],
                               vm["metadata"]["resourceVersion"], type_) for type_ in ("MODIFIED", "RELISTED")}
    loop.outputs.wait_for(lambda o: any(a["input"]["ref"] in refs for a in o.seen["audit"]), timeout=90,
                          what=f"the worker to decide VM version {vm['metadata']['resourceVersion']}")


def test_a_kubectl_gpu_vm_is_brought_under_the_rules_once(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 1})
    loop.vm("hand-1", run_strategy="Always", gpu=RTX, eviction_strategy=None)
    loop.running_vmi("hand-1")

    def patched() -> dict[str, Any] | None:
        vm = loop.get("virtualmachines", "hand-1")
        return vm if vm and not rule_gaps(vm, eviction_strategy="External") else None

    vm = eventually(patched, "hand-1 patched under the GPU rules")
    validate_vm({k: v for k, v in vm.items() if k != "status"}, allow_unknown_fields=True)
    managers = {entry["manager"]: json.dumps(entry.get("fieldsV1"))
                for entry in vm["metadata"].get("managedFields") or ()}
    assert "f:evictionStrategy" in managers.get("vmstream", ""), managers

    loop.outputs.wait_for(lambda o: o.notifications("gpu_rules_applied"), what="the owner's notice")
    # Let the patch's own events (the VM, KubeVirt's status writes, the VMI) go through the
    # worker: none of them plans a second patch or a second notice.
    decided(loop, vm)

    def reconciled() -> dict[str, Any] | None:  # virt-controller's status for the patched VM is written
        latest = loop.get("virtualmachines", "hand-1") or {}
        desired = (latest.get("status") or {}).get("desiredGeneration")  # observedGeneration waits for a restart
        return latest if desired == latest["metadata"]["generation"] == vm["metadata"]["generation"] else None

    latest = eventually(reconciled, "virt-controller to observe the patched VM")
    assert latest is not None
    decided(loop, latest)
    assert [c["target"]["name"] for c in loop.outputs.commands("patch_vm")] == ["hand-1"]
    [told] = loop.outputs.notifications("gpu_rules_applied")
    # Whether it says "after the next restart" depends on whether the worker had seen the VMI
    # yet when it decided the VM: the watch bridge publishes the two kinds independently.
    assert told["recipients"] == [ALICE] and isinstance(told["details"]["running"], bool)
