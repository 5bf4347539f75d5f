"""``vmstream simulate --maintenance``: a GPU node maintenance plan made offline, as a what-if.

Two JSON files in: the plan request (the ``plan_maintenance`` intent's spec, read by that
intent's own model, :class:`~handlers.contracts.messages.PlanMaintenanceSpec`, alone or as the
whole intent with its ``spec``) and the AZ (``--az``: every node with its labels, its
cards by GPU class and the GPU VMs on it). The planned nodes are those the request names or
selects; the other schedulable nodes lend their free cards. The plan itself is
handlers/rules/maintenance.py's ``plan_maintenance`` (and ``name_order_baseline`` with
``--compare``): this module only reads the files and prints what the planner decided — a
table, or ``--json``. Nothing is published; no broker, no cluster.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from handlers.contracts.messages import PlanMaintenanceSpec
from handlers.rules.maintenance import (
    FATES,
    GPUVM,
    AfterMaintenance,
    MaintenancePlan,
    MaintenanceRequest,
    OtherNode,
    PlannedNode,
    VMEntry,
    name_order_baseline,
    no_wait_guaranteed,
    plan_maintenance,
)
from streams.cli.simulating import parse_time
from streams.common.errors import EXIT_USAGE, UserError

# ------------------------------------------------------------------------------ the input


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AZVM(_Strict):
    namespace: str = Field(min_length=1)
    name: str = Field(min_length=1)
    uid: str | None = None  # default: namespace/name
    owner: str | None = None  # default: the project's recipients (project:<project>)
    project: str | None = None
    gpus: dict[str, int] = Field(min_length=1)  # cards by GPU class
    run_strategy: str = "Always"
    after_maintenance: AfterMaintenance = "elsewhere"  # the annotation vmstream.io/after-maintenance


class AZNode(_Strict):
    name: str = Field(min_length=1)
    labels: dict[str, str] = {}
    cards: dict[str, int] = {}  # by GPU class
    schedulable: bool = True
    vms: list[AZVM] = []


class AZ(_Strict):
    nodes: list[AZNode]


def _errors(error: ValidationError) -> str:
    def where(e: Any) -> str:
        return ".".join(str(part) for part in e["loc"]) or "the document"

    return "; ".join(f"{where(e)}: {e['msg'].removeprefix('Value error, ')}" for e in error.errors())


def _read_json(path: str, what: str) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(f"{what} {path} cannot be read: {error.strerror or error}",
                        "give an existing JSON file", exit_code=EXIT_USAGE) from error
    try:
        return json.loads(text)
    except ValueError as error:
        raise UserError(f"{what} {path} is not JSON: {error}", "fix the file", exit_code=EXIT_USAGE) from error


def read_spec(path: str) -> tuple[PlanMaintenanceSpec, datetime | None]:
    """The plan request in ``path``, and the intent's ``requested_at`` if it is a whole intent."""
    document = _read_json(path, "plan request")
    requested_at = None
    if isinstance(document, dict) and "spec" in document:  # the whole intent
        if document.get("type") != "plan_maintenance":
            raise UserError(f"plan request {path} is a {document.get('type')!r} intent, not plan_maintenance",
                            "give a plan_maintenance intent, or its spec alone", exit_code=EXIT_USAGE)
        requested_at = parse_time(document.get("requested_at"))
        document = document["spec"]
    try:
        return PlanMaintenanceSpec.model_validate(document), requested_at
    except ValidationError as error:
        raise UserError(f"plan request {path} is invalid: {_errors(error)}",
                        "see docs/operators.md, \"Planning GPU node maintenance with the owners\"",
                        exit_code=EXIT_USAGE) from error


def read_az(path: str) -> AZ:
    try:
        return AZ.model_validate(_read_json(path, "AZ"))
    except ValidationError as error:
        raise UserError(f"AZ {path} is invalid: {_errors(error)}",
                        "see docs/operators.md, \"Planning GPU node maintenance with the owners\"",
                        exit_code=EXIT_USAGE) from error


def _refused(message: str) -> UserError:
    return UserError(message, "fix the plan request or the AZ", exit_code=EXIT_USAGE)


