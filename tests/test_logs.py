"""Structured logs carry the ids a reader searches by."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from harness.localkafka import LocalKafka
from streams.common.logs import JsonFormatter, RateLimit


def test_extra_fields_become_top_level_keys() -> None:
    record = logging.LogRecord("streams.worker.app", logging.INFO, __file__, 1, "decided %s", ("now",), None)
    record.ref = "it-1"
    record.outcome = "accepted"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "decided now" and line["level"] == "info"
    assert (line["ref"], line["outcome"], line["logger"]) == ("it-1", "accepted", "streams.worker.app")
    assert line["at"].endswith("Z")


def _record(name: str, msg: str = "Unable connect to node with id %s: %s", level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, (1, "refused"), None)


def test_client_lines_are_held_to_a_few_per_period_and_counted() -> None:
    now = [0.0]
    limit = RateLimit(period=10.0, burst=3, clock=lambda: now[0])
    passed = [limit.filter(_record("aiokafka")) for _ in range(1000)]
    assert passed.count(True) == 3 and passed[:3] == [True, True, True]
    # Another kind of trouble, and our own lines, still show.
    assert limit.filter(_record("aiokafka", "Unable to update metadata from %s"))
    assert all(limit.filter(_record("streams.kube.applying", "command %s: %s", logging.INFO)) for _ in range(100))
    assert limit.filter(_record("kafka.net.manager", "Connection failed: %s", logging.ERROR))
    now[0] = 10.0  # the next period: the first line says what was held back
    first = _record("aiokafka")
    assert limit.filter(first)
    assert vars(first)["suppressed"] == 997  # set by the filter on the record it lets through
    assert first.getMessage().endswith("[997 more like this not logged in 10s]")
    assert json.loads(JsonFormatter().format(first))["suppressed"] == 997
    nxt = _record("aiokafka")
    assert limit.filter(nxt) and not hasattr(nxt, "suppressed")


OUTAGE_CLIENTS = """
import asyncio, logging, logging.config, sys, threading, time
from streams.common.logs import logging_config
logging.config.dictConfig(logging_config("INFO"))
from aiokafka import AIOKafkaConsumer
from streams.common.kafka_clients import consumer as librdkafka_consumer
from streams.common.settings import KafkaSettings

bootstrap, topic = sys.argv[1], sys.argv[2]

def blocking() -> None:
    consumer = librdkafka_consumer(KafkaSettings(bootstrap_servers=bootstrap), group_id=topic + "-rd")
    consumer.subscribe([topic])
    while True:
        consumer.poll(0.5)

async def main() -> None:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=topic + "-aio")
    await consumer.start()
    threading.Thread(target=blocking, daemon=True).start()
    print("CONNECTED", file=sys.stderr, flush=True)
    while True:
        try:
            await consumer.getmany(timeout_ms=500)
        except Exception as error:
            logging.getLogger("aiokafka").error("getmany: %s", error)

asyncio.run(main())
"""


@pytest.mark.kafka
def test_a_broker_outage_logs_at_a_bounded_rate(tmp_path: Path) -> None:
    """Two consumers (aiokafka, librdkafka) lose their broker for 20 s: without the limit,
    some 1,400 lines; with it, at most a few per kind and period."""
    outage = 20.0
    broker = LocalKafka()
    bootstrap = broker.start()
    stderr = tmp_path / "clients.log"
    try:
        with stderr.open("w") as sink:
            clients = subprocess.Popen(
                [sys.executable, "-c", OUTAGE_CLIENTS, bootstrap, f"outage-{uuid.uuid4().hex[:8]}"],
                stderr=sink, cwd=Path(__file__).resolve().parent.parent,
            )
        try:
            deadline = time.monotonic() + 60
            while "CONNECTED" not in stderr.read_text():
                assert clients.poll() is None, stderr.read_text()
                assert time.monotonic() < deadline, "the clients never connected"
                time.sleep(0.1)  # polling interval
            broker.stop()
            before = len(stderr.read_text().splitlines())
            ends = time.monotonic() + outage
            while time.monotonic() < ends:  # the outage itself: the clients log meanwhile
                assert clients.poll() is None, stderr.read_text()[-2000:]
                time.sleep(0.5)  # polling interval
            lines = [json.loads(line) for line in stderr.read_text().splitlines()[before:] if line.startswith("{")]
        finally:
            clients.kill()
            clients.wait()
    finally:
        broker.stop()
    kinds = {(line["logger"], line["level"], line["message"][:40]) for line in lines}
    assert any(line.get("suppressed") for line in lines), "the outage produced no repeated lines at all"
    # burst 5 per 10 s per kind: three periods at most in 20 s, plus a margin for kinds
    # whose message text varies (the template is the kind, the text is what we see).
    assert len(lines) <= 5 * 3 * len(kinds) and len(lines) <= 250, (len(lines), sorted(kinds))
