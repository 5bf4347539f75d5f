"""Two of the worker's fixes to Faust (streams/worker/faustfixes.py), deterministically: the
in-memory tables drop the rows of partitions given away, written or recovered (fix 3), and
each record is handed over as Faust's race would hand it, without its tasks when the
callback does not wait (fix 4)."""

from __future__ import annotations

import asyncio
from typing import Any

import faust
import pytest
from faust.types import TP
from mode import Service
from mode.utils.locks import Event

from streams.worker.faustfixes import App, PartitionTrackedTable, WorkerConsumer


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

    _deliver = WorkerConsumer._deliver

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
