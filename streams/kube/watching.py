"""Kubernetes → Kafka: the watch bridge (``vmstream watch``).

API server → list, then watch, one thread per kind → :class:`~handlers.contracts.messages.WatchEvent`
→ idempotent producer → ``vmstream.k8s-events`` (key ``<Kind>/<namespace>/<name>``) →
the worker. Nothing here decides anything; the bridge only makes sure that what the API
server showed reaches Kafka, in order per object, even across restarts of the watch.

How it keeps that promise:

* A (re)list publishes every object as ``RELISTED`` and, for each object it knew before
  but the list no longer holds, a ``DELETED`` carrying the last object it saw: the
  deletions that happened while it was away (a ``410 Gone``) are not lost.
* The resourceVersion a watch resumes from — and the objects kept for that reconciliation
  — advance only when Kafka has acknowledged every event up to it (``acks=all``). A
  failed send or a broken connection therefore resumes from a point that republishes
  whatever might not have been written: at least once, never lost. A republished version
  has the same ``event_id`` (a hash of kind, object, resourceVersion and type), so
  consumers drop the repeat.
* A restarted process first reads ``k8s-events`` back to its end (:func:`last_published`):
  what it last published of each object seeds the watchers, so its first relist also
  publishes the deletions that happened while no bridge ran. Each kind relists every
  :data:`RESYNC_SECONDS`, so that every live object's last event stays within the topic's
  retention.
* Every event gets a message (:class:`Publisher`): the whole object when the worker takes
  it (``limits.max_input_bytes``); else the object reduced to what the rules read; else a
  dead letter naming it. No object can hold back the events behind it. Batches are
  gzip-compressed.
* Network errors, 5xx and anything else unexpected are retried with exponential backoff
  and full jitter (tenacity, capped at :data:`BACKOFF_CAP`); the process never dies of them.

Objects are read raw (``_preload_content=False``): the client's models would drop
fields they do not know and cost more than the JSON itself. ``/health``, ``/ready`` and
``/metrics`` come from :meth:`Bridge.probes`. docs/watch.md tells the whole design.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import pydantic_core
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import ConfigResource, ResourceType
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines
from prometheus_client import Counter as Metric
from prometheus_client import Gauge
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_when_event_set,
    wait_random_exponential,
)

from handlers.contracts.config import Limits
from handlers.contracts.events import watch_event_type
from handlers.contracts.ids import watch_event_id
from handlers.contracts.messages import (
    ORIGINAL_PREFIX_BYTES,
    WATCHED_KINDS,
    DeadLetter,
    DeadLetterSource,
    WatchedKind,
    WatchEvent,
    object_key,
)
from handlers.contracts.topics import DLQ, K8S_EVENTS
from handlers.contracts.tracing import ce_headers
from handlers.core.cluster import rule_view
from streams.common import spans
from streams.common.cloudevents import event_source, kafka_headers, trace_of
from streams.common.durable import Delivered, DurableProducer, Record
from streams.common.kafka_clients import ADMIN_SECONDS, COMPRESSION, admin_client, consumer
from streams.common.metrics import DEAD_LETTERS, family
from streams.common.probes import ProbeServer, add_probe_arguments
from streams.common.reading import partitions_of, read_to_end
from streams.common.settings import KafkaSettings, read_yaml

if TYPE_CHECKING:
    from concurrent.futures import Future
    from urllib3 import BaseHTTPResponse

log = logging.getLogger(__name__)

EventType = Literal["ADDED", "MODIFIED", "DELETED", "RELISTED"]

TOPIC = K8S_EVENTS.name
DLQ_TOPIC = DLQ.name
LIST_PAGE = 500  # objects per list page: a 10,000-VM AZ is listed in 20 requests
WATCH_SECONDS = 300  # one watch request's lifetime, server side (jittered up to 2x)
CONNECT_SECONDS = 10.0
READ_GRACE_SECONDS = 60.0  # a watch silent this long past its lifetime is a dead connection
BACKOFF_FIRST = 0.5  # the first retry waits up to this, doubling per failure...
BACKOFF_CAP = 30.0  # ...up to this
STATS_SECONDS = 60.0
READ_BACK_STALL_SECONDS = 60.0  # reading k8s-events back without a record this long: start again
RESYNC_SECONDS = 24 * 3600.0  # a full relist this often, well within k8s-events' 7-day retention
# One event must fit one Kafka message: what the broker takes per batch (the topic's
# max.message.bytes, read at start; this is its default) less a batch's header, the record's
# own fields and headers.
MESSAGE_BYTES = 1_048_588
RECORD_OVERHEAD = 512
REDUCED_HEADER = "vmstream-reduced"  # on an event whose object is its rule view: the whole size
PROBE_PORT = 6068

EVENTS = family(Metric("vmstream_watch_events_total", "Watch events Kafka acknowledged, by kind and type",
                       ["kind", "type"], registry=None), "watch")
RELISTS = family(Metric("vmstream_watch_relists_total", "Lists of a whole kind: at start, after 410 Gone, resyncs",
                        ["kind"], registry=None), "watch")
DELETED_WHILE_AWAY = family(Metric("vmstream_watch_deleted_while_away_total",
                                   "Deletions a list found (objects last published but no longer listed)", ["kind"],
                                   registry=None), "watch")
ERRORS = family(Metric("vmstream_watch_errors_total",
                       "Failed attempts, retried: source=api (the API server or its data), kafka (a send)",
                       ["kind", "source"], registry=None), "watch")
OVERSIZED = family(Metric("vmstream_watch_oversized_total",
                          "Events too large for the worker as they are, by what was published instead: "
                          "reduced (the rule view), dead_letter", ["kind", "outcome"], registry=None), "watch")
LISTED = family(Gauge("vmstream_watch_listed", "1 once the kind's first list is on Kafka", ["kind"], registry=None),
                "watch")


# A watched resource and the watched ones: declared once, with the messages (handlers/contracts/messages.py).
Kind = WatchedKind
KINDS: tuple[Kind, ...] = WATCHED_KINDS

# Core kinds are listed through CoreV1Api (their path is /api/v1, not /apis/<group>/...).
_CORE_LISTERS = {"nodes": "list_node", "namespaces": "list_namespace"}


def select_kinds(names: Iterable[str] | str | None) -> tuple[Kind, ...]:
    """The kinds named (``VirtualMachine,Node`` or plurals, any case); all when none."""
    if names is None:
        return KINDS
    if isinstance(names, str):
        names = names.split(",")
    wanted = [name.strip().lower() for name in names if name.strip()]
    by_name = {k.kind.lower(): k for k in KINDS} | {k.plural: k for k in KINDS}
    unknown = [name for name in wanted if name not in by_name]
    if unknown:
        choices = ", ".join(k.kind for k in KINDS)
        raise ValueError(f"unknown kind(s) {', '.join(unknown)}; choose from {choices}")
    return tuple(k for k in KINDS if k in {by_name[name] for name in wanted})


# ------------------------------------------------------------------------- errors


class Gone(Exception):
    """The resourceVersion the watcher holds is too old (410): it must relist."""


class WatchError(Exception):
    """The API server ended a watch with an error status other than 410."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"watch error {code}: {message}")
        self.code = code


