"""The applier's judgment: one command and what was read for it → what to do about it.

    command → :func:`reads` → the objects, read once → :class:`Observed`
        → :func:`judge` → an action to send, :class:`Done`, a :class:`Refusal`, a :class:`Failure`
        → the API server's answer; a conflict → :func:`conflicted` → :class:`~handlers.rules.results.RetryLater`

The applier (streams/kube/applying/) reads what :func:`reads` names and nothing else, then
does what :func:`judge` says; a command held by :class:`~handlers.rules.results.RetryLater` is read
and judged afresh on its next try. The policy's rules (handlers/rules/policy.py) refuse; the rest is
what each command type asks of the objects as they are.

Level-based (ARCHITECTURE.md, principle 2): a ``patch_vm`` is sent under the observed
``resourceVersion``; when the VM is no longer the one the command was planned against, the
patch is planned again from it with the worker's own functions (:func:`~handlers.rules.gpus.desired_vm`,
:func:`~handlers.rules.gpus.plan_patch`), so only the GPU fields are touched and nobody else's change
is clobbered. A restart cannot be read off the VM's level (its new VMI may not exist yet), so
the applier records on the VM which command restarts which VMI (:data:`RESTART_ANNOTATION`)
before the call, and a restart seen again whose VMI is gone, going or asked to stop is not sent
again.

Pure: no I/O; the objects and the number of the try come in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, assert_never

from handlers.contracts.messages import Command
from handlers.core.cluster import OWNER_ANNOTATION
from handlers.rules import policy
from handlers.rules.gpus import GPURuleViolation, desired_vm, plan_patch
from handlers.rules.results import Outcome, RetryLater

# On a VM: the restart command last sent for it and the uid of the VMI it restarts, written
# before the call so that the command seen again after a crash is not sent twice.
RESTART_ANNOTATION = "vmstream.io/restart"
MAX_CONFLICTS = 6  # a VM that changes under the applier this often is being fought over: give up, say so

Kind = Literal["Namespace", "VirtualMachine", "VirtualMachineInstance", "Node"]
NAMESPACE: Kind = "Namespace"
VM: Kind = "VirtualMachine"
VMI: Kind = "VirtualMachineInstance"
NODE: Kind = "Node"

# What each command type is judged on. The VM of a create_vm: one made before under its name
# is this command's, replayed, or another's. start and stop read nothing more: virt-api knows
# whether the VM runs, and says so (a 409, judged by :func:`~handlers.rules.running.already_so`).
READS: dict[str, frozenset[Kind]] = {
    "patch_vm": frozenset({NAMESPACE, VM}),
    "create_vm": frozenset({NAMESPACE, VM}),
    "restart_vm": frozenset({NAMESPACE, VM, VMI}),
    "start_vm": frozenset({NAMESPACE}),
    "stop_vm": frozenset({NAMESPACE}),
    "delete_vmi": frozenset({NAMESPACE}),
    "cancel_evacuation": frozenset({NAMESPACE, VMI}),
    "cordon_node": frozenset({NODE}),
    "uncordon_node": frozenset({NODE}),
}


@dataclass(frozen=True, slots=True)
class Observed:
    """The objects a command concerns, as read for one try: each None when it does not exist
    (or was not read: :func:`reads` says which are). ``namespace`` is its labels."""

    namespace: Mapping[str, str] | None = None
    vm: dict[str, Any] | None = None
    vmi: dict[str, Any] | None = None
    node: dict[str, Any] | None = None


# --- what to send --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PatchVM:
    """A JSON Patch of the VM, sent only while it is at ``resource_version``; ``outcome`` is
    ``conflict_retried`` when the patch was planned again on a VM that had moved on."""

    namespace: str
    name: str
    patch: list[dict[str, Any]]
    resource_version: str | None
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class CreateVM:
    namespace: str
    manifest: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PutSubresource:
    """virt-api's start, stop or restart of the VM; ``record`` (a restart's) is written on the
    VM first, under :data:`RESTART_ANNOTATION`."""

    namespace: str
    name: str
    action: Literal["start", "stop", "restart"]
    record: str | None = None


@dataclass(frozen=True, slots=True)
class DeleteVMI:
    """Only the VMI of ``uid`` when there is one: a VMI of that name made since is another's."""

    namespace: str
    name: str
    uid: str | None


@dataclass(frozen=True, slots=True)
class CancelMark:
    """virt-api's evacuate/cancel: the mark is removed only while it names ``node``."""

    namespace: str
    name: str
    node: str


@dataclass(frozen=True, slots=True)
class PatchNode:
    """A merge patch of the node: its ``spec.unschedulable`` and vmstream's cordon annotation."""

    name: str
    body: dict[str, Any]


