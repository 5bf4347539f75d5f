"""The handlers' state, kept in Faust tables, written by group commit.

A batch of inputs is decided one after the other; each decision's state changes are
*staged* (later decisions in the batch read them), the batch's messages are sent and
acknowledged, and only then are the changes written to the tables — each to the changelog
partition of the input that made it. One broker round trip per batch instead of one per
input, and still: no state is recorded whose messages might have been lost (see
``docs/worker.md``, "Effectively once"). The rows go to the changelogs as records of the
worker's own producer, sent with the batch's and waited for before its inputs are
acknowledged; the local store is written as Faust's table would write it. (Faust's own way,
a table's ``__setitem__``, queues each row in its changelog buffer, a task and a future per
row, sent apart from the batch's own records. Under ``worker.exactly_once`` rows take that
way still, inside Faust's transaction.)

The rows of one decision go to several changelogs (one per table), and a worker can die
between any two of them. So before anything of a batch leaves, the :class:`Journal` records
each input's whole decision — its messages and its state changes — as one record, keyed by
the input's topic, partition and offset, and waits for the broker to have it. An input
delivered again after a crash finds its record: its messages are sent again as they were
and its rows written again, instead of a new decision over half-written state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from faust.streams import _current_event
from faust.types import TP, EventT
from pydantic import TypeAdapter, ValidationError

from handlers.contracts.messages import AuditRecord, Command, DeadLetter, Notification
from handlers.core.decisions import Decision, ResidentUpdate
from handlers.core.state import Change, DeadlineIndex, ExpiryIndex, PlanIndex
from handlers.core.tables import DRAINS, PLANS, PROCESSED, Table, TableName, table_named
from handlers.decide.engine import Result
from streams.common.codecs import decode_state, encode_state
from streams.common.durable import Delivered, Record
from streams.common.globalview import GlobalView

log = logging.getLogger(__name__)

INDEXED_PER_ASK = 10_000  # processed rows read into the rebuilt index each time it is asked
EXIT_UNJOURNALED = 75  # as a batch whose messages cannot be published: restarted, replayed or decided again

_DELETED = object()
V = TypeVar("V")

# Sends records and returns once the broker has every one, where each landed; never returns
# otherwise (the worker's ``_deliver`` stops the process first).
Deliver = Callable[[Sequence[Record]], Awaitable[list[Delivered]]]


class Row(NamedTuple):
    """A table row as its changelog gets it, with the input whose decision wrote it."""

    event: EventT[Any]
    table: str  # the table's name (handlers/core/tables.py)
    record: Record


def row_key(key: str) -> bytes:
    """A row's key as Faust's tables serialize a ``str`` key (``json``), which recovery reads."""
    return json.dumps(key).encode()


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


def input_ref(event: EventT[Any]) -> str:
    """An input as the journal names it: ``topic:partition:offset`` (topic names hold no ':')."""
    message = event.message
    return f"{message.topic}:{message.partition}:{message.offset}"


def _fingerprint(event: EventT[Any]) -> str:
    """The input's key, value and time: a record is replayed only for the message it was made
    for, never for another one at the same offset (a topic deleted and created again)."""
    message = event.message
    digest = hashlib.blake2b(digest_size=16)
    for part in (message.key, message.value):
        raw = part if isinstance(part, bytes) else (b"" if part is None else str(part).encode())
        digest.update(b"-" if part is None else len(raw).to_bytes(8, "big"))
        digest.update(raw)
    digest.update(repr(message.timestamp).encode())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class _Recorded:
    """One :class:`~handlers.decide.engine.Result` as the journal keeps it; state values as the
    text their table's codec writes (``streams/common/codecs.py``)."""

    commands: list[Command]
    notifications: list[Notification]
    audit: AuditRecord | None
    forwards: list[ResidentUpdate]
    changes: list[tuple[TableName, str, str | None]]
    dead_letters: list[DeadLetter]
    dead_letter_key: str | None


@dataclass(frozen=True, slots=True)
class _Entry:
    input: str  # the input's fingerprint
    results: list[_Recorded]


@dataclass(frozen=True, slots=True)
class _Parts:
    """The head of an entry too large for one record: its parts follow under ``<ref>#<i>``."""

    input: str
    parts: int
    digest: str


_ENTRY: TypeAdapter[_Entry] = TypeAdapter(_Entry)
_PARTS: TypeAdapter[_Parts] = TypeAdapter(_Parts)


