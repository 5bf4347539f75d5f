"""``read_to_end`` (streams/common/reading.py) on a real broker: what it reads past the end
offsets it took is not yielded and not lost either.

The ledgers (the applier's results, notify's deliveries) read to the end at start and after
a rebalance, then read on. A record that arrived after the end offsets were taken, on a
partition already at its end, used to be dropped with the client's position moved past it:
the ledger never learnt of it. Here the end offsets are taken before a late record (the
client is handed a snapshot from before it), and the test's next poll must see it.
"""

from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from streams.common.reading import read_to_end
from tests.support.kafka_broker import TopicFactory

pytestmark = pytest.mark.kafka


def test_a_record_past_the_end_is_left_for_the_next_read(
        kafka_bootstrap: str, kafka_topic_factory: TopicFactory) -> None:
    topic = kafka_topic_factory("read-to-end", partitions=2)
    busy, quiet = TopicPartition(topic, 0), TopicPartition(topic, 1)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    for i in range(200):  # many fetches' worth for the busy partition (1 KiB per fetch below)
        producer.send(topic, value=b"%03d" % i + b"." * 97, partition=0)
    producer.flush()
    snapshot = {busy: 200, quiet: 0}  # the end offsets as they were before the late record
    producer.send(topic, value=b"late", partition=1)
    producer.flush()
    producer.close()

    reader = KafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False,
                           max_partition_fetch_bytes=1024)
    try:
        reader.assign([busy, quiet])
        reader.seek_to_beginning(busy, quiet)
        reader.end_offsets = lambda partitions: {tp: snapshot[tp] for tp in partitions}
        read = [(r.partition, r.value) for r in read_to_end(reader, [busy, quiet], stall=30)]
        assert len(read) == 200 and {p for p, _ in read} == {0}  # up to the ends taken, nothing past them
        later: list[bytes] = []
        deadline = time.monotonic() + 30
        while not later and time.monotonic() < deadline:
            later += [r.value for records in reader.poll(timeout_ms=500).values() for r in records]
    finally:
        reader.close()
    assert later == [b"late"], "the record read past the end was skipped for good"
