"""Watch events: fold what Kubernetes shows into state, then reconcile what it touches.

event → record → state → the rules of the VM or of the node. Each event is decided under
its *decision key* (:func:`decision_key`, declared with its fold in :data:`FOLDS`): VMs
and VMIs under their VM, Nodes and NodeMaintenances under their node. What a VM's decision
must tell its node — a GPU VMI arrived, changed or left — travels as a
:class:`~handlers.core.decisions.ResidentUpdate`.

The rules read the observed state, not the event type (level-based): a relist, a missed
event or a redelivery converge to the same decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from handlers.contracts.messages import WatchEvent, node_key, vm_key
from handlers.core.cluster import (
    InstancetypeRevision,
    KubeVirtRecord,
    MaintenanceRecord,
    NamespaceRecord,
    NodeRecord,
    Resident,
    VMIRecord,
    VMRecord,
    resident_of,
)
from handlers.core.decisions import Context, PlanStep, ResidentUpdate
from handlers.core.outcomes import ACCEPTED, Accepted, Ignored
from handlers.core.state import KUBEVIRT_KEY, DrainEpisode, ObservedFate, put_tracking, tracking_of
from handlers.core.tables import (
    DRAINS,
    KUBEVIRT,
    MAINTENANCES,
    NAMESPACES,
    NODES,
    RESIDENTS,
    REVISIONS,
    TRACKING,
    VMIS,
    VMS,
)
from handlers.rules.availability import reconcile_availability
from handlers.rules.capacity import refresh_usage
from handlers.rules.drains import (
    call_off_drain,
    cancelled_mark,
    kubevirt_starts_it,
    observe_fate,
    recheck_others,
    reconcile_drain,
    start_drain,
)
from handlers.rules.enforcement import reconcile_gpu_rules
from handlers.rules.restarts import reconcile_pending

CLUSTER_KEY = "cluster/kubevirt"


class Fold(NamedTuple):
    """What the rules make of one watched kind's events: the key an event is decided under,
    read off its object, and what folds it into state and reconciles what it touches.

    Declared once per kind in :data:`FOLDS`, so that the route stage (which keys an event)
    and the engine (which folds it) never tell the kinds apart themselves.
    """

    key: Callable[[dict[str, Any]], str]
    apply: Callable[[Context, WatchEvent], None]


def decision_key(kind: str, obj: dict[str, Any], folds: Mapping[str, Fold] | None = None) -> str:
    """The key a watch event about ``obj`` is decided under: its VM, its node, or the cluster
    (a kind nothing folds: the engine ignores it there)."""
    fold = (FOLDS if folds is None else folds).get(kind)
    return CLUSTER_KEY if fold is None else fold.key(obj)


def observe(ctx: Context, event: WatchEvent, folds: Mapping[str, Fold] | None = None) -> Accepted | Ignored:
    """Fold ``event`` into state and reconcile; ignored (and why) if nothing reads it."""
    fold = (FOLDS if folds is None else folds).get(event.kind)
    if fold is None:
        return Ignored(f"kind {event.kind} is not watched")
    fold.apply(ctx, event)
    return ACCEPTED


def _vm_key_of(obj: dict[str, Any]) -> str:
    """A VM's key, and its VMI's (a VMI is named after its VM)."""
    metadata = obj.get("metadata") or {}
    return vm_key(metadata.get("namespace") or "default", str(metadata.get("name")))


def _node_key_of(obj: dict[str, Any]) -> str:
    return node_key(str((obj.get("metadata") or {}).get("name")))


def _maintained_node_key(obj: dict[str, Any]) -> str:
    return node_key(str((obj.get("spec") or {}).get("nodeName") or ""))


def _revision_key(obj: dict[str, Any]) -> str:
    return InstancetypeRevision.owner(obj) or CLUSTER_KEY


def _cluster_key(obj: dict[str, Any]) -> str:
    return CLUSTER_KEY


# ------------------------------------------------------------- under the VM's key


def vm_record(ctx: Context, obj: dict[str, Any]) -> VMRecord:
    """The record of a VM as the rules read it: its GPUs with its instance type's."""
    metadata = obj.get("metadata") or {}
    key = vm_key(metadata.get("namespace") or "default", str(metadata.get("name")))
    return VMRecord.from_object(obj, project_label=ctx.config.labels.project, gpu_names=ctx.catalog.device_names,
                                revisions=ctx.state.get(REVISIONS, key))


