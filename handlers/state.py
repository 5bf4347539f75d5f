"""The state decisions read, and the changes they make to it — as data.

Handlers never hold a Faust table: they read a :class:`StateView` and return
:class:`Change` values. The shell applies the changes to wherever state lives (Kafka
changelog tables in the worker, :class:`MemoryState` in ``simulate``, replay and tests).

Every table is written by decisions of one *decision key* only, so that in the worker a
table key always lives in the partition of the input that writes it:

================  ==================  =======================  ============================
table             key                 written under            value
================  ==================  =======================  ============================
``vms``           ``vm/<ns>/<name>``  that VM                  :class:`~handlers.cluster.VMRecord`
``vmis``          ``vm/<ns>/<name>``  that VM (VMI = VM name)  :class:`~handlers.cluster.VMIRecord`
``tracking``      ``vm/<ns>/<name>``  that VM                  :class:`VMTracking`
``nodes``         ``<node>``          that node                :class:`~handlers.cluster.NodeRecord`
``residents``     ``<node>``          that node                ``dict[vm key, Resident]``
``drains``        ``<node>``          that node                :class:`DrainEpisode`
``maintenances``  ``<name>``          its node                 :class:`~handlers.cluster.MaintenanceRecord`
``processed``     ``<intent_id>``     the intent's key         outcome of an intent decided
``usage``         ``<node>``          that node; read by all   :class:`~handlers.cluster.NodeUsage`
``kubevirt``      ``cluster``         the KubeVirt CR; by all  :class:`~handlers.cluster.KubeVirtRecord`
``namespaces``    ``<namespace>``     the cluster; read by all :class:`~handlers.cluster.NamespaceRecord`
================  ==================  =======================  ============================

``usage``, ``kubevirt`` and ``namespaces`` are cluster-wide facts: every worker instance
reads all of them.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol

from handlers.cluster import (
    KubeVirtRecord,
    MaintenanceRecord,
    NamespaceRecord,
    NodeRecord,
    NodeUsage,
    Resident,
    VMIRecord,
    VMRecord,
)

TableName = Literal[
    "vms", "vmis", "tracking", "nodes", "residents", "drains", "maintenances", "processed", "usage", "kubevirt",
    "namespaces",
]
TABLES: tuple[TableName, ...] = (
    "vms",
    "vmis",
    "tracking",
    "nodes",
    "residents",
    "drains",
    "maintenances",
    "processed",
    "usage",
    "kubevirt",
    "namespaces",
)
GLOBAL_TABLES: tuple[TableName, ...] = ("usage", "kubevirt", "namespaces")
KUBEVIRT_KEY = "cluster"

DrainSource = Literal["intent", "maintenance", "cordon", "eviction"]
DrainOutcome = Literal["returns_automatically", "waits_for_gpu", "needs_manual_start"]
DrainScope = Literal["node", "evictions"]
ObservedFate = Literal["came_back", "waits_for_gpu", "off"]


@dataclass(frozen=True, slots=True)
class VMTracking:
    """What vmstream has told a VM's owner, so that each fact is told once."""

    pending_episode: str | None = None  # the pending-restart episode the owner was told of
    unavailable_episode: str | None = None  # the gpu_unavailable episode the owner was told of
    left_node: str | None = None  # its GPU VMI left this node; where it went is not reported yet
    left_fate: str | None = None  # what was last reported to that node (waits_for_gpu)
    # The GPU rules (handlers/enforcement.py): the VM content a GPU patch was planned from,
    # while it is in flight (or, enforce: notify, the gaps the owner was told of); and the
    # memory-not-pinned episode the owner was told of.
    gpu_rules_episode: str | None = None
    unpinned_episode: str | None = None

    @property
    def empty(self) -> bool:
        return (self.pending_episode is None and self.unavailable_episode is None and self.left_node is None
                and self.gpu_rules_episode is None and self.unpinned_episode is None)


