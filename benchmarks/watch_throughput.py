"""Does the watch bridge keep up with the API server, and how long does it take to start?

The bridge is the one path by which the worker learns what happened in the cluster, and a
burst (a relist after 410, an operator patching every VM, a rolling KubeVirt update touching
every VMI) must reach Kafka quickly, every event acknowledged before the watch moves on.

- **bursts** — a local kube-apiserver + etcd with KubeVirt's CRDs (or ``--kubeconfig``), a
  broker, and the bridge as its own process (``vmstream watch --kinds VirtualMachine``, through
  :func:`streams.kube.watching.main`). ``--vms`` VMs are created from ``--threads`` clients,
  then annotated, then relisted by a fresh bridge; each is timed from the first write to the
  last event consumed from ``k8s-events``. The anchor, side by side: the rate at which the API
  server took the writes. Everything shares the machine (API server, etcd, broker, writers,
  consumer, bridge), so the figures are a floor for the bridge, not a ceiling.
- **read-back** — before its first list, a starting bridge reads everything ``k8s-events``
  holds (``streams.kube.watching.last_published``) to learn what it last published of each
  object, so that deletions made while no bridge ran are published (docs/watch.md). That read
  grows with the topic, not only with the objects: ``--objects`` VMs of ``--object-bytes``,
  ``--events-per-object`` events apiece (the last a deletion for one VM in ten), then
  ``last_published`` timed and what it found checked.

    .venv/bin/python benchmarks/watch_throughput.py --only bursts                 # 1,000 VMs
    .venv/bin/python benchmarks/watch_throughput.py --only read-back --objects 2000 --events-per-object 10
    .venv/bin/python benchmarks/watch_throughput.py --small
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import kit  # noqa: E402  (this directory's; first: it puts the repository on sys.path)
from kit import REPO  # noqa: E402

from kubernetes import client, config  # noqa: E402  # isort: skip

from harness.localkube import LocalKube  # noqa: E402
from streams.common.durable import DurableProducer  # noqa: E402
from streams.common.kafka_clients import COMPRESSION, consumer  # noqa: E402
from streams.common.reading import assign_from_start, poll_records  # noqa: E402
from streams.common.settings import KafkaSettings  # noqa: E402
from streams.kube.watching import TOPIC, Publisher, last_published, select_kinds  # noqa: E402

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
        self.consumer = consumer(kafka, client_id="vmstream-bench-arrivals", config={"fetch.wait.max.ms": 50})
        assign_from_start(self.consumer, [kafka.topic(TOPIC)])  # the deployment's topic is new
        self.first: dict[tuple[str, str], float] = {}
        self.count = 0

    def poll(self) -> None:
        records = poll_records(self.consumer, 0.1)
        now = time.monotonic()
        for record in records:
            if record.key is None or record.value is None:
                continue
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


def bursts(args: argparse.Namespace, bootstrap: str, stack: contextlib.ExitStack) -> None:
    kubeconfig = Path(args.kubeconfig) if args.kubeconfig else stack.enter_context(LocalKube()).kubeconfig
    tmp = stack.enter_context(tempfile.TemporaryDirectory())
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
            reread = bridge.wait_log(r"read back .* keys=(\d+) .* seconds=([\d.]+)")[0]
        finally:
            bridge.stop()
        relist = {
            "events_per_s": args.vms / (last - started),
            "total_s": last - started,
            "read_back_s": float(reread.group(2)),  # k8s-events read to its end first
            "list_and_publish_s": float(logged.group(2)),
        }
        arrivals.close()

    print(f"\nthe watch bridge beside the API server: {args.vms:,} VMs, {args.threads} writer threads; "
          f"{kit.load_average()}")
    body = [(phase, f"{figures['writes_per_s']:,.0f}", f"{figures['events_per_s']:,.0f}",
             f"{figures['latency_p50_ms']:,.0f}", f"{figures['latency_p99_ms']:,.0f}",
             f"{1000 * figures['lag_after_last_write_s']:,.0f}") for phase, figures in results.items()]
    print(kit.table(("burst", "API server writes/s", "events/s on Kafka", "p50 ms", "p99 ms", "lag after last write ms"),
                    body))
    print(f"relist by a new bridge: {relist['events_per_s']:,.0f} events/s, the last {relist['total_s']:.1f} s after "
          f"its start (interpreter and imports included); it read k8s-events back in {relist['read_back_s']:.1f} s, "
          f"listed and published in {relist['list_and_publish_s']:.1f} s")
    print(f"bridge CPU during create+patch: {bridge_cpu:.1f} s ({1000 * bridge_cpu / (2 * args.vms):.2f} ms per event)")


def padded_vm(index: int, version: int, size: int) -> dict[str, object]:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": f"vm-{index}", "namespace": "bench", "resourceVersion": str(version),
                     "annotations": {"bench/padding": "x" * size}},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}}}}},
    }


def read_back(args: argparse.Namespace, bootstrap: str, stack: contextlib.ExitStack) -> None:
    kind = select_kinds("VirtualMachine")[0]
    deployment = kit.new_deployment(bootstrap, Path(stack.enter_context(tempfile.TemporaryDirectory())))
    stack.callback(deployment.delete_topics)
    kafka = deployment.kafka
    sending = DurableProducer(kafka, client_id="bench-read-back", linger_ms=20, compression=COMPRESSION)
    publisher = Publisher(sending, kafka.topic(TOPIC))
    started = time.monotonic()
    for version in range(args.events_per_object):
        for index in range(args.objects):
            last = version == args.events_per_object - 1
            type_: Literal["DELETED", "RELISTED", "MODIFIED"] = (
                "DELETED" if last and index % 10 == 0 else "RELISTED" if version == 0 else "MODIFIED")
            publisher.send(kind, type_, padded_vm(index, version * args.objects + index + 1, args.object_bytes))
    sending.close()  # once every event is acknowledged
    published = time.monotonic() - started
    events = args.objects * args.events_per_object

    started, cpu_started = time.monotonic(), time.process_time()
    alive = last_published(kafka, kafka.topic(TOPIC), [kind])
    seconds, cpu = time.monotonic() - started, time.process_time() - cpu_started
    expected = args.objects - len(range(0, args.objects, 10))
    found = len(alive.get("VirtualMachine", {}))
    assert found == expected, f"{found} alive, expected {expected}"

    print(f"watch read-back: {events:,} events of ~{args.object_bytes} bytes ({args.objects:,} VMs x "
          f"{args.events_per_object}), {kit.load_average()}")
    print(f"  published in            {published:8.1f} s")
    print(f"  read back in            {seconds:8.1f} s  ({events / seconds:,.0f} events/s), "
          f"CPU {cpu:.1f} s ({1e6 * cpu / events:.0f} us per event)")
    print(f"  alive after read-back   {found:8,}   (one VM in ten deleted last)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", choices=("bursts", "read-back"), help="one part only (default: both)")
    parser.add_argument("--vms", type=int, default=1000, help="VMs written in a burst")
    parser.add_argument("--threads", type=int, default=8, help="concurrent API clients writing")
    parser.add_argument("--kubeconfig", help="an API server to use (default: a local one)")
    parser.add_argument("--objects", type=int, default=2000, help="VMs on k8s-events to read back")
    parser.add_argument("--events-per-object", type=int, default=10)
    parser.add_argument("--object-bytes", type=int, default=2000)
    kit.add_small_option(parser, vms=100, objects=200, events_per_object=2)
    args = kit.parse(parser)
    kit.print_load("at the start")
    with contextlib.ExitStack() as stack:
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        if args.only in (None, "read-back"):
            read_back(args, bootstrap, stack)
        if args.only in (None, "bursts"):
            bursts(args, bootstrap, stack)
    kit.print_load("at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
