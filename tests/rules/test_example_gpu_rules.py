"""The shipped examples of the GPU rules on any VM and of what KubeVirt would refuse
(examples/build.py: gpu-rules, refused-up-front) show the right outputs under ``simulate``."""

from __future__ import annotations

import json

import jsonpatch

from samples.cluster import RTX
from tests.support.kubevirt_schema import validate_vm
from tests.rules.test_example_cases import EXAMPLES, commands, notifications, outputs


def test_gpu_rules_example_patches_a_kubectl_vm_once_per_content() -> None:
    # Made without the rules: patched; its status update and the patched VM: nothing; the
    # GitOps revert: patched again.
    assert commands("gpu-rules") == [("patch_vm", "gitops-1"), ("patch_vm", "gitops-1")]
    told = notifications("gpu-rules", "gpu_rules_applied")
    assert [n["recipients"] for n in told] == [["alice@example.com"]] * 2
    assert all(len(n["details"]["gaps"]) == 3 and n["details"]["field_manager"] == "vmstream" for n in told)
    [first, _] = [v for t, v in outputs("gpu-rules") if t == "vmstream.commands"]
    assert first["mutation"] == {"device_name": RTX, "eviction_strategy": "External", "enforce": True}


def test_gpu_rules_example_leaves_a_valid_vm() -> None:
    lines = (EXAMPLES / "gpu-rules.jsonl").read_text().splitlines()
    made = next(json.loads(line)["value"]["object"] for line in lines
                if '"gitops-1"' in line and '"ADDED"' in line)
    [first, _] = [v for t, v in outputs("gpu-rules") if t == "vmstream.commands"]
    validate_vm(jsonpatch.apply_patch(made, first["patch"]))


def test_refused_up_front_example() -> None:
    rejected = notifications("refused-up-front", "intent_rejected")
    assert [n["details"]["intent_id"] for n in rejected] == ["it-a100-1", "it-a100-2"]
    assert all("permittedHostDevices" in n["details"]["reason"] for n in rejected)
    assert commands("refused-up-front") == [("patch_vm", "it-1")]
    [warned] = notifications("refused-up-front", "gpu_memory_not_pinned")
    assert warned["recipients"] == ["alice@example.com"] and warned["details"]["memory_overcommit"] == 200
    [audit] = [v for t, v in outputs("refused-up-front")
               if t == "vmstream.audit" and v["input"]["ref"] == "it-rtx-it-1"]
    assert audit["outcome"] == "accepted" and "memory not pinned" in audit["reason"]
