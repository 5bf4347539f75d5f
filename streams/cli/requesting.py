"""``vmstream intent …``: a person's or a script's request, checked, published, answered.

CLI arguments → :func:`build_intent` (the pydantic models the worker parses with, so a
request the worker would refuse as malformed never leaves the machine) → :func:`publish_intent`
on the intents topic under its contract key, with the idempotent producer → with ``--wait``,
:class:`OutcomeWatch` reads the audit, notifications and command-results topics from the end
offsets it noted *before* the publish, so however fast the worker and the applier answer,
their records cannot be missed. ``--wait`` (``--wait=applied``) waits for the decision, then
for the result of each command the decision's audit record names; ``--wait=decided`` for the
decision only. Audit records count only when sealed by the worker or an applier, results only
when sealed by an applier, if the signing keys are at hand (``signing`` in the configuration, or
``VMSTREAM_SIGNING__KEYS``; docs/security.md); and an ``unauthenticated`` refusal under the
intent's id counts only when it is this intent's own (a forged copy's is someone else's).

The intent goes out as a CloudEvent in vmstream's one scheme (handlers/contracts/events.py): ``ce_id``
its id, ``ce_type`` ``io.vmstream.intent.<type>``, ``ce_source`` ``/vmstream/cli/<app_id>``
(``worker.app_id`` of the configuration), ``ce_time`` its ``requested_at``, and the
``traceparent`` the worker would derive from its id.

Exit codes (also in ``vmstream intent --help``):

- 0: published; with ``--wait``, accepted and every command applied in Kubernetes (or the
  decision had no command); with ``--wait=decided``, accepted.
- 1: with ``--wait``, decided but not accepted (rejected, duplicate, …): the outcome says why.
- 2: invalid arguments, intent or configuration; nothing was published.
- 3: with ``--wait``, no decision, or not every command's result, before ``--timeout``; the
  intent *was* published.
- 4: Kafka could not be written or read (no broker, no topics).
- 5: with ``--wait``, accepted, but a command failed in Kubernetes (the API server or the
  applier's policy refused it): the result's error says why.
- 130: interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TextIO, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic_settings import SettingsConfigDict

from handlers.contracts import ids
from handlers.contracts.config import AuthPolicy
from handlers.contracts.messages import (
    INTENT_TYPES,
    PLAN_INTENT_TYPES,
    VM_INTENT_TYPES,
    AnyIntent,
    AuditRecord,
    CommandResult,
    Intent,
    Notification,
    Preference,
    RunStrategy,
)
from handlers.contracts.topics import AUDIT, COMMAND_RESULTS, INTENTS, NOTIFICATIONS
from streams.cli.tailing import (
    positive_seconds,
    quiet_kafka_logs,
    render_audit,
    render_command_result,
    render_notification,
)
from handlers.contracts.tracing import derived_trace
from streams.common import errors
from streams.common.cloudevents import event_source, kafka_headers
from streams.common.credentials import SigningKey, environment_key, sign_intent
from streams.common.settings import EnvironmentFirst, KafkaSettings, SigningSettings, WorkerSettings, read_yaml
from streams.common.signing import Keyring, open_sealed

if TYPE_CHECKING:
    from confluent_kafka import Consumer

    from streams.common.reading import Received

log = logging.getLogger(__name__)

OPERATOR_ROLE = AuthPolicy().operator_role

# The exit codes of streams/common/errors.py, under the names of what they mean for an intent.
EXIT_ACCEPTED = errors.EXIT_OK
EXIT_NOT_ACCEPTED = errors.EXIT_FAILURE
EXIT_INVALID = errors.EXIT_USAGE
EXIT_TIMEOUT = errors.EXIT_TIMEOUT
EXIT_KAFKA = errors.EXIT_KAFKA
EXIT_FAILED = errors.EXIT_COMMAND_FAILED
EXIT_INTERRUPTED = errors.EXIT_INTERRUPTED
WAIT_STAGES = ("decided", "applied")
SUCCEEDED = ("applied", "noop", "conflict_retried")  # a result's outcomes that mean it is in Kubernetes

DEFAULT_TIMEOUT = 30.0
POLL_SECONDS = 0.5  # the longest one poll blocks; the deadline is checked between polls

_INTENT: TypeAdapter[AnyIntent] = TypeAdapter(Intent)
_M = TypeVar("_M", AuditRecord, CommandResult, Notification)


class InvalidRequest(ValueError):
    """The arguments do not make a valid intent; ``problems`` name the fields."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class RequestError(RuntimeError):
    """Kafka is not as the request needs it (e.g. the topics do not exist)."""


