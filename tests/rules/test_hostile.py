"""A bad input costs only itself: whatever bytes arrive, the engine returns one decision with
one audit record; what cannot be decided is one dead letter naming its topic, partition and
offset; and every message it makes fits the broker.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from typing import Any

import pytest

from handlers.contracts.messages import (
    ORIGINAL_MAX,
    ORIGINAL_PREFIX_BYTES,
    TEXT_MAX,
    AuditInput,
    AuditRecord,
    MalformedMessage,
    Notification,
    ObjectRef,
    wire_bytes,
)
from handlers.core.decisions import Decision
from handlers.core.tables import NODES, PROCESSED
from handlers.decide.engine import Result, Source
from samples.cluster import RTX, node, vm
from tests.support.harness import EVENTS_TOPIC, INTENTS_TOPIC, START, Harness, config

ALICE = "alice@example.com"
SPEC = {"namespace": "spx-proj-a", "name": "w-1", "gpu_class": "nvidia-a100"}
KEY = "vm/spx-proj-a/w-1"
BROKER_LIMIT = 1_000_000  # the producer's request limit, below the broker's message limit


def harness(**overrides: Any) -> Harness:
    """Intents taken at their word (``auth: none``): these are about bytes, not credentials."""
    return Harness(config(auth={"mode": "none"}, **overrides))


def set_gpu(**changes: Any) -> dict[str, Any]:
    value: dict[str, Any] = {"intent_id": "it-1", "type": "set_gpu", "requested_by": ALICE, "project": "proj-a",
                             "spec": dict(SPEC)}
    value.update(changes)
    return value


def encoded(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


def event_of(obj: dict[str, Any], event_id: str = "ev-1") -> dict[str, Any]:
    return {"event_id": event_id, "type": "ADDED", "kind": obj["kind"], "object": obj,
            "observed_at": START.isoformat()}


def decide_intent(h: Harness, raw: Any, key: str | None = KEY, offset: int = 41) -> Result:
    return h.engine.on_intent(h.state, raw, Source(INTENTS_TOPIC, key, 3, offset), h.now)


def decide_event(h: Harness, raw: Any, key: str | None, offset: int = 7) -> Result:
    return h.engine.on_event(h.state, raw, Source(EVENTS_TOPIC, key, 2, offset), h.now)


def assert_dead_lettered(result: Result, topic: str, partition: int, offset: int, error: str) -> None:
    """One dead letter with its input's place, one audit record naming it; nothing else."""
    [letter] = result.dead_letters
    assert error in letter.error, letter.error
    assert (letter.source.topic, letter.source.partition, letter.source.offset) == (topic, partition, offset)
    audit = result.decision.audit
    assert audit is not None and audit.outcome == "rejected" and audit.input.ref == f"{topic}:{partition}:{offset}"
    assert result.decision.commands == [] and result.decision.notifications == []
    assert result.decision.changes == []
    assert_fits(result)


def assert_fits(result: Result) -> None:
    for output in result.outputs():
        assert len(output.key.encode()) + len(wire_bytes(output.value)) < BROKER_LIMIT, output.topic


HOSTILE_VALUES = [
    pytest.param(None, "no value (a tombstone)", id="null-value"),
    pytest.param(b"", "not JSON", id="empty"),
    pytest.param(b'{"intent_id": "\xff\xfe"}', "not JSON", id="invalid-utf8"),
    pytest.param(b'{"intent_id": "\\ud800"}', "not JSON", id="lone-surrogate"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, "recursion limit exceeded", id="nested-100k-deep"),
    pytest.param(b'{"a": ' + b"[" * 250 + b"]" * 250 + b"}", "recursion limit exceeded", id="nested-250-deep"),
    pytest.param(b'{"intent_id": ' + b"7" * 5000 + b"}", "number out of range", id="5000-digit-integer"),
    pytest.param(b'{"intent_id": NaN}', "not JSON", id="nan"),
    pytest.param(b'{"a": "' + b"x" * 600_000 + b'"}', "over the limit of 524288", id="600-kB-value"),
    pytest.param(b'"just a string"', "not a JSON object but str", id="not-an-object"),
]