def _vm(vm: AZVM) -> GPUVM:
    owner = vm.owner or (f"project:{vm.project}" if vm.project else None)
    if owner is None:
        raise _refused(f"VM {vm.namespace}/{vm.name} has neither an owner nor a project: nobody would be told")
    if any(count < 1 for count in vm.gpus.values()):
        raise _refused(f"VM {vm.namespace}/{vm.name} holds no card of a class it names")
    return GPUVM(uid=vm.uid or f"{vm.namespace}/{vm.name}", name=vm.name, namespace=vm.namespace, owner=owner,
                 gpus=dict(vm.gpus), run_strategy=vm.run_strategy, after_maintenance=vm.after_maintenance,
                 project=vm.project)


def _held(node: AZNode) -> dict[str, int]:
    held: dict[str, int] = {}
    for vm in node.vms:
        for gpu_class, count in vm.gpus.items():
            held[gpu_class] = held.get(gpu_class, 0) + count
    for gpu_class, count in held.items():
        if count > node.cards.get(gpu_class, 0):
            raise _refused(f"the VMs on node {node.name} hold {count} {gpu_class} cards; "
                           f"it has {node.cards.get(gpu_class, 0)}")
    return held


def request_of(spec: PlanMaintenanceSpec, az: AZ, published: datetime) -> MaintenanceRequest:
    """The planner's request: the nodes the spec names or selects, the other schedulable
    nodes' free cards, the spec's window, limit, duration and notice."""
    by_name: dict[str, AZNode] = {}
    for node in az.nodes:
        if node.name in by_name:
            raise _refused(f"node {node.name} is twice in the AZ")
        by_name[node.name] = node
    if spec.nodes is not None:
        unknown = sorted(set(spec.nodes) - set(by_name))
        if unknown:
            raise _refused(f"node(s) {', '.join(unknown)} are not in the AZ")
        chosen = set(spec.nodes)
    else:
        selector = spec.node_selector or {}
        chosen = {node.name for node in az.nodes
                  if all(node.labels.get(key) == value for key, value in selector.items())}
        if not chosen:
            raise _refused(f"no node of the AZ has the labels {json.dumps(selector, sort_keys=True)}")
    planned, others = [], []
    for node in az.nodes:
        held = _held(node)
        if node.name in chosen:
            planned.append(PlannedNode(node.name, dict(node.cards), tuple(_vm(vm) for vm in node.vms)))
        elif node.schedulable:
            free = {c: n - held.get(c, 0) for c, n in node.cards.items() if n > held.get(c, 0)}
            others.append(OtherNode(node.name, free))
    uids = [vm.uid for node in planned for vm in node.vms]
    if len(set(uids)) != len(uids):
        raise _refused("a VM is named twice in the AZ")
    try:
        return MaintenanceRequest(
            nodes=tuple(planned), others=tuple(others),
            earliest_start=spec.earliest_start, latest_end=spec.latest_end, concurrency=spec.concurrency,
            duration=timedelta(seconds=spec.node_duration_seconds), notice=timedelta(seconds=spec.notice_seconds),
            published=published,
        )
    except ValueError as error:
        raise _refused(str(error)) from error


def az_document(request: MaintenanceRequest,
                labels: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, Any]:
    """The AZ of ``request`` as ``--az`` reads it: the planned nodes with their VMs, the other
    nodes with their free cards (``labels``: by node name)."""
    labels = labels or {}

    def vm(v: GPUVM) -> dict[str, Any]:
        out: dict[str, Any] = {"namespace": v.namespace, "name": v.name, "uid": v.uid, "owner": v.owner,
                               "gpus": dict(v.gpus), "run_strategy": v.run_strategy,
                               "after_maintenance": v.after_maintenance}
        if v.project:
            out["project"] = v.project
        return out

    nodes = [{"name": n.name, "labels": dict(labels.get(n.name, {})), "cards": dict(n.capacity),
              "vms": [vm(v) for v in n.vms]} for n in request.nodes]
    nodes += [{"name": o.name, "labels": dict(labels.get(o.name, {})), "cards": dict(o.free), "vms": []}
              for o in request.others]
    return {"nodes": nodes}


