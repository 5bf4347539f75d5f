"""``vmstream tail <topic>``: read one topic the way a person (or ``jq``) wants to.

topic → consumer (read_committed, no group: tailing never moves anyone's offsets) →
:func:`render` → one line per message. :func:`render` is pure, so what people read is
tested without Kafka, and it never raises: a message it cannot read is shown as such,
which is exactly when somebody is tailing.

Without ``--follow`` the command stops at the end offsets it saw when it started, so it
terminates even on a busy topic. ``--json`` prints the ``simulate`` input format
(``{"topic", "key", "value", "timestamp"}``), so a tailed stream can be replayed offline.

Exit codes: 0 done (or ``--follow`` reached ``--timeout``); 2 bad arguments or
configuration; 3 the end offsets were not reached before ``--timeout``; 4 Kafka could not
be read (no broker, no such topic); 130 interrupted.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TextIO

from pydantic import ValidationError

from handlers.contracts.messages import (
    AuditRecord,
    Command,
    CommandResult,
    CreateVMIntent,
    DeadLetter,
    DrainNodeIntent,
    IntentBase,
    InvalidIntent,
    MalformedMessage,
    Notification,
    ObjectRef,
    SetGPUIntent,
    UndrainNodeIntent,
    WatchEvent,
    decode_json_object,
    describe_validation_error,
    parse_intent,
)
from handlers.contracts.topics import AUDIT, COMMAND_RESULTS, COMMANDS, DLQ, INTENTS, K8S_EVENTS, NOTIFICATIONS, TOPICS
from streams.common import errors
from streams.common.settings import KafkaSettings

if TYPE_CHECKING:
    from confluent_kafka import Consumer, TopicPartition

    from streams.common.reading import Received

log = logging.getLogger(__name__)

# The public topics of handlers/contracts/topics.py, by the logical name ``vmstream tail`` accepts.
LOGICAL_TOPICS = tuple(topic.name for topic in TOPICS if not topic.internal)

EXIT_OK = errors.EXIT_OK  # the exit codes of streams/common/errors.py
EXIT_CONFIG = errors.EXIT_USAGE
EXIT_TIMEOUT = errors.EXIT_TIMEOUT
EXIT_KAFKA = errors.EXIT_KAFKA
EXIT_INTERRUPTED = errors.EXIT_INTERRUPTED

DEFAULT_LAST = 10
DEFAULT_TIMEOUT = 30.0  # without --follow: how long reaching the end offsets may take
POLL_SECONDS = 0.5  # the longest one poll blocks; the deadline is checked between polls
EXCERPT = 160
ERROR_EXCERPT = 4096  # handlers/contracts/messages.py bounds free text to this


# ------------------------------------------------------------------------- rendering


def _excerpt(text: str, limit: int = EXCERPT) -> str:
    """One line, bounded: a tail must stay readable whatever a producer wrote."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _clock(at: datetime, *, seconds: bool = False) -> str:
    """``10:15Z``: UTC, to the minute unless the seconds matter."""
    at = at.astimezone(UTC)
    return at.strftime("%H:%M:%SZ" if seconds or at.second else "%H:%MZ")


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _where(ref: ObjectRef) -> str:
    return f"{ref.namespace}/{ref.name}" if ref.namespace else ref.name


def render_notification(notification: Notification) -> str:
    """``[warning] → alice@example.com: <message> (deadline 10:15Z)``."""
    recipients = ", ".join(notification.recipients) or "(nobody)"
    line = f"[{notification.severity}] → {recipients}: {notification.message}"
    if notification.deadline is not None:
        line += f" (deadline {_clock(notification.deadline)})"
    return line


def render_audit(record: AuditRecord) -> str:
    """``accepted it-1 (vmstream.intents vm/ns/name): 1 command, 1 notification``."""
    source = " ".join(part for part in (record.input.topic, record.input.key) if part)
    line = (
        f"{record.outcome} {record.input.ref} ({source}): "
        f"{_plural(len(record.commands), 'command')}, {_plural(len(record.notifications), 'notification')}"
    )
    if record.reason:
        line += f" — {record.reason}"
    return line


def render_command(command: Command) -> str:
    """``patch_vm VirtualMachine ns/name ← it-1 [command id]``."""
    return f"{command.type} {command.target.kind} {_where(command.target)} ← {command.cause} [{command.command_id}]"


