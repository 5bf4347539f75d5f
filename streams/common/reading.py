"""Reading a topic from its start to its end as it is now: the one loop every process needs.

The applier's and notify's ledgers, the watch bridge's read-back, replay, the cluster-wide
view and the read API each rebuild something from a topic before they start work. They all
need the same three steps — find the partitions (a topic created a moment ago may not be in
the client's metadata yet), assign them from the beginning, read until every partition's
position reaches the end offset taken at the start — and the same guard: a read that makes
no progress for a while is an error, not a hang. kafka-python's consumer serves the
synchronous processes; the asynchronous ones (the cluster-wide view, the read API) follow a
topic with librdkafka's consumer, each call made on a thread of the follower's own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message
from confluent_kafka import TopicPartition as Assigned
from kafka import KafkaConsumer, TopicPartition

from streams.common.kafka_clients import LIBRDKAFKA_LOG, librdkafka_options
from streams.common.settings import KafkaSettings

METADATA_POLL_SECONDS = 0.2  # how often to look again for a topic's partitions
POLL_MS = 500
FOLLOW_BATCH = 500  # the most records one poll of a follower hands over


@dataclass(frozen=True, slots=True)
class Received:
    """One record read, with where it was read from; ``timestamp`` in ms since the epoch."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]]
    timestamp: int = -1


def received(message: Message) -> Received:
    """A librdkafka message as read: bytes, headers as a list of pairs."""
    offset = message.offset()
    raw = message.headers() or []
    headers = [(name, value if isinstance(value, bytes) else (value or "").encode())
               for name, value in (raw.items() if isinstance(raw, dict) else raw)]
    key, value = message.key(), message.value()
    _, timestamp = message.timestamp()
    return Received(str(message.topic()), int(message.partition() or 0), -1 if offset is None else offset,
                    key if isinstance(key, bytes) else None, value if isinstance(value, bytes) else None, headers,
                    timestamp)


class TopicNotFound(RuntimeError):
    """The topic has no partitions in the broker's metadata (does it exist?)."""


def partitions_of(
    client: KafkaConsumer, topics: Iterable[str], *, wait: float = 60.0, missing_ok: bool = False
) -> list[TopicPartition]:
    """Every partition of ``topics``, looking again for up to ``wait`` seconds for each; a topic
    still without partitions then is an error, or left out if ``missing_ok``."""
    found: list[TopicPartition] = []
    deadline = time.monotonic() + wait
    for topic in topics:
        ids = client.partitions_for_topic(topic)
        while not ids:
            if time.monotonic() > deadline:
                if missing_ok:
                    break
                raise TopicNotFound(f"topic {topic} has no partitions (does it exist?)")
            time.sleep(METADATA_POLL_SECONDS)  # metadata is not loaded yet
            ids = client.partitions_for_topic(topic)
        found += [TopicPartition(topic, p) for p in sorted(ids or ())]
    return found


def assign_from_start(
    client: KafkaConsumer, topics: Iterable[str], *, wait: float = 60.0, missing_ok: bool = False
) -> list[TopicPartition]:
    """Assign every partition of ``topics`` to ``client``, positioned at the beginning."""
    partitions = partitions_of(client, topics, wait=wait, missing_ok=missing_ok)
    if not partitions:
        return []
    client.assign(partitions)
    client.seek_to_beginning(*partitions)
    return partitions


def read_to_end(
    client: KafkaConsumer,
    partitions: Iterable[TopicPartition],
    *,
    stall: float = 30.0,
    stop: threading.Event | None = None,
) -> Iterator[Any]:
    """The records of ``partitions`` from their positions up to their end offsets as they are
    now. Records written meanwhile are not yielded, and not skipped either: the client is left
    at the first of them, for its next read (a ledger that reads on would otherwise lose
    them). ``TimeoutError`` after ``stall`` seconds without a record while a partition is
    short of its end; ends early when ``stop`` is set."""
    partitions = list(partitions)
    if not partitions:
        return
    ends = {tp: end for tp, end in client.end_offsets(partitions).items() if client.position(tp) < end}
    progressed = time.monotonic()
    while ends:
        if stop is not None and stop.is_set():
            return
        batches = client.poll(timeout_ms=POLL_MS)
        for tp, records in batches.items():
            end = ends.get(tp, 0)
            before_end = [record for record in records if record.offset < end]
            if len(before_end) < len(records):  # written since the end was taken: read next time
                client.seek(tp, records[len(before_end)].offset)
            yield from before_end
        if batches:
            progressed = time.monotonic()
        elif time.monotonic() - progressed > stall:
            short = ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in ends))
            raise TimeoutError(f"no record for {stall:.0f}s while reading to the end of {short}")
        ends = {tp: end for tp, end in ends.items() if client.position(tp) < end}


