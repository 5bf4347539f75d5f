"""GPU node maintenance plans carried out: the request read off the AZ, the owners' notices,
their answers, and the plan called off (docs/maintenance.md).

The plan itself is :func:`~handlers.rules.maintenance.plan_maintenance`, a pure function of a
:class:`~handlers.core.maintenance.MaintenanceRequest`. A plan's intents are decided under
``maintenance/<plan>``, so what they read of the AZ is the cluster-wide ``usage`` table alone
(each node's cards, its GPU VMs and its labels: :func:`~handlers.rules.capacity.refresh_usage`);
the plan's own row is ``plans`` (:class:`~handlers.core.maintenance.PlanRecord`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Literal, cast

from handlers.contracts.messages import ObjectRef, PlanMaintenanceSpec
from handlers.core.cluster import NodeUsage, UsageVM
from handlers.core.decisions import Context, PlanStep, vm_subject
from handlers.core.maintenance import (
    GPUVM,
    AfterMaintenance,
    MaintenancePlan,
    MaintenanceRequest,
    OtherNode,
    PlannedNode,
    PlanRecord,
    VMEntry,
)
from handlers.core.outcomes import Accepted, Refused
from handlers.core.tables import PLANS, USAGE
from handlers.rules.maintenance import (
    Change,
    Refusal,
    no_wait_guaranteed,
    plan_maintenance,
    reschedule,
    resimulated,
)

PLAN_KIND = "MaintenancePlan"  # the subject of a plan's notices to operators
# A plan's row is one changelog record, under the broker's 1 MB: about 900 bytes a GPU VM
# (its entry, its request, its recipients), so a plan of more VMs is refused, to be split.
PLAN_VMS_MAX = 600


def plan_subject(plan_id: str) -> ObjectRef:
    return ObjectRef(kind=PLAN_KIND, name=plan_id)


def when(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# ------------------------------------------------------------------------------ the request


def _gpu_class(ctx: Context, device: str) -> str:
    """The GPU class a plan counts a device's cards in (a device no class names: itself)."""
    return ctx.catalog.for_device(device).id or device


def _gpu_devices(ctx: Context, usage: NodeUsage) -> list[str]:
    """The node's devices that are GPUs: a configured class's, or one a GPU VM holds there."""
    held = {device for vm in usage.vms for device in vm.gpus} | set(usage.held)
    return sorted(d for d in usage.allocatable if d in ctx.catalog.device_names or d in held)


def _planned_vm(ctx: Context, vm: UsageVM) -> GPUVM:
    _, namespace, name = vm.key.split("/", 2)
    return GPUVM(
        uid=vm.vm_uid or vm.key,
        name=name,
        namespace=namespace,
        owner=vm.recipients[0] if vm.recipients else "",
        gpus=dict(Counter(_gpu_class(ctx, device) for device in vm.gpus)),
        run_strategy=vm.run_strategy or "Halted",
        after_maintenance=cast(AfterMaintenance, vm.after_maintenance),
        project=vm.project,
    )


def _planned_node(ctx: Context, usage: NodeUsage) -> PlannedNode:
    capacity: Counter[str] = Counter()
    for device in _gpu_devices(ctx, usage):
        capacity[_gpu_class(ctx, device)] += usage.allocatable[device]
    return PlannedNode(usage.node, dict(capacity), tuple(_planned_vm(ctx, vm) for vm in usage.vms))


def _free_by_class(ctx: Context, usage: NodeUsage) -> dict[str, int]:
    free: Counter[str] = Counter()
    for device in _gpu_devices(ctx, usage):
        free[_gpu_class(ctx, device)] += usage.free(device)
    return {gpu_class: count for gpu_class, count in sorted(free.items()) if count > 0}


def planned_nodes(ctx: Context, spec: PlanMaintenanceSpec) -> list[str] | Refused:
    """The nodes the operator names or selects, in name order; or why there are none."""
    known = {usage.node for usage in ctx.state.values(USAGE)}
    if spec.nodes is not None:
        unknown = sorted(set(spec.nodes) - known)
        if unknown:
            return Refused(f"node(s) {', '.join(unknown)} unknown in AZ {ctx.config.az}")
        return sorted(spec.nodes)
    selector = spec.node_selector or {}
    selected = sorted(usage.node for usage in ctx.state.values(USAGE)
                      if all(usage.labels.get(key) == value for key, value in selector.items()))
    if not selected:
        labels = ", ".join(f"{key}={value}" for key, value in sorted(selector.items()))
        return Refused(f"no node of AZ {ctx.config.az} carries the labels {labels}")
    return selected