@dataclass(frozen=True, slots=True)
class DrainEpisode:
    """One drain of one node, from its first signal until no GPU VM is left on it."""

    node: str
    episode: str
    source: DrainSource
    cause: str
    reason: str
    requested_by: str | None
    started_at: datetime
    deadline: datetime
    announced: dict[str, DrainOutcome] = field(default_factory=dict)
    stopped: tuple[str, ...] = ()
    deadline_passed: bool = False
    cordon_observed: bool = False
    completed: bool = False  # kept until the episode ends, so a late signal starts no new one
    scope: DrainScope = "node"  # "evictions": only the VMIs KubeVirt was asked to evict
    cordoned: bool = False  # vmstream cordoned the node itself (and so may uncordon it)
    warned: dict[str, tuple[str | None, tuple[str, ...]]] = field(default_factory=dict)  # key: (project, recipients)
    observed: dict[str, ObservedFate] = field(default_factory=dict)  # what became of each announced VM


@dataclass(frozen=True, slots=True)
class Change:
    table: TableName
    key: str
    value: Any | None  # None deletes the key


class DeadlineIndex:
    """The drain deadlines still to fire, by time: derived from the ``drains`` table alone.

    Whoever keeps the table tells the index each row it writes (:meth:`note`), so asking
    which deadlines are due costs the number of due ones, not the number of episodes. It is
    a hint, never the truth: :meth:`due` names the nodes whose indexed deadline is due, and
    the engine checks each against the table before it fires anything. Rebuilt from the
    table's rows (:meth:`of`), it gives the same answers as the one kept along.
    """

    def __init__(self) -> None:
        self._deadline: dict[str, datetime] = {}  # node → the deadline of its episode still to fire
        self._heap: list[tuple[datetime, str]] = []  # may hold entries no longer current

    @classmethod
    def of(cls, episodes: Iterable[DrainEpisode | None]) -> DeadlineIndex:
        index = cls()
        for episode in episodes:
            if episode is not None:
                index.note(episode.node, episode)
        return index

    def note(self, node: str, episode: DrainEpisode | None) -> None:
        """The ``drains`` row of ``node`` is now ``episode`` (None: deleted)."""
        if episode is None or episode.deadline_passed or episode.completed:
            self._deadline.pop(node, None)
            return
        if self._deadline.get(node) != episode.deadline:
            self._deadline[node] = episode.deadline
            heapq.heappush(self._heap, (episode.deadline, node))
            if len(self._heap) > 2 * len(self._deadline) + 64:
                self._heap = [(at, name) for name, at in self._deadline.items()]
                heapq.heapify(self._heap)

    def due(self, now: datetime) -> list[str]:
        """The nodes whose deadline is at or before ``now``, in name order; they stay
        indexed until their row says the deadline passed."""
        due: set[str] = set()
        while self._heap and self._heap[0][0] <= now:
            at, node = heapq.heappop(self._heap)
            if self._deadline.get(node) == at:
                due.add(node)
        for node in due:
            heapq.heappush(self._heap, (self._deadline[node], node))
        return sorted(due)

    def __len__(self) -> int:
        return len(self._deadline)


class UsageTotals:
    """GPU cards per device summed over every node's :class:`~handlers.cluster.NodeUsage`,
    kept as ``usage`` rows change: capacity without a pass over every node."""

    def __init__(self) -> None:
        self._sums: dict[str, list[int]] = {}  # device → [total, schedulable, used, free]

    @staticmethod
    def share(usage: NodeUsage | None, device: str) -> tuple[int, int, int, int]:
        """One node's part of ``device``'s capacity: (total, schedulable, used, free)."""
        if usage is None:
            return 0, 0, 0, 0
        allocatable = usage.allocatable.get(device, 0)
        if not allocatable:
            return 0, 0, 0, 0
        if not usage.schedulable:
            return allocatable, 0, 0, 0
        return allocatable, allocatable, min(usage.held.get(device, 0), allocatable), usage.free(device)

    def note(self, old: NodeUsage | None, new: NodeUsage | None) -> None:
        """A node's usage row went from ``old`` to ``new``."""
        for usage, sign in ((old, -1), (new, 1)):
            if usage is None:
                continue
            for device in usage.allocatable:
                part = self.share(usage, device)
                if part == (0, 0, 0, 0):
                    continue
                sums = self._sums.setdefault(device, [0, 0, 0, 0])
                for i in range(4):
                    sums[i] += sign * part[i]

    def get(self, device: str) -> tuple[int, int, int, int]:
        sums = self._sums.get(device)
        return (0, 0, 0, 0) if sums is None else (sums[0], sums[1], sums[2], sums[3])