@pytest.mark.parametrize(("raw", "error"), HOSTILE_VALUES)
def test_hostile_intents_are_one_dead_letter_each_with_their_offset(raw: bytes | None, error: str) -> None:
    h = harness()
    result = decide_intent(h, raw)
    assert_dead_lettered(result, INTENTS_TOPIC, 3, 41, error)
    good = h.intent("set_gpu", SPEC)  # and the line goes on
    assert good.decision.audit is not None and good.dead_letters == []


@pytest.mark.parametrize(("raw", "error"), HOSTILE_VALUES)
def test_hostile_watch_events_are_one_dead_letter_each_with_their_offset(raw: bytes | None, error: str) -> None:
    h = harness()
    assert_dead_lettered(decide_event(h, raw, "Node/gpu-node-1"), EVENTS_TOPIC, 2, 7, error)


def test_a_tombstone_is_dead_lettered_as_an_empty_original() -> None:
    h = harness()
    [letter] = decide_intent(h, None).dead_letters
    assert letter.original == "" and letter.encoding == "utf-8"


def test_invalid_utf8_is_kept_as_base64() -> None:
    raw = b'{"intent_id": "\xff"}'
    [letter] = decide_intent(harness(), raw).dead_letters
    assert letter.encoding == "base64" and base64.b64decode(letter.original) == raw


@pytest.mark.parametrize("raw", [b'{"a": "' + b"x" * 600_000 + b'"}', bytes(range(256)) * 2400],
                         ids=["text", "binary"])
def test_an_oversized_original_is_kept_as_a_prefix_its_size_and_digest(raw: bytes) -> None:
    [letter] = decide_intent(harness(), raw).dead_letters
    assert letter.original_truncated is True
    assert letter.original_size == len(raw) and letter.original_sha256 == hashlib.sha256(raw).hexdigest()
    prefix = base64.b64decode(letter.original) if letter.encoding == "base64" else letter.original.encode()
    assert prefix == raw[:ORIGINAL_PREFIX_BYTES] and len(letter.original) <= ORIGINAL_MAX
    assert len(wire_bytes(letter)) < 30_000


def test_a_small_original_is_kept_whole_without_size_or_digest() -> None:
    [letter] = decide_intent(harness(), b"{not json").dead_letters
    assert letter.original == "{not json" and letter.original_truncated is None and letter.original_sha256 is None


def test_an_oversized_key_is_dead_lettered_and_cut() -> None:
    h = harness()
    key = "vm/" + "k" * 600_000
    result = decide_intent(h, encoded(set_gpu()), key=key)
    assert_dead_lettered(result, INTENTS_TOPIC, 3, 41, "a key of 600003 characters, over the limit of 512")
    assert len(result.outputs()[0].key) <= 512 and result.decision.audit is not None
    assert result.decision.audit.input.key is not None and len(result.decision.audit.input.key) <= 512
    assert_dead_lettered(decide_event(h, b"{}", "Node/" + "n" * 600_000), EVENTS_TOPIC, 2, 7, "over the limit of 512")


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        pytest.param({"requested_by": "a" * 300_000 + "@example.com"}, "requested_by", id="300-kB-principal"),
        pytest.param({"type": "t" * 300_000}, "type: String should have at most 64 characters", id="300-kB-type"),
        pytest.param({"intent_id": "i" * 300_000}, "intent_id: String should have at most 256", id="300-kB-id"),
    ],
)
def test_an_oversized_envelope_field_is_a_dead_letter_not_quoted(changes: dict[str, Any], error: str) -> None:
    result = decide_intent(harness(), encoded(set_gpu(**changes)))
    assert_dead_lettered(result, INTENTS_TOPIC, 3, 41, error)
    assert len(result.dead_letters[0].error) < 1000


def test_an_oversized_spec_field_is_rejected_to_its_requester_without_quoting_it() -> None:
    h = harness()
    result = decide_intent(h, encoded(set_gpu(spec={**SPEC, "gpu_class": "g" * 300_000})))
    [told] = result.decision.notifications
    assert told.type == "intent_rejected" and told.recipients == [ALICE]
    assert "spec.gpu_class: String should have at most 253 characters" in told.message
    assert result.decision.audit is not None and result.decision.audit.outcome == "rejected"
    assert len(wire_bytes(told)) < 2000
    assert_fits(result)


