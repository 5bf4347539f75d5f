"""Scale-out shown, not assumed: one worker pinned to a core, against two in one group.

Why this exists: the worker is one Python process, so an AZ's load is carried by more of
them in one consumer group, each holding a share of the partitions. That only helps if the
partitions really divide the work and the workers do not wait on one another; this script
measures it on the same broker with the same preloaded intents:

(a) **one worker**, every thread pinned to core 0 (``taskset -a -p -c 0`` at spawn);
(b) **two workers** of one deployment (one app id: one consumer group, one set of tables),
    pinned to cores 0 and 1.

Per case, on a fresh :class:`~harness.running.Deployment`: the workers are started and
ready; the cluster of ``worker_throughput.py`` (``--vms`` VMs, half with an RTX card, over
``--nodes`` 8-card nodes) is published and decided, and the group has committed everything;
then

1. **preloaded** — the workers are stopped with SIGSTOP (their group session is set to
   60 s, so the group does not change), ``--intents`` intents are written, the workers are
   continued with SIGCONT: intents/s from the first audit record to the last, read back by
   this script's own consumer (``read_committed``), and the CPU time per intent of the
   workers (and of the broker, when it is this run's);
2. **steady** — ``--rate`` intents/s, paced, for ``--warmup`` + ``--duration`` seconds:
   p50/p99/max from a send to its audit record, after the warm-up.

The broker and this driver are not pinned: on a 2-core machine they share the cores with
the workers (``--broker-cpus`` pins the broker when it is this run's). Sizes: after both
cases, every topic and changelog of the two-worker deployment is read back; the records
and bytes per intent, and the tables' bytes per VM and per node (the last record per key:
what compaction keeps), are what ``docs/scaling.md`` is derived from.

Run it from the repository root::

    .venv/bin/python benchmarks/scale_out.py            # 10,000 intents, 200/s steady (≈ 6 min)
    .venv/bin/python benchmarks/scale_out.py --quick    # 2,000 intents, 100/s for 5 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's)
from kit import Arrivals, Cpu, Worker, audit_ref_of, cpu_of, new_producer, percentile  # noqa: E402
from kit import Intent, bench_cluster, publish_cluster  # noqa: E402

from harness.running import Deployment  # noqa: E402
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client  # noqa: E402
from streams.common.topics import ROUTED  # noqa: E402

# A stopped worker keeps its partitions: the group waits this long for its heartbeat.
SESSION_ENV = {"VMSTREAM_WORKER__SESSION_TIMEOUT_SECONDS": "60", "VMSTREAM_WORKER__HEARTBEAT_INTERVAL_SECONDS": "3",
               "VMSTREAM_WORKER__TICK_SECONDS": "1.0"}  # the tick at its production default
STALL_SECONDS = 20.0  # a preloaded drain with no output for this long is over


@dataclass
class Case:
    name: str
    cpus: list[str]
    preloaded_rate: float = 0.0
    preloaded_seconds: float = 0.0
    preloaded_missing: int = 0
    preloaded_cpu: list[Cpu] = field(default_factory=list)  # per worker
    broker_cpu: Cpu | None = None
    steady_latencies: list[float] = field(default_factory=list)
    steady_missing: int = 0
    steady_cpu: list[Cpu] = field(default_factory=list)
    steady_count: int = 0
    load: list[float] = field(default_factory=list)
    sizes: list[kit.TopicBytes] = field(default_factory=list)
    events: int = 0
    events_sizes: list[kit.TopicBytes] = field(default_factory=list)  # what the cluster's events wrote
    events_cpu: list[Cpu] = field(default_factory=list)  # per worker, deciding the cluster's watch events
    rss: list[tuple[float, float]] = field(default_factory=list)  # per worker at the end: (current, peak) MiB

    def cpu_ms_per_intent(self, cpus: list[Cpu], count: int) -> float:
        return 1000 * sum(c.total for c in cpus) / count if count else float("nan")


def cpu_all(workers: list[Worker]) -> list[Cpu]:
    return [cpu_of(w.pid) for w in workers]


def signal_all(workers: list[Worker], sig: int) -> None:
    for worker in workers:
        os.kill(worker.pid, sig)


async def start_group(deployment: Deployment, cpus: list[str]) -> list[Worker]:
    """Workers of one group, each on its CPUs; returns once every one of them is ready."""
    workers = []
    for i, cpu in enumerate(cpus):
        worker = Worker(deployment, f"w{i}", cpu, env=SESSION_ENV)
        await asyncio.to_thread(worker.start, 300)
        workers.append(worker)
    for worker in workers:  # a later one joining makes the earlier ones recover again
        await asyncio.to_thread(worker.wait_ready, 300)
    return workers


async def send_all(bootstrap: str, topic: str, intents: list[Intent], rate: float | None = None) -> dict[str, float]:
    """Send the intents (paced at ``rate``, or as fast as possible); when each was sent (perf_counter)."""
    producer = await new_producer(bootstrap)
    sent: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        for i, intent in enumerate(intents):
            if rate is not None and (delay := t0 + i / rate - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            sent[intent.intent_id] = time.perf_counter()
            await producer.send(topic, key=intent.key, value=intent.value)
        await producer.flush()
    finally:
        await producer.stop()
    return sent


async def preloaded(case: Case, deployment: Deployment, workers: list[Worker], intents: list[Intent],
                    broker_pid: int | None) -> None:
    arrivals = await Arrivals(deployment.bootstrap, deployment.kafka.topic("audit"), audit_ref_of).start()
    marks: dict[str, Any] = {}

    def first_arrival() -> None:
        marks["workers"] = cpu_all(workers)
        marks["broker"] = cpu_of(broker_pid) if broker_pid else None

    arrivals.on_first = first_arrival
    try:
        signal_all(workers, signal.SIGSTOP)
        try:
            await send_all(deployment.bootstrap, deployment.kafka.topic("intents"), intents)
        finally:
            signal_all(workers, signal.SIGCONT)
        ids = [intent.intent_id for intent in intents]
        missing = await arrivals.wait_for(ids, timeout=max(300.0, len(ids) / 20), idle=STALL_SECONDS)
        arrived = sorted(arrivals.first[i] for i in ids if i in arrivals.first)
        case.preloaded_missing = len(missing)
        case.preloaded_seconds = arrived[-1] - arrived[0] if len(arrived) > 1 else 0.0
        case.preloaded_rate = (len(arrived) - 1) / case.preloaded_seconds if case.preloaded_seconds else 0.0
        if not missing:  # else the CPU of the idle wait is not the drain's
            case.preloaded_cpu = [after - before for after, before in zip(cpu_all(workers), marks["workers"])]
            if broker_pid and marks["broker"] is not None:
                case.broker_cpu = cpu_of(broker_pid) - marks["broker"]
    finally:
        await arrivals.stop()


async def steady(case: Case, deployment: Deployment, workers: list[Worker], intents: list[Intent],
                 warm: int, rate: float) -> None:
    arrivals = await Arrivals(deployment.bootstrap, deployment.kafka.topic("audit"), audit_ref_of).start()
    try:
        warm_sent = await send_all(deployment.bootstrap, deployment.kafka.topic("intents"), intents[:warm], rate)
        del warm_sent  # the warm-up is not counted
        cpu0 = cpu_all(workers)
        sent = await send_all(deployment.bootstrap, deployment.kafka.topic("intents"), intents[warm:], rate)
        ids = list(sent)
        missing = await arrivals.wait_for(ids, timeout=max(120.0, len(ids) / 20))
        case.steady_cpu = [after - before for after, before in zip(cpu_all(workers), cpu0)]
        case.steady_latencies = sorted(arrivals.first[i] - sent[i] for i in ids if i in arrivals.first)
        case.steady_missing = len(missing)
        case.steady_count = len(ids)
    finally:
        await arrivals.stop()


def deployment_topics(deployment: Deployment) -> list[str]:
    """The deployment's topics and every changelog its workers created (whatever tables there are)."""
    kafka = deployment.kafka
    names = [kafka.topic(n) for n in ("intents", "k8s-events", ROUTED, "commands", "notifications", "audit", "dlq")]
    listed = admin_client(kafka).list_topics(timeout=ADMIN_SECONDS).topics
    changelogs = sorted(t for t in listed if t.startswith(f"{deployment.app_id}-") and t.endswith("-changelog"))
    return names + changelogs


