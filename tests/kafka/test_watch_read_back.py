"""The watch bridge reads k8s-events back at start (streams/watching.py ``last_published``)
to learn what the worker last saw alive. Whatever else the topic holds — a record nobody
should have written, or one the worker dead-letters — is skipped there: one bad record must
not keep the bridge from starting, and so every event of every kind from flowing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kafka import KafkaProducer

from streams.settings import KafkaSettings
from streams.watching import KINDS, last_published, watch_event
from tests.kafka_broker import TopicFactory

pytestmark = pytest.mark.kafka

VM_KIND = next(kind for kind in KINDS if kind.kind == "VirtualMachine")


def _nested(depth: int) -> dict[str, Any]:
    outer: dict[str, Any] = {}
    inner = outer
    for _ in range(depth):
        inner["a"] = {}
        inner = inner["a"]
    return outer


def test_records_that_are_no_watch_event_are_skipped_not_fatal(
    kafka_bootstrap: str, kafka_topic_factory: TopicFactory
) -> None:
    topic = kafka_topic_factory("events", partitions=1)
    obj = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
           "metadata": {"namespace": "spx-proj-a", "name": "vm-1", "resourceVersion": "7"}, "spec": {}}
    key, value = watch_event(VM_KIND, "ADDED", obj)
    hostile = [
        (b"VirtualMachine/spx-proj-a/deep", b"[" * 100_000 + b"]" * 100_000),  # deeper than json.loads goes
        (b"VirtualMachine/spx-proj-a/\xff\xfe", value),  # a key that is not UTF-8
        (b"VirtualMachine/spx-proj-a/list-kind", json.dumps({"kind": [], "type": "ADDED", "object": {}}).encode()),
        (b"VirtualMachine/spx-proj-a/deep-object",
         json.dumps({"kind": "VirtualMachine", "type": "ADDED", "object": _nested(600)}).encode()),
    ]
    out = KafkaProducer(bootstrap_servers=kafka_bootstrap, max_request_size=4 * 1024 * 1024)
    try:
        for record_key, record_value in [*hostile, (key.encode(), value)]:
            out.send(topic, key=record_key, value=record_value)
        out.flush()
    finally:
        out.close()

    alive = last_published(KafkaSettings(bootstrap_servers=kafka_bootstrap), topic, [VM_KIND])

    assert list(alive.get("VirtualMachine", {})) == [key]
