"""A producer that sends a batch of records and returns once the broker has every one.

The applier publishes what each command came to before it commits the command's offset
(streams/kube/applying/), and the worker its journal, messages and table rows before
its inputs are acknowledged (streams/worker/app.py): every send waits for ``acks=all``.
kafka-python does that in Python, on a sender thread and an I/O thread of its own, which
cost the applier more CPU per command than the API call it records; aiokafka does it on the
worker's event loop, beside the decisions (benchmarks/README.md, apply_rate.py). librdkafka
(confluent-kafka) does it in C, outside the GIL. Idempotent, as every producer of
vmstream's: a retried send never writes a record twice.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
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


REPORT_POLL_SECONDS = 0.1  # the reporting thread's longest wait for a delivery report (it wakes on one)


@dataclass(frozen=True, slots=True)
class Record:
    """One record to send: bytes as they go on the wire. ``value`` None is a tombstone;
    ``partition`` None: the key's (murmur2); ``timestamp_ms`` None: when it is sent."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()
    partition: int | None = None
    timestamp_ms: int | None = None


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

    def __init__(self, kafka: KafkaSettings, *, client_id: str, timeout: float = DELIVERY_SECONDS,
                 linger_ms: int = 0, compression: str | None = None) -> None:
        """``linger_ms``: how long a record waits for others to share its request (0: a batch
        is sent as a whole already); ``compression``: each request's codec (the broker's size
        limit then applies to the compressed batch)."""
        self.timeout = timeout
        self._producer = Producer({
            **librdkafka_options(kafka),
            "client.id": client_id,
            "enable.idempotence": True,  # acks=all, and retries that never duplicate or reorder
            # A record lost for good behind others that were written (a gap in a key's results)
            # is a fatal error of the producer, every later send fails: never a silent gap.
            "enable.gapless.guarantee": True,
            "partitioner": "murmur2_random",  # the Java client's murmur2; a record without a key anywhere
            "linger.ms": linger_ms,
            **({"compression.type": compression} if compression else {}),
            "message.max.bytes": MAX_REQUEST_BYTES,
            "request.timeout.ms": int(min(REQUEST_SECONDS, timeout) * 1000),
            "delivery.timeout.ms": int(timeout * 1000),
        }, logger=LIBRDKAFKA_LOG)
        # ``deliver``'s batches, and the thread that serves their delivery reports (started at
        # the first ``deliver``).
        self._pending: set[_Batch] = set()
        self._futures: set[Future[Delivered]] = set()  # ``send``'s, until reported
        self._reporter: threading.Thread | None = None
        self._closing = threading.Event()

    def send_all(self, records: Sequence[Record]) -> list[Delivered]:
        """Send ``records`` and wait until the broker has acknowledged every one; where each
        landed, in the order given. Raises :class:`NotDelivered` when any was not written."""
        outcomes = self.send_each(records)
        failed = [(record, outcome) for record, outcome in zip(records, outcomes, strict=True)
                  if not isinstance(outcome, Delivered)]
        if failed:
            record, why = failed[0]
            raise NotDelivered(f"{len(failed)} of {len(records)} records not written; "
                               f"first: {record.topic}, {_size(record)} bytes: {why}")
        return [outcome for outcome in outcomes if isinstance(outcome, Delivered)]

    def send_each(self, records: Sequence[Record]) -> list[Delivered | str]:
        """Send ``records``, wait until the broker has acknowledged them: for each, in the
        order given, where it landed or why it was not written — so that a caller sends
        again only what failed, and nothing twice.

        Safe from several threads at once, and beside ``deliver``'s reporting thread: each
        call waits until its own records are reported — by whichever thread serves the
        reports — not on the producer's queue length alone, which counts everyone's."""
        reports: list[Delivered | str | None] = [None] * len(records)  # None: not reported yet

        def report(index: int) -> Any:
            def delivered(error: KafkaError | None, message: Message) -> None:
                reports[index] = _outcome(error, message)
            return delivered

        unsent = f"not acknowledged in {self.timeout:g}s"
        for index, record in enumerate(records):
            refused = self._produce(record, report(index))
            if refused is not None:  # else its report may come at once, on another thread
                reports[index] = refused
        deadline = time.monotonic() + self.timeout
        try:
            while None in reports and (left := deadline - time.monotonic()) > 0:
                if self._producer.flush(left) == 0 and None in reports:
                    self._producer.poll(0.001)  # another thread is reporting the last of ours
        except Exception as error:
            # The producer failed for good (a gap it will not leave: a record the broker
            # refused). confluent-kafka raises that out of flush, the batch's reports cut
            # short: what was not reported is not written, and every later send fails too.
            unsent = f"the producer failed: {error.__cause__ or error}"
        return [unsent if outcome is None else outcome for outcome in reports]

    async def deliver(self, records: Sequence[Record]) -> list[Delivered | str]:
        """:meth:`send_each` from an event loop: the records are queued on the loop's thread
        (a few µs each, in C) and their reports served by a thread of this producer's, which
        wakes the loop once, when the batch's last report is in. Batches of several callers
        (the worker's route and decide stages) are waited for each on its own: no flush, which
        would wait for the other's records too."""
        if not records:
            return []
        batch = _Batch(len(records), asyncio.get_running_loop())
        self._pending.add(batch)
        try:
            for index, record in enumerate(records):
                refused = self._produce(record, batch.reporter(index))
                if refused is not None:
                    batch.report(index, refused)
            self._start_reporting()
            try:
                await asyncio.wait_for(asyncio.shield(batch.done), self.timeout)
            except TimeoutError:
                pass
        finally:
            self._pending.discard(batch)
        return batch.outcomes(f"not acknowledged in {self.timeout:g}s")

    def send(self, record: Record) -> Future[Delivered]:
        """Queue one record; the future is resolved, on the reporting thread, with where it
        landed, or fails with :class:`NotDelivered`. For a caller that goes on meanwhile (the
        watch bridge: its next events are sent before this one is acknowledged)."""
        future: Future[Delivered] = Future()
        self._futures.add(future)

        def delivered(error: KafkaError | None, message: Message) -> None:
            _settle(future, _outcome(error, message))
            self._futures.discard(future)

        refused = self._produce(record, delivered)
        if refused is not None:
            _settle(future, refused)
            self._futures.discard(future)
        self._start_reporting()
        return future

    def _start_reporting(self) -> None:
        if self._reporter is None:
            self._reporter = threading.Thread(target=self._serve_reports, name="vmstream-delivery-reports", daemon=True)
            self._reporter.start()

    def _serve_reports(self) -> None:
        while not self._closing.is_set():
            try:
                self._producer.poll(REPORT_POLL_SECONDS)
            except Exception as error:  # failed for good: confluent-kafka raises it, the reports cut short
                why = f"the producer failed: {error.__cause__ or error}"
                for batch in list(self._pending):
                    batch.fail(why)
                for future in list(self._futures):
                    _settle(future, why)
                    self._futures.discard(future)
                self._closing.wait(REPORT_POLL_SECONDS)

    def _produce(self, record: Record, on_delivery: Any) -> str | None:
        """Queue one record: None, or why it was refused at once."""
        options: dict[str, Any] = {"headers": list(record.headers), "on_delivery": on_delivery}
        if record.partition is not None:
            options["partition"] = record.partition
        if record.timestamp_ms is not None:
            options["timestamp"] = record.timestamp_ms
        for _ in range(2):
            try:
                self._producer.produce(record.topic, record.value, record.key, **options)
                return None
            except BufferError:  # the local queue is full: let it drain, then once more
                self._producer.flush(self.timeout)
            except KafkaException as error:  # refused at once (too large, unknown topic)
                return str(error)
        return f"the producer's queue stayed full for {self.timeout:g}s"

    def close(self) -> None:
        """Send what is queued (for at most the delivery timeout)."""
        self._closing.set()
        if self._reporter is not None:
            self._reporter.join()
        self._producer.flush(self.timeout)


