"""The state decisions read, and the changes they make to it — as data.

Handlers never hold a Faust table: they read a :class:`StateView` and return
:class:`Change` values. The shell applies the changes to wherever state lives (Kafka
changelog tables in the worker, :class:`MemoryState` in ``simulate``, replay and tests).

The tables are declared once, as typed handles, in handlers/core/tables.py: ``state.get(VMS,
key)`` is a ``VMRecord | None``. Their own values (VMTracking, DrainEpisode) are in
handlers/core/rows.py; both are re-exported here for the modules that import them from here.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from handlers.core.cluster import NodeUsage
from handlers.core.maintenance import PlanRecord
from handlers.core.rows import (
    NOTHING_TOLD,
    DecidedIntent,
    DrainEpisode,
    DrainOutcome,
    DrainScope,
    DrainSource,
    ObservedFate,
    VMTracking,
)
from handlers.core.tables import (
    DRAINS,
    GLOBAL_TABLES,
    KUBEVIRT_KEY,
    PLANS,
    PROCESSED,
    TABLES,
    TRACKING,
    USAGE,
    Table,
    TableName,
)

__all__ = [
    "GLOBAL_TABLES", "KUBEVIRT_KEY", "TABLES", "Change", "DeadlineIndex", "DrainEpisode", "DrainOutcome",
    "DrainScope", "DrainSource", "ExpiryIndex", "MemoryState", "PlanIndex", "ObservedFate", "Overlay", "StateView", "Table",
    "TableName", "TimeIndex", "UsageTotals", "VMTracking", "put_tracking", "tracking_of",
]

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Change:
    table: Table[Any]
    key: str
    value: Any | None  # None deletes the key


class TimeIndex:
    """Keys by a time each, asked which are at or before a moment: a heap with lazy deletion.

    Whoever keeps a table tells its index each row it writes, so asking what is due costs
    the number of due keys, not the number of rows. An index is a hint, never the truth: the
    engine checks each key it names against the table before acting on it. Entries of keys
    whose time changed or went stay in the heap until they reach its top, and the heap is
    rebuilt when they outnumber the current ones.
    """

    def __init__(self) -> None:
        self._at: dict[str, datetime] = {}  # key → its current time
        self._heap: list[tuple[datetime, str]] = []  # may hold entries no longer current

    def set(self, key: str, at: datetime | None) -> None:
        """``key``'s time is now ``at`` (None: it has none, and is not indexed)."""
        if at is None:
            self._at.pop(key, None)
            return
        if self._at.get(key) != at:
            self._at[key] = at
            heapq.heappush(self._heap, (at, key))
            if len(self._heap) > 2 * len(self._at) + 64:
                self._heap = [(when, name) for name, when in self._at.items()]
                heapq.heapify(self._heap)

    def earliest(self) -> datetime | None:
        """The earliest current time (a glance at the heap's top)."""
        heap = self._heap
        while heap and self._at.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # no longer current
        return heap[0][0] if heap else None

    def until(self, limit: datetime, *, inclusive: bool, most: int | None = None) -> list[str]:
        """The keys whose time is before ``limit`` (or at it, ``inclusive``), earliest first,
        each once, and at most ``most`` of them; they stay indexed until their time changes
        or goes. (A key whose time went back to an earlier one has two current entries.)"""
        heap = self._heap
        if not heap or heap[0][0] > limit or (not inclusive and heap[0][0] == limit):
            return []  # the common case, asked before every input
        found: dict[str, datetime] = {}
        while heap and (heap[0][0] < limit or (inclusive and heap[0][0] == limit)):
            if most is not None and len(found) >= most:
                break
            at, key = heapq.heappop(heap)
            if self._at.get(key) == at:
                found[key] = at
        for key, at in found.items():
            heapq.heappush(heap, (at, key))
        return list(found)

    def __len__(self) -> int:
        return len(self._at)


class DeadlineIndex(TimeIndex):
    """The drain deadlines still to fire, by time: derived from the ``drains`` table alone.
    Rebuilt from the table's rows (:meth:`of`), it gives the same answers as the one kept
    along."""

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
            self.set(node, None)
        else:
            self.set(node, episode.deadline)

    def due(self, now: datetime) -> list[str]:
        """The nodes whose deadline is at or before ``now``, in name order; they stay
        indexed until their row says the deadline passed."""
        return sorted(self.until(now, inclusive=True))


class PlanIndex(TimeIndex):
    """The maintenance plans by the time their next node is due to go: derived from the
    ``plans`` table alone (:meth:`~handlers.core.maintenance.PlanRecord.next_step`)."""

    @classmethod
    def of(cls, rows: Iterable[tuple[str, PlanRecord | None]]) -> PlanIndex:
        index = cls()
        for plan_id, record in rows:
            index.note(plan_id, record)
        return index

    def note(self, plan_id: str, record: PlanRecord | None) -> None:
        """The ``plans`` row of ``plan_id`` is now ``record`` (None: deleted)."""
        self.set(plan_id, None if record is None else record.next_step())

    def due(self, now: datetime) -> list[str]:
        """The plans with a node due at or before ``now``, by id."""
        return sorted(self.until(now, inclusive=True))


