"""Writes the example scenarios (``examples/*.jsonl``) and their configuration.

Run ``python examples/build.py`` after changing a scenario; a test checks the committed
files are what this script writes. Each scenario starts from the same small AZ:

- ``gpu-node-1``: 2 × RTX PRO 6000, ``gpu-node-2``: 2 × RTX PRO 6000 + 1 × A100,
  ``cpu-node-1``: no GPU;
- VMs of three owners in projects ``proj-a`` and ``proj-b``, with and without GPUs.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from streams.scenarios import A100, EVENTS, EXAMPLE_CONFIG, INTENTS, RTX, Script, kubevirt_cr, node, vm, vmi  # noqa: E402

HERE = Path(__file__).resolve().parent
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


def maintenance() -> Script:
    """No intent: a NodeMaintenance created by an operator starts the same announcements."""
    from streams.scenarios import node_maintenance

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


def render_config() -> str:
    return "# The example AZ: two GPU classes, one operator.\n" + yaml.safe_dump(EXAMPLE_CONFIG, sort_keys=False)


def main() -> None:
    (HERE / "config.yaml").write_text(render_config())
    for name, build in SCENARIOS.items():
        (HERE / f"{name}.jsonl").write_text("\n".join(build().jsonl()) + "\n")


if __name__ == "__main__":
    main()
