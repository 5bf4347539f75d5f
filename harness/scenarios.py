"""Scenarios of the sample AZ (samples/cluster.py): its objects as watch events and intents,
on a clock, as the demo, the shipped examples, the benchmarks and the Kafka tests replay them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from handlers.contracts import topics
from samples.cluster import A100, RTX, iso, kubevirt_cr, node, node_maintenance, vm, vmi
from streams.common.settings import KafkaSettings

# Scenario files name the topics by their default full names.
INTENTS = KafkaSettings().topic(topics.INTENTS)
EVENTS = KafkaSettings().topic(topics.K8S_EVENTS)


def _key(obj: dict[str, Any]) -> str:
    metadata = obj["metadata"]
    namespace = metadata.get("namespace") if obj["kind"] != "KubeVirt" else metadata.get("namespace")
    return f"{obj['kind']}/{namespace}/{metadata['name']}" if namespace else f"{obj['kind']}/{metadata['name']}"


@dataclass
class Script:
    """Builds a scenario as input lines, advancing a clock."""

    start: datetime
    prefix: str = "ev"  # event ids are <prefix>-000001, …: unique within a scenario
    lines: list[dict[str, Any]] = field(default_factory=list)
    _events: int = 0

    @property
    def now(self) -> datetime:
        return self.start

    def wait(self, seconds: float) -> Script:
        self.start += timedelta(seconds=seconds)
        return self

    def event(self, type_: str, obj: dict[str, Any]) -> Script:
        self._events += 1
        self.lines.append({
            "topic": EVENTS,
            "key": _key(obj),
            "value": {"event_id": f"{self.prefix}-{self._events:06d}", "type": type_, "kind": obj["kind"],
                      "object": obj, "observed_at": iso(self.start)},
        })
        return self

    def intent(self, intent_id: str, type_: str, spec: dict[str, Any], *, by: str,
               project: str | None = None) -> Script:
        key = f"node/{spec['node']}" if "node" in spec else f"vm/{spec['namespace']}/{spec['name']}"
        value: dict[str, Any] = {"intent_id": intent_id, "type": type_, "requested_by": by,
                                 "requested_at": iso(self.start), "spec": spec}
        if project:
            value["project"] = project
        self.lines.append({"topic": INTENTS, "key": key, "value": value})
        return self

    def raw(self, topic: str, key: str, text: str) -> Script:
        self.lines.append({"topic": topic, "key": key, "value": text, "timestamp": iso(self.start)})
        return self

    def jsonl(self) -> Iterator[str]:
        for line in self.lines:
            yield json.dumps(line, sort_keys=True)


# ------------------------------------------------------------------ the scenarios

START = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
ALICE, BOB, CAROL, OPS = "alice@example.com", "bob@example.com", "carol@example.com", "ops@example.com"


def cluster() -> Script:
    """The AZ as the watch bridge first lists it."""
    s = Script(START)
    s.event("ADDED", kubevirt_cr())
    s.event("ADDED", node("gpu-node-1", gpus={RTX: 2}))
    s.event("ADDED", node("gpu-node-2", gpus={RTX: 2, A100: 1}))
    s.event("ADDED", node("cpu-node-1"))
    # proj-a: alice's training VM (Always) and batch VM (Manual) on gpu-node-1, a web VM.
    s.event("ADDED", vm("spx-proj-a", "train-1", project="proj-a", owner=ALICE, gpu=RTX))
    s.event("ADDED", vmi("spx-proj-a", "train-1", node_name="gpu-node-1", gpu=RTX, cpu_model="host-passthrough"))
    s.event("ADDED", vm("spx-proj-a", "batch-1", project="proj-a", owner=ALICE, run_strategy="Manual", gpu=RTX))
    s.event("ADDED", vmi("spx-proj-a", "batch-1", node_name="gpu-node-1", gpu=RTX, cpu_model="host-passthrough"))
    s.event("ADDED", vm("spx-proj-a", "web-1", project="proj-a", owner=ALICE))
    s.event("ADDED", vmi("spx-proj-a", "web-1", node_name="gpu-node-1"))
    # proj-b: bob's inference VM (RerunOnFailure) on gpu-node-2; carol's dev VM, no owner recorded.
    s.event("ADDED", vm("spx-proj-b", "infer-1", project="proj-b", owner=BOB, run_strategy="RerunOnFailure", gpu=A100))
    s.event("ADDED", vmi("spx-proj-b", "infer-1", node_name="gpu-node-2", gpu=A100, cpu_model="host-passthrough"))
    s.event("ADDED", vm("spx-proj-b", "dev-1", project="proj-b", memory="32Gi"))
    s.event("ADDED", vmi("spx-proj-b", "dev-1", node_name="cpu-node-1"))
    s.event("ADDED", vm("spx-proj-b", "legacy-1", project="proj-b", owner=CAROL, run_strategy=None, running=True))
    s.event("ADDED", vmi("spx-proj-b", "legacy-1", node_name="cpu-node-1"))
    return s


def gpu_change() -> Script:
    """A GPU added to a running VM waits for a restart; the owner is told once."""
    s = cluster().wait(60)
    s.intent("it-gpu-1", "set_gpu", {"namespace": "spx-proj-b", "name": "dev-1",
                                     "gpu_class": "NVIDIA-RTX-PRO-6000-BSE"}, by=BOB, project="proj-b")
    s.wait(2)
    # The applier patched the VM; the watch bridge sees the new template (no second notice).
    s.event("MODIFIED", vm("spx-proj-b", "dev-1", project="proj-b", memory="32Gi", gpu=RTX, rv=2))
    s.wait(30)
    s.intent("it-restart-1", "restart_vm", {"namespace": "spx-proj-b", "name": "dev-1"}, by=BOB, project="proj-b")
    s.wait(20)
    s.event("DELETED", vmi("spx-proj-b", "dev-1", node_name="cpu-node-1", phase="Succeeded"))
    s.event("ADDED", vmi("spx-proj-b", "dev-1", node_name="gpu-node-2", gpu=RTX,
                         cpu_model="host-passthrough", generation=2))
    # The same set_gpu delivered again: one effect only.
    s.intent("it-gpu-1", "set_gpu", {"namespace": "spx-proj-b", "name": "dev-1",
                                     "gpu_class": "nvidia-rtx-pro-6000-bse"}, by=BOB, project="proj-b")
    # Removing the GPU again restores the CPU model, memory and eviction strategy.
    s.intent("it-gpu-2", "set_gpu", {"namespace": "spx-proj-a", "name": "train-1", "gpu_class": None},
             by=ALICE, project="proj-a")
    return s


def drain() -> Script:
    """A drain of gpu-node-1: owners told first, GPU VMs stopped at the deadline."""
    s = cluster().wait(60)
    s.intent("it-drain-1", "drain_node", {"node": "gpu-node-1", "reason": "firmware upgrade",
                                          "notice_seconds": 600}, by=OPS)
    s.wait(1)
    s.event("MODIFIED", node("gpu-node-1", gpus={RTX: 2}, unschedulable=True, rv=2))
    # The non-GPU VM live-migrates away on its own.
    s.wait(30)
    s.event("MODIFIED", vmi("spx-proj-a", "web-1", node_name="cpu-node-1"))
    # Ten minutes later: the worker's timer fires the deadline before this heartbeat.
    s.wait(600)
    s.event("MODIFIED", node("gpu-node-2", gpus={RTX: 2, A100: 1}, rv=3))
    s.wait(5)
    s.event("DELETED", vmi("spx-proj-a", "train-1", node_name="gpu-node-1", phase="Succeeded", gpu=RTX))
    s.event("ADDED", vmi("spx-proj-a", "train-1", node_name="gpu-node-2", gpu=RTX,
                         cpu_model="host-passthrough", generation=2))
    s.event("DELETED", vmi("spx-proj-a", "batch-1", node_name="gpu-node-1", phase="Succeeded", gpu=RTX))
    return s


def cordon_landed(node_name: str = "gpu-node-1") -> list[str]:
    """The watch event of the cordon a drain of the scripted AZ's node asked for, landed: a
    whole-node drain stops its GPU VMs only on a node seen cordoned (handlers/rules/drains.py)."""
    s = Script(cluster().now, f"cordon-{node_name}")
    s.event("MODIFIED", node(node_name, gpus={RTX: 2}, unschedulable=True, rv=2))
    return list(s.jsonl())


def maintenance() -> Script:
    """No intent: a NodeMaintenance created by an operator starts the same announcements."""
    s = cluster().wait(60)
    s.event("ADDED", node_maintenance("nm-gpu-node-2", "gpu-node-2", "PSU replacement"))
    return s


def bad_input() -> Script:
    """What goes wrong upstream: each is dead-lettered or rejected, and the line goes on."""
    s = cluster().wait(60)
    s.raw(INTENTS, "vm/spx-proj-a/train-1", "{not json")
    s.raw(INTENTS, "vm/spx-proj-a/train-1", json.dumps({"type": "set_gpu", "spec": {}}))
    s.raw(EVENTS, "Node/gpu-node-1", json.dumps({"event_id": "ev-x", "type": "ADDED", "kind": "Node"}))
    s.intent("it-bad-1", "set_gpu", {"namespace": "spx-proj-a", "name": "web-1", "gpu_class": "nvidia-h100"},
             by=ALICE, project="proj-a")
    s.intent("it-bad-2", "set_gpu", {"namespace": "spx-proj-a", "name": "web-1", "gpu_class": "nvidia-a100"},
             by=BOB, project="proj-b")
    s.intent("it-bad-3", "create_vm", {"namespace": "spx-proj-a", "name": "big-1", "cores": 3, "memory_gib": 128,
                                       "image": "quay.io/containerdisks/ubuntu:24.04"}, by=ALICE, project="proj-a")
    s.intent("it-bad-4", "drain_node", {"node": "gpu-node-1", "reason": "I want it"}, by=ALICE)
    s.intent("it-bad-5", "create_vm", {"namespace": "spx-proj-a", "name": "web-1", "cores": 2, "memory_gib": 4,
                                       "image": "quay.io/containerdisks/ubuntu:24.04"}, by=ALICE, project="proj-a")
    s.event("MODIFIED", vm("spx-proj-a", "batch-1", project="proj-a", owner=ALICE, run_strategy="Halted", gpu=RTX, rv=2))
    s.intent("it-bad-6", "restart_vm", {"namespace": "spx-proj-a", "name": "batch-1"}, by=ALICE, project="proj-a")
    s.intent("it-ok-1", "create_vm", {"namespace": "spx-proj-a", "name": "gpu-2", "cores": 8, "memory_gib": 64,
                                      "image": "quay.io/containerdisks/ubuntu:24.04", "gpu_class": "nvidia-a100",
                                      "run_strategy": "Always"}, by=ALICE, project="proj-a")
    return s


SCENARIOS = {
    "gpu-change": gpu_change,
    "drain": drain,
    "maintenance": maintenance,
    "bad-input": bad_input,
}


def demo_phases(notice_seconds: int = 15) -> list[tuple[str, Script]]:
    """The demo, in phases the demo waits between (the cluster's reactions are scripted).

    Until the watch bridge is in the loop, what Kubernetes would show after each command
    (the VM patched, the VMI restarted, the VMIs stopped by the drain) comes from here.
    """
    s = cluster()
    phases = [("the AZ as the watch bridge lists it", s)]
    gpu = Script(s.now, "demo-gpu")
    gpu.intent("demo-gpu-1", "set_gpu", {"namespace": "spx-proj-b", "name": "dev-1",
                                         "gpu_class": "nvidia-rtx-pro-6000-bse"}, by=BOB, project="proj-b")
    phases.append(("bob gives his running VM dev-1 a GPU", gpu))
    patched = Script(gpu.now, "demo-patched")
    patched.event("MODIFIED", vm("spx-proj-b", "dev-1", project="proj-b", memory="32Gi", gpu=RTX, rv=2))
    patched.intent("demo-restart-1", "restart_vm", {"namespace": "spx-proj-b", "name": "dev-1"},
                   by=BOB, project="proj-b")
    phases.append(("the VM is patched; bob restarts it", patched))
    restarted = Script(patched.now, "demo-restarted")
    restarted.event("DELETED", vmi("spx-proj-b", "dev-1", node_name="cpu-node-1", phase="Succeeded"))
    restarted.event("ADDED", vmi("spx-proj-b", "dev-1", node_name="gpu-node-2", gpu=RTX,
                                 cpu_model="host-passthrough", generation=2))
    phases.append(("dev-1 comes back on gpu-node-2 with its GPU", restarted))
    drain_ = Script(restarted.now, "demo-drain")
    drain_.intent("demo-drain-1", "drain_node", {"node": "gpu-node-1", "reason": "firmware upgrade",
                                                  "notice_seconds": notice_seconds}, by=OPS)
    # The cordon lands: the deadline stops the GPU VMs only on a node that takes no new ones.
    drain_.event("MODIFIED", node("gpu-node-1", gpus={RTX: 2}, unschedulable=True, rv=2))
    phases.append((f"ops drains gpu-node-1 with {notice_seconds}s notice", drain_))
    stopped = Script(drain_.now, "demo-stopped")
    stopped.event("DELETED", vmi("spx-proj-a", "train-1", node_name="gpu-node-1", phase="Succeeded", gpu=RTX))
    stopped.event("DELETED", vmi("spx-proj-a", "batch-1", node_name="gpu-node-1", phase="Succeeded", gpu=RTX))
    stopped.event("ADDED", vmi("spx-proj-a", "train-1", node_name="gpu-node-2", gpu=RTX,
                               cpu_model="host-passthrough", generation=2))
    phases.append(("the deadline passed: the GPU VMIs stop; train-1 (Always) restarts elsewhere", stopped))
    return phases
