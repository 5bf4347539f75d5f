"""``vmstream schemas``: the published contracts, generated from the pydantic models.

pydantic models (``handlers.contracts.messages``, ``handlers.reads.views``, ``handlers.contracts.delivery``,
``streams.common.settings``) → one JSON Schema file per message plus the configuration file;
the topics' declaration (``handlers.contracts.topics``: name, key, value, configs, who sends and who
receives) → an AsyncAPI 3.0.0 document, its channels and operations, so it says what the
code is declared to do and nothing else.
Consumers read these files instead of our code, so they are committed under
``docs/schemas/`` and a test fails when they drift from the models: rendering is pure and
deterministic (:func:`render_schemas`), writing is separate (:func:`write_schemas`).

The JSON Schema files are draft 2020-12 and self-contained (``$defs`` with local refs).
The AsyncAPI document embeds the same schemas under ``components.schemas`` with the
``$defs`` hoisted next to them and their refs rewritten, because AsyncAPI tooling resolves
``#/...`` against the whole document, not against an embedded schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast, get_args

import yaml
from pydantic import TypeAdapter

from handlers.contracts import ids, topics
from handlers.contracts.delivery import Channel, DeliveryRecord, Target
from handlers.contracts.events import (
    AUDIT_TYPE,
    COMMAND_RESULT_TYPE,
    DEAD_LETTER_TYPE,
    DELIVERY_TYPE,
    DOMAIN,
    GPU_CLASS_TYPE,
    PROCESSES,
    SOURCE_PREFIX,
    TYPE_PREFIX,
    TYPES,
    command_type,
    intent_type,
    process_named,
    watch_event_type,
)
from handlers.contracts.events import Process as EventProcess  # handlers.contracts.topics' Process names them otherwise
from handlers.contracts.messages import (
    WATCHED_KINDS,
    AuditInput,
    AuditRecord,
    Command,
    CommandResult,
    DeadLetter,
    DeadLetterSource,
    GPUClassStatus,
    GPUMutation,
    Intent,
    Notification,
    ObjectRef,
    SetGPUIntent,
    WatchEvent,
)
from handlers.contracts.topics import (
    AUDIT,
    COMMAND_RESULTS,
    COMMANDS,
    DELIVERIES,
    DLQ,
    GPU_CLASSES,
    INTENTS,
    K8S_EVENTS,
    NOTIFICATIONS,
    WORKER_ROUTED,
    Process,
    Topic,
)
from handlers.contracts.tracing import (
    CONTENT_TYPE,
    SPEC_VERSION,
    ce_headers,
    derived_trace,
    message_headers,
    parse_traceparent,
)
from streams.common.cloudevents import event_source
from streams.common.settings import KafkaSettings, Settings
from streams.kube.watching import EventType, event_headers
from streams.serve.api import class_headers, openapi_document

__all__ = [
    "ASYNCAPI_FILE", "CONFIG", "MESSAGES", "TOPICS",
    "asyncapi_document", "json_schema", "render_schemas", "write_schemas",
]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_ID_BASE = "https://vmstream.io/schemas/"
ASYNCAPI_FILE = "asyncapi.yaml"
OPENAPI_FILE = "openapi.json"
# The contracts' own version, not the package's: bump the minor on an additive change.
CONTRACTS_VERSION = "1.1.0"
KAFKA_BINDING_VERSION = "0.5.0"

JsonObject = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SchemaDoc:
    """One published schema: its file, its component name and what a reader is told."""

    file: str
    name: str
    description: str
    generate: Callable[[], JsonObject]
    value: Any = None  # the type a topic declares as its value (handlers/contracts/topics.py)


@dataclass(frozen=True, slots=True)
class TopicDoc:
    """One public topic of handlers/contracts/topics.py and the schema of its message."""

    topic: Topic
    message: SchemaDoc

    @property
    def name(self) -> str:
        return self.topic.name


@dataclass(frozen=True, slots=True)
class OperationDoc:
    """One send or receive, seen from the vmstream component that does it."""

    component: Process
    action: Literal["send", "receive"]
    topic: str
    summary: str

    @property
    def id(self) -> str:
        words = [*self.component.split("-"), self.action.capitalize(), *self.topic.split("-")]
        return words[0] + "".join(word[:1].upper() + word[1:] for word in words[1:])


def _model(adapter: TypeAdapter[Any]) -> Callable[[], JsonObject]:
    return lambda: adapter.json_schema(mode="validation")


_DEFAULTS = KafkaSettings()  # the published names are the default ones


def _named(topic: Topic) -> str:
    """A topic's default full name (``vmstream.intents``)."""
    return _DEFAULTS.topic(topic)


