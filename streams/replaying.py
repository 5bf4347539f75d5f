"""``vmstream replay``: decide the recorded inputs again and compare with the audit stream.

The audit stream is the record: replaying the inputs (intents and watch events, from the
beginning, in time order) through the same handlers must reproduce it — the same audit
ids with the same outcomes, reasons, commands and notifications. A difference means a
decision was not a function of its inputs (or the record was altered). With another
``--config`` the same replay answers "what if the policy had been different?".

Audit records of command results (written by the applier, from what the API server
answered) cannot be re-decided offline and are left out of the comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

from kafka import TopicPartition
from kafka.consumer.fetcher import ConsumerRecord

from handlers.decisions import Output
from handlers.engine import Engine, Source
from handlers.messages import AuditRecord
from streams.credentials import key_source
from streams.kafka_clients import consumer
from streams.settings import KafkaSettings, load_settings
from streams.simulating import Simulation

COMPARED = ("outcome", "reason", "commands", "notifications", "input")


def read_topics(kafka: KafkaSettings, topics: list[str], *, idle_seconds: float = 30.0) -> Iterator[ConsumerRecord]:
    """Every committed record of ``topics`` up to their end offsets now (a bounded read)."""
    client = consumer(kafka, enable_auto_commit=False, isolation_level="read_committed")
    try:
        partitions = [
            TopicPartition(topic, p) for topic in topics for p in sorted(client.partitions_for_topic(topic) or ())
        ]
        client.assign(partitions)
        client.seek_to_beginning(*partitions)
        ends = {tp: end for tp, end in client.end_offsets(partitions).items() if end > 0}
        last_progress = time.monotonic()
        while ends:
            for tp, records in client.poll(timeout_ms=500).items():
                last_progress = time.monotonic()
                yield from (record for record in records if record.offset < ends.get(tp, 0))
            ends = {tp: end for tp, end in ends.items() if client.position(tp) < end}
            if time.monotonic() - last_progress > idle_seconds:
                raise TimeoutError(f"no progress reading {sorted(str(tp) for tp in ends)}")
    finally:
        client.close()


@dataclass
class Comparison:
    matched: int = 0
    missing: list[str] = field(default_factory=list)  # replayed, but not in the record
    unexpected: list[str] = field(default_factory=list)  # in the record, not replayed
    different: list[tuple[str, dict[str, tuple[Any, Any]]]] = field(default_factory=list)
    skipped: int = 0  # applier records

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.different)


def compare(replayed: list[AuditRecord], recorded: list[dict[str, Any]], skip_topics: set[str]) -> Comparison:
    """Match audit records by id. A redelivered decision repeats its id with the same
    content; the same id with other content is a difference (an altered record)."""
    result = Comparison()
    mine = {record.audit_id: record.model_dump(mode="json") for record in replayed}
    theirs: dict[str, list[dict[str, Any]]] = {}
    for record in recorded:
        if record.get("input", {}).get("topic") in skip_topics:
            result.skipped += 1
            continue
        theirs.setdefault(record["audit_id"], []).append(record)
    for audit_id, expected in mine.items():
        if audit_id not in theirs:
            result.missing.append(audit_id)
            continue
        diff = {
            f: (expected.get(f), actual.get(f))
            for actual in theirs[audit_id]
            for f in COMPARED
            if _norm(expected.get(f)) != _norm(actual.get(f))
        }
        if diff:
            result.different.append((audit_id, diff))
        else:
            result.matched += 1
    result.unexpected = [audit_id for audit_id in theirs if audit_id not in mine]
    return result


def _norm(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items() if v is not None}
    return value


class Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total, self.out, self.done = max(total, 1), out, 0
        self.live = out.isatty()

    def step(self, count: int = 1) -> None:
        self.done += count
        if self.live and (self.done % 500 == 0 or self.done == self.total):
            filled = int(30 * self.done / self.total)
            self.out.write(f"\r  replaying [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            self.out.flush()

    def close(self) -> None:
        if self.live:
            self.out.write("\n")


def replay(engine: Engine, kafka: KafkaSettings, out: TextIO) -> Comparison:
    inputs = sorted(
        read_topics(kafka, [kafka.topic("intents"), kafka.topic("k8s-events")]),
        key=lambda r: (r.timestamp, r.topic, r.partition, r.offset),
    )
    recorded = [json.loads(record.value) for record in read_topics(kafka, [kafka.topic("audit")])]
    simulation = Simulation(engine, kafka)
    replayed: list[AuditRecord] = []
    progress = Progress(len(inputs), out)
    for record in inputs:
        key = record.key.decode("utf-8", "replace") if record.key else None
        source = Source(record.topic, key, record.partition, record.offset)
        at = datetime.fromtimestamp(record.timestamp / 1000, UTC)
        replayed += _audits(simulation.step(record.value, source, at))
        progress.step()
    # The worker's timer fired what was due by now; so does the replay.
    replayed += _audits(simulation.tick(datetime.now(UTC)))
    progress.close()
    return compare(replayed, recorded, skip_topics={kafka.topic("commands")})


def _audits(outputs: list[Output]) -> list[AuditRecord]:
    return [o.value for o in outputs if isinstance(o.value, AuditRecord)]


def report(comparison: Comparison, out: TextIO) -> None:
    out.write(
        f"{comparison.matched} decisions reproduced, {len(comparison.different)} different, "
        f"{len(comparison.missing)} missing from the audit stream, {len(comparison.unexpected)} "
        f"recorded but not reproduced ({comparison.skipped} applier records not compared)\n"
    )
    for audit_id, diff in comparison.different[:20]:
        for name, (expected, actual) in diff.items():
            out.write(f"  {audit_id} {name}: replayed {expected!r}, recorded {actual!r}\n")
    for audit_id in comparison.missing[:20]:
        out.write(f"  {audit_id}: replayed, but not in the audit stream\n")
    for audit_id in comparison.unexpected[:20]:
        out.write(f"  {audit_id}: in the audit stream, not reproduced\n")


def main(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    started = time.monotonic()
    comparison = replay(Engine(settings.rules(), keys=key_source(settings.auth)), settings.kafka, sys.stderr)
    report(comparison, sys.stdout)
    sys.stdout.write(f"replayed in {time.monotonic() - started:.1f}s\n")
    return 0 if comparison.clean else 1


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("replay", help="decide the recorded inputs again; diff against the audit stream")
    parser.add_argument("--config", help="the configuration (another one asks: what if the policy differed?)")
    parser.set_defaults(handler=main)
