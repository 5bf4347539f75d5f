"""The handlers' state, kept in Faust tables, written by group commit.

A batch of inputs is decided one after the other; each decision's state changes are
*staged* (later decisions in the batch read them), the batch's messages are sent and
acknowledged, and only then are the changes written to the tables — each to the changelog
partition of the input that made it. One broker round trip per batch instead of one per
input, and still: no state is recorded whose messages might have been lost (see
``docs/worker.md``, "Effectively once").
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from faust.streams import _current_event
from faust.types import EventT

from handlers.state import Change, TableName
from streams.codecs import decode_state, encode_state
from streams.globalview import GlobalView

_DELETED = object()


@contextmanager
def deciding(event: EventT[Any]) -> Iterator[None]:
    """Make ``event`` Faust's current event while its rows are written after the batch.

    Faust takes a row's changelog partition (and the RocksDB store its partition database)
    from the event being processed; a group commit writes after the batch, so it names the
    event itself. ``faust.streams._current_event`` is the context variable Faust's own
    stream iteration sets.
    """
    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


class TableState:
    """The handlers' :class:`~handlers.state.StateView` over Faust tables of bytes.

    Reads see, in order: changes staged by the current batch, this instance's tables, and
    — for cluster-wide tables — the :class:`GlobalView` of every partition. Decoded values
    are cached and reused while the stored bytes are the same object.
    """

    def __init__(self, tables: Mapping[TableName, Any], view: GlobalView) -> None:
        self.tables = tables
        self.view = view
        self._decoded: dict[tuple[str, str], tuple[bytes, Any]] = {}
        self._staged: dict[tuple[str, str], Any] = {}

    def get(self, table: TableName, key: str) -> Any | None:
        staged = self._staged.get((table, key), None)
        if staged is not None:
            return None if staged is _DELETED else staged
        raw = self.tables[table].get(key)
        if raw is None:
            return self.view.tables[table].get(key) if table in self.view.tables else None
        cached = self._decoded.get((table, key))
        if cached is not None and cached[0] is raw:
            return cached[1]
        value = decode_state(table, raw)
        self._decoded[(table, key)] = (raw, value)
        return value

    def values(self, table: TableName) -> Iterable[Any]:
        keys = set(self.tables[table].keys())
        if table in self.view.tables:
            keys |= set(self.view.tables[table])
        keys |= {key for name, key in self._staged if name == table}
        return [value for key in sorted(keys) if (value := self.get(table, key)) is not None]

    def stage(self, changes: Iterable[Change]) -> None:
        """Make a decision's changes visible to the rest of the batch, not yet recorded."""
        for change in changes:
            self._staged[(change.table, change.key)] = _DELETED if change.value is None else change.value

    def write(self, changes: Iterable[Change], *, event: EventT[Any]) -> None:
        """Record changes in the tables, in the changelog partition of their input."""
        with deciding(event):
            for change in changes:
                target = self.tables[change.table]
                self._decoded.pop((change.table, change.key), None)
                if change.value is None:
                    if change.key in target:
                        del target[change.key]
                else:
                    raw = encode_state(change.table, change.value)
                    target[change.key] = raw
                    self._decoded[(change.table, change.key)] = (raw, change.value)

    def unstage(self) -> None:
        self._staged.clear()

    def sizes(self) -> dict[str, int]:
        return {name: len(table) for name, table in self.tables.items()}
