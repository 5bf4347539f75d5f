"""Writes the example scenarios (``examples/*.jsonl``) and their configuration.

Run ``python examples/build.py`` after changing a scenario in ``harness/scenarios.py``, the
sample AZ in ``samples/cluster.py`` or here; a test checks the committed files are what this
script writes. The scenarios below show, each on the same small AZ, one case of what KubeVirt
does and what vmstream makes of it (docs/kubevirt.md): run strategies after a drain, an
eviction that is not a drain, a drain called off, and a GPU change across KubeVirt's
``RestartRequired``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from handlers.contracts.messages import GPUMutation  # noqa: E402
from handlers.rules.gpus import desired_vm  # noqa: E402
from harness.scenarios import ALICE, BOB, OPS, SCENARIOS, Script, cluster  # noqa: E402
from samples.cluster import EXAMPLE_CONFIG, RTX, kubevirt_cr, node, node_maintenance, vm, vmi  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_strategies() -> Script:
    """A drain of gpu-node-3, whose five GPU VMs run under five run strategies.

    KubeVirt starts a new VMI for Always, Once and legacy ``running: true`` once the drain
    deletes theirs; RerunOnFailure and Manual stay off. The three that come back compete for
    the 2 RTX cards free elsewhere, so none is promised one: each owner is told the numbers.
    drain_completed tells what was then observed: two back on gpu-node-2, one waiting, two off.
    """
    s = cluster()
    s.event("ADDED", node("gpu-node-3", gpus={RTX: 8}))
    strategies: list[tuple[str, dict[str, Any]]] = [
        ("run-always", {"run_strategy": "Always"}),
        ("run-once", {"run_strategy": "Once"}),
        ("run-legacy", {"run_strategy": None, "running": True}),
        ("run-rerun", {"run_strategy": "RerunOnFailure"}),
        ("run-manual", {"run_strategy": "Manual"}),
    ]
    for name, spec in strategies:
        s.event("ADDED", vm("spx-proj-c", name, project="proj-c", owner=BOB, gpu=RTX, **spec))
        s.event("ADDED", vmi("spx-proj-c", name, node_name="gpu-node-3", gpu=RTX, cpu_model="host-passthrough"))
    s.wait(60)
    s.intent("it-drain-3", "drain_node", {"node": "gpu-node-3", "reason": "BIOS update", "notice_seconds": 300},
             by=OPS)
    s.wait(1)
    s.event("MODIFIED", node("gpu-node-3", gpus={RTX: 8}, unschedulable=True, rv=2))
    s.wait(300)  # the deadline: the worker's timer deletes the five VMIs before this event
    for name, _ in strategies:
        s.event("DELETED", vmi("spx-proj-c", name, node_name="gpu-node-3", phase="Succeeded", gpu=RTX))
    # KubeVirt starts new VMIs for Always, Once and running: true; two find a card.
    s.wait(5)
    s.event("ADDED", vmi("spx-proj-c", "run-always", node_name="gpu-node-2", gpu=RTX,
                         cpu_model="host-passthrough", generation=2))
    s.event("ADDED", vmi("spx-proj-c", "run-once", node_name="gpu-node-2", gpu=RTX,
                         cpu_model="host-passthrough", generation=2))
    s.event("ADDED", vmi("spx-proj-c", "run-legacy", node_name=None, phase="Scheduling", gpu=RTX,
                         cpu_model="host-passthrough", generation=2, unschedulable=True))
    return s


def eviction() -> Script:
    """A cordon alone stops nothing; an eviction (evictionStrategy External) stops its one VM.

    gpu-node-2 is cordoned by hand: nothing happens. Then KubeVirt's eviction webhook marks
    train-1 on gpu-node-1 (``evacuationNodeName``): alice is told train-1 will be stopped at
    the deadline; the node is not cordoned and batch-1 beside it is left alone. At the
    deadline train-1's VMI is deleted; it starts again on gpu-node-2 (runStrategy Always).
    """
    s = cluster().wait(60)
    s.event("MODIFIED", node("gpu-node-2", gpus={RTX: 2, "nvidia.com/GA100_A100_PCIE_40GB": 1},
                             unschedulable=True, rv=2))
    s.wait(60)
    s.event("MODIFIED", node("gpu-node-2", gpus={RTX: 2, "nvidia.com/GA100_A100_PCIE_40GB": 1}, rv=3))
    s.wait(10)
    s.event("MODIFIED", vmi("spx-proj-a", "train-1", node_name="gpu-node-1", gpu=RTX, cpu_model="host-passthrough",
                            eviction_requested=True))
    s.wait(900)  # the deadline: the timer deletes train-1's VMI, and only it
    s.event("DELETED", vmi("spx-proj-a", "train-1", node_name="gpu-node-1", phase="Succeeded", gpu=RTX))
    s.event("ADDED", vmi("spx-proj-a", "train-1", node_name="gpu-node-2", gpu=RTX,
                         cpu_model="host-passthrough", generation=2))
    return s


def called_off() -> Script:
    """Three drains called off before their deadline; no VM is stopped by any of them.

    1. ops drains gpu-node-1, then undrains it: alice hears that it is off for both her VMs,
       vmstream uncordons the node it cordoned, ops gets the tally.
    2. a NodeMaintenance for gpu-node-2 is created, then deleted: the same, for bob's VM.
    3. ops drains gpu-node-1 again; someone uncordons the node by hand: the drain is off,
       and vmstream has nothing to undo.
    """
    s = cluster().wait(60)
    s.intent("it-drain-off-1", "drain_node", {"node": "gpu-node-1", "reason": "firmware upgrade",
                                              "notice_seconds": 600}, by=OPS)
    s.wait(1)
    s.event("MODIFIED", node("gpu-node-1", gpus={RTX: 2}, unschedulable=True, rv=2))
    s.wait(120)
    s.intent("it-undrain-1", "undrain_node", {"node": "gpu-node-1", "reason": "vendor postponed"}, by=OPS)
    s.wait(1)
    s.event("MODIFIED", node("gpu-node-1", gpus={RTX: 2}, rv=3))
    s.wait(60)
    s.event("ADDED", node_maintenance("nm-gpu-node-2", "gpu-node-2", "PSU replacement"))
    s.wait(60)
    s.event("DELETED", node_maintenance("nm-gpu-node-2", "gpu-node-2", "PSU replacement"))
    s.wait(60)
    s.intent("it-drain-off-2", "drain_node", {"node": "gpu-node-1", "reason": "kernel", "notice_seconds": 600},
             by=OPS)
    s.wait(1)
    s.event("MODIFIED", node("gpu-node-1", gpus={RTX: 2}, unschedulable=True, rv=4))
    s.wait(30)
    s.event("MODIFIED", node("gpu-node-1", gpus={RTX: 2}, rv=5))
    s.wait(900)
    s.event("MODIFIED", node("cpu-node-1", rv=2))  # later than every deadline: nothing fires
    return s


def restart_required() -> Script:
    """A GPU change is told once, across KubeVirt's RestartRequired; other changes are not.

    bob gives dev-1 a GPU: told it applies after a restart. KubeVirt sets RestartRequired;
    bob restarts; the new VMI with the GPU shows up before KubeVirt clears the condition —
    no second notice. Then carol's legacy-1 gets more cores: RestartRequired, no GPU notice.
    """
    s = cluster().wait(60)
    s.intent("it-gpu-rr-1", "set_gpu", {"namespace": "spx-proj-b", "name": "dev-1",
                                        "gpu_class": "nvidia-rtx-pro-6000-bse"}, by=BOB, project="proj-b")
    s.wait(2)
    s.event("MODIFIED", _restart_required(vm("spx-proj-b", "dev-1", project="proj-b", memory="32Gi", gpu=RTX, rv=2)))
    s.wait(30)
    s.intent("it-restart-rr-1", "restart_vm", {"namespace": "spx-proj-b", "name": "dev-1"}, by=BOB, project="proj-b")
    s.wait(20)
    s.event("DELETED", vmi("spx-proj-b", "dev-1", node_name="cpu-node-1", phase="Succeeded"))
    s.event("ADDED", vmi("spx-proj-b", "dev-1", node_name="gpu-node-2", gpu=RTX,
                         cpu_model="host-passthrough", generation=2))
    s.event("MODIFIED", _restart_required(vm("spx-proj-b", "dev-1", project="proj-b", memory="32Gi", gpu=RTX, rv=3)))
    s.event("MODIFIED", vm("spx-proj-b", "dev-1", project="proj-b", memory="32Gi", gpu=RTX, rv=4))
    s.wait(60)
    s.event("MODIFIED", _restart_required(vm("spx-proj-b", "legacy-1", project="proj-b", owner=ALICE,
                                             run_strategy=None, running=True, cores=8, rv=2)))
    return s


def _restart_required(obj: dict[str, Any]) -> dict[str, Any]:
    obj["status"] = {"conditions": [{"type": "RestartRequired", "status": "True",
                                     "message": "a non-live-updatable field was changed in the template spec"}]}
    return obj


def gpu_rules() -> Script:
    """A GPU VM made with kubectl (or synced by a GitOps tool) gets the GPU rules.

    gitops-1 arrives with an RTX card alone: no host-passthrough, no memory request, no
    eviction strategy. vmstream patches it as a set_gpu would, under its field manager
    ``vmstream``, and tells alice. KubeVirt's status update of the same VM plans nothing (the
    patch is in flight); the VM as patched plans nothing. Then the GitOps tool syncs its
    manifest back (it was not told to ignore those fields, docs/gitops.md): the VM is patched
    again, and alice told again.
    """
    s = cluster().wait(60)
    made = vm("spx-proj-a", "gitops-1", project="proj-a", owner=ALICE, run_strategy="Manual", gpu=RTX,
              gpu_rules=False)
    s.event("ADDED", made)
    s.wait(2)
    status = copy.deepcopy(made)
    status["metadata"]["resourceVersion"] = "2"
    status["status"] = {"printableStatus": "Stopped"}
    s.event("MODIFIED", status)
    s.wait(1)
    patched = desired_vm(status, GPUMutation(device_name=RTX, eviction_strategy="External", enforce=True))
    patched["metadata"].update(resourceVersion="3", generation=2)
    s.event("MODIFIED", patched)
    s.wait(180)
    synced = copy.deepcopy(made)
    synced["metadata"].update(resourceVersion="4", generation=3)
    s.event("MODIFIED", synced)
    return s


def refused_up_front() -> Script:
    """What KubeVirt would refuse is refused before anything is written.

    The operator narrows the KubeVirt CR's permittedHostDevices to the RTX card and sets
    memoryOvercommit: 200. bob's set_gpu and create_vm for the A100 class are refused with
    that reason (KubeVirt would accept the VM and never start it). alice's it-1 takes its
    memory from an instance type: her RTX is accepted, and she and the audit are told its
    memory is not pinned (gpu_vm.instancetype_overcommit: warn).
    """
    s = cluster().wait(60)
    narrowed = kubevirt_cr()
    narrowed["spec"]["configuration"]["permittedHostDevices"] = {"pciHostDevices": [
        {"pciVendorSelector": "10DE:2BB5", "resourceName": RTX, "externalResourceProvider": True}]}
    narrowed["spec"]["configuration"]["developerConfiguration"]["memoryOvercommit"] = 200
    s.event("MODIFIED", narrowed)
    s.wait(10)
    s.intent("it-a100-1", "set_gpu", {"namespace": "spx-proj-b", "name": "dev-1", "gpu_class": "nvidia-a100"},
             by=BOB, project="proj-b")
    s.wait(1)
    s.intent("it-a100-2", "create_vm", {"namespace": "spx-proj-b", "name": "dev-2", "cores": 4, "memory_gib": 16,
                                        "image": "quay.io/containerdisks/ubuntu:24.04", "gpu_class": "nvidia-a100"},
             by=BOB, project="proj-b")
    s.wait(10)
    typed = vm("spx-proj-a", "it-1", project="proj-a", owner=ALICE, run_strategy="Manual")
    domain = typed["spec"]["template"]["spec"]["domain"]
    del domain["memory"], domain["cpu"]
    typed["spec"]["instancetype"] = {"kind": "VirtualMachineClusterInstancetype", "name": "u1.xlarge"}
    s.event("ADDED", typed)
    s.wait(5)
    s.intent("it-rtx-it-1", "set_gpu", {"namespace": "spx-proj-a", "name": "it-1",
                                         "gpu_class": "nvidia-rtx-pro-6000-bse"}, by=ALICE, project="proj-a")
    return s


CASES: dict[str, Callable[[], Script]] = {
    "run-strategies": run_strategies,
    "eviction": eviction,
    "called-off": called_off,
    "restart-required": restart_required,
    "gpu-rules": gpu_rules,
    "refused-up-front": refused_up_front,
}


# Not part of the rules' configuration (EXAMPLE_CONFIG is a handlers.contracts.config.Config), but
# every process that seals needs it: the example key beside the file (keys/README.md).
EXAMPLE_SIGNING = {"signing": {"keys_file": "keys/signing-keys.yaml"}}


def render_config() -> str:
    return ("# The example AZ: two GPU classes, one operator.\n"
            "# auth: none takes intents at their word: for `vmstream simulate` over the shipped,\n"
            "# unsigned scenarios and local development only. deploy/ verifies credentials, and\n"
            "# `make demo` runs the worker with auth: jwt and signs its intents (docs/auth.md).\n"
            + yaml.safe_dump(EXAMPLE_CONFIG, sort_keys=False)
            + "# The key that seals commands (worker) and their results (applier): an EXAMPLE key,\n"
            "# published with the source, so it protects nothing (keys/README.md); a path relative\n"
            "# to this file. deploy/ mounts the Secret vmstream-signing instead (docs/security.md).\n"
            + yaml.safe_dump(EXAMPLE_SIGNING, sort_keys=False))


def main() -> None:
    (HERE / "config.yaml").write_text(render_config())
    for name, build in {**SCENARIOS, **CASES}.items():
        (HERE / f"{name}.jsonl").write_text("\n".join(build().jsonl()) + "\n")


if __name__ == "__main__":
    main()
