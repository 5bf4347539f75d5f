"""``vmstream replay``: decide the recorded inputs again and compare with what was recorded.

The worker decides only what it reads from its routed topic, one partition at a time in
offset order (docs/worker.md): intents and watch events re-keyed by decision key, resident
updates, deadline ticks. Replay decides the very same records in the very same order per
partition, so a re-decision does not depend on how partitions interleaved in time — with
one worker or ten. Partitions are merged by time, and a resident update waits for the
decision that made it. Every routed intent or event must match its record on intents or
k8s-events, and every record there must have been routed or refused by ``route``.

What the worker recorded must be reproduced exactly: audit records, commands (the seal
aside), notifications and dead letters, by id — the same ids with the same content, none
missing, none more. An id decided more than once (a watch event published again after the
watch bridge restarted: the same event id, a later time) is recorded once per decision, and
each record must be one of the decisions made again under that id. With the signing keys,
audit records count only when sealed by the worker or an applier: one that is not is
reported as such and left out of the comparison, so a forged record never passes for a
decision nor makes a real one look different. The applier's records (docs/security.md) are checked against the
commands: one result per command (repeats of the same result aside), sealed by an applier
when the replay has the keys, and its audit record (and failure notice) the one
:func:`~handlers.rules.results.decide_result` makes of that result. They are checked when the
applier has written anything, or always with ``--applier yes``.

A difference means a decision was not a function of its inputs, or a record was altered,
dropped or forged. With another ``--config`` the same replay answers "what if the policy
had been different?". Decisions that read other partitions' rows (free cards in ``usage``,
the KubeVirt CR, namespaces) see them as of the merged time, which may differ from what the
worker's cluster-wide view held at that moment by its lag (milliseconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

from pydantic import ValidationError

from handlers.contracts.messages import AuditRecord, Command, CommandResult, MalformedMessage
from handlers.contracts.topics import AUDIT, COMMAND_RESULTS, COMMANDS, DLQ, INTENTS, K8S_EVENTS, NOTIFICATIONS
from handlers.core.decisions import Output
from handlers.core.state import MemoryState
from handlers.decide.engine import Engine, Source
from handlers.decide.inputs import routed_input
from handlers.rules.results import decide_result
from streams.common.codecs import encode_resident_update
from streams.common.credentials import key_source
from streams.common.kafka_clients import consumer
from streams.common.reading import Received, partitions_of, read_to_end
from streams.common.settings import KafkaSettings
from streams.common.signing import MAC_FIELD, Keyring, KeyringError
from streams.common.topics import KIND_HEADER, ROUTED, ROUTED_INPUTS, SOURCE_HEADER

COMPARED = ("at", "outcome", "reason", "commands", "notifications", "input")


def read_topics(kafka: KafkaSettings, topics: list[str], *, idle_seconds: float = 30.0) -> Iterator[Received]:
    """Every committed record of ``topics`` up to their end offsets now (a bounded read)."""
    client = consumer(kafka, client_id="vmstream-replay")
    try:
        yield from read_to_end(client, partitions_of(client, topics, wait=0, missing_ok=True), stall=idle_seconds)
    finally:
        client.close()


def _short(value: Any, limit: int = 300) -> str:
    """A field's value for a person, cut at ``limit`` characters."""
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass
class Comparison:
    matched: int = 0
    missing: list[str] = field(default_factory=list)  # replayed, but not in the record
    unexpected: list[str] = field(default_factory=list)  # in the record, not replayed
    different: list[tuple[str, dict[str, tuple[Any, Any]]]] = field(default_factory=list)
    skipped: int = 0  # audit records of the applier, checked apart (``applier_checked``)
    problems: list[str] = field(default_factory=list)  # any other record altered, dropped or forged
    applier_checked: int = 0  # commands whose result and its audit record were checked
    unsealed: int = 0  # audit records not sealed by the worker or an applier: left out, reported
    inputs: dict[str, str] = field(default_factory=dict)  # audit id → the input it records, for a person

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.different or self.problems)

    def named(self, audit_id: str) -> str:
        """``audit_id`` and the input it records (``topic key ref``)."""
        about = self.inputs.get(audit_id)
        return f"{audit_id} [{about}]" if about else audit_id


