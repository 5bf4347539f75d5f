"""A GPU node maintenance plan as data: what the plan is given, what it decides for each node
and each GPU VM, and the row vmstream keeps of a plan being carried out.

The plan is made by handlers/rules/maintenance.py (``plan_maintenance``); these are the
values it reads and writes, kept here so a table can hold them (handlers/core/tables.py).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

AfterMaintenance = Literal["elsewhere", "same_node", "stay_off"]
Fate = Literal["lands_elsewhere", "back_on_own_node", "stays_off", "waits_for_card"]
FATES: tuple[Fate, ...] = ("lands_elsewhere", "back_on_own_node", "stays_off", "waits_for_card")


@dataclass(frozen=True, slots=True)
class GPUVM:
    """A GPU VM running on a planned node: what the plan needs to know of it."""

    uid: str
    name: str
    namespace: str
    owner: str  # who is told: its owner, or its project's recipients
    gpus: Mapping[str, int]  # cards by GPU class, all on one node (one launcher pod)
    run_strategy: str
    after_maintenance: AfterMaintenance = "elsewhere"
    project: str | None = None  # the project it belongs to: a tenant sees only its own

    @property
    def cards(self) -> int:
        return sum(self.gpus.values())


@dataclass(frozen=True, slots=True)
class PlannedNode:
    """A node to maintain: its cards by class, and the GPU VMs holding some of them."""

    name: str
    capacity: Mapping[str, int]
    vms: tuple[GPUVM, ...]

    @property
    def used(self) -> Counter[str]:
        used: Counter[str] = Counter()
        for vm in self.vms:
            used.update(vm.gpus)
        return used

    @property
    def free(self) -> dict[str, int]:
        used = self.used
        return {gpu_class: count - used[gpu_class] for gpu_class, count in self.capacity.items()
                if count > used[gpu_class]}


@dataclass(frozen=True, slots=True)
class OtherNode:
    """A schedulable node outside the plan, with its free cards by class."""

    name: str
    free: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class MaintenanceRequest:
    """What an operator asks for, and the AZ as it is when the plan is made."""

    nodes: tuple[PlannedNode, ...]
    others: tuple[OtherNode, ...]
    earliest_start: datetime
    latest_end: datetime
    concurrency: int  # nodes in maintenance at once, at most
    duration: timedelta  # per node
    notice: timedelta  # owners are told this long before their VM is stopped
    published: datetime  # when the plan is made (and its first notices could go)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("a maintenance plan needs a concurrency of at least one node")
        if self.duration <= timedelta(0):
            raise ValueError("a node's maintenance takes some time")
        if len({node.name for node in self.nodes}) != len(self.nodes):
            raise ValueError("a node is planned once")

    @property
    def start(self) -> datetime:
        """The first moment a node may go: owners get their full notice before it."""
        return max(self.earliest_start, self.published + self.notice)

    def node(self, name: str) -> PlannedNode:
        return next(node for node in self.nodes if node.name == name)


@dataclass(frozen=True, slots=True)
class NodeSlot:
    node: str
    start: datetime
    end: datetime
    outside_window: bool  # the operator's window does not hold it: said so before the plan starts


@dataclass(frozen=True, slots=True)
class VMEntry:
    """What becomes of one GPU VM, as its owner is told."""

    uid: str
    name: str
    namespace: str
    owner: str
    node: str
    gpus: Mapping[str, int]
    told_at: datetime
    stop: datetime
    fate: Fate
    reason: str
    back_at: datetime | None  # running again with its cards (None: off, or no card within the plan)
    lands_on: str | None = None  # the node its card is reserved on (not told: the scheduler places it)
    stops: int = 1  # more than one: it landed on a node that was drained later
    outside_window: bool = False
    hours_without_gpu: float = 0.0  # meant to run again: from each stop until it runs with its cards
    project: str | None = None

    @property
    def notice(self) -> tuple[object, ...]:
        """What the owner's notice says: a change of any of it is a new notice to them."""
        back = self.back_at if self.fate == "back_on_own_node" else None
        return (self.node, self.stop, self.fate, back, self.outside_window)


