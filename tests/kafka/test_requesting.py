"""``vmstream intent`` and ``vmstream tail`` on a real broker.

Publishing puts exactly one keyed, schema-valid intent on the topic; ``--wait`` reports the
decision written *after* the publish (never an older record for the same id) with its
notifications; no decision in time is exit 3. The worker is played by a test stand-in that
answers as soon as it sees the intent, so the race ``--wait`` must win is real.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from handlers.contracts.messages import AuditInput, AuditRecord, Notification, ObjectRef, SetGPUIntent, parse_intent
from handlers.contracts.tracing import derived_trace
from streams.cli import requesting
from streams.cli import tailing
from streams.common.cloudevents import trace_of
from streams.common.codecs import encode_message
from streams.common.settings import KafkaSettings
from streams.common.topics import ensure_topics
from tests.support.kafka_io import Received, Record, TopicReader, publish
from tests.support.kafka_broker import delete_topics

pytestmark = pytest.mark.kafka

DEADLINE = 30.0
SET_GPU = ["set-gpu", "--by", "bob@example.com", "--project", "proj-b",
           "--namespace", "spx-proj-b", "--name", "dev-1", "--gpu-class", "nvidia-a100"]


@pytest.fixture
def kafka(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[KafkaSettings]:
    """This test's own topics; the CLI finds them through the environment, as in a shell."""
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:8]}.")
    created = ensure_topics(settings)
    monkeypatch.setenv("VMSTREAM_KAFKA__BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    monkeypatch.setenv("VMSTREAM_KAFKA__TOPIC_PREFIX", settings.topic_prefix)
    yield settings
    delete_topics(settings, created)


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="vmstream")
    commands = parser.add_subparsers(dest="command", required=True)
    requesting.add_parser(commands)
    tailing.add_parser(commands)
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


def read_all(kafka: KafkaSettings, logical: str) -> list[Received]:
    """Every record of a topic up to its current end, polled with a deadline."""
    reader = TopicReader(kafka, [kafka.topic(logical)])
    try:
        return reader.read_to_end(stall=DEADLINE)
    finally:
        reader.close()


def produce(kafka: KafkaSettings, logical: str, key: str, value: bytes) -> None:
    publish(kafka, [Record(kafka.topic(logical), key.encode(), value)], timeout=DEADLINE)


def audit_for(kafka: KafkaSettings, ref: str, key: str, outcome: str, *, reason: str | None = None,
              commands: list[str] | None = None, notifications: list[str] | None = None) -> AuditRecord:
    return AuditRecord(
        audit_id=f"audit-{uuid.uuid4().hex[:8]}", at=datetime.now(UTC),
        input=AuditInput(topic=kafka.topic("intents"), key=key, ref=ref), outcome=outcome, reason=reason,
        commands=commands or [], notifications=notifications or [],
    )


class WorkerStandIn(threading.Thread):
    """Test stand-in for the worker: as soon as an intent is on the topic, it writes a
    decision for it — the audit record first, its notification after, as fast as it can."""

    def __init__(self, kafka: KafkaSettings, *, outcome: str, reason: str | None = None) -> None:
        super().__init__(name="worker-stand-in", daemon=True)
        self.kafka = kafka
        self.outcome = outcome
        self.reason = reason
        self.intent: Received | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()  # subscribed: whatever is published next is seen

    def run(self) -> None:
        try:
            self.intent = self._first_intent()
            key, ref = (self.intent.key or b"").decode(), json.loads(self.intent.value or b"")["intent_id"]
            notification = Notification(
                notification_id=f"n-{ref}", type="gpu_change_pending_restart", recipients=["bob@example.com"],
                subject=ObjectRef(kind="VirtualMachine", namespace="spx-proj-b", name="dev-1"), severity="info",
                message="VM spx-proj-b/dev-1 will have GPU nvidia-a100 after its next restart.",
            )
            commands = [f"c-{ref}"] if self.outcome == "accepted" else []
            audit = audit_for(self.kafka, ref, key, self.outcome, reason=self.reason, commands=commands,
                              notifications=[notification.notification_id])
            produce(self.kafka, "audit", key, encode_message(audit))
            produce(self.kafka, "notifications", key, encode_message(notification))
        except BaseException as error:  # handed to the test thread by result()
            self.error = error
        finally:
            self.ready.set()

    def _first_intent(self) -> Received:
        topic = self.kafka.topic("intents")
        reader = TopicReader(self.kafka, [topic])
        try:
            self.ready.set()
            deadline = time.monotonic() + DEADLINE
            while time.monotonic() < deadline:
                for record in reader.poll(0.2):
                    return record
            raise AssertionError(f"no intent on {topic} within {DEADLINE}s")
        finally:
            reader.close()

    def result(self) -> Received:
        self.join(DEADLINE)
        if self.error is not None:
            raise self.error
        assert self.intent is not None
        return self.intent


