"""How long does a worker take to get through hostile input, and does it lose anything?

A worker decides a small AZ; then N hostile records of every class (``harness/hostile.py``:
tombstones, invalid UTF-8, JSON nested 100k deep, 5,000-digit numbers, values up to the
broker's limit, oversized keys and fields, keys naming another object, a rule's own error)
are published on the intents and k8s-events topics, interleaved with M valid intents.
Counted by this script's own consumer: valid intents without an audit record (must be 0),
dead letters and rejections against those expected, records dead-lettered twice, and the
time from the first record sent until the last expected output arrived.

    .venv/bin/python benchmarks/hostile_input.py [--hostile 10000] [--valid 2200] [--big-every 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
from kafka import KafkaConsumer, KafkaProducer, TopicPartition  # noqa: E402

from harness.hostile import Hostile, interleaved, valid_intent  # noqa: E402
from harness.running import Deployment, WorkerProcess  # noqa: E402
from harness.scenarios import cluster  # noqa: E402


class Reader:
    """Audit records and dead letters as they arrive, reduced to what is counted."""

    def __init__(self, deployment: Deployment) -> None:
        kafka = deployment.kafka
        self.audit, self.dlq = kafka.topic("audit"), kafka.topic("dlq")
        self.consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, enable_auto_commit=False,
                                      max_partition_fetch_bytes=2_000_000)
        partitions = [TopicPartition(t, p) for t in (self.audit, self.dlq) for p in range(kafka.partitions)]
        self.consumer.assign(partitions)
        self.consumer.seek_to_beginning(*partitions)
        self.refs: Counter[str] = Counter()
        self.sources: Counter[tuple[str, int, int]] = Counter()
        self.largest = 0
        self.last_arrival = time.monotonic()

    def poll(self) -> None:
        for records in self.consumer.poll(timeout_ms=200).values():
            for record in records:
                self.last_arrival = time.monotonic()
                self.largest = max(self.largest, len(record.value) + len(record.key or b""))
                value = json.loads(record.value)
                if record.topic == self.audit:
                    self.refs[value["input"]["ref"]] += 1
                else:
                    source = value["source"]
                    self.sources[(source["topic"], source["partition"], source["offset"])] += 1


def run(bootstrap: str, hostile: int, valid: int, big_every: int, window: float) -> dict[str, Any]:
    deployment = kit.new_deployment(bootstrap, Path(tempfile.mkdtemp(prefix="vmstream-hostile-")))
    reader = Reader(deployment)
    worker = WorkerProcess(deployment, "w1").start()
    try:
        lines = list(cluster().jsonl())
        deployment.publish_lines(lines)
        deadline = time.monotonic() + 120
        while sum(reader.refs.values()) < len(lines):
            if time.monotonic() > deadline:
                raise SystemExit("the AZ was not decided in 120 s")
            reader.poll()
        out = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=1_100_000)
        sends: list[tuple[Hostile, Any]] = []
        valid_ids: list[str] = []
        started = time.monotonic()
        for _, item in interleaved(hostile, valid, big_every=big_every):
            if isinstance(item, Hostile):
                sends.append((item, out.send(deployment.kafka.topic(item.topic), key=item.key, value=item.value)))
            else:
                key, value, intent_id = valid_intent(item)
                out.send(deployment.kafka.topic("intents"), key=key, value=value)
                valid_ids.append(intent_id)
            if len(sends) % 500 == 0:
                reader.poll()  # keep the reader's fetches going while publishing
        out.flush()
        published = time.monotonic() - started
        placed = [(h, f.get(timeout=60)) for h, f in sends]
        out.close()
        letters = {(deployment.kafka.topic(h.topic), m.partition, m.offset) for h, m in placed
                   if h.fate == "dead_letter"}
        rejections = {h.ref for h, _ in placed if h.fate == "rejected" and h.ref is not None}

        def through() -> bool:
            return (all(reader.refs[i] for i in valid_ids) and all(reader.refs[r] for r in rejections)
                    and all(reader.sources[s] for s in letters))

        deadline = time.monotonic() + window
        while not through() and time.monotonic() < deadline:
            reader.poll()
        got_through = reader.last_arrival - started if through() else None
        log = worker.log.read_text(errors="replace")
        return {
            "hostile": len(placed), "valid": len(valid_ids), "published_s": published,
            "through_s": got_through,
            "valid_lost": sum(1 for i in valid_ids if not reader.refs[i]),
            "valid_twice": sum(1 for i in valid_ids if reader.refs[i] > 1),
            "dead_letters_expected": len(letters), "dead_letters_seen": sum(reader.sources[s] > 0 for s in letters),
            "dead_lettered_twice": sum(reader.sources[s] > 1 for s in letters),
            "rejections_expected": len(rejections), "rejections_seen": sum(reader.refs[r] > 0 for r in rejections),
            "big_records": sum(1 for h, _ in placed if h.big),
            "largest_output": reader.largest, "agent_crashes": log.count("Crashed"),
            "worker_running": worker.process is not None and worker.process.poll() is None,
            "load_average": os.getloadavg(),
        }
    finally:
        worker.stop()
        reader.consumer.close()
        deployment.delete_topics()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hostile", type=int, default=10_000, help="hostile records (default 10,000)")
    parser.add_argument("--valid", type=int, default=None, help="valid intents (default 22 %% of --hostile)")
    parser.add_argument("--big-every", type=int, default=20,
                        help="the classes over 100 kB in one round of every N (default 20)")
    parser.add_argument("--window", type=float, default=600.0, help="seconds to wait for every output")
    kit.add_json_option(parser)
    kit.add_small_option(parser, hostile=300, big_every=3)
    args = kit.parse(parser)
    valid = args.valid if args.valid is not None else args.hostile * 22 // 100
    with ExitStack() as stack:
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        figures = run(bootstrap, args.hostile, valid, args.big_every, args.window)
    through = figures["through_s"]
    print(f"{figures['hostile']:,} hostile records ({figures['big_records']:,} over 100 kB) among "
          f"{figures['valid']:,} valid intents, published in {figures['published_s']:.1f} s")
    print("time to get through: " + (f"{through:.1f} s" if through is not None else
                                     f"NOT THROUGH within {args.window:.0f} s"))
    print(f"valid intents lost: {figures['valid_lost']}  (audited twice: {figures['valid_twice']})")
    print(f"dead letters: {figures['dead_letters_seen']:,} of {figures['dead_letters_expected']:,} expected "
          f"(a record dead-lettered twice: {figures['dead_lettered_twice']}); rejections: "
          f"{figures['rejections_seen']:,} of {figures['rejections_expected']:,}")
    print(f"largest output: {figures['largest_output']:,} bytes; agent crashes: {figures['agent_crashes']}; "
          f"worker still running: {figures['worker_running']}")
    kit.print_load("at the end")
    kit.write_json(args.json, figures)
    ok = (through is not None and figures["valid_lost"] == 0 and figures["dead_lettered_twice"] == 0
          and figures["dead_letters_seen"] == figures["dead_letters_expected"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
