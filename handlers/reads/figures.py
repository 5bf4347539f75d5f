"""What an operator watches, counted from the state: GPUs free and used per class, VMs waiting
for a card or a restart, open drains and their deadlines.

    state (one worker's rows, or every partition's) → :func:`figures` → :class:`Figures`
    → the worker's gauges (streams/worker/gauges.py)

Pure: the shell decides which rows it hands over. A worker hands over the rows of the
partitions it owns, so its figures are its share of the AZ, and the AZ's are the sum over
every worker (docs/operators.md, "Metrics"); a class with no card in those rows still shows
with zeros, so every worker names every configured class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from handlers.core.catalog import Catalog
from handlers.core.cluster import next_gpus
from handlers.core.state import StateView
from handlers.core.tables import DRAINS, RESIDENTS, TRACKING, USAGE, VMIS, VMS
from handlers.rules.availability import waiting_for_gpu, wanted_gpus
from handlers.rules.capacity import Capacity, capacity
from handlers.rules.drains import in_scope
from handlers.rules.restarts import change_pending

NO_GPU = "none"  # the class a pending change names when it takes the GPU away


@dataclass(frozen=True, slots=True)
class ClassFigures:
    """One GPU class (or an undefined one, by its device) in the rows counted."""

    class_id: str  # the class's id, or the device's name for a device no class names
    device_name: str
    capacity: Capacity
    waiting_for_gpu: int  # VMs of the class whose VMI waits for a card (ErrorUnschedulable)
    pending_restart: int  # VMs whose change to this class applies after their next restart


@dataclass(frozen=True, slots=True)
class DrainFigures:
    """One open drain (not completed)."""

    node: str
    source: str  # intent, maintenance, eviction
    scope: str  # node, evictions
    started_at: datetime
    deadline: datetime
    deadline_passed: bool  # vmstream stopped what was left at the deadline
    vms_left: int  # GPU VMIs of the drain still on the node


@dataclass(frozen=True, slots=True)
class Figures:
    classes: tuple[ClassFigures, ...]
    pending_without_gpu: int  # VMs whose change removes their GPU, waiting for a restart
    drains: tuple[DrainFigures, ...]


def _class_id(catalog: Catalog, device: str) -> str:
    return catalog.for_device(device).id or device


def figures(state: StateView, catalog: Catalog, *, tracked: Iterable[str] | None = None) -> Figures:
    """The figures of the rows ``state`` holds. ``tracked``: the keys of the ``tracking``
    table when the caller has them at hand (a VM that waits for a card or a restart has a
    row there, its owner being told once), else read from ``state``."""
    devices = {d for usage in state.values(USAGE) for d in usage.allocatable} | set(catalog.by_device)
    waiting: Counter[str] = Counter()
    pending: Counter[str] = Counter()
    keys = [key for key, _ in state.items(TRACKING)] if tracked is None else tracked
    for key in keys:
        vm = state.get(VMS, key)
        if vm is None:
            continue
        vmi = state.get(VMIS, key)
        if waiting_for_gpu(vm, vmi):
            waiting.update(set(wanted_gpus(vm, vmi)))  # the set the console shows (handlers/reads/views.py)
            continue
        wanted = set(next_gpus(vm, vmi))
        tracking = state.get(TRACKING, key)
        if change_pending(vm, vmi) or (tracking is not None and tracking.pending_episode is not None):
            pending.update(wanted or {NO_GPU})
    devices |= set(waiting) | (set(pending) - {NO_GPU})
    classes = tuple(
        ClassFigures(_class_id(catalog, device), device, capacity(state, device), waiting[device], pending[device])
        for device in sorted(devices))
    drains = []
    for episode in state.values(DRAINS):
        if episode.completed:
            continue
        residents = state.get(RESIDENTS, episode.node) or {}
        drains.append(DrainFigures(
            episode.node, episode.source, episode.scope, episode.started_at, episode.deadline,
            episode.deadline_passed, len(in_scope(episode, list(residents.values())))))
    return Figures(classes, pending[NO_GPU], tuple(sorted(drains, key=lambda d: d.node)))
