"""Faust (faust-streaming 0.15.3) with the patches that keep it from losing or delaying
the worker's inputs: two start-up races closed, the rows of partitions given away dropped,
a shorter long poll, and a restarted static member taken back.

A worker that starts over a backlog must decide every waiting message. Two races in how
Faust resumes its input partitions after table recovery lose a run of them instead; the
offsets of the lost run are never acked, so the committed offset stops before it until the
next restart decides it, late. ``benchmarks/recovery.py --only backlog`` saw it in restarts over a
backlog; ``tests/test_faustfixes.py`` holds each fix to the order it makes.

1. **The queue clear.** Recovery ends by resuming the input partitions, seeking them to the
   committed offsets, and only then resuming flow control, which clears the agents' queues.
   A batch fetched in between is counted as read and thrown away (faust-streaming issue
   #596). :class:`HeldRecovery` resumes the input partitions last.
2. **The empty partition set.** Faust asks aiokafka for records of its *live* set of active
   partitions. When that set empties during the call (recovery pauses the changelogs),
   aiokafka reads the empty set as "every partition" and returns input records, which Faust
   then drops as inactive, although aiokafka's position has moved past them.
   :class:`WorkerConsumer` passes a copy taken when the call starts.
3. **Rows of partitions given away.** The in-memory store forgets, after a rebalance, the
   keys of partitions this instance no longer owns, but it knows a key's partition only
   for rows it recovered from a changelog, not for rows it wrote itself. A worker that
   wrote rows while it owned every partition keeps them, stale, after another instance
   took half: they would answer its reads of cluster-wide rows (a node's GPU usage) before
   the other instance's current rows, and they are iterated with its own (the deadline
   index is rebuilt from them). :class:`PartitionTrackedTable` records the partition of
   every row it writes (``tests/test_faustfixes.py``).

And one setting Faust hard-codes: its consumer long-polls the broker for up to 1.5 s
(``fetch_max_wait_ms=1500``). aiokafka keeps one fetch in flight per broker and leaves out of
it the partitions whose records are still being consumed; under load the intents partitions
were left out of nearly every fetch, which then waited out its long poll on partitions
without news (changelogs, the routed topic), and every intent waited with it before it was
decided. :class:`App` takes ``fetch_max_wait_ms``, ``fetch_min_bytes`` and
``fetch_idle_wait_ms``, and paces its fetches by what the worker is doing
(:class:`ShortPollConsumerThread`): a busy worker fetches once per wait instead of once per
few records, an idle one once per idle wait, and while tables recover a fetch returns as
soon as it has anything, so that recovery is not held back by fetches waiting to fill.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import faust
from faust.assignor import PartitionAssignor
from faust.tables import TableManager
from faust.tables.recovery import Recovery
from faust.transport.drivers import aiokafka as aiokafka_driver
from faust.types import TP
from faust.types.transports import TransportT

from streams.worker.broker_credentials import pace_fetches

log = logging.getLogger(__name__)


class HeldRecovery(Recovery):
    """Recovery whose input partitions resume only after flow control has cleared the queues
    (fix 1), so that no batch fetched in between is thrown away unacknowledged; fetches are
    filled (``fetch_min_bytes``) only once it is over."""

    async def on_rebalance(self, *args: Any, **kwargs: Any) -> None:
        self._fill_fetches(False)
        await super().on_rebalance(*args, **kwargs)

    async def on_recovery_completed(self, generation_id: int = 0) -> None:
        with self._inputs_held(generation_id):
            await super().on_recovery_completed(generation_id)
        self._fill_fetches(True)

    def _fill_fetches(self, fill: bool) -> None:
        consumer = cast(WorkerConsumer, self.app.consumer)  # App's transport makes it
        consumer.pacer.fill_fetches(fill)

    async def _resume_streams(self, generation_id: int = 0) -> None:
        with self._inputs_held(generation_id):
            await super()._resume_streams(generation_id)

    @contextmanager
    def _inputs_held(self, generation_id: int) -> Iterator[None]:
        """Record the partitions Faust resumes inside the block; resume them after it.

        Only if the block finished and no rebalance began meanwhile: otherwise the next
        assignment decides what is fetched, as it would have without us.
        """
        consumer: Any = self.app.consumer
        held: set[TP] = set()

        def hold(tps: Iterable[TP]) -> None:
            held.update(tps)

        consumer.resume_partitions = hold  # shadows the method on this instance only
        try:
            yield
        finally:
            del consumer.resume_partitions
        if held and self.app.consumer_generation_id == generation_id:
            consumer.resume_partitions(held & set(consumer.assignment()))


class HeldRecoveryTableManager(TableManager):
    """Faust's table manager, recovering with :class:`HeldRecovery`."""

    @property
    def recovery(self) -> Recovery:
        if self._recovery is None:
            self._recovery = HeldRecovery(self.app, self, beacon=self.beacon, loop=self.loop)
        return self._recovery


