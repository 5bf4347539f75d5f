"""The worker's fixes to Faust (streams/worker/faustfixes.py), without a broker: recovery
resumes the input partitions only after flow control has cleared the queues (fix 1),
aiokafka is asked for the partitions active when the call starts (fix 2), and the in-memory
tables drop the rows of partitions given away, written or recovered (fix 3)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import faust
import pytest
from faust.transport.drivers import aiokafka as aiokafka_driver
from faust.tables.manager import TableManager
from faust.types import TP

from streams.worker.faustfixes import App, HeldRecovery, PartitionTrackedTable, WorkerConsumer


class _Consumer:
    """What recovery's end asks of the consumer, each call recorded in order."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def assignment(self) -> set[TP]:
        return {TP("vmstream.routed", 0), TP("vmstream.routed", 1)}

    def resume_partitions(self, tps: set[TP]) -> None:
        self.calls.append(f"resume {len(tps)} partitions")

    async def perform_seek(self) -> None:
        self.calls.append("seek")

    def resume_flow(self) -> None:
        self.calls.append("resume flow")


async def test_recovery_resumes_the_inputs_only_once_flow_control_has_cleared_the_queues() -> None:
    """Faust resumes the inputs, seeks, then resumes flow control, which clears the agents'
    queues: a batch fetched in between would be thrown away unacknowledged."""
    app = App("faustfixes-recovery", broker="kafka://127.0.0.1:9", store="memory://",
              loop=asyncio.get_running_loop())
    calls: list[str] = []
    app.__dict__["_consumer"] = _Consumer(calls)  # the four calls recovery's end makes, recorded
    app.flow_control.resume = lambda: calls.append("clear the queues")  # type: ignore[method-assign]

    async def fetching() -> None:
        calls.append("fetch")

    app.__dict__["_fetcher"] = SimpleNamespace(maybe_start=fetching)  # Faust's fetcher needs a broker
    app.on_rebalance_end = lambda: None  # type: ignore[method-assign]
    tables = app.tables
    assert isinstance(tables, TableManager)
    recovery = tables.recovery
    assert isinstance(recovery, HeldRecovery)
    await recovery._resume_streams(app.consumer_generation_id)
    assert calls == ["seek", "clear the queues", "resume flow", "fetch", "resume 2 partitions"]


async def test_aiokafka_is_asked_for_the_partitions_active_when_the_call_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovery pausing the changelogs empties Faust's live set during the call: aiokafka
    would read the empty set as every partition and return input records Faust then drops."""
    asked: list[set[TP]] = []

    async def getmany(self: Any, active_partitions: set[TP], timeout: float) -> dict[TP, list[Any]]:
        asked.append(active_partitions)
        live.clear()  # recovery pauses the changelogs meanwhile
        return {}

    monkeypatch.setattr(aiokafka_driver.Consumer, "_getmany", getmany)
    consumer = object.__new__(WorkerConsumer)  # only _getmany is under test: no broker, no thread
    vars(consumer)["_thread"] = SimpleNamespace(pace=lambda busy: None)
    live = {TP("vmstream.state-changelog", 0)}
    await consumer._getmany(live, 1.0)
    assert asked == [{TP("vmstream.state-changelog", 0)}]


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

