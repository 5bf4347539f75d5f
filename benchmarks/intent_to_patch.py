"""From a ``set_gpu`` intent to the VM patched in the API server, against the API server's own
rate for the same patches.

The whole loop, each part its own process: a real kube-apiserver (local control plane with
KubeVirt's CRDs), a real Kafka broker, ``vmstream watch``, ``vmstream worker`` and ``vmstream
apply``. The benchmark creates three sets of ``--vms`` VMs (and ``--warmup`` more), waits
until the worker has observed every one through the bridge, then:

* **anchor** — the JSON patches the worker plans for the anchor set (the GPU rules' patch
  guarded by the VM's ``resourceVersion``, ``patching.py``) sent straight to the API server by
  a plain kubernetes client from ``--threads`` threads, vmstream's three processes frozen
  meanwhile (SIGSTOP): left running, the bridge and the worker react to every one of these
  patches and take the API server's CPU (the anchor fell from 270 to 147/s in one run);
* **loop** — one ``set_gpu`` intent per VM of the loop set, all on the intents topic at once:
  intent → route → decide → command → applier → API server;
* the two take turns over ``--rounds`` rounds, a share of each set per round, so a load that
  changes meanwhile weighs on both; a rate is VMs / (last patch seen − first request or
  intent sent);
* **paced** — one intent at a time at half the anchor's rate (``--rate`` to choose): each
  intent's latency from the producer to its VM seen patched, and where the time went, from
  the Kafka timestamps of the worker's command and the applier's result.

A VM counts as patched when the benchmark's own watch shows the GPU in its template. Before
the rounds, ``--warmup`` VMs go through the anchor and the loop, not counted (a broker just
started costs four times the CPU per request, ``broker_cost.py``). The CPU each process
spent per VM patched is printed beside the machine's whole busy time, from ``/proc``, and
with it the rate that CPU allows: the machine's cores (or, pinned, each part's own core)
divided by the CPU-seconds one VM patched costs the processes that share them. On one
machine the loop also pays for the broker, the bridge, the worker and the applier, so its
ceiling, not the API server, can be what bounds it.

``--pin`` gives the API server and etcd CPU 0 and everything else (the broker, vmstream's
processes, this script and its client) CPU 1, for the anchor and the loop alike: the API
server then has a core of its own, as it has a machine of its own in a cluster.

    .venv/bin/python benchmarks/intent_to_patch.py               # 600 VMs per set
    .venv/bin/python benchmarks/intent_to_patch.py --small       # 100 per set, a quick run
    .venv/bin/python benchmarks/intent_to_patch.py --rate 40     # paced at 40 intents/s
    .venv/bin/python benchmarks/intent_to_patch.py --pin         # the API server on a core of its own
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
from kit import percentile  # noqa: E402
from kubernetes import client  # noqa: E402
from patching import (  # noqa: E402
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

from handlers.messages import object_key  # noqa: E402
from harness.localkube import LocalKube  # noqa: E402
from harness.running import CONFIG, Deployment, Outputs, VmstreamProcess, WorkerProcess  # noqa: E402
from streams.common.durable import DurableProducer, Record  # noqa: E402

PROCESSES = ("kube-apiserver", "etcd", "broker", "worker", "watch", "apply", "benchmark")
CONTROL_PLANE = ("kube-apiserver", "etcd")  # CPU 0 with --pin
REST = tuple(name for name in PROCESSES if name not in CONTROL_PLANE)  # CPU 1 with --pin


def ceiling(split: dict[str, float], count: int, pinned: bool) -> tuple[float, str]:
    """The VMs/s the CPU spent allows: the cores over the CPU-seconds per VM of the processes
    sharing them (pinned: the lower of the control plane's core and the rest's), and which."""
    def per_vm(names: tuple[str, ...]) -> float:
        return max(sum(split.get(name, 0.0) for name in names) / count, 1e-9)

    if not pinned:
        return (os.cpu_count() or 1) / per_vm(PROCESSES), f"{os.cpu_count()} cores shared"
    control, others = 1 / per_vm(CONTROL_PLANE), 1 / per_vm(REST)
    return min(control, others), ("CPU 0, the control plane's" if control <= others else "CPU 1, the rest's")


def intent(name: str) -> dict[str, bytes]:
    """The ``set_gpu`` of one VM: its key and value on the intents topic."""
    value = {"intent_id": f"bench-{name}", "type": "set_gpu", "requested_by": "bench@example.com",
             "project": "bench", "spec": {"namespace": NAMESPACE, "name": name, "gpu_class": "nvidia-a100"}}
    return {"key": f"vm/{NAMESPACE}/{name}".encode(), "value": json.dumps(value).encode()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=600, help="VMs per set (three sets)")
    parser.add_argument("--threads", type=int, default=8, help="the anchor's threads")
    parser.add_argument("--rate", type=float, help="intents/s of the paced run (default: half the anchor's rate)")
    parser.add_argument("--rounds", type=int, default=3, help="the anchor and the loop take turns this many times")
    parser.add_argument("--warmup", type=int, help="VMs through the anchor and the loop first, not counted "
                                                   "(default 300; 50 with --small)")
    parser.add_argument("--pin", action="store_true", help="the API server and etcd on CPU 0, the rest on CPU 1")
    kit.add_small_option(parser, vms=100)
    args = kit.parse(parser)
    count = args.vms
    warmup = args.warmup if args.warmup is not None else 50 if args.small else 300
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vmstream-bench-")))
        broker = stack.enter_context(kit.broker())
        kube = stack.enter_context(LocalKube())
        api = kube.api_client()
        api.configuration.connection_pool_maxsize = args.threads
        api = client.ApiClient(api.configuration)  # its pool sized for the anchor's threads
        custom = client.CustomObjectsApi(api)
        sets = {part: [f"{part}-{i:05d}" for i in range(count)] for part in ("anchor", "loop", "paced")}
        warm = {part: [f"warm-{part}-{i:05d}" for i in range(warmup)] for part in ("anchor", "loop")}
        everything = [name for names in (*sets.values(), *warm.values()) for name in names]
        started = time.monotonic()
        create_vms(api, everything, args.threads)
        print(f"created {len(everything)} VMs in {time.monotonic() - started:.1f}s")
        send = anchor_request(custom, planned(custom, [*sets["anchor"], *warm["anchor"]]))

        deployment = kit.new_deployment(broker.bootstrap, workdir)
        kubeconfig = str(kube.kubeconfig)
        worker = WorkerProcess(deployment, "worker").start()
        stack.callback(worker.stop)
        processes: dict[str, VmstreamProcess] = {"worker": worker}
        for name in ("watch", "apply"):
            process = VmstreamProcess(deployment, name, [name, "--config", str(CONFIG), "--kubeconfig", kubeconfig])
            process.start()
            stack.callback(process.stop)
            processes[name] = process
        outputs = Outputs(deployment)
        stack.callback(outputs.close)
        events = deployment.kafka.topic("k8s-events")
        keys = {object_key("VirtualMachine", NAMESPACE, name) for name in everything}
        started = time.monotonic()
        outputs.wait_for(lambda o: keys <= {a["input"]["key"] for a in o.audits(input__topic=events)},
                         timeout=600, what="every VM observed")
        print(f"the worker observed the {len(keys)} VMs through the bridge in {time.monotonic() - started:.1f}s")

        watcher = watch_patches(api)
        stack.callback(watcher.stop.set)
        sender = DurableProducer(deployment.kafka, client_id="bench")
        stack.callback(sender.close)
        topic = deployment.kafka.topic("intents")
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

        def through_loop(names: list[str]) -> tuple[float, dict[str, float]]:
            """Every intent of ``names`` at once: when the last VM was seen patched, the CPU then."""
            sender.send_all([Record(topic, **intent(name)) for name in names])
            return wait_patched(watcher, names), cpu_split(pids)

        def through_anchor(names: list[str]) -> tuple[float, dict[str, float]]:
            """The plain client with vmstream's processes frozen (SIGSTOP, for less than a group
            session): the API server has the machine as it has it in apply_rate.py's anchor.
            Thawed, the bridge and the worker catch up on these VMs' events before the loop runs."""
            frozen = [p.process.pid for p in processes.values() if p.process is not None]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            try:
                with ThreadPoolExecutor(args.threads) as pool:
                    list(pool.map(send, names))
                last, after = wait_patched(watcher, names), cpu_split(pids)
            finally:
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)
            wanted = {object_key("VirtualMachine", NAMESPACE, name) for name in names}
            outputs.wait_for(lambda o: wanted <= {key for key, n in Counter(
                a["input"]["key"] for a in o.audits(input__topic=events)).items() if n >= 2},
                timeout=300, what="the worker to decide the anchor's patches")
            return last, after

        if warmup:
            started = time.monotonic()
            through_anchor(warm["anchor"])
            through_loop(warm["loop"])
            print(f"warm-up: {warmup} VMs each through the anchor and the loop in "
                  f"{time.monotonic() - started:.1f}s, not counted")

        spent = {"anchor": 0.0, "loop": 0.0}
        splits: dict[str, dict[str, float]] = {"anchor": {}, "loop": {}, "paced": {}}
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}: {len(sets['anchor'][round_::args.rounds])} VMs each, "
                  f"{kit.load_average()}")
            for part, run in (("anchor", through_anchor), ("loop", through_loop)):
                before, first = cpu_split(pids), time.monotonic()
                last, after = run(sets[part][round_::args.rounds])
                spent[part] += last - first
                add_split(splits[part], before, after)
        anchor_rate, loop_rate = count / spent["anchor"], count / spent["loop"]

        rate = args.rate or anchor_rate / 2
        print(f"paced: {count} intents at {rate:.0f}/s, {kit.load_average()}")
        sent: dict[str, float] = {}
        sent_wall: dict[str, float] = {}
        before, first, first_wall = cpu_split(pids), time.monotonic(), time.time()
        for index, name in enumerate(sets["paced"]):
            kit.sleep_until(first + index / rate)
            sent[name], sent_wall[name] = time.monotonic(), time.time()
            sender.send_all([Record(topic, **intent(name))])
        last = wait_patched(watcher, sets["paced"])
        add_split(splits["paced"], before, cpu_split(pids))
        latencies = [1000 * (watcher.patched[n] - sent[n]) for n in sets["paced"]]

        print(f"\nset_gpu → VM patched in the API server, {count} VMs per set, anchor {args.threads} threads, "
              f"{kit.load_average()}")
        print(f"  anchor (plain client → API server)   {anchor_rate:5.0f} VMs patched/s")
        print(f"  loop (intents → API server)          {loop_rate:5.0f} VMs patched/s   "
              f"ratio {loop_rate / anchor_rate:.2f} (target ≥ 0.8)")
        busy = splits["paced"]["machine"] / (last - first) / (os.cpu_count() or 1)
        print(f"  paced at {rate:.0f} intents/s: intent → VM patched  p50 {percentile(latencies, 0.5):.0f} ms   "
              f"p90 {percentile(latencies, 0.9):.0f} ms   p99 {percentile(latencies, 0.99):.0f} ms   "
              f"max {max(latencies):.0f} ms{' (target p99 ≤ 250 ms)' if not args.rate else ''}; "
              f"the machine {busy:.0%} busy")
        for stage, values in stage_latencies(deployment, sent_wall, watcher, first_wall - first).items():
            if values:
                print(f"    {stage:<34} p50 {percentile(values, 0.5):6.0f} ms   p99 {percentile(values, 0.99):6.0f} ms")
        print("\nThe machine's CPU per VM patched, by process (other: the jobs the benchmark did not start)")
        for part in ("anchor", "loop", "paced"):
            print(f"  {part:<8} {split_line(splits[part], count, PROCESSES)}")
        bounds = {part: ceiling(splits[part], count, args.pin) for part in ("anchor", "loop")}
        print("\nThe rate that CPU allows (VMs patched/s, if nothing else ran and nothing waited)")
        for part, (bound, by) in bounds.items():
            print(f"  {part:<8} ≤ {bound:5.0f}/s, bound by {by}")
        print(f"  the loop's ceiling over the anchor's ceiling: {bounds['loop'][0] / bounds['anchor'][0]:.2f}")
    return 0


def stage_latencies(deployment: Deployment, sent_wall: dict[str, float], watcher: PatchWatcher,
                    offset: float) -> dict[str, list[float]]:
    """Where the time of the paced intents went, from the Kafka timestamps of the worker's
    commands and the applier's results (producer clocks: the same machine)."""
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
        value: dict[str, Any] = json.loads(record.value)
        if record.topic == topics[0] and value["type"] == "patch_vm" and value["target"]["name"] in sent_wall:
            command_at[value["target"]["name"]] = record.timestamp / 1000
            command_vm[value["command_id"]] = value["target"]["name"]
        elif record.topic == topics[1] and value["command_id"] in command_vm:
            result_at[command_vm[value["command_id"]]] = record.timestamp / 1000
    reader.close()
    patched = watcher.patched
    return {
        "intent → command sent (worker)": [1000 * (command_at[n] - sent_wall[n]) for n in command_at],
        "command → result sent (applier)": [1000 * (result_at[n] - command_at[n]) for n in result_at],
        "result sent → patch watched": [1000 * (patched[n] + offset - result_at[n]) for n in result_at if n in patched],
    }


if __name__ == "__main__":
    sys.exit(main())