INTENT = SchemaDoc(
    "intent.schema.json",
    "Intent",
    f"A request to vmstream ({_named(INTENTS)}), discriminated by `type`. The same "
    "`intent_id` twice has one effect. A message without `intent_id`, `type` or "
    "`requested_by` is malformed and dead-lettered; one that has them but fails the rest "
    "of this schema is rejected and its requester told why.",
    _model(TypeAdapter(Intent)),
    Intent,
)
WATCH_EVENT = SchemaDoc(
    "watch-event.schema.json",
    "WatchEvent",
    f"A change the watch bridge saw on a watched Kubernetes object ({_named(K8S_EVENTS)}); "
    "`object` is the whole object as the API served it and must carry `metadata.name`.",
    _model(TypeAdapter(WatchEvent)),
    WatchEvent,
)
COMMAND = SchemaDoc(
    "command.schema.json",
    "Command",
    f"A change for the applier to make ({_named(COMMANDS)}). `command_id` is deterministic "
    "from its cause, so a replay reissues the same id. A VM change carries an RFC 6902 "
    "`patch` from the object at `base_resource_version`; `create_vm` carries `manifest`.",
    _model(TypeAdapter(Command)),
    Command,
)
COMMAND_RESULT = SchemaDoc(
    "command-result.schema.json",
    "CommandResult",
    f"What the applier did with a command ({_named(COMMAND_RESULTS)}); `error` is set when "
    "`outcome` is `failed`.",
    _model(TypeAdapter(CommandResult)),
    CommandResult,
)
NOTIFICATION = SchemaDoc(
    "notification.schema.json",
    "Notification",
    f"A fact a person must be told ({_named(NOTIFICATIONS)}). `notification_id` is "
    "deterministic: the same fact never notifies twice. `message` is one plain sentence.",
    _model(TypeAdapter(Notification)),
    Notification,
)
AUDIT_RECORD = SchemaDoc(
    "audit-record.schema.json",
    "AuditRecord",
    f"The record of one consumed input and what was decided ({_named(AUDIT)}): exactly one "
    "per consumed intent and per command result. `input.ref` is the intent_id, event_id "
    "or command_id.",
    _model(TypeAdapter(AuditRecord)),
    AuditRecord,
)
DEAD_LETTER = SchemaDoc(
    "dead-letter.schema.json",
    "DeadLetter",
    f"A message that could not be read ({_named(DLQ)}), kept so it is never lost: `original` "
    "is the raw value as text, or base64 when `encoding` says so.",
    _model(TypeAdapter(DeadLetter)),
    DeadLetter,
)
GPU_CLASS_STATUS = SchemaDoc(
    "gpu-class-status.schema.json",
    "GPUClassStatus",
    f"One GPU class of the AZ and its cards ({_named(GPU_CLASSES)}, compacted), as `GET /v1/gpu-classes` "
    "of `vmstream api` lists it: one current record per class, keyed by its `name`, written only when "
    "its figures change; a tombstone (null value) when the class is gone.",
    _model(TypeAdapter(GPUClassStatus)),
    GPUClassStatus,
)
DELIVERY = SchemaDoc(
    "delivery.schema.json",
    "Delivery",
    f"One delivery of a notification to one recipient on one channel ({_named(DELIVERIES)}, "
    "`vmstream notify`'s compacted ledger): delivered or dead-lettered, either way done. notify reads "
    "the ledger back when it starts and never makes a delivery whose key is on it.",
    _model(TypeAdapter(DeliveryRecord)),
    DeliveryRecord,
)
CONFIG = SchemaDoc(
    "config.schema.json",
    "Config",
    "The worker's configuration file (YAML). Each key may be overridden by an environment "
    "variable VMSTREAM_<KEY>, nested with `__` (VMSTREAM_DRAIN__NOTICE_SECONDS=60).",
    lambda: Settings.model_json_schema(mode="validation"),
)

MESSAGES: tuple[SchemaDoc, ...] = (
    INTENT, WATCH_EVENT, COMMAND, COMMAND_RESULT, NOTIFICATION, AUDIT_RECORD, DEAD_LETTER,
    GPU_CLASS_STATUS, DELIVERY,
)

# What names one delivery of a notification: its ledger key, ``ce_id`` and dead letter's suffix.
_DELIVERY_SUFFIX = Target(cast(Channel, "<channel>"), "<recipient>").key("")
_DELIVERY_KEY = "<notification_id>" + _DELIVERY_SUFFIX


