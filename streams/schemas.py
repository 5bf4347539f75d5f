"""``vmstream schemas``: the published contracts, generated from the pydantic models.

pydantic models (``handlers.messages``, ``streams.settings``) → one JSON Schema file per
message plus the configuration file → an AsyncAPI 3.0.0 document naming every topic.
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
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import TypeAdapter

from handlers.messages import (
    AuditRecord,
    Command,
    CommandResult,
    DeadLetter,
    Intent,
    Notification,
    WatchEvent,
)
from streams.api import openapi_document
from streams.settings import KafkaSettings, Settings

__all__ = [
    "ASYNCAPI_FILE", "CONFIG", "MESSAGES", "TOPICS",
    "asyncapi_document", "json_schema", "render_schemas", "write_schemas",
]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_ID_BASE = "https://vmstream.io/schemas/"
ASYNCAPI_FILE = "asyncapi.yaml"
OPENAPI_FILE = "openapi.json"
# The contracts' own version, not the package's: bump the minor on an additive change.
CONTRACTS_VERSION = "1.0.0"
KAFKA_BINDING_VERSION = "0.5.0"

JsonObject = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SchemaDoc:
    """One published schema: its file, its component name and what a reader is told."""

    file: str
    name: str
    description: str
    generate: Callable[[], JsonObject]


@dataclass(frozen=True, slots=True)
class TopicDoc:
    """One topic of CONTRACTS.md: its logical name (without prefix), key and message."""

    name: str
    title: str
    key: str
    description: str
    message: SchemaDoc


@dataclass(frozen=True, slots=True)
class OperationDoc:
    """One send or receive, seen from the vmstream component that does it."""

    component: Literal["worker", "applier", "watch-bridge"]
    action: Literal["send", "receive"]
    topic: str
    summary: str

    @property
    def id(self) -> str:
        words = [*self.component.split("-"), self.action.capitalize(), *self.topic.split("-")]
        return words[0] + "".join(word[:1].upper() + word[1:] for word in words[1:])


def _model(adapter: TypeAdapter[Any]) -> Callable[[], JsonObject]:
    return lambda: adapter.json_schema(mode="validation")


INTENT = SchemaDoc(
    "intent.schema.json",
    "Intent",
    "A request to vmstream (vmstream.intents), discriminated by `type`. The same "
    "`intent_id` twice has one effect. A message without `intent_id`, `type` or "
    "`requested_by` is malformed and dead-lettered; one that has them but fails the rest "
    "of this schema is rejected and its requester told why.",
    _model(TypeAdapter(Intent)),
)
WATCH_EVENT = SchemaDoc(
    "watch-event.schema.json",
    "WatchEvent",
    "A change the watch bridge saw on a watched Kubernetes object (vmstream.k8s-events); "
    "`object` is the whole object as the API served it and must carry `metadata.name`.",
    _model(TypeAdapter(WatchEvent)),
)
COMMAND = SchemaDoc(
    "command.schema.json",
    "Command",
    "A change for the applier to make (vmstream.commands). `command_id` is deterministic "
    "from its cause, so a replay reissues the same id. A VM change carries an RFC 6902 "
    "`patch` from the object at `base_resource_version`; `create_vm` carries `manifest`.",
    _model(TypeAdapter(Command)),
)
COMMAND_RESULT = SchemaDoc(
    "command-result.schema.json",
    "CommandResult",
    "What the applier did with a command (vmstream.command-results); `error` is set when "
    "`outcome` is `failed`.",
    _model(TypeAdapter(CommandResult)),
)
NOTIFICATION = SchemaDoc(
    "notification.schema.json",
    "Notification",
    "A fact a person must be told (vmstream.notifications). `notification_id` is "
    "deterministic: the same fact never notifies twice. `message` is one plain sentence.",
    _model(TypeAdapter(Notification)),
)
AUDIT_RECORD = SchemaDoc(
    "audit-record.schema.json",
    "AuditRecord",
    "The record of one consumed input and what was decided (vmstream.audit): exactly one "
    "per consumed intent and per command result. `input.ref` is the intent_id, event_id "
    "or command_id.",
    _model(TypeAdapter(AuditRecord)),
)
DEAD_LETTER = SchemaDoc(
    "dead-letter.schema.json",
    "DeadLetter",
    "A message that could not be read (vmstream.dlq), kept so it is never lost: `original` "
    "is the raw value as text, or base64 when `encoding` says so.",
    _model(TypeAdapter(DeadLetter)),
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
)

_VM_OR_NODE = "`vm/<namespace>/<name>` or `node/<name>`"
TOPICS: tuple[TopicDoc, ...] = (
    TopicDoc("intents", "Intents", _VM_OR_NODE,
             "Requests from upstream services and the CLI. Any partitioner will do (murmur2, "
             "FNV-1a, CRC32, explicit partitions): the worker re-keys each intent by its key onto "
             "a topic it partitions itself (vmstream.worker-routed, internal) and decides it "
             "there, with its VM's or node's state.", INTENT),
    TopicDoc("k8s-events", "Kubernetes events",
             "`<Kind>/<namespace>/<name>` (cluster-scoped: `<Kind>/<name>`)",
             "Watched objects (VirtualMachine, VirtualMachineInstance, Node, NodeMaintenance, "
             "KubeVirt) as the watch bridge sees them. Any partitioner will do: the worker "
             "re-keys each event by the key it is decided under (`vm/<namespace>/<name>`, "
             "`node/<name>`) onto vmstream.worker-routed.", WATCH_EVENT),
    TopicDoc("commands", "Commands", f"the target's key: {_VM_OR_NODE}",
             "Changes the worker decided, for the applier to make.", COMMAND),
    TopicDoc("command-results", "Command results", "the key of its command",
             "What the applier did with each command.", COMMAND_RESULT),
    TopicDoc("notifications", "Notifications", f"the subject's key: {_VM_OR_NODE}",
             "What VM owners, requesters and operators must be told.", NOTIFICATION),
    TopicDoc("audit", "Audit", "the subject's key (the key of the input it records)",
             "One record per consumed input: the record of every decision.", AUDIT_RECORD),
    TopicDoc("dlq", "Dead letters", "the original key",
             "Malformed input, kept whole; it never blocks its partition.", DEAD_LETTER),
)

OPERATIONS: tuple[OperationDoc, ...] = (
    OperationDoc("worker", "receive", "intents", "Route each intent by its key to the instance that decides it."),
    OperationDoc("worker", "receive", "k8s-events", "Route each event by its decision key; keep the observed state."),
    OperationDoc("worker", "send", "commands", "Ask the applier for a change."),
    OperationDoc("worker", "send", "notifications", "Tell people what will happen or happened."),
    OperationDoc("worker", "send", "audit", "Record each decision."),
    OperationDoc("worker", "send", "dlq", "Set aside what cannot be read."),
    OperationDoc("applier", "receive", "commands", "Apply each command to the Kubernetes API."),
    OperationDoc("applier", "send", "command-results", "Report each command's outcome."),
    OperationDoc("applier", "send", "audit", "Record each command it applied or failed."),
    OperationDoc("watch-bridge", "send", "k8s-events", "Publish each change of a watched object."),
)

COMPONENTS: dict[str, str] = {
    "worker": "Consumes intents and watch events, re-keyed onto its own internal topic "
              "(vmstream.worker-routed) by decision key; runs the decision rules.",
    "applier": "The only writer to the Kubernetes API; applies commands idempotently.",
    "watch-bridge": "Watches the Kubernetes API and publishes what it sees.",
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
    for topic in TOPICS:
        message = topic.message.name
        channels[topic.name] = {
            "address": kafka.topic(topic.name),
            "title": topic.title,
            "description": f"{topic.description} Key: {topic.key}. Value: {message}.",
            "messages": {message: {"$ref": f"#/components/messages/{message}"}},
        }
    operations: JsonObject = {}
    for op in OPERATIONS:
        topic = by_name[op.topic]
        operations[op.id] = {
            "action": op.action,
            "channel": {"$ref": f"#/channels/{topic.name}"},
            "summary": op.summary,
            "tags": [{"name": op.component}],
            "messages": [{"$ref": f"#/channels/{topic.name}/messages/{topic.message.name}"}],
        }
    messages: JsonObject = {}
    for topic in TOPICS:
        doc = topic.message
        messages[doc.name] = {
            "name": doc.name,
            "title": doc.name,
            "description": doc.description,
            "contentType": "application/json",
            "payload": {"$ref": f"#/components/schemas/{doc.name}"},
            "bindings": {
                "kafka": {
                    "key": {"type": "string", "description": f"Key: {topic.key}."},
                    "bindingVersion": KAFKA_BINDING_VERSION,
                },
            },
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
                "Changes to these contracts are additive only."
            ),
            "license": {"name": "Apache-2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
            "tags": [{"name": name, "description": text} for name, text in COMPONENTS.items()],
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": _component_schemas(MESSAGES)},
    }


def _render_yaml(document: JsonObject) -> str:
    text: str = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=100)
    return text


# ---------------------------------------------------------------------------- entry points


def render_schemas() -> dict[str, str]:
    """Every published file's name and text, in a stable order; no I/O."""
    files = {doc.file: _render_json(json_schema(doc)) for doc in (*MESSAGES, CONFIG)}
    files[ASYNCAPI_FILE] = _render_yaml(asyncapi_document())
    files[OPENAPI_FILE] = _render_json(openapi_document())  # the read API (streams/api.py)
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
