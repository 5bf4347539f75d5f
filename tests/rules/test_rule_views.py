"""An object reduced to what the rules read (``rule_view``) decides exactly as the whole one.

The watch bridge publishes such a view when a whole object does not fit in a Kafka message
(streams/kube/watching.py). Every object here carries what real ones do beyond the rules' reach —
a large cloud-init, volume and interface status, a node's image list — and the same
scenario is decided twice, once on whole objects and once on their views.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.contracts.messages import GPUMutation
from handlers.core.cluster import (
    KEPT_FOR_EVERY_KIND,
    RULE_PATHS,
    InstancetypeRevision,
    KubeVirtRecord,
    MaintenanceRecord,
    NamespaceRecord,
    NodeRecord,
    VMIRecord,
    VMRecord,
    rule_view,
)
from handlers.core.tables import VMS
from handlers.rules.capacity import capacity_report
from handlers.rules.gpus import desired_vm, plan_patch
from samples.cluster import (
    A100,
    PROJECT_LABEL,
    RTX,
    instancetype_revision,
    kubevirt_cr,
    node,
    node_maintenance,
    vm,
    vmi,
    with_devices,
)
from streams.common.codecs import decode_state, encode_state
from streams.kube.watching import KINDS
from tests.support.harness import Harness

ALICE, OPS = "alice@example.com", "ops@example.com"
CLOUD_INIT = "#cloud-config\nwrite_files:\n" + "  - content: " + "x" * 50_000 + "\n"


def padded(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with the bulk real objects carry and no rule reads."""
    obj = copy.deepcopy(obj)
    kind = obj["kind"]
    obj["metadata"].setdefault("finalizers", ["kubevirt.io/virtualMachineControllerFinalize"])
    status = obj.setdefault("status", {})
    if kind == "VirtualMachine":
        template = obj["spec"]["template"]["spec"]
        template.setdefault("volumes", []).append(
            {"name": "cloudinit", "cloudInitNoCloud": {"userData": CLOUD_INIT}})
        template["networks"] = [{"name": "default", "pod": {}}]
        obj["spec"]["dataVolumeTemplates"] = [{"metadata": {"name": "root"}, "spec": {"storage": {}}}]
        status.update({"created": True, "ready": True, "volumeSnapshotStatuses": [{"name": "root"}]})
    elif kind == "VirtualMachineInstance":
        obj["spec"]["volumes"] = [{"name": "cloudinit", "cloudInitNoCloud": {"userData": CLOUD_INIT}}]
        status.update({"interfaces": [{"ipAddress": "10.0.0.7", "name": "default"}],
                       "guestOSInfo": {"id": "ubuntu"}, "volumeStatus": [{"name": "cloudinit"}]})
    elif kind == "Node":
        status["images"] = [{"names": [f"registry.example/image-{i}:latest"], "sizeBytes": i}
                            for i in range(2_000)]
        status["nodeInfo"] = {"kubeletVersion": "v1.35.0"}
    elif kind == "KubeVirt":
        status.update({"phase": "Deployed", "observedDeploymentConfig": json.dumps(obj["spec"]) * 200})
    else:
        status.update({"phase": "Running", "pendingPods": [f"virt-launcher-{i}" for i in range(500)]})
    return obj


def rich_objects() -> list[dict[str, Any]]:
    """One of each kind, with every field a record reads set to something other than its default."""
    restart_vm = vm("p", "rich", project="proj-a", owner=ALICE, gpu=RTX, run_strategy="RerunOnFailure")
    restart_vm["spec"]["instancetype"] = {"kind": "VirtualMachineClusterInstancetype", "name": "u1.large"}
    restart_vm["status"] = {"printableStatus": "Running", "runStrategy": "RerunOnFailure",
                            "stateChangeRequests": [{"action": "Start"}],
                            "conditions": [{"type": "RestartRequired", "status": "True"}],
                            "instancetypeRef": {"kind": "VirtualMachineClusterInstancetype", "name": "u1.large",
                                                "controllerRevisionRef": {"name": "rich-u1.large-1"}}}
    with_devices(restart_vm, host_devices=[A100, "intel.com/sriov_vf"])
    evicted = vmi("p", "rich", node_name="gpu-node-1", gpu=RTX, cpu_model="host-passthrough",
                  eviction_requested=True, unschedulable=True, phase="Scheduling")
    cordoned = node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True)
    maintenance = node_maintenance("nm-1", "gpu-node-1", "replace a fan")
    maintenance["status"] = {"phase": "Running"}
    namespace = {"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": "spx-proj-a", "labels": {PROJECT_LABEL: "proj-a"}},
                 "spec": {"finalizers": ["kubernetes"]}}
    with_devices(evicted, host_devices=[A100])
    revision = instancetype_revision("p", "rich", "rich-u1.large-1", instancetype="u1.large", gpus=[RTX],
                                     host_devices=[A100], cpu_model="host-passthrough")
    return [padded(o) for o in (restart_vm, evicted, cordoned, maintenance, kubevirt_cr(), namespace, revision)]


