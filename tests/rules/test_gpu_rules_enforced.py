"""Every GPU VM gets the GPU rules, however it was created (handlers/rules/enforcement.py).

A VM observed with a GPU but without host-passthrough, with its memory overcommitted or
without the eviction strategy gets the mutation a set_gpu intent gives, once per content:
no command when it is right, none again while the patch is in flight, none for the event the
patch itself causes; its owner is told. ``gpu_vm.enforce`` chooses patch, notify or off.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.contracts.messages import Command, GPUMutation
from handlers.core.tables import TRACKING
from handlers.rules.gpus import (
    PRE_GPU_ANNOTATION,
    desired_vm,
    gpu_devices,
    plan_patch,
    quantity,
    rule_gaps,
    same_quantity,
)
from samples.cluster import A100, RTX, vm, vmi
from streams.common.settings import load_settings
from tests.support.harness import Harness, config
from tests.support.kubevirt_schema import validate_vm
from tests.rules.test_example_cases import EXAMPLES

ALICE = "alice@example.com"


def kubectl_vm(*, rv: int = 1, **kwargs: Any) -> dict[str, Any]:
    """A GPU VM as kubectl creates it: the device alone."""
    return vm("spx-proj-a", "hand-1", project="proj-a", owner=ALICE, gpu=RTX, gpu_rules=False, rv=rv, **kwargs)


def domain(obj: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = obj["spec"]["template"]["spec"]["domain"]
    return found


def applied(obj: dict[str, Any], command: Command, rv: int) -> dict[str, Any]:
    """The VM after the applier sent ``command`` (the API server bumps resourceVersion)."""
    assert command.patch is not None
    after: dict[str, Any] = jsonpatch.apply_patch(obj, command.patch)
    after["metadata"]["resourceVersion"] = str(rv)
    return after


def harness(enforce: str = "patch") -> Harness:
    return Harness(config(gpu_vm={"eviction_strategy": "External", "enforce": enforce}))


def test_a_gpu_vm_made_without_the_rules_gets_the_set_gpu_mutation_and_its_owner_is_told() -> None:
    h = harness()
    obj = kubectl_vm()
    result = h.observe(obj)
    [command] = result.decision.commands
    assert command.type == "patch_vm" and command.base_resource_version == "1"
    assert command.mutation == GPUMutation(device_name=RTX, eviction_strategy="External", enforce=True)
    after = applied(obj, command, 2)
    validate_vm(after)
    assert domain(after)["cpu"]["model"] == "host-passthrough"
    assert domain(after)["resources"]["requests"]["memory"] == domain(after)["memory"]["guest"] == "16Gi"
    assert after["spec"]["template"]["spec"]["evictionStrategy"] == "External"
    assert rule_gaps(after, eviction_strategy="External") == []
    # The same patch a set_gpu intent for its class would send.
    set_gpu = GPUMutation(device_name=RTX, eviction_strategy="External")
    assert after == jsonpatch.apply_patch(obj, plan_patch(obj, desired_vm(obj, set_gpu))) | {
        "metadata": after["metadata"]}
    [notice] = result.decision.notifications
    assert notice.type == "gpu_rules_applied" and notice.recipients == [ALICE]
    assert len(notice.details["gaps"]) == 3 and "host-passthrough" in notice.message
    assert result.decision.audit is not None and result.decision.audit.commands == [command.command_id]


def test_each_rule_alone_is_enforced() -> None:
    right = vm("spx-proj-a", "hand-1", project="proj-a", owner=ALICE, gpu=RTX)
    assert harness().observe(right).decision.commands == []
    wrong_model = copy.deepcopy(right)
    domain(wrong_model)["cpu"]["model"] = "Haswell-noTSX"
    overcommitted = copy.deepcopy(right)
    domain(overcommitted)["resources"]["requests"]["memory"] = "8Gi"
    no_strategy = copy.deepcopy(right)
    no_strategy["spec"]["template"]["spec"]["evictionStrategy"] = "LiveMigrate"
    for obj in (wrong_model, overcommitted, no_strategy):
        [command] = harness().observe(obj).decision.commands
        assert rule_gaps(applied(obj, command, 2), eviction_strategy="External") == []


def test_the_same_memory_written_otherwise_is_not_overcommitted() -> None:
    obj = vm("spx-proj-a", "hand-1", project="proj-a", owner=ALICE, gpu=RTX, memory="32Gi")
    domain(obj)["resources"]["requests"]["memory"] = "32768Mi"
    assert rule_gaps(obj, eviction_strategy="External") == []
    assert harness().observe(obj).decision.commands == []


def test_no_second_patch_while_the_first_is_in_flight_and_none_for_the_event_it_causes() -> None:
    h = harness()
    obj = kubectl_vm()
    [command] = h.observe(obj).decision.commands
    # KubeVirt writes the VM's status, the VMI shows up: the same content, still unpatched.
    status_update = copy.deepcopy(obj)
    status_update["metadata"]["resourceVersion"] = "2"
    status_update["status"] = {"printableStatus": "Starting"}
    assert h.observe(status_update, "MODIFIED").decision.commands == []
    assert h.observe(vmi("spx-proj-a", "hand-1", node_name="gpu-node-1", gpu=RTX)).decision.commands == []
    # The patch lands: its own event shows a VM that follows the rules — nothing more.
    result = h.observe(applied(status_update, command, 3), "MODIFIED")
    assert result.decision.commands == [] and result.decision.notifications == []
    assert len(h.commands("patch_vm")) == 1 and len(h.notifications("gpu_rules_applied")) == 1
    tracking = h.state.get(TRACKING, "vm/spx-proj-a/hand-1")
    assert tracking is None or tracking.gpu_rules_episode is None


def test_a_vm_reverted_after_the_patch_is_patched_again() -> None:
    h = harness()
    obj = kubectl_vm()
    [first] = h.observe(obj).decision.commands
    h.observe(applied(obj, first, 2), "MODIFIED")
    reverted = kubectl_vm(rv=3)  # a GitOps tool syncs its manifest back
    [second] = h.observe(reverted, "MODIFIED").decision.commands
    assert second.command_id != first.command_id and second.base_resource_version == "3"


def test_a_patch_landed_and_reverted_unseen_is_planned_again() -> None:
    h = harness()
    [first] = h.observe(kubectl_vm()).decision.commands
    # A relist shows the VM after the patch and a GitOps sync back: the same content, but
    # the API server counted two spec changes.
    relisted = kubectl_vm(rv=5)
    relisted["metadata"]["generation"] = 3
    [second] = h.observe(relisted, "RELISTED").decision.commands
    assert second.base_resource_version == "5"
    [told_first, told_second] = h.notifications("gpu_rules_applied")
    assert told_first.notification_id != told_second.notification_id


def test_notify_tells_the_owner_once_and_changes_nothing() -> None:
    h = harness("notify")
    result = h.observe(kubectl_vm())
    assert result.decision.commands == []
    [notice] = result.decision.notifications
    assert notice.type == "gpu_rules_applied" and notice.severity == "warning"
    assert notice.details["enforce"] == "notify"
    assert h.observe(kubectl_vm(rv=2), "MODIFIED").decision.notifications == []


def test_off_does_nothing() -> None:
    result = harness("off").observe(kubectl_vm())
    assert result.decision.commands == [] and result.decision.notifications == []


def test_a_vm_in_a_system_namespace_or_being_deleted_is_left_alone() -> None:
    obj = vm("kube-system", "hand-1", project="proj-a", owner=ALICE, gpu=RTX, gpu_rules=False)
    assert harness().observe(obj).decision.commands == []
    going = kubectl_vm()
    going["metadata"]["deletionTimestamp"] = "2026-11-30T10:00:00Z"
    assert harness().observe(going).decision.commands == []


def test_a_status_update_while_a_set_gpu_patch_is_in_flight_plans_nothing() -> None:
    h = harness()
    obj = kubectl_vm()
    [enforced] = h.observe(obj).decision.commands
    h.observe(applied(obj, enforced, 2), "MODIFIED")
    reverted = kubectl_vm(rv=3)
    [again] = h.observe(reverted, "MODIFIED").decision.commands
    # The owner asks for another class before that patch lands: the intent plans from the same
    # content, and a status update of that content plans nothing more.
    accepted = h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "hand-1", "gpu_class": "nvidia-a100"})
    [changed] = accepted.decision.commands
    assert changed.mutation is not None and changed.mutation.device_name == A100
    status_update = copy.deepcopy(reverted)
    status_update["metadata"]["resourceVersion"] = "4"
    status_update["status"] = {"printableStatus": "Stopped"}
    assert h.observe(status_update, "MODIFIED").decision.commands == []
    # Whatever order the applier meets them in, the enforcement never undoes the change:
    # planned again on the VM with the A100, its mutation leaves it as it is.
    with_a100 = applied(reverted, changed, 5)
    assert again.mutation is not None and desired_vm(with_a100, again.mutation) == with_a100


def test_a_gpu_adopted_by_the_rules_is_removed_by_set_gpu_null() -> None:
    h = harness()
    obj = kubectl_vm()
    [command] = h.observe(obj).decision.commands
    h.observe(applied(obj, command, 2), "MODIFIED")
    [removal] = h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "hand-1", "gpu_class": None}
                         ).decision.commands
    after = applied(h.vm_object("spx-proj-a", "hand-1"), removal, 3)
    validate_vm(after)
    assert gpu_devices(after) == [] and PRE_GPU_ANNOTATION not in (after["metadata"].get("annotations") or {})
    # Only what vmstream set is undone: kubectl's VM had no eviction strategy and no request.
    assert "evictionStrategy" not in after["spec"]["template"]["spec"]
    assert "resources" not in domain(after)


# ------------------------------------------------------------------------ properties

models = st.sampled_from([None, "host-passthrough", "Haswell-noTSX"])
requests = st.sampled_from([None, "16Gi", "8Gi", "16384Mi"])
strategies = st.sampled_from([None, "External", "LiveMigrate", "None"])


def gpu_vm(model: str | None, request: str | None, strategy: str | None, rv: int = 1) -> dict[str, Any]:
    obj = kubectl_vm(rv=rv)
    if model:
        domain(obj)["cpu"]["model"] = model
    if request:
        domain(obj)["resources"] = {"requests": {"memory": request}}
    if strategy:
        obj["spec"]["template"]["spec"]["evictionStrategy"] = strategy
    return obj


@settings(max_examples=60, deadline=None)
@given(model=models, request=requests, strategy=strategies, repeats=st.integers(min_value=1, max_value=4))
def test_one_command_per_content_and_none_once_it_follows_the_rules(
        model: str | None, request: str | None, strategy: str | None, repeats: int) -> None:
    h = harness()
    obj = gpu_vm(model, request, strategy)
    gaps = rule_gaps(obj, eviction_strategy="External")
    for rv in range(1, repeats + 1):  # redeliveries, relists, status updates of one content
        h.observe(gpu_vm(model, request, strategy, rv=rv), "MODIFIED")
    commands = h.commands("patch_vm")
    assert len(commands) == (1 if gaps else 0)
    assert len(h.notifications("gpu_rules_applied")) == len(commands)
    if commands:
        after = applied(gpu_vm(model, request, strategy, rv=repeats), commands[0], repeats + 1)
        validate_vm(after)
        assert rule_gaps(after, eviction_strategy="External") == []
        h.observe(after, "MODIFIED")
        h.observe(after, "MODIFIED")
        assert len(h.commands("patch_vm")) == 1


@settings(max_examples=60, deadline=None)
@given(model=models, request=requests, strategy=strategies, device=st.sampled_from([RTX, A100, None]))
def test_an_enforce_mutation_never_changes_which_gpu_a_vm_has(
        model: str | None, request: str | None, strategy: str | None, device: str | None) -> None:
    obj = gpu_vm(model, request, strategy)
    if device is None:
        del domain(obj)["devices"]["gpus"]
    else:
        domain(obj)["devices"]["gpus"][0]["deviceName"] = device
    mutation = GPUMutation(device_name=RTX, eviction_strategy="External", enforce=True)
    once = desired_vm(obj, mutation)
    assert gpu_devices(once) == gpu_devices(obj)
    assert desired_vm(once, mutation) == once
    if device != RTX:
        assert once == obj


def test_a_forged_long_quantity_is_read_as_any_other() -> None:
    forged = "9" * 100_000 + "Gi"  # a watch event forged on the bus: memory.guest of 100 kB
    assert quantity(forged) == quantity(forged) != quantity("9Gi")
    assert quantity("x" * 100_000) is None


@settings(max_examples=80, deadline=None)
@given(gib=st.integers(min_value=1, max_value=4096), other=st.integers(min_value=1, max_value=4096))
def test_memory_is_compared_as_a_quantity(gib: int, other: int) -> None:
    assert same_quantity(f"{gib}Gi", f"{gib * 1024}Mi") and same_quantity(f"{gib}Gi", str(gib * 2**30))
    assert same_quantity(f"{gib}Gi", f"{other}Gi") is (gib == other)
    obj = gpu_vm("host-passthrough", None, "External")
    domain(obj)["memory"]["guest"] = f"{gib}Gi"
    domain(obj)["resources"] = {"requests": {"memory": f"{other * 1024}Mi"}}
    assert (rule_gaps(obj, eviction_strategy="External") == []) is (gib == other)


def test_an_instance_type_owns_the_memory_so_no_request_is_asked_for() -> None:
    obj = gpu_vm("host-passthrough", None, "External")
    del domain(obj)["memory"]
    obj["spec"]["instancetype"] = {"kind": "VirtualMachineClusterInstancetype", "name": "u1.large"}
    assert rule_gaps(obj, eviction_strategy="External") == []
    assert harness().observe(obj).decision.commands == []


def test_the_policy_comes_from_the_config_file_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(EXAMPLES / "config.yaml").rules().gpu_vm.enforce == "patch"
    monkeypatch.setenv("VMSTREAM_GPU_VM__ENFORCE", "notify")
    monkeypatch.setenv("VMSTREAM_GPU_VM__INSTANCETYPE_OVERCOMMIT", "refuse")
    policy = load_settings(EXAMPLES / "config.yaml").rules().gpu_vm
    assert (policy.enforce, policy.instancetype_overcommit) == ("notify", "refuse")
    monkeypatch.setenv("VMSTREAM_GPU_VM__ENFORCE", "always")
    with pytest.raises(ValueError, match="'patch', 'notify' or 'off'"):
        load_settings(EXAMPLES / "config.yaml")
