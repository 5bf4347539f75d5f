"""New VMs: the manifest a ``create_vm`` intent asks for, within Superphenix's limits.

The limits themselves (cores, memory, run strategy, preference, name) are enforced by the
intent's model (:class:`~handlers.contracts.messages.CreateVMSpec`); this module turns a valid spec
into a ``kubevirt.io/v1`` VirtualMachine, GPU included through the same rules as
``set_gpu``.
"""

from __future__ import annotations

from typing import Any

from handlers.contracts.messages import CreateVMIntent, GPUMutation
from handlers.core.cluster import OWNER_ANNOTATION
from handlers.rules.gpus import desired_vm

TERMINATION_GRACE_SECONDS = 180
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"


def vm_manifest(
    intent: CreateVMIntent,
    *,
    project_label: str,
    gpu: GPUMutation | None,
) -> dict[str, Any]:
    """The VirtualMachine for ``intent``; ``Manual`` (the default) creates it stopped."""
    spec = intent.spec
    labels = {**spec.labels, project_label: intent.project, MANAGED_BY_LABEL: "vmstream"}
    vm: dict[str, Any] = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": labels,
            # Nothing else records who created a VM, and notifications need a recipient.
            "annotations": {OWNER_ANNOTATION: intent.requested_by},
        },
        "spec": {
            "runStrategy": spec.run_strategy,
            "preference": {"kind": "VirtualMachineClusterPreference", "name": spec.preference},
            "template": {
                "metadata": {"labels": {"kubevirt.io/vm": spec.name, project_label: intent.project}},
                "spec": {
                    "domain": {
                        "cpu": {"sockets": 1, "cores": spec.cores, "threads": 1},
                        "memory": {"guest": f"{spec.memory_gib}Gi"},
                        "devices": {
                            "disks": [{"name": "containerdisk", "disk": {"bus": "virtio"}}],
                        },
                    },
                    "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
                    "volumes": [{"name": "containerdisk", "containerDisk": {"image": spec.image}}],
                },
            },
        },
    }
    return desired_vm(vm, gpu) if gpu is not None else vm
