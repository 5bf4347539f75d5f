"""The published schemas match the models and accept what vmstream really reads and writes.

The committed files under ``docs/schemas/`` are what consumers code against, so they must
be what :func:`streams.cli.schemas.render_schemas` produces today, and every example input and
every simulated output must validate against the schema of its topic — both the standalone
JSON Schema file and the copy embedded in the AsyncAPI document.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from handlers.contracts.messages import InvalidIntent, MalformedMessage, parse_intent, parse_watch_event
from handlers.decide.engine import Engine
from streams.cli.schemas import ASYNCAPI_FILE, CONFIG, MESSAGES, TOPICS, render_schemas
from handlers.contracts.topics import TOPICS as TOPICS_DECLARED
from handlers.contracts.topics import ROUTED_INPUTS, outputs
from streams.common.principals import PRINCIPAL_OF, PRINCIPALS
from streams.common.settings import KafkaSettings, load_settings
from streams.cli.simulating import Simulation
from streams.common.topics import DELIVERIES, GPU_CLASSES
from tests.support.producers import KeptRecords

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS_DIR = ROOT / "docs" / "schemas"
EXAMPLES_DIR = ROOT / "examples"
CONTRACTS = ROOT / "docs" / "contracts.md"
SCENARIOS = sorted(path.name for path in EXAMPLES_DIR.glob("*.jsonl"))
KAFKA = KafkaSettings()
INPUT_TOPICS = tuple(topic.name for topic in ROUTED_INPUTS)
OUTPUT_TOPICS = tuple(topic.name for topic in outputs("worker", "applier"))
PREFIX = KAFKA.topic_prefix

# Example values that are deliberately wrong in a way the schema can see, by file and id.
# Other "bad" inputs there (unknown GPU class, wrong project, non-operator drain, restart
# of a halted VM) are well-formed: only the rules can refuse them.
SCHEMA_INVALID = {("bad-input.jsonl", "it-bad-3")}  # cores 3, memory_gib 128
# Compacted topics other processes keep: vmstream api's GPU classes, vmstream notify's ledger.
KEPT_TOPICS = (GPU_CLASSES, DELIVERIES)


@cache
def _committed(name: str) -> str:
    return (SCHEMAS_DIR / name).read_text(encoding="utf-8")


@cache
def _rendered() -> dict[str, str]:
    return render_schemas()


@cache
def _validator(topic: str) -> Draft202012Validator:
    """The standalone JSON Schema file of a logical topic (``intents``, ``audit``, …)."""
    doc = next(t.message for t in TOPICS if t.name == topic)
    schema = json.loads(_committed(doc.file))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@cache
def _asyncapi() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(_committed(ASYNCAPI_FILE))
    return document


@cache
def _asyncapi_validator(topic: str) -> Draft202012Validator:
    """The payload schema of a channel's message, resolved inside the AsyncAPI document."""
    document = _asyncapi()
    (message_ref,) = document["channels"][topic]["messages"].values()
    message = _resolve(document, message_ref["$ref"])
    # The document is the root, so `#/components/schemas/...` resolves as tooling does.
    return Draft202012Validator({"components": document["components"], **message["payload"]})


def _resolve(document: dict[str, Any], ref: str) -> Any:
    node: Any = document
    for step in ref.removeprefix("#/").split("/"):
        node = node[step]
    return node


def _errors(topic: str, value: Any) -> list[str]:
    """Schema errors from both the file and the AsyncAPI copy; they must agree."""
    plain = sorted(e.message for e in _validator(topic).iter_errors(value))
    embedded = sorted(e.message for e in _asyncapi_validator(topic).iter_errors(value))
    assert bool(plain) == bool(embedded), f"file and AsyncAPI schemas disagree: {plain} vs {embedded}"
    return plain


