"""The state decisions read, and the changes they make to it — as data.

Handlers never hold a Faust table: they read a :class:`StateView` and return
:class:`Change` values. The shell applies the changes to wherever state lives (Kafka
changelog tables in the worker, :class:`MemoryState` in ``simulate``, replay and tests).

Tables and their keys (the same names the worker's tables use):

================  ==================  ================================================
table             key                 value
================  ==================  ================================================
``vms``           ``vm/<ns>/<name>``  :class:`~handlers.cluster.VMRecord`
``vmis``          ``vm/<ns>/<name>``  :class:`~handlers.cluster.VMIRecord` (VMI = VM name)
``nodes``         ``<node>``          :class:`~handlers.cluster.NodeRecord`
``maintenances``  ``<name>``          :class:`~handlers.cluster.MaintenanceRecord`
``kubevirt``      ``cluster``         :class:`~handlers.cluster.KubeVirtRecord`
``tracking``      ``vm/<ns>/<name>``  :class:`VMTracking` (what the owner was told)
``drains``        ``<node>``          :class:`DrainEpisode`
``processed``     input ref           outcome of an intent/event already decided
================  ==================  ================================================
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol

from handlers.cluster import VMIRecord

TableName = Literal["vms", "vmis", "nodes", "maintenances", "kubevirt", "tracking", "drains", "processed"]
TABLES: tuple[TableName, ...] = (
    "vms",
    "vmis",
    "nodes",
    "maintenances",
    "kubevirt",
    "tracking",
    "drains",
    "processed",
)
KUBEVIRT_KEY = "cluster"

DrainSource = Literal["intent", "maintenance", "cordon", "eviction"]
DrainOutcome = Literal["returns_automatically", "waits_for_gpu", "needs_manual_start"]


@dataclass(frozen=True, slots=True)
class VMTracking:
    """What vmstream has told a VM's owner, so that each fact is told once."""

    pending_episode: str | None = None  # the pending-restart episode the owner was told of
    unavailable_episode: str | None = None  # the gpu_unavailable episode the owner was told of

    @property
    def empty(self) -> bool:
        return self.pending_episode is None and self.unavailable_episode is None


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


def put_tracking(state: Overlay, key: str, tracking: VMTracking) -> None:
    """Store what the owner was told; an empty record is not kept."""
    state.put("tracking", key, None if tracking.empty else tracking)


@dataclass(frozen=True, slots=True)
class Change:
    table: TableName
    key: str
    value: Any | None  # None deletes the key


class StateView(Protocol):
    """Read access to state: all a handler may know besides its input and the time."""

    def get(self, table: TableName, key: str) -> Any | None: ...

    def values(self, table: TableName) -> Iterable[Any]: ...

    def vmis_on_node(self, node: str) -> list[VMIRecord]: ...


class MemoryState:
    """State in dicts, with a node → VMIs index; used by simulate, replay and tests."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, Any]] = {name: {} for name in TABLES}
        self._vmis_by_node: dict[str, set[str]] = defaultdict(set)

    def get(self, table: TableName, key: str) -> Any | None:
        return self.tables[table].get(key)

    def values(self, table: TableName) -> Iterable[Any]:
        return list(self.tables[table].values())

    def vmis_on_node(self, node: str) -> list[VMIRecord]:
        vmis = self.tables["vmis"]
        return [vmis[key] for key in sorted(self._vmis_by_node.get(node, ()))]

    def apply(self, changes: Iterable[Change]) -> None:
        for change in changes:
            table = self.tables[change.table]
            if change.table == "vmis":
                self._unindex(table.get(change.key))
            if change.value is None:
                table.pop(change.key, None)
            else:
                table[change.key] = change.value
                if change.table == "vmis":
                    self._vmis_by_node[change.value.node or ""].add(change.key)

    def _unindex(self, old: VMIRecord | None) -> None:
        if old is not None:
            self._vmis_by_node[old.node or ""].discard(old.key)

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
        mine = {key: value for (name, key), value in self._changes.items() if name == table}
        for value in self.base.values(table):
            key = _key_of(table, value)
            if key not in mine:
                yield value
        yield from (value for value in mine.values() if value is not None)

    def vmis_on_node(self, node: str) -> list[VMIRecord]:
        found = {vmi.key: vmi for vmi in self.base.vmis_on_node(node)}
        for (name, key), value in self._changes.items():
            if name != "vmis":
                continue
            if value is None or value.node != node:
                found.pop(key, None)
            else:
                found[key] = value
        return [found[key] for key in sorted(found)]

    def changes(self) -> list[Change]:
        return [Change(table, key, value) for (table, key), value in self._changes.items()]


def _key_of(table: TableName, value: Any) -> str:
    if table in ("vms", "vmis"):
        return str(value.key)
    if table in ("nodes", "drains"):
        return str(value.node if table == "drains" else value.name)
    if table == "maintenances":
        return str(value.name)
    raise ValueError(f"table {table} cannot be listed")
