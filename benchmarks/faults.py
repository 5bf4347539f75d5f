"""Does a fault or a hostile record cost only itself? Lost intents, ids with two contents,
dead letters, time to get through.

- **hostile** — a worker decides a small AZ; then ``--hostile`` records of every class
  (``harness/hostile.py``: tombstones, invalid UTF-8, JSON nested 100k deep, 5,000-digit
  numbers, values up to the broker's limit, oversized keys and fields, keys naming another
  object, a rule's own error) are published on the intents and k8s-events topics, interleaved
  with valid intents (22 % as many). Counted from the worker's outputs: valid intents without
  an audit record (must be 0), dead letters and rejections against those expected, records
  dead-lettered twice, and the time from the first record sent to the last expected output.
- **crashes** — a broker of its own (``LocalKafka``, kept data) and one worker. The AZ of
  ``tests/support/chaos.py`` is decided, then its set_gpu intents (with GPU VMIs arriving and
  drains whose deadlines fire) are published at a steady rate while faults strike at random
  moments, in a shuffled order: the worker killed with SIGKILL and started again; the worker
  replaced by one that dies (``os._exit``) right after the n-th table row of a decision has
  reached the broker (n random in 1..50, ``tests/support/crashpoints/sitecustomize.py``); the
  broker stopped and started again on its data, down for 2–5 s. A worker that exits is
  started again, as Kubernetes would. At the end: the intents without an audit record
  (lost), the command, notification and audit ids seen with two different contents, and how
  long after each SIGKILL the first intent published after it was audited.

    .venv/bin/python benchmarks/faults.py --only hostile     # 10,000 hostile records
    .venv/bin/python benchmarks/faults.py --only crashes     # 3,000 intents, 8 kills, 4 row crashes, 2 broker restarts
    .venv/bin/python benchmarks/faults.py --small            # 300 hostile; 300 intents, 2 kills, 1 row crash, 1 restart
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's; first: it puts the repository on sys.path)

from harness.hostile import Hostile, interleaved, valid_intent  # noqa: E402
from harness.localkafka import LocalKafka, free_ports  # noqa: E402  (a broker of its own, restarted on purpose)
from harness.running import Outputs, WorkerProcess  # noqa: E402
from harness.scenarios import cluster  # noqa: E402
from streams.common.durable import DurableProducer, Record  # noqa: E402
from tests.support.chaos import Ledger, Publisher, Workload, with_faults, worker_env  # noqa: E402


# ------------------------------------------------------------------------ hostile


class Reader:
    """The worker's audit records and dead letters as they arrive, reduced to what is counted."""

    def __init__(self, outputs: Outputs) -> None:
        self.outputs = outputs
        self.refs: Counter[str] = Counter()
        self.sources: Counter[tuple[str, int, int]] = Counter()
        self.largest = 0
        self.last_arrival = time.monotonic()

    def poll(self) -> None:
        for name, raw in self.outputs.poll():
            self.last_arrival = time.monotonic()
            self.largest = max(self.largest, len(raw))
            value = json.loads(raw)
            if name == "audit":
                self.refs[value["input"]["ref"]] += 1
            elif name == "dlq":
                source = value["source"]
                self.sources[(source["topic"], source["partition"], source["offset"])] += 1


