"""Cluster-wide tables, read by every worker instance: all partitions of a changelog.

Each node's GPU usage is written by the instance that owns the node's partition, into an
ordinary Faust table; capacity questions need every node's usage. Faust's ``GlobalTable``
is meant for this, but with more than one instance it does not deliver the partitions
another instance writes (faust-streaming issue #283, and seen here: an instance saw only
its own nodes). So this view reads the changelog topics itself, with a group-less consumer
assigned every partition, from the beginning and then as they grow.

The worker's pages answer for the whole cluster the same way: ``/pending`` reads the
``tracking``, ``vms`` and ``vmis`` changelogs through a view of their own that keeps the
rows as bytes and decodes only those a page asks for (``decode=False``), so any replica
behind a Service gives the same list.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, TypeVar

from handlers.core.tables import Table
from streams.common.codecs import decode_state
from streams.common.reading import Follower, follow_from_start
from streams.common.settings import KafkaSettings

log = logging.getLogger(__name__)
V = TypeVar("V")


class GlobalView:
    """The latest value of every key of some tables' changelogs, across all partitions."""

    def __init__(self, kafka: KafkaSettings, changelogs: dict[Table[Any], str], *, decode: bool = True,
                 client_id: str = "vmstream-view") -> None:
        self.kafka = kafka
        self.changelogs = changelogs
        self.decode = decode  # else rows are kept as bytes, decoded by ``get``
        self.client_id = client_id
        self.tables: dict[str, dict[str, Any]] = {table: {} for table in changelogs}
        self.caught_up = asyncio.Event()
        self._names = {topic: table for table, topic in changelogs.items()}

    async def run(self) -> None:
        """Read every partition from the start, flag when the start-up backlog is read, go on."""
        follower = Follower(self.kafka, client_id=self.client_id)
        try:
            async for records in follow_from_start(follower, self.changelogs.values(), self.caught_up):
                for record in records:
                    self._apply(record.topic, record.key, record.value)
        finally:
            await follower.close()

    def _apply(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        name = self._names[topic]
        decoded_key = json.loads(key)  # Faust writes str keys as JSON
        if value is None:
            self.tables[name].pop(decoded_key, None)
        else:
            self.tables[name][decoded_key] = decode_state(name, value) if self.decode else value

    def get(self, table: Table[V], key: str) -> V | None:
        """A row, decoded (a :class:`~handlers.core.state.StateView` over the view alone)."""
        value = self.tables[table].get(key)
        row: V | None = decode_state(table, value) if isinstance(value, bytes) else value
        return row

    def items(self, table: Table[V]) -> list[tuple[str, V]]:
        return [(key, value) for key in self.keys(table) if (value := self.get(table, key)) is not None]

    def values(self, table: Table[V]) -> list[V]:
        return [value for _, value in self.items(table)]

    def keys(self, table: Table[Any]) -> list[str]:
        return sorted(self.tables[table])
