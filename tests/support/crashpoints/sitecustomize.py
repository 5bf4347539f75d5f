"""Test-only faults, patched into Faust in a worker process.

Put this directory first on ``PYTHONPATH`` of a worker process and set the variable of
the fault wanted.

``VMSTREAM_TEST_CRASH_AFTER_ROWS=<n>``: the process dies (``os._exit(86)``) right after the
*n*-th table row written while deciding an intent has reached the broker: the rows of its
batch up to that one are sent synchronously and acknowledged, and nothing after it. Rows of other inputs (the cluster's
events) do not count. The crash a decision's rows fear most: some of its changelogs have
the decision, others not.

``VMSTREAM_TEST_SLOW_PUBLISH=<seconds>``: the first batch with an intent waits that long
before its messages are published, having created the file named by
``VMSTREAM_TEST_SLOW_PUBLISH_MARK``: a test stops the worker while a batch is in flight.

``VMSTREAM_TEST_SEEK_DELAY`` (seconds): the first fetch answers before the seek to the
committed offsets returns. ``Consumer.perform_seek`` then returns only once
more messages than an agent takes in one batch (500) have been delivered to the agents'
queues since the seek, or after that many seconds: what a busy broker does to the seek
Faust makes at the end of table recovery. It turns an
upstream race that loses the batch fetched meanwhile (``streams/worker/faustfixes.py``) from
occasional into regular, so the test of the fix fails without it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from faust.types import EventT

    from handlers.decide.engine import Result
    from streams.worker.tablestate import Deliver, Row

_delay = float(os.environ.get("VMSTREAM_TEST_SEEK_DELAY", "0") or 0)
_MORE_THAN_A_BATCH = 1000


def _is_intent(event: EventT[Any]) -> bool:
    """An intent, as read from its topic or as the worker routed it (``vmstream-kind: intent``)."""
    message = event.message
    headers = message.headers or {}
    items = headers.items() if isinstance(headers, Mapping) else headers
    return message.topic.endswith(".intents") or any(k == "vmstream-kind" and v == b"intent" for k, v in items)


def _read_since(now: Mapping[Any, int | None], before: Mapping[Any, int | None]) -> int:
    return sum((now.get(tp) or 0) - (at or 0) for tp, at in before.items())

if _delay > 0:
    from faust.transport.consumer import Consumer

    _perform_seek = Consumer.perform_seek

    async def _seek_overtaken_by_a_fetch(self: Consumer) -> None:
        await _perform_seek(self)
        after_seek = dict(self._read_offset)  # the last offset read, per partition
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _delay
        while loop.time() < deadline and _read_since(self._read_offset, after_seek) <= _MORE_THAN_A_BATCH:
            await asyncio.sleep(0.005)

    setattr(Consumer, "perform_seek", _seek_overtaken_by_a_fetch)


CRASH_EXIT_CODE = 86
_crash_after = int(os.environ.get("VMSTREAM_TEST_CRASH_AFTER_ROWS", "0") or 0)

if _crash_after > 0:
    from streams.worker.tablestate import TableState

    _send_rows = TableState.send_rows
    _rows = 0

    def _write_and_die(rows: Sequence[Row]) -> None:
        """Send the rows up to the fatal one ourselves, in order, each acknowledged, and die."""
        from streams.common.durable import DurableProducer, Record
        from streams.common.settings import KafkaSettings

        try:
            kafka = KafkaSettings(bootstrap_servers=os.environ["VMSTREAM_KAFKA__BOOTSTRAP_SERVERS"])
            producer = DurableProducer(kafka, client_id="vmstream-crashpoint", timeout=30)
            for row in rows:
                record = row.record
                producer.send_all([Record(record.topic, record.key, record.value, partition=record.partition)])
        finally:  # the rows written or not (a broker down), the process dies here
            os._exit(CRASH_EXIT_CODE)

    async def _send_rows_then_crash(self: TableState, rows: Sequence[Row], *, deliver: Deliver) -> None:
        global _rows
        for index, row in enumerate(rows):
            if _is_intent(row.event):
                _rows += 1
                if _rows >= _crash_after:
                    _write_and_die(rows[:index + 1])
        await _send_rows(self, rows, deliver=deliver)

    setattr(TableState, "send_rows", _send_rows_then_crash)


_slow_publish = float(os.environ.get("VMSTREAM_TEST_SLOW_PUBLISH", "0") or 0)

if _slow_publish > 0:
    from streams.worker.app import Worker

    _publish = Worker._publish
    _slowed: list[bool] = []

    async def _publish_slowly(self: Worker, decided: list[tuple[EventT[Any], Result]]) -> None:
        if not _slowed and any(_is_intent(event) for event, _ in decided):
            _slowed.append(True)
            with open(os.environ["VMSTREAM_TEST_SLOW_PUBLISH_MARK"], "w"):
                pass
            await asyncio.sleep(_slow_publish)
        await _publish(self, decided)

    setattr(Worker, "_publish", _publish_slowly)