def maintenance_request(ctx: Context, spec: PlanMaintenanceSpec, nodes: list[str]) -> MaintenanceRequest:
    """What the plan is given, as the AZ is now: the planned nodes with their GPU VMs, and
    the free cards of every other schedulable node, by GPU class."""
    usage = {row.node: row for row in ctx.state.values(USAGE)}
    chosen = set(nodes)
    others = []
    for name in sorted(usage):
        if name in chosen or not usage[name].schedulable:
            continue
        free = _free_by_class(ctx, usage[name])
        if free:
            others.append(OtherNode(name, free))
    return MaintenanceRequest(
        nodes=tuple(_planned_node(ctx, usage[name]) for name in nodes),
        others=tuple(others),
        earliest_start=spec.earliest_start,
        latest_end=spec.latest_end,
        concurrency=spec.concurrency,
        duration=timedelta(seconds=spec.node_duration_seconds),
        notice=timedelta(seconds=spec.notice_seconds),
        published=ctx.now,
    )


# ------------------------------------------------------------------------------ the notices


def fate_text(entry: VMEntry) -> str:
    """What the owner is told becomes of the VM after the stop."""
    if entry.fate == "lands_elsewhere":
        return "it starts again by itself on another node, where a card of its class is kept for it"
    if entry.fate == "back_on_own_node":
        back = f" (planned for {when(entry.back_at)})" if entry.back_at else ""
        return f"vmstream starts it again on node {entry.node} once the node is back{back}"
    if entry.fate == "stays_off":
        return f"it stays off until it is started ({entry.reason})"
    back = f", planned for {when(entry.back_at)}" if entry.back_at else ", not within the plan"
    return (f"no card of its class is free for it when its node goes: it starts again by itself once its "
            f"cards are free on one node{back}")


def _notice_episode(record: PlanRecord, uid: str) -> str:
    """The episode part of the id of the next notice about VM ``uid``: each has its own."""
    count = record.told.get(uid, 0)
    return record.plan_id if count == 0 else f"{record.plan_id}/{count}"


def _vm_details(record: PlanRecord, entry: VMEntry) -> dict[str, object]:
    slot = record.plan.slot(entry.node)
    return {
        "plan": record.plan_id,
        "node": entry.node,
        "reason": record.reason,
        "stop": entry.stop.isoformat(),
        "fate": entry.fate,
        "fate_text": fate_text(entry),
        "back_at": entry.back_at.isoformat() if entry.back_at else None,
        "outside_window": entry.outside_window,
        "slot": {"start": slot.start.isoformat(), "end": slot.end.isoformat()},
    }


def _tell(ctx: Context, record: PlanRecord, entry: VMEntry,
          type_: Literal["maintenance_planned", "maintenance_changed"], lead: str,
          more: dict[str, object] | None = None) -> PlanRecord:
    """Tell the VM's owner (and the operators, when it waits for a card) what the plan says
    of it now; the record counts the notice."""
    outside = " Its node's slot falls outside the window the operators gave." if entry.outside_window else ""
    recipients = list(record.recipients.get(entry.uid, ()))
    if entry.fate == "waits_for_card":
        recipients += [op for op in ctx.config.operators if op not in recipients]
    ctx.notify(
        type_,
        subject=vm_subject(f"vm/{entry.namespace}/{entry.name}"),
        episode=_notice_episode(record, entry.uid),
        recipients=recipients,
        project=entry.project,
        severity="warning",
        message=(f"{lead}Node {entry.node} will be maintained ({record.reason}; plan {record.plan_id}): GPU VM "
                 f"{entry.namespace}/{entry.name} will be stopped at {when(entry.stop)}, and "
                 f"{fate_text(entry)}.{outside}"),
        details={**_vm_details(record, entry), **(more or {})},
        deadline=entry.stop,
    )
    return replace(record, told={**record.told, entry.uid: record.told.get(entry.uid, 0) + 1})


def _progress(ctx: Context, record: PlanRecord, episode: str, message: str, details: dict[str, object],
              to: list[str] | None = None) -> None:
    """A notice to the operator who made the plan (and ``to``), about the plan."""
    recipients = sorted({record.requested_by, *(to or [])})
    ctx.notify("maintenance_progress", subject=plan_subject(record.plan_id), episode=f"{record.plan_id}/{episode}",
               recipients=recipients, project=None, severity="info", message=message,
               details={"plan": record.plan_id, **details})


