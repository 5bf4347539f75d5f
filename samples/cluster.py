"""The sample AZ: its configuration and its cluster objects as the API server serves them.

The harness (the demo, its scenarios, the shipped examples, the benchmarks) and the tests
all draw their Kubernetes objects from here, so they describe one and the same small AZ:
GPU nodes with RTX PRO 6000 and A100 cards, a CPU-only node, VMs of several owners and run
strategies. It is its own package, beside both, because the rule tests are a specification
of the product and import neither the harness nor anything that starts a process, and the
harness never imports the tests; what both build their inputs with lives where either may
import it. Pure data, standard library only.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

RTX = "nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION"
A100 = "nvidia.com/GA100_A100_PCIE_40GB"
PROJECT_LABEL = "superphenix.net/projectID"

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
