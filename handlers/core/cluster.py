"""Views of the cluster, folded from watch events: what the rules need of each object.

Each ``*Record`` is built from the whole object the API server served (a pure function of
that object) and keeps only what decisions read. :class:`VMRecord` keeps the VM too, because
a patch is computed against the last observed VM — but only its rule view
(:func:`stored_view`): a GPU patch planned on it is the patch planned on the whole VM, at a
fraction of the memory a whole AZ's VMs would hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from handlers.contracts.messages import vm_key

HOST_PASSTHROUGH = "host-passthrough"
OWNER_ANNOTATION = "vmstream.io/owner"
# What the owner wants of a GPU VM after a planned node maintenance stops it
# (docs/maintenance.md): ``elsewhere`` (the default), ``same_node`` or ``stay_off``.
AFTER_MAINTENANCE_ANNOTATION = "vmstream.io/after-maintenance"
AFTER_MAINTENANCE_CHOICES = ("elsewhere", "same_node", "stay_off")
ENDED_PHASES = frozenset({"Succeeded", "Failed"})


def _get(obj: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _true_condition(conditions: Any, type_: str) -> dict[str, Any] | None:
    for condition in conditions or ():
        if isinstance(condition, dict) and condition.get("type") == type_:
            return condition if condition.get("status") == "True" else None
    return None


def _device_names(entries: Any) -> list[str]:
    return [str(e["deviceName"]) for e in entries or () if isinstance(e, dict) and e.get("deviceName")]


def gpu_set(devices: Any, gpu_names: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The GPUs a domain's ``devices`` pass through, one device name per card, sorted.

    KubeVirt asks the launcher pod for one of a device's resource per entry of ``gpus`` and
    per entry of ``hostDevices`` alike (``WithGPUsDevicePlugins``, ``WithHostDevicesDevicePlugins``
    in pkg/virt-controller/services/renderresources.go): a GPU's device name given as a host
    device takes a card just the same. Every ``gpus`` entry is a GPU; a host device is one
    when its device is a GPU class's (``gpu_names``) — a NIC's virtual function is not.
    """
    if not isinstance(devices, dict):
        return ()
    gpus = _device_names(devices.get("gpus"))
    hosts = [name for name in _device_names(devices.get("hostDevices")) if name in gpu_names]
    return tuple(sorted(gpus + hosts))


def describe_gpus(devices: tuple[str, ...], display: Any = None) -> str:
    """``devices`` in words: "no GPU", "GPU X", "GPUs 2 × X and 1 × Y" (``display`` names a device)."""
    if not devices:
        return "no GPU"
    name = display or (lambda device: device)
    counts: dict[str, int] = {}
    for device in devices:
        counts[device] = counts.get(device, 0) + 1
    if len(devices) == 1:
        return f"GPU {name(devices[0])}"
    return "GPUs " + " and ".join(f"{count} × {name(device)}" for device, count in counts.items())


def after_maintenance(annotations: Any) -> str:
    """The owner's choice in :data:`AFTER_MAINTENANCE_ANNOTATION`; ``elsewhere`` when it is
    absent or names no choice."""
    value = annotations.get(AFTER_MAINTENANCE_ANNOTATION) if isinstance(annotations, dict) else None
    return value if value in AFTER_MAINTENANCE_CHOICES else "elsewhere"


def effective_run_strategy(spec: dict[str, Any]) -> str:
    """``spec.runStrategy``, or the deprecated ``spec.running`` mapped onto it.

    As KubeVirt's ``VirtualMachine.RunStrategy()`` (staging/src/kubevirt.io/api/core/v1/types.go):
    ``running: true`` is Always; ``running: false``, or neither field set, is Halted.
    """
    strategy = spec.get("runStrategy")
    if isinstance(strategy, str):
        return strategy
    running = spec.get("running")
    if running is True:
        return "Always"
    return "Halted"


INSTANCETYPE_KINDS = ("VirtualMachineInstancetype", "VirtualMachineClusterInstancetype")
REVISION_KIND_LABEL = "instancetype.kubevirt.io/object-kind"  # kubevirt.io/api instancetype/register.go
REVISION_NAME_LABEL = "instancetype.kubevirt.io/object-name"


