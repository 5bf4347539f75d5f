"""GPU node maintenance, planned: which node goes when, and what becomes of each GPU VM.

A drain stops the GPU VMs of its node (they cannot live-migrate). Those KubeVirt starts
again by itself (:func:`~handlers.rules.drains.restarts_by_itself`) come back elsewhere only if a
card of their class is free there, so draining several GPU nodes is a question of order:
a node drained while the spare cards cannot take its VMs leaves them waiting, while the
same node drained after another one came back finds that node's cards free.

:func:`plan_maintenance` answers it with a greedy that is easy to follow. At each moment a
node may start (the earliest start, then each end of a node's slot), it starts the nodes
whose VMs all find a card now (in name order, for a plan that is the same every time), as
long as the concurrency limit allows; a node that does not fit waits for the cards the
nodes in maintenance give back when their slot ends. Only when waiting would make the plan
miss its window, or when no node is in maintenance to give cards back, does a node go with
VMs that find no card — the one with the fewest — and the plan says so, per VM, before
anything is stopped.

Cards are reserved, never counted twice: a VM that lands takes its card for good, on a node
outside the plan or on a planned node whose slot has ended (never on one still to go: it
would be stopped a second time). A node that comes back returns every card but those of
the VMs vmstream starts on it again (``after_maintenance="same_node"``).

The guarantee (docs/maintenance.md, and property-tested): no VM waits for a card when

1. every VM that KubeVirt starts again by itself and that is to land elsewhere needs one card,
2. for each class, the free cards outside the plan are at least the cards of that class the
   VMs of any one planned node want elsewhere, and
3. the window, from the later of its earliest start and the plan's publication plus the
   notice, is at least as long as every planned node one after another.

Then, whenever no node is in maintenance, every card a drained node's VMs took is matched
by one of its own given back, so the pool holds at least the spare cards, which fit any one
node (2); some node always fits, the plan never idles, and it ends within the nodes'
durations one after another (3), so it never has to force a node.

Owners answer (:func:`reschedule`, :func:`ready_now`): every change keeps the other
nodes' slots where they are, is refused with a reason if it would leave a VM without the
card it was promised, break the concurrency limit or leave the window, and names the owners
whose notice changed — only those.

:func:`name_order_baseline` is what a plain NodeMaintenance (or Harvester's maintenance
mode) gives, in the same model, for comparison (benchmarks/maintenance_plan.py).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from handlers.core.maintenance import (
    FATES,
    GPUVM,
    AfterMaintenance,
    Fate,
    MaintenancePlan,
    MaintenanceRequest,
    NodeSlot,
    OtherNode,
    PlannedNode,
    Totals,
    VMEntry,
)
from handlers.rules.drains import restarts_by_itself

__all__ = [
    "FATES", "GPUVM", "AfterMaintenance", "Change", "Fate", "MaintenancePlan", "MaintenanceRequest", "NodeSlot",
    "OtherNode", "PlannedNode", "Refusal", "Totals", "VMEntry", "name_order_baseline", "no_wait_guaranteed",
    "plan_maintenance", "ready_now", "reschedule", "resimulated", "wanted_elsewhere",
]

@dataclass(frozen=True, slots=True)
class Change:
    """A plan changed on an owner's answer, and the owners whose notice changed with it."""

    plan: MaintenancePlan
    owners: frozenset[str]


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str


# ------------------------------------------------------------------------------ the model


@dataclass(frozen=True, slots=True)
class _Policy:
    """vmstream's plan, or a plain drain: whether owners' preferences are kept and where a
    restarted VM may land."""

    preferences: bool  # after_maintenance is honoured (vmstream stops and starts the VM)
    on_nodes_to_go: bool  # a VM may land on a planned node still to go (the scheduler does not know)
    pick: Callable[[list[str], Mapping[str, int], Mapping[str, Counter[str]]], str]
    told_ahead: bool  # owners are told at the notice period, not at the drain


def _best_fit(fitting: list[str], demand: Mapping[str, int], free: Mapping[str, Counter[str]]) -> str:
    """The node left with the fewest cards of the VM's classes: large holes stay for large VMs."""
    return min(fitting, key=lambda node: (sum(free[node][c] for c in demand), node))


def _spread(fitting: list[str], demand: Mapping[str, int], free: Mapping[str, Counter[str]]) -> str:
    """The node with the most free cards of the VM's classes, as the scheduler's default
    scoring (LeastAllocated) prefers."""
    return min(fitting, key=lambda node: (-sum(free[node][c] for c in demand), node))


