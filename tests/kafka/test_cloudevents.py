"""The bus's envelope on a real broker: every output record carries the CloudEvents Kafka
binding's headers (binary mode) and a W3C ``traceparent`` that links it to its input.

A real ``vmstream worker`` decides intents sent with and without a ``traceparent``; the
applier, run on a real kube-apiserver, records a command's result under the command's
trace. What was written is read back, headers and all, with a plain consumer of the test's own.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from handlers.contracts import ids
from handlers.contracts.messages import Command, ObjectRef
from handlers.contracts.tracing import ce_time, derived_trace, parse_traceparent, span_id
from handlers.core.decisions import subject_key
from streams.kube.applying import Applier, KubeApplier
from streams.common.codecs import encode_message
from harness.running import CONFIG, Deployment, WorkerProcess
from harness.scenarios import cluster
from samples.cluster import node as node_object
from streams.common.settings import load_settings
from tests.support.kafka_io import Record, TopicReader, publish
from tests.support.kube_apiserver import Kube

pytestmark = pytest.mark.kafka

DEADLINE = 90.0
CLUSTER = list(cluster().jsonl())
OUTPUTS = ("commands", "command-results", "notifications", "audit", "dlq")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
OTHER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CE_HEADERS = ("ce_specversion", "ce_id", "ce_type", "ce_source", "ce_time", "content-type", "traceparent")


def set_gpu(intent_id: str, name: str, gpu_class: str) -> dict[str, Any]:
    return {"intent_id": intent_id, "type": "set_gpu", "requested_by": "bob@example.com", "project": "proj-b",
            "spec": {"namespace": "spx-proj-b", "name": name, "gpu_class": gpu_class}}


class Records:
    """Every record of the deployment's output topics, with its headers, read as it comes."""

    def __init__(self, deployment: Deployment) -> None:
        kafka = deployment.kafka
        self.names = {kafka.topic(name): name for name in OUTPUTS}
        self.reader = TopicReader(kafka, self.names, partitions=kafka.partitions)
        self.seen: dict[str, list[tuple[dict[str, Any], dict[str, str]]]] = {name: [] for name in OUTPUTS}

    def poll(self) -> None:
        for record in self.reader.poll(0.2):
            headers = {name: value.decode() for name, value in record.headers}
            assert len(headers) == len(record.headers), f"a header twice: {record.headers}"
            self.seen[self.names[record.topic]].append((json.loads(record.value or b""), headers))

    def wait_for(self, what: str, condition: Any) -> None:
        deadline = time.monotonic() + DEADLINE
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.counts()}"
            self.poll()

    def counts(self) -> dict[str, int]:
        return {name: len(records) for name, records in self.seen.items()}

    def audits(self, ref: str) -> list[tuple[dict[str, Any], dict[str, str]]]:
        return [(value, headers) for value, headers in self.seen["audit"] if value["input"]["ref"] == ref]

    def close(self) -> None:
        self.reader.close()


@pytest.fixture
def deployment(kafka_bootstrap: str, tmp_path: Path) -> Deployment:
    deployed = Deployment(kafka_bootstrap, tmp_path)
    deployed.create_topics()
    return deployed


@pytest.fixture
def records(deployment: Deployment) -> Iterator[Records]:
    reader = Records(deployment)
    yield reader
    reader.close()


def send(deployment: Deployment, key: str, value: bytes, headers: list[tuple[str, bytes]],
         topic: str = "intents") -> None:
    publish(deployment.kafka, [Record(deployment.kafka.topic(topic), key.encode(), value, headers)])


def trace_id(headers: dict[str, str]) -> str:
    trace = parse_traceparent(headers["traceparent"])
    assert trace is not None, f"not a valid traceparent: {headers['traceparent']!r}"
    return trace.trace_id


def assert_cloudevent(headers: dict[str, str], *, id_: str, type_: str, source: str, at: str) -> None:
    assert headers["ce_specversion"] == "1.0"
    assert headers["ce_id"] == id_
    assert headers["ce_type"] == type_
    assert headers["ce_source"] == source
    assert headers["ce_time"] == ce_time(datetime.fromisoformat(at))
    assert headers["content-type"] == "application/json"
    trace = parse_traceparent(headers["traceparent"])
    assert trace is not None and trace.span_id == span_id(id_), headers["traceparent"]


