"""Realistic inputs: cluster objects as the API server serves them, and scenarios of them.

The shipped examples, the demo, the benchmarks and the tests all draw their Kubernetes
objects from here, so they describe one and the same small AZ: GPU nodes with RTX PRO 6000
and A100 cards, a CPU-only node, VMs of several owners and run strategies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

RTX = "nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION"
A100 = "nvidia.com/GA100_A100_PCIE_40GB"
PROJECT_LABEL = "superphenix.net/projectID"
INTENTS = "vmstream.intents"
EVENTS = "vmstream.k8s-events"

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
    "gpu_vm": {"eviction_strategy": "External"},
    "labels": {"project": PROJECT_LABEL},
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
       printable_status: str | None = None) -> dict[str, Any]:
    """A Superphenix-style VM; ``gpu`` adds a device by hand (as if set before vmstream)."""
    domain: dict[str, Any] = {
        "cpu": {"sockets": 1, "cores": cores, "threads": 1},
        "memory": {"guest": memory},
        "devices": {"disks": [{"name": "containerdisk", "disk": {"bus": "virtio"}}]},
    }
    if gpu:
        domain["devices"]["gpus"] = [{"name": "gpu-0", "deviceName": gpu}]
        domain["cpu"]["model"] = "host-passthrough"
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
            "value": {"event_id": f"ev-{self._events:06d}", "type": type_, "kind": obj["kind"],
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