PLANNED = _Policy(preferences=True, on_nodes_to_go=False, pick=_best_fit, told_ahead=True)
PLAIN_DRAIN = _Policy(preferences=False, on_nodes_to_go=True, pick=_spread, told_ahead=False)


def _fits(free: Mapping[str, Counter[str]], demand: Mapping[str, int]) -> list[str]:
    return sorted(node for node, cards in free.items() if all(cards[c] >= n for c, n in demand.items()))


@dataclass
class _Track:
    """One VM's course through a simulation (mutable, local to it)."""

    vm: GPUVM
    node: str
    first_stop: datetime | None = None
    stops: int = 0
    fate: Fate | None = None
    reason: str = ""
    off_since: datetime | None = None
    hours: float = 0.0
    back_at: datetime | None = None
    lands_on: str | None = None


_BACK, _STOP, _GOES = 0, 1, 2  # at one instant, in this order


class _Simulation:
    """The AZ's cards through a plan, event by event: a node's slot starting stops its VMs,
    which take a card where one is free or wait; a slot ending returns the node's cards,
    which the waiting VMs take first, in the order they were stopped. Events are processed
    in time order (at one instant: returns, then early stops, then nodes going), so a card
    is never taken before it is free."""

    def __init__(self, request: MaintenanceRequest, policy: _Policy) -> None:
        self.request, self.policy = request, policy
        self.free: dict[str, Counter[str]] = {other.name: Counter(other.free) for other in request.others}
        if policy.on_nodes_to_go:
            self.free.update({node.name: Counter(node.free) for node in request.nodes})
        self.tracks = {vm.uid: _Track(vm, node.name) for node in request.nodes for vm in node.vms}
        self.residents: dict[str, list[str]] = {node.name: [vm.uid for vm in node.vms] for node in request.nodes}
        self.own: dict[str, list[str]] = {node.name: [] for node in request.nodes}
        self.waiting: list[str] = []
        self.events: list[tuple[datetime, int, str]] = []  # (when, what: _BACK, _STOP or _GOES, whom)
        self.slots: dict[str, NodeSlot] = {}

    def schedule(self, slot: NodeSlot) -> None:
        self.slots[slot.node] = slot
        heapq.heappush(self.events, (slot.end, _BACK, slot.node))
        heapq.heappush(self.events, (slot.start, _GOES, slot.node))

    def stop_early(self, uid: str, at: datetime) -> None:
        heapq.heappush(self.events, (at, _STOP, uid))

    def advance(self, until: datetime) -> None:
        while self.events and self.events[0][0] <= until:
            at, what, name = heapq.heappop(self.events)
            if what == _BACK:
                self._up(name, at)
            elif what == _GOES:
                self._down(name, at)
            else:
                track = self.tracks[name]
                if track.stops == 0 and name in self.residents[track.node]:
                    self.residents[track.node].remove(name)
                    self._stop(track, track.node, at)

    def landing(self, vm: GPUVM) -> bool:
        """Whether this VM would take a card where it goes (else it stays off or comes back home)."""
        if self.policy.preferences and vm.after_maintenance != "elsewhere":
            return False
        return restarts_by_itself(vm.run_strategy) and bool(vm.gpus)

    def would_wait(self, node: str) -> int:
        """How many of the node's VMs would find no card if it went now."""
        free = {name: Counter(cards) for name, cards in self.free.items()}
        waits = 0
        for uid in self._in_order(self.residents[node]):
            vm = self.tracks[uid].vm
            if not self.landing(vm):
                continue
            fitting = _fits(free, vm.gpus)
            if fitting:
                free[self.policy.pick(fitting, vm.gpus, free)].subtract(vm.gpus)
            else:
                waits += 1
        return waits

    def _in_order(self, uids: Iterable[str]) -> list[str]:
        """Largest VMs first, as one packs bins; then by uid, for a plan that is the same every time."""
        return sorted(uids, key=lambda uid: (-self.tracks[uid].vm.cards, uid))

    def _take(self, track: _Track, at: datetime) -> bool:
        fitting = _fits(self.free, track.vm.gpus)
        if not fitting:
            return False
        node = self.policy.pick(fitting, track.vm.gpus, self.free)
        self.free[node].subtract(track.vm.gpus)
        self._runs(track, node, at)
        return True

    def _runs(self, track: _Track, node: str, at: datetime) -> None:
        """The VM runs again, with its cards, on ``node`` from ``at``."""
        track.lands_on, track.back_at = node, at
        if track.off_since is not None:
            track.hours += (at - track.off_since).total_seconds() / 3600
            track.off_since = None
        if node in self.residents:  # a planned node: it goes with it if it goes later
            self.residents[node].append(track.vm.uid)

    def _stop(self, track: _Track, node: str, at: datetime) -> None:
        vm = track.vm
        track.stops += 1
        track.first_stop = track.first_stop or at
        track.off_since, track.back_at, track.lands_on = at, None, None
        strategy = f"run strategy {vm.run_strategy}"
        if self.policy.preferences and vm.after_maintenance == "stay_off":
            track.fate, track.reason, track.off_since = "stays_off", "its owner asked that it stay off", None
        elif self.policy.preferences and vm.after_maintenance == "same_node" and node == track.node:
            track.fate = "back_on_own_node"
            track.reason = f"its owner asked for it back on node {node}: vmstream starts it there once the node is back"
            self.own[node].append(vm.uid)
        elif not restarts_by_itself(vm.run_strategy) or not vm.gpus:
            track.fate, track.off_since = "stays_off", None
            track.reason = f"{strategy}: KubeVirt does not start it again; it stays off until it is started"
        elif self._take(track, at):
            track.fate = "lands_elsewhere"
            track.reason = f"{strategy}: it starts again by itself on another node, on a card kept for it"
        else:
            track.fate = "waits_for_card"
            wanted = ", ".join(f"{n} {c}" for c, n in sorted(vm.gpus.items()))
            track.reason = (f"{strategy}: no free card for it ({wanted}) when node {node} goes; "
                            "it starts again by itself once its cards are free on one node")
            self.waiting.append(vm.uid)

    def _down(self, node: str, at: datetime) -> None:
        self.free.pop(node, None)
        leaving, self.residents[node] = self.residents[node], []
        for uid in self._in_order(leaving):
            self._stop(self.tracks[uid], node, at)

    def _up(self, node: str, at: datetime) -> None:
        cards = Counter(self.request.node(node).capacity)
        for uid in self.own[node]:
            cards.subtract(self.tracks[uid].vm.gpus)
            self._runs(self.tracks[uid], node, at)
        self.own[node] = []
        self.free[node] = cards
        still = []
        for uid in self.waiting:  # in the order they were stopped
            if not self._take(self.tracks[uid], at):
                still.append(uid)
        self.waiting = still

    def finish(self) -> tuple[VMEntry, ...]:
        """Every planned VM's entry, once every event is processed."""
        self.advance(datetime.max.replace(tzinfo=self.request.published.tzinfo))
        end = max((slot.end for slot in self.slots.values()), default=self.request.start)
        entries = []
        for track in self.tracks.values():
            if track.first_stop is None or track.fate is None:
                continue
            if track.off_since is not None:  # still waiting at the plan's end
                track.hours += (end - track.off_since).total_seconds() / 3600
            slot = self.slots[track.node]
            told = (max(self.request.published, min(track.first_stop, slot.start - self.request.notice))
                    if self.policy.told_ahead else track.first_stop)
            vm = track.vm
            entries.append(VMEntry(
                uid=vm.uid, name=vm.name, namespace=vm.namespace, owner=vm.owner, node=track.node,
                gpus=dict(vm.gpus), told_at=told, stop=track.first_stop, fate=track.fate,
                reason=track.reason, back_at=track.back_at, lands_on=track.lands_on, stops=track.stops,
                outside_window=slot.outside_window, hours_without_gpu=track.hours, project=vm.project,
            ))
        return tuple(sorted(entries, key=lambda entry: (entry.stop, entry.uid)))


