"""Spans (streams/common/spans.py): one intent is one trace — route → decide → command →
apply → result, and decide → notification → notify → delivery — each step's span a child of
the span its record's ``traceparent`` names, and each record's span the one that header
names. Run through the shells' own code (the worker's route and decide, the applier's apply
and send, notify's handling, the watch bridge's publishing) with an in-memory exporter; no
broker. tests/kafka/test_spans_otlp.py exports from the real processes to an OTLP receiver."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from handlers.contracts.messages import Command, Notification
from handlers.contracts.tracing import Trace, derived_trace, parse_traceparent, span_id
from handlers.decide.engine import Result, Source
from handlers.decide.inputs import IntentInput
from handlers.rules.results import Tries
from samples.cluster import RTX, node, vm, vmi
from streams.common import spans
from streams.common.cloudevents import TraceBook, kafka_headers, trace_headers
from streams.common.group_reading import Received
from streams.common.settings import Settings
from streams.common.topics import KIND_HEADER
from streams.kube.applying import Applied, Applier
from streams.kube.watching import KINDS, Publisher
from streams.serve.notify import DeliveryLedger, Notifier
from streams.worker.app import Worker
from streams.worker.routing import Read
from tests.support.harness import START, Harness
from tests.support.producers import KeptRecords

ALICE = "alice@example.com"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"  # the console's span that published the intent
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert spans.configure("test", exporter=exporter)
    yield exporter
    spans.unconfigure()


def _hex(number: int, digits: int) -> str:
    return f"{number:0{digits}x}"


def ids(span: ReadableSpan) -> tuple[str, str, str | None]:
    """(trace-id, span id, parent span id) in hex."""
    context = span.get_span_context()
    assert context is not None
    parent = span.parent
    return (_hex(context.trace_id, 32), _hex(context.span_id, 16),
            _hex(parent.span_id, 16) if parent is not None else None)


def named(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


def trace_of(traceparent: str) -> Trace:
    """The trace a ``traceparent`` names, which must be a valid one."""
    trace = parse_traceparent(traceparent)
    assert trace is not None, traceparent
    return trace


def header(headers: Any, name: str = "traceparent") -> str:
    items = headers.items() if isinstance(headers, dict) else headers
    [value] = [v for k, v in items if k == name]
    return value.decode() if isinstance(value, bytes) else str(value)


def bare_worker() -> Any:
    """A Worker without its Faust app: route's and decide's span code reads nothing else."""
    worker = Worker.__new__(Worker)
    worker._decided = {}
    return worker


@dataclass
class Event:
    message: Any


def running_vm() -> Harness:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 1}), vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE),
                  vmi("spx-proj-a", "w-1", node_name="gpu-node-1"))
    return h


def route_and_decide(h: Harness, value: dict[str, Any],
                     headers: list[tuple[str, bytes]]) -> tuple[Any, tuple[Read, Result]]:
    """The worker's route and decide of one intent, as the worker runs them: the routed
    record's headers from route, decide's spans and the spans of what it sent."""
    worker = bare_worker()
    raw = json.dumps(value).encode()
    key = f"vm/{value['spec']['namespace']}/{value['spec']['name']}"
    read = Read("vmstream.intents", 0, 7, key.encode(), raw, START.timestamp(), headers)
    routed_headers = worker._route_trace(read, value, True)
    routed = Read("vmstream.worker-routed", 3, 11, key.encode(), raw, START.timestamp(),
                  [(KIND_HEADER, b"intent"), *routed_headers.items()])
    began = spans.now()
    [result] = h.engine.decide(h.state, IntentInput(value, Source("vmstream.intents", key, 0, 7), h.now))
    worker._decide_spans(routed, "intent", [result], began)
    worker._sent_spans([(Event(routed), result)], spans.now())
    return worker, (routed, result)


def sent_headers(worker: Any, routed: Any, result: Result, message: object) -> dict[str, bytes]:
    """The headers the worker gives an output (``Worker._outgoing``)."""
    trace, when = worker._trace(routed, result)
    return kafka_headers(message, source="/vmstream/worker/vmstream", trace=trace, time=when)


@dataclass
class FakeKube:
    def try_once(self, command: Command, tries: Tries = Tries()) -> Applied:
        return Applied("applied", resource_version="2")


def bare_applier() -> Any:
    """An Applier without its clients: apply's and send's span code reads only these."""
    applier: Any = Applier.__new__(Applier)
    applier.kube, applier.traces, applier.applied_spans = FakeKube(), TraceBook(), {}
    applier.clock = lambda: datetime(2026, 11, 30, 10, 0, 1, tzinfo=UTC)
    applier.commands_topic, applier.keyring = "vmstream.commands", None
    applier.event_source = "/vmstream/applier/vmstream"
    return applier


def nothing_delivered(topic: str) -> DeliveryLedger:
    """notify's ledger with no delivery made yet, without the consumer that reads one back."""
    ledger = DeliveryLedger.__new__(DeliveryLedger)
    ledger.topic, ledger.done = topic, set()
    return ledger


@dataclass
class Mailbox:
    contexts: list[dict[str, str]] = field(default_factory=list)

    def send(self, target: Any, notification: Notification, context: dict[str, str], *, source: str) -> None:
        self.contexts.append(dict(context))

    def idle(self) -> None:
        pass


