"""The applier's loop: commands from Kafka, applied by key at once, results published, offsets committed.

    commands topic → :class:`~handlers.contracts.messages.Command` → already has a result? skip
        → :meth:`KubeApplier.try_once <streams.kube.applying.api.KubeApplier.try_once>`
          → :class:`~handlers.rules.results.RetryLater`? held, and tried again after its delay
        → :func:`~handlers.rules.results.decide_result` → notifications, audit, command-results
        → commit the command's offset

Commands of different keys (VMs, nodes) are applied at once by a pool of
``apply.concurrency`` workers, those of one key one after the other in offset order
(:class:`Lanes`); what they came to is published, and the offset committed, only for the
prefix of each partition whose commands all have their result. A command held for a retry
holds the commands of its key behind it, and its partition's offset.

Effectively once: the command-results topic is the ledger. At start-up (and before the
first batch after partitions are assigned, so a rebalance hands over what another applier
did) it is read to the end, and before every other batch what has arrived of it is taken;
a command whose id already has a result is skipped, with no second effect and no second
result. The result is published last and the offset committed after it, so a crash in
between re-applies a command: the level-based judgment (handlers/rules/judgment.py) makes that a
``noop``, and a restart is recognised by the record it left on its VM.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from handlers.contracts.messages import Command, CommandResult, describe_validation_error
from handlers.contracts.topics import AUDIT, COMMAND_RESULTS, COMMANDS, NOTIFICATIONS
from handlers.core.decisions import subject_key
from handlers.decide.engine import Engine, Source
from handlers.rules import policy
from handlers.rules.results import ResultDecision, RetryLater, Tries, decide_result
from streams.common import metrics, spans
from streams.common.cloudevents import TraceBook, event_source, kafka_headers, ref_of
from streams.common.codecs import encode_message
from streams.common.durable import Delivered, DurableProducer, Record
from streams.common.group_reading import GroupReader, Partition, Received
from streams.common.kafka_clients import consumer
from streams.common.reading import partitions_of, poll_records, read_to_end
from streams.common.settings import Settings
from streams.common.signing import Keyring, KeyringError, open_sealed
from streams.kube.applying.api import Applied, KubeApplier

if TYPE_CHECKING:
    from confluent_kafka import Consumer
    from pydantic import BaseModel

log = logging.getLogger(__name__)

CACHE_SYNC_SECONDS = 60.0  # at start, how long to wait for the policy's cache before reading live
QUIET_OUTCOMES = ("applied", "noop")  # logged at DEBUG: most commands, and all on the audit stream
COMMIT_SECONDS = 0.5  # offsets committed at most this often while running: each commit is a request
LEDGER_FETCH_BYTES, LEDGER_FETCH_WAIT_MS = 64 * 1024, 250  # the ledger fetches in batches


class ResultLedger:
    """Which commands already have a result, read from the command-results topic itself.

    The topic is the record (no local state to lose): read from the beginning at start-up
    (the first :meth:`catch_up`, before which it reads nothing), then read to the end again
    after a rebalance, and what has arrived taken before every other batch, so results
    another applier published count too.
    Only results sealed by an applier count (streams/common/signing.py), and not those refusing an
    unsealed command: anyone could publish either under a real command's id.
    """

    def __init__(self, settings: Settings, *, keyring: Keyring, timeout: float = 60.0) -> None:

        self.keyring = keyring
        self.ignored = 0  # results that did not count: unsealed, forged, refusing a forgery
        self.topic = settings.kafka.topic(COMMAND_RESULTS)
        self.consumer: Consumer = consumer(
            settings.kafka, client_id=f"{settings.worker.app_id}-applier-ledger",
            group_id=f"{settings.worker.app_id}-applier",
            # Not one fetch per result: the applier's own results it knows already, and what
            # other appliers did matters after a rebalance, which reads to the end anyway.
            config={"fetch.min.bytes": LEDGER_FETCH_BYTES, "fetch.wait.max.ms": LEDGER_FETCH_WAIT_MS},
        )
        self.partitions = partitions_of(self.consumer, [self.topic], wait=timeout)  # assigned by the first read
        self.done: set[str] = set()
        # partition → offsets of the results this applier wrote there, oldest first, until read back
        self.written: dict[int, deque[int]] = {tp.partition: deque() for tp in self.partitions}

    def __contains__(self, command_id: object) -> bool:
        return command_id in self.done

    def add(self, command_id: str) -> None:
        self.done.add(command_id)

    def wrote(self, delivered: Iterable[Delivered]) -> None:
        """Results this applier wrote, where the broker says it put them. Their commands were
        added to :attr:`done` as they were read (a refusal of an unsealed command marks
        nothing done, sealed or not), so reading them back needs no parse and no MAC check.
        Only the partitions this ledger reads, and only offsets the broker reported."""
        for place in delivered:
            mine = self.written.get(place.partition)
            if place.topic == self.topic and place.offset >= 0 and mine is not None:
                mine.append(place.offset)

    def _own(self, record: Received) -> bool:
        """Is ``record`` one this applier wrote? Offsets below it that were never read back
        (compacted away, or skipped) are forgotten on the way: a partition is read in order."""
        mine = self.written.get(record.partition)
        while mine and mine[0] < record.offset:
            mine.popleft()
        if mine and mine[0] == record.offset:
            mine.popleft()
            return True
        return False

    def catch_up(self, timeout: float = 60.0) -> None:
        """Read every result up to the end offsets as they are now."""
        for record in read_to_end(self.consumer, self.partitions, stall=timeout):
            self._read(record)

    def take_arrived(self) -> None:
        """Read the results already fetched, without waiting for more."""
        for record in poll_records(self.consumer, 0):
            self._read(record)

    def _read(self, record: Received) -> None:
        if self._own(record):  # this applier's own: its command is done already
            return
        result, problem = open_sealed(CommandResult, record.value or b"", "command-result", self.keyring)
        if result is None or problem is not None or (result.model_extra or {}).get("refused") == "unauthenticated":
            self.ignored += 1
            if result is not None and problem is not None:
                log.warning("a result for command %s is not sealed by an applier (%s): ignored",
                            result.command_id[:80], problem)
            return
        self.done.add(result.command_id)

    def close(self) -> None:
        self.consumer.close()


def _now() -> datetime:
    return datetime.now(UTC)


# What one command read comes to: messages to publish first (notification, audit record or
# dead letter), then its result.
Outputs = tuple[list[tuple[str, str, "BaseModel"]], list[tuple[str, str, "BaseModel"]]]


class Lanes:
    """Commands read and not yet released: one lane per key, lanes applied at once.

    The commands of one key (one VM, one node: the Kafka key) are applied one after the
    other in the order they were read, by one worker of the pool at a time; commands of
    different keys do not wait for each other. Each partition keeps its commands in offset
    order, and :meth:`release` hands out only the prefix of each that is settled. A try that
    says :class:`~handlers.rules.results.RetryLater` keeps its command at the head of its lane,
    unsettled, until a later try comes to something.
    """

    def __init__(self, pool: ThreadPoolExecutor, apply: Callable[[Command, Tries], Outputs | RetryLater]) -> None:
        self.pool = pool
        self.apply = apply
        self.changed = threading.Condition()
        self.waiting: dict[str, deque[tuple[list[Any], Command]]] = {}  # key → its lane, the running one first
        self.partitions: dict[Any, deque[list[Any]]] = {}  # partition → [offset, Outputs or None], in offset order
        self.running = 0  # commands started and not settled
        self.unreleased = 0  # commands read and not released: what bounds reading
        self.failure: BaseException | None = None

    def in_flight(self) -> int:
        """Commands read and not released yet, settled or not: a command that takes long
        holds back its partition's later ones, and the reading of more."""
        with self.changed:
            return self.unreleased

    def pending(self) -> bool:
        with self.changed:
            return any(self.partitions.values())

    def settled(self, tp: Any, offset: int, outputs: Outputs) -> None:
        """A command read that needs no API call: released in its turn."""
        with self.changed:
            self.partitions.setdefault(tp, deque()).append([offset, outputs])
            self.unreleased += 1

    def start(self, tp: Any, offset: int, key: str, command: Command) -> None:
        """Apply ``command`` after every command of ``key`` read before it."""
        slot: list[Any] = [offset, None]
        with self.changed:
            self.partitions.setdefault(tp, deque()).append(slot)
            self.running += 1
            self.unreleased += 1
            lane = self.waiting.get(key)
            if lane is not None:  # its key is busy: the lane's worker takes it in turn
                lane.append((slot, command))
                return
            self.waiting[key] = deque([(slot, command)])
        self.pool.submit(self._run_lane, key)

    def _run_lane(self, key: str) -> None:
        while True:
            with self.changed:
                slot, command = self.waiting[key][0]
            try:
                outputs = self._settle(command)
            except BaseException as exc:  # a bug: the loop stops on it, nothing past it is released
                with self.changed:
                    self.failure = exc
                    self.changed.notify_all()
                raise
            with self.changed:
                slot[1] = outputs
                self.running -= 1
                lane = self.waiting[key]
                lane.popleft()
                self.changed.notify_all()
                if not lane:
                    del self.waiting[key]
                    return

    def _settle(self, command: Command) -> Outputs:
        """Try ``command`` until it comes to something, waiting between tries as each asks."""
        started, tries = time.perf_counter(), Tries()
        while isinstance(outputs := self.apply(command, tries), RetryLater):
            if outputs.after > 0:
                time.sleep(outputs.after)
            tries = tries.after(outputs)
        metrics.APPLY_SECONDS.labels(command.type).observe(time.perf_counter() - started)
        return outputs

    def wait_for_change(self, timeout: float) -> None:
        """Until a command settles, unless one at the head of a partition has already."""
        with self.changed:
            if not any(slots and slots[0][1] is not None for slots in self.partitions.values()):
                self.changed.wait(timeout)

    def wait_until_idle(self) -> None:
        with self.changed:
            while self.running and self.failure is None:
                self.changed.wait()

    def release(self) -> tuple[list[tuple[str, str, BaseModel]], list[tuple[str, str, BaseModel]], dict[Any, int]]:
        """The settled prefix of every partition: its outputs, and the offset to commit."""
        first: list[tuple[str, str, BaseModel]] = []
        results: list[tuple[str, str, BaseModel]] = []
        offsets: dict[Any, int] = {}
        with self.changed:
            if self.failure is not None:
                raise RuntimeError("applying a command failed unexpectedly") from self.failure
            for tp, slots in self.partitions.items():
                while slots and slots[0][1] is not None:
                    offset, (before, result) = slots.popleft()
                    self.unreleased -= 1
                    first.extend(before)
                    results.extend(result)
                    offsets[tp] = offset + 1
        return first, results, offsets


