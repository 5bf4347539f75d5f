"""Reading a topic from its start to its end as it is now: the one loop every process needs.

The applier's and notify's ledgers, the watch bridge's read-back, replay, the cluster-wide
view and the read API each rebuild something from a topic before they start work. They all
need the same three steps — find the partitions (a topic created a moment ago may not be in
the client's metadata yet), assign them from the beginning, read until every partition's
position reaches the end offset taken at the start — and the same guard: a read that makes
no progress for a while is an error, not a hang. kafka-python's consumer serves the
synchronous processes, aiokafka's the asynchronous ones.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as AsyncTopicPartition
from kafka import KafkaConsumer, TopicPartition

METADATA_POLL_SECONDS = 0.2  # how often to look again for a topic's partitions
POLL_MS = 500


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


async def partitions_of_async(consumer: AIOKafkaConsumer, topic: str, *, wait: float = 5.0) -> list[AsyncTopicPartition]:
    """Every partition of ``topic``, asking the broker again for up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        ids = consumer.partitions_for_topic(topic)
        if ids:
            return [AsyncTopicPartition(topic, p) for p in sorted(ids)]
        if time.monotonic() > deadline:
            raise TopicNotFound(f"topic {topic} has no partitions (does it exist?)")
        await consumer._client.force_metadata_update()  # aiokafka fetches a topic's metadata lazily
        await asyncio.sleep(0.1)  # metadata refresh interval


async def follow_from_start(
    consumer: AIOKafkaConsumer, topics: Iterable[str], caught_up: asyncio.Event, *, poll_ms: int = POLL_MS
) -> AsyncIterator[list[Any]]:
    """The records of ``topics`` from the beginning, forever, one list per poll (empty when
    nothing came within ``poll_ms``). ``caught_up`` is set once the caller has taken every
    record up to the end offsets found at the start (at once for empty topics)."""
    partitions = [tp for topic in topics for tp in await partitions_of_async(consumer, topic)]
    consumer.assign(partitions)
    await consumer.seek_to_beginning(*partitions)
    backlog = {tp: end for tp, end in (await consumer.end_offsets(partitions)).items() if end > 0}
    if not backlog:
        caught_up.set()
    while True:
        batches = await consumer.getmany(timeout_ms=poll_ms)
        yield [record for records in batches.values() for record in records]
        if not caught_up.is_set():  # the caller has taken this poll's records
            positions = {tp: await consumer.position(tp) for tp in backlog}
            if all(positions[tp] >= end for tp, end in backlog.items()):
                caught_up.set()
