"""Every GPU VM gets the GPU rules, however it was created.

watch event → VM record → :func:`reconcile_gpu_rules` → a ``patch_vm`` (the same mutation as
a ``set_gpu`` intent for the GPU the VM already has) and a ``gpu_rules_applied`` notice to
its owner — or, under ``gpu_vm.enforce: notify``, the notice alone.

A VM created with kubectl or by a GitOps tool may carry a GPU without ``host-passthrough``,
with its memory overcommitted, or without the eviction strategy that keeps drains from
hanging on it (``handlers/rules/gpus.py``, :func:`~handlers.rules.gpus.rule_gaps`). The rule reads the
observed VM only (level-based): a VM that follows the rules gets nothing, whatever event
showed it.

In flight: a GPU patch — this one's or a ``set_gpu`` intent's — records the VM content it
was planned from, with its ``metadata.generation`` (``VMTracking.gpu_rules_episode``).
Until the VM's content changes, no other patch is planned: the status updates and VMI
events that arrive meanwhile show the same content and generation and are let pass. The patch's own event shows the VM following the rules and
ends the episode; a VM whose content changed otherwise (someone edited or reverted it) is
planned again from what it now is. The command's mutation is an ``enforce`` one: an applier
planning it again after a conflict leaves a VM alone that no longer has that GPU.

Instance types (point 8 of the rules, :func:`warn_unpinned`): a VM whose memory comes from a
``VirtualMachine(Cluster)Instancetype`` cannot take a memory request (KubeVirt reports a
conflict), so under a KubeVirt CR with ``memoryOvercommit`` over 100 its GPU runs with
memory KubeVirt overcommits; the owner is told once.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from handlers.contracts import ids
from handlers.contracts.messages import GPUMutation, Severity
from handlers.core.cluster import VMRecord, describe_gpus
from handlers.core.decisions import Context, vm_subject
from handlers.core.state import KUBEVIRT_KEY, VMTracking, put_tracking, tracking_of
from handlers.core.tables import KUBEVIRT, VMIS
from handlers.rules.gpus import (
    ANNOTATIONS,
    DOMAIN,
    EVICTION_STRATEGY,
    PRE_GPU_ANNOTATION,
    GPURuleViolation,
    desired_vm,
    gpu_devices,
    plan_patch,
    rule_gaps,
    template_devices,
)
from handlers.rules.policy import is_system_namespace

# The field manager of every write the applier makes (streams/kube/applying/api.py), so managedFields —
# and the GitOps tools that read them (docs/gitops.md) — show which fields vmstream set.
FIELD_MANAGER = "vmstream"


def rules_content(obj: dict[str, Any], instancetype_cpu_model: str | None = None) -> str:
    """The episode of a VM's content as far as the GPU rules read it (not its status).

    ``metadata.generation`` is part of it: the API server bumps it on every change of the
    spec and never for the status, so a VM whose patch landed and was then reverted — both
    unseen, as after a relist — is told apart from one whose patch is still in flight.
    """
    def at(path: tuple[str, ...]) -> Any:
        value: Any = obj
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        return value

    annotations = at(ANNOTATIONS) or {}
    content = {
        "uid": at(("metadata", "uid")),
        "generation": at(("metadata", "generation")),
        "domain": at(DOMAIN),
        "eviction": at(EVICTION_STRATEGY),
        "instancetype": at(("spec", "instancetype")),
        "record": annotations.get(PRE_GPU_ANNOTATION) if isinstance(annotations, dict) else None,
    }
    if instancetype_cpu_model is not None:
        content["instancetype_cpu_model"] = instancetype_cpu_model
    return ids.episode_id("gpu-rules", json.dumps(content, sort_keys=True, default=str))


def mark_in_flight(ctx: Context, vm: VMRecord) -> None:
    """A GPU patch planned from ``vm`` is on its way: plan no other until the VM changes."""
    tracking = tracking_of(ctx.state, vm.key)
    put_tracking(ctx.state, vm.key, replace(tracking, gpu_rules_episode=rules_content(vm.object)))


def reconcile_gpu_rules(ctx: Context, vm: VMRecord) -> None:
    """Bring an observed GPU VM under the GPU rules (or tell its owner), once per content."""
    policy = ctx.config.gpu_vm
    tracking = tracking_of(ctx.state, vm.key)
    deleting = bool((vm.object.get("metadata") or {}).get("deletionTimestamp"))
    if not vm.gpu_devices or policy.enforce == "off" or is_system_namespace(vm.namespace) or deleting:
        if tracking.gpu_rules_episode is not None or tracking.unpinned_episode is not None:
            put_tracking(ctx.state, vm.key, replace(tracking, gpu_rules_episode=None, unpinned_episode=None))
        return
    device = vm.gpu_devices[0]
    warn_unpinned(ctx, vm, device)
    tracking = tracking_of(ctx.state, vm.key)
    gaps = rule_gaps(vm.object, eviction_strategy=policy.eviction_strategy,
                     instancetype_cpu_model=vm.instancetype_cpu_model)
    if not gaps:
        _forget(ctx, vm, tracking)
        return
    if policy.enforce == "notify":
        episode = ids.episode_id(vm.key, vm.uid, *vm.gpu_devices, *gaps)
    else:
        episode = rules_content(vm.object, vm.instancetype_cpu_model)
    if tracking.gpu_rules_episode == episode:
        return  # the patch planned from this very content is in flight (or the owner was told)
    gpu = ctx.catalog.for_device(device)
    gpus = describe_gpus(vm.gpu_devices, lambda d: ctx.catalog.for_device(d).display_name)
    vmi = ctx.state.get(VMIS, vm.key)
    running = vmi is not None and vmi.active
    where = f"VM {vm.namespace}/{vm.name}"
    severity: Severity
    if policy.enforce == "patch":
        mutation = enforce_mutation(vm, policy.eviction_strategy)
        try:
            patch = plan_patch(vm.object, desired_vm(vm.object, mutation))
        except GPURuleViolation:
            return
        fixed = rule_gaps(desired_vm(vm.object, mutation), eviction_strategy=policy.eviction_strategy,
                          instancetype_cpu_model=vm.instancetype_cpu_model)
        if patch:
            ctx.command("patch_vm", vm_subject(vm.key), patch=patch, base_resource_version=vm.resource_version,
                        mutation=mutation)
        when = ("they apply at its next restart; until then it keeps running as it is" if running
                else "they apply when it next starts")
        message = (f"{where} has {gpus} but was made without what a GPU needs "
                   f"({'; '.join(gaps)}): vmstream sets it as for any GPU VM; {when}.")
        if fixed:
            # What vmstream may not change: the instance type's own CPU model.
            message = (f"{where} has {gpus} but lacks what a GPU needs ({'; '.join(gaps)}). "
                       + (f"vmstream sets the rest ({when}); " if patch else "")
                       + f"it cannot change {'; '.join(fixed)}: the instance type "
                       f"{vm.object.get('spec', {}).get('instancetype', {}).get('name')} sets it, and KubeVirt "
                       "refuses a VM that sets it too. Use an instance type with cpu.model host-passthrough, "
                       "or none.")
            severity = "warning"
        else:
            severity = "info"
    else:
        message = (f"{where} has {gpus} but lacks what a GPU needs ({'; '.join(gaps)}): "
                   "it may hang at boot, fail to start or hold up a drain. vmstream changes nothing "
                   "(gpu_vm.enforce: notify): set these fields, or ask for its GPU class again.")
        severity = "warning"
    ctx.notify(
        "gpu_rules_applied",
        subject=vm_subject(vm.key),
        episode=episode,
        recipients=vm.recipients(),
        project=vm.project,
        severity=severity,
        message=message,
        details={"gpu": gpu.describe(), "gpus": [ctx.catalog.for_device(d).describe() for d in vm.gpu_devices],
                 "gaps": gaps, "enforce": policy.enforce, "running": running, "field_manager": FIELD_MANAGER},
    )
    put_tracking(ctx.state, vm.key, replace(tracking, gpu_rules_episode=episode))


def enforce_mutation(vm: VMRecord, eviction_strategy: Literal["External", "None"]) -> GPUMutation:
    """The mutation that brings ``vm``'s own GPUs under the rules and changes none of them:
    the one template GPU as a ``set_gpu`` would set it; any other set (several GPUs, GPU host
    devices, an instance type's) with its devices left as they are."""
    cpu_model = None if vm.instancetype_cpu_model is None else False
    if gpu_devices(vm.object) == list(vm.gpu_devices) and len(vm.gpu_devices) == 1 and cpu_model is None:
        return GPUMutation(device_name=vm.gpu_devices[0], eviction_strategy=eviction_strategy, enforce=True)
    return GPUMutation(device_name=None, eviction_strategy=eviction_strategy, enforce=True,
                       devices=template_devices(vm.object), cpu_model=cpu_model)


def _forget(ctx: Context, vm: VMRecord, tracking: VMTracking) -> None:
    if tracking.gpu_rules_episode is not None:
        put_tracking(ctx.state, vm.key, replace(tracking, gpu_rules_episode=None))


# ------------------------------------------------------------------ instance types


def unpinned_overcommit(ctx: Context, obj: dict[str, Any]) -> int | None:
    """KubeVirt's memoryOvercommit when it leaves this instance-type VM's memory unpinned."""
    kubevirt = ctx.state.get(KUBEVIRT, KUBEVIRT_KEY)
    spec = obj.get("spec") or {}
    if kubevirt is None or not spec.get("instancetype") or kubevirt.memory_overcommit <= 100:
        return None
    return kubevirt.memory_overcommit


def unpinned_message(vm_name: str, gpu_name: str, overcommit: int) -> str:
    return (f"VM {vm_name} takes its memory from an instance type, which vmstream cannot pin for GPU "
            f"{gpu_name}: KubeVirt's memoryOvercommit is {overcommit}%, so the VM's pod requests only "
            f"{round(10000 / overcommit)}% of its guest memory while passthrough locks all of it — it may "
            "fail to start or the node may run out of memory. Use an instance type without overcommit, or a "
            "VM without an instance type.")


def warn_unpinned(ctx: Context, vm: VMRecord, device: str) -> bool:
    """Tell the owner once that this GPU VM's memory is not pinned; True if it is not."""
    overcommit = unpinned_overcommit(ctx, vm.object)
    tracking = tracking_of(ctx.state, vm.key)
    if overcommit is None:
        if tracking.unpinned_episode is not None:
            put_tracking(ctx.state, vm.key, replace(tracking, unpinned_episode=None))
        return False
    episode = ids.episode_id(vm.key, vm.uid, device, str(overcommit))
    if tracking.unpinned_episode == episode:
        return True
    gpu = ctx.catalog.for_device(device)
    ctx.notify(
        "gpu_memory_not_pinned",
        subject=vm_subject(vm.key),
        episode=episode,
        recipients=vm.recipients(),
        project=vm.project,
        severity="warning",
        message=unpinned_message(f"{vm.namespace}/{vm.name}", gpu.display_name, overcommit),
        details={"gpu": gpu.describe(), "memory_overcommit": overcommit,
                 "instancetype": (vm.object.get("spec") or {}).get("instancetype")},
    )
    ctx.remark(f"GPU VM {vm.namespace}/{vm.name}: memory not pinned (instance type, memoryOvercommit {overcommit})")
    put_tracking(ctx.state, vm.key, replace(tracking, unpinned_episode=episode))
    return True
