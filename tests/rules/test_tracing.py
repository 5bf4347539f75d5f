"""W3C trace context and CloudEvents attributes, as pure values (handlers/contracts/tracing.py).

An incoming ``traceparent`` is taken only when it is valid per the W3C spec; otherwise the
trace is derived from the input's id, the same every time. Each output's attributes come
from the output itself.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from handlers.contracts.messages import (
    AuditInput,
    AuditRecord,
    Command,
    CommandResult,
    DeadLetter,
    DeadLetterSource,
    Notification,
    ObjectRef,
)
from handlers.contracts.tracing import (
    Trace,
    ce_headers,
    ce_time,
    derived_trace,
    identity,
    incoming_trace,
    message_headers,
    parse_traceparent,
    span_id,
    with_state,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{PARENT}-01"
AT = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
VM = ObjectRef(kind="VirtualMachine", namespace="spx-proj-b", name="dev-1")


def test_a_valid_traceparent_is_read() -> None:
    assert parse_traceparent(VALID) == Trace(TRACE_ID, PARENT, 1)
    assert parse_traceparent(VALID.encode()) == Trace(TRACE_ID, PARENT, 1)
    assert parse_traceparent(f"00-{TRACE_ID}-{PARENT}-00") == Trace(TRACE_ID, PARENT, 0)
    assert parse_traceparent(f" {VALID}\t") == Trace(TRACE_ID, PARENT, 1)  # optional whitespace


@pytest.mark.parametrize("value", [
    None,
    "",
    "garbage",
    f"00-{'0' * 32}-{PARENT}-01",  # all-zero trace-id
    f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent-id
    f"ff-{TRACE_ID}-{PARENT}-01",  # version ff is invalid
    f"00-{TRACE_ID.upper()}-{PARENT}-01",  # upper-case hex
    f"00-{TRACE_ID}-{PARENT}-01-extra",  # version 00 has exactly four fields
    f"00-{TRACE_ID}-{PARENT}-1",  # flags of one digit
    f"00-{TRACE_ID[:-1]}-{PARENT}-01",  # a trace-id one digit short
    f"00_{TRACE_ID}_{PARENT}_01",  # not dash-separated
    f"0g-{TRACE_ID}-{PARENT}-01",  # version not hex
    f"00-{TRACE_ID[:-1]}z-{PARENT}-01",  # trace-id not hex
    b"\xff" * 55,  # not ASCII
])
def test_an_invalid_traceparent_is_refused(value: str | bytes | None) -> None:
    assert parse_traceparent(value) is None


def test_a_later_version_is_read_by_its_first_four_fields() -> None:
    assert parse_traceparent(f"cc-{TRACE_ID}-{PARENT}-01-what-the-future-adds") == Trace(TRACE_ID, PARENT, 1)
    assert parse_traceparent(f"cc-{TRACE_ID}-{PARENT}-01") == Trace(TRACE_ID, PARENT, 1)
    assert parse_traceparent(f"cc-{TRACE_ID}-{PARENT}-01x") is None  # more, but not after a dash


def test_an_input_without_a_valid_traceparent_gets_a_trace_derived_from_its_id() -> None:
    first = incoming_trace(None, None, "it-gpu-1")
    assert first == incoming_trace(f"ff-{TRACE_ID}-{PARENT}-01", None, "it-gpu-1")  # invalid: as if absent
    assert first == derived_trace("it-gpu-1")  # the same id, the same trace, every time
    assert first.trace_id != derived_trace("it-gpu-2").trace_id
    assert len(first.trace_id) == 32 and int(first.trace_id, 16) != 0
    assert parse_traceparent(first.child("cmd-1")) is not None  # what it sends is valid


def test_a_valid_traceparent_passes_its_trace_id_on_with_a_span_per_output() -> None:
    trace = incoming_trace(VALID, "vendor=abc", "it-gpu-1")
    command, audit = parse_traceparent(trace.child("cmd-1")), parse_traceparent(trace.child("aud-1"))
    assert command is not None and audit is not None
    assert command.trace_id == audit.trace_id == TRACE_ID
    assert command.span_id == span_id("cmd-1") != audit.span_id == span_id("aud-1")
    assert command.span_id != PARENT
    assert trace.state == "vendor=abc"


def test_only_the_sampled_flag_is_passed_on() -> None:
    assert parse_traceparent(f"00-{TRACE_ID}-{PARENT}-ff") == Trace(TRACE_ID, PARENT, 0xFF)
    assert Trace(TRACE_ID, PARENT, 0xFF).child("x").endswith("-01")
    assert Trace(TRACE_ID, PARENT, 0x00).child("x").endswith("-00")


def test_a_tracestate_is_kept_only_when_printable_and_bounded() -> None:
    trace = Trace(TRACE_ID, PARENT)
    assert with_state(trace, "a=1,b=2").state == "a=1,b=2"
    assert with_state(trace, "x" * 513).state is None
    assert with_state(trace, "a=\x00").state is None
    assert with_state(trace, b"\xff").state is None


def test_each_output_names_itself() -> None:
    command = Command(command_id="cmd-1", type="patch_vm", target=VM, cause="it-gpu-1", issued_at=AT)
    notification = Notification(notification_id="ntf-1", type="gpu_change_pending_restart", recipients=["a@b"],
                                subject=VM, severity="info", message="m", at=AT)
    audit = AuditRecord(audit_id="aud-1", at=AT, input=AuditInput(topic="vmstream.intents", ref="it-gpu-1"),
                        outcome="accepted")
    result = CommandResult(command_id="cmd-1", outcome="applied", at=AT)
    letter = DeadLetter(error="not JSON", source=DeadLetterSource(topic="vmstream.intents", partition=2, offset=7),
                        original="{", at=AT)
    assert identity(command) == ("cmd-1", "io.vmstream.command.patch_vm", AT)
    assert identity(notification) == ("ntf-1", "io.vmstream.notification.gpu_change_pending_restart", AT)
    assert identity(audit) == ("aud-1", "io.vmstream.audit", AT)
    assert identity(result) == ("cmd-1", "io.vmstream.command-result", AT)
    assert identity(letter) == ("dlq:vmstream.intents:2:7", "io.vmstream.dead-letter", AT)
    offline = letter.model_copy(update={"source": DeadLetterSource(topic="vmstream.intents")})
    assert identity(offline)[0].startswith("dlq:raw:") and identity(offline)[0] == identity(offline)[0]
    with pytest.raises(TypeError):
        identity({"not": "a message"})


def test_the_cloudevents_headers_of_an_output() -> None:
    trace = Trace(TRACE_ID, PARENT, 1)
    headers = dict(message_headers(
        AuditRecord(audit_id="aud-1", at=AT, input=AuditInput(topic="t", ref="r"), outcome="accepted"),
        source="/vmstream/worker/vmstream", time=datetime(2030, 1, 1, tzinfo=UTC), trace=trace))
    assert headers == {
        "ce_specversion": "1.0",
        "ce_id": "aud-1",
        "ce_type": "io.vmstream.audit",
        "ce_source": "/vmstream/worker/vmstream",
        "ce_time": "2026-11-30T10:00:00Z",  # the message's own time, not the fallback
        "content-type": "application/json",
        "traceparent": f"00-{TRACE_ID}-{span_id('aud-1')}-01",
    }
    dated = dict(ce_headers(id_="x", type_="t", source="s", time=AT, trace=Trace(TRACE_ID, PARENT, 1, "k=v")))
    assert dated["tracestate"] == "k=v"


def test_ce_time_is_rfc3339_in_utc() -> None:
    assert ce_time(AT) == "2026-11-30T10:00:00Z"
    assert ce_time(datetime(2026, 11, 30, 10, 0, 0, 250000, tzinfo=UTC)) == "2026-11-30T10:00:00.25Z"
    paris = datetime.fromisoformat("2026-11-30T11:00:00+01:00")
    assert ce_time(paris) == "2026-11-30T10:00:00Z"
    assert ce_time(datetime(999, 1, 2, 3, 4, 5, tzinfo=UTC)) == "0999-01-02T03:04:05Z"  # four digits, always


RFC3339_UTC = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{0,5}[1-9])?Z")


@given(st.datetimes(min_value=datetime(2, 1, 1), max_value=datetime(9998, 12, 31), timezones=st.timezones()))
def test_ce_time_is_the_same_moment_in_rfc3339_for_any_aware_time(moment: datetime) -> None:
    text = ce_time(moment)
    assert RFC3339_UTC.fullmatch(text), text
    # Compared in UTC: an ambiguous or missing local time (a DST change) never equals a time
    # of another zone (PEP 495), though its UTC instant is well defined.
    assert datetime.fromisoformat(text) == moment.astimezone(UTC)


def test_the_asyncapi_examples_are_what_the_headers_and_payloads_promise() -> None:
    """Each message's example: headers its header schema accepts, a payload its schema
    accepts, and — for an output — the CloudEvents id and the trace of the intent example."""
    from jsonschema import Draft202012Validator

    from streams.cli.schemas import asyncapi_document

    document = asyncapi_document()
    messages = document["components"]["messages"]
    [intent] = messages["Intent"]["examples"]
    upstream = parse_traceparent(intent["headers"]["traceparent"])
    assert upstream is not None
    outputs = ("Command", "CommandResult", "Notification", "AuditRecord", "DeadLetter")
    for name, message in messages.items():
        [example] = message["examples"]
        assert not list(Draft202012Validator(message["headers"]).iter_errors(example["headers"])), name
        payload = Draft202012Validator({"components": document["components"], **message["payload"]})
        assert not list(payload.iter_errors(example["payload"])), name
        assert message["correlationId"]["location"].startswith(("$message.payload#/", "$message.header#/"))
        if name in outputs:
            own_id, _, _ = identity(_model(name, example["payload"]))
            assert example["headers"]["ce_id"] == own_id, name
            trace = parse_traceparent(example["headers"]["traceparent"])
            assert trace is not None and trace.trace_id == upstream.trace_id, name
    broken = dict(messages["Command"]["examples"][0]["headers"], ce_specversion="0.3")
    assert list(Draft202012Validator(messages["Command"]["headers"]).iter_errors(broken))
    audit = document["channels"]["audit"]["bindings"]["kafka"]
    assert audit["topicConfiguration"]["retention.ms"] == -1 and audit["partitions"] >= 1
    assert document["servers"]["production"]["security"] == [
        {"$ref": f"#/components/securitySchemes/{scheme}"} for scheme in ("scramSha512", "mutualTls", "oauthBearer")]


def _model(name: str, payload: dict[str, object]) -> object:
    models: dict[str, type[BaseModel]] = {"Command": Command, "CommandResult": CommandResult, "Notification": Notification,
              "AuditRecord": AuditRecord, "DeadLetter": DeadLetter}
    return models[name].model_validate(payload)


def test_the_shell_reads_one_valid_traceparent_and_passes_on_only_a_valid_one() -> None:
    from streams.common.cloudevents import TraceBook, trace_headers, trace_of

    assert trace_of([("traceparent", VALID.encode())], "it-1").trace_id == TRACE_ID
    assert trace_of({"traceparent": VALID.encode()}, "it-1").trace_id == TRACE_ID
    # Two traceparents are ambiguous: as if none came.
    two = [("traceparent", VALID.encode()), ("traceparent", f"00-{'1' * 32}-{PARENT}-01".encode())]
    assert trace_of(two, "it-1") == derived_trace("it-1")
    assert trace_of(None, "it-1") == derived_trace("it-1")
    assert trace_headers([("traceparent", VALID.encode()), ("tracestate", b"a=1"), ("other", b"x")]) == {
        "traceparent": VALID.encode(), "tracestate": b"a=1"}
    assert trace_headers([("traceparent", b"x" * 10_000)]) == {}  # nothing invalid travels on
    assert trace_headers([("traceparent", f"cc-{TRACE_ID}-{PARENT}-03-more".encode())]) == {
        "traceparent": f"00-{TRACE_ID}-{PARENT}-01".encode()}
    book = TraceBook(limit=2)
    book.keep("cmd-1", [("traceparent", VALID.encode())])
    assert book.trace("cmd-1").trace_id == TRACE_ID
    book.keep("cmd-2", [])
    book.keep("cmd-3", [])
    assert book.trace("cmd-1") == derived_trace("cmd-1")  # the oldest is forgotten first
