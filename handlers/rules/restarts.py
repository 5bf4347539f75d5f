"""Pending restarts: a GPU change waits for the VM's next boot.

KubeVirt never touches a running VMI's GPUs, so a GPU change *applies after a restart*. It
is pending while a live VMI runs with other GPUs than the VM's template — Superphenix's
console compares the same. The owner is told once per GPU change (per running VMI and
wanted GPUs); a restart or a stop ends it.

KubeVirt's ``RestartRequired`` condition is neither needed nor enough: it is set for any
change that is not live-updatable (cores, memory, disks), which is no GPU notice; and it is
cleared only after the new VMI exists — ``startVMI`` in pkg/virt-controller/watch/vm/vm.go
drops it (``cleanupRestartRequired``) from the VM it then creates the VMI for, and the VM's
status is written after — so the watch shows the new VMI, already with the GPU, while the VM
still says ``RestartRequired``. That VMI ends the episode.
"""

from __future__ import annotations

from dataclasses import replace

from handlers.contracts import ids
from handlers.core.cluster import VMIRecord, VMRecord, describe_gpus
from handlers.core.decisions import Context, vm_subject
from handlers.core.outcomes import ACCEPTED, Accepted, Refused
from handlers.core.state import StateView, put_tracking, tracking_of
from handlers.core.tables import TRACKING, VMIS, VMS

# ``RestartVMRequestHandler`` (pkg/virt-api/rest/lifecycle.go) refuses these (409).
RESTART_REFUSED = {
    "Halted": "its run strategy is Halted: start it instead",
    "Once": "its run strategy is Once: KubeVirt refuses to restart it; stop it and start it again "
            "(the stop makes its run strategy Halted, the start then Always)",
}


def how_it_applies(vm: VMRecord) -> str:
    """When a GPU change of a running VM takes effect, by what KubeVirt lets it do.

    ``RestartVMRequestHandler`` restarts Always, RerunOnFailure and Manual VMs, and refuses
    Once and Halted (409). A Once VM is started again by nobody — ``StartVMRequestHandler``
    refuses it too, and ``syncRunStrategy`` leaves its ended VMI off — until a stop makes it
    Halted (``StopVMRequestHandler``: ``getRunningPatch(vm, false)``) and a start then Always.
    """
    if vm.run_strategy == "Once":
        return ("the next time it starts. KubeVirt does not restart a VM of run strategy Once (it refuses a "
                "restart, and a start): the change takes effect once it is stopped and started again — the stop "
                "makes its run strategy Halted, the start then Always")
    return "after its next restart"



def change_pending(vm: VMRecord, vmi: VMIRecord | None) -> bool:
    """A GPU change waits for a restart: a live VMI runs with other GPUs than the VM's next
    one gets (its template's and its instance type's, card for card). Not while the VM's
    instance type is unknown: then nobody knows what its next VMI gets."""
    if vmi is None or not vmi.active or not vm.gpus_known:
        return False
    return vm.gpu_devices != vmi.gpu_devices


def reconcile_pending(ctx: Context, vm: VMRecord) -> None:
    """Tell the owner once that a change waits for a restart; forget it once it doesn't."""
    vmi = ctx.state.get(VMIS, vm.key)
    tracking = tracking_of(ctx.state, vm.key)
    if not change_pending(vm, vmi):
        if tracking.pending_episode is not None:
            put_tracking(ctx.state, vm.key, replace(tracking, pending_episode=None))
        return
    assert vmi is not None
    episode = ids.episode_id(vm.key, vmi.uid, *vm.gpu_devices)
    if tracking.pending_episode == episode:
        return
    running = [ctx.catalog.for_device(d).display_name for d in vmi.gpu_devices]
    now_text = describe_gpus(vm.gpu_devices, lambda d: ctx.catalog.for_device(d).display_name)
    ctx.notify(
        "gpu_change_pending_restart",
        subject=vm_subject(vm.key),
        episode=episode,
        recipients=vm.recipients(),
        project=vm.project,
        severity="info",
        message=(
            f"VM {vm.namespace}/{vm.name} will have {now_text} {how_it_applies(vm)}; "
            "until then it keeps running as it is."
        ),
        details={
            "desired_gpus": [ctx.catalog.for_device(d).describe() for d in vm.gpu_devices],
            "running_gpus": [ctx.catalog.for_device(d).describe() for d in vmi.gpu_devices],
            "running_gpu_names": running,
            "restart_required_condition": vm.restart_required,
            "restart_possible": vm.run_strategy not in RESTART_REFUSED,
        },
    )
    put_tracking(ctx.state, vm.key, replace(tracking, pending_episode=episode))


def pending_detail(state: StateView, key: str) -> dict[str, object] | None:
    """What waits for a restart on VM ``key``, as the owner was told; None if nothing."""
    tracking = state.get(TRACKING, key)
    vm = state.get(VMS, key)
    if tracking is None or tracking.pending_episode is None or vm is None:
        return None
    vmi = state.get(VMIS, key)
    return {
        "vm": key,
        "episode": tracking.pending_episode,
        "desired_gpus": list(vm.gpu_devices),
        "running_gpus": list(vmi.gpu_devices) if vmi else [],
        "restart_required_condition": vm.restart_required,
    }


def restart_judgement(vm: VMRecord, vmi: VMIRecord | None) -> Accepted | Refused:
    """Whether a restart of ``vm`` may go ahead, and if not, why — as virt-api judges it
    (``RestartVMRequestHandler``): refused for Halted and Once, and without a VMI ("VM is not
    running"); a VMI that ended and is still there (a Manual VM whose guest shut down) is
    restarted: virt-api sends a stop request for it and a start request."""
    if vm.run_strategy in RESTART_REFUSED:
        return Refused(f"cannot restart VM {vm.namespace}/{vm.name}: {RESTART_REFUSED[vm.run_strategy]}")
    if vmi is None:
        return Refused(f"cannot restart VM {vm.namespace}/{vm.name}: it is not running")
    return ACCEPTED