GPU_NAMES = frozenset({RTX, A100})
_REVISION = InstancetypeRevision.from_object(instancetype_revision(
    "p", "rich", "rich-u1.large-1", instancetype="u1.large", gpus=[RTX], host_devices=[A100]))
assert _REVISION is not None
REVISION: InstancetypeRevision = _REVISION

RECORDS = {
    "Namespace": lambda o: NamespaceRecord.from_object(o, project_label=PROJECT_LABEL),
    "VirtualMachine": lambda o: VMRecord.from_object(o, project_label=PROJECT_LABEL, gpu_names=GPU_NAMES,
                                                     revisions={REVISION.name: REVISION}),
    "VirtualMachineInstance": lambda o: VMIRecord.from_object(o, gpu_names=GPU_NAMES),
    "ControllerRevision": InstancetypeRevision.from_object,
    "Node": NodeRecord.from_object,
    "NodeMaintenance": MaintenanceRecord.from_object,
    "KubeVirt": KubeVirtRecord.from_object,
}


def test_every_watched_kind_has_its_rule_paths() -> None:
    assert set(RULE_PATHS) == set(RECORDS) == {kind.kind for kind in KINDS}


@pytest.mark.parametrize("obj", rich_objects(), ids=lambda o: o["kind"])
def test_the_view_yields_the_same_record_and_is_much_smaller(obj: dict[str, Any]) -> None:
    view = rule_view(obj["kind"], obj)
    assert RECORDS[obj["kind"]](view) == RECORDS[obj["kind"]](obj)
    assert len(json.dumps(view)) < len(json.dumps(obj)) / 10
    assert obj == rich_objects()[[o["kind"] for o in rich_objects()].index(obj["kind"])]  # untouched


def view_path_by_path(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """The view as it was first taken, one path at a time: what the path tree must give."""
    view: dict[str, Any] = {}
    for path in (*KEPT_FOR_EVERY_KIND, *RULE_PATHS.get(kind, ())):
        source: Any = obj
        target = view
        for part in path[:-1]:
            source = source.get(part)
            if not isinstance(source, dict):
                break
            target = target.setdefault(part, {})
        else:
            value = source.get(path[-1])
            if value is not None:
                target[path[-1]] = value
    return view


RULE_KEYS = sorted({part for paths in (*RULE_PATHS.values(), KEPT_FOR_EVERY_KIND) for path in paths for part in path}
                   | {"other", "more"})
SCALARS = st.none() | st.booleans() | st.integers() | st.text(max_size=5)
OBJECTS = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.sampled_from(RULE_KEYS), inner, max_size=6), max_leaves=40)


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from([*RULE_PATHS, "Pod"]), obj=st.dictionaries(st.sampled_from(RULE_KEYS), OBJECTS, max_size=8))
def test_the_path_tree_takes_the_view_each_path_takes(kind: str, obj: dict[str, Any]) -> None:
    view = rule_view(kind, obj)
    assert view == view_path_by_path(kind, obj)
    assert json.dumps(view) == json.dumps(view_path_by_path(kind, obj))  # the same order of keys too


@pytest.mark.parametrize("device", [RTX, None])
@pytest.mark.parametrize("instancetype", [False, True])
def test_gpu_patches_are_the_same_from_the_view(device: str | None, instancetype: bool) -> None:
    whole = padded(vm("p", "v", project="proj-a", owner=ALICE, gpu=None if device else A100))
    whole["metadata"]["annotations"]["other.example/keep"] = "yes"
    whole["spec"]["template"]["spec"]["evictionStrategy"] = "LiveMigrate"
    if instancetype:
        whole["spec"]["instancetype"] = {"name": "u1.large"}
    mutation = GPUMutation(device_name=device, eviction_strategy="External")
    view = rule_view("VirtualMachine", whole)
    patch = plan_patch(whole, desired_vm(whole, mutation))
    assert patch, "the scenario must change something"
    assert plan_patch(view, desired_vm(view, mutation)) == patch


