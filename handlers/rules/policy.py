"""The applier's own policy: what it will write, whatever a command says (docs/security.md).

    command + the objects it touches, as observed → a refusal (why), or None (go ahead)

A command is sealed by the worker, but the applier holds the cluster-wide write permission,
so it checks every command against what vmstream is for, as the API server's admission
policy (deploy/base/admission-apply.yaml) checks every write again:

* VMs and VMIs only in **project namespaces** — a namespace that exists, carries the
  project label and is not a system namespace;
* a VM changes only at the **GPU paths** (:data:`VM_PATHS`) and the annotation recording them,
  judged on the VM before and after the patch, whatever the patch's shape;
* ``create_vm`` only a ``kubevirt.io/v1`` VirtualMachine named as its target, labelled as
  vmstream labels what it creates (managed by vmstream, the namespace's project) and
  recording its owner;
* nodes are cordoned only when they are not control-plane nodes, and uncordoned only when
  vmstream cordoned them (:data:`CORDONED_ANNOTATION`, set with the cordon).

Pure: the applier reads the objects and passes them in.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jsonpatch

from handlers.contracts import ids
from handlers.contracts.messages import AuditInput, AuditRecord, Command, CommandResult, ObjectRef
from handlers.core.cluster import OWNER_ANNOTATION
from handlers.core.decisions import subject_key
from handlers.rules.gpus import (
    ANNOTATIONS,
    CONTAINERS,
    CPU_MODEL,
    EVICTION_STRATEGY,
    GPUS,
    MEMORY_REQUEST,
    PRE_GPU_ANNOTATION,
    Path,
    plan_patch,
)
from handlers.rules.results import COMMANDS_TOPIC, ResultDecision
from handlers.rules.vms import MANAGED_BY_LABEL

CORDONED_ANNOTATION = "vmstream.io/cordoned-by"  # the command that cordoned the node
VM_PATHS: tuple[Path, ...] = (GPUS, CPU_MODEL, MEMORY_REQUEST, EVICTION_STRATEGY)
VM_ANNOTATIONS = (PRE_GPU_ANNOTATION,)  # what a GPU change records; the owner is set at creation only
SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease", "kubevirt", "cdi", "vmstream"})
SYSTEM_PREFIXES = ("kube-", "openshift-")
CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")

KINDS: dict[str, str] = {
    "patch_vm": "VirtualMachine",
    "create_vm": "VirtualMachine",
    "restart_vm": "VirtualMachine",
    "start_vm": "VirtualMachine",
    "stop_vm": "VirtualMachine",
    "delete_vmi": "VirtualMachineInstance",
    "cordon_node": "Node",
    "uncordon_node": "Node",
    "cancel_evacuation": "VirtualMachineInstance",
}


class PatchError(ValueError):
    """A JSON Patch that cannot be applied (or uses an operation the applier never sends)."""


def is_system_namespace(name: str) -> bool:
    return name in SYSTEM_NAMESPACES or name.startswith(SYSTEM_PREFIXES)


def target_refusal(command: Command) -> str | None:
    """The command's type and target agree: a VM command names a VM in a namespace, etc."""
    kind = KINDS.get(command.type)
    if kind != command.target.kind:
        return f"{command.type} acts on a {kind}, not a {command.target.kind}"
    if kind == "Node" and command.target.namespace:
        return "a Node has no namespace"
    if kind != "Node" and not command.target.namespace:
        return f"{command.type} needs a namespaced target"
    return None


def namespace_refusal(namespace: str, labels: Mapping[str, str] | None, *, project_label: str) -> str | None:
    """Only project namespaces: ``labels`` is None when the namespace does not exist."""
    if is_system_namespace(namespace):
        return f"namespace {namespace} is a system namespace"
    if labels is None:
        return f"namespace {namespace} does not exist"
    if not labels.get(project_label):
        return f"namespace {namespace} is not a project namespace (no {project_label} label)"
    return None