class ExpiryIndex(TimeIndex):
    """The ``processed`` rows by the time they were decided: which are past the dedup window.

    The engine forgets old intent ids without a pass over the table, and deletes only rows
    whose own time says they are past the window. Rows of before the window (a bare
    outcome) have no time and are not indexed.
    """

    @classmethod
    def of(cls, rows: Iterable[tuple[str, DecidedIntent | str | None]]) -> ExpiryIndex:
        index = cls()
        for intent_id, row in rows:
            index.note(intent_id, row)
        return index

    def note(self, intent_id: str, row: DecidedIntent | str | None) -> None:
        self.set(intent_id, row.at if isinstance(row, DecidedIntent) else None)

    def any_before(self, at: datetime) -> bool:
        """Whether some row was decided before ``at``."""
        earliest = self.earliest()
        return earliest is not None and earliest < at

    def before(self, at: datetime, most: int | None = None) -> list[str]:
        """The intent ids decided before ``at``, oldest first (at most ``most``); they stay
        indexed until deleted."""
        return self.until(at, inclusive=False, most=most)


def dedup_window(seconds: int) -> timedelta:
    """How long an intent id is remembered: rows decided before ``now - window`` are past it."""
    return timedelta(seconds=seconds)


class UsageTotals:
    """GPU cards per device summed over every node's :class:`~handlers.core.cluster.NodeUsage`,
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

    def get(self, table: Table[V], key: str) -> V | None: ...

    def items(self, table: Table[V]) -> Iterable[tuple[str, V]]: ...

    def values(self, table: Table[V]) -> Iterable[V]: ...


class MemoryState:
    """State in dicts; used by simulate, replay and tests."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, Any]] = {name: {} for name in TABLES}
        self.deadlines = DeadlineIndex()  # of the ``drains`` rows
        self.usage_totals = UsageTotals()  # of the ``usage`` rows
        self.decided = ExpiryIndex()  # of the ``processed`` rows
        self.plans = PlanIndex()  # of the ``plans`` rows

    def get(self, table: Table[V], key: str) -> V | None:
        value: V | None = self.tables[table].get(key)
        return value

    def items(self, table: Table[V]) -> list[tuple[str, V]]:
        return list(self.tables[table].items())

    def values(self, table: Table[V]) -> list[V]:
        return list(self.tables[table].values())

    def apply(self, changes: Iterable[Change]) -> None:
        for change in changes:
            rows = self.tables[change.table]
            if change.table == USAGE:
                self.usage_totals.note(rows.get(change.key), change.value)
            elif change.table == DRAINS:
                self.deadlines.note(change.key, change.value)
            elif change.table == PROCESSED:
                self.decided.note(change.key, change.value)
            elif change.table == PLANS:
                self.plans.note(change.key, change.value)
            if change.value is None:
                rows.pop(change.key, None)
            else:
                rows[change.key] = change.value

    def sizes(self) -> dict[str, int]:
        return {name: len(table) for name, table in self.tables.items()}


class Overlay:
    """A view of ``base`` with a decision's own changes on top, recorded in order.

    Handlers read their own writes through it (a VM observed a moment ago is visible to the
    rules that run next), and its :meth:`changes` become the decision's state changes.
    """

    def __init__(self, base: StateView) -> None:
        self.base = base
        self._changes: dict[tuple[Table[Any], str], Any | None] = {}  # in the order written
        self._mine: dict[str, dict[str, Any | None]] = {}  # the same, by table: what reads look up

    def get(self, table: Table[V], key: str) -> V | None:
        rows = self._mine.get(table)
        if rows is None or key not in rows:
            return self.base.get(table, key)
        mine: V | None = rows[key]
        return mine

    def put(self, table: Table[V], key: str, value: V | None) -> None:
        self._changes[(table, key)] = value
        rows = self._mine.get(table)
        if rows is None:
            rows = self._mine[table] = {}
        rows[key] = value

    def items(self, table: Table[V]) -> Iterator[tuple[str, V]]:
        """The base's rows under this decision's own (by key), then rows only it wrote."""
        mine = self.changed(table)
        for key, value in self.base.items(table):
            if key not in mine:
                yield key, value
        yield from ((key, value) for key, value in mine.items() if value is not None)

    def values(self, table: Table[V]) -> Iterator[V]:
        return (value for _, value in self.items(table))

    def changed(self, table: Table[V]) -> dict[str, V | None]:
        """This decision's own rows of ``table`` so far (None: deleted)."""
        return dict(self._mine.get(table, {}))

    def changes(self) -> list[Change]:
        return [Change(table, key, value) for (table, key), value in self._changes.items()]


def tracking_of(state: StateView, key: str) -> VMTracking:
    """What VM ``key``'s owner was told (nothing, without a row)."""
    return state.get(TRACKING, key) or NOTHING_TOLD


def put_tracking(state: Overlay, key: str, tracking: VMTracking) -> None:
    """Store what the owner was told; an empty record is not kept."""
    state.put(TRACKING, key, None if tracking.empty else tracking)
