"""How fast the applier patches VMs, against the API server's own rate for the same patches.

One run, one local kube-apiserver (KubeVirt's CRDs) and one broker, six sets of fresh VMs:

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
  latency from a command handed to the producer to the VM seen patched; then the same at a
  quarter of it.

A VM counts as patched when the benchmark's own watch on the API server shows the GPU in
its template; a rate is VMs / (last patch seen − first request or command sent), summed over
``--rounds`` rounds in which the four saturating runs take turns.

Before the rounds, ``--warmup`` VMs more go through the anchor and both appliers, not
counted: a broker just started spends four times the CPU on a produce request that it
spends once its JVM has compiled its hot paths, some thousands of requests later
(``benchmarks/broker_cost.py``), and on two cores that CPU is taken from the API server.
``--warmup 0`` measures cold parts.

The CPU the machine spent per VM patched is printed by process for each run, beside the
machine's whole busy time (other jobs included): on two cores the parts share, a rate is
what the API server has left once the rest has taken its share.

    .venv/bin/python benchmarks/apply_rate.py                 # 600 VMs per set
    .venv/bin/python benchmarks/apply_rate.py --small         # 100 VMs per set, a quick run
    .venv/bin/python benchmarks/apply_rate.py --warmup 0      # cold broker, as before the warm-up
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
from kubernetes import client  # noqa: E402
from patching import (  # noqa: E402
    MUTATION,
    NAMESPACE,
    PatchWatcher,
    add_split,
    anchor_request,
    cpu_split,
    create_vms,
    planned,
    split_line,
    wait_patched,
    watch_patches,
)

from handlers import ids  # noqa: E402
from handlers.decisions import subject_key  # noqa: E402
from handlers.messages import Command, ObjectRef  # noqa: E402
from harness.localkube import LocalKube  # noqa: E402
from harness.running import CONFIG, VmstreamProcess  # noqa: E402
from streams.common.codecs import encode_message  # noqa: E402
from streams.common.durable import DurableProducer, Record  # noqa: E402
from streams.kube.applying import KUBEVIRT  # noqa: E402


class ApplierProcess(VmstreamProcess):
    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "applier ready" not in (self.log.read_text(errors="replace") if self.log.exists() else ""):
            self.check_running()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the applier was not ready in {timeout}s:\n{self.tail()}")
            time.sleep(0.2)  # polling its log


PROCESSES = ("kube-apiserver", "etcd", "broker", "applier", "live", "benchmark")


def paced_run(sender: Any, topic: str, watcher: PatchWatcher, paced: list[tuple[str, str, bytes]], rate: float,
              pids: dict[str, int]) -> tuple[list[float], dict[str, float], float]:
    """Commands published one by one at ``rate``: each one's latency to its VM seen patched (ms),
    the CPU spent meanwhile, and how long it took."""
    sent: dict[str, float] = {}
    before = cpu_split(pids)
    first = time.monotonic()
    for index, (name, key, value) in enumerate(paced):
        kit.sleep_until(first + index / rate)
        sent[name] = time.monotonic()
        sender.send_all([Record(topic, key.encode(), value)])
    last = wait_patched(watcher, [name for name, _, _ in paced])
    split: dict[str, float] = {}
    add_split(split, before, cpu_split(pids))
    return [1000 * (watcher.patched[name] - sent[name]) for name, _, _ in paced], split, last - first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=600, help="VMs per set (six sets)")
    parser.add_argument("--threads", type=int, default=8, help="the anchor's threads")
    parser.add_argument("--concurrency", type=int, help="the applier's apply.concurrency (default: --threads)")
    parser.add_argument("--paced-rate", type=float, help="commands/s of the paced run (default: half the anchor's rate)")
    parser.add_argument("--small", action="store_true", help="100 VMs per set")
    parser.add_argument("--rounds", type=int, default=3, help="the saturating runs take turns this many times")
    parser.add_argument("--warmup", type=int, help="VMs through the anchor and each applier first, not counted "
                                                   "(default 1,000; 100 with --small)")
    args = parser.parse_args()
    count = 100 if args.small else args.vms
    warmup = args.warmup if args.warmup is not None else 100 if args.small else 1000
    concurrency = args.concurrency or args.threads
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vmstream-apply-rate-")))
        broker = stack.enter_context(kit.broker())
        bootstrap = broker.bootstrap
        kube = stack.enter_context(LocalKube())
        api = kube.api_client()
        api.configuration.connection_pool_maxsize = args.threads
        api = client.ApiClient(api.configuration)  # its pool sized for the anchor's threads
        custom = client.CustomObjectsApi(api)
        parts = ("anchor", "reads", "applier", "live", "paced", "quarter")
        sets = {part: [f"{part}-{i:05d}" for i in range(count)] for part in parts}
        warm = {part: [f"warm-{part}-{i:05d}" for i in range(warmup)] for part in ("anchor", "applier", "live")}
        started = time.monotonic()
        create_vms(api, [name for names in (*sets.values(), *warm.values()) for name in names], args.threads)
        print(f"created {len(parts) * count + len(warm) * warmup} VMs in {time.monotonic() - started:.1f}s")
        patches = planned(custom, [name for names in (*sets.values(), *warm.values()) for name in names])

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

        watcher = watch_patches(api)
        stack.callback(watcher.stop.set)

        send = anchor_request(custom, patches)
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

        sender = DurableProducer(deployment.kafka, client_id="bench")
        stack.callback(sender.close)
        assert applier.process is not None and live_applier.process is not None
        pids = {"applier": applier.process.pid, "live": live_applier.process.pid}
        topics = {"applier": topic, "live": live_deployment.kafka.topic("commands")}
        keyrings = {"applier": keyring, "live": live_deployment.signing.keyring()}
        state = kube.state
        assert state is not None
        every = {"kube-apiserver": state.apiserver_pid, "etcd": state.etcd_pid, **pids, "benchmark": os.getpid(),
                 **({"broker": broker.pid} if broker.pid else {})}

        def through_applier(part: str, names: list[str]) -> float:
            """Every command of ``names`` on ``part``'s commands topic at once; when the last VM was seen patched."""
            sender.send_all([Record(topics[part], key.encode(), value)
                             for key, value in [sealed(name, keyrings[part]) for name in names]])
            return wait_patched(watcher, names)

        if warmup:
            started = time.monotonic()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(send, warm["anchor"]))
            wait_patched(watcher, warm["anchor"])
            through_applier("applier", warm["applier"])
            through_applier("live", warm["live"])
            print(f"warm-up: {warmup} VMs each through the anchor and both appliers in "
                  f"{time.monotonic() - started:.1f}s, not counted")

        # The four in turn, a share of each set per round: a load that changes during the
        # run weighs on all four alike.
        spent = {"anchor": 0.0, "reads": 0.0, "applier": 0.0, "live": 0.0}
        cpu = {"anchor": 0.0, "applier": 0.0, "live": 0.0}
        splits: dict[str, dict[str, float]] = {"anchor": {}, "reads": {}, "applier": {}, "live": {}}
        for round_ in range(args.rounds):
            share = {part: names[round_::args.rounds] for part, names in sets.items()}
            print(f"round {round_ + 1}/{args.rounds}: {len(share['anchor'])} VMs each, {kit.load_average()}")
            split, first, before = cpu_split(every), time.monotonic(), time.process_time()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(send, share["anchor"]))
            cpu["anchor"] += time.process_time() - before  # the watch thread's share included
            spent["anchor"] += wait_patched(watcher, share["anchor"]) - first
            add_split(splits["anchor"], split, cpu_split(every))
            split, first = cpu_split(every), time.monotonic()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(read_and_send, share["reads"]))
            spent["reads"] += wait_patched(watcher, share["reads"]) - first
            add_split(splits["reads"], split, cpu_split(every))
            for part in ("applier", "live"):
                split, first = cpu_split(every), time.monotonic()
                spent[part] += through_applier(part, share[part]) - first
                after = cpu_split(every)  # until the last patch
                cpu[part] += after[part] - split[part]
                add_split(splits[part], split, after)
        anchor_rate, reads_rate, applier_rate, live_rate = (
            count / spent[part] for part in ("anchor", "reads", "applier", "live"))
        anchor_cpu, applier_cpu, live_cpu = (1000 * cpu[part] / count for part in ("anchor", "applier", "live"))

        rate = args.paced_rate or anchor_rate / 2
        paced: dict[str, tuple[float, list[float], dict[str, float], float]] = {}
        for part, part_rate in (("paced", rate), ("quarter", rate / 2)):
            commands = [(name, *sealed(name)) for name in sets[part]]
            print(f"paced: {count} commands at {part_rate:.0f}/s, {kit.load_average()}")
            paced[part] = (part_rate, *paced_run(sender, topic, watcher, commands, part_rate, every))

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
        for part, (part_rate, latencies, split, took) in paced.items():
            target = " (target p99 ≤ 250 ms)" if part == "paced" else ""
            print(f"  paced at {part_rate:.0f} commands/s: command → VM patched  "
                  f"p50 {kit.percentile(latencies, 0.5):.0f} ms   p90 {kit.percentile(latencies, 0.9):.0f} ms   "
                  f"p99 {kit.percentile(latencies, 0.99):.0f} ms   max {max(latencies):.0f} ms{target}; "
                  f"the machine {split['machine'] / took / (os.cpu_count() or 1):.0%} busy")
        print("\nThe machine's CPU per VM patched, by process (other: the jobs the benchmark did not start)")
        for part, title in (("anchor", "anchor"), ("reads", "anchor with reads"), ("applier", "applier"),
                            ("live", "applier, live reads"), ("paced", "paced"), ("quarter", "paced, half as fast")):
            split = splits[part] if part in splits else paced[part][2]
            print(f"  {title:<20} {split_line(split, count, PROCESSES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
