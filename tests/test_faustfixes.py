"""One of the worker's fixes to Faust (streams/worker/faustfixes.py), without a broker: the
in-memory tables drop the rows of partitions given away, written or recovered (fix 3)."""

from __future__ import annotations

from typing import Any

import faust
import pytest
from faust.types import TP

from streams.worker.faustfixes import App, PartitionTrackedTable


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

