"""What the applier's policy costs per ``patch_vm``: ``handlers.policy.patch_refusal`` on a VM
as the API server serves it, beside one whole copy of that VM (the anchor: what any check
that copies the VM pays at least), and beside another tree's policy (``--baseline``).

Why this exists: the applier judges every patch on the live VM (docs/security.md), once per
command, on the CPU it shares with the API server; a policy that copied the VM three times
whole was a tenth to a half of the applier's CPU per command (benchmarks/README.md, the
applier). CPU time of this process, best of ``--repeat`` runs of ``--calls`` calls.

    .venv/bin/python benchmarks/policy_cost.py
    mkdir -p /tmp/before && git archive HEAD~1 | tar -x -C /tmp/before
    .venv/bin/python benchmarks/policy_cost.py --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)

from handlers import policy  # noqa: E402
from handlers.gpus import desired_vm, plan_patch  # noqa: E402
from handlers.messages import GPUMutation  # noqa: E402
from samples.cluster import A100, vm  # noqa: E402

HERE = Path(__file__).resolve()


def live_vm() -> dict[str, Any]:
    """A VM as a GET returns it: the harness's VM with the API server's managedFields (two
    managers) and a running VM's status."""
    live = vm("spx-proj-a", "vm-1", project="proj-a", owner="alice@example.com")
    live["metadata"]["managedFields"] = [
        {"manager": manager, "operation": "Update", "apiVersion": "kubevirt.io/v1", "fieldsType": "FieldsV1",
         "fieldsV1": {"f:spec": {f"f:field-{i}": {} for i in range(60)}}}
        for manager in ("kubectl", "virt-controller")]
    live["status"] = {
        "printableStatus": "Running",
        "conditions": [{"type": kind, "status": "True", "lastProbeTime": None}
                       for kind in ("Ready", "LiveMigratable", "AgentConnected")],
        "volumeSnapshotStatuses": [{"name": f"disk-{i}", "enabled": False} for i in range(4)],
    }
    return live


def cpu_microseconds(call: Callable[[], object], calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - started) / calls)
    return best * 1e6


def measure(calls: int, repeat: int) -> dict[str, float]:
    live = live_vm()
    patch = plan_patch(live, desired_vm(live, GPUMutation(device_name=A100, eviction_strategy="External")))
    assert policy.patch_refusal(live, patch) is None
    return {
        "vm_bytes": len(json.dumps(live)),
        "whole_copy_us": cpu_microseconds(lambda: copy.deepcopy(live), calls, repeat),
        "patch_refusal_us": cpu_microseconds(lambda: policy.patch_refusal(live, patch), calls, repeat),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", type=Path, metavar="DIR", help="also measure the policy of DIR (another tree)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # print the figures as JSON
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.calls, args.repeat)))
        return 0
    kit.print_load("start")
    trees = [("now", HERE.parent.parent)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    rows = []
    for name, tree in trees * 2:  # each tree twice, taking turns
        script = tree / "benchmarks" / HERE.name
        if tree != HERE.parent.parent:
            script.write_bytes(HERE.read_bytes())
        out = subprocess.run([sys.executable, str(script), "--child", "--calls", str(args.calls),
                              "--repeat", str(args.repeat)], check=True, capture_output=True, text=True).stdout
        figures = json.loads(out)
        rows.append([name, f"{figures['vm_bytes']:,} B", f"{figures['whole_copy_us']:,.0f} µs",
                     f"{figures['patch_refusal_us']:,.0f} µs", kit.load_average()])
    print(kit.table(["tree", "VM as JSON", "anchor: one whole copy", "patch_refusal", "load"], rows))
    kit.print_load("end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
