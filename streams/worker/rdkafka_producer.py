"""The producer of the worker's outputs and journal entries: librdkafka, through confluent-kafka.

aiokafka builds every record and produce request in Python: some 17 µs of CPU per record
here, against 4 µs for librdkafka, which encodes and sends in C on threads of its own
(``benchmarks/README.md``, worker_throughput). The worker writes four records per intent
on this producer (its audit record, command, routed record, journal entry), so it is the
cheaper one for them. Faust keeps its own aiokafka producer for the changelog rows.

Same promises as the aiokafka producer it replaces: ``acks=all`` and idempotence (a retried
send is written once), murmur2 partitioning of keys (``murmur2_random``: the partition Java
and aiokafka give a key), and :meth:`RdProducer.send` returns a future that is resolved once
the broker has the record or has refused it, which ``Worker._deliver`` awaits before the
batch's inputs may be acknowledged.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import confluent_kafka
from mode import Service

POLL_SECONDS = 0.05  # how long one wait for delivery reports lasts, off the event loop


class RecordRefused(Exception):
    """The broker refused a record, or it could not be delivered in time."""


class RdProducer(Service):
    """A librdkafka producer as a Faust dependency: started and stopped with the app."""

    def __init__(self, config: Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = {"acks": "all", "enable.idempotence": True, "partitioner": "murmur2_random",
                       "linger.ms": 1, **config}
        self._producer: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsettled = 0  # records produced whose delivery report has not been handled
        self._reports: list[tuple[asyncio.Future[Any], Any, Any]] = []  # filled by the poller thread
        self._lock = threading.Lock()
        self._wanted = asyncio.Event()
        self._poller = ThreadPoolExecutor(1, thread_name_prefix="rdkafka-reports")  # waits in librdkafka, off the loop

    async def on_start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._producer = confluent_kafka.Producer(self.config)
        self.add_future(self._settle_forever())

    async def on_stop(self) -> None:
        if self._producer is not None:
            await asyncio.get_running_loop().run_in_executor(self._poller, self._producer.flush, 30.0)
            self._settle(self._taken())
        self._poller.shutdown(wait=False)

    async def send(self, topic: str, key: bytes | None, value: bytes | None, partition: int | None,
                   timestamp: float | None, headers: Mapping[str, bytes] | None) -> asyncio.Future[Any]:
        """Queue a record; the future it returns is resolved when the broker has it."""
        assert self._loop is not None and self._producer is not None, "the producer is not started"
        future: asyncio.Future[Any] = self._loop.create_future()

        def delivered(error: Any, message: Any) -> None:  # on librdkafka's poll, in the poller thread
            with self._lock:
                self._reports.append((future, error, message))

        options: dict[str, Any] = {"on_delivery": delivered}
        if partition is not None:
            options["partition"] = partition
        if timestamp:
            options["timestamp"] = int(timestamp * 1000)
        if headers:
            options["headers"] = list(headers.items())
        try:
            self._producer.produce(topic, value, key, **options)
        except BufferError:  # the local queue is full: serve delivery reports, then once more
            await self._loop.run_in_executor(self._poller, self._producer.poll, 1.0)
            self._producer.produce(topic, value, key, **options)
        self._unsettled += 1
        self._wanted.set()
        return future

    async def flush(self) -> None:
        assert self._loop is not None and self._producer is not None
        await self._loop.run_in_executor(self._poller, self._producer.flush)

    def _taken(self) -> list[tuple[asyncio.Future[Any], Any, Any]]:
        with self._lock:
            reports, self._reports = self._reports, []
        return reports

    async def _settle_forever(self) -> None:
        """While records wait for their reports, poll librdkafka off the loop and resolve their futures."""
        assert self._loop is not None
        while True:
            if not self._unsettled:
                self._wanted.clear()
                await self._wanted.wait()
            await self._loop.run_in_executor(self._poller, self._producer.poll, POLL_SECONDS)
            self._settle(self._taken())

    def _settle(self, reports: list[tuple[asyncio.Future[Any], Any, Any]]) -> None:
        self._unsettled -= len(reports)
        for future, error, message in reports:
            if future.done():
                continue
            if error is not None:
                future.set_exception(RecordRefused(str(error)))
            else:
                future.set_result(message)
