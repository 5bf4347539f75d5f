"""The tests' own readers and writers of topics, on librdkafka as every process of vmstream's.

A test reads what vmstream wrote with a :class:`TopicReader` (group-less, assigned whole
topics from their beginning: streams/common/kafka_clients.py's consumer and
streams/common/reading.py's loop) and writes its inputs with :func:`publish`
(streams/common/durable.py's producer: ``acks=all``, keys partitioned by murmur2).
:func:`murmur2_partition` is Kafka's default partitioner, computed here on its own, so
that a test can say where the Java client would put a key without asking a client.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING
from confluent_kafka import TopicPartition as Assigned

from streams.common.durable import Delivered, DurableProducer, Record
from streams.common.group_reading import Partition
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client, consumer
from streams.common.reading import Received, partitions_of, poll_records, read_to_end, watermarks
from streams.common.settings import KafkaSettings

__all__ = ["Delivered", "Received", "Record", "TopicReader", "murmur2", "murmur2_partition", "publish", "settings",
           "stored_bytes"]


def settings(kafka: KafkaSettings | str) -> KafkaSettings:
    """``kafka`` as settings: bootstrap servers alone are a plain-text broker's."""
    return kafka if isinstance(kafka, KafkaSettings) else KafkaSettings(bootstrap_servers=kafka)


class TopicReader:
    """Every record of ``topics`` from their beginning, as they grow: a consumer that joins no
    group and commits nothing. ``partitions``: how many each topic has (else asked of the
    broker); ``committed_only``: read as ``read_committed`` (else every record written, as
    the default of the Java client); ``config``: other librdkafka options; ``missing_ok``: a
    topic not there yet is not an error, :meth:`assigned` looks for it again."""

    def __init__(self, kafka: KafkaSettings | str, topics: Iterable[str], *, partitions: int | None = None,
                 committed_only: bool = False, config: dict[str, Any] | None = None,
                 missing_ok: bool = False, client_id: str = "vmstream-tests") -> None:
        isolation = "read_committed" if committed_only else "read_uncommitted"
        self.consumer = consumer(settings(kafka), client_id=client_id,
                                 config={"isolation.level": isolation, **(config or {})})
        self.topics = list(topics)
        self.partitions: list[Assigned] = []
        self._eof: dict[Assigned, int] = {}  # where each partition's end was last reported
        if partitions is None:
            self._assign(partitions_of(self.consumer, self.topics, wait=0.0 if missing_ok else 60.0,
                                       missing_ok=missing_ok))
        else:
            self._assign([Assigned(topic, p) for topic in self.topics for p in range(partitions)])

    def _assign(self, partitions: list[Assigned]) -> None:
        """Read ``partitions`` from their beginning too, those already read left as they are."""
        new = [tp for tp in partitions if tp not in self.partitions]
        if new:
            self.partitions += new
            self.consumer.incremental_assign([Assigned(tp.topic, tp.partition, OFFSET_BEGINNING) for tp in new])

    def assigned(self) -> bool:
        """Whether every topic has been found, and is read; those not yet are looked for again."""
        found = {tp.topic for tp in self.partitions}
        if any(topic not in found for topic in self.topics):
            self._assign(partitions_of(self.consumer, self.topics, wait=0.0, missing_ok=True))
            found = {tp.topic for tp in self.partitions}
        return all(topic in found for topic in self.topics)

    def poll(self, timeout: float) -> list[Received]:
        """What has arrived, waiting up to ``timeout`` seconds for a first record."""
        return poll_records(self.consumer, timeout, ends=self._eof)

    def read_to_end(self, *, stall: float = 30.0) -> list[Received]:
        """Every record from the reader's positions up to the topics' end offsets as they are
        now (``TimeoutError`` after ``stall`` seconds without one while short of them)."""
        return list(read_to_end(self.consumer, self.partitions, stall=stall))

    def ends(self, *, timeout: float = 30.0) -> dict[Partition, int]:
        """Each partition's end offset as it is now: the offset its next record will take."""
        partitions = [Assigned(tp.topic, tp.partition) for tp in self.partitions]
        marks = watermarks(self.consumer, partitions, timeout=timeout)
        return {Partition(tp.topic, tp.partition): end for tp, (_, end) in marks.items()}

    def positions(self) -> dict[Partition, int]:
        """The next offset to read of each partition: past every record and control record
        read, or where its end was reported; -1 while neither."""
        listed = self.consumer.position([Assigned(tp.topic, tp.partition) for tp in self.partitions])
        at = {}
        for tp in listed:
            key = Assigned(tp.topic, tp.partition)
            at[Partition(tp.topic, tp.partition)] = tp.offset if tp.offset >= 0 else self._eof.get(key, -1)
        return at

    def caught_up(self, ends: dict[Partition, int]) -> bool:
        """Whether every partition of ``ends`` is read up to its offset there."""
        at = self.positions()
        return all(end <= 0 or at.get(tp, -1) >= end for tp, end in ends.items())

    def close(self) -> None:
        self.consumer.close()