def _lines(name: str) -> list[dict[str, Any]]:
    text = (EXAMPLES_DIR / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _logical(topic: str) -> str:
    assert topic.startswith(PREFIX), topic
    return topic.removeprefix(PREFIX)


def _ref(value: dict[str, Any]) -> str:
    return str(value.get("intent_id") or value.get("event_id"))


# ------------------------------------------------------------------------- staleness


@pytest.mark.parametrize("name", sorted(render_schemas()))
def test_committed_files_are_current(name: str) -> None:
    path = SCHEMAS_DIR / name
    assert path.exists(), f"{path} is missing: run `vmstream schemas --output docs/schemas`"
    assert _committed(name) == _rendered()[name], (
        f"{path} is stale: the models changed; run `vmstream schemas --output docs/schemas` "
        "and commit the result"
    )


def test_no_stray_files() -> None:
    stray = {path.name for path in SCHEMAS_DIR.iterdir()} - set(_rendered())
    assert not stray, f"not written by `vmstream schemas`: {sorted(stray)}"


def test_rendering_is_deterministic() -> None:
    assert render_schemas() == _rendered()


@pytest.mark.parametrize("name", sorted(n for n in render_schemas() if n.endswith(".schema.json")))
def test_json_schema_files_are_draft_2020_12(name: str) -> None:
    schema = json.loads(_committed(name))
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].endswith("/" + name)
    assert schema["title"] and schema["description"]
    Draft202012Validator.check_schema(schema)


# -------------------------------------------------------------------------- examples


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_example_values_match_their_schema(scenario: str) -> None:
    """Object values validate; raw-text values are the malformed cases and must not."""
    declared = {ref for file, ref in SCHEMA_INVALID if file == scenario}
    seen_invalid: set[str] = set()
    checked = 0
    for number, line in enumerate(_lines(scenario), start=1):
        topic, value = _logical(line["topic"]), line["value"]
        assert topic in INPUT_TOPICS, f"{scenario}:{number}: {topic} is not an input topic"
        where = f"{scenario}:{number}"
        if isinstance(value, str):
            # A JSON string is the raw text of a deliberately malformed message.
            assert scenario == "bad-input.jsonl", f"{where}: raw-text value outside bad-input"
            try:
                decoded = json.loads(value)
            except json.JSONDecodeError:
                continue  # not JSON at all: no schema to ask
            assert _errors(topic, decoded), f"{where}: a malformed message passes the {topic} schema"
            continue
        checked += 1
        errors = _errors(topic, value)
        if _ref(value) in declared:
            assert errors, f"{where}: {_ref(value)} is meant to fail the {topic} schema"
            seen_invalid.add(_ref(value))
        else:
            assert not errors, f"{where}: {errors}"
    assert checked, f"{scenario}: no JSON object values"
    assert seen_invalid == declared, f"{scenario}: declared invalid but not found: {declared - seen_invalid}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_schema_accepts_whatever_the_parser_accepts(scenario: str) -> None:
    """The schema may be looser than the models (validators it cannot express), never stricter."""
    for number, line in enumerate(_lines(scenario), start=1):
        topic, value = _logical(line["topic"]), line["value"]
        try:
            if topic == "intents":
                parse_intent(value)
            else:
                parse_watch_event(value)
        except (MalformedMessage, InvalidIntent):
            continue
        assert not _errors(topic, value if isinstance(value, dict) else json.loads(value)), (
            f"{scenario}:{number}: the parser accepts what the schema refuses"
        )


def test_example_config_matches_config_schema() -> None:
    schema = json.loads(_committed(CONFIG.file))
    config = yaml.safe_load((EXAMPLES_DIR / "config.yaml").read_text(encoding="utf-8"))
    assert not sorted(e.message for e in Draft202012Validator(schema).iter_errors(config))
    assert list(Draft202012Validator(schema).iter_errors({"az": "az1", "typo": 1}))


# ------------------------------------------------------------------------- simulation


def _simulate(scenario: str, lines: list[str] | None = None) -> list[dict[str, Any]]:
    settings = load_settings(EXAMPLES_DIR / "config.yaml")
    simulation = Simulation(Engine(settings.rules()), settings.kafka)
    if lines is None:
        lines = (EXAMPLES_DIR / scenario).read_text(encoding="utf-8").splitlines()
    return [json.loads(out) for out in simulation.feed(lines)]


@cache
def _all_outputs() -> tuple[tuple[str, int, dict[str, Any]], ...]:
    return tuple((scenario, number, out) for scenario in SCENARIOS
                 for number, out in enumerate(_simulate(scenario), start=1))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_simulated_outputs_match_their_schema(scenario: str) -> None:
    outputs = [(number, out) for name, number, out in _all_outputs() if name == scenario]
    assert outputs, f"{scenario}: the simulation wrote nothing"
    for number, out in outputs:
        topic = _logical(out["topic"])
        assert topic in OUTPUT_TOPICS, f"{scenario} output {number}: {topic} is not an output topic"
        errors = _errors(topic, out["value"])
        assert not errors, f"{scenario} output {number} ({topic}): {errors}"