Action = PatchVM | CreateVM | PutSubresource | DeleteVMI | CancelMark | PatchNode


# --- what it comes to without a call ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Done:
    """Nothing to send: the objects are as the command would leave them (``noop``), or it was
    sent before (``applied``)."""

    outcome: Outcome
    resource_version: str | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """The applier's policy does not allow it; ``owner`` is the VM's, when the VM was judged."""

    reason: str
    owner: str | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """It cannot be applied as it stands."""

    error: str


Judgment = Action | Done | Refusal | Failure | RetryLater


def reads(command: Command) -> frozenset[Kind]:
    """What to read for ``command``: nothing when its target alone refuses it."""
    namespace = command.target.namespace
    if policy.target_refusal(command) is not None or (namespace and policy.is_system_namespace(namespace)):
        return frozenset()
    return READS[command.type]


def owner(obj: Mapping[str, Any] | None) -> str | None:
    """The owner an object records (:data:`~handlers.core.cluster.OWNER_ANNOTATION`)."""
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    found = annotations.get(OWNER_ANNOTATION)
    return found if isinstance(found, str) and found else None


def resource_version(obj: Mapping[str, Any]) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv is not None else None


def namespace_refusal(command: Command, labels: Mapping[str, str] | None, *, project_label: str) -> str | None:
    """Is the target's namespace a project's (``labels`` None: it does not exist), and the
    manifest of a ``create_vm`` its project's?"""
    namespace = command.target.namespace
    if not namespace:
        return None
    refusal = policy.namespace_refusal(namespace, labels, project_label=project_label)
    if refusal is None and command.type == "create_vm":
        refusal = policy.create_refusal(command, labels or {}, project_label=project_label)
    return refusal


def judge(command: Command, seen: Observed, *, project_label: str) -> Judgment:
    """What to do about ``command``, the objects being as ``seen``: one case per command type
    (handlers/contracts/messages.py); mypy fails here when a type has none (``assert_never``)."""
    refusal = policy.target_refusal(command) or namespace_refusal(command, seen.namespace, project_label=project_label)
    if refusal is not None:
        return Refusal(refusal)
    namespace, name = command.target.namespace or "", command.target.name
    match command.type:
        case "patch_vm":
            return _patch_vm(command, seen.vm)
        case "create_vm":
            return _create_vm(command, seen.vm)
        case "restart_vm":
            return _restart(command, seen.vm, seen.vmi)
        case "start_vm":
            return PutSubresource(namespace, name, "start")
        case "stop_vm":
            return PutSubresource(namespace, name, "stop")
        case "delete_vmi":
            return DeleteVMI(namespace, name, command.target.uid)
        case "cordon_node":
            return _set_unschedulable(command, seen.node, True)
        case "uncordon_node":
            return _set_unschedulable(command, seen.node, False)
        case "cancel_evacuation":
            return _cancel_evacuation(command, seen.vmi)
        case _:
            assert_never(command.type)


def conflicted(command: Command, conflicts: int) -> RetryLater | Failure:
    """The API server answered 409 after ``conflicts`` earlier ones: the object is not the
    one judged. Read and judged again at once, unless it keeps changing."""
    target = f"{command.target.kind} {command.target.namespace}/{command.target.name}"
    if conflicts + 1 < MAX_CONFLICTS:
        return RetryLater(0.0, f"{target} changed under the command", cause="conflict")
    return Failure(f"{target} kept changing: gave up after {conflicts + 1} conflicts")


# --- one command type each ---------------------------------------------------------------------


def _where(command: Command) -> str:
    return f"{command.target.namespace}/{command.target.name}"


def _patch_vm(command: Command, vm: dict[str, Any] | None) -> Judgment:
    """The command's own patch while the VM is the one it was planned against; else its
    mutation planned again on the VM as it is."""
    if vm is None:
        return Failure(f"VirtualMachine {_where(command)} does not exist")
    rv = resource_version(vm)
    if command.patch is not None and rv == command.base_resource_version:
        if not command.patch:
            return Done("noop", rv)
        return _guarded(command, vm, command.patch, "applied")
    if command.mutation is None:
        return Failure(f"VirtualMachine {_where(command)} changed since the command was planned "
                       f"(resourceVersion {rv}, planned against {command.base_resource_version}) "
                       "and the command carries no mutation to plan again")
    try:
        desired = desired_vm(vm, command.mutation)
    except GPURuleViolation as exc:
        return Failure(str(exc))
    patch = plan_patch(vm, desired)
    if not patch:
        return Done("noop", rv)
    return _guarded(command, vm, patch, "conflict_retried")


