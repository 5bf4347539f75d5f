"""What KubeVirt will refuse, refused up front: a GPU intent is checked against the observed
KubeVirt CR before a command is issued.

intent (set_gpu, create_vm) → :func:`device_refusal` → the requester is told why, nothing is
written. Each check follows KubeVirt's source (docs/kubevirt.md, "Refused up front"):

- a GPU whose device is not in ``permittedHostDevices`` (when that list is set at all, and
  not under the ``GPUsWithDRA`` gate): ``validatePermittedHostDevices`` in
  pkg/virt-controller/services/renderresources.go fails the launcher pod's rendering, so
  the VM would be accepted and then never start (:meth:`~handlers.core.cluster.KubeVirtRecord.permits`);
- a GPU on an instance-type VM under ``memoryOvercommit`` > 100 (``gpu_vm.instancetype_overcommit:
  refuse``): :func:`~handlers.rules.enforcement.unpinned_overcommit`.
"""

from __future__ import annotations

from handlers.core.catalog import GPUClass
from handlers.core.cluster import KubeVirtRecord
from handlers.core.state import KUBEVIRT_KEY, StateView
from handlers.core.tables import KUBEVIRT


def kubevirt_record(state: StateView) -> KubeVirtRecord | None:
    record = state.get(KUBEVIRT, KUBEVIRT_KEY)
    return record


def permitted(state: StateView, device_name: str) -> bool:
    """Whether KubeVirt, as last observed, lets a VM with this GPU start (True while unknown)."""
    record = kubevirt_record(state)
    return record is None or record.permits(device_name)


def device_refusal(state: StateView, gpu: GPUClass) -> str | None:
    if permitted(state, gpu.device_name):
        return None
    return (f"GPU class {gpu.id} ({gpu.device_name}) is not permitted by KubeVirt: its device is not in "
            "the KubeVirt CR's spec.configuration.permittedHostDevices, so a VM with it would never start")
