"""The applier's producer (streams/common/durable.py) against a real broker: ``send_all``
returns only once every record is written, says where each went, puts a key where
kafka-python and the Java client do, and raises instead of returning for what was not
written. Read back with a consumer of the test's own, not with the code under test."""

from __future__ import annotations

import socket

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.partitioner.default import murmur2

from streams.common.durable import DurableProducer, NotDelivered, Record
from streams.common.settings import KafkaSettings
from tests.support.kafka_broker import TopicFactory

pytestmark = pytest.mark.kafka


def read_back(bootstrap: str, topic: str, partitions: int) -> list[tuple[int, int, bytes | None, bytes, list]]:
    """Every record of ``topic`` as (partition, offset, key, value, headers)."""
    reader = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=1)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        reader.assign(tps)
        reader.seek_to_beginning(*tps)
        ends = reader.end_offsets(tps)
        seen: list[tuple[int, int, bytes | None, bytes, list]] = []
        while any(reader.position(tp) < ends[tp] for tp in tps):
            for records in reader.poll(timeout_ms=1000).values():
                seen += [(r.partition, r.offset, r.key, r.value, list(r.headers)) for r in records]
        return sorted(seen)
    finally:
        reader.close()


def test_send_all_returns_where_every_record_is_once_the_broker_has_it(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    topic = kafka_topic_factory("durable", partitions=6)
    producer = DurableProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_id="vmstream-test")
    records = [Record(topic, f"vm/ns/vm-{i}".encode(), f"value-{i}".encode(), [("ce_id", f"id-{i}".encode())])
               for i in range(40)] + [Record(topic, None, b"no key")]
    try:
        delivered = producer.send_all(records)
    finally:
        producer.close()
    seen = read_back(kafka_bootstrap, topic, 6)
    assert len(seen) == len(records) == len(delivered)
    by_place = {(partition, offset): (key, value, headers) for partition, offset, key, value, headers in seen}
    for record, place in zip(records, delivered, strict=True):
        assert place.topic == topic
        key, value, headers = by_place[(place.partition, place.offset)]  # where send_all said, nowhere else
        assert (key, value, headers) == (record.key, record.value, list(record.headers))
        if record.key is not None:  # the partition kafka-python and the Java client pick
            assert place.partition == (murmur2(record.key) & 0x7FFFFFFF) % 6


def test_what_the_broker_takes_is_sent_and_what_it_does_not_is_not_delivered(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    """A record of 1,040,000 bytes is under the broker's default limit (1,048,588) and was
    written by kafka-python's producer: it is written here too (librdkafka's own default
    limit, 1,000,000, would refuse it). Twice the limit is refused, and said so."""
    topic = kafka_topic_factory("durable-large")
    producer = DurableProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_id="vmstream-test")
    try:
        [large] = producer.send_all([Record(topic, b"k", b"x" * 1_040_000)])
        with pytest.raises(NotDelivered, match=topic):
            producer.send_all([Record(topic, b"k", b"small"), Record(topic, b"k", b"x" * 2_000_000)])
    finally:
        producer.close()
    assert [(offset, len(value)) for _, offset, _, value, _ in read_back(kafka_bootstrap, topic, 1)][0] == (
        large.offset, 1_040_000)


def test_no_broker_is_a_failed_send_not_a_silent_one() -> None:
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    producer = DurableProducer(KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}"), client_id="vmstream-test",
                               timeout=2.0)
    with pytest.raises(NotDelivered, match="1 of 1 records not written"):
        producer.send_all([Record("vmstream.nowhere", b"k", b"v")])
