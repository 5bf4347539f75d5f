"""Throughput of the watch bridge: API server writes → WatchEvents consumed from Kafka.

Why this exists: the bridge is the one path by which the worker learns what happened in
the cluster, and a burst (a relist after 410, an operator patching every VM, a rolling
KubeVirt update touching every VMI) must reach Kafka quickly, every event acknowledged
before the watch moves on. This measures how fast it does that on a real kube-apiserver
and a real broker.

What it does:

1. starts a local kube-apiserver + etcd with KubeVirt's CRDs and a local Kafka broker
   (or uses ``--kubeconfig`` / ``KAFKA_BOOTSTRAP_SERVERS``), and an isolated topic set;
2. runs the bridge as its own process (``vmstream watch --kinds VirtualMachine``, through
   :func:`streams.kube.watching.main`), so its CPU time is its own;
3. **create**: N VMs written as fast as ``--threads`` clients can, timed from the first
   write to the last ADDED event consumed from ``k8s-events``;
4. **patch**: an annotation on every VM, timed the same way to the last MODIFIED;
5. **relist**: a fresh bridge process over the N VMs, timed from its start to the last
   RELISTED consumed (interpreter start and imports included), and the list+publish time
   the bridge logs.

Everything shares the machine (API server, etcd, broker, writers, consumer, bridge), so
the figures are a floor for the bridge, not a ceiling.

Run it from the repository root::

    .venv/bin/python benchmarks/watch_throughput.py             # 1,000 VMs
    .venv/bin/python benchmarks/watch_throughput.py --vms 5000 --threads 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's; first: quiets kafka-python's import)
from kit import REPO  # noqa: E402

from kafka import KafkaConsumer, TopicPartition  # noqa: E402  # isort: skip
from kubernetes import client, config  # noqa: E402

from harness.localkube import LocalKube  # noqa: E402
from streams.common.settings import KafkaSettings  # noqa: E402
from streams.kube.watching import TOPIC  # noqa: E402

GROUP, VERSION, PLURAL = "kubevirt.io", "v1", "virtualmachines"
BRIDGE = """
import argparse, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
logging.getLogger("kafka").setLevel(logging.WARNING)
from streams.kube import watching
sys.exit(watching.main(argparse.Namespace(config=sys.argv[2], kubeconfig=sys.argv[1], kinds="VirtualMachine",
                                          probe_host="127.0.0.1", probe_port=0)))
"""


def vm(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "labels": {"superphenix.net/projectID": "bench"}},
        "spec": {
            "runStrategy": "Halted",
            "template": {
                "spec": {
                    "domain": {
                        "cpu": {"cores": 4},
                        "memory": {"guest": "8Gi"},
                        "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]},
                    },
                    "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora:41"}}],
                }
            },
        },
    }


class BridgeProcess:
    """The bridge in its own interpreter, as ``vmstream watch`` runs it."""

    def __init__(self, kafka: KafkaSettings, kubeconfig: Path, log: Path) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "VMSTREAM_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "VMSTREAM_KAFKA__TOPIC_PREFIX": kafka.topic_prefix,
        }
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", BRIDGE, str(kubeconfig), str(REPO / "examples" / "config.yaml")], env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_log(self, pattern: str, count: int = 1, timeout: float = 120.0) -> list[re.Match[str]]:
        deadline = time.monotonic() + timeout
        while True:
            found = list(re.finditer(pattern, self.text()))
            if len(found) >= count:
                return found
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bridge never logged {pattern!r}:\n{self.text()[-3000:]}")
            time.sleep(0.05)  # polling interval

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Arrivals:
    """When each (key, type) first arrived on k8s-events (monotonic clock)."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, enable_auto_commit=False,
                                      fetch_max_wait_ms=50)
        partitions = [TopicPartition(kafka.topic(TOPIC), p) for p in range(kafka.partitions)]
        self.consumer.assign(partitions)
        self.consumer.seek_to_beginning(*partitions)  # the deployment's topic is new
        self.first: dict[tuple[str, str], float] = {}
        self.count = 0

    def poll(self) -> None:
        for records in self.consumer.poll(timeout_ms=100).values():
            now = time.monotonic()
            for record in records:
                self.count += 1
                event = json.loads(record.value)
                self.first.setdefault((record.key.decode(), event["type"]), now)

    def wait(self, keys: list[str], type_: str, timeout: float) -> float:
        """Poll until every key has an event of ``type_``; the arrival time of the last."""
        deadline = time.monotonic() + timeout
        while any((key, type_) not in self.first for key in keys):
            if time.monotonic() > deadline:
                missing = sum((key, type_) not in self.first for key in keys)
                raise RuntimeError(f"{missing} {type_} events missing after {timeout:.0f}s")
            self.poll()
        return max(self.first[(key, type_)] for key in keys)

    def close(self) -> None:
        self.consumer.close()