@dataclass(frozen=True, slots=True)
class InstancetypeRevision:
    """An instance type as KubeVirt applies it to a VM's VMIs: the ControllerRevision
    virt-controller stores for the VM (``CreateControllerRevision``, pkg/instancetype/revision/store.go)
    holds the instance type as it was when the VM first referenced it, and every VMI of the
    VM is made from that copy (``specFinder.Find``, pkg/instancetype/find/spec.go; ``ApplyToVMI``,
    pkg/instancetype/apply/vmi.go: its ``gpus`` and ``hostDevices`` go into every VMI). A later
    change to the instance type itself changes nothing for the VM."""

    name: str  # the ControllerRevision's
    vm: str  # the key of the VM that owns it
    kind: str  # VirtualMachineClusterInstancetype or VirtualMachineInstancetype
    instancetype: str  # the instance type's name (the revision's object-name label)
    gpus: tuple[str, ...]  # spec.gpus, device names
    host_devices: tuple[str, ...]  # spec.hostDevices, device names (GPUs or not)
    cpu_model: str | None  # spec.cpu.model: then the VM's own cpu.model is a conflict

    @staticmethod
    def owner(obj: dict[str, Any]) -> str | None:
        """The key of the VM a ControllerRevision belongs to (its controller owner), if any."""
        metadata = obj.get("metadata") or {}
        for ref in metadata.get("ownerReferences") or ():
            if isinstance(ref, dict) and ref.get("kind") == "VirtualMachine" and ref.get("name"):
                return vm_key(metadata.get("namespace") or "default", str(ref["name"]))
        return None

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> InstancetypeRevision | None:
        """The instance type a ControllerRevision holds; None for any other revision."""
        metadata = obj.get("metadata") or {}
        labels = metadata.get("labels") or {}
        data: dict[str, Any] = obj["data"] if isinstance(obj.get("data"), dict) else {}
        kind = labels.get(REVISION_KIND_LABEL) or data.get("kind")
        owner = cls.owner(obj)
        if kind not in INSTANCETYPE_KINDS or owner is None:
            return None
        spec = data.get("spec") or {}
        model = _get(spec, "cpu", "model")
        return cls(
            name=str(metadata["name"]),
            vm=owner,
            kind=str(kind),
            instancetype=str(labels.get(REVISION_NAME_LABEL) or _get(data, "metadata", "name") or ""),
            gpus=tuple(_device_names(spec.get("gpus"))),
            host_devices=tuple(_device_names(spec.get("hostDevices"))),
            cpu_model=model if isinstance(model, str) and model else None,
        )

    def gpu_devices(self, gpu_names: frozenset[str]) -> tuple[str, ...]:
        return tuple(sorted([*self.gpus, *(d for d in self.host_devices if d in gpu_names)]))


def applied_revision(spec: dict[str, Any], status: dict[str, Any]) -> str | None:
    """The ControllerRevision KubeVirt takes a VM's instance type from, as
    ``revisionFinder.Find`` (pkg/instancetype/find/revision.go): ``spec.instancetype.revisionName``,
    else ``status.instancetypeRef.controllerRevisionRef.name`` (for the instance type named)."""
    matcher = spec.get("instancetype")
    if not isinstance(matcher, dict):
        return None
    if matcher.get("revisionName"):
        return str(matcher["revisionName"])
    ref: dict[str, Any] = status["instancetypeRef"] if isinstance(status.get("instancetypeRef"), dict) else {}
    name = _get(ref, "controllerRevisionRef", "name")
    if name and ref.get("name") in (None, matcher.get("name")):
        return str(name)
    return None


