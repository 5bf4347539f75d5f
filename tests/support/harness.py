"""A small driver for the decision engine in tests: state in memory, time by hand.

It feeds inputs exactly as ``simulate`` does (ticks first, then the input) and keeps every
result, so a test reads like a scenario: observe objects, send an intent, look at what
came out. Intents are signed as an upstream service signs them (``auth: jwt``, a key the
tests generate; operators of the example config get the operator role).
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

from handlers.contracts.config import Config
from handlers.contracts.messages import AuditRecord, Command, Notification
from handlers.contracts.topics import INTENTS, K8S_EVENTS
from handlers.core.state import MemoryState
from handlers.core.tables import VMS
from handlers.decide.engine import Engine, Result, Source
from handlers.decide.inputs import DeadlineTick, IntentInput, ResidentInput, WatchInput
from handlers.rules.auth import KeySet
from samples.cluster import EXAMPLE_CONFIG
from streams.common.credentials import SigningKey, jwks, signed
from streams.common.settings import KafkaSettings

# The full names the worker passes as an input's source (the default prefix).
INTENTS_TOPIC = KafkaSettings().topic(INTENTS)
EVENTS_TOPIC = KafkaSettings().topic(K8S_EVENTS)

START = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
SIGNER = SigningKey.generate("tests-1")  # the upstream service's key in these tests
KEYS = KeySet.from_jwks(jwks(SIGNER))


def config(**overrides: Any) -> Config:
    return Config.model_validate({**EXAMPLE_CONFIG, "auth": {"mode": "jwt"}, **overrides})


class Harness:
    def __init__(self, cfg: Config | None = None, keys: KeySet = KEYS) -> None:
        self.engine = Engine(cfg or config(), keys)
        self.state = MemoryState()
        self.now = START
        self.results: list[Result] = []
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ inputs

    def wait(self, seconds: float) -> Harness:
        self.now += timedelta(seconds=seconds)
        return self

    def tick(self) -> list[Result]:
        results = self.engine.decide(self.state, DeadlineTick(self.now))
        for result in results:
            self._keep(result)
        return results

    def observe(self, obj: dict[str, Any], type_: str = "ADDED") -> Result:
        self.tick()
        metadata = obj["metadata"]
        key = "/".join(p for p in (obj["kind"], metadata.get("namespace"), metadata["name"]) if p)
        event = {"event_id": f"ev-{next(self._ids)}", "type": type_, "kind": obj["kind"],
                 "object": obj, "observed_at": self.now.isoformat()}
        [result] = self.engine.decide(self.state, WatchInput(event, Source(EVENTS_TOPIC, key), self.now))
        return self._keep(result)

    def observe_all(self, *objects: dict[str, Any]) -> Harness:
        for obj in objects:
            self.observe(obj)
        return self

    def intent(self, type_: str, spec: dict[str, Any], *, by: str = "alice@example.com",
               project: str | None = "proj-a", intent_id: str | None = None,
               claims: dict[str, Any] | None = None, signer: SigningKey | None = SIGNER) -> Result:
        """An intent signed for ``by`` (member of ``project``); ``claims`` override the
        credential's (subject, projects, roles, now, lifetime), ``signer=None`` leaves it unsigned."""
        self.tick()
        if "plan" in spec:  # a maintenance plan's intents
            key = f"maintenance/{spec['plan']}"
        elif "node" in spec:
            key = f"node/{spec['node']}"
        else:
            key = f"vm/{spec.get('namespace')}/{spec.get('name')}"
        value: dict[str, Any] = {"intent_id": intent_id or f"it-{next(self._ids)}", "type": type_,
                                 "requested_by": by, "spec": spec}
        if project is not None:
            value["project"] = project
        if signer is not None:
            value = self.sign(value, signer, **(claims or {}))
        return self.raw_intent(value, key=key)

    def sign(self, value: dict[str, Any], signer: SigningKey = SIGNER, **claims: Any) -> dict[str, Any]:
        """``value`` with a credential for its requester as of now (see streams/common/credentials.py)."""
        by, project = value.get("requested_by"), value.get("project")
        defaults: dict[str, Any] = {
            "projects": [project] if isinstance(project, str) else [],
            "roles": [self.engine.config.auth.operator_role] if by in self.engine.config.operators else [],
            "now": self.now,
        }
        return signed(value, signer, **{**defaults, **claims})

    def raw_intent(self, raw: Any, *, key: str | None = None, offset: int | None = None) -> Result:
        source = Source(INTENTS_TOPIC, key, 0 if offset is not None else None, offset)
        [result] = self.engine.decide(self.state, IntentInput(raw, source, self.now))
        return self._keep(result)

    def _keep(self, result: Result) -> Result:
        """Apply a result and decide what it told the nodes, as ``simulate`` does."""
        self.state.apply(result.decision.changes)
        self.results.append(result)
        for update in result.decision.forwards:
            for forwarded in self.engine.decide(self.state, ResidentInput(update, self.now)):
                self._keep(forwarded)
        return result

    # ---------------------------------------------------------------- outputs

    def commands(self, type_: str | None = None) -> list[Command]:
        return [c for r in self.results for c in r.decision.commands if type_ in (None, c.type)]

    def notifications(self, type_: str | None = None) -> list[Notification]:
        return [n for r in self.results for n in r.decision.notifications if type_ in (None, n.type)]

    def audits(self) -> list[AuditRecord]:
        return [r.decision.audit for r in self.results if r.decision.audit is not None]

    def vm_object(self, namespace: str, name: str) -> dict[str, Any]:
        record = self.state.get(VMS, f"vm/{namespace}/{name}")
        assert record is not None, f"VM {namespace}/{name} is not in state"
        return record.object