def _simulated(request: MaintenanceRequest, slots: Iterable[NodeSlot], early: Mapping[str, datetime],
               policy: _Policy = PLANNED) -> tuple[VMEntry, ...]:
    simulation = _Simulation(request, policy)
    for slot in slots:
        simulation.schedule(slot)
    for uid, at in early.items():
        simulation.stop_early(uid, at)
    return simulation.finish()


def wanted_elsewhere(node: PlannedNode) -> Counter[str]:
    """The cards, by class, the node's VMs take on other nodes under the plan: those KubeVirt
    starts again by itself whose owners did not ask for their own node or to stay off."""
    wanted: Counter[str] = Counter()
    for vm in node.vms:
        if vm.after_maintenance == "elsewhere" and restarts_by_itself(vm.run_strategy):
            wanted.update(vm.gpus)
    return wanted


def no_wait_guaranteed(request: MaintenanceRequest) -> bool:
    """Whether the request meets the guarantee's three conditions (the module's docstring):
    then :func:`plan_maintenance` leaves no VM waiting for a card."""
    landing = [vm for node in request.nodes for vm in node.vms
               if vm.after_maintenance == "elsewhere" and restarts_by_itself(vm.run_strategy)]
    spare: Counter[str] = Counter()
    for other in request.others:
        spare.update(other.free)
    largest: Counter[str] = Counter()
    for node in request.nodes:
        largest |= wanted_elsewhere(node)
    return (all(vm.cards <= 1 for vm in landing)
            and all(spare[gpu_class] >= count for gpu_class, count in largest.items())
            and request.start + len(request.nodes) * request.duration <= request.latest_end)


