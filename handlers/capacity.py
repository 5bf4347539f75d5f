"""GPU capacity per device: how many cards exist, are held, and are free.

Free cards of a device = over schedulable nodes (Ready, not cordoned), allocatable minus the
cards held by VMIs that have not ended on that node. Everything here reads state; nothing
is stored, so capacity can never drift from the cluster it is computed from.
"""

from __future__ import annotations

from dataclasses import dataclass

from handlers.cluster import NodeRecord
from handlers.state import StateView


@dataclass(frozen=True, slots=True)
class Capacity:
    device_name: str
    total: int  # on every node, schedulable or not
    schedulable: int  # on schedulable nodes
    used: int  # held on schedulable nodes
    free: int

    def as_details(self) -> dict[str, int]:
        return {"total": self.total, "schedulable": self.schedulable, "used": self.used, "free": self.free}


def held_on(state: StateView, node: str, device_name: str) -> int:
    return sum(
        vmi.gpu_devices.count(device_name) for vmi in state.vmis_on_node(node) if vmi.active
    )


def free_on(state: StateView, node: NodeRecord, device_name: str) -> int:
    if not node.schedulable:
        return 0
    allocatable = node.gpu_allocatable.get(device_name, 0)
    return max(0, allocatable - held_on(state, node.name, device_name)) if allocatable else 0


def capacity(state: StateView, device_name: str, *, excluding_node: str | None = None) -> Capacity:
    """Capacity of ``device_name``, optionally as seen from outside one node (a drain)."""
    total = schedulable = used = free = 0
    for node in state.values("nodes"):
        allocatable = node.gpu_allocatable.get(device_name, 0)
        if not allocatable or node.name == excluding_node:
            continue
        total += allocatable
        if node.schedulable:
            held = held_on(state, node.name, device_name)
            schedulable += allocatable
            used += min(held, allocatable)
            free += max(0, allocatable - held)
    return Capacity(device_name, total, schedulable, used, free)
