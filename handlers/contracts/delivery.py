"""Delivering notifications to people: who gets one, over what, in which words — as data.

    Notification → :func:`targets` (recipients resolved, routes added) → :func:`pending`
    (the ledger's deliveries left out) → :func:`render_email` / :func:`cloud_event` /
    :func:`slack_payload` → the shell sends (streams/serve/notify.py) → :func:`classify_http` /
    :func:`classify_smtp` → delivered, retried, or dead-lettered

A recipient is a principal: an e-mail address is an address; ``project:<id>`` stands for the
project's members, from a directory the shell looks up; ``webhook:<name>`` is an endpoint of
the configuration (a generic webhook receiving CloudEvents, or a chat room's incoming
webhook receiving Slack-compatible payloads). Routes add targets by severity and type
(``critical`` also to the on-call webhook). No I/O and no clock here: the shell passes the
directory, the ledger's keys and the time in.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, NamedTuple

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from handlers.contracts.events import notification_type
from handlers.contracts.messages import Notification, NotificationType, Severity
from handlers.contracts.tracing import SPEC_VERSION, ce_time

Channel = Literal["email", "webhook"]
Verdict = Literal["delivered", "transient", "permanent"]

PROJECT_PREFIX = "project:"
WEBHOOK_PREFIX = "webhook:"
# Good enough to tell an address from a principal of another kind; the SMTP server decides.
EMAIL = re.compile(r"^[^@\s<>\"]+@[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)+$")
SEVERITY_MARK = {"info": ":information_source:", "warning": ":warning:", "critical": ":rotating_light:"}


class DeliveryRecord(BaseModel):
    """The value of one record of ``vmstream notify``'s ledger (handlers/contracts/topics.py ``DELIVERIES``),
    as streams/serve/notify.py writes it."""

    model_config = ConfigDict(frozen=True)

    notification_id: str = Field(min_length=1, description="The notification delivered")
    channel: Channel | Literal["none"] = Field(
        description="How it went out; `none` for a recipient without an address (dead-lettered, 0 attempts)")
    recipient: str = Field(min_length=1, description="An e-mail address, or a configured webhook's name")
    outcome: Literal["delivered", "dead_lettered"] = Field(
        description="delivered, or given up and set aside on the dead-letter topic; either way never tried again")
    attempts: int = Field(ge=0, description="Attempts made")
    at: AwareDatetime = Field(description="When it was recorded")


class Endpoint(BaseModel):
    """A webhook of the configuration, named by ``webhook:<name>`` principals and routes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(min_length=1, description="Where to POST (http or https).")
    format: str = Field("cloudevent", description="cloudevent: a structured-mode CloudEvent 1.0 (JSON); "
                        "slack: a Slack-compatible incoming-webhook payload (Mattermost, Rocket.Chat too).",
                        json_schema_extra=lambda schema: schema.update(enum=list(PAYLOADS)))
    headers: dict[str, str] = Field(default_factory=dict, description="Extra request headers (e.g. a token).")

    @field_validator("format")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in PAYLOADS:
            raise ValueError(f"unknown format {value!r}; expected one of {', '.join(PAYLOADS)}")
        return value