@dataclass(frozen=True, slots=True)
class VMRecord:
    key: str
    namespace: str
    name: str
    uid: str
    resource_version: str
    project: str | None
    owner: str | None
    run_strategy: str
    # Every GPU the VM's next VMI gets, one device name per card, sorted: its template's
    # ``gpus``, its template's GPU ``hostDevices`` and its instance type's (:func:`vm_gpu_set`).
    gpu_devices: tuple[str, ...]
    cpu_model: str | None
    printable_status: str | None
    restart_required: bool
    uses_instancetype: bool
    # The VM as the rules read it (stored_view). A row written before it was reduced holds the
    # whole VM: the rules decide the same on either (tests/rules/test_rule_views.py).
    object: dict[str, Any] = field(compare=False, repr=False)
    # The GPUs of the template alone (gpus and GPU hostDevices): what vmstream may change.
    template_gpus: tuple[str, ...] = ()
    # The instance type's share of gpu_devices, or None while the revision KubeVirt applies
    # is not observed: then gpu_devices is not known to be all of them.
    instancetype_gpus: tuple[str, ...] | None = ()
    instancetype_cpu_model: str | None = None  # the instance type's cpu.model, which wins
    # status.runStrategy: what virt-controller last acted on (written when it creates a VMI).
    status_run_strategy: str | None = None
    # A start request waits in status.stateChangeRequests: virt-controller starts a VMI for it.
    start_requested: bool = False
    after_maintenance: str = "elsewhere"  # AFTER_MAINTENANCE_ANNOTATION

    @classmethod
    def from_object(cls, obj: dict[str, Any], *, project_label: str, gpu_names: frozenset[str] = frozenset(),
                    revisions: dict[str, InstancetypeRevision] | None = None) -> VMRecord:
        """The record of a VM; ``revisions`` are its observed instance-type ControllerRevisions."""
        metadata = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        status: dict[str, Any] = obj["status"] if isinstance(obj.get("status"), dict) else {}
        domain = _get(spec, "template", "spec", "domain")
        namespace = metadata.get("namespace") or "default"
        template = gpu_set(_get(domain, "devices"), gpu_names)
        instancetype = vm_instancetype(spec, status, revisions or {})
        from_instancetype = None if instancetype is _UNKNOWN else (
            instancetype.gpu_devices(gpu_names) if isinstance(instancetype, InstancetypeRevision) else ())
        return cls(
            key=vm_key(namespace, metadata["name"]),
            namespace=namespace,
            name=metadata["name"],
            uid=str(metadata.get("uid") or ""),
            resource_version=str(metadata.get("resourceVersion") or ""),
            project=(metadata.get("labels") or {}).get(project_label),
            owner=(metadata.get("annotations") or {}).get(OWNER_ANNOTATION),
            run_strategy=effective_run_strategy(spec),
            gpu_devices=tuple(sorted((*template, *(from_instancetype or ())))),
            cpu_model=_get(domain, "cpu", "model"),
            printable_status=_get(obj, "status", "printableStatus"),
            restart_required=_true_condition(_get(obj, "status", "conditions"), "RestartRequired")
            is not None,
            uses_instancetype=bool(spec.get("instancetype")),
            object=stored_view("VirtualMachine", obj),
            template_gpus=template,
            instancetype_gpus=from_instancetype,
            instancetype_cpu_model=instancetype.cpu_model if isinstance(instancetype, InstancetypeRevision) else None,
            status_run_strategy=status.get("runStrategy") if isinstance(status.get("runStrategy"), str) else None,
            start_requested=any(isinstance(r, dict) and r.get("action") == "Start"
                                for r in status.get("stateChangeRequests") or ()),
            after_maintenance=after_maintenance(metadata.get("annotations")),
        )

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu_devices)

    @property
    def gpus_known(self) -> bool:
        """Whether gpu_devices is every GPU the VM's next VMI gets (its instance type is known)."""
        return self.instancetype_gpus is not None

    def recipients(self) -> list[str]:
        """Who hears about this VM: its recorded owner, else its project's group."""
        if self.owner:
            return [self.owner]
        return [f"project:{self.project}"] if self.project else []


_UNKNOWN = object()


def vm_instancetype(spec: dict[str, Any], status: dict[str, Any],
                    revisions: dict[str, InstancetypeRevision]) -> InstancetypeRevision | None | object:
    """The instance type KubeVirt applies to the VM's VMIs: None when it names none, the
    revision when it is observed, else ``_UNKNOWN``."""
    if not isinstance(spec.get("instancetype"), dict):
        return None
    name = applied_revision(spec, status)
    revision = revisions.get(name) if name else None
    return revision if revision is not None else _UNKNOWN


