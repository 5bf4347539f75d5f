"""Realistic inputs: cluster objects as the API server serves them, and scenarios of them.

The shipped examples, the demo, the benchmarks and the tests all draw their Kubernetes
objects from here, so they describe one and the same small AZ: GPU nodes with RTX PRO 6000
and A100 cards, a CPU-only node, VMs of several owners and run strategies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from handlers import topics
from streams.common.settings import KafkaSettings

RTX = "nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION"
A100 = "nvidia.com/GA100_A100_PCIE_40GB"
PROJECT_LABEL = "superphenix.net/projectID"
# Scenario files name the topics by their default full names.
INTENTS = KafkaSettings().topic(topics.INTENTS)
EVENTS = KafkaSettings().topic(topics.K8S_EVENTS)

EXAMPLE_CONFIG = {
    "az": "az1",
    "gpu_classes": {
        "nvidia-rtx-pro-6000-bse": {
            "display_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            "device_name": RTX,
        },
        "nvidia-a100": {"device_name": A100},
    },
    "operators": ["ops@example.com"],
    "drain": {"notice_seconds": 900},
    "gpu_vm": {"eviction_strategy": "External", "enforce": "patch", "instancetype_overcommit": "warn"},
    "labels": {"project": PROJECT_LABEL},
    # Superphenix's convention: project proj-a's VMs live in namespace spx-proj-a.
    "namespaces": {"template": "spx-{project}"},
    # The shipped examples are unsigned, for `vmstream simulate` offline (docs/auth.md):
    # deploy/ verifies credentials, and the demo and the tests sign theirs.
    "auth": {"mode": "none"},
}


def iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def node(name: str, *, gpus: dict[str, int] | None = None, unschedulable: bool = False,
         ready: bool = True, rv: int = 1) -> dict[str, Any]:
    allocatable = {"cpu": "64", "memory": "512Gi", "pods": "110", "devices.kubevirt.io/kvm": "1k"}
    allocatable.update({device: str(count) for device, count in (gpus or {}).items()})
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-node-{name}", "resourceVersion": str(rv),
                     "labels": {"kubernetes.io/hostname": name}},
        "spec": {},
        "status": {
            "allocatable": allocatable,
            "capacity": dict(allocatable),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"}],
        },
    }
    if unschedulable:
        obj["spec"] = {
            "unschedulable": True,
            "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
        }
    return obj


def vm(namespace: str, name: str, *, project: str, owner: str | None = None,
       run_strategy: str | None = "Always", running: bool | None = None, gpu: str | None = None,
       memory: str = "16Gi", cores: int = 4, rv: int = 1,
       printable_status: str | None = None, gpu_rules: bool = True) -> dict[str, Any]:
    """A Superphenix-style VM; ``gpu`` adds a device by hand (as if set before vmstream), with
    what the GPU rules add (``host-passthrough``, memory request = guest memory, eviction
    strategy External) — or, ``gpu_rules=False``, the device alone, as kubectl would create it."""
    domain: dict[str, Any] = {
        "cpu": {"sockets": 1, "cores": cores, "threads": 1},
        "memory": {"guest": memory},
        "devices": {"disks": [{"name": "containerdisk", "disk": {"bus": "virtio"}}]},
    }
    if gpu:
        domain["devices"]["gpus"] = [{"name": "gpu-0", "deviceName": gpu}]
        if gpu_rules:
            domain["cpu"]["model"] = "host-passthrough"
            domain["resources"] = {"requests": {"memory": memory}}
    spec: dict[str, Any] = {
        "preference": {"kind": "VirtualMachineClusterPreference", "name": "linux"},
        "template": {
            "metadata": {"labels": {"kubevirt.io/vm": name}},
            "spec": {
                "domain": domain,
                "terminationGracePeriodSeconds": 180,
                "volumes": [{"name": "containerdisk",
                             "containerDisk": {"image": "quay.io/containerdisks/ubuntu:24.04"}}],
            },
        },
    }
    if gpu and gpu_rules:
        spec["template"]["spec"]["evictionStrategy"] = "External"
    if running is not None:
        spec["running"] = running
    elif run_strategy is not None:
        spec["runStrategy"] = run_strategy
    metadata: dict[str, Any] = {
        "name": name, "namespace": namespace, "uid": f"uid-vm-{namespace}-{name}",
        "resourceVersion": str(rv), "generation": 1, "labels": {PROJECT_LABEL: project},
    }
    if owner:
        metadata["annotations"] = {"vmstream.io/owner": owner}
    obj: dict[str, Any] = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                           "metadata": metadata, "spec": spec}
    if printable_status:
        obj["status"] = {"printableStatus": printable_status}
    return obj


def vmi(namespace: str, name: str, *, node_name: str | None, phase: str = "Running",
        gpu: str | None = None, cpu_model: str | None = None, generation: int = 1,
        unschedulable: bool = False, eviction_requested: bool = False) -> dict[str, Any]:
    domain: dict[str, Any] = {"cpu": {"model": cpu_model or "Haswell-noTSX", "cores": 4},
                              "devices": {}, "memory": {"guest": "16Gi"}}
    if gpu:
        domain["devices"]["gpus"] = [{"name": "gpu-0", "deviceName": gpu}]
    conditions: list[dict[str, Any]] = []
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": "0/3 nodes are available: Insufficient GPU"})
    if eviction_requested:
        conditions.append({"type": "EvictionRequested", "status": "True"})
    status: dict[str, Any] = {"phase": phase, "conditions": conditions}
    if node_name:
        status["nodeName"] = node_name
    if eviction_requested and node_name:
        status["evacuationNodeName"] = node_name
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": namespace,
                     "uid": f"uid-vmi-{namespace}-{name}-{generation}", "resourceVersion": "1"},
        "spec": {"domain": domain},
        "status": status,
    }


def with_devices(obj: dict[str, Any], *, gpus: list[str] | None = None,
                 host_devices: list[str] | None = None) -> dict[str, Any]:
    """A VM (its template) or a VMI with these ``gpus`` and ``hostDevices`` (device names), one
    entry per card as KubeVirt takes them; the lists replace what it had."""
    domain = obj["spec"]["template"]["spec"]["domain"] if obj["kind"] == "VirtualMachine" else obj["spec"]["domain"]
    devices = domain.setdefault("devices", {})
    for field, names, prefix in (("gpus", gpus, "gpu"), ("hostDevices", host_devices, "hostdev")):
        if names is None:
            continue
        if names:
            devices[field] = [{"name": f"{prefix}-{i}", "deviceName": name} for i, name in enumerate(names)]
        else:
            devices.pop(field, None)
    return obj


def with_instancetype(vm_obj: dict[str, Any], name: str, *, revision: str | None = None,
                      kind: str = "VirtualMachineClusterInstancetype") -> dict[str, Any]:
    """A VM that takes its CPU and memory (and GPUs) from an instance type, as KubeVirt
    admits it: no cpu topology nor memory of its own; ``revision``, the ControllerRevision
    virt-controller stored for it (``status.instancetypeRef``)."""
    spec = vm_obj["spec"]
    spec["instancetype"] = {"kind": kind, "name": name}
    domain = spec["template"]["spec"]["domain"]
    for key in ("sockets", "cores", "threads"):
        domain.get("cpu", {}).pop(key, None)
    domain.pop("memory", None)
    (domain.get("resources") or {}).get("requests", {}).pop("memory", None)
    if revision:
        vm_obj.setdefault("status", {})["instancetypeRef"] = {
            "kind": kind, "name": name, "controllerRevisionRef": {"name": revision}}
    return vm_obj


def instancetype_revision(namespace: str, vm_name: str, name: str, *, instancetype: str,
                          gpus: list[str] | None = None, host_devices: list[str] | None = None,
                          cpu_model: str | None = None, kind: str = "VirtualMachineClusterInstancetype",
                          guest_cpus: int = 4, memory: str = "16Gi") -> dict[str, Any]:
    """The ControllerRevision virt-controller stores for a VM's instance type
    (``CreateControllerRevision``, pkg/instancetype/revision/store.go): the instance type
    itself under ``data``, labelled with its kind and name, owned by the VM."""
    spec: dict[str, Any] = {"cpu": {"guest": guest_cpus}, "memory": {"guest": memory}}
    if cpu_model:
        spec["cpu"]["model"] = cpu_model
    if gpus:
        spec["gpus"] = [{"name": f"gpu-{i}", "deviceName": d} for i, d in enumerate(gpus)]
    if host_devices:
        spec["hostDevices"] = [{"name": f"hostdev-{i}", "deviceName": d} for i, d in enumerate(host_devices)]
    return {
        "apiVersion": "apps/v1",
        "kind": "ControllerRevision",
        "metadata": {
            "name": name, "namespace": namespace, "uid": f"uid-cr-{namespace}-{name}", "resourceVersion": "1",
            "labels": {"instancetype.kubevirt.io/object-kind": kind,
                       "instancetype.kubevirt.io/object-name": instancetype,
                       "instancetype.kubevirt.io/object-generation": "1",
                       "instancetype.kubevirt.io/object-version": "v1beta1"},
            "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": vm_name,
                                 "uid": f"uid-vm-{namespace}-{vm_name}", "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "data": {"apiVersion": "instancetype.kubevirt.io/v1beta1", "kind": kind,
                 "metadata": {"name": instancetype, "generation": 1}, "spec": spec},
        "revision": 0,
    }


def kubevirt_cr() -> dict[str, Any]:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {"configuration": {
            "cpuModel": "Haswell-noTSX",
            "evictionStrategy": "LiveMigrate",
            "developerConfiguration": {"featureGates": ["GPU"]},
            "permittedHostDevices": {"pciHostDevices": [
                {"pciVendorSelector": "10DE:2BB5", "resourceName": RTX, "externalResourceProvider": True},
                {"pciVendorSelector": "10DE:20F1", "resourceName": A100, "externalResourceProvider": True},
            ]},
        }},
    }


def node_maintenance(name: str, node_name: str, reason: str) -> dict[str, Any]:
    return {"apiVersion": "nodemaintenance.medik8s.io/v1beta1", "kind": "NodeMaintenance",
            "metadata": {"name": name}, "spec": {"nodeName": node_name, "reason": reason}}


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
    whole-node drain stops its GPU VMs only on a node seen cordoned (handlers/drains.py)."""
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
