"""The watch bridge reads k8s-events back at start (streams/kube/watching.py ``last_published``)
to learn what the worker last saw alive. Whatever else the topic holds — a record nobody
should have written, or one the worker dead-letters — is skipped there: one bad record must
not keep the bridge from starting, and so every event of every kind from flowing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from streams.common.durable import DurableProducer, Record
from streams.common.settings import KafkaSettings
from streams.kube.watching import KINDS, Publisher, Watcher, last_published, watch_event
from tests.support.kafka_broker import TopicFactory

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
    out = DurableProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_id="read-back-test")
    try:
        out.send_all([Record(topic, record_key, record_value) for record_key, record_value in [*hostile, (key.encode(), value)]])
    finally:
        out.close()

    alive = last_published(KafkaSettings(bootstrap_servers=kafka_bootstrap), topic, [VM_KIND])

    assert list(alive.get("VirtualMachine", {})) == [key]


def test_a_relist_publishes_deletions_only_for_what_was_read_back_as_that_very_object(
    kafka_bootstrap: str, kafka_topic_factory: TopicFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read back, a record whose object is no VM (no name, metadata that is no map) or is
    another VM than its key says made every relist of the kind fail, so the bridge never
    watched VMs again; and one naming a live VM under another key would have had it
    published as deleted. Only a genuinely gone VM is."""
    topic = kafka_topic_factory("events", partitions=1)

    def vm(name: str) -> dict[str, Any]:
        return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "metadata": {"namespace": "spx-proj-a", "name": name, "resourceVersion": "7"}, "spec": {}}

    records = [
        watch_event(VM_KIND, "ADDED", vm("live")),
        watch_event(VM_KIND, "ADDED", vm("gone")),
        ("VirtualMachine/spx-proj-a/nameless", json.dumps({"kind": "VirtualMachine", "type": "ADDED",
                                                           "object": {"metadata": {}}}).encode()),
        ("VirtualMachine/spx-proj-a/flat", json.dumps({"kind": "VirtualMachine", "type": "ADDED",
                                                       "object": {"metadata": "x"}}).encode()),
        ("VirtualMachine/spx-proj-a/ghost", json.dumps({"kind": "VirtualMachine", "type": "ADDED",
                                                        "object": vm("live")}).encode()),
    ]
    out = DurableProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_id="read-back-test")
    try:
        out.send_all([Record(topic, record_key.encode(), record_value) for record_key, record_value in records])
        watcher = Watcher(VM_KIND)
        watcher.known = last_published(KafkaSettings(bootstrap_servers=kafka_bootstrap), topic,
                                       [VM_KIND]).get("VirtualMachine", {})
        watcher.seeded = True
        monkeypatch.setattr(watcher, "_list", lambda api: ([vm("live")], "8"))
        published: list[tuple[str, str]] = []
        publisher = Publisher(out, topic, dlq_topic=topic)
        send = publisher.send

        def recorded(kind: Any, type_: Any, obj: dict[str, Any]) -> Any:
            sent = send(kind, type_, obj)
            published.append((type_, obj["metadata"]["name"]))
            return sent

        monkeypatch.setattr(publisher, "send", recorded)
        watcher.relist(None, publisher)  # _list is the stand-in
    finally:
        out.close()

    assert sorted(published) == [("DELETED", "gone"), ("RELISTED", "live")]
    assert list(watcher.known) == ["VirtualMachine/spx-proj-a/live"]