@dataclass(frozen=True, slots=True)
class VMIRecord:
    key: str  # the VM's key: a VMI is named after its VM
    uid: str
    node: str | None
    phase: str | None
    gpu_devices: tuple[str, ...]
    cpu_model: str | None
    unschedulable: bool
    eviction_requested: bool
    evacuation_node: str | None
    deleting: bool = False  # metadata.deletionTimestamp set: on its way out, whatever its phase

    @classmethod
    def from_object(cls, obj: dict[str, Any], *, gpu_names: frozenset[str] = frozenset()) -> VMIRecord:
        """The record of a VMI; ``gpu_names`` are the GPU classes' devices (:func:`gpu_set`)."""
        metadata = obj.get("metadata") or {}
        status = obj.get("status") or {}
        domain = _get(obj, "spec", "domain")
        conditions = status.get("conditions")
        scheduled = next(
            (c for c in conditions or () if isinstance(c, dict) and c.get("type") == "PodScheduled"),
            None,
        )
        return cls(
            key=vm_key(metadata.get("namespace") or "default", metadata["name"]),
            uid=str(metadata.get("uid") or ""),
            node=status.get("nodeName"),
            phase=status.get("phase"),
            gpu_devices=gpu_set(_get(domain, "devices"), gpu_names),
            cpu_model=_get(domain, "cpu", "model"),
            unschedulable=bool(
                scheduled
                and scheduled.get("status") == "False"
                and scheduled.get("reason") == "Unschedulable"
            ),
            eviction_requested=_true_condition(conditions, "EvictionRequested") is not None,
            evacuation_node=status.get("evacuationNodeName"),
            deleting=bool(metadata.get("deletionTimestamp")),
        )

    @property
    def active(self) -> bool:
        """Holds (or is about to hold) its node's resources: not ended."""
        return self.phase not in ENDED_PHASES


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    gpu_allocatable: dict[str, int]
    unschedulable: bool
    ready: bool
    labels: dict[str, str] = field(default_factory=dict)  # what a maintenance plan's node_selector reads

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> NodeRecord:
        """Extended resources (names with a '/') are kept: devices are looked up by name."""
        allocatable = _get(obj, "status", "allocatable") or {}
        conditions = _get(obj, "status", "conditions")
        gpus: dict[str, int] = {}
        for resource, quantity in allocatable.items():
            if "/" in resource:
                try:
                    gpus[resource] = int(str(quantity))
                except ValueError:
                    continue
        return cls(
            name=obj["metadata"]["name"],
            gpu_allocatable=gpus,
            unschedulable=bool(_get(obj, "spec", "unschedulable")),
            ready=_true_condition(conditions, "Ready") is not None,
            labels={str(k): str(v) for k, v in (_get(obj, "metadata", "labels") or {}).items()},
        )

    @property
    def schedulable(self) -> bool:
        return self.ready and not self.unschedulable


@dataclass(frozen=True, slots=True)
class MaintenanceRecord:
    name: str
    node: str
    reason: str | None
    phase: str | None

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> MaintenanceRecord:
        return cls(
            name=obj["metadata"]["name"],
            node=str(_get(obj, "spec", "nodeName") or ""),
            reason=_get(obj, "spec", "reason"),
            phase=_get(obj, "status", "phase"),
        )


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    """A namespace and the project its label names (None: no project's namespace)."""

    name: str
    project: str | None

    @classmethod
    def from_object(cls, obj: dict[str, Any], *, project_label: str) -> NamespaceRecord:
        project = (_get(obj, "metadata", "labels") or {}).get(project_label)
        return cls(name=obj["metadata"]["name"], project=project if isinstance(project, str) and project else None)


@dataclass(frozen=True, slots=True)
class KubeVirtRecord:
    """What the rules read of the KubeVirt CR's ``spec.configuration``.

    ``permitted_devices`` is None when KubeVirt checks no GPU against a list: as
    ``validatePermittedHostDevices`` (pkg/virt-controller/services/renderresources.go, called
    by ``TemplateService.newResourceRenderer`` when it renders the launcher pod), only when
    ``permittedHostDevices`` is set at all — then a GPU whose ``deviceName`` is no
    ``resourceName`` of its ``pciHostDevices``, ``mediatedDevices`` or ``usb`` makes the VMI
    fail to start — and not under the ``GPUsWithDRA`` feature gate. (The ``GPU`` gate is GA,
    ``HostDevices`` concerns ``hostDevices`` only: docs/kubevirt.md.)
    """

    cpu_model: str | None
    eviction_strategy: str | None
    permitted_devices: tuple[str, ...] | None
    # developerConfiguration.memoryOvercommit (KubeVirt's default 100): the launcher pod of a VM
    # without a memory request requests guest * 100 / memoryOvercommit (``WithMemoryRequests``).
    memory_overcommit: int = 100

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> KubeVirtRecord:
        configuration = _get(obj, "spec", "configuration") or {}
        developer = configuration.get("developerConfiguration") or {}
        gates = developer.get("featureGates") or ()
        permitted = configuration.get("permittedHostDevices")
        devices: tuple[str, ...] | None = None
        if isinstance(permitted, dict) and "GPUsWithDRA" not in gates:
            listed = [entry for kind in ("pciHostDevices", "mediatedDevices", "usb")
                      for entry in permitted.get(kind) or () if isinstance(entry, dict)]
            devices = tuple(sorted({str(d["resourceName"]) for d in listed if d.get("resourceName")}))
        overcommit = developer.get("memoryOvercommit")
        return cls(
            cpu_model=configuration.get("cpuModel"),
            eviction_strategy=configuration.get("evictionStrategy"),
            permitted_devices=devices,
            memory_overcommit=overcommit if isinstance(overcommit, int) and overcommit > 0 else 100,
        )

    def permits(self, device_name: str) -> bool:
        """Whether KubeVirt lets a VMI with this GPU start (see the class docstring)."""
        return self.permitted_devices is None or device_name in self.permitted_devices