async def run_case(case: Case, args: argparse.Namespace, workdir: Path, broker_pid: int | None,
                   deployments: list[Deployment]) -> None:
    deployment = kit.new_deployment(args.bootstrap, workdir / case.name.replace(" ", "-"))
    deployments.append(deployment)
    case.load.append(kit.load1())
    workers = await start_group(deployment, case.cpus)
    try:
        cluster = bench_cluster(args.vms, args.nodes, prefix=f"{deployment.ident}-ev")
        cpu0 = cpu_all(workers)
        events, seconds = await publish_cluster(deployment, cluster.script(), timeout=600)
        await kit.wait_until_caught_up(deployment, timeout=300)
        case.events, case.events_cpu = events, [a - b for a, b in zip(cpu_all(workers), cpu0)]
        print(f"  {case.name}: {len(workers)} ready, {events:,} cluster events decided in {seconds:.1f} s", flush=True)
        topics = deployment_topics(deployment)
        before = await asyncio.to_thread(kit.topic_bytes, args.bootstrap, topics)
        case.events_sizes = before
        await preloaded(case, deployment, workers, cluster.intents(args.intents, f"{deployment.ident}-pre"), broker_pid)
        case.load.append(kit.load1())
        print(f"  {case.name}: preloaded {case.preloaded_rate:,.0f} intents/s (load {case.load[-1]:.2f})", flush=True)
        await kit.wait_until_caught_up(deployment, timeout=300)
        after = await asyncio.to_thread(kit.topic_bytes, args.bootstrap, topics)
        case.sizes = [kit.TopicBytes(a.topic, a.records - b.records, a.key_bytes - b.key_bytes,
                                     a.value_bytes - b.value_bytes, a.keys, a.latest_bytes)
                      for a, b in zip(after, before)]
        warm = int(args.rate * args.warmup)
        count = warm + int(args.rate * args.duration)
        # Rounds go on from where the preloaded intents left the VMs (ids differ by their run).
        steady_intents = cluster.intents(args.intents + count, f"{deployment.ident}-st")[args.intents:]
        await steady(case, deployment, workers, steady_intents, warm, args.rate)
        case.load.append(kit.load1())
        p99 = f"{1000 * percentile(case.steady_latencies, 0.99):,.1f}" if case.steady_latencies else "-"
        print(f"  {case.name}: steady {args.rate:,.0f}/s p99 {p99} ms (load {case.load[-1]:.2f})", flush=True)
        case.rss = [kit.rss_mib(w.pid) for w in workers]
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)