class ShortPollConsumerThread(aiokafka_driver.AIOKafkaConsumerThread):
    """Faust's aiokafka consumer with the app's fetch pacing instead of a fixed 1.5 s poll.

    aiokafka's fetcher reads ``_fetch_min_bytes`` and ``_fetch_max_wait_ms`` for each fetch
    it builds, so the pace can change between fetches:

    - recovering: 1 byte, ``fetch_max_wait_ms`` — read the changelogs as fast as they come;
    - deciding, busy (the last read had records): ``fetch_min_bytes``, ``fetch_max_wait_ms``
      — one full fetch per wait rather than one per few records;
    - deciding, idle: 1 byte, ``fetch_idle_wait_ms`` — few empty fetches, and the first
      record after a lull is returned at once.
    """

    deciding = False  # set by HeldRecovery once the tables are recovered

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        app: Any = self.app
        consumer._fetch_max_wait_ms = app.fetch_max_wait_ms  # read when the consumer starts
        consumer._fetch_min_bytes = 1
        return consumer

    def fill_fetches(self, fill: bool) -> None:
        """Recovery is over (``True``) or begins again (``False``)."""
        self.deciding = fill
        self.pace(busy=True)

    def pace(self, *, busy: bool) -> None:
        """Set the next fetches' pace from whether the last read had records."""
        app: Any = self.app
        if not self.deciding:
            self._pace(1, app.fetch_max_wait_ms)
        elif busy:
            self._pace(app.fetch_min_bytes, app.fetch_max_wait_ms)
        else:
            self._pace(1, app.fetch_idle_wait_ms)

    def _pace(self, min_bytes: int, max_wait_ms: int) -> None:
        pace_fetches(self._consumer, min_bytes=min_bytes, max_wait_ms=max_wait_ms)


class WorkerConsumer(aiokafka_driver.Consumer):
    """Faust's consumer, asking aiokafka for a snapshot of the active partitions (fix 2), so
    that records fetched while recovery empties the set are not dropped as inactive; through
    a thread that paces its fetches."""

    def _new_consumer_thread(self) -> aiokafka_driver.AIOKafkaConsumerThread:
        return ShortPollConsumerThread(self, loop=self.loop, beacon=self.beacon)

    @property
    def pacer(self) -> ShortPollConsumerThread:
        return cast(ShortPollConsumerThread, self._thread)  # made by _new_consumer_thread

    async def _getmany(self, active_partitions: set[TP] | None, timeout: float) -> Any:
        snapshot = None if active_partitions is None else set(active_partitions)
        records = await super()._getmany(snapshot, timeout)
        self.pacer.pace(busy=any(records.values()))
        return records


class WorkerTransport(aiokafka_driver.Transport):
    Consumer = WorkerConsumer


class StaticMemberAssignor(PartitionAssignor):
    """Faust's assignor, for a worker restarted with the same ``group_instance_id``.

    A static member that rejoins is handed back the assignment it had (KIP-345), without a
    new one being computed: Faust's metadata in it names the web URL of the process before
    the crash, and Faust asserts it is its own. A worker restarted on another port (or host)
    then failed in aiokafka's coordinator and never consumed. The URL only names where a
    worker's pages are; the partitions are checked as before.
    """

    def on_assignment(self, assignment: Any) -> None:
        try:
            super().on_assignment(assignment)
        except AssertionError:
            handed = sorted(assignment.assignment)
            computed = sorted(self._assignment.kafka_protocol_assignment(self._table_manager))
            if handed != computed:
                raise
            log.info("assignment handed back from before a restart (static membership): "
                     "its worker URL is not this one's")


class PartitionTrackedTable(faust.Table):  # type: ignore[type-arg]  # generic over key and value; rows are bytes
    """A table whose in-memory store knows the partition of every row, written or recovered,
    so that :meth:`~faust.stores.memory.Store.on_recovery_completed` drops the rows of the
    partitions given away (fix 3): stale, they would answer reads before the current rows
    of the instance that owns them now."""

    def send_changelog(self, partition: int | None, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        owners = getattr(self.data, "_key_partition", None)  # the in-memory store's map
        if owners is not None and partition is not None:
            owners[key] = partition
        return super().send_changelog(partition, key, value, *args, **kwargs)


class App(faust.App):
    """``faust.App`` with these fixes; takes its arguments, and the fetch pacing."""

    def __init__(self, *args: Any, fetch_max_wait_ms: int = 1500, fetch_min_bytes: int = 1,
                 fetch_idle_wait_ms: int = 1500, **kwargs: Any) -> None:
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.fetch_min_bytes = fetch_min_bytes
        self.fetch_idle_wait_ms = fetch_idle_wait_ms
        kwargs.setdefault("TableManager", HeldRecoveryTableManager)
        kwargs.setdefault("Table", PartitionTrackedTable)
        kwargs.setdefault("PartitionAssignor", StaticMemberAssignor)
        super().__init__(*args, **kwargs)

    def _new_transport(self) -> TransportT:
        return WorkerTransport(self.conf.broker_consumer, self)