def test_a_thousand_unknown_fields_are_described_in_a_bounded_reason() -> None:
    spec = {**SPEC, **{f"{'x' * 400}{i}": i for i in range(1000)}}
    result = decide_intent(harness(), encoded(set_gpu(spec=spec)))
    audit = result.decision.audit
    assert audit is not None and audit.outcome == "rejected" and audit.reason is not None
    assert "and 990 more" in audit.reason and len(audit.reason) < 4000


@pytest.mark.parametrize("value", [set_gpu(), {"bad": "schema"}], ids=["valid", "wrong-schema"])
def test_an_intent_keyed_for_another_vm_is_a_dead_letter(value: dict[str, Any]) -> None:
    h = harness()
    result = decide_intent(h, encoded(value), key="vm/spx-proj-a/someone-else")
    [letter] = result.dead_letters
    assert letter.source.offset == 41
    assert result.decision.commands == [] and result.decision.changes == []
    if value == set_gpu():
        assert "does not match the message's 'vm/spx-proj-a/w-1'" in letter.error
    assert h.state.get(PROCESSED, "it-1") is None


def test_an_intent_without_a_key_on_kafka_is_a_dead_letter_and_offline_it_is_decided() -> None:
    h = harness()
    assert_dead_lettered(decide_intent(h, encoded(set_gpu()), key=None), INTENTS_TOPIC, 3, 41, "the key None")
    offline = h.engine.on_intent(h.state, encoded(set_gpu()), Source(INTENTS_TOPIC, None), h.now)
    assert offline.dead_letters == [] and offline.decision.audit is not None


def test_a_drain_keyed_for_another_node_is_a_dead_letter() -> None:
    drain = {"intent_id": "d-1", "type": "drain_node", "requested_by": "ops@example.com",
             "spec": {"node": "gpu-node-1", "reason": "firmware"}}
    assert_dead_lettered(decide_intent(harness(), encoded(drain), key="node/gpu-node-2"), INTENTS_TOPIC, 3, 41,
                         "does not match the message's 'node/gpu-node-1'")


def test_a_watch_event_keyed_for_another_object_is_a_dead_letter() -> None:
    h = harness()
    raw = encoded(event_of(node("gpu-node-1", gpus={RTX: 2})))
    assert_dead_lettered(decide_event(h, raw, "Node/gpu-node-2"), EVENTS_TOPIC, 2, 7,
                         "does not match the message's 'Node/gpu-node-1'")
    assert h.state.get(NODES, "gpu-node-1") is None
    assert decide_event(h, raw, "Node/gpu-node-1").dead_letters == []


@pytest.mark.parametrize(
    ("metadata", "error"),
    [({"name": "n" * 300}, "object.metadata.name must be 1 to 253"),
     ({"name": "v", "namespace": ["spx"]}, "object.metadata.namespace must be a string")],
    ids=["long-name", "namespace-not-a-string"],
)
def test_a_watch_event_with_an_impossible_name_is_a_dead_letter(metadata: dict[str, Any], error: str) -> None:
    raw = encoded(event_of({"kind": "VirtualMachine", "metadata": metadata}))
    assert_dead_lettered(decide_event(harness(), raw, "VirtualMachine/v"), EVENTS_TOPIC, 2, 7, error)


def test_an_object_no_rule_foresaw_is_a_dead_letter_not_an_exception() -> None:
    """``metadata.labels`` a list: the rules' own error is caught and the input dead-lettered."""
    h = harness()
    obj = vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE)
    obj["metadata"]["labels"] = ["not", "a", "map"]
    result = decide_event(h, encoded(event_of(obj)), "VirtualMachine/spx-proj-a/w-1")
    assert_dead_lettered(result, EVENTS_TOPIC, 2, 7, "internal error: AttributeError")