def hostile(bootstrap: str, count: int, valid: int, big_every: int, window: float) -> dict[str, Any]:
    deployment = kit.new_deployment(bootstrap, Path(tempfile.mkdtemp(prefix="vmstream-hostile-")))
    outputs = Outputs(deployment)
    reader = Reader(outputs)
    worker = WorkerProcess(deployment, "w1").start()
    try:
        lines = list(cluster().jsonl())
        deployment.publish_lines(lines)
        deadline = time.monotonic() + 120
        while sum(reader.refs.values()) < len(lines):
            if time.monotonic() > deadline:
                raise SystemExit("the AZ was not decided in 120 s")
            reader.poll()
        out = DurableProducer(deployment.kafka, client_id="bench-hostile", linger_ms=5)
        sends: list[tuple[Hostile, Any]] = []
        valid_ids: list[str] = []
        started = time.monotonic()
        for _, item in interleaved(count, valid, big_every=big_every):
            if isinstance(item, Hostile):
                sends.append((item, out.send(Record(deployment.kafka.topic(item.topic), item.key, item.value))))
            else:
                key, value, intent_id = valid_intent(item)
                out.send(Record(deployment.kafka.topic("intents"), key, value))
                valid_ids.append(intent_id)
            if len(sends) % 500 == 0:
                reader.poll()  # keep the reader's fetches going while publishing
        out.close()  # once every record is acknowledged
        published = time.monotonic() - started
        placed = [(h, f.result(timeout=60)) for h, f in sends]
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
        }
    finally:
        worker.stop()
        outputs.close()
        deployment.delete_topics()


def print_hostile(figures: dict[str, Any], window: float) -> bool:
    through = figures["through_s"]
    print(f"{figures['hostile']:,} hostile records ({figures['big_records']:,} over 100 kB) among "
          f"{figures['valid']:,} valid intents, published in {figures['published_s']:.1f} s")
    print("time to get through: " + (f"{through:.1f} s" if through is not None else
                                     f"NOT THROUGH within {window:.0f} s"))
    print(f"valid intents lost: {figures['valid_lost']}  (audited twice: {figures['valid_twice']})")
    print(f"dead letters: {figures['dead_letters_seen']:,} of {figures['dead_letters_expected']:,} expected "
          f"(a record dead-lettered twice: {figures['dead_lettered_twice']}); rejections: "
          f"{figures['rejections_seen']:,} of {figures['rejections_expected']:,}")
    print(f"largest output: {figures['largest_output']:,} bytes; agent crashes: {figures['agent_crashes']}; "
          f"worker still running: {figures['worker_running']}", flush=True)
    return (through is not None and figures["valid_lost"] == 0 and figures["dead_lettered_twice"] == 0
            and figures["dead_letters_seen"] == figures["dead_letters_expected"])


# ------------------------------------------------------------------------ crashes