@dataclass(frozen=True, slots=True)
class Totals:
    stopped: int  # VM stops, a VM stopped twice counted twice
    fates: Mapping[Fate, int]
    stopped_twice: int
    hours_without_gpu: float  # of VMs meant to run again: from each stop until they run with their cards
    lead_min: timedelta | None  # owners' notice before their VM's first stop
    lead_median: timedelta | None
    start: datetime | None
    end: datetime | None
    outside_window: tuple[str, ...]  # nodes

    @property
    def duration(self) -> timedelta:
        return self.end - self.start if self.start and self.end else timedelta(0)

    @property
    def waiting(self) -> int:
        return self.fates.get("waits_for_card", 0)


@dataclass(frozen=True, slots=True)
class MaintenancePlan:
    request: MaintenanceRequest
    slots: tuple[NodeSlot, ...]  # by start, then node
    vms: tuple[VMEntry, ...]  # by stop, then uid
    early: Mapping[str, datetime] = field(default_factory=dict)  # VMs stopped before their node goes
    ready: frozenset[str] = frozenset()  # VMs whose owner said "now"

    @property
    def totals(self) -> Totals:
        return totals_of(self.slots, self.vms)

    def slot(self, node: str) -> NodeSlot:
        return next(slot for slot in self.slots if slot.node == node)

    def entry(self, uid: str) -> VMEntry:
        return next(entry for entry in self.vms if entry.uid == uid)


def totals_of(slots: tuple[NodeSlot, ...], vms: tuple[VMEntry, ...]) -> Totals:
    leads = sorted(entry.stop - entry.told_at for entry in vms)
    fates = Counter(entry.fate for entry in vms)
    return Totals(
        stopped=sum(entry.stops for entry in vms),
        fates={fate: fates[fate] for fate in FATES},
        stopped_twice=sum(1 for entry in vms if entry.stops > 1),
        hours_without_gpu=sum(entry.hours_without_gpu for entry in vms),
        lead_min=leads[0] if leads else None,
        lead_median=statistics.median_low(leads) if leads else None,
        start=min((slot.start for slot in slots), default=None),
        end=max((slot.end for slot in slots), default=None),
        outside_window=tuple(slot.node for slot in slots if slot.outside_window),
    )


NodePhase = Literal["planned", "draining", "back"]


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """A maintenance plan being carried out: the plan as last told, and where each node is."""

    plan_id: str
    plan: MaintenancePlan
    requested_by: str
    reason: str
    cause: str  # the intent that made it
    phases: dict[str, NodePhase] = field(default_factory=dict)  # node → where it is
    told: dict[str, int] = field(default_factory=dict)  # VM uid → notices its owner was told
    cancelled: bool = False
    recipients: dict[str, tuple[str, ...]] = field(default_factory=dict)  # VM uid → who is told about it
    # Nodes whose slot came while the concurrency limit was full (a node in maintenance not
    # back by its slot's end): they go once a node is back.
    held: tuple[str, ...] = ()
    # Node in maintenance → the VMs vmstream starts on it once it is back (namespace, name, uid).
    to_start: dict[str, tuple[tuple[str, str, str], ...]] = field(default_factory=dict)
    stopped_early: tuple[str, ...] = ()  # VM uids vmstream stopped before their node went (plan.early)

    def next_step(self) -> datetime | None:
        """When a node of the plan is next due to go: the earliest slot start of a node still
        planned and not held (None: nothing to start by the clock)."""
        if self.cancelled:
            return None
        starts = [slot.start for slot in self.plan.slots
                  if self.phases.get(slot.node, "planned") == "planned" and slot.node not in self.held]
        starts += self.early_stops().values()
        return min(starts, default=None)

    def early_stops(self) -> dict[str, datetime]:
        """The VMs to stop before their node goes (an owner's "ready now", a VM moved
        earlier), not stopped yet, by uid: their node is still to go."""
        return {uid: at for uid, at in self.plan.early.items() if uid not in self.stopped_early
                and self.phases.get(self.plan.entry(uid).node, "planned") == "planned"
                and at < self.plan.slot(self.plan.entry(uid).node).start}

    def due(self, now: datetime) -> list[str]:
        """The nodes whose slot has started by ``now`` and that are still to go, by slot."""
        if self.cancelled:
            return []
        return [slot.node for slot in self.plan.slots if slot.start <= now and slot.node not in self.held
                and self.phases.get(slot.node, "planned") == "planned"]
