"""How soon does vmstream work again after a crash, a restart over a backlog, a cold start?

Three parts, each against an anchor in the same run:

- **kill** — the worker, then the applier, killed with SIGKILL in the middle of a steady
  stream of inputs (one every 100 ms) and started again at once, as a kubelet restarts a
  crashed container: the time from the kill to the first output of an input published after
  it (the worker: a node event's audit record; the applier: a ``cordon_node`` /
  ``uncordon_node`` command's result on a local kube-apiserver). Anchor: the same with the
  consumer settings of before (no group instance id; Faust's 60 s session and 3 s heartbeat
  for the worker, kafka-python's 10 s and 3 s for the applier) beside those of now
  (``streams/common/settings.py``'s defaults with a ``group_instance_id`` per process, as
  ``deploy/`` sets it).
- **backlog** — a worker decides a small AZ and stops; ``--intents`` ``set_gpu`` intents are
  published while none runs; a new worker (same app id) must decide every one of them.
- **cold** — a new worker process (new working directory, no local state) timed from its
  start to ``/health`` and to ``/ready`` over tables of ``--vms`` VMs and ``--nodes`` nodes
  (recovered from their changelogs), beside the same start over an empty deployment.

    .venv/bin/python benchmarks/recovery.py --runs 3
    .venv/bin/python benchmarks/recovery.py --only backlog --intents 5000 --runs 5
    .venv/bin/python benchmarks/recovery.py --only cold
    .venv/bin/python benchmarks/recovery.py --small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)

from handlers.contracts.messages import Command, ObjectRef  # noqa: E402
from handlers.contracts.topics import AUDIT, COMMAND_RESULTS  # noqa: E402
from handlers.core.decisions import subject_key  # noqa: E402
from harness.publishing import publish  # noqa: E402
from harness.running import CONFIG, Deployment, Outputs, WorkerProcess  # noqa: E402
from harness.scenarios import cluster  # noqa: E402
from samples.cluster import A100  # noqa: E402
from samples.cluster import node as node_object  # noqa: E402
from streams.common.codecs import encode_message  # noqa: E402
from streams.common.durable import DurableProducer, Record  # noqa: E402
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client  # noqa: E402

PERIOD = 0.1  # one input every 100 ms
DEADLINE = 240.0  # a recovery slower than this is reported as such
TABLES_SHOWN = ("vms", "vmis", "nodes", "residents", "usage")
BACKLOG_VMS = ("train-1", "batch-1", "web-1")  # observed VMs of harness.scenarios.cluster

# Membership settings per row and process (VMSTREAM_WORKER__* environment variables).
SETTINGS = {
    "before": {
        "worker": {"VMSTREAM_WORKER__SESSION_TIMEOUT_SECONDS": "60", "VMSTREAM_WORKER__HEARTBEAT_INTERVAL_SECONDS": "3"},
        "applier": {"VMSTREAM_WORKER__SESSION_TIMEOUT_SECONDS": "10", "VMSTREAM_WORKER__HEARTBEAT_INTERVAL_SECONDS": "3"},
    },
    "now": {
        "worker": {"VMSTREAM_WORKER__GROUP_INSTANCE_ID": "worker-0"},
        "applier": {"VMSTREAM_WORKER__GROUP_INSTANCE_ID": "apply-0"},
    },
}


def new_deployment(bootstrap: str) -> Deployment:
    return kit.new_deployment(bootstrap, Path(tempfile.mkdtemp(prefix="vmstream-recovery-")))


# --------------------------------------------------------------------------- kill


class Feeder:
    """Publishes ``make(n)`` → (topic, key, value, ref) every PERIOD; remembers when each went."""

    def __init__(self, deployment: Deployment, make: Callable[[int], tuple[str, str, bytes, str]]) -> None:
        self.kafka = deployment.kafka
        self.make = make
        self.sent: dict[str, float] = {}  # ref → epoch seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client = DurableProducer(self.kafka, client_id="bench", timeout=30)
        try:
            n = 0
            while not self._stop.wait(PERIOD):
                topic, key, value, ref = self.make(n)
                self.sent[ref] = time.time()  # before the send: its output cannot come earlier
                client.send_all([Record(self.kafka.topic(topic), key.encode(), value)])
                n += 1
        finally:
            client.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def recovery(feeder: Feeder, outputs: Outputs, ref: Callable[[str, dict[str, Any]], str | None],
             kill: Callable[[], None], restart: Callable[[], None]) -> float:
    """Kill, restart at once, and time until an input published after the kill has its output."""

    def first_after(since: float) -> float | None:
        outputs.poll()
        after = {r for r, sent in list(feeder.sent.items()) if sent >= since}
        times = [at.timestamp() for at, topic, value in outputs.arrivals if ref(topic, value) in after]
        return min(times) - since if times else None

    flowing = time.time() + 120
    while first_after(time.time() - 2.0) is None:
        if time.time() > flowing:
            raise TimeoutError("no steady flow before the kill")
    killed = time.time()
    kill()
    restart()
    while (seconds := first_after(killed)) is None:
        if time.time() > killed + DEADLINE:
            return float("inf")
    return seconds


def node_event(n: int, label: str) -> tuple[str, str, bytes, str]:
    event = json.loads(next(line for line in cluster().jsonl() if '"kind": "Node"' in line))
    value = event["value"]
    ref = f"rec-{label}-{n}"
    value.update(event_id=ref, type="MODIFIED", observed_at=datetime.now(UTC).isoformat())
    value["object"]["metadata"]["resourceVersion"] = str(1000 + n)
    return "k8s-events", event["key"], json.dumps(value).encode(), ref


def worker_killed(bootstrap: str, label: str) -> float:
    env = SETTINGS[label]["worker"]
    deployment = new_deployment(bootstrap)
    workers = [WorkerProcess(deployment, "w1", env=env).start()]
    outputs = Outputs(deployment)
    feeder = None
    try:
        deployment.publish_lines(cluster().jsonl())
        feeder = Feeder(deployment, lambda n: node_event(n, label))

        def restart() -> None:
            workers.append(WorkerProcess(deployment, f"w{len(workers) + 1}", env=env))
            workers[-1].start(timeout=DEADLINE)

        def kill() -> None:
            workers[-1].stop(signal.SIGKILL)

        return recovery(feeder, outputs, lambda topic, audit: (audit.get("input") or {}).get("ref") if topic == AUDIT.name
                        else None, kill, restart)
    finally:
        if feeder is not None:
            feeder.close()
        outputs.close()
        for worker in workers:
            worker.stop(signal.SIGKILL)
        deployment.delete_topics()


@contextmanager
def applier_process(deployment: Deployment, kubeconfig: Path, env: dict[str, str],
                    name: str) -> Iterator[subprocess.Popen[bytes]]:
    with open(deployment.workdir / f"{name}.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "streams.kube.applying", "apply", "--config", str(CONFIG), "--kubeconfig",
             str(kubeconfig), "--probe-port", "0"],
            env={**deployment.env(0), **env}, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def applier_killed(bootstrap: str, kubeconfig: Path, label: str) -> float:
    from kubernetes import client, config

    env = SETTINGS[label]["applier"]
    deployment = new_deployment(bootstrap)
    name = f"rec-{label}-{uuid.uuid4().hex[:6]}"
    obj = node_object(name, gpus={A100: 1})
    for field in ("uid", "resourceVersion"):
        del obj["metadata"][field]
    with config.new_client_from_config(config_file=str(kubeconfig)) as api:
        client.CoreV1Api(api).create_node(obj)
    target = ObjectRef(kind="Node", namespace=None, name=name)
    keyring = deployment.signing.keyring()

    def make(n: int) -> tuple[str, str, bytes, str]:
        ref = f"{name}-{n}"
        command = Command(command_id=ref, type="uncordon_node" if n % 2 else "cordon_node", target=target,
                          cause=f"recovery-{n}", issued_at=datetime.now(UTC), requested_by="ops@example.com")
        return "commands", subject_key(target), encode_message(command, keyring=keyring), ref

    with ExitStack() as stack:
        processes = [stack.enter_context(applier_process(deployment, kubeconfig, env, "apply-1"))]
        stack.callback(deployment.delete_topics)
        outputs = Outputs(deployment)
        stack.callback(outputs.close)
        feeder = Feeder(deployment, make)
        stack.callback(feeder.close)

        def kill() -> None:
            processes[-1].kill()
            processes[-1].wait()

        def restart() -> None:
            processes.append(stack.enter_context(
                applier_process(deployment, kubeconfig, env, f"apply-{len(processes) + 1}")))

        # Outputs reads the commands topic too, where each command carries the same id: only a result counts.
        return recovery(feeder, outputs, lambda topic, result: result.get("command_id") if topic == COMMAND_RESULTS.name
                        else None, kill, restart)
    raise AssertionError("unreachable")


def kills(args: argparse.Namespace, bootstrap: str, stack: ExitStack) -> dict[str, Any]:
    from harness.localkube import LocalKube

    kubeconfig = stack.enter_context(LocalKube()).kubeconfig
    rows: dict[str, list[float]] = {}
    for _ in range(args.runs):
        for label in args.rows.split(","):
            runs: tuple[tuple[str, Callable[[], float]], ...] = (
                ("worker", lambda: worker_killed(bootstrap, label)),
                ("applier", lambda: applier_killed(bootstrap, kubeconfig, label)))
            for process, run in runs:
                rows.setdefault(f"{process} {label}", []).append(run())
                print(f"{process:7} {label:6}: {rows[f'{process} {label}'][-1]:6.1f} s  ({kit.load_average()})",
                      flush=True)
    medians = {key: statistics.median(values) for key, values in rows.items()}
    body = [(what, *(f"{medians[f'{process} {label}']:.1f} s" if f"{process} {label}" in medians else "-"
                     for label in ("before", "now")))
            for process, what in (("worker", "the first new decision (worker)"),
                                  ("applier", "the first new apply (applier)"))]
    print()
    print(kit.table(("from kill -9 to (median)", "before", "now"), body))
    print("before: no group instance id, session 60 s / heartbeat 3 s (worker), 10 s / 3 s (applier)")
    print("now:    group_instance_id per process, session 10 s / heartbeat 1 s (streams/common/settings.py)")
    return {"kill_seconds": rows}


# ------------------------------------------------------------------------ backlog


def backlog_run(bootstrap: str, count: int, window: float) -> int:
    """How many of ``count`` waiting intents a restarted worker decided within ``window``."""
    deployment = new_deployment(bootstrap)
    outputs = Outputs(deployment)
    first = WorkerProcess(deployment, "w1").start()
    lines = list(cluster().jsonl())
    try:
        deployment.publish_lines(lines)
        outputs.wait_for(lambda o: len(o.seen["audit"]) >= len(lines), timeout=120, what="the AZ decided")
    finally:
        first.stop()
    now = int(time.time() * 1000)
    records = []
    for i in range(count):
        name = BACKLOG_VMS[i % len(BACKLOG_VMS)]
        value = {"intent_id": f"backlog-{i}", "type": "set_gpu", "requested_by": "alice@example.com",
                 "project": "proj-a",
                 "spec": {"namespace": "spx-proj-a", "name": name, "gpu_class": None if i % 2 else "nvidia-a100"}}
        records.append((deployment.kafka.topic("intents"), f"vm/spx-proj-a/{name}", json.dumps(value).encode(), now))
    publish(deployment.kafka, records)
    second = WorkerProcess(deployment, "w2").start()

    def decided(o: Outputs) -> int:
        return len({a["input"]["ref"] for a in o.seen["audit"] if a["input"]["ref"].startswith("backlog-")})

    try:
        outputs.wait_for(lambda o: decided(o) >= count, timeout=window, what="every waiting intent")
    except AssertionError:
        pass  # reported below: how many were decided
    finally:
        second.stop()
        outputs.close()
        deployment.delete_topics()
    return decided(outputs)


def backlogs(args: argparse.Namespace, bootstrap: str) -> dict[str, Any]:
    results = []
    for run in range(1, args.runs + 1):
        results.append(backlog_run(bootstrap, args.intents, args.window))
        missing = args.intents - results[-1]
        print(f"backlog run {run}: {results[-1]:,} of {args.intents:,} waiting intents decided"
              + (f"  ({missing} MISSING)" if missing else "") + f"  ({kit.load_average()})", flush=True)
    return {"backlog_decided": results, "backlog_intents": args.intents}


# --------------------------------------------------------------------------- cold


def changelog_records(deployment: Deployment) -> int:
    """Records in the deployment's changelogs: what a new instance reads before /ready."""
    prefix = f"{deployment.app_id}-state-"
    listed = admin_client(deployment.kafka).list_topics(timeout=ADMIN_SECONDS).topics
    topics = [name for name in listed if name.startswith(prefix) and name.endswith("-changelog")]
    return sum(t.records for t in kit.topic_bytes(deployment.bootstrap, topics))


