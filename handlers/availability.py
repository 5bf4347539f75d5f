"""GPU availability: a GPU VM that cannot start because no card of its class is free.

KubeVirt shows it as ``printableStatus: ErrorUnschedulable`` on the VM (and
``PodScheduled=False, reason Unschedulable`` on the VMI). The owner is told once per
episode, with how many cards of the class exist and are free; the episode ends when the
VM is no longer waiting.
"""

from __future__ import annotations

from dataclasses import replace

from handlers import ids
from handlers.capacity import capacity
from handlers.cluster import VMIRecord, VMRecord
from handlers.decisions import Context, vm_subject
from handlers.state import put_tracking, tracking_of
from handlers.tables import VMIS


def waiting_for_gpu(vm: VMRecord, vmi: VMIRecord | None) -> bool:
    if not vm.has_gpu:
        return False
    if vm.printable_status == "ErrorUnschedulable":
        return True
    return vmi is not None and vmi.active and vmi.unschedulable


def reconcile_availability(ctx: Context, vm: VMRecord) -> None:
    vmi = ctx.state.get(VMIS, vm.key)
    tracking = tracking_of(ctx.state, vm.key)
    if not waiting_for_gpu(vm, vmi):
        if tracking.unavailable_episode is not None:
            put_tracking(ctx.state, vm.key, replace(tracking, unavailable_episode=None))
        return
    if tracking.unavailable_episode is not None:
        return
    episode = ids.episode_id(vm.key, "gpu_unavailable", ctx.cause)
    gpu = ctx.catalog.for_device(vm.gpu_devices[0])
    cards = capacity(ctx.state, gpu.device_name)
    ctx.notify(
        "gpu_unavailable",
        subject=vm_subject(vm.key),
        episode=episode,
        recipients=vm.recipients(),
        project=vm.project,
        severity="warning",
        message=(
            f"VM {vm.namespace}/{vm.name} is waiting for a free {gpu.display_name}: "
            f"{cards.free} of {cards.total} in this AZ are free; it starts as soon as one is."
        ),
        details={"gpu": gpu.describe(), "capacity": cards.as_details()},
    )
    put_tracking(ctx.state, vm.key, replace(tracking, unavailable_episode=episode))

