"""What every benchmark here shares: the parts started, the anchor run beside vmstream, one
percentile, one table, one way to read the load.

Benchmarks measure on a machine shared with other work, so each prints the load average
beside its figures, measures vmstream beside an anchor in the same run (:func:`in_turns`),
and reports latencies with the same percentile definition so that a p99 in one script means
what it means in another. The broker, deployment, worker and reader helpers start the parts
and watch them from the outside (their own Kafka clients, ``/proc``, the worker's pages),
never through the code under test.

Import it as ``import kit`` (a benchmark's own directory is first on ``sys.path``); importing
it puts the repository root on ``sys.path`` as well.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the tree this file sits in is the one measured

from harness.localkafka import LocalKafka  # noqa: E402

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # noqa: E402  # isort: skip
from confluent_kafka import ConsumerGroupTopicPartitions  # noqa: E402
from confluent_kafka import TopicPartition as Offset  # noqa: E402
from confluent_kafka.admin import NewTopic, OffsetSpec  # noqa: E402

from harness.running import Deployment, WorkerProcess  # noqa: E402
from harness.scenarios import Script  # noqa: E402
from samples.cluster import RTX, iso, kubevirt_cr, node, vm, vmi  # noqa: E402
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client, consumer  # noqa: E402
from streams.common import reading  # noqa: E402
from streams.common.settings import KafkaSettings  # noqa: E402
from streams.common.topics import ROUTED, TOPICS, route_group  # noqa: E402

PARTITIONS = KafkaSettings().partitions


# ----------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value with at least a share ``q`` of the values at or below it.

    No interpolation: the figure is always one that was measured. p99 of 100 values is the
    99th smallest, of 1,000 the 990th; of fewer than 100 values it is the largest but one
    only from 100 on, so a p99 of a short run is close to its maximum. ``values`` need not be
    sorted (sorting a sorted list is linear).

    >>> percentile(range(1, 101), 0.99), percentile(range(1, 1001), 0.99), percentile(range(1, 51), 0.99)
    (99, 990, 50)
    >>> percentile([3.0, 1.0, 2.0], 0.5), percentile([5.0], 0.99), percentile([1, 2, 3, 4], 0.0)
    (2.0, 5.0, 1)
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], not {q}")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary_ms(seconds: Sequence[float], quantiles: Sequence[float] = (0.5, 0.9, 0.99)) -> str:
    """``p50 12.0 ms, p90 …, p99 …, max …`` of latencies given in seconds.

    >>> summary_ms([0.001 * i for i in range(1, 101)])
    'p50 50.0 ms, p90 90.0 ms, p99 99.0 ms, max 100.0 ms'
    """
    if not seconds:
        return "none arrived"
    parts = [f"p{100 * q:g} {1000 * percentile(seconds, q):,.1f} ms" for q in quantiles]
    return ", ".join([*parts, f"max {1000 * max(seconds):,.1f} ms"])


# ----------------------------------------------------------------------------- load


def quiet_client_logs() -> None:
    """Warnings only, and none of the Kafka clients' chatter about connections a benchmark
    opens and closes on purpose (a metadata refresh cancelled by a reader's close)."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    logging.getLogger("kafka").setLevel(logging.ERROR)
    logging.getLogger("kafka.cluster").setLevel(logging.CRITICAL)


def load_average() -> str:
    """``load average 1.20 0.80 0.50`` (1, 5, 15 minutes), for a report's first and last line."""
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def print_load(when: str) -> None:
    print(f"{load_average()} ({when}; {os.cpu_count()} CPUs)", flush=True)


def sleep_until(due: float) -> None:
    """Until ``time.monotonic()`` reaches ``due``, in steps of at most 5 ms: pacing a
    producer, not synchronising."""
    while (now := time.monotonic()) < due:
        time.sleep(min(due - now, 0.005))


def load1() -> float:
    return os.getloadavg()[0]


# ------------------------------------------------------------------------ processes


@dataclass(frozen=True)
class Cpu:
    """User and system time of a process (all its threads): system time is the sockets' share."""

    user: float = 0.0
    system: float = 0.0

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.user - other.user, self.system - other.system)

    def __add__(self, other: Cpu) -> Cpu:
        return Cpu(self.user + other.user, self.system + other.system)

    @property
    def total(self) -> float:
        return self.user + self.system


