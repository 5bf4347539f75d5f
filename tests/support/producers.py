"""A durable producer that sends nothing: it keeps what it is given, for tests of code that
publishes through :class:`streams.common.durable.DurableProducer` without a broker."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from streams.common.durable import Delivered, DurableProducer, Record


class KeptRecords(DurableProducer):
    """Every record sent, in order, each reported at offset -1 (the broker said nothing)."""

    def __init__(self) -> None:  # no librdkafka producer: nothing leaves the process
        self.records: list[Record] = []

    def send_all(self, records: Sequence[Record]) -> list[Delivered]:
        self.records += records
        return [Delivered(record.topic, -1, -1) for record in records]

    def send(self, record: Record) -> Future[Delivered]:
        [delivered] = self.send_all([record])
        future: Future[Delivered] = Future()
        future.set_result(delivered)
        return future

    def close(self) -> None:
        return None
