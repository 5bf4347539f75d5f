"""How long after ``kill -9`` until the worker decides and the applier applies again, with the
consumer settings of before and of now, side by side in one run.

Each process is killed with SIGKILL in the middle of a steady stream of inputs and started
again at once, as a kubelet restarts a crashed container (same pod, same name). The time is
from the kill to the first output for an input published after the kill:

- **worker** — a node event every 100 ms on ``k8s-events`` (the AZ of ``harness/scenarios.py``
  decided first); the first audit record of an event published after the kill;
- **applier** — a ``cordon_node`` / ``uncordon_node`` command every 100 ms (a local
  kube-apiserver, ``harness/localkube.py``); the first command result of a command published
  after the kill.

Rows: **before** — no group instance id, Faust's 60 s session and 3 s heartbeat for the
worker, kafka-python's 10 s and 3 s for the applier; **now** — ``streams/common/settings.py``'s
defaults (10 s session, 1 s heartbeat) with a ``group_instance_id`` per process, as
``deploy/`` sets it (the pod name). Inputs are counted by our own Kafka consumer.

    .venv/bin/python benchmarks/recovery.py [--runs 1] [--only worker|applier]
"""

from __future__ import annotations

import argparse
import json
import os
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
from kafka import KafkaConsumer, TopicPartition  # noqa: E402

from handlers.decisions import subject_key  # noqa: E402
from handlers.messages import Command, ObjectRef  # noqa: E402
from harness.running import CONFIG, Deployment, WorkerProcess  # noqa: E402
from harness.scenarios import A100, cluster  # noqa: E402
from harness.scenarios import node as node_object  # noqa: E402
from streams.common.codecs import encode_message  # noqa: E402
from streams.common.durable import DurableProducer, Record  # noqa: E402

PERIOD = 0.1  # one input every 100 ms
DEADLINE = 240.0  # a recovery slower than this is reported as such
VERBOSE = False

# Membership settings per row and process (VMSTREAM_WORKER__* environment variables).
BEFORE = {
    "worker": {"VMSTREAM_WORKER__SESSION_TIMEOUT_SECONDS": "60", "VMSTREAM_WORKER__HEARTBEAT_INTERVAL_SECONDS": "3"},
    "applier": {"VMSTREAM_WORKER__SESSION_TIMEOUT_SECONDS": "10", "VMSTREAM_WORKER__HEARTBEAT_INTERVAL_SECONDS": "3"},
}
NOW = {
    "worker": {"VMSTREAM_WORKER__GROUP_INSTANCE_ID": "worker-0"},
    "applier": {"VMSTREAM_WORKER__GROUP_INSTANCE_ID": "apply-0"},
}


class Arrivals:
    """When each output of one topic arrived, by the id of its input (our own consumer)."""

    def __init__(self, deployment: Deployment, topic: str, ref: Callable[[dict[str, Any]], str | None]) -> None:
        kafka = deployment.kafka
        self.ref = ref
        self.consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, enable_auto_commit=False)
        partitions = [TopicPartition(kafka.topic(topic), p) for p in range(kafka.partitions)]
        self.consumer.assign(partitions)
        self.consumer.seek_to_beginning(*partitions)
        self.at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for records in self.consumer.poll(timeout_ms=100).values():
                now = time.monotonic()
                for record in records:
                    ref = self.ref(json.loads(record.value))
                    if ref is not None:
                        self.at.setdefault(ref, now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.consumer.close()


class Feeder:
    """Publishes ``make(n)`` → (topic, key, value, ref) every PERIOD; remembers when each went."""

    def __init__(self, deployment: Deployment, make: Callable[[int], tuple[str, str, bytes, str]]) -> None:
        self.kafka = deployment.kafka
        self.make = make
        self.sent: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client = DurableProducer(self.kafka, client_id="bench", timeout=30)
        try:
            n = 0
            while not self._stop.wait(PERIOD):
                topic, key, value, ref = self.make(n)
                client.send_all([Record(self.kafka.topic(topic), key.encode(), value)])
                self.sent[ref] = time.monotonic()
                n += 1
        finally:
            client.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def first_after(feeder: Feeder, arrivals: Arrivals, since: float) -> float | None:
    """Seconds from ``since`` to the first output of an input published after it."""
    times = [arrivals.at[ref] for ref, sent in list(feeder.sent.items()) if sent >= since and ref in arrivals.at]
    return min(times) - since if times else None


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)  # polling interval


