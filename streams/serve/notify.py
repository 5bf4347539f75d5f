"""``vmstream notify``: notifications delivered to people — e-mail, webhooks, chat rooms.

    notifications topic → :class:`~handlers.contracts.messages.Notification`
        → :func:`~handlers.contracts.delivery.targets` (addresses, ``project:`` members, routes)
        → :func:`~handlers.contracts.delivery.pending` (what the deliveries ledger does not hold yet)
        → per target: rate limit, send (SMTP / HTTP POST), retried while transient
        → a ledger record per delivery (or a dead letter, and its ledger record)
        → commit the notification's offset

At least once, and once in practice: the compacted topic ``vmstream.deliveries`` is the
ledger, one record per (notification_id, channel, recipient) delivered or dead-lettered,
written as soon as the receiver took it. It is read to its end at start-up and caught up
before every batch, so a notification read again after a crash (its offset not committed
yet) is sent only where it had not arrived. What remains is the window between a
receiver's answer and the ledger's acknowledgement: a crash there sends that one delivery
twice; CloudEvents carry the notification's id for receivers that drop repeats.

Transient failures (HTTP 408/425/429/5xx, SMTP 4xx, connection errors, timeouts) are
retried with exponential backoff (tenacity); after the last attempt, and at once on a
permanent one (another HTTP 4xx, SMTP 5xx), the delivery goes to ``vmstream.dlq`` with the
reason, its original the notification. docs/notify.md describes the configuration.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import signal
import smtplib
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.message import EmailMessage
from email.utils import make_msgid
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Histogram
from pydantic import ValidationError
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from handlers.contracts import delivery
from handlers.contracts.delivery import Bucket, Endpoint, Target, Verdict
from handlers.contracts.events import DEAD_LETTER_TYPE, DELIVERY_TYPE, source_process
from handlers.contracts.messages import DeadLetter, DeadLetterSource, Notification, clip, describe_validation_error
from handlers.contracts.topics import DLQ, NOTIFICATIONS
from handlers.contracts.tracing import ce_headers, dead_letter_id, span_id
from streams.common import spans
from streams.common.cloudevents import TRACEPARENT, TRACESTATE, Trace, event_source, header_text, trace_of
from streams.common.durable import DurableProducer, Record
from streams.common.group_reading import GroupReader, Received
from streams.common.kafka_clients import consumer
from streams.common.metrics import DEAD_LETTERS, family
from streams.common.probes import ProbeServer, add_probe_arguments
from streams.common.reading import partitions_of, read_to_end
from streams.common.settings import NotifySettings, Settings, SmtpSettings
from streams.common.topics import DELIVERIES as LEDGER  # the logical name of the ledger topic (compacted)
from streams.common.topics import ensure_topics

if TYPE_CHECKING:
    from confluent_kafka import Consumer

log = logging.getLogger(__name__)

# A ledger record or dead letter not acknowledged by then is a failed write: the notification
# is not committed, and is handled again.
LEDGER_WRITE_SECONDS = 30.0
DELIVERIES = family(Counter(
    "vmstream_notify_deliveries_total",
    "Deliveries of notifications, by channel and outcome (delivered, dead_lettered, skipped: already in the ledger)",
    ["channel", "outcome"], registry=None), "notify")
ATTEMPTS = family(Counter("vmstream_notify_attempts_total", "Attempts to deliver, by channel and what came of each",
                          ["channel", "verdict"], registry=None), "notify")
LATENCY = family(Histogram("vmstream_notify_latency_seconds", "From a notification's time to its delivery",
                           ["channel"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
                           registry=None), "notify")


class Failed(Exception):
    """A delivery that did not arrive: ``transient`` is worth another try, ``permanent`` not."""

    def __init__(self, verdict: Verdict, reason: str) -> None:
        super().__init__(reason)
        self.verdict = verdict
        self.reason = reason


class Transport(Protocol):
    """Talks to the outside: one delivery of one notification, or :class:`Failed`."""

    def send(self, target: Target, notification: Notification, context: dict[str, str], *, source: str) -> None: ...

    def idle(self) -> None: ...


# ------------------------------------------------------------------------------ senders


class SmtpSender:
    """E-mail through the configured relay; one connection kept while there is mail to send."""

    def __init__(self, smtp: SmtpSettings) -> None:
        self.smtp = smtp
        self._connection: smtplib.SMTP | None = None

    def _connect(self) -> smtplib.SMTP:
        if self._connection is not None:
            return self._connection
        settings = self.smtp
        if settings.host is None:
            raise Failed("permanent", "no SMTP relay configured (notify.smtp.host)")
        context = ssl.create_default_context(cafile=settings.ssl_cafile) if settings.security != "none" else None
        connection: smtplib.SMTP
        if settings.security == "ssl":
            connection = smtplib.SMTP_SSL(settings.host, settings.port, timeout=settings.timeout_seconds,
                                          context=context)
        else:
            connection = smtplib.SMTP(settings.host, settings.port, timeout=settings.timeout_seconds)
        try:
            connection.ehlo()
            if settings.security == "starttls":
                connection.starttls(context=context)
                connection.ehlo()
            if settings.username:
                password = settings.password.get_secret_value() if settings.password else ""
                connection.login(settings.username, password)
        except BaseException:
            _close_quietly(connection)
            raise
        self._connection = connection
        return connection

    def send(self, address: str, notification: Notification) -> None:
        mail = delivery.render_email(notification)
        message = EmailMessage()
        message["From"] = self.smtp.sender
        message["To"] = address
        message["Subject"] = mail.subject
        message["Message-ID"] = make_msgid(domain="vmstream")
        message["X-Vmstream-Notification-Id"] = notification.notification_id
        message.set_content(mail.body)
        try:
            self._connect().send_message(message, from_addr=self.smtp.sender, to_addrs=[address])
        except smtplib.SMTPRecipientsRefused as exc:
            self.idle()
            code, text = next(iter(exc.recipients.values()), (550, b"refused"))
            raise Failed(delivery.classify_smtp(code), f"SMTP {code} for {address}: {_text(text)}") from exc
        except smtplib.SMTPResponseException as exc:
            self.idle()
            raise Failed(delivery.classify_smtp(exc.smtp_code),
                         f"SMTP {exc.smtp_code}: {_text(exc.smtp_error)}") from exc
        except smtplib.SMTPNotSupportedError as exc:
            self.idle()
            raise Failed("permanent", f"SMTP: {exc}") from exc
        except (smtplib.SMTPException, OSError) as exc:  # disconnected, refused, timed out, TLS
            self.idle()
            raise Failed("transient", f"SMTP {self.smtp.host}:{self.smtp.port}: {type(exc).__name__}: {exc}") from exc

    def idle(self) -> None:
        """Let the connection go (nothing to send for now, or it failed)."""
        if self._connection is not None:
            _close_quietly(self._connection)
            self._connection = None


def _close_quietly(connection: smtplib.SMTP) -> None:
    try:
        connection.quit()
    except (smtplib.SMTPException, OSError):
        connection.close()


def _text(raw: bytes | str) -> str:
    return clip(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw), 512)


def post_json(url: str, body: dict[str, Any], *, content_type: str, headers: dict[str, str],
              timeout: float) -> None:
    """POST ``body``; :class:`Failed` unless the answer is 2xx."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={**headers, "Content-Type": content_type, "User-Agent": "vmstream-notify"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 — configured endpoints only
            response.read()
    except urllib.error.HTTPError as exc:
        text = exc.read(512).decode("utf-8", "replace").strip() if exc.fp is not None else ""
        raise Failed(delivery.classify_http(exc.code), f"HTTP {exc.code} from {_site(url)}"
                     + (f": {clip(text, 256)}" if text else "")) from exc
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        raise Failed("transient", f"{_site(url)}: {type(exc).__name__}: {exc}") from exc