# ------------------------------------------------------------------ building intents


def field_problems(error: ValidationError) -> list[str]:
    """``spec.cores: Input should be 1, 2, 4, 8, 16 or 32``: one per problem, by field."""
    problems = []
    for item in error.errors(include_url=False):
        loc = list(item["loc"])
        if loc and loc[0] in INTENT_TYPES:  # the union's tag, not a field
            loc = loc[1:]
        problems.append(f"{'.'.join(str(part) for part in loc) or '(intent)'}: {item['msg']}")
    return problems


def _labels(pairs: list[str] | None) -> tuple[dict[str, str], list[str]]:
    labels: dict[str, str] = {}
    problems = []
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            problems.append(f"spec.labels: {pair!r} is not KEY=VALUE")
        else:
            labels[key] = value
    return labels, problems


def intent_data(args: argparse.Namespace, *, now: datetime | None = None) -> tuple[dict[str, Any], list[str]]:
    """The intent as JSON data, from parsed arguments, with optional fields left out when
    unset; and the problems the models cannot see (a label without ``=``)."""
    kind: str = args.intent_type
    problems: list[str] = []
    spec: dict[str, Any]
    if kind in VM_INTENT_TYPES:
        spec = {"namespace": args.namespace, "name": args.name}
    elif kind in PLAN_INTENT_TYPES:
        spec, problems = _plan_spec(kind, args)
    else:
        spec = {"node": args.node}
    if kind == "set_gpu":
        spec["gpu_class"] = None if args.remove else args.gpu_class  # null is the request
    elif kind == "create_vm":
        labels, problems = _labels(args.label)
        spec |= {"cores": args.cores, "memory_gib": args.memory_gib, "image": args.image}
        optional = {"run_strategy": args.run_strategy, "preference": args.preference,
                    "gpu_class": args.gpu_class, "labels": labels or None}
        spec |= {field: value for field, value in optional.items() if value is not None}
    elif kind == "drain_node":
        spec["reason"] = args.reason
        if args.notice_seconds is not None:  # unset: the worker's configured notice
            spec["notice_seconds"] = args.notice_seconds
    elif kind == "undrain_node" and args.reason is not None:
        spec["reason"] = args.reason
    data: dict[str, Any] = {
        "intent_id": str(uuid.uuid4()) if args.intent_id is None else args.intent_id,
        "type": kind,
        "requested_by": args.requested_by,
        "requested_at": (now or datetime.now(UTC)).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "spec": spec,
    }
    if args.project is not None:
        data["project"] = args.project
    return data, problems


