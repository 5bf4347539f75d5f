"""A producer cannot back-date an intent: the broker refuses an old timestamp on the topic.

The worker checks a credential's expiry at the intent's Kafka timestamp, and a producer
chooses that timestamp. Without a bound, a credential that expired hours ago is current
again for a record stamped inside its lifetime. ``vmstream.intents`` is created with
``message.timestamp.before.max.ms`` (handlers/contracts/topics.py), so such a record never reaches the
worker; this test counts what the topic holds with a consumer of its own.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from streams.common.durable import DurableProducer, NotDelivered, Record
from streams.common.kafka_clients import consumer
from streams.common.reading import partitions_of, read_to_end
from harness.running import Deployment
from handlers.contracts.topics import INTENT_TIMESTAMP_BEFORE_MS

pytestmark = pytest.mark.kafka


def test_an_intent_stamped_further_back_than_the_bound_is_refused_by_the_broker(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    deployment.create_topics()
    topic = deployment.kafka.topic("intents")
    client = DurableProducer(deployment.kafka, client_id="back-dating", timeout=30)
    try:
        with pytest.raises(NotDelivered, match="INVALID_TIMESTAMP|timestamp"):
            client.send_all([Record(topic, b"vm/spx-proj-b/dev-1", b'{"back":"dated"}',
                                    timestamp_ms=int(time.time() * 1000) - 2 * 3600 * 1000)])
    finally:
        client.close()
    client = DurableProducer(deployment.kafka, client_id="current")  # of its own: the one refused is done
    try:
        client.send_all([Record(topic, b"vm/spx-proj-b/dev-1", b'{"current":true}')])
    finally:
        client.close()
    assert INTENT_TIMESTAMP_BEFORE_MS < 3600 * 1000  # shorter than the longest credential

    reader = consumer(deployment.kafka, client_id="back-dating")
    try:
        values = [record.value for record in read_to_end(reader, partitions_of(reader, [topic]), stall=30)]
    finally:
        reader.close()
    assert values == [b'{"current":true}']