def _vm(ctx: Context, event: WatchEvent) -> None:
    vm = vm_record(ctx, event.object)
    before = _residence(ctx, vm.key)
    known = ctx.state.get(VMS, vm.key)
    other = known is not None and bool(known.uid) and bool(vm.uid) and known.uid != vm.uid
    if event.type == "DELETED" and other:
        return  # the DELETED of a VM already made again under its name: nothing of the new one
    if event.type == "DELETED" or other:
        # Deleted — or deleted and made again under its name, seen only as another uid (a
        # relist shows the new VM without the old one's DELETED): the old VM is gone, and
        # what its owner was told is not the new one's.
        ctx.state.put(VMS, vm.key, None)
        _tell_nodes(ctx, vm.key, before)
        ctx.state.put(TRACKING, vm.key, None)
        if event.type == "DELETED":
            return
        before = _residence(ctx, vm.key)
    ctx.state.put(VMS, vm.key, vm)
    _reconcile_vm(ctx, vm.key)
    _tell_nodes(ctx, vm.key, before)


def _vmi(ctx: Context, event: WatchEvent) -> None:
    vmi = VMIRecord.from_object(event.object, gpu_names=ctx.catalog.device_names)
    before = _residence(ctx, vmi.key)
    ctx.state.put(VMIS, vmi.key, None if event.type == "DELETED" else vmi)
    _reconcile_vm(ctx, vmi.key)
    _tell_nodes(ctx, vmi.key, before)


def _revision(ctx: Context, event: WatchEvent) -> None:
    """An instance type KubeVirt stored for a VM: the VM's GPU set is read again with it."""
    revision = InstancetypeRevision.from_object(event.object)
    if revision is None:
        return
    known = ctx.state.get(REVISIONS, revision.vm)
    revisions = dict(known) if known else {}
    if event.type == "DELETED":
        revisions.pop(revision.name, None)
    else:
        revisions[revision.name] = revision
    ctx.state.put(REVISIONS, revision.vm, revisions or None)
    vm = ctx.state.get(VMS, revision.vm)
    if vm is None:
        return
    before = _residence(ctx, vm.key)
    again = vm_record(ctx, vm.object)
    if again != vm:
        ctx.state.put(VMS, vm.key, again)
        _reconcile_vm(ctx, vm.key)
        _tell_nodes(ctx, vm.key, before)


def _namespace(ctx: Context, event: WatchEvent) -> None:
    """Which project a namespace belongs to: create_vm goes only into its own (handlers/decide/intents.py)."""
    record = NamespaceRecord.from_object(event.object, project_label=ctx.config.labels.project)
    ctx.state.put(NAMESPACES, record.name, None if event.type == "DELETED" else record)


def _kubevirt(ctx: Context, event: WatchEvent) -> None:
    record = None if event.type == "DELETED" else KubeVirtRecord.from_object(event.object)
    ctx.state.put(KUBEVIRT, KUBEVIRT_KEY, record)


def _reconcile_vm(ctx: Context, key: str) -> None:
    vm = ctx.state.get(VMS, key)
    if vm is not None:
        reconcile_gpu_rules(ctx, vm)
        reconcile_pending(ctx, vm)
        reconcile_availability(ctx, vm)


def _residence(ctx: Context, key: str) -> tuple[str, Resident] | None:
    return resident_of(ctx.state.get(VMS, key), ctx.state.get(VMIS, key))


def _tell_nodes(ctx: Context, key: str, before: tuple[str, Resident] | None) -> None:
    """Forward the VM's GPU residence to the node(s) it concerns, if it changed; and to the
    node its GPU VMI left, what became of the VM once that is seen (a drain reports it)."""
    after = _residence(ctx, key)
    left = before is not None and (after is None or after[0] != before[0])
    if after != before:
        if left:
            assert before is not None
            ctx.forward(before[0], key, None)
        if after is not None:
            ctx.forward(after[0], key, after[1])
    tracking = tracking_of(ctx.state, key)
    if left:
        assert before is not None
        tracking = replace(tracking, left_node=before[0], left_fate=None, left_phase=None)
    vmi = ctx.state.get(VMIS, key)
    if tracking.left_node is not None and vmi is not None and not vmi.active and not vmi.deleting \
            and vmi.phase != tracking.left_phase:
        tracking = replace(tracking, left_phase=vmi.phase)  # ended by itself, not stopped
    if tracking.left_node is None:
        return
    fate = fate_since_left(ctx, key, ended=tracking.left_phase)
    if fate is not None and fate != tracking.left_fate:
        ctx.forward(tracking.left_node, key, None, fate=fate)
        if fate == "waits_for_gpu":  # it may still get a card: keep listening
            tracking = replace(tracking, left_fate=fate)
        else:
            tracking = replace(tracking, left_node=None, left_fate=None, left_phase=None)
    put_tracking(ctx.state, key, tracking)