def test_publishing_puts_one_keyed_valid_intent_on_the_topic(
    kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("intent", *SET_GPU, "--id", "it-one") == requesting.EXIT_ACCEPTED

    [record] = read_all(kafka, "intents")
    assert record.key == b"vm/spx-proj-b/dev-1"
    intent = parse_intent(record.value)  # the worker's own parser
    assert isinstance(intent, SetGPUIntent)
    assert intent.intent_id == "it-one" and intent.spec.gpu_class == "nvidia-a100"
    assert capsys.readouterr().out.startswith(
        f"published set_gpu it-one to {kafka.topic('intents')} under vm/spx-proj-b/dev-1"
    )


def test_an_intent_goes_out_as_a_cloudevent_in_vmstream_s_scheme(
    kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`vmstream intent` names what it sends as every vmstream record is named
    (handlers/contracts/events.py): its id, io.vmstream.intent.<type>, /vmstream/cli/<app_id>, its time,
    and the trace the worker would derive from its id."""
    monkeypatch.setenv("VMSTREAM_WORKER__APP_ID", "vmstream-az1")
    assert cli("intent", *SET_GPU, "--id", "it-ce") == requesting.EXIT_ACCEPTED

    [record] = read_all(kafka, "intents")
    headers = {name: value.decode() for name, value in record.headers}
    intent = parse_intent(record.value)
    assert isinstance(intent, SetGPUIntent) and intent.requested_at is not None
    assert headers == {
        "ce_specversion": "1.0", "ce_id": "it-ce", "ce_type": "io.vmstream.intent.set_gpu",
        "ce_source": "/vmstream/cli/vmstream-az1", "ce_time": intent.requested_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "content-type": "application/json", "traceparent": derived_trace("it-ce").child("it-ce"),
    }
    assert trace_of(record.headers, "it-ce") == derived_trace("it-ce")  # the worker's outputs: the same trace


@pytest.mark.parametrize(
    ("outcome", "reason", "code"),
    [
        ("accepted", None, requesting.EXIT_ACCEPTED),
        ("rejected", "VM spx-proj-b/dev-1 does not exist", requesting.EXIT_NOT_ACCEPTED),
        ("duplicate", "intent was already decided", requesting.EXIT_NOT_ACCEPTED),
    ],
)
def test_wait_reports_the_decision_written_after_the_publish(
    kafka: KafkaSettings, capsys: pytest.CaptureFixture[str], outcome: str, reason: str | None, code: int
) -> None:
    intent_id = f"it-{uuid.uuid4().hex[:8]}"
    # An older decision on the same id (a previous publish): it must not be taken for this one.
    stale = audit_for(kafka, intent_id, "vm/spx-proj-b/dev-1", "failed", reason="an older decision")
    produce(kafka, "audit", "vm/spx-proj-b/dev-1", encode_message(stale))
    stand_in = WorkerStandIn(kafka, outcome=outcome, reason=reason)
    stand_in.start()
    assert stand_in.ready.wait(DEADLINE)

    assert cli("intent", *SET_GPU, "--id", intent_id, "--wait=decided", "--timeout", str(DEADLINE)) == code

    assert json.loads(stand_in.result().value or b"")["intent_id"] == intent_id
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"{outcome} {intent_id} ({kafka.topic('intents')} vm/spx-proj-b/dev-1): ")
    assert "an older decision" not in "\n".join(out)
    assert out[-1] == (
        "  [info] → bob@example.com: VM spx-proj-b/dev-1 will have GPU nvidia-a100 after its next restart."
    )
    if outcome == "accepted":
        assert f"  command c-{intent_id}" in out


def test_no_decision_in_time_is_exit_3_and_the_intent_stays_published(
    kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert cli("intent", *SET_GPU, "--id", "it-late", "--wait", "--timeout", "1") == requesting.EXIT_TIMEOUT
    assert time.monotonic() - started < DEADLINE
    assert "no decision on it-late within 1s" in capsys.readouterr().err
    assert [json.loads(r.value or b"")["intent_id"] for r in read_all(kafka, "intents")] == ["it-late"]


def test_without_topics_nothing_is_published_and_the_exit_is_4(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VMSTREAM_KAFKA__BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("VMSTREAM_KAFKA__TOPIC_PREFIX", f"absent{uuid.uuid4().hex[:8]}.")
    assert cli("intent", *SET_GPU, "--wait", "--timeout", "5") == requesting.EXIT_KAFKA
    assert "vmstream topics create" in capsys.readouterr().err


def test_tail_prints_what_was_there_and_stops(kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("vm-a", "vm-b", "vm-c"):  # three keys: spread over partitions
        assert cli("intent", "restart", "--by", "bob@example.com", "--project", "proj-b",
                   "--namespace", "spx-proj-b", "--name", name, "--id", f"it-{name}") == 0
    capsys.readouterr()

    assert cli("tail", "intents", "--from-beginning") == tailing.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == [f"restart_vm it-{name} by bob@example.com (proj-b): vm/spx-proj-b/{name}"
                             for name in ("vm-a", "vm-b", "vm-c")]

    assert cli("tail", "intents", "-n", "2") == tailing.EXIT_OK  # the newest two, oldest first
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["it-vm-b", "it-vm-c"]

    assert cli("tail", kafka.topic("intents"), "-n", "1", "--json") == tailing.EXIT_OK
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["value"]["intent_id"] == "it-vm-c"