def cpu_of(pid: int) -> Cpu:
    """A process's CPU time so far, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return Cpu(int(fields[11]) / tick, int(fields[12]) / tick)


def machine_busy() -> float:
    """CPU-seconds every core of the machine has spent busy since boot, whoever ran
    (``/proc/stat``: user, nice, system, irq, softirq, steal)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> tuple[float, float]:
    """(current, peak) resident set of a process."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def pin(pid: int, cpus: str) -> None:
    """Every thread of a process on ``cpus`` (``taskset -a -p -c``); threads it starts later inherit it."""
    subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True, stdout=subprocess.DEVNULL)


# --------------------------------------------------------------------------- tables


def render(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """Columns side by side: the first left-aligned, the others right-aligned.

    >>> print("\\n".join(render(("run", "msgs/s"), [("one", "213"), ("two workers", "1,239")])))
    run          msgs/s
    -----------  ------
    one             213
    two workers   1,239
    """
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))

    return [line(header), "  ".join("-" * width for width in widths), *(line(row) for row in body)]


def table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    return "\n".join(render(header, body))


def yes(flag: bool | None) -> str:
    return "n/a" if flag is None else ("met" if flag else "MISSED")


# ----------------------------------------------------------------------------- JSON


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON to FILE")


def write_json(path: Path | None, figures: dict[str, Any]) -> None:
    """The figures with when and under what load they were taken; nothing when ``path`` is None."""
    if path is None:
        return
    record = {"script": Path(sys.argv[0]).name, "argv": sys.argv[1:], "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cpus": os.cpu_count(), "load_average_end": os.getloadavg(), **figures}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"figures written to {path}")


def add_small_option(parser: argparse.ArgumentParser, **sizes: Any) -> None:
    """``--small``: a smoke run of the script, its sizes overridden by ``sizes`` (see :func:`parse`)."""
    shown = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in sizes.items())
    parser.add_argument("--small", action="store_const", const=sizes, default=None,
                        help=f"a quick smoke run: {shown}")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse, then apply ``--small``'s sizes (over any given on the command line)."""
    args = parser.parse_args(argv)
    for name, value in (getattr(args, "small", None) or {}).items():
        setattr(args, name, value)
    return args


# ---------------------------------------------------------------------------- Kafka


@dataclass(frozen=True)
class Broker:
    bootstrap: str
    pid: int | None  # None: a broker given by KAFKA_BOOTSTRAP_SERVERS, not this run's


@contextlib.contextmanager
def broker() -> Iterator[Broker]:
    """KAFKA_BOOTSTRAP_SERVERS if set, else a local broker for this run (stopped at the end)."""
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        yield Broker(given, None)
        return
    with LocalKafka() as kafka:
        yield Broker(kafka.bootstrap_servers, kafka.pid)


def create_topics(bootstrap: str, names: Sequence[str]) -> None:
    client = admin_client(KafkaSettings(bootstrap_servers=bootstrap))
    for created in client.create_topics([NewTopic(name, PARTITIONS, 1) for name in names]).values():
        created.result()
    wait_for_leaders(bootstrap, names)


def wait_for_leaders(bootstrap: str, names: Sequence[str], timeout: float = 30.0) -> None:
    """A topic just created has no partition leaders for a moment: producing then only retries."""
    client = admin_client(KafkaSettings(bootstrap_servers=bootstrap))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = client.list_topics(timeout=ADMIN_SECONDS).topics
        if all(name in listed and len(listed[name].partitions) == PARTITIONS
               and all(p.leader >= 0 for p in listed[name].partitions.values()) for name in names):
            return
        time.sleep(0.1)  # polling interval of the metadata


def new_deployment(bootstrap: str, workdir: Path) -> Deployment:
    """A deployment whose topics exist and have leaders.

    A process that subscribes to a topic the broker does not list yet (the applier, when it
    was on kafka-python: "No partition metadata") is assigned nothing until its next metadata
    refresh, five minutes later: every topic is waited for before anything is started.
    """
    deployment = Deployment(bootstrap, workdir)
    deployment.create_topics()
    wait_for_leaders(bootstrap, [deployment.kafka.topic(spec.name) for spec in TOPICS])
    return deployment