def burst(
    write: Callable[[str], object], names: list[str], threads: int, arrivals: Arrivals, type_: str, namespace: str
) -> dict[str, float]:
    """Write every name concurrently while consuming; the figures of that burst."""
    done: dict[str, float] = {}

    def one(name: str) -> None:
        write(name)
        done[name] = time.monotonic()

    keys = [f"VirtualMachine/{namespace}/{name}" for name in names]
    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(one, name) for name in names]
        while not all(f.done() for f in futures):
            arrivals.poll()
        for future in futures:
            future.result()
    written = max(done.values())
    last = arrivals.wait(keys, type_, timeout=300)
    latencies = sorted(arrivals.first[(f"VirtualMachine/{namespace}/{n}", type_)] - done[n] for n in names)
    return {
        "writes_per_s": len(names) / (written - started),
        "events_per_s": len(names) / (last - started),
        "total_s": last - started,
        "lag_after_last_write_s": last - written,
        "latency_p50_ms": 1000 * kit.percentile(latencies, 0.5),
        "latency_p99_ms": 1000 * kit.percentile(latencies, 0.99),
    }


@contextlib.contextmanager
def parts(kubeconfig: str | None) -> Iterator[tuple[Path, str]]:
    """(kubeconfig, bootstrap): given ones, else local ones for the run."""
    with contextlib.ExitStack() as stack:
        if kubeconfig:
            kube_path = Path(kubeconfig)
        else:
            kube_path = stack.enter_context(LocalKube()).kubeconfig
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        yield kube_path, bootstrap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--vms", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=8, help="concurrent API clients writing")
    parser.add_argument("--kubeconfig", help="an API server to use (default: a local one)")
    kit.add_small_option(parser, vms=100)
    args = kit.parse(parser)

    with parts(args.kubeconfig) as (kubeconfig, bootstrap), tempfile.TemporaryDirectory() as tmp:
        deployment = kit.new_deployment(bootstrap, Path(tmp))
        kafka = deployment.kafka
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = args.threads
        namespace = f"bench-{uuid.uuid4().hex[:6]}"
        names = [f"vm-{i:05d}" for i in range(args.vms)]
        results: dict[str, dict[str, float]] = {}

        with client.ApiClient(configuration) as api:
            client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
            custom = client.CustomObjectsApi(api)

            # Raw responses (no model deserialisation in the writers), read to the end so
            # that their connection can serve the next request.
            def create(name: str) -> None:
                response = custom.create_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, vm(name), _preload_content=False
                )
                response.read()
                response.release_conn()

            def annotate(name: str) -> None:
                response = custom.patch_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name,
                    {"metadata": {"annotations": {"bench/touched": "1"}}}, _preload_content=False,
                )
                response.read()
                response.release_conn()

            arrivals = Arrivals(kafka)
            bridge = BridgeProcess(kafka, kubeconfig, Path(tmp) / "bridge-1.log")
            try:
                bridge.wait_log(r"relisted objects=")
                cpu_before = bridge.cpu_seconds()
                results["create"] = burst(create, names, args.threads, arrivals, "ADDED", namespace)
                results["patch"] = burst(annotate, names, args.threads, arrivals, "MODIFIED", namespace)
                bridge_cpu = bridge.cpu_seconds() - cpu_before
            finally:
                bridge.stop()

            keys = [f"VirtualMachine/{namespace}/{name}" for name in names]
            started = time.monotonic()
            bridge = BridgeProcess(kafka, kubeconfig, Path(tmp) / "bridge-2.log")
            try:
                last = arrivals.wait(keys, "RELISTED", timeout=300)
                logged = bridge.wait_log(r"relisted objects=(\d+) .* seconds=([\d.]+)")[0]
                read_back = bridge.wait_log(r"read back .* keys=(\d+) .* seconds=([\d.]+)")[0]
            finally:
                bridge.stop()
            results["relist"] = {
                "events_per_s": args.vms / (last - started),
                "total_s": last - started,
                "bridge_read_back_s": float(read_back.group(2)),  # k8s-events read to its end first
                "keys_read_back": float(read_back.group(1)),
                "bridge_list_and_publish_s": float(logged.group(2)),
                "objects_listed": float(logged.group(1)),
            }
            arrivals.close()

    print(f"watch bridge throughput: {args.vms} VMs, {args.threads} writer threads, {os.cpu_count()} CPUs")
    for phase, figures in results.items():
        print(f"  {phase}")
        for name, value in figures.items():
            print(f"    {name:28s} {value:10.1f}")
    print(f"  bridge CPU during create+patch: {bridge_cpu:.1f} s "
          f"({1000 * bridge_cpu / (2 * args.vms):.2f} ms per event)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
