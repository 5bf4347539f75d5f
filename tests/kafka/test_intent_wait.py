"""``vmstream intent … --wait`` waits for the outcome in Kubernetes, on a real broker.

The worker and the applier are played by a test stand-in that answers as soon as it sees
the intent: the audit record naming the decision's command, then that command's result,
each sealed as the worker and the applier seal them (streams/common/signing.py, with the key
the CLI is given through ``VMSTREAM_SIGNING__KEYS``). The exit code says which outcome came;
``--wait=decided`` does not wait for results. Forged records ahead of the real ones — an
unsealed ``rejected``, the worker's own refusal of an unsigned copy — are not taken for the
decision.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from handlers.contracts import ids
from handlers.contracts.messages import AuditInput, AuditRecord, CommandResult, ObjectRef
from streams.cli import requesting
from streams.common.codecs import encode_message
from streams.common.settings import KafkaSettings
from streams.common.signing import Keyring
from tests.kafka.test_requesting import SET_GPU, audit_for, cli, kafka, produce  # noqa: F401 (kafka: a fixture)
from tests.support.kafka_io import TopicReader

pytestmark = pytest.mark.kafka

DEADLINE = 30.0
SECRET = "a-test-only-sealing-secret-of-enough-length"
KEYRING = Keyring({"k1": SECRET.encode()}, "k1")
REFUSED = 'admission webhook "vmstream-apply" denied the request: only the GPU fields may change'


class ApplierStandIn(threading.Thread):
    """As soon as an intent is on the topic: its audit record (``outcome``, one command), then
    the ``results`` of that command, in order, each sealed unless ``unsealed``."""

    def __init__(self, kafka: KafkaSettings, *, outcome: str = "accepted", commands: int = 1,
                 results: tuple[tuple[str, bool], ...] = (), forged: tuple[str, ...] = ()) -> None:
        super().__init__(name="applier-stand-in", daemon=True)
        self.kafka, self.outcome, self.commands, self.results = kafka, outcome, commands, results
        self.forged = forged  # audit records written first: "unsealed rejected", "another copy"
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            key, ref, body = self._first_intent()
            intents = self.kafka.topic("intents")
            for forged in self.forged:
                if forged == "unsealed rejected":  # anyone who can write the topic
                    fake = audit_for(self.kafka, ref, key, "rejected", reason="forged: the VM is not yours")
                    produce(self.kafka, "audit", key, encode_message(fake))
                else:  # the worker's own refusal of an unsigned copy of the intent: sealed, about its id
                    copy = {**{k: v for k, v in body.items() if k != "credential"},
                            "spec": {**body["spec"], "gpu_class": None}}
                    refusal = refused_copy(intents, ref, key, copy)
                    produce(self.kafka, "audit", key, encode_message(refusal, keyring=KEYRING))
            if self.outcome == "unauthenticated":  # the intent itself refused for who asks
                produce(self.kafka, "audit", key, encode_message(refused_copy(intents, ref, key, body),
                                                                 keyring=KEYRING))
                return
            command_ids = [f"cmd-{ref}-{n}" for n in range(self.commands)] if self.outcome == "accepted" else []
            audit = audit_for(self.kafka, ref, key, self.outcome, commands=command_ids,
                              reason=None if self.outcome == "accepted" else "unknown GPU class")
            produce(self.kafka, "audit", key, encode_message(audit, keyring=KEYRING))
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

    def _first_intent(self) -> tuple[str, str, dict[str, Any]]:
        topic = self.kafka.topic("intents")
        reader = TopicReader(self.kafka, [topic])
        try:
            self.ready.set()
            deadline = time.monotonic() + DEADLINE
            while time.monotonic() < deadline:
                for record in reader.poll(0.2)[:1]:
                    body = json.loads(record.value or b"")
                    return (record.key or b"").decode(), body["intent_id"], body
            raise AssertionError("no intent was published")
        finally:
            reader.close()

    def check(self) -> None:
        self.join(DEADLINE)
        if self.error is not None:
            raise self.error


def refused_copy(topic: str, ref: str, key: str, body: dict[str, Any]) -> AuditRecord:
    """The audit record the worker writes for ``body`` refused for who asks (handlers/decide/engine.py)."""
    return AuditRecord(audit_id=ids.audit_id(topic, ids.unauthenticated_ref(topic, ref, body), "unauthenticated"),
                       at=datetime.now(UTC), input=AuditInput(topic=topic, key=key, ref=ref),
                       outcome="unauthenticated", reason="unauthenticated: no credential: an intent must carry a "
                       "signed credential in 'credential'")


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


def test_a_forged_rejection_and_a_forged_copy_s_refusal_are_not_the_decision(
    kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ahead of the real, sealed ``accepted``: an unsealed ``rejected`` under the intent's id
    (anyone who can write the audit topic), and the worker's sealed refusal of an unsigned copy
    of the intent (anyone who can write the intents topic). Neither is this intent's decision."""
    stand_in = ApplierStandIn(kafka, results=(("applied", True),), forged=("unsealed rejected", "another copy"))
    assert run(stand_in, "--wait") == requesting.EXIT_ACCEPTED
    captured = capsys.readouterr()
    assert "\naccepted " in captured.out and "rejected" not in captured.out and "forged" not in captured.out
    assert "  result applied patch_vm" in captured.out


def test_a_forged_rejection_is_not_the_decision_with_wait_decided(
    kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in = ApplierStandIn(kafka, forged=("unsealed rejected",))
    assert run(stand_in, "--wait=decided") == requesting.EXIT_ACCEPTED
    assert "rejected" not in capsys.readouterr().out


def test_the_intent_s_own_refusal_for_who_asks_is_its_decision(
    kafka: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    """Told apart from a copy's by its audit id, which the sender computes from what it sent."""
    stand_in = ApplierStandIn(kafka, outcome="unauthenticated", forged=("another copy",))
    assert run(stand_in, "--wait") == requesting.EXIT_NOT_ACCEPTED
    assert "\nunauthenticated " in capsys.readouterr().out