class Journal:
    """Write-ahead journal of decisions: one record per input, written before its outputs.

    Each decided input's results — the messages ``_publish`` sends and the rows the tables
    get — are written as one record (``state-journal`` changelog, the input's partition,
    keyed by :func:`input_ref`) and acknowledged by the broker before anything of its batch
    is sent. A crash before that acknowledgement left nothing behind: the input is decided
    afresh. After it, a redelivered input is not decided again: :meth:`recorded` gives its
    results back, its messages go out again byte for byte (the same ids, dropped by
    consumers) and its rows are written again (the same values). Records of inputs whose
    offsets are committed are never needed again and are deleted (:meth:`prune`).
    """

    PART_BYTES = 256 * 1024  # an entry above this is split: every record fits the broker's 1 MB

    def __init__(self, table: Any, *, prune_seconds: float = 1.0) -> None:
        self.table = table
        self.prune_seconds = prune_seconds
        self._pruned_at = 0.0
        self._committed: dict[TP, int] = {}  # what the broker has acknowledged as committed
        app = getattr(table, "app", None)
        if app is not None:
            self._hear_commits(app.tables)

    def _hear_commits(self, manager: Any) -> None:
        """Learn each commit the broker acknowledged: Faust calls its table manager's
        ``on_commit`` only then. (Its consumer's ``_committed_offset`` is updated even when
        the commit failed, and an entry pruned on its word would be missed after a crash.)"""
        on_commit = manager.on_commit

        def committed(offsets: Mapping[TP, int]) -> None:
            self._committed.update(offsets)
            on_commit(offsets)

        manager.on_commit = committed

    @property
    def topic(self) -> str:
        return str(self.table.changelog_topic.get_topic_name())

    # ------------------------------------------------------------------ reading

    def recorded(self, event: EventT[Any]) -> list[Result] | None:
        """The results recorded for this very input, or ``None`` if it must be decided."""
        ref = input_ref(event)
        with deciding(event):
            raw = _rows(self.table).get(ref)
            if raw is None:
                return None
            try:
                head = json.loads(raw)
                if "parts" in head:
                    raw = self._joined(ref, _PARTS.validate_python(head))
                    if raw is None:
                        return None
                entry = _ENTRY.validate_json(raw)
                if entry.input != _fingerprint(event):
                    return None  # the record of another message once at this offset
                return [_result(recorded) for recorded in entry.results]
            except (ValueError, ValidationError) as error:  # written by another version of the worker
                log.warning("journal entry not readable, deciding again", extra={"ref": ref, "error": str(error)})
                return None

    def _joined(self, ref: str, head: _Parts) -> bytes | None:
        """An entry's parts joined, if all of them are there and are the ones the head names."""
        rows = _rows(self.table)
        parts = [rows.get(f"{ref}#{index}") for index in range(1, head.parts + 1)]
        if any(part is None for part in parts):
            return None
        joined = b"".join(parts)
        return joined if hashlib.blake2b(joined, digest_size=16).hexdigest() == head.digest else None

    # ------------------------------------------------------------------ writing

    async def record(self, decided: Sequence[tuple[EventT[Any], list[Result]]], *, deliver: Deliver,
                     encoded: dict[int, bytes]) -> None:
        """Write the entries of freshly decided inputs and wait until the broker has them all
        (``deliver`` stops the process otherwise, before the batch is acknowledged: restarted,
        it decides the batch again).

        ``encoded`` receives each change's encoded value (by ``id``) so the rows written
        afterwards are the very bytes recorded. Inputs without any effect are not recorded:
        deciding them again can only decide what nobody has seen yet.
        """
        topic = self.topic
        stored: list[tuple[EventT[Any], list[tuple[str, bytes]]]] = []
        for event, results in decided:
            if not any(r.dead_letters or r.decision.changes or r.decision.forwards or r.decision.has_outputs
                       for r in results):
                continue
            fingerprint = _fingerprint(event)
            entry = _ENTRY.dump_json(_Entry(fingerprint, [_recorded(r, encoded) for r in results]))
            stored.append((event, self._records(input_ref(event), fingerprint, entry)))
        await deliver([Record(topic, row_key(key), value, partition=event.message.partition)
                       for event, records in stored for key, value in records])
        for event, records in stored:  # the local copy of what the changelog now holds
            with deciding(event):
                for key, value in records:
                    self.table.data[key] = value

    def _records(self, ref: str, fingerprint: str, entry: bytes) -> list[tuple[str, bytes]]:
        """The entry as one record, or as parts followed by their head (same partition, in order)."""
        if len(entry) <= self.PART_BYTES:
            return [(ref, entry)]
        pieces = [entry[at:at + self.PART_BYTES] for at in range(0, len(entry), self.PART_BYTES)]
        head = _Parts(fingerprint, len(pieces), hashlib.blake2b(entry, digest_size=16).hexdigest())
        return [(f"{ref}#{index}", piece) for index, piece in enumerate(pieces, 1)] + [(ref, _PARTS.dump_json(head))]

    # ------------------------------------------------------------------ pruning

    def prune(self) -> list[Record]:
        """Delete the entries of inputs whose offsets this process committed (at most once
        per ``prune_seconds``); returns their tombstones, for the caller to send.

        An input is acknowledged only after its rows are (:meth:`TableState.send_rows`), so a
        committed input's rows are all written. Entries of inputs committed by a predecessor
        stay until this process commits their partition past them.
        """
        now = time.monotonic()
        if now - self._pruned_at < self.prune_seconds:
            return []
        self._pruned_at = now
        done = []
        for key in list(self.table.keys()):
            topic, partition, offset = key.split("#", 1)[0].rsplit(":", 2)
            tp = TP(topic, int(partition))
            upto = self._committed.get(tp)
            if upto is not None and int(offset) < upto:
                done.append((key, tp.partition))
        for key, _ in done:
            self.table.data.pop(key, None)
        topic = self.topic
        return [Record(topic, row_key(key), None, partition=partition) for key, partition in done]


