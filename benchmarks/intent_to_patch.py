"""How long from a ``set_gpu`` intent to the VM patched in the API server, for 1,000 VMs.

The whole loop, each part its own process: a real kube-apiserver (local control plane
with KubeVirt's CRDs), a real Kafka broker, ``vmstream watch``, ``vmstream worker`` and
``vmstream apply``. The benchmark creates the VMs, waits until the worker has observed them
through the bridge, then publishes one ``set_gpu`` per VM at a steady rate and watches the
API server: a VM counts as patched when a watch event shows the GPU in its template.
Latency = that moment − the moment the intent was handed to the producer.

    .venv/bin/python benchmarks/intent_to_patch.py [--vms 1000] [--rate 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
from kit import percentile  # noqa: E402
from kubernetes import client, watch  # noqa: E402

from harness.localkube import LocalKube  # noqa: E402
from harness.running import CONFIG, Deployment, Outputs, VmstreamProcess, WorkerProcess  # noqa: E402
from harness.scenarios import PROJECT_LABEL  # noqa: E402
from streams.common.kafka_clients import producer  # noqa: E402

NAMESPACE = "spx-bench"
KUBEVIRT = ("kubevirt.io", "v1")


def vm_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {PROJECT_LABEL: "bench"},
                     "annotations": {"vmstream.io/owner": "bench@example.com"}},
        "spec": {"runStrategy": "Manual", "template": {"spec": {
            "domain": {"cpu": {"cores": 2}, "memory": {"guest": "4Gi"},
                       "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
            "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/ubuntu:24.04"}}]}}},
    }


class PatchWatcher(threading.Thread):
    """Records when each VM's template first shows a GPU, from a watch on the API server."""

    def __init__(self, api: client.ApiClient, resource_version: str) -> None:
        super().__init__(daemon=True)
        self.custom = client.CustomObjectsApi(api)
        self.resource_version = resource_version
        self.patched: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        stream = watch.Watch()
        while not self.stop.is_set():
            for event in stream.stream(self.custom.list_namespaced_custom_object, *KUBEVIRT, NAMESPACE,
                                       "virtualmachines", resource_version=self.resource_version,
                                       timeout_seconds=5):
                obj = event["object"]
                self.resource_version = obj["metadata"]["resourceVersion"]
                gpus = obj["spec"]["template"]["spec"]["domain"].get("devices", {}).get("gpus")
                if gpus and obj["metadata"]["name"] not in self.patched:
                    self.patched[obj["metadata"]["name"]] = time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100.0, help="intents per second")
    kit.add_small_option(parser, vms=100, rate=20.0)
    args = kit.parse(parser)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vmstream-bench-")))
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        kube = stack.enter_context(LocalKube())
        api = kube.api_client()
        # A project namespace: the applier writes nowhere else (docs/security.md).
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE, "labels": {PROJECT_LABEL: "bench"}}})
        custom = client.CustomObjectsApi(api)
        names = [f"vm-{i:05d}" for i in range(args.vms)]
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: custom.create_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines",
                                                                            vm_body(n)), names))
        print(f"created {args.vms} VMs in {time.monotonic() - started:.1f}s")

        deployment = kit.new_deployment(bootstrap, workdir)
        kubeconfig = str(kube.kubeconfig)
        worker = WorkerProcess(deployment, "worker").start()
        stack.callback(worker.stop)
        for name in ("watch", "apply"):
            process = VmstreamProcess(deployment, name, [name, "--config", str(CONFIG), "--kubeconfig", kubeconfig])
            process.start()
            stack.callback(process.stop)
        outputs = Outputs(deployment)
        stack.callback(outputs.close)
        events = deployment.kafka.topic("k8s-events")
        started = time.monotonic()
        outputs.wait_for(lambda o: len(o.audits(input__topic=events)) >= args.vms, timeout=600,
                         what="the VMs observed")
        print(f"worker observed {args.vms} VMs through the bridge in {time.monotonic() - started:.1f}s")

        listed = custom.list_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines", limit=1)
        watcher = PatchWatcher(api, listed["metadata"]["resourceVersion"])
        watcher.start()
        sender = producer(deployment.kafka, linger_ms=0)
        sent: dict[str, float] = {}
        sent_wall: dict[str, float] = {}
        interval = 1.0 / args.rate
        first, first_wall = time.monotonic(), time.time()
        for index, name in enumerate(names):
            kit.sleep_until(first + index * interval)
            value = {"intent_id": f"bench-{name}", "type": "set_gpu", "requested_by": "bench@example.com",
                     "project": "bench", "spec": {"namespace": NAMESPACE, "name": name, "gpu_class": "nvidia-a100"}}
            sent[name], sent_wall[name] = time.monotonic(), time.time()
            sender.send(deployment.kafka.topic("intents"), key=f"vm/{NAMESPACE}/{name}".encode(),
                        value=json.dumps(value).encode())
        sender.flush()
        deadline = time.monotonic() + 600
        while len(watcher.patched) < args.vms and time.monotonic() < deadline:
            time.sleep(0.2)  # waiting for the watch thread's count
        watcher.stop.set()
        latencies = [1000 * (watcher.patched[n] - sent[n]) for n in names if n in watcher.patched]
        last = max(watcher.patched.values()) if watcher.patched else first
        print(f"\nset_gpu → VM patched in the API server, {len(latencies)}/{args.vms} VMs, "
              f"offered {args.rate:.0f} intents/s, {kit.load_average()}")
        if latencies:
            print(f"  p50 {percentile(latencies, 0.5):.0f} ms   p90 {percentile(latencies, 0.9):.0f} ms   "
                  f"p99 {percentile(latencies, 0.99):.0f} ms   max {max(latencies):.0f} ms")
            print(f"  throughput {len(latencies) / (last - first):.0f} VMs patched/s "
                  f"(first intent → last patch {last - first:.1f}s)")
            stages = stage_latencies(deployment, sent_wall, watcher.patched, first_wall - first)
            for stage, values in stages.items():
                if values:
                    print(f"  {stage:<34} p50 {percentile(values, 0.5):6.0f} ms   "
                          f"p99 {percentile(values, 0.99):6.0f} ms")
        sender.close()
    return 0 if len(latencies) == args.vms else 1


