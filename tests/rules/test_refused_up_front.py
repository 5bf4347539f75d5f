"""What KubeVirt will refuse is refused up front (handlers/rules/admission.py, docs/kubevirt.md).

A GPU class whose device is not in the observed KubeVirt CR's permittedHostDevices
(``validatePermittedHostDevices``, pkg/virt-controller/services/renderresources.go: checked
only when the list is set, not under the GPUsWithDRA gate) is rejected for set_gpu and
create_vm and shown as not permitted by the capacity view. A GPU on an instance-type VM
under memoryOvercommit > 100 is told to the owner and the audit, or refused.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.core.cluster import KubeVirtRecord
from handlers.rules.capacity import capacity_report
from samples.cluster import A100, RTX, kubevirt_cr, node, vm, vmi
from tests.support.harness import Harness, config
from tests.support.kubevirt_schema import validate_vm

ALICE = "alice@example.com"


def cr(*, permitted: dict[str, Any] | None | str = "rtx-only", gates: tuple[str, ...] = (),
       overcommit: int | None = None) -> dict[str, Any]:
    obj = kubevirt_cr()
    configuration = obj["spec"]["configuration"]
    if permitted == "rtx-only":
        configuration["permittedHostDevices"] = {"pciHostDevices": [
            {"pciVendorSelector": "10DE:2BB5", "resourceName": RTX, "externalResourceProvider": True}]}
    elif permitted is None:
        del configuration["permittedHostDevices"]
    else:
        configuration["permittedHostDevices"] = permitted
    configuration["developerConfiguration"]["featureGates"] = list(gates)
    if overcommit is not None:
        configuration["developerConfiguration"]["memoryOvercommit"] = overcommit
    return obj


def cluster(kubevirt: dict[str, Any] | None, **overrides: Any) -> Harness:
    h = Harness(config(**overrides)) if overrides else Harness()
    if kubevirt is not None:
        h.observe(kubevirt)
    h.observe_all(
        node("gpu-node-1", gpus={RTX: 2, A100: 2}),
        vm("spx-proj-a", "web-1", project="proj-a", owner=ALICE),
        vmi("spx-proj-a", "web-1", node_name="gpu-node-1"),
    )
    return h


def set_gpu(h: Harness, gpu_class: str | None, name: str = "web-1") -> Any:
    return h.intent("set_gpu", {"namespace": "spx-proj-a", "name": name, "gpu_class": gpu_class})


def create(h: Harness, gpu_class: str) -> Any:
    return h.intent("create_vm", {"namespace": "spx-proj-a", "name": "new-1", "cores": 4, "memory_gib": 8,
                                  "image": "quay.io/containerdisks/ubuntu:24.04", "gpu_class": gpu_class})


def outcome(result: Any) -> tuple[str, str | None]:
    audit = result.decision.audit
    return audit.outcome, audit.reason


# ------------------------------------------------------------ permittedHostDevices


def test_a_class_whose_device_kubevirt_does_not_permit_is_rejected_with_that_reason() -> None:
    h = cluster(cr())
    for result in (set_gpu(h, "nvidia-a100"), create(h, "nvidia-a100")):
        status, reason = outcome(result)
        assert status == "rejected" and result.decision.commands == []
        assert reason is not None and "permittedHostDevices" in reason and A100 in reason
        [told] = result.decision.notifications
        assert told.type == "intent_rejected" and "permittedHostDevices" in told.message


def test_a_permitted_class_is_accepted() -> None:
    h = cluster(cr())
    assert outcome(set_gpu(h, "nvidia-rtx-pro-6000-bse"))[0] == "accepted"
    assert outcome(create(h, "nvidia-rtx-pro-6000-bse"))[0] == "accepted"


def test_removing_a_gpu_is_never_refused_for_its_device() -> None:
    h = cluster(cr(permitted={}))
    h.observe(vm("spx-proj-a", "old-1", project="proj-a", owner=ALICE, gpu=A100))
    result = set_gpu(h, None, name="old-1")
    assert outcome(result)[0] == "accepted" and len(result.decision.commands) == 1


@pytest.mark.parametrize(("kubevirt", "accepted"), [
    (None, True),  # no CR observed: nothing known to refuse
    (cr(permitted=None), True),  # permittedHostDevices not set: KubeVirt checks nothing
    (cr(permitted={}), False),  # set, and empty: every GPU is refused
    (cr(permitted={"mediatedDevices": [{"mdevNameSelector": "A100", "resourceName": A100}]}), True),
    (cr(permitted={"usb": [{"resourceName": A100, "selectors": [{"vendor": "10de", "product": "20f1"}]}]}), True),
    (cr(gates=("GPUsWithDRA",)), True),  # GPUs through DRA are not checked against the list
    (cr(), False),
])
def test_when_kubevirt_checks_the_list(kubevirt: dict[str, Any] | None, accepted: bool) -> None:
    h = cluster(kubevirt)
    assert outcome(set_gpu(h, "nvidia-a100"))[0] == ("accepted" if accepted else "rejected")
    assert capacity_report(h.state, h.engine.catalog)["nvidia-a100"]["permitted"] is accepted


def test_the_capacity_view_shows_a_class_kubevirt_does_not_permit_as_unavailable() -> None:
    h = cluster(cr())
    report = capacity_report(h.state, h.engine.catalog)
    assert report["nvidia-a100"]["permitted"] is False and report["nvidia-a100"]["total"] == 2
    assert report["nvidia-rtx-pro-6000-bse"]["permitted"] is True
    h.observe(cr(permitted=None), "MODIFIED")  # the operator lifts the list
    assert capacity_report(h.state, h.engine.catalog)["nvidia-a100"]["permitted"] is True


@settings(max_examples=40, deadline=None)
@given(listed=st.sets(st.sampled_from([RTX, A100, "nvidia.com/other"])),
       kind=st.sampled_from(["pciHostDevices", "mediatedDevices", "usb"]))
def test_a_device_is_permitted_exactly_when_some_entry_names_it(listed: set[str], kind: str) -> None:
    record = KubeVirtRecord.from_object(cr(permitted={kind: [{"resourceName": d} for d in sorted(listed)]}))
    assert record.permits(RTX) is (RTX in listed) and record.permits(A100) is (A100 in listed)
    h = cluster(cr(permitted={kind: [{"resourceName": d} for d in sorted(listed)]}))
    assert (outcome(set_gpu(h, "nvidia-a100"))[0] == "accepted") is (A100 in listed)


# ------------------------------------------------------- instance types and overcommit


def instancetype_vm(name: str = "it-1", *, gpu: str | None = None) -> dict[str, Any]:
    obj = vm("spx-proj-a", name, project="proj-a", owner=ALICE, gpu=gpu)
    domain = obj["spec"]["template"]["spec"]["domain"]
    del domain["memory"], domain["cpu"]["sockets"], domain["cpu"]["cores"], domain["cpu"]["threads"]
    domain.pop("resources", None)
    obj["spec"]["instancetype"] = {"kind": "VirtualMachineClusterInstancetype", "name": "u1.large"}
    return obj


def test_a_gpu_on_an_instance_type_vm_under_overcommit_is_accepted_with_a_warning() -> None:
    h = cluster(cr(permitted=None, overcommit=200))
    h.observe(instancetype_vm())
    result = set_gpu(h, "nvidia-rtx-pro-6000-bse", name="it-1")
    status, reason = outcome(result)
    [command] = result.decision.commands
    assert status == "accepted" and command.type == "patch_vm"
    assert reason is not None and "not pinned" in reason and "200" in reason
    [warning] = [n for n in result.decision.notifications if n.type == "gpu_memory_not_pinned"]
    assert warning.recipients == [ALICE] and warning.details["memory_overcommit"] == 200
    assert "50%" in warning.message
    # The patched VM carries no memory request (KubeVirt would report a conflict) and stays valid.
    assert command.patch is not None
    after = jsonpatch.apply_patch(h.vm_object("spx-proj-a", "it-1"), command.patch)
    validate_vm(after)
    assert "resources" not in after["spec"]["template"]["spec"]["domain"]
    # Its watch event does not tell the owner a second time.
    after["metadata"]["resourceVersion"] = "2"
    assert h.observe(after, "MODIFIED").decision.notifications == []


def test_refuse_rejects_it() -> None:
    h = cluster(cr(permitted=None, overcommit=150),
                gpu_vm={"eviction_strategy": "External", "instancetype_overcommit": "refuse"})
    h.observe(instancetype_vm())
    result = set_gpu(h, "nvidia-rtx-pro-6000-bse", name="it-1")
    status, reason = outcome(result)
    assert status == "rejected" and result.decision.commands == []
    assert reason is not None and "memoryOvercommit is 150%" in reason and "instance type" in reason


@pytest.mark.parametrize("overcommit", [None, 100])
def test_without_overcommit_nothing_is_said(overcommit: int | None) -> None:
    h = cluster(cr(permitted=None, overcommit=overcommit),
                gpu_vm={"eviction_strategy": "External", "instancetype_overcommit": "refuse"})
    h.observe(instancetype_vm())
    result = set_gpu(h, "nvidia-rtx-pro-6000-bse", name="it-1")
    assert outcome(result) == ("accepted", None)
    assert not [n for n in result.decision.notifications if n.type == "gpu_memory_not_pinned"]


def test_a_vm_without_an_instance_type_has_its_memory_pinned_and_no_warning() -> None:
    h = cluster(cr(permitted=None, overcommit=200),
                gpu_vm={"eviction_strategy": "External", "instancetype_overcommit": "refuse"})
    result = set_gpu(h, "nvidia-rtx-pro-6000-bse")
    assert outcome(result) == ("accepted", None)
    [command] = result.decision.commands
    assert {"op": "add", "path": "/spec/template/spec/domain/resources",
            "value": {"requests": {"memory": "16Gi"}}} in (command.patch or [])


def test_an_observed_instance_type_gpu_vm_under_overcommit_is_told_once() -> None:
    h = cluster(cr(permitted=None, overcommit=200))
    obj = instancetype_vm("it-2", gpu=RTX)
    first = h.observe(obj)
    [warning] = [n for n in first.decision.notifications if n.type == "gpu_memory_not_pinned"]
    assert warning.recipients == [ALICE]
    assert first.decision.audit is not None and "not pinned" in (first.decision.audit.reason or "")
    again = copy.deepcopy(obj)
    again["metadata"]["resourceVersion"] = "2"
    assert not [n for n in h.observe(again, "MODIFIED").decision.notifications
                if n.type == "gpu_memory_not_pinned"]
    # The operator ends the overcommit: the episode is over; raised again, told again.
    h.observe(cr(permitted=None, overcommit=100), "MODIFIED")
    again["metadata"]["resourceVersion"] = "3"
    h.observe(again, "MODIFIED")
    h.observe(cr(permitted=None, overcommit=300), "MODIFIED")
    again["metadata"]["resourceVersion"] = "4"
    [second] = [n for n in h.observe(again, "MODIFIED").decision.notifications
                if n.type == "gpu_memory_not_pinned"]
    assert second.details["memory_overcommit"] == 300
    # Its GPU removed and given back: a new GPU on it, told again.
    bare = instancetype_vm("it-2")
    bare["metadata"]["resourceVersion"] = "5"
    h.observe(bare, "MODIFIED")
    again["metadata"]["resourceVersion"] = "6"
    assert [n for n in h.observe(again, "MODIFIED").decision.notifications if n.type == "gpu_memory_not_pinned"]