def fate_since_left(ctx: Context, key: str, *, ended: str | None = None) -> ObservedFate | None:
    """What became of a VM whose GPU VMI left its node, as observed; None while unknown."""
    vm = ctx.state.get(VMS, key)
    vmi = ctx.state.get(VMIS, key)
    if vm is None:
        return "off"
    if vmi is not None and vmi.active:
        if vmi.unschedulable or vm.printable_status == "ErrorUnschedulable":
            return "waits_for_gpu"
        # Running, not just placed: a Scheduled VMI's domain has not started (virt-handler
        # moves it to Running; lifecycle.go sets Scheduled once the pod is ready).
        return "came_back" if vmi.node and vmi.phase == "Running" else None
    if kubevirt_starts_it(vm, vmi, ended=ended):
        # KubeVirt is about to start a new VMI (its VM may already say it waits for a card):
        # the tally waits for it.
        return "waits_for_gpu" if vm.printable_status == "ErrorUnschedulable" else None
    return "off"


# ------------------------------------------------------------ under the node's key


def _node(ctx: Context, event: WatchEvent) -> None:
    new = NodeRecord.from_object(event.object)
    ctx.state.put(NODES, new.name, None if event.type == "DELETED" else new)
    recheck_others(ctx, new.name, *refresh_usage(ctx.state, new.name))
    if event.type == "DELETED":
        reconcile_drain(ctx, new.name)
        return
    # A cordon alone is not a drain: it stops nothing (docs/kubevirt.md).
    episode = ctx.state.get(DRAINS, new.name)
    if back_from_plan(ctx, new, episode):
        return
    if episode is not None and episode.scope == "node" and episode.cordon_observed and not new.unschedulable:
        # Uncordoned by someone else after the cordon was seen: the drain is called off.
        call_off_drain(ctx, new.name, why="the node was uncordoned", undo_cordon=False)
        back_from_plan(ctx, new, ctx.state.get(DRAINS, new.name))
        return
    reconcile_drain(ctx, new.name)


def back_from_plan(ctx: Context, node: NodeRecord, episode: DrainEpisode | None) -> bool:
    """A node a maintenance plan drained is back — Ready and schedulable again, its drain
    over (its GPU VMs gone, or the drain called off by undrain_node): its plan is told, and
    the episode ends."""
    if episode is None or episode.plan is None or not episode.completed or not node.schedulable:
        return False
    ctx.step(node.name, PlanStep(episode.plan, "back", requested_by=episode.requested_by))
    ctx.state.put(DRAINS, node.name, None)
    refresh_usage(ctx.state, node.name)
    return True


def _maintenance(ctx: Context, event: WatchEvent) -> None:
    maintenance = MaintenanceRecord.from_object(event.object)
    old = ctx.state.get(MAINTENANCES, maintenance.name)
    if event.type == "DELETED":
        ctx.state.put(MAINTENANCES, maintenance.name, None)
        episode = ctx.state.get(DRAINS, maintenance.node)
        if episode is not None and episode.source == "maintenance":
            call_off_drain(ctx, maintenance.node, why=f"NodeMaintenance {maintenance.name} was deleted",
                           undo_cordon=True)
        return
    ctx.state.put(MAINTENANCES, maintenance.name, maintenance)
    if old is None and maintenance.node:
        start_drain(
            ctx,
            node=maintenance.node,
            source="maintenance",
            reason=maintenance.reason or f"NodeMaintenance {maintenance.name}",
            requested_by=None,
        )


def settle_resident(ctx: Context, update: ResidentUpdate) -> None:
    """A GPU VMI arrived on, changed on or left ``update.node`` — or (``recheck``) the cards
    the node's drain counted on other nodes changed."""
    if update.recheck:
        reconcile_drain(ctx, update.node)
        return
    before = ctx.state.get(RESIDENTS, update.node)
    residents = dict(before) if before else {}
    if update.resident is None:
        residents.pop(update.vm_key, None)
    else:
        residents[update.vm_key] = update.resident
    ctx.state.put(RESIDENTS, update.node, residents or None)
    recheck_others(ctx, update.node, *refresh_usage(ctx.state, update.node))
    if update.fate is not None:
        observe_fate(ctx, update.node, update.vm_key, update.fate)
    if update.resident is not None and update.resident.evacuating and not cancelled_mark(
            ctx.state.get(DRAINS, update.node), update.resident):
        # evictionStrategy External: KubeVirt marked this one VMI and leaves its stop to us.
        start_drain(
            ctx,
            node=update.node,
            source="eviction",
            reason="evictionStrategy External: vmstream stops it",
            requested_by=None,
            scope="evictions",
        )
    reconcile_drain(ctx, update.node)


# Each watched kind (handlers/contracts/messages.py WATCHED_KINDS) by the key its events are decided
# under and its fold (docs/worker.md, "Decision keys").
FOLDS: Mapping[str, Fold] = {
    "VirtualMachine": Fold(_vm_key_of, _vm),
    "VirtualMachineInstance": Fold(_vm_key_of, _vmi),
    "Node": Fold(_node_key_of, _node),
    "NodeMaintenance": Fold(_maintained_node_key, _maintenance),
    "KubeVirt": Fold(_cluster_key, _kubevirt),
    "Namespace": Fold(_cluster_key, _namespace),
    "ControllerRevision": Fold(_revision_key, _revision),
}