def stage_latencies(deployment: Deployment, sent_wall: dict[str, float], patched: dict[str, float],
                    offset: float) -> dict[str, list[float]]:
    """Where the time goes, from the Kafka timestamps of the worker's commands and the
    applier's results (producer clocks: the same machine)."""
    from kafka import KafkaConsumer, TopicPartition

    kafka = deployment.kafka
    reader = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, enable_auto_commit=False,
                           consumer_timeout_ms=3000)
    topics = [kafka.topic("commands"), kafka.topic("command-results")]
    partitions = [TopicPartition(t, p) for t in topics for p in range(kafka.partitions)]
    reader.assign(partitions)
    reader.seek_to_beginning(*partitions)
    command_at: dict[str, float] = {}
    command_vm: dict[str, str] = {}
    result_at: dict[str, float] = {}
    for record in reader:
        value = json.loads(record.value)
        if record.topic == topics[0] and value["type"] == "patch_vm":
            command_at[value["target"]["name"]] = record.timestamp / 1000
            command_vm[value["command_id"]] = value["target"]["name"]
        elif record.topic == topics[1] and value["command_id"] in command_vm:
            result_at[command_vm[value["command_id"]]] = record.timestamp / 1000
    reader.close()
    return {
        "intent → command sent (worker)": [1000 * (command_at[n] - sent_wall[n]) for n in command_at if n in sent_wall],
        "command → result sent (applier)": [1000 * (result_at[n] - command_at[n]) for n in result_at if n in command_at],
        "result sent → patch watched": [1000 * (patched[n] + offset - result_at[n]) for n in result_at if n in patched],
    }


if __name__ == "__main__":
    sys.exit(main())