class Route(BaseModel):
    """Send matching notifications to more recipients as well. A route without ``severity``
    or ``types`` matches every severity or type."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    severity: list[Severity] = Field(default_factory=list)
    types: list[NotificationType] = Field(default_factory=list)
    to: list[str] = Field(min_length=1, description="Principals: addresses, project:<id>, webhook:<name>.")

    def matches(self, notification: Notification) -> bool:
        return ((not self.severity or notification.severity in self.severity)
                and (not self.types or notification.type in self.types))


@dataclass(frozen=True, slots=True, order=True)
class Target:
    """One delivery: a channel and who on it (an address, or an endpoint's name)."""

    channel: Channel
    recipient: str

    def key(self, notification_id: str) -> str:
        """The ledger's key of this delivery of that notification."""
        return f"{notification_id}|{self.channel}|{self.recipient}"


@dataclass(frozen=True, slots=True)
class Resolution:
    targets: tuple[Target, ...]
    unresolved: tuple[str, ...]  # principals with no address: said in a dead letter


def is_email(principal: str) -> bool:
    return len(principal) <= 254 and EMAIL.match(principal) is not None


def projects_to_expand(notification: Notification, routes: Sequence[Route] = ()) -> list[str]:
    """The project ids whose members the shell must look up for this notification."""
    principals = [*notification.recipients, *(p for r in routes if r.matches(notification) for p in r.to)]
    return sorted({p[len(PROJECT_PREFIX):] for p in principals if p.startswith(PROJECT_PREFIX)})


def targets(
    notification: Notification,
    *,
    directory: Mapping[str, Sequence[str]],
    routes: Sequence[Route] = (),
    endpoints: Mapping[str, Endpoint],
) -> Resolution:
    """Every delivery ``notification`` needs, each once, in a stable order (e-mail first).

    ``directory`` maps a project id to its members (principals; a member may itself be a
    ``webhook:<name>``, e.g. a project's chat room; ``project:`` inside a project is not
    followed). A ``project:<id>`` the directory does not know, a ``webhook:`` that is not
    configured and a principal that is neither are *unresolved*: nobody can be told by it.
    """
    principals = [*notification.recipients, *(p for r in routes if r.matches(notification) for p in r.to)]
    found: set[Target] = set()
    unresolved: list[str] = []

    def one(principal: str, *, expand: bool) -> None:
        if is_email(principal):
            found.add(Target("email", principal.lower()))
        elif principal.startswith(WEBHOOK_PREFIX) and principal[len(WEBHOOK_PREFIX):] in endpoints:
            found.add(Target("webhook", principal[len(WEBHOOK_PREFIX):]))
        elif expand and principal.startswith(PROJECT_PREFIX) and principal[len(PROJECT_PREFIX):] in directory:
            members = directory[principal[len(PROJECT_PREFIX):]]
            if not members:
                unresolved.append(principal)
            for member in members:
                one(member, expand=False)
        elif principal not in unresolved:
            unresolved.append(principal)

    for principal in principals:
        one(principal, expand=True)
    return Resolution(tuple(sorted(found)), tuple(unresolved))


def pending(notification_id: str, wanted: Iterable[Target], done: Iterable[str] | set[str]) -> list[Target]:
    """The targets not yet delivered (nor dead-lettered) according to the ledger's keys."""
    seen = done if isinstance(done, set) else set(done)
    return [target for target in wanted if target.key(notification_id) not in seen]


# ------------------------------------------------------------------------------ rendering


@dataclass(frozen=True, slots=True)
class Email:
    subject: str
    body: str


SUBJECTS: dict[str, str] = {
    "drain_will_stop_gpu_vm": "will be stopped for a node drain",
    "gpu_change_pending_restart": "GPU change waits for a restart",
    "gpu_unavailable": "waits for a free GPU",
    "intent_rejected": "request refused",
    "drain_completed": "drain completed",
    "command_failed": "change failed",
    "drain_called_off": "drain called off",
    "gpu_rules_applied": "GPU rules applied",
    "gpu_memory_not_pinned": "GPU memory not pinned",
    "maintenance_planned": "will be stopped for a planned maintenance",
    "maintenance_changed": "planned maintenance changed",
    "maintenance_cancelled": "planned maintenance cancelled",
    "maintenance_progress": "planned maintenance",
}


def subject_name(notification: Notification) -> str:
    ref = notification.subject
    return f"{ref.namespace}/{ref.name}" if ref.namespace else ref.name


def render_email(notification: Notification) -> Email:
    """A plain-text mail a person reads: the sentence, then when and what it is about."""
    what = SUBJECTS.get(notification.type, notification.type.replace("_", " "))
    subject = f"[vmstream {notification.severity}] {notification.subject.kind} {subject_name(notification)}: {what}"
    lines = [notification.message, ""]
    if notification.deadline is not None:
        lines.append(f"When: {notification.deadline.strftime('%Y-%m-%d %H:%M:%S %Z').strip()}")
    lines.append(f"About: {notification.subject.kind} {subject_name(notification)}")
    if notification.project:
        lines.append(f"Project: {notification.project}")
    lines += [f"Severity: {notification.severity}", f"Type: {notification.type}",
              f"Notification: {notification.notification_id}"]
    return Email(subject=subject[:998], body="\n".join(lines) + "\n")


def cloud_event(notification: Notification, *, source: str, time: datetime | None = None) -> dict[str, Any]:
    """The notification as a CloudEvent 1.0 in structured mode (``application/cloudevents+json``),
    the same event as the Kafka record that carried it (handlers/contracts/events.py): its ``id`` the
    notification's, its ``type`` ``io.vmstream.notification.<type>``, its ``source`` the
    record's (the process that wrote it), its ``time`` the notification's (``time``, the
    record's, when it names none). A receiver drops repeats by ``id`` and ``source``."""
    event: dict[str, Any] = {
        "specversion": SPEC_VERSION,
        "id": notification.notification_id,
        "source": source,
        "type": notification_type(notification.type),
        "subject": f"{notification.subject.kind}/{subject_name(notification)}",
        "datacontenttype": "application/json",
        "data": notification.model_dump(mode="json", exclude_none=True),
    }
    moment = notification.at or time
    if moment is not None:
        event["time"] = ce_time(moment)
    return event


def slack_payload(notification: Notification) -> dict[str, Any]:
    """A Slack-compatible incoming-webhook message: ``text`` for notifications and clients
    without blocks, the same in ``blocks`` with its context."""
    mark = SEVERITY_MARK[notification.severity]
    text = f"{mark} {notification.message}"
    context = [f"*{notification.severity}*", f"`{notification.type}`",
               f"{notification.subject.kind} {subject_name(notification)}"]
    if notification.project:
        context.append(f"project {notification.project}")
    if notification.deadline is not None:
        context.append(f"at {notification.deadline.strftime('%Y-%m-%d %H:%M:%S UTC')}")
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": text}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": " · ".join(context)}]},
        ],
    }