def publish(kafka: KafkaSettings | str, records: Sequence[Record], *, timeout: float = 30.0,
            client_id: str = "vmstream-tests") -> list[Delivered]:
    """Write ``records`` and return once the broker has every one (``acks=all``): where each
    landed. Keys without a partition go where the Java client puts them (murmur2)."""
    producer = DurableProducer(settings(kafka), client_id=client_id, timeout=timeout)
    try:
        return producer.send_all(records)
    finally:
        producer.close()


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (``org.apache.kafka.common.utils.Utils.murmur2``), its 32 bits unsigned."""
    seed, m, r = 0x9747B28C, 0x5BD1E995, 24
    length = len(data)
    h = (seed ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = length % 4
    base = length - tail
    if tail == 3:
        h ^= data[base + 2] << 16
    if tail >= 2:
        h ^= data[base + 1] << 8
    if tail >= 1:
        h ^= data[base]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def murmur2_partition(key: bytes, partitions: int) -> int:
    """Where the Java client's default partitioner (and librdkafka's ``murmur2``) puts ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


# DescribeLogDirs (API key 35), version 1: the last before the flexible encoding; every broker
# since Kafka 1.1 answers it.
_DESCRIBE_LOG_DIRS, _VERSION = 35, 1


def stored_bytes(kafka: KafkaSettings | str, topic: str, *, timeout: float = ADMIN_SECONDS) -> int:
    """What the brokers store of ``topic``: its log segments' size, batches as compressed.

    librdkafka has no DescribeLogDirs, so the request is sent here, to each broker over a
    plain-text connection of its own (the tests' brokers'), its answer read as the protocol
    lays it out (https://kafka.apache.org/protocol#The_Messages_DescribeLogDirs)."""
    metadata = admin_client(settings(kafka), client_id="vmstream-tests").list_topics(topic, timeout=timeout)
    partitions = sorted(metadata.topics[topic].partitions)
    name = topic.encode()
    body = (struct.pack(">i", 1) + struct.pack(">h", len(name)) + name
            + struct.pack(">i", len(partitions)) + b"".join(struct.pack(">i", p) for p in partitions))
    client_id = b"vmstream-tests"
    request = struct.pack(">hhih", _DESCRIBE_LOG_DIRS, _VERSION, 1, len(client_id)) + client_id + body
    total = 0
    for broker in metadata.brokers.values():
        with socket.create_connection((broker.host, broker.port), timeout=timeout) as connection:
            connection.sendall(struct.pack(">i", len(request)) + request)
            answer = _Answer(_read_exactly(connection, struct.unpack(">i", _read_exactly(connection, 4))[0]))
        answer.take(">i")  # the correlation id
        answer.take(">i")  # throttle time
        for _ in range(answer.take(">i")):
            error, log_dir = answer.take(">h"), answer.string()
            if error:
                raise RuntimeError(f"DescribeLogDirs: broker {broker.id}, {log_dir}: error {error}")
            for _ in range(answer.take(">i")):
                stored = answer.string()
                for _ in range(answer.take(">i")):
                    _partition, size, _lag, _future = answer.take(">iqqb")
                    if stored == topic:
                        total += size
    return total


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the broker closed the connection mid-answer")
        data += chunk
    return data


class _Answer:
    """A response read front to back."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, layout: str) -> Any:
        values = struct.unpack_from(layout, self.data, self.at)
        self.at += struct.calcsize(layout)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        size = self.take(">h")
        text = self.data[self.at:self.at + size].decode()
        self.at += size
        return text
