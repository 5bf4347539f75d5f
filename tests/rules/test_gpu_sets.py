"""One GPU set per VM, wherever KubeVirt takes its GPUs from: the template's ``gpus``, its
``hostDevices`` (a GPU's device name passed as a host device), and the instance type, whose
``gpus`` and ``hostDevices`` ``ApplyToVMI`` puts into every VMI — from the ControllerRevision
virt-controller stored for the VM (docs/kubevirt.md, "Where a VM's GPUs come from"). Capacity,
drain notices and promises, pending restarts, the console and the GPU rules all read that
one set, card for card."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.core.tables import USAGE, VMIS, VMS
from handlers.reads.views import vm_badge
from handlers.rules.gpus import desired_vm, template_devices
from handlers.rules.policy import apply_patch
from handlers.rules.restarts import pending_detail
from samples.cluster import (
    A100,
    RTX,
    instancetype_revision,
    node,
    vm,
    vmi,
    with_devices,
    with_instancetype,
)
from tests.support.harness import Harness

ALICE, OPS = "alice@example.com", "ops@example.com"
NIC = "intel.com/sriov_vf"  # a host device that is no GPU
NS = "spx-proj-a"
REVISION = "gpu-1-u1-gpu-v1beta1-uid-1"


def instancetype_vm(name: str = "gpu-1", *, gpus: list[str], run_strategy: str = "Always",
                    revision: str | None = REVISION) -> dict[str, Any]:
    """A VM of instance type u1-gpu, as virt-controller leaves it once it stored the revision."""
    return with_instancetype(vm(NS, name, project="proj-a", owner=ALICE, run_strategy=run_strategy,
                                gpu=None), "u1-gpu", revision=revision)


def the_revision(name: str = "gpu-1", *, gpus: list[str] | None = None, host_devices: list[str] | None = None,
                 cpu_model: str | None = "host-passthrough") -> dict[str, Any]:
    return instancetype_revision(NS, name, REVISION, instancetype="u1-gpu", gpus=gpus,
                                 host_devices=host_devices, cpu_model=cpu_model)


def running(name: str, *, node_name: str = "gpu-node-1", gpus: list[str] | None = None,
            host_devices: list[str] | None = None, generation: int = 1) -> dict[str, Any]:
    """The VMI KubeVirt makes: the template's devices, or the instance type's (ApplyToVMI)."""
    return with_devices(vmi(NS, name, node_name=node_name, cpu_model="host-passthrough", generation=generation),
                        gpus=gpus or [], host_devices=host_devices or [])


def drain(h: Harness, node_name: str = "gpu-node-1", *, notice: int = 600) -> None:
    h.intent("drain_node", {"node": node_name, "reason": "firmware", "notice_seconds": notice}, by=OPS, project=None)
    h.observe(node(node_name, gpus={RTX: 8, A100: 8}, unschedulable=True, rv=2), "MODIFIED")


# ------------------------------------------------------------------ the instance type's GPUs


def test_a_vm_whose_gpu_comes_from_its_instancetype_is_not_told_it_loses_it_after_restart() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), the_revision(gpus=[RTX]), instancetype_vm(gpus=[RTX]),
                  running("gpu-1", gpus=[RTX]))
    assert h.notifications("gpu_change_pending_restart") == []
    record = h.state.get(VMS, f"vm/{NS}/gpu-1")
    assert record is not None and record.gpu_devices == (RTX,)
    badge = vm_badge(h.state, h.engine.catalog, NS, "gpu-1")
    assert badge is not None and badge.waits_for is None
    assert [g.device_name for g in badge.gpus_after_restart] == [g.device_name for g in badge.gpus_now] == [RTX]


def test_a_vm_seen_before_its_instancetype_is_told_nothing_until_the_revision_shows_its_gpus() -> None:
    """Three watches, three orders: the VM and its VMI may come before the revision."""
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), instancetype_vm(gpus=[RTX]), running("gpu-1", gpus=[RTX]))
    assert h.notifications("gpu_change_pending_restart") == []
    h.observe(the_revision(gpus=[RTX]))
    assert h.notifications("gpu_change_pending_restart") == []
    record = h.state.get(VMS, f"vm/{NS}/gpu-1")
    assert record is not None and record.gpu_devices == (RTX,) and record.gpus_known


def test_an_instancetype_changed_after_the_vm_stored_it_changes_nothing_for_the_vm() -> None:
    """KubeVirt applies the revision it stored, not the instance type as it is now: a second
    revision (another VM's, or one the VM does not name) is not this VM's."""
    h = Harness()
    other = instancetype_revision(NS, "gpu-1", "gpu-1-u1-gpu-v1beta1-uid-2", instancetype="u1-gpu", gpus=[RTX, RTX])
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), the_revision(gpus=[RTX]), other, instancetype_vm(gpus=[RTX]),
                  running("gpu-1", gpus=[RTX]))
    assert h.notifications("gpu_change_pending_restart") == []


def test_a_new_revision_named_by_the_vm_is_a_gpu_change_that_waits_for_the_restart() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), the_revision(gpus=[RTX]), instancetype_vm(gpus=[RTX]),
                  running("gpu-1", gpus=[RTX]))
    bigger = "gpu-1-u1-gpu-2-v1beta1-uid-3"
    h.observe(instancetype_revision(NS, "gpu-1", bigger, instancetype="u1-gpu-2", gpus=[RTX, RTX]))
    moved = with_instancetype(vm(NS, "gpu-1", project="proj-a", owner=ALICE, rv=2), "u1-gpu-2", revision=bigger)
    h.observe(moved, "MODIFIED")
    [told] = h.notifications("gpu_change_pending_restart")
    assert "will have GPUs 2 × NVIDIA RTX PRO 6000 Blackwell Server Edition after its next restart" in told.message


def test_set_gpu_on_a_vm_whose_gpus_come_from_its_instancetype_or_host_devices_is_refused() -> None:
    h = Harness()
    h.observe_all(the_revision(gpus=[RTX]), instancetype_vm(gpus=[RTX]),
                  with_devices(vm(NS, "host-1", project="proj-a", owner=ALICE, gpu=None), host_devices=[A100]))
    results = [h.intent("set_gpu", {"namespace": NS, "name": name, "gpu_class": "nvidia-a100"})
               for name in ("gpu-1", "host-1")]
    reasons = [n.details["reason"] for n in h.notifications("intent_rejected")]
    assert "takes its GPUs from its instance type u1-gpu" in reasons[0]
    assert "passes its GPUs as hostDevices" in reasons[1]
    assert [r.decision.commands for r in results] == [[], []]


def test_an_instancetype_that_sets_another_cpu_model_is_told_not_patched() -> None:
    """applyCPU: the instance type's cpu.model and the VM's conflict; vmstream says why it
    cannot give the VM host-passthrough, and sets only what it may."""
    h = Harness()
    h.observe_all(the_revision(gpus=[RTX], cpu_model="Haswell-noTSX"), instancetype_vm(gpus=[RTX]))
    [told] = h.notifications("gpu_rules_applied")
    assert "it cannot change CPU model Haswell-noTSX instead of host-passthrough" in told.message
    assert told.severity == "warning"
    assert all("/cpu" not in op["path"] for c in h.commands("patch_vm") for op in c.patch or [])


# ------------------------------------------------------------------ GPUs as host devices


def test_a_gpu_passed_as_a_host_device_counts_for_capacity_and_drains() -> None:
    h = Harness()
    host_vm = with_devices(vm(NS, "host-1", project="proj-a", owner=ALICE, gpu=None), host_devices=[A100, NIC])
    host_vm["spec"]["template"]["spec"]["domain"]["cpu"]["model"] = "host-passthrough"
    host_vm["spec"]["template"]["spec"]["evictionStrategy"] = "External"
    host_vm["spec"]["template"]["spec"]["domain"]["resources"] = {"requests": {"memory": "16Gi"}}
    h.observe_all(node("gpu-node-1", gpus={A100: 1}), node("gpu-node-2", gpus={A100: 1}), host_vm,
                  running("host-1", host_devices=[A100, NIC]))
    usage = h.state.get(USAGE, "gpu-node-1")
    assert usage is not None and usage.held == {A100: 1}
    drain(h)
    [told] = h.notifications("drain_will_stop_gpu_vm")
    assert told.recipients == [ALICE] and told.details["outcome"] == "returns_automatically"
    assert [g["device_name"] for g in told.details["gpus"]] == [A100]
    assert h.notifications("gpu_rules_applied") == []  # it follows the rules


def test_a_host_device_gpu_without_the_rules_gets_them_and_keeps_its_devices() -> None:
    h = Harness()
    h.observe(with_devices(vm(NS, "host-1", project="proj-a", owner=ALICE, gpu=None), host_devices=[A100, A100]))
    [told] = h.notifications("gpu_rules_applied")
    assert "has GPUs 2 × nvidia-a100" in told.message
    [command] = h.commands("patch_vm")
    assert command.mutation is not None and command.mutation.devices == [A100, A100]
    patched = apply_patch(h.vm_object(NS, "host-1"), command.patch or [])
    assert template_devices(patched) == [A100, A100]
    assert patched["spec"]["template"]["spec"]["domain"]["cpu"]["model"] == "host-passthrough"
    # The applier planning it again on a VM whose devices changed meanwhile leaves it alone.
    changed = with_devices(h.vm_object(NS, "host-1"), host_devices=[A100])
    assert desired_vm(changed, command.mutation) is changed


# ------------------------------------------------------------------ several GPUs


def two_gpu_vm(name: str, *, node_name: str = "gpu-node-1") -> list[dict[str, Any]]:
    return [with_devices(vm(NS, name, project="proj-a", owner=ALICE, gpu=RTX), gpus=[RTX, RTX]),
            running(name, node_name=node_name, gpus=[RTX, RTX])]


def test_a_two_gpu_vm_is_not_promised_a_return_on_one_free_card_on_each_of_two_nodes() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), node("gpu-node-2", gpus={RTX: 1}),
                  node("gpu-node-3", gpus={RTX: 1}), *two_gpu_vm("big-1"))
    drain(h)
    [told] = h.notifications("drain_will_stop_gpu_vm")
    assert told.details["outcome"] == "waits_for_gpu"
    assert "GPUs 2 × NVIDIA RTX PRO 6000 Blackwell Server Edition free on one node" in told.message
    assert "free now on the other nodes: 2 NVIDIA RTX PRO 6000" in told.message


def test_a_two_gpu_vm_is_promised_a_return_when_one_node_has_both_cards() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), node("gpu-node-2", gpus={RTX: 2}), *two_gpu_vm("big-1"))
    drain(h)
    [told] = h.notifications("drain_will_stop_gpu_vm")
    assert told.details["outcome"] == "returns_automatically"


def test_a_one_gpu_vm_beside_a_two_gpu_one_is_promised_only_what_whatever_the_scheduler_does_leaves() -> None:
    """Three free cards, two on one node: the one-card VM may take one of the pair, and the
    two-card VM is then left with cards on two nodes. Neither is promised."""
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 3}), node("gpu-node-2", gpus={RTX: 2}),
                  node("gpu-node-3", gpus={RTX: 1}), *two_gpu_vm("big-1"),
                  vm(NS, "small-1", project="proj-a", owner=ALICE, gpu=RTX), running("small-1", gpus=[RTX]))
    drain(h)
    told = {n.subject.name: n.details["outcome"] for n in h.notifications("drain_will_stop_gpu_vm")}
    assert told == {"big-1": "waits_for_gpu", "small-1": "returns_automatically"}


def test_a_vm_with_gpus_of_two_classes_needs_both_on_one_node() -> None:
    h = Harness()
    mixed = with_devices(vm(NS, "mixed-1", project="proj-a", owner=ALICE, gpu=RTX), gpus=[RTX], host_devices=[A100])
    h.observe_all(node("gpu-node-1", gpus={RTX: 1, A100: 1}), node("gpu-node-2", gpus={RTX: 1}),
                  node("gpu-node-3", gpus={A100: 1}), mixed, running("mixed-1", gpus=[RTX], host_devices=[A100]))
    drain(h)
    [told] = h.notifications("drain_will_stop_gpu_vm")
    assert told.details["outcome"] == "waits_for_gpu"


# ------------------------------------------------------------------ one set for everyone

DEVICES = st.lists(st.sampled_from([RTX, A100]), max_size=2)
HOSTS = st.lists(st.sampled_from([RTX, A100, NIC]), max_size=2)


@st.composite
def gpu_vms(draw: st.DrawFn) -> tuple[list[str], list[str], list[str] | None, list[str] | None, int]:
    """Template gpus and hostDevices, and an instance type's (None: no instance type) — never
    both sides of one kind: KubeVirt refuses the conflict (applyGPUs, applyHostDevices)."""
    gpus, hosts = draw(DEVICES), draw(HOSTS)
    uses = draw(st.booleans())
    it_gpus = draw(DEVICES) if uses and not gpus else ([] if uses else None)
    it_hosts = draw(HOSTS) if uses and not hosts else ([] if uses else None)
    return gpus, hosts, it_gpus, it_hosts, draw(st.integers(0, 5))


@settings(max_examples=80, deadline=None)
@given(gpu_vms(), st.permutations(["revision", "vm", "vmi"]))
def test_capacity_promises_pending_restarts_drain_notices_and_the_console_see_one_gpu_set(
        case: tuple[list[str], list[str], list[str] | None, list[str] | None, int], order: list[str]) -> None:
    gpus, hosts, it_gpus, it_hosts, spare = case
    vm_obj = with_devices(vm(NS, "v-1", project="proj-a", owner=ALICE, gpu=None), gpus=gpus, host_devices=hosts)
    objects: dict[str, dict[str, Any] | None] = {"revision": None}
    if it_gpus is not None:
        with_instancetype(vm_obj, "u1-gpu", revision=REVISION)
        objects["revision"] = the_revision("v-1", gpus=it_gpus, host_devices=it_hosts)
    objects["vm"] = vm_obj
    objects["vmi"] = running("v-1", gpus=gpus or it_gpus or [], host_devices=hosts or it_hosts or [])
    expected = tuple(sorted(d for d in [*gpus, *hosts, *(it_gpus or []), *(it_hosts or [])] if d != NIC))

    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 8, A100: 8}), node("gpu-node-2", gpus={RTX: spare, A100: spare}))
    for kind in order:
        obj = objects[kind]
        if obj is not None:
            h.observe(obj)

    key = f"vm/{NS}/v-1"
    record, running_vmi = h.state.get(VMS, key), h.state.get(VMIS, key)
    assert record is not None and running_vmi is not None
    assert record.gpu_devices == running_vmi.gpu_devices == expected  # the VM and its VMI
    usage = h.state.get(USAGE, "gpu-node-1")
    assert Counter(usage.held if usage else {}) == Counter(expected)  # capacity
    assert h.notifications("gpu_change_pending_restart") == [] and pending_detail(h.state, key) is None
    badge = vm_badge(h.state, h.engine.catalog, NS, "v-1")  # the console
    assert badge is not None and badge.waits_for is None
    assert tuple(g.device_name for g in badge.gpus_now) == tuple(g.device_name for g in badge.gpus_after_restart) \
        == expected
    for command in h.commands("patch_vm"):  # the GPU rules change no device
        patched = apply_patch(h.vm_object(NS, "v-1"), command.patch or [])
        assert template_devices(patched) == template_devices(vm_obj)
        assert (patched["spec"]["template"]["spec"]["domain"]["devices"].get("gpus")
                == vm_obj["spec"]["template"]["spec"]["domain"]["devices"].get("gpus"))
        model = patched["spec"]["template"]["spec"]["domain"].get("cpu", {}).get("model")
        assert (model or "host-passthrough") == "host-passthrough"  # else the instance type's
    assert bool(h.commands("patch_vm")) == bool(expected)  # the rules, for every GPU VM (none has its strategy)

    drain(h)  # the drain notice and its promise
    told = h.notifications("drain_will_stop_gpu_vm")
    if not expected:
        assert told == []
        return
    [notice] = told
    assert tuple(g["device_name"] for g in notice.details["gpus"]) == expected
    needed = Counter(expected)
    fits = all(spare >= count for count in needed.values())
    assert notice.details["outcome"] == ("returns_automatically" if fits else "waits_for_gpu")