def timed_start(deployment: Deployment, name: str) -> tuple[float, float, dict[str, float], float]:
    """(to /health, to /ready, table rows, RSS MiB) of a new worker process on ``deployment``."""
    worker = kit.Worker(deployment, name, env={"VMSTREAM_WORKER__TICK_SECONDS": "1.0"}).start(timeout=600)
    try:
        assert worker.health_s is not None and worker.ready_s is not None
        time.sleep(1.5)  # the tick (1 s) sets vmstream_table_rows
        rows = {label.split('"')[1]: value for label, value in worker.metric("vmstream_table_rows").items()}
        return worker.health_s, worker.ready_s, rows, kit.rss_mib(worker.pid)[0]
    finally:
        worker.stop()


def cold(args: argparse.Namespace, bootstrap: str) -> dict[str, Any]:
    results: list[tuple[str, int, tuple[float, float, dict[str, float], float]]] = []
    empty = new_deployment(bootstrap)
    results.append(("empty, first start (creates the changelogs)", 0, timed_start(empty, "w1")))
    results.append(("empty, new process", changelog_records(empty), timed_start(empty, "w2")))
    full = new_deployment(bootstrap)
    builder = kit.Worker(full, "builder").start(timeout=600)
    try:
        events, seconds = asyncio.run(kit.publish_cluster(full, kit.az_cluster(args.vms, args.nodes, "rec-ev").script(), 1800))
    finally:
        builder.stop()
    print(f"tables built by one worker deciding {events:,} watch events in {seconds:.1f} s", flush=True)
    results.append((f"{args.vms:,} VMs + VMIs, {args.nodes:,} nodes, new process", changelog_records(full),
                    timed_start(full, "fresh")))
    for deployment in (empty, full):
        deployment.delete_topics()
    body = [(case, f"{health:.2f}", f"{ready:.2f}", f"{records:,}", *(f"{rows.get(t, 0):,.0f}" for t in TABLES_SHOWN),
             f"{rss:,.0f}") for case, records, (health, ready, rows, rss) in results]
    print()
    print(kit.table(("start of a new worker process", "to /health s", "to /ready s", "changelog records",
                     *(f"{t} rows" for t in TABLES_SHOWN), "RSS MiB"), body))
    print("/health: the interpreter, imports and Faust's web server are up; /ready: the tables are recovered "
          "and the cluster-wide view caught up")
    return {"cold": [{"case": case, "health_s": h, "ready_s": r, "changelog_records": n, "rss_mib": m}
                     for case, n, (h, r, _, m) in results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("kill", "backlog", "cold"), help="one part only (default: all three)")
    parser.add_argument("--runs", type=int, default=1, help="kills per row and process (the median is shown), "
                                                            "or backlog runs")
    parser.add_argument("--rows", default="before,now", help="the kills' settings: before, now or both")
    parser.add_argument("--intents", type=int, default=5_000, help="intents waiting for the restarted worker")
    parser.add_argument("--window", type=float, default=90.0, help="seconds the backlog is waited for")
    parser.add_argument("--vms", type=int, default=10_000, help="VMs in the cold start's tables")
    parser.add_argument("--nodes", type=int, default=1_000, help="nodes in the cold start's tables")
    kit.add_json_option(parser)
    kit.add_small_option(parser, rows="now", intents=500, vms=1_000, nodes=100)
    args = kit.parse(parser)
    kit.quiet_client_logs()
    kit.print_load("at the start")
    figures: dict[str, Any] = {}
    with ExitStack() as stack:
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        if args.only in (None, "kill"):
            figures |= kills(args, bootstrap, stack)
        if args.only in (None, "backlog"):
            figures |= backlogs(args, bootstrap)
        if args.only in (None, "cold"):
            figures |= cold(args, bootstrap)
    kit.print_load("at the end")
    kit.write_json(args.json, figures)
    return 0 if all(n == args.intents for n in figures.get("backlog_decided", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