def _site(url: str) -> str:
    """Where a URL points, without its path (an incoming webhook's path is its secret)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class Senders:
    """The real transport: SMTP for addresses, HTTP POST for endpoints."""

    def __init__(self, settings: NotifySettings) -> None:
        self.settings = settings
        self.mail = SmtpSender(settings.smtp)

    def send(self, target: Target, notification: Notification, context: dict[str, str], *, source: str) -> None:
        """``context``: the W3C trace context of this delivery, sent as HTTP headers and, in a
        CloudEvent, as its ``traceparent``/``tracestate`` extension attributes; ``source``: the
        CloudEvents source of the record delivered, a CloudEvent's own."""
        if target.channel == "email":
            self.mail.send(target.recipient, notification)
            return
        endpoint: Endpoint = self.settings.endpoints[target.recipient]
        payload = delivery.PAYLOADS[endpoint.format]
        post_json(endpoint.url, payload.body(notification, source, context), content_type=payload.content_type,
                  headers={**endpoint.headers, **context}, timeout=self.settings.http_timeout_seconds)

    def idle(self) -> None:
        self.mail.idle()


# ------------------------------------------------------------------------------ directory


@dataclass
class Directory:
    """Project members: the configured map first, else an HTTP lookup kept for a while."""

    settings: NotifySettings
    clock: Callable[[], float] = time.monotonic
    _cache: dict[str, tuple[list[str], float]] = field(default_factory=dict)

    def members(self, projects: Sequence[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for project in projects:
            if project in self.settings.directory:
                found[project] = self.settings.directory[project]
            elif self.settings.directory_url:
                looked_up = self._lookup(project)
                if looked_up is not None:
                    found[project] = looked_up
        return found

    def _lookup(self, project: str) -> list[str] | None:
        cached = self._cache.get(project)
        if cached is not None and cached[1] > self.clock():
            return cached[0]
        assert self.settings.directory_url is not None
        url = self.settings.directory_url.replace("{project}", urllib.parse.quote(project, safe=""))
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "application/json"}),  # noqa: S310
                                        timeout=self.settings.http_timeout_seconds) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # no such project: nobody to tell, and that is an answer
                self._cache[project] = ([], self.clock() + self.settings.directory_cache_seconds)
                return []
            log.warning("directory lookup of project %s: HTTP %d", project, exc.code)
            return cached[0] if cached else None
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            log.warning("directory lookup of project %s failed: %s", project, exc)
            return cached[0] if cached else None  # a stale answer beats none
        members = answer.get("members") if isinstance(answer, dict) else answer
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            log.warning("directory lookup of project %s: not a list of principals", project)
            return cached[0] if cached else None
        self._cache[project] = (members, self.clock() + self.settings.directory_cache_seconds)
        return members