def test_one_intent_is_one_trace_from_route_to_the_delivery(exported: InMemorySpanExporter) -> None:
    h = running_vm()
    value = h.sign({"intent_id": "it-set-gpu", "type": "set_gpu", "requested_by": ALICE, "project": "proj-a",
                    "spec": {"namespace": "spx-proj-a", "name": "w-1", "gpu_class": "nvidia-a100"}})
    worker, (routed, result) = route_and_decide(h, value, [("traceparent", TRACEPARENT.encode())])
    [command] = result.decision.commands
    [told] = result.decision.notifications

    [route] = named(exported, "route")
    [decide] = named(exported, "decide")
    assert ids(route)[0] == TRACE_ID and ids(route)[2] == PARENT  # a child of the console's span
    assert trace_of(header(routed.headers)).span_id == ids(route)[1]  # the routed record names route
    assert ids(decide)[2] == ids(route)[1]

    # The worker's records: each one's span is the one its traceparent names, decide's child.
    sends = {(s.attributes or {})["messaging.message.id"]: s for s in named(exported, "send")}
    for message, own_id in ((command, command.command_id), (told, told.notification_id)):
        traceparent = trace_of(header(sent_headers(worker, routed, result, message)))
        assert (traceparent.trace_id, traceparent.span_id) == (TRACE_ID, ids(sends[own_id])[1])
        assert ids(sends[own_id])[2] == ids(decide)[1]

    # The applier reads the command, applies it, sends its result: apply a child of the command's span.
    applier = bare_applier()
    applier.traces.keep(command.command_id, list(sent_headers(worker, routed, result, command).items()))
    decision = applier.apply_one(command)
    out = KeptRecords()
    applier._send(out, [("vmstream.command-results", command.command_id, decision.result)])
    [apply] = named(exported, "apply")
    assert ids(apply)[:1] == (TRACE_ID,) and ids(apply)[2] == ids(sends[command.command_id])[1]
    [result_record] = out.records
    [result_span] = named(exported, "send vmstream.command-results")
    assert ids(result_span)[2] == ids(apply)[1]
    assert trace_of(header(result_record.headers)).span_id == ids(result_span)[1]

    # notify reads the notification and delivers it: its delivery's span is what the receiver is told.
    mailbox = Mailbox()
    notifier = Notifier(Settings(az="az1"), transport=mailbox, clock=lambda: datetime(2026, 11, 30, 10, 0, 2, tzinfo=UTC))
    record = Received("vmstream.notifications", 0, 5, told.subject.name.encode() if told.subject else None,
                      told.model_dump_json().encode(), list(sent_headers(worker, routed, result, told).items()))
    notifier.handle(record, nothing_delivered("vmstream.deliveries"), KeptRecords())
    [notify] = named(exported, "notify")
    [deliver] = named(exported, "deliver")
    assert ids(notify)[2] == ids(sends[told.notification_id])[1]
    assert ids(deliver)[2] == ids(notify)[1]
    [context] = mailbox.contexts
    assert trace_of(context["traceparent"]).span_id == ids(deliver)[1]

    assert {ids(s)[0] for s in exported.get_finished_spans()} == {TRACE_ID}
    every = {ids(s)[1] for s in exported.get_finished_spans()}
    assert all(ids(s)[2] in every for s in exported.get_finished_spans() if s is not route)  # no loose end


def test_an_intent_without_a_trace_has_route_as_its_root(exported: InMemorySpanExporter) -> None:
    h = running_vm()
    value = h.sign({"intent_id": "it-no-trace", "type": "set_gpu", "requested_by": ALICE, "project": "proj-a",
                    "spec": {"namespace": "spx-proj-a", "name": "w-1", "gpu_class": "nvidia-a100"}})
    worker, (routed, result) = route_and_decide(h, value, [])
    assert trace_headers(routed.headers) == {}  # nothing added to the routed record
    derived = derived_trace("it-no-trace")
    [route] = named(exported, "route")
    [decide] = named(exported, "decide")
    assert ids(route) == (derived.trace_id, derived.span_id, None)
    assert ids(decide)[:1] == (derived.trace_id,) and ids(decide)[2] == ids(route)[1]
    [command] = result.decision.commands
    traceparent = trace_of(header(sent_headers(worker, routed, result, command)))
    assert traceparent.trace_id == derived.trace_id  # the headers as without spans


def test_a_watch_event_s_trace_starts_at_the_bridge(exported: InMemorySpanExporter) -> None:
    out = KeptRecords()
    publisher = Publisher(out, "vmstream.k8s-events")
    [node_kind] = [k for k in KINDS if k.kind == "Node"]
    publisher.send(node_kind, "ADDED", node("gpu-node-7", gpus={RTX: 2}))
    [record] = out.records
    traceparent = trace_of(header(record.headers))
    [watch] = named(exported, "watch Node")
    assert ids(watch) == (traceparent.trace_id, traceparent.span_id, None)

    value = json.loads(record.value or b"")
    read = Read("vmstream.k8s-events", 0, 3, record.key, record.value, START.timestamp(), record.headers)
    routed = bare_worker()._route_trace(read, value, False)
    [route] = named(exported, "route")
    assert ids(route)[0] == traceparent.trace_id and ids(route)[2] == ids(watch)[1]
    assert trace_of(routed["traceparent"]).span_id == ids(route)[1] == span_id("route/vmstream.k8s-events:0:3")


def test_without_configuration_nothing_is_recorded_and_headers_pass_unchanged() -> None:
    assert not spans.enabled()
    headers = [("traceparent", TRACEPARENT.encode()), ("tracestate", b"v=1")]
    read = Read("vmstream.intents", 0, 1, b"k", b"{}", 0.0, headers)
    assert bare_worker()._route_trace(read, {}, True) == {"traceparent": TRACEPARENT.encode(), "tracestate": b"v=1"}
    assert spans.record("x", None, start=spans.now()) is None
    with spans.span("y", None) as current:
        assert current is None


@pytest.mark.parametrize(("environ", "on"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
])
def test_spans_are_exported_only_when_the_environment_asks(environ: dict[str, str], on: bool) -> None:
    assert spans.configured(environ) is on