def _plan_spec(kind: str, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """A maintenance plan's intent's spec, its optional fields left out when unset; and the
    problems the models cannot see (a selector label without ``=``)."""
    spec: dict[str, Any] = {"plan": args.plan}
    problems: list[str] = []
    if kind == "plan_maintenance":
        selector, problems = _labels(args.selector)
        problems = [problem.replace("spec.labels", "spec.node_selector") for problem in problems]
        spec |= {"earliest_start": args.earliest_start, "latest_end": args.latest_end,
                 "concurrency": args.concurrency, "node_duration_seconds": args.node_duration_seconds,
                 "notice_seconds": args.notice_seconds, "reason": args.reason}
        if args.node:
            spec["nodes"] = args.node
        if args.selector:
            spec["node_selector"] = selector
    elif kind == "reschedule_maintenance":
        optional = {"node": args.node, "namespace": args.namespace, "name": args.name}
        spec |= {field: value for field, value in optional.items() if value is not None}
        spec["start"] = args.start
    elif kind == "maintenance_ready":
        spec |= {"namespace": args.namespace, "name": args.name}
    else:
        spec["reason"] = args.reason
    return spec, problems


def validate_intent(data: dict[str, Any]) -> AnyIntent:
    """The worker's own models: raises :class:`InvalidRequest` naming each bad field."""
    try:
        return _INTENT.validate_python(data)
    except ValidationError as exc:
        raise InvalidRequest(field_problems(exc)) from exc


def build_intent(args: argparse.Namespace, *, now: datetime | None = None) -> AnyIntent:
    """The intent the arguments ask for; :class:`InvalidRequest` lists every problem at once."""
    data, problems = intent_data(args, now=now)
    try:
        intent = validate_intent(data)
    except InvalidRequest as exc:
        problems += exc.problems
    if problems:
        raise InvalidRequest(problems)
    return intent


def intent_key(intent: AnyIntent) -> str:
    """The contract key: the one its type is decided under (``vm/<namespace>/<name>``, ``node/<name>``)."""
    return intent.decision_key()


def sign(intent: AnyIntent, key: SigningKey, *, projects: list[str] | None = None, operator: bool = False,
         issuer: str | None = None, lifetime: float = 300.0) -> AnyIntent:
    """``intent`` with a credential for exactly the bytes :func:`encode_intent` writes
    (docs/auth.md): its subject the requester, its projects ``projects`` (default: the
    intent's project), the operator role if ``operator``."""
    body = json.loads(encode_intent(intent))
    member_of = projects if projects is not None else ([intent.project] if intent.project else [])
    token = sign_intent(body, key, projects=member_of, roles=[OPERATOR_ROLE] if operator else [],
                        issuer=issuer, lifetime=timedelta(seconds=lifetime))
    return intent.model_copy(update={"credential": token})


def encode_intent(intent: AnyIntent) -> bytes:
    """Only what was set: a ``null`` GPU class is kept (it means remove), defaults are not."""
    return intent.model_dump_json(exclude_unset=True).encode()


# --------------------------------------------------------------------------- Kafka


@dataclass(frozen=True, slots=True)
class Published:
    topic: str
    key: str
    partition: int
    offset: int

    @property
    def source_ref(self) -> str:
        """The audit ``ref`` the worker gives a message it could not parse (dead-lettered)."""
        return f"{self.topic}:{self.partition}:{self.offset}"


@dataclass(frozen=True, slots=True)
class Outcome:
    audit: AuditRecord
    notifications: list[Notification]
    missing: list[str]  # notification ids the audit lists but the deadline came first


DEFAULT_SOURCE = event_source("cli", WorkerSettings().app_id)


def intent_headers(intent: AnyIntent, *, source: str = DEFAULT_SOURCE) -> list[tuple[str, bytes]]:
    """The intent's CloudEvents headers (binary mode) in vmstream's scheme, and the
    ``traceparent`` the worker derives from its id (so its outputs carry the same trace)."""
    time = intent.requested_at or datetime.now(UTC)
    return list(kafka_headers(intent, source=source, trace=derived_trace(intent.intent_id), time=time).items())


def publish_intent(kafka: KafkaSettings, intent: AnyIntent, *, timeout: float,
                   source: str = DEFAULT_SOURCE) -> Published:
    """Send one intent, with its CloudEvents headers, and wait for the broker's acknowledgement
    (acks=all, idempotent)."""
    from streams.common.durable import DurableProducer, Record

    topic, key = kafka.topic(INTENTS), intent_key(intent)
    client = DurableProducer(kafka, client_id="vmstream-cli", timeout=timeout)
    try:
        [metadata] = client.send_all([Record(topic, key.encode(), encode_intent(intent),
                                             intent_headers(intent, source=source))])
    finally:
        client.close()
    log.debug("published %s to %s[%d]@%d", intent.intent_id, topic, metadata.partition, metadata.offset)
    return Published(topic, key, metadata.partition, metadata.offset)


class OutcomeWatch:
    """The audit and notifications topics, read from their end offsets as of construction.

    Construct it before publishing: the worker's answer is then at or after those offsets,
    however soon it comes. No consumer group, no commits: watching changes nothing.
    """

    def __init__(self, kafka: KafkaSettings, *, timeout: float | None = None, results: bool = False,
                 keyring: Keyring | None = None) -> None:
        from confluent_kafka import TopicPartition

        from streams.common.kafka_clients import consumer
        from streams.common.reading import partitions_of, watermarks

        self.audit_topic = kafka.topic(AUDIT)
        self.notifications_topic = kafka.topic(NOTIFICATIONS)
        self.results_topic = kafka.topic(COMMAND_RESULTS)
        self.keyring = keyring
        self.ignored = 0  # audit records under the intent's id that were not sealed
        self._results: dict[str, CommandResult] = {}
        # read_committed: the worker writes in transactions; an aborted decision never happened.
        self._client: Consumer = consumer(kafka, client_id="vmstream-cli")
        try:
            partitions = []
            # A topic created a moment ago may not be in every broker's metadata yet: look again
            # for a while before calling it missing.
            settle = min(timeout if timeout is not None else 10.0, 10.0)
            for topic in (self.audit_topic, self.notifications_topic, *([self.results_topic] if results else [])):
                found = partitions_of(self._client, [topic], wait=settle, missing_ok=True)
                if not found:
                    raise RequestError(f"no topic {topic!r} on {kafka.bootstrap_servers} "
                                       "(create them with `vmstream topics create`)")
                partitions += found
            marks = watermarks(self._client, partitions, timeout=settle)
            self._client.assign([TopicPartition(tp.topic, tp.partition, end) for tp, (_, end) in marks.items()])
        except BaseException:
            self._client.close()
            raise
        self._notifications: dict[str, Notification] = {}

    def __enter__(self) -> OutcomeWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def wait(self, refs: Collection[str], deadline: float, *, own: Collection[str] = ()) -> Outcome | None:
        """The first audit record whose ``input.ref`` is one of ``refs``, with its notifications.

        Only a record sealed by the worker or an applier counts, when the keys are at hand; and
        an ``unauthenticated`` one only when its id is in ``own`` (the audit id the refusal of
        the intent sent would have): anyone may publish an unsigned copy under a real intent's
        id, and its refusal is not this intent's decision. ``deadline`` is a
        ``time.monotonic()`` value. None if no such record came by then; notifications still
        unseen at the deadline are listed in ``missing``.
        """
        audit: AuditRecord | None = None
        while True:
            if audit is not None and all(n in self._notifications for n in audit.notifications):
                return self._outcome(audit)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None if audit is None else self._outcome(audit)
            for record in self._poll(min(remaining, POLL_SECONDS)):
                if record.topic == self.audit_topic:
                    found = self._take_audit(record.value, refs)
                    if audit is None and found is not None and self._decides(found, own):
                        audit = found
                elif record.topic == self.results_topic:
                    self._take_result(record.value)
                else:
                    notification = _read(Notification, record.value)
                    if notification is not None:
                        self._notifications[notification.notification_id] = notification

    def wait_results(self, command_ids: Collection[str], deadline: float) -> dict[str, CommandResult]:
        """The first result of each of ``command_ids`` seen by ``deadline`` (all of them, if
        they came in time). Reading goes on from where :meth:`wait` stopped."""
        while not all(c in self._results for c in command_ids):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for record in self._poll(min(remaining, POLL_SECONDS)):
                if record.topic == self.results_topic:
                    self._take_result(record.value)
        return {c: self._results[c] for c in command_ids if c in self._results}

    def _poll(self, timeout: float) -> list[Received]:
        from streams.common.reading import poll_records

        return poll_records(self._client, timeout)

    def _take_audit(self, raw: bytes | None, refs: Collection[str]) -> AuditRecord | None:
        """An audit record about one of ``refs`` that counts: sealed by the worker or an applier,
        if the keys are at hand (an unsealed one is ignored, and said so)."""
        if raw is None:
            return None
        if not self.keyring:
            found = _read(AuditRecord, raw)
            return found if found is not None and found.input.ref in refs else None
        found, problem = open_sealed(AuditRecord, raw, "audit", self.keyring)
        if found is None or found.input.ref not in refs:
            return None
        if problem is not None:
            self.ignored += 1
            log.warning("an audit record for %s is not sealed by the worker or an applier (%s): ignored",
                        found.input.ref[:80], problem)
            return None
        return found

    @staticmethod
    def _decides(audit: AuditRecord, own: Collection[str]) -> bool:
        """Whether ``audit`` is the intent's decision: any but an ``unauthenticated`` refusal of
        another copy of its id."""
        if audit.outcome == "unauthenticated" and audit.audit_id not in own:
            log.warning("a copy of intent %s was refused for who asks (%s): not this one, still waiting",
                        audit.input.ref[:80], audit.audit_id)
            return False
        return True

    def _take_result(self, raw: bytes | None) -> None:
        """A result counts when an applier sealed it (if the keys are at hand), and never one
        refusing an unsealed command: anyone could publish that under a real command's id."""
        if raw is None:
            return
        if self.keyring:
            result, problem = open_sealed(CommandResult, raw, "command-result", self.keyring)
            if result is not None and problem is not None:
                log.warning("a result for command %s is not sealed by an applier (%s): ignored",
                            result.command_id[:80], problem)
                return
        else:
            result = _read(CommandResult, raw)
        if result is None or (result.model_extra or {}).get("refused") == "unauthenticated":
            return
        self._results.setdefault(result.command_id, result)

    def _outcome(self, audit: AuditRecord) -> Outcome:
        seen = [self._notifications[n] for n in audit.notifications if n in self._notifications]
        missing = [n for n in audit.notifications if n not in self._notifications]
        return Outcome(audit, seen, missing)


def _read(model: type[_M], raw: bytes | None) -> _M | None:
    """A message of another producer's making may be anything: skip what is not ours to read."""
    if raw is None:
        return None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        log.debug("skipping an unreadable %s: %s", model.__name__, exc)
        return None


# ----------------------------------------------------------------------------- CLI


def request(
    kafka: KafkaSettings,
    intent: AnyIntent,
    *,
    wait: str | bool | None,
    timeout: float,
    out: TextIO,
    err: TextIO,
    keyring: Keyring | None = None,
    source: str = DEFAULT_SOURCE,
) -> int:
    """Publish ``intent``; with ``wait`` (``"decided"``, or ``"applied"``/True: also the
    commands' results), print its outcome. Returns the exit code."""
    deadline = time.monotonic() + timeout
    stage = "applied" if wait is True else (wait or None)
    if stage is None:
        published = publish_intent(kafka, intent, timeout=timeout, source=source)
        _print_published(intent, published, out)
        return EXIT_ACCEPTED
    # Before publishing: the answers cannot be missed.
    with OutcomeWatch(kafka, timeout=timeout, results=stage == "applied", keyring=keyring) as watch:
        published = publish_intent(kafka, intent, timeout=max(0.001, deadline - time.monotonic()), source=source)
        _print_published(intent, published, out)
        outcome = watch.wait({intent.intent_id, published.source_ref}, deadline,
                             own={own_refusal_id(published.topic, intent)})
        if outcome is None:
            print(
                f"vmstream intent: no decision on {intent.intent_id} within {timeout:g}s. It was published "
                f"({published.topic}[{published.partition}]@{published.offset}) and may still be decided: "
                f"is a worker running? Watch with `vmstream tail audit --follow`.",
                file=err,
            )
            return EXIT_TIMEOUT
        _print_outcome(outcome, out, err)
        if outcome.audit.outcome != "accepted":
            return EXIT_NOT_ACCEPTED
        if stage == "decided" or not outcome.audit.commands:
            return EXIT_ACCEPTED
        results = watch.wait_results(outcome.audit.commands, deadline)
    for command_id in outcome.audit.commands:
        if command_id in results:
            print(f"  result {render_command_result(results[command_id])}", file=out)
    out.flush()
    missing = [c for c in outcome.audit.commands if c not in results]
    if missing:
        print(f"vmstream intent: {intent.intent_id} was accepted, but no result for command(s) "
              f"{', '.join(missing)} within {timeout:g}s: is an applier running? Watch with "
              "`vmstream tail command-results --follow`.", file=err)
        return EXIT_TIMEOUT
    failed = [r for r in results.values() if r.outcome not in SUCCEEDED]
    if failed:
        print(f"vmstream intent: {intent.intent_id} was accepted, but {len(failed)} of {len(results)} "
              "command(s) failed in Kubernetes", file=err)
        return EXIT_FAILED
    return EXIT_ACCEPTED


def own_refusal_id(topic: str, intent: AnyIntent) -> str:
    """The audit id the worker gives ``intent``, as sent, if it refuses it for who asks
    (handlers/contracts/ids.py ``unauthenticated_ref``): another copy's refusal has another."""
    ref = ids.unauthenticated_ref(topic, intent.intent_id, json.loads(encode_intent(intent)))
    return ids.audit_id(topic, ref, "unauthenticated")


def _print_published(intent: AnyIntent, published: Published, out: TextIO) -> None:
    print(f"published {intent.type} {intent.intent_id} to {published.topic} under {published.key} "
          f"(partition {published.partition}, offset {published.offset})", file=out, flush=True)


def _print_outcome(outcome: Outcome, out: TextIO, err: TextIO) -> None:
    print(render_audit(outcome.audit), file=out)
    for command_id in outcome.audit.commands:
        print(f"  command {command_id}", file=out)
    for notification in outcome.notifications:
        print(f"  {render_notification(notification)}", file=out)
    for notification_id in outcome.missing:
        print(f"vmstream intent: notification {notification_id} not seen before the deadline", file=err)
    out.flush()


def check_gpu_class(intent: AnyIntent, config: str | None) -> None:
    """With a configuration that has a GPU catalog, an intent naming a class outside it is
    refused before it is published (the worker would reject it): a :class:`ConfigError`."""
    from streams.common.errors import ConfigError
    from streams.common.startup import config_problem

    wanted = getattr(getattr(intent, "spec", None), "gpu_class", None)
    if not wanted or not config:
        return
    try:
        catalog = read_yaml(config).get("gpu_classes")
    except (OSError, ValueError) as exc:
        raise config_problem(config, exc) from exc
    if isinstance(catalog, dict) and catalog and wanted.lower() not in {str(name).lower() for name in catalog}:
        raise ConfigError(f"invalid {intent.type} intent, nothing published: GPU class {wanted!r} is not in "
                          f"the catalog of {config}", f"use one of {', '.join(sorted(map(str, catalog)))}")


def _run(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException

    from streams.common.durable import NotDelivered

    from streams.common.startup import load_kafka_config, reach_kafka

    quiet_kafka_logs(args)
    try:
        intent = build_intent(args)
    except InvalidRequest as exc:
        print(f"vmstream intent: invalid {args.intent_type} intent, nothing published:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_INVALID
    kafka = load_kafka_config(args)  # a ConfigError: exit 2 (EXIT_INVALID)
    check_gpu_class(intent, args.config)
    try:
        if args.key and not args.kid:
            raise ValueError("--key needs --kid, the key's id in the worker's JWKS")
        key = SigningKey.from_file(args.kid, args.key) if args.key else environment_key()
    except (OSError, ValueError, TypeError) as exc:
        print(f"vmstream intent: signing key: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if key is not None:
        intent = sign(intent, key, projects=args.member_of, operator=args.operator, issuer=args.issuer,
                      lifetime=args.lifetime)
    else:
        print("vmstream intent: no --key: the intent goes unsigned (accepted only by a worker with "
              "auth: none)", file=sys.stderr)
    reach_kafka(kafka)  # within KAFKA_PROBE_SECONDS, else exit 4 (EXIT_KAFKA)
    try:
        side = cli_settings(args.config, err=sys.stderr)
        return request(kafka, intent, wait=args.wait, timeout=args.timeout, out=sys.stdout, err=sys.stderr,
                       keyring=side.keyring if args.wait else None, source=side.source)
    except RequestError as exc:
        print(f"vmstream intent: {exc}", file=sys.stderr)
        return EXIT_KAFKA
    except (KafkaException, NotDelivered) as exc:
        print(f"vmstream intent: Kafka at {kafka.bootstrap_servers}: {exc!r}", file=sys.stderr)
        return EXIT_KAFKA
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


EXIT_CODES = (
    "exit codes: 0 published (with --wait: accepted and every command applied, or no command; "
    "with --wait=decided: accepted); 1 decided but not accepted (rejected, duplicate, …); 2 invalid "
    "arguments or intent, nothing published; 3 no decision, or not every command's result, within "
    "--timeout (the intent was published); 4 Kafka unreachable or topics missing; 5 accepted, but "
    "a command failed in Kubernetes"
)


class _AppOnly(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    app_id: str = WorkerSettings().app_id


class IntentSide(EnvironmentFirst):
    """The file as ``vmstream intent`` sees it beyond ``kafka``: the signing keys (which audit
    records and results count) and the deployment's ``worker.app_id`` (its CloudEvents source)."""

    model_config = SettingsConfigDict(env_prefix="VMSTREAM_", env_nested_delimiter="__", frozen=True,
                                      extra="ignore")

    signing: SigningSettings = SigningSettings()
    worker: _AppOnly = _AppOnly()


@dataclass(frozen=True, slots=True)
class CliSide:
    keyring: Keyring | None  # None: no keys at hand, every record counts as the topic holds it
    source: str  # the CloudEvents source of the intents it sends


def cli_settings(config: str | None, *, err: TextIO) -> CliSide:
    """The keys audit records and results are sealed with (``signing`` of the configuration file
    and ``VMSTREAM_SIGNING__*``), to count only the worker's and an applier's, and the source
    of the intents it sends (``/vmstream/cli/<worker.app_id>``)."""
    source = DEFAULT_SOURCE
    try:
        side = IntentSide(**{k: v for k, v in read_yaml(config).items() if k in ("signing", "worker")})
        source = event_source("cli", side.worker.app_id)
        keyring = side.signing.keyring()
    except (OSError, ValueError) as exc:
        print(f"vmstream intent: the signing keys cannot be read ({exc}): audit records and results are "
              "taken as their topics hold them (only the worker and the applier may write them: "
              "docs/security.md)", file=err)
        return CliSide(None, source)
    return CliSide(keyring or None, source)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``vmstream intent`` and its one subcommand per intent type."""
    from streams.common.startup import add_kafka_arguments

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--by", dest="requested_by", required=True, metavar="PRINCIPAL",
                        help="who asks (e.g. alice@example.com); notifications go to them")
    common.add_argument("--project", help="the project that owns the VM (required for VM intents)")
    common.add_argument("--id", dest="intent_id", metavar="ID",
                        help="the intent id (default: a new UUID); the same id twice has one effect")
    common.add_argument("--config", help="the configuration file (YAML); with a gpu_classes catalog, "
                        "--gpu-class is checked against it")
    add_kafka_arguments(common)
    signing = common.add_argument_group(
        "credential", "sign the intent as an upstream service does (docs/auth.md); default from "
        "VMSTREAM_INTENT_KEY and VMSTREAM_INTENT_KID")
    signing.add_argument("--key", metavar="PEM", help="the signer's private key (Ed25519, EC P-256 or RSA)")
    signing.add_argument("--kid", help="the key's id in the worker's JWKS (required with --key)")
    signing.add_argument("--member-of", action="append", metavar="PROJECT",
                         help="a project the requester belongs to (default: --project); repeatable")
    signing.add_argument("--operator", action="store_true", help="vouch that the requester is an operator")
    signing.add_argument("--issuer", help="the iss claim, if the worker checks issuers")
    signing.add_argument("--lifetime", type=positive_seconds, default=300.0, metavar="SECONDS",
                         help="how long the credential is valid (default 300)")
    common.add_argument("--wait", nargs="?", const="applied", choices=WAIT_STAGES, metavar="applied|decided",
                        help="wait for the decision and print it; then (applied, the default) for the "
                        "result of each of its commands in Kubernetes")
    common.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"give up publishing and waiting after SECONDS (default {DEFAULT_TIMEOUT:g})")

    intent = commands.add_parser(
        "intent", help="publish a validated intent (optionally wait for its decision)",
        description="Publish one intent to the intents topic, after checking it against the "
        "contract's models.", epilog=EXIT_CODES,
    )
    kinds = intent.add_subparsers(dest="intent_command", required=True, metavar="TYPE")

    def kind(name: str, intent_type: str, help_text: str) -> argparse.ArgumentParser:
        parser = kinds.add_parser(name, parents=[common], help=help_text, description=help_text,
                                  epilog=EXIT_CODES)
        parser.set_defaults(handler=_run, intent_type=intent_type)
        return parser

    def vm(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--namespace", required=True, help="the VM's namespace")
        parser.add_argument("--name", required=True, help="the VM's name")

    set_gpu = kind("set-gpu", "set_gpu", "give a VM a GPU of a class, or remove its GPU")
    vm(set_gpu)
    gpu = set_gpu.add_mutually_exclusive_group(required=True)
    gpu.add_argument("--gpu-class", metavar="CLASS", help="the GPU class id (see the configuration)")
    gpu.add_argument("--remove", action="store_true", help="remove the VM's GPU")

    create = kind("create-vm", "create_vm", "create a VM")
    vm(create)
    create.add_argument("--cores", type=int, required=True, help="1, 2, 4, 8, 16 or 32")
    create.add_argument("--memory-gib", type=int, required=True, help="1, 2, 4, 8, 16, 32 or 64")
    create.add_argument("--image", required=True, help="the container disk image")
    create.add_argument("--run-strategy", help=f"{' | '.join(get_args(RunStrategy))} (default Manual)")
    create.add_argument("--preference", help=f"{' | '.join(get_args(Preference))} (default linux)")
    create.add_argument("--gpu-class", metavar="CLASS", help="a GPU class id (default: no GPU)")
    create.add_argument("--label", action="append", metavar="KEY=VALUE", help="a label; repeatable")

    restart = kind("restart", "restart_vm", "restart a VM (applies a pending GPU change)")
    vm(restart)

    drain = kind("drain", "drain_node", "drain a node (operators only): GPU VMs are stopped after notice")
    drain.add_argument("--node", required=True, help="the node's name")
    drain.add_argument("--reason", required=True, help="why, told to the VMs' owners")
    drain.add_argument("--notice-seconds", type=int, metavar="SECONDS",
                       help="notice before GPU VMs are stopped (default: the configured notice)")

    undrain = kind("undrain", "undrain_node", "end a node's drain (operators only)")
    undrain.add_argument("--node", required=True, help="the node's name")
    undrain.add_argument("--reason", help="why (optional)")

    def plan(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--plan", required=True, help="the plan's id (a DNS-1123 label)")

    planned = kind("plan-maintenance", "plan_maintenance",
                   "plan the maintenance of GPU nodes (operators only): owners are told ahead")
    plan(planned)
    which = planned.add_mutually_exclusive_group(required=True)
    which.add_argument("--node", action="append", metavar="NODE", help="a node to maintain; repeatable")
    which.add_argument("--selector", action="append", metavar="KEY=VALUE",
                       help="a label the nodes to maintain carry; repeatable")
    planned.add_argument("--earliest-start", required=True, metavar="TIME", help="RFC 3339, with a zone")
    planned.add_argument("--latest-end", required=True, metavar="TIME", help="RFC 3339, with a zone")
    planned.add_argument("--concurrency", type=int, default=1, help="nodes in maintenance at once (default 1)")
    planned.add_argument("--node-duration-seconds", type=int, required=True, metavar="SECONDS",
                         help="the time each node needs")
    planned.add_argument("--notice-seconds", type=int, required=True, metavar="SECONDS",
                         help="owners are told at least this long before their VM stops")
    planned.add_argument("--reason", required=True, help="why, told to the VMs' owners")

    moved = kind("reschedule-maintenance", "reschedule_maintenance",
                 "another slot for a planned node (operators) or a VM's stop (its project)")
    plan(moved)
    moved.add_argument("--node", help="the planned node to move")
    moved.add_argument("--namespace", help="with --name: the VM whose stop moves")
    moved.add_argument("--name", help="the VM's name")
    moved.add_argument("--start", required=True, metavar="TIME", help="the new time, RFC 3339 with a zone")

    ready = kind("maintenance-ready", "maintenance_ready", "a planned maintenance may stop this VM now")
    plan(ready)
    vm(ready)

    cancel = kind("cancel-maintenance", "cancel_maintenance", "call a maintenance plan off (operators only)")
    plan(cancel)
    cancel.add_argument("--reason", required=True, help="why, told to the VMs' owners")
