"""The ``route`` stage on a consumer group of its own, outside Faust's per-message machinery.

``route`` keeps no state: it reads an intent or a watch event, names the key it is decided
under and writes it onto the routed topic (docs/worker.md, "Decision keys"). Nothing Faust
gives an agent — tables co-partitioned with its input, their recovery, the assignor that
keeps them together — is used by it, and what Faust costs per message (an event, its ack,
its sensors, an asyncio queue per topic) was paid on every intent twice, here and again in
``decide``. So the stage is a plain aiokafka consumer in the group ``<app_id>-route``
(:data:`~streams.common.topics.ROUTE_GROUP`), at least once:

- a batch's routed records (and dead letters) are acknowledged by the broker before the
  batch's offsets are committed (``deliver`` never returns otherwise: it stops the process);
- offsets are committed at most every ``commit_interval`` seconds, and at once when
  partitions are revoked and when the worker stops, after the batch in flight is delivered;
  a crash in between routes the uncommitted inputs again, which ``decide`` takes as it takes
  any redelivery (an intent is then a ``duplicate``; ids come from the input's origin);
- before it joins its group, a partition the group has never committed is given the offset
  the worker's Faust group (``<app_id>``), which routed before this stage existed, committed
  for it (:func:`inherit_offsets`): an upgrade routes nothing twice and skips nothing. A
  partition neither group committed starts at the beginning. If the offsets cannot be read
  or written, the worker does not start: from the beginning, it would route a retention's
  intents again.

Membership is the worker's (static with ``worker.group_instance_id``, its id suffixed
``-route``) and so is the fetch pacing: full fetches while busy, a long poll that returns at
the first record while idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import IllegalGenerationError, KafkaError, RebalanceInProgressError, UnknownMemberIdError
from mode import Service
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from streams.common import metrics
from streams.common.group_reading import Partition
from streams.common.settings import KafkaSettings, Settings
from streams.common.topics import route_group
from streams.worker.broker_credentials import aiokafka_options, pace_fetches

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # the longest a poll waits before a due commit or a stop is looked at
INHERIT_ATTEMPTS = 3  # another replica may join the route group while offsets are given to it
# A broker that answers but cannot say yet (no group coordinator on a fresh cluster, a leader
# moving) is asked again for this long before the worker gives up and exits.
INHERIT_PATIENCE_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Read:
    """A record as the route stage read it, in the shape of Faust's ``Message`` (timestamp in
    seconds, as Faust gives it), so that routing and dead-lettering read both alike."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: float
    headers: Sequence[tuple[str, bytes]]