def behind(deployment: Deployment) -> int:
    """Messages the deployment's worker has not committed yet, over every topic it reads: the
    routed topic in its Faust group, intents and watch events in its route group."""
    kafka = deployment.kafka
    partitions = [(kafka.topic(name), p) for name in ("intents", "k8s-events", ROUTED) for p in range(kafka.partitions)]
    groups = [deployment.app_id, route_group(deployment.app_id)]
    admin = admin_client(kafka)
    found: dict[str, dict[tuple[str, int], int]] = {}
    for group in groups:
        listed = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result()
        found[group] = {(tp.topic, tp.partition): tp.offset for tp in listed.topic_partitions or ()
                        if tp.error is None and tp.offset >= 0}
    ends = end_offsets(kafka.bootstrap_servers, partitions)
    committed = {tp: max((found[group][tp] for group in groups if tp in found[group]), default=0)
                 for tp in partitions}
    return sum(end - committed[tp] for tp, end in ends.items())


async def wait_until_caught_up(deployment: Deployment, timeout: float) -> None:
    """Until the worker group has committed all it was given, so a tail of work set off by
    one phase (a GPU VMI's resident update, routed to its node) does not run into the next."""
    deadline = time.monotonic() + timeout
    while (left := await asyncio.to_thread(behind, deployment)) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker is still {left} messages behind after {timeout:.0f}s")
        await asyncio.sleep(0.5)


async def new_producer(bootstrap: str) -> AIOKafkaProducer:
    """A driver's producer, as an upstream service would configure one."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=0)
    await producer.start()
    return producer


def audit_ref_of(value: bytes) -> str | None:
    """What an audit record decided: its input's ref (an intent id, a watch event id)."""
    ref: str | None = json.loads(value)["input"]["ref"]
    return ref


class Arrivals:
    """A driver's own reader of an output topic: when each id first came back (perf_counter),
    and the Kafka timestamp its writer gave it (epoch seconds). Reads ``read_committed``."""

    def __init__(self, bootstrap: str, topic: str, ident: Callable[[bytes], str | None]) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.ident = ident
        self.first: dict[str, float] = {}
        self.stamped: dict[str, float] = {}
        self.on_first: Callable[[], None] | None = None  # called once, at the first arrival
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Arrivals:
        """Read from the topic's current end: only what is sent from now on counts."""
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                    isolation_level="read_committed", fetch_max_wait_ms=50)
        await consumer.start()
        partitions = [TopicPartition(self.topic, p) for p in range(PARTITIONS)]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        for tp in partitions:
            await consumer.position(tp)  # resolve the lazy seek before anything is sent
        self._consumer = consumer
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=200)
            now = time.perf_counter()
            for records in batches.values():
                for record in records:
                    ident = self.ident(record.value) if record.value is not None else None
                    if ident is not None and ident not in self.first:
                        if not self.first and self.on_first is not None:
                            self.on_first()
                        self.first[ident] = now
                        self.stamped[ident] = record.timestamp / 1000

    async def wait_for(self, ids: Sequence[str], timeout: float, idle: float | None = None) -> list[str]:
        """Wait until every id arrived; returns those that did not in time.

        With ``idle``, also give up once something arrived and then nothing more for that
        long: a process that skipped inputs would otherwise be waited for until ``timeout``.
        """
        deadline = time.monotonic() + timeout
        missing = [i for i in ids if i not in self.first]
        progress = time.monotonic()
        while missing and time.monotonic() < deadline:
            if self._task is not None and self._task.done():
                self._task.result()  # the reader died: say why
            await asyncio.sleep(0.05)  # polling interval of a dict the reader fills
            still = [i for i in missing if i not in self.first]
            if len(still) < len(missing):
                progress = time.monotonic()
            elif idle is not None and len(still) < len(ids) and time.monotonic() - progress > idle:
                return still
            missing = still
        return missing

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()


@dataclass(frozen=True)
class TopicBytes:
    """What a topic holds, read back by a plain consumer: records, bytes, distinct keys."""

    topic: str
    records: int
    key_bytes: int
    value_bytes: int
    keys: int
    latest_bytes: int  # key + value of the last record per key: the topic once compacted

    @property
    def bytes(self) -> int:
        return self.key_bytes + self.value_bytes


