"""A member of a consumer group on librdkafka: the applier reads its commands with it, notify
its notifications.

kafka-python 3.0.12 stalls a member for good when a short ``poll()`` runs out while the group
is joining: the join finished a millisecond after the poll gave up, the next poll went
straight to fetching, and that fetch never returned (the member's IO thread idle in
``select``, the caller waiting on it in ``NetworkSelector.run``). The broker dropped the
member after its session; the applier applied nothing more and said nothing. The applier's
loop polls for 20 ms while commands are in flight, and the group's first join is followed by
a second one at once (the leader's metadata moves on): half the runs of
``tests/e2e/test_kubevirt_cases.py`` stalled so. librdkafka runs the group protocol on
threads of its own, outside the GIL, and a poll's timeout ends only that poll.

Two other things come with it. The rebalance callbacks run inside :meth:`GroupReader.poll`,
on the caller's thread, so a partition taken away is committed there and then, the commit
waited for (kafka-python ran its listener on its network thread, where a commit cannot be
waited for). And the records are parsed in C.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from streams.common import metrics
from streams.common.kafka_clients import LIBRDKAFKA_LOG, librdkafka_options
from streams.common.reading import Received as Received  # what a poll hands over
from streams.common.reading import received
from streams.common.settings import KafkaSettings

log = logging.getLogger(__name__)
TOPIC_WAIT_SECONDS = 60.0  # how long a subscribed topic may take to show its partitions
PREFETCH_KIB = 8192  # what librdkafka fetches ahead, all partitions together
# What a held fetch waits for (``fetch_wait_ms``): some 50 of the applier's commands (1.2 kB sealed).
FETCH_MIN_BYTES = 64 * 1024
LAG_QUERY_SECONDS = 5.0  # where a partition just assigned starts: its committed offset, else its first


class Partition(NamedTuple):
    """One partition of a topic: the key of what is read and committed."""

    topic: str
    partition: int


Callback = Callable[[list[Partition]], None]


class GroupReader:
    """Subscribe ``topic`` in ``group_id``; read, and commit what the caller says is done.

    ``on_revoke`` is called with the partitions about to be taken away (a rebalance, or
    :meth:`close`), ``on_assign`` with those given (either may be left out), both from inside :meth:`poll` or
    :meth:`close`: the caller's own thread. Partitions lost instead (the session ran out)
    go to ``on_revoke`` too; a commit there fails, and is only a warning.

    ``fetch_wait_ms`` 0 (librdkafka's default): the broker answers a fetch at the first
    record, so records arriving one by one cost a fetch request each. Otherwise it holds a
    fetch until :data:`FETCH_MIN_BYTES` have come or that many milliseconds have passed: a
    record arriving alone waits up to that long, records in a stream come several to a
    request (benchmarks/README.md, ``apply_rate.py``).
    """

    def __init__(self, kafka: KafkaSettings, *, group_id: str, client_id: str, topic: str,
                 on_revoke: Callback | None = None, on_assign: Callback | None = None,
                 membership: dict[str, Any] | None = None, fetch_wait_ms: int = 0,
                 topic_wait: float = TOPIC_WAIT_SECONDS) -> None:
        self.topic = topic
        self._positions: dict[Partition, int] = {}  # the next offset to read, where known: the lag's
        self._lag_query_at = 0.0  # monotonic: when the start of a partition may be asked again
        self._consumer = Consumer({
            **librdkafka_options(kafka),
            "group.id": group_id,
            "client.id": client_id,
            "enable.auto.commit": False,  # committed by the caller, past what it has published
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            # The Java client's and kafka-python's default: a group of older appliers agrees.
            "partition.assignment.strategy": "range",
            # What librdkafka fetches ahead, for all partitions together: its default is 64 MiB,
            # kafka-python held a fetch of at most 1 MiB per partition.
            "queued.max.messages.kbytes": PREFETCH_KIB,
            **({"fetch.min.bytes": FETCH_MIN_BYTES, "fetch.wait.max.ms": fetch_wait_ms} if fetch_wait_ms else {}),
            "on_commit": _log_failed_commit,
            **(membership or {}),
        }, logger=LIBRDKAFKA_LOG)
        self._wait_for_topic(topic_wait)
        self._consumer.subscribe([topic], on_assign=self._told(on_assign, "assigned"),
                                 on_revoke=self._told(on_revoke, "revoked"), on_lost=self._told(on_revoke, "lost"))

    def _told(self, callback: Callback | None, what: str) -> Callable[[Any, list[TopicPartition]], None]:
        def told(_: Any, tps: list[TopicPartition]) -> None:
            partitions = _partitions(tps)
            for tp in partitions:
                self._positions.pop(tp, None)
            log.info("partitions %s: %s", what, ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "none")
            if callback is not None:
                callback(partitions)
        return told

    def _wait_for_topic(self, timeout: float) -> None:
        """Wait for the topic to be listed with partitions: a member subscribed before the
        group's leader knows the topic is assigned nothing until a metadata refresh (kafka-python
        asked again five minutes later), and a topic that never comes is an error at start,
        not a member idle for good."""
        deadline = time.monotonic() + timeout
        while True:
            listed = self._consumer.list_topics(self.topic, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            found = listed.topics.get(self.topic)
            if found is not None and found.error is None and found.partitions:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"topic {self.topic} has no partitions after {timeout:g}s")
            time.sleep(0.2)

    def poll(self, timeout: float, max_records: int) -> dict[Partition, list[Received]]:
        """What has arrived, at most ``max_records``, each partition's in offset order;
        waits up to ``timeout`` seconds for a first record. Rebalance callbacks run here."""
        # consume() waits for all of num_messages or the timeout, not for a first record:
        # a command arriving alone would wait the whole timeout. poll() returns with the first
        # one, and consume() without a timeout takes what has been fetched behind it.
        first = self._consumer.poll(timeout)
        if first is None:
            return {}
        messages = [first]
        if max_records > 1:
            messages.extend(self._consumer.consume(num_messages=max_records - 1, timeout=0))
        batch: dict[Partition, list[Received]] = {}
        for message in messages:
            error = message.error()
            if error is not None:
                if error.fatal():  # its instance id fenced by another member, say: this member is done
                    raise KafkaException(error)
                log.warning("reading %s: %s", self.topic, error.str())  # librdkafka retries on its own
                continue
            tp = Partition(str(message.topic()), int(message.partition() or 0))
            record = received(message)
            batch.setdefault(tp, []).append(record)
            self._positions[tp] = record.offset + 1
        return batch

    def commit(self, offsets: dict[Partition, int], *, wait: bool) -> None:
        """Commit the next offset to read of each partition. Without ``wait`` the caller goes
        on meanwhile; a commit lost (a rebalance, a crash) only means records read again."""
        if not offsets:
            return
        listed = [TopicPartition(tp.topic, tp.partition, offset) for tp, offset in offsets.items()]
        try:
            if wait:
                for tp in self._consumer.commit(offsets=listed, asynchronous=False) or []:
                    if tp.error is not None:
                        log.warning("commit of %s[%d] failed (partition moved?): %s", tp.topic, tp.partition, tp.error)
            else:
                self._consumer.commit(offsets=listed, asynchronous=True)
        except KafkaException as error:  # a rebalance took the partition: the caller's ledger covers it
            log.warning("commit failed (partition moved?): %s", error)

    def record_lag(self) -> None:
        """Lag of each assigned partition: the highwater of the last fetch response minus the
        offset past the last record returned. A partition nothing was read from yet starts at
        its committed offset (else its first): asked of the broker once per assignment."""
        assigned = self._consumer.assignment()
        unknown = [tp for tp in assigned if Partition(tp.topic, tp.partition) not in self._positions]
        if unknown and time.monotonic() >= self._lag_query_at:
            try:
                for tp in self._consumer.committed(unknown, timeout=LAG_QUERY_SECONDS):
                    start = tp.offset
                    if start < 0:  # nothing committed: read from the first offset (auto.offset.reset)
                        start, _ = self._consumer.get_watermark_offsets(tp, timeout=LAG_QUERY_SECONDS)
                    self._positions[Partition(tp.topic, tp.partition)] = start
            except KafkaException as error:  # the broker away: the lag waits, the loop does not
                log.debug("where the partitions start is not known yet: %s", error)
                self._lag_query_at = time.monotonic() + LAG_QUERY_SECONDS
        for tp in assigned:
            _, high = self._consumer.get_watermark_offsets(tp, cached=True)
            metrics.set_lag(tp.topic, tp.partition, high if high >= 0 else None,
                            self._positions.get(Partition(tp.topic, tp.partition)))

    def close(self) -> None:
        """Leave the group: ``on_revoke`` runs once more, for the partitions still held."""
        self._consumer.close()


def _partitions(tps: Sequence[TopicPartition]) -> list[Partition]:
    return [Partition(tp.topic, tp.partition) for tp in tps]


def _log_failed_commit(error: KafkaError | None, partitions: Sequence[TopicPartition]) -> None:
    if error is not None:
        log.warning("commit failed (partition moved?): %s", error.str())
