"""From a ``set_gpu`` intent (or the applier's sealed command) to the VM patched in the API
server, beside the same patches sent by a plain client.

Each part its own process: a local kube-apiserver (KubeVirt's CRDs), a broker and, with
``--from intents`` (the default), ``vmstream watch``, ``vmstream worker`` and ``vmstream
apply``; with ``--from commands``, ``vmstream apply`` alone. Three sets of ``--vms`` VMs are
created (and ``--warmup`` more, not counted); then:

* **anchor** — the JSON patches the worker plans for the anchor set (the GPU rules' patch
  guarded by the VM's ``resourceVersion``) sent straight to the API server by a plain
  kubernetes client from ``--threads`` threads, vmstream's processes frozen meanwhile
  (SIGSTOP, for less than a group session): left running, the bridge and the worker react to
  every one of these patches and take the API server's CPU;
* **vmstream** — one ``set_gpu`` intent per VM (intent → route → decide → command → applier
  → API server), or one sealed ``patch_vm`` command per VM, all published at once;
* the two take turns over ``--rounds`` rounds, a share of each set per round
  (:func:`kit.in_turns`); a rate is VMs / (last patch seen − first request or message sent);
* **paced** — one message at a time at half the anchor's rate (``--rate`` to choose): each
  one's latency from the producer to its VM seen patched.

A VM counts as patched when the benchmark's own watch on the API server shows the GPU in its
template, never by what the code under test reports. The warm-up matters: a broker just
started spends several times the CPU per request it spends once its JIT has compiled the
paths every request takes, and on two cores that CPU is taken from the API server.

The CPU each process spent per VM patched is printed beside the machine's whole busy time
(from ``/proc``), and with it the rate that CPU allows: the machine's cores (or, with
``--pin``, each part's own core) over the CPU-seconds one VM patched costs the processes that
share them. ``--pin`` gives the API server and etcd CPU 0 and everything else CPU 1, for the
anchor and vmstream alike: the API server then has a core of its own, as in a cluster.

    .venv/bin/python benchmarks/intent_to_patch.py                   # intents, 600 VMs per set
    .venv/bin/python benchmarks/intent_to_patch.py --pin
    .venv/bin/python benchmarks/intent_to_patch.py --from commands   # the applier alone
    .venv/bin/python benchmarks/intent_to_patch.py --small           # 100 per set
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
from kubernetes import client, watch  # noqa: E402

from handlers.contracts import ids  # noqa: E402
from handlers.contracts.messages import Command, GPUMutation, ObjectRef, object_key  # noqa: E402
from handlers.core.decisions import subject_key  # noqa: E402
from handlers.rules.enforcement import FIELD_MANAGER  # noqa: E402
from handlers.rules.gpus import desired_vm, plan_patch  # noqa: E402
from harness.localkube import LocalKube  # noqa: E402
from harness.running import CONFIG, Deployment, Outputs, VmstreamProcess, WorkerProcess  # noqa: E402
from samples.cluster import A100, PROJECT_LABEL  # noqa: E402
from streams.common.codecs import encode_message  # noqa: E402
from streams.common.durable import DurableProducer, Record  # noqa: E402
from streams.kube.applying import JSON_PATCH, KUBEVIRT  # noqa: E402

NAMESPACE = "spx-bench"
# What config.yaml's nvidia-a100 class asks of a VM: the patch of a ``set_gpu`` to it.
MUTATION = GPUMutation(device_name=A100, eviction_strategy="External")
PROCESSES = ("kube-apiserver", "etcd", "broker", "worker", "watch", "apply", "benchmark")
CONTROL_PLANE = ("kube-apiserver", "etcd")  # CPU 0 with --pin
REST = tuple(name for name in PROCESSES if name not in CONTROL_PLANE)  # CPU 1 with --pin

Patches = dict[str, tuple[list[dict[str, Any]], str]]  # name → (JSON patch, resourceVersion)


# ---------------------------------------------------------------- the API server side


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


def create_vms(api: client.ApiClient, names: Sequence[str], threads: int) -> None:
    """The project namespace (the applier writes nowhere else, docs/security.md) and the VMs."""
    client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE, "labels": {PROJECT_LABEL: "bench"}}})
    custom = client.CustomObjectsApi(api)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda n: custom.create_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines",
                                                                        vm_body(n)), names))


class PatchWatcher(threading.Thread):
    """Records when each VM's template first shows a GPU, from a watch on the API server
    started from now: only patches made from here on are seen."""

    def __init__(self, api: client.ApiClient) -> None:
        super().__init__(daemon=True)
        self.custom = client.CustomObjectsApi(api)
        listed = self.custom.list_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines", limit=1)
        self.resource_version = listed["metadata"]["resourceVersion"]
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

    def last(self, names: Sequence[str], timeout: float = 900.0) -> float:
        """When the last of ``names`` was seen patched."""
        deadline = time.monotonic() + timeout
        while any(name not in self.patched for name in names):
            if time.monotonic() > deadline:
                missing = sum(name not in self.patched for name in names)
                raise TimeoutError(f"{missing} of {len(names)} VMs not patched in {timeout}s")
            time.sleep(0.1)  # waiting for the watch thread's record
        return max(self.patched[name] for name in names)


def planned(custom: client.CustomObjectsApi, names: Sequence[str]) -> Patches:
    """name → (the GPU rules' JSON patch for the live VM, its resourceVersion), as the worker plans it."""
    listed = custom.list_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines")
    live = {vm["metadata"]["name"]: vm for vm in listed["items"]}
    return {name: (plan_patch(live[name], desired_vm(live[name], MUTATION)), live[name]["metadata"]["resourceVersion"])
            for name in names}


def anchor_request(custom: client.CustomObjectsApi, patches: Patches) -> Callable[[str], None]:
    """The anchor: the applier's own request, straight from a plain client."""

    def send(name: str) -> None:
        patch, rv = patches[name]
        custom.patch_namespaced_custom_object(
            *KUBEVIRT, NAMESPACE, "virtualmachines", name,
            [{"op": "replace", "path": "/metadata/resourceVersion", "value": rv}, *patch],
            _content_type=JSON_PATCH, field_manager=FIELD_MANAGER)

    return send


# ----------------------------------------------------------------------- messages


def intent(name: str) -> tuple[bytes, bytes]:
    """The ``set_gpu`` of one VM: its key and value on the intents topic."""
    value = {"intent_id": f"bench-{name}", "type": "set_gpu", "requested_by": "bench@example.com",
             "project": "bench", "spec": {"namespace": NAMESPACE, "name": name, "gpu_class": "nvidia-a100"}}
    return f"vm/{NAMESPACE}/{name}".encode(), json.dumps(value).encode()


def sealed(deployment: Deployment, patches: Patches) -> Callable[[str], tuple[bytes, bytes]]:
    """The ``patch_vm`` command the worker would send for one VM, sealed with the deployment's key."""
    keyring = deployment.signing.keyring()

    def command(name: str) -> tuple[bytes, bytes]:
        patch, rv = patches[name]
        target = ObjectRef(kind="VirtualMachine", namespace=NAMESPACE, name=name)
        cause = f"bench-{deployment.ident}-{name}"
        value = Command(command_id=ids.command_id(cause, "patch_vm", subject_key(target)), type="patch_vm",
                        target=target, cause=cause, issued_at=datetime.now(UTC), patch=patch,
                        base_resource_version=rv, mutation=MUTATION, requested_by="bench@example.com")
        return subject_key(target).encode(), encode_message(value, keyring=keyring)

    return command


class ApplierProcess(VmstreamProcess):
    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "applier ready" not in (self.log.read_text(errors="replace") if self.log.exists() else ""):
            self.check_running()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the applier was not ready in {timeout}s:\n{self.tail()}")
            time.sleep(0.2)  # polling its log


# ---------------------------------------------------------------------------- CPU


def cpu_split(pids: dict[str, int]) -> dict[str, float]:
    """CPU-seconds so far of each process in ``pids``, and of the whole machine."""
    return {**{name: kit.cpu_of(pid).total for name, pid in pids.items()}, "machine": kit.machine_busy()}


def add_split(into: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    for name, value in after.items():
        into[name] = into.get(name, 0.0) + value - before[name]


def split_line(split: dict[str, float], count: int) -> str:
    """The machine's CPU per VM patched, each process's, and the rest of the machine's (other jobs)."""
    named = sum(split.get(name, 0.0) for name in PROCESSES)
    cells = [f"{name} {1000 * split[name] / count:.1f}" for name in PROCESSES if 1000 * split.get(name, 0.0) / count >= 0.05]
    return (f"machine {1000 * split['machine'] / count:.1f} ms per VM patched: " + ", ".join(cells)
            + f", other {1000 * max(split['machine'] - named, 0.0) / count:.1f}")


def ceiling(split: dict[str, float], count: int, pinned: bool) -> tuple[float, str]:
    """The VMs/s the CPU spent allows: the cores over the CPU-seconds per VM of the processes
    sharing them (pinned: the lower of the control plane's core and the rest's), and which."""
    def per_vm(names: tuple[str, ...]) -> float:
        return max(sum(split.get(name, 0.0) for name in names) / count, 1e-9)

    if not pinned:
        return (os.cpu_count() or 1) / per_vm(PROCESSES), f"{os.cpu_count()} cores shared"
    control, others = 1 / per_vm(CONTROL_PLANE), 1 / per_vm(REST)
    return min(control, others), ("CPU 0, the control plane's" if control <= others else "CPU 1, the rest's")


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", choices=("intents", "commands"), default="intents",
                        help="what vmstream is given: intents (the whole loop) or sealed commands (the applier)")
    parser.add_argument("--vms", type=int, default=600, help="VMs per set (three sets)")
    parser.add_argument("--threads", type=int, default=8, help="the anchor's threads, and apply.concurrency")
    parser.add_argument("--rate", type=float, help="messages/s of the paced run (default: half the anchor's rate)")
    parser.add_argument("--rounds", type=int, default=3, help="the anchor and vmstream take turns this many times")
    parser.add_argument("--warmup", type=int, help="VMs through the anchor and vmstream first, not counted "
                                                   "(default 300; 50 with --small)")
    parser.add_argument("--pin", action="store_true", help="the API server and etcd on CPU 0, the rest on CPU 1")
    kit.add_small_option(parser, vms=100)
    args = kit.parse(parser)
    count = args.vms
    warmup = args.warmup if args.warmup is not None else 50 if args.small else 300
    kit.print_load("at the start")
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vmstream-bench-")))
        broker = stack.enter_context(kit.broker())
        kube = stack.enter_context(LocalKube())
        configuration = kube.api_client().configuration
        configuration.connection_pool_maxsize = args.threads
        api = client.ApiClient(configuration)  # its pool sized for the anchor's threads
        custom = client.CustomObjectsApi(api)
        sets = {part: [f"{part}-{i:05d}" for i in range(count)] for part in ("anchor", "vmstream", "paced")}
        warm = {part: [f"warm-{part}-{i:05d}" for i in range(warmup)] for part in ("anchor", "vmstream")}
        everything = [name for names in (*sets.values(), *warm.values()) for name in names]
        started = time.monotonic()
        create_vms(api, everything, args.threads)
        print(f"created {len(everything)} VMs in {time.monotonic() - started:.1f}s", flush=True)
        patches = planned(custom, everything)
        send = anchor_request(custom, patches)

        deployment = kit.new_deployment(broker.bootstrap, workdir)
        stack.callback(deployment.delete_topics)
        kubeconfig = str(kube.kubeconfig)
        processes: dict[str, VmstreamProcess] = {"apply": ApplierProcess(
            deployment, "apply", ["apply", "--config", str(CONFIG), "--kubeconfig", kubeconfig, "--probe-port", "0"],
            env={"VMSTREAM_APPLY__CONCURRENCY": str(args.threads)})}
        if args.source == "intents":
            processes["worker"] = WorkerProcess(deployment, "worker")
            processes["watch"] = VmstreamProcess(deployment, "watch",
                                                 ["watch", "--config", str(CONFIG), "--kubeconfig", kubeconfig])
        for process in processes.values():
            process.start()
            stack.callback(process.stop)
        outputs = Outputs(deployment)
        stack.callback(outputs.close)
        events = deployment.kafka.topic("k8s-events")

        def decided_twice(names: Sequence[str]) -> Callable[[Outputs], bool]:
            """The worker has decided each VM's creation and the anchor's patch of it."""
            wanted = {object_key("VirtualMachine", NAMESPACE, name) for name in names}
            return lambda o: wanted <= {key for key, n in Counter(
                a["input"]["key"] for a in o.audits(input__topic=events)).items() if n >= 2}

        message: Callable[[str], tuple[bytes, bytes]]
        if args.source == "intents":
            keys = {object_key("VirtualMachine", NAMESPACE, name) for name in everything}
            started = time.monotonic()
            outputs.wait_for(lambda o: keys <= {a["input"]["key"] for a in o.audits(input__topic=events)},
                             timeout=600, what="every VM observed")
            print(f"the worker observed the {len(keys)} VMs through the bridge in {time.monotonic() - started:.1f}s")
            topic, message = deployment.kafka.topic("intents"), intent
        else:
            topic, message = deployment.kafka.topic("commands"), sealed(deployment, patches)

        watcher = PatchWatcher(api)
        watcher.start()
        stack.callback(watcher.stop.set)
        sender = DurableProducer(deployment.kafka, client_id="bench")
        stack.callback(sender.close)
        state = kube.state
        assert state is not None
        pids = {"kube-apiserver": state.apiserver_pid, "etcd": state.etcd_pid, "benchmark": os.getpid(),
                **{name: p.process.pid for name, p in processes.items() if p.process is not None},
                **({"broker": broker.pid} if broker.pid else {})}
        if args.pin:
            for name, pid in pids.items():
                kit.pin(pid, "0" if name in CONTROL_PLANE else "1")
            print(f"pinned: {', '.join(CONTROL_PLANE)} on CPU 0; "
                  f"{', '.join(name for name in REST if name in pids)} on CPU 1")

        def through_vmstream(names: list[str]) -> float:
            """Every message of ``names`` at once; when the last VM was seen patched."""
            sender.send_all([Record(topic, *message(name)) for name in names])
            return watcher.last(names)

        def through_anchor(names: list[str]) -> float:
            """The plain client with vmstream's processes frozen; thawed, the bridge and the worker
            catch up on these VMs' events before vmstream's turn."""
            frozen = [p.process.pid for p in processes.values() if p.process is not None]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            try:
                with ThreadPoolExecutor(args.threads) as pool:
                    list(pool.map(send, names))
                last = watcher.last(names)
            finally:
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)
            if args.source == "intents":
                outputs.wait_for(decided_twice(names), timeout=300, what="the worker to decide the anchor's patches")
            return last

        if warmup:
            started = time.monotonic()
            through_anchor(warm["anchor"])
            through_vmstream(warm["vmstream"])
            print(f"warm-up: {warmup} VMs each through the anchor and vmstream in "
                  f"{time.monotonic() - started:.1f}s, not counted", flush=True)

        splits: dict[str, dict[str, float]] = {"anchor": {}, "vmstream": {}, "paced": {}}

        def turn(part: str, run: Callable[[list[str]], float]) -> Callable[[int], float]:
            def one(round_: int) -> float:
                before, first = cpu_split(pids), time.monotonic()
                last = run(sets[part][round_::args.rounds])
                add_split(splits[part], before, cpu_split(pids))
                return last - first

            return one

        spent = kit.in_turns(args.rounds, {"anchor": turn("anchor", through_anchor),
                                           "vmstream": turn("vmstream", through_vmstream)})
        anchor_rate, vmstream_rate = count / sum(spent["anchor"]), count / sum(spent["vmstream"])

        rate = args.rate or anchor_rate / 2
        print(f"paced: {count} {args.source} at {rate:.0f}/s, {kit.load_average()}", flush=True)
        sent: dict[str, float] = {}
        before, first = cpu_split(pids), time.monotonic()
        for index, name in enumerate(sets["paced"]):
            kit.sleep_until(first + index / rate)
            sent[name] = time.monotonic()
            sender.send_all([Record(topic, *message(name))])
        last = watcher.last(sets["paced"])
        add_split(splits["paced"], before, cpu_split(pids))
        latencies = [watcher.patched[name] - sent[name] for name in sets["paced"]]

        what = "set_gpu intent" if args.source == "intents" else "patch_vm command"
        print(f"\n{what} → VM patched in the API server, {count} VMs per set, {args.threads} threads, "
              f"{kit.load_average()}")
        busy = splits["paced"]["machine"] / (last - first) / (os.cpu_count() or 1)
        print(kit.table(("run", "VMs patched/s", "ratio (target ≥ 0.8)"), [
            ("anchor (plain client → API server)", f"{anchor_rate:,.0f}", ""),
            (f"vmstream ({args.source} → API server)", f"{vmstream_rate:,.0f}", f"{vmstream_rate / anchor_rate:.2f}")]))
        print(f"paced at {rate:.0f}/s: {what} → VM patched {kit.summary_ms(latencies)}"
              f"{' (target p99 ≤ 250 ms)' if not args.rate else ''}; the machine {busy:.0%} busy")
        print("\nThe machine's CPU per VM patched, by process (other: the jobs the benchmark did not start)")
        for part, split in splits.items():
            print(f"  {part:<8} {split_line(split, count)}")
        bounds = {part: ceiling(splits[part], count, args.pin) for part in ("anchor", "vmstream")}
        print("\nThe rate that CPU allows (VMs patched/s, if nothing else ran and nothing waited)")
        for part, (bound, by) in bounds.items():
            print(f"  {part:<8} ≤ {bound:5.0f}/s, bound by {by}")
        print(f"  vmstream's ceiling over the anchor's: {bounds['vmstream'][0] / bounds['anchor'][0]:.2f}")
    kit.print_load("at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
