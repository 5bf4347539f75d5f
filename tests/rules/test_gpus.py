"""The GPU mutation rules (DOMAIN.md, "What a GPU does to a VM"), one test per rule,
and the invariants as properties: idempotent, add-then-remove is the identity, and every
VM produced validates against KubeVirt's own CRD schema."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.contracts.messages import GPUMutation
from handlers.rules.gpus import (
    PRE_GPU_ANNOTATION,
    GPURuleViolation,
    desired_vm,
    plan_patch,
)
from samples.cluster import A100, RTX, vm
from tests.support.kubevirt_schema import example_vms, validate_vm

ADD_RTX = GPUMutation(device_name=RTX, eviction_strategy="External")
ADD_A100 = GPUMutation(device_name=A100, eviction_strategy="External")
REMOVE = GPUMutation(device_name=None, eviction_strategy="External")


def domain(obj: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = obj["spec"]["template"]["spec"]["domain"]
    return found


def plain_vm(**kwargs: Any) -> dict[str, Any]:
    return vm("spx-proj-a", "vm-1", project="proj-a", owner="alice@example.com", **kwargs)


# ------------------------------------------------------------------ one rule each


def test_gpu_goes_into_gpus_with_the_class_device() -> None:
    result = desired_vm(plain_vm(), ADD_RTX)
    assert domain(result)["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": RTX}]
    assert "hostDevices" not in domain(result)["devices"]


def test_a_vm_with_two_gpus_is_refused() -> None:
    two = plain_vm()
    domain(two)["devices"]["gpus"] = [{"name": "a", "deviceName": RTX}, {"name": "b", "deviceName": RTX}]
    with pytest.raises(GPURuleViolation, match="2 GPUs"):
        desired_vm(two, ADD_A100)


def test_changing_the_class_replaces_the_device_and_keeps_the_entry_name() -> None:
    with_gpu = desired_vm(plain_vm(), ADD_RTX)
    domain(with_gpu)["devices"]["gpus"][0]["name"] = "mygpu"
    changed = desired_vm(with_gpu, ADD_A100)
    assert domain(changed)["devices"]["gpus"] == [{"name": "mygpu", "deviceName": A100}]


def test_cpu_model_becomes_host_passthrough_creating_the_cpu_block() -> None:
    no_cpu = plain_vm()
    del domain(no_cpu)["cpu"]
    assert domain(desired_vm(no_cpu, ADD_RTX))["cpu"] == {"model": "host-passthrough"}


def test_removal_clears_host_passthrough() -> None:
    added = desired_vm(plain_vm(), ADD_RTX)
    assert "model" not in domain(desired_vm(added, REMOVE))["cpu"]


def test_removal_keeps_a_cpu_model_the_user_set_since() -> None:
    added = desired_vm(plain_vm(), ADD_RTX)
    domain(added)["cpu"]["model"] = "Cascadelake-Server"
    assert domain(desired_vm(added, REMOVE))["cpu"]["model"] == "Cascadelake-Server"


def test_removal_of_a_hand_made_gpu_clears_host_passthrough_only() -> None:
    hand_made = plain_vm(gpu=RTX)  # GPU and host-passthrough set before vmstream, no record
    removed = desired_vm(hand_made, REMOVE)
    assert "gpus" not in domain(removed)["devices"]
    assert "model" not in domain(removed)["cpu"]
    hand_made_named = plain_vm(gpu=RTX)
    domain(hand_made_named)["cpu"]["model"] = "Haswell"
    assert domain(desired_vm(hand_made_named, REMOVE))["cpu"]["model"] == "Haswell"


def test_memory_request_is_pinned_to_guest_memory() -> None:
    result = desired_vm(plain_vm(memory="32Gi"), ADD_RTX)
    assert domain(result)["resources"]["requests"]["memory"] == "32Gi"


def test_removal_restores_the_previous_memory_request() -> None:
    original = plain_vm(memory="32Gi")
    domain(original)["resources"] = {"requests": {"memory": "16Gi"}}
    added = desired_vm(original, ADD_RTX)
    assert domain(added)["resources"]["requests"]["memory"] == "32Gi"
    assert domain(desired_vm(added, REMOVE))["resources"] == {"requests": {"memory": "16Gi"}}


def test_removal_keeps_a_memory_request_changed_since() -> None:
    added = desired_vm(plain_vm(memory="32Gi"), ADD_RTX)
    domain(added)["resources"]["requests"]["memory"] = "64Gi"
    assert domain(desired_vm(added, REMOVE))["resources"]["requests"]["memory"] == "64Gi"


def test_eviction_strategy_follows_policy_and_is_restored() -> None:
    original = plain_vm()
    original["spec"]["template"]["spec"]["evictionStrategy"] = "LiveMigrate"
    added = desired_vm(original, GPUMutation(device_name=RTX, eviction_strategy="None"))
    assert added["spec"]["template"]["spec"]["evictionStrategy"] == "None"
    assert desired_vm(added, REMOVE)["spec"]["template"]["spec"]["evictionStrategy"] == "LiveMigrate"


def test_instancetype_vm_gets_no_memory_request() -> None:
    """The instance type owns memory: KubeVirt refuses a template that also sets it."""
    original = plain_vm()
    original["spec"]["instancetype"] = {"kind": "VirtualMachineClusterInstancetype", "name": "u1.large"}
    del domain(original)["memory"]
    result = desired_vm(original, ADD_RTX)
    assert "resources" not in domain(result)
    assert domain(result)["devices"]["gpus"][0]["deviceName"] == RTX
    assert domain(result)["cpu"]["model"] == "host-passthrough"


def test_legacy_running_vm_keeps_running_and_gets_no_run_strategy() -> None:
    legacy = plain_vm(run_strategy=None, running=True)
    result = desired_vm(legacy, ADD_RTX)
    assert result["spec"]["running"] is True
    assert "runStrategy" not in result["spec"]


def test_the_record_of_what_was_overwritten_is_an_annotation() -> None:
    result = desired_vm(plain_vm(), ADD_RTX)
    record = json.loads(result["metadata"]["annotations"][PRE_GPU_ANNOTATION])
    assert "/spec/template/spec/domain/cpu/model" in record["absent"]
    assert PRE_GPU_ANNOTATION not in desired_vm(result, REMOVE)["metadata"].get("annotations", {})


def test_removing_from_a_vm_without_gpu_is_no_change() -> None:
    original = plain_vm()
    assert plan_patch(original, desired_vm(original, REMOVE)) == []


def test_patch_turns_the_observed_vm_into_the_desired_one() -> None:
    original = plain_vm()
    desired = desired_vm(original, ADD_RTX)
    patch = plan_patch(original, desired)
    assert patch and all(op["op"] in {"add", "remove", "replace", "move", "copy", "test"} for op in patch)
    assert jsonpatch.apply_patch(original, patch) == desired


def test_observed_object_is_never_mutated() -> None:
    original = plain_vm()
    before = copy.deepcopy(original)
    desired_vm(original, ADD_RTX)
    assert original == before


def _containers(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [value, *(c for item in value.values() for c in _containers(item))]
    if isinstance(value, list):
        return [value, *(c for item in value for c in _containers(item))]
    return []


def test_the_desired_vm_shares_nothing_with_the_observed_one() -> None:
    original = plain_vm()
    desired = desired_vm(original, ADD_RTX)
    assert not {id(c) for c in _containers(original)} & {id(c) for c in _containers(desired)}


# ------------------------------------------------------------------- properties

QUANTITIES = st.sampled_from(["1Gi", "2Gi", "4Gi", "8Gi", "16Gi", "32Gi", "64Gi", "128Mi", "1024M"])


@st.composite
def generated_vms(draw: st.DrawFn) -> dict[str, Any]:
    """VMs as users and other tools leave them: optional blocks present, absent or empty."""
    obj = plain_vm(
        run_strategy=draw(st.sampled_from(["Always", "Manual", "RerunOnFailure", "Halted", "Once"])),
        memory=draw(QUANTITIES),
        cores=draw(st.sampled_from([1, 2, 4, 8, 16, 32])),
    )
    dom = domain(obj)
    if draw(st.booleans()):
        obj["spec"].pop("runStrategy")
        obj["spec"]["running"] = draw(st.booleans())
    cpu_choice = draw(st.sampled_from(["absent", "empty", "named", "passthrough", "topology"]))
    if cpu_choice == "absent":
        del dom["cpu"]
    elif cpu_choice == "empty":
        dom["cpu"] = {}
    elif cpu_choice == "named":
        dom["cpu"]["model"] = draw(st.sampled_from(["Haswell-noTSX", "Cascadelake-Server", "host-model"]))
    elif cpu_choice == "passthrough":
        dom["cpu"]["model"] = "host-passthrough"
    resources = draw(st.sampled_from(["absent", "empty", "requests-empty", "request"]))
    if resources == "empty":
        dom["resources"] = {}
    elif resources == "requests-empty":
        dom["resources"] = {"requests": {}}
    elif resources == "request":
        dom["resources"] = {"requests": {"memory": draw(QUANTITIES)}}
    if draw(st.booleans()):
        del dom["memory"]
    if draw(st.booleans()):
        obj["spec"]["template"]["spec"]["evictionStrategy"] = draw(
            st.sampled_from(["LiveMigrate", "LiveMigrateIfPossible", "None", "External"])
        )
    if draw(st.booleans()):
        dom["devices"]["gpus"] = []
    if draw(st.booleans()):
        obj["metadata"].pop("annotations", None)
    elif draw(st.booleans()):
        obj["metadata"]["annotations"] = {}
    if draw(st.booleans()):
        obj["spec"]["instancetype"] = {"kind": "VirtualMachineClusterInstancetype", "name": "u1.large"}
        dom.pop("memory", None)
    return obj


MUTATIONS = st.builds(
    GPUMutation,
    device_name=st.sampled_from([RTX, A100, "nvidia.com/UNKNOWN_CARD", None]),
    eviction_strategy=st.sampled_from(["External", "None"]),
)


@given(generated_vms(), MUTATIONS)
@settings(max_examples=200, deadline=None)
def test_set_gpu_twice_is_set_gpu_once(original: dict[str, Any], mutation: GPUMutation) -> None:
    once = desired_vm(original, mutation)
    assert desired_vm(once, mutation) == once
    assert plan_patch(once, desired_vm(once, mutation)) == []


@given(generated_vms(), MUTATIONS)
@settings(max_examples=200, deadline=None)
def test_add_then_remove_restores_the_original(original: dict[str, Any], mutation: GPUMutation) -> None:
    if mutation.device_name is None:
        mutation = ADD_RTX
    assert desired_vm(desired_vm(original, mutation), REMOVE) == original


@given(generated_vms(), MUTATIONS)
@settings(max_examples=200, deadline=None)
def test_the_patch_turns_the_observed_vm_into_the_desired_one(original: dict[str, Any], mutation: GPUMutation) -> None:
    original["status"] = {"printableStatus": "Running", "ready": True}
    desired = desired_vm(original, mutation)
    patch = plan_patch(original, desired)
    assert jsonpatch.apply_patch(original, patch) == desired
    assert all(not op["path"].startswith("/status") for op in patch)


@given(generated_vms(), MUTATIONS, MUTATIONS)
@settings(max_examples=200, deadline=None)
def test_add_change_remove_restores_the_original(
    original: dict[str, Any], first: GPUMutation, second: GPUMutation
) -> None:
    first = first if first.device_name else ADD_RTX
    second = second if second.device_name else ADD_A100
    changed = desired_vm(desired_vm(original, first), second)
    assert desired_vm(changed, REMOVE) == original


@given(generated_vms(), MUTATIONS)
@settings(max_examples=150, deadline=None)
def test_every_produced_vm_validates_against_kubevirts_schema(
    original: dict[str, Any], mutation: GPUMutation
) -> None:
    validate_vm(original)
    validate_vm(desired_vm(original, mutation))


@pytest.mark.parametrize("example", example_vms(), ids=lambda vm_: vm_["metadata"]["name"])
def test_kubevirt_examples_round_trip_and_stay_valid(example: dict[str, Any]) -> None:
    for mutation in (ADD_RTX, GPUMutation(device_name=A100, eviction_strategy="None")):
        added = desired_vm(example, mutation)
        validate_vm(added)
        assert desired_vm(added, mutation) == added
        removed = desired_vm(added, REMOVE)
        validate_vm(removed)
        assert removed == example


def test_schema_validation_would_catch_a_broken_mutation() -> None:
    """The schema check is not vacuous: a GPU entry without a name is refused."""
    broken = desired_vm(plain_vm(), ADD_RTX)
    del domain(broken)["devices"]["gpus"][0]["name"]
    with pytest.raises(AssertionError, match="name"):
        validate_vm(broken)



def test_plan_patch_escapes_keys_and_replaces_changed_lists_whole() -> None:
    """Annotation keys carry ``/`` (RFC 6901: ``~1``); a changed list is one ``replace``."""
    observed = {"metadata": {"annotations": {"a~b": "1"}}, "spec": {"gpus": [{"name": "gpu1"}], "keep": [1]}}
    desired = {"metadata": {"annotations": {"vmstream.io/pre-gpu": "{}"}},
               "spec": {"gpus": [{"name": "gpu1"}, {"name": "gpu2"}], "keep": [1]}}
    patch = plan_patch(observed, desired)
    assert patch == [
        {"op": "remove", "path": "/metadata/annotations/a~0b"},
        {"op": "add", "path": "/metadata/annotations/vmstream.io~1pre-gpu", "value": "{}"},
        {"op": "replace", "path": "/spec/gpus", "value": [{"name": "gpu1"}, {"name": "gpu2"}]},
    ]
    assert jsonpatch.apply_patch(observed, patch) == desired
