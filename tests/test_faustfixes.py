"""Three of the worker's fixes to Faust (streams/worker/faustfixes.py), without a broker: the
in-memory tables drop the rows of partitions given away, written or recovered (fix 3), each
record is handed over as Faust's race would hand it, without its tasks when the callback
does not wait (fix 4), and each batch waits as long as the batch before says (fix 5)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import faust
import pytest
from faust.types import TP
from mode import Service
from mode.utils.locks import Event

from streams.common.settings import WorkerSettings
from streams.worker.app import batch_window
from streams.worker.faustfixes import App, PartitionTrackedTable, WorkerConsumer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Any:
    sent: list[tuple[int | None, Any]] = []
    # Faust's own send needs a running producer; what is under test is what the store learns.
    monkeypatch.setattr(faust.Table, "send_changelog", lambda self, partition, key, value, *a, **k: sent.append((partition, key)))
    app = App("faustfixes-test", broker="kafka://127.0.0.1:9", store="memory://")
    made = app.Table("rows", key_type=str, value_type=bytes, partitions=4)
    assert isinstance(made, PartitionTrackedTable)
    return made


async def test_rows_written_in_a_partition_given_away_are_dropped_after_the_rebalance(table: Any) -> None:
    for partition, key in ((0, "node/a"), (3, "node/b")):
        table.data[key] = b"row"
        table.send_changelog(partition, key, b"row")
    changelog = table.changelog_topic.get_topic_name()
    await table.data.on_recovery_completed({TP(changelog, 0)}, set())  # partition 3 went to another instance
    assert "node/a" in table.data
    assert "node/b" not in table.data


async def test_without_the_partition_a_written_row_would_stay(table: Any) -> None:
    """What Faust's store does on its own: a row it did not recover is kept, whatever its partition."""
    table.data["node/b"] = b"row"  # written, but its partition never told to the store
    changelog = table.changelog_topic.get_topic_name()
    await table.data.on_recovery_completed({TP(changelog, 0)}, set())
    assert "node/b" in table.data


# ---------------------------------------------------------------- fix 4: the hand-over of each record


class _Flow(Service):
    """What ``WorkerConsumer._deliver`` reads of its consumer: mode's ``Service`` (its
    ``wait_first``, its stop and crash events) and a flow that a rebalance suspends."""

    _deliver = vars(WorkerConsumer)["_deliver"]  # the consumer's own, run on what it reads of one

    def __init__(self) -> None:
        super().__init__()
        self.suspend_flow = Event()
        self.raced = 0  # how often Faust's race was run

    async def wait_first(self, *coros: Any, timeout: Any = None) -> Any:
        self.raced += 1
        return await super().wait_first(*coros, timeout=timeout)


async def test_a_callback_that_does_not_wait_is_delivered_without_the_race() -> None:
    flow, delivered = _Flow(), []

    async def callback(message: Any) -> None:
        delivered.append(message)

    await flow._deliver(callback, "m1")
    assert delivered == ["m1"] and flow.raced == 0


async def test_a_callback_that_waits_goes_on_from_its_wait_with_what_it_waited_for() -> None:
    flow, delivered = _Flow(), []
    room: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def callback(message: Any) -> None:
        delivered.append((message, await room, await asyncio.sleep(0, "after")))

    handing = asyncio.ensure_future(flow._deliver(callback, "m1"))
    await asyncio.sleep(0)
    assert not handing.done() and delivered == []  # it waits for room in the queue
    room.set_result("room")
    await handing
    assert delivered == [("m1", "room", "after")] and flow.raced == 1


async def test_a_waiting_callback_is_abandoned_when_the_flow_is_suspended_as_faust_abandons_it() -> None:
    flow, ended = _Flow(), []
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def callback(message: Any) -> None:
        try:
            await never
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    handing = asyncio.ensure_future(flow._deliver(callback, "m1"))
    await asyncio.sleep(0)
    flow.suspend_flow.set()  # a rebalance begins
    await asyncio.wait_for(handing, 5)
    assert ended == ["cancelled"]


@pytest.mark.parametrize("waits_first", [False, True])
async def test_a_callback_that_fails_fails_the_hand_over(waits_first: bool) -> None:
    flow = _Flow()

    async def callback(message: Any) -> None:
        if waits_first:
            await asyncio.sleep(0)
        raise ValueError("undecodable")

    with pytest.raises(ValueError, match="undecodable"):
        await flow._deliver(callback, "m1")
    assert flow.raced == (1 if waits_first else 0)


async def test_while_the_flow_is_suspended_it_is_faust_s_race_as_it_is() -> None:
    flow, delivered = _Flow(), []
    flow.suspend_flow.set()

    async def callback(message: Any) -> None:
        delivered.append(message)

    await flow._deliver(callback, "m1")
    assert flow.raced == 1


# ---------------------------------------------------------------- fix 5: batches under a backlog


# Faust's agent test context leaves an event loop of its own open when it is done, which the
# suite's warnings-as-errors would blame on a later test: the stream runs in a process of its own.
_BATCHES = """
import asyncio, json
from streams.worker.faustfixes import App, take_events

async def main():
    app = App("faustfixes-batches", broker="kafka://127.0.0.1:9", store="memory://", loop=asyncio.get_running_loop())
    topic = app.topic("inputs", value_type=bytes, value_serializer="raw")
    batches, asked = [], []

    def window(last):
        asked.append(last)
        return 0.01

    @app.agent(topic)
    async def decide(stream):
        async for events in take_events(stream, 3, window):
            batches.append([event.value.decode() for event in events])

    async with decide.test_context() as agent:
        for value in range(7):
            await agent.put(str(value).encode())
        for _ in range(500):  # a batch closes at its window's end: poll for the last one
            if sum(map(len, batches)) == 7:
                break
            await asyncio.sleep(0.01)
    print(json.dumps({"batches": batches, "asked": asked}))

asyncio.run(main())
"""


def test_batches_are_at_most_max_in_order_each_waiting_as_the_batch_before_says() -> None:
    run = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", _BATCHES],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["batches"] == [["0", "1", "2"], ["3", "4", "5"], ["6"]]
    assert seen["asked"][:4] == [0, 3, 3, 1]  # the first batch waits as after none


@pytest.mark.parametrize(("last", "waits"), [(0, 0.005), (1, 0.005), (99, 0.005), (100, 0.025), (500, 0.025)])
def test_a_batch_waits_long_only_after_a_batch_of_a_fifth_of_batch_size(last: int, waits: float) -> None:
    assert batch_window(WorkerSettings(batch_size=500, batch_seconds=0.005, busy_batch_seconds=0.025), last) == waits