def _summary(plan: MaintenancePlan) -> dict[str, object]:
    totals = plan.totals
    return {
        "nodes": [{"node": slot.node, "start": slot.start.isoformat(), "end": slot.end.isoformat(),
                   "outside_window": slot.outside_window} for slot in plan.slots],
        "fates": dict(totals.fates),
        "waits_for_card": [f"vm/{e.namespace}/{e.name}" for e in plan.vms if e.fate == "waits_for_card"],
        "outside_window": list(totals.outside_window),
        "start": totals.start.isoformat() if totals.start else None,
        "end": totals.end.isoformat() if totals.end else None,
    }


# ------------------------------------------------------------------------------ the plan


def accept_plan(ctx: Context, spec: PlanMaintenanceSpec, requested_by: str) -> Accepted | Refused:
    """Plan the nodes, keep the plan, tell every GPU VM's owner and the operator who asked.

    A window too short is no refusal: the plan places every node and says which fall
    outside it. Refused: a plan id in use, a node unknown, a selector that selects nothing.
    """
    if ctx.state.get(PLANS, spec.plan) is not None:
        return Refused(f"maintenance plan {spec.plan} exists already: a plan id is used once")
    nodes = planned_nodes(ctx, spec)
    if isinstance(nodes, Refused):
        return nodes
    request = maintenance_request(ctx, spec, nodes)
    vms = sum(len(node.vms) for node in request.nodes)
    if vms > PLAN_VMS_MAX:
        return Refused(f"the nodes hold {vms} GPU VMs, more than one plan keeps ({PLAN_VMS_MAX}): "
                       "split them into several plans")
    plan = plan_maintenance(request)
    recipients = {vm.vm_uid or vm.key: vm.recipients for node in nodes for vm in _usage_vms(ctx, node)}
    record = PlanRecord(plan_id=spec.plan, plan=plan, requested_by=requested_by, reason=spec.reason,
                        cause=ctx.cause, phases={slot.node: "planned" for slot in plan.slots},
                        recipients=recipients)
    for entry in plan.vms:
        record = _tell(ctx, record, entry, "maintenance_planned", "")
    totals = plan.totals
    outside = (f"; outside the window: node(s) {', '.join(totals.outside_window)}" if totals.outside_window else "")
    waiting = f"; {totals.waiting} GPU VM(s) wait for a card" if totals.waiting else ""
    _progress(ctx, record, "planned",
              f"Maintenance plan {spec.plan} ({spec.reason}): {len(plan.slots)} node(s) from "
              f"{when(totals.start or request.start)} to {when(totals.end or request.start)}, "
              f"{len(plan.vms)} GPU VM owner(s) told{waiting}{outside}.",
              {**_summary(plan), "no_wait_guaranteed": no_wait_guaranteed(request)})
    ctx.state.put(PLANS, spec.plan, record)
    return Accepted(f"maintenance plan {spec.plan}: {len(plan.slots)} node(s), {len(plan.vms)} GPU VM(s) told")


def _usage_vms(ctx: Context, node: str) -> tuple[UsageVM, ...]:
    usage = ctx.state.get(USAGE, node)
    return usage.vms if usage is not None else ()


# ------------------------------------------------------------------------------ answers


def open_plan(ctx: Context, plan_id: str) -> PlanRecord | Refused:
    record = ctx.state.get(PLANS, plan_id)
    if record is None:
        return Refused(f"no maintenance plan {plan_id}")
    if record.cancelled:
        return Refused(f"maintenance plan {plan_id} was cancelled")
    return record


def planned_vm(record: PlanRecord, namespace: str, name: str) -> VMEntry | Refused:
    for entry in record.plan.vms:
        if (entry.namespace, entry.name) == (namespace, name):
            return entry
    return Refused(f"VM {namespace}/{name} is no GPU VM of maintenance plan {record.plan_id}")


def not_started(record: PlanRecord, node: str) -> Refused | None:
    phase = record.phases.get(node, "planned")
    if phase != "planned":
        return Refused(f"node {node} is {'in maintenance' if phase == 'draining' else 'back'} already")
    return None


