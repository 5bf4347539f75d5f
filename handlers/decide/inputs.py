"""What the engine decides, as types: an intent, a watch event, a node's resident update, a
deadline tick. ``Engine.decide`` takes any :data:`Input` (one entry for the worker,
``simulate``, ``replay`` and the tests).

The worker's routed topic names each record's kind in a header; :func:`routed_input` reads
a record of any kind into its :data:`Input`, so the worker and ``replay`` read the routed
topic alike, and ``simulate`` names its lines' kinds the same way (:data:`KIND_OF_TOPIC`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import TypeAdapter

from handlers.contracts.messages import MalformedMessage
from handlers.core.decisions import ResidentUpdate

# Whatever a topic may hold: bytes, or None for a tombstone (simulate and the tests also pass
# text and parsed objects).
RawInput = bytes | str | dict[str, Any] | None
InputKind = Literal["intent", "event", "resident", "tick"]
KINDS: tuple[InputKind, ...] = ("intent", "event", "resident", "tick")

RESIDENT_UPDATE: TypeAdapter[ResidentUpdate] = TypeAdapter(ResidentUpdate)


@dataclass(frozen=True, slots=True)
class Source:
    """Where an input came from; partition and offset are known only on Kafka."""

    topic: str
    key: str | None
    partition: int | None = None
    offset: int | None = None


@dataclass(frozen=True, slots=True)
class IntentInput:
    """An intent as read, not parsed yet: malformed ones are decided too (a dead letter)."""

    raw: RawInput
    source: Source
    at: datetime


@dataclass(frozen=True, slots=True)
class WatchInput:
    """A watch event as read (``vmstream.k8s-events``)."""

    raw: RawInput
    source: Source
    at: datetime


@dataclass(frozen=True, slots=True)
class ResidentInput:
    """A node learns that a GPU VMI came, changed or went (sent by a VM's decision)."""

    update: ResidentUpdate
    at: datetime


@dataclass(frozen=True, slots=True)
class DeadlineTick:
    """The time is ``at``: fire the drain deadlines due (only ``node``'s, when named)."""

    at: datetime
    node: str | None = None


@dataclass(frozen=True, slots=True)
class ForgetTick:
    """The time is ``at``: forget these intent ids if they are past the dedup window.

    The worker names the ids, because it must decide the forgetting in the routed partition
    whose changelog holds their rows; the engine checks each row's own time against ``at``,
    so a tick forgets nothing decided within a window of its own time. That time is the
    routed record's timestamp, which only the worker writes (the topic's ACLs), as for a
    drain deadline's tick.
    """

    at: datetime
    intent_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PlanTick:
    """The time is ``at``: start the slots of maintenance plan ``plan`` that are due (decided
    under ``maintenance/<plan>``)."""

    at: datetime
    plan: str


Input = IntentInput | WatchInput | ResidentInput | DeadlineTick | ForgetTick | PlanTick


def kind_of(input_: Input) -> InputKind:
    """The routed topic's name for an input's kind (its ``KIND_HEADER``)."""
    if isinstance(input_, IntentInput):
        return "intent"
    if isinstance(input_, WatchInput):
        return "event"
    if isinstance(input_, ResidentInput):
        return "resident"
    return "tick"


def routed_input(kind: str, raw: RawInput, source: Source, at: datetime) -> Input:
    """A record of the routed topic as the input it carries, by its kind.

    Raises :class:`MalformedMessage` for a kind no one routes, ValueError (pydantic's, or
    JSON's) for a resident update or a tick that does not read.
    """
    if kind == "intent":
        return IntentInput(raw, source, at)
    if kind == "event":
        return WatchInput(raw, source, at)
    if kind == "resident":
        return ResidentInput(RESIDENT_UPDATE.validate_json(_bytes(raw)), at)
    if kind == "tick":
        tick = json.loads(_bytes(raw))
        if "forget" in tick:
            return ForgetTick(at, tuple(str(intent_id) for intent_id in tick["forget"]))
        if "plan" in tick:
            return PlanTick(at, str(tick["plan"]))
        return DeadlineTick(at, str(tick["node"]))
    raise MalformedMessage(f"routed message without a known vmstream-kind header: {kind!r}")


def tick_value(node: str) -> dict[str, str]:
    """What a tick for ``node`` carries on the routed topic."""
    return {"node": node}


def plan_tick_value(plan: str) -> dict[str, str]:
    """What a tick for maintenance plan ``plan`` carries on the routed topic."""
    return {"plan": plan}


def forget_value(tick: ForgetTick) -> dict[str, list[str]]:
    """What a tick that forgets intent ids carries on the routed topic."""
    return {"forget": list(tick.intent_ids)}


def _bytes(raw: RawInput) -> bytes | str:
    if isinstance(raw, dict) or raw is None:
        return json.dumps(raw)
    return raw
