"""The wire contracts: every message vmstream reads or writes, as pydantic models.

These models *are* docs/contracts.md in code; the JSON Schemas and the AsyncAPI document in
``docs/`` are generated from them (``vmstream schemas``). Changes must stay additive.

Flow: raw bytes → :func:`parse_intent` / :func:`parse_watch_event` → handlers →
:class:`Command`, :class:`Notification`, :class:`AuditRecord`, :class:`DeadLetter`.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Union, get_args

import pydantic_core
from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# ------------------------------------------------------------------------------ limits
# Every field a message carries is bounded, so that every output fits the broker's message
# limit whatever the input (docs/worker.md, "Bad input"). Identifiers and names beyond their
# bound make a message invalid; free text (reasons, errors, messages) is cut to its bound.
KEY_MAX = 512  # a Kafka key, in characters: vm/<ns>/<name>, node/<name>, <Kind>/<ns>/<name>
NAME_MAX = 253  # a Kubernetes object's name (a DNS-1123 subdomain); a node's name
KIND_MAX = 63  # a Kubernetes kind
ID_MAX = 256  # intent_id, event_id; the ids vmstream makes are shorter
CAUSE_MAX = 512  # a command's cause: an intent id, an event id, deadline/<node>/<episode>
TYPE_MAX = 64  # an intent's type as sent, before it is known to be one of INTENT_TYPES
TOPIC_MAX = 249  # Kafka's own limit on a topic's name
CLASS_MAX = 253  # a GPU class id
IMAGE_MAX = 1024  # a container image reference
REASON_MAX = 1024  # a reason given in an intent (drain, undrain)
TEXT_MAX = 4096  # free text vmstream writes: reasons, errors, notification messages
RECIPIENTS_MAX = 256  # principals one notification is addressed to
ORIGINAL_PREFIX_BYTES = 16384  # of a dead letter's original, the rest named by size and digest
ORIGINAL_MAX = 21848  # the prefix as text: 16,384 UTF-8 characters or its base64 (4 * ceil(16384 / 3))


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the cut marked with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clipped(limit: int) -> Any:
    def cut(value: Any) -> Any:
        return clip(value, limit) if isinstance(value, str) else value

    return BeforeValidator(cut)


# Free text, cut to TEXT_MAX characters where it is made: the schemas say maxLength.
Text = Annotated[str, _clipped(TEXT_MAX), Field(json_schema_extra={"maxLength": TEXT_MAX})]
Recipient = Annotated[str, Field(max_length=256)]  # a principal (PRINCIPAL_MAX)
OutputId = Annotated[str, Field(max_length=ID_MAX)]

RunStrategy = Literal["Always", "RerunOnFailure", "Manual", "Halted", "Once"]
Cores = Literal[1, 2, 4, 8, 16, 32]
MemoryGiB = Literal[1, 2, 4, 8, 16, 32, 64]
Preference = Literal["linux", "windows"]
Severity = Literal["info", "warning", "critical"]


class Message(BaseModel):
    """Base of every wire message: unknown fields are kept (additive contracts)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class Spec(BaseModel):
    """Base of intent specs: unknown fields are refused, so typos reach the requester."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _dns1123(value: str) -> str:
    if len(value) > 63 or not DNS1123_LABEL.match(value):
        raise ValueError(
            "must be a DNS-1123 label: at most 63 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit"
        )
    return value


_DNS1123_SCHEMA: dict[str, JsonValue] = {"pattern": DNS1123_LABEL.pattern, "maxLength": 63}

# Kubernetes' label rules: a value (and a key's name part) of at most 63 alphanumerics,
# '-', '_' or '.', starting and ending alphanumeric; a key's prefix is a DNS-1123 subdomain.
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Prefixes Kubernetes and KubeVirt keep for themselves (app.kubernetes.io, the
# recommended labels, is the users').
RESERVED_LABEL_DOMAINS = ("kubernetes.io", "k8s.io", "kubevirt.io")
PRINCIPAL_MAX = 256


def principal_problem(value: str) -> str | None:
    """Why ``value`` cannot name a principal: printable, no whitespace, no control,
    format (bidi) or unassigned characters, at most 256 characters."""
    if not value:
        return "must not be empty"
    if len(value) > PRINCIPAL_MAX:
        return f"at most {PRINCIPAL_MAX} characters"
    # Of the printable characters only the ASCII space is whitespace (every code point checked:
    # tests/rules/test_auth.py), so one look for it replaces a pass per character.
    if not value.isprintable() or " " in value:
        return "no whitespace, control, format (bidi) or unassigned characters"
    return None


def _principal(value: str) -> str:
    if problem := principal_problem(value):
        raise ValueError(f"not a principal: {problem}")
    return value


def label_value_problem(value: str) -> str | None:
    if len(value) > 63 or not LABEL_VALUE.match(value):
        return ("a label value is at most 63 letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit")
    return None


def label_key_problem(key: str, *, reserved: bool = True) -> str | None:
    """Why ``key`` cannot be a label key a user sets; ``reserved=False`` for a key that is
    only read (a node selector's ``kubernetes.io/hostname``)."""
    prefix, _, name = key.rpartition("/")
    if "/" in prefix or (key.count("/") == 1 and not prefix):
        return "a label key is [prefix/]name"
    if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        return "a label key's prefix is a DNS-1123 subdomain of at most 253 characters"
    if reserved and prefix and prefix != "app.kubernetes.io" and any(
            prefix == d or prefix.endswith("." + d) for d in RESERVED_LABEL_DOMAINS):
        return f"label prefix {prefix} is reserved"
    if not name or label_value_problem(name):
        return "a label key's name is 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
    return None


def _project(value: str | None) -> str | None:
    if value is not None and (not value or label_value_problem(value)):
        raise ValueError("a project id is a label value: at most 63 letters, digits, '-', '_' or '.', "
                         "starting and ending with a letter or digit")
    return value


class VMRef(Spec):
    namespace: str = Field(min_length=1, description="The VM's namespace (spx-<project> on Superphenix).",
                           json_schema_extra=_DNS1123_SCHEMA)
    name: str = Field(min_length=1, description="The VM's name, a DNS-1123 label.", json_schema_extra=_DNS1123_SCHEMA)

    _check_namespace = field_validator("namespace")(_dns1123)
    _check_name = field_validator("name")(_dns1123)


# ---------------------------------------------------------------------------- intents


@functools.cache
def _template_parts(template: str) -> tuple[tuple[str, str], ...]:
    """Parsed once per template (the route stage reads a key off every intent): each literal
    text with the field after it ("" at the end)."""
    return tuple((literal, field or "") for literal, field, _, _ in string.Formatter().parse(template))


class DecisionKey(NamedTuple):
    """The key an intent type is decided under, read off its fields by a template:
    ``vm/{spec.namespace}/{spec.name}``, ``node/{spec.node}``, ``project/{project}``.

    Each intent model declares its own (``decided_under``), so that nothing else tells the
    types apart: the engine checks an intent's Kafka key against it, the route stage routes
    by it, the CLI sends under it (docs/worker.md, "Decision keys"). A decision sees the rows
    written under its key and the cluster-wide tables (handlers/core/tables.py), so the key says
    what state the intent's rule may read.
    """

    template: str

    @property
    def fields(self) -> tuple[str, ...]:
        """The dotted paths the template reads: ``spec.namespace``, ``project``."""
        return tuple(field for _, field in _template_parts(self.template) if field)

    @property
    def pattern(self) -> str:
        """The key as the contracts show it, each field by its last name: ``vm/<namespace>/<name>``."""
        return "".join(literal + (f"<{field.rsplit('.', 1)[-1]}>" if field else "")
                       for literal, field in _template_parts(self.template))

    def of(self, intent: object) -> str | None:
        """The key of ``intent`` — a parsed intent or its JSON object, not yet validated —
        or None where a field it reads is missing, empty or not a string."""
        parts = []
        for literal, field in _template_parts(self.template):
            parts.append(literal)
            if not field:
                continue
            value: object = intent
            for name in field.split("."):
                value = value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)
            if not isinstance(value, str) or not value:
                return None
            parts.append(value)
        return "".join(parts)


