"""Pending restarts and GPU availability: what the owner is told about a VM's own state,
each fact once per episode."""

from __future__ import annotations

from typing import Any

from handlers.core.tables import TRACKING
from samples.cluster import A100, RTX, node, vm, vmi
from tests.support.harness import Harness

ALICE = "alice@example.com"


def running_vm(**vm_kwargs: Any) -> Harness:
    h = Harness()
    h.observe_all(
        node("gpu-node-1", gpus={RTX: 1}),
        vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, **vm_kwargs),
        vmi("spx-proj-a", "w-1", node_name="gpu-node-1"),
    )
    return h


def test_gpu_change_on_a_running_vm_tells_the_owner_it_applies_after_restart() -> None:
    h = running_vm()
    result = h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "w-1", "gpu_class": "nvidia-a100"})
    [told] = result.decision.notifications
    assert told.type == "gpu_change_pending_restart"
    assert told.recipients == [ALICE]
    assert "after its next restart" in told.message
    assert told.details["desired_gpus"][0]["device_name"] == A100


def test_gpu_change_on_a_stopped_vm_is_not_pending() -> None:
    h = Harness()
    h.observe(vm("spx-proj-a", "s-1", project="proj-a", owner=ALICE, run_strategy="Manual"))
    result = h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "s-1", "gpu_class": "nvidia-a100"})
    assert result.decision.notifications == []


def test_the_owner_is_told_once_when_the_watch_catches_up() -> None:
    h = running_vm()
    h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "w-1", "gpu_class": "nvidia-a100"})
    patched = vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=A100, rv=2)
    h.observe(patched, "MODIFIED")
    h.observe(patched, "MODIFIED")
    assert len(h.notifications("gpu_change_pending_restart")) == 1


def test_a_change_seen_only_on_the_watch_is_told_too() -> None:
    """A GPU added by someone else (kubectl) is pending just the same."""
    h = running_vm()
    h.observe(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=RTX, rv=2), "MODIFIED")
    assert len(h.notifications("gpu_change_pending_restart")) == 1


def test_a_restart_with_the_new_spec_clears_the_pending_state() -> None:
    h = running_vm()
    h.observe(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=RTX, rv=2), "MODIFIED")
    assert h.state.get(TRACKING, "vm/spx-proj-a/w-1") is not None
    h.observe(vmi("spx-proj-a", "w-1", node_name="gpu-node-1", phase="Succeeded"), "DELETED")
    h.observe(vmi("spx-proj-a", "w-1", node_name="gpu-node-1", gpu=RTX, cpu_model="host-passthrough", generation=2))
    assert h.state.get(TRACKING, "vm/spx-proj-a/w-1") is None
    # A later change is a new episode: told again.
    h.observe(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=A100, rv=3), "MODIFIED")
    assert len(h.notifications("gpu_change_pending_restart")) == 2


def test_pending_detail_says_what_waits_for_the_restart() -> None:
    from handlers.rules.restarts import pending_detail

    h = running_vm()
    assert pending_detail(h.state, "vm/spx-proj-a/w-1") is None
    h.observe(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=RTX, rv=2), "MODIFIED")
    detail = pending_detail(h.state, "vm/spx-proj-a/w-1")
    assert detail is not None and detail["desired_gpus"] == [RTX] and detail["running_gpus"] == []


def test_a_stop_clears_the_pending_state() -> None:
    h = running_vm()
    h.observe(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=RTX, rv=2), "MODIFIED")
    h.observe(vmi("spx-proj-a", "w-1", node_name="gpu-node-1", phase="Succeeded"), "MODIFIED")
    assert h.state.get(TRACKING, "vm/spx-proj-a/w-1") is None


def restart_required(obj: dict[str, Any]) -> dict[str, Any]:
    obj["status"] = {"conditions": [{"type": "RestartRequired", "status": "True"}]}
    return obj


def test_restart_required_for_another_change_is_no_gpu_notice() -> None:
    """Memory, cores, disks: KubeVirt's RestartRequired, but no GPU waits for the restart."""
    h = running_vm()
    h.observe(restart_required(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, memory="32Gi", rv=2)),
              "MODIFIED")
    h.observe(restart_required(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, cores=8, rv=3)), "MODIFIED")
    assert h.notifications("gpu_change_pending_restart") == []