def test_simulations_exercise_every_written_topic() -> None:
    """Guards the test above from passing vacuously; command results come from the applier."""
    counts = Counter(_logical(out["topic"]) for _, _, out in _all_outputs())
    assert {"commands", "notifications", "audit", "dlq"} <= set(counts), counts


def test_keyless_input_audit_matches_schema() -> None:
    outputs = _simulate("keyless", ['{"topic": "vmstream.intents", "value": "{not json"}'])
    audits = [out["value"] for out in outputs if out["topic"] == KAFKA.topic("audit")]
    assert audits
    for audit in audits:
        assert not _errors("audit", audit), audit


# -------------------------------------------------------------------------- AsyncAPI


def _contract_topics() -> set[str]:
    text = CONTRACTS.read_text(encoding="utf-8")
    return set(re.findall(r"^\| `(vmstream\.[a-z0-9-]+)` \|", text, flags=re.MULTILINE))


def test_asyncapi_names_every_contract_topic() -> None:
    document = _asyncapi()
    assert document["asyncapi"] == "3.0.0"
    addresses = {channel["address"] for channel in document["channels"].values()}
    expected = {KAFKA.topic(name) for name in (*INPUT_TOPICS, *OUTPUT_TOPICS, *KEPT_TOPICS)}
    assert addresses == expected
    contract = _contract_topics()
    assert contract == expected, f"docs/contracts.md lists {sorted(contract)}"


def test_asyncapi_references_resolve() -> None:
    document = _asyncapi()

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            return own + [r for value in node.values() for r in refs(value)]
        if isinstance(node, list):
            return [r for item in node for r in refs(item)]
        return []

    found = refs(document)
    assert found and all(ref.startswith("#/") for ref in found)
    for ref in found:
        _resolve(document, ref)  # KeyError names the broken ref
    assert "$defs" not in yaml.safe_dump(document["components"]["schemas"])


def test_asyncapi_operations_are_what_the_acls_allow() -> None:
    """The document's operations are the sends and receives handlers/contracts/topics.py declares; the ACL
    table derives from the same declaration and tests/kafka/test_acls.py shows, on a secured
    broker, that each process needs exactly those grants. So the document says what the code does."""
    operations = _asyncapi()["operations"].values()
    seen = {(op["tags"][0]["name"], op["action"], op["channel"]["$ref"].rsplit("/", 1)[1]) for op in operations}
    public = {topic.name for topic in TOPICS_DECLARED if not topic.internal}
    granted = {(process, action, name)
               for process, principal in PRINCIPAL_OF.items()
               for action, names in (("receive", PRINCIPALS[principal].read), ("send", PRINCIPALS[principal].write))
               for name in names if name in public}
    assert seen == granted
    assert ("notify", "receive", "notifications") in seen  # once missing from a hand-written list