def _doc_of(topic: Topic) -> SchemaDoc:
    """The message a topic holds: the schema generated from its declared value type."""
    found = [doc for doc in MESSAGES if doc.value is topic.value]
    if len(found) != 1:
        raise ValueError(f"{topic.name}: {len(found)} published messages are its value")
    return found[0]


# The public topics (handlers/contracts/topics.py), in their declared order, each with its message.
TOPICS: tuple[TopicDoc, ...] = tuple(TopicDoc(topic, _doc_of(topic)) for topic in topics.TOPICS if not topic.internal)

# Every declared send and receive of a public topic, by process: what the AsyncAPI operations say.
OPERATIONS: tuple[OperationDoc, ...] = tuple(
    OperationDoc(process, action, doc.name, summary)
    for process in topics.PROCESSES
    for action in ("receive", "send")
    for doc in TOPICS
    for name, summary in (doc.topic.receives if action == "receive" else doc.topic.sends).items()
    if name == process
)


def describe(topic: Topic, kafka: KafkaSettings) -> str:
    """A topic's purpose with the topics it names given their full names."""
    names = {other.name: kafka.topic(other) for other in topics.TOPICS}
    return topic.purpose.format(**names, watched_kinds=", ".join(kind.kind for kind in WATCHED_KINDS))


COMPONENTS: dict[str, str] = {
    "worker": "Consumes intents and watch events, re-keyed onto its own internal topic "
              f"({_named(WORKER_ROUTED)}) by decision key; runs the decision rules.",
    "applier": "The only writer to the Kubernetes API; applies commands idempotently.",
    "watch-bridge": "Watches the Kubernetes API and publishes what it sees.",
    "api": f"`vmstream api`: the read API for consoles (docs/schemas/{OPENAPI_FILE}); keeps "
           f"{_named(GPU_CLASSES)} (compacted) current, one record per GPU class keyed by its name, "
           "a tombstone when a class is gone, with CloudEvents headers: ce_id <name>@<the first 16 hex "
           f"digits of SHA-256 of the value> (<name>@tombstone), ce_type {GPU_CLASS_TYPE}, ce_source "
           f"{event_source('api', '<app_id>')}, ce_time when its figures were computed, a trace derived "
           "from ce_id.",
    "notify": f"`vmstream notify`: consumes {_named(NOTIFICATIONS)} and delivers each to its recipients; "
              f"records each delivery on {_named(DELIVERIES)} (its compacted ledger), keyed {_DELIVERY_KEY}, "
              f"with CloudEvents headers: ce_id that key, ce_type {DELIVERY_TYPE}, ce_source "
              f"{event_source('notify', '<app_id>')}, ce_time when it was written, the notification's trace; "
              f"dead-letters what it cannot deliver on {_named(DLQ)}.",
}


# ----------------------------------------------------- the envelope: headers, keys, examples

_KEY_RULE = (
    "The key, not the partition, carries the routing: produce with any partitioner (murmur2, "
    "FNV-1a, CRC32, explicit partitions); the key must be exactly this string whatever partition it "
    "lands on, and no consumer may infer anything from a record's partition. Order holds per key."
)
_TRACEPARENT = {
    "type": "string",
    "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$",
    "description": "W3C Trace Context. On an input: optional; a valid one passes its trace-id on to "
                   "every output it leads to, and without one the trace-id is derived from the "
                   "input's id (intent_id, event_id). On an output: the input's trace-id with a span "
                   "id derived from the output's own id (`ce_id`).",
}
_TRACESTATE = {"type": "string", "maxLength": 512,
               "description": "W3C Trace Context vendor state, passed on unchanged with its traceparent."}
_DECIDED_AT = "When it was decided: the input's own time, so a replay writes the same headers."


def _writers(topic: Topic) -> tuple[EventProcess, ...]:
    """The processes that write a topic (handlers/contracts/topics.py), by their name in CloudEvents ``source``."""
    return tuple(process_named(process) for process in topic.sends)