def render_command_result(result: CommandResult) -> str:
    """``applied patch_vm VirtualMachine ns/name [command id] rv 42``, or the error."""
    parts: list[str] = [result.outcome]
    if result.type is not None:
        parts.append(result.type)
    if result.target is not None:
        parts += [result.target.kind, _where(result.target)]
    parts.append(f"[{result.command_id}]")
    if result.resource_version:
        parts.append(f"rv {result.resource_version}")
    line = " ".join(parts)
    if result.error:  # whole (the contract bounds it): an API server's reason is the point
        line += f": {_excerpt(result.error, ERROR_EXCERPT)}"
    return line


def render_dead_letter(letter: DeadLetter) -> str:
    """Where the message came from, why it was refused, and what it was."""
    source = letter.source.topic
    if letter.source.partition is not None:
        source += f"[{letter.source.partition}]"
    if letter.source.offset is not None:
        source += f"@{letter.source.offset}"
    original = letter.original if letter.encoding == "utf-8" else f"(base64) {letter.original}"
    return f"dead letter from {source}: {_excerpt(letter.error)} | original: {_excerpt(original, 100)}"


def _intent_target(intent: Any) -> str:
    return intent.decision_key() if isinstance(intent, IntentBase) else "?"


def _intent_details(intent: Any) -> str:
    if isinstance(intent, SetGPUIntent):
        gpu = intent.spec.gpu_class
        return f"gpu_class={gpu}" if gpu is not None else "gpu_class=null (remove the GPU)"
    if isinstance(intent, CreateVMIntent):
        spec = intent.spec
        details = f"{_plural(spec.cores, 'core')}, {spec.memory_gib} GiB, {spec.run_strategy}, {spec.preference}, image={spec.image}"
        return details + (f", gpu_class={spec.gpu_class}" if spec.gpu_class else "")
    if isinstance(intent, DrainNodeIntent):
        notice = "default notice" if intent.spec.notice_seconds is None else f"notice {intent.spec.notice_seconds}s"
        return f"{intent.spec.reason!r}, {notice}"
    if isinstance(intent, UndrainNodeIntent) and intent.spec.reason:
        return repr(intent.spec.reason)
    return ""


def render_intent(raw: bytes) -> str:
    """``set_gpu it-1 by alice (proj-a): vm/ns/name gpu_class=…``; invalid ones say why."""
    try:
        intent = parse_intent(raw)
    except InvalidIntent as exc:
        envelope = exc.envelope
        return f"invalid {envelope.type} {envelope.intent_id} by {envelope.requested_by}: {_excerpt(exc.reason)}"
    except MalformedMessage as exc:
        return f"malformed intent: {_excerpt(str(exc))} | {_excerpt(_text(raw), 100)}"
    by = f"by {intent.requested_by}" + (f" ({intent.project})" if intent.project else "")
    details = _intent_details(intent)
    return f"{intent.type} {intent.intent_id} {by}: {_intent_target(intent)}" + (f" {details}" if details else "")


def render_watch_event(event: WatchEvent) -> str:
    """``MODIFIED VirtualMachine ns/name rv 7 Running at 10:00:01Z (ev-1)``."""
    metadata = event.object.get("metadata", {})
    namespace, name = metadata.get("namespace"), metadata["name"]
    parts = [event.type, event.kind, f"{namespace}/{name}" if namespace else name]
    if metadata.get("resourceVersion"):
        parts.append(f"rv {metadata['resourceVersion']}")
    status = event.object.get("status") or {}
    spec = event.object.get("spec") or {}
    if isinstance(status, dict) and isinstance(spec, dict):
        state = status.get("printableStatus") or status.get("phase")
        if state:
            parts.append(str(state))
        if status.get("nodeName"):
            parts.append(f"on {status['nodeName']}")
        if event.kind == "Node" and spec.get("unschedulable"):
            parts.append("cordoned")
    parts.append(f"at {_clock(event.observed_at, seconds=True)} ({event.event_id})")
    return " ".join(parts)


def _model_renderer(model: type[Any], show: Callable[[Any], str]) -> Callable[[bytes], str]:
    def renderer(raw: bytes) -> str:
        return show(model.model_validate(decode_json_object(raw)))

    return renderer


