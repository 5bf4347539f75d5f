"""``vmstream worker``: the decision engine as a Faust stream processor.

Topology (declared once, in :class:`Worker`)::

    vmstream.intents ────┐
    vmstream.k8s-events ─┴─route──► vmstream.worker-routed ──decide──► commands, notifications,
                          (re-keyed by decision key)                   audit, dlq
    decide ──(a GPU VMI came or went)──► worker-routed, keyed by its node
    timer ──(a drain deadline is due)──► worker-routed, keyed by its node

``decide`` consumes only the routed topic, which the worker partitions itself (murmur2 of
the decision key, ``vm/<ns>/<name>`` or ``node/<name>``, by its own producer): whatever
partitioner wrote an intent or a watch event, one instance owns a key's inputs and table
rows at once. ``decide`` is a Faust agent, for its tables; ``route``, which keeps no state,
reads on a consumer group of its own (streams/worker/routing.py). Table rows are written
under the partition of the message being decided, which is what keeps each row with its
key. The rules run in :class:`~handlers.decide.engine.Engine`; this module only moves bytes.

Effectively once without Faust's exactly-once: intents are deduplicated by ``intent_id``
in the ``processed`` table, every output carries an id derived from its cause, and a batch's
state is recorded only after its messages are acknowledged (group commit,
``streams/worker/tablestate.py``), so a redelivered input reissues the same ids and consumers drop
repeats.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, cast

import aiohttp.web
from faust.types import EventT

from handlers.contracts.messages import KEY_MAX, DeadLetter, MalformedMessage
from handlers.contracts.topics import INTENTS, ROUTED_INPUTS, WORKER_ROUTED, written_by
from handlers.contracts.tracing import span_id
from handlers.core.rows import DecidedIntent
from handlers.core.tables import GLOBAL_TABLES, PROCESSED, TABLES, TRACKING, VMIS, VMS, Table
from handlers.decide.engine import Engine, Result, Source
from handlers.decide.inputs import (
    DeadlineTick,
    ForgetTick,
    PlanTick,
    forget_value,
    kind_of,
    plan_tick_value,
    routed_input,
    tick_value,
)
from handlers.reads.figures import Figures, figures
from handlers.reads.plan_counts import plan_counts, plan_intent
from handlers.rules.capacity import capacity_report
from handlers.rules.restarts import pending_detail
from streams.common import metrics, spans
from streams.common.cloudevents import (
    TRACEPARENT,
    TRACESTATE,
    Trace,
    event_source,
    kafka_headers,
    trace_headers,
    trace_of,
)
from streams.common.codecs import encode_json, encode_message, encode_resident_update
from streams.common.credentials import key_source
from streams.common.durable import Delivered, DurableProducer
from streams.common.durable import Record as Outgoing  # a message to send, as bytes on the wire
from streams.common.globalview import GlobalView
from streams.common.heap import Heap
from streams.common.settings import Settings
from streams.common.signing import KeyringError
from streams.common.topics import KIND_HEADER, ROUTED, SOURCE_HEADER, changelog_topic, missing_topics
from streams.worker import faustfixes
from streams.worker.broker_credentials import faust_credentials
from streams.worker.routing import Read, Router
from streams.worker.tablestate import Journal, TableState

log = logging.getLogger(__name__)

# The exit status when a batch's messages cannot be published: the process stops before its
# inputs are acknowledged, and is restarted (by Kubernetes) to decide them again.
EXIT_UNPUBLISHED = 75
_LATEST = 253402300799.0  # 9999-12-31T23:59:59Z, the latest time a datetime holds

PENDING_TABLES: tuple[Table[Any], ...] = (TRACKING, VMS, VMIS)  # the rows /pending reads
UNROUTABLE_KEY = "malformed"  # the routed key of an input with no usable key of its own
FORGET_PER_TICK = 1000  # intent ids one forgetting tick names at most (a record well under 1 MB)
FORGET_AGAIN_SECONDS = 30.0  # an id asked to be forgotten is not asked again sooner
PUBLIC_PAGES = ("/health", "/ready")  # what probes read; everything else needs the token


def pages_guard(token: str | None) -> Any:
    """An aiohttp middleware: every page but :data:`PUBLIC_PAGES` (Faust's own included)
    wants ``Authorization: Bearer <token>``; without a configured token, none is served."""
    expected = f"Bearer {token}".encode() if token else None

    @aiohttp.web.middleware
    async def guard(request: Any, handler: Any) -> Any:
        if request.path.rstrip("/") in PUBLIC_PAGES:
            return await handler(request)
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")  # bytes as sent
        if expected is not None and hmac.compare_digest(given, expected):
            return await handler(request)
        return aiohttp.web.json_response({"error": "a bearer token is required"}, status=401,
                                         headers={"WWW-Authenticate": 'Bearer realm="vmstream"'})

    return guard


# What the shell reads of a record, routed (``Read``) or decided (Faust's ``Message``): both
# have topic, partition, offset, key, value, timestamp in seconds and headers.
Record = Any


def _headers(message: Record) -> dict[str, bytes]:
    headers = message.headers or {}
    items = headers.items() if isinstance(headers, Mapping) else headers
    return {str(k): (v if isinstance(v, bytes) else str(v).encode()) for k, v in items}


def _key(message: Record) -> str | None:
    key = message.key
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key


def _origin(message: Record) -> Source:
    """Where an input was first read: a routed intent or watch event names its record on
    intents or k8s-events (KIND_HEADER, SOURCE_HEADER: streams/common/topics.py)."""
    try:
        headers = _headers(message) if message.topic.endswith(ROUTED) else {}
        if headers.get(KIND_HEADER) in (b"event", b"intent"):
            origin = json.loads(headers[SOURCE_HEADER])
            return Source(str(origin["topic"]), origin["key"], int(origin["partition"]), int(origin["offset"]))
    except (KeyError, TypeError, ValueError):
        pass  # not ours: it is dead-lettered as read on the routed topic
    return Source(message.topic, _key(message), message.partition, message.offset)


def _ms(seconds: float) -> int:
    """A record's timestamp as the wire has it, from a message's seconds (Faust's ``Message``,
    ``Read``): rounded, so the routed record keeps its input's very millisecond."""
    return round(seconds * 1000)


class Worker:
    """The Faust app with its topics, tables, agents and pages; one per process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.kafka = settings.kafka
        self.engine = Engine(settings.rules(), keys=key_source(settings.auth))  # docs/auth.md
        self.keyring = settings.signing.keyring()  # seals the commands and audit records (docs/security.md)
        if self.keyring.active is None:  # unsealed, every command would be refused by the applier
            raise KeyringError("the worker needs a key to seal commands with: set signing.keys_file or "
                               "VMSTREAM_SIGNING__KEYS, and signing.key_id if there are several (docs/security.md)")
        conf = settings.worker
        self.event_source = event_source("worker", conf.app_id)  # CloudEvents ``source`` of its outputs
        self.app = faustfixes.App(  # faust.App, minus two start-up races
            conf.app_id,
            broker=[f"kafka://{server}" for server in self.kafka.bootstrap_servers.split(",")],
            broker_credentials=faust_credentials(self.kafka),
            store=conf.store,
            topic_partitions=self.kafka.partitions,
            topic_replication_factor=self.kafka.replication_factor,
            # Faust's exactly-once loses its transaction producers on a rebalance ("No
            # transaction producer found"): opt-in only. Correctness comes from _publish.
            processing_guarantee="exactly_once" if conf.exactly_once else "at_least_once",
            table_standby_replicas=0,
            web_port=conf.web_port,
            web_host=conf.web_host,
            web_bind=conf.web_host,  # where Faust listens; web_host only names it
            consumer_auto_offset_reset="earliest",
            producer_acks=-1,
            fetch_max_wait_ms=conf.fetch_max_wait_ms,
            fetch_min_bytes=conf.fetch_min_bytes,
            fetch_idle_wait_ms=conf.fetch_idle_wait_ms,
            topic_allow_declare=self.kafka.create_topics,  # else the platform's KafkaTopics
            **conf.faust_consumer_settings(),  # static membership, session: back at once after a crash
        )
        # The batch's journal, messages and rows through librdkafka (streams/common/durable.py),
        # their reports served off the loop that decides. Faust's producer sends the ticks.
        self.durable = DurableProducer(self.kafka, client_id=f"{conf.app_id}-outputs")
        self.routed = self._topic(ROUTED)
        self.routed_topic = self.kafka.topic(ROUTED)  # its name on the wire, for the worker's own producer
        # route: re-keys intents and watch events onto the routed topic, on a group of its own.
        for name in (*(topic.name for topic in ROUTED_INPUTS), ROUTED):  # at 0 from the start (the alert's increase())
            metrics.child(metrics.DEAD_LETTERS, self.kafka.topic(name))
        self.router = Router(settings, [self.kafka.topic(topic.name) for topic in ROUTED_INPUTS],
                             route=self._route_one, deliver=self._deliver_routed,
                             commit_interval=self.app.conf.broker_commit_interval, beacon=self.app.beacon)
        self.app.add_dependency(self.router)
        self.outputs = {topic.name: self._topic(topic.name) for topic in written_by("worker") if topic is not WORKER_ROUTED}
        # By the name on the wire: what a message sent inside Faust's transaction goes through.
        self.faust_topics = {self.kafka.topic(name): topic for name, topic in [*self.outputs.items(), (ROUTED, self.routed)]}
        self.tables: dict[str, Any] = {  # by table name
            table: self.app.Table(table.stored_as, key_type=str, value_type=bytes,
                                  partitions=self.kafka.partitions, help=table.help)
            for table in TABLES
        }
        self.view = GlobalView(
            self.kafka,
            {table: changelog_topic(conf.app_id, table.stored_as) for table in GLOBAL_TABLES},
            client_id=f"{conf.app_id}-view",
        )
        journal = self.app.Table("state-journal", key_type=str, value_type=bytes, partitions=self.kafka.partitions,
                                 help="input topic:partition:offset → its decision, until the offset is committed")
        self.state = TableState(self.tables, self.view, Journal(journal), rows_through_faust=conf.exactly_once)
        self.app.on_rebalance_complete.connect(self._partitions_settled)
        self.app.task(self.view.run)
        # What /pending shows, for the whole cluster from any instance (kept as bytes).
        self.pages_view = GlobalView(
            self.kafka,
            {table: changelog_topic(conf.app_id, table.stored_as) for table in PENDING_TABLES},
            decode=False,
            client_id=f"{conf.app_id}-pages-view",
        )
        self.app.task(self.pages_view.run)
        self.missing_topics: list[str] | None = None  # checked at start, then while any is missing
        self._asked_to_forget: dict[str, float] = {}  # intent id → when a tick was sent to forget it
        self._decided: dict[int, Any] = {}  # a batch's result (by id) → its decide span, while spans are on
        self.app.agent(self.routed, name="decide")(self._decide)
        self.app.timer(conf.tick_seconds)(self._tick)
        self.heap = Heap(full_every=conf.gc_full_seconds)
        self.app.timer(conf.gc_freeze_seconds)(self._tend_heap)
        self._page("/health", self._health)
        self._page("/ready", self._ready)
        self._page("/metrics", self._metrics)
        metrics.FIGURES.source = self.figures  # the gauges of what this instance's tables hold
        self._page("/capacity", self._capacity)
        self._page("/pending", self._pending)
        web: Any = self.app.web  # Faust's aiohttp driver; its type does not show the aiohttp app
        web.web_app.middlewares.append(pages_guard(conf.page_token()))

    def _topic(self, *names: str) -> Any:
        """Topics of bytes: the codecs are ours (streams/common/codecs.py), not Faust's."""
        return self.app.topic(
            *(self.kafka.topic(name) for name in names),
            key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw",
            partitions=self.kafka.partitions,
        )

    # ------------------------------------------------------------------ agents

    def _route_one(self, message: Read) -> list[Outgoing]:
        """The routed message of one intent or watch event, or its dead letter; never raises.

        The routed topic is partitioned by the worker's own producer, so an intent a Go
        (FNV-1a) or librdkafka (CRC32) producer put on another partition than murmur2 would
        meets its VM's state all the same. What no rule could read (no value, too large, not
        a JSON object, an oversized key) is dead-lettered here, with its own topic, partition
        and offset; the rest goes on, and ``decide`` validates it in full.

        An intent's decision key is read off it as its type declares, and is its Kafka key too
        (docs/contracts.md; one whose Kafka key differs is dead-lettered by ``decide``), so the
        same intent always lands in the same routed partition, with its ``processed`` row; one
        that names no key goes under its Kafka key, for ``decide`` to refuse. A watch event's is
        read off its object, as its kind declares. The routed record keeps the input's value and timestamp (the time it
        is decided at), and names its origin in ``SOURCE_HEADER``; of the input's own headers
        only its trace context goes on.
        """
        source = Source(message.topic, _key(message), message.partition, message.offset)
        intent = message.topic == self.kafka.topic(INTENTS)
        try:
            try:
                value = self.engine.screen(message.value, source)
            except MalformedMessage as exc:  # as ``on_intent`` / ``on_event`` would dead-letter it
                return self._dead_end(message, source, str(exc))
            try:  # a light look at the input: the key its type or kind declares
                key = (self.engine.intent_key(value) if intent
                       else self.engine.event_key(str(value["kind"]), value["object"])) or ""
            except Exception:
                key = ""
            if not key or len(key) > KEY_MAX:
                key = source.key or UNROUTABLE_KEY  # decide dead-letters it, with its source
            origin = encode_json({"topic": message.topic, "partition": message.partition,
                                  "offset": message.offset, "key": source.key})
            headers = {KIND_HEADER: b"intent" if intent else b"event", SOURCE_HEADER: origin,
                       **self._route_trace(message, value, intent)}  # its trace goes on (docs/integrators.md)
            return [Outgoing(self.routed_topic, key.encode(), cast(bytes, message.value),  # screened: not None
                             list(headers.items()), timestamp_ms=_ms(message.timestamp))]
        except Exception as error:  # a bug here must cost this event only
            log.exception("routing failed", extra={"topic": message.topic, "offset": message.offset})
            return self._dead_end(message, source, f"internal error: {type(error).__name__}: {error}")

    def _route_trace(self, message: Read, value: dict[str, Any], intent: bool) -> dict[str, bytes]:
        """The routed record's trace context: the input's, passed on. With spans on, route's
        span (streams/common/spans.py) is a child of the input's and the routed record names
        it, so decide's span is route's child; an input without a trace gets route's span as
        its trace's root, with the ids decide derives for it (from its intent or event id)."""
        if not spans.enabled():
            return trace_headers(message.headers)
        started, ref = spans.now(), f"{message.topic}:{message.partition}:{message.offset}"
        attributes = {"messaging.source.name": message.topic, "messaging.kafka.offset": message.offset,
                      "vmstream.input": ref}
        passed = trace_headers(message.headers)
        if passed:
            own = span_id(f"route/{ref}")
            spans.record("route", trace_of(message.headers, ref), start=started, kind=spans.Kind.CONSUMER,
                         own_span=own, attributes=attributes)
            return trace_headers(message.headers, parent=own)
        cause = value.get("intent_id" if intent else "event_id")
        trace_id, root = spans.root_of(cause if isinstance(cause, str) and cause else ref)
        spans.record("route", None, start=started, kind=spans.Kind.CONSUMER, own_span=root, root_trace=trace_id,
                     attributes=attributes)
        return passed

    def _dead_end(self, message: Read, source: Source, error: str) -> list[Outgoing]:
        now = self._time(message)
        result = self.engine.fitted(self.engine.dead_letter(message.value, error, source, now),
                                    message.value, source, now, encode=self._encode)
        self._log(result)
        return self._outgoing(message, result)

    async def _deliver_routed(self, outgoing: list[Outgoing]) -> None:
        """A route batch's messages, outside any transaction (route reads no Faust event)."""
        await self._deliver(outgoing, transactional=False)

    async def _deliver_own(self, records: Sequence[Outgoing]) -> list[Delivered]:
        """The worker's own records — journal entries, table rows, their tombstones — never
        in a transaction: the journal must be there before anything of its batch."""
        return await self._deliver(records, transactional=False)

    async def _decide(self, stream: Any) -> None:
        """Decide in batches: journal, messages, then rows (group commit, streams/worker/tablestate.py).

        An input whose decision is journaled already (delivered again after a crash) is not
        decided again: its recorded results are sent and written as they were.
        """
        conf = self.settings.worker
        async for events in stream.take_events(conf.batch_size, within=conf.batch_seconds):
            fresh, decided = [], []
            for event in events:
                results = self.state.recorded(event)
                if results is None:
                    results = self._decide_safely(event)
                    fresh.append((event, results))
                decided += [(event, result) for result in results]

            async def settle() -> None:
                await self.state.record(fresh, deliver=self._deliver_own)
                await self._publish(decided)
                await self.state.send_rows(self.state.write_all(decided), deliver=self._deliver_own)

            # Faust acknowledges the batch however this loop is left, a cancellation too (a
            # graceful stop, the app crashing on a failed commit), and commits on its way
            # out: the batch is finished first, or its inputs would be committed unrecorded.
            settling = asyncio.ensure_future(settle())
            try:
                await asyncio.shield(settling)
            except asyncio.CancelledError:
                await settling
                raise
            finally:
                self.state.unstage()
                self._decided.clear()
            if self.state.journal is not None and (tombstones := self.state.journal.prune()):
                await self._deliver_own(tombstones)

    def _decide_safely(self, event: EventT[Any]) -> list[Result]:
        """Decide one input, staging its changes; a bug dead-letters the input, never stops us."""
        started = time.perf_counter()
        began = spans.now() if spans.enabled() else 0
        kind = "unknown"
        source, now = _origin(event.message), self._time(event.message)
        try:
            kind, results = self._decide_one(event, source, now)
            # Each output encoded now, while a decision too large for the broker can still
            # become the input's dead letter instead.
            results = [self.engine.fitted(r, event.value, source, now, encode=self._encode) for r in results]
        except Exception as error:
            log.exception("decision failed", extra={"topic": source.topic, "offset": source.offset})
            results = [self.engine.fitted(self.engine.dead_letter(event.value, f"internal error: {error!r}", source, now),
                                          event.value, source, now, encode=self._encode)]
        intent = plan_intent(source.key, event.value) if kind == "intent" else None
        for result in results:
            self._count_plans(result, intent)  # against the state before its changes are staged
            self.state.stage(result.decision.changes)
            self._log(result)
        metrics.child(metrics.DECISION_SECONDS, kind).observe(time.perf_counter() - started)
        if began:
            self._decide_spans(event.message, kind, results, began)
        return results

    def _count_plans(self, result: Result, intent: str | None) -> None:
        """The maintenance counters (streams/common/metrics.py); a failing count costs them, never the decision."""
        try:
            metrics.record_plan_counts(plan_counts(self.state, result.decision, intent))
        except Exception:
            log.exception("counting a decision's maintenance plans failed")

    def _decide_spans(self, message: Record, kind: str, results: list[Result], began: int) -> None:
        """Decide's span of each result, a child of the span the routed record names (route's,
        or a forwarding decision's send); a tick, which none names, is its trace's root."""
        ended = spans.now()
        rooted = kind not in ("intent", "event", "resident") and not trace_headers(message.headers)
        for result in results:
            trace, _ = self._trace(message, result)
            audit = result.decision.audit
            attributes = {"vmstream.kind": kind}
            if audit is not None:
                attributes.update({"vmstream.input": audit.input.ref, "vmstream.outcome": audit.outcome,
                                   "vmstream.key": audit.input.key or ""})
            context = spans.record(f"decide {kind}", None if rooted else trace, start=began, end=ended,
                                   own_span=trace.span_id if rooted else None,
                                   root_trace=trace.trace_id if rooted else None, attributes=attributes)
            if context is not None:
                self._decided[id(result)] = context

    def _decide_one(self, event: EventT[Any], source: Source, now: datetime) -> tuple[str, list[Result]]:
        """A routed record read as its input (handlers/decide/inputs.py), decided by the one entry."""
        kind = _headers(event.message).get(KIND_HEADER, b"").decode("utf-8", "replace")
        input_ = routed_input(kind, event.value, source, now)
        return kind_of(input_), self.engine.decide(self.state, input_)

    async def _publish(self, decided: list[tuple[EventT[Any], Result]]) -> None:
        """Send a batch's messages and wait until the broker has them all.

        Only then are the batch's state changes recorded: if the worker dies before, its
        inputs are decided again from the old state and yield the same ids, which consumers
        drop. Were state recorded first, a re-decision would find the intent ``processed``
        (or the owner told) and the lost messages would never be sent.
        """
        started = spans.now() if spans.enabled() else 0
        await self._deliver([message for event, result in decided for message in self._outgoing(event.message, result)])
        if started:
            self._sent_spans(decided, started)

    def _sent_spans(self, decided: list[tuple[EventT[Any], Result]], started: int) -> None:
        """A span per message a batch sent, with the id its ``traceparent`` names, a child of
        its decision's span (or, replayed from the journal, of the routed record's)."""
        ended = spans.now()
        for event, result in decided:
            parent = self._decided.pop(id(result), None) or self._trace(event.message, result)[0]
            for output in result.outputs():
                spans.sent(output.value, parent, topic=output.topic, start=started, end=ended)
            for update in result.decision.forwards:
                spans.sent_as(f"{update.cause}@{update.node}/{update.vm_key}", parent, topic=ROUTED,
                              start=started, end=ended, type_="resident")

    def _outgoing(self, message: Record, result: Result) -> list[Outgoing]:
        """A result's messages: its outputs as ``Engine.fitted`` encoded them, and what it tells nodes."""
        wire = result.wire
        if wire is None:  # not fitted here: decided before, by another instance or run
            wire = [(o.topic, o.key.encode(), self._encode(o.value)) for o in result.outputs()]
        trace, when = self._trace(message, result)
        outputs = result.outputs()
        outgoing = [Outgoing(self.kafka.topic(topic), key, value, list(self._ce_headers(output.value, trace, when).items()))
                    for output, (topic, key, value) in zip(outputs, wire, strict=True)]
        for output, (topic, _, _) in zip(outputs, wire, strict=True):
            metrics.child(metrics.OUTPUTS, topic).inc()
            if isinstance(output.value, DeadLetter):
                metrics.child(metrics.DEAD_LETTERS, output.value.source.topic).inc()
        for update in result.decision.forwards:  # the parent's timestamp keeps replays identical
            headers = {KIND_HEADER: b"resident",
                       TRACEPARENT: trace.child(f"{update.cause}@{update.node}/{update.vm_key}").encode()}
            if trace.state:
                headers[TRACESTATE] = trace.state.encode()
            outgoing.append(Outgoing(self.routed_topic, update.key.encode(), encode_resident_update(update),
                                     list(headers.items()), timestamp_ms=_ms(message.timestamp)))
        return outgoing

    def _trace(self, message: Record, result: Result) -> tuple[Trace, datetime]:
        """The trace a result's messages carry and the time it was decided at: the input's
        ``traceparent``, else one derived from the input's id (its audit record's ``ref``),
        so a decision taken again yields the same headers (handlers/contracts/tracing.py)."""
        audit = result.decision.audit
        input_id = audit.input.ref if audit is not None else f"{message.topic}:{message.partition}:{message.offset}"
        return trace_of(message.headers, input_id), audit.at if audit is not None else self._time(message)

    def _ce_headers(self, value: Any, trace: Trace, when: datetime) -> dict[str, bytes]:
        """An output's CloudEvents headers; a bug here costs the headers, never the message."""
        try:
            return kafka_headers(value, source=self.event_source, trace=trace, time=when)
        except Exception:
            log.exception("no CloudEvents headers for a %s", type(value).__name__)
            return {TRACEPARENT: trace.child("").encode()}

    def _encode(self, value: Any) -> bytes:
        return encode_message(value, keyring=self.keyring)

    async def _deliver(self, outgoing: Sequence[Outgoing], *, transactional: bool = True) -> list[Delivered]:
        """Send messages and wait until the broker has every one; where each landed, in the
        order given. What failed is sent again, after a backoff that doubles, up to
        ``worker.publish_attempts`` times (librdkafka retries a send itself meanwhile).

        A message the broker still refuses then stops the process (exit status 75) before
        the inputs that led to it are acknowledged: after the restart they are decided
        again, and their offsets were never committed past them. A stopping worker cancels
        its agents, and Faust acknowledges the batch of a cancelled agent: the delivery is
        finished first.
        """
        delivery = asyncio.ensure_future(self._deliver_now(outgoing, transactional))
        try:
            return await asyncio.shield(delivery)
        except asyncio.CancelledError:
            if not delivery.done():
                await delivery
            raise

    async def _deliver_now(self, outgoing: Sequence[Outgoing], transactional: bool) -> list[Delivered]:
        conf = self.settings.worker
        placed: list[Delivered | str] = ["not sent"] * len(outgoing)
        pending, delay = list(range(len(outgoing))), conf.publish_backoff_seconds
        for attempt in range(1, conf.publish_attempts + 1):
            outcomes = await self._send_batch([outgoing[index] for index in pending], transactional)
            for index, outcome in zip(pending, outcomes, strict=True):
                placed[index] = outcome
            pending = [index for index in pending if not isinstance(placed[index], Delivered)]
            if not pending:
                return cast(list[Delivered], placed)
            log.warning("publishing failed", extra={
                "attempt": attempt, "failed": len(pending), "of": len(outgoing),
                "topic": outgoing[pending[0]].topic, "error": placed[pending[0]]})
            if attempt < conf.publish_attempts:
                await asyncio.sleep(delay)  # a backoff before the next attempt
                delay *= 2
        self._stop_unpublished([(outgoing[index], str(placed[index])) for index in pending])
        raise AssertionError("not reached")  # the process has exited

    async def _send_batch(self, outgoing: Sequence[Outgoing], transactional: bool) -> list[Delivered | str]:
        """Send and wait: where each message landed, or why it did not. Under exactly-once a
        decision's messages must join Faust's transaction, so they go through Faust's topics;
        everything else (route's, outside any Faust event; the journal; the rows) through
        librdkafka."""
        if not (transactional and self.settings.worker.exactly_once):
            return await self.durable.deliver(outgoing)
        sent: list[Any] = []
        for message in outgoing:
            try:
                sent.append(await self.faust_topics[message.topic].send(
                    key=message.key, value=message.value, headers=dict(message.headers), force=True,
                    timestamp=None if message.timestamp_ms is None else message.timestamp_ms / 1000))
            except Exception as error:  # refused at once (too large, no buffer)
                sent.append(repr(error))
        outcomes = await asyncio.gather(*(s for s in sent if not isinstance(s, str)), return_exceptions=True)
        landed = iter(outcomes)
        results: list[Delivered | str] = []
        for message, send in zip(outgoing, sent, strict=True):
            outcome = send if isinstance(send, str) else next(landed)
            if isinstance(outcome, BaseException):
                results.append(repr(outcome))
            elif isinstance(outcome, str):
                results.append(outcome)
            else:
                results.append(Delivered(message.topic, outcome.partition, outcome.offset))
        return results

    def _stop_unpublished(self, failed: list[tuple[Outgoing, str]]) -> None:
        """Stop the process at once: neither Faust's acknowledgement of the batch nor its
        commit on a graceful stop may run, or the batch's inputs would be skipped."""
        log.critical("messages not published after %d attempts: stopping before their inputs are acknowledged",
                     self.settings.worker.publish_attempts, extra={
                         "failed": len(failed),
                         "topics": sorted({m.topic for m, _ in failed}),
                         "sizes": sorted({len(m.key or b"") + len(m.value or b"") for m, _ in failed})[-3:],
                         "error": failed[0][1]})
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(EXIT_UNPUBLISHED)

    def _log(self, result: Result) -> None:
        audit = result.decision.audit
        if audit is None:
            return
        metrics.child(metrics.INPUTS, audit.input.topic, audit.outcome).inc()
        quiet = audit.outcome in ("accepted", "ignored")  # the audit stream has every decision
        level = logging.DEBUG if quiet else logging.INFO
        if not log.isEnabledFor(level):  # most intents: their line's fields are not even gathered
            return
        log.log(level, "decided", extra={
            "ref": audit.input.ref, "topic": audit.input.topic, "key": audit.input.key,
            "outcome": audit.outcome, "reason": audit.reason, "commands": audit.commands,
            "notifications": audit.notifications,
        })

    async def _tick(self) -> None:
        """Send what the rules say is due (``Engine.due``, from the table state's indexes)
        through the routed partition that decides it: a drain deadline to its node's, a
        maintenance plan's slots to the plan's, the intent ids past the dedup window to the
        partitions whose changelogs hold them."""
        now = datetime.now(UTC)
        for tick in self.engine.due(self.state, now):
            match tick:
                case DeadlineTick(_, node):  # the node's decision checks its row
                    await self.routed.send(key=f"node/{node or ''}".encode(), value=encode_json(tick_value(node or "")),
                                           headers={KIND_HEADER: b"tick"})
                case PlanTick(_, plan):  # the plan's decision checks its row
                    await self.routed.send(key=f"maintenance/{plan}".encode(), value=encode_json(plan_tick_value(plan)),
                                           headers={KIND_HEADER: b"tick"})
                case ForgetTick():
                    for key, forgetting in self._forgetting(tick):
                        await self.routed.send(key=key, value=encode_json(forget_value(forgetting)),
                                               headers={KIND_HEADER: b"tick"})
        for name, size in self.state.sizes().items():
            metrics.TABLE_ROWS.labels(name).set(size)
        metrics.record_lag(self.app)
        self.router.record_lag()

    def _forgetting(self, tick: ForgetTick) -> list[tuple[bytes, ForgetTick]]:
        """``tick``'s intent ids grouped by the routed partition their rows were written in —
        where the worker's producer puts the key each row was decided under, by that
        producer's own partitioner and its metadata of the topic — each group keyed by one
        of those keys, so its tick lands there, and cut into ticks of at most
        :data:`FORGET_PER_TICK` ids. An id asked for within :data:`FORGET_AGAIN_SECONDS` is
        left out: its tick may not be decided yet. Nothing is sent while the producer does
        not know the topic's partitions."""
        clock = time.monotonic()
        asked = self._asked_to_forget
        for intent_id in [i for i, at in asked.items() if clock - at >= FORGET_AGAIN_SECONDS]:
            del asked[intent_id]
        topic = self.routed.get_topic_name()
        groups: dict[int, tuple[bytes, list[str]]] = {}
        try:
            for intent_id in tick.intent_ids:
                row = self.state.get(PROCESSED, intent_id)
                if intent_id in asked or not isinstance(row, DecidedIntent):
                    continue
                key = (row.key or UNROUTABLE_KEY).encode()  # the routed key the intent was decided under
                partition = self.app.producer.key_partition(topic, key).partition
                groups.setdefault(partition, (key, []))[1].append(intent_id)
        except Exception as error:  # no metadata of the routed topic yet: asked again next tick
            log.info("not forgetting yet: %r", error)
            return []
        for _, ids in groups.values():
            asked.update(dict.fromkeys(ids, clock))
        return [(key, ForgetTick(tick.at, tuple(ids[at:at + FORGET_PER_TICK])))
                for key, ids in groups.values() for at in range(0, len(ids), FORGET_PER_TICK)]

    async def _partitions_settled(self, sender: Any, /, *args: Any, signal: Any = None, **kwargs: Any) -> None:
        """Partitions came or went and their tables are recovered: the indexes of drain
        deadlines and decided intent ids are rebuilt from the rows this instance now holds."""
        self.state.rebuild_indexes()

    async def _tend_heap(self) -> None:
        """Keep full garbage collections off the decision path (streams/common/heap.py)."""
        self.heap.tend()

    @staticmethod
    def _time(message: Record) -> datetime:
        """Decisions take the input's own time, so replaying it decides the same; a
        timestamp no date can show (a producer may set any) is taken as the nearest one."""
        stamp = message.timestamp
        seconds = float(stamp) if isinstance(stamp, (int, float)) and stamp == stamp else 0.0  # NaN is not a time
        return datetime.fromtimestamp(min(max(seconds, 0.0), _LATEST), UTC)

    # ------------------------------------------------------------------- pages

    def _page(self, path: str, handler: Any) -> None:
        """Faust binds a page function to its view: wrap our bound method in a plain one."""

        async def view(web: Any, request: Any) -> Any:
            return await handler(web, request)

        view.__name__ = f"page{path.replace('/', '_')}"
        self.app.page(path)(view)

    async def _health(self, web: Any, request: Any) -> Any:
        return web.json({"status": "ok"})

    def changelogs(self) -> tuple[str, ...]:
        tables = [*self.tables.values(), self.state.journal.table] if self.state.journal else self.tables.values()
        return tuple(changelog_topic(self.settings.worker.app_id, table.name) for table in tables)

    async def _ready(self, web: Any, request: Any) -> Any:
        """Ready once the tables are recovered from their changelogs and no topic is missing."""
        tables_recovered = self.app.tables.recovery.completed.is_set()  # type: ignore[attr-defined]
        recovered = tables_recovered and self.view.caught_up.is_set() and self.pages_view.caught_up.is_set()
        if self.missing_topics is None or self.missing_topics:
            self.missing_topics = await self.app.loop.run_in_executor(None, missing_topics, self.kafka)
        missing = self.missing_topics
        ready = recovered and not missing
        body = {"ready": ready, "tables_recovered": recovered, "missing_topics": missing}
        return web.json(body, status=200 if ready else 503)

    async def _capacity(self, web: Any, request: Any) -> Any:
        """GPU capacity per class as this instance sees it (usage is a global table)."""
        return web.json(capacity_report(self.state, self.engine.catalog))

    async def _pending(self, web: Any, request: Any) -> Any:
        """The VMs of the whole cluster whose GPU change waits for a restart: any instance
        gives the same list (a console asks one replica behind a Service), read from the
        changelogs of every partition (``pages_view``), not from this instance's tables."""
        view = self.pages_view
        return web.json([d for key in view.keys(TRACKING) if (d := pending_detail(view, key)) is not None])

    async def _metrics(self, web: Any, request: Any) -> Any:
        return web.bytes(metrics.exposition("worker"), content_type=metrics.CONTENT_TYPE)

    def figures(self) -> Figures:
        """GPUs, waiting VMs and open drains in the partitions this instance owns: its share of
        the AZ, which the sum over every worker makes whole (docs/operators.md, "Metrics")."""
        local = self.state.local()
        return figures(local, self.engine.catalog, tracked=local.keys(TRACKING))