def _output_headers(ce_type: JsonObject, id_field: str, *, written_by: tuple[EventProcess, ...],
                    time: str = _DECIDED_AT, trace: str | None = None,
                    extra: JsonObject | None = None, tombstones: bool = False) -> JsonObject:
    """The CloudEvents Kafka protocol binding (binary mode) headers every output record carries;
    with ``tombstones``, a record without a value (a compacted topic's tombstone) has no content-type."""
    sources = ", ".join(event_source(process, "<app_id>") for process in written_by)
    traceparent = _TRACEPARENT if trace is None else {**_TRACEPARENT, "description": trace}
    required = ["ce_specversion", "ce_id", "ce_type", "ce_source", "ce_time", "content-type", "traceparent"]
    content_type: JsonObject = {"const": CONTENT_TYPE}
    if tombstones:
        required.remove("content-type")
        content_type["description"] = "On every record with a value; none on a tombstone (null value)."
    return {
        "type": "object",
        "required": required,
        "properties": {
            "ce_specversion": {"const": SPEC_VERSION},
            "ce_id": {"type": "string", "description": f"The message's own id: {id_field}."},
            "ce_type": ce_type,
            "ce_source": {"type": "string", "pattern": f"^{SOURCE_PREFIX}({'|'.join(written_by)})/",
                          "description": f"The process that wrote it, {SOURCE_PREFIX}<process>/<app_id> "
                                         f"(`worker.app_id` of its configuration): {sources}."},
            "ce_time": {"type": "string", "format": "date-time", "description": time},
            "content-type": content_type,
            "traceparent": traceparent,
            "tracestate": _TRACESTATE,
            **(extra or {}),
        },
    }


EVENT_SCHEME = (
    "Every record vmstream writes is a CloudEvent (the Kafka protocol binding's ce_* headers, binary "
    "mode), named in one scheme whatever carries it — the same type, source and id on Kafka, on a "
    "webhook (`vmstream notify`, structured mode) and on the intents `vmstream intent` sends: type "
    f"{TYPE_PREFIX}<what>[.<its own type>] ({DOMAIN} written as CloudEvents advise, the domain of "
    f"vmstream's Kubernetes annotations too), source {SOURCE_PREFIX}<process>/<app_id> with process one "
    f"of {', '.join(PROCESSES)}. Types: "
    + ", ".join(f"{name} {type_}" for name, type_ in TYPES.items()) + "."
)


def _intent_headers() -> JsonObject:
    """An intent's headers: none required; what `vmstream intent` sends, in the one scheme."""
    cli = event_source("cli", "<app_id>")
    return {
        "type": "object",
        "description": "All optional: the worker reads traceparent and tracestate only. CloudEvents "
                       "headers (ce_*) of an upstream service's own are accepted and not required; "
                       "`vmstream intent` sends them in vmstream's scheme: ce_id the intent_id, ce_type "
                       f"{TYPES['Intent']}, ce_source {cli}, ce_time its requested_at, and a traceparent "
                       "derived from the intent_id (the trace the worker would derive without one).",
        "properties": {
            "ce_specversion": {"const": SPEC_VERSION},
            "ce_id": {"type": "string", "description": "`vmstream intent`'s: the intent_id."},
            "ce_type": {"type": "string",
                        "description": f"`vmstream intent`'s: {TYPES['Intent']}, e.g. {intent_type('set_gpu')}."},
            "ce_source": {"type": "string", "description": f"`vmstream intent`'s: {cli}."},
            "ce_time": {"type": "string", "format": "date-time",
                        "description": "`vmstream intent`'s: the intent's requested_at."},
            "content-type": {"const": CONTENT_TYPE},
            "traceparent": _TRACEPARENT,
            "tracestate": _TRACESTATE,
        },
    }