def apply_change(ctx: Context, record: PlanRecord, answer: Change | Refusal, asked: str) -> Accepted | Refused:
    """An answer the planner gave: refused with its reason, or the new plan kept and only the
    owners whose notice changed told again (``change.owners``)."""
    if isinstance(answer, Refusal):
        return Refused(answer.reason)
    refused = early_refusal(record, answer)
    if refused is not None:
        return refused
    before = {entry.uid: entry.notice for entry in record.plan.vms}
    changed = [entry for entry in answer.plan.vms if entry.notice != before[entry.uid]]
    record = _changed_for(ctx, record, answer)
    ctx.state.put(PLANS, record.plan_id, record)
    return Accepted(f"{asked}: {len(changed)} owner notice(s) corrected" if changed
                    else f"{asked}: no owner's notice changed")


def cancel_plan(ctx: Context, record: PlanRecord, reason: str, by: str) -> list[str]:
    """Call the plan off: every owner told of a stop still to come is told it is off, the
    operator who made it gets the tally. The nodes in maintenance already, returned, are
    called off by their own drains."""
    draining = sorted(node for node, phase in record.phases.items() if phase == "draining")
    spared = [(entry.uid, f"vm/{entry.namespace}/{entry.name}", entry.node, entry.project)
              for entry in record.plan.vms
              if record.phases.get(entry.node, "planned") == "planned" and entry.stop > ctx.now]
    for uid, key, node, project in spared:
        subject = vm_subject(key)
        ctx.notify(
            "maintenance_cancelled",
            subject=subject,
            episode=_notice_episode(record, uid),
            recipients=list(record.recipients.get(uid, ())),
            project=project,
            severity="info",
            message=(f"Maintenance plan {record.plan_id} ({record.reason}) is cancelled ({reason}): GPU VM "
                     f"{subject.namespace}/{subject.name} will not be stopped for it on node {node}."),
            details={"plan": record.plan_id, "node": node, "reason": record.reason, "cancelled": reason},
        )
        record = replace(record, told={**record.told, uid: record.told.get(uid, 0) + 1})
    _progress(ctx, record, "cancelled",
              f"Maintenance plan {record.plan_id} ({record.reason}) is cancelled by {by} ({reason}): "
              f"{len(spared)} GPU VM owner(s) told it is off"
              + (f"; node(s) {', '.join(draining)} in maintenance are called off" if draining else "") + ".",
              {"cancelled": reason, "told_it_is_off": [key for _, key, _, _ in spared],
               "called_off": draining}, to=[by])
    for node in draining:
        ctx.step(node, PlanStep(record.plan_id, "call_off", f"maintenance plan {record.plan_id} cancelled by {by}: "
                                f"{reason}", by))
    ctx.state.put(PLANS, record.plan_id, replace(record, cancelled=True))
    return draining


# ------------------------------------------------------------------------------ carried out


def _vm_ref(namespace: str, name: str, uid: str) -> ObjectRef:
    """The VM by identity (a VM without a uid is planned under its key: then by name)."""
    return ObjectRef(kind="VirtualMachine", namespace=namespace, name=name, uid=None if uid.startswith("vm/") else uid)


def _draining(record: PlanRecord) -> int:
    return sum(1 for phase in record.phases.values() if phase == "draining")


def _go(ctx: Context, record: PlanRecord, node: str) -> PlanRecord:
    """The node's slot starts: the VMs its owners want back on it, or off, are stopped by
    vmstream (so that KubeVirt does not start them elsewhere), and the node's own key
    drains it (a ``go`` step: cordon, then stop its GPU VMs once the cordon is seen)."""
    for vm in record.plan.request.node(node).vms:
        if vm.after_maintenance != "elsewhere" and vm.uid not in record.stopped_early:
            ctx.command("stop_vm", _vm_ref(vm.namespace, vm.name, vm.uid), requested_by=record.requested_by)
    told = tuple(sorted(f"vm/{entry.namespace}/{entry.name}" for entry in record.plan.vms if entry.node == node))
    back = tuple((entry.namespace, entry.name, entry.uid) for entry in record.plan.vms
                 if entry.node == node and entry.fate == "back_on_own_node")
    ctx.step(node, PlanStep(record.plan_id, "go", f"maintenance plan {record.plan_id}: {record.reason}",
                            record.requested_by, told))
    return replace(record, phases={**record.phases, node: "draining"}, to_start={**record.to_start, node: back},
                   held=tuple(held for held in record.held if held != node))


