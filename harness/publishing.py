"""Publish scenario lines (the ``simulate`` input format) to Kafka, keeping their time.

Each record's Kafka timestamp is the line's own time, which is the time the worker
decides with — so a scenario decided by the worker and by ``simulate`` agree. With
``shift_to_now`` the whole scenario is moved to start now (gaps kept): brokers refuse
timestamps far in the future (``message.timestamp.after.max.ms``, one hour by default),
and the worker's wall-clock timer must see drain deadlines come due.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from streams.cli.simulating import EPOCH, input_time
from streams.common.durable import DurableProducer, Record
from streams.common.settings import KafkaSettings


def scenario_records(lines: Iterable[str], *, shift_to_now: bool = False) -> list[tuple[str, str | None, bytes, int]]:
    """(topic, key, value bytes, timestamp ms) for each line, in order."""
    parsed = [json.loads(text) for text in lines if text.strip()]
    times: list[datetime] = []
    previous = EPOCH
    for line in parsed:
        previous = input_time(line, previous)
        times.append(previous)
    shift = timedelta(0)
    if shift_to_now and times:
        shift = datetime.now(UTC) - times[0]
    records = []
    for line, at in zip(parsed, times, strict=True):
        value: Any = line.get("value")
        if isinstance(value, dict) and shift:
            value = _shifted(value, shift)
        raw = value.encode() if isinstance(value, str) else json.dumps(value).encode()
        records.append((line["topic"], line.get("key"), raw, int((at + shift).timestamp() * 1000)))
    return records


def _shifted(value: dict[str, Any], shift: timedelta) -> dict[str, Any]:
    shifted = dict(value)
    for field in ("requested_at", "observed_at"):
        if isinstance(shifted.get(field), str):
            at = datetime.fromisoformat(shifted[field].replace("Z", "+00:00")) + shift
            shifted[field] = at.isoformat().replace("+00:00", "Z")
    return shifted


def publish(kafka: KafkaSettings, records: Iterable[tuple[str, str | None, bytes, int]]) -> int:
    """Send records in order with an idempotent producer; returns how many were sent.

    Each run of records of one topic is sent at once, and acknowledged before the next run:
    records of two topics have no order of their own, and a scenario's intent must not reach
    the worker before the watch events of the VM it names. Within a topic the idempotent
    producer keeps each partition's order."""
    client = DurableProducer(kafka, client_id="vmstream-publish", timeout=30)
    sent = 0
    try:
        for topic, run in itertools.groupby(records, key=lambda record: record[0]):
            # raises what the broker said, e.g. a timestamp out of range
            sent += len(client.send_all([Record(_topic(kafka, topic), key.encode() if key else None, value,
                                                timestamp_ms=timestamp_ms) for _, key, value, timestamp_ms in run]))
    finally:
        client.close()
    return sent


def _topic(kafka: KafkaSettings, name: str) -> str:
    """Scenario files name default topics; honour a configured prefix."""
    default = KafkaSettings().topic_prefix
    return kafka.topic(name.removeprefix(default)) if name.startswith(default) else name
