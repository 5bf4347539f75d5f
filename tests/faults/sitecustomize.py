"""Test-only fault: the first fetch answers before the seek to the committed offsets returns.

Put this directory first on ``PYTHONPATH`` of a worker process and set
``VMSTREAM_TEST_SEEK_DELAY`` (seconds). ``Consumer.perform_seek`` then returns only once
more messages than an agent takes in one batch (500) have been delivered to the agents'
queues since the seek, or after that many seconds: what a busy broker does to the seek
Faust makes at the end of table recovery. It turns an
upstream race that loses the batch fetched meanwhile (``streams/faustfixes.py``) from
occasional into regular, so the test of the fix fails without it.
"""

import asyncio
import os

_delay = float(os.environ.get("VMSTREAM_TEST_SEEK_DELAY", "0") or 0)
_MORE_THAN_A_BATCH = 1000


def _read_since(now: dict, before: dict) -> int:
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

    Consumer.perform_seek = _seek_overtaken_by_a_fetch  # type: ignore[method-assign]