_RENDERERS: dict[str, Callable[[bytes], str]] = {
    NOTIFICATIONS.name: _model_renderer(NOTIFICATIONS.value, render_notification),
    AUDIT.name: _model_renderer(AUDIT.value, render_audit),
    COMMANDS.name: _model_renderer(COMMANDS.value, render_command),
    COMMAND_RESULTS.name: _model_renderer(COMMAND_RESULTS.value, render_command_result),
    DLQ.name: _model_renderer(DLQ.value, render_dead_letter),
    K8S_EVENTS.name: _model_renderer(K8S_EVENTS.value, render_watch_event),
    INTENTS.name: render_intent,  # its own: a rejected intent is shown with why
}


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def render(topic_logical_name: str | None, value_bytes: bytes | None) -> str:
    """One readable line for a message of a topic (logical name); never raises."""
    if value_bytes is None:
        return "(tombstone: no value)"
    renderer = _RENDERERS.get(topic_logical_name or "")
    if renderer is None:
        return _excerpt(_text(value_bytes), 400)
    try:
        return renderer(value_bytes)
    except MalformedMessage as exc:
        problem = str(exc)
    except ValidationError as exc:
        problem = describe_validation_error(exc)
    return f"(unreadable {topic_logical_name}: {_excerpt(problem, 200)}) {_excerpt(_text(value_bytes), 100)}"


def json_line(topic: str, key: bytes | None, value: bytes | None, timestamp_ms: int | None) -> str:
    """The ``simulate`` input format: a JSON value as itself, anything else as a string."""
    decoded: Any = None
    if value is not None:
        try:
            decoded = json.loads(value)
        except (UnicodeDecodeError, json.JSONDecodeError):
            try:
                decoded = value.decode("utf-8")
            except UnicodeDecodeError:
                decoded = base64.b64encode(value).decode("ascii")
    line: dict[str, Any] = {"topic": topic, "key": key.decode("utf-8", "replace") if key is not None else None,
                            "value": decoded}
    if timestamp_ms is not None and timestamp_ms >= 0:
        at = datetime.fromtimestamp(timestamp_ms / 1000, UTC)
        line["timestamp"] = at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False)


def resolve_topic(kafka: KafkaSettings, name: str) -> tuple[str, str | None]:
    """(full name, logical name or None) for a logical or full topic name."""
    if name in LOGICAL_TOPICS:
        return kafka.topic(name), name
    for logical in LOGICAL_TOPICS:
        if name == kafka.topic(logical) or name.endswith("." + logical):
            return name, logical
    return name, None


# ------------------------------------------------------------------------- settings


# ---------------------------------------------------------------------------- reading


class TailError(RuntimeError):
    """There is no such topic (a broker that does not answer raises Kafka's own errors)."""


def _open(kafka: KafkaSettings, topic: str) -> tuple[Consumer, list[TopicPartition]]:
    from streams.common.kafka_clients import consumer
    from streams.common.reading import partitions_of

    # No group and no commits: tailing is read-only. read_committed: the worker writes
    # in transactions, and an aborted write never happened.
    client = consumer(kafka, client_id="vmstream-tail")
    partitions = partitions_of(client, [topic], wait=0, missing_ok=True)
    if not partitions:
        client.close()
        raise TailError(f"no topic {topic!r} on {kafka.bootstrap_servers} (create them with `vmstream topics create`)")
    return client, partitions


class Tail:
    """One tail of one topic: where it starts, where it stops, how it prints."""

    def __init__(self, topic: str, logical: str | None, out: TextIO, *, as_json: bool) -> None:
        self.topic = topic
        self.logical = logical
        self.out = out
        self.as_json = as_json

    def line(self, record: Received) -> str:
        if self.as_json:
            return json_line(record.topic, record.key, record.value, record.timestamp)
        return render(self.logical, record.value)

    def emit(self, records: Iterable[Received]) -> None:
        for record in records:
            print(self.line(record), file=self.out, flush=True)

    def run(
        self,
        kafka: KafkaSettings,
        *,
        from_beginning: bool,
        last: int,
        follow: bool,
        timeout: float | None,
    ) -> int:
        from confluent_kafka import TopicPartition

        from streams.common.reading import watermarks

        deadline = None if timeout is None else time.monotonic() + timeout
        client, partitions = _open(kafka, self.topic)
        try:
            marks = watermarks(client, partitions, timeout=timeout or POLL_SECONDS * 10)
            end = {tp: high for tp, (_, high) in marks.items()}
            start = {tp: low if from_beginning else max(low, high - last) for tp, (low, high) in marks.items()}
            client.assign([TopicPartition(tp.topic, tp.partition, start[tp]) for tp in partitions])
            at = dict(start)  # each partition's next offset to read
            # What was there at start: in order as read with --from-beginning, else the last
            # ``last`` across partitions by time (a partition's tail alone means little).
            backlog: list[Received] = []
            later: list[Received] = []  # arrived meanwhile; printed after the backlog
            while not all(at[tp] >= end[tp] for tp in partitions):
                if deadline is not None and time.monotonic() >= deadline:
                    self._flush_backlog(backlog, last)
                    if follow:
                        self.emit(later)
                        return EXIT_OK
                    print(f"vmstream tail: the end of {self.topic} was not reached within {timeout:g}s",
                          file=sys.stderr)
                    return EXIT_TIMEOUT
                reached: dict[TopicPartition, int] = {}
                for record in self._poll(client, deadline, reached):
                    tp = TopicPartition(record.topic, record.partition)
                    at[tp] = max(at[tp], record.offset + 1)
                    if record.offset >= end[tp] and not follow:
                        continue  # newer than the start: not ours to print
                    if from_beginning:
                        self.emit([record])
                    elif record.offset < end[tp]:
                        backlog.append(record)
                    else:
                        later.append(record)
                for tp, offset in reached.items():
                    at[tp] = max(at[tp], offset)
                if not follow:  # the rest is newer than the start: not fetched at all
                    client.pause([tp for tp in partitions if at[tp] >= end[tp]])
            self._flush_backlog(backlog, last)
            self.emit(later)
            while follow and (deadline is None or time.monotonic() < deadline):
                self.emit(self._poll(client, deadline, {}))
            return EXIT_OK
        finally:
            client.close()

    def _flush_backlog(self, backlog: list[Received], last: int) -> None:
        """The newest ``last`` messages across partitions, oldest first."""
        backlog.sort(key=lambda r: (r.timestamp, r.partition, r.offset))
        self.emit(backlog[-last:] if last else [])
        backlog.clear()

    @staticmethod
    def _poll(client: Consumer, deadline: float | None, reached: dict[TopicPartition, int]) -> list[Received]:
        from streams.common.reading import poll_records

        wait = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
        return poll_records(client, wait, ends=reached)


