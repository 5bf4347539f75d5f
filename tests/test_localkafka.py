"""The local broker is a real Kafka: records round-trip, transactions commit and abort,
and ``up`` / ``status`` / ``down`` manage a background broker across calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streams import localkafka
from tests.kafka_broker import TopicFactory

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