def describe_input(record: dict[str, Any]) -> str:
    """An audit record's input as a person finds it again: ``<topic> <key> <ref>``."""
    where = record.get("input") or {}
    return " ".join(str(where.get(name)) for name in ("topic", "key", "ref") if where.get(name) is not None)


def _differences(expected: dict[str, Any], actual: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {f: (expected.get(f), actual.get(f)) for f in COMPARED if _norm(expected.get(f)) != _norm(actual.get(f))}


def compare(replayed: list[AuditRecord], recorded: list[dict[str, Any]], skip_topics: set[str]) -> Comparison:
    """Match audit records by id. An id decided again (an event published again) is recorded
    once per decision: each recorded copy must be one of the decisions made under its id, and
    each decision must be recorded (a redelivered decision repeats a copy, which is fine). A
    copy that is none of them is a difference (an altered record), shown against the decision
    it differs least from."""
    result = Comparison()
    mine: dict[str, list[dict[str, Any]]] = {}
    for decided in replayed:
        mine.setdefault(decided.audit_id, []).append(decided.model_dump(mode="json"))
    theirs: dict[str, list[dict[str, Any]]] = {}
    for record in recorded:
        if record.get("input", {}).get("topic") in skip_topics:
            result.skipped += 1
            continue
        theirs.setdefault(record["audit_id"], []).append(record)
    for audit_id, copies in [*mine.items(), *theirs.items()]:
        result.inputs.setdefault(audit_id, describe_input(copies[0]))
    for audit_id, decisions in mine.items():
        if audit_id not in theirs:
            result.missing.append(audit_id)
            continue
        diff: dict[str, tuple[Any, Any]] = {}
        found = [False] * len(decisions)
        for actual in theirs[audit_id]:
            differences = [_differences(expected, actual) for expected in decisions]
            for index, difference in enumerate(differences):
                found[index] = found[index] or not difference
            if all(differences):  # none of the decisions: altered
                closest: dict[str, tuple[Any, Any]] = min(differences, key=len)
                diff.update(closest)
        if diff:
            result.different.append((audit_id, diff))
        elif not all(found):  # a decision under this id that no record holds
            result.missing.append(audit_id)
        else:
            result.matched += 1
    result.unexpected = [audit_id for audit_id in theirs if audit_id not in mine]
    return result


def _norm(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items() if v is not None}
    return value


class Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total, self.out, self.done = max(total, 1), out, 0
        self.live = out.isatty()

    def step(self, count: int = 1) -> None:
        self.done += count
        if self.live and (self.done % 500 == 0 or self.done == self.total):
            filled = int(30 * self.done / self.total)
            self.out.write(f"\r  replaying [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            self.out.flush()

    def close(self) -> None:
        if self.live:
            self.out.write("\n")


_LATEST = 253402300799.0  # 9999-12-31T23:59:59Z, as the worker clamps a timestamp (Worker._time)
_APPLIER_MADE = ("command_failed",)  # notifications the applier sends, not the worker


def _key(record: Received) -> str | None:
    """A record's key as the worker reads it (undecodable bytes replaced)."""
    return record.key.decode("utf-8", "replace") if isinstance(record.key, bytes) else record.key


def _headers(record: Received) -> dict[str, bytes]:
    return {str(name): value or b"" for name, value in (record.headers or ())}


def _ref(record: Received) -> str:
    return f"{record.topic}:{record.partition}:{record.offset}"


def _time(stamp: Any) -> datetime:
    """A record's time as the worker decides with it: its timestamp, brought into a date's range."""
    seconds = stamp / 1000 if isinstance(stamp, (int, float)) and stamp == stamp else 0.0
    return datetime.fromtimestamp(min(max(seconds, 0.0), _LATEST), UTC)


def _origin(record: Received) -> Source:
    """Where a routed intent or event was first read (the worker's ``_origin``)."""
    headers = _headers(record)
    try:
        if headers.get(KIND_HEADER) in (b"event", b"intent"):
            origin = json.loads(headers[SOURCE_HEADER])
            return Source(str(origin["topic"]), origin["key"], int(origin["partition"]), int(origin["offset"]))
    except (KeyError, TypeError, ValueError):
        pass
    return Source(record.topic, _key(record), record.partition, record.offset)


class Replay:
    """The worker's decisions made again from its routed topic, and its records checked."""

    def __init__(self, engine: Engine, kafka: KafkaSettings, *, keyring: Keyring | None = None) -> None:
        self.engine = engine
        self.kafka = kafka
        self.keyring = keyring if keyring else None
        self.state = MemoryState()
        self.outputs: list[Output] = []
        self.problems: list[str] = []
        self.made: set[tuple[bytes, bytes]] = set()  # resident updates the decisions sent
        self.forwarded: set[tuple[bytes, bytes]] = set()  # resident updates on the routed topic

    # ------------------------------------------------------------------ route

    def check_routing(self, inputs: dict[str, Received], routed: list[Received]) -> None:
        """Each routed intent or event is its input's copy; each input was routed or refused."""
        kinds = {self.kafka.topic(INTENTS): b"intent", self.kafka.topic(K8S_EVENTS): b"event"}
        copied: set[str] = set()
        for record in routed:
            kind = _headers(record).get(KIND_HEADER)
            if kind not in (b"intent", b"event"):
                continue
            origin = _origin(record)
            ref = f"{origin.topic}:{origin.partition}:{origin.offset}"
            source = inputs.get(ref)
            if source is None or kinds.get(source.topic) != kind:
                self.problems.append(f"routed {_ref(record)} names {ref}, which is not an input of its kind")
            elif (source.value, source.timestamp, _key(source)) != (record.value, record.timestamp, origin.key):
                self.problems.append(f"routed {_ref(record)} is not the record {ref} it names")
            else:
                copied.add(ref)
        for ref, record in inputs.items():
            if ref in copied:
                continue
            place = Source(record.topic, _key(record), record.partition, record.offset)
            now = _time(record.timestamp)
            try:
                self.engine.screen(record.value, place)
            except MalformedMessage as exc:  # refused by route, as ``on_intent``/``on_event`` would
                letter = self.engine.dead_letter(record.value, str(exc), place, now)
                self.outputs += self.engine.fitted(letter, record.value, place, now).outputs()
            else:
                self.problems.append(f"input {ref} was never routed")

    # ------------------------------------------------------------------ decide

    def decide_all(self, routed: list[Received], progress: Progress) -> None:
        """Each routed partition in offset order, partitions merged by time; a resident
        update waits until the decision that sent it has been made."""
        partitions: dict[int, list[Received]] = {}
        for record in routed:
            partitions.setdefault(record.partition, []).append(record)
        for records in partitions.values():
            records.sort(key=lambda r: r.offset)
        position = dict.fromkeys(partitions, 0)
        while True:
            heads = [(records[position[p]].timestamp, p) for p, records in partitions.items()
                     if position[p] < len(records)]
            if not heads:
                break
            ready = [(stamp, p) for stamp, p in heads if not self._waits(partitions[p][position[p]])]
            _, partition = min(ready or heads)
            record = partitions[partition][position[partition]]
            position[partition] += 1
            if not ready:
                self.problems.append(f"resident update {_ref(record)} was sent by no decision")
            self.decide(record)
            progress.step()
        for key, _ in self.made - self.forwarded:
            self.problems.append(f"a resident update for {key.decode()} was decided but is not on the routed topic")

    def _waits(self, record: Received) -> bool:
        return _headers(record).get(KIND_HEADER) == b"resident" and (record.key, record.value) not in self.made

    def decide(self, record: Received) -> None:
        """One routed record, as the worker's ``decide`` agent decides it."""
        now, source = _time(record.timestamp), _origin(record)
        kind = _headers(record).get(KIND_HEADER, b"").decode("utf-8", "replace")
        if kind == "resident":
            self.forwarded.add((record.key or b"", record.value or b""))
        try:
            results = self.engine.decide(self.state, routed_input(kind, record.value, source, now))
            results = [self.engine.fitted(result, record.value, source, now) for result in results]
        except Exception as error:
            letter = self.engine.dead_letter(record.value, f"internal error: {error!r}", source, now)
            results = [self.engine.fitted(letter, record.value, source, now)]
        for result in results:
            self.state.apply(result.decision.changes)
            self.outputs += result.outputs()
            self.made |= {(update.key.encode(), encode_resident_update(update))
                          for update in result.decision.forwards}

    # ------------------------------------------------------------------ records

    def check_outputs(self, recorded: dict[str, list[dict[str, Any]]]) -> None:
        """Commands, notifications and dead letters: the same ones, with the same content."""
        mine: dict[str, dict[str, list[dict[str, Any]]]] = {COMMANDS.name: {}, NOTIFICATIONS.name: {}, DLQ.name: {}}
        for output in self.outputs:  # an id decided again (an event published again): each decision
            if output.topic in mine:
                body = output.value.model_dump(mode="json", exclude_none=True)
                made = mine[output.topic].setdefault(_output_id(output.topic, body), [])
                if body not in made:
                    made.append(body)
        commands_topic = self.kafka.topic(COMMANDS)
        for name, replayed in mine.items():
            theirs: dict[str, list[dict[str, Any]]] = {}
            for body in recorded[name]:
                if name == DLQ.name and (body.get("source") or {}).get("topic") == commands_topic:
                    continue  # the applier's: checked with its audit records
                if name == NOTIFICATIONS.name and body.get("type") in _APPLIER_MADE:
                    continue  # the applier's: checked with its results
                theirs.setdefault(_output_id(name, body), []).append(body)
            for ident, made in replayed.items():
                if ident not in theirs:
                    self.problems.append(f"{name} {ident}: decided again, but not recorded")
                    continue
                held = [False] * len(made)
                for actual in theirs[ident]:
                    unsealed = _without_mac(actual)
                    fields_of = [sorted(f for f in set(expected) | set(unsealed)
                                        if _norm(expected.get(f)) != _norm(unsealed.get(f))) for expected in made]
                    for index, fields in enumerate(fields_of):
                        held[index] = held[index] or not fields
                    if all(fields_of):
                        fields = min(fields_of, key=len)
                        expected = made[fields_of.index(fields)]
                        shown = "; ".join(f"{f}: recorded {_short(unsealed.get(f))}, replayed {_short(expected.get(f))}"
                                          for f in fields)
                        self.problems.append(f"{name} {ident}: recorded otherwise ({', '.join(fields)}) — {shown}")
                    elif name == COMMANDS.name and self.keyring is not None:
                        problem = self.keyring.problem("command", Command.model_validate(actual))
                        if problem:
                            self.problems.append(f"commands {ident}: not sealed by the worker: {problem}")
                if any(held) and not all(held):  # what matched none was reported as recorded otherwise
                    self.problems.append(f"{name} {ident}: decided {len(made)} times, recorded {sum(held)} of them")
            self.problems += [f"{name} {ident}: recorded, but decided by nobody" for ident in theirs
                              if ident not in replayed]

    def check_applier(self, recorded: dict[str, list[dict[str, Any]]]) -> int:
        """One result per command, and the audit record (and failure notice) it makes;
        returns how many commands were checked."""
        commands_topic = self.kafka.topic(COMMANDS)
        commands: dict[str, Command] = {}
        for body in recorded[COMMANDS.name]:
            try:
                commands.setdefault(body["command_id"], Command.model_validate(body))
            except (KeyError, ValidationError):
                pass  # reported with the commands
        results: dict[str, list[dict[str, Any]]] = {}
        for body in recorded[COMMAND_RESULTS.name]:
            distinct = results.setdefault(str(body.get("command_id")), [])
            if body not in distinct:
                distinct.append(body)
        audits: dict[str, list[dict[str, Any]]] = {}  # every copy under an id: one may be altered
        for audit in recorded[AUDIT.name]:
            if (audit.get("input") or {}).get("topic") == commands_topic:
                audits.setdefault(str(audit.get("audit_id")), []).append(audit)
        notices: dict[str, list[dict[str, Any]]] = {}
        for notice in recorded[NOTIFICATIONS.name]:
            notices.setdefault(str(notice.get("notification_id")), []).append(notice)
        explained: set[str] = set()
        for command_id, command in commands.items():
            distinct = results.pop(command_id, [])
            if not distinct:
                self.problems.append(f"command {command_id}: no result")
            elif len(distinct) > 1:
                self.problems.append(f"command {command_id}: {len(distinct)} different results")
            for body in distinct:
                explained |= self._check_result(command, body, audits, notices)
        for command_id in results:
            self.problems.append(f"command-results for {command_id}: no such command was issued")
        letters = {f"{d['source']['topic']}:{d['source'].get('partition')}:{d['source'].get('offset')}"
                   for d in recorded[DLQ.name] if (d.get("source") or {}).get("topic") == commands_topic}
        for audit_id, copies in audits.items():
            audit = copies[0]
            if audit_id in explained:
                continue
            if audit.get("outcome") == "rejected" and audit["input"].get("ref") in letters:
                letters.discard(audit["input"]["ref"])  # a malformed command, dead-lettered
                continue
            self.problems.append(f"audit {audit_id}: an applier's record of no result")
        self.problems += [f"dlq {ref}: a malformed command without its audit record" for ref in sorted(letters)]
        return len(commands)

    def _check_result(self, command: Command, body: dict[str, Any], audits: dict[str, list[dict[str, Any]]],
                      notices: dict[str, list[dict[str, Any]]]) -> set[str]:
        """A result against its command; its audit record and notice as ``decide_result``
        makes them of it. Returns the audit ids it explains."""
        command_id = command.command_id
        try:
            result = CommandResult.model_validate(body)
        except ValidationError:
            self.problems.append(f"command-results for {command_id}: not a command result")
            return set()
        if self.keyring is not None and (problem := self.keyring.problem("command-result", result)):
            self.problems.append(f"command-results for {command_id}: not sealed by an applier: {problem}")
        claims = (result.type, result.target, result.cause, result.requested_by)
        if claims != (command.type, command.target, command.cause, command.requested_by):
            self.problems.append(f"command-results for {command_id}: not the command's type, target, cause, requester")
        made = decide_result(command, outcome=result.outcome, now=result.at, error=result.error,
                             resource_version=result.resource_version, topic=self.kafka.topic(COMMANDS))
        expected = made.audit.model_dump(mode="json", exclude_none=True)
        copies = audits.get(made.audit.audit_id, [])
        if not copies:
            self.problems.append(f"command {command_id}: its result ({result.outcome}) has no audit record")
        elif any(_norm(_without_mac(actual)) != _norm(expected) for actual in copies):
            self.problems.append(f"audit {made.audit.audit_id}: not the record of command {command_id}'s result")
        if made.notification is not None:
            told = notices.get(made.notification.notification_id, [])
            wanted = made.notification.model_dump(mode="json", exclude_none=True)
            if not told:
                self.problems.append(f"command {command_id}: failed, and nobody was told")
            elif any(_norm(notice.get(f)) != _norm(wanted.get(f))
                     for notice in told for f in ("type", "subject", "details", "at")):
                self.problems.append(f"notifications {made.notification.notification_id}: not command "
                                     f"{command_id}'s failure")
        return {made.audit.audit_id}


def _without_mac(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != MAC_FIELD}


def sealed_audits(audits: list[dict[str, Any]], keyring: Keyring | None,
                  problems: list[str]) -> tuple[list[dict[str, Any]], int]:
    """The audit records sealed by the worker or an applier, and how many were not: each of
    those is reported in ``problems`` and left out (without the keys, all of them count)."""
    if keyring is None:
        return audits, 0
    kept: list[dict[str, Any]] = []
    for body in audits:
        try:
            problem = keyring.problem("audit", AuditRecord.model_validate(body))
        except (ValidationError, KeyringError) as exc:
            problem = f"not an audit record: {exc}"
        if problem is None:
            kept.append(body)
        else:
            problems.append(f"audit {body.get('audit_id')} [{describe_input(body)}]: not sealed by the worker "
                            f"or an applier ({problem}): ignored")
    return kept, len(audits) - len(kept)


def _output_id(topic: str, body: dict[str, Any]) -> str:
    if topic == COMMANDS.name:
        return str(body.get("command_id"))
    if topic == NOTIFICATIONS.name:
        return str(body.get("notification_id"))
    source = body.get("source") or {}
    return f"{source.get('topic')}:{source.get('partition')}:{source.get('offset')}"


def _json(records: Iterator[Received], problems: list[str]) -> list[dict[str, Any]]:
    values = []
    for record in records:
        try:
            value = json.loads(record.value or b"")
        except (TypeError, ValueError):
            value = None
        if isinstance(value, dict):
            values.append(value)
        else:
            problems.append(f"{_ref(record)}: not a JSON object")
    return values


def replay(engine: Engine, kafka: KafkaSettings, out: TextIO, *, applier: bool | None = None,
           keyring: Keyring | None = None) -> Comparison:
    """Decide the routed topic again and compare with every record of the worker and, when
    ``applier`` (``None``: when it has written anything), of the applier."""
    inputs = {_ref(r): r for r in read_topics(kafka, [kafka.topic(name) for name in ROUTED_INPUTS])}
    routed = list(read_topics(kafka, [kafka.topic(ROUTED)]))
    run = Replay(engine, kafka, keyring=keyring)
    recorded = {name: _json(read_topics(kafka, [kafka.topic(name)]), run.problems)
                for name in (AUDIT.name, COMMANDS.name, NOTIFICATIONS.name, DLQ.name, COMMAND_RESULTS.name)}
    recorded[AUDIT.name], unsealed = sealed_audits(recorded[AUDIT.name], run.keyring, run.problems)
    progress = Progress(len(routed), out)
    run.check_routing(inputs, routed)
    run.decide_all(routed, progress)
    progress.close()
    commands_topic = kafka.topic(COMMANDS)
    if applier is None:
        applier = bool(recorded[COMMAND_RESULTS.name]) or any(
            (a.get("input") or {}).get("topic") == commands_topic for a in recorded[AUDIT.name])
    if not applier:  # its records are left out, not checked
        recorded[NOTIFICATIONS.name] = [n for n in recorded[NOTIFICATIONS.name] if n.get("type") not in _APPLIER_MADE]
    run.check_outputs(recorded)
    comparison = compare(_audits(run.outputs), recorded[AUDIT.name], skip_topics={commands_topic})
    if applier:
        comparison.applier_checked = run.check_applier(recorded)
    comparison.problems = run.problems
    comparison.unsealed = unsealed
    return comparison


def _audits(outputs: list[Output]) -> list[AuditRecord]:
    return [o.value for o in outputs if isinstance(o.value, AuditRecord)]


def report(comparison: Comparison, out: TextIO) -> None:
    out.write(
        f"{comparison.matched} decisions reproduced, {len(comparison.different)} different, "
        f"{len(comparison.missing)} missing from the audit stream, {len(comparison.unexpected)} "
        f"recorded but not reproduced, {len(comparison.problems)} other records altered, dropped or forged; "
        f"{comparison.applier_checked} commands' results checked ({comparison.skipped} applier audit records"
        f"{f', {comparison.unsealed} unsealed audit records ignored' if comparison.unsealed else ''})\n"
    )
    for audit_id, diff in comparison.different[:50]:
        for name, (expected, actual) in diff.items():
            out.write(f"  {comparison.named(audit_id)} {name}: replayed {expected!r}, recorded {actual!r}\n")
    for audit_id in comparison.missing[:50]:
        out.write(f"  {comparison.named(audit_id)}: replayed, but not in the audit stream\n")
    for audit_id in comparison.unexpected[:50]:
        out.write(f"  {comparison.named(audit_id)}: in the audit stream, not reproduced\n")
    for problem in comparison.problems[:50]:
        out.write(f"  {problem}\n")


def main(args: argparse.Namespace) -> int:
    from streams.common.startup import check_secrets, load_config, reach_kafka

    settings = load_config(args)
    check_secrets(settings, signing=True, credentials=True)
    reach_kafka(settings.kafka)
    started = time.monotonic()
    checked = {"auto": None, "yes": True, "no": False}[args.applier]
    comparison = replay(Engine(settings.rules(), keys=key_source(settings.auth)), settings.kafka, sys.stderr,
                        applier=checked, keyring=settings.signing.keyring())
    report(comparison, sys.stdout)
    sys.stdout.write(f"replayed in {time.monotonic() - started:.1f}s\n")
    return 0 if comparison.clean else 1


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from streams.common.errors import EXIT_CODES_HELP
    from streams.common.startup import add_kafka_arguments

    parser = commands.add_parser(
        "replay", help="decide the recorded inputs again; diff against every record",
        description="Read the recorded inputs back from Kafka, decide them again with --config's policy, "
        "and compare with every record the worker (and the applier) wrote; exit 1 on any difference.",
        epilog=EXIT_CODES_HELP)
    parser.add_argument("--config", help="the configuration (another one asks: what if the policy differed?)")
    add_kafka_arguments(parser)
    parser.add_argument("--applier", choices=("auto", "yes", "no"), default="auto",
                        help="check the applier's records: when it has written any (auto), always, or never")
    parser.set_defaults(handler=main)
