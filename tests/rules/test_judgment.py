"""The applier's judgment (handlers/rules/judgment.py): what each command reads, and what it comes to
on what was read — an action, done already, refused, failed, or tried again later. One test per
rule; the objects are given, nothing is sent."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from handlers.contracts.messages import COMMAND_TYPES, Command, GPUMutation, ObjectRef
from handlers.core.cluster import OWNER_ANNOTATION
from handlers.rules import judgment, policy
from handlers.rules.gpus import desired_vm, plan_patch
from handlers.rules.judgment import (
    MAX_CONFLICTS,
    NAMESPACE,
    NODE,
    RESTART_ANNOTATION,
    VM,
    VMI,
    CancelMark,
    CreateVM,
    DeleteVMI,
    Done,
    Failure,
    Observed,
    PatchNode,
    PatchVM,
    PutSubresource,
    Refusal,
)
from handlers.rules.results import RetryLater
from samples.cluster import A100, PROJECT_LABEL, vm

ISSUED = datetime(2026, 12, 1, 10, 0, 0, 500000, tzinfo=UTC)
OWNER = "alice@example.com"
PROJECT_NS = {PROJECT_LABEL: "proj-a"}
ADD_A100 = GPUMutation(device_name=A100, eviction_strategy="External")
VM_REF = ObjectRef(kind="VirtualMachine", namespace="spx-proj-a", name="vm-1")
VMI_REF = ObjectRef(kind="VirtualMachineInstance", namespace="spx-proj-a", name="vm-1")
NODE_REF = ObjectRef(kind="Node", name="gpu-node-1")


def command(type_: str, target: ObjectRef, **fields: Any) -> Command:
    return Command(command_id="cmd-1", type=type_, target=target, cause="it-1", issued_at=ISSUED,
                   **fields)


def plain_vm(rv: int = 1) -> dict[str, Any]:
    return vm("spx-proj-a", "vm-1", project="proj-a", owner=OWNER, rv=rv)


def judge(cmd: Command, **seen: Any) -> judgment.Judgment:
    return judgment.judge(cmd, Observed(**{"namespace": PROJECT_NS, **seen}), project_label=PROJECT_LABEL)


def node(*, unschedulable: bool = False, labels: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "gpu-node-1", "resourceVersion": "7", "labels": labels or {},
                         "annotations": annotations or {}},
            "spec": {"unschedulable": True} if unschedulable else {}}


def vmi(uid: str, created: datetime = ISSUED - timedelta(hours=1), deleting: bool = False,
        mark: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"uid": uid, "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-01T10:00:01Z"
    status: dict[str, Any] = {"phase": "Running"}
    if mark:
        status["evacuationNodeName"] = mark
    return {"metadata": metadata, "status": status}


# ------------------------------------------------------------------------------ reads


@pytest.mark.parametrize(("type_", "target", "kinds"), [
    ("patch_vm", VM_REF, {NAMESPACE, VM}),
    ("create_vm", VM_REF, {NAMESPACE, VM}),
    ("restart_vm", VM_REF, {NAMESPACE, VM, VMI}),
    ("start_vm", VM_REF, {NAMESPACE}),
    ("stop_vm", VM_REF, {NAMESPACE}),
    ("delete_vmi", VMI_REF, {NAMESPACE}),
    ("cancel_evacuation", VMI_REF, {NAMESPACE, VMI}),
    ("cordon_node", NODE_REF, {NODE}),
    ("uncordon_node", NODE_REF, {NODE}),
])
def test_each_command_type_reads_what_it_is_judged_on(type_: str, target: ObjectRef, kinds: set[str]) -> None:
    assert judgment.reads(command(type_, target)) == kinds


def test_every_command_type_says_what_it_reads() -> None:
    assert set(judgment.READS) == set(COMMAND_TYPES)


def test_a_command_its_target_refuses_reads_nothing() -> None:
    assert judgment.reads(command("cordon_node", VM_REF)) == frozenset()
    assert judgment.reads(command("patch_vm", VM_REF.model_copy(update={"namespace": "kube-system"}))) == frozenset()


# ------------------------------------------------------------------------------ refusals


def test_a_target_of_the_wrong_kind_is_refused() -> None:
    assert judge(command("delete_vmi", VM_REF)) == Refusal("delete_vmi acts on a VirtualMachineInstance, "
                                                            "not a VirtualMachine")


@pytest.mark.parametrize(("labels", "why"), [(None, "does not exist"), ({}, "not a project namespace")])
def test_a_command_outside_a_project_namespace_is_refused(labels: dict[str, str] | None, why: str) -> None:
    judged = judge(command("start_vm", VM_REF), namespace=labels)
    assert isinstance(judged, Refusal) and why in judged.reason


def test_a_manifest_of_another_project_is_refused() -> None:
    manifest = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "metadata": {"namespace": "spx-proj-a", "name": "vm-1",
                             "labels": {"app.kubernetes.io/managed-by": "vmstream", PROJECT_LABEL: "proj-b"},
                             "annotations": {OWNER_ANNOTATION: OWNER}}}
    judged = judge(command("create_vm", VM_REF, manifest=manifest))
    assert isinstance(judged, Refusal) and "proj-a" in judged.reason


def test_a_patch_outside_the_gpu_fields_is_refused_and_tells_the_owner() -> None:
    live = plain_vm()
    judged = judge(command("patch_vm", VM_REF, patch=[{"op": "replace", "path": "/spec/runStrategy", "value": "Halted"}],
                           base_resource_version="1"), vm=live)
    assert isinstance(judged, Refusal) and "outside the GPU fields" in judged.reason and judged.owner == OWNER


def test_a_control_plane_node_is_never_cordoned() -> None:
    judged = judge(command("cordon_node", NODE_REF), node=node(labels={"node-role.kubernetes.io/control-plane": ""}))
    assert isinstance(judged, Refusal) and "control-plane" in judged.reason


def test_a_node_vmstream_did_not_cordon_is_not_uncordoned() -> None:
    judged = judge(command("uncordon_node", NODE_REF), node=node(unschedulable=True))
    assert isinstance(judged, Refusal) and policy.CORDONED_ANNOTATION in judged.reason


# ------------------------------------------------------------------------------ patch_vm


def test_a_patch_on_the_vm_it_was_planned_against_is_sent_as_planned() -> None:
    patch = plan_patch(plain_vm(), desired_vm(plain_vm(), ADD_A100))
    judged = judge(command("patch_vm", VM_REF, patch=patch, base_resource_version="1", mutation=ADD_A100),
                   vm=plain_vm())
    assert judged == PatchVM("spx-proj-a", "vm-1", patch, "1", "applied")


def test_an_empty_patch_on_the_vm_it_was_planned_against_is_a_noop() -> None:
    assert judge(command("patch_vm", VM_REF, patch=[], base_resource_version="1"), vm=plain_vm()) == Done("noop", "1")


def test_a_vm_that_moved_on_is_planned_again_from_what_it_is() -> None:
    moved = plain_vm(rv=2)
    stale = [{"op": "add", "path": "/spec/x", "value": 1}]  # not what the VM needs now: never sent
    judged = judge(command("patch_vm", VM_REF, patch=stale, base_resource_version="1", mutation=ADD_A100), vm=moved)
    assert judged == PatchVM("spx-proj-a", "vm-1", plan_patch(moved, desired_vm(moved, ADD_A100)), "2",
                             "conflict_retried")


def test_a_vm_that_moved_on_to_what_the_command_wants_is_a_noop() -> None:
    done = desired_vm(plain_vm(rv=2), ADD_A100)
    judged = judge(command("patch_vm", VM_REF, patch=[], base_resource_version="1", mutation=ADD_A100), vm=done)
    assert judged == Done("noop", "2")


def test_a_vm_that_moved_on_fails_a_command_with_nothing_to_plan_again() -> None:
    judged = judge(command("patch_vm", VM_REF, patch=[], base_resource_version="1"), vm=plain_vm(rv=2))
    assert isinstance(judged, Failure) and "no mutation" in judged.error


def test_a_patch_of_a_vm_that_is_gone_fails() -> None:
    assert judge(command("patch_vm", VM_REF, patch=[], base_resource_version="1"), vm=None) == Failure(
        "VirtualMachine spx-proj-a/vm-1 does not exist")


def test_a_conflict_is_judged_again_at_once_until_the_vm_keeps_changing() -> None:
    patch = command("patch_vm", VM_REF, patch=[], base_resource_version="1")
    for attempt in range(MAX_CONFLICTS - 1):
        assert judgment.conflicted(patch, attempt) == RetryLater(
            0.0, "VirtualMachine spx-proj-a/vm-1 changed under the command", cause="conflict")
    assert judgment.conflicted(patch, MAX_CONFLICTS - 1) == Failure(
        f"VirtualMachine spx-proj-a/vm-1 kept changing: gave up after {MAX_CONFLICTS} conflicts")


# ------------------------------------------------------------------------------ create_vm


def manifest(owner: str = OWNER) -> dict[str, Any]:
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"namespace": "spx-proj-a", "name": "vm-1",
                         "labels": {"app.kubernetes.io/managed-by": "vmstream", PROJECT_LABEL: "proj-a"},
                         "annotations": {OWNER_ANNOTATION: owner}},
            "spec": {}}


def test_a_vm_not_there_is_created() -> None:
    assert judge(command("create_vm", VM_REF, manifest=manifest()), vm=None) == CreateVM("spx-proj-a", manifest())


def test_a_vm_created_before_for_the_same_owner_is_a_noop() -> None:
    assert judge(command("create_vm", VM_REF, manifest=manifest()), vm=plain_vm()) == Done("noop", "1")


def test_a_vm_of_that_name_made_for_somebody_else_fails_the_create() -> None:
    judged = judge(command("create_vm", VM_REF, manifest=manifest("bob@example.com")), vm=plain_vm())
    assert judged == Failure("VirtualMachine spx-proj-a/vm-1 already exists and was not created for bob@example.com")


# ------------------------------------------------------------------------------ restart_vm

RESTART = command("restart_vm", VM_REF)
MINE = {"command": RESTART.command_id, "vmi": "uid-old"}


def restartable(record: dict[str, str] | None = None, requests: list[dict[str, str]] | None = None) -> dict[str, Any]:
    annotations = {RESTART_ANNOTATION: json.dumps(record)} if record else {}
    return {"metadata": {"name": "vm-1", "namespace": "spx-proj-a", "annotations": annotations},
            "status": {"stateChangeRequests": requests} if requests else {}}


def test_a_first_restart_is_recorded_with_its_vmi_and_sent() -> None:
    judged = judge(RESTART, vm=restartable(), vmi=vmi("uid-old"))
    assert isinstance(judged, PutSubresource) and judged.action == "restart"
    assert json.loads(judged.record or "") == MINE


@pytest.mark.parametrize(("what", "the_vm", "the_vmi"), [
    ("the old VMI is gone, the new one not created yet", restartable(MINE), None),
    ("a new VMI runs", restartable(MINE), vmi("uid-new")),
    ("the old VMI is being deleted", restartable(MINE), vmi("uid-old", deleting=True)),
    ("virt-api asked to stop the old VMI",
     restartable(MINE, [{"action": "Stop", "uid": "uid-old"}, {"action": "Start"}]), vmi("uid-old")),
])
def test_a_restart_recorded_and_under_way_is_not_sent_again(
    what: str, the_vm: dict[str, Any], the_vmi: dict[str, Any] | None
) -> None:
    assert judge(RESTART, vm=the_vm, vmi=the_vmi) == Done("applied"), what


def test_a_restart_recorded_but_never_sent_is_sent_under_the_record_it_has() -> None:
    """The crash came between the record and the call: the old VMI runs, nothing asked of it."""
    assert judge(RESTART, vm=restartable(MINE), vmi=vmi("uid-old")) == PutSubresource("spx-proj-a", "vm-1", "restart")


def test_a_vmi_created_in_the_same_second_after_the_command_is_no_proof_without_a_record() -> None:
    """creationTimestamp has 1 s resolution: 10:00:00 reads as before a command of 10:00:00.5.
    Without this command's record the VMI is not taken for its restart: recorded and sent."""
    judged = judge(RESTART, vm=restartable({"command": "cmd-earlier", "vmi": "uid-x"}), vmi=vmi("uid-new", ISSUED))
    assert isinstance(judged, PutSubresource) and judged.record is not None


