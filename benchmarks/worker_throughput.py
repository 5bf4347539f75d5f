"""Throughput and latency of ``vmstream worker`` on a real broker, against a bare pass-through.

Why this exists: the worker is a Python stream processor, so its honest yardstick is not
the broker's speed but what *any* Python pipeline can do on the same broker and machine.
One run measures both, with the same intents, topics of the same shape and the same
driver:

(a) **pass-through** — an aiokafka consumer (a consumer group, 6 partitions) that per input
    writes what the worker writes per intent: as many records, of the same sizes, on topics
    of the same kinds, acknowledged in the worker's order (journal, messages, rows; acks=all,
    committed about once a second, as Faust does), reading at most the worker's
    ``batch_size`` inputs at a time, in one asyncio process: the ceiling for a Python
    consume→produce loop doing the worker's writes. What the worker writes is read back from
    its topics and changelogs after its preloaded drain, which runs first;
(b) **the worker end to end** — ``vmstream worker`` as its own process, from an intent's
    send to its audit record (``input.ref == intent_id``) read back with read_committed;
(c) **the engine alone** — the same intents through ``Simulation.step`` in the driver, no
    Kafka: what the worker spends beyond it is its shell;
(d) **the engine in a thin shell** — the pass-through (a) deciding each input with the
    engine first, state in memory as in (c), outputs encoded and sealed as the worker's, then
    writing what (a) writes (preloaded only): what a shell no heavier than (a) would make of
    the engine.

Each side is measured two ways, each on a fresh :class:`~harness.running.Deployment`
(its own topics, group and changelogs):

- **preloaded** — ``--saturation`` intents written while the process is stopped, then the
  process started: throughput from the first output to the last. This is the saturation
  figure the ratio (b)/(a) is taken from: the driver's producer is idle while it is measured;
- **steady** — a paced producer at each of ``--rates`` for ``--duration`` seconds after
  ``--warmup`` seconds at the same rate (their latency is reported apart: from idle, on
  partitions never written before); latency = the driver's send of a message → the
  driver's read of its output, both on one monotonic clock.

Workload: a cluster is published first so intents mean something — ``--vms`` VMs (half
with an RTX card) with running VMIs over ``--nodes`` 8-card nodes, as watch events that
the worker must have audited before any intent is sent. Intents go round the VMs:
``set_gpu`` that flips the VM's GPU (add on a CPU VM, remove on a GPU VM — the VM table
keeps the watched VM, so each is a patch), then ``restart_vm``; each has its own
``intent_id`` and is keyed ``vm/<ns>/<name>``.

Everything shares the machine (broker, driver, the process measured), so the figures are
for this machine at its load — which the report prints. Run it from the repository root::

    .venv/bin/python benchmarks/worker_throughput.py --rates 250,500,1000,2000 --duration 10 --saturation 10000
    .venv/bin/python benchmarks/worker_throughput.py --quick      # smoke run (≈ 3 min)
    .venv/bin/python benchmarks/worker_throughput.py --only idle  # an idle worker's CPU
    .venv/bin/python benchmarks/worker_throughput.py --only preloaded --saturation 10000 --repeat 3

``--only idle``: what a ready worker with nothing to decide costs, its CPU over
``--duration`` seconds (set ``VMSTREAM_WORKER__FETCH_IDLE_WAIT_MS`` to compare pacings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: percentile, tables, load, broker and reader helpers)
from kit import (  # noqa: E402
    Arrivals,
    Cpu,
    audit_ref_of,
    cpu_of,
    create_topics,
    new_deployment,
    new_producer,
    percentile,
    render,
    wait_until_caught_up,
    yes,
)

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # noqa: E402  # isort: skip
from confluent_kafka import TopicPartition as Assigned  # noqa: E402
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client, consumer  # noqa: E402
from streams.common.reading import read_to_end  # noqa: E402

from harness.running import CONFIG, Deployment, simulated  # noqa: E402
from streams.common.settings import KafkaSettings, load_settings  # noqa: E402

TARGET_RATIO = 0.5  # the worker's saturation throughput over the pass-through's
TARGET_P99_MS = 100.0  # at the steady rate of TARGET_RATE
TARGET_RATE = 1_000.0
STALL_SECONDS = 15.0  # a preloaded drain with no output for this long is over
RUN_PREFIX = {"pass-through": "pt", "thin-shell": "ts", "worker": "wk"}
# The tick at its production default, not the tests' 0.2 s.
WORKER_ENV = {"VMSTREAM_WORKER__TICK_SECONDS": "1.0"}


# ---------------------------------------------------------------------- measuring


def intent_id_of(value: bytes) -> str | None:
    """What the pass-through forwards is the intent itself."""
    ident: str | None = json.loads(value).get("intent_id")
    return ident


@dataclass
class Row:
    """One measurement: a process under one load."""

    run: str
    messages: int
    seconds: float
    latencies: list[float] = field(default_factory=list)  # seconds, sorted
    cpu: Cpu | None = None  # the measured process's CPU time in the window
    missing: int = 0
    load1: float = field(default_factory=kit.load1)
    note: str = ""

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else float("nan")

    def ms(self, q: float) -> str:
        return f"{1000 * percentile(self.latencies, q):,.1f}" if self.latencies else "-"


# ------------------------------------------------------------------ the processes


class Process:
    """What the driver feeds: a pass-through or a worker, as a subprocess with a pid."""

    name: str

    @property
    def pid(self) -> int:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class PassThrough(Process):
    """``--pass-through-child`` of this script in its own interpreter, as the worker runs;
    with ``cluster`` (the watch events of the cluster, JSON Lines), the thin shell (d)."""

    def __init__(self, bootstrap: str, source: str, target: str, group: str, log: Path, recipe: Path | None,
                 cluster: Path | None = None) -> None:
        self.argv = [sys.executable, str(Path(__file__).resolve()), "--pass-through-child",
                     bootstrap, source, target, group, str(recipe or ""), str(cluster or "")]
        self.name = "(d) pass-through + engine" if cluster else "(a) pass-through"
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 60.0) -> None:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while "ready" not in self.log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pass-through not ready:\n{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)  # polling interval of a log file

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class WorkerUnderTest(Process):
    """The worker as the driver sees it: one :class:`kit.Worker` at a time per deployment."""

    name = "(b) worker"

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.instances = 0
        self.worker: kit.Worker | None = None

    @property
    def pid(self) -> int:
        assert self.worker is not None
        return self.worker.pid

    def start(self) -> None:
        self.instances += 1
        self.worker = kit.Worker(self.deployment, f"w{self.instances}", env=WORKER_ENV)
        self.worker.start(timeout=300)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def gc_pauses(self) -> str:
        """The garbage collections of its life so far, by generation: how many, how long in all."""
        assert self.worker is not None
        count = self.worker.metric("vmstream_gc_pause_seconds_count")
        total = self.worker.metric("vmstream_gc_pause_seconds_sum")
        return ", ".join(f"gen {g}: {count.get(label, 0):,.0f} in {1000 * total.get(label, 0):,.0f} ms"
                         for g in "012" if (label := f'generation="{g}"'))


# --------------------------------------------------------------- the pass-through


@dataclass(frozen=True)
class Stream:
    """One kind of record the worker writes for its inputs, per input: how many, how large.

    ``phase`` is when the worker writes it in a batch: 1 the journal (acknowledged before
    anything else leaves), 2 the messages (acknowledged before the rows), 3 the table rows
    (acknowledged before the offsets are committed)."""

    kind: str  # "audit", "commands", …, "changelog state-vms", "journal"
    topic: str  # the worker's topic it was read from
    per_input: float
    key_bytes: float  # means per record
    value_bytes: float
    header_bytes: float
    phase: int

    def anchor_topic(self, prefix: str) -> str:
        return prefix + re.sub(r"[^a-zA-Z0-9-]", "-", self.kind)


def phase_of(kind: str) -> int:
    return 1 if kind == "journal" else 3 if kind.startswith("changelog") else 2


def deployment_topics(deployment: Deployment) -> list[str]:
    """The topics a deployment's worker writes: its own and its app's changelogs."""
    listed = admin_client(deployment.kafka).list_topics(timeout=ADMIN_SECONDS).topics
    return sorted(name for name in listed
                  if name.startswith(deployment.kafka.topic_prefix) or name.startswith(f"{deployment.app_id}-"))


def end_offsets(bootstrap: str, topics: Sequence[str]) -> dict[tuple[str, int], int]:
    return kit.end_offsets(bootstrap, kit.partitions_of(bootstrap, topics))


def kind_of_topic(deployment: Deployment, topic: str) -> str:
    """``audit``, ``commands``, …; ``changelog state-vms``; ``journal``."""
    if topic.startswith(f"{deployment.app_id}-"):
        table = topic.removeprefix(f"{deployment.app_id}-").removesuffix("-changelog")
        return "journal" if table == "state-journal" else f"changelog {table}"
    return topic.removeprefix(deployment.kafka.topic_prefix).removeprefix("vmstream.")


def written_between(deployment: Deployment, starts: dict[tuple[str, int], int], inputs: int,
                    skip: Sequence[str] = ()) -> list[Stream]:
    """What the worker wrote since ``starts`` on each topic, per input (``inputs``): read back."""
    ends = end_offsets(deployment.bootstrap, sorted({topic for topic, _ in starts}))
    reader = consumer(KafkaSettings(bootstrap_servers=deployment.bootstrap), client_id="vmstream-bench",
                      config={"isolation.level": "read_uncommitted"})
    sizes: dict[str, list[int]] = {}  # topic → [records, key bytes, value bytes, header bytes]
    try:
        for (topic, partition), end in ends.items():
            start = starts.get((topic, partition), 0)
            if end <= start or kind_of_topic(deployment, topic) in skip:
                continue
            reader.assign([Assigned(topic, partition, start)])
            total = sizes.setdefault(topic, [0, 0, 0, 0])
            for record in read_to_end(reader, [Assigned(topic, partition)], stall=60):
                if record.offset >= end:
                    continue
                total[0] += 1
                total[1] += len(record.key or b"")
                total[2] += len(record.value or b"")
                total[3] += sum(len(k) + len(v or b"") for k, v in record.headers)
    finally:
        reader.close()
    streams = []
    for topic, (records, key, value, header) in sorted(sizes.items()):
        kind = kind_of_topic(deployment, topic)
        streams.append(Stream(kind, topic, records / inputs, key / records, value / records, header / records,
                              phase_of(kind)))
    return streams


def shape_table(streams: Sequence[Stream]) -> str:
    body = [(s.kind, f"{s.per_input:.3f}", f"{s.key_bytes:.0f}", f"{s.value_bytes:.0f}", f"{s.header_bytes:.0f}",
             str(s.phase)) for s in streams]
    body.append(("all", f"{sum(s.per_input for s in streams):.2f}", "", "", "",
                 f"{sum(s.per_input * (s.key_bytes + s.value_bytes + s.header_bytes) for s in streams):,.0f} B/input"))
    lines = render(("what the worker wrote", "records per intent", "key B", "value B", "headers B", "phase"), body)
    lines.append("read back from every topic and changelog after the worker's preloaded drain; phase: "
                 "1 acknowledged first (journal), 2 then (messages), 3 before the commit (rows)")
    return "\n".join(lines)


def _padded(size: float, ident: str | None = None) -> bytes:
    """A JSON value of about ``size`` bytes; the one that carries an input's id reads as an audit record."""
    head = {"input": {"ref": ident}} if ident is not None else {}
    body = json.dumps({**head, "pad": ""}).encode()
    return json.dumps({**head, "pad": "x" * max(0, round(size) - len(body))}).encode()