def test_an_output_too_large_for_the_broker_makes_the_input_a_dead_letter() -> None:
    h = harness(limits={"max_output_bytes": 65_536})
    subject = ObjectRef(kind="VirtualMachine", namespace="spx-proj-a", name="w-1")
    told = Notification(notification_id="ntf-1", type="gpu_unavailable", recipients=[ALICE], subject=subject,
                        severity="info", message="m", details={"blob": "x" * 100_000})
    audit = AuditRecord(audit_id="aud-1", at=START, input=AuditInput(topic=INTENTS_TOPIC, key=KEY, ref="it-1"),
                        outcome="accepted", notifications=["ntf-1"])
    decided = Result(Decision(notifications=[told], audit=audit))
    source = Source(INTENTS_TOPIC, KEY, 3, 41)
    result = h.engine.fitted(decided, encoded(set_gpu()), source, h.now)
    assert_dead_lettered(result, INTENTS_TOPIC, 3, 41, "the decision's notifications message would be 100")
    assert result.wire is not None and [topic for topic, _, _ in result.wire] == ["dlq", "audit"]
    small = h.engine.fitted(Result(Decision(audit=audit)), encoded(set_gpu()), source, h.now)
    assert small.dead_letters == [] and small.wire == [("audit", KEY.encode(), wire_bytes(audit))]


def test_free_text_is_cut_to_its_bound() -> None:
    audit = AuditRecord(audit_id="aud-1", at=START, input=AuditInput(topic=INTENTS_TOPIC, ref="r"),
                        outcome="failed", reason="r" * 1_000_000)
    assert audit.reason is not None and len(audit.reason) == TEXT_MAX and audit.reason.endswith("…")


def test_no_bytes_make_the_engine_raise() -> None:
    """Random bytes and valid messages with bytes flipped: one audit record each, never an
    exception, every output within the broker's limit."""
    rng = random.Random(10)
    h = harness()
    h.observe(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE))
    valid_intent = encoded(set_gpu())
    valid_event = encoded(event_of(node("gpu-node-1", gpus={RTX: 2})))
    seeds = [valid_intent, valid_event, b"[" * 5000, b'{"a": ' + b"9" * 5000 + b"}", b'{"a": 1e999}']
    for i in range(1500):
        choice = rng.randrange(len(seeds) + 2)
        if choice == len(seeds):
            raw: bytes | None = None
        else:
            base = seeds[choice] if choice < len(seeds) else bytes(rng.randrange(256) for _ in range(64))
            flipped = bytearray(base)
            for _ in range(rng.randrange(4)):
                flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            raw = bytes(flipped)
        for result in (decide_intent(h, raw, offset=i), decide_event(h, raw, "Node/gpu-node-1", i)):
            assert result.decision.audit is not None
            assert len(result.dead_letters) <= 1
            assert_fits(result)


@pytest.mark.parametrize(("raw", "error"), HOSTILE_VALUES)
def test_an_event_screened_before_routing_has_the_dead_letter_on_event_gives(raw: bytes | None, error: str) -> None:
    """The worker's ``route`` dead-letters what ``Engine.screen`` refuses; a replay, which
    calls ``on_event``, must reproduce that dead letter and its audit record byte for byte."""
    h = harness()
    source = Source(EVENTS_TOPIC, "Node/gpu-node-1", 2, 7)
    with pytest.raises(MalformedMessage) as refused:
        h.engine.screen(raw, source)
    routed = h.engine.dead_letter(raw, str(refused.value), source, h.now)
    decided = decide_event(h, raw, "Node/gpu-node-1")
    assert [wire_bytes(o.value) for o in routed.outputs()] == [wire_bytes(o.value) for o in decided.outputs()]


def test_an_output_that_cannot_be_encoded_makes_the_input_a_dead_letter() -> None:
    """A lone surrogate (possible in parsed input, as simulate's) has no UTF-8: no message can carry it."""
    h = harness()
    subject = ObjectRef(kind="VirtualMachine", namespace="spx-proj-a", name="w-1")
    told = Notification(notification_id="ntf-1", type="gpu_unavailable", recipients=[ALICE], subject=subject,
                        severity="info", message="GPU \ud800 unavailable")
    result = h.engine.fitted(Result(Decision(notifications=[told])), encoded(set_gpu()),
                             Source(INTENTS_TOPIC, KEY, 3, 41), h.now)
    assert_dead_lettered(result, INTENTS_TOPIC, 3, 41, "internal error: its outputs cannot be encoded")