class Follower:
    """A group-less librdkafka consumer for an event loop: every call on one thread of its
    own, one at a time, so a poll in flight is finished before the consumer is closed."""

    def __init__(self, kafka: KafkaSettings, *, client_id: str) -> None:
        # librdkafka wants a group id even for a consumer that is only assigned partitions;
        # nothing is committed under it and it never joins.
        self._consumer = Consumer({
            **librdkafka_options(kafka),
            "group.id": client_id,
            "client.id": client_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        }, logger=LIBRDKAFKA_LOG)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=client_id)

    async def _call(self, call: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, call, *args)

    async def partitions(self, topic: str, *, wait: float = 5.0) -> list[Assigned]:
        """Every partition of ``topic``, asking the broker again for up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while True:
            listed = await self._call(lambda: self._consumer.list_topics(topic, timeout=5.0))
            found = listed.topics.get(topic)
            if found is not None and found.error is None and found.partitions:
                return [Assigned(topic, p) for p in sorted(found.partitions)]
            if time.monotonic() > deadline:
                raise TopicNotFound(f"topic {topic} has no partitions (does it exist?)")
            await asyncio.sleep(0.1)  # metadata refresh interval

    async def assign_from_start(self, partitions: list[Assigned]) -> dict[Assigned, int]:
        """Assign ``partitions`` from their beginning; their end offsets as they are now."""
        self._consumer.assign([Assigned(tp.topic, tp.partition, OFFSET_BEGINNING) for tp in partitions])
        ends = {}
        for tp in partitions:
            _, high = await self._call(lambda tp=tp: self._consumer.get_watermark_offsets(tp, timeout=10.0))
            ends[tp] = high
        return ends

    async def poll(self, timeout: float) -> list[Received]:
        """What has arrived, waiting up to ``timeout`` seconds for a first record."""
        messages: list[Message] = await self._call(self._poll, timeout)
        records = []
        for message in messages:
            error = message.error()
            if error is None:
                records.append(received(message))
            elif error.fatal():
                raise KafkaException(error)
            else:  # librdkafka retries on its own
                LIBRDKAFKA_LOG.warning("reading %s: %s", message.topic(), error.str())
        return records

    def _poll(self, timeout: float) -> list[Message]:
        # consume() with a timeout waits for all it may take: poll() returns at the first
        # record, consume() without one takes what was fetched behind it.
        first = self._consumer.poll(timeout)
        if first is None:
            return []
        return [first, *self._consumer.consume(num_messages=FOLLOW_BATCH - 1, timeout=0)]

    async def positions(self, partitions: Iterable[Assigned]) -> dict[Assigned, int]:
        """The next offset to read of each partition (past control records too); -1001 before
        the first fetch."""
        listed = await self._call(self._consumer.position, [Assigned(tp.topic, tp.partition) for tp in partitions])
        return {Assigned(tp.topic, tp.partition): tp.offset for tp in listed}

    async def close(self) -> None:
        try:
            await self._call(self._consumer.close)
        finally:
            self._thread.shutdown(wait=False)


async def follow_from_start(
    follower: Follower, topics: Iterable[str], caught_up: asyncio.Event, *, poll_ms: int = POLL_MS
) -> AsyncIterator[list[Received]]:
    """The records of ``topics`` from the beginning, forever, one list per poll (empty when
    nothing came within ``poll_ms``). ``caught_up`` is set once the caller has taken every
    record up to the end offsets found at the start (at once for empty topics)."""
    partitions = [tp for topic in topics for tp in await follower.partitions(topic)]
    ends = await follower.assign_from_start(partitions)
    backlog = {tp: end for tp, end in ends.items() if end > 0}
    if not backlog:
        caught_up.set()
    while True:
        yield await follower.poll(poll_ms / 1000)
        if not caught_up.is_set():  # the caller has taken this poll's records
            positions = await follower.positions(backlog)
            if all(positions[tp] >= end for tp, end in backlog.items()):
                caught_up.set()