def spec_document(request: MaintenanceRequest, plan: str = "what-if", reason: str = "what-if") -> dict[str, Any]:
    """The ``plan_maintenance`` spec of ``request``, its nodes by name."""
    return {"plan": plan, "reason": reason, "nodes": [node.name for node in request.nodes],
            "earliest_start": _iso(request.earliest_start), "latest_end": _iso(request.latest_end),
            "concurrency": request.concurrency, "node_duration_seconds": int(request.duration.total_seconds()),
            "notice_seconds": int(request.notice.total_seconds())}


# ------------------------------------------------------------------------------ the output


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _seconds(delta: timedelta | None) -> float | None:
    return None if delta is None else delta.total_seconds()


def _totals_json(plan: MaintenancePlan) -> dict[str, Any]:
    totals = plan.totals
    return {
        "duration_seconds": totals.duration.total_seconds(), "start": _iso(totals.start), "end": _iso(totals.end),
        "stopped": totals.stopped, "fates": dict(totals.fates), "waits_for_card": totals.waiting,
        "stopped_twice": totals.stopped_twice, "hours_without_gpu": round(totals.hours_without_gpu, 3),
        "hours_without_gpu_back_on_own_node": round(float(_own_node_hours(plan)), 3),
        "lead_min_seconds": _seconds(totals.lead_min), "lead_median_seconds": _seconds(totals.lead_median),
        "nodes_outside_window": list(totals.outside_window),
    }


def _entry_json(entry: VMEntry) -> dict[str, Any]:
    return {
        "uid": entry.uid, "namespace": entry.namespace, "name": entry.name, "owner": entry.owner,
        "project": entry.project, "node": entry.node, "gpus": dict(entry.gpus), "fate": entry.fate,
        "told_at": _iso(entry.told_at), "stop": _iso(entry.stop), "back_at": _iso(entry.back_at),
        "lands_on": entry.lands_on, "stops": entry.stops, "hours_without_gpu": round(entry.hours_without_gpu, 3),
        "outside_window": entry.outside_window, "reason": entry.reason,
    }


def plan_json(plan: MaintenancePlan) -> dict[str, Any]:
    vms_on = {slot.node: 0 for slot in plan.slots}
    for entry in plan.vms:
        vms_on[entry.node] += 1
    return {
        "totals": _totals_json(plan),
        "slots": [{"node": slot.node, "start": _iso(slot.start), "end": _iso(slot.end),
                   "outside_window": slot.outside_window, "vms": vms_on[slot.node]} for slot in plan.slots],
        "vms": [_entry_json(entry) for entry in plan.vms],
    }


@dataclass(frozen=True, slots=True)
class WhatIf:
    """The plan of a request, and the name-order baseline beside it if asked for."""

    plan_id: str
    request: MaintenanceRequest
    plan: MaintenancePlan
    baseline: MaintenancePlan | None

    def document(self) -> dict[str, Any]:
        request = self.request
        out: dict[str, Any] = {
            "plan": self.plan_id,
            "request": {
                "nodes": [node.name for node in request.nodes], "published": _iso(request.published),
                "earliest_start": _iso(request.earliest_start), "latest_end": _iso(request.latest_end),
                "first_start": _iso(request.start), "concurrency": request.concurrency,
                "node_duration_seconds": int(request.duration.total_seconds()),
                "notice_seconds": int(request.notice.total_seconds()),
                "gpu_vms": sum(len(node.vms) for node in request.nodes),
            },
            "no_wait_guaranteed": no_wait_guaranteed(request),
            "planned": plan_json(self.plan),
        }
        if self.baseline is not None:
            out["name_order"] = plan_json(self.baseline)
        return out


def what_if(spec: PlanMaintenanceSpec, az: AZ, published: datetime, *, compare: bool = False) -> WhatIf:
    request = request_of(spec, az, published)
    return WhatIf(spec.plan, request, plan_maintenance(request),
                  name_order_baseline(request) if compare else None)


def _when(at: datetime | None) -> str:
    return "-" if at is None else at.astimezone(UTC).strftime("%Y-%m-%d %H:%M") + "Z"


def _hours(delta: timedelta | None) -> str:
    return "-" if delta is None else f"{delta.total_seconds() / 3600:,.1f} h"


def table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Columns side by side: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                         for i, cell in enumerate(row)).rstrip()

    return "\n".join([line(header), "  ".join("-" * width for width in widths), *(line(row) for row in body)])


