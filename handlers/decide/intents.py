"""Intents: what upstream services ask for, checked and turned into commands.

intent → authenticate (``handlers/rules/auth.py``) → rule → commands + notifications. A wrong
request is *rejected*: the rule returns :class:`~handlers.core.outcomes.Refused` with its
reason, the requester gets ``intent_rejected``, the audit says why. Each rule receives the
:class:`~handlers.rules.auth.Principal` the intent's credential proves, and returns
:class:`~handlers.core.outcomes.Accepted` or :class:`~handlers.core.outcomes.Refused`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from handlers.contracts.config import Config
from handlers.contracts.messages import (
    CancelMaintenanceIntent,
    CreateVMIntent,
    DrainNodeIntent,
    GPUMutation,
    IntentBase,
    MaintenanceReadyIntent,
    PlanMaintenanceIntent,
    RescheduleMaintenanceIntent,
    RestartVMIntent,
    SetGPUIntent,
    UndrainNodeIntent,
    VMIntent,
)
from handlers.core.catalog import UnknownGPUClass
from handlers.core.cluster import NamespaceRecord, VMRecord
from handlers.core.decisions import Context, vm_subject
from handlers.core.outcomes import ACCEPTED, Accepted, Refused
from handlers.core.tables import NAMESPACES, NODES, VMIS, VMS
from handlers.decide.observing import vm_record
from handlers.rules.admission import device_refusal
from handlers.rules.auth import Principal
from handlers.rules.drains import call_off_drain, start_drain
from handlers.rules.enforcement import mark_in_flight, unpinned_overcommit, warn_unpinned
from handlers.rules.gpus import GPURuleViolation, desired_vm, gpu_devices, plan_patch
from handlers.rules.maintenance import ready_now, reschedule
from handlers.rules.plans import accept_plan, apply_change, cancel_plan, not_started, open_plan, planned_vm
from handlers.rules.restarts import reconcile_pending, restart_judgement
from handlers.rules.vms import vm_manifest

Refusal = str | None
RuleOutcome = Accepted | Refused
Rule = Callable[[Context, Any, Principal], RuleOutcome]


def _gpu_mutation(ctx: Context, gpu_class: str | None) -> GPUMutation:
    device = None if gpu_class is None else ctx.catalog.lookup(gpu_class).device_name
    return GPUMutation(device_name=device, eviction_strategy=ctx.config.gpu_vm.eviction_strategy)


def _owned_vm(ctx: Context, intent: VMIntent) -> VMRecord | Refused:
    """The VM the intent is about, if it exists and belongs to the intent's project."""
    vm = ctx.state.get(VMS, intent.vm_key())
    if vm is None:
        spec = intent.spec  # type: ignore[attr-defined]
        return Refused(f"VM {spec.namespace}/{spec.name} does not exist")
    if vm.project != intent.project:
        return Refused(f"VM {vm.namespace}/{vm.name} does not belong to project {intent.project!r}")
    return vm


def namespace_project(config: Config, namespace: str, observed: NamespaceRecord | None = None) -> str | None:
    """The project a namespace belongs to: its project label when the watch bridge has
    shown the namespace (unlabelled: none), else as configured (a template or a mapping)."""
    if observed is not None:
        return observed.project
    policy = config.namespaces
    if namespace in policy.projects:
        return policy.projects[namespace]
    if policy.template is not None:
        prefix, suffix = policy.template.split("{project}")
        middle = namespace[len(prefix):len(namespace) - len(suffix)]
        if namespace.startswith(prefix) and namespace.endswith(suffix) and middle:
            return middle
    return None


def namespace_refusal(config: Config, namespace: str, project: str,
                      observed: NamespaceRecord | None = None) -> Refusal:
    """VMs are created only in a namespace of their project, never in a system one."""
    if namespace.startswith("kube-") or namespace in config.namespaces.system:
        return f"namespace {namespace} is a system namespace: no VM is created there"
    owner = namespace_project(config, namespace, observed)
    if owner is None:
        return f"namespace {namespace} is not known to belong to a project"
    if owner != project:
        return f"namespace {namespace} does not belong to project {project!r}"
    return None