def test_every_worker_output_carries_cloudevents_headers_and_its_input_s_trace(
    deployment: Deployment, records: Records
) -> None:
    source = f"/vmstream/worker/{deployment.app_id}"
    worker = WorkerProcess(deployment, "w1").start()
    try:
        deployment.publish_lines(CLUSTER)  # watch events without any traceparent
        events = [json.loads(line)["value"]["event_id"] for line in CLUSTER]
        records.wait_for("the cluster's events decided", lambda: all(records.audits(e) for e in events))

        # An intent with a trace (and CloudEvents headers of its own: taken, not required)...
        traced = set_gpu("it-traced", "dev-1", "nvidia-rtx-pro-6000-bse")
        send(deployment, "vm/spx-proj-b/dev-1", json.dumps(traced).encode(),
             [("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01".encode()), ("tracestate", b"upstream=7"),
              ("ce_specversion", b"1.0"), ("ce_id", b"it-traced"), ("ce_type", b"com.example.intent"),
              ("ce_source", b"/upstream"), ("content-type", b"application/json")])
        # ...one without, refused (an unknown class)...
        untraced = set_gpu("it-untraced", "infer-1", "no-such-class")
        send(deployment, "vm/spx-proj-b/infer-1", json.dumps(untraced).encode(), [])
        # ...and one no rule can read, with a trace: its dead letter carries it.
        send(deployment, "vm/spx-proj-b/dev-1", b"{not json",
             [("traceparent", f"00-{OTHER_TRACE_ID}-b7ad6b7169203331-00".encode())])
        records.wait_for("the three intents decided", lambda: (
            records.audits("it-traced") and records.audits("it-untraced") and records.seen["dlq"]
            and any(n["type"] == "gpu_change_pending_restart" for n, _ in records.seen["notifications"])
            and any(n["type"] == "intent_rejected" for n, _ in records.seen["notifications"])))
    finally:
        assert worker.stop() == 0, worker.tail()
    records.poll()

    # Every output record, whatever decided it, is a CloudEvent with a valid traceparent.
    for name in ("commands", "notifications", "audit", "dlq"):
        for value, headers in records.seen[name]:
            assert set(CE_HEADERS) <= set(headers), (name, headers)
            assert headers["ce_source"] == source and headers["ce_specversion"] == "1.0"
            trace_id(headers)

    # The traced intent: its audit record, command and notification share the intent's trace.
    [(audit, audit_headers)] = records.audits("it-traced")
    assert audit["outcome"] == "accepted", audit
    [(command, command_headers)] = [(v, h) for v, h in records.seen["commands"] if v["cause"] == "it-traced"]
    [(told, told_headers)] = [(v, h) for v, h in records.seen["notifications"]
                              if v["notification_id"] in audit["notifications"]]
    assert_cloudevent(audit_headers, id_=audit["audit_id"], type_="io.vmstream.audit", source=source, at=audit["at"])
    assert_cloudevent(command_headers, id_=command["command_id"], type_="io.vmstream.command.patch_vm",
                      source=source, at=audit["at"])
    assert_cloudevent(told_headers, id_=told["notification_id"],
                      type_="io.vmstream.notification.gpu_change_pending_restart", source=source, at=audit["at"])
    assert trace_id(audit_headers) == trace_id(command_headers) == trace_id(told_headers) == TRACE_ID
    assert audit_headers["tracestate"] == command_headers["tracestate"] == "upstream=7"

    # The intent without one: a trace-id derived from its id, the same for all it led to.
    [(refused, refused_headers)] = records.audits("it-untraced")
    assert refused["outcome"] == "rejected", refused
    [(rejection, rejection_headers)] = [(v, h) for v, h in records.seen["notifications"]
                                        if v["notification_id"] in refused["notifications"]]
    expected = derived_trace("it-untraced").trace_id
    assert trace_id(refused_headers) == trace_id(rejection_headers) == expected != TRACE_ID
    assert rejection_headers["ce_type"] == "io.vmstream.notification.intent_rejected"
    assert "tracestate" not in refused_headers

    # The unreadable record: its dead letter and audit record carry the trace it came with.
    [(letter, letter_headers)] = records.seen["dlq"]
    ref = f"{letter['source']['topic']}:{letter['source']['partition']}:{letter['source']['offset']}"
    assert_cloudevent(letter_headers, id_=f"dlq:{ref}", type_="io.vmstream.dead-letter", source=source,
                      at=letter["at"])
    [(_, letter_audit_headers)] = records.audits(ref)
    assert trace_id(letter_headers) == trace_id(letter_audit_headers) == OTHER_TRACE_ID

    # Watch events brought no trace: each decision's trace derives from its event's id.
    for event_id in events:
        [(_, headers)] = records.audits(event_id)
        assert trace_id(headers) == derived_trace(event_id).trace_id


@pytest.mark.kube
def test_the_applier_s_result_and_audit_carry_the_command_s_trace(
    deployment: Deployment, records: Records, kube: Kube
) -> None:
    settings = load_settings(CONFIG).model_copy(update={"kafka": deployment.kafka, "signing": deployment.signing})
    source = f"/vmstream/applier/{settings.worker.app_id}"
    name = f"node-{uuid.uuid4().hex[:8]}"
    obj = node_object(name)
    for field in ("uid", "resourceVersion"):
        del obj["metadata"][field]
    stop = threading.Event()
    with kube.api_client() as api:
        client.CoreV1Api(api).create_node(obj)
        target = ObjectRef(kind="Node", name=name)
        cause = f"it-{uuid.uuid4().hex[:8]}"
        cordon = Command(command_id=ids.command_id(cause, "cordon_node", subject_key(target)), type="cordon_node",
                         target=target, cause=cause, issued_at=datetime.fromisoformat("2026-11-30T10:00:00+00:00"),
                         requested_by="ops@example.com")
        send(deployment, subject_key(target), encode_message(cordon, keyring=deployment.signing.keyring()),
             [("traceparent", f"00-{TRACE_ID}-{span_id(cordon.command_id)}-01".encode())], topic="commands")
        applier = Applier(settings, KubeApplier(api), group_id=f"{deployment.app_id}-applier")
        thread = threading.Thread(target=applier.run, args=(stop,), daemon=True)
        thread.start()
        try:
            records.wait_for("the command's result", lambda: records.seen["command-results"]
                             and records.audits(cordon.command_id))
        finally:
            stop.set()
            thread.join(60)
            client.CoreV1Api(api).delete_node(name)
    [(result, result_headers)] = records.seen["command-results"]
    assert result["command_id"] == cordon.command_id and result["outcome"] == "applied", result
    assert_cloudevent(result_headers, id_=cordon.command_id, type_="io.vmstream.command-result", source=source,
                      at=result["at"])
    [(audit, audit_headers)] = records.audits(cordon.command_id)
    assert_cloudevent(audit_headers, id_=audit["audit_id"], type_="io.vmstream.audit", source=source, at=audit["at"])
    assert trace_id(result_headers) == trace_id(audit_headers) == TRACE_ID
