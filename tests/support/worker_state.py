"""The worker's table state (streams/worker/tablestate.py) over plain dicts: its indexes and
rows tested without Faust or a broker."""

from __future__ import annotations

from typing import Any, cast

from faust.types import EventT

from handlers.core.tables import TABLES
from streams.common.globalview import GlobalView
from streams.common.settings import KafkaSettings
from streams.worker.tablestate import TableState


class RowEvent:
    """Stands for the Faust event a row is written under: what rows take of it, its partition."""

    class message:  # noqa: N801  # as Faust's event names it
        partition = 0


def row_event() -> EventT[Any]:
    """A :class:`RowEvent` where the worker's state takes a Faust event: rows read its
    partition alone, and no stand-in can be the whole of Faust's event."""
    return cast("EventT[Any]", RowEvent())


class LocalTable(dict[str, Any]):
    """Stands for a Faust table: its local rows and its changelog's name."""

    class changelog_topic:  # noqa: N801  # as Faust's table names it
        @staticmethod
        def get_topic_name() -> str:
            return "app-state-changelog"


def worker_table_state() -> TableState:
    return TableState({table: LocalTable() for table in TABLES}, GlobalView(KafkaSettings(bootstrap_servers="localhost:9"), {}), None)
