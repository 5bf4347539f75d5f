"""Intent rules: create_vm limits and manifest, set_gpu through the engine, restarts,
authorization, rejections and idempotency."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from samples.cluster import A100, RTX, node, vm, vmi
from tests.support.harness import Harness
from tests.support.kubevirt_schema import validate_vm

ALICE = "alice@example.com"


def cluster() -> Harness:
    h = Harness()
    h.observe_all(
        node("gpu-node-1", gpus={RTX: 2}),
        vm("spx-proj-a", "web-1", project="proj-a", owner=ALICE),
        vmi("spx-proj-a", "web-1", node_name="gpu-node-1"),
        vm("spx-proj-a", "off-1", project="proj-a", owner=ALICE, run_strategy="Manual"),
    )
    return h


def create_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"namespace": "spx-proj-a", "name": "new-1", "cores": 4, "memory_gib": 8,
                            "image": "quay.io/containerdisks/ubuntu:24.04"}
    spec.update(overrides)
    return spec


# -------------------------------------------------------------------- create_vm


def test_create_vm_builds_a_valid_manifest_with_owner_and_project() -> None:
    h = cluster()
    result = h.intent("create_vm", create_spec())
    [command] = result.decision.commands
    manifest = command.manifest
    assert command.type == "create_vm" and manifest is not None
    validate_vm(manifest)
    assert manifest["metadata"]["annotations"]["vmstream.io/owner"] == ALICE
    assert manifest["metadata"]["labels"]["superphenix.net/projectID"] == "proj-a"
    domain = manifest["spec"]["template"]["spec"]["domain"]
    assert domain["cpu"] == {"sockets": 1, "cores": 4, "threads": 1}
    assert domain["memory"] == {"guest": "8Gi"}
    assert manifest["spec"]["preference"]["name"] == "linux"
    assert manifest["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 180


def test_manual_is_the_default_and_creates_the_vm_stopped() -> None:
    manifest = cluster().intent("create_vm", create_spec()).decision.commands[0].manifest
    assert manifest is not None and manifest["spec"]["runStrategy"] == "Manual"


def test_create_vm_with_a_gpu_class_applies_every_gpu_rule() -> None:
    manifest = cluster().intent("create_vm", create_spec(gpu_class="NVIDIA-A100")).decision.commands[0].manifest
    assert manifest is not None
    validate_vm(manifest)
    domain = manifest["spec"]["template"]["spec"]["domain"]
    assert domain["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": A100}]
    assert domain["cpu"]["model"] == "host-passthrough"
    assert domain["resources"]["requests"]["memory"] == "8Gi"
    assert manifest["spec"]["template"]["spec"]["evictionStrategy"] == "External"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"cores": 3}, "spec.cores"),
        ({"cores": 64}, "spec.cores"),
        ({"memory_gib": 3}, "spec.memory_gib"),
        ({"memory_gib": 128}, "spec.memory_gib"),
        ({"run_strategy": "Sometimes"}, "spec.run_strategy"),
        ({"preference": "macos"}, "spec.preference"),
        ({"name": "Not_A_Label"}, "spec.name"),
        ({"name": "x" * 64}, "spec.name"),
        ({"image": ""}, "spec.image"),
        ({"gpus": 2}, "spec.gpus"),
    ],
)
def test_create_vm_limits_are_enforced_and_the_reason_names_the_field(override: dict[str, Any], field: str) -> None:
    h = cluster()
    result = h.intent("create_vm", create_spec(**override))
    assert result.decision.commands == []
    assert result.decision.audit is not None and result.decision.audit.outcome == "rejected"
    assert field in (result.decision.audit.reason or "")
    [told] = result.decision.notifications
    assert told.type == "intent_rejected" and told.recipients == [ALICE]
    assert told.details["reason"] == result.decision.audit.reason


def test_create_vm_refuses_an_existing_name() -> None:
    result = cluster().intent("create_vm", create_spec(name="web-1"))
    assert result.decision.audit is not None and "already exists" in (result.decision.audit.reason or "")


def test_create_vm_refuses_an_unknown_class() -> None:
    result = cluster().intent("create_vm", create_spec(gpu_class="nvidia-h100"))
    assert result.decision.audit is not None
    assert "unknown GPU class 'nvidia-h100'" in (result.decision.audit.reason or "")


# ---------------------------------------------------------------------- set_gpu


def test_set_gpu_emits_a_patch_against_the_observed_resource_version() -> None:
    h = cluster()
    result = h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "off-1", "gpu_class": "nvidia-a100"})
    [command] = result.decision.commands
    assert command.type == "patch_vm"
    assert command.base_resource_version == "1"
    assert command.mutation is not None and command.mutation.device_name == A100
    assert {op["path"] for op in command.patch or []} >= {"/spec/template/spec/domain/devices/gpus"}


def test_set_gpu_on_a_vm_already_as_asked_issues_no_command_and_says_so() -> None:
    h = Harness()
    h.observe(vm("spx-proj-a", "g-1", project="proj-a", owner=ALICE, gpu=RTX))
    first = h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "g-1", "gpu_class": None})
    assert first.decision.commands
    h.observe(vm("spx-proj-a", "g-1", project="proj-a", owner=ALICE, rv=2))
    again = h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "g-1", "gpu_class": None})
    assert again.decision.commands == []
    assert again.decision.audit is not None
    assert again.decision.audit.outcome == "accepted"
    assert again.decision.audit.reason == "nothing to change: already as asked"


def test_set_gpu_class_ids_are_case_insensitive() -> None:
    result = cluster().intent("set_gpu", {"namespace": "spx-proj-a", "name": "off-1", "gpu_class": "NVIDIA-A100"})
    mutation = result.decision.commands[0].mutation
    assert mutation is not None and mutation.device_name == A100


@pytest.mark.parametrize(
    ("spec", "by", "project", "reason"),
    [
        ({"namespace": "spx-proj-a", "name": "off-1", "gpu_class": "nvidia-h100"}, ALICE, "proj-a",
         "unknown GPU class 'nvidia-h100'; this AZ offers: nvidia-a100, nvidia-rtx-pro-6000-bse"),
        ({"namespace": "spx-proj-a", "name": "off-1", "gpu_class": "nvidia-a100"}, "mallory@example.com", "proj-b",
         "VM spx-proj-a/off-1 does not belong to project 'proj-b'"),
        ({"namespace": "spx-proj-a", "name": "ghost", "gpu_class": "nvidia-a100"}, ALICE, "proj-a",
         "VM spx-proj-a/ghost does not exist"),
    ],
)
def test_wrong_set_gpu_requests_are_rejected_and_the_requester_told(
    spec: dict[str, Any], by: str, project: str, reason: str
) -> None:
    result = cluster().intent("set_gpu", spec, by=by, project=project)
    assert result.decision.commands == []
    audit = result.decision.audit
    assert audit is not None and audit.outcome == "rejected" and audit.reason == reason
    [told] = result.decision.notifications
    assert told.type == "intent_rejected" and told.recipients == [by]
    assert told.details == {"intent_id": audit.input.ref, "reason": reason}


def test_a_vm_intent_without_project_is_rejected() -> None:
    result = cluster().intent("set_gpu", {"namespace": "spx-proj-a", "name": "off-1", "gpu_class": None}, project=None)
    assert result.decision.audit is not None and result.decision.audit.outcome == "rejected"
    assert "project" in (result.decision.audit.reason or "")


def test_an_az_without_classes_offers_no_gpu() -> None:
    from tests.support.harness import config

    h = Harness(config(gpu_classes={}))
    h.observe(vm("spx-proj-a", "off-1", project="proj-a", owner=ALICE))
    result = h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "off-1", "gpu_class": "nvidia-a100"})
    assert result.decision.audit is not None
    assert result.decision.audit.reason == "this AZ offers no GPU (asked for 'nvidia-a100')"


def test_set_gpu_on_a_vm_with_two_gpus_is_rejected() -> None:
    h = Harness()
    two = vm("spx-proj-a", "two-1", project="proj-a", owner=ALICE)
    two["spec"]["template"]["spec"]["domain"]["devices"]["gpus"] = [
        {"name": "a", "deviceName": RTX}, {"name": "b", "deviceName": RTX}]
    h.observe(two)
    result = h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "two-1", "gpu_class": "nvidia-a100"})
    assert result.decision.audit is not None and "at most one" in (result.decision.audit.reason or "")


# ---------------------------------------------------------------------- restart


def test_restart_of_a_running_vm_issues_a_restart_command() -> None:
    result = cluster().intent("restart_vm", {"namespace": "spx-proj-a", "name": "web-1"})
    assert [c.type for c in result.decision.commands] == ["restart_vm"]


@pytest.mark.parametrize(
    ("strategy", "reason"),
    [("Halted", "its run strategy is Halted"), ("Once", "its run strategy is Once")],
)
def test_restart_is_refused_for_halted_and_once(strategy: str, reason: str) -> None:
    h = Harness()
    h.observe_all(vm("spx-proj-a", "r-1", project="proj-a", owner=ALICE, run_strategy=strategy),
                  vmi("spx-proj-a", "r-1", node_name="n"))
    result = h.intent("restart_vm", {"namespace": "spx-proj-a", "name": "r-1"})
    assert result.decision.commands == []
    assert result.decision.audit is not None
    assert reason in (result.decision.audit.reason or "")
    assert result.decision.notifications[0].type == "intent_rejected"


def test_restart_is_refused_for_a_vm_that_is_not_running() -> None:
    result = cluster().intent("restart_vm", {"namespace": "spx-proj-a", "name": "off-1"})
    assert result.decision.audit is not None
    assert result.decision.audit.reason == "cannot restart VM spx-proj-a/off-1: it is not running"


def test_legacy_running_false_counts_as_halted() -> None:
    h = Harness()
    h.observe(vm("spx-proj-a", "old-1", project="proj-a", owner=ALICE, run_strategy=None, running=False))
    result = h.intent("restart_vm", {"namespace": "spx-proj-a", "name": "old-1"})
    assert result.decision.audit is not None
    assert "Halted" in (result.decision.audit.reason or "")


# ----------------------------------------------------------------- idempotency


def test_the_same_intent_id_has_one_effect() -> None:
    h = cluster()
    spec = {"namespace": "spx-proj-a", "name": "off-1", "gpu_class": "nvidia-a100"}
    first = h.intent("set_gpu", spec, intent_id="it-same")
    second = h.intent("set_gpu", spec, intent_id="it-same")
    assert len(first.decision.commands) == 1
    assert second.decision.commands == [] and second.decision.notifications == []
    assert second.decision.audit is not None and second.decision.audit.outcome == "duplicate"


def test_a_rejected_intent_repeated_is_a_duplicate_not_a_second_rejection() -> None:
    h = cluster()
    spec = {"namespace": "spx-proj-a", "name": "off-1", "gpu_class": "nvidia-h100"}
    h.intent("set_gpu", spec, intent_id="it-bad")
    again = h.intent("set_gpu", spec, intent_id="it-bad")
    assert again.decision.notifications == []
    assert again.decision.audit is not None and again.decision.audit.outcome == "duplicate"


def test_ids_are_deterministic_across_engines() -> None:
    spec = {"namespace": "spx-proj-a", "name": "off-1", "gpu_class": "nvidia-a100"}
    one = cluster().intent("set_gpu", spec, intent_id="it-x")
    two = cluster().intent("set_gpu", spec, intent_id="it-x")
    assert one.decision.commands[0].command_id == two.decision.commands[0].command_id
    assert one.decision.audit == two.decision.audit


@given(
    cores=st.sampled_from([1, 2, 4, 8, 16, 32]),
    memory=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
    strategy=st.sampled_from(["Always", "RerunOnFailure", "Manual", "Halted", "Once"]),
    preference=st.sampled_from(["linux", "windows"]),
    gpu=st.sampled_from([None, "nvidia-a100", "NVIDIA-RTX-PRO-6000-BSE"]),
    labels=st.dictionaries(st.sampled_from(["team", "app.kubernetes.io/part-of", "tier"]),
                           st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True), max_size=3),
)
@settings(max_examples=60, deadline=None)
def test_every_created_manifest_validates_against_kubevirts_schema(
    cores: int, memory: int, strategy: str, preference: str, gpu: str | None, labels: dict[str, str]
) -> None:
    h = Harness()
    spec = create_spec(cores=cores, memory_gib=memory, run_strategy=strategy, preference=preference,
                       gpu_class=gpu, labels=labels)
    [command] = h.intent("create_vm", spec).decision.commands
    assert command.manifest is not None
    validate_vm(command.manifest)
    assert command.manifest["spec"]["runStrategy"] == strategy