def _own_node_hours(plan: MaintenancePlan) -> float:
    """VM-hours without a GPU of VMs back on their own node at their owner's wish: from the stop
    to the node's return."""
    return sum(entry.hours_without_gpu for entry in plan.vms if entry.fate == "back_on_own_node")


def _totals_rows(plans: Sequence[MaintenancePlan]) -> list[list[str]]:
    totals = [plan.totals for plan in plans]

    def row(label: str, cell: Any) -> list[str]:
        return [label, *(cell(t) for t in totals)]

    return [
        row("duration", lambda t: _hours(t.duration)),
        row("first node goes", lambda t: _when(t.start)),
        row("last node back", lambda t: _when(t.end)),
        row("VMs waiting for a card", lambda t: str(t.waiting)),
        row("VMs stopped twice", lambda t: str(t.stopped_twice)),
        row("VM-hours without a GPU", lambda t: f"{t.hours_without_gpu:,.1f}"),
        ["  of which back on own node", *(f"{_own_node_hours(plan):,.1f}" for plan in plans)],
        row("notice min / median", lambda t: f"{_hours(t.lead_min)} / {_hours(t.lead_median)}"),
        row("nodes outside the window", lambda t: str(len(t.outside_window))),
        ["GPU VMs", *(str(len(plan.vms)) for plan in plans)],
        *(row(f"  {fate}", lambda t, fate=fate: str(t.fates.get(fate, 0))) for fate in FATES),
        row("stops", lambda t: str(t.stopped)),
    ]


def render(result: WhatIf) -> str:
    request, plan = result.request, result.plan
    vms = sum(len(node.vms) for node in request.nodes)
    lines = [
        f"maintenance plan {result.plan_id} (what-if): {len(request.nodes)} nodes, {vms} GPU VMs",
        f"published {_when(request.published)}, notice {_hours(request.notice)}: first node at "
        f"{_when(request.start)}; window {_when(request.earliest_start)} to {_when(request.latest_end)}, "
        f"{request.concurrency} at once, {_hours(request.duration)} per node",
        "no VM waits for a card, guaranteed (docs/maintenance.md, \"The guarantee\"): "
        + ("yes" if no_wait_guaranteed(request) else "no"),
        "",
    ]
    plans = [plan] if result.baseline is None else [plan, result.baseline]
    header = ["", "planned"] if result.baseline is None else ["", "planned", "name order, one by one"]
    lines += [table(header, _totals_rows(plans)), ""]
    vms_on: dict[str, list[VMEntry]] = {slot.node: [] for slot in plan.slots}
    for entry in plan.vms:
        vms_on[entry.node].append(entry)
    lines.append(table(["node", "start", "end", "VMs", "waiting", "window"], [
        [slot.node, _when(slot.start), _when(slot.end), str(len(vms_on[slot.node])),
         str(sum(1 for entry in vms_on[slot.node] if entry.fate == "waits_for_card")),
         "outside" if slot.outside_window else "in"] for slot in plan.slots]))
    lines.append("")
    lines.append(table(["VM", "node", "stop", "fate", "back", "stops", "h without GPU"], [
        [f"{entry.namespace}/{entry.name}", entry.node, _when(entry.stop), entry.fate,
         _when(entry.back_at), str(entry.stops), f"{entry.hours_without_gpu:,.1f}"] for entry in plan.vms]))
    waiting = [entry for entry in plan.vms if entry.fate == "waits_for_card"]
    if waiting:
        lines += ["", "waiting for a card:"]
        lines += [f"  {entry.namespace}/{entry.name}: {entry.reason}" for entry in waiting]
    return "\n".join(lines)


def run(spec_path: str, az_path: str | None, *, at: datetime | None, compare: bool, as_json: bool) -> str:
    """What ``vmstream simulate --maintenance`` prints."""
    if az_path is None:
        raise UserError("--maintenance needs the AZ", "give it with --az FILE", exit_code=EXIT_USAGE)
    spec, requested_at = read_spec(spec_path)
    published = at or requested_at or datetime.now(UTC)
    result = what_if(spec, read_az(az_path), published, compare=compare)
    if as_json:
        return json.dumps(result.document(), indent=2)
    return render(result)