# --------------------------------------------------------------------------------- ledger


def ensure_ledger(settings: Settings) -> None:
    """The topics notify reads and writes, the compacted ledger among them (streams/common/topics.py)."""
    ensure_topics(settings.kafka)


class DeliveryLedger:
    """Which deliveries were made (or dead-lettered), read back from the ledger topic."""

    def __init__(self, settings: Settings, *, timeout: float = 60.0) -> None:

        self.topic = settings.kafka.topic(LEDGER)
        self.consumer: Consumer = consumer(settings.kafka, client_id=f"{settings.notify.group_id}-ledger",
                                           group_id=settings.notify.group_id)
        self.partitions = partitions_of(self.consumer, [self.topic], wait=timeout)  # assigned by the first read
        self.done: set[str] = set()

    def catch_up(self, timeout: float = 60.0) -> None:
        for record in read_to_end(self.consumer, self.partitions, stall=timeout):
            if record.key is not None and record.value is not None:
                self.done.add(record.key.decode("utf-8", "replace"))

    def close(self) -> None:
        self.consumer.close()


# ---------------------------------------------------------------------------------- loop


def _now() -> datetime:
    return datetime.now(UTC)


class Notifier:
    """The loop: consume notifications, deliver each where it must go once, commit."""

    def __init__(self, settings: Settings, *, transport: Transport | None = None,
                 clock: Callable[[], datetime] = _now, batch_size: int = 100) -> None:
        self.settings = settings
        self.notify = settings.notify
        self.kafka = settings.kafka
        DEAD_LETTERS.labels(self.kafka.topic(NOTIFICATIONS))  # shown at 0 from the start (the alert's increase())
        self.transport: Transport = transport or Senders(settings.notify)
        self.directory = Directory(settings.notify)
        self.clock = clock
        self.batch_size = batch_size
        self.ready = threading.Event()
        self.buckets: dict[Target, Bucket] = {}  # rate limits: this process's own, lost on restart
        self.event_source = event_source("notify", settings.worker.app_id)  # CloudEvents ``source``
        self.stop = threading.Event()

    def run(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set; ``ready`` once the ledger has been read."""
        self.stop = stop
        ledger = DeliveryLedger(self.settings)
        out = DurableProducer(self.kafka, client_id=self.notify.group_id, timeout=LEDGER_WRITE_SECONDS)
        notifications: GroupReader | None = None
        try:
            ledger.catch_up()
            # The same group member as the applier's (streams/common/group_reading.py): what was
            # handled is committed after each batch, so a partition taken away needs nothing more.
            notifications = GroupReader(
                self.kafka, group_id=self.notify.group_id, client_id=self.notify.group_id,
                topic=self.kafka.topic(NOTIFICATIONS), membership=self.settings.worker.librdkafka_membership(),
            )
            log.info("notify ready: %d deliveries in the ledger", len(ledger.done))
            self.ready.set()
            while not stop.is_set():
                batch = notifications.poll(0.5, max_records=self.batch_size)
                if batch:
                    ledger.catch_up()
                    for records in batch.values():
                        for record in records:
                            self.handle(record, ledger, out)
                            if stop.is_set():
                                break
                    if stop.is_set():
                        break  # offsets of what was not handled stay uncommitted
                    notifications.commit({tp: records[-1].offset + 1 for tp, records in batch.items()}, wait=True)
                else:
                    self.transport.idle()
                notifications.record_lag()
        finally:
            self.transport.idle()
            if notifications is not None:
                notifications.close()
            out.close()
            ledger.close()

    def handle(self, record: Received, ledger: DeliveryLedger, out: DurableProducer) -> None:
        """One notification: every pending delivery made or dead-lettered, each recorded."""
        raw: bytes = record.value or b""
        try:
            notification = Notification.model_validate_json(raw)
        except ValidationError as exc:
            log.warning("malformed notification at %s:%d:%d", record.topic, record.partition, record.offset)
            self._dead_letter(out, record, f"not a notification: {describe_validation_error(exc)}")
            return
        trace = trace_of(record.headers, notification.notification_id)  # passed on (docs/integrators.md)
        with spans.span(f"notify {notification.type}", trace, kind=spans.Kind.CONSUMER,
                        attributes={"vmstream.notification": notification.notification_id}) as span:
            self._handle(record, notification, trace, span.get_span_context() if span is not None else None,
                         ledger, out)

    def _handle(self, record: Received, notification: Notification, trace: Trace, span: Any,
                ledger: DeliveryLedger, out: DurableProducer) -> None:
        source = self._source_of(record)
        members = self.directory.members(delivery.projects_to_expand(notification, self.notify.routes))
        resolution = delivery.targets(notification, directory=members, routes=self.notify.routes,
                                      endpoints=self.notify.endpoints)
        for principal in resolution.unresolved:
            key = f"{notification.notification_id}|none|{principal}"
            if key not in ledger.done:
                self._dead_letter(out, record, f"no address for recipient {principal!r} (not an e-mail address, "
                                  "a configured webhook:<name>, or a project:<id> with members)", recipient=principal,
                                  trace=trace)
                self._record(out, ledger, key, notification, channel="none", recipient=principal,
                             outcome="dead_lettered", attempts=0, trace=trace)
        for target in resolution.targets:
            key = target.key(notification.notification_id)
            if key in ledger.done:
                DELIVERIES.labels(target.channel, "skipped").inc()
                continue
            if self.stop.is_set():
                return
            self._limit(target)
            started = spans.now() if span is not None else 0
            attempts, failure = self._deliver(target, notification, _trace_context(trace, key), source)
            if started:  # the span the receiver's traceparent names (_trace_context)
                spans.record(f"deliver {target.channel}", span, start=started, kind=spans.Kind.CLIENT,
                             own_span=span_id(key), attributes={"vmstream.channel": target.channel,
                                                                "vmstream.attempts": attempts},
                             error=None if failure is None else failure.reason)
            if failure is not None and failure.verdict == "transient" and self.stop.is_set():
                return  # stopping: neither delivered nor given up; the next process tries again
            if failure is None:
                DELIVERIES.labels(target.channel, "delivered").inc()
                latency = delivery.latency_seconds(notification, self.clock())
                if latency is not None:
                    LATENCY.labels(target.channel).observe(latency)
                self._record(out, ledger, key, notification, channel=target.channel, recipient=target.recipient,
                             outcome="delivered", attempts=attempts, trace=trace)
            else:
                DELIVERIES.labels(target.channel, "dead_lettered").inc()
                why = "permanent failure" if failure.verdict == "permanent" else f"still failing after {attempts} attempts"
                log.warning("notification %s to %s %s: %s (%s)", notification.notification_id, target.channel,
                            target.recipient, failure.reason, why)
                self._dead_letter(out, record, f"{target.channel} {target.recipient}: {failure.reason} ({why})",
                                  recipient=target.recipient, channel=target.channel, attempts=attempts, trace=trace)
                self._record(out, ledger, key, notification, channel=target.channel, recipient=target.recipient,
                             outcome="dead_lettered", attempts=attempts, trace=trace)

    def _source_of(self, record: Received) -> str:
        """The CloudEvents source a webhook's event has: the record's own (``ce_source``, the
        process that wrote it: handlers/contracts/events.py), so an event has one identity on Kafka and
        on a webhook; this process's for a record without one in the scheme."""
        written = header_text(record.headers, "ce_source")
        return written if written is not None and source_process(written) is not None else self.event_source

    def _limit(self, target: Target) -> None:
        """Wait for the recipient's token bucket (``notify.rate_limit``)."""
        bucket, wait = delivery.take(self.buckets.get(target), now=time.monotonic(),
                                     rate=self.notify.rate_limit.per_second, burst=self.notify.rate_limit.burst)
        self.buckets[target] = bucket
        if wait > 0:
            log.info("rate limit of %s %s: waiting %.1f s", target.channel, target.recipient, wait)
            self.stop.wait(wait)

    def _deliver(self, target: Target, notification: Notification, context: dict[str, str],
                 source: str) -> tuple[int, Failed | None]:
        """(attempts made, the last failure or None): transient failures retried with backoff;
        ``context`` the delivery's trace context, sent with each attempt; ``source`` the record's."""
        attempts = 0

        def once() -> None:
            nonlocal attempts
            attempts += 1
            try:
                self.transport.send(target, notification, context, source=source)
            except Failed as exc:
                ATTEMPTS.labels(target.channel, exc.verdict).inc()
                raise
            ATTEMPTS.labels(target.channel, "delivered").inc()

        def pause(seconds: float) -> None:
            self.stop.wait(seconds)  # a stop request ends the backoff

        retrying = Retrying(
            retry=retry_if_exception(lambda e: isinstance(e, Failed) and e.verdict == "transient"
                                     and not self.stop.is_set()),
            stop=stop_after_attempt(self.notify.attempts),
            wait=wait_exponential(multiplier=self.notify.backoff_seconds, max=self.notify.backoff_max_seconds),
            sleep=pause,
            reraise=True,
            before_sleep=lambda state: log.info(
                "notification %s to %s %s: %s; trying again (attempt %d)", notification.notification_id,
                target.channel, target.recipient, state.outcome.exception() if state.outcome else None,
                state.attempt_number),
        )
        try:
            retrying(once)
        except Failed as exc:
            return attempts, exc
        return attempts, None

    def _record(self, out: DurableProducer, ledger: DeliveryLedger, key: str, notification: Notification, *,
                channel: str, recipient: str, outcome: str, attempts: int, trace: Trace) -> None:
        """The ledger's record of one delivery, acknowledged before the next one starts: named
        by its key, in the notification's trace."""
        at = self.clock()
        value = {"notification_id": notification.notification_id, "channel": channel, "recipient": recipient,
                 "outcome": outcome, "attempts": attempts, "at": at.isoformat()}
        out.send_all([Record(ledger.topic, key.encode(), json.dumps(value).encode(),
                             self._envelope(key, DELIVERY_TYPE, at, trace))])
        ledger.done.add(key)

    def _dead_letter(self, out: DurableProducer, record: Received, reason: str, *, trace: Trace | None = None,
                     **about: Any) -> None:
        """A dead letter of ``record``: in ``trace`` (a malformed one: derived from where it was
        read); named by where it was read and, one per delivery, the delivery's channel and recipient."""
        raw: bytes = record.value or b""
        try:
            original, encoding = raw.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            import base64

            original, encoding = base64.b64encode(raw).decode(), "base64"
        at = self.clock()
        letter = DeadLetter(error=reason, source=DeadLetterSource(topic=record.topic, partition=record.partition,
                                                                  offset=record.offset),
                            original=clip(original, 16384), encoding=encoding, at=at, **about)
        if trace is None:
            trace = trace_of(record.headers, f"{record.topic}:{record.partition}:{record.offset}")
        id_ = dead_letter_id(letter)
        if "recipient" in about:
            id_ += f"|{about.get('channel', 'none')}|{about['recipient']}"
        out.send_all([Record(self.kafka.topic(DLQ), record.key, letter.model_dump_json(exclude_none=True).encode(),
                             self._envelope(id_, DEAD_LETTER_TYPE, at, trace))])
        DEAD_LETTERS.labels(record.topic).inc()

    def _envelope(self, id_: str, type_: str, at: datetime, trace: Trace) -> list[tuple[str, bytes]]:
        """A record's CloudEvents headers and ``traceparent`` (docs/integrators.md)."""
        return [(name, value.encode("utf-8"))
                for name, value in ce_headers(id_=id_, type_=type_, source=self.event_source, time=at, trace=trace)]


def _trace_context(trace: Trace, own_id: str) -> dict[str, str]:
    """The W3C trace context of one delivery, sent to the receiver: its span derived from its id."""
    context = {TRACEPARENT: trace.child(own_id)}
    if trace.state:
        context[TRACESTATE] = trace.state
    return context


# ---------------------------------------------------------------------------------- CLI


def _run(args: argparse.Namespace) -> int:
    from streams.common.errors import EXIT_OK
    from streams.common.startup import cannot_listen, check_port, check_secrets, load_config, reach_kafka

    logging.getLogger("kafka").setLevel(logging.WARNING)
    settings = load_config(args)
    check_secrets(settings, smtp=True)
    if settings.notify.source is not None:
        log.warning("notify.source is no longer read: a webhook's CloudEvent has the source of the record it "
                    "delivers (docs/notify.md)")
    check_port(args.probe_host, args.probe_port, "--probe-port")
    reach_kafka(settings.kafka)
    ensure_ledger(settings)
    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping after the current delivery", signum)
        stop.set()

    notifier = Notifier(settings)
    try:
        probes = ProbeServer(ready=lambda: notifier.ready.is_set() and not stop.is_set(), host=args.probe_host,
                             port=args.probe_port, process="notify").start()
    except OSError as exc:  # the kubelet probes this port: without it the Pod would be restarted
        raise cannot_listen(args.probe_host, args.probe_port, "--probe-port", exc) from exc
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        notifier.run(stop)
    finally:
        probes.close()
    return EXIT_OK


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``vmstream notify``."""
    from streams.common.startup import add_kafka_arguments

    notify = commands.add_parser(
        "notify", help="deliver notifications by e-mail, webhook (CloudEvents) and chat (docs/notify.md)",
        description="Consume vmstream.notifications and deliver each to its recipients: e-mail over SMTP, "
        "CloudEvents to webhooks, Slack-compatible messages to chat rooms; once per recipient, recorded "
        "in vmstream.deliveries; what cannot be delivered goes to vmstream.dlq with the reason.",
    )
    notify.add_argument("--config", help="the configuration file (YAML), section notify:")
    add_kafka_arguments(notify)
    add_probe_arguments(notify, 6070)
    notify.set_defaults(handler=_run, process=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m streams.serve.notify notify …``, the same as ``vmstream notify …``."""
    from streams.common.dispatch import run_alone

    return run_alone(add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
