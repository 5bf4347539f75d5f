"""``vmstream simulate``: the decision engine over a file of inputs, no Kafka, no cluster.

JSON Lines in (``{"topic", "key", "value", "timestamp"?}``), JSON Lines out
(``{"topic", "key", "value"}``), state in memory. The clock is the inputs' own time, and
due drain deadlines fire before each input, exactly as the worker's timer would have fired
them — so the same input always gives byte-identical output.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any, TextIO

import pydantic_core

from handlers.contracts.topics import INTENTS, ROUTED_INPUTS
from handlers.core.decisions import Output
from handlers.core.state import MemoryState
from handlers.decide.engine import Engine, Result
from handlers.decide.inputs import DeadlineTick, InputKind, ResidentInput, Source, routed_input
from streams.common.settings import KafkaSettings

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
SIMULATION_INPUT = "simulate-input"


def parse_time(value: Any) -> datetime | None:
    """An ISO 8601 time with its zone (``Z`` too), else None."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def input_time(line: dict[str, Any], previous: datetime) -> datetime:
    """The input's timestamp, else its value's ``requested_at``/``observed_at``, else the last."""
    value = line.get("value")
    parsed = parse_time(line.get("timestamp"))
    if parsed is None and isinstance(value, dict):
        parsed = parse_time(value.get("requested_at")) or parse_time(value.get("observed_at"))
    return previous if parsed is None else max(parsed, previous)  # time never runs backwards


class Simulation:
    """The engine with in-memory state; feed it inputs, collect its output lines."""

    def __init__(self, engine: Engine, kafka: KafkaSettings | None = None) -> None:
        self.engine = engine
        self.kafka = kafka or KafkaSettings()
        self.state = MemoryState()
        self.now = EPOCH
        # A line's kind by its topic, as the worker's route names it on the routed topic.
        self._inputs: dict[str, InputKind] = {self.kafka.topic(topic): "intent" if topic is INTENTS else "event"
                                              for topic in ROUTED_INPUTS}

    def feed(self, lines: Iterable[str]) -> Iterator[str]:
        for number, text in enumerate(lines, start=1):
            if text.strip():
                yield from self.feed_line(text, number)

    def feed_line(self, text: str, number: int) -> Iterator[str]:
        try:
            line = parse_line(text)
            if not isinstance(line, dict) or line.get("topic") not in self._inputs:
                raise ValueError(f"expected {{topic, key, value}} with topic one of {sorted(self._inputs)}")
        except ValueError as exc:
            letter = self.engine.dead_letter(text, f"input line {number}: {exc}",
                                             Source(SIMULATION_INPUT, None, None, number), self.now)
            outputs = self._settle(letter)
        else:
            self.now = input_time(line, self.now)
            outputs = self.step(line["value"], Source(line["topic"], line.get("key")), self.now)
        for output in outputs:
            yield render(self.kafka.topic(output.topic), output.key, output.value)

    def step(self, value: Any, source: Source, now: datetime) -> list[Output]:
        """Decide one input at ``now``: due deadlines first, then the input itself."""
        self.now = max(self.now, now)
        outputs = self.tick(self.now)
        for result in self.engine.decide(self.state, routed_input(self._inputs[source.topic], value, source, self.now)):
            outputs += self._settle(result)
        return outputs

    def tick(self, now: datetime) -> list[Output]:
        """Every drain deadline due at ``now``, each node's decided on the same state."""
        if not self.engine.due(self.state, now):
            return []  # the common case, asked before every input
        return [output for result in self.engine.decide(self.state, DeadlineTick(now))
                for output in self._settle(result)]

    def _settle(self, result: Result) -> list[Output]:
        """Apply a result, then decide what it told the nodes, depth first."""
        self.state.apply(result.decision.changes)
        outputs = result.outputs()
        for update in result.decision.forwards:
            for forwarded in self.engine.decide(self.state, ResidentInput(update, self.now)):
                outputs += self._settle(forwarded)
        return outputs


def parse_line(text: str) -> Any:
    """A line's JSON: pydantic-core's parser, faster than ``json`` and sharing the strings
    that repeat (keys, kinds, names) as the worker's does; ``json`` again for a line it
    refuses, so a line ``json`` reads is read the same and one it refuses too is refused in
    its words (the dead letter quotes them)."""
    try:
        return pydantic_core.from_json(text)
    except ValueError:
        return json.loads(text)


def render(topic: str, key: str, value: Any) -> str:
    """One output line; the value's JSON comes straight from pydantic."""
    return f'{{"topic":{json.dumps(topic)},"key":{json.dumps(key)},"value":{value.model_dump_json(exclude_none=True)}}}'


def run(engine: Engine, source: TextIO, sink: TextIO, kafka: KafkaSettings | None = None) -> int:
    simulation = Simulation(engine, kafka)
    for line in simulation.feed(source):
        sink.write(line)
        sink.write("\n")
    return 0
