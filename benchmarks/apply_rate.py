"""How fast the applier patches VMs, against the API server's own rate for the same patches.

One run, one local kube-apiserver (KubeVirt's CRDs) and one broker, five sets of fresh VMs:

* **anchor** — the very JSON patches the applier sends (the GPU rules' patch guarded by the
  VM's ``resourceVersion``), sent straight to the API server by a plain kubernetes client
  from ``--threads`` threads;
* **anchor with reads** — the same, each patch after the two reads the applier made
  first before its policy read from a watched copy (the namespace's labels and the live VM);
* **applier** — the same patches as sealed ``patch_vm`` commands, all on the commands topic
  at once, applied by ``vmstream apply`` (its own process, ``apply.concurrency`` =
  ``--threads``), its policy reading from its watched copy (``apply.cache``, the default);
* **applier, live reads** — the same with ``apply.cache: false``: a second ``vmstream apply``
  (its own group and commands topic) that reads the namespace and the VM before each patch;
* **paced** — commands published one by one at half the anchor's rate (``--paced-rate``):
  latency from a command handed to the producer to the VM seen patched.

A VM counts as patched when the benchmark's own watch on the API server shows the GPU in
its template; a rate is VMs / (last patch seen − first request or command sent), summed over
``--rounds`` rounds in which the four saturating runs take turns.

    .venv/bin/python benchmarks/apply_rate.py                 # 600 VMs per set
    .venv/bin/python benchmarks/apply_rate.py --small         # 100 VMs per set, a quick run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
from intent_to_patch import NAMESPACE, PatchWatcher, vm_body  # noqa: E402
from kubernetes import client  # noqa: E402

from handlers import ids  # noqa: E402
from handlers.decisions import subject_key  # noqa: E402
from handlers.enforcement import FIELD_MANAGER  # noqa: E402
from handlers.gpus import desired_vm, plan_patch  # noqa: E402
from handlers.messages import Command, GPUMutation, ObjectRef  # noqa: E402
from harness.localkube import LocalKube  # noqa: E402
from harness.running import CONFIG, VmstreamProcess  # noqa: E402
from harness.scenarios import A100, PROJECT_LABEL  # noqa: E402
from streams.common.codecs import encode_message  # noqa: E402
from streams.common.kafka_clients import producer  # noqa: E402
from streams.kube.applying import JSON_PATCH, KUBEVIRT  # noqa: E402

MUTATION = GPUMutation(device_name=A100, eviction_strategy="External")


class ApplierProcess(VmstreamProcess):
    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "applier ready" not in (self.log.read_text(errors="replace") if self.log.exists() else ""):
            self.check_running()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the applier was not ready in {timeout}s:\n{self.tail()}")
            time.sleep(0.2)  # polling its log


def planned(custom: client.CustomObjectsApi, names: list[str]) -> dict[str, tuple[list[dict[str, Any]], str]]:
    """name → (the GPU rules' JSON patch for the live VM, its resourceVersion), as the worker plans it."""
    listed = custom.list_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines")
    live = {vm["metadata"]["name"]: vm for vm in listed["items"]}
    return {name: (plan_patch(live[name], desired_vm(live[name], MUTATION)), live[name]["metadata"]["resourceVersion"])
            for name in names}


def wait_patched(watcher: PatchWatcher, names: list[str], timeout: float = 900.0) -> float:
    """When the last of ``names`` was seen patched."""
    deadline = time.monotonic() + timeout
    while any(name not in watcher.patched for name in names):
        if time.monotonic() > deadline:
            missing = sum(name not in watcher.patched for name in names)
            raise TimeoutError(f"{missing} of {len(names)} VMs not patched in {timeout}s")
        time.sleep(0.1)  # waiting for the watch thread's record
    return max(watcher.patched[name] for name in names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=600, help="VMs per set (five sets)")
    parser.add_argument("--threads", type=int, default=8, help="the anchor's threads")
    parser.add_argument("--concurrency", type=int, help="the applier's apply.concurrency (default: --threads)")
    parser.add_argument("--paced-rate", type=float, help="commands/s of the paced run (default: half the anchor's rate)")
    parser.add_argument("--small", action="store_true", help="100 VMs per set")
    parser.add_argument("--rounds", type=int, default=3, help="the saturating runs take turns this many times")
    args = parser.parse_args()
    count = 100 if args.small else args.vms
    concurrency = args.concurrency or args.threads
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vmstream-apply-rate-")))
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        kube = stack.enter_context(LocalKube())
        api = kube.api_client()
        api.configuration.connection_pool_maxsize = args.threads
        api = client.ApiClient(api.configuration)  # its pool sized for the anchor's threads
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE, "labels": {PROJECT_LABEL: "bench"}}})
        custom = client.CustomObjectsApi(api)
        parts = ("anchor", "reads", "applier", "live", "paced")
        sets = {part: [f"{part}-{i:05d}" for i in range(count)] for part in parts}
        started = time.monotonic()
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(lambda n: custom.create_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines",
                                                                            vm_body(n)),
                          [name for names in sets.values() for name in names]))
        print(f"created {len(parts) * count} VMs in {time.monotonic() - started:.1f}s")
        patches = planned(custom, [name for names in sets.values() for name in names])

        deployment = kit.new_deployment(bootstrap, workdir)
        stack.callback(deployment.delete_topics)
        applier = ApplierProcess(deployment, "apply", ["apply", "--config", str(CONFIG), "--kubeconfig",
                                                       str(kube.kubeconfig), "--probe-port", "0"],
                                 env={"VMSTREAM_APPLY__CONCURRENCY": str(concurrency)})
        applier.start()
        stack.callback(applier.stop)
        # The same applier reading live (apply.cache false), on a deployment of its own.
        (workdir / "live").mkdir()
        live_deployment = kit.new_deployment(bootstrap, workdir / "live")
        stack.callback(live_deployment.delete_topics)
        live_applier = ApplierProcess(live_deployment, "apply-live",
                                      ["apply", "--config", str(CONFIG), "--kubeconfig", str(kube.kubeconfig),
                                       "--probe-port", "0"],
                                      env={"VMSTREAM_APPLY__CONCURRENCY": str(concurrency),
                                           "VMSTREAM_APPLY__CACHE": "false"})
        live_applier.start()
        stack.callback(live_applier.stop)

        listed = custom.list_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines", limit=1)
        watcher = PatchWatcher(api, listed["metadata"]["resourceVersion"])
        watcher.start()
        stack.callback(watcher.stop.set)

        # The anchor: the applier's own request (_json_patch_vm), straight from a plain client.
        def send(name: str) -> None:
            patch, rv = patches[name]
            custom.patch_namespaced_custom_object(
                *KUBEVIRT, NAMESPACE, "virtualmachines", name,
                [{"op": "replace", "path": "/metadata/resourceVersion", "value": rv}, *patch],
                _content_type=JSON_PATCH, field_manager=FIELD_MANAGER)

        core = client.CoreV1Api(api)

        def read_and_send(name: str) -> None:
            core.read_namespace(NAMESPACE)
            custom.get_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines", name)
            send(name)

        keyring = deployment.signing.keyring()
        topic = deployment.kafka.topic("commands")

        def sealed(name: str, keyring: Any = keyring) -> tuple[str, bytes]:
            patch, rv = patches[name]
            target = ObjectRef(kind="VirtualMachine", namespace=NAMESPACE, name=name)
            cause = f"bench-{deployment.ident}-{name}"
            command = Command(command_id=ids.command_id(cause, "patch_vm", subject_key(target)), type="patch_vm",
                              target=target, cause=cause, issued_at=datetime.now(UTC), patch=patch,
                              base_resource_version=rv, mutation=MUTATION, requested_by="bench@example.com")
            return subject_key(target), encode_message(command, keyring=keyring)

        sender = producer(deployment.kafka, linger_ms=0)
        stack.callback(sender.close)
        assert applier.process is not None and live_applier.process is not None
        pids = {"applier": applier.process.pid, "live": live_applier.process.pid}
        topics = {"applier": topic, "live": live_deployment.kafka.topic("commands")}
        keyrings = {"applier": keyring, "live": live_deployment.signing.keyring()}

        # The four in turn, a share of each set per round: a load that changes during the
        # run weighs on all four alike.
        spent = {"anchor": 0.0, "reads": 0.0, "applier": 0.0, "live": 0.0}
        cpu = {"anchor": 0.0, "applier": 0.0, "live": 0.0}
        for round_ in range(args.rounds):
            share = {part: names[round_::args.rounds] for part, names in sets.items()}
            print(f"round {round_ + 1}/{args.rounds}: {len(share['anchor'])} VMs each, {kit.load_average()}")
            first, before = time.monotonic(), time.process_time()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(send, share["anchor"]))
            cpu["anchor"] += time.process_time() - before  # the watch thread's share included
            spent["anchor"] += wait_patched(watcher, share["anchor"]) - first
            first = time.monotonic()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(read_and_send, share["reads"]))
            spent["reads"] += wait_patched(watcher, share["reads"]) - first
            for part in ("applier", "live"):
                commands = [sealed(name, keyrings[part]) for name in share[part]]
                first, before = time.monotonic(), kit.cpu_of(pids[part]).total
                for key, value in commands:
                    sender.send(topics[part], key=key.encode(), value=value)
                sender.flush()
                spent[part] += wait_patched(watcher, share[part]) - first
                cpu[part] += kit.cpu_of(pids[part]).total - before  # until the last patch
        anchor_rate, reads_rate, applier_rate, live_rate = (
            count / spent[part] for part in ("anchor", "reads", "applier", "live"))
        anchor_cpu, applier_cpu, live_cpu = (1000 * cpu[part] / count for part in ("anchor", "applier", "live"))

        rate = args.paced_rate or anchor_rate / 2
        paced = [(name, *sealed(name)) for name in sets["paced"]]
        print(f"paced: {count} commands at {rate:.0f}/s, {kit.load_average()}")
        sent: dict[str, float] = {}
        first = time.monotonic()
        for index, (name, key, value) in enumerate(paced):
            due = first + index / rate
            while (now := time.monotonic()) < due:
                time.sleep(min(due - now, 0.005))  # pacing the producer, not synchronising
            sent[name] = time.monotonic()
            sender.send(topic, key=key.encode(), value=value)
            sender.flush()
        wait_patched(watcher, sets["paced"])
        latencies = [1000 * (watcher.patched[name] - sent[name]) for name in sets["paced"]]

        ratio = applier_rate / anchor_rate
        print(f"\nJSON patches of GPU VMs, {count} VMs per set, anchor {args.threads} threads, "
              f"apply.concurrency {concurrency}, {kit.load_average()}")
        print(f"  anchor (plain client → API server)   {anchor_rate:7.0f} VMs patched/s   "
              f"client CPU {anchor_cpu:.1f} ms per patch")
        print(f"  anchor with the applier's reads       {reads_rate:7.0f} VMs patched/s")
        print(f"  applier (commands → API server)      {applier_rate:7.0f} VMs patched/s   "
              f"ratio {ratio:.2f} (target ≥ 0.8), {applier_rate / reads_rate:.2f} of the anchor with reads; "
              f"applier CPU {applier_cpu:.1f} ms per command")
        print(f"  applier, live reads (apply.cache off) {live_rate:7.0f} VMs patched/s   "
              f"ratio {live_rate / anchor_rate:.2f}; applier CPU {live_cpu:.1f} ms per command")
        print(f"  paced at {rate:.0f} commands/s: command → VM patched  p50 {kit.percentile(latencies, 0.5):.0f} ms   "
              f"p90 {kit.percentile(latencies, 0.9):.0f} ms   p99 {kit.percentile(latencies, 0.99):.0f} ms   "
              f"max {max(latencies):.0f} ms (target p99 ≤ 250 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
