"""Faust (faust-streaming 0.15.3) with two of its start-up races closed, a shorter long poll,
a lighter hand-over of each record and batches that fill while inputs wait.

A worker that starts over a backlog must decide every waiting message. Two races in how
Faust resumes its input partitions after table recovery lose a run of them instead; the
offsets of the lost run are never acked, so the committed offset stops before it until the
next restart decides it, late. ``benchmarks/restart_backlog.py`` saw it in 3 of 5 restarts
over 5,000 intents; ``tests/kafka/test_worker.py`` reproduces it every time with a slowed
seek (``tests/faults/``).

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
it the partitions whose records are still being consumed; at 1,000 intents/s the intents
partitions were left out of nearly every fetch, which then waited out its 1.5 s on partitions
without news (changelogs, the routed topic). Every intent waited with it: 1.2–1.5 s from
intent to audit record, at any load above a few hundred a second. :class:`App` takes
``fetch_max_wait_ms``, ``fetch_min_bytes`` and ``fetch_idle_wait_ms``, and paces its fetches
by what the worker is doing (:class:`ShortPollConsumerThread`): a busy worker fetches once
per wait instead of once per few records, an idle one once per idle wait, and while tables
recover a fetch returns as soon as it has anything (with 16 KiB fetches throughout, 10,000
VMs took 8.2 s to recover instead of 5.8 s).

4. **The hand-over of each record.** Faust hands each record to its agents' queues through
   ``wait_first(callback(message), suspend_flow.wait())``, which makes four tasks (the
   callback, the flow's, the consumer's stop and crash waits) and cancels three: 28.7 µs a
   record where the callback itself takes a fraction (``timeit``), about 6 % of the worker at
   saturation. The callback almost never waits (a full queue, flow control during a
   rebalance): :meth:`WorkerConsumer._deliver` runs it up to its first wait, and only a
   callback that does wait goes on as Faust's race, from where it stopped.

5. **Batches under a backlog.** Faust's ``take_events(max_, within)`` waits ``within`` for
   each batch to fill, counted from when the last one was done, and events reach the batch
   only while it waits. With the worker's 5 ms, a backlog of routed records came in
   batches of about 150 of the 500 allowed, each paying the group commit's three
   round trips to the broker. :func:`take_events` waits ``window(len(last batch))``
   instead: the worker's ``batch_seconds`` (5 ms) after a small batch, so a lone input
   is decided as soon as before, and ``busy_batch_seconds`` (25 ms) after a batch that
   held a fifth of ``batch_size`` or more, which a backlog then fills.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import faust
from faust.assignor import PartitionAssignor
from faust.tables import TableManager
from faust.tables.recovery import Recovery
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as aiokafka_driver
from faust.types import TP, EventT
from faust.types.transports import TransportT
from mode.utils.futures import notify

from streams.worker.broker_credentials import pace_fetches

log = logging.getLogger(__name__)


class HeldRecovery(Recovery):
    """Recovery whose input partitions resume only after flow control has cleared the queues;
    fetches are filled (``fetch_min_bytes``) only once it is over."""

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
    """Faust's consumer, asking aiokafka for a snapshot of the active partitions (race 2),
    through a thread that paces its fetches."""

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

    async def _deliver(self, callback: Callable[[Any], Awaitable[Any]], message: Any) -> None:
        """Hand ``message`` to the agents (fix 4): what Faust's ``wait_first(callback(message),
        suspend_flow.wait())`` does, without its tasks when the callback does not wait.

        While the flow is suspended or the consumer stops, Faust's race as it is. Else the
        callback runs here up to its first wait; most finish without one. One that waits is
        raced, from there on, against the flow's suspension and the consumer's stop, as Faust
        races it: abandoned (cancelled) if the flow is suspended first.
        """
        started = callback(message)
        racing = self.suspend_flow.is_set() or self._stopped.is_set() or self._crashed.is_set()
        if racing or not inspect.iscoroutine(started):  # Faust's conductor gives a coroutine
            await self.wait_first(started, self.suspend_flow.wait())
            return
        try:
            waits_for = started.send(None)
        except StopIteration:
            return  # delivered without waiting: the common case
        await self.wait_first(_Resumed(started, waits_for), self.suspend_flow.wait())

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - Faust's loop, run by every worker test
        """Faust 0.15.3's ``Consumer._drain_messages``, line for line, but for the hand-over
        of each record (:meth:`_deliver`, fix 4)."""
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set

        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        flag_consumer_fetching = CONSUMER_FETCHING
        set_flag = self.diag.set_flag
        unset_flag = self.diag.unset_flag
        commit_every = self._commit_every
        acks_enabled_for = self.app.topics.acks_enabled_for

        yield_every = 100
        num_since_yield = 0
        sleep = asyncio.sleep

        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag(flag_consumer_fetching)
                ait = getmany(timeout=1.0)

                # Sleeping because sometimes getmany is called in a loop
                # never releasing to the event loop
                await self.sleep(0)
                if not self.should_stop:
                    async for tp, message in ait:
                        num_since_yield += 1
                        if num_since_yield > yield_every:
                            await sleep(0)
                            num_since_yield = 0

                        offset = message.offset
                        r_offset = get_read_offset(tp)
                        if r_offset is None or offset >= r_offset:
                            gap = offset - (r_offset or 0)
                            # We have a gap in income messages
                            if gap > 1 and r_offset:
                                acks_enabled = acks_enabled_for(message.topic)
                                if acks_enabled:
                                    await self._add_gap(tp, r_offset + 1, offset)
                            if commit_every is not None:
                                if self._n_acked >= commit_every:
                                    self._n_acked = 0
                                    await self.commit()
                            await self._deliver(callback, message)
                            set_read_offset(tp, offset)
                        else:
                            self.log.dev("DROPPED MESSAGE ROFF %r: k=%r v=%r", offset, message.key, message.value)
                    unset_flag(flag_consumer_fetching)

        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                # we're already stopping so ignore
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                # we're already stopping so ignore
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            unset_flag(flag_consumer_fetching)


class _Resumed(Awaitable[Any]):
    """A coroutine that ran up to a wait, awaited from there: the wait it yielded is handed to
    whoever drives this (a task), then each value sent or error thrown goes on into it, as
    ``yield from`` would have passed them."""

    __slots__ = ("coroutine", "waits_for")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], waits_for: Any) -> None:
        self.coroutine = coroutine
        self.waits_for = waits_for

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, waits_for = self.coroutine, self.waits_for
        while True:
            try:
                sent = yield waits_for
            except BaseException as error:  # a cancellation, thrown in by the task
                try:
                    waits_for = coroutine.throw(error)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    waits_for = coroutine.send(sent)
                except StopIteration as done:
                    return done.value


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
    partitions given away (fix 3)."""

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


