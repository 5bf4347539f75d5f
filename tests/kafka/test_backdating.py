"""A producer cannot back-date an intent: the broker refuses an old timestamp on the topic.

The worker checks a credential's expiry at the intent's Kafka timestamp, and a producer
chooses that timestamp. Without a bound, a credential that expired hours ago is current
again for a record stamped inside its lifetime. ``vmstream.intents`` is created with
``message.timestamp.before.max.ms`` (handlers/topics.py), so such a record never reaches the
worker; this test counts what the topic holds with a consumer of its own.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import InvalidTimestampError

from streams.common.kafka_clients import producer
from harness.running import Deployment
from handlers.topics import INTENT_TIMESTAMP_BEFORE_MS

pytestmark = pytest.mark.kafka


def test_an_intent_stamped_further_back_than_the_bound_is_refused_by_the_broker(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    deployment.create_topics()
    topic = deployment.kafka.topic("intents")
    client = producer(deployment.kafka)
    try:
        back_dated = client.send(topic, key=b"vm/spx-proj-b/dev-1", value=b'{"back":"dated"}',
                                 timestamp_ms=int(time.time() * 1000) - 2 * 3600 * 1000)
        client.flush()  # a batch of its own: the broker refuses a whole batch holding it
        with pytest.raises(InvalidTimestampError):
            back_dated.get(timeout=30)
    finally:
        client.close()
    client = producer(deployment.kafka)  # a producer of its own: the one refused is done
    try:
        client.send(topic, key=b"vm/spx-proj-b/dev-1", value=b'{"current":true}').get(timeout=30)
    finally:
        client.close()
    assert INTENT_TIMESTAMP_BEFORE_MS < 3600 * 1000  # shorter than the longest credential

    reader = KafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    try:
        partitions = [TopicPartition(topic, p) for p in reader.partitions_for_topic(topic) or ()]
        reader.assign(partitions)
        reader.seek_to_beginning()
        end = reader.end_offsets(partitions)
        values: list[bytes | None] = []
        deadline = time.monotonic() + 30
        while any(reader.position(tp) < end[tp] for tp in partitions) and time.monotonic() < deadline:
            for records in reader.poll(timeout_ms=500).values():
                values.extend(record.value for record in records)
    finally:
        reader.close()
    assert values == [b'{"current":true}']