def end_offsets(bootstrap: str, partitions: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Each partition's end offset, asked of the broker: the offset its next record will take."""
    if not partitions:
        return {}
    asked = {Offset(topic, p): OffsetSpec.latest() for topic, p in partitions}  # type: ignore[no-untyped-call]  # unannotated in confluent-kafka
    admin = admin_client(KafkaSettings(bootstrap_servers=bootstrap))  # held until the answers: it goes with them
    answers = admin.list_offsets(asked, request_timeout=ADMIN_SECONDS)
    return {(tp.topic, tp.partition): answer.result().offset for tp, answer in answers.items()}


def partitions_of(bootstrap: str, topics: Sequence[str]) -> list[tuple[str, int]]:
    """Every partition of those of ``topics`` the broker lists."""
    listed = admin_client(KafkaSettings(bootstrap_servers=bootstrap)).list_topics(timeout=ADMIN_SECONDS).topics
    return [(topic, p) for topic in topics if topic in listed for p in sorted(listed[topic].partitions)]


def topic_bytes(bootstrap: str, topics: Sequence[str], timeout: float = 60.0) -> list[TopicBytes]:
    """Read each topic from its start to its current end (``read_uncommitted``: what is on disk);
    ``TimeoutError`` when ``timeout`` seconds pass without a record while a topic is short of it."""
    reader = consumer(KafkaSettings(bootstrap_servers=bootstrap), client_id="vmstream-bench",
                      config={"isolation.level": "read_uncommitted"})
    results = []
    try:
        for topic in topics:
            partitions = reading.partitions_of(reader, [topic], wait=0.0, missing_ok=True)
            records = key_bytes = value_bytes = 0
            latest: dict[bytes, int] = {}
            for record in reading.read_to_end(reader, partitions, stall=timeout):
                key, value = record.key or b"", record.value or b""
                records += 1
                key_bytes += len(key)
                value_bytes += len(value)
                latest[key] = len(key) + len(value)
            results.append(TopicBytes(topic, records, key_bytes, value_bytes, len(latest), sum(latest.values())))
    finally:
        reader.close()
    return results


class Worker(WorkerProcess):
    """A ``vmstream worker`` of this tree, pinned to ``cpus`` from its first instruction on
    (``taskset``), its start-up timed: to ``/health`` (imports, Faust up) and to ``/ready``
    (tables recovered, the cluster-wide view caught up)."""

    def __init__(self, deployment: Deployment, name: str, cpus: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(deployment, name, env={"PYTHONPATH": str(REPO), **(env or {})})
        self.cpus = cpus
        self.health_s: float | None = None
        self.ready_s: float | None = None

    def wait_ready(self, timeout: float) -> None:
        # Called right after the process is spawned: pin it before it has done anything.
        if self.cpus is not None:
            pin(self.pid, self.cpus)
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_running()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/ready", timeout=2) as answer:
                    body = json.loads(answer.read())
            except urllib.error.HTTPError as error:  # 503 while recovering: the process is up
                body = json.loads(error.read() or b"{}")
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                body = None
            if body is not None and self.health_s is None:
                self.health_s = time.perf_counter() - started
            if body and body.get("ready"):
                self.ready_s = time.perf_counter() - started
                return
            time.sleep(0.02)  # polling interval: fine enough to time a start-up
        raise RuntimeError(f"worker {self.name} not ready after {timeout}s:\n{self.tail()}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def metric(self, name: str) -> dict[str, float]:
        """One metric of ``/metrics``, by its label set (``table="vms"``)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.web_port}/metrics",
                                         headers={"Authorization": f"Bearer {self.deployment.web_token}"})
        with urllib.request.urlopen(request, timeout=5) as answer:
            text = answer.read().decode()
        return {m[1]: float(m[2]) for m in re.finditer(rf"^{re.escape(name)}\{{(.*?)\}} (\S+)$", text, re.M)}


# ----------------------------------------------------------------------- workload

CARDS_PER_NODE = 8
GPU_CLASS = "nvidia-rtx-pro-6000-bse"  # RTX in examples/config.yaml
PROJECTS = 10


@dataclass(frozen=True, slots=True)
class Intent:
    intent_id: str
    key: bytes
    value: bytes


@dataclass(frozen=True)
class Cluster:
    """VMs with running VMIs over GPU nodes, as the watch bridge's first list shows them."""

    vms: int
    nodes: int
    gpu_nodes: int
    gpu_share: float
    prefix: str  # event ids are <prefix>-000001, …

    def _vm(self, j: int) -> tuple[str, str, str, str, bool]:
        """(namespace, name, project, owner, has a GPU) of the j-th VM."""
        project = f"p{j % PROJECTS:02d}"
        has_gpu = int((j + 1) * self.gpu_share) > int(j * self.gpu_share)  # evenly spread
        return f"spx-{project}", f"vm-{j:05d}", project, f"user{j % 97}@example.com", has_gpu

    def script(self) -> Script:
        s = Script(datetime.now(UTC), prefix=self.prefix)
        s.event("ADDED", kubevirt_cr())
        names = [f"node-{i:04d}" for i in range(self.nodes)]
        for i, name in enumerate(names):
            s.event("ADDED", node(name, gpus={RTX: CARDS_PER_NODE} if i < self.gpu_nodes else None))
        gpu_placed = cpu_placed = 0
        for j in range(self.vms):
            namespace, name, project, owner, has_gpu = self._vm(j)
            if has_gpu:
                host, gpu_placed = names[gpu_placed % max(1, self.gpu_nodes)], gpu_placed + 1
            else:
                host, cpu_placed = names[cpu_placed % self.nodes], cpu_placed + 1
            gpu = RTX if has_gpu else None
            s.event("ADDED", vm(namespace, name, project=project, owner=owner, gpu=gpu, printable_status="Running"))
            s.event("ADDED", vmi(namespace, name, node_name=host, gpu=gpu,
                                 cpu_model="host-passthrough" if gpu else None))
        return s

    def intents(self, count: int, run: str) -> list[Intent]:
        """``set_gpu`` flipping each VM's GPU, then ``restart_vm``, round after round."""
        out = []
        now = iso(datetime.now(UTC))
        for i in range(count):
            j = i % self.vms
            namespace, name, project, owner, has_gpu = self._vm(j)
            spec: dict[str, Any] = {"namespace": namespace, "name": name}
            if (i // self.vms) % 2 == 0:
                type_ = "set_gpu"
                spec["gpu_class"] = None if has_gpu else GPU_CLASS
            else:
                type_ = "restart_vm"
            intent_id = f"{run}-{i:07d}"
            value = {"intent_id": intent_id, "type": type_, "requested_by": owner, "project": project,
                     "requested_at": now, "spec": spec}
            out.append(Intent(intent_id, f"vm/{namespace}/{name}".encode(), json.dumps(value).encode()))
        return out


def bench_cluster(vms: int, nodes: int, prefix: str) -> Cluster:
    """The 1,000-VM cluster the intents act on: half the VMs have a card, every node has 8."""
    return Cluster(vms=vms, nodes=nodes, gpu_nodes=nodes, gpu_share=0.5, prefix=prefix)


def az_cluster(vms: int, nodes: int, prefix: str) -> Cluster:
    """A production-sized AZ: 20 % GPU nodes, 15 % GPU VMs (as the engine's AZ stream)."""
    return Cluster(vms=vms, nodes=nodes, gpu_nodes=max(1, nodes // 5), gpu_share=0.15, prefix=prefix)


async def publish_cluster(deployment: Deployment, script: Script, timeout: float) -> tuple[int, float]:
    """Publish a cluster's watch events and wait until the worker audited each one: the
    events, and the seconds from the first sent to the last audited."""
    ids = [line["value"]["event_id"] for line in script.lines]
    arrivals = await Arrivals(deployment.bootstrap, deployment.kafka.topic("audit"), audit_ref_of).start()
    try:
        started = time.perf_counter()
        await asyncio.to_thread(deployment.publish_lines, list(script.jsonl()))
        missing = await arrivals.wait_for(ids, timeout)
        if missing:
            raise RuntimeError(f"{len(missing)} of {len(ids)} cluster events not audited after {timeout:.0f}s")
        return len(ids), max(arrivals.first.values()) - started
    finally:
        await arrivals.stop()


# -------------------------------------------------------------------------- turns


def in_turns(rounds: int, runs: dict[str, Callable[[int], Any]]) -> dict[str, list[Any]]:
    """Each run once per round, in turn: the anchor and the project share whatever the
    machine's load does meanwhile, so their ratio holds where their absolute figures drift."""
    results: dict[str, list[Any]] = {name: [] for name in runs}
    for round_ in range(rounds):
        print(f"round {round_ + 1}/{rounds}: {', '.join(runs)}; {load_average()}", flush=True)
        for name, run in runs.items():
            results[name].append(run(round_))
    return results


if __name__ == "__main__":  # the examples above: python benchmarks/kit.py
    import doctest

    sys.exit(doctest.testmod().failed)