def test_without_a_record_a_vmi_created_after_the_command_is_its_restart() -> None:
    assert judge(RESTART, vm=restartable(), vmi=vmi("uid-new", ISSUED + timedelta(seconds=5))) == Done("noop")


def test_a_restart_without_a_vmi_records_nothing() -> None:
    assert judge(RESTART, vm=restartable(), vmi=None) == PutSubresource("spx-proj-a", "vm-1", "restart", None)


def test_a_restart_of_a_vm_that_is_gone_fails() -> None:
    assert judge(RESTART, vm=None) == Failure("VirtualMachine spx-proj-a/vm-1 does not exist")


# ------------------------------------------------------------------------ the other types


def test_start_stop_and_delete_go_as_they_are() -> None:
    assert judge(command("start_vm", VM_REF)) == PutSubresource("spx-proj-a", "vm-1", "start")
    assert judge(command("stop_vm", VM_REF)) == PutSubresource("spx-proj-a", "vm-1", "stop")
    uid = VMI_REF.model_copy(update={"uid": "uid-1"})
    assert judge(command("delete_vmi", uid)) == DeleteVMI("spx-proj-a", "vm-1", "uid-1")


def test_a_mark_is_cancelled_only_while_the_vmi_carries_it_from_that_node() -> None:
    cancel = command("cancel_evacuation", VMI_REF.model_copy(update={"uid": "uid-1"}), evacuation_node="gpu-node-1")
    assert judge(cancel, vmi=vmi("uid-1", mark="gpu-node-1")) == CancelMark("spx-proj-a", "vm-1", "gpu-node-1")
    assert judge(cancel, vmi=None) == Done("noop")
    assert judge(cancel, vmi=vmi("uid-1", mark="gpu-node-2")) == Done("noop")
    assert judge(cancel, vmi=vmi("uid-2", mark="gpu-node-1")) == Done("noop")  # another VMI of that name


