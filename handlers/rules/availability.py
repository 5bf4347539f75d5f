"""GPU availability: a GPU VM that cannot start because no card of its class is free.

KubeVirt shows it as ``printableStatus: ErrorUnschedulable`` on the VM (and
``PodScheduled=False, reason Unschedulable`` on the VMI). The owner is told once per
episode, with how many cards of the class exist and are free; the episode ends when the
VM is no longer waiting.
"""

from __future__ import annotations

from dataclasses import replace

from handlers.contracts import ids
from handlers.core.cluster import VMIRecord, VMRecord, describe_gpus
from handlers.core.decisions import Context, vm_subject
from handlers.core.state import put_tracking, tracking_of
from handlers.core.tables import VMIS
from handlers.rules.capacity import capacity


def wanted_gpus(vm: VMRecord, vmi: VMIRecord | None) -> tuple[str, ...]:
    """The GPUs the VM waits for: its pending VMI's (KubeVirt made it with all of them), else
    what its next VMI gets."""
    if vmi is not None and vmi.active:
        return vmi.gpu_devices
    return vm.gpu_devices


def waiting_for_gpu(vm: VMRecord, vmi: VMIRecord | None) -> bool:
    if not wanted_gpus(vm, vmi):
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
    wanted = wanted_gpus(vm, vmi)
    devices = sorted(set(wanted))
    gpu = ctx.catalog.for_device(devices[0])
    cards = {device: capacity(ctx.state, device) for device in devices}
    if len(wanted) == 1:
        message = (f"VM {vm.namespace}/{vm.name} is waiting for a free {gpu.display_name}: "
                   f"{cards[gpu.device_name].free} of {cards[gpu.device_name].total} in this AZ are free; "
                   "it starts as soon as one is.")
    else:
        counts = "; ".join(f"{cards[d].free} of {cards[d].total} {ctx.catalog.for_device(d).display_name} free"
                           for d in devices)
        message = (f"VM {vm.namespace}/{vm.name} is waiting for "
                   f"{describe_gpus(wanted, lambda d: ctx.catalog.for_device(d).display_name)} on one node: "
                   f"in this AZ {counts}; it starts as soon as one node has all of them free.")
    ctx.notify(
        "gpu_unavailable",
        subject=vm_subject(vm.key),
        episode=episode,
        recipients=vm.recipients(),
        project=vm.project,
        severity="warning",
        message=message,
        details={"gpu": gpu.describe(), "capacity": cards[gpu.device_name].as_details(),
                 "gpus": [ctx.catalog.for_device(d).describe() for d in wanted],
                 "capacities": {d: cards[d].as_details() for d in devices}},
    )
    put_tracking(ctx.state, vm.key, replace(tracking, unavailable_episode=episode))