class _Batch:
    """One ``deliver``'s records: their reports, filled in on the reporting thread, and the
    future its caller awaits, resolved on the caller's loop when the last report is in."""

    def __init__(self, size: int, loop: asyncio.AbstractEventLoop) -> None:
        self.reports: list[Delivered | str | None] = [None] * size
        self.loop = loop
        self.done: asyncio.Future[None] = loop.create_future()
        self._left = size
        self._lock = threading.Lock()  # reports may come on two threads (a flush of _produce)

    def reporter(self, index: int) -> Any:
        def delivered(error: KafkaError | None, message: Message) -> None:
            self.report(index, _outcome(error, message))
        return delivered

    def report(self, index: int, outcome: Delivered | str) -> None:
        self.reports[index] = outcome
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def fail(self, why: str) -> None:
        """The producer failed for good: whatever is not reported was not written."""
        for index, outcome in enumerate(self.reports):
            if outcome is None:
                self.reports[index] = why
        self._finish()

    def outcomes(self, unsent: str) -> list[Delivered | str]:
        return [unsent if outcome is None else outcome for outcome in self.reports]

    def _finish(self) -> None:
        try:
            self.loop.call_soon_threadsafe(_resolve, self.done)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


def _settle(future: Future[Delivered], outcome: Delivered | str) -> None:
    try:
        if isinstance(outcome, Delivered):
            future.set_result(outcome)
        else:
            future.set_exception(NotDelivered(outcome))
    except InvalidStateError:  # settled already, by the other thread that could
        pass


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def _outcome(error: KafkaError | None, message: Message) -> Delivered | str:
    """A delivery report as ``send_each`` and ``deliver`` give it: where the record landed,
    or why it was not written."""
    if error is not None:
        return str(error.str())
    partition, offset = message.partition(), message.offset()
    return Delivered(str(message.topic()), -1 if partition is None else partition, -1 if offset is None else offset)


def _size(record: Record) -> int:
    return len(record.value or b"")