_PREFIX = TYPE_PREFIX.replace(".", r"\.")
_WATCHED = "|".join(kind.kind.lower() for kind in WATCHED_KINDS)
_WATCH_TYPES = "|".join(type_.lower() for type_ in get_args(EventType))
HEADERS: dict[str, JsonObject] = {
    "Intent": _intent_headers(),
    "WatchEvent": _output_headers(
        {"type": "string", "pattern": f"^{_PREFIX}watch-event\\.({_WATCHED})\\.({_WATCH_TYPES})$",
         "description": f"{TYPES['WatchEvent']}, the event's kind and type in lower case, e.g. "
                        f"{watch_event_type('VirtualMachine', 'MODIFIED')}."},
        "event_id", written_by=_writers(K8S_EVENTS),
        time="The latest time its object shows: its last write (`managedFields`), else its "
             "`deletionTimestamp` or `creationTimestamp`; else when it was published.",
        trace="W3C Trace Context: a trace-id derived from event_id (the first 32 hex digits of SHA-256 "
              "of `trace`, the byte 0x1F and the id) and a span id derived from it too, so an event "
              "published again has the same traceparent and the worker's outputs of it the same trace. "
              "The worker reads only traceparent and tracestate of these headers.",
        extra={"vmstream-reduced": {
            "type": "string", "pattern": "^[0-9]+$",
            "description": "The whole event's size in bytes, on an event reduced to what the rules read."}}),
    "Command": _output_headers({"type": "string", "pattern": f"^{_PREFIX}command\\.[a-z_]+$",
                                "description": f"{TYPES['Command']}, e.g. {command_type('patch_vm')}."},
                               "command_id", written_by=_writers(COMMANDS)),
    "CommandResult": _output_headers({"const": COMMAND_RESULT_TYPE},
                                     "the command_id of its command (one result per command)",
                                     written_by=_writers(COMMAND_RESULTS)),
    "Notification": _output_headers({"type": "string", "pattern": f"^{_PREFIX}notification\\.[a-z_]+$",
                                     "description": f"{TYPES['Notification']}; a webhook's CloudEvent "
                                                    "(`vmstream notify`) has the same type, id, source "
                                                    "and time."}, "notification_id",
                                    written_by=_writers(NOTIFICATIONS)),
    "AuditRecord": _output_headers({"const": AUDIT_TYPE}, "audit_id", written_by=_writers(AUDIT)),
    "DeadLetter": _output_headers(
        {"const": DEAD_LETTER_TYPE},
        "dlq:<topic>:<partition>:<offset> of the record set aside; `vmstream notify`'s, one per failed "
        f"delivery, followed by {_DELIVERY_SUFFIX} (a recipient without an address: |none|<recipient>); "
        "the watch bridge's (an event too large even reduced), which has no offset: dlq:raw:<digest>",
        written_by=_writers(DLQ),
        time="Its `at`: the worker's, the input's own time, so a replay writes the same headers; the "
             "applier's (a malformed command), the watch bridge's and `vmstream notify`'s, when they wrote it.",
        trace="W3C Trace Context: the trace-id of the record set aside (its valid traceparent, else one "
              "derived from where it was read); the watch bridge's, the trace of the event it stands for; "
              "`vmstream notify`'s for a delivery, the notification's (its traceparent, else derived from "
              "its notification_id). The span id is derived from `ce_id`."),
    "GPUClassStatus": _output_headers(
        {"const": GPU_CLASS_TYPE},
        "<name>@<the first 16 hex digits of SHA-256 of the record's value>, <name>@tombstone for a "
        "tombstone: the same record has the same id whichever replica writes it",
        written_by=_writers(GPU_CLASSES), tombstones=True,
        time="When its figures were computed (a tombstone: when the class was found gone).",
        trace="W3C Trace Context: a trace-id derived from `ce_id` (the first 32 hex digits of SHA-256 of "
              "`trace`, the byte 0x1F and the id) and a span id derived from it too; no input caused it."),
    "Delivery": _output_headers(
        {"const": DELIVERY_TYPE}, f"the record's key, {_DELIVERY_KEY}", written_by=_writers(DELIVERIES),
        time="When it was written: its `at`.",
        trace="W3C Trace Context: the notification's trace (the traceparent it arrived with, else one "
              "derived from its notification_id) with a span id derived from `ce_id` — the traceparent "
              "the delivery itself was sent with (HTTP header of a webhook or chat POST)."),
}

CORRELATION: dict[str, tuple[str, str]] = {
    "Intent": ("$message.payload#/intent_id", "The intent's id: its audit record's `input.ref`, its "
               "commands' `cause`, their results' `cause`; its trace-id is in every one's traceparent."),
    "WatchEvent": ("$message.payload#/event_id", "The event's id: its audit record's `input.ref` and its "
                   "commands' `cause`."),
    "Command": ("$message.payload#/cause", "The intent_id or event_id (or drain deadline) it was decided "
                "for; its own `command_id` names its result."),
    "CommandResult": ("$message.payload#/cause", "Its command's cause (the intent_id or event_id); "
                      "`command_id` names the command."),
    "Notification": ("$message.header#/traceparent", "The trace-id of the input it was decided for "
                     "(an intent_rejected also names `details.intent_id`)."),
    "AuditRecord": ("$message.payload#/input/ref", "The input it records: an intent_id, event_id or "
                    "command_id."),
    "DeadLetter": ("$message.header#/traceparent", "The trace-id the unreadable record came with, else one "
                   "derived from where it was read."),
    "GPUClassStatus": ("$message.payload#/name", "The class, also the record's key."),
    "Delivery": ("$message.payload#/notification_id", "The notification delivered; the record's key (and "
                 "`ce_id`) adds the channel and recipient."),
}


