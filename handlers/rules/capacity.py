"""GPU capacity per device: how many cards exist, are held, and are free.

Free cards of a device = over schedulable nodes (Ready, not cordoned), allocatable minus
the cards held by GPU VMIs there. Each node's :class:`~handlers.core.cluster.NodeUsage` is kept
by that node's decisions (:func:`refresh_usage`); capacity sums them, so every worker
instance can answer for the whole AZ.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from handlers.core.catalog import Catalog
from handlers.core.cluster import Claim, NodeUsage, UsageVM
from handlers.core.state import DrainEpisode, Overlay, StateView, UsageTotals
from handlers.core.tables import DRAINS, NODES, RESIDENTS, USAGE
from handlers.rules.admission import permitted


@dataclass(frozen=True, slots=True)
class Capacity:
    device_name: str
    total: int  # on every node, schedulable or not
    schedulable: int  # on schedulable nodes
    used: int  # held on schedulable nodes
    free: int

    def as_details(self) -> dict[str, int]:
        return {"total": self.total, "schedulable": self.schedulable, "used": self.used, "free": self.free}


def capacity(state: StateView, device_name: str, *, excluding_node: str | None = None) -> Capacity:
    """Capacity of ``device_name``, optionally as seen from outside one node (a drain).

    Over a state that keeps :class:`~handlers.core.state.UsageTotals` (``MemoryState``, and a
    decision's :class:`~handlers.core.state.Overlay` on it), the sums kept along, corrected by
    the nodes this decision changed and the one excluded; else a pass over every node.
    """
    indexed = _indexed(state, device_name, excluding_node)
    if indexed is not None:
        return indexed
    total = schedulable = used = free = 0
    for usage in state.values(USAGE):
        allocatable = usage.allocatable.get(device_name, 0)
        if not allocatable or usage.node == excluding_node:
            continue
        total += allocatable
        if usage.schedulable:
            schedulable += allocatable
            used += min(usage.held.get(device_name, 0), allocatable)
            free += usage.free(device_name)
    return Capacity(device_name, total, schedulable, used, free)


def _indexed(state: StateView, device_name: str, excluding_node: str | None) -> Capacity | None:
    base, own = (state.base, state.changed(USAGE)) if isinstance(state, Overlay) else (state, {})
    totals: UsageTotals | None = getattr(base, "usage_totals", None)
    if totals is None:
        return None
    sums = list(totals.get(device_name))
    corrections = dict(own)
    if excluding_node is not None:
        corrections[excluding_node] = None
    for node, usage in corrections.items():
        before, after = UsageTotals.share(base.get(USAGE, node), device_name), UsageTotals.share(usage, device_name)
        for i in range(4):
            sums[i] += after[i] - before[i]
    return Capacity(device_name, *sums)


def free_on_nodes(state: StateView, devices: Iterable[str], *, excluding_node: str | None = None) -> list[dict[str, int]]:
    """The free cards of ``devices`` on each schedulable node (but one), where any is free."""
    wanted = set(devices)
    found = []
    for usage in state.values(USAGE):
        if usage.node == excluding_node or not usage.schedulable:
            continue
        free = {device: usage.free(device) for device in wanted if usage.free(device) > 0}
        if free:
            found.append(free)
    return found


def surely_placed(state: StateView, demand: Mapping[str, int], competing: Mapping[str, int], *,
                  excluding_node: str | None = None) -> bool:
    """Whether a VM that needs ``demand`` (cards by device, all on one node, as KubeVirt's
    launcher pod asks for them) finds a node with them free, whatever the scheduler does
    with the other VMs that want cards now, ``competing`` in all (by device).

    A node serves the VM while it has ``demand[d]`` free of each of its devices ``d``. To
    leave it none, the others must take, on every node that could serve it, ``free - demand
    + 1`` cards of one of its devices; holding fewer cards of its devices than that in all,
    they cannot. For VMs of one card each this is: the free cards are at least as many as
    the VMs. Two cards free on two nodes are not two cards for one VM.
    """
    budget = sum(competing.get(device, 0) for device in demand)
    if len(demand) == 1:
        [(device, count)] = demand.items()
        if count == 1:  # any free card serves it: the sums kept along, no pass over the nodes
            return capacity(state, device, excluding_node=excluding_node).free > budget
    cost = 0
    for free in free_on_nodes(state, demand, excluding_node=excluding_node):
        if all(free.get(device, 0) >= count for device, count in demand.items()):
            cost += min(free[device] - count + 1 for device, count in demand.items())
    return cost > budget


def capacity_report(state: StateView, catalog: Catalog) -> dict[str, dict[str, object]]:
    """Every configured class's capacity, plus devices seen on nodes that map to no class.

    ``permitted`` is False for a device KubeVirt will not start a VM with (not in the
    observed KubeVirt CR's ``permittedHostDevices``, handlers/rules/admission.py): its cards are
    counted as they are, but the class is unavailable — an intent for it is refused.
    """
    devices = {d for usage in state.values(USAGE) for d in usage.allocatable}
    devices |= set(catalog.by_device)
    report: dict[str, dict[str, object]] = {}
    for device in sorted(devices):
        gpu = catalog.for_device(device)
        report[gpu.id or device] = {**gpu.describe(), **capacity(state, device).as_details(),
                                    "permitted": permitted(state, device)}
    return report


def drain_claims(episode: DrainEpisode | None) -> tuple[Claim, ...]:
    """The cards a node's drain will want elsewhere: of every VM it announced that KubeVirt
    starts again by itself with GPUs, not yet seen back (or off), from its deadline on."""
    if episode is None or episode.completed or episode.called_off:
        return ()
    claims = []
    for key, fate in sorted(episode.announced.items()):
        gpus = episode.told_gpus.get(key, ())
        if fate != "needs_manual_start" and gpus and episode.observed.get(key) in (None, "waits_for_gpu"):
            claims.append(Claim(key, episode.due.get(key, episode.deadline), gpus))
    return tuple(claims)


def refresh_usage(state: Overlay, node: str) -> tuple[NodeUsage | None, NodeUsage | None]:
    """Recompute one node's usage from its record, its residents and its drain; (before, after)."""
    record = state.get(NODES, node)
    residents = state.get(RESIDENTS, node) or {}
    held: Counter[str] = Counter()
    for resident in residents.values():
        held.update(resident.gpu_devices)
    claims = drain_claims(state.get(DRAINS, node))
    if record is None and not held and not claims:
        usage = None
    else:
        usage = NodeUsage(
            node=node,
            schedulable=record.schedulable if record else False,
            allocatable=dict(record.gpu_allocatable) if record else {},
            held=dict(sorted(held.items())),
            claims=claims,
            vms=tuple(UsageVM.of(residents[key]) for key in sorted(residents) if residents[key].has_vm),
            labels=dict(record.labels) if record else {},
        )
    before = state.get(USAGE, node)
    if usage != before:
        state.put(USAGE, node, usage)
    return before, usage


def tighter(before: NodeUsage | None, after: NodeUsage | None) -> bool:
    """Whether a node's change may break a promise another drain made: a card it had free is
    taken (or the node went unschedulable), or its drain wants cards it did not want before."""
    if after is None:
        return before is not None and any(before.free(d) for d in before.allocatable)
    if before is None:
        return bool(after.claims)
    if set(after.claims) - set(before.claims):
        return True
    return any(after.free(device) < before.free(device) for device in before.allocatable)


def claims_elsewhere(state: StateView, node: str) -> list[Claim]:
    """What the drains of other nodes will want (cluster-wide: the ``usage`` rows)."""
    return [claim for usage in state.values(USAGE) if usage.node != node for claim in usage.claims]


def drained_nodes(state: StateView, *, but: str) -> list[str]:
    """The other nodes whose drains hold claims: their promises may depend on a change here."""
    return sorted(usage.node for usage in state.values(USAGE) if usage.node != but and usage.claims)
