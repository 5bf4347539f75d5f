"""A producer that sends a batch of records and returns once the broker has every one.

The applier publishes what each command came to before it commits the command's offset
(streams/kube/applying.py): every send waits for ``acks=all``. kafka-python does that in
Python, on a sender thread and an I/O thread of its own, about 1.3 ms of the applier's CPU
per command (two records) on the benchmark of benchmarks/apply_rate.py, more than the API
call it records; librdkafka (confluent-kafka) does it in C, outside the GIL that the
applier's API calls share. Idempotent, as every producer of vmstream's: a retried send
never writes a record twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from streams.common.kafka_clients import LIBRDKAFKA_LOG, librdkafka_options
from streams.common.settings import KafkaSettings

DELIVERY_SECONDS = 120.0  # a record not acknowledged by then is a failed send (kafka-python's delivery timeout)
REQUEST_SECONDS = 15.0  # one produce request: a hung one leaves time to retry within the delivery timeout
# The largest request, as kafka-python's max_request_size: the broker's default limit on a
# batch is 1,048,588 bytes, and librdkafka's own default (1,000,000) would refuse records that
# kafka-python wrote.
MAX_REQUEST_BYTES = 1_048_576


@dataclass(frozen=True, slots=True)
class Record:
    """One record to send: bytes as they go on the wire."""

    topic: str
    key: bytes | None
    value: bytes
    headers: Sequence[tuple[str, bytes]] = ()


@dataclass(frozen=True, slots=True)
class Delivered:
    """Where the broker put a record (-1: the broker did not say)."""

    topic: str
    partition: int
    offset: int


class NotDelivered(RuntimeError):
    """A record of the batch was refused, or not acknowledged in time: the caller must not
    go on as if it were written (the applier stops before committing its inputs)."""


class DurableProducer:
    """``send_all``: produce a batch, wait for the broker's acknowledgement of every record.

    Keys are partitioned as the Java client and kafka-python do (murmur2), so a key's
    records land where they did before this producer and where any other client puts them.
    """

    def __init__(self, kafka: KafkaSettings, *, client_id: str, timeout: float = DELIVERY_SECONDS) -> None:
        self.timeout = timeout
        self._producer = Producer({
            **librdkafka_options(kafka),
            "client.id": client_id,
            "enable.idempotence": True,  # acks=all, and retries that never duplicate or reorder
            # A record lost for good behind others that were written (a gap in a key's results)
            # is a fatal error of the producer, every later send fails: never a silent gap.
            "enable.gapless.guarantee": True,
            "partitioner": "murmur2_random",  # the Java client's murmur2; a record without a key anywhere
            "linger.ms": 0,  # a batch is sent as a whole already
            "message.max.bytes": MAX_REQUEST_BYTES,
            "request.timeout.ms": int(min(REQUEST_SECONDS, timeout) * 1000),
            "delivery.timeout.ms": int(timeout * 1000),
        }, logger=LIBRDKAFKA_LOG)

    def send_all(self, records: Sequence[Record]) -> list[Delivered]:
        """Send ``records`` and wait until the broker has acknowledged every one; where each
        landed, in the order given. Raises :class:`NotDelivered` when any was not written."""
        reports: list[Delivered | KafkaError | None] = [None] * len(records)

        def report(index: int) -> Any:
            def delivered(error: KafkaError | None, message: Message) -> None:
                partition, offset = message.partition(), message.offset()
                reports[index] = error if error is not None else Delivered(
                    str(message.topic()), -1 if partition is None else partition, -1 if offset is None else offset)
            return delivered

        for index, record in enumerate(records):
            self._produce(record, report(index))
        left = self._producer.flush(self.timeout)
        failed = [(record, outcome) for record, outcome in zip(records, reports, strict=True)
                  if not isinstance(outcome, Delivered)]
        if failed:
            record, outcome = failed[0]
            why = outcome.str() if isinstance(outcome, KafkaError) else f"not acknowledged in {self.timeout:g}s"
            raise NotDelivered(f"{len(failed)} of {len(records)} records not written ({left} still queued); "
                               f"first: {record.topic}, {len(record.value)} bytes: {why}")
        return [outcome for outcome in reports if isinstance(outcome, Delivered)]

    def _produce(self, record: Record, on_delivery: Any) -> None:
        for _ in range(2):
            try:
                self._producer.produce(record.topic, record.value, record.key, headers=list(record.headers),
                                       on_delivery=on_delivery)
                return
            except BufferError:  # the local queue is full: let it drain, then once more
                self._producer.flush(self.timeout)
            except KafkaException as error:  # refused at once (too large, unknown topic)
                raise NotDelivered(f"{record.topic}, {len(record.value)} bytes: {error}") from error
        raise NotDelivered(f"{record.topic}: the producer's queue stayed full for {self.timeout:g}s")

    def close(self) -> None:
        """Send what is queued (for at most the delivery timeout)."""
        self._producer.flush(self.timeout)
