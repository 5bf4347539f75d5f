"""Spans of every step, exported with OpenTelemetry over OTLP/HTTP — only when configured.

    intent ─route─► routed record ─decide─► command ─apply─► result, notification ─notify─► webhook
                                          └► notification ─notify─► e-mail, webhook

The records already carry W3C trace context (handlers/contracts/tracing.py): every output's
``traceparent`` names the input's trace-id and a span id derived from the output's own id.
The spans here are made to match those headers, so one intent is one trace in Jaeger or
Tempo: each step's span is a child of the span its record's ``traceparent`` names, and each
record a step sends gets a span (``send``) whose id is the one its ``traceparent`` names — the
parent of the next step, in whichever process that runs. An input that came without a trace
(a traceless intent) has its route span as the trace's root, with the trace-id and span id
the worker derives for it anyway.

Off by default: nothing is set up, and every function here returns at once, unless
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, and
neither ``OTEL_SDK_DISABLED=true`` nor ``OTEL_TRACES_EXPORTER=none`` says no. The exporter
reads the rest of the standard variables itself (headers, timeout, compression);
``OTEL_SERVICE_NAME`` names the process (default ``vmstream-<process>``),
``OTEL_RESOURCE_ATTRIBUTES`` adds to it, ``OTEL_TRACES_SAMPLER`` samples (default: as the
parent says, and every vmstream-derived trace is sampled).
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from handlers.contracts.tracing import Trace, derived_trace, identity, span_id

log = logging.getLogger(__name__)

Kind = SpanKind
__all__ = ["Kind", "Status", "StatusCode", "configure", "configured", "enabled", "now", "record", "root_of",
           "sent", "sent_as", "span", "unconfigure"]
Parent = Trace | SpanContext | None
_FORCED: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("vmstream_span_ids", default=None)
_tracer: otel.Tracer | None = None
_provider: TracerProvider | None = None


class _Ids(RandomIdGenerator):
    """Random ids, except where a span must have the id a record's ``traceparent`` names."""

    def generate_span_id(self) -> int:
        forced = _FORCED.get()
        return forced[1] if forced is not None else super().generate_span_id()

    def generate_trace_id(self) -> int:  # only for a root span
        forced = _FORCED.get()
        return forced[0] if forced is not None and forced[0] else super().generate_trace_id()


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for spans to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(process: str, *, exporter: SpanExporter | None = None) -> bool:
    """Set this process's tracer up: with ``exporter`` (the tests), else the OTLP/HTTP exporter
    when the environment asks for it (:func:`configured`), else none at all. True if spans
    are recorded from now on."""
    global _tracer, _provider
    processor: SpanProcessor
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    elif configured():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor = BatchSpanProcessor(OTLPSpanExporter())
    else:
        return False
    from streams.common.metrics import vmstream_version

    name = os.environ.get("OTEL_SERVICE_NAME") or f"vmstream-{process}"
    resource = Resource.create({"service.name": name, "service.namespace": "vmstream",
                                "service.version": vmstream_version()})
    provider = TracerProvider(resource=resource, id_generator=_Ids())
    provider.add_span_processor(processor)
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer = provider, provider.get_tracer("vmstream")
    log.info("exporting spans", extra={"service": name, "exporter": type(processor).__name__})
    return True


def unconfigure() -> None:
    """Flush and stop exporting (the tests; a process's exit does it by itself)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def now() -> int:
    """The time spans take, in nanoseconds since the epoch."""
    return time.time_ns()


def _context(parent: Parent) -> Any:
    if parent is None:
        return None
    if isinstance(parent, Trace):
        state = TraceState.from_header([parent.state]) if parent.state else None
        parent = SpanContext(int(parent.trace_id, 16), int(parent.span_id, 16), is_remote=True,
                             trace_flags=TraceFlags(parent.flags & 0x01), trace_state=state)
    return otel.set_span_in_context(NonRecordingSpan(parent))


@contextmanager
def _ids(trace_id: str | None, own_span: str | None) -> Iterator[None]:
    if own_span is None:
        yield
        return
    token = _FORCED.set((int(trace_id, 16) if trace_id else 0, int(own_span, 16)))
    try:
        yield
    finally:
        _FORCED.reset(token)


def record(name: str, parent: Parent, *, start: int, end: int | None = None, kind: SpanKind = SpanKind.INTERNAL,
           own_span: str | None = None, root_trace: str | None = None,
           attributes: Mapping[str, Any] | None = None, error: str | None = None) -> SpanContext | None:
    """A span that happened (from ``start`` to ``end``, nanoseconds): its context, to parent
    others with; None when spans are off or it is not sampled. ``own_span``: the span id it
    must have (16 hex digits); ``root_trace``: the trace-id of a span without a parent."""
    if _tracer is None:
        return None
    with _ids(root_trace if parent is None else None, own_span):
        span = _tracer.start_span(name, context=_context(parent), kind=kind, attributes=attributes, start_time=start)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end if end is not None else now())
    context: SpanContext = span.get_span_context()
    return context if context.trace_flags.sampled else None


@contextmanager
def span(name: str, parent: Parent, *, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, Any] | None = None) -> Iterator[otel.Span | None]:
    """A span around a step, ended when the block is left (an exception marks it failed)."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, context=_context(parent), kind=kind, attributes=attributes) as current:
        yield current


def sent(message: object, parent: Parent, *, topic: str, start: int, end: int | None = None) -> SpanContext | None:
    """The span of a record sent: the id its ``traceparent`` names (derived from the
    message's own id, :meth:`Trace.child`), a child of the step that made it."""
    if _tracer is None:
        return None
    own_id, type_, _ = identity(message)
    return sent_as(own_id, parent, topic=topic, start=start, end=end, type_=type_)


def sent_as(own_id: str, parent: Parent, *, topic: str, start: int, end: int | None = None,
            type_: str = "") -> SpanContext | None:
    """:func:`sent` of a record named ``own_id`` (a forwarded update, a delivery)."""
    if _tracer is None:
        return None
    attributes = {"messaging.system": "kafka", "messaging.destination.name": topic, "messaging.message.id": own_id}
    if type_:
        attributes["cloudevents.event_type"] = type_
    return record(f"send {topic}", parent, start=start, end=end, kind=SpanKind.PRODUCER, own_span=span_id(own_id),
                  attributes=attributes)


def root_of(input_id: str) -> tuple[str, str]:
    """(trace-id, span id) of the trace the worker derives for an input that brought none:
    the span the decision's outputs descend from (handlers/contracts/tracing.py, ``derived_trace``)."""
    derived = derived_trace(input_id)
    return derived.trace_id, derived.span_id