@dataclass(frozen=True, slots=True)
class Resident:
    """A GPU VMI on a node, with what a drain needs to know of its VM.

    The node-keyed view of the cluster: VM-keyed decisions publish a resident whenever
    the VM or its VMI changes, so node-keyed decisions (drains) never read VM state that
    lives in another partition.
    """

    key: str  # the VM's key
    vmi_uid: str
    gpu_devices: tuple[str, ...]  # held by the VMI
    evacuating: bool  # EvictionRequested, or evacuationNodeName set
    has_vm: bool
    run_strategy: str | None
    recipients: tuple[str, ...]
    project: str | None
    template_gpus: tuple[str, ...]  # what the VM comes back with: its whole GPU set
    vm_uid: str = ""  # which VM of that name: one deleted and made again is another VM
    after_maintenance: str = "elsewhere"  # its owner's choice for a planned maintenance


def next_gpus(vm: VMRecord, vmi: VMIRecord | None) -> tuple[str, ...]:
    """The GPUs the VM's next VMI gets: its whole set (template and instance type); while its
    instance type is not observed, those its VMI has (made from that instance type)."""
    if vm.gpus_known or vmi is None:
        return vm.gpu_devices
    return vmi.gpu_devices


def resident_of(vm: VMRecord | None, vmi: VMIRecord | None) -> tuple[str, Resident] | None:
    """Where (node, resident) the VMI holds GPUs, or None when it holds none."""
    if vmi is None or not vmi.active or not vmi.gpu_devices or not vmi.node:
        return None
    return vmi.node, Resident(
        key=vmi.key,
        vmi_uid=vmi.uid,
        gpu_devices=vmi.gpu_devices,
        evacuating=vmi.eviction_requested or bool(vmi.evacuation_node),
        has_vm=vm is not None,
        run_strategy=vm.run_strategy if vm else None,
        recipients=tuple(vm.recipients()) if vm else (),
        project=vm.project if vm else None,
        template_gpus=next_gpus(vm, vmi) if vm else (),
        vm_uid=vm.uid if vm else "",
        after_maintenance=vm.after_maintenance if vm else "elsewhere",
    )


@dataclass(frozen=True, slots=True)
class Claim:
    """A GPU VM a drain of a node stops (or stopped) and KubeVirt starts again by itself: it
    will want its cards elsewhere from its deadline on, until it is seen back or off."""

    vm: str  # its key
    due: datetime  # its deadline
    gpus: tuple[str, ...]  # the cards it wants, one device name each


@dataclass(frozen=True, slots=True)
class UsageVM:
    """A GPU VM as a maintenance plan reads it off its node's usage (cluster-wide)."""

    key: str  # vm/<ns>/<name>
    vm_uid: str
    gpus: tuple[str, ...]  # the cards it comes back with, one device name each
    run_strategy: str | None
    recipients: tuple[str, ...]  # its owner, or its project's group
    project: str | None
    after_maintenance: str = "elsewhere"

    @classmethod
    def of(cls, resident: Resident) -> UsageVM:
        return cls(resident.key, resident.vm_uid, resident.template_gpus or resident.gpu_devices,
                   resident.run_strategy, resident.recipients, resident.project, resident.after_maintenance)