class Applier:
    """The loop: consume commands, apply each once, publish what came of it, commit."""

    def __init__(
        self,
        settings: Settings,
        kube: KubeApplier,
        *,
        group_id: str | None = None,
        clock: Callable[[], datetime] = _now,
        concurrency: int | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        self.settings = settings
        self.concurrency = concurrency or settings.apply.concurrency
        self.max_in_flight = max_in_flight or settings.apply.max_in_flight
        self.kafka = settings.kafka
        self.kube = kube
        self.group_id = group_id or f"{settings.worker.app_id}-applier"
        self.clock = clock
        self.commands_topic = self.kafka.topic(COMMANDS)
        metrics.DEAD_LETTERS.labels(self.commands_topic)  # shown at 0 from the start (the alert's increase())
        self.engine = Engine(settings.rules())  # only for its dead letters
        self.event_source = event_source("applier", settings.worker.app_id)  # CloudEvents ``source``
        self.traces = TraceBook()  # each command's trace, carried by what comes of it (docs/integrators.md)
        self.applied_spans: dict[str, Any] = {}  # command id → its apply span, while spans are on
        self.ready = threading.Event()
        self.uncommitted: dict[Any, int] = {}  # partition → offset past its last released command
        self.unpublished: BaseException | None = None  # why a release failed: nothing is committed after it
        self.committed_at = time.monotonic()
        self.released_at = -math.inf  # when the loop last released (monotonic): the first one is not held
        self.keyring = settings.signing.keyring()
        if not self.keyring or self.keyring.active is None:
            raise KeyringError("the applier needs the signing keys the worker seals commands with, and one to "
                               "seal results with: set signing.keys_file or VMSTREAM_SIGNING__KEYS (docs/security.md)")

    def run(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set; ``ready`` is set once the ledger has been read."""
        ledger = ResultLedger(self.settings, keyring=self.keyring)
        out = DurableProducer(self.kafka, client_id=f"{self.settings.worker.app_id}-applier")
        cache = self.kube.cache
        try:
            if cache is not None:
                cache.start()
            ledger.catch_up()
            if cache is not None and not cache.wait_synced(CACHE_SYNC_SECONDS):
                log.warning("the policy's cache is not listed after %ss: reading live until it is",
                            CACHE_SYNC_SECONDS)
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="apply") as pool:
                lanes = Lanes(pool, self._try)
                self._consume(stop, lanes, ledger, out)
        finally:
            out.close()
            ledger.close()
            if cache is not None:
                cache.stop()

    def _consume(self, stop: threading.Event, lanes: Lanes, ledger: ResultLedger, out: DurableProducer) -> None:
        """The loop proper: read commands, set them going, release what they came to."""
        assigned = threading.Event()  # partitions came since the ledger last read to its end
        failed = False  # the loop stopped on an error: nothing is released on the way out

        def settle(revoked: list[Partition]) -> None:
            # A partition taken away mid-flight: what was read of it is finished, published
            # and committed first, so its next owner starts where this one stopped. Called
            # inside commands.poll() and commands.close(), on this thread.
            if not failed:
                self._release(lanes, commands, out, ledger, wait=True)

        commands = GroupReader(
            self.kafka, group_id=self.group_id, client_id=f"{self.settings.worker.app_id}-applier",
            topic=self.commands_topic, on_revoke=settle, on_assign=lambda _: assigned.set(),
            # Static membership and the session: back at once after a crash (settings.py).
            membership=self.settings.worker.librdkafka_membership(),
            fetch_wait_ms=self.settings.apply.fetch_wait_ms,
        )
        log.info("applier ready: %d commands already have a result", len(ledger.done))
        self.ready.set()
        try:
            while not stop.is_set():
                if lanes.in_flight() >= self.max_in_flight:
                    lanes.wait_for_change(timeout=0.5)
                else:
                    self._read(commands, assigned, ledger, lanes)
                # At the bound, at once: wait_for_change does not wait while a settled command
                # heads a partition, so holding it back would spin the loop.
                if (lanes.in_flight() >= self.max_in_flight
                        or time.monotonic() - self.released_at >= self.settings.apply.release_seconds):
                    self._release(lanes, commands, out, ledger)
                commands.record_lag()
            self._release(lanes, commands, out, ledger, wait=True)
        except BaseException:
            failed = True
            raise
        finally:
            commands.close()  # leaves the group: settle() runs once more, with nothing left

    def _read(self, commands: GroupReader, assigned: threading.Event, ledger: ResultLedger, lanes: Lanes) -> None:
        """Read what commands have come, up to the bound, and set each going.

        Partitions handed over: what their last owner applied is read to the end first.
        Otherwise the results that have come are taken as they are, without a round trip to
        the broker. While commands are in flight, back soon to publish what they came to.
        """
        batch = commands.poll(0.02 if lanes.pending() else 0.5, max_records=self.max_in_flight - lanes.in_flight())
        if not batch:
            return
        if assigned.is_set():
            assigned.clear()
            ledger.catch_up()
        else:
            ledger.take_arrived()
        for tp, records in batch.items():
            for record in records:
                self._admit(tp, record, ledger, lanes)

    def _admit(self, tp: Partition, record: Received, ledger: ResultLedger, lanes: Lanes) -> None:
        """One command read: set going behind the commands of its key, or settled at once
        (malformed: a dead letter; not sealed by the worker: refused; already done: skipped)."""
        dead: list[tuple[str, str, BaseModel]] = []
        command = self._parse(record, dead)
        if command is None:
            lanes.settled(tp, record.offset, (dead, []))
            return
        problem = self.keyring.problem("command", command)
        if problem is not None:  # not the worker's: refused, and it marks nothing done
            log.warning("command %s at %s:%d:%d is not sealed by the worker (%s): refused",
                        command.command_id[:80], record.topic, record.partition, record.offset, problem)
            decision = policy.unauthenticated(command, reason=problem, now=self.clock(), topic=self.commands_topic)
            lanes.settled(tp, record.offset, self._outputs(command, decision))
            return
        if command.command_id in ledger:
            log.info("command %s already has a result: skipped", command.command_id)
            lanes.settled(tp, record.offset, ([], []))
            return
        ledger.add(command.command_id)  # a repeat read before this one is done is skipped too
        lanes.start(tp, record.offset, subject_key(command.target), command)

    def _try(self, command: Command, tries: Tries) -> Outputs | RetryLater:
        decision = self.apply_one(command, tries)
        return decision if isinstance(decision, RetryLater) else self._outputs(command, decision)

    def _outputs(self, command: Command, decision: ResultDecision) -> Outputs:
        """What to publish of a decision: notification and audit record first, then the result."""
        first: list[tuple[str, str, BaseModel]] = []
        if decision.notification is not None:
            first.append((self.kafka.topic(NOTIFICATIONS), subject_key(decision.notification.subject),
                          decision.notification))
        first.append((self.kafka.topic(AUDIT), decision.audit.input.key or "", decision.audit))
        return first, [(self.kafka.topic(COMMAND_RESULTS), subject_key(command.target), decision.result)]

    def _release(self, lanes: Lanes, commands: GroupReader, out: DurableProducer, ledger: ResultLedger, *,
                 wait: bool = False) -> None:
        """Publish what the commands at the head of each partition came to, and commit past them.

        Only a prefix of each partition is released: a command still in flight holds back
        the ones read after it on its partition (their effects are in the API server, their
        results wait), so the committed offset never passes a command that has no result.
        Notifications and audit records first, the results last: they are what marks a
        command done, for this applier and the next. The offsets are committed once the
        results are acknowledged, at most every :data:`COMMIT_SECONDS`; the loop waits for
        that commit only with ``wait``: when partitions are taken away (the revoke callback)
        and when it stops. A commit not made when the process dies
        or a partition moves only means commands read again: the ledger, read to its end at
        start and after an assignment, skips them.

        The loop releases at most every ``apply.release_seconds`` while commands keep
        settling, and at once when ``max_in_flight`` are unreleased: commands that arrive one
        by one share the two produce requests of a release (tests/kube/test_applier_release.py).

        Once a release could not be published, nothing is released or committed again by
        this process, whoever asks (the loop, or the revoke callback as the consumer
        closes): the commands released with it were taken off their lanes, so a
        later commit would pass them, and they were applied without a result.
        """
        if self.unpublished is not None:
            return
        if wait:
            lanes.wait_until_idle()
        first, results, offsets = lanes.release()
        if first or results:
            self.released_at = time.monotonic()
        try:
            if first:
                self._send(out, first)
            if results:
                ledger.wrote(self._send(out, results))
        except BaseException as error:
            self.unpublished = error
            raise
        self.uncommitted.update(offsets)
        if self.uncommitted and (wait or time.monotonic() - self.committed_at >= COMMIT_SECONDS):
            commands.commit(self.uncommitted, wait=wait)
            self.uncommitted, self.committed_at = {}, time.monotonic()

    def _parse(self, record: Received, dead: list[tuple[str, str, BaseModel]]) -> Command | None:
        key = record.key.decode("utf-8", "replace") if record.key else None
        raw: bytes = record.value or b""
        try:
            command = Command.model_validate_json(raw)
            self.traces.keep(command.command_id, record.headers)
            return command
        except ValidationError as exc:
            self.traces.keep(f"{record.topic}:{record.partition}:{record.offset}", record.headers)
            source = Source(record.topic, key, record.partition, record.offset)
            result = self.engine.dead_letter(raw, describe_validation_error(exc), source, self.clock())
            log.warning("malformed command at %s:%d:%d", record.topic, record.partition, record.offset)
            metrics.DEAD_LETTERS.labels(record.topic).inc()
            dead.extend((self.kafka.topic(o.topic), o.key, o.value) for o in result.outputs())
            return None

    def apply_one(self, command: Command, tries: Tries = Tries()) -> ResultDecision | RetryLater:
        """One try of one command on the API server after ``tries``, and what to record of it
        once it has come to something."""
        with spans.span(f"apply {command.type}", self.traces.trace(command.command_id), kind=spans.Kind.CONSUMER,
                        attributes={"vmstream.command": command.command_id,
                                    "vmstream.target": subject_key(command.target)}) as span:
            try:
                applied = self.kube.try_once(command, tries)
            except Exception as exc:  # a bug must not stop the line: record it as a failure
                log.exception("applying command %s failed unexpectedly", command.command_id)
                applied = Applied("failed", error=f"internal error: {type(exc).__name__}: {exc}")
            if span is not None:
                if isinstance(applied, RetryLater):
                    span.set_attribute("vmstream.outcome", "retry_later")
                else:
                    span.set_attribute("vmstream.outcome", applied.outcome)
                    if applied.outcome == "failed":
                        span.set_status(spans.Status(spans.StatusCode.ERROR, applied.error or "failed"))
                self.applied_spans[command.command_id] = span.get_span_context()
        if isinstance(applied, RetryLater):
            # An API server in trouble is worth a warning; a VM that changed meanwhile is not.
            log.log(logging.WARNING if applied.cause == "transient" else logging.INFO,
                    "command %s (%s %s) held, tried again in %.1fs: %s", command.command_id, command.type,
                    subject_key(command.target), applied.after, applied.reason)
            return applied
        metrics.APPLY_RESULTS.labels(command.type, applied.outcome).inc()
        # The audit stream records every result; a line of its own only for what went otherwise.
        level = logging.DEBUG if applied.outcome in QUIET_OUTCOMES else logging.INFO
        if log.isEnabledFor(level):
            log.log(level, "command %s (%s %s): %s%s", command.command_id, command.type, subject_key(command.target),
                    applied.outcome, f" — {applied.error}" if applied.error else "")
        decision = decide_result(
            command, outcome=applied.outcome, now=self.clock(), error=applied.error,
            resource_version=applied.resource_version, owner=applied.owner, topic=self.commands_topic,
        )
        if applied.refused:
            return ResultDecision(decision.result.model_copy(update={"refused": "policy"}), decision.audit,
                                  decision.notification)
        return decision

    def _send(self, out: DurableProducer, messages: Sequence[tuple[str, str, BaseModel]]) -> list[Delivered]:
        """Send and wait for the broker; each record carries the CloudEvents headers and the
        trace of the command it comes of (streams/common/cloudevents.py). Where each landed."""
        started = spans.now() if spans.enabled() else 0
        delivered = out.send_all([
            Record(topic, key.encode() if key else None, encode_message(value, keyring=self.keyring),
                   list(kafka_headers(value, source=self.event_source, trace=self.traces.trace(ref_of(value)),
                                      time=self.clock()).items()))
            for topic, key, value in messages
        ])
        if started:  # each record's span, a child of its command's apply span (streams/common/spans.py)
            ended = spans.now()
            for topic, _, value in messages:
                ref = ref_of(value)
                spans.sent(value, self.applied_spans.get(ref) or self.traces.trace(ref), topic=topic,
                           start=started, end=ended)
        for _, _, value in messages:
            if isinstance(value, CommandResult):  # the command is done: its trace is not needed again
                self.traces.forget(value.command_id)
                self.applied_spans.pop(value.command_id, None)
        return delivered


