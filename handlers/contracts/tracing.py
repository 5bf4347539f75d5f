"""The bus's envelope: CloudEvents attributes and W3C trace context, as pure values.

    input's ``traceparent`` (or its id) → :class:`Trace` → each output's ``traceparent``
    output message (its id, type and time) → CloudEvents attributes (``ce_*`` headers)

An intent or watch event that carries a valid ``traceparent`` passes its trace-id on; one
without gets a trace-id derived from its own id, so a decision taken again after a crash has
the very same headers. Every output of a decision then carries that trace-id with a span id
derived from the output's own id. The shell attaches the headers (streams/common/cloudevents.py);
nothing here reads a clock or a random source.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

from handlers.contracts.events import (
    AUDIT_TYPE,
    COMMAND_RESULT_TYPE,
    DEAD_LETTER_TYPE,
    command_type,
    intent_type,
    notification_type,
)
from handlers.contracts.messages import (
    AuditRecord,
    Command,
    CommandResult,
    CreateVMIntent,
    DeadLetter,
    DrainNodeIntent,
    Notification,
    RestartVMIntent,
    SetGPUIntent,
    UndrainNodeIntent,
)

SPEC_VERSION = "1.0"
CONTENT_TYPE = "application/json"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACESTATE_MAX = 512  # characters kept of an incoming tracestate; longer is dropped
_HEX = frozenset("0123456789abcdef")
_SAMPLED = 0x01
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace-id with the parent span and flags it was received with (W3C Trace Context)."""

    trace_id: str  # 32 lowercase hex digits, not all zero
    span_id: str  # 16 lowercase hex digits, not all zero: the span that caused what follows
    flags: int = _SAMPLED
    state: str | None = None  # the incoming ``tracestate``, passed on unchanged

    def child(self, own_id: str) -> str:
        """The ``traceparent`` of a message named ``own_id`` within this trace."""
        return f"00-{self.trace_id}-{span_id(own_id)}-{self.flags & _SAMPLED:02x}"


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and set(text) <= _HEX


def parse_traceparent(value: str | bytes | None) -> Trace | None:
    """The trace a ``traceparent`` header names, or ``None`` when it is not a valid one.

    Per W3C Trace Context: ``version-traceid-parentid-flags`` in lowercase hex; version
    ``ff`` is invalid; all-zero trace or parent ids are invalid; version ``00`` is exactly 55
    characters, and a later version may add fields after a ``-`` (the first four are read).
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    value = value.strip(" \t")
    if len(value) < 55:
        return None
    version, trace_id, parent_id, flags = value[0:2], value[3:35], value[36:52], value[53:55]
    if value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    if not (_is_hex(version, 2) and _is_hex(trace_id, 32) and _is_hex(parent_id, 16) and _is_hex(flags, 2)):
        return None
    if version == "ff" or trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    if version == "00" and len(value) != 55:
        return None
    if len(value) > 55 and value[55] != "-":
        return None
    return Trace(trace_id, parent_id, int(flags, 16))


def with_state(trace: Trace, state: str | bytes | None) -> Trace:
    """``trace`` with an incoming ``tracestate`` kept, when it is printable ASCII of bounded size."""
    if isinstance(state, bytes):
        try:
            state = state.decode("ascii")
        except UnicodeDecodeError:
            return trace
    if not state or len(state) > TRACESTATE_MAX or not all(" " <= c <= "~" for c in state):
        return trace
    return Trace(trace.trace_id, trace.span_id, trace.flags, state.strip(" \t"))


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()


def derived_trace(input_id: str) -> Trace:
    """The trace of an input that brought none: its trace-id and span derived from its id."""
    trace_id = _digest("trace", input_id)[:32]
    if trace_id == _ZERO_TRACE:  # a 2^-128 chance; still never the invalid id
        trace_id = trace_id[:-1] + "1"
    return Trace(trace_id, span_id(input_id), _SAMPLED)


def span_id(own_id: str) -> str:
    """A message's span id, derived from its own id: 16 hex digits, never all zero."""
    span = _digest("span", own_id)[:16]
    return span if span != _ZERO_SPAN else span[:-1] + "1"


def incoming_trace(traceparent: str | bytes | None, tracestate: str | bytes | None, input_id: str) -> Trace:
    """The trace an input's outputs carry: its valid ``traceparent``'s, else one from ``input_id``."""
    trace = parse_traceparent(traceparent)
    if trace is None:
        return derived_trace(input_id)
    return with_state(trace, tracestate)


# ------------------------------------------------------------------------- CloudEvents


def ce_time(moment: datetime) -> str:
    """RFC 3339 in UTC with a ``Z``, microseconds only when there are any (their trailing
    zeros dropped). ``isoformat`` pads the year to four digits, as RFC 3339 requires, where
    ``strftime("%Y")`` writes 999 for the year 999; and costs a third less."""
    moment = moment.astimezone(UTC)
    text = moment.replace(tzinfo=None).isoformat()  # the fraction: six digits, or none when zero
    return (text.rstrip("0") if moment.microsecond else text) + "Z"


def dead_letter_id(letter: DeadLetter) -> str:
    """A dead letter's id: where its input was read, or a digest of it where that is not known."""
    where = letter.source
    if where.offset is not None:
        return f"dlq:{where.topic}:{where.partition}:{where.offset}"
    return "dlq:raw:" + _digest("dead-letter", where.topic, letter.original, letter.error)[:32]


def identity(message: object) -> tuple[str, str, datetime | None]:
    """A message's CloudEvents ``id``, ``type`` (handlers/contracts/events.py) and time, read off the message itself."""
    if isinstance(message, Command):
        return message.command_id, command_type(message.type), message.issued_at
    if isinstance(message, Notification):
        return message.notification_id, notification_type(message.type), message.at
    if isinstance(message, AuditRecord):
        return message.audit_id, AUDIT_TYPE, message.at
    if isinstance(message, CommandResult):
        return message.command_id, COMMAND_RESULT_TYPE, message.at
    if isinstance(message, DeadLetter):
        return dead_letter_id(message), DEAD_LETTER_TYPE, message.at
    if isinstance(message, (CreateVMIntent, SetGPUIntent, RestartVMIntent, DrainNodeIntent, UndrainNodeIntent)):
        # as `vmstream intent` sends one
        return message.intent_id, intent_type(message.type), message.requested_at
    raise TypeError(f"not a message vmstream sends: {type(message).__name__}")


def ce_headers(*, id_: str, type_: str, source: str, time: datetime, trace: Trace) -> list[tuple[str, str]]:
    """The CloudEvents Kafka binding's headers (binary mode) and the W3C trace of one record."""
    headers = [
        ("ce_specversion", SPEC_VERSION),
        ("ce_id", id_),
        ("ce_type", type_),
        ("ce_source", source),
        ("ce_time", ce_time(time)),
        ("content-type", CONTENT_TYPE),
        (TRACEPARENT, trace.child(id_)),
    ]
    if trace.state:
        headers.append((TRACESTATE, trace.state))
    return headers


def message_headers(message: object, *, source: str, time: datetime, trace: Trace) -> list[tuple[str, str]]:
    """:func:`ce_headers` of an output message; ``time`` when the message names none."""
    id_, type_, own_time = identity(message)
    return ce_headers(id_=id_, type_=type_, source=source, time=own_time or time, trace=trace)