class PublishFailed(Exception):
    """Kafka did not acknowledge an event: resume from the last acknowledged point."""


# ------------------------------------------------------------------------- events


def watch_event(kind: Kind, type_: EventType, obj: dict[str, Any]) -> tuple[str, bytes]:
    """(key, value) of the WatchEvent showing ``obj``; checked against the contract's model.

    ``metadata.managedFields`` is dropped (it can be most of an object and nobody reads it).
    """
    metadata = obj.get("metadata") or {}
    metadata.pop("managedFields", None)
    namespace = metadata.get("namespace")
    name = metadata.get("name", "")
    event = WatchEvent(
        event_id=event_id_of(kind, type_, obj),
        type=type_,
        kind=kind.kind,
        object=obj,
        observed_at=datetime.now(UTC),
    )
    return object_key(kind.kind, namespace, name), event.model_dump_json().encode()


def changed_at(obj: dict[str, Any]) -> datetime | None:
    """The latest time an object shows: its last write (``managedFields``), its
    ``deletionTimestamp``, its ``creationTimestamp``; None when it shows none."""
    metadata = obj.get("metadata") or {}
    stamps = [metadata.get("creationTimestamp"), metadata.get("deletionTimestamp")]
    stamps += [entry.get("time") for entry in metadata.get("managedFields") or [] if isinstance(entry, dict)]
    times = []
    for stamp in stamps:
        if isinstance(stamp, str):
            try:
                moment = datetime.fromisoformat(stamp)
            except ValueError:
                continue
            times.append(moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC))
    return max(times, default=None)


def event_id_of(kind: Kind, type_: EventType, obj: dict[str, Any]) -> str:
    """The ``event_id`` of the event showing ``obj``: a republished version keeps it."""
    metadata = obj.get("metadata") or {}
    return watch_event_id(kind.kind, metadata.get("namespace"), metadata.get("name", ""),
                          str(metadata.get("resourceVersion", "")), type_)


def event_headers(kind: Kind, type_: EventType, event_id: str, *, source: str, time: datetime
                  ) -> list[tuple[str, bytes]]:
    """A watch event's CloudEvents headers and ``traceparent``: ``ce_id`` its ``event_id``, a
    trace derived from that id — a republished event has the very headers it had
    (docs/integrators.md)."""
    headers = ce_headers(id_=event_id, type_=watch_event_type(kind.kind, type_),
                         source=source, time=time, trace=trace_of(None, event_id))
    return [(name, text.encode("utf-8")) for name, text in headers]


