"""Watch events: fold what Kubernetes shows into state, then reconcile what it touches.

event → record (VM, VMI, Node, NodeMaintenance, KubeVirt) → state → the rules of the VM
and of the nodes involved. The rules read the observed state, not the event type
(level-based): a relist, a missed event or a redelivery converge to the same decisions.
"""

from __future__ import annotations

from handlers.availability import reconcile_availability
from handlers.cluster import (
    KubeVirtRecord,
    MaintenanceRecord,
    NodeRecord,
    VMIRecord,
    VMRecord,
)
from handlers.decisions import Context
from handlers.drains import end_drain, gpu_vmis_on, reconcile_drain, start_drain
from handlers.messages import WatchEvent
from handlers.restarts import reconcile_pending
from handlers.state import KUBEVIRT_KEY, DrainEpisode

Ignored = str | None


def observe(ctx: Context, event: WatchEvent) -> Ignored:
    """Fold ``event`` into state and reconcile; returns why it was ignored, if it was."""
    fold = _FOLDS.get(event.kind)
    if fold is None:
        return f"kind {event.kind} is not watched"
    fold(ctx, event)
    return None


def _vm(ctx: Context, event: WatchEvent) -> None:
    vm = VMRecord.from_object(event.object, project_label=ctx.config.labels.project)
    if event.type == "DELETED":
        ctx.state.put("vms", vm.key, None)
        ctx.state.put("tracking", vm.key, None)
        return
    ctx.state.put("vms", vm.key, vm)
    _reconcile_vm(ctx, vm.key)


def _vmi(ctx: Context, event: WatchEvent) -> None:
    vmi = VMIRecord.from_object(event.object)
    old: VMIRecord | None = ctx.state.get("vmis", vmi.key)
    ctx.state.put("vmis", vmi.key, None if event.type == "DELETED" else vmi)
    _reconcile_vm(ctx, vmi.key)
    if event.type != "DELETED" and vmi.active and vmi.gpu_devices:
        evacuating = vmi.evacuation_node or (vmi.node if vmi.eviction_requested else None)
        if evacuating:
            start_drain(
                ctx,
                node=evacuating,
                source="eviction",
                reason="KubeVirt was asked to evict its VMs",
                requested_by=None,
            )
    for node in sorted({n for n in (old.node if old else None, vmi.node) if n}):
        reconcile_drain(ctx, node)


def _node(ctx: Context, event: WatchEvent) -> None:
    new = NodeRecord.from_object(event.object)
    old: NodeRecord | None = ctx.state.get("nodes", new.name)
    if event.type == "DELETED":
        ctx.state.put("nodes", new.name, None)
        reconcile_drain(ctx, new.name)
        return
    ctx.state.put("nodes", new.name, new)
    episode: DrainEpisode | None = ctx.state.get("drains", new.name)
    cordoned_now = new.unschedulable and (old is None or not old.unschedulable)
    if cordoned_now and episode is None and gpu_vmis_on(ctx, new.name):
        start_drain(ctx, node=new.name, source="cordon", reason="the node was cordoned", requested_by=None)
        return
    if episode is not None and episode.cordon_observed and not new.unschedulable:
        end_drain(ctx, new.name)  # uncordoned again: the drain was called off
        return
    reconcile_drain(ctx, new.name)


def _maintenance(ctx: Context, event: WatchEvent) -> None:
    maintenance = MaintenanceRecord.from_object(event.object)
    old: MaintenanceRecord | None = ctx.state.get("maintenances", maintenance.name)
    if event.type == "DELETED":
        ctx.state.put("maintenances", maintenance.name, None)
        episode: DrainEpisode | None = ctx.state.get("drains", maintenance.node)
        if episode is not None and episode.source == "maintenance":
            end_drain(ctx, maintenance.node)
        return
    ctx.state.put("maintenances", maintenance.name, maintenance)
    if old is None and maintenance.node:
        start_drain(
            ctx,
            node=maintenance.node,
            source="maintenance",
            reason=maintenance.reason or f"NodeMaintenance {maintenance.name}",
            requested_by=None,
        )


def _kubevirt(ctx: Context, event: WatchEvent) -> None:
    record = None if event.type == "DELETED" else KubeVirtRecord.from_object(event.object)
    ctx.state.put("kubevirt", KUBEVIRT_KEY, record)


def _reconcile_vm(ctx: Context, key: str) -> None:
    vm: VMRecord | None = ctx.state.get("vms", key)
    if vm is not None:
        reconcile_pending(ctx, vm)
        reconcile_availability(ctx, vm)


_FOLDS = {
    "VirtualMachine": _vm,
    "VirtualMachineInstance": _vmi,
    "Node": _node,
    "NodeMaintenance": _maintenance,
    "KubeVirt": _kubevirt,
}