def recovery(feeder: Feeder, arrivals: Arrivals, kill: Callable[[], None], restart: Callable[[], None]) -> float:
    """Kill, restart at once, and time until an input published after the kill has its output."""
    wait_for(lambda: first_after(feeder, arrivals, time.monotonic() - 2.0), 120, "a steady flow before the kill")
    killed = time.monotonic()
    kill()
    if VERBOSE:
        print(f"  killed at {datetime.now(UTC).isoformat(timespec='milliseconds')}", flush=True)
    restart()
    try:
        return float(wait_for(lambda: first_after(feeder, arrivals, killed), DEADLINE, "an output after the kill"))
    except TimeoutError:
        return float("inf")


# ------------------------------------------------------------------------------ worker


def node_event(n: int, label: str) -> tuple[str, str, bytes, str]:
    event = json.loads(next(line for line in cluster().jsonl() if '"kind": "Node"' in line))
    value = event["value"]
    ref = f"rec-{label}-{n}"
    value["event_id"] = ref
    value["type"] = "MODIFIED"
    value["observed_at"] = datetime.now(UTC).isoformat()
    value["object"]["metadata"]["resourceVersion"] = str(1000 + n)
    return "k8s-events", event["key"], json.dumps(value).encode(), ref


def worker_run(bootstrap: str, label: str, env: dict[str, str]) -> float:
    deployment = kit.new_deployment(bootstrap, Path(tempfile.mkdtemp(prefix="vmstream-recovery-")))
    if VERBOSE:
        print(f"  worker logs in {deployment.workdir}", flush=True)
    workers: list[WorkerProcess] = [WorkerProcess(deployment, "w1", env=env).start()]
    arrivals = Arrivals(deployment, "audit", lambda audit: (audit.get("input") or {}).get("ref"))
    feeder = None
    try:
        deployment.publish_lines(cluster().jsonl())
        feeder = Feeder(deployment, lambda n: node_event(n, label))

        def kill() -> None:
            process = workers[-1].process
            assert process is not None
            process.send_signal(signal.SIGKILL)
            process.wait()

        def restart() -> None:
            second = WorkerProcess(deployment, f"w{len(workers) + 1}", env=env)
            workers.append(second)
            second.start(timeout=DEADLINE)

        return recovery(feeder, arrivals, kill, restart)
    finally:
        if feeder is not None:
            feeder.close()
        arrivals.close()
        for worker in workers:
            worker.stop(signal.SIGKILL)
        deployment.delete_topics()


# ----------------------------------------------------------------------------- applier


@contextmanager
def applier_process(deployment: Deployment, kubeconfig: Path, env: dict[str, str], name: str) -> Iterator[subprocess.Popen[bytes]]:
    log_path = deployment.workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "streams.kube.applying", "apply", "--config", str(CONFIG), "--kubeconfig",
             str(kubeconfig), "--probe-port", "0"],
            env={**deployment.env(0), **env}, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def seal(deployment: Deployment, command: Command) -> bytes:
    """As the deployment's worker publishes it: sealed with its key where commands are sealed."""
    signing = getattr(deployment, "signing", None)
    if signing is not None:
        return encode_message(command, keyring=signing.keyring())
    return encode_message(command)


