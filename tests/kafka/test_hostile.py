"""Hostile input on a real broker: a bad record costs only itself.

Every class of hostile record (harness/hostile.py) goes to a real worker interleaved with
valid intents; the test counts with a consumer of its own what came out: every
valid intent has one audit record, every hostile one has one dead letter naming its topic,
partition and offset (or one rejection). And a message the broker refuses stops the worker
before it acknowledges the input, which the next worker then decides.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from harness.hostile import Hostile, hostile_events, hostile_intents, interleaved, valid_intent
from harness.running import Deployment, WorkerProcess
from harness.scenarios import cluster
from streams.common.topics import KIND_HEADER, SOURCE_HEADER
from streams.worker.app import EXIT_UNPUBLISHED, Worker, _origin
from streams.common.durable import DurableProducer
from streams.common.group_reading import Partition
from tests.support.kafka_broker import committed as group_offsets
from tests.support.kafka_broker import set_topic_config
from tests.support.kafka_io import Record, TopicReader

pytestmark = pytest.mark.kafka

CLUSTER = list(cluster().jsonl())


class Reader:
    """The deployment's audit records and dead letters, read by the test itself."""

    def __init__(self, deployment: Deployment) -> None:
        kafka = deployment.kafka
        self.names = {kafka.topic("audit"): "audit", kafka.topic("dlq"): "dlq"}
        self.reader = TopicReader(kafka, self.names, partitions=kafka.partitions,
                                  config={"max.partition.fetch.bytes": 2_000_000})
        self.audit: list[dict[str, Any]] = []
        self.dlq: list[dict[str, Any]] = []
        self.largest = 0

    def poll(self) -> None:
        for record in self.reader.poll(0.2):
            self.largest = max(self.largest, len(record.value or b"") + len(record.key or b""))
            getattr(self, self.names[record.topic]).append(json.loads(record.value or b""))

    def wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {len(self.audit)} audit records, "
                                     f"{len(self.dlq)} dead letters")
            self.poll()

    def close(self) -> None:
        self.reader.close()



@pytest.fixture
def reader(deployment: Deployment) -> Iterator[Reader]:
    reader = Reader(deployment)
    yield reader
    reader.close()


def producer(deployment: Deployment) -> DurableProducer:
    return DurableProducer(deployment.kafka, client_id="vmstream-tests", timeout=30, linger_ms=5)


def test_every_hostile_record_is_one_dead_letter_and_every_valid_intent_is_decided(
    deployment: Deployment, reader: Reader
) -> None:
    worker = WorkerProcess(deployment, "w1").start()
    try:
        deployment.publish_lines(CLUSTER)
        reader.wait_for(lambda: len(reader.audit) >= len(CLUSTER), 60, "the cluster's events decided")
        sends: list[Hostile | None] = []  # None: a valid intent
        records: list[Record] = []
        valid: list[str] = []
        out = producer(deployment)
        every_class = len(hostile_intents(0)) + len(hostile_events(0))
        for _, item in interleaved(hostile=2 * every_class, valid=40):
            if isinstance(item, Hostile):
                sends.append(item)
                records.append(Record(deployment.kafka.topic(item.topic), item.key, item.value))
            else:
                key, value, intent_id = valid_intent(item)
                sends.append(None)
                records.append(Record(deployment.kafka.topic("intents"), key, value))
                valid.append(intent_id)
        try:
            delivered = out.send_all(records)
        finally:
            out.close()
        placed = [(hostile, where) for hostile, where in zip(sends, delivered, strict=True) if hostile is not None]
        assert {h.kind for h, _ in placed} >= {"tombstone", "nested-100k-deep", "near-broker-limit", "no-key"}

        letters = {(h.topic, m.partition, m.offset) for h, m in placed if h.fate == "dead_letter"}
        rejected = {h.ref for h, _ in placed if h.fate == "rejected" and h.ref is not None}

        def sources() -> Counter[tuple[str, int, int]]:
            topics = {deployment.kafka.topic(name): name for name in ("intents", "k8s-events")}
            return Counter((topics.get(d["source"]["topic"], d["source"]["topic"]), d["source"]["partition"],
                            d["source"]["offset"]) for d in reader.dlq)

        def refs() -> Counter[str]:
            return Counter(a["input"]["ref"] for a in reader.audit)

        def through() -> bool:
            seen = refs()
            return (set(sources()) >= letters and all(seen[r] for r in rejected)
                    and all(seen[intent_id] for intent_id in valid))

        reader.wait_for(through, 120, "every valid intent audited and every hostile record dead-lettered")
        reader.poll()  # and anything that came after: the counts below must still hold
        seen = refs()
        assert [i for i in valid if seen[i] != 1] == []
        assert sorted(sources().items()) == sorted((letter, 1) for letter in letters)
        assert [r for r in rejected if seen[r] != 1] == []
        assert all(a["outcome"] == "rejected" for a in reader.audit if a["input"]["ref"] in rejected)
        assert all(seen[f"{deployment.kafka.topic(t)}:{p}:{o}"] == 1 for t, p, o in letters)
        assert reader.largest < 1_000_000
        worker.check_running()
        assert "Crashed" not in worker.log.read_text(errors="replace")
    finally:
        assert worker.stop() == 0, worker.tail()