class StateView(Protocol):
    """Read access to state: all a handler may know besides its input and the time."""

    def get(self, table: TableName, key: str) -> Any | None: ...

    def values(self, table: TableName) -> Iterable[Any]: ...


class MemoryState:
    """State in dicts; used by simulate, replay and tests."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, Any]] = {name: {} for name in TABLES}
        self.deadlines = DeadlineIndex()  # of the ``drains`` rows
        self.usage_totals = UsageTotals()  # of the ``usage`` rows

    def get(self, table: TableName, key: str) -> Any | None:
        return self.tables[table].get(key)

    def values(self, table: TableName) -> Iterable[Any]:
        return list(self.tables[table].values())

    def apply(self, changes: Iterable[Change]) -> None:
        for change in changes:
            rows = self.tables[change.table]
            if change.table == "usage":
                self.usage_totals.note(rows.get(change.key), change.value)
            elif change.table == "drains":
                self.deadlines.note(change.key, change.value)
            if change.value is None:
                rows.pop(change.key, None)
            else:
                rows[change.key] = change.value

    def sizes(self) -> dict[str, int]:
        return {name: len(table) for name, table in self.tables.items()}


_MISSING = object()


class Overlay:
    """A view of ``base`` with a decision's own changes on top, recorded in order.

    Handlers read their own writes through it (a VM observed a moment ago is visible to the
    rules that run next), and its :meth:`changes` become the decision's state changes.
    """

    def __init__(self, base: StateView) -> None:
        self.base = base
        self._changes: dict[tuple[TableName, str], Any | None] = {}

    def get(self, table: TableName, key: str) -> Any | None:
        value = self._changes.get((table, key), _MISSING)
        return self.base.get(table, key) if value is _MISSING else value

    def put(self, table: TableName, key: str, value: Any | None) -> None:
        self._changes[(table, key)] = value

    def values(self, table: TableName) -> Iterator[Any]:
        """Listing is only needed for ``usage`` and ``drains`` (keyed by node)."""
        mine = {key: value for (name, key), value in self._changes.items() if name == table}
        for value in self.base.values(table):
            if value.node not in mine:
                yield value
        yield from (value for value in mine.values() if value is not None)

    def changed(self, table: TableName) -> dict[str, Any | None]:
        """This decision's own rows of ``table`` so far (None: deleted)."""
        return {key: value for (name, key), value in self._changes.items() if name == table}

    def changes(self) -> list[Change]:
        return [Change(table, key, value) for (table, key), value in self._changes.items()]


def table_types() -> dict[TableName, Any]:
    """The value type of each table, for codecs that store state outside Python."""
    return {
        "vms": VMRecord,
        "vmis": VMIRecord,
        "tracking": VMTracking,
        "nodes": NodeRecord,
        "residents": dict[str, Resident],
        "drains": DrainEpisode,
        "maintenances": MaintenanceRecord,
        "processed": str,
        "usage": NodeUsage,
        "kubevirt": KubeVirtRecord,
        "namespaces": NamespaceRecord,
    }


def put_tracking(state: Overlay, key: str, tracking: VMTracking) -> None:
    """Store what the owner was told; an empty record is not kept."""
    state.put("tracking", key, None if tracking.empty else tracking)