def applier_run(bootstrap: str, kubeconfig: Path, label: str, env: dict[str, str]) -> float:
    from kubernetes import client, config

    deployment = kit.new_deployment(bootstrap, Path(tempfile.mkdtemp(prefix="vmstream-recovery-")))
    name = f"rec-{label}-{uuid.uuid4().hex[:6]}"
    obj = node_object(name, gpus={A100: 1})
    for field in ("uid", "resourceVersion"):
        del obj["metadata"][field]
    with config.new_client_from_config(config_file=str(kubeconfig)) as api:
        client.CoreV1Api(api).create_node(obj)
    target = ObjectRef(kind="Node", namespace=None, name=name)

    def make(n: int) -> tuple[str, str, bytes, str]:
        ref = f"{name}-{n}"
        command = Command(command_id=ref, type="uncordon_node" if n % 2 else "cordon_node", target=target,
                          cause=f"recovery-{n}", issued_at=datetime.now(UTC), requested_by="ops@example.com")
        return "commands", subject_key(target), seal(deployment, command), ref

    arrivals = Arrivals(deployment, "command-results", lambda result: result.get("command_id"))
    with ExitStack() as stack:
        processes = [stack.enter_context(applier_process(deployment, kubeconfig, env, "apply-1"))]
        feeder = Feeder(deployment, make)
        stack.callback(feeder.close)
        stack.callback(arrivals.close)
        stack.callback(deployment.delete_topics)

        def kill() -> None:
            processes[-1].send_signal(signal.SIGKILL)
            processes[-1].wait()

        def restart() -> None:
            processes.append(stack.enter_context(
                applier_process(deployment, kubeconfig, env, f"apply-{len(processes) + 1}")))

        return recovery(feeder, arrivals, kill, restart)
    raise AssertionError("unreachable")


# -------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="kills per row and process (the median is shown)")
    parser.add_argument("--only", choices=("worker", "applier"), default=None)
    parser.add_argument("--rows", default="before,now", help="which settings to run (default: both)")
    parser.add_argument("--verbose", action="store_true", help="print when each kill happened (to read the logs by)")
    kit.add_small_option(parser, runs=1, rows="now")
    args = kit.parse(parser)
    global VERBOSE
    VERBOSE = args.verbose
    rows: dict[tuple[str, str], list[float]] = {}
    loads: list[float] = []
    with ExitStack() as stack:
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        kubeconfig: Path | None = None
        if args.only != "worker":
            from harness.localkube import LocalKube

            kubeconfig = stack.enter_context(LocalKube()).kubeconfig
        for _ in range(args.runs):
            for label, settings in (("before", BEFORE), ("now", NOW)):
                if label not in args.rows.split(","):
                    continue
                if args.only != "applier":
                    rows.setdefault(("worker", label), []).append(worker_run(bootstrap, label, settings["worker"]))
                    loads.append(kit.load1())
                    print(f"worker  {label:6}: {rows['worker', label][-1]:6.1f} s  (load {loads[-1]:.2f})", flush=True)
                if kubeconfig is not None:
                    rows.setdefault(("applier", label), []).append(
                        applier_run(bootstrap, kubeconfig, label, settings["applier"]))
                    loads.append(kit.load1())
                    print(f"applier {label:6}: {rows['applier', label][-1]:6.1f} s  (load {loads[-1]:.2f})", flush=True)
    print()
    print(f"{'from kill -9 to':34} {'before':>8} {'now':>8}")
    for process, what in (("worker", "the first new decision (worker)"), ("applier", "the first new apply (applier)")):
        cells = [statistics.median(rows[process, label]) if (process, label) in rows else None
                 for label in ("before", "now")]
        if any(cell is not None for cell in cells):
            print(f"{what:34} " + " ".join(f"{cell:7.1f}s" if cell is not None else f"{'-':>8}" for cell in cells))
    print(f"runs per cell {args.runs}; load average during the runs {min(loads):.2f}-{max(loads):.2f}, "
          f"now: {kit.load_average()}; {os.cpu_count()} cores shared")
    print("before: no group instance id, session 60 s / heartbeat 3 s (worker, Faust's defaults), "
          "10 s / 3 s (applier, kafka-python's)")
    print("now:    group_instance_id per process, session 10 s / heartbeat 1 s (streams/common/settings.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
