"""Reading to the end (streams/common/reading.py) on a real broker: what is read past the end
offsets taken is not yielded and not lost either; partitions not assigned yet are read from
their start; a broker that cannot say yet is asked again; a reader whose offset is gone starts
at the first record, not the end.

The ledgers (the applier's results, notify's deliveries) read to the end at start and after
a rebalance, then read on. A record that arrived after the end offsets were taken, on a
partition already at its end, used to be dropped with the client's position moved past it:
the ledger never learnt of it. Here the end offsets are taken before a late record (the
client is handed a snapshot from before it), and the test's next poll must see it.
"""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from streams.common.durable import DurableProducer, Record
from streams.common.kafka_clients import consumer
from streams.common.reading import assign_from_start, partitions_of, poll_records, read_to_end
from streams.common.settings import KafkaSettings
from tests.support.kafka_broker import TopicFactory
from tests.support.kafka_io import publish

pytestmark = pytest.mark.kafka


def test_a_record_past_the_end_is_left_for_the_next_read(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = kafka_topic_factory("read-to-end", partitions=2)
    producer = DurableProducer(kafka, client_id="read-to-end")
    # many fetches' worth for the busy partition (1 KiB per fetch below)
    producer.send_all([Record(topic, None, b"%03d" % i + b"." * 97, partition=0) for i in range(200)])
    snapshot = {0: 200, 1: 0}  # the end offsets as they were before the late record
    producer.send_all([Record(topic, None, b"late", partition=1)])
    producer.close()

    reader = consumer(kafka, client_id="read-to-end", config={"max.partition.fetch.bytes": 1024})

    def ends_before_the_late_record(tp: TopicPartition, **_: Any) -> tuple[int, int]:
        return 0, snapshot[tp.partition]

    try:
        partitions = assign_from_start(reader, [topic])
        read = [(r.partition, r.value) for r in read_to_end(cast(Consumer, Snapshot(reader, ends_before_the_late_record)),
                                                            partitions, stall=30)]
        assert len(read) == 200 and {p for p, _ in read} == {0}  # up to the ends taken, nothing past them
        later: list[bytes | None] = []
        deadline = time.monotonic() + 30
        while not later and time.monotonic() < deadline:
            later += [r.value for r in poll_records(reader, 0.5)]
    finally:
        reader.close()
    assert later == [b"late"], "the record read past the end was skipped for good"


class Snapshot:
    """A consumer whose end offsets are those given, not the broker's: a snapshot taken earlier."""

    def __init__(self, client: Consumer, watermarks: Any) -> None:
        self.client = client
        self.get_watermark_offsets = watermarks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_a_partition_still_empty_is_at_its_end_on_a_second_read(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    """A ledger reads to the end at start, when its topic may be empty, and again later, when
    only some partitions got records: librdkafka reported the empty one's end once, on the
    first read, and moves no position for it."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = kafka_topic_factory("read-again", partitions=2)
    reader = consumer(kafka, client_id="read-again")
    producer = DurableProducer(kafka, client_id="read-again")
    try:
        partitions = assign_from_start(reader, [topic])
        assert list(read_to_end(reader, partitions, stall=10)) == []
        producer.send_all([Record(topic, None, b"one", partition=1)])
        assert [r.value for r in read_to_end(reader, partitions, stall=10)] == [b"one"]
    finally:
        producer.close()
        reader.close()


def test_a_broker_that_cannot_say_yet_is_asked_again_and_a_refusal_is_not(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    """A broker just started, or a leader moving, answers an offset query with "not leader"
    for a moment: a ledger reading to the end then asks again, not dies. A refusal (not
    authorised) is no moment's state: it is raised at once."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = kafka_topic_factory("read-not-yet", partitions=2)
    publish(kafka, [Record(topic, None, b"%d" % i, partition=i % 2) for i in range(6)])
    reader = consumer(kafka, client_id="read-not-yet")
    answers: list[int] = []

    def failing(code: int, times: int) -> Any:
        def watermarks(tp: TopicPartition, **options: Any) -> tuple[int, int]:
            answers.append(code if len(answers) < times else 0)
            if len(answers) <= times:
                raise KafkaException(KafkaError(code))
            return reader.get_watermark_offsets(tp, **options)
        return watermarks

    try:
        partitions = assign_from_start(reader, [topic])
        # The broker's "not leader"; librdkafka's own "unknown partition" while its metadata
        # is not refreshed after a broker's restart.
        read: list[bytes] = []
        for code in (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError._UNKNOWN_PARTITION):
            answers.clear()
            read += [r.value or b"" for r in read_to_end(cast(Consumer, Snapshot(reader, failing(code, 2))),
                                                          partitions, stall=30)]
            assert answers == [code] * 2 + [0, 0]
        assert sorted(read) == [b"%d" % i for i in range(6)]  # all of them, once
        answers.clear()
        with pytest.raises(KafkaException) as refused:
            list(read_to_end(cast(Consumer, Snapshot(reader, failing(KafkaError.TOPIC_AUTHORIZATION_FAILED, 5))),
                             partitions, stall=30))
        assert refused.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
        assert len(answers) == 1, "a refusal was asked again"
    finally:
        reader.close()


def test_a_reader_whose_offset_is_not_there_reads_from_the_first_record_not_the_end(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    """Where librdkafka cannot start a reader at its offset (out of range, or the query for
    the first offset failed: a leader moving on a topic created a moment ago) it starts it
    where ``auto.offset.reset`` says. Its default, the end, would have every ledger skip the
    records of that partition and take it as read to the end."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = kafka_topic_factory("read-reset", partitions=1)
    publish(kafka, [Record(topic, None, b"%d" % i) for i in range(5)])
    reader = consumer(kafka, client_id="read-reset")
    try:
        reader.assign([TopicPartition(topic, 0, 1_000)])  # past the end: not there
        read: list[bytes | None] = []
        deadline = time.monotonic() + 30
        while len(read) < 5 and time.monotonic() < deadline:
            read += [r.value for r in poll_records(reader, 0.5)]
    finally:
        reader.close()
    assert read == [b"%d" % i for i in range(5)]


def test_partitions_not_assigned_yet_are_read_from_their_start_and_then_read_on(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    """A ledger's first read, a watch bridge's read-back: the partitions are assigned by the
    read, after their end offsets were asked; an empty partition is at its end at once, and
    a second read goes on from where the first stopped."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = kafka_topic_factory("read-from-start", partitions=3)
    publish(kafka, [Record(topic, None, b"%02d" % i, partition=i % 2) for i in range(40)])  # partition 2 empty
    reader = consumer(kafka, client_id="read-from-start")
    try:
        partitions = partitions_of(reader, [topic])
        read = list(read_to_end(reader, partitions, stall=30))
        publish(kafka, [Record(topic, None, b"later", partition=2)])
        later = [r.value for r in read_to_end(reader, partitions, stall=30)]
        nothing = list(read_to_end(reader, partitions_of(reader, ["vmstream.nowhere"], wait=0, missing_ok=True)))
    finally:
        reader.close()
    assert sorted(r.value or b"" for r in read) == [b"%02d" % i for i in range(40)]
    assert {r.partition for r in read} == {0, 1}
    assert later == [b"later"]
    assert nothing == []
