"""Drains at scale on a real broker: is every owner told within 1 s of the drain reaching the worker?

Why this exists: issue 14 asks that a node with 500 GPU VMs drained tells every owner within
1 s of the intent reaching the worker, and that a NodeMaintenance on 50 nodes at once does
so per node. ``engine.py --parts scale`` shows the engine decides such a drain in milliseconds; what
the owners see is that decision plus the worker around it (the intent read, 500
notifications encoded and sent, the broker), which only a run on Kafka shows.

One ``vmstream worker`` on a fresh :class:`~harness.running.Deployment` (auth mode none:
intents are taken at their word), with a cluster published as watch events and decided
first (every event audited, the group caught up):

- ``big-node`` with ``--vms`` RTX cards, each held by a running GPU VM of its own (owners
  among ``--owners``, half of the VMs ``Always``, half ``Manual``), and ``spare-node`` with
  100 free cards, as ``tests/rules/test_drains_at_scale.py``;
- ``--nodes`` rack nodes with ``--per-node`` GPU VMs each.

Then

(a) **one drain** — a ``drain_node`` intent for ``big-node`` (900 s notice), its Kafka
    timestamp set by this script's producer at the send (CreateTime);
(b) **NodeMaintenance at once** — one NodeMaintenance watch event per rack node, all sent
    back to back by one producer, each with its own timestamp.

This script's own reader (a librdkafka consumer on ``notifications``, ``read_committed``,
positioned at the end before anything is sent) takes every ``drain_will_stop_gpu_vm``
notification: its Kafka timestamp (set by the worker's producer at the send) minus the
input's is the latency reported; the moment the reader had it (this machine's wall clock,
the same as both producers') is reported beside it as "readable". (a): count (must be
``--vms``), p50/p99/max per notification and the time to the last; (b): per node, its
NodeMaintenance to its last notification, p50/p99/max over the nodes and to the very last.

Anchor, in the same run and process, before the worker starts: the pure engine
(``Simulation`` of ``vmstream simulate``, the same config) fed the very same lines, timing
the drain intent and each NodeMaintenance (wall and CPU).

Run it from the repository root::

    .venv/bin/python benchmarks/drain_at_scale.py            # 500 VMs; 50 nodes × 10 (≈ 1 min)
    .venv/bin/python benchmarks/drain_at_scale.py --small    # 50 VMs; 5 nodes × 10 (≈ 30 s)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: percentile, tables, load, broker and reader helpers)
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, IsolationLevel, Producer  # noqa: E402
from confluent_kafka import TopicPartition as Assigned  # noqa: E402
from confluent_kafka.admin import OffsetSpec  # noqa: E402
from kit import Worker, percentile  # noqa: E402

from handlers.decide.engine import Engine  # noqa: E402
from harness.running import CONFIG, Deployment  # noqa: E402
from harness.scenarios import Script  # noqa: E402
from samples.cluster import RTX, iso, kubevirt_cr, node, node_maintenance, vm, vmi  # noqa: E402
from streams.cli.simulating import Simulation  # noqa: E402
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client, consumer  # noqa: E402
from streams.common.settings import KafkaSettings, load_settings  # noqa: E402

TARGET_SECONDS = 1.0
TOLD = "drain_will_stop_gpu_vm"
BIG_NODE = "big-node"
OPS = "ops@example.com"  # an operator in examples/config.yaml
NOTICE_SECONDS = 900  # no deadline passes during a run
PROJECTS = 10
WORKER_ENV = {"VMSTREAM_AUTH__MODE": "none", "VMSTREAM_WORKER__TICK_SECONDS": "1.0"}  # the tick at its default


# ------------------------------------------------------------------------- workload


def rack_nodes(count: int) -> list[str]:
    return [f"rack-node-{i:02d}" for i in range(count)]


def crowded_node(s: Script, name: str, gpus: int, owners: int) -> None:
    """A node whose ``gpus`` RTX cards are each held by a running GPU VM."""
    s.event("ADDED", node(name, gpus={RTX: gpus}))
    for i in range(gpus):
        project = f"proj-{i % PROJECTS:02d}"
        vm_name = f"{name}-vm-{i:03d}"
        s.event("ADDED", vm(f"spx-{project}", vm_name, project=project, owner=f"user-{i % owners:03d}@example.com",
                            run_strategy="Always" if i % 2 else "Manual", gpu=RTX, printable_status="Running"))
        s.event("ADDED", vmi(f"spx-{project}", vm_name, node_name=name, gpu=RTX, cpu_model="host-passthrough"))


def cluster_script(args: argparse.Namespace, prefix: str) -> Script:
    s = Script(datetime.now(UTC), prefix=prefix)
    s.event("ADDED", kubevirt_cr())
    s.event("ADDED", node("spare-node", gpus={RTX: 100}))
    crowded_node(s, BIG_NODE, args.vms, args.owners)
    for name in rack_nodes(args.nodes):
        crowded_node(s, name, args.per_node, args.owners)
    return s


def drain_intent(intent_id: str) -> dict[str, Any]:
    return {"intent_id": intent_id, "type": "drain_node", "requested_by": OPS, "requested_at": iso(datetime.now(UTC)),
            "spec": {"node": BIG_NODE, "reason": "firmware upgrade", "notice_seconds": NOTICE_SECONDS}}


def maintenance_event(event_id: str, name: str) -> tuple[str, dict[str, Any]]:
    obj = node_maintenance(f"nm-{name}", name, "rack PSU replacement")
    return f"NodeMaintenance/nm-{name}", {"event_id": event_id, "type": "ADDED", "kind": "NodeMaintenance",
                                          "object": obj, "observed_at": iso(datetime.now(UTC))}


# --------------------------------------------------------------------- the engine


@dataclass
class EngineFigures:
    drain_wall: float = 0.0
    drain_cpu: float = 0.0
    drain_told: int = 0
    maintenance_wall: list[float] = field(default_factory=list)  # per node
    maintenance_cpu: list[float] = field(default_factory=list)
    maintenance_told: list[int] = field(default_factory=list)


def engine_anchor(args: argparse.Namespace) -> EngineFigures:
    """The pure engine deciding the same drain and NodeMaintenances over the same cluster."""
    settings = load_settings(CONFIG)
    sim = Simulation(Engine(settings.rules()), settings.kafka)
    number = 0

    def feed(line: dict[str, Any]) -> tuple[float, float, int]:
        nonlocal number
        number += 1
        text = json.dumps(line, sort_keys=True)
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = list(sim.feed_line(text, number))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall, cpu, sum(1 for o in outputs if f'"type":"{TOLD}"' in o)

    for line in cluster_script(args, "engine").lines:
        feed(line)
    figures = EngineFigures()
    figures.drain_wall, figures.drain_cpu, figures.drain_told = feed(
        {"topic": "vmstream.intents", "key": f"node/{BIG_NODE}", "value": drain_intent("engine-drain")})
    for i, name in enumerate(rack_nodes(args.nodes)):
        key, value = maintenance_event(f"engine-nm-{i:03d}", name)
        wall, cpu, told = feed({"topic": "vmstream.k8s-events", "key": key, "value": value})
        figures.maintenance_wall.append(wall)
        figures.maintenance_cpu.append(cpu)
        figures.maintenance_told.append(told)
    return figures


# ---------------------------------------------------------------------- the worker


@dataclass(frozen=True)
class Told:
    node: str
    vm: str
    stamped: float  # the notification's Kafka timestamp, epoch seconds
    readable: float  # when this script's reader had it, epoch seconds


class NoticeReader:
    """This script's own librdkafka consumer of the notifications topic, from its current end."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        kafka = KafkaSettings(bootstrap_servers=bootstrap)
        self.consumer = consumer(kafka, client_id="vmstream-bench", config={"fetch.wait.max.ms": 50})  # read_committed
        # The end as a read_committed reader sees it (the last stable offset), asked before
        # anything is sent: the consumer starts there.
        asked = {Assigned(topic, p): OffsetSpec.latest() for p in range(kit.PARTITIONS)}  # type: ignore[no-untyped-call]  # unannotated in confluent-kafka
        admin = admin_client(kafka)  # held until the answers: it goes with them
        ends = admin.list_offsets(asked, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=ADMIN_SECONDS)
        self.consumer.assign([Assigned(tp.topic, tp.partition, answer.result().offset) for tp, answer in ends.items()])
        self.told: list[Told] = []
        self.timestamp_types: set[int] = set()

    def read_until(self, done: Callable[[list[Told]], bool], timeout: float, idle: float = 20.0) -> None:
        """Poll until ``done`` holds, ``timeout`` passed, or nothing arrived for ``idle`` seconds."""
        deadline = time.monotonic() + timeout
        progress = time.monotonic()
        while not done(self.told) and time.monotonic() < deadline and time.monotonic() - progress < idle:
            messages = [message for message in self.consumer.consume(num_messages=500, timeout=0.2)
                        if message.error() is None]  # else the end of a partition, or an error librdkafka retries
            now = time.time()
            for message in messages:
                value = json.loads(message.value() or b"")
                if value.get("type") != TOLD:
                    continue
                progress = time.monotonic()
                kind, stamp = message.timestamp()
                self.timestamp_types.add(1 if kind == TIMESTAMP_LOG_APPEND_TIME else 0)  # Kafka's own numbering
                self.told.append(Told(value["details"]["node"], value["subject"]["name"], stamp / 1000, now))

    def close(self) -> None:
        self.consumer.close()