def _hold(ctx: Context, record: PlanRecord, node: str) -> PlanRecord:
    """The node's slot came while the limit is full (a node in maintenance is not back by
    its slot's end): it waits for one to come back, and its owners are told so."""
    waiting_for = sorted(other for other, phase in record.phases.items() if phase == "draining")
    for entry in record.plan.vms:
        if entry.node != node:
            continue
        recipients = list(record.recipients.get(entry.uid, ()))
        ctx.notify(
            "maintenance_changed", subject=vm_subject(f"vm/{entry.namespace}/{entry.name}"),
            episode=_notice_episode(record, entry.uid), recipients=recipients, project=entry.project,
            severity="warning",
            message=(f"Correction: node {node} was to be maintained at {when(entry.stop)} ({record.reason}; plan "
                     f"{record.plan_id}), but node(s) {', '.join(waiting_for)} in maintenance are not back yet: "
                     f"GPU VM {entry.namespace}/{entry.name} will be stopped once one is, and {fate_text(entry)}."),
            details={**_vm_details(record, entry), "delayed": True, "waiting_for": waiting_for},
        )
        record = replace(record, told={**record.told, entry.uid: record.told.get(entry.uid, 0) + 1})
    return replace(record, held=(*record.held, node))


def _start_what_may(ctx: Context, record: PlanRecord, due: list[str]) -> PlanRecord:
    """Start the ``due`` nodes, in their slots' order, while the concurrency limit allows;
    hold the others."""
    for node in due:
        if _draining(record) < record.plan.request.concurrency:
            record = _go(ctx, record, node)
        elif node not in record.held:
            record = _hold(ctx, record, node)
    return record


def _stop_early(ctx: Context, record: PlanRecord) -> PlanRecord:
    """Stop the VMs due to stop before their node goes (their owner is ready, or asked for an
    earlier stop): only VMs that stay off or come back on their node, which virt-api's stop
    keeps off (:func:`early_refusal`)."""
    due = sorted(uid for uid, at in record.early_stops().items() if at <= ctx.now)
    for uid in due:
        entry = record.plan.entry(uid)
        ctx.command("stop_vm", _vm_ref(entry.namespace, entry.name, entry.uid), requested_by=record.requested_by)
    return replace(record, stopped_early=(*record.stopped_early, *due)) if due else record


def early_refusal(record: PlanRecord, change: Change) -> Refused | None:
    """An earlier stop vmstream cannot carry out as told: a VM that KubeVirt starts again by
    itself, stopped while its node still takes VMs, may be started on that very node by the
    scheduler and be stopped a second time with it. Such a VM is stopped with its node."""
    for uid, at in change.plan.early.items():
        entry = change.plan.entry(uid)
        if (record.plan.early.get(uid) != at and at < change.plan.slot(entry.node).start
                and entry.fate in ("lands_elsewhere", "waits_for_card")):
            return Refused(f"VM {entry.namespace}/{entry.name} starts again by itself: stopped before node "
                           f"{entry.node} is cordoned, it could be started on that node again; it is stopped with "
                           f"its node at {when(change.plan.slot(entry.node).start)}")
    return None


def start_due(ctx: Context, record: PlanRecord) -> PlanRecord:
    """The clock reached slots of the plan (or early stops): the GPU VMs that came on
    planned nodes since are told, the VMs due to stop early are stopped, and the due nodes
    go, as the limit allows."""
    record = _replan(ctx, record)
    record = _stop_early(ctx, record)
    record = _start_what_may(ctx, record, record.due(ctx.now))
    ctx.state.put(PLANS, record.plan_id, record)
    return record


def _given_back(plan: MaintenancePlan, node: str) -> dict[str, int]:
    """The cards a node in maintenance gives back at its slot's end, by class."""
    cards = Counter(plan.request.node(node).capacity)
    for entry in plan.vms:
        if entry.node == node and entry.fate == "back_on_own_node":
            cards.subtract(entry.gpus)
    return {gpu_class: count for gpu_class, count in cards.items() if count > 0}