def _slot(request: MaintenanceRequest, node: str, start: datetime) -> NodeSlot:
    end = start + request.duration
    return NodeSlot(node, start, end, outside_window=start < request.earliest_start or end > request.latest_end)


def _earliest_end(busy: list[datetime], count: int, request: MaintenanceRequest, start: datetime) -> datetime:
    """When ``count`` more nodes are done at the soonest from ``start``, next to the nodes busy
    until ``busy``, under the concurrency limit (cards left aside)."""
    free_at = sorted(max(end, start) for end in busy)[: request.concurrency]
    free_at += [start] * (request.concurrency - len(free_at))
    heapq.heapify(free_at)
    last = start
    for _ in range(count):
        last = heapq.heappop(free_at) + request.duration
        heapq.heappush(free_at, last)
    return max(last, *busy) if busy else last


# ------------------------------------------------------------------------------ the plan


def plan_maintenance(request: MaintenanceRequest) -> MaintenancePlan:
    """Node slots and each GPU VM's fate, the same for the same request (see the module's
    docstring for the greedy and its guarantee)."""
    simulation = _Simulation(request, PLANNED)
    remaining = sorted(node.name for node in request.nodes)
    slots: list[NodeSlot] = []
    at = request.start

    def go(node: str) -> None:
        slot = _slot(request, node, at)
        slots.append(slot)
        remaining.remove(node)
        simulation.schedule(slot)
        simulation.advance(at)  # its VMs take their cards before the next node is weighed

    while remaining:
        simulation.advance(at)
        for node in list(remaining):
            if sum(1 for slot in slots if slot.end > at) >= request.concurrency:
                break
            if simulation.would_wait(node) == 0:
                go(node)
        while remaining:
            busy = [slot.end for slot in slots if slot.end > at]
            if len(busy) >= request.concurrency:
                break
            if busy and _earliest_end(busy, len(remaining), request, min(busy)) <= request.latest_end:
                break  # waiting for the cards of the nodes in maintenance still keeps the window
            go(min(remaining, key=lambda name: (simulation.would_wait(name), name)))
            if not busy:
                break  # one node in maintenance: its end brings cards back
        at = min(slot.end for slot in slots if slot.end > at)
    vms = simulation.finish()
    return MaintenancePlan(request, tuple(sorted(slots, key=lambda slot: (slot.start, slot.node))), vms)


def resimulated(request: MaintenanceRequest, slots: Iterable[NodeSlot], early: Mapping[str, datetime],
                ready: frozenset[str] = frozenset()) -> MaintenancePlan:
    """The plan of these very slots for ``request`` — the AZ as it is now: each VM's fate
    simulated again (a plan being carried out, planned again at a slot's start)."""
    ordered = tuple(sorted(slots, key=lambda slot: (slot.start, slot.node)))
    return MaintenancePlan(request, ordered, _simulated(request, ordered, early), dict(early), ready)


def name_order_baseline(request: MaintenanceRequest) -> MaintenancePlan:
    """The same nodes drained one by one in name order from the earliest start, as a
    NodeMaintenance per node (or Harvester's maintenance mode) does: no card kept for
    anyone, restarted VMs placed by the scheduler on any schedulable node — a planned node
    still to go included —, owners' preferences unknown, owners told at the drain."""
    slots = []
    at = request.earliest_start
    for node in sorted(node.name for node in request.nodes):
        slots.append(_slot(request, node, at))
        at += request.duration
    return MaintenancePlan(request, tuple(slots), _simulated(request, slots, {}, PLAIN_DRAIN))


# ------------------------------------------------------------------------------ owners' answers


