"""Who a notification reaches, over what, in which words: handlers/contracts/delivery.py, no I/O."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from handlers.contracts.delivery import (
    Bucket,
    Endpoint,
    Route,
    Target,
    classify_http,
    classify_smtp,
    cloud_event,
    is_email,
    pending,
    projects_to_expand,
    render_email,
    slack_payload,
    take,
    targets,
)
from handlers.contracts.events import notification_type
from handlers.contracts.messages import Notification, ObjectRef
from handlers.contracts.tracing import derived_trace, message_headers

AT = datetime(2026, 11, 30, 6, 30, tzinfo=UTC)
DEADLINE = datetime(2026, 11, 30, 6, 45, 58, tzinfo=UTC)
ENDPOINTS = {"oncall": Endpoint(url="https://pager.example/hook"),
             "proj-a-room": Endpoint(url="https://chat.example/hooks/xyz", format="slack")}


def drain_notice(*recipients: str, severity: str = "warning", type_: str = "drain_will_stop_gpu_vm") -> Notification:
    return Notification(
        notification_id="ntf-6793d4", type=type_, recipients=list(recipients), project="proj-a",
        subject=ObjectRef(kind="VirtualMachine", namespace="spx-proj-a", name="batch-1"), severity=severity,
        message="Node gpu-node-1 is being drained (firmware upgrade): GPU VM spx-proj-a/batch-1 will be stopped "
                "at 2026-11-30 06:45:58 UTC, and it will stay off until it is started again (run strategy Manual).",
        details={"outcome": "needs_manual_start"}, deadline=DEADLINE, at=AT,
    )


def test_an_address_is_an_address_and_other_principals_are_not() -> None:
    assert is_email("alice@example.com")
    assert is_email("Alice.Smith+gpu@mail.example.co.uk")
    for principal in ("alice", "project:proj-a", "webhook:oncall", "alice@localhost", "a b@example.com",
                      "alice@example..com", "<alice@example.com>"):
        assert not is_email(principal), principal


def test_an_owner_by_address_gets_one_mail() -> None:
    resolved = targets(drain_notice("alice@example.com"), directory={}, endpoints=ENDPOINTS)
    assert resolved.targets == (Target("email", "alice@example.com"),)
    assert resolved.unresolved == ()


def test_a_project_is_expanded_to_its_members_each_once() -> None:
    notice = drain_notice("project:proj-a", "carol@example.com")
    assert projects_to_expand(notice) == ["proj-a"]
    resolved = targets(notice, endpoints=ENDPOINTS, directory={
        "proj-a": ["alice@example.com", "Carol@example.com", "webhook:proj-a-room", "project:proj-b"]})
    assert resolved.targets == (Target("email", "alice@example.com"), Target("email", "carol@example.com"),
                                Target("webhook", "proj-a-room"))
    # A project inside a project is not followed: nobody is told through it.
    assert resolved.unresolved == ("project:proj-b",)


def test_what_cannot_reach_anyone_is_unresolved() -> None:
    resolved = targets(drain_notice("project:unknown", "bob", "webhook:nowhere"), directory={}, endpoints=ENDPOINTS)
    assert resolved.targets == ()
    assert resolved.unresolved == ("project:unknown", "bob", "webhook:nowhere")
    empty = targets(drain_notice("project:proj-c"), directory={"proj-c": []}, endpoints=ENDPOINTS)
    assert empty.unresolved == ("project:proj-c",)


def test_routes_add_recipients_by_severity_and_type() -> None:
    routes = [Route(severity=["critical"], to=["webhook:oncall"]),
              Route(types=["drain_will_stop_gpu_vm"], severity=["warning"], to=["project:ops"])]
    directory = {"ops": ["ops@example.com"]}
    critical = drain_notice("alice@example.com", severity="critical", type_="command_failed")
    assert targets(critical, directory=directory, routes=routes, endpoints=ENDPOINTS).targets == (
        Target("email", "alice@example.com"), Target("webhook", "oncall"))
    warning = drain_notice("alice@example.com")
    assert projects_to_expand(warning, routes) == ["ops"]
    assert targets(warning, directory=directory, routes=routes, endpoints=ENDPOINTS).targets == (
        Target("email", "alice@example.com"), Target("email", "ops@example.com"))
    info = drain_notice("alice@example.com", severity="info", type_="gpu_change_pending_restart")
    assert targets(info, directory=directory, routes=routes, endpoints=ENDPOINTS).targets == (
        Target("email", "alice@example.com"),)


def test_the_ledger_leaves_out_what_was_delivered() -> None:
    wanted = [Target("email", "alice@example.com"), Target("webhook", "oncall")]
    done = {"ntf-6793d4|email|alice@example.com", "ntf-other|webhook|oncall"}
    assert pending("ntf-6793d4", wanted, done) == [Target("webhook", "oncall")]
    assert Target("webhook", "oncall").key("ntf-1") == "ntf-1|webhook|oncall"


def test_the_mail_says_what_happens_when_and_to_what() -> None:
    mail = render_email(drain_notice("alice@example.com"))
    assert mail.subject == "[vmstream warning] VirtualMachine spx-proj-a/batch-1: will be stopped for a node drain"
    assert mail.body.startswith("Node gpu-node-1 is being drained (firmware upgrade)")
    assert "When: 2026-11-30 06:45:58 UTC" in mail.body
    assert "Project: proj-a" in mail.body
    assert "Notification: ntf-6793d4" in mail.body


def test_a_webhook_gets_a_structured_cloud_event_named_by_the_notification() -> None:
    notice = drain_notice("alice@example.com")
    event = cloud_event(notice, source="/vmstream/worker/vmstream")
    assert {k: v for k, v in event.items() if k != "data"} == {
        "specversion": "1.0", "id": "ntf-6793d4", "source": "/vmstream/worker/vmstream",
        "type": "io.vmstream.notification.drain_will_stop_gpu_vm",
        "subject": "VirtualMachine/spx-proj-a/batch-1", "datacontenttype": "application/json",
        "time": "2026-11-30T06:30:00Z",
    }
    assert Notification.model_validate(event["data"]) == notice


def test_a_webhook_event_is_the_kafka_record_s_event_whatever_carries_it() -> None:
    """One identity: the CloudEvent a webhook gets has the type, id, source and time of the
    ``ce_*`` headers the worker wrote on the notification's Kafka record."""
    notice = drain_notice("alice@example.com").model_copy(update={"at": datetime(2026, 11, 30, 6, 30, 0, 250_000,
                                                                                 tzinfo=UTC)})
    source = "/vmstream/worker/vmstream-az1"
    kafka = dict(message_headers(notice, source=source, time=AT, trace=derived_trace("it-1")))
    event = cloud_event(notice, source=source)
    assert (event["specversion"], event["id"], event["type"], event["source"], event["time"]) == (
        kafka["ce_specversion"], kafka["ce_id"], kafka["ce_type"], kafka["ce_source"], kafka["ce_time"])
    assert event["type"] == notification_type("drain_will_stop_gpu_vm")