def create_vm(ctx: Context, intent: CreateVMIntent, principal: Principal) -> RuleOutcome:
    refusal = namespace_refusal(ctx.config, intent.spec.namespace, intent.project,
                                ctx.state.get(NAMESPACES, intent.spec.namespace))
    if refusal:
        return Refused(refusal)
    if ctx.state.get(VMS, intent.vm_key()) is not None:
        return Refused(f"VM {intent.spec.namespace}/{intent.spec.name} already exists")
    try:
        gpu = None if intent.spec.gpu_class is None else _gpu_mutation(ctx, intent.spec.gpu_class)
    except UnknownGPUClass as exc:
        return Refused(str(exc))
    if intent.spec.gpu_class is not None:
        refusal = device_refusal(ctx.state, ctx.catalog.lookup(intent.spec.gpu_class))
        if refusal:
            return Refused(refusal)
    manifest = vm_manifest(intent, project_label=ctx.config.labels.project, gpu=gpu)
    ctx.command("create_vm", vm_subject(intent.vm_key()), manifest=manifest, requested_by=intent.requested_by)
    return ACCEPTED


def set_gpu(ctx: Context, intent: SetGPUIntent, principal: Principal) -> RuleOutcome:
    vm = _owned_vm(ctx, intent)
    if isinstance(vm, Refused):
        return vm
    refusal = _other_gpus(vm)
    if refusal:
        return Refused(refusal)
    try:
        mutation = _gpu_mutation(ctx, intent.spec.gpu_class)
        desired = desired_vm(vm.object, mutation)
    except (UnknownGPUClass, GPURuleViolation) as exc:
        return Refused(str(exc))
    unpinned = None
    if intent.spec.gpu_class is not None:
        refusal = device_refusal(ctx.state, ctx.catalog.lookup(intent.spec.gpu_class))
        if refusal:
            return Refused(refusal)
        unpinned = unpinned_overcommit(ctx, vm.object)
        if unpinned is not None and ctx.config.gpu_vm.instancetype_overcommit == "refuse":
            return Refused(f"VM {vm.namespace}/{vm.name} takes its memory from an instance type and KubeVirt's "
                           f"memoryOvercommit is {unpinned}%: its memory would not be pinned for the GPU "
                           "(gpu_vm.instancetype_overcommit: refuse)")
    after = vm_record(ctx, desired)
    if unpinned is not None and mutation.device_name is not None:
        warn_unpinned(ctx, after, mutation.device_name)
    patch = plan_patch(vm.object, desired)
    if not patch:
        return ACCEPTED  # already as asked: no command; the audit says "no change"
    mark_in_flight(ctx, vm)
    ctx.command(
        "patch_vm",
        vm_subject(vm.key),
        patch=patch,
        base_resource_version=vm.resource_version,
        mutation=mutation,
        requested_by=intent.requested_by,
    )
    # Tell the owner now, not when the watch catches up: the change will wait for a restart.
    reconcile_pending(ctx, after)
    return ACCEPTED


def _other_gpus(vm: VMRecord) -> Refusal:
    """set_gpu changes the template's one ``gpus`` entry: not GPUs that come from elsewhere."""
    where = f"VM {vm.namespace}/{vm.name}"
    if vm.instancetype_gpus:
        name = ((vm.object.get("spec") or {}).get("instancetype") or {}).get("name")
        return (f"{where} takes its GPUs from its instance type {name}: change its instance type instead "
                "(KubeVirt refuses a VM whose template and instance type both set GPUs)")
    if len(vm.template_gpus) > len(gpu_devices(vm.object)):
        return f"{where} passes its GPUs as hostDevices: change them there"
    return None


def restart_vm(ctx: Context, intent: RestartVMIntent, principal: Principal) -> RuleOutcome:
    vm = _owned_vm(ctx, intent)
    if isinstance(vm, Refused):
        return vm
    judgement = restart_judgement(vm, ctx.state.get(VMIS, vm.key))
    if isinstance(judgement, Accepted):
        ctx.command("restart_vm", vm_subject(vm.key), requested_by=intent.requested_by)
    return judgement


def _operator_refusal(principal: Principal, what: str) -> Refusal:
    """Refused unless an operator asks: ``what`` is what they may not do ("drain nodes")."""
    if not principal.operator:
        return f"{principal.name} may not {what}: only operators may"
    return None


def drain_node(ctx: Context, intent: DrainNodeIntent, principal: Principal) -> RuleOutcome:
    refusal = _operator_refusal(principal, "drain nodes")
    if refusal:
        return Refused(refusal)
    if ctx.state.get(NODES, intent.spec.node) is None:
        return Refused(f"node {intent.spec.node} is unknown in AZ {ctx.config.az}")
    start_drain(
        ctx,
        node=intent.spec.node,
        source="intent",
        reason=intent.spec.reason,
        requested_by=intent.requested_by,
        notice_seconds=intent.spec.notice_seconds,
    )
    return ACCEPTED