def test_the_kept_topics_accept_what_api_and_notify_write() -> None:
    """vmstream api's class records (a tombstone's headers too) and notify's ledger records, with
    their headers, as those processes build them."""
    import asyncio
    import hashlib
    from collections.abc import Sequence
    from datetime import UTC, datetime

    from handlers.contracts.messages import GPUClassStatus, Notification
    from handlers.contracts.tracing import derived_trace
    from streams.common.durable import Delivered, Record
    from streams.serve.api import ClassTopic
    from streams.serve.notify import DeliveryLedger, Notifier

    status = GPUClassStatus(name="nvidia-a100", class_id=None, display_name="A100", device_name="nvidia.com/A100",
                            undefined=True, permitted=True, total=2, schedulable=1, in_use=1, free=0)
    published: list[tuple[str, bytes, bytes | None, list[tuple[str, bytes]]]] = []

    class ClassProducer:
        async def deliver(self, records: Sequence[Record]) -> list[Delivered | str]:
            published.extend((record.topic, record.key or b"", record.value, list(record.headers)) for record in records)
            return [Delivered(record.topic, 0, offset) for offset, record in enumerate(records)]

    computed = datetime(2026, 11, 30, 10, 0, 5, tzinfo=UTC)
    topic = ClassTopic()
    for current in ([status], [status], []):  # a class, unchanged, gone
        asyncio.run(topic.publish(ClassProducer(), KAFKA.topic(GPU_CLASSES), current,
                                  source="/vmstream/api/vmstream", time=computed))
    assert [(key, value is None) for _, key, value, _ in published] == [(b"nvidia-a100", False), (b"nvidia-a100", True)]
    assert topic.changes([]) == []
    classes = _asyncapi()["components"]["messages"]["GPUClassStatus"]
    for topic_name, key_bytes, value, headers in published:
        assert topic_name == KAFKA.topic(GPU_CLASSES)
        named = {header: raw.decode() for header, raw in headers}
        assert not list(Draft202012Validator(classes["headers"]).iter_errors(named)), named
        assert named["ce_time"] == "2026-11-30T10:00:05Z" and named["ce_source"] == "/vmstream/api/vmstream"
        assert named["traceparent"] == derived_trace(named["ce_id"]).child(named["ce_id"])
        if value is None:  # a tombstone: no value to check, nor its content-type
            assert named["ce_id"] == "nvidia-a100@tombstone" and "content-type" not in named
        else:
            assert not _errors(GPU_CLASSES, json.loads(value))
            assert named["ce_id"] == f"nvidia-a100@{hashlib.sha256(value).hexdigest()[:16]}"
            assert named["content-type"] == "application/json"

    out = KeptRecords()
    ledger = DeliveryLedger.__new__(DeliveryLedger)  # nothing delivered yet, and no consumer to read it back
    ledger.topic, ledger.done = KAFKA.topic(DELIVERIES), set()

    at = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    notifier = Notifier(load_settings(EXAMPLES_DIR / "config.yaml"), clock=lambda: at)
    [example] = _asyncapi()["components"]["messages"]["Notification"]["examples"]
    parsed = Notification.model_validate(example["payload"])
    for channel, recipient, outcome, attempts in (("email", "bob@example.com", "delivered", 1),
                                                   ("none", "carol", "dead_lettered", 0)):
        key = f"{parsed.notification_id}|{channel}|{recipient}"
        notifier._record(out, ledger, key, parsed, channel=channel,
                         recipient=recipient, outcome=outcome, attempts=attempts,
                         trace=derived_trace(parsed.notification_id))
    sent = [(r.topic, r.key or b"", r.value or b"", list(r.headers)) for r in out.records]
    assert len(sent) == 2
    message = _asyncapi()["components"]["messages"]["Delivery"]
    for topic_name, key_bytes, value_bytes, headers in sent:
        assert topic_name == KAFKA.topic(DELIVERIES)
        assert not _errors(DELIVERIES, json.loads(value_bytes))
        named = {header: raw.decode() for header, raw in headers}
        assert named["ce_id"] == key_bytes.decode()
        assert not list(Draft202012Validator(message["headers"]).iter_errors(named)), named
    assert _errors(DELIVERIES, {**json.loads(sent[0][2]), "outcome": "skipped"})


def test_every_message_has_a_channel() -> None:
    assert {topic.message.name for topic in TOPICS} == {doc.name for doc in MESSAGES}


def test_openapi_document_describes_the_read_api_with_valid_schemas() -> None:
    """docs/schemas/openapi.json is OpenAPI 3.1, whose schemas are JSON Schema 2020-12."""
    document = json.loads(_committed("openapi.json"))
    assert document["openapi"].startswith("3.1.")
    assert set(document["paths"]) == {"/v1/gpu-classes", "/v1/vms/{namespace}/{name}", "/v1/projects/{project}",
                                      "/v1/plans", "/v1/plans/{plan}"}
    plan = document["paths"]["/v1/plans/{plan}"]["get"]
    assert plan["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/PlanView")
    assert "404" in plan["responses"] and "404" not in document["paths"]["/v1/plans"]["get"]["responses"]
    assert {"PlanList", "PlanView", "PlanNode", "PlanVM", "PlanOwner"} <= set(document["components"]["schemas"])
    for schema in document.get("components", {}).get("schemas", {}).values():
        Draft202012Validator.check_schema(schema)
