"""What a console shows, computed from the worker's tables: the read API's answers.

worker tables (changelogs, every partition) → ``vmstream api`` (streams/serve/api.py) → these
functions → a response model. Pure: the state is passed in (a
:class:`~handlers.core.state.StateView`), nothing is read from Kafka or the clock here, so any
replica holding the same rows gives the same answer.

- :func:`gpu_classes`: the AZ's GPU classes with their cards (``capacity_report``);
- :func:`vm_badge`: a VM's GPU now (its running VMI), after its next restart (its template),
  and what it waits for — a restart (``change_pending``, handlers/rules/restarts.py) or a free
  card (``waiting_for_gpu``, handlers/rules/availability.py);
- :func:`project_view`: a project's VMs that wait, and the drains its owners were warned of.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from handlers.contracts.messages import GPUClassStatus, vm_key
from handlers.core.catalog import Catalog
from handlers.core.cluster import next_gpus
from handlers.core.state import DrainEpisode, DrainOutcome, ObservedFate, StateView, tracking_of
from handlers.core.tables import DRAINS, NAMESPACES, VMIS, VMS
from handlers.rules.availability import waiting_for_gpu
from handlers.rules.capacity import capacity_report
from handlers.rules.restarts import change_pending

WaitsFor = Literal["restart", "gpu"]
BADGES: dict[WaitsFor, str] = {"restart": "(applies after restart)", "gpu": "(waiting for a free GPU)"}


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GPUClassList(_Model):
    az: str
    classes: list[GPUClassStatus]


class GPURef(_Model):
    class_id: str | None
    display_name: str
    device_name: str


class VMBadge(_Model):
    """A VM's GPU now and after its next restart, and what it waits for."""

    namespace: str
    name: str
    project: str | None
    run_strategy: str
    running: bool = Field(description="A VMI that has not ended exists")
    node: str | None = Field(description="The node its VMI runs on")
    gpus_now: list[GPURef] = Field(description="The GPUs of its running VMI, one per card: gpus and GPU "
                                   "hostDevices (none when it does not run)")
    gpus_after_restart: list[GPURef] = Field(description="The GPUs its next VMI gets, one per card: its "
                                             "template's gpus and GPU hostDevices and its instance type's")
    waits_for: WaitsFor | None = Field(description="restart: a GPU change applies after the next restart; "
                                                   "gpu: it waits for a free card of its class")
    badge: str | None = Field(description="What a console shows beside the GPU, e.g. '(applies after restart)'")
    owner_told: bool = Field(description="The owner was notified of what it waits for")


class DrainedVM(_Model):
    vm: str = Field(description="vm/<namespace>/<name>")
    outcome: DrainOutcome = Field(description="What the owner was told will happen after the stop")
    stopped: bool = Field(description="vmstream deleted its VMI at the deadline")
    observed: ObservedFate | None = Field(description="What became of it after the stop, once observed")


class ProjectDrain(_Model):
    node: str
    reason: str
    source: str
    scope: str
    started_at: datetime
    deadline: datetime
    deadline_passed: bool
    vms: list[DrainedVM] = Field(description="This project's GPU VMs announced in the drain")


class ProjectView(_Model):
    project: str
    pending: list[VMBadge] = Field(description="Its VMs that wait for a restart or for a free card")
    drains: list[ProjectDrain] = Field(description="Open drains that announced a stop to one of its VMs")


def gpu_classes(state: StateView, catalog: Catalog, *, az: str) -> GPUClassList:
    """Every configured class, plus devices seen on nodes that no class maps to, by name."""
    classes = [
        GPUClassStatus.model_validate({"name": name, "in_use": row["used"],
                                       **{field: value for field, value in row.items() if field != "used"}})
        for name, row in capacity_report(state, catalog).items()
    ]
    return GPUClassList(az=az, classes=sorted(classes, key=lambda c: c.name))


def _refs(catalog: Catalog, devices: tuple[str, ...]) -> list[GPURef]:
    return [GPURef(class_id=gpu.id, display_name=gpu.display_name, device_name=gpu.device_name)
            for gpu in (catalog.for_device(device) for device in devices)]


def project_of(state: StateView, namespace: str) -> str | None:
    """The project a namespace belongs to, by its label (the ``namespaces`` table)."""
    record = state.get(NAMESPACES, namespace)
    return record.project if record else None


def vm_badge(state: StateView, catalog: Catalog, namespace: str, name: str) -> VMBadge | None:
    """The badge of VM ``namespace/name``; None when no such VM was observed."""
    key = vm_key(namespace, name)
    vm = state.get(VMS, key)
    if vm is None:
        return None
    vmi = state.get(VMIS, key)
    tracking = tracking_of(state, key)
    running = vmi is not None and vmi.active
    waits_for: WaitsFor | None = None
    if waiting_for_gpu(vm, vmi):
        waits_for = "gpu"
    elif change_pending(vm, vmi) or tracking.pending_episode is not None:
        # Told as soon as set_gpu is accepted; the template shows the new GPU once the
        # applier's patch is observed.
        waits_for = "restart"
    told = {"gpu": tracking.unavailable_episode, "restart": tracking.pending_episode}
    return VMBadge(
        namespace=vm.namespace,
        name=vm.name,
        project=vm.project or project_of(state, vm.namespace),
        run_strategy=vm.run_strategy,
        running=running,
        node=vmi.node if running and vmi is not None else None,
        gpus_now=_refs(catalog, vmi.gpu_devices) if running and vmi is not None else [],
        gpus_after_restart=_refs(catalog, next_gpus(vm, vmi)),
        waits_for=waits_for,
        badge=BADGES[waits_for] if waits_for else None,
        owner_told=waits_for is not None and told[waits_for] is not None,
    )


def _split(key: str) -> tuple[str, str]:
    _, namespace, name = key.split("/", 2)
    return namespace, name


def project_view(state: StateView, catalog: Catalog, project: str, *, tracked: list[str]) -> ProjectView:
    """What waits in ``project`` and the open drains that warned its owners.

    ``tracked`` are the keys of the ``tracking`` table: a VM that waits for a restart or a
    card has a row there (its owner is told once), so only those VMs are read.
    """
    pending = []
    for key in sorted(tracked):
        badge = vm_badge(state, catalog, *_split(key))
        if badge is not None and badge.project == project and badge.waits_for is not None:
            pending.append(badge)
    drains = []
    episodes: list[DrainEpisode] = sorted(state.values(DRAINS), key=lambda e: e.node)
    for episode in episodes:
        if episode.completed:
            continue
        mine = sorted(key for key, (vm_project, _) in episode.warned.items() if vm_project == project)
        if not mine:
            continue
        drains.append(ProjectDrain(
            node=episode.node, reason=episode.reason, source=episode.source, scope=episode.scope,
            started_at=episode.started_at, deadline=episode.deadline, deadline_passed=episode.deadline_passed,
            vms=[DrainedVM(vm=key, outcome=episode.announced[key], stopped=key in episode.stopped,
                           observed=episode.observed.get(key)) for key in mine if key in episode.announced],
        ))
    return ProjectView(project=project, pending=pending, drains=drains)