def report(cases: list[Case], args: argparse.Namespace, broker_pinned: str) -> dict[str, Any]:
    header = ("case", "intents/s (preloaded)", "s", "missing", "worker cpu ms/intent", "per worker", "broker cpu ms/intent",
              f"steady {args.rate:,.0f}/s p50 / p99 / max ms", "steady missing", "worker cpu ms/intent", "load1 start/pre/steady")
    body = []
    for c in cases:
        per_worker = " + ".join(f"{1000 * x.total / args.intents:.2f}" for x in c.preloaded_cpu) or "-"
        broker = f"{1000 * c.broker_cpu.total / args.intents:.2f}" if c.broker_cpu else "-"
        lat = (" / ".join(f"{1000 * percentile(c.steady_latencies, q):,.0f}" for q in (0.5, 0.99, 1.0))
               if c.steady_latencies else "-")
        body.append((c.name, f"{c.preloaded_rate:,.0f}", f"{c.preloaded_seconds:.1f}", str(c.preloaded_missing),
                     f"{c.cpu_ms_per_intent(c.preloaded_cpu, args.intents):.2f}" if c.preloaded_cpu else "-",
                     per_worker, broker, lat, str(c.steady_missing),
                     f"{c.cpu_ms_per_intent(c.steady_cpu, c.steady_count):.2f}" if c.steady_cpu else "-",
                     " / ".join(f"{x:.1f}" for x in c.load)))
    print()
    print(kit.table(header, body))
    one, two = cases[0], cases[-1]
    ratio = two.preloaded_rate / one.preloaded_rate if len(cases) == 2 and one.preloaded_rate else float("nan")
    print(f"\nratio two / one (preloaded intents/s): {ratio:.2f}")
    for c in cases:
        print(f"{c.name}: the cluster's {c.events:,} watch events (and the resident updates they set off) cost "
              f"{1000 * sum(x.total for x in c.events_cpu) / max(1, c.events):.2f} ms of worker CPU each; "
              "RSS at the end (current / peak MiB): " + ", ".join(f"{now:,.0f} / {peak:,.0f}" for now, peak in c.rss))
    print(f"workers pinned: {', '.join(f'{c.name} on CPU {chr(44).join(c.cpus)}' for c in cases)}; "
          f"broker {broker_pinned}; this driver unpinned")
    sizes = two.sizes
    print(f"\nwhat {args.intents:,} preloaded intents wrote ({two.name}'s deployment; bytes = key + value):")
    size_rows = [(s.topic.split(".", 1)[-1] if not s.topic.endswith("-changelog") else s.topic.split("-", 2)[-1],
                  f"{s.records:,}", f"{s.records / args.intents:.2f}", f"{s.bytes:,}", f"{s.bytes / args.intents:,.0f}",
                  f"{s.bytes / s.records:,.0f}" if s.records else "-") for s in sizes]
    print(kit.table(("topic", "records", "per intent", "bytes", "bytes per intent", "bytes per record"), size_rows))
    print(f"\nwhat the cluster's {two.events:,} watch events wrote ({args.vms:,} VMs with their VMIs, {args.nodes} nodes):")
    print(kit.table(("topic", "records", "per event", "bytes", "bytes per event"),
                    [(s.topic.split(".", 1)[-1] if not s.topic.endswith("-changelog") else s.topic.split("-", 2)[-1],
                      f"{s.records:,}", f"{s.records / max(1, two.events):.2f}", f"{s.bytes:,}",
                      f"{s.bytes / max(1, two.events):,.0f}") for s in two.events_sizes]))
    tables = {s.topic.split("-", 2)[-1].removeprefix("state-").removesuffix("-changelog"): s
              for s in two.sizes if s.topic.endswith("-changelog")}
    print(f"\ntables once compacted (last record per key), {args.vms:,} VMs over {args.nodes} nodes, after the runs:")
    print(kit.table(("table", "keys", "bytes", "bytes per key"),
                    [(name, f"{t.keys:,}", f"{t.latest_bytes:,}", f"{t.latest_bytes / t.keys:,.0f}" if t.keys else "-")
                     for name, t in tables.items()]))
    return {
        "cases": [{"name": c.name, "cpus": c.cpus, "preloaded_rate": c.preloaded_rate,
                   "preloaded_missing": c.preloaded_missing,
                   "worker_cpu_ms_per_intent": c.cpu_ms_per_intent(c.preloaded_cpu, args.intents) if c.preloaded_cpu else None,
                   "per_worker_cpu_s": [x.total for x in c.preloaded_cpu],
                   "broker_cpu_ms_per_intent": 1000 * c.broker_cpu.total / args.intents if c.broker_cpu else None,
                   "steady_rate": args.rate, "steady_count": c.steady_count, "steady_missing": c.steady_missing,
                   "steady_p50_ms": 1000 * percentile(c.steady_latencies, 0.5) if c.steady_latencies else None,
                   "steady_p99_ms": 1000 * percentile(c.steady_latencies, 0.99) if c.steady_latencies else None,
                   "steady_worker_cpu_ms_per_intent": c.cpu_ms_per_intent(c.steady_cpu, c.steady_count) if c.steady_cpu else None,
                   "load1": c.load, "events": c.events,
                   "worker_cpu_ms_per_event": 1000 * sum(x.total for x in c.events_cpu) / max(1, c.events),
                   "rss_mib": c.rss} for c in cases],
        "ratio": ratio,
        "intents": args.intents,
        "events_written_per_topic": [{"topic": s.topic, "records": s.records, "bytes": s.bytes}
                                     for s in two.events_sizes],
        "written_per_topic": [{"topic": s.topic, "records": s.records, "bytes": s.bytes} for s in sizes],
        "tables": {name: {"keys": t.keys, "latest_bytes": t.latest_bytes} for name, t in tables.items()},
        "vms": args.vms, "nodes": args.nodes,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--intents", type=int, default=10_000, help="preloaded intents per case (default 10,000)")
    parser.add_argument("--rate", type=float, default=200.0, help="steady offered intents/s (default 200)")
    parser.add_argument("--duration", type=float, default=20.0, help="steady seconds measured (default 20)")
    parser.add_argument("--warmup", type=float, default=5.0, help="steady seconds sent first, not counted")
    parser.add_argument("--vms", type=int, default=1_000, help="VMs the intents act on (default 1,000)")
    parser.add_argument("--nodes", type=int, default=64, help="8-card nodes they run on (default 64)")
    parser.add_argument("--cpus", default="0,1", help="the CPU of each worker in the two-worker case (default 0,1)")
    parser.add_argument("--broker-cpus", help="pin this run's broker to these CPUs (default: not pinned)")
    parser.add_argument("--only", choices=("one", "two"), help="one case only")
    parser.add_argument("--quick", action="store_true", help="2,000 intents, 100/s for 5 s, 200 VMs")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the workers' logs in DIR")
    kit.add_json_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.intents, args.rate, args.duration, args.warmup, args.vms, args.nodes = 2_000, 100.0, 5.0, 2.0, 200, 16
    return args


async def measure(args: argparse.Namespace, broker: kit.Broker, workdir: Path) -> int:
    print(f"scale-out: {args.intents:,} preloaded intents and {args.rate:,.0f}/s steady for {args.duration:.0f} s "
          f"(+{args.warmup:.0f} s warm-up), {args.vms:,} VMs over {args.nodes} nodes; broker {broker.bootstrap}")
    kit.print_load("at the start")
    broker_pinned = "shared (not this run's)" if broker.pid is None else "not pinned (shares the cores)"
    if args.broker_cpus and broker.pid is not None:
        kit.pin(broker.pid, args.broker_cpus)
        broker_pinned = f"pinned to CPU {args.broker_cpus}"
    cpus = args.cpus.split(",")
    cases = [Case("one worker", cpus[:1]), Case("two workers", cpus[:2])]
    if args.only:
        cases = [cases[0] if args.only == "one" else cases[1]]
    deployments: list[Deployment] = []
    try:
        for case in cases:
            await run_case(case, args, workdir, broker.pid, deployments)
        figures = report(cases, args, broker_pinned)
    finally:
        deleted = sum(len(d.delete_topics()) for d in deployments)
        print(f"deleted the runs' {deleted} topics")
    print()
    kit.print_load("at the end")
    kit.write_json(args.json, figures)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kit.quiet_client_logs()
    with kit.broker() as broker, tempfile.TemporaryDirectory(prefix="vmstream-scale-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        args.bootstrap = broker.bootstrap
        return asyncio.run(measure(args, broker, workdir))


if __name__ == "__main__":
    sys.exit(main())
