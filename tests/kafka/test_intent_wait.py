"""``vmstream intent … --wait`` waits for the outcome in Kubernetes, on a real broker.

The worker and the applier are played by a test stand-in that answers as soon as it sees
the intent: the audit record naming the decision's command, then that command's result,
sealed as the applier seals it (streams/common/signing.py, with the key the CLI is given through
``VMSTREAM_SIGNING__KEYS``). The exit code says which outcome came; ``--wait=decided`` does
not wait for results.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime

import pytest
from kafka import KafkaConsumer, TopicPartition

from handlers.messages import CommandResult, ObjectRef
from streams.cli import requesting
from streams.common.codecs import encode_message
from streams.common.settings import KafkaSettings
from streams.common.signing import Keyring
from tests.kafka.test_requesting import SET_GPU, audit_for, cli, kafka, produce  # noqa: F401 (kafka: a fixture)

pytestmark = pytest.mark.kafka

DEADLINE = 30.0
SECRET = "a-test-only-sealing-secret-of-enough-length"
KEYRING = Keyring({"k1": SECRET.encode()}, "k1")
REFUSED = 'admission webhook "vmstream-apply" denied the request: only the GPU fields may change'


class ApplierStandIn(threading.Thread):
    """As soon as an intent is on the topic: its audit record (``outcome``, one command), then
    the ``results`` of that command, in order, each sealed unless ``unsealed``."""

    def __init__(self, kafka: KafkaSettings, *, outcome: str = "accepted", commands: int = 1,
                 results: tuple[tuple[str, bool], ...] = ()) -> None:
        super().__init__(name="applier-stand-in", daemon=True)
        self.kafka, self.outcome, self.commands, self.results = kafka, outcome, commands, results
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            key, ref = self._first_intent()
            command_ids = [f"cmd-{ref}-{n}" for n in range(self.commands)] if self.outcome == "accepted" else []
            audit = audit_for(self.kafka, ref, key, self.outcome, commands=command_ids,
                              reason=None if self.outcome == "accepted" else "unknown GPU class")
            produce(self.kafka, "audit", key, encode_message(audit))
            for command_id in command_ids:
                for outcome, sealed in self.results:
                    result = CommandResult(
                        command_id=command_id, outcome=outcome, at=datetime.now(UTC), type="patch_vm",
                        target=ObjectRef(kind="VirtualMachine", namespace="spx-proj-b", name="dev-1"),
                        error=REFUSED if outcome == "failed" else None,
                        resource_version="42" if outcome == "applied" else None, cause=ref)
                    produce(self.kafka, "command-results", key,
                            encode_message(result, keyring=KEYRING if sealed else None))
        except BaseException as error:  # handed to the test thread by check()
            self.error = error
        finally:
            self.ready.set()

    def _first_intent(self) -> tuple[str, str]:
        topic = self.kafka.topic("intents")
        consumer = KafkaConsumer(bootstrap_servers=self.kafka.bootstrap_servers, enable_auto_commit=False)
        try:
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
            consumer.assign(partitions)
            consumer.seek_to_beginning(*partitions)
            self.ready.set()
            deadline = time.monotonic() + DEADLINE
            while time.monotonic() < deadline:
                for records in consumer.poll(timeout_ms=200).values():
                    record = records[0]
                    return record.key.decode(), json.loads(record.value)["intent_id"]
            raise AssertionError("no intent was published")
        finally:
            consumer.close()

    def check(self) -> None:
        self.join(DEADLINE)
        if self.error is not None:
            raise self.error


@pytest.fixture(autouse=True)
def sealing_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMSTREAM_SIGNING__KEYS", json.dumps({"k1": SECRET}))


def run(stand_in: ApplierStandIn, *wait: str, timeout: float = DEADLINE) -> int:
    stand_in.start()
    assert stand_in.ready.wait(DEADLINE)
    code = cli("intent", *SET_GPU, *wait, "--timeout", str(timeout))
    stand_in.check()
    return code


def test_applied_in_kubernetes_is_exit_0(kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(ApplierStandIn(kafka, results=(("applied", True),)), "--wait") == requesting.EXIT_ACCEPTED
    out = capsys.readouterr().out
    assert "  result applied patch_vm VirtualMachine spx-proj-b/dev-1 [cmd-" in out
    assert out.rstrip().endswith("rv 42")


def test_a_command_the_api_server_refused_is_exit_5_whatever_a_forger_says(
    kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unsealed "applied" comes first: anyone could write it, so it does not count."""
    stand_in = ApplierStandIn(kafka, results=(("applied", False), ("failed", True)))
    assert run(stand_in, "--wait") == requesting.EXIT_FAILED
    captured = capsys.readouterr()
    assert "  result failed patch_vm VirtualMachine spx-proj-b/dev-1 [cmd-" in captured.out
    assert "denied the request" in captured.out
    assert "applied patch_vm" not in captured.out
    assert "1 of 1 command(s) failed in Kubernetes" in captured.err


def test_a_refused_intent_is_exit_1_without_waiting_for_results(
    kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert run(ApplierStandIn(kafka, outcome="rejected"), "--wait=applied") == requesting.EXIT_NOT_ACCEPTED
    assert time.monotonic() - started < DEADLINE
    assert "rejected" in capsys.readouterr().out


def test_no_result_in_time_is_exit_3(kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(ApplierStandIn(kafka, results=()), "--wait", timeout=3) == requesting.EXIT_TIMEOUT
    assert "was accepted, but no result for command(s) cmd-" in capsys.readouterr().err


def test_wait_decided_keeps_to_the_decision(kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]) -> None:
    """No result is ever published: --wait=decided does not wait for one."""
    started = time.monotonic()
    assert run(ApplierStandIn(kafka, results=()), "--wait=decided") == requesting.EXIT_ACCEPTED
    assert time.monotonic() - started < DEADLINE
    assert "result " not in capsys.readouterr().out


def test_a_decision_without_commands_is_exit_0(kafka: KafkaSettings) -> None:
    assert run(ApplierStandIn(kafka, commands=0), "--wait") == requesting.EXIT_ACCEPTED