def _replan(ctx: Context, record: PlanRecord) -> PlanRecord:
    """The nodes still to go, planned again from the AZ as it is now (their GPU VMs as the
    ``usage`` rows show them, the free cards elsewhere, the nodes in maintenance giving their
    cards back at their slots' end), in the slots they have: the owners whose notice changed
    (a card gone, a VM gone elsewhere) are told again, and the owner of a GPU VM that came on
    a planned node since is told now. A node whose slot would give such a VM less than the
    plan's notice is moved later with the planner's :func:`reschedule` (its owners told again);
    if it cannot be, the operator is told."""
    plan = record.plan
    rest = [slot for slot in plan.slots if record.phases.get(slot.node, "planned") == "planned"]
    if not rest:
        return record
    draining = [slot for slot in plan.slots if record.phases.get(slot.node) == "draining"]
    usage = {row.node: row for row in ctx.state.values(USAGE)}
    nodes = [_planned_node(ctx, usage[slot.node]) if slot.node in usage else plan.request.node(slot.node)
             for slot in rest]
    # A node in maintenance gives its cards back at its slot's end (none if it is overdue), but
    # those of the VMs vmstream starts on it again.
    nodes += [PlannedNode(slot.node, _given_back(plan, slot.node) if slot.end > ctx.now else {}, ())
              for slot in draining]
    keep = {slot.node for slot in (*rest, *draining)}
    others = tuple(OtherNode(name, free) for name in sorted(usage) if name not in keep and usage[name].schedulable
                   and (free := _free_by_class(ctx, usage[name])))
    uids = {vm.uid for node in nodes for vm in node.vms}
    early = {uid: at for uid, at in plan.early.items() if uid in uids}
    again = resimulated(replace(plan.request, nodes=tuple(nodes), others=others), (*rest, *draining), early,
                        frozenset(plan.ready & uids))
    before = {entry.uid: entry for entry in plan.vms}
    came = [entry for entry in again.vms if entry.uid not in before]
    for node in sorted({entry.node for entry in came}):
        slot = again.slot(node)
        if slot.start >= ctx.now + plan.request.notice:
            continue
        moved = reschedule(again, node, ctx.now + plan.request.notice, now=ctx.now)
        if isinstance(moved, Change):
            again = moved.plan
            continue
        keys = [f"vm/{entry.namespace}/{entry.name}" for entry in came if entry.node == node]
        _progress(ctx, record, f"short/{node}/{ctx.now.isoformat()}",
                  f"GPU VM(s) {', '.join(keys)} came on node {node} after maintenance plan {record.plan_id} was "
                  f"made: they are told now, less than the plan's notice before {when(slot.start)}; node {node} "
                  f"cannot be moved later ({moved.reason}).",
                  {"node": node, "vms": keys, "not_moved": moved.reason})
    recipients = {vm.vm_uid or vm.key: vm.recipients for slot in rest for vm in _usage_vms(ctx, slot.node)}
    record = replace(record, plan=again, recipients={**record.recipients, **recipients})
    for entry in again.vms:
        old = before.get(entry.uid)
        if old is None:
            record = _tell(ctx, record, entry, "maintenance_planned", "", {"came_after_plan": True})
        elif entry.notice != old.notice:
            record = _tell(ctx, record, entry, "maintenance_changed", "Correction: ")
    return record


def _changed_for(ctx: Context, record: PlanRecord, change: Change) -> PlanRecord:
    """``change`` kept; the owners whose notice it changed told again."""
    before = {entry.uid: entry for entry in record.plan.vms}
    record = replace(record, plan=change.plan)
    for entry in change.plan.vms:
        if entry.notice != before[entry.uid].notice:
            record = _tell(ctx, record, entry, "maintenance_changed", "Correction: ")
    return record


def node_back(ctx: Context, plan_id: str, node: str) -> None:
    """A node of the plan is back: the VMs whose owners wanted them back on it are started,
    the operator is told, and a node held for the limit goes."""
    record = ctx.state.get(PLANS, plan_id)
    if record is None or record.phases.get(node) != "draining":
        return
    record = replace(record, phases={**record.phases, node: "back"})
    started = record.to_start.get(node, ())
    for namespace, name, uid in started:
        ctx.command("start_vm", _vm_ref(namespace, name, uid), requested_by=record.requested_by)
    left = sorted(other for other, phase in record.phases.items() if phase != "back")
    _progress(ctx, record, f"back/{node}",
              f"Node {node} of maintenance plan {record.plan_id} ({record.reason}) is back"
              + (f"; vmstream starts {len(started)} GPU VM(s) on it again" if started else "")
              + (f"; {len(left)} node(s) to go or in maintenance." if left else "; every node of the plan is back."),
              {"node": node, "started": [f"vm/{namespace}/{name}" for namespace, name, _ in started], "left": left})
    if not record.cancelled:
        record = _start_what_may(ctx, record, list(record.held))
    ctx.state.put(PLANS, plan_id, record)