def decide(reduce: bool) -> tuple[list[str], list[dict[str, Any]]]:
    """One AZ's day: GPUs set, a restart, an eviction, a maintenance, a drain, deletions."""
    h = Harness()
    reports: list[dict[str, Any]] = []

    def see(obj: dict[str, Any], type_: str = "ADDED") -> None:
        obj = padded(obj)
        h.observe(rule_view(obj["kind"], obj) if reduce else obj, type_)
        reports.append(capacity_report(h.state, h.engine.catalog))

    see(kubevirt_cr())
    see(node("gpu-node-1", gpus={RTX: 2, A100: 1}))
    see(node("gpu-node-2", gpus={RTX: 1}))
    see(vm("p", "train", project="proj-a", owner=ALICE, gpu=RTX))
    see(vmi("p", "train", node_name="gpu-node-1", gpu=RTX, cpu_model="host-passthrough"))
    see(vm("p", "dev", project="proj-a", owner=ALICE, memory="32Gi"))
    see(vmi("p", "dev", node_name="gpu-node-2"))
    see(vm("p", "batch", project="proj-a", owner=ALICE, run_strategy="Manual", gpu=A100))
    see(vmi("p", "batch", node_name="gpu-node-1", gpu=A100, cpu_model="host-passthrough"))
    h.intent("set_gpu", {"namespace": "p", "name": "dev", "gpu_class": "nvidia-rtx-pro-6000-bse"})
    h.intent("set_gpu", {"namespace": "p", "name": "train", "gpu_class": None})
    h.intent("restart_vm", {"namespace": "p", "name": "batch"})
    see(vmi("p", "train", node_name="gpu-node-1", gpu=RTX, eviction_requested=True), "MODIFIED")
    see(node_maintenance("nm-2", "gpu-node-2", "replace a fan"))
    h.intent("drain_node", {"node": "gpu-node-1", "reason": "firmware", "notice_seconds": 60},
             by=OPS, project=None)
    see(node("gpu-node-1", gpus={RTX: 2, A100: 1}, unschedulable=True, rv=2), "MODIFIED")
    h.wait(3600).tick()
    see(vmi("p", "batch", node_name="gpu-node-1", gpu=A100), "DELETED")
    see(vm("p", "batch", project="proj-a", owner=ALICE, run_strategy="Manual", gpu=A100), "DELETED")
    see(node("gpu-node-2", gpus={RTX: 1}), "DELETED")
    h.intent("set_gpu", {"namespace": "p", "name": "batch", "gpu_class": "nvidia-a100"})
    outputs = [f"{o.topic} {o.key} {o.value.model_dump_json()}" for r in h.results for o in r.outputs()]
    return outputs, reports


def test_the_rules_decide_the_same_on_views_as_on_whole_objects() -> None:
    whole, whole_capacity = decide(reduce=False)
    assert any('"patch_vm"' in line for line in whole) and any('"delete_vmi"' in line for line in whole)
    assert any("drain_will_stop_gpu_vm" in line for line in whole)
    reduced, reduced_capacity = decide(reduce=True)
    assert reduced == whole
    assert reduced_capacity == whole_capacity


def test_a_vm_row_keeps_only_the_rule_view() -> None:
    whole = padded(vm("p", "v", project="proj-a", owner=ALICE, gpu=RTX))
    record = VMRecord.from_object(whole, project_label=PROJECT_LABEL)
    assert record.object == rule_view("VirtualMachine", whole)
    assert "volumes" not in record.object["spec"]["template"]["spec"]
    assert len(json.dumps(record.object)) < len(json.dumps(whole)) / 10


def test_a_vm_row_stored_whole_still_decodes_and_plans_the_same_patch() -> None:
    """Changelogs outlive upgrades: a row written when a VM row kept the whole VM."""
    whole = padded(vm("p", "v", project="proj-a", owner=ALICE, gpu=None))
    whole["spec"]["template"]["spec"]["evictionStrategy"] = "LiveMigrate"
    now = VMRecord.from_object(whole, project_label=PROJECT_LABEL)
    before = dataclasses.replace(now, object=whole)  # as such a row was written
    old = decode_state(VMS, encode_state(VMS, before))
    assert old == now and old.object == whole
    mutation = GPUMutation(device_name=RTX, eviction_strategy="External")
    patch = plan_patch(now.object, desired_vm(now.object, mutation))
    assert patch and plan_patch(old.object, desired_vm(old.object, mutation)) == patch


def test_a_gpu_patch_creates_a_missing_domain_under_the_same_parent_on_the_view() -> None:
    """The maps on the way to a rule path are kept: a template without a domain gets one
    added at ``/spec/template/spec/domain`` from the view as from the whole VM."""
    whole = padded(vm("p", "v", project="proj-a", owner=ALICE, gpu=None))
    del whole["spec"]["template"]["spec"]["domain"]
    mutation = GPUMutation(device_name=RTX, eviction_strategy="External")
    view = rule_view("VirtualMachine", whole)
    patch = plan_patch(whole, desired_vm(whole, mutation))
    assert {"op": "add", "path": "/spec/template/spec/domain"} in [
        {k: v for k, v in op.items() if k != "value"} for op in patch]
    assert plan_patch(view, desired_vm(view, mutation)) == patch