def test_the_new_vmi_with_the_gpu_ends_the_episode_before_kubevirt_clears_restart_required() -> None:
    """vm.go clears RestartRequired with the VM's status after the new VMI is created: the
    watch shows the new VMI (with the GPU) while the VM still says RestartRequired."""
    h = running_vm()
    h.intent("set_gpu", {"namespace": "spx-proj-a", "name": "w-1", "gpu_class": "nvidia-rtx-pro-6000-bse"})
    patched = restart_required(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=RTX, rv=2))
    h.observe(patched, "MODIFIED")
    h.observe(vmi("spx-proj-a", "w-1", node_name="gpu-node-1", phase="Succeeded"), "DELETED")
    h.observe(vmi("spx-proj-a", "w-1", node_name="gpu-node-1", gpu=RTX, cpu_model="host-passthrough",
                  generation=2))
    h.observe(patched, "MODIFIED")
    assert len(h.notifications("gpu_change_pending_restart")) == 1
    assert h.state.get(TRACKING, "vm/spx-proj-a/w-1") is None
    h.observe(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=RTX, rv=3), "MODIFIED")
    assert len(h.notifications("gpu_change_pending_restart")) == 1


def test_a_cpu_model_change_alone_is_no_gpu_notice() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 1}),
                  vm("spx-proj-a", "g-1", project="proj-a", owner=ALICE, gpu=RTX),
                  vmi("spx-proj-a", "g-1", node_name="gpu-node-1", gpu=RTX))  # runs a named CPU model
    assert h.notifications("gpu_change_pending_restart") == []


def test_the_restart_required_condition_is_reported_alongside_a_gpu_change() -> None:
    h = running_vm()
    h.observe(restart_required(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE, gpu=RTX, rv=2)), "MODIFIED")
    [told] = h.notifications("gpu_change_pending_restart")
    assert told.details["restart_required_condition"] is True


def test_without_an_owner_the_project_group_is_told() -> None:
    h = Harness()
    h.observe_all(vm("spx-proj-b", "x-1", project="proj-b"), vmi("spx-proj-b", "x-1", node_name="n"))
    h.observe(vm("spx-proj-b", "x-1", project="proj-b", gpu=RTX, rv=2), "MODIFIED")
    assert h.notifications("gpu_change_pending_restart")[0].recipients == ["project:proj-b"]


# ----------------------------------------------------------------- availability


def unschedulable_gpu_vm(h: Harness, rv: int = 2) -> None:
    h.observe(vm("spx-proj-a", "g-1", project="proj-a", owner=ALICE, gpu=RTX, rv=rv,
                 printable_status="ErrorUnschedulable"), "MODIFIED")


def test_a_gpu_vm_waiting_for_a_card_is_told_with_the_capacity() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 1}), node("gpu-node-2", gpus={RTX: 1}, unschedulable=True),
                  vm("spx-proj-a", "busy", project="proj-a", owner=ALICE, gpu=RTX),
                  vmi("spx-proj-a", "busy", node_name="gpu-node-1", gpu=RTX))
    unschedulable_gpu_vm(h)
    [told] = h.notifications("gpu_unavailable")
    assert told.recipients == [ALICE]
    assert told.details["capacity"] == {"total": 2, "schedulable": 1, "used": 1, "free": 0}
    assert "0 of 2" in told.message


def test_gpu_unavailable_is_told_once_per_episode() -> None:
    h = Harness()
    unschedulable_gpu_vm(h, 1)
    unschedulable_gpu_vm(h, 2)
    assert len(h.notifications("gpu_unavailable")) == 1
    h.observe(vm("spx-proj-a", "g-1", project="proj-a", owner=ALICE, gpu=RTX, rv=3), "MODIFIED")
    unschedulable_gpu_vm(h, 4)
    assert len(h.notifications("gpu_unavailable")) == 2


def test_an_unschedulable_vmi_counts_too() -> None:
    h = Harness()
    h.observe(vm("spx-proj-a", "g-1", project="proj-a", owner=ALICE, gpu=RTX))
    h.observe(vmi("spx-proj-a", "g-1", node_name=None, phase="Scheduling", gpu=RTX, unschedulable=True))
    assert len(h.notifications("gpu_unavailable")) == 1


def test_a_vm_without_gpu_is_never_gpu_unavailable() -> None:
    h = Harness()
    h.observe(vm("spx-proj-a", "c-1", project="proj-a", owner=ALICE, printable_status="ErrorUnschedulable"))
    assert h.notifications("gpu_unavailable") == []