def undrain_node(ctx: Context, intent: UndrainNodeIntent, principal: Principal) -> RuleOutcome:
    refusal = _operator_refusal(principal, "undrain nodes")
    if refusal:
        return Refused(refusal)
    # vmstream undoes only what it did itself: its own cordon (handlers/rules/drains.py).
    why = f"undrain_node by {principal.name}" + (f": {intent.spec.reason}" if intent.spec.reason else "")
    if call_off_drain(ctx, intent.spec.node, why=why, undo_cordon=True) is None:
        return Refused(f"node {intent.spec.node} is not being drained")
    return ACCEPTED


def plan_maintenance(ctx: Context, intent: PlanMaintenanceIntent, principal: Principal) -> RuleOutcome:
    refusal = _operator_refusal(principal, "make maintenance plans")
    if refusal:
        return Refused(refusal)
    return accept_plan(ctx, intent.spec, intent.requested_by)


def reschedule_maintenance(ctx: Context, intent: RescheduleMaintenanceIntent, principal: Principal) -> RuleOutcome:
    """A node moves on an operator's word; one VM's stop on its project's (or an operator's)."""
    spec = intent.spec
    record = open_plan(ctx, spec.plan)
    if isinstance(record, Refused):
        return record
    if spec.node is not None:
        refusal = _operator_refusal(principal, "move the nodes of maintenance plans")
        if refusal:
            return Refused(refusal)
        if spec.node not in record.phases:
            return Refused(f"node {spec.node} is no node of maintenance plan {spec.plan}")
        target, node, asked = spec.node, spec.node, f"node {spec.node} moved to {spec.start.isoformat()}"
    else:
        entry = planned_vm(record, spec.namespace or "", spec.name or "")
        if isinstance(entry, Refused):
            return entry
        refusal = _member_refusal(principal, entry.project, f"{entry.namespace}/{entry.name}")
        if refusal:
            return Refused(refusal)
        target, node = entry.uid, entry.node
        asked = f"VM {entry.namespace}/{entry.name} stopped at {spec.start.isoformat()}"
    started = not_started(record, node)
    if started is not None:
        return started
    return apply_change(ctx, record, reschedule(record.plan, target, spec.start, now=ctx.now), asked)


def maintenance_ready(ctx: Context, intent: MaintenanceReadyIntent, principal: Principal) -> RuleOutcome:
    spec = intent.spec
    record = open_plan(ctx, spec.plan)
    if isinstance(record, Refused):
        return record
    entry = planned_vm(record, spec.namespace, spec.name)
    if isinstance(entry, Refused):
        return entry
    refusal = _member_refusal(principal, entry.project, f"{entry.namespace}/{entry.name}")
    if refusal:
        return Refused(refusal)
    started = not_started(record, entry.node)
    if started is not None:
        return started
    return apply_change(ctx, record, ready_now(record.plan, entry.uid, ctx.now),
                        f"VM {entry.namespace}/{entry.name} ready now")


def _member_refusal(principal: Principal, project: str | None, vm: str) -> Refusal:
    """A planned VM is its project's members' to answer for, and the operators'."""
    if principal.operator or (project is not None and project in principal.projects):
        return None
    return f"{principal.name} may not answer for VM {vm}: only its project's members and operators may"


def cancel_maintenance(ctx: Context, intent: CancelMaintenanceIntent, principal: Principal) -> RuleOutcome:
    refusal = _operator_refusal(principal, "cancel maintenance plans")
    if refusal:
        return Refused(refusal)
    record = open_plan(ctx, intent.spec.plan)
    if isinstance(record, Refused):
        return record
    cancel_plan(ctx, record, intent.spec.reason, intent.requested_by)
    return Accepted(f"maintenance plan {intent.spec.plan} cancelled")


# The rule of each intent type (its model, in handlers/contracts/messages.py, declares the wire contract
# and the key it is decided under): the engine decides an intent by this table alone.
RULES: Mapping[type[IntentBase], Rule] = {
    CreateVMIntent: create_vm,
    SetGPUIntent: set_gpu,
    RestartVMIntent: restart_vm,
    DrainNodeIntent: drain_node,
    UndrainNodeIntent: undrain_node,
    PlanMaintenanceIntent: plan_maintenance,
    RescheduleMaintenanceIntent: reschedule_maintenance,
    MaintenanceReadyIntent: maintenance_ready,
    CancelMaintenanceIntent: cancel_maintenance,
}
