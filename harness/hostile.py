"""Hostile input: every kind of record a topic may hold that no rule can decide, for the
broker tests and ``benchmarks/faults.py --only hostile`` (valid intents come with them, interleaved).

Each :class:`Hostile` says what must become of it: one dead letter naming its topic,
partition and offset, or — an intent whose envelope is sound but whose spec is not — one
rejection told to its requester. Intents and watch events are about the VMs of
:func:`harness.scenarios.cluster`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from handlers.contracts.topics import INTENTS, K8S_EVENTS
from samples.cluster import vm

Fate = Literal["dead_letter", "rejected"]
VMS = ("train-1", "batch-1", "web-1")
BIG = 600_000  # bytes: over the worker's input limit, under the broker's
NEAR_LIMIT = 1_000_000  # bytes: as large as the broker takes


@dataclass(frozen=True, slots=True)
class Hostile:
    kind: str  # its class
    topic: str  # the logical name: INTENTS or K8S_EVENTS
    key: bytes | None
    value: bytes | None
    fate: Fate = "dead_letter"
    ref: str | None = None  # the intent id a rejection's audit record names
    big: bool = False  # over 100 kB: the benchmark sends fewer of these


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def set_gpu(intent_id: str, name: str, gpu_class: str | None = "nvidia-a100", **changes: Any) -> dict[str, Any]:
    value: dict[str, Any] = {"intent_id": intent_id, "type": "set_gpu", "requested_by": "alice@example.com",
                             "project": "proj-a",
                             "spec": {"namespace": "spx-proj-a", "name": name, "gpu_class": gpu_class}}
    value.update(changes)
    return value


def valid_intent(i: int) -> tuple[bytes, bytes, str]:
    """(key, value, intent id) of the i-th valid intent: set_gpu or restart_vm on a cluster VM."""
    name, intent_id = VMS[i % len(VMS)], f"valid-{i}"
    if i % 4 == 3:
        value = {"intent_id": intent_id, "type": "restart_vm", "requested_by": "alice@example.com",
                 "project": "proj-a", "spec": {"namespace": "spx-proj-a", "name": name}}
    else:
        value = set_gpu(intent_id, name, None if i % 2 else "nvidia-a100")
    return f"vm/spx-proj-a/{name}".encode(), _json(value), intent_id


def hostile_intents(round_: int) -> list[Hostile]:
    """One of each class of hostile intent; ids unique to the round."""
    key = b"vm/spx-proj-a/train-1"
    sound = set_gpu(f"hostile-{round_}", "train-1")
    unknown_fields = {f"{'x' * 20}{n}": n for n in range(1000)}

    def intent(kind: str, value: bytes | None, *, key: bytes | None = key, fate: Fate = "dead_letter",
               ref: str | None = None) -> Hostile:
        size = len(value or b"") + len(key or b"")
        return Hostile(kind, INTENTS.name, key, value, fate, ref, size > 100_000)

    return [
        intent("tombstone", None),
        intent("empty", b""),
        intent("invalid-utf8", b'{"intent_id": "\xff\xfe"}'),
        intent("lone-surrogate", b'{"intent_id": "\\ud800"}'),
        intent("nested-100k-deep", b"[" * 100_000 + b"]" * 100_000),
        intent("nested-300-deep", b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}"),
        intent("5000-digit-integer", b'{"intent_id": ' + b"7" * 5000 + b"}"),
        intent("nan", b'{"intent_id": "n", "x": NaN}'),
        intent("not-an-object", b"[1, 2, 3]"),
        intent("wrong-schema", _json({"hello": "world"})),
        intent("oversized-value", _json({**sound, "padding": "p" * BIG})),
        intent("near-broker-limit", _json({"padding": "p" * (NEAR_LIMIT - 200)})),
        intent("oversized-key", _json(sound), key=b"vm/" + b"k" * 300_000),
        intent("oversized-principal", _json({**sound, "requested_by": "a" * 300_000 + "@example.com"})),
        intent("key-of-another-vm", _json(sound), key=b"vm/spx-proj-a/web-1"),
        intent("no-key", _json(sound), key=None),
        intent("key-not-utf8", _json(sound), key=b"vm/spx-proj-a/train-1\xff"),
        intent("oversized-gpu-class", _json(set_gpu(f"long-class-{round_}", "train-1", "g" * 100_000)),
               fate="rejected", ref=f"long-class-{round_}"),
        intent("a-thousand-unknown-fields",
               _json({**sound, "intent_id": f"fields-{round_}",
                      "spec": {**sound["spec"], **unknown_fields}}), fate="rejected", ref=f"fields-{round_}"),
    ]


def hostile_events(round_: int) -> list[Hostile]:
    """One of each class of hostile watch event."""
    obj = vm("spx-proj-a", "train-1", project="proj-a", owner="alice@example.com", rv=1000 + round_)
    key = b"VirtualMachine/spx-proj-a/train-1"
    sound = {"event_id": f"hostile-ev-{round_}", "type": "MODIFIED", "kind": "VirtualMachine", "object": obj,
             "observed_at": "2026-11-30T10:00:00Z"}
    no_map = json.loads(json.dumps(sound))
    no_map["object"]["metadata"]["labels"] = ["not", "a", "map"]  # the rules' own error, after routing

    def event(kind: str, value: bytes | None, *, key: bytes | None = key) -> Hostile:
        size = len(value or b"") + len(key or b"")
        return Hostile(kind, K8S_EVENTS.name, key, value, "dead_letter", None, size > 100_000)

    return [
        event("tombstone", None),
        event("invalid-utf8", b'{"event_id": "\xff"}'),
        event("nested-100k-deep", b"[" * 100_000 + b"]" * 100_000),
        event("5000-digit-integer", b'{"event_id": ' + b"7" * 5000 + b"}"),
        event("wrong-schema", _json({"event_id": f"e-{round_}", "type": "ADDED", "kind": "Node"})),
        event("oversized-value", _json({**sound, "padding": "p" * BIG})),
        event("near-broker-limit", _json({"padding": "p" * (NEAR_LIMIT - 200)})),
        event("oversized-key", _json(sound), key=b"VirtualMachine/" + b"k" * 300_000),
        event("key-of-another-object", _json(sound), key=b"VirtualMachine/spx-proj-a/web-1"),
        event("no-key", _json(sound), key=None),
        event("labels-not-a-map", _json(no_map)),
    ]


def interleaved(hostile: int, valid: int, *, big_every: int = 1) -> Iterator[tuple[str, Hostile | int]]:
    """``hostile`` hostile records and ``valid`` valid intents (by number), mixed evenly.

    Rounds of every small class; the classes over 100 kB only every ``big_every`` rounds
    (the benchmark's 10,000 would otherwise be gigabytes). Yields ("hostile", Hostile) or
    ("valid", i).
    """
    chosen: list[Hostile] = []
    round_ = 0
    while len(chosen) < hostile:
        chosen += [h for h in hostile_intents(round_) + hostile_events(round_)
                   if not h.big or round_ % big_every == 0]
        round_ += 1
    chosen = chosen[:hostile]
    total = len(chosen) + valid
    next_valid = 0
    for position in range(total):
        # valid intents spread evenly among the hostile ones
        if next_valid < valid and (position + 1) * valid >= (next_valid + 1) * total:
            yield "valid", next_valid
            next_valid += 1
        else:
            yield "hostile", chosen[position - next_valid]