def test_a_cancel_that_names_no_node_fails() -> None:
    judged = judge(command("cancel_evacuation", VMI_REF), vmi=vmi("uid-1", mark="gpu-node-1"))
    assert isinstance(judged, Failure) and "evacuation_node" in judged.error


def test_a_node_is_cordoned_with_its_command_recorded_and_uncordoned_with_the_record_removed() -> None:
    assert judge(command("cordon_node", NODE_REF), node=node()) == PatchNode("gpu-node-1", {
        "metadata": {"annotations": {policy.CORDONED_ANNOTATION: "cmd-1"}}, "spec": {"unschedulable": True}})
    ours = node(unschedulable=True, annotations={policy.CORDONED_ANNOTATION: "cmd-0"})
    assert judge(command("uncordon_node", NODE_REF), node=ours) == PatchNode("gpu-node-1", {
        "metadata": {"annotations": {policy.CORDONED_ANNOTATION: None}}, "spec": {"unschedulable": None}})


def test_a_node_already_so_is_a_noop_and_one_that_is_gone_fails() -> None:
    assert judge(command("cordon_node", NODE_REF), node=node(unschedulable=True)) == Done("noop", "7")
    assert judge(command("uncordon_node", NODE_REF), node=node()) == Done("noop", "7")
    assert judge(command("cordon_node", NODE_REF), node=None) == Failure("node gpu-node-1 does not exist")