@dataclass(frozen=True, slots=True)
class NodeUsage:
    """One node's GPU cards: what it offers and what its residents hold — and, while it is
    drained, the cards its GPU VMs will want elsewhere (``claims``).

    Kept per node by the node's own decisions and read cluster-wide (capacity, and every
    other drain's promises: a card is promised once across the AZ).
    """

    node: str
    schedulable: bool
    allocatable: dict[str, int]
    held: dict[str, int]
    claims: tuple[Claim, ...] = ()
    # What a maintenance plan reads of the node (handlers/rules/plans.py): its GPU VMs that
    # have a VM, by key, and its labels (a plan's node_selector).
    vms: tuple[UsageVM, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)

    def free(self, device_name: str) -> int:
        if not self.schedulable:
            return 0
        return max(0, self.allocatable.get(device_name, 0) - self.held.get(device_name, 0))


# What the rules read of each kind's object: the records above, and for a VM the paths
# handlers/rules/gpus.py computes its patch from (the domain, the eviction strategy, the
# annotations). A watch event too large for Kafka is published with only these
# (:func:`rule_view`); tests/rules/test_rule_views.py checks that every rule decides the same.
RULE_PATHS: dict[str, tuple[tuple[str, ...], ...]] = {
    "VirtualMachine": (
        ("spec", "runStrategy"),
        ("spec", "running"),
        ("spec", "instancetype"),
        ("spec", "preference"),
        ("spec", "template", "spec", "domain"),
        ("spec", "template", "spec", "evictionStrategy"),
        ("status", "printableStatus"),
        ("status", "conditions"),
        ("status", "instancetypeRef"),
        ("status", "runStrategy"),
        ("status", "stateChangeRequests"),
    ),
    "VirtualMachineInstance": (
        ("spec", "domain"),
        ("status", "nodeName"),
        ("status", "phase"),
        ("status", "conditions"),
        ("status", "evacuationNodeName"),
    ),
    "Node": (("spec", "unschedulable"), ("status", "allocatable"), ("status", "conditions")),
    "NodeMaintenance": (("spec", "nodeName"), ("spec", "reason"), ("status", "phase")),
    "KubeVirt": (("spec", "configuration"),),
    "Namespace": (),  # its project label: kept with the metadata
    "ControllerRevision": (
        ("data", "kind"),
        ("data", "metadata", "name"),
        ("data", "spec", "gpus"),
        ("data", "spec", "hostDevices"),
        ("data", "spec", "cpu", "model"),
    ),
}
# Kept for every kind: identity, labels and annotations (bounded by the API server to 256 KiB).
KEPT_FOR_EVERY_KIND: tuple[tuple[str, ...], ...] = (("apiVersion",), ("kind",), ("metadata",))


def rule_view(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` reduced to what the rules read of ``kind`` (a copy; nested values shared).

    The maps on the way to each path are kept when ``obj`` has them, even when the path's
    own value is absent: a GPU patch that creates ``.../domain/cpu`` adds it under the same
    parent on the view as on the whole object, so the two patches are the same.
    """
    return _reduced(obj, _VIEW_TREES.get(kind, _ALWAYS_TREE))


PathTree = dict[str, "PathTree | None"]  # None: a path ends here, its whole value is kept


def path_tree(paths: tuple[tuple[str, ...], ...]) -> PathTree:
    """``paths`` as one tree of keys, in the order they first appear: each object is walked
    once, not once per path (every VM's view is taken on each of its events)."""
    tree: PathTree = {}
    for path in paths:
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if child is None:
                raise ValueError(f"path {path}: a prefix of it is kept whole")
            node = child
        if node.get(path[-1]) is not None:
            raise ValueError(f"path {path}: kept whole, and some of it by another path")
        node[path[-1]] = None
    return tree


def _reduced(obj: dict[str, Any], tree: PathTree) -> dict[str, Any]:
    view: dict[str, Any] = {}
    for key, subtree in tree.items():
        value = obj.get(key)
        if subtree is None:
            if value is not None:
                view[key] = value
        elif isinstance(value, dict):
            view[key] = _reduced(value, subtree)
    return view


_ALWAYS_TREE = path_tree(KEPT_FOR_EVERY_KIND)
_VIEW_TREES = {kind: path_tree((*KEPT_FOR_EVERY_KIND, *paths)) for kind, paths in RULE_PATHS.items()}


def stored_view(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """:func:`rule_view` as a row keeps it: the rest of the object is left to be freed."""
    return rule_view(kind, obj)