def send_stamped(bootstrap: str, records: list[tuple[str, str, dict[str, Any]]]) -> list[float]:
    """Send records back to back, each stamped (CreateTime) at its send; their timestamps, epoch seconds.

    The timestamps are the broker's as RecordMetadata reports them (the one set here unless
    the topic stamps LogAppendTime)."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0,
                         "partitioner": "murmur2_random"})  # keys where the Java client puts them
    for topic in {topic for topic, _, _ in records}:
        producer.list_topics(topic, timeout=30)  # the metadata first: a send waiting for it is not stamped early
    reports: list[tuple[int, int] | str | None] = [None] * len(records)  # (timestamp type, timestamp), or the error
    sent = []
    for index, (topic, key, value) in enumerate(records):
        stamp = int(time.time() * 1000)

        def delivered(error: Any, message: Any, index: int = index) -> None:
            reports[index] = str(error) if error is not None else message.timestamp()

        producer.produce(topic, key=key.encode(), value=json.dumps(value).encode(), timestamp=stamp,
                         on_delivery=delivered)
        producer.poll(0)
        sent.append(stamp)
    if producer.flush(30) > 0:
        raise RuntimeError("records not acknowledged in 30 s")
    stamps = []
    for stamp, report in zip(sent, reports, strict=True):
        if not isinstance(report, tuple):
            raise RuntimeError(f"a record was not written: {report}")
        _, timestamp = report
        stamps.append((timestamp if timestamp not in (None, -1) else stamp) / 1000)
    return stamps


@dataclass(frozen=True)
class Sched:
    """A process's time on a CPU and waiting for one (all its threads, ``/proc/<pid>/task/*/schedstat``):
    a notification late while the worker waited for a CPU is the machine's, not the worker's."""

    running: float = 0.0
    waiting: float = 0.0

    def __sub__(self, other: Sched) -> Sched:
        return Sched(self.running - other.running, self.waiting - other.waiting)


def sched_of(pid: int) -> Sched:
    running = waiting = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ran, waited, _ = (int(x) for x in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        running, waiting = running + ran, waiting + waited
    return Sched(running / 1e9, waiting / 1e9)


@dataclass
class WorkerFigures:
    drain_stamp: float = 0.0
    drain_told: list[Told] = field(default_factory=list)
    maintenance_stamps: dict[str, float] = field(default_factory=dict)  # per node
    maintenance_told: list[Told] = field(default_factory=list)
    events: int = 0
    events_seconds: float = 0.0
    timestamp_types: set[int] = field(default_factory=set)
    load: list[float] = field(default_factory=list)
    drain_sched: Sched = Sched()  # the worker, from before the send to the last notification read
    maintenance_sched: Sched = Sched()


async def on_the_worker(args: argparse.Namespace, deployment: Deployment) -> WorkerFigures:
    figures = WorkerFigures(load=[kit.load1()])
    worker = Worker(deployment, "w", None, env=WORKER_ENV)
    await asyncio.to_thread(worker.start, 300)
    try:
        script = cluster_script(args, f"{deployment.ident}-ev")
        figures.events, figures.events_seconds = await kit.publish_cluster(deployment, script, timeout=900)
        await kit.wait_until_caught_up(deployment, timeout=300)
        print(f"  cluster: {figures.events:,} watch events decided in {figures.events_seconds:.1f} s", flush=True)
        kafka = deployment.kafka
        notifications = kafka.topic("notifications")

        # (a) one drain of a node with --vms GPU VMs
        figures.load.append(kit.load1())
        reader = await asyncio.to_thread(NoticeReader, args.bootstrap, notifications)
        try:
            before = sched_of(worker.pid)
            [figures.drain_stamp] = await asyncio.to_thread(
                send_stamped, args.bootstrap,
                [(kafka.topic("intents"), f"node/{BIG_NODE}", drain_intent(f"{deployment.ident}-drain"))])
            await asyncio.to_thread(reader.read_until, lambda told: len(told) >= args.vms, 120.0)
            figures.drain_sched = sched_of(worker.pid) - before
            figures.drain_told = list(reader.told)
            figures.timestamp_types |= reader.timestamp_types
        finally:
            reader.close()
        print(f"  (a) drain: {len(figures.drain_told)} owners told (load {kit.load1():.2f})", flush=True)
        await kit.wait_until_caught_up(deployment, timeout=300)

        # (b) a NodeMaintenance on --nodes nodes at once
        figures.load.append(kit.load1())
        names = rack_nodes(args.nodes)
        expected = args.nodes * args.per_node
        reader = await asyncio.to_thread(NoticeReader, args.bootstrap, notifications)
        try:
            events = [(kafka.topic("k8s-events"), *maintenance_event(f"{deployment.ident}-nm-{i:03d}", name))
                      for i, name in enumerate(names)]
            before = sched_of(worker.pid)
            stamps = await asyncio.to_thread(send_stamped, args.bootstrap, events)
            figures.maintenance_stamps = dict(zip(names, stamps))
            await asyncio.to_thread(reader.read_until, lambda told: len(told) >= expected, 300.0)
            figures.maintenance_sched = sched_of(worker.pid) - before
            figures.maintenance_told = list(reader.told)
            figures.timestamp_types |= reader.timestamp_types
        finally:
            reader.close()
        figures.load.append(kit.load1())
        print(f"  (b) NodeMaintenance: {len(figures.maintenance_told)} owners told (load {figures.load[-1]:.2f})",
              flush=True)
    finally:
        await asyncio.to_thread(worker.stop)
    return figures


# ---------------------------------------------------------------------- reporting


def ms(seconds: float) -> str:
    return f"{1000 * seconds:,.1f}"


def spread(values: list[float]) -> tuple[str, str, str]:
    if not values:
        return "-", "-", "-"
    return ms(percentile(values, 0.5)), ms(percentile(values, 0.99)), ms(max(values))


def report(args: argparse.Namespace, engine: EngineFigures, worker: WorkerFigures) -> dict[str, Any]:
    header = ("case", "told", "of", "first ms", "p50 ms", "p99 ms", "max ms", "to the last ms", "readable: to the last ms",
              f"≤ {TARGET_SECONDS:.0f} s")
    body = []

    # (a)
    drain = [t for t in worker.drain_told if t.node == BIG_NODE]
    latencies = [t.stamped - worker.drain_stamp for t in drain]
    last = max(latencies) if latencies else float("nan")
    readable_last = max(t.readable for t in drain) - worker.drain_stamp if drain else float("nan")
    distinct = len({t.vm for t in drain})
    drain_met = distinct == args.vms and last <= TARGET_SECONDS
    body.append((f"(a) worker: drain_node of a node with {args.vms} GPU VMs, per notification", str(len(drain)),
                 str(args.vms), ms(min(latencies)) if latencies else "-", *spread(latencies), ms(last), ms(readable_last), kit.yes(drain_met)))
    body.append(("(a) engine alone: the same drain decided (wall)", str(engine.drain_told), str(args.vms),
                 "-", "-", "-", "-", ms(engine.drain_wall), "-", "-"))

    # (b)
    per_node: dict[str, list[Told]] = {}
    for t in worker.maintenance_told:
        per_node.setdefault(t.node, []).append(t)
    to_last = {name: max(t.stamped for t in told) - worker.maintenance_stamps[name]
               for name, told in per_node.items() if name in worker.maintenance_stamps}
    first_sent = min(worker.maintenance_stamps.values()) if worker.maintenance_stamps else float("nan")
    total = (max(t.stamped for t in worker.maintenance_told) - first_sent) if worker.maintenance_told else float("nan")
    readable_total = (max(t.readable for t in worker.maintenance_told) - first_sent
                      if worker.maintenance_told else float("nan"))
    complete = all(len({t.vm for t in per_node.get(name, [])}) == args.per_node for name in rack_nodes(args.nodes))
    nm_met = complete and bool(to_last) and max(to_last.values()) <= TARGET_SECONDS
    to_first = [min(t.stamped for t in told) - worker.maintenance_stamps[name]
                for name, told in per_node.items() if name in worker.maintenance_stamps]
    body.append((f"(b) worker: NodeMaintenance on {args.nodes} nodes × {args.per_node} GPU VMs, per node to its last",
                 str(len(worker.maintenance_told)), str(args.nodes * args.per_node),
                 ms(min(to_first)) if to_first else "-", *spread(list(to_last.values())),
                 ms(total), ms(readable_total), kit.yes(nm_met)))
    body.append(("(b) engine alone: each NodeMaintenance decided (wall), per node", str(sum(engine.maintenance_told)),
                 str(args.nodes * args.per_node), "-", *spread(engine.maintenance_wall), ms(sum(engine.maintenance_wall)),
                 "-", "-"))
    print()
    print(kit.table(header, body))
    types = {0: "CreateTime", 1: "LogAppendTime"}
    print(f"latency: the notification's Kafka timestamp ({', '.join(types.get(t, str(t)) for t in sorted(worker.timestamp_types)) or '-'}, "
          "set by the worker's producer) minus the input's (set by this script at its send); readable: "
          "when this script's read_committed reader had the last one, same clock; first: the earliest notification "
          "(the input read, routed and decided), so first → last is the writing of the decision's outputs")
    print(f"(b) to the last: from the first NodeMaintenance sent to the last notification; the {args.nodes} events "
          f"were sent within {ms(max(worker.maintenance_stamps.values()) - first_sent) if worker.maintenance_stamps else '-'} ms")
    print(f"engine CPU: the drain {ms(engine.drain_cpu)} ms; the NodeMaintenances {ms(sum(engine.maintenance_cpu))} ms in all "
          f"(max {ms(max(engine.maintenance_cpu, default=0.0))} ms)")
    print(f"the cluster: {worker.events:,} watch events decided in {worker.events_seconds:.1f} s before the cases; "
          f"load1 at start / (a) / (b) / end: {' / '.join(f'{x:.2f}' for x in worker.load)}")
    print(f"the worker from the send to the last notification read: (a) {ms(worker.drain_sched.running)} ms on a CPU, "
          f"{ms(worker.drain_sched.waiting)} ms ready but waiting for one; (b) {ms(worker.maintenance_sched.running)} ms "
          f"on a CPU, {ms(worker.maintenance_sched.waiting)} ms waiting (summed over its threads)")
    print(f"within {TARGET_SECONDS:.0f} s: (a) {kit.yes(drain_met)}, (b) {kit.yes(nm_met)}")
    return {
        "vms": args.vms, "nodes": args.nodes, "per_node": args.per_node, "owners": args.owners,
        "drain": {"told": len(drain), "distinct_vms": distinct, "p50_ms": 1000 * percentile(latencies, 0.5) if latencies else None,
                  "p99_ms": 1000 * percentile(latencies, 0.99) if latencies else None, "last_ms": 1000 * last,
                  "readable_last_ms": 1000 * readable_last, "met": drain_met,
                  "engine_wall_ms": 1000 * engine.drain_wall, "engine_cpu_ms": 1000 * engine.drain_cpu},
        "maintenance": {"told": len(worker.maintenance_told), "per_node_last_ms": {k: 1000 * v for k, v in to_last.items()},
                        "total_ms": 1000 * total, "readable_total_ms": 1000 * readable_total, "met": nm_met,
                        "engine_wall_ms": [1000 * x for x in engine.maintenance_wall]},
        "load1": worker.load,
        "worker_sched_s": {"drain": [worker.drain_sched.running, worker.drain_sched.waiting],
                           "maintenance": [worker.maintenance_sched.running, worker.maintenance_sched.waiting]},
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--vms", type=int, default=500, help="GPU VMs on the drained node (default 500)")
    parser.add_argument("--nodes", type=int, default=50, help="nodes put in maintenance at once (default 50)")
    parser.add_argument("--per-node", type=int, default=10, help="GPU VMs on each of them (default 10)")
    parser.add_argument("--owners", type=int, default=50, help="distinct owners the VMs belong to (default 50)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the worker's log in DIR (default: removed)")
    kit.add_small_option(parser, vms=50, nodes=5)
    kit.add_json_option(parser)
    return kit.parse(parser, argv)


async def measure(args: argparse.Namespace, workdir: Path) -> int:
    print(f"drains at scale: a node of {args.vms} GPU VMs drained; a NodeMaintenance on {args.nodes} nodes of "
          f"{args.per_node} GPU VMs at once; broker {args.bootstrap}")
    kit.print_load("at the start")
    engine = engine_anchor(args)
    print(f"  engine alone: the drain in {ms(engine.drain_wall)} ms, {engine.drain_told} told", flush=True)
    deployment = kit.new_deployment(args.bootstrap, workdir / "drains")
    try:
        worker = await on_the_worker(args, deployment)
        figures = report(args, engine, worker)
    finally:
        print(f"deleted the run's {len(deployment.delete_topics())} topics")
    print()
    kit.print_load("at the end")
    kit.write_json(args.json, figures)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kit.quiet_client_logs()
    with kit.broker() as broker, tempfile.TemporaryDirectory(prefix="vmstream-drains-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        args.bootstrap = broker.bootstrap
        return asyncio.run(measure(args, workdir))


if __name__ == "__main__":
    sys.exit(main())
