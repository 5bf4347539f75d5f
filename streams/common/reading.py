"""Reading a topic from its start to its end as it is now: the one loop every process needs.

The applier's and notify's ledgers, the watch bridge's read-back, replay, the cluster-wide
view and the read API each rebuild something from a topic before they start work. They all
need the same three steps — find the partitions (a topic created a moment ago may not be in
the client's metadata yet), assign them from the beginning, read until every partition's
position reaches the end offset taken at the start — and the same guard: a read that makes
no progress for a while is an error, not a hang. librdkafka's consumer serves them all: the
asynchronous processes (the cluster-wide view, the read API) make each call on a thread of
their :class:`Follower`'s own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message
from confluent_kafka import TopicPartition as Assigned
from tenacity import Retrying, retry_if_exception, wait_exponential

from streams.common.kafka_clients import LIBRDKAFKA_LOG, consumer
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
    client: Consumer, topics: Iterable[str], *, wait: float = 60.0, missing_ok: bool = False
) -> list[Assigned]:
    """Every partition of ``topics``, looking again for up to ``wait`` seconds for each; a topic
    still without partitions then is an error, or left out if ``missing_ok``."""
    found: list[Assigned] = []
    deadline = time.monotonic() + wait
    for topic in topics:
        while True:
            listed = client.list_topics(topic, timeout=min(5.0, max(2.0, deadline - time.monotonic())))
            known = listed.topics.get(topic)
            if known is not None and known.error is None and known.partitions:
                found += [Assigned(topic, p) for p in sorted(known.partitions)]
                break
            if time.monotonic() > deadline:
                if missing_ok:
                    break
                raise TopicNotFound(f"topic {topic} has no partitions (does it exist?)")
            time.sleep(METADATA_POLL_SECONDS)  # metadata is not loaded yet
    return found


def assign_from_start(
    client: Consumer, topics: Iterable[str], *, wait: float = 60.0, missing_ok: bool = False
) -> list[Assigned]:
    """Assign every partition of ``topics`` to ``client``, positioned at the beginning."""
    partitions = partitions_of(client, topics, wait=wait, missing_ok=missing_ok)
    if partitions:
        client.assign([Assigned(tp.topic, tp.partition, OFFSET_BEGINNING) for tp in partitions])
    return partitions


def poll_records(client: Consumer, timeout: float, *, max_records: int = FOLLOW_BATCH,
                 ends: dict[Assigned, int] | None = None) -> list[Received]:
    """What has arrived, at most ``max_records``, waiting up to ``timeout`` seconds for a first
    record. ``ends``: each partition whose end of partition was reached (librdkafka says so when
    the consumer has ``enable.partition.eof``) is given the offset it was reached at."""
    first = client.poll(timeout)
    if first is None:
        return []
    messages = [first]
    if max_records > 1:  # what was fetched behind it, without waiting: consume() waits for all it may take
        messages.extend(client.consume(num_messages=max_records - 1, timeout=0))
    records = []
    for message in messages:
        error = message.error()
        if error is None:
            records.append(received(message))
        elif error.code() == KafkaError._PARTITION_EOF:
            if ends is not None:
                ends[Assigned(str(message.topic()), int(message.partition() or 0))] = int(message.offset() or 0)
        elif error.fatal():
            raise KafkaException(error)
        else:  # librdkafka retries on its own
            LIBRDKAFKA_LOG.warning("reading %s: %s", message.topic(), error.str())
    return records


def watermarks(client: Consumer, partitions: list[Assigned], *, timeout: float) -> dict[Assigned, tuple[int, int]]:
    """The first and the end offset of each of ``partitions``, asked of the broker, each
    within ``timeout`` seconds. An answer the broker cannot give yet (a broker just started,
    a leader moving) is asked for again until then.

    Those ``client`` is assigned are paused meanwhile: a fetch long-poll in flight would hold
    each query behind it (half a second a partition). Better still, ask before assigning: a
    partition paused while librdkafka looks up where it begins hands over its first record
    half a second late."""
    assigned = {Assigned(tp.topic, tp.partition) for tp in client.assignment()}
    paused = [tp for tp in partitions if Assigned(tp.topic, tp.partition) in assigned]
    if paused:
        client.pause(paused)
    try:
        return {tp: _asked(client, tp, timeout=timeout) for tp in partitions}
    finally:
        if paused:
            client.resume(paused)


def _asked(client: Consumer, tp: Assigned, *, timeout: float) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    for attempt in Retrying(retry=retry_if_exception(_retriable), reraise=True,
                            stop=lambda _: time.monotonic() >= deadline,
                            wait=wait_exponential(multiplier=0.05, max=1.0)):
        with attempt:
            return client.get_watermark_offsets(tp, timeout=max(deadline - time.monotonic(), 0.1))
    raise AssertionError("unreachable: Retrying returns or raises")


# What a broker answers while it cannot say yet. librdkafka marks none of them retriable here.
NOT_YET = frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART,
                     KafkaError.OFFSET_NOT_AVAILABLE, KafkaError.UNKNOWN_LEADER_EPOCH,
                     KafkaError.FENCED_LEADER_EPOCH, KafkaError._TRANSPORT,
                     # librdkafka's own metadata, not refreshed yet after a broker's restart
                     KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC})


def _retriable(error: BaseException) -> bool:
    return isinstance(error, KafkaException) and error.args[0].code() in NOT_YET


def read_to_end(
    client: Consumer,
    partitions: Iterable[Assigned],
    *,
    stall: float = 30.0,
    stop: threading.Event | None = None,
) -> Iterator[Received]:
    """The records of ``partitions`` from their positions up to their end offsets as they are
    now. Records written meanwhile are not yielded, and not skipped either: the client is left
    at the first of them, for its next read (a ledger that reads on would otherwise lose
    them). ``TimeoutError`` after ``stall`` seconds without a record while a partition is
    short of its end; ends early when ``stop`` is set.

    A partition ``client`` is not assigned yet is assigned from its beginning, its offsets
    asked first: asked after, while librdkafka looks up where the partition begins, the first
    record comes half a second later (a ledger's first read, a watch bridge's read-back).

    A partition is at its end once a record at or past the end offset comes, or librdkafka
    reports the end of the partition there (``enable.partition.eof``: past transaction
    markers too, which are never handed over as records)."""
    partitions = [Assigned(tp.topic, tp.partition) for tp in partitions]
    if not partitions:
        return
    assigned = {Assigned(tp.topic, tp.partition) for tp in client.assignment()}
    marks = watermarks(client, partitions, timeout=stall)  # the new ones asked before they are assigned
    if new := [tp for tp in partitions if tp not in assigned]:
        client.incremental_assign([Assigned(tp.topic, tp.partition, OFFSET_BEGINNING) for tp in new])
    ends = {tp: end for tp, (_, end) in marks.items()}
    # Where each partition is: past the last record handed over; none yet, at its first (the
    # end of a partition reported earlier moves no position).
    at = {tp: tp.offset if tp.offset >= 0 else marks[tp][0] for tp in client.position(partitions)}
    short = {tp for tp, end in ends.items() if at.get(tp, end) < end}
    progressed = time.monotonic()
    while short:
        if stop is not None and stop.is_set():
            return
        reached: dict[Assigned, int] = {}
        records = poll_records(client, POLL_MS / 1000, ends=reached)
        later: set[Assigned] = set()  # partitions whose next record is past their end
        for record in records:
            tp = Assigned(record.topic, record.partition)
            if tp in later:
                continue
            end = ends.get(tp)
            if end is None or record.offset < end:
                yield record
                if end is not None and record.offset + 1 >= end:
                    short.discard(tp)
            else:  # written since the end was taken: the client goes back to it, for next time
                client.seek(Assigned(record.topic, record.partition, record.offset))
                later.add(tp)
                short.discard(tp)
        short -= {tp for tp, offset in reached.items() if offset >= ends.get(tp, 0)}
        if records or reached:
            progressed = time.monotonic()
        elif time.monotonic() - progressed > stall:
            waiting = ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in short))
            raise TimeoutError(f"no record for {stall:.0f}s while reading to the end of {waiting}")


class Follower:
    """A group-less librdkafka consumer for an event loop: every call on one thread of its
    own, one at a time, so a poll in flight is finished before the consumer is closed."""

    def __init__(self, kafka: KafkaSettings, *, client_id: str) -> None:
        self._consumer = consumer(kafka, client_id=client_id)
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
        """Assign ``partitions`` from their beginning; their end offsets as they are now, asked
        before the assignment: after it, each query waits behind the fetch long-poll in flight
        (half a second a partition, nine seconds of a worker's start)."""
        marks = await self._call(lambda: watermarks(self._consumer, partitions, timeout=10.0))
        ends = {tp: end for tp, (_, end) in marks.items()}
        self._consumer.assign([Assigned(tp.topic, tp.partition, OFFSET_BEGINNING) for tp in partitions])
        return ends

    async def poll(self, timeout: float) -> list[Received]:
        """What has arrived, waiting up to ``timeout`` seconds for a first record."""
        records: list[Received] = await self._call(poll_records, self._consumer, timeout)
        return records

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