class Router(Service):
    """Reads ``topics`` in the route group, hands each batch to ``route``, delivers what it
    returns with ``deliver`` and commits the batch's offsets after."""

    def __init__(self, settings: Settings, topics: Sequence[str], *,
                 route: Callable[[Read], list[Any]], deliver: Callable[[list[Any]], Awaitable[None]],
                 commit_interval: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.settings = settings
        self.topics = tuple(topics)
        self.route = route
        self.deliver = deliver
        self.commit_interval = commit_interval
        self.group_id = route_group(settings.worker.app_id)
        self.consumer: AIOKafkaConsumer | None = None
        self.delivered: dict[TopicPartition, int] = {}  # the next offset, delivered, not committed
        self._committed_at = time.monotonic()
        self._in_flight: asyncio.Future[None] | None = None
        self._loop_task: asyncio.Future[None] | None = None

    def __repr__(self) -> str:  # mode logs services by repr
        return f"<Router {self.group_id}>"

    async def on_start(self) -> None:
        conf, kafka = self.settings.worker, self.settings.kafka
        inherited = await asyncio.get_running_loop().run_in_executor(None, self._inherit)
        if inherited:
            log.info("the route group starts where the worker's group left its inputs",
                     extra={"group": conf.app_id, "partitions": len(inherited)})
        instance = f"{conf.group_instance_id}-route" if conf.group_instance_id else None
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka.bootstrap_servers, client_id=self.group_id, group_id=self.group_id,
            group_instance_id=instance, enable_auto_commit=False, auto_offset_reset="earliest",
            # as Faust read these topics: an aborted transaction's intents are skipped under
            # exactly-once only
            isolation_level="read_committed" if conf.exactly_once else "read_uncommitted",
            session_timeout_ms=int(conf.session_timeout_seconds * 1000),
            heartbeat_interval_ms=int(conf.heartbeat_interval_seconds * 1000),
            fetch_max_wait_ms=conf.fetch_idle_wait_ms, fetch_min_bytes=1,
            max_poll_records=conf.batch_size, **aiokafka_options(kafka))
        self.consumer.subscribe(topics=list(self.topics), listener=_Handover(self))
        await self.consumer.start()
        self._loop_task = asyncio.ensure_future(self._run())

    async def on_stop(self) -> None:
        """Finish the batch in flight, commit what was delivered, stop the consumer."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass  # a failure was logged where it happened
        if self.consumer is not None:
            await self.commit()
            await self.consumer.stop()

    async def _run(self) -> None:
        consumer, conf = self.consumer, self.settings.worker
        assert consumer is not None
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=int(POLL_SECONDS * 1000), max_records=conf.batch_size)
                busy = any(batches.values())
                pace_fetches(consumer, min_bytes=conf.fetch_min_bytes if busy else 1,
                             max_wait_ms=conf.fetch_max_wait_ms if busy else conf.fetch_idle_wait_ms)
                if busy:
                    await self._route_batch(batches)
                if self.delivered and time.monotonic() - self._committed_at >= self.commit_interval:
                    await self.commit()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the consumer cannot go on (authorization, a fatal error)
            log.exception("the route stage stopped")
            await self.crash(error)
            raise

    async def _route_batch(self, batches: dict[TopicPartition, list[Any]]) -> None:
        outgoing: list[Any] = []
        ends: dict[TopicPartition, int] = {}
        for tp, records in batches.items():
            for record in records:
                outgoing += self.route(Read(record.topic, record.partition, record.offset, record.key, record.value,
                                            record.timestamp / 1000.0, record.headers))
            ends[tp] = records[-1].offset + 1
        # Shielded: a stop or a revocation waits for it (``settle``), and finds its offsets
        # among the delivered ones when it ends.
        self._in_flight = asyncio.ensure_future(self._deliver(outgoing, ends))
        try:
            await asyncio.shield(self._in_flight)
        except asyncio.CancelledError:
            await self._in_flight
            raise

    async def _deliver(self, outgoing: list[Any], ends: dict[TopicPartition, int]) -> None:
        await self.deliver(outgoing)
        self.delivered.update(ends)

    async def settle(self) -> None:
        """The batch in flight delivered, then every delivered offset committed."""
        if self._in_flight is not None and not self._in_flight.done():
            await asyncio.shield(self._in_flight)
        await self.commit()

    async def commit(self) -> None:
        """Commit the delivered offsets. Those of a commit that fails (the partition went
        meanwhile) or is cut short go back among the delivered, for the next commit; one
        whose partition is owned elsewhere by then fails again there, and its owner routes
        those inputs again."""
        offsets, self.delivered = self.delivered, {}
        self._committed_at = time.monotonic()
        if not offsets or self.consumer is None:
            return
        try:
            await self.consumer.commit(offsets)
        except BaseException as error:
            for tp, offset in offsets.items():
                self.delivered[tp] = max(offset, self.delivered.get(tp, offset))
            if not isinstance(error, Exception):
                raise  # a cancellation: the stop commits them
            log.warning("route offsets not committed: %r", error, extra={"partitions": len(offsets)})

    def _inherit(self) -> dict[TopicPartition, int]:
        groups = GroupOffsets(self.settings.kafka, client_id=f"{self.group_id}-inherit")
        given = inherit_offsets_patiently(groups, self.group_id, self.settings.worker.app_id, self.topics)
        return {TopicPartition(tp.topic, tp.partition): offset for tp, offset in given.items()}

    def record_lag(self) -> None:
        """The route stage's lag on its input partitions (``vmstream_consumer_lag``)."""
        if self.consumer is not None:
            metrics.record_aiokafka_lag(self.consumer)


# What a write of a group's offsets gets while the group has members: read them again.
REFUSED_WHILE_MEMBERS: tuple[type[Exception], ...] = (
    UnknownMemberIdError, IllegalGenerationError, RebalanceInProgressError)