async def pass_through(bootstrap: str, source: str, target: str, group: str, recipe: str = "",
                       cluster: str = "") -> None:
    """Per input read, write what the recipe says (or the input once), at least once.

    With a recipe (the worker's :class:`Stream` s, measured), each input becomes the same
    number of records of the same sizes on topics of the same kinds, acknowledged in the
    worker's order per batch: the journal's first, then the messages, then the rows before the
    offsets are committed (about once a second, as Faust does). The first audit record
    of an input carries its id, as the worker's does.

    It reads at most the worker's ``batch_size`` inputs at a time, as the worker decides
    them. Unbounded, one read took all 10,000 preloaded intents at once, and their journal
    records were written before the first audit record: outside the timed window, which
    opens at the first output, so the anchor was timed on part of its work
    (benchmarks/README.md has the figures of both).

    With ``cluster`` (a file of the cluster's watch events), each batch is first decided by
    the engine, as ``simulate`` decides (state in memory, the same rules and policy as the
    worker's), and every output encoded as the worker encodes it, commands sealed: a shell
    as thin as the pass-through around the worker's engine (:func:`thin_engine`).
    """
    streams = [Stream(**s) for s in json.loads(Path(recipe).read_text())] if recipe else []
    decide = thin_engine(Path(cluster)) if cluster else None
    batch_size = load_settings(CONFIG).worker.batch_size
    owed = [0.0] * len(streams)
    values = [_padded(s.value_bytes) for s in streams]
    keys = [b"k" * round(s.key_bytes) for s in streams]
    headers = [[("h", b"x" * max(0, round(s.header_bytes) - 1))] if s.header_bytes >= 1 else None for s in streams]
    topics = [s.anchor_topic(target) for s in streams]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    consumer = AIOKafkaConsumer(source, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await consumer.start()
    await producer.start()
    try:
        while not consumer.assignment():
            await consumer.getmany(timeout_ms=100)  # joins the group; nothing is written yet
        print("ready", flush=True)
        committed = time.monotonic()
        rows: list[Any] = []
        while not stopping.is_set():
            batches = await consumer.getmany(timeout_ms=100, max_records=batch_size)
            records = [record for part in batches.values() for record in part]
            if decide is not None:
                for record in records:
                    decide(record.key, record.value)
            if not streams:
                sent = [await producer.send(target, key=record.key, value=record.value) for record in records]
                if sent:
                    await asyncio.gather(*sent)
            idents = [intent_id_of(record.value) for record in records] if streams else []
            for phase in (1, 2, 3):
                sent = []
                for record, ident in zip(records, idents, strict=True):
                    for i, stream in enumerate(streams):
                        if stream.phase != phase:
                            continue
                        owed[i] += stream.per_input
                        while owed[i] >= 1:
                            owed[i] -= 1
                            value = _padded(stream.value_bytes, ident) if ident and stream.kind == "audit" else values[i]
                            ident = ident if stream.kind != "audit" else None
                            partition = record.partition if phase != 2 else None  # rows: the input's partition
                            sent.append(await producer.send(topics[i], key=keys[i] if phase != 2 else record.key,
                                                            value=value, partition=partition, headers=headers[i]))
                if phase == 3:
                    rows += sent
                elif sent:
                    await asyncio.gather(*sent)
            if time.monotonic() - committed >= 1.0:
                await asyncio.gather(*rows)
                rows = []
                await consumer.commit()
                committed = time.monotonic()
        await asyncio.gather(*rows)
        await consumer.commit()
    finally:
        await producer.stop()
        await consumer.stop()


def thin_engine(cluster: Path) -> Callable[[bytes | None, bytes], list[bytes]]:
    """One intent decided as the worker decides it, with nothing of Kafka around it: the
    engine over state in memory that holds ``cluster``, each output encoded as the worker
    encodes it (``encode_message``, commands sealed with a keyring of its own, as a
    deployment's)."""
    from handlers.contracts.topics import INTENTS
    from handlers.decide.engine import Source
    from streams.common.codecs import encode_message
    from streams.common.signing import keyring_from

    simulation = simulated(cluster.read_text().splitlines())
    keyring = keyring_from(keys={"bench": secrets.token_urlsafe(32)}, keys_file=None, key_id="bench")
    topic = simulation.kafka.topic(INTENTS.name)

    def decide(key: bytes | None, value: bytes) -> list[bytes]:
        source = Source(topic, key.decode() if key is not None else None)
        return [encode_message(output.value, keyring=keyring)
                for output in simulation.step(value, source, simulation.now)]

    return decide


# ---------------------------------------------------------------------- the runs


@dataclass
class Setup:
    """The measured process on a fresh deployment, with where its input and output are."""

    process: Process
    input_topic: str
    output_topic: str
    ident: Callable[[bytes], str | None]
    intents: list[kit.Intent]
    deployment: Deployment

    @property
    def workdir(self) -> Path:
        return self.deployment.workdir

    def finish(self) -> None:
        self.process.stop()


@dataclass
class Options:
    bootstrap: str
    workdir: Path
    vms: int
    nodes: int
    duration: float
    warmup: float
    saturation: int
    deployments: list[Deployment] = field(default_factory=list)  # their topics are deleted at the end
    recipe: list[Stream] | None = None  # what the worker writes per intent, once measured


async def new_setup(kind: str, options: Options, run: str, count: int, *, started: bool) -> Setup:
    """A fresh deployment for one measurement; the worker's gets the cluster first."""
    deployment = new_deployment(options.bootstrap, options.workdir / run)
    options.deployments.append(deployment)
    cluster = kit.bench_cluster(options.vms, options.nodes, prefix=f"{run}-ev")
    intents = cluster.intents(count, run)
    if kind in ("pass-through", "thin-shell"):
        source, target = deployment.kafka.topic("pt-in"), deployment.kafka.topic("pt-out")
        deployment.workdir.mkdir(parents=True, exist_ok=True)
        script = None
        if kind == "thin-shell":  # the cluster the worker's engine holds, for its own
            script = deployment.workdir / "cluster.jsonl"
            script.write_text("\n".join(cluster.script().jsonl()))
        recipe = None
        if options.recipe:  # the fair anchor: the worker's records, on topics of their own
            recipe = deployment.workdir / "recipe.json"
            recipe.write_text(json.dumps([asdict(stream) for stream in options.recipe]))
            outputs = [stream.anchor_topic(f"{target}.") for stream in options.recipe]
            create_topics(options.bootstrap, [source, *outputs])
            target, ident = f"{target}.", audit_ref_of
            output = next(t for t, s in zip(outputs, options.recipe, strict=True) if s.kind == "audit")
        else:
            create_topics(options.bootstrap, [source, target])
            ident, output = intent_id_of, target
        pt = PassThrough(options.bootstrap, source, target, f"pt-{deployment.ident}",
                         deployment.workdir / "pass-through.log", recipe, script)
        if started:
            await asyncio.to_thread(pt.start)
        return Setup(pt, source, output, ident, intents, deployment)
    worker = WorkerUnderTest(deployment)
    await asyncio.to_thread(worker.start)
    try:
        await kit.publish_cluster(deployment, cluster.script(), timeout=300)
        await wait_until_caught_up(deployment, timeout=120)
    except BaseException:
        await asyncio.to_thread(worker.stop)  # no worker left running into the next runs
        raise
    if not started:
        await asyncio.to_thread(worker.stop)
    return Setup(worker, deployment.kafka.topic("intents"), deployment.kafka.topic("audit"), audit_ref_of,
                 intents, deployment)


def drain_timeout(count: int) -> float:
    return max(120.0, count / 50)  # generous: a slow process is reported, not killed


async def steady(kind: str, options: Options, rate: float) -> Row:
    """A paced producer at ``rate``; latency of each message after the warm-up."""
    warm = int(rate * options.warmup)
    count = warm + int(rate * options.duration)
    setup = await new_setup(kind, options, f"{RUN_PREFIX[kind]}-steady-{rate:.0f}", count,
                            started=True)
    arrivals = await Arrivals(options.bootstrap, setup.output_topic, setup.ident).start()
    producer = await new_producer(options.bootstrap)
    sent_at: dict[str, float] = {}
    sent_epoch: dict[str, float] = {}  # the same moment on the clock Kafka timestamps use
    try:
        t0 = time.perf_counter()
        cpu0 = Cpu()
        for i, intent in enumerate(setup.intents):
            if i == warm:
                cpu0 = cpu_of(setup.process.pid)
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent_at[intent.intent_id] = time.perf_counter()
            sent_epoch[intent.intent_id] = time.time()
            await producer.send(setup.input_topic, key=intent.key, value=intent.value)
        await producer.flush()
        measured = [intent.intent_id for intent in setup.intents[warm:]]
        missing = await arrivals.wait_for(measured, drain_timeout(len(measured)))
        cpu: Cpu | None = cpu_of(setup.process.pid) - cpu0
        arrived = [i for i in measured if i in arrivals.first]
        latencies = sorted(arrivals.first[i] - sent_at[i] for i in arrived)
        warming = sorted(arrivals.first[ident] - sent_at[ident] for intent in setup.intents[:warm]
                         if (ident := intent.intent_id) in arrivals.first)
        written = sorted(arrivals.stamped[i] - sent_epoch[i] for i in arrived)
        window = max(arrivals.first[i] for i in arrived) - sent_at[measured[0]] if arrived else 0.0
        return Row(f"{setup.process.name} steady {rate:,.0f}/s", len(arrived), window, latencies, cpu,
                   len(missing), note=f"{warm:,} warm-up messages not counted ({from_idle(warming)}); "
                   f"to the output's Kafka timestamp (written, not yet read back): {spread(written)}")
    finally:
        await producer.stop()
        await arrivals.stop()
        await asyncio.to_thread(setup.finish)


def spread(latencies: Sequence[float]) -> str:
    return kit.summary_ms(latencies, (0.5, 0.99))


def from_idle(latencies: Sequence[float]) -> str:
    """The warm-up's latency: the same rate, from an idle process on partitions never written."""
    return f"from idle: {spread(latencies)}"


def at_rate(rate: float) -> Callable[[str, Options], Awaitable[Row]]:
    async def run(kind: str, options: Options) -> Row:
        return await steady(kind, options, rate)

    return run


async def preloaded(kind: str, options: Options) -> Row:
    """Everything written while the process is stopped; its drain rate once started."""
    setup = await new_setup(kind, options, f"{RUN_PREFIX[kind]}-preloaded",
                            options.saturation, started=False)
    topics = deployment_topics(setup.deployment) if kind == "worker" and not options.recipe else []
    starts = await asyncio.to_thread(end_offsets, options.bootstrap, topics) if topics else {}
    producer = await new_producer(options.bootstrap)
    try:
        for intent in setup.intents:
            await producer.send(setup.input_topic, key=intent.key, value=intent.value)
        await producer.flush()
    finally:
        await producer.stop()
    arrivals = await Arrivals(options.bootstrap, setup.output_topic, setup.ident).start()
    marks: dict[str, Cpu] = {}

    def first_arrival() -> None:
        marks["cpu"] = cpu_of(setup.process.pid)

    arrivals.on_first = first_arrival
    try:
        started = time.perf_counter()
        await asyncio.to_thread(setup.process.start)
        ids = [intent.intent_id for intent in setup.intents]
        missing = await arrivals.wait_for(ids, drain_timeout(len(ids)), idle=STALL_SECONDS)
        arrived = sorted(arrivals.first[i] for i in ids if i in arrivals.first)
        cpu: Cpu | None = cpu_of(setup.process.pid) - marks.get("cpu", Cpu())
        if missing:  # the CPU of the idle wait is not the drain's
            cpu = None
        window = arrived[-1] - arrived[0] if len(arrived) > 1 else 0.0
        first_after = arrived[0] - started if arrived else float("nan")
        note = f"first output {first_after:.1f} s after the process started"
        if missing:
            note += (f"; {len(missing):,} never came (nothing more for {STALL_SECONDS:.0f} s): inputs skipped "
                     f"at start-up; its log is in {setup.workdir} (--keep)")
        if isinstance(setup.process, WorkerUnderTest):
            note += f"; garbage collections since its start: {setup.process.gc_pauses()}"
        row = Row(f"{setup.process.name} preloaded", max(0, len(arrived) - 1), window, [], cpu, len(missing),
                  note=note)
    finally:
        await arrivals.stop()
        await asyncio.to_thread(setup.finish)
    if starts and not missing:  # stopped: its rows are flushed and its offsets committed
        options.recipe = await asyncio.to_thread(written_between, setup.deployment, starts, len(setup.intents),
                                                 ("intents",))
    return row


def engine_alone(options: Options) -> Row:
    """The same intents through the engine in this process, no Kafka: the worker's floor.

    ``Simulation`` runs the rules the worker runs, with state in memory, and each output is
    encoded as the worker encodes it; what the worker spends beyond this is its Kafka shell.
    """
    from handlers.decide.engine import Source

    cluster = kit.bench_cluster(options.vms, options.nodes, prefix="engine-ev")
    simulation = simulated(cluster.script().jsonl())
    intents = cluster.intents(options.saturation, "engine")
    before, started = os.times(), time.perf_counter()
    for intent in intents:
        for output in simulation.step(intent.value, Source("vmstream.intents", intent.key.decode()), simulation.now):
            output.value.model_dump_json(exclude_none=True)
    seconds, after = time.perf_counter() - started, os.times()
    cpu = Cpu(after.user - before.user, after.system - before.system)
    return Row("(c) engine alone, no Kafka", len(intents), seconds, [], cpu,
               note="Simulation.step over the same intents in the driver, outputs encoded")


# ---------------------------------------------------------------------- reporting


def throughput_table(rows: list[Row]) -> str:
    header = ("run", "msgs", "seconds", "msgs/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "cpu ms/msg",
              "of it sys", "missing", "load1")
    body = []
    for r in rows:
        per = f"{1000 * r.cpu.total / r.messages:.2f}" if r.cpu is not None and r.messages else "-"
        system = f"{100 * r.cpu.system / r.cpu.total:.0f} %" if r.cpu is not None and r.cpu.total else "-"
        body.append((r.run, f"{r.messages:,}", f"{r.seconds:.2f}", f"{r.rate:,.0f}", r.ms(0.5), r.ms(0.9),
                     r.ms(0.99), r.ms(1.0), per, system, str(r.missing), f"{r.load1:.2f}"))
    lines = render(header, body)
    lines += [f"  {r.run}: {r.note}" for r in rows if r.note]
    lines.append("cpu ms/msg: the measured process's user + system time per message in the window "
                 "(steady: after the warm-up; preloaded: from its first output); of it sys: the kernel's share")
    return "\n".join(lines)


def verdict(rows: dict[str, Row]) -> tuple[list[str], bool]:
    """The targets, from the rows that define them."""
    lines = []
    ok = True
    a, b = rows.get("pt-preloaded"), rows.get("wk-preloaded")
    if a and b:
        ratio = b.rate / a.rate
        ok &= ratio >= TARGET_RATIO
        lines.append(f"(b)/(a) at saturation (preloaded): {b.rate:,.0f} / {a.rate:,.0f} msgs/s = {ratio:.2f}  "
                     f"(target ≥ {TARGET_RATIO:.2f}: {yes(ratio >= TARGET_RATIO)})")
    a, d = rows.get("pt-preloaded"), rows.get("ts-preloaded")
    if a and d:
        lines.append(f"(d)/(a) at saturation (preloaded): {d.rate:,.0f} / {a.rate:,.0f} msgs/s = {d.rate / a.rate:.2f}  "
                     f"(the engine in a shell as thin as the pass-through)")
    engine = rows.get("engine")
    b = rows.get("wk-preloaded")
    if engine and b and engine.cpu and b.cpu:
        alone, worker = engine.cpu.total / engine.messages, b.cpu.total / b.messages
        shell = worker - alone
        lines.append(f"CPU per intent: engine alone {1000 * alone:.3f} ms, worker {1000 * worker:.3f} ms "
                     f"({b.run}): the shell (worker - engine) {1000 * shell:.3f} ms = {shell / alone:.1f}x the "
                     f"engine (target <= 1.0x: {yes(shell <= alone)}), {100 * shell / worker:.0f} % of the worker's CPU")
        a = rows.get("pt-preloaded")
        if a and a.cpu and a.messages:
            lines.append(f"CPU per intent of the pass-through (a): {1000 * a.cpu.total / a.messages:.3f} ms; "
                         f"the shell over it: {shell / (a.cpu.total / a.messages):.1f}x")
        d = rows.get("ts-preloaded")
        if d and d.cpu and d.messages:
            lines.append(f"CPU per intent of the thin shell (d): {1000 * d.cpu.total / d.messages:.3f} ms, of it "
                         f"the shell (d - engine) {1000 * (d.cpu.total / d.messages - alone):.3f} ms")
    steady_row = rows.get("wk-steady")
    if steady_row and steady_row.latencies:
        p99 = 1000 * percentile(steady_row.latencies, 0.99)
        met = p99 <= TARGET_P99_MS and not steady_row.missing
        ok &= met
        lines.append(f"worker p99 at the steady rate: {p99:,.1f} ms  (target ≤ {TARGET_P99_MS:.0f} ms: {yes(met)})")
    for key, row in rows.items():
        if key.startswith("wk-steady") and row.latencies:
            anchor = rows.get("pt" + key.removeprefix("wk"))
            beside = (f"; pass-through p99 {anchor.ms(0.99)} ms (p50 {anchor.ms(0.5)}) at load {anchor.load1:.2f}"
                      if anchor else "")
            lines.append(f"steady {row.run.rsplit(' ', 1)[-1]}: worker p99 {row.ms(0.99)} ms (p50 {row.ms(0.5)}, "
                         f"{row.missing} missing) at load {row.load1:.2f}{beside}")
    return lines, ok


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", choices=("throughput", "preloaded", "idle"), default="throughput",
                        help="the runs against the pass-through (default), the worker's preloaded run alone, "
                             "or an idle worker's CPU")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --only preloaded: that many runs, each on a fresh deployment")
    parser.add_argument("--vms", type=int, default=1_000, help="VMs the intents act on (default 1,000)")
    parser.add_argument("--nodes", type=int, default=64, help="8-card nodes they run on (default 64)")
    parser.add_argument("--rates", type=lambda text: [float(r) for r in text.split(",") if float(r)],
                        default=[1_000.0, 250.0], help="steady runs at these intents/s (default 1000,250)")
    parser.add_argument("--duration", type=float, default=20.0, help="steady (or idle) seconds measured (default 20)")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="steady seconds sent first, reported apart (from idle) and not counted")
    parser.add_argument("--saturation", type=int, default=20_000, help="intents of a preloaded run")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, short durations")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the workers' logs in DIR (default: removed)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    kit.add_json_option(parser)
    parser.add_argument("--pass-through-child", nargs=6,
                        metavar=("BOOTSTRAP", "SOURCE", "TARGET", "GROUP", "RECIPE", "CLUSTER"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.vms, args.nodes, args.duration, args.warmup, args.saturation = 200, 16, 5.0, 1.0, 3_000
    return args


def idle(options: Options) -> int:
    """A ready worker with nothing to decide: its share of a core over ``--duration`` seconds."""
    deployment = new_deployment(options.bootstrap, options.workdir / "idle")
    worker = kit.Worker(deployment, "idle").start(timeout=120)
    try:
        time.sleep(5.0)  # the start-up's own work (first collection, commits) is done
        cpu0, t0 = cpu_of(worker.pid), time.monotonic()
        time.sleep(options.duration)
        share = (cpu_of(worker.pid) - cpu0).total / (time.monotonic() - t0)
    finally:
        worker.stop()
        deployment.delete_topics()
    pacing = os.environ.get("VMSTREAM_WORKER__FETCH_IDLE_WAIT_MS", "default")
    print(f"an idle worker used {100 * share:.1f} % of a core over {options.duration:.0f} s "
          f"(fetch_idle_wait_ms {pacing}; {kit.load_average()})")
    return 0


def delete_topics(options: Options) -> None:
    """The runs' topics, deleted at the end, not between runs: the broker deletes the files a
    minute later, in the middle of another run."""
    deleted = sum(len(deployment.delete_topics()) for deployment in options.deployments)
    print(f"deleted the runs' {deleted} topics")


async def preloaded_only(options: Options, repeat: int) -> int:
    """The worker's preloaded run alone, ``repeat`` times: the figure to compare two trees by,
    run from each in turn (``cd TREE && PYTHONPATH=TREE TREE/.venv/bin/python benchmarks/…``)."""
    rows = []
    for _ in range(repeat):
        rows.append(row := await preloaded("worker", options))
        cpu = f"{1000 * row.cpu.total / row.messages:.3f} ms" if row.cpu and row.messages else "-"
        print(f"  {row.run}: {row.rate:,.0f} intents/s, CPU per intent {cpu} (load {row.load1:.2f}); {row.note}",
              flush=True)
    print(throughput_table(rows))
    delete_topics(options)
    return 0


async def measure(args: argparse.Namespace, bootstrap: str, workdir: Path) -> int:
    options = Options(bootstrap, workdir, args.vms, args.nodes, args.duration, args.warmup, args.saturation)
    print(f"worker throughput, broker {bootstrap}")
    kit.print_load("at the start")
    if args.only == "idle":
        return idle(options)
    if args.only == "preloaded":
        return await preloaded_only(options, args.repeat)
    print(f"  intents on {args.vms:,} VMs over {args.nodes} nodes; steady {', '.join(f'{r:,.0f}/s' for r in args.rates)} "
          f"for {args.duration:.0f} s (+{args.warmup:.0f} s warm-up); preloaded {args.saturation:,} intents")
    # The worker's preloaded run first: the pass-through writes what it measured the worker writing.
    plan: list[tuple[str, str, Callable[[str, Options], Awaitable[Row]]]] = [
        ("wk-preloaded", "worker", preloaded), ("pt-preloaded", "pass-through", preloaded),
        ("ts-preloaded", "thin-shell", preloaded)]
    for rate in args.rates:
        suffix = "" if rate == TARGET_RATE else f"-{rate:.0f}"
        plan += [(f"pt-steady{suffix}", "pass-through", at_rate(rate)), (f"wk-steady{suffix}", "worker", at_rate(rate))]
    rows: dict[str, Row] = {}
    for key, kind, run in plan:
        if kind == "thin-shell" and not options.recipe:
            continue  # it writes what the worker wrote: measured by the worker's preloaded run
        started = time.perf_counter()
        rows[key] = row = await run(kind, options)
        if key == "wk-preloaded" and options.recipe:
            print(shape_table(options.recipe), flush=True)
        print(f"  {row.run}: {row.rate:,.0f} msgs/s, p99 {row.ms(0.99)} ms "
              f"({time.perf_counter() - started:.0f} s, load {row.load1:.2f})", flush=True)
    rows["engine"] = engine_alone(options)
    print()
    print(throughput_table(list(rows.values())))
    lines, ok = verdict(rows)
    print("\n".join(lines))
    print()
    kit.print_load("at the end")
    kit.write_json(args.json, {
        "rows": {key: {"run": r.run, "messages": r.messages, "seconds": r.seconds, "rate": r.rate,
                       "p50_ms": r.ms(0.5), "p99_ms": r.ms(0.99), "missing": r.missing, "load1": r.load1,
                       "cpu_ms_per_msg": 1000 * r.cpu.total / r.messages if r.cpu and r.messages else None}
                 for key, r in rows.items()},
        "targets_met": ok,
    })
    delete_topics(options)
    return 1 if args.check and not ok else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kit.quiet_client_logs()  # a topic a moment old can answer NotLeaderForPartition: the clients retry
    if args.pass_through_child:
        asyncio.run(pass_through(*args.pass_through_child))
        return 0
    with kit.broker() as running, tempfile.TemporaryDirectory(prefix="vmstream-bench-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(measure(args, running.bootstrap, workdir))


if __name__ == "__main__":
    sys.exit(main())
