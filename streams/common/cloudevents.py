"""CloudEvents headers and W3C trace context on the records vmstream sends.

    record's headers → :func:`trace_of` → :class:`~handlers.contracts.tracing.Trace`
    output message + trace → :func:`kafka_headers` → the record's headers

The values are computed in ``handlers/contracts/tracing.py``; this module only reads and writes Kafka
headers (names are text, values bytes). The worker, the applier, the watch bridge,
``vmstream notify`` and ``vmstream api`` send through it, so every output record carries the
same envelope (docs/integrators.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from handlers.contracts.events import Process, source
from handlers.contracts.messages import AuditRecord, CommandResult, DeadLetter, Notification
from handlers.contracts.tracing import (
    TRACEPARENT,
    TRACESTATE,
    Trace,
    incoming_trace,
    message_headers,
    parse_traceparent,
    with_state,
)

__all__ = [
    "TRACEPARENT", "TRACESTATE", "Trace", "TraceBook",
    "event_source", "header_text", "kafka_headers", "ref_of", "trace_headers", "trace_of",
]

HeaderItems = Mapping[str, bytes] | Iterable[tuple[str, bytes | None]] | None


def event_source(process: Process, app_id: str) -> str:
    """The CloudEvents ``source`` of one vmstream process: ``/vmstream/<process>/<app_id>``
    (handlers/contracts/events.py)."""
    return source(process, app_id)


def _values(headers: HeaderItems, name: str) -> list[bytes]:
    if headers is None:
        return []
    items = headers.items() if isinstance(headers, Mapping) else headers
    return [value if isinstance(value, bytes) else str(value).encode()
            for key, value in items if str(key).lower() == name and value is not None]


def header_text(headers: HeaderItems, name: str) -> str | None:
    """A record's one header ``name`` as UTF-8 text; None when it has none, several, or not text."""
    values = _values(headers, name)
    if len(values) != 1:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        return None


def trace_of(headers: HeaderItems, input_id: str) -> Trace:
    """The trace of a record's outputs: its one valid ``traceparent``, else one derived from
    ``input_id``. A record with two ``traceparent`` headers has none (W3C: ambiguous)."""
    parents = _values(headers, TRACEPARENT)
    states = _values(headers, TRACESTATE)
    return incoming_trace(parents[0] if len(parents) == 1 else None,
                          states[0] if len(states) == 1 else None, input_id)


def trace_headers(headers: HeaderItems, *, parent: str | None = None) -> dict[str, bytes]:
    """The trace context a record brought, to pass on (an intent routed): only a valid one,
    as version 00, so nothing but a well-formed, bounded header travels further. ``parent``:
    the span id to name instead of the record's (the span that passed it on)."""
    parents = _values(headers, TRACEPARENT)
    trace = parse_traceparent(parents[0]) if len(parents) == 1 else None
    if trace is None:
        return {}
    states = _values(headers, TRACESTATE)
    trace = with_state(trace, states[0] if len(states) == 1 else None)
    kept = {TRACEPARENT: f"00-{trace.trace_id}-{parent or trace.span_id}-{trace.flags & 0x01:02x}".encode()}
    if trace.state:
        kept[TRACESTATE] = trace.state.encode()
    return kept


def kafka_headers(message: object, *, source: str, trace: Trace, time: datetime) -> dict[str, bytes]:
    """An output message's CloudEvents (binary mode) and ``traceparent`` headers, as Kafka takes them.

    ``time`` is the decision's, for a message that names no time of its own.
    """
    return {name: value.encode("utf-8") for name, value in message_headers(message, source=source, time=time,
                                                                              trace=trace)}


class TraceBook:
    """The traces of the records a process read, by the id its outputs name them with (a
    command's id), until those outputs are sent: bounded, the oldest forgotten first."""

    def __init__(self, limit: int = 65_536) -> None:
        self.limit = limit
        self._traces: dict[str, Trace] = {}

    def keep(self, ref: str, headers: HeaderItems) -> None:
        self._traces.pop(ref, None)
        self._traces[ref] = trace_of(headers, ref)
        while len(self._traces) > self.limit:
            del self._traces[next(iter(self._traces))]

    def trace(self, ref: str) -> Trace:
        """The trace kept for ``ref``; one derived from it when none was kept."""
        kept = self._traces.get(ref)
        return kept if kept is not None else trace_of(None, ref)

    def forget(self, ref: str) -> None:
        self._traces.pop(ref, None)


def ref_of(message: object) -> str:
    """The input an applier's (or a consumer's) output is about: a result's or audit record's
    command, a ``command_failed`` notification's command, a dead letter's record."""
    if isinstance(message, CommandResult):
        return message.command_id
    if isinstance(message, AuditRecord):
        return message.input.ref
    if isinstance(message, Notification):
        return str(message.details.get("command_id") or message.notification_id)
    if isinstance(message, DeadLetter):
        where = message.source
        return f"{where.topic}:{where.partition}:{where.offset}"
    return ""