class Groups(Protocol):
    """The committed offsets of consumer groups, as :func:`inherit_offsets` reads and writes them."""

    def committed(self, group: str) -> dict[Partition, int]: ...

    def give(self, group: str, offsets: dict[Partition, int]) -> list[str]:
        """Write ``offsets``; why any was refused (nothing: all written)."""
        ...


class GroupOffsets:
    """:class:`Groups` through aiokafka, the route stage's own client: the offsets read with
    its admin client, written by a consumer of the group that commits without joining it
    (a commit the broker refuses while the group has members).

    Not librdkafka's admin client, as the other processes use: version 2.16 crashes the
    process at a group request after one that met a coordinator still loading, which is
    what a broker just started answers (tests/kafka/test_route_group.py). Each call runs on
    an event loop of its own: the route stage asks from a thread, before it starts.
    """

    def __init__(self, kafka: KafkaSettings, client_id: str) -> None:
        self.kafka = kafka
        self.client_id = client_id

    def committed(self, group: str) -> dict[Partition, int]:
        return asyncio.run(self._committed(group))

    def give(self, group: str, offsets: dict[Partition, int]) -> list[str]:
        return asyncio.run(self._give(group, offsets))

    async def _committed(self, group: str) -> dict[Partition, int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.kafka.bootstrap_servers, client_id=self.client_id,
                                    **aiokafka_options(self.kafka))
        await admin.start()
        try:
            listed = await admin.list_consumer_group_offsets(group)
        finally:
            await admin.close()
        return {Partition(tp.topic, tp.partition): meta.offset for tp, meta in listed.items()}

    async def _give(self, group: str, offsets: dict[Partition, int]) -> list[str]:
        writer = AIOKafkaConsumer(bootstrap_servers=self.kafka.bootstrap_servers, client_id=self.client_id,
                                  group_id=group, enable_auto_commit=False, **aiokafka_options(self.kafka))
        await writer.start()
        try:
            writer.assign([TopicPartition(tp.topic, tp.partition) for tp in offsets])
            await writer.commit({TopicPartition(tp.topic, tp.partition): offset for tp, offset in offsets.items()})
        except REFUSED_WHILE_MEMBERS as refused:
            return [type(refused).__name__]
        finally:
            await writer.stop()
        return []


def _retriable(error: BaseException) -> bool:
    return isinstance(error, KafkaError) and bool(error.retriable)


def inherit_offsets_patiently(groups: Groups, group: str, former: str, topics: Sequence[str], *,
                              patience: float = INHERIT_PATIENCE_SECONDS) -> dict[Partition, int]:
    """:func:`inherit_offsets`, asked again after a retriable error for ``patience`` seconds."""
    for attempt in Retrying(retry=retry_if_exception(_retriable), reraise=True, stop=stop_after_delay(patience),
                            wait=wait_exponential(multiplier=0.1, max=2.0)):
        with attempt:
            return inherit_offsets(groups, group, former, topics)
    raise AssertionError("unreachable: Retrying returns or raises")


def inherit_offsets(groups: Groups, group: str, former: str, topics: Sequence[str]) -> dict[Partition, int]:
    """Give ``group`` the offsets ``former`` committed on ``topics`` for every partition
    ``group`` has none of; returns what was given.

    Offsets can be written only while the group has no member. A replica that started
    meanwhile joined it with the offsets it gave: read again, they are then found.
    """
    for _ in range(INHERIT_ATTEMPTS):
        ours = groups.committed(group)
        theirs = groups.committed(former)
        wanted = {tp: offset for tp, offset in theirs.items()
                  if tp.topic in topics and offset >= 0 and ours.get(tp, -1) < 0}
        if not wanted:
            return {}
        refused = groups.give(group, wanted)
        if not refused:
            return wanted
        log.info("route offsets not given yet: %s", sorted(set(refused)))
    raise RuntimeError(f"could not give the consumer group {group} the offsets {former} committed "
                       f"({len(wanted)} partitions): its members would route them from the beginning")


class _Handover(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka's abc has no types
    """Revoked: the batch in flight delivered and committed before the partitions go."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.router.settle()

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        pass  # where to start was settled before the group was joined (inherit_offsets)
