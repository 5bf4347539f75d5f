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

from handlers import ids
from handlers.cluster import OWNER_ANNOTATION
from handlers.decisions import subject_key
from handlers.gpus import (
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
from handlers.messages import AuditInput, AuditRecord, Command, CommandResult, ObjectRef
from handlers.results import COMMANDS_TOPIC, ResultDecision
from handlers.vms import MANAGED_BY_LABEL

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


class _Owned:
    """A document copied on write: a change copies only the maps and lists on its way, and
    everything else stays shared with the original, which is never changed. The policy
    judges a whole VM per command; three whole copies of it were most of that cost
    (benchmarks/policy_cost.py)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = dict(doc)
        self._mine = {id(self.doc)}  # the containers this copy made, free to change

    def child(self, node: Any, key: str | int) -> Any:
        """``node[key]``, copied first if it is a container of the original."""
        value = node[key]
        if isinstance(value, (dict, list)) and id(value) not in self._mine:
            value = node[key] = dict(value) if isinstance(value, dict) else list(value)
            self._mine.add(id(value))
        return value

    def delete(self, path: Path) -> None:
        """Delete ``path`` where it exists (the maps on the way copied, not the rest)."""
        if not isinstance(parent := _get(self.doc, path[:-1]), dict) or path[-1] not in parent:
            return
        node: Any = self.doc
        for part in path[:-1]:
            node = self.child(node, part)
        del node[path[-1]]


def _get(obj: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _outside_gpu_paths(vm: dict[str, Any]) -> dict[str, Any]:
    """``vm`` without what vmstream may change: the GPU paths, their annotation, and the maps
    it creates to hold them when they are left empty. ``vm`` itself is left as it is."""
    rest = _Owned(vm)
    rest.doc.pop("status", None)
    for key in ("resourceVersion", "generation", "managedFields"):  # the API server's own
        rest.delete(("metadata", key))
    for path in VM_PATHS:
        rest.delete(path)
    for key in VM_ANNOTATIONS:
        rest.delete((*ANNOTATIONS, key))
    for path in reversed(CONTAINERS):
        if _get(rest.doc, path) == {}:
            rest.delete(path)
    return rest.doc


def vm_change_refusal(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """A VM may change only at the GPU paths and the annotation that records them."""
    outside = plan_patch(_outside_gpu_paths(before), _outside_gpu_paths(after))
    if outside:
        paths = ", ".join(sorted({op["path"] for op in outside})[:5])
        return f"the patch changes the VM outside the GPU fields: {paths}"
    return None


def _token(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _parent(doc: _Owned, pointer: str) -> tuple[Any, str]:
    """The container ``pointer`` ends in, copied on the way, and its last token."""
    if not pointer.startswith("/"):
        raise PatchError(f"not a JSON pointer: {pointer!r}")
    parts = [_token(p) for p in pointer[1:].split("/")]
    node: Any = doc.doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = doc.child(node, part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = doc.child(node, int(part))
        else:
            raise PatchError(f"{pointer}: no such path")
    return node, parts[-1]


def apply_patch(doc: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add``, ``remove``, ``replace`` and ``test`` on a copy of ``doc`` (vmstream
    sends nothing else: ``move`` and ``copy`` are refused). ``doc`` is left as it is; the
    result shares with it what the patch does not touch, so it is for reading."""
    result = _Owned(doc)
    for op in patch:
        kind, pointer = op.get("op"), op.get("path")
        if kind not in ("add", "remove", "replace", "test") or not isinstance(pointer, str):
            raise PatchError(f"unsupported patch operation {kind!r}")
        parent, key = _parent(result, pointer)
        value = op.get("value") if kind == "test" else copy.deepcopy(op.get("value"))
        if isinstance(parent, dict):
            if kind != "add" and key not in parent:
                raise PatchError(f"{pointer}: no such path")
            if kind == "test":
                if parent[key] != value:
                    raise PatchError(f"{pointer}: test failed")
            elif kind == "remove":
                del parent[key]
            else:
                parent[key] = value
        elif isinstance(parent, list):
            index = len(parent) if key == "-" and kind == "add" else (int(key) if key.isdigit() else -1)
            if not 0 <= index <= len(parent) - (0 if kind == "add" else 1):
                raise PatchError(f"{pointer}: no such index")
            if kind == "test":
                if parent[index] != value:
                    raise PatchError(f"{pointer}: test failed")
            elif kind == "remove":
                del parent[index]
            elif kind == "add":
                parent.insert(index, value)
            else:
                parent[index] = value
        else:
            raise PatchError(f"{pointer}: no such path")
    return result.doc


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