class Payload(NamedTuple):
    """What an endpoint of one format is sent: the request's content type and its body, made of
    the notification, the CloudEvents source of the record that carried it and the delivery's
    W3C trace context (sent as HTTP headers as well)."""

    content_type: str
    body: Callable[[Notification, str, dict[str, str]], dict[str, Any]]


def _cloud_event_body(notification: Notification, source: str, context: dict[str, str]) -> dict[str, Any]:
    return {**cloud_event(notification, source=source), **context}  # the trace as extension attributes


def _slack_body(notification: Notification, source: str, context: dict[str, str]) -> dict[str, Any]:
    return slack_payload(notification)


# Each webhook format (``Endpoint.format``) by what its endpoints are sent: vmstream notify posts
# what the entry makes, and nothing else tells the formats apart (docs/howto.md, "A notification sink").
PAYLOADS: dict[str, Payload] = {
    "cloudevent": Payload("application/cloudevents+json; charset=utf-8", _cloud_event_body),
    "slack": Payload("application/json", _slack_body),
}


# ---------------------------------------------------------------------------- outcomes


def classify_http(status: int) -> Verdict:
    """2xx delivered; 408, 425, 429 and 5xx worth another try; any other answer is final."""
    if 200 <= status < 300:
        return "delivered"
    if status in (408, 425, 429) or status >= 500:
        return "transient"
    return "permanent"


def classify_smtp(code: int) -> Verdict:
    """SMTP replies: 4xx is a temporary failure (try again), 5xx a permanent one."""
    if 200 <= code < 400:
        return "delivered"
    return "transient" if 400 <= code < 500 else "permanent"


# ----------------------------------------------------------------------------- rate limits


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket's state: ``tokens`` left at ``at`` (seconds on any monotonic clock)."""

    tokens: float
    at: float


def take(bucket: Bucket | None, *, now: float, rate: float, burst: int) -> tuple[Bucket, float]:
    """Take one token: the bucket after it, and how long to wait before sending (0: now).

    A bucket starts full (``burst`` tokens) and refills at ``rate`` tokens per second; a
    token taken while the bucket is empty is borrowed, and the wait says when it is earned.
    """
    if bucket is None:
        bucket = Bucket(float(burst), now)
    tokens = min(float(burst), bucket.tokens + max(0.0, now - bucket.at) * rate) - 1.0
    wait = 0.0 if tokens >= 0 else -tokens / rate
    return Bucket(tokens, now), wait


def latency_seconds(notification: Notification, delivered_at: datetime) -> float | None:
    """From the notification's time to its delivery, when it carries one."""
    if notification.at is None:
        return None
    return max(0.0, (delivered_at - notification.at).total_seconds())
