"""Maintenance plans as a console shows them, read from the ``plans`` table: the read API's
``/v1/plans`` pages (streams/serve/api.py).

- :func:`plan_list`: every plan, its window and counts;
- :func:`plan_view`: one plan per node (its slot and where it is), per GPU VM (its stop, what
  becomes of it, when it is back, why) and per owner (what that owner is told).

Scoped by who asks: ``project`` None is an operator, who sees every VM; a project sees only
its own project's VMs (a VM's project label, else its namespace's, as for every page), the
nodes that hold them and their owners, and a plan holding none of them is not there for it.
Pure, like :mod:`handlers.reads.views`: the state is passed in.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from handlers.core.maintenance import Fate, NodePhase, PlanRecord, VMEntry
from handlers.core.state import StateView
from handlers.core.tables import PLANS
from handlers.reads.views import project_of
from handlers.rules.plans import fate_text


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PlanSummary(_Model):
    plan: str
    reason: str
    requested_by: str | None = Field(description="The operator who made it (null for a project token)")
    cancelled: bool
    start: datetime | None = Field(description="The first slot's start (of the nodes shown)")
    end: datetime | None = Field(description="The last slot's end (of the nodes shown)")
    nodes: int = Field(description="Nodes shown: every planned node, or those holding the project's VMs")
    vms: int = Field(description="GPU VMs shown: every planned VM, or the project's")
    waits_for_card: int = Field(description="Of those, the VMs that find no card of their class when their node goes")


class PlanList(_Model):
    plans: list[PlanSummary] = Field(description="By plan id")


class PlanNode(_Model):
    node: str
    start: datetime = Field(description="Its slot's start: when its GPU VMs are stopped and it is drained")
    end: datetime = Field(description="Its slot's end: when it is planned back")
    outside_window: bool = Field(description="The operators' window does not hold its slot")
    phase: NodePhase = Field(description="planned: still to go; draining: in maintenance; back: seen back")
    held: bool = Field(description="Its slot came while the plan's concurrency was full: it goes once a node "
                                   "in maintenance is back")
    vms: int = Field(description="Its GPU VMs shown")


class PlanVM(_Model):
    vm: str = Field(description="vm/<namespace>/<name>")
    namespace: str
    name: str
    project: str | None
    owner: str
    recipients: list[str] = Field(description="Who is told of it: its owner, or its project's recipients")
    node: str
    stop: datetime = Field(description="When it is stopped for the plan")
    fate: Fate = Field(description="What becomes of it after the stop, as its owner is told")
    fate_text: str = Field(description="The fate in the words of the owner's notice")
    back_at: datetime | None = Field(description="When it runs again with its cards (null: it stays off, or no "
                                                 "card is free for it within the plan)")
    reason: str = Field(description="Why the planner gave it this fate")
    outside_window: bool
    stopped_early: bool = Field(description="vmstream stopped it before its node went (its owner was ready)")
    notices: int = Field(description="Notices its owner was told of it: the first, then each correction")


class PlanOwner(_Model):
    owner: str = Field(description="One recipient of the owners' notices")
    vms: list[PlanVM] = Field(description="The GPU VMs of the plan they are told of, as they are told, by stop")


class PlanView(_Model):
    plan: str
    reason: str
    requested_by: str | None = Field(description="The operator who made it (null for a project token)")
    cancelled: bool
    nodes: list[PlanNode] = Field(description="By slot start")
    vms: list[PlanVM] = Field(description="By stop")
    owners: list[PlanOwner] = Field(description="Per recipient of the owners' notices, by recipient: what each is told")


def _project(state: StateView, entry: VMEntry) -> str | None:
    return entry.project or project_of(state, entry.namespace)


def _shown(state: StateView, record: PlanRecord, project: str | None) -> list[VMEntry]:
    """The plan's VMs the caller sees: all for an operator (``project`` None), else the project's."""
    return [entry for entry in record.plan.vms if project is None or _project(state, entry) == project]


def _vm(state: StateView, record: PlanRecord, entry: VMEntry) -> PlanVM:
    recipients = list(record.recipients.get(entry.uid) or ([entry.owner] if entry.owner else []))
    return PlanVM(
        vm=f"vm/{entry.namespace}/{entry.name}", namespace=entry.namespace, name=entry.name,
        project=_project(state, entry), owner=entry.owner, recipients=recipients, node=entry.node,
        stop=entry.stop, fate=entry.fate,
        fate_text=fate_text(entry), back_at=entry.back_at, reason=entry.reason, outside_window=entry.outside_window,
        stopped_early=entry.uid in record.stopped_early, notices=record.told.get(entry.uid, 0))


def _summary(record: PlanRecord, shown: list[VMEntry], project: str | None) -> PlanSummary:
    nodes = {entry.node for entry in shown}
    slots = [slot for slot in record.plan.slots if project is None or slot.node in nodes]
    return PlanSummary(
        plan=record.plan_id, reason=record.reason, requested_by=record.requested_by if project is None else None,
        cancelled=record.cancelled, start=min((slot.start for slot in slots), default=None),
        end=max((slot.end for slot in slots), default=None), nodes=len(slots), vms=len(shown),
        waits_for_card=sum(1 for entry in shown if entry.fate == "waits_for_card"))


def plan_list(state: StateView, *, project: str | None) -> PlanList:
    """Every plan the caller sees: an operator (``project`` None) every plan, a project those
    holding one of its VMs, counted over its own."""
    plans = []
    for record in sorted(state.values(PLANS), key=lambda r: r.plan_id):
        shown = _shown(state, record, project)
        if project is not None and not shown:
            continue
        plans.append(_summary(record, shown, project))
    return PlanList(plans=plans)


def plan_view(state: StateView, plan_id: str, *, project: str | None) -> PlanView | None:
    """Plan ``plan_id`` as the caller sees it; None when there is no such plan, or, for a
    project, when it holds none of the project's VMs."""
    record = state.get(PLANS, plan_id)
    if record is None:
        return None
    shown = _shown(state, record, project)
    if project is not None and not shown:
        return None
    vms = [_vm(state, record, entry) for entry in shown]
    on_node: dict[str, int] = {}
    for entry in shown:
        on_node[entry.node] = on_node.get(entry.node, 0) + 1
    nodes = [PlanNode(node=slot.node, start=slot.start, end=slot.end, outside_window=slot.outside_window,
                      phase=record.phases.get(slot.node, "planned"), held=slot.node in record.held,
                      vms=on_node.get(slot.node, 0))
             for slot in record.plan.slots if project is None or slot.node in on_node]
    owners: dict[str, list[PlanVM]] = {}
    for item in vms:
        for recipient in item.recipients:
            owners.setdefault(recipient, []).append(item)
    return PlanView(plan=record.plan_id, reason=record.reason,
                    requested_by=record.requested_by if project is None else None, cancelled=record.cancelled,
                    nodes=nodes, vms=vms,
                    owners=[PlanOwner(owner=owner, vms=owners[owner]) for owner in sorted(owners)])