def _rows(table: Any) -> Any:
    """A Faust table's store, read as a mapping: where :func:`_store` writes the rows, read
    the same way; a plain mapping in tests is its own store."""
    return getattr(table, "data", table)


def _store(table: Any, key: str, raw: bytes | None, partition: int) -> None:
    """Write a row into a Faust table's local store only, as its ``__setitem__`` would
    before it sends the row (the store of the current event's partition), and keep the
    row's partition where the in-memory store's fix looks for it (streams/worker/faustfixes.py)."""
    store = _rows(table)
    owners = getattr(store, "_key_partition", None)
    if raw is None:
        store.pop(key, None)
        if owners is not None:
            owners.pop(key, None)
        return
    store[key] = raw
    if owners is not None:
        owners[key] = partition


def _stop() -> None:
    """End the process before Faust acknowledges the batch: raised, the error would leave
    the agent and Faust would acknowledge the batch on its way out, and its inputs would be
    skipped. Restarted, the worker replays the batch from the journal or decides it again."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(EXIT_UNJOURNALED)


def _recorded(result: Result, encoded: dict[int, bytes]) -> _Recorded:
    decision = result.decision
    changes: list[tuple[TableName, str, str | None]] = []
    for change in decision.changes:
        name = table_named(change.table).name
        if change.value is None:
            changes.append((name, change.key, None))
        else:
            raw = encoded[id(change)] = encode_state(change.table, change.value)
            changes.append((name, change.key, raw.decode()))
    return _Recorded(decision.commands, decision.notifications, decision.audit, decision.forwards, changes,
                     result.dead_letters, result.dead_letter_key)


def _result(recorded: _Recorded) -> Result:
    changes = [Change(table_named(table), key, None if value is None else decode_state(table, value))
               for table, key, value in recorded.changes]
    decision = Decision(list(recorded.commands), list(recorded.notifications), recorded.audit, changes,
                        list(recorded.forwards))
    return Result(decision, list(recorded.dead_letters), recorded.dead_letter_key)


class TableState:
    """The handlers' :class:`~handlers.core.state.StateView` over Faust tables of bytes.

    Reads see, in order: changes staged by the current batch, this instance's tables, and
    — for cluster-wide tables — the :class:`GlobalView` of every partition. Decoded values
    are cached and reused while the stored bytes are the same object.

    It keeps the :class:`~handlers.core.state.DeadlineIndex` of its ``drains`` rows and the
    :class:`~handlers.core.state.ExpiryIndex` of its ``processed`` rows, so the timer asks the
    rules what is due (``Engine.due``) without a pass over every episode or intent id:
    noted as rows are written, and rebuilt from the rows after the partitions this instance
    owns changed (:meth:`rebuild_indexes`, on every completed rebalance).
    """

    def __init__(self, tables: Mapping[str, Any], view: GlobalView, journal: Journal | None = None, *,
                 rows_through_faust: bool = False) -> None:
        self.tables = tables
        self.view = view
        self.journal = journal
        self.rows_through_faust = rows_through_faust  # under exactly-once: in Faust's transaction
        self._changelogs: dict[str, str] = {}  # table name → its changelog topic
        self._decoded: dict[tuple[str, str], tuple[bytes, Any]] = {}
        self._staged: dict[tuple[str, str], Any] = {}
        self._encoded: dict[int, bytes] = {}  # a change's value as the journal recorded it, by id
        self._deadlines: DeadlineIndex | None = None  # None: to be rebuilt from the rows
        self._decided: ExpiryIndex | None = None  # likewise
        self._plans: PlanIndex | None = None  # likewise
        self._to_index: list[str] = []  # processed keys the index has still to read

    def get(self, table: Table[V], key: str) -> V | None:
        """A row: rows are written through the table's own codec, so of its type."""
        value: V | None
        staged = self._staged.get((table, key), None)
        if staged is not None:
            value = None if staged is _DELETED else staged
            return value
        raw = _rows(self.tables[table]).get(key)
        if raw is None:
            return self.view.get(table, key) if table in self.view.tables else None
        cached = self._decoded.get((table, key))
        if cached is not None and cached[0] is raw:
            value = cached[1]
            return value
        value = decode_state(table, raw)
        self._decoded[(table, key)] = (raw, value)
        return value

    def items(self, table: Table[V]) -> list[tuple[str, V]]:
        keys = set(self.tables[table].keys())
        if table in self.view.tables:
            keys |= set(self.view.tables[table])
        keys |= {key for name, key in self._staged if name == table}
        return [(key, value) for key in sorted(keys) if (value := self.get(table, key)) is not None]

    def values(self, table: Table[V]) -> list[V]:
        return [value for _, value in self.items(table)]

    @property
    def deadlines(self) -> DeadlineIndex:
        """The drain deadlines still to fire among this instance's rows."""
        if self._deadlines is None:
            episodes = self.values(DRAINS)
            self._deadlines = DeadlineIndex.of(episodes)
        return self._deadlines

    @property
    def plans(self) -> PlanIndex:
        """The maintenance plans among this instance's rows, by when their next node goes."""
        if self._plans is None:
            self._plans = PlanIndex.of((plan_id, record) for plan_id, record in self.items(PLANS))
        return self._plans

    @property
    def decided(self) -> ExpiryIndex:
        """The intent ids this instance's ``processed`` rows hold, by when they were decided.

        Rebuilt a slice of :data:`INDEXED_PER_ASK` rows each time it is asked (the timer asks
        once a tick), so that a table of a week's intents does not stall the event loop after
        a rebalance; until it is whole it names fewer ids, which only defers their forgetting.
        Rows written meanwhile are noted as always; a row is read as it is when its turn
        comes, and decoded without entering the decoded cache.
        """
        if self._decided is None:
            self._decided = ExpiryIndex()
            self._to_index = list(self.tables[PROCESSED].keys())
        if self._to_index:
            rows = self.tables[PROCESSED]
            for key in self._to_index[-INDEXED_PER_ASK:]:
                raw = rows.get(key)
                if raw is not None:
                    self._decided.note(key, decode_state(PROCESSED, raw))
            del self._to_index[-INDEXED_PER_ASK:]
        return self._decided

    def rebuild_indexes(self) -> None:
        """Rows came or went without :meth:`write` (a rebalance, a recovery): rebuild the
        indexes from the rows when they are next asked."""
        self._deadlines = None
        self._decided = None
        self._plans = None

    def stage(self, changes: Iterable[Change]) -> None:
        """Make a decision's changes visible to the rest of the batch, not yet recorded."""
        for change in changes:
            self._staged[(change.table, change.key)] = _DELETED if change.value is None else change.value

    def write(self, changes: Iterable[Change], *, event: EventT[Any]) -> list[Row]:
        """Record changes in the local tables; the rows their changelogs get, in the
        partition of their input (none under exactly-once: Faust's table sends them)."""
        rows: list[Row] = []
        partition = event.message.partition
        with deciding(event):
            for change in changes:
                target = self.tables[change.table]
                self._decoded.pop((change.table, change.key), None)
                if change.table == DRAINS and self._deadlines is not None:
                    self._deadlines.note(change.key, change.value)
                elif change.table == PROCESSED and self._decided is not None:
                    self._decided.note(change.key, change.value)
                elif change.table == PLANS and self._plans is not None:
                    self._plans.note(change.key, change.value)
                raw = None
                if change.value is not None:
                    raw = self._encoded.pop(id(change), None) or encode_state(change.table, change.value)
                    self._decoded[(change.table, change.key)] = (raw, change.value)
                if self.rows_through_faust:
                    if raw is not None:
                        target[change.key] = raw
                    elif change.key in target:
                        del target[change.key]
                    continue
                _store(target, change.key, raw, partition)
                rows.append(Row(event, change.table, Record(self._changelog(change.table), row_key(change.key), raw,
                                                            partition=partition)))
        return rows

    def write_all(self, decided: Sequence[tuple[EventT[Any], Result]]) -> list[Row]:
        """Write a batch's rows, each input's in its own partition; the rows to send
        (:meth:`send_rows`). The batch is journaled and its messages are out: if a row
        cannot be written, the process stops before the batch is acknowledged, and its
        restart replays the batch from the journal."""
        try:
            return [row for event, result in decided for row in self.write(result.decision.changes, event=event)]
        except Exception:
            log.critical("rows not written: stopping before the batch is acknowledged", exc_info=True)
            _stop()
            raise  # not reached

    async def send_rows(self, rows: Sequence[Row], *, deliver: Deliver) -> None:
        """Send a batch's rows and wait for the broker; then tell each table's store the
        changelog offset it holds rows up to (what Faust's own sends tell a RocksDB store,
        whose recovery starts there)."""
        delivered = await deliver([row.record for row in rows])
        upto: dict[tuple[str, int], tuple[Any, int]] = {}
        for row, place in zip(rows, delivered, strict=True):
            upto[(place.topic, place.partition)] = (self.tables[row.table], place.offset)
        for (topic, partition), (table, offset) in upto.items():
            persisted = getattr(getattr(table, "data", None), "set_persisted_offset", None)
            if persisted is not None:
                persisted(TP(topic, partition), offset)

    def _changelog(self, table: str) -> str:
        topic = self._changelogs.get(table)
        if topic is None:
            topic = self._changelogs[table] = str(self.tables[table].changelog_topic.get_topic_name())
        return topic

    async def record(self, decided: Sequence[tuple[EventT[Any], list[Result]]], *, deliver: Deliver) -> None:
        """Journal a batch's fresh decisions before any of their messages is sent."""
        if self.journal is not None:
            await self.journal.record(decided, deliver=deliver, encoded=self._encoded)

    def recorded(self, event: EventT[Any]) -> list[Result] | None:
        """An input's journaled results, staged for the rest of the batch; ``None``: decide it."""
        results = self.journal.recorded(event) if self.journal is not None else None
        for result in results or ():
            self.stage(result.decision.changes)
        return results

    def unstage(self) -> None:
        self._staged.clear()
        self._encoded.clear()

    def local(self) -> LocalRows:
        """The rows of the partitions this instance owns, as recorded: no staged change, no
        other instance's rows of a cluster-wide table (what the worker's gauges count)."""
        return LocalRows(self)

    def sizes(self) -> dict[str, int]:
        sizes = {name: len(table) for name, table in self.tables.items()}
        if self.journal is not None:
            sizes["journal"] = len(self.journal.table)
        return sizes


class LocalRows:
    """A :class:`~handlers.core.state.StateView` of one instance's own rows (:meth:`TableState.local`),
    decoded through the table state's cache."""

    def __init__(self, state: TableState) -> None:
        self.state = state

    def get(self, table: Table[V], key: str) -> V | None:
        raw = _rows(self.state.tables[table]).get(key)
        if raw is None:
            return None
        cached = self.state._decoded.get((table, key))
        if cached is not None and cached[0] is raw:
            value: V = cached[1]
            return value
        return decode_state(table, raw)  # type: ignore[no-any-return]

    def items(self, table: Table[V]) -> list[tuple[str, V]]:
        return [(key, value) for key in sorted(self.keys(table)) if (value := self.get(table, key)) is not None]

    def values(self, table: Table[V]) -> list[V]:
        return [value for _, value in self.items(table)]

    def keys(self, table: Table[Any]) -> list[str]:
        return list(_rows(self.state.tables[table]).keys())
