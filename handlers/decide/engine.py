"""The decision engine: one entry, :meth:`Engine.decide`, for every kind of input.

    (state, Input) → [Result(Decision(commands, notifications, audit, changes), dead letters, judgement)]

An :data:`~handlers.decide.inputs.Input` is an intent, a watch event, a node's resident update or
a deadline tick (handlers/decide/inputs.py). The worker, ``vmstream simulate`` and ``vmstream
replay`` all call ``decide``, so the code that is tested is the code that runs. Every input
consumed yields exactly one audit record; malformed input yields a dead letter as well;
nothing here raises for bad input. Each result says what the rules made of its input as a
type (handlers/core/outcomes.py): accepted, refused and why, ignored and why.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import reprlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from handlers.contracts import ids, topics
from handlers.contracts.config import Config
from handlers.contracts.messages import (
    KEY_MAX,
    ORIGINAL_PREFIX_BYTES,
    AuditInput,
    AuditRecord,
    DeadLetter,
    DeadLetterSource,
    IntentBase,
    IntentEnvelope,
    InvalidIntent,
    MalformedMessage,
    WatchEvent,
    clip,
    decode_json_object,
    intent_type,
    label_value_problem,
    object_key,
    parse_intent,
    parse_watch_event,
    wire_bytes,
)
from handlers.core.catalog import Catalog
from handlers.core.decisions import Context, Decision, Output, PlanStep, ResidentUpdate, subject_of_key
from handlers.core.outcomes import ACCEPTED, Accepted, Duplicate, Judgement, Refused, Unproven, judgement_of
from handlers.core.rows import DecidedIntent
from handlers.core.state import Change, ExpiryIndex, PlanIndex, StateView, dedup_window
from handlers.core.tables import DRAINS, PLANS, PROCESSED
from handlers.decide.inputs import (
    DeadlineTick,
    ForgetTick,
    Input,
    IntentInput,
    PlanTick,
    RawInput,
    ResidentInput,
    Source,
    WatchInput,
)
from handlers.decide.intents import RULES, Rule
from handlers.decide.observing import FOLDS, Fold, decision_key, observe, settle_resident
from handlers.rules.auth import (
    CREDENTIAL_FIELD,
    KeySet,
    Unauthenticated,
    Verification,
    agreement_problem,
    claimed_principal,
    verify_intent,
)
from handlers.rules.drains import call_off_drain, due_nodes, fire_deadline, is_due, start_drain
from handlers.rules.plans import node_back, start_due

# Not Kafka topics: they name, in audit records, decisions that no external input caused.
TIMER_TOPIC = topics.TIMER
RESIDENTS_TOPIC = topics.RESIDENTS

log = logging.getLogger(__name__)

FORGET_AT_ONCE = 5_000  # intent ids past the window that one call of Engine.due names at most

__all__ = ["Engine", "RawInput", "Result", "Source"]

@dataclass(slots=True)
class Result:
    """A decision plus any dead letter, ready for the shell to send and apply."""

    decision: Decision
    dead_letters: list[DeadLetter] = field(default_factory=list)
    dead_letter_key: str | None = None  # a dead letter keeps its input's key
    # (logical topic, key, value) of each output as sent, once Engine.fitted has checked them
    wire: list[tuple[str, bytes, bytes]] | None = None

    @property
    def judgement(self) -> Judgement:
        """What the rules made of the input: Accepted, Refused(reason) or Ignored(reason); a
        dead letter is refused. Read off the audit record the judgement was written into
        (``Engine._closed``), so a result the journal gives back says the same."""
        return judgement_of(self.decision.audit)

    def outputs(self) -> list[Output]:
        letters = [Output(topics.DLQ.name, self.dead_letter_key or "", d) for d in self.dead_letters]
        return letters + self.decision.outputs()


EntryPoint = Callable[["Engine", StateView, RawInput, Source, datetime], Result]


def _never_raises(entry: EntryPoint) -> EntryPoint:
    """An entry point that decides any input: an error no rule foresaw (a bug, a shape of
    input nothing expected) dead-letters the input instead of escaping."""

    @functools.wraps(entry)
    def decide(engine: Engine, state: StateView, raw: RawInput, source: Source, now: datetime) -> Result:
        try:
            return entry(engine, state, raw, source, now)
        except Exception as error:
            log.exception("deciding %s:%s:%s failed", source.topic, source.partition, source.offset)
            return engine.dead_letter(raw, f"internal error: {type(error).__name__}: {error}", source, now)

    return decide


KeySource = Callable[[], KeySet]


class Engine:
    """The rules bound to one AZ's policy. Holds no state between calls.

    ``keys`` are the public keys intents' credentials are verified with: a key set, or a
    function the shell refreshes behind (a JWKS URL, a file that changes). ``rules`` are the
    intent types it decides, each model with its rule (handlers/decide/intents.py ``RULES``), and
    ``folds`` the watched kinds (handlers/decide/observing.py ``FOLDS``): an extension decides through
    the same engine with its own added (docs/howto.md).
    """

    def __init__(self, config: Config, keys: KeySet | KeySource | None = None, *,
                 rules: Mapping[type[IntentBase], Rule] = RULES, folds: Mapping[str, Fold] = FOLDS) -> None:
        self.config = config
        self._models = {intent_type(model): model for model in rules}
        self._rules = {intent_type(model): rule for model, rule in rules.items()}
        self._folds = folds
        self.catalog = Catalog.from_config(config)
        self._dedup_window = dedup_window(config.intents.dedup_window_seconds)
        fixed = keys if isinstance(keys, KeySet) else KeySet()
        self.keys: KeySource = keys if callable(keys) else (lambda: fixed)

    def _context(self, state: StateView, now: datetime, cause: str) -> Context:
        return Context.open(state, self.config, self.catalog, now, cause)

    # ------------------------------------------------------------------ the entry

    def decide(self, state: StateView, input_: Input) -> list[Result]:
        """Decide one input: one result each (a tick: one per deadline it fires)."""
        match input_:
            case IntentInput(raw, source, at):
                return [self.on_intent(state, raw, source, at)]
            case WatchInput(raw, source, at):
                return [self.on_event(state, raw, source, at)]
            case ResidentInput(update, at):
                return [self.on_resident(state, update, at)]
            case DeadlineTick(at, node):
                return self.on_tick(state, at, only=node)
            case ForgetTick(at, intent_ids):
                return self._forget_decided(state, at, intent_ids)
            case PlanTick(at, plan):
                return self.on_plan_tick(state, at, plan)

    def due(self, state: StateView, now: datetime) -> list[DeadlineTick | ForgetTick | PlanTick]:
        """The ticks to send at ``now``: one per node whose drain deadline may be due (the
        state's :class:`~handlers.core.state.DeadlineIndex`); each is decided under its node. And
        one that names the intent ids past the dedup window (the state's
        :class:`~handlers.core.state.ExpiryIndex`, where it keeps one), to forget them: the
        oldest :data:`FORGET_AT_ONCE`, so that a backlog of them (a first start with a
        window, a window shortened) costs each tick a bounded pass."""
        ticks: list[DeadlineTick | ForgetTick | PlanTick] = [DeadlineTick(now, node) for node in due_nodes(state, now)]
        ticks += [PlanTick(now, plan) for plan in due_plans(state, now)]
        index: ExpiryIndex | None = getattr(state, "decided", None)
        horizon = self._horizon(now)
        if index is not None and index.any_before(horizon):
            oldest = index.before(horizon, most=FORGET_AT_ONCE)
            ticks.append(ForgetTick(now, tuple(self._expired(state, oldest, horizon))))
        return ticks

    def _horizon(self, now: datetime) -> datetime:
        return now - self._dedup_window

    def _decided(self, state: StateView, intent_id: str, now: datetime) -> str | None:
        """How the intent was decided before, if it was within the dedup window; else None."""
        row = state.get(PROCESSED, intent_id)
        if isinstance(row, DecidedIntent):
            return row.outcome if row.at >= self._horizon(now) else None
        return row  # a row of before the window: its outcome alone, kept for ever

    @staticmethod
    def _closed(ctx: Context, source: Source, judgement: Judgement) -> Result:
        """The decision with its one audit record, which says what ``judgement`` says."""
        return Result(ctx.decide(topic=source.topic, key=source.key, outcome=judgement.outcome,
                                 reason=judgement.reason))

    # ------------------------------------------------------------------ by kind

    @_never_raises
    def on_intent(self, state: StateView, raw: RawInput, source: Source, now: datetime) -> Result:
        try:
            intent = self._parse_intent(raw, source)
        except MalformedMessage as exc:
            return self.dead_letter(raw, str(exc), source, now)
        except InvalidIntent as exc:
            who = self._authenticate(raw, exc.envelope, now)
            if isinstance(who, Unauthenticated):
                return self._unauthenticated(state, raw, exc.envelope.intent_id, who, source, now)
            project = exc.envelope.project
            return self._reject(state, exc.envelope.intent_id, who.name,
                                project if project and not label_value_problem(project) else None,
                                exc.reason, source, now)
        who = self._authenticate(raw, intent, now)
        if isinstance(who, Unauthenticated):
            return self._unauthenticated(state, raw, intent.intent_id, who, source, now)
        ctx = self._context(state, now, intent.intent_id)
        previous = self._decided(state, intent.intent_id, now)
        if previous is not None:
            return self._closed(ctx, source, Duplicate(f"intent {intent.intent_id} was already decided ({previous})"))
        judgement = self._rules[intent.type](ctx, intent, who)
        if isinstance(judgement, Refused):
            return self._reject(state, intent.intent_id, intent.requested_by, intent.project,
                                judgement.reason, source, now)
        if not ctx.commands and judgement.reason is None:
            judgement = Accepted("nothing to change: already as asked")
        ctx.state.put(PROCESSED, intent.intent_id, DecidedIntent("accepted", now, source.key))
        return self._closed(ctx, source, judgement)

    def _authenticate(self, raw: RawInput, intent: IntentEnvelope | Any,
                      now: datetime) -> Verification:
        """Who asks, from the credential only (handlers/rules/auth.py); the body must agree."""
        policy = self.config.auth
        if policy.mode == "none":
            return claimed_principal(intent.requested_by, intent.project, self.config.operators)
        body = decode_json_object(raw)  # parsed already: this cannot fail here
        who = verify_intent(body.get(CREDENTIAL_FIELD), body, self.keys(), policy, now)
        if isinstance(who, Unauthenticated):
            return who
        problem = agreement_problem(who, intent.requested_by, intent.project)
        return Unauthenticated(problem, who.name) if problem else who

    def _unauthenticated(
        self,
        state: StateView,
        raw: RawInput,
        intent_id: str,
        refusal: Unauthenticated,
        source: Source,
        now: datetime,
    ) -> Result:
        """Refused for who asks: audited (outcome ``unauthenticated``, whether or not the intent
        id was decided before: an unsigned copy of a decided intent is no harmless duplicate),
        and told only to whom it is safe to tell.

        The body's ``requested_by`` is unproven, so it is never told: only the signer of a
        valid credential that disagrees with the body, and ``auth.rejections_to``. Nothing
        is recorded under the intent id, which a forger must not be able to use up.
        """
        reason = f"unauthenticated: {refusal.reason}"
        copy = ids.unauthenticated_ref(source.topic, intent_id, decode_json_object(raw))
        ctx = self._context(state, now, intent_id)
        recipients = sorted({*([refusal.signer] if refusal.signer else []), *self.config.auth.rejections_to})
        if recipients:
            ctx.notify(
                "intent_rejected",
                subject=subject_of_key(source.key, fallback=intent_id),
                episode=copy,
                recipients=recipients,
                project=None,
                severity="warning",
                message=f"Request {intent_id} was refused: {reason}.",
                details={"intent_id": intent_id, "reason": reason},
            )
        result = self._closed(ctx, source, Unproven(reason))
        audit = result.decision.audit
        assert audit is not None
        # Forged copies of one intent id are audited apart, each once.
        result.decision.audit = audit.model_copy(
            update={"audit_id": ids.audit_id(source.topic, copy, "unauthenticated")})
        return result

    def _reject(
        self,
        state: StateView,
        intent_id: str,
        requested_by: str,
        project: str | None,
        reason: str,
        source: Source,
        now: datetime,
    ) -> Result:
        """A fresh context: nothing a refused rule prepared may leak into the decision."""
        ctx = self._context(state, now, intent_id)
        if self._decided(state, intent_id, now) is not None:
            return self._closed(ctx, source, Duplicate(f"intent {intent_id} was already decided"))
        ctx.notify(
            "intent_rejected",
            subject=subject_of_key(source.key, fallback=intent_id),
            episode=intent_id,
            recipients=[requested_by],
            project=project,
            severity="warning",
            message=f"Your request {intent_id} was refused: {reason}.",
            details={"intent_id": intent_id, "reason": reason},
        )
        ctx.state.put(PROCESSED, intent_id, DecidedIntent("rejected", now, source.key))
        return self._closed(ctx, source, Refused(reason))

    @_never_raises
    def on_event(self, state: StateView, raw: RawInput, source: Source, now: datetime) -> Result:
        try:
            event = self._parse_event(raw, source)
        except MalformedMessage as exc:
            return self.dead_letter(raw, str(exc), source, now)
        ctx = self._context(state, now, event.event_id)
        return self._closed(ctx, source, observe(ctx, event, self._folds))

    def on_resident(self, state: StateView, update: ResidentUpdate, now: datetime) -> Result:
        """A node's view of its GPU VMIs changed, or a maintenance plan's step between the plan
        and a node (decided under ``update.key``); audited only if it led to an effect."""
        ctx = self._context(state, now, f"{update.cause}@{update.node}")
        if update.plan is None:
            settle_resident(ctx, update)
        else:
            self._plan_step(ctx, update.node, update.plan)
        decision = ctx.decide(topic=RESIDENTS_TOPIC, key=update.key, outcome="accepted")
        if not decision.has_effects:
            decision.audit = None  # judged NO_EFFECT
        return Result(decision)

    @staticmethod
    def _plan_step(ctx: Context, node: str, step: PlanStep) -> None:
        match step.step:
            case "go":  # under the node's key: its drain, as the plan's (owners told days ahead)
                start_drain(ctx, node=node, source="plan", reason=step.reason, requested_by=step.requested_by,
                            notice_seconds=0, plan=step.plan, planned=step.told)
            case "call_off":
                episode = ctx.state.get(DRAINS, node)
                if episode is not None and episode.plan == step.plan:
                    call_off_drain(ctx, node, why=step.reason, undo_cordon=True)
            case "back":  # under the plan's key
                node_back(ctx, step.plan, node)

    def on_plan_tick(self, state: StateView, now: datetime, plan: str) -> list[Result]:
        """Start the plan's slots due at ``now``: decided as of the earliest of them, however
        late the timer fires, so a replay reissues byte-identical outputs."""
        record = state.get(PLANS, plan)
        due = record.next_step() if record is not None else None
        if record is None or due is None or due > now:
            return []
        ctx = self._context(state, due, f"plan/{plan}/{due.isoformat()}")
        start_due(ctx, record)
        return [self._closed(ctx, Source(TIMER_TOPIC, f"maintenance/{plan}"), ACCEPTED)]

    def on_tick(self, state: StateView, now: datetime, *, only: str | None = None) -> list[Result]:
        """Fire every drain deadline due at ``now`` (or only ``only``'s); one decision per node.
        Without ``only``, also forget the intent ids past the dedup window."""
        index: ExpiryIndex | None = getattr(state, "decided", None)
        horizon = self._horizon(now)
        results = [] if only is not None or index is None else self._forget_decided(state, now, index.before(horizon))
        for node in due_nodes(state, now) if only is None else [only]:
            episode = state.get(DRAINS, node)
            if episode is None or not is_due(episode, now):
                continue
            # Decided *as of the deadline*, however late the timer fires: a replay or a
            # simulation reissues byte-identical commands.
            ctx = self._context(state, episode.deadline, f"deadline/{node}/{episode.episode}")
            fire_deadline(ctx, node)
            results.append(self._closed(ctx, Source(TIMER_TOPIC, f"node/{node}"), ACCEPTED))
        if only is None:  # offline (simulate, the tests): the plans' slots due too
            for plan in due_plans(state, now):
                results += self.on_plan_tick(state, now, plan)
        return results

    @staticmethod
    def _expired(state: StateView, intent_ids: Iterable[str], horizon: datetime) -> list[str]:
        """Those of ``intent_ids`` whose ``processed`` row says it was decided before ``horizon``."""
        return [intent_id for intent_id in intent_ids
                if isinstance(row := state.get(PROCESSED, intent_id), DecidedIntent) and row.at < horizon]

    def _forget_decided(self, state: StateView, now: datetime, intent_ids: Iterable[str]) -> list[Result]:
        """The ``processed`` rows of ``intent_ids`` past the dedup window at ``now`` deleted, as
        one decision with no outputs (housekeeping: no input is decided, so nothing is
        audited); the others are kept."""
        expired = self._expired(state, intent_ids, self._horizon(now))
        if not expired:
            return []
        return [Result(Decision(changes=[Change(PROCESSED, intent_id, None) for intent_id in expired]))]

    # ------------------------------------------------------------------ bad input

    def screen(self, raw: RawInput, source: Source) -> dict[str, Any]:
        """What every input passes before any rule reads it: a key and a value of bounded
        size, and a value that is a JSON object (handlers/contracts/messages.py ``decode_json_object``).

        Raises :class:`MalformedMessage` only. The worker's ``route`` agent screens watch
        events with it too, so an event refused there has the dead letter ``on_event`` gives.
        """
        if source.key is not None and len(source.key) > KEY_MAX:
            raise MalformedMessage(f"a key of {len(source.key)} characters, over the limit of {KEY_MAX}")
        return decode_json_object(raw, max_bytes=self.config.limits.max_input_bytes)

    def intent_key(self, value: Mapping[str, Any]) -> str | None:
        """The key an intent (its JSON object, screened, not yet validated) is decided under,
        as its type declares (``decided_under``); None for a type it does not decide or
        fields that name no key."""
        kind = value.get("type")
        model = self._models.get(kind) if isinstance(kind, str) else None
        return None if model is None else model.decided_under.of(value)

    def event_key(self, kind: str, obj: dict[str, Any]) -> str:
        """The key a watch event about ``obj`` is decided under, as its kind's fold declares."""
        return decision_key(kind, obj, self._folds)

    def _parse_intent(self, raw: RawInput, source: Source) -> Any:
        """An intent, keyed as its type declares (docs/contracts.md): its state is kept under that
        key, so a Kafka key that names another (or no key, on Kafka) would write it elsewhere."""
        intent: IntentBase = parse_intent(self.screen(raw, source), self._models)  # its spec checked
        self._check_key(source, intent.decision_key())
        return intent

    def _parse_event(self, raw: RawInput, source: Source) -> WatchEvent:
        """A watch event, keyed ``<Kind>/<namespace>/<name>`` by the object it shows."""
        event = parse_watch_event(self.screen(raw, source))
        metadata = event.object["metadata"]
        self._check_key(source, object_key(event.kind, metadata.get("namespace"), metadata["name"]))
        return event

    @staticmethod
    def _check_key(source: Source, expected: str) -> None:
        if source.key == expected or (source.key is None and source.offset is None):
            return  # offline input (simulate, the tests) may leave the key out
        raise MalformedMessage(f"the key {source.key!r} does not match the message's {expected!r}")

    def fitted(self, result: Result, raw: RawInput, source: Source, now: datetime,
               encode: Callable[[Any], bytes] = wire_bytes) -> Result:
        """``result`` with its outputs encoded (``result.wire``) — or, when one of them would
        not fit the broker (``limits.max_output_bytes``) or cannot be encoded, the input's
        dead letter instead, its state changes dropped with the decision."""
        limit = self.config.limits.max_output_bytes
        try:
            wire: list[tuple[str, bytes, bytes]] = [(o.topic, o.key.encode(), encode(o.value))
                                                    for o in result.outputs()]
            oversized = [(topic, len(key) + len(value)) for topic, key, value in wire if len(key) + len(value) > limit]
            if not oversized:
                result.wire = wire
                return result
            topic, size = oversized[0]
            error = f"the decision's {topic} message would be {size} bytes, over the limit of {limit}"
        except Exception as exc:
            log.exception("encoding the outputs of %s:%s:%s failed", source.topic, source.partition, source.offset)
            error = f"internal error: its outputs cannot be encoded: {type(exc).__name__}: {exc}"
        letter = self.dead_letter(raw, error, source, now)
        try:  # sealed as any audit record is, where ``encode`` seals
            letter.wire = [(o.topic, o.key.encode(), encode(o.value)) for o in letter.outputs()]
        except Exception:
            log.exception("encoding the dead letter of %s:%s:%s failed", source.topic, source.partition, source.offset)
            letter.wire = [(o.topic, o.key.encode(), wire_bytes(o.value)) for o in letter.outputs()]
        return letter

    def dead_letter(self, raw: RawInput, error: str, source: Source, now: datetime) -> Result:
        """The input's dead letter and audit record: for any value whatever, never raising,
        and small enough for the broker — a value over 16 KiB is kept as its first 16 KiB,
        its size and its SHA-256; a key over 512 characters is cut."""
        original = _Original.of(raw)
        key = None if source.key is None else clip(_printable(source.key), KEY_MAX)
        ref = (
            f"{source.topic}:{source.partition}:{source.offset}"
            if source.offset is not None
            else f"raw:{ids.episode_id(source.topic, key or '', original.identity)}"
        )
        letter = DeadLetter(
            error=error,
            source=DeadLetterSource(topic=source.topic, partition=source.partition, offset=source.offset),
            original=original.text,
            encoding=original.encoding,
            at=now,
            original_truncated=True if original.truncated else None,
            original_size=original.size if original.truncated else None,
            original_sha256=original.sha256 if original.truncated else None,
        )
        audit = AuditRecord(
            audit_id=ids.audit_id(source.topic, ref, "rejected"),
            at=now,
            input=AuditInput(topic=source.topic, key=key, ref=ref),
            outcome="rejected",
            reason=f"malformed: {error}",
        )
        return Result(Decision(audit=audit), [letter], key)


def due_plans(state: StateView, now: datetime) -> list[str]:
    """The maintenance plans with a slot due at ``now``: the state's
    :class:`~handlers.core.state.PlanIndex` when it keeps one, else every plan looked at."""
    index: PlanIndex | None = getattr(state, "plans", None)
    if index is not None:
        return index.due(now)
    return sorted(plan_id for plan_id, record in state.items(PLANS)
                  if (at := record.next_step()) is not None and at <= now)


@dataclass(frozen=True, slots=True)
class _Original:
    """A dead letter's copy of its input: UTF-8 text or base64, at most 16 KiB of it."""

    text: str
    encoding: Literal["utf-8", "base64"]
    size: int
    truncated: bool
    sha256: str
    identity: str  # what names it in a ref: the whole text, or its digest when cut

    @classmethod
    def of(cls, raw: object) -> _Original:
        data = _as_bytes(raw)
        truncated = len(data) > ORIGINAL_PREFIX_BYTES
        kept = data[:ORIGINAL_PREFIX_BYTES]
        sha256 = hashlib.sha256(data).hexdigest()
        try:
            whole = data.decode("utf-8")
        except UnicodeDecodeError:
            text = base64.b64encode(kept).decode("ascii")
            return cls(text, "base64", len(data), truncated, sha256, sha256 if truncated else text)
        text = kept.decode("utf-8", "ignore") if truncated else whole  # a character cut in two is left out
        return cls(text, "utf-8", len(data), truncated, sha256, sha256 if truncated else text)


def _as_bytes(raw: object) -> bytes:
    """The bytes of an input of any kind; a parsed object as canonical JSON."""
    if raw is None:
        return b""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return bytes(raw)
    if isinstance(raw, str):
        return raw.encode("utf-8", "surrogatepass")  # lone surrogates make it base64
    try:
        return json.dumps(raw, sort_keys=True).encode()
    except (TypeError, ValueError, RecursionError):
        return reprlib.repr(raw).encode("utf-8", "surrogatepass")


def _printable(text: str) -> str:
    """``text`` without lone surrogates, which no UTF-8 encoder takes."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _as_text(raw: RawInput) -> tuple[str, Literal["utf-8", "base64"]]:
    """The whole input as text, or as base64 when it is not UTF-8."""
    data = _as_bytes(raw)
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"