def _guarded(command: Command, vm: dict[str, Any], patch: list[dict[str, Any]], outcome: Outcome) -> Judgment:
    refusal = policy.patch_refusal(vm, patch)
    if refusal is not None:
        return Refusal(refusal, owner=owner(vm))
    return PatchVM(command.target.namespace or "", command.target.name, patch, resource_version(vm), outcome)


def _create_vm(command: Command, existing: dict[str, Any] | None) -> Judgment:
    """Created, unless a VM of that name was: by this very command, replayed, or an earlier
    one like it for the same owner (``noop``), or for somebody else (a failure). The manifest
    is there: :func:`~handlers.rules.policy.create_refusal` refuses a command without one."""
    manifest = command.manifest or {}
    if existing is None:
        return CreateVM(command.target.namespace or "", manifest)
    if owner(existing) == owner(manifest):
        return Done("noop", resource_version(existing))
    return Failure(f"VirtualMachine {_where(command)} already exists and was not created for "
                   f"{owner(manifest) or 'this request'}")


def restart_record(vm: Mapping[str, Any]) -> dict[str, Any] | None:
    raw = ((vm.get("metadata") or {}).get("annotations") or {}).get(RESTART_ANNOTATION)
    try:
        record = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _restart(command: Command, vm: dict[str, Any] | None, vmi: dict[str, Any] | None) -> Judgment:
    """Sent, unless it was sent before a crash; recorded on the VM with the uid of the VMI it
    restarts.

    The command seen again with its record: when that VMI is gone, being deleted, or asked to
    stop (``status.stateChangeRequests``, which virt-api writes before it answers), the
    restart got through — ``applied``, not sent twice. Otherwise the crash came between the
    record and the call: the restart is sent now. No clock is compared: a restart whose new
    VMI does not exist yet is recognised as well as one whose VMI was created in the same
    second as the command.

    Without a record of this command, a VMI created after the command was issued is a restart
    already (``noop``), as before records were kept.
    """
    if vm is None:
        return Failure(f"VirtualMachine {_where(command)} does not exist")
    namespace, name = command.target.namespace or "", command.target.name
    vmi_meta = (vmi or {}).get("metadata") or {}
    uid = vmi_meta.get("uid")
    recorded = restart_record(vm)
    if recorded is not None and recorded.get("command") == command.command_id:
        before = recorded.get("vmi")
        stopping = any(request.get("action") == "Stop" and request.get("uid") in (None, before)
                       for request in ((vm.get("status") or {}).get("stateChangeRequests") or []))
        if uid != before or vmi_meta.get("deletionTimestamp") or stopping:
            return Done("applied")
        return PutSubresource(namespace, name, "restart")
    created = vmi_meta.get("creationTimestamp")
    if created and datetime.fromisoformat(str(created).replace("Z", "+00:00")) > command.issued_at:
        return Done("noop")
    # Without a VMI virt-api refuses (409): nothing to record.
    record = json.dumps({"command": command.command_id, "vmi": uid}, separators=(",", ":")) if uid else None
    return PutSubresource(namespace, name, "restart", record)


def _cancel_evacuation(command: Command, vmi: dict[str, Any] | None) -> Judgment:
    """A VMI gone, no longer marked from that node, or another VMI of that name: its mark is
    not the one told off (``noop``)."""
    node = command.evacuation_node
    if not node:
        return Failure("a cancel_evacuation command must name the node of the mark (evacuation_node)")
    if vmi is None or (vmi.get("status") or {}).get("evacuationNodeName") != node:
        return Done("noop")
    if command.target.uid and (vmi.get("metadata") or {}).get("uid") != command.target.uid:
        return Done("noop")
    return CancelMark(command.target.namespace or "", command.target.name, node)


def _set_unschedulable(command: Command, node: dict[str, Any] | None, unschedulable: bool) -> Judgment:
    """Cordoned with the command recorded on the node (:data:`~handlers.rules.policy.CORDONED_ANNOTATION`),
    uncordoned with the record removed; null removes a field, as a never-cordoned node has none."""
    name = command.target.name
    if node is None:
        return Failure(f"node {name} does not exist")
    metadata = node.get("metadata") or {}
    cordoned = bool((node.get("spec") or {}).get("unschedulable"))
    refusal = policy.node_refusal(command, labels=metadata.get("labels") or {},
                                  annotations=metadata.get("annotations") or {}, unschedulable=cordoned)
    if refusal is not None:
        return Refusal(refusal)
    if cordoned == unschedulable:
        return Done("noop", resource_version(node))
    return PatchNode(name, {
        "metadata": {"annotations": {policy.CORDONED_ANNOTATION: command.command_id if unschedulable else None}},
        "spec": {"unschedulable": True if unschedulable else None},
    })