def committed(deployment: Deployment, partition: Partition) -> int | None:
    """The worker's committed offset of ``partition``, asked without joining its group."""
    return group_offsets(deployment.kafka, deployment.app_id).get(partition)


def limit_audit(deployment: Deployment, max_message_bytes: str) -> None:
    set_topic_config(deployment.kafka, deployment.kafka.topic("audit"), "max.message.bytes", max_message_bytes)


def test_an_output_the_broker_refuses_stops_the_worker_before_its_input_is_committed(
    deployment: Deployment, reader: Reader
) -> None:
    limit_audit(deployment, "100")
    first = WorkerProcess(deployment, "w1", env={"VMSTREAM_WORKER__PUBLISH_BACKOFF_SECONDS": "0.05"}).start()
    try:
        key, value, intent_id = valid_intent(0)
        out = producer(deployment)
        try:
            [placed] = out.send_all([Record(deployment.kafka.topic("intents"), key, value)])
        finally:
            out.close()
        deadline = time.monotonic() + 60
        assert first.process is not None
        while first.process.poll() is None:
            assert time.monotonic() < deadline, "the worker went on although its audit record was refused"
            time.sleep(0.1)  # polling interval
        assert first.process.returncode == EXIT_UNPUBLISHED, first.tail()
        assert "not published after 5 attempts" in first.tail()
        offset = committed(deployment, Partition(deployment.kafka.topic("intents"), placed.partition))
        assert offset is None or offset <= placed.offset, (offset, placed.offset)
    finally:
        first.stop()
    limit_audit(deployment, "1048588")  # the broker's default again
    second = WorkerProcess(deployment, "w2").start()
    try:
        reader.wait_for(lambda: any(a["input"]["ref"] == intent_id for a in reader.audit), 60, "the intent decided")
        assert {a["input"]["ref"] for a in reader.audit} == {intent_id}
        # After the restart an output may be sent again (the same record, which consumers
        # drop) and an input read again (audited as a duplicate): decided once all the same.
        decisions = {json.dumps(a, sort_keys=True) for a in reader.audit if a["outcome"] != "duplicate"}
        assert len(decisions) == 1, decisions
    finally:
        assert second.stop() == 0, second.tail()


def event(topic: str, headers: dict[str, bytes], *, timestamp: Any = 1.0) -> Any:
    """A record as the shell reads it (a Faust ``Message`` or the route stage's ``Read``)."""
    return SimpleNamespace(topic=topic, partition=4, offset=99, key=b"node/gpu-node-1", headers=headers,
                           timestamp=timestamp)


def test_a_routed_event_is_dead_lettered_under_its_k8s_events_record_and_only_it() -> None:
    origin = json.dumps({"topic": "t.k8s-events", "partition": 1, "offset": 7, "key": "Node/gpu-node-1"}).encode()
    routed = _origin(event("t.worker-routed", {KIND_HEADER: b"event", SOURCE_HEADER: origin}))
    assert (routed.topic, routed.partition, routed.offset, routed.key) == ("t.k8s-events", 1, 7, "Node/gpu-node-1")
    forged = _origin(event("t.intents", {KIND_HEADER: b"event", SOURCE_HEADER: origin}))  # not read on intents
    assert (forged.topic, forged.partition, forged.offset) == ("t.intents", 4, 99)
    broken = _origin(event("t.worker-routed", {KIND_HEADER: b"event", SOURCE_HEADER: b"{not json"}))
    assert (broken.topic, broken.offset) == ("t.worker-routed", 99)


@pytest.mark.parametrize("timestamp", [float("nan"), None, -5.0, 1e300])
def test_a_timestamp_no_date_can_show_is_taken_as_the_nearest(timestamp: Any) -> None:
    assert 1970 <= Worker._time(event("t.intents", {}, timestamp=timestamp)).year <= 9999