def _key_of(kind: Kind, obj: dict[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    return object_key(kind.kind, metadata.get("namespace"), metadata.get("name", ""))


Form = Literal["whole", "reduced", "dead_letter"]


@dataclass(frozen=True, slots=True)
class Sent:
    """An event handed to the producer: when Kafka has it, and the object as published."""

    future: Future[Delivered]
    obj: bytes  # compact JSON: the object, or its rule view when reduced or dead-lettered
    form: Form


class Publisher:
    """Sends watch events to the k8s-events topic; the futures say when Kafka has them.

    Every event gets a message, whatever its object's size: the whole object when the event
    is at most ``max_bytes`` — what the worker takes (its ``limits.max_input_bytes``: it
    dead-letters larger input unparsed) — and fits ``message_bytes`` (the topic's
    max.message.bytes); else the object reduced to what the rules read
    (:func:`~handlers.core.cluster.rule_view`, marked by the :data:`REDUCED_HEADER` header); else
    a dead letter naming it. Nothing one object does can stop the events behind it.
    """

    def __init__(
        self, kafka_producer: DurableProducer, topic: str, *, dlq_topic: str | None = None,
        max_bytes: int = Limits().max_input_bytes, message_bytes: int = MESSAGE_BYTES,
        source: str = event_source("watch", "vmstream"),
    ) -> None:
        self.producer = kafka_producer
        self.source = source  # the CloudEvents ``source`` of what it publishes
        self.topic = topic
        self.dlq_topic = dlq_topic or topic.replace(TOPIC, DLQ_TOPIC)
        DEAD_LETTERS.labels(topic)  # shown at 0 from the start (the alert's increase())
        self.max_bytes = max_bytes
        self.message_bytes = message_bytes

    def send(self, kind: Kind, type_: EventType, obj: dict[str, Any]) -> Sent:
        # The object's time (read before watch_event drops managedFields), else now.
        event_id, changed = event_id_of(kind, type_, obj), changed_at(obj) or datetime.now(UTC)
        key, value = watch_event(kind, type_, obj)
        envelope = event_headers(kind, type_, event_id, source=self.source, time=changed)
        if spans.enabled():  # the trace's root: the id the event's traceparent names (handlers/contracts/tracing.py)
            started = spans.now()
            trace_id, root = spans.root_of(event_id)
            spans.record(f"watch {kind.kind} {type_}", None, start=started, kind=spans.Kind.PRODUCER, own_span=root,
                         root_trace=trace_id, attributes={"messaging.destination.name": self.topic,
                                                          "messaging.message.id": event_id, "vmstream.key": key})
        if self._fits(key, value, envelope):
            future = self.producer.send(Record(self.topic, key.encode(), value, envelope))
            return self._sent(kind, future, pydantic_core.to_json(obj), "whole")
        whole_size = len(value)
        view = rule_view(kind.kind, obj)
        _, reduced = watch_event(kind, type_, view)
        headers = [*envelope, (REDUCED_HEADER, str(whole_size).encode())]
        if self._fits(key, reduced, headers):
            future = self.producer.send(Record(self.topic, key.encode(), reduced, headers))
            log.warning("watch %s %s: %d bytes, over %d; published reduced to what the rules read (%d bytes)",
                        type_, key, whole_size, self.max_bytes, len(reduced))
            return self._sent(kind, future, pydantic_core.to_json(view), "reduced")
        at = datetime.now(UTC)
        letter = DeadLetter(
            error=f"watch event {type_} {key} (resourceVersion "
                  f"{(obj.get('metadata') or {}).get('resourceVersion')}) is too large: "
                  f"{whole_size} bytes whole, {len(reduced)} reduced to what the rules read, over "
                  f"{self.max_bytes}",
            source=DeadLetterSource(topic=self.topic),
            original=value[:ORIGINAL_PREFIX_BYTES].decode("utf-8", "ignore"),  # a cut character left out
            at=at,
            original_truncated=True,
            original_size=whole_size,
            original_sha256=hashlib.sha256(value).hexdigest(),
        )
        log.error("watch %s %s: %d bytes, too large even reduced; dead-lettered", type_, key, whole_size)
        DEAD_LETTERS.labels(self.topic).inc()
        trace = trace_of(None, event_id)  # the event's, as if it had been published
        future = self.producer.send(Record(self.dlq_topic, key.encode(), letter.model_dump_json().encode(),
                                           list(kafka_headers(letter, source=self.source, trace=trace,
                                                              time=at).items())))
        return self._sent(kind, future, pydantic_core.to_json(view), "dead_letter")

    def _fits(self, key: str, value: bytes, headers: list[tuple[str, bytes]]) -> bool:
        extra = sum(len(name) + len(data) + 4 for name, data in headers)  # each with its two lengths
        return len(value) <= self.max_bytes and len(key) + len(value) + RECORD_OVERHEAD + extra <= self.message_bytes

    @staticmethod
    def _sent(kind: Kind, future: Future[Delivered], obj: bytes, form: Form) -> Sent:
        if form != "whole":
            OVERSIZED.labels(kind.kind, form).inc()
        return Sent(future, obj, form)


# ------------------------------------------------------------------------- one kind


@dataclass
class WatchStats:
    """Counts for logs and tests (events counted once Kafka has them); written by the
    watcher's thread only."""

    published: Counter[str] = field(default_factory=Counter)
    oversized: Counter[str] = field(default_factory=Counter)  # by form: reduced, dead_letter
    relists: int = 0
    deleted_while_away: int = 0
    gone: int = 0
    failures: int = 0
    bookmarks: int = 0
    last_error: str | None = None

    def line(self) -> str:
        published = " ".join(f"{t.lower()}={n}" for t, n in sorted(self.published.items())) or "none"
        oversized = " ".join(f"{form}={n}" for form, n in sorted(self.oversized.items())) or "none"
        return (
            f"published[{published}] oversized[{oversized}] relists={self.relists} "
            f"deleted_while_away={self.deleted_while_away} gone={self.gone} "
            f"failures={self.failures} bookmarks={self.bookmarks}"
        )


@dataclass(slots=True)
class _Pending:
    """A sent event (or a bookmark, ``future`` None) not yet applied to the watcher's state."""

    resource_version: str
    type_: str
    key: str | None
    obj: bytes | None  # the object as JSON; None once deleted
    future: Future[Delivered] | None
    form: Form = "whole"


class Watcher:
    """Lists and watches one kind; its state (resourceVersion, known objects) outlives a run.

    ``known`` maps each key to the object last *acknowledged* on Kafka, as compact JSON (a
    parsed dict costs several times more): what a relist compares against to find deletions.
    ``resource_version`` is where the next watch resumes; None means "relist first".
    ``seeded`` says ``known`` holds what Kafka last showed (read back by the bridge, or
    this watcher's own acknowledged events): a list can then tell what was deleted.
    """

    def __init__(
        self, kind: Kind, *, watch_seconds: int = WATCH_SECONDS, resync_seconds: float = RESYNC_SECONDS
    ) -> None:
        self.kind = kind
        self.watch_seconds = watch_seconds
        self.resync_seconds = resync_seconds
        self.resource_version: str | None = None
        self.known: dict[str, bytes] = {}
        self.seeded = False
        self.listed = threading.Event()  # the first list is on Kafka
        self.stats = WatchStats()
        self._listed_at = 0.0
        for metric, labels in (  # every series exists from the start, at 0
            (RELISTS, ()), (DELETED_WHILE_AWAY, ()), (ERRORS, ("api",)), (ERRORS, ("kafka",)),
            *((OVERSIZED, (form,)) for form in ("reduced", "dead_letter")),
        ):
            metric.labels(kind.kind, *labels)
        self._pending: deque[_Pending] = deque()
        self._response: BaseHTTPResponse | None = None
        self._lock = threading.Lock()

    # The loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event, api: client.ApiClient, publisher: Publisher) -> None:
        """Keep Kafka in step with this kind until ``stop`` is set; never raises."""
        while not stop.is_set():
            retrying = Retrying(
                retry=retry_if_exception_type(Exception),
                wait=self._wait,
                stop=stop_when_event_set(stop),
                sleep=lambda seconds: _pause(stop, seconds),
                before_sleep=self._log_retry,
                reraise=True,
            )
            try:
                for attempt in retrying:
                    with attempt:
                        self._step(stop, api, publisher)
            except Exception:  # only when stopping: the retry loop gives up only then
                if not stop.is_set():
                    log.exception("watch kind=%s loop ended unexpectedly; restarting", self.kind.kind)

    def interrupt(self) -> None:
        """Unblock a watch waiting for data (from another thread), so that stop is prompt."""
        with self._lock:
            response = self._response
        if response is not None:
            try:
                response.shutdown()  # urllib3 >= 2.3: a blocked read returns
            except Exception as error:  # already closed: nothing to unblock
                log.debug("watch kind=%s interrupt: %s", self.kind.kind, error)

    def _step(self, stop: threading.Event, api: client.ApiClient, publisher: Publisher) -> None:
        """Relist if needed, then one watch request until it ends."""
        try:
            if self.resource_version is None or time.monotonic() - self._listed_at > self.resync_seconds:
                self.relist(api, publisher)
            if not stop.is_set():
                self._watch(stop, api, publisher)
        except Gone:
            self.resource_version = None
            raise

    def _wait(self, state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, Gone) and state.attempt_number == 1:
            return 0.0  # relist at once; a relist loop backs off from the second time
        return _backoff(state)

    def _log_retry(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        if isinstance(error, Gone):
            self.stats.gone += 1
            log.info("watch kind=%s gone (410): %s; relisting in %.1fs", self.kind.kind, error, wait)
            return
        self.stats.failures += 1
        self.stats.last_error = f"{type(error).__name__}: {error}"
        ERRORS.labels(self.kind.kind, "kafka" if isinstance(error, PublishFailed) else "api").inc()
        log.warning(
            "watch kind=%s failed attempt=%d error=%s; retrying from resource_version=%s in %.1fs",
            self.kind.kind, state.attempt_number, self.stats.last_error, self.resource_version, wait,
        )

    # Reading the API server ------------------------------------------------------------

    def _call(self, api: client.ApiClient, **params: Any) -> BaseHTTPResponse:
        kind = self.kind
        if kind.label_selector:
            params["label_selector"] = kind.label_selector
        try:
            if kind.group:
                response = client.CustomObjectsApi(api).list_cluster_custom_object(
                    kind.group, kind.version, kind.plural, _preload_content=False, **params
                )
            else:
                lister = getattr(client.CoreV1Api(api), _CORE_LISTERS[kind.plural])
                response = lister(_preload_content=False, **params)
        except ApiException as error:
            if error.status == 410:
                raise Gone(error.reason) from error
            raise
        return response  # type: ignore[no-any-return]

    def _list(self, api: client.ApiClient) -> tuple[list[dict[str, Any]], str]:
        """Every object (paged, one consistent snapshot) and the list's resourceVersion."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            params: dict[str, Any] = {"limit": LIST_PAGE, "_request_timeout": (CONNECT_SECONDS, 120.0)}
            if token:
                params["_continue"] = token
            response = self._call(api, **params)
            try:
                page = json.loads(response.data)
            finally:
                response.release_conn()
            for item in page.get("items") or []:
                # Lists of core kinds leave these out of their items; a watch carries them.
                item.setdefault("apiVersion", self.kind.api_version)
                item.setdefault("kind", self.kind.kind)
                items.append(item)
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items, str(page["metadata"]["resourceVersion"])

    def relist(self, api: client.ApiClient, publisher: Publisher) -> None:
        """List, publish the state as RELISTED and the deletions missed as DELETED.

        The new state replaces the old only once Kafka has acknowledged all of it: if a send
        fails, the next attempt relists again and still knows what to call deleted.
        """
        self._settle(block=True)
        self.resource_version = None
        started = time.monotonic()
        items, resource_version = self._list(api)
        sent: list[Sent] = []
        listed: dict[str, bytes] = {}
        for obj in items:
            key = _key_of(self.kind, obj)
            relisted = publisher.send(self.kind, "RELISTED", obj)
            sent.append(relisted)
            listed[key] = relisted.obj
        gone = []
        for key in [key for key in self.known if key not in listed]:
            try:  # read back from the topic, where anyone may have written: only an event of that very object
                obj = json.loads(self.known[key])
                if _key_of(self.kind, obj) != key:
                    raise ValueError(f"its object is {_key_of(self.kind, obj)}")
                sent.append(publisher.send(self.kind, "DELETED", obj))
            except (ValueError, TypeError, AttributeError) as error:  # a ValidationError is a ValueError
                log.warning("watch kind=%s: %s was read back as no event of it (%s); no DELETED",
                            self.kind.kind, key[:300], str(error)[:300])
                continue
            gone.append(key)
        for one in sent:
            _acknowledged(one.future)
        self.known = listed
        self.seeded = True
        self.resource_version = resource_version
        self._listed_at = time.monotonic()
        self.stats.relists += 1
        self.stats.deleted_while_away += len(gone)
        self._count("RELISTED", len(items))
        self._count("DELETED", len(gone))
        for one in sent:
            if one.form != "whole":
                self.stats.oversized[one.form] += 1
        RELISTS.labels(self.kind.kind).inc()
        DELETED_WHILE_AWAY.labels(self.kind.kind).inc(len(gone))
        LISTED.labels(self.kind.kind).set(1)
        self.listed.set()
        log.info(
            "watch kind=%s relisted objects=%d deleted_while_away=%d resource_version=%s seconds=%.2f",
            self.kind.kind, len(items), len(gone), resource_version, time.monotonic() - started,
        )

    def _watch(self, stop: threading.Event, api: client.ApiClient, publisher: Publisher) -> None:
        """One watch request from the acknowledged resourceVersion, until it ends."""
        lifetime = random.randint(self.watch_seconds, 2 * self.watch_seconds)  # spread reconnects
        response = self._call(
            api,
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=lifetime,
            _request_timeout=(CONNECT_SECONDS, lifetime + READ_GRACE_SECONDS),
        )
        with self._lock:
            self._response = response
        consumed = False  # read to its end: the connection can go back to the pool
        try:
            if stop.is_set():  # stop came while connecting: interrupt() found nothing to shut
                return
            for line in iter_resp_lines(response):
                if line:
                    self._on_event(json.loads(line), publisher)
                    self._settle(block=False)
                if stop.is_set():
                    return
            consumed = True
        except Exception:
            if stop.is_set():
                return  # the interrupt broke the read; what was sent is settled below
            raise
        finally:
            with self._lock:
                self._response = None
            if not consumed:
                response.close()
            response.release_conn()
            self._settle(block=True)

    def _on_event(self, event: dict[str, Any], publisher: Publisher) -> None:
        type_ = event.get("type")
        obj = event.get("object") or {}
        if type_ == "ERROR":
            code = int(obj.get("code") or 0)
            message = str(obj.get("message") or obj.get("reason") or "")
            if code == 410:
                raise Gone(message)
            raise WatchError(code, message)
        resource_version = str((obj.get("metadata") or {}).get("resourceVersion", ""))
        if type_ == "BOOKMARK":
            self.stats.bookmarks += 1
            self._pending.append(_Pending(resource_version, "BOOKMARK", None, None, None))
            return
        if type_ not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("watch kind=%s ignores an event of type %r", self.kind.kind, type_)
            return
        sent = publisher.send(self.kind, type_, obj)
        kept = None if type_ == "DELETED" else sent.obj
        self._pending.append(_Pending(resource_version, type_, _key_of(self.kind, obj), kept, sent.future, sent.form))

    def _settle(self, *, block: bool) -> None:
        """Apply, in order, what Kafka has acknowledged: the known objects and the resume point.

        Stops at the first event not yet acknowledged (unless ``block``); on a failed send
        waits for the rest, drops them all and raises, so the watch resumes before it.
        """
        pending = self._pending
        while pending:
            head = pending[0]
            if head.future is not None:
                if not block and not head.future.done():
                    return
                try:
                    _acknowledged(head.future)
                except PublishFailed:
                    for rest in pending:
                        if rest.future is not None:
                            _quietly(rest.future)
                    pending.clear()
                    raise
            pending.popleft()
            if head.key is not None:
                self._count(head.type_, 1)
                if head.form != "whole":
                    self.stats.oversized[head.form] += 1
                if head.obj is None:
                    self.known.pop(head.key, None)
                else:
                    self.known[head.key] = head.obj
            if head.resource_version:
                self.resource_version = head.resource_version

    def _count(self, type_: str, n: int) -> None:
        self.stats.published[type_] += n
        EVENTS.labels(self.kind.kind, type_).inc(n)


def message_limit(kafka: KafkaSettings, topic: str) -> int | None:
    """The topic's ``max.message.bytes`` as the broker reports it (None if it has no such topic)."""
    resource = ConfigResource(ResourceType.TOPIC, topic)
    try:
        admin = admin_client(kafka)  # held until the answer: a client let go cancels its requests
        configs = admin.describe_configs([resource], request_timeout=ADMIN_SECONDS)[resource].result()
    except KafkaException as error:
        if error.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            return None
        raise
    entry = configs.get("max.message.bytes")
    return int(entry.value) if entry is not None and entry.value else None


def last_published(
    kafka: KafkaSettings, topic: str, kinds: Sequence[Kind], stop: threading.Event | None = None
) -> dict[str, dict[str, bytes]]:
    """kind → key → object (compact JSON) of every object whose last event on ``topic`` is
    not a deletion: what the worker last learnt is alive, read to the end without a group.

    Only the last value of each key is kept while reading, and parsed at the end. A
    tombstone forgets its key; a value that is no watch event is skipped.
    """
    wanted = {kind.kind for kind in kinds}
    reader = consumer(kafka, client_id="vmstream-watch-read-back",
                      config={"max.partition.fetch.bytes": 8 * 1024 * 1024, "fetch.max.bytes": 64 * 1024 * 1024})
    started = time.monotonic()
    try:
        last: dict[bytes, bytes | None] = {}
        partitions = partitions_of(reader, [topic], wait=0, missing_ok=True)
        for record in read_to_end(reader, partitions, stall=READ_BACK_STALL_SECONDS, stop=stop):
            if record.key is not None:
                last[record.key] = record.value
        if stop is not None and stop.is_set():
            return {}
    finally:
        reader.close()
    alive: dict[str, dict[str, bytes]] = {}
    skipped = 0
    for key, value in last.items():
        if value is None:
            continue
        try:  # anyone may have written anything here: a record that is no watch event is skipped
            event = json.loads(value)
            kind, type_, obj = event["kind"], event["type"], event["object"]
            if isinstance(kind, str) and kind in wanted and type_ != "DELETED" and isinstance(obj, dict):
                name, shown = key.decode(), pydantic_core.to_json(obj)
                alive.setdefault(kind, {})[name] = shown
        except (ValueError, TypeError, KeyError, RecursionError):  # UnicodeDecodeError is a ValueError
            skipped += 1
    log.info(
        "watch read back %s: keys=%d alive=%s skipped=%d seconds=%.2f", topic, len(last),
        ",".join(f"{kind}={len(keys)}" for kind, keys in sorted(alive.items())) or "none", skipped,
        time.monotonic() - started,
    )
    return alive


def _pause(stop: threading.Event, seconds: float) -> None:
    """Back off, but wake up at once when asked to stop."""
    stop.wait(seconds)


def _backoff(state: RetryCallState) -> float:
    return float(_JITTERED(state))


_JITTERED = wait_random_exponential(multiplier=BACKOFF_FIRST, max=BACKOFF_CAP)


def _acknowledged(future: Future[Delivered]) -> None:
    """Wait for Kafka's acknowledgement (bounded by the producer's delivery timeout)."""
    try:
        future.result()
    except Exception as error:
        raise PublishFailed(f"Kafka did not acknowledge an event: {error}") from error


def _quietly(future: Future[Delivered]) -> None:
    try:
        future.result()
    except Exception:  # already reported through the first failure
        pass


# ------------------------------------------------------------------------- the bridge


def _until_stopped(stop: threading.Event, trouble: str) -> Retrying:
    """Retry with jittered backoff until it works or ``stop`` is set, logging ``trouble``."""
    return Retrying(
        retry=retry_if_exception_type(Exception),
        wait=_JITTERED,
        stop=stop_when_event_set(stop),
        sleep=lambda seconds: _pause(stop, seconds),
        before_sleep=lambda state: log.warning(
            "watch: %s attempt=%d error=%s; retrying",
            trouble, state.attempt_number, state.outcome.exception() if state.outcome else None,
        ),
        reraise=True,
    )


class Bridge:
    """All the kinds' watchers, each on its own thread, sharing one idempotent producer."""

    def __init__(
        self,
        kafka: KafkaSettings,
        kube: client.Configuration,
        *,
        kinds: Sequence[Kind] = KINDS,
        watch_seconds: int = WATCH_SECONDS,
        stats_seconds: float = STATS_SECONDS,
        resync_seconds: float = RESYNC_SECONDS,
        max_event_bytes: int = Limits().max_input_bytes,
        app_id: str = "vmstream",
    ) -> None:
        self.kafka = kafka
        self.kube = kube
        self.source = event_source("watch", app_id)  # CloudEvents ``source`` of its records
        self.stats_seconds = stats_seconds
        self.max_event_bytes = max_event_bytes
        self.watchers = {
            kind.kind: Watcher(kind, watch_seconds=watch_seconds, resync_seconds=resync_seconds)
            for kind in kinds
        }

    def ready(self) -> bool:
        """Every kind's first list is on Kafka (deletions found by it included)."""
        return all(watcher.listed.is_set() for watcher in self.watchers.values())

    def details(self) -> dict[str, Any]:
        return {
            "kinds": {
                name: {"listed": watcher.listed.is_set(), "resource_version": watcher.resource_version,
                       "known": len(watcher.known)}
                for name, watcher in self.watchers.items()
            }
        }

    def probes(self, *, host: str = "127.0.0.1", port: int = PROBE_PORT) -> ProbeServer:
        """``/health``, ``/ready`` (:meth:`ready`) and ``/metrics`` for this bridge (not started)."""
        return ProbeServer(ready=self.ready, details=self.details, host=host, port=port, process="watch")

    def run(self, stop: threading.Event) -> None:
        """Watch until ``stop`` is set; then flush what was sent and return."""
        kafka_producer = self._producer(stop)
        if kafka_producer is None:
            return
        if not self._seed(stop):
            kafka_producer.close()
            return
        publisher = Publisher(kafka_producer, self.kafka.topic(TOPIC), dlq_topic=self.kafka.topic(DLQ_TOPIC),
                              max_bytes=self.max_event_bytes, message_bytes=self._message_bytes(),
                              source=self.source)
        apis = {name: client.ApiClient(self.kube) for name in self.watchers}
        threads = [
            threading.Thread(
                target=watcher.run, args=(stop, apis[name], publisher), name=f"watch-{name}", daemon=True
            )
            for name, watcher in self.watchers.items()
        ]
        log.info("watch started kinds=%s topic=%s", ",".join(self.watchers), publisher.topic)
        try:
            for thread in threads:
                thread.start()
            while not stop.wait(self.stats_seconds):
                self.log_stats()
        finally:
            stop.set()
            for watcher in self.watchers.values():
                watcher.interrupt()
            for thread in threads:
                thread.join()
            kafka_producer.close()  # what was sent, flushed
            for api in apis.values():
                api.close()
            self.log_stats()
            log.info("watch stopped")

    def _producer(self, stop: threading.Event) -> DurableProducer | None:
        """The idempotent producer, once Kafka answers (None if stopped before it did)."""
        try:
            for attempt in _until_stopped(stop, "Kafka not reachable"):
                with attempt:
                    return DurableProducer(self.kafka, client_id="vmstream-watch", linger_ms=5, compression=COMPRESSION)
        except Exception:
            if not stop.is_set():
                raise
        return None

    def _message_bytes(self) -> int:
        """What the broker takes per message on k8s-events (its default if it cannot say)."""
        topic = self.kafka.topic(TOPIC)
        try:
            limit = message_limit(self.kafka, topic)
        except Exception as error:  # the broker refuses DescribeConfigs (ACLs): assume its default
            log.warning("watch: cannot read %s's max.message.bytes (%s); assuming %d", topic, error, MESSAGE_BYTES)
            return MESSAGE_BYTES
        if limit is None:
            return MESSAGE_BYTES
        if limit < self.max_event_bytes + RECORD_OVERHEAD:
            log.warning("watch: %s takes messages of at most %d bytes, less than the worker's %d: events "
                        "over it are published reduced", topic, limit, self.max_event_bytes)
        return limit

    def _seed(self, stop: threading.Event) -> bool:
        """Give each watcher that has no state yet what k8s-events last showed of its kind.

        Its first list then publishes a DELETED for each object the topic still shows alive
        and the API server no longer has: deletions while no bridge ran are not lost.
        False if stopped first.
        """
        fresh = [watcher for watcher in self.watchers.values() if not watcher.seeded]
        if not fresh:
            return True
        try:
            for attempt in _until_stopped(stop, "could not read back k8s-events"):
                with attempt:
                    alive = last_published(self.kafka, self.kafka.topic(TOPIC), [w.kind for w in fresh], stop)
        except Exception:
            if not stop.is_set():
                raise
            return False
        if stop.is_set():
            return False
        for watcher in fresh:
            watcher.known = alive.get(watcher.kind.kind, {})
            watcher.seeded = True
        return True

    def log_stats(self) -> None:
        for name, watcher in self.watchers.items():
            log.info(
                "watch kind=%s resource_version=%s known=%d %s",
                name, watcher.resource_version, len(watcher.known), watcher.stats.line(),
            )


# ------------------------------------------------------------------------- the command


def load_limits(path: str | None) -> Limits:
    """``limits`` from the configuration file, ``VMSTREAM_LIMITS__MAX_INPUT_BYTES`` first:
    the bridge publishes whole only what the worker reading the same file takes."""
    section = dict(read_yaml(path).get("limits") or {})
    if os.environ.get("VMSTREAM_LIMITS__MAX_INPUT_BYTES"):
        section["max_input_bytes"] = os.environ["VMSTREAM_LIMITS__MAX_INPUT_BYTES"]
    return Limits.model_validate(section)


def load_app_id(path: str | None) -> str:
    """``worker.app_id`` from the configuration file, ``VMSTREAM_WORKER__APP_ID`` first: the
    bridge's CloudEvents ``source`` is ``/vmstream/watch/<app_id>``."""
    app_id = os.environ.get("VMSTREAM_WORKER__APP_ID") or (read_yaml(path).get("worker") or {}).get("app_id")
    return str(app_id) if app_id else "vmstream"


def main(args: argparse.Namespace) -> int:
    """``vmstream watch``: run the bridge until SIGINT or SIGTERM."""
    from streams.common.errors import ConfigError
    from streams.common.startup import config_problem, load_kafka_config, reach_kafka, run_until_signalled
    from streams.common.topics import ensure_topics
    from streams.kube.kubeconfig import kube_configuration, reach_kubernetes

    try:
        kinds = select_kinds(args.kinds)
    except ValueError as error:
        raise ConfigError(str(error), f"--kinds takes some of {', '.join(k.kind for k in KINDS)}") from error
    kafka = load_kafka_config(args)  # the bridge needs no policy: Kafka and limits
    try:
        limits = load_limits(args.config)
        app_id = load_app_id(args.config)
    except (ValueError, OSError) as error:  # a ValidationError is a ValueError
        raise config_problem(args.config, error) from error
    kube = kube_configuration(args.kubeconfig)
    reach_kubernetes(kube)
    reach_kafka(kafka)
    try:
        ensure_topics(kafka)
    except Exception as error:  # refused (ACLs), not unreachable: the watchers retry their sends
        log.warning("watch: could not check the topics (%s); continuing", error)
    logging.getLogger("kafka").setLevel(logging.WARNING)

    bridge = Bridge(kafka, kube, kinds=kinds, max_event_bytes=limits.max_input_bytes, app_id=app_id)
    return run_until_signalled("watch", bridge.run, lambda stop: bridge.probes(host=args.probe_host, port=args.probe_port),
                               host=args.probe_host, port=args.probe_port)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``vmstream watch``."""
    from streams.common.startup import add_kafka_arguments

    watch = commands.add_parser(
        "watch",
        help="publish Kubernetes watch events (VMs, VMIs, Nodes, NodeMaintenances, KubeVirt, Namespaces) to Kafka",
        description="List, then watch the kinds vmstream reacts to and publish every change to "
        "the k8s-events topic; relists after 410 Gone, reconnects with backoff.",
    )
    watch.add_argument("--config", help="the configuration file (YAML); its kafka section is used")
    watch.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else in-cluster, else ~/.kube/config: "
        "streams/kube/kubeconfig.py)"
    )
    watch.add_argument(
        "--kinds", metavar="KIND[,KIND...]",
        help=f"watch only these (default: all of {', '.join(k.kind for k in KINDS)})",
    )
    add_kafka_arguments(watch)
    add_probe_arguments(watch, PROBE_PORT)
    watch.set_defaults(handler=main, process=True)


__all__ = [
    "KINDS",
    "Bridge",
    "Kind",
    "Publisher",
    "Sent",
    "Watcher",
    "add_parser",
    "last_published",
    "load_limits",
    "main",
    "message_limit",
    "select_kinds",
    "watch_event",
]