def _examples() -> dict[str, JsonObject]:
    """One example record per message — payload and headers — built through the models, so each
    is valid by construction, and with the ids and headers vmstream would give it."""
    at = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    vm = ObjectRef(kind="VirtualMachine", namespace="spx-proj-b", name="dev-1")
    device = "nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION"
    intent = SetGPUIntent(intent_id="4a0c7c5e-2b1e-4f0a-9a51-0d7f3e1c9b20", type="set_gpu",
                          requested_by="bob@example.com", project="proj-b", requested_at=at,
                          spec={"namespace": "spx-proj-b", "name": "dev-1", "gpu_class": "nvidia-rtx-pro-6000-bse"},
                          credential="eyJhbGciOiJFZERTQSIsImtpZCI6InVwc3RyZWFtLTIwMjYtMTEiLCJ0eXAiOiJKV1QifQ.…")
    cause = intent.intent_id
    command = Command(command_id=ids.command_id(cause, "patch_vm", "vm/spx-proj-b/dev-1"), type="patch_vm",
                      target=vm, cause=cause, issued_at=at, base_resource_version="226",
                      patch=[{"op": "add", "path": "/spec/template/spec/domain/devices/gpus",
                              "value": [{"name": "gpu1", "deviceName": device}]}],
                      mutation=GPUMutation(device_name=device, eviction_strategy="External"),
                      requested_by="bob@example.com")
    notification = Notification(
        notification_id=ids.notification_id("gpu_change_pending_restart", "vm/spx-proj-b/dev-1", cause),
        type="gpu_change_pending_restart", recipients=["bob@example.com"], project="proj-b", subject=vm,
        severity="info", at=at,
        message="VM spx-proj-b/dev-1 will have GPU NVIDIA RTX PRO 6000 Blackwell Server Edition after its "
                "next restart; until then it keeps running as it is.")
    audit = AuditRecord(audit_id=ids.audit_id(_named(INTENTS), cause, "accepted"), at=at,
                        input=AuditInput(topic=_named(INTENTS), key="vm/spx-proj-b/dev-1", ref=cause),
                        outcome="accepted", commands=[command.command_id],
                        notifications=[notification.notification_id])
    result = CommandResult(command_id=command.command_id, outcome="applied", at=at, type="patch_vm", target=vm,
                           resource_version="227", cause=cause, requested_by="bob@example.com")
    letter = DeadLetter(error="not JSON: Expecting property name enclosed in double quotes",
                        source=DeadLetterSource(topic=_named(INTENTS), partition=3, offset=41),
                        original="{not json", at=at)
    event = WatchEvent(event_id=ids.watch_event_id("VirtualMachine", "spx-proj-b", "dev-1", "226", "MODIFIED"),
                       type="MODIFIED", kind="VirtualMachine", observed_at=at,
                       object={"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                               "metadata": {"name": "dev-1", "namespace": "spx-proj-b", "resourceVersion": "226",
                                            "labels": {"superphenix.net/projectID": "proj-b"}},
                               "spec": {"runStrategy": "Always"}})
    classes = GPUClassStatus(name="nvidia-rtx-pro-6000-bse", class_id="nvidia-rtx-pro-6000-bse",
                             display_name="NVIDIA RTX PRO 6000 Blackwell Server Edition", device_name=device,
                             undefined=False, permitted=True, total=16, schedulable=16, in_use=11, free=5)
    delivered = DeliveryRecord(notification_id=notification.notification_id, channel="email",
                               recipient="bob@example.com", outcome="delivered", attempts=1, at=at)
    upstream = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    traced = parse_traceparent(upstream) or derived_trace(cause)

    def record(name: str, summary: str, value: Any, headers: JsonObject) -> JsonObject:
        return {"name": name, "summary": summary, "headers": headers,
                "payload": value.model_dump(mode="json", exclude_none=True)}

    def output(name: str, summary: str, value: Any, source: str) -> JsonObject:
        return record(name, summary, value, dict(message_headers(value, source=source, time=at, trace=traced)))

    worker, applier = event_source("worker", "vmstream"), event_source("applier", "vmstream")
    vm_kind = next(kind for kind in WATCHED_KINDS if kind.kind == event.kind)
    watched = {name: value.decode() for name, value in
               event_headers(vm_kind, event.type, event.event_id, source=event_source("watch", "vmstream"), time=at)}
    return {
        "Intent": record("set_gpu", "A signed request for a GPU, with the caller's trace.", intent,
                         {"traceparent": upstream}),
        "WatchEvent": record("vm_modified", "A VirtualMachine changed, as the watch bridge publishes it: "
                             "its trace derived from event_id.", event, watched),
        "Command": output("patch_vm", "The GPU change the intent above leads to.", command, worker),
        "CommandResult": output("applied", "The applier's result of that command, in the intent's trace.",
                                result, applier),
        "Notification": output("gpu_change_pending_restart", "What the owner is told.", notification, worker),
        "AuditRecord": output("accepted", "The intent's audit record: it names the command and notification.",
                              audit, worker),
        "DeadLetter": output("not_json", "A record no rule could read, set aside with where it was read.",
                             letter, worker),
        "GPUClassStatus": record("nvidia_rtx_pro_6000_bse", "A class's figures, keyed by its name.", classes,
                                 {name: value.decode() for name, value in
                                  class_headers(classes.name, classes.model_dump_json().encode(),
                                                source=event_source("api", "vmstream"), time=at)}),
        "Delivery": record("delivered", "The e-mail to the owner of the notification above, delivered at the "
                           "first attempt, in the notification's trace.", delivered,
                           dict(ce_headers(id_=Target("email", delivered.recipient).key(delivered.notification_id),
                                           type_=DELIVERY_TYPE, source=event_source("notify", "vmstream"),
                                           time=at, trace=traced))),
    }