def _changed(plan: MaintenancePlan, slots: tuple[NodeSlot, ...], early: Mapping[str, datetime],
             ready: frozenset[str], moved: str | None) -> Change | Refusal:
    """``plan`` with these slots and early stops, if it keeps what the plan promised: the
    concurrency limit at every instant, the moved node inside the window, a card for every
    VM that had one."""
    request = plan.request
    if moved is not None and next(slot for slot in slots if slot.node == moved).outside_window:
        return Refusal(f"node {moved} would leave the window "
                       f"({request.earliest_start.isoformat()} to {request.latest_end.isoformat()})")
    for slot in slots:
        during = sorted(other.node for other in slots if other.start <= slot.start < other.end)
        if len(during) > request.concurrency:
            return Refusal(f"at {slot.start.isoformat()} nodes {', '.join(during)} would be in maintenance "
                           f"at once; at most {request.concurrency} may be")
    vms = _simulated(request, slots, early)
    before = {entry.uid: entry for entry in plan.vms}
    for entry in vms:
        if entry.fate == "waits_for_card" and before[entry.uid].fate != "waits_for_card":
            wanted = ", ".join(f"{n} {c}" for c, n in sorted(entry.gpus.items()))
            return Refusal(f"VM {entry.namespace}/{entry.name} would find no free card ({wanted}) "
                           f"when stopped at {entry.stop.isoformat()}")
    ordered = tuple(sorted(slots, key=lambda slot: (slot.start, slot.node)))
    new = MaintenancePlan(request, ordered, vms, dict(early), ready)
    owners = frozenset(entry.owner for entry in vms if entry.notice != before[entry.uid].notice)
    return Change(new, owners)


def _moved(plan: MaintenancePlan, node: str, start: datetime) -> tuple[tuple[NodeSlot, ...], dict[str, datetime]]:
    slots = tuple(_slot(plan.request, node, start) if slot.node == node else slot for slot in plan.slots)
    early = {uid: at for uid, at in plan.early.items() if not (plan.entry(uid).node == node and at >= start)}
    return slots, early


def reschedule(plan: MaintenancePlan, target: str, new_start: datetime, *, now: datetime) -> Change | Refusal:
    """An owner's (or operator's) other slot inside the window, for a node or one VM.

    A node moves if its owners still get their notice, the window holds it and neither the
    concurrency limit nor any promised card breaks; every other node keeps its slot. A VM
    is stopped earlier (before its node goes) if a card is free for it then, or its node
    moves to the later start asked for, on the same terms.
    """
    nodes = {slot.node for slot in plan.slots}
    if new_start < now:
        return Refusal(f"{new_start.isoformat()} has passed")
    if target in nodes:
        node = target
    elif any(entry.uid == target for entry in plan.vms):
        entry = plan.entry(target)
        if new_start <= plan.slot(entry.node).start:
            early = {**plan.early, target: new_start}
            return _changed(plan, plan.slots, early, plan.ready, None)
        node = entry.node
    else:
        return Refusal(f"{target} is neither a planned node nor a VM on one")
    told = {entry.uid for entry in plan.vms if entry.node == node} - plan.ready
    if told and new_start < now + plan.request.notice:
        return Refusal(f"the owners on node {node} would get less than their notice "
                       f"({plan.request.notice}) before {new_start.isoformat()}")
    slots, early = _moved(plan, node, new_start)
    return _changed(plan, slots, early, plan.ready, node)


def ready_now(plan: MaintenancePlan, vm_uid: str, now: datetime) -> Change | Refusal:
    """An owner's "stop my VM now": it is stopped now if a card is free for it now (or it
    needs none); a node whose VMs are all ready goes early too, if the concurrency limit, the
    window and the cards allow — else it keeps its slot."""
    if not any(entry.uid == vm_uid for entry in plan.vms):
        return Refusal(f"{vm_uid} is no VM of this plan")
    entry = plan.entry(vm_uid)
    if entry.stop <= now:
        return Refusal(f"VM {entry.namespace}/{entry.name} is stopped at {entry.stop.isoformat()} already")
    ready = plan.ready | {vm_uid}
    early = {**plan.early, vm_uid: now}
    alone = _changed(plan, plan.slots, early, ready, None)
    if isinstance(alone, Refusal):
        return alone
    if all(other.uid in ready for other in plan.vms if other.node == entry.node):
        slots, _ = _moved(plan, entry.node, max(now, plan.request.earliest_start))
        together = _changed(plan, slots, early, ready, entry.node)
        if isinstance(together, Change):
            return together
    return alone