def create_refusal(command: Command, namespace_labels: Mapping[str, str], *, project_label: str) -> str | None:
    """A manifest as vmstream writes them: its target, its labels, its owner."""
    manifest = command.manifest or {}
    metadata = manifest.get("metadata") or {}
    if (manifest.get("apiVersion"), manifest.get("kind")) != ("kubevirt.io/v1", "VirtualMachine"):
        return "create_vm creates kubevirt.io/v1 VirtualMachines only"
    if (metadata.get("namespace"), metadata.get("name")) != (command.target.namespace, command.target.name):
        return "the manifest's namespace and name are not the command's target"
    labels = metadata.get("labels") or {}
    if labels.get(MANAGED_BY_LABEL) != "vmstream":
        return f"the manifest lacks the label {MANAGED_BY_LABEL}=vmstream"
    project = namespace_labels.get(project_label)
    if labels.get(project_label) != project:
        return f"the manifest's {project_label} label is not the namespace's ({project})"
    template_labels = ((manifest.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {}
    if project_label in template_labels and template_labels[project_label] != project:
        return f"the template's {project_label} label is not the namespace's ({project})"
    if not (metadata.get("annotations") or {}).get(OWNER_ANNOTATION):
        return f"the manifest does not record its owner ({OWNER_ANNOTATION})"
    for field in ("ownerReferences", "finalizers", "generateName"):
        if field in metadata:
            return f"the manifest sets metadata.{field}"
    return None


def node_refusal(command: Command, *, labels: Mapping[str, str], annotations: Mapping[str, str],
                 unschedulable: bool) -> str | None:
    """Only nodes vmstream drains: never a control-plane node; uncordon only its own cordon."""
    for label in CONTROL_PLANE_LABELS:
        if label in labels:
            return f"node {command.target.name} is a control-plane node ({label})"
    if command.type == "uncordon_node" and unschedulable and CORDONED_ANNOTATION not in annotations:
        return f"node {command.target.name} was not cordoned by vmstream (no {CORDONED_ANNOTATION} annotation)"
    return None


# ------------------------------------------------------------------------ VM changes


def _get(obj: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _delete(doc: dict[str, Any], path: Path) -> None:
    """Delete ``path`` from ``doc`` where it exists."""
    parent = _get(doc, path[:-1])
    if isinstance(parent, dict):
        parent.pop(path[-1], None)


def _outside_gpu_paths(vm: dict[str, Any]) -> dict[str, Any]:
    """``vm`` without what vmstream may change: the GPU paths, their annotation, and the maps
    it creates to hold them when they are left empty. ``vm`` itself is left as it is."""
    rest = copy.deepcopy(vm)
    rest.pop("status", None)
    for key in ("resourceVersion", "generation", "managedFields"):  # the API server's own
        _delete(rest, ("metadata", key))
    for path in VM_PATHS:
        _delete(rest, path)
    for key in VM_ANNOTATIONS:
        _delete(rest, (*ANNOTATIONS, key))
    for path in reversed(CONTAINERS):
        if _get(rest, path) == {}:
            _delete(rest, path)
    return rest


def vm_change_refusal(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """A VM may change only at the GPU paths and the annotation that records them."""
    outside = plan_patch(_outside_gpu_paths(before), _outside_gpu_paths(after))
    if outside:
        paths = ", ".join(sorted({op["path"] for op in outside})[:5])
        return f"the patch changes the VM outside the GPU fields: {paths}"
    return None


def apply_patch(doc: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add``, ``remove``, ``replace`` and ``test`` on a copy of ``doc``, which is
    left as it is. vmstream sends nothing else, so ``move`` and ``copy`` are refused, as is
    a patch of the whole document: what is judged is a change to a VM's fields. An operation
    that fails is named by its path alone, never by the document it was applied to."""
    result = copy.deepcopy(doc)
    for op in patch:
        kind, pointer = op.get("op"), op.get("path")
        if kind not in ("add", "remove", "replace", "test"):
            raise PatchError(f"unsupported patch operation {kind!r}")
        if not isinstance(pointer, str) or not pointer.startswith("/"):
            raise PatchError(f"not a JSON pointer: {pointer!r}")
        try:
            jsonpatch.apply_patch(result, [op], in_place=True)
        except jsonpatch.JsonPatchTestFailed as exc:
            raise PatchError(f"{pointer}: test failed") from exc
        except jsonpatch.InvalidJsonPatch as exc:
            raise PatchError(f"{pointer}: a malformed {kind} operation") from exc
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:  # a path that is not there
            raise PatchError(f"{pointer}: no such path") from exc
    return result


def patch_refusal(live: dict[str, Any], patch: list[dict[str, Any]]) -> str | None:
    """Would ``patch`` change ``live`` only where vmstream may?"""
    try:
        after = apply_patch(live, patch)
    except PatchError as exc:
        return f"the patch does not apply to the live VM: {exc}"
    return vm_change_refusal(live, after)


# ------------------------------------------------------------------------ refusals


def unauthenticated(command: Command, *, reason: str, now: datetime, topic: str = COMMANDS_TOPIC) -> ResultDecision:
    """What a command without a valid MAC comes to: refused, audited, nobody told.

    Its result is marked ``refused: unauthenticated``, which the results ledger does not
    count: anyone can publish a command under the id of a real one, and that must not
    pass for the real one's result. Its requester and target are claims, so no
    notification goes to them, and its audit record is named apart from the real one's.
    """
    error = f"refused: the command is not sealed by the worker: {reason}"
    # The target's own fields only: whatever else a forger puts in it must not make the
    # refusal too large for the results topic.
    target = ObjectRef(kind=command.target.kind, namespace=command.target.namespace, name=command.target.name)
    result = CommandResult(
        command_id=command.command_id, outcome="failed", error=error, at=now, type=command.type,
        target=target, cause=command.cause, requested_by=command.requested_by, refused="unauthenticated",
    )
    audit = AuditRecord(
        audit_id=ids.audit_id(topic, command.command_id, "unauthenticated"),
        at=now,
        input=AuditInput(topic=topic, key=subject_key(command.target), ref=command.command_id),
        outcome="rejected",
        reason=error,
        commands=[],
    )
    return ResultDecision(result, audit, None)