def _channel_binding(topic: Topic, kafka: KafkaSettings) -> JsonObject:
    """The Kafka channel binding of a topic: partitions, replicas and the configs it is created with."""
    configs: JsonObject = {"cleanup.policy": [topic.configs.get("cleanup.policy", "delete")]}
    for key in ("retention.ms", "retention.bytes"):
        if key in topic.configs:
            configs[key] = int(topic.configs[key])
    return {"kafka": {"topic": kafka.topic(topic), "partitions": kafka.partitions,
                      "replicas": kafka.replication_factor, "topicConfiguration": configs,
                      "bindingVersion": KAFKA_BINDING_VERSION}}


SERVERS: JsonObject = {
    "production": {
        "host": "kafka-bootstrap.kafka.svc:9093",
        "protocol": "kafka-secure",
        "description": "The platform's Kafka (Strimzi): TLS, one principal per process and per upstream "
                       "service, each allowed exactly its topics (docs/security.md). The principal authenticates "
                       "with SASL/SCRAM-SHA-512 (settings: kafka.security_protocol SASL_SSL, kafka.sasl_mechanism, "
                       "kafka.sasl_username, kafka.sasl_password), a client certificate (kafka.security_protocol "
                       "SSL, kafka.ssl_certfile, kafka.ssl_keyfile) or an OAuth 2 token (kafka.sasl_mechanism "
                       "OAUTHBEARER, kafka.oauth); kafka.ssl_cafile verifies the brokers.",
        "security": [{"$ref": "#/components/securitySchemes/scramSha512"},
                     {"$ref": "#/components/securitySchemes/mutualTls"},
                     {"$ref": "#/components/securitySchemes/oauthBearer"}],
    },
    "local": {
        "host": "127.0.0.1:9092",
        "protocol": "kafka",
        "description": "`python -m harness kafka up`: a single-node broker for development, PLAINTEXT.",
    },
}
SECURITY_SCHEMES: JsonObject = {
    "scramSha512": {"type": "scramSha512", "description": "SASL/SCRAM-SHA-512 over TLS: the user and "
                    "password of the principal (a Strimzi KafkaUser's Secret)."},
    "scramSha256": {"type": "scramSha256", "description": "SASL/SCRAM-SHA-256, where the platform uses it."},
    "mutualTls": {"type": "X509", "description": "Mutual TLS: the principal's client certificate, CN=<principal> "
                  "(a Strimzi type: tls KafkaUser's Secret: user.crt, user.key, ca.crt)."},
    "oauthBearer": {"type": "oauth2", "description": "SASL/OAUTHBEARER: an access token of the platform's "
                    "authorization server, whose subject is the principal (a Strimzi type: oauth listener).",
                    "flows": {"clientCredentials": {"tokenUrl": "https://sso.example.com/realms/kafka/protocol/"
                                                                "openid-connect/token", "availableScopes": {}}}},
}


# ------------------------------------------------------------------------- JSON Schema


def json_schema(doc: SchemaDoc) -> JsonObject:
    """A standalone draft 2020-12 schema: meta keys first, then pydantic's, ``$defs`` last."""
    generated = doc.generate()
    defs: JsonObject = generated.pop("$defs", {})
    generated.pop("title", None)
    generated.pop("description", None)
    schema: JsonObject = {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": SCHEMA_ID_BASE + doc.file,
        "title": doc.name,
        "description": doc.description,
        **generated,
    }
    if defs:
        schema["$defs"] = {name: defs[name] for name in sorted(defs)}
    return schema


def _render_json(schema: JsonObject) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------- AsyncAPI


