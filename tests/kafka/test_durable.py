"""The applier's and the worker's producer (streams/common/durable.py) against a real
broker: ``send_all`` returns only once every record is written, says where each went, puts
a key where the Java client does, and raises instead of returning for what
was not written; ``send_each`` and ``deliver`` (the worker's, from its event loop) say per
record, keep an explicit partition, a timestamp to the millisecond and a tombstone. Read
back with a consumer of the test's own, not with the code under test."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from streams.common.durable import Delivered, DurableProducer, NotDelivered, Record
from streams.common.settings import KafkaSettings
from tests.support.kafka_broker import TopicFactory
from tests.support.kafka_io import TopicReader, murmur2_partition

pytestmark = pytest.mark.kafka

# A record read back: partition, offset, key, value (None: a tombstone), headers.
Read = tuple[int, int, bytes | None, bytes | None, list[tuple[str, bytes]]]


def read_back(bootstrap: str, topic: str, partitions: int, *,
              stamps: dict[tuple[int, int], int] | None = None) -> list[Read]:
    """Every record of ``topic`` as (partition, offset, key, value, headers); ``stamps``
    receives each record's timestamp by (partition, offset)."""
    reader = TopicReader(bootstrap, [topic], partitions=partitions)
    try:
        records = reader.read_to_end()
    finally:
        reader.close()
    if stamps is not None:
        stamps.update({(r.partition, r.offset): r.timestamp for r in records})
    return sorted((r.partition, r.offset, r.key, r.value, list(r.headers)) for r in records)


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
        if record.key is not None:  # the partition the Java client picks
            assert place.partition == murmur2_partition(record.key, 6)


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
    assert [(offset, len(value)) for _, offset, _, value, _ in read_back(kafka_bootstrap, topic, 1) if value][0] == (
        large.offset, 1_040_000)


def test_no_broker_is_a_failed_send_not_a_silent_one() -> None:
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    producer = DurableProducer(KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}"), client_id="vmstream-test",
                               timeout=2.0)
    with pytest.raises(NotDelivered, match="1 of 1 records not written"):
        producer.send_all([Record("vmstream.nowhere", b"k", b"v")])


def test_deliver_keeps_the_partition_the_time_and_the_tombstone_and_says_per_record(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    """What the worker sends: table rows in their input's partition (not their key's), routed
    records with their input's timestamp, journal tombstones; one refused record among them
    fails alone, so the worker sends again only that one."""
    topic = kafka_topic_factory("durable-deliver", partitions=3)
    rows = [Record(topic, f'"row-{i}"'.encode(), f"value-{i}".encode(), partition=i % 3,
                   timestamp_ms=1_764_547_200_123 + i) for i in range(30)]
    tombstone = Record(topic, b'"row-0"', None, partition=0)
    too_large = Record(topic, b'"too-large"', b"x" * 2_000_000, partition=1)
    producer = DurableProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_id="vmstream-test")

    async def from_a_loop() -> list[Delivered | str]:
        return await producer.deliver([*rows, too_large, tombstone])

    try:
        outcomes = asyncio.run(from_a_loop())
    finally:
        producer.close()
    assert isinstance(outcomes[len(rows)], str) and outcomes[len(rows)]  # why it was refused
    placed = [o for o in outcomes if not isinstance(o, str)]
    assert [p.partition for p in placed] == [r.partition for r in rows] + [0]
    stamps: dict[tuple[int, int], int] = {}
    seen = {(partition, offset): (key, value) for partition, offset, key, value, _ in
            read_back(kafka_bootstrap, topic, 3, stamps=stamps)}
    assert len(seen) == len(rows) + 1
    for record, place in zip(rows, placed, strict=False):
        assert seen[(place.partition, place.offset)] == (record.key, record.value)
        assert stamps[(place.partition, place.offset)] == record.timestamp_ms
    assert seen[(placed[-1].partition, placed[-1].offset)] == (b'"row-0"', None)


def test_a_record_the_broker_refuses_fails_its_batch_and_every_send_after_it(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    """A topic whose ``max.message.bytes`` the record exceeds: the broker refuses it, and
    the producer, which leaves no gap behind a refused record, fails for good. Each record
    of the batch says it was not written (confluent-kafka raises that out of ``flush`` with
    the batch's reports cut short: before, the raise left the worker's batch waiting), and
    so does every later send, at once: the worker stops before its inputs are committed."""
    topic = kafka_topic_factory("durable-refused", configs={"max.message.bytes": "100"})
    producer = DurableProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_id="vmstream-test")
    try:
        first = producer.send_each([Record(topic, b"k", b"x" * 300), Record(topic, b"k2", b"small")])
        later = producer.send_each([Record(topic, b"k", b"small")])
        with pytest.raises(NotDelivered):
            producer.send_all([Record(topic, b"k", b"small")])
    finally:
        producer.close()
    assert all(isinstance(outcome, str) and outcome for outcome in [*first, *later])
    assert read_back(kafka_bootstrap, topic, 1) == []


def test_batches_delivered_from_several_threads_at_once_each_get_every_report(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    """The worker's route stage and its decide stage deliver at the same time, each on a
    thread of the producer's: any of them may run the other's delivery callbacks. Each batch
    must still learn where every one of its records went, none reported unsent."""
    topic = kafka_topic_factory("durable-threads", partitions=6)
    producer = DurableProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_id="vmstream-test")
    batches = [[Record(topic, f"vm/ns/{b}-{i}".encode(), f"{b}-{i}".encode()) for i in range(1 + b % 7)]
               for b in range(300)]

    async def all_at_once() -> list[list[Delivered | str]]:
        return await asyncio.gather(*(producer.deliver(batch) for batch in batches))

    try:
        outcomes = asyncio.run(all_at_once())
    finally:
        producer.close()
    unsent = [o for batch in outcomes for o in batch if isinstance(o, str)]
    assert unsent == []
    placed = {(o.partition, o.offset) for batch in outcomes for o in batch if not isinstance(o, str)}
    assert len(placed) == sum(len(batch) for batch in batches)
    assert len(read_back(kafka_bootstrap, topic, 6)) == len(placed)


def test_a_small_batch_is_not_held_behind_another_callers_large_one(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    """While one caller waits for 30,000 records, another's single record returns as soon
    as it is written: each batch waits for its own reports, not for the producer's whole
    queue (a flush would, so the route stage's records held up the decide stage's)."""
    large_topic, small_topic = kafka_topic_factory("durable-large-batch"), kafka_topic_factory("durable-small")
    producer = DurableProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_id="vmstream-test")
    large = [Record(large_topic, f"k-{i}".encode(), b"x" * 1000) for i in range(30_000)]
    outcome: list[list[Delivered | str]] = []
    sender = threading.Thread(target=lambda: outcome.append(producer.send_each(large)))

    async def one_record_meanwhile() -> tuple[list[Delivered | str], bool]:
        sender.start()
        while len(producer._producer) < 1000 and sender.is_alive():  # the large batch is queued
            await asyncio.sleep(0)
        placed = await producer.deliver([Record(small_topic, b"k", b"one")])
        return placed, sender.is_alive()

    try:
        placed, large_still_waiting = asyncio.run(one_record_meanwhile())
        sender.join()
    finally:
        producer.close()
    assert not isinstance(placed[0], str)
    assert large_still_waiting, "the single record waited for the whole queue"
    assert not any(isinstance(o, str) for o in outcome[0])
