"""The local broker is a real Kafka: records round-trip, transactions commit and abort,
and ``up`` / ``status`` / ``down`` manage a background broker across calls, which keeps its
topics and records across ``down`` / ``up`` unless ``--reset``."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from confluent_kafka.admin import NewTopic

from harness import localkafka
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client
from tests.support.kafka_broker import TopicFactory
from tests.support.kafka_io import Record, TopicReader, publish, settings

pytestmark = pytest.mark.kafka

READ_TIMEOUT = 30.0


async def _read_until(
    bootstrap: str, topic: str, last: bytes, *, isolation_level: str
) -> list[bytes]:
    """Values of partition 0 from the start up to and including ``last``."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level=isolation_level
    )
    await consumer.start()
    try:
        partition = TopicPartition(topic, 0)
        consumer.assign([partition])
        await consumer.seek_to_beginning(partition)
        values: list[bytes] = []
        async with asyncio.timeout(READ_TIMEOUT):
            while last not in values:
                record = await consumer.getone()
                assert record.value is not None
                values.append(record.value)
        return values
    finally:
        await consumer.stop()


async def test_records_round_trip_through_a_consumer_group(
    kafka_bootstrap: str, kafka_topic_factory: TopicFactory
) -> None:
    topic = kafka_topic_factory()
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        metadata = await producer.send_and_wait(topic, b"value", key=b"key")
    finally:
        await producer.stop()
    assert metadata.offset == 0

    # A group exercises the coordinator and __consumer_offsets (replication factor 1).
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=f"{topic}-group",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        async with asyncio.timeout(READ_TIMEOUT):
            record = await consumer.getone()
        await consumer.commit()
        committed = await consumer.committed(TopicPartition(topic, 0))
    finally:
        await consumer.stop()
    assert (record.topic, record.key, record.value) == (topic, b"key", b"value")
    assert committed == 1


async def test_transactions_commit_and_abort(
    kafka_bootstrap: str, kafka_topic_factory: TopicFactory
) -> None:
    topic = kafka_topic_factory()
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"{topic}-tx")
    await producer.start()
    try:
        await producer.begin_transaction()
        await producer.send_and_wait(topic, b"aborted", partition=0)
        await producer.abort_transaction()
        async with producer.transaction():
            await producer.send_and_wait(topic, b"committed", partition=0)
    finally:
        await producer.stop()

    committed_view = await _read_until(
        kafka_bootstrap, topic, b"committed", isolation_level="read_committed"
    )
    raw_view = await _read_until(
        kafka_bootstrap, topic, b"committed", isolation_level="read_uncommitted"
    )
    assert committed_view == [b"committed"]
    assert raw_view == [b"aborted", b"committed"]


def test_up_status_down_manage_a_background_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "run"
    assert localkafka.status(state_dir) is None

    state = localkafka.up(state_dir)
    try:
        assert localkafka.probe(state.bootstrap_servers)
        assert localkafka.status(state_dir) == state
        assert localkafka.up(state_dir) == state, "a second up reuses the running broker"
        assert localkafka.main(["status", "--state-dir", str(state_dir)]) == 0
        assert capsys.readouterr().out.strip() == state.bootstrap_servers
    finally:
        assert localkafka.main(["down", "--state-dir", str(state_dir)]) == 0

    assert localkafka.status(state_dir) is None
    assert not localkafka.probe(state.bootstrap_servers)
    assert localkafka.main(["status", "--state-dir", str(state_dir)]) == 1
    assert localkafka.down(state_dir) is False


def _topics(bootstrap: str) -> set[str]:
    admin = admin_client(settings(bootstrap), client_id="test-localkafka")
    return set(admin.list_topics(timeout=ADMIN_SECONDS).topics)


def _create(bootstrap: str, topic: str) -> None:
    """Create ``topic``. The client goes with the call, its connections closed by it: one the
    broker closed on its way down would hold the broker's port a while (TIME_WAIT)."""
    admin = admin_client(settings(bootstrap), client_id="test-localkafka")
    created = admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)],
                                  operation_timeout=ADMIN_SECONDS)
    created[topic].result()


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    publish(bootstrap, [Record(topic, None, value, partition=0) for value in values], timeout=READ_TIMEOUT)


def _read_all(bootstrap: str, topic: str) -> list[bytes]:
    """Every value of partition 0, read by a consumer of the test's own."""
    reader = TopicReader(bootstrap, [topic], partitions=1)
    try:
        return [record.value or b"" for record in reader.read_to_end(stall=READ_TIMEOUT)]
    finally:
        reader.close()


def test_down_and_up_keep_topics_and_records_unless_reset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "run"
    topic = f"kept-{uuid.uuid4().hex[:8]}"
    values = [f"record-{i}".encode() for i in range(50)]
    try:
        assert localkafka.main(["up", "--state-dir", str(state_dir)]) == 0
        first = localkafka.status(state_dir)
        assert first is not None
        assert f"export KAFKA_BOOTSTRAP_SERVERS={first.bootstrap_servers}" in capsys.readouterr().out.splitlines()
        _create(first.bootstrap_servers, topic)
        _produce(first.bootstrap_servers, topic, values)
        assert localkafka.main(["down", "--state-dir", str(state_dir)]) == 0
        assert not localkafka.probe(first.bootstrap_servers)

        again = localkafka.up(state_dir)
        assert again.pid != first.pid
        assert again.port == first.port, "the same port again, when it is free"
        assert topic in _topics(again.bootstrap_servers)
        assert _read_all(again.bootstrap_servers, topic) == values
        assert localkafka.main(["up", "--reset", "--state-dir", str(state_dir)]) == 1, "not while it runs"
        assert localkafka.down(state_dir)

        assert localkafka.main(["up", "--reset", "--state-dir", str(state_dir)]) == 0
        reset = localkafka.status(state_dir)
        assert reset is not None and topic not in _topics(reset.bootstrap_servers)
    finally:
        localkafka.down(state_dir)
