"""The journal's records give back the very results they were made of (no broker needed).

A replayed input's messages are encoded again from what the journal kept, so every field
of every result must survive the trip: checked on every decision of the example scenarios,
dead letters included. Entries too large for one Kafka record are split and joined again;
a record made for another message at the same offset is not replayed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from faust.types import EventT

from handlers.decide.engine import Engine, Result, Source
from streams.common.codecs import encode_message
from harness.locations import REPO_ROOT
from streams.common.durable import Delivered, Record
from streams.common.settings import load_settings
from streams.cli.simulating import Simulation
from streams.worker.tablestate import Journal, input_ref

EXAMPLES = REPO_ROOT / "examples"


def example_results() -> list[Result]:
    engine = Engine(load_settings(EXAMPLES / "config.yaml").rules())
    simulation = Simulation(engine)
    results: list[Result] = []
    settle = simulation._settle

    def keep(result: Result) -> Any:
        results.append(result)
        return settle(result)

    setattr(simulation, "_settle", keep)
    for name in ("drain.jsonl", "gpu-change.jsonl", "maintenance.jsonl"):
        list(simulation.feed((EXAMPLES / name).read_text().splitlines()))
    source = Source("vmstream.intents", "vm/x/y", 3, 17)
    results.append(engine.dead_letter(b"\xff{not json", "not JSON", source, simulation.now))
    return results


@dataclass
class Message:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: float = 1764547200.0


@dataclass(eq=False)
class Event:
    message: Message


def faust_event(message: Message) -> EventT[Any]:
    """An :class:`Event` where the journal takes a Faust event: it reads the message alone,
    and no stand-in can be the whole of Faust's event."""
    return cast("EventT[Any]", Event(message))


class ChangelogTopic:
    def get_topic_name(self) -> str:
        return "app-state-journal-changelog"


@dataclass
class Table:
    """What the journal uses of a Faust table: get, the store, the changelog's name."""

    data: dict[str, bytes] = field(default_factory=dict)
    changelog_topic: ChangelogTopic = field(default_factory=ChangelogTopic)

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def keys(self) -> list[str]:
        return list(self.data)


class Producer:
    """Records what is sent, as the broker would have it at once."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes | None, int | None]] = []

    async def deliver(self, records: Sequence[Record]) -> list[Delivered]:
        placed = []
        for record in records:
            placed.append(Delivered(record.topic, record.partition or 0, len(self.sent)))
            self.sent.append((record.topic, record.key, record.value, record.partition))
        return placed


def wire(result: Result) -> list[tuple[str, str, bytes]]:
    return [(o.topic, o.key, encode_message(o.value)) for o in result.outputs()]


def test_every_result_of_the_examples_comes_back_from_the_journal_unchanged() -> None:
    results = example_results()
    assert len(results) > 50 and any(r.dead_letters for r in results) and any(r.decision.forwards for r in results)
    journal, producer = Journal(Table()), Producer()
    events = [faust_event(Message("t.intents", n % 3, n, b"k", f"input {n}".encode())) for n in range(len(results))]
    asyncio.run(journal.record([(e, [r]) for e, r in zip(events, results)], deliver=producer.deliver, encoded={}))
    for event, result in zip(events, results):
        effects = result.dead_letters or result.decision.changes or result.decision.outputs()
        back = journal.recorded(event)
        if not effects:
            assert back is None
            continue
        assert back == [result]
        assert [wire(r) for r in back] == [wire(result)]  # the same bytes on the wire
    assert {partition for *_, partition in producer.sent} == {0, 1, 2}  # each in its input's partition


@pytest.mark.parametrize("copies", [1, 30])
def test_an_entry_is_split_when_large_and_read_whole(copies: int) -> None:
    """30 results of 20,000 characters each: an entry of some 600 KB, in three parts."""
    [result] = [r for r in example_results() if r.dead_letters]
    result.dead_letters[0] = result.dead_letters[0].model_copy(update={"original": "x" * 20_000})
    results = [result] * copies
    journal, producer = Journal(Table()), Producer()
    event = faust_event(Message("t.intents", 1, 42, b"k", b"v"))
    asyncio.run(journal.record([(event, results)], deliver=producer.deliver, encoded={}))
    assert max(len(value or b"") for _, _, value, _ in producer.sent) <= Journal.PART_BYTES
    assert len(producer.sent) == (1 if copies == 1 else 4)
    assert journal.recorded(event) == results
    if copies > 1:
        del journal.table.data[f"{input_ref(event)}#2"]  # a part never written: the entry is not whole
        assert journal.recorded(event) is None


def test_a_record_is_replayed_only_for_the_message_it_was_made_for() -> None:
    [result] = [r for r in example_results() if r.dead_letters]
    journal = Journal(Table())
    event = faust_event(Message("t.intents", 0, 7, b"k", b"the first message"))
    asyncio.run(journal.record([(event, [result])], deliver=Producer().deliver, encoded={}))
    assert journal.recorded(event) == [result]
    other = faust_event(Message("t.intents", 0, 7, b"k", b"another message at the same offset"))
    assert journal.recorded(other) is None


class TableManager:
    def __init__(self) -> None:
        self.heard: list[dict[Any, int]] = []

    def on_commit(self, offsets: dict[Any, int]) -> None:
        self.heard.append(dict(offsets))


def test_entries_are_deleted_once_the_broker_acknowledged_the_commit_past_them() -> None:
    """Faust's consumer believes in a commit even when it failed; the journal waits for the
    table manager's ``on_commit``, which Faust calls only for commits that succeeded."""
    from faust.types import TP

    [result] = [r for r in example_results() if r.dead_letters]
    journal, manager = Journal(Table(), prune_seconds=0), TableManager()
    journal._hear_commits(manager)
    events = [faust_event(Message("t.intents", 2, offset, b"k", b"v")) for offset in (5, 6, 7)]
    asyncio.run(journal.record([(e, [result]) for e in events], deliver=Producer().deliver, encoded={}))
    assert journal.prune() == []  # nothing committed yet
    manager.on_commit({TP("t.intents", 2): 7, TP("t.intents", 3): 100})
    assert manager.heard == [{TP("t.intents", 2): 7, TP("t.intents", 3): 100}]  # Faust's own call still made
    topic = "app-state-journal-changelog"
    assert journal.prune() == [Record(topic, b'"t.intents:2:5"', None, partition=2),
                               Record(topic, b'"t.intents:2:6"', None, partition=2)]  # keys as Faust's json
    assert list(journal.table.data) == ["t.intents:2:7"]