def crashes(*, vms: int, kills: int, row_crashes: int, outages: int, rate: float, seed: int) -> dict[str, object]:
    chance = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="vmstream-faults-") as tmp:
        kafka = LocalKafka(data_dir=Path(tmp) / "broker", keep_data=True, port=free_ports(1)[0])
        kafka.start()
        deployment = kit.new_deployment(kafka.bootstrap_servers, Path(tmp))
        ledger, publisher = Ledger(deployment), Publisher(deployment)
        workload = Workload(vms=vms, drains=2)
        started = 0
        worker = WorkerProcess(deployment, "w0", env=worker_env()).start()
        restarts = 0
        exits: dict[str, int] = {}  # exit status → how many of the workers that ended by themselves

        def supervise() -> None:
            nonlocal worker, restarts, started
            assert worker.process is not None
            if worker.process.poll() is not None:
                exits[str(worker.process.returncode)] = exits.get(str(worker.process.returncode), 0) + 1
                restarts += 1
                started += 1
                worker = WorkerProcess(deployment, f"w{started}", env=worker_env()).start()

        try:
            setup = workload.setup()
            publisher.publish(setup)
            ledger.wait_until(lambda seen: seen.event_audits >= len(setup), timeout=300, what="the AZ decided")
            stream = workload.stream()
            intent_at = [(n, value["intent_id"]) for n, (topic, _, value) in enumerate(stream, len(setup))
                         if topic == "intents"]
            began = time.monotonic()
            publisher.start(stream, per_second=rate)
            faults = ["kill"] * kills + ["row"] * row_crashes + ["broker"] * outages
            chance.shuffle(faults)
            recoveries: list[float] = []
            for fault in faults:
                moment = time.monotonic() + chance.uniform(1.0, 3.0)  # a random moment to strike
                ledger.wait_until(lambda _: time.monotonic() >= moment, timeout=60, what="the next fault",
                                  while_waiting=supervise)
                if fault == "kill":
                    later = {ident for n, ident in intent_at if n >= publisher.sent}
                    killed = time.monotonic()
                    worker.stop(signal.SIGKILL)
                    started += 1
                    worker = WorkerProcess(deployment, f"w{started}", env=worker_env()).start()
                    if later and publisher.running:
                        ledger.wait_until(lambda seen: any(i in seen.audited for i in later), timeout=300,
                                          what="an intent published after the kill audited", while_waiting=supervise)
                        recoveries.append(time.monotonic() - killed)
                elif fault == "row":
                    worker.stop(signal.SIGKILL)
                    started += 1
                    after = str(chance.randint(1, 50))
                    worker = WorkerProcess(deployment, f"w{started}",
                                           env=with_faults(VMSTREAM_TEST_CRASH_AFTER_ROWS=after)).start()
                else:
                    kafka.stop()
                    time.sleep(chance.uniform(2.0, 5.0))  # the outage itself
                    kafka.start()
            publisher.join(timeout=600)
            ledger.wait_until(lambda seen: not seen.missing(workload.intent_ids), timeout=600,
                              what="every intent audited", while_waiting=supervise)
            took = time.monotonic() - began
            ledger.poll()
            for ident, contents in list(ledger.two_contents().items())[:3]:  # what to look at, if any
                print(f"two contents of {ident}:", *contents, sep="\n  ", file=sys.stderr)
            return {
                "seed": seed,
                "intents": len(workload.intent_ids),
                "kills": kills,
                "row_crashes": row_crashes,
                "broker_restarts": outages,
                "worker_exits_restarted": restarts,
                "worker_exit_statuses": exits,  # 86: a row crash fired (tests/support/crashpoints/sitecustomize.py)
                "lost": len(ledger.missing(workload.intent_ids)),
                "ids_with_two_contents": len(ledger.two_contents()),
                "records_read": ledger.records,
                "distinct_ids": len(ledger.contents),
                "seconds": round(took, 1),
                "recovery_after_kill_s": {
                    "runs": len(recoveries),
                    "median": round(statistics.median(recoveries), 1) if recoveries else None,
                    "max": round(max(recoveries), 1) if recoveries else None,
                },
                "broker_port_kept": kafka.bootstrap_servers == deployment.bootstrap,
            }
        finally:
            worker.stop()
            publisher.close()
            ledger.close()
            kafka.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("hostile", "crashes"), help="one part only (default: both)")
    parser.add_argument("--hostile", type=int, default=10_000, help="hostile records (default 10,000)")
    parser.add_argument("--big-every", type=int, default=20,
                        help="the classes over 100 kB in one round of every N (default 20)")
    parser.add_argument("--window", type=float, default=600.0, help="seconds to wait for every output")
    parser.add_argument("--seed", type=int, default=None, help="the crashes' random order and moments")
    kit.add_json_option(parser)
    kit.add_small_option(parser, hostile=300, big_every=3)
    args = kit.parse(parser)
    kit.quiet_client_logs()
    kit.print_load("at the start")
    figures: dict[str, Any] = {}
    ok = True
    if args.only in (None, "hostile"):
        with kit.broker() as broker:
            figures["hostile"] = hostile(broker.bootstrap, args.hostile, args.hostile * 22 // 100, args.big_every,
                                         args.window)
        ok &= print_hostile(figures["hostile"], args.window)
    if args.only in (None, "crashes"):
        seed = args.seed if args.seed is not None else random.randrange(1 << 30)
        sizes = (dict(vms=100, kills=2, row_crashes=1, outages=1, rate=10) if args.small
                 else dict(vms=1000, kills=8, row_crashes=4, outages=2, rate=20))
        figures["crashes"] = crashes(seed=seed, **sizes)
        print(json.dumps(figures["crashes"], indent=2))
        ok &= figures["crashes"]["lost"] == 0 and figures["crashes"]["ids_with_two_contents"] == 0
    kit.print_load("at the end")
    kit.write_json(args.json, figures)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
