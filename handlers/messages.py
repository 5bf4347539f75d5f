"""The wire contracts: every message vmstream reads or writes, as pydantic models.

These models *are* CONTRACTS.md in code; the JSON Schemas and the AsyncAPI document in
``docs/`` are generated from them (``vmstream schemas``). Changes must stay additive.

Flow: raw bytes → :func:`parse_intent` / :func:`parse_watch_event` → handlers →
:class:`Command`, :class:`Notification`, :class:`AuditRecord`, :class:`DeadLetter`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    field_validator,
)

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

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
    if not value.isprintable() or any(char.isspace() for char in value):
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


def label_key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if "/" in prefix or (key.count("/") == 1 and not prefix):
        return "a label key is [prefix/]name"
    if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        return "a label key's prefix is a DNS-1123 subdomain of at most 253 characters"
    if prefix and prefix != "app.kubernetes.io" and any(
            prefix == d or prefix.endswith("." + d) for d in RESERVED_LABEL_DOMAINS):
        return f"label prefix {prefix} is reserved"
    if not name or (problem := label_value_problem(name)):
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


class CreateVMSpec(VMRef):
    cores: Cores = Field(description="vCPU cores, on one socket.")
    memory_gib: MemoryGiB = Field(description="Guest memory in GiB.")
    run_strategy: RunStrategy = Field("Manual", description="KubeVirt run strategy; Manual creates it stopped.")
    preference: Preference = Field("linux", description="The VirtualMachineClusterPreference.")
    image: str = Field(min_length=1, description="The container disk image to boot.")
    gpu_class: str | None = Field(None, description="A GPU class id of this AZ (case-insensitive).")
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
    gpu_class: str | None = Field(description="A GPU class id of this AZ, or null to remove the GPU (required).")


class RestartVMSpec(VMRef):
    pass


class DrainNodeSpec(Spec):
    node: str = Field(min_length=1, description="The node to drain.")
    reason: str = Field(min_length=1, description="Why; told to every owner whose GPU VM will stop.")
    notice_seconds: int | None = Field(
        default=None, ge=0, le=7 * 24 * 3600, description="Notice before GPU VMs are stopped; default from config."
    )


class UndrainNodeSpec(Spec):
    node: str = Field(min_length=1)
    reason: str | None = None


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


class VMIntent(IntentBase):
    project: str = Field(min_length=1)  # a VM intent must name the VM's project

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


class UndrainNodeIntent(IntentBase):
    type: Literal["undrain_node"]
    spec: UndrainNodeSpec


Intent = Annotated[
    Union[CreateVMIntent, SetGPUIntent, RestartVMIntent, DrainNodeIntent, UndrainNodeIntent],
    Field(discriminator="type"),
]
INTENT_TYPES = ("create_vm", "set_gpu", "restart_vm", "drain_node", "undrain_node")


class IntentEnvelope(Message):
    """The least an intent must carry for anyone to be told anything about it.

    A message without these is *malformed* (dead letter); one with them but with a wrong
    spec is a *rejected request* (its requester is told why).
    """

    intent_id: str = Field(min_length=1, max_length=256)
    type: str = Field(min_length=1)
    requested_by: str = Field(min_length=1)
    project: str | None = None

    # A principal that could not be told anything safely makes the message malformed.
    _check_requested_by = field_validator("requested_by")(_principal)


# ------------------------------------------------------------------------ watch events

WATCHED_KINDS = ("VirtualMachine", "VirtualMachineInstance", "Node", "NodeMaintenance", "KubeVirt")


class WatchEvent(Message):
    event_id: str = Field(min_length=1, max_length=256)
    type: Literal["ADDED", "MODIFIED", "DELETED", "RELISTED"]
    kind: str = Field(min_length=1)
    object: dict[str, Any]
    observed_at: AwareDatetime

    @field_validator("object")
    @classmethod
    def _has_name(cls, obj: dict[str, Any]) -> dict[str, Any]:
        metadata = obj.get("metadata")
        if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
            raise ValueError("object.metadata.name is required")
        return obj


# ----------------------------------------------------------------------------- outputs


class ObjectRef(Message):
    kind: str
    namespace: str | None = None
    name: str


class GPUMutation(Message):
    """What a ``patch_vm`` command wants, so the applier can re-plan after a conflict."""

    device_name: str | None = None  # None removes the GPU
    eviction_strategy: Literal["External", "None"]


CommandType = Literal[
    "patch_vm",
    "create_vm",
    "restart_vm",
    "start_vm",
    "stop_vm",
    "delete_vmi",
    "cordon_node",
    "uncordon_node",
]


class Command(Message):
    command_id: str
    type: CommandType
    target: ObjectRef
    cause: str
    issued_at: AwareDatetime
    patch: list[dict[str, Any]] | None = None
    base_resource_version: str | None = None
    manifest: dict[str, Any] | None = None
    mutation: GPUMutation | None = None
    requested_by: str | None = None


class CommandResult(Message):
    command_id: str
    outcome: Literal["applied", "noop", "conflict_retried", "failed"]
    error: str | None = None
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
]


class Notification(Message):
    notification_id: str
    type: NotificationType
    recipients: list[str]
    project: str | None = None
    subject: ObjectRef
    severity: Severity
    message: str
    details: dict[str, Any] = Field(default_factory=dict)
    deadline: AwareDatetime | None = None
    at: AwareDatetime | None = None


class AuditInput(Message):
    topic: str
    key: str | None = None
    ref: str


AuditOutcome = Literal["accepted", "rejected", "ignored", "duplicate", "applied", "failed"]


class AuditRecord(Message):
    audit_id: str
    at: AwareDatetime
    input: AuditInput
    outcome: AuditOutcome
    reason: str | None = None
    commands: list[str] = Field(default_factory=list)
    notifications: list[str] = Field(default_factory=list)


class DeadLetterSource(Message):
    topic: str
    partition: int | None = None
    offset: int | None = None


class DeadLetter(Message):
    error: str
    source: DeadLetterSource
    original: str
    encoding: Literal["utf-8", "base64"] = "utf-8"
    at: AwareDatetime | None = None


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


_INTENT: TypeAdapter[Any] = TypeAdapter(Intent)


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the field and the reason."""
    parts = []
    for item in error.errors(include_url=False):
        loc = list(item["loc"])
        if loc and loc[0] in INTENT_TYPES:  # the union's tag, not a field
            loc = loc[1:]
        where = ".".join(str(part) for part in loc)
        parts.append(f"{where or '(message)'}: {item['msg']}")
    return "; ".join(parts)


def decode_json_object(raw: bytes | str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedMessage(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise MalformedMessage(f"not a JSON object but {type(value).__name__}")
    return value


def parse_intent(raw: bytes | str | dict[str, Any]) -> IntentEnvelope | Any:
    """Parse an intent in two stages.

    Raises :class:`MalformedMessage` when the envelope is unusable and
    :class:`InvalidIntent` when the envelope is fine but the intent is not.
    """
    data = decode_json_object(raw)
    try:
        envelope = IntentEnvelope.model_validate(data)
    except ValidationError as exc:
        raise MalformedMessage(describe_validation_error(exc)) from exc
    if envelope.type not in INTENT_TYPES:
        raise InvalidIntent(
            envelope, f"type: unknown intent type {envelope.type!r}; expected one of {', '.join(INTENT_TYPES)}"
        )
    try:
        return _INTENT.validate_python(data)
    except ValidationError as exc:
        raise InvalidIntent(envelope, describe_validation_error(exc)) from exc


def parse_watch_event(raw: bytes | str | dict[str, Any]) -> WatchEvent:
    data = decode_json_object(raw)
    try:
        return WatchEvent.model_validate(data)
    except ValidationError as exc:
        raise MalformedMessage(describe_validation_error(exc)) from exc