def test_a_chat_room_gets_a_slack_message() -> None:
    payload = slack_payload(drain_notice("alice@example.com", severity="critical"))
    assert payload["text"].startswith(":rotating_light: Node gpu-node-1 is being drained")
    section, context = payload["blocks"]
    assert section == {"type": "section", "text": {"type": "mrkdwn", "text": payload["text"]}}
    assert context["elements"][0]["text"] == ("*critical* · `drain_will_stop_gpu_vm` · VirtualMachine "
                                              "spx-proj-a/batch-1 · project proj-a · at 2026-11-30 06:45:58 UTC")


@pytest.mark.parametrize(("status", "verdict"), [
    (200, "delivered"), (202, "delivered"), (204, "delivered"), (301, "permanent"), (400, "permanent"),
    (401, "permanent"), (404, "permanent"), (410, "permanent"), (408, "transient"), (429, "transient"),
    (500, "transient"), (502, "transient"), (503, "transient"),
])
def test_http_answers_are_delivered_transient_or_final(status: int, verdict: str) -> None:
    assert classify_http(status) == verdict


@pytest.mark.parametrize(("code", "verdict"), [
    (250, "delivered"), (421, "transient"), (450, "transient"), (452, "transient"), (550, "permanent"),
    (553, "permanent"), (554, "permanent"),
])
def test_smtp_4xx_is_tried_again_and_5xx_is_final(code: int, verdict: str) -> None:
    assert classify_smtp(code) == verdict


def test_a_token_bucket_lets_a_burst_through_then_the_rate() -> None:
    bucket: Bucket | None = None
    waits = []
    for _ in range(4):
        bucket, wait = take(bucket, now=100.0, rate=0.5, burst=3)
        waits.append(wait)
    assert waits == [0.0, 0.0, 0.0, 2.0]  # the fourth waits for a token earned at 0.5/s
    assert bucket is not None
    bucket, wait = take(bucket, now=110.0, rate=0.5, burst=3)  # refilled, never above the burst
    assert wait == 0.0 and bucket.tokens == 2.0