class CreateVMSpec(VMRef):
    cores: Cores = Field(description="vCPU cores, on one socket.")
    memory_gib: MemoryGiB = Field(description="Guest memory in GiB.")
    run_strategy: RunStrategy = Field("Manual", description="KubeVirt run strategy; Manual creates it stopped.")
    preference: Preference = Field("linux", description="The VirtualMachineClusterPreference.")
    image: str = Field(min_length=1, max_length=IMAGE_MAX, description="The container disk image to boot.")
    gpu_class: str | None = Field(None, max_length=CLASS_MAX,
                                  description="A GPU class id of this AZ (case-insensitive).")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels for the VM (Kubernetes "
                                   "label rules; kubernetes.io, k8s.io and kubevirt.io prefixes are reserved).")

    @field_validator("labels")
    @classmethod
    def _label_rules(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if problem := label_key_problem(key):
                raise ValueError(f"label {key!r}: {problem}")
            if problem := label_value_problem(value):
                raise ValueError(f"label {key!r}: {problem}")
        return labels


class SetGPUSpec(VMRef):
    gpu_class: str | None = Field(max_length=CLASS_MAX,
                                  description="A GPU class id of this AZ, or null to remove the GPU (required).")


class RestartVMSpec(VMRef):
    pass


class DrainNodeSpec(Spec):
    node: str = Field(min_length=1, max_length=NAME_MAX, description="The node to drain.")
    reason: str = Field(min_length=1, max_length=REASON_MAX,
                        description="Why; told to every owner whose GPU VM will stop.")
    notice_seconds: int | None = Field(
        default=None, ge=0, le=7 * 24 * 3600, description="Notice before GPU VMs are stopped; default from config."
    )


class UndrainNodeSpec(Spec):
    node: str = Field(min_length=1, max_length=NAME_MAX)
    reason: str | None = Field(None, max_length=REASON_MAX)


PLAN_NODES_MAX = 100  # nodes one maintenance plan names (its row is one changelog record: docs/maintenance.md)
SELECTOR_MAX = 16  # labels a node selector matches
PLAN_DURATION_MAX = 30 * 24 * 3600  # a node's maintenance, in seconds
PLAN_NOTICE_MAX = 90 * 24 * 3600  # owners' notice before a planned stop, in seconds


class PlanRef(Spec):
    plan: str = Field(min_length=1, description="The maintenance plan's id, a DNS-1123 label.",
                      json_schema_extra=_DNS1123_SCHEMA)

    _check_plan = field_validator("plan")(_dns1123)


def _exactly_one(what: str, *present: bool) -> None:
    if sum(present) != 1:
        raise ValueError(f"give exactly one of {what}")


class PlanMaintenanceSpec(PlanRef):
    nodes: list[Annotated[str, Field(min_length=1, max_length=NAME_MAX)]] | None = Field(
        None, min_length=1, max_length=PLAN_NODES_MAX, description="The nodes to maintain (or node_selector).")
    node_selector: dict[str, str] | None = Field(
        None, min_length=1, max_length=SELECTOR_MAX,
        description="The labels the nodes to maintain carry, all of them (or nodes).")
    earliest_start: AwareDatetime = Field(description="No node goes before it.")
    latest_end: AwareDatetime = Field(description="Every node should be back by then; the plan names those "
                                      "that cannot be.")
    concurrency: int = Field(1, ge=1, le=PLAN_NODES_MAX, description="Nodes in maintenance at once, at most.")
    node_duration_seconds: int = Field(ge=1, le=PLAN_DURATION_MAX, description="The time each node needs.")
    notice_seconds: int = Field(ge=0, le=PLAN_NOTICE_MAX,
                                description="Owners are told at least this long before their VM is stopped.")
    reason: str = Field(min_length=1, max_length=REASON_MAX, description="Why; told to every owner.")

    @field_validator("node_selector")
    @classmethod
    def _selector_rules(cls, selector: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (selector or {}).items():
            if problem := label_key_problem(key, reserved=False):
                raise ValueError(f"label {key!r}: {problem}")
            if problem := label_value_problem(value):
                raise ValueError(f"label {key!r}: {problem}")
        return selector

    @model_validator(mode="after")
    def _whole(self) -> PlanMaintenanceSpec:
        _exactly_one("nodes and node_selector", self.nodes is not None, self.node_selector is not None)
        if self.nodes is not None and len(set(self.nodes)) != len(self.nodes):
            raise ValueError("nodes: a node is named once")
        if self.latest_end <= self.earliest_start:
            raise ValueError("latest_end must be after earliest_start")
        return self


class RescheduleMaintenanceSpec(PlanRef):
    node: str | None = Field(None, min_length=1, max_length=NAME_MAX, description="A planned node to move.")
    namespace: str | None = Field(None, min_length=1, description="With name: the VM whose stop moves.",
                                  json_schema_extra=_DNS1123_SCHEMA)
    name: str | None = Field(None, min_length=1, json_schema_extra=_DNS1123_SCHEMA)
    start: AwareDatetime = Field(description="The new time: the node's slot start, or the VM's stop.")

    @field_validator("namespace", "name")
    @classmethod
    def _label(cls, value: str | None) -> str | None:
        return None if value is None else _dns1123(value)

    @model_validator(mode="after")
    def _whole(self) -> RescheduleMaintenanceSpec:
        if (self.namespace is None) != (self.name is None):
            raise ValueError("a VM is named by namespace and name, both")
        _exactly_one("node and (namespace, name)", self.node is not None, self.name is not None)
        return self


class MaintenanceReadySpec(PlanRef):
    namespace: str = Field(min_length=1, json_schema_extra=_DNS1123_SCHEMA)
    name: str = Field(min_length=1, json_schema_extra=_DNS1123_SCHEMA)

    _check_namespace = field_validator("namespace")(_dns1123)
    _check_name = field_validator("name")(_dns1123)


class CancelMaintenanceSpec(PlanRef):
    reason: str = Field(min_length=1, max_length=REASON_MAX, description="Why; told to every owner told.")


class IntentBase(Message):
    intent_id: str = Field(min_length=1, max_length=256, description="The same id twice has one effect.")
    requested_by: str = Field(min_length=1, description="The principal asking; told if the intent is refused. "
                              "Must be the subject of the credential.")
    project: str | None = Field(None, description="Required for VM intents: the project that must own the VM; "
                                "one of the credential's projects.")
    requested_at: AwareDatetime | None = None
    credential: str | None = Field(
        None, description="A compact JWS (JWT) of the requester, bound to this intent (docs/auth.md). "
                          "Required unless the worker runs with auth: none.")

    _check_requested_by = field_validator("requested_by")(_principal)
    _check_project = field_validator("project")(_project)

    # Declared by every intent type: the key it is decided, routed and sent under.
    decided_under: ClassVar[DecisionKey]

    def decision_key(self) -> str:
        key = self.decided_under.of(self)
        if key is None:  # a validated intent has every field its declaration reads
            raise ValueError(f"{self.decided_under.template} reads a field {type(self).__name__} does not require")
        return key


class VMIntent(IntentBase):
    project: str = Field(min_length=1)  # a VM intent must name the VM's project
    decided_under = DecisionKey("vm/{spec.namespace}/{spec.name}")

    def vm_key(self) -> str:
        spec: VMRef = self.spec  # type: ignore[attr-defined]
        return vm_key(spec.namespace, spec.name)


class CreateVMIntent(VMIntent):
    type: Literal["create_vm"]
    spec: CreateVMSpec


class SetGPUIntent(VMIntent):
    type: Literal["set_gpu"]
    spec: SetGPUSpec


class RestartVMIntent(VMIntent):
    type: Literal["restart_vm"]
    spec: RestartVMSpec


class DrainNodeIntent(IntentBase):
    type: Literal["drain_node"]
    spec: DrainNodeSpec
    decided_under = DecisionKey("node/{spec.node}")


class UndrainNodeIntent(IntentBase):
    type: Literal["undrain_node"]
    spec: UndrainNodeSpec
    decided_under = DecisionKey("node/{spec.node}")


PLAN_KEY = DecisionKey("maintenance/{spec.plan}")  # a maintenance plan's intents: its row is kept there


class PlanMaintenanceIntent(IntentBase):
    """An operator's maintenance plan of GPU nodes (docs/maintenance.md)."""

    type: Literal["plan_maintenance"]
    spec: PlanMaintenanceSpec
    decided_under = PLAN_KEY


class RescheduleMaintenanceIntent(IntentBase):
    """Another slot for a planned node (operators) or one VM's stop (its project or operators)."""

    type: Literal["reschedule_maintenance"]
    spec: RescheduleMaintenanceSpec
    decided_under = PLAN_KEY


class MaintenanceReadyIntent(IntentBase):
    """An owner's "stop my VM now" for a plan."""

    type: Literal["maintenance_ready"]
    spec: MaintenanceReadySpec
    decided_under = PLAN_KEY


class CancelMaintenanceIntent(IntentBase):
    type: Literal["cancel_maintenance"]
    spec: CancelMaintenanceSpec
    decided_under = PLAN_KEY


# The intent types are declared here, once: each by its model's ``type`` literal and the key
# it is decided under (``decided_under``), the set by this union. INTENT_TYPES derives from it;
# the engine's rules (handlers/decide/intents.py RULES) and the CLI's sub-commands are checked
# against it (tests/test_facts.py).
AnyIntent = Union[CreateVMIntent, SetGPUIntent, RestartVMIntent, DrainNodeIntent, UndrainNodeIntent,
                  PlanMaintenanceIntent, RescheduleMaintenanceIntent, MaintenanceReadyIntent, CancelMaintenanceIntent]
Intent = Annotated[AnyIntent, Field(discriminator="type")]  # parsed by its ``type``
INTENT_MODELS: tuple[type[IntentBase], ...] = get_args(AnyIntent)
INTENT_TYPES: tuple[str, ...] = tuple(
    tag for model in INTENT_MODELS for tag in get_args(model.model_fields["type"].annotation))
VM_INTENT_TYPES: tuple[str, ...] = tuple(  # those about a VM
    tag for model in INTENT_MODELS if issubclass(model, VMIntent)
    for tag in get_args(model.model_fields["type"].annotation))


def intent_type(model: type[IntentBase]) -> str:
    """The type an intent model stands for: its ``type`` literal."""
    (tag,) = get_args(model.model_fields["type"].annotation)
    return str(tag)


INTENT_MODEL_OF: Mapping[str, type[IntentBase]] = {intent_type(model): model for model in INTENT_MODELS}
PLAN_INTENT_TYPES: tuple[str, ...] = tuple(  # those about a maintenance plan
    intent_type(model) for model in INTENT_MODELS if model.decided_under is PLAN_KEY)


class IntentEnvelope(Message):
    """The least an intent must carry for anyone to be told anything about it.

    A message without these is *malformed* (dead letter); one with them but with a wrong
    spec is a *rejected request* (its requester is told why).
    """

    intent_id: str = Field(min_length=1, max_length=256)
    type: str = Field(min_length=1, max_length=TYPE_MAX)
    requested_by: str = Field(min_length=1)
    project: str | None = None

    # A principal that could not be told anything safely makes the message malformed.
    _check_requested_by = field_validator("requested_by")(_principal)


# ------------------------------------------------------------------------ watch events


@dataclass(frozen=True, slots=True)
class WatchedKind:
    """A kind the watch bridge watches: its name (as in ``WatchEvent.kind`` and the key) and where
    the API server serves it. The one list of them is :data:`WATCHED_KINDS`; the watch bridge's
    RBAC (deploy/base/rbac-watch.yaml) and the folds of handlers/decide/observing.py follow it, and
    tests/test_facts.py checks that they do."""

    kind: str
    group: str  # "" for the core API
    version: str
    plural: str
    label_selector: str | None = None  # only the objects it selects are watched

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


WATCHED_KINDS: tuple[WatchedKind, ...] = (
    WatchedKind("VirtualMachine", "kubevirt.io", "v1", "virtualmachines"),
    WatchedKind("VirtualMachineInstance", "kubevirt.io", "v1", "virtualmachineinstances"),
    WatchedKind("Node", "", "v1", "nodes"),
    WatchedKind("NodeMaintenance", "nodemaintenance.medik8s.io", "v1beta1", "nodemaintenances"),
    WatchedKind("KubeVirt", "kubevirt.io", "v1", "kubevirts"),
    # Their project label says where a project's VMs may be created (docs/auth.md).
    WatchedKind("Namespace", "", "v1", "namespaces"),
    # The instance types KubeVirt stored for VMs: their GPUs go into every VMI (docs/kubevirt.md).
    WatchedKind("ControllerRevision", "apps", "v1", "controllerrevisions",
                label_selector="instancetype.kubevirt.io/object-kind in "
                               "(VirtualMachineInstancetype,VirtualMachineClusterInstancetype)"),
)


class WatchEvent(Message):
    event_id: str = Field(min_length=1, max_length=256)
    type: Literal["ADDED", "MODIFIED", "DELETED", "RELISTED"]
    kind: str = Field(min_length=1, max_length=KIND_MAX)
    object: dict[str, Any]
    observed_at: AwareDatetime

    @field_validator("object")
    @classmethod
    def _has_name(cls, obj: dict[str, Any]) -> dict[str, Any]:
        metadata = obj.get("metadata")
        if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
            raise ValueError("object.metadata.name is required")
        if not 0 < len(metadata["name"]) <= NAME_MAX:
            raise ValueError(f"object.metadata.name must be 1 to {NAME_MAX} characters")
        namespace = metadata.get("namespace")
        if namespace is not None and not (isinstance(namespace, str) and len(namespace) <= 63):
            raise ValueError("object.metadata.namespace must be a string of at most 63 characters")
        return obj


# ----------------------------------------------------------------------------- outputs


class ObjectRef(Message):
    kind: str = Field(max_length=KIND_MAX)
    namespace: str | None = Field(None, max_length=63)
    name: str = Field(max_length=NAME_MAX)
    # A command's target by identity as well as by name: the object of that name with another
    # uid (deleted and made again) is not the one the command is for, and is left alone.
    uid: str | None = Field(None, max_length=128)


class GPUMutation(Message):
    """What a ``patch_vm`` command wants, so the applier can re-plan after a conflict."""

    device_name: str | None = None  # None removes the GPU
    eviction_strategy: Literal["External", "None"]
    # True: bring the GPU the VM already has under the rules, never change it (a VM observed
    # without them, handlers/rules/enforcement.py); a VM that no longer has exactly this GPU when
    # the applier plans again is left as it is.
    enforce: bool | None = None
    # An enforce mutation of a VM whose GPUs are not one template GPU (several, GPU host devices,
    # an instance type's): the template's device names (gpus and hostDevices, sorted) it was
    # planned on. Its devices are never changed, and a VM whose template devices differ when
    # the applier plans again is left as it is.
    devices: list[str] | None = None
    # False: leave the template's cpu.model alone, the instance type sets the CPU model
    # (KubeVirt refuses a VM that sets both).
    cpu_model: bool | None = None


CommandType = Literal[
    "patch_vm",
    "create_vm",
    "restart_vm",
    "start_vm",
    "stop_vm",
    "delete_vmi",
    "cordon_node",
    "uncordon_node",
    "cancel_evacuation",  # virt-api's evacuate/cancel on a VMI: its eviction mark from one node removed
]

COMMAND_TYPES: tuple[CommandType, ...] = get_args(CommandType)  # the applier dispatches on each


class Command(Message):
    command_id: OutputId
    type: CommandType
    target: ObjectRef
    cause: str = Field(max_length=CAUSE_MAX)
    issued_at: AwareDatetime
    patch: list[dict[str, Any]] | None = None
    base_resource_version: str | None = None
    manifest: dict[str, Any] | None = None
    mutation: GPUMutation | None = None
    requested_by: Recipient | None = None
    # cancel_evacuation: the node whose eviction mark (status.evacuationNodeName) is removed;
    # a mark naming another node is left alone.
    evacuation_node: str | None = Field(None, max_length=NAME_MAX)


class CommandResult(Message):
    command_id: OutputId
    outcome: Literal["applied", "noop", "conflict_retried", "failed"]
    error: Text | None = None
    at: AwareDatetime
    type: CommandType | None = None
    target: ObjectRef | None = None
    resource_version: str | None = None  # of the object after the change, when known
    cause: str | None = None  # the command's cause (intent_id, event_id, deadline)
    requested_by: str | None = None


NotificationType = Literal[
    "drain_will_stop_gpu_vm",
    "gpu_change_pending_restart",
    "gpu_unavailable",
    "intent_rejected",
    "drain_completed",
    "command_failed",
    "drain_called_off",  # a drain announced to owners was called off before it stopped their VMs
    "gpu_rules_applied",  # a GPU VM observed without the GPU rules: patched (or, enforce: notify, only told)
    "gpu_memory_not_pinned",  # a GPU on an instance-type VM whose memory KubeVirt overcommits
    "maintenance_planned",  # a GPU VM's owner: when a planned maintenance stops it and what becomes of it
    "maintenance_changed",  # that notice corrected: its node, stop time, fate or return changed
    "maintenance_cancelled",  # the plan is off: the VM will not be stopped for it
    "maintenance_progress",  # the operator who asked: the plan made, a node back, the plan over
]


class Notification(Message):
    notification_id: OutputId
    type: NotificationType
    recipients: list[Recipient] = Field(max_length=RECIPIENTS_MAX)
    project: str | None = Field(None, max_length=NAME_MAX)
    subject: ObjectRef
    severity: Severity
    message: Text
    details: dict[str, Any] = Field(default_factory=dict)
    deadline: AwareDatetime | None = None
    at: AwareDatetime | None = None


class AuditInput(Message):
    topic: str = Field(max_length=TOPIC_MAX)
    key: str | None = Field(None, max_length=KEY_MAX)
    ref: str = Field(max_length=KEY_MAX)


# ``unauthenticated``: an intent refused for who asks (its credential missing, forged, expired or
# not its own): a copy of a real intent's id without its credential is one, never a duplicate.
AuditOutcome = Literal["accepted", "rejected", "unauthenticated", "ignored", "duplicate", "applied", "failed"]


class AuditRecord(Message):
    audit_id: OutputId
    at: AwareDatetime
    input: AuditInput
    outcome: AuditOutcome
    reason: Text | None = None
    commands: list[OutputId] = Field(default_factory=list)
    notifications: list[OutputId] = Field(default_factory=list)


class DeadLetterSource(Message):
    topic: str = Field(max_length=TOPIC_MAX)
    partition: int | None = None
    offset: int | None = None


class DeadLetter(Message):
    error: Text
    source: DeadLetterSource
    original: str = Field(max_length=ORIGINAL_MAX, description=(
        "The raw value as text, or base64 when not UTF-8; of a value over 16,384 bytes only its first "
        "16,384 bytes (original_truncated, with original_size and original_sha256 of the whole)."))
    encoding: Literal["utf-8", "base64"] = "utf-8"
    at: AwareDatetime | None = None
    original_truncated: bool | None = Field(None, description="The original is a prefix of the value.")
    original_size: int | None = Field(None, ge=0, description="The whole value's size in bytes, when truncated.")
    original_sha256: str | None = Field(None, pattern="^[0-9a-f]{64}$",
                                        description="The whole value's SHA-256, hex, when truncated.")


class GPUClassStatus(BaseModel):
    """One GPU class of the AZ and its cards; also the value of ``vmstream.gpu-classes``."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # the read API's answers refuse unknown fields

    name: str = Field(description="The class id, or the device name of a device no class maps to")
    class_id: str | None = Field(description="None for a device seen on nodes that no configured class names")
    display_name: str
    device_name: str = Field(description="The device plugin's resource name (KubeVirt's deviceName)")
    undefined: bool = Field(description="No configured class maps to this device")
    permitted: bool = Field(description="The observed KubeVirt CR lets a VM with this device start "
                                        "(permittedHostDevices); True while no CR was observed")
    total: int = Field(ge=0, description="Cards on every node, schedulable or not")
    schedulable: int = Field(ge=0, description="Cards on Ready, uncordoned nodes")
    in_use: int = Field(ge=0, description="Cards held by GPU VMIs on schedulable nodes")
    free: int = Field(ge=0, description="Schedulable cards no VMI holds")


# ---------------------------------------------------------------------------- helpers


def vm_key(namespace: str, name: str) -> str:
    return f"vm/{namespace}/{name}"


def node_key(name: str) -> str:
    return f"node/{name}"


def object_key(kind: str, namespace: str | None, name: str) -> str:
    """The k8s-events key: ``<Kind>/<namespace>/<name>`` or ``<Kind>/<name>``."""
    return f"{kind}/{namespace}/{name}" if namespace else f"{kind}/{name}"


class MalformedMessage(ValueError):
    """The bytes are not a message of the expected kind: they go to dead letters."""


class InvalidIntent(ValueError):
    """A well-formed intent whose content is wrong: it is rejected, its requester told."""

    def __init__(self, envelope: IntentEnvelope, reason: str) -> None:
        super().__init__(reason)
        self.envelope = envelope
        self.reason = reason


def describe_validation_error(error: ValidationError, *, most: int = 10) -> str:
    """One line per problem, each naming the field and the reason; at most ``most`` problems,
    each field name cut to 64 characters (a field's name may be anything a sender chose)."""
    parts = []
    problems = error.errors(include_url=False, include_input=False)
    for item in problems[:most]:
        loc = list(item["loc"])
        if loc and loc[0] in INTENT_TYPES:  # the union's tag, not a field
            loc = loc[1:]
        where = ".".join(clip(str(part), 64) for part in loc)
        parts.append(f"{where or '(message)'}: {clip(item['msg'], 256)}")
    if len(problems) > most:
        parts.append(f"and {len(problems) - most} more")
    return "; ".join(parts)


def decode_json_object(raw: object, *, max_bytes: int | None = None) -> dict[str, Any]:
    """Whatever a topic holds (bytes, or ``None`` for a tombstone) as a JSON object, or
    :class:`MalformedMessage` saying why it is not one; never another exception.

    A value over ``max_bytes`` is refused before it is parsed. The parser is pydantic's
    (the one that reads the tables back): strict UTF-8 without lone surrogates, no NaN or
    Infinity, nesting at most 200 deep, integers of at most 4,300 digits.
    """
    if isinstance(raw, dict):
        return raw
    if raw is None:
        raise MalformedMessage("no value (a tombstone): not a JSON object")
    if isinstance(raw, str):
        data = raw.encode("utf-8", "surrogatepass")  # a lone surrogate is then not UTF-8
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        data = bytes(raw)
    else:
        raise MalformedMessage(f"not a JSON object but {type(raw).__name__}")
    if max_bytes is not None and len(data) > max_bytes:
        raise MalformedMessage(f"a value of {len(data)} bytes, over the limit of {max_bytes}")
    try:
        value = pydantic_core.from_json(data, allow_inf_nan=False)
    except ValueError as exc:
        raise MalformedMessage(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise MalformedMessage(f"not a JSON object but {type(value).__name__}")
    return value


def wire_bytes(value: BaseModel) -> bytes:
    """A message as it goes on the wire: compact JSON, absent optional fields left out."""
    return value.model_dump_json(exclude_none=True).encode()


def parse_intent(raw: object, models: Mapping[str, type[IntentBase]] = INTENT_MODEL_OF) -> Any:
    """Parse an intent in two stages: its envelope, then the model of its type in ``models``.

    Raises :class:`MalformedMessage` when the envelope is unusable and
    :class:`InvalidIntent` when the envelope is fine but the intent is not.
    """
    data = decode_json_object(raw)
    try:
        envelope = IntentEnvelope.model_validate(data)
    except ValidationError as exc:
        raise MalformedMessage(describe_validation_error(exc)) from exc
    model = models.get(envelope.type)
    if model is None:
        raise InvalidIntent(
            envelope, f"type: unknown intent type {envelope.type!r}; expected one of {', '.join(models)}"
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidIntent(envelope, describe_validation_error(exc)) from exc


def parse_watch_event(raw: object) -> WatchEvent:
    data = decode_json_object(raw)
    try:
        return WatchEvent.model_validate(data)
    except ValidationError as exc:
        raise MalformedMessage(describe_validation_error(exc)) from exc

