"""The decision engine: one entry point per kind of input, each a pure function.

    (state, raw input, time) → Decision(commands, notifications, audit, changes, dead letters)

The worker, ``vmstream simulate`` and ``vmstream replay`` all call these, so the code that
is tested is the code that runs. Every input consumed yields exactly one audit record;
malformed input yields a dead letter as well; nothing here raises for bad input.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from handlers import ids
from handlers.auth import (
    CREDENTIAL_FIELD,
    KeySet,
    Principal,
    Unauthenticated,
    Verification,
    agreement_problem,
    claimed_principal,
    verify_intent,
)
from handlers.catalog import Catalog
from handlers.config import Config
from handlers.decisions import Context, Decision, Output, ResidentUpdate, subject_of_key
from handlers.drains import due_deadlines, fire_deadline
from handlers.intents import create_vm, drain_node, restart_vm, set_gpu, undrain_node
from handlers.messages import (
    AuditInput,
    AuditRecord,
    DeadLetter,
    DeadLetterSource,
    IntentEnvelope,
    InvalidIntent,
    MalformedMessage,
    decode_json_object,
    label_value_problem,
    parse_intent,
    parse_watch_event,
)
from handlers.observing import observe, settle_resident
from handlers.state import DrainEpisode, StateView

INTENTS_TOPIC = "vmstream.intents"
EVENTS_TOPIC = "vmstream.k8s-events"
# Not Kafka topics: they name, in audit records, decisions that no external input caused.
TIMER_TOPIC = "vmstream.timer"  # a drain deadline firing
RESIDENTS_TOPIC = "vmstream.residents"  # a node learning that a GPU VMI came or went

_RULES: dict[str, Callable[[Context, Any, Principal], str | None]] = {
    "create_vm": create_vm,
    "set_gpu": set_gpu,
    "restart_vm": restart_vm,
    "drain_node": drain_node,
    "undrain_node": undrain_node,
}


@dataclass(frozen=True, slots=True)
class Source:
    """Where an input came from; partition and offset are known only on Kafka."""

    topic: str
    key: str | None
    partition: int | None = None
    offset: int | None = None


@dataclass(slots=True)
class Result:
    """A decision plus any dead letter, ready for the shell to send and apply."""

    decision: Decision
    dead_letters: list[DeadLetter] = field(default_factory=list)
    dead_letter_key: str | None = None  # a dead letter keeps its input's key

    def outputs(self) -> list[Output]:
        letters = [Output("dlq", self.dead_letter_key or "", d) for d in self.dead_letters]
        return letters + self.decision.outputs()


KeySource = Callable[[], KeySet]


class Engine:
    """The rules bound to one AZ's policy. Holds no state between calls.

    ``keys`` are the public keys intents' credentials are verified with: a key set, or a
    function the shell refreshes behind (a JWKS URL, a file that changes).
    """

    def __init__(self, config: Config, keys: KeySet | KeySource | None = None) -> None:
        self.config = config
        self.catalog = Catalog.from_config(config)
        fixed = keys if isinstance(keys, KeySet) else KeySet()
        self.keys: KeySource = keys if callable(keys) else (lambda: fixed)


    def _context(self, state: StateView, now: datetime, cause: str) -> Context:
        return Context.open(state, self.config, self.catalog, now, cause)

    def on_intent(self, state: StateView, raw: bytes | str | dict[str, Any], source: Source, now: datetime) -> Result:
        try:
            intent = parse_intent(raw)
        except MalformedMessage as exc:
            return self.dead_letter(raw, str(exc), source, now)
        except InvalidIntent as exc:
            who = self._authenticate(raw, exc.envelope, now)
            if isinstance(who, Unauthenticated):
                return Result(self._unauthenticated(state, raw, exc.envelope.intent_id, who, source, now))
            project = exc.envelope.project
            return Result(self._reject(state, exc.envelope.intent_id, who.name,
                                       project if project and not label_value_problem(project) else None,
                                       exc.reason, source, now))
        who = self._authenticate(raw, intent, now)
        if isinstance(who, Unauthenticated):
            return Result(self._unauthenticated(state, raw, intent.intent_id, who, source, now))
        ctx = self._context(state, now, intent.intent_id)
        previous = state.get("processed", intent.intent_id)
        if previous is not None:
            return Result(ctx.decide(
                topic=source.topic, key=source.key, outcome="duplicate",
                reason=f"intent {intent.intent_id} was already decided ({previous})",
            ))
        refusal = _RULES[intent.type](ctx, intent, who)
        if refusal is not None:
            return Result(self._reject(state, intent.intent_id, intent.requested_by, intent.project,
                                       refusal, source, now))
        reason = None if ctx.commands else "nothing to change: already as asked"
        ctx.state.put("processed", intent.intent_id, "accepted")
        return Result(ctx.decide(topic=source.topic, key=source.key, outcome="accepted", reason=reason))

    def _authenticate(self, raw: bytes | str | dict[str, Any], intent: IntentEnvelope | Any,
                      now: datetime) -> Verification:
        """Who asks, from the credential only (handlers/auth.py); the body must agree."""
        body = decode_json_object(raw)  # parsed already: this cannot fail here
        policy = self.config.auth
        if policy.mode == "none":
            return claimed_principal(body, self.config.operators)
        who = verify_intent(body.get(CREDENTIAL_FIELD), body, self.keys(), policy, now)
        if isinstance(who, Unauthenticated):
            return who
        problem = agreement_problem(who, intent.requested_by, intent.project)
        return Unauthenticated(problem, who.name) if problem else who

    def _unauthenticated(
        self,
        state: StateView,
        raw: bytes | str | dict[str, Any],
        intent_id: str,
        refusal: Unauthenticated,
        source: Source,
        now: datetime,
    ) -> Decision:
        """Refused for who asks: audited, and told only to whom it is safe to tell.

        The body's ``requested_by`` is unproven, so it is never told: only the signer of a
        valid credential that disagrees with the body, and ``auth.rejections_to``. Nothing
        is recorded under the intent id, which a forger must not be able to use up.
        """
        reason = f"unauthenticated: {refusal.reason}"
        digest = ids.episode_id(source.topic, json.dumps(decode_json_object(raw), sort_keys=True))
        ctx = self._context(state, now, intent_id)
        recipients = sorted({*([refusal.signer] if refusal.signer else []), *self.config.auth.rejections_to})
        if recipients:
            ctx.notify(
                "intent_rejected",
                subject=subject_of_key(source.key, fallback=intent_id),
                episode=f"{intent_id}/{digest}",
                recipients=recipients,
                project=None,
                severity="warning",
                message=f"Request {intent_id} was refused: {reason}.",
                details={"intent_id": intent_id, "reason": reason},
            )
        decision = ctx.decide(topic=source.topic, key=source.key, outcome="rejected", reason=reason)
        assert decision.audit is not None
        # Forged copies of one intent id are audited apart, each once.
        decision.audit = decision.audit.model_copy(
            update={"audit_id": ids.audit_id(source.topic, f"{intent_id}/{digest}", "unauthenticated")})
        return decision

    def _reject(
        self,
        state: StateView,
        intent_id: str,
        requested_by: str,
        project: str | None,
        reason: str,
        source: Source,
        now: datetime,
    ) -> Decision:
        """A fresh context: nothing a refused rule prepared may leak into the decision."""
        ctx = self._context(state, now, intent_id)
        if state.get("processed", intent_id) is not None:
            return ctx.decide(topic=source.topic, key=source.key, outcome="duplicate",
                              reason=f"intent {intent_id} was already decided")
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
        ctx.state.put("processed", intent_id, "rejected")
        return ctx.decide(topic=source.topic, key=source.key, outcome="rejected", reason=reason)

    def on_event(self, state: StateView, raw: bytes | str | dict[str, Any], source: Source, now: datetime) -> Result:
        try:
            event = parse_watch_event(raw)
        except MalformedMessage as exc:
            return self.dead_letter(raw, str(exc), source, now)
        ctx = self._context(state, now, event.event_id)
        ignored = observe(ctx, event)
        if ignored:
            return Result(ctx.decide(topic=source.topic, key=source.key, outcome="ignored", reason=ignored))
        return Result(ctx.decide(topic=source.topic, key=source.key, outcome="accepted"))

    def on_resident(self, state: StateView, update: ResidentUpdate, now: datetime) -> Result:
        """A node's view of its GPU VMIs changed; audited only if it led to an effect."""
        ctx = self._context(state, now, f"{update.cause}@{update.node}")
        settle_resident(ctx, update)
        decision = ctx.decide(topic=RESIDENTS_TOPIC, key=f"node/{update.node}", outcome="accepted")
        if not decision.has_effects:
            decision.audit = None
        return Result(decision)

    def on_tick(self, state: StateView, now: datetime, *, only: str | None = None) -> list[Result]:
        """Fire every drain deadline due at ``now`` (or only ``only``'s); one decision per node."""
        results = []
        episodes = state.values("drains") if only is None else [state.get("drains", only)]
        due = {e.node: e for e in episodes if e is not None}
        for node in due_deadlines(due.values(), now):
            episode: DrainEpisode = due[node]
            # Decided *as of the deadline*, however late the timer fires: a replay or a
            # simulation reissues byte-identical commands.
            ctx = self._context(state, episode.deadline, f"deadline/{node}/{episode.episode}")
            fire_deadline(ctx, node)
            results.append(Result(ctx.decide(topic=TIMER_TOPIC, key=f"node/{node}", outcome="accepted")))
        return results

    def dead_letter(self, raw: bytes | str | dict[str, Any], error: str, source: Source, now: datetime) -> Result:
        original, encoding = _as_text(raw)
        ref = (
            f"{source.topic}:{source.partition}:{source.offset}"
            if source.offset is not None
            else f"raw:{ids.episode_id(source.topic, source.key or '', original)}"
        )
        letter = DeadLetter(
            error=error,
            source=DeadLetterSource(topic=source.topic, partition=source.partition, offset=source.offset),
            original=original,
            encoding=encoding,
            at=now,
        )
        audit = AuditRecord(
            audit_id=ids.audit_id(source.topic, ref, "rejected"),
            at=now,
            input=AuditInput(topic=source.topic, key=source.key, ref=ref),
            outcome="rejected",
            reason=f"malformed: {error}",
        )
        return Result(Decision(audit=audit), [letter], source.key)


def _as_text(raw: bytes | str | dict[str, Any]) -> tuple[str, Literal["utf-8", "base64"]]:
    if isinstance(raw, str):
        return raw, "utf-8"
    if isinstance(raw, dict):
        return json.dumps(raw, sort_keys=True), "utf-8"
    try:
        return raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode("ascii"), "base64"