def _for_asyncapi(node: Any) -> Any:
    """Rewrite refs into ``components.schemas``; OpenAPI's discriminator object → its name.

    AsyncAPI's Schema Object takes ``discriminator`` as a property name, not pydantic's
    ``{propertyName, mapping}``.
    """
    if isinstance(node, list):
        return [_for_asyncapi(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: JsonObject = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
            out[key] = "#/components/schemas/" + value.removeprefix("#/$defs/")
        elif key == "discriminator" and isinstance(value, dict) and "propertyName" in value:
            out[key] = value["propertyName"]
        else:
            out[key] = _for_asyncapi(value)
    return out


def _component_schemas(docs: tuple[SchemaDoc, ...]) -> JsonObject:
    """Every message schema and its ``$defs``, by name; a name defined twice must agree."""
    found: JsonObject = {}

    def add(name: str, schema: JsonObject) -> None:
        if name in found and found[name] != schema:
            raise ValueError(f"two different schemas are both named {name!r}")
        found[name] = schema

    for doc in docs:
        schema = json_schema(doc)
        for name, definition in schema.pop("$defs", {}).items():
            add(name, _for_asyncapi(definition))
        del schema["$schema"], schema["$id"]  # an $id would rebase the rewritten refs
        add(doc.name, _for_asyncapi(schema))
    return {name: found[name] for name in sorted(found)}


def asyncapi_document(kafka: KafkaSettings | None = None) -> JsonObject:
    """The AsyncAPI 3.0.0 document: channels, operations, messages and schemas, in order."""
    kafka = kafka or KafkaSettings()
    by_name = {topic.name: topic for topic in TOPICS}
    channels: JsonObject = {}
    for entry in TOPICS:
        topic, message = entry.topic, entry.message.name
        channels[topic.name] = {
            "address": kafka.topic(topic),
            "title": topic.title,
            "description": f"{describe(topic, kafka)} Key: {topic.key}. Value: {message}.",
            "messages": {message: {"$ref": f"#/components/messages/{message}"}},
            "bindings": _channel_binding(topic, kafka),
        }
    operations: JsonObject = {}
    for op in OPERATIONS:
        channel = by_name[op.topic]
        operations[op.id] = {
            "action": op.action,
            "channel": {"$ref": f"#/channels/{channel.name}"},
            "summary": op.summary,
            "tags": [{"name": op.component}],
            "messages": [{"$ref": f"#/channels/{channel.name}/messages/{channel.message.name}"}],
        }
    messages: JsonObject = {}
    examples = _examples()
    for channel in TOPICS:
        doc, key = channel.message, channel.topic.key
        location, meaning = CORRELATION[doc.name]
        messages[doc.name] = {
            "name": doc.name,
            "title": doc.name,
            "description": doc.description,
            "contentType": "application/json",
            "headers": HEADERS[doc.name],
            "correlationId": {"location": location, "description": meaning},
            "payload": {"$ref": f"#/components/schemas/{doc.name}"},
            "bindings": {
                "kafka": {
                    "key": {"type": "string", "minLength": 1, "maxLength": 512,
                            "description": f"Key: {key}. {_KEY_RULE}"},
                    "bindingVersion": KAFKA_BINDING_VERSION,
                },
            },
            "examples": [examples[doc.name]],
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "vmstream",
            "version": CONTRACTS_VERSION,
            "description": (
                "Keeps GPU-passthrough VMs on KubeVirt right, event by event, over Kafka. "
                "Topic names are the defaults: a configured prefix may replace `vmstream.`. "
                "Values are UTF-8 JSON objects; timestamps are RFC 3339 with a zone. "
                "Changes to these contracts are additive only. "
                f"{EVENT_SCHEME}"
            ),
            "license": {"name": "Apache-2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
            "tags": [{"name": name, "description": text} for name, text in COMPONENTS.items()],
        },
        "defaultContentType": "application/json",
        "servers": SERVERS,
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": _component_schemas(MESSAGES),
                       "securitySchemes": SECURITY_SCHEMES},
    }


def _render_yaml(document: JsonObject) -> str:
    text: str = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=100)
    return text


# ---------------------------------------------------------------------------- entry points


def render_schemas() -> dict[str, str]:
    """Every published file's name and text, in a stable order; no I/O."""
    files = {doc.file: _render_json(json_schema(doc)) for doc in (*MESSAGES, CONFIG)}
    files[ASYNCAPI_FILE] = _render_yaml(asyncapi_document())
    files[OPENAPI_FILE] = _render_json(openapi_document())  # the read API (streams/serve/api.py)
    return files


def write_schemas(output: str | Path) -> list[Path]:
    """Write :func:`render_schemas` into ``output``; returns the paths written."""
    directory = Path(output)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_schemas().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