# -------------------------------------------------------------------------------- CLI


def quiet_kafka_logs(args: argparse.Namespace) -> None:
    """The Kafka client narrates every connection and retry: noise on a person's terminal, where
    the command's own message says what failed (``-v`` shows it all)."""
    if not getattr(args, "verbose", False):
        logging.getLogger("kafka").setLevel(logging.CRITICAL)


def _tail(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException

    from streams.common.startup import load_kafka_config, reach_kafka

    quiet_kafka_logs(args)
    kafka = load_kafka_config(args)  # a ConfigError: exit 2 (EXIT_CONFIG)
    reach_kafka(kafka)  # within KAFKA_PROBE_SECONDS, else exit 4 (EXIT_KAFKA)
    topic, logical = resolve_topic(kafka, args.topic)
    timeout = args.timeout if args.timeout is not None else (None if args.follow else DEFAULT_TIMEOUT)
    tail = Tail(topic, logical, sys.stdout, as_json=args.json)
    try:
        return tail.run(kafka, from_beginning=args.from_beginning, last=args.last,
                        follow=args.follow, timeout=timeout)
    except TailError as exc:
        print(f"vmstream tail: {exc}", file=sys.stderr)
        return EXIT_KAFKA
    except KafkaException as exc:
        print(f"vmstream tail: cannot read {topic} from {kafka.bootstrap_servers}: {exc!r}",
              file=sys.stderr)
        return EXIT_KAFKA
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: seconds, more than zero (``tail`` and ``intent`` share it)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return value


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``vmstream tail``."""
    from streams.common.startup import add_kafka_arguments

    tail = commands.add_parser(
        "tail",
        help="print a topic's messages, one readable line each",
        description="Print a topic's messages, one readable line each. Without --follow, stop at the "
        "end offsets seen at start.",
        epilog="exit codes: 0 done; 2 bad arguments or configuration; 3 the end was not reached within --timeout; 4 Kafka unreadable; "
        "130 interrupted",
    )
    tail.add_argument("topic", help=f"a logical name ({', '.join(LOGICAL_TOPICS)}) or a full topic name")
    start = tail.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true", help="start at the oldest message kept")
    start.add_argument("-n", "--last", type=_non_negative, default=DEFAULT_LAST,
                       help=f"start with the last N messages, by time (default {DEFAULT_LAST})")
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing new messages")
    tail.add_argument("--timeout", type=positive_seconds, default=None, metavar="SECONDS",
                      help=f"give up after SECONDS (default: {DEFAULT_TIMEOUT:g} without --follow, "
                      "none with it)")
    tail.add_argument("--json", action="store_true",
                      help="print JSON Lines {topic, key, value, timestamp} (the simulate input format)")
    tail.add_argument("--config", help="the configuration file (YAML)")
    add_kafka_arguments(tail)
    tail.set_defaults(handler=_tail)