def take_events(stream: Any, max_: int, window: Callable[[int], float]) -> AsyncGenerator[list[EventT[Any]], None]:
    """Batches of at most ``max_`` events of ``stream``, each waiting at most ``window(n)``
    seconds to fill, ``n`` the size of the batch before it (0 for the first): Faust 0.15.3's
    ``Stream.take_events``, line for line but for that wait (fix 5). Each batch's events are
    acknowledged once the caller asks for the next, as Faust's are."""
    batches = _take_events(stream, max_, window)
    stream._active_agens.add(batches)  # closed with the stream, as Faust tracks its own
    return batches


async def _take_events(self: Any, max_: int, window: Callable[[int], float]) -> AsyncGenerator[list[EventT[Any]], None]:
    buffer: list[Any] = []
    events: list[EventT[Any]] = []
    buffer_add = buffer.append
    event_add = events.append
    buffer_size = buffer.__len__
    buffer_full = asyncio.Event()
    buffer_consumed = asyncio.Event()
    last = 0  # the size of the batch before (fix 5)
    stream_enable_acks: bool = self.enable_acks

    buffer_consuming: asyncio.Future[Any] | None = None

    channel_it = aiter(self.channel)

    # We add this processor to populate the buffer, and the stream
    # is passively consumed in the background (enable_passive below).
    async def add_to_buffer(value: Any) -> Any:
        try:
            # buffer_consuming is set when consuming buffer after timeout.
            nonlocal buffer_consuming
            if buffer_consuming is not None:
                try:
                    await buffer_consuming
                finally:
                    buffer_consuming = None
            buffer_add(value)
            event = self.current_event
            if event is None:
                raise RuntimeError("Take buffer found current_event is None")
            event_add(event)
            if buffer_size() >= max_:
                # signal that the buffer is full and should be emptied.
                buffer_full.set()
                # strict wait for buffer to be consumed after buffer full.
                # If max is 1000, we are not allowed to return 1001 values.
                buffer_consumed.clear()
                await self.wait(buffer_consumed)
        except asyncio.CancelledError:  # pragma: no cover
            raise
        except Exception as exc:
            self.log.exception("Error adding to take buffer: %r", exc)
            await self.crash(exc)
        return value

    # Disable acks to ensure this method acks manually
    # events only after they are consumed by the user
    self.enable_acks = False

    self.add_processor(add_to_buffer)
    self._enable_passive(channel_it)
    try:
        while not self.should_stop:
            # wait until buffer full, or timeout.
            await self.wait_for_stopped(buffer_full, timeout=window(last))
            if buffer:
                # make sure background thread does not add new items to
                # buffer while we read.
                buffer_consuming = self.loop.create_future()
                last = len(events)
                try:
                    yield list(events)
                finally:
                    buffer.clear()
                    for event in events:
                        await self.ack(event)
                    events.clear()
                    # allow writing to buffer again
                    notify(buffer_consuming)
                    buffer_full.clear()
                    buffer_consumed.set()
            else:
                last = 0
    finally:
        # Restore last behaviour of "enable_acks"
        self.enable_acks = stream_enable_acks
        self._processors.remove(add_to_buffer)
