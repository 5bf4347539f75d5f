"""Bytes ↔ values for everything vmstream keeps or sends through Kafka.

Wire messages are pydantic models (``model_dump_json``); table values are the handlers'
frozen dataclasses, encoded with pydantic ``TypeAdapter``s so a changelog record is plain
JSON that any tool can read. Faust only ever sees bytes: the codecs live here, not in
Faust's registry, and the same functions serve the worker, replay and the tests.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from pydantic import BaseModel, TypeAdapter

from handlers.core.decisions import ResidentUpdate
from handlers.core.tables import table_named
from handlers.decide.inputs import RESIDENT_UPDATE
from streams.common.signing import Keyring, sealed_json

_RESIDENT_UPDATE = RESIDENT_UPDATE  # the routed topic's reading of it (handlers/decide/inputs.py)


@cache
def _adapter(name: str) -> TypeAdapter[Any]:
    return TypeAdapter(table_named(name).value_type)


def encode_state(table: str, value: Any) -> bytes:
    """A row of ``table`` (a handle of handlers/core/tables.py, or its name) as JSON."""
    return _adapter(table).dump_json(value)


def decode_state(table: str, raw: bytes | str) -> Any:
    return _adapter(table).validate_json(raw)


def encode_message(value: BaseModel, *, keyring: Keyring | None = None) -> bytes:
    """An output message as compact JSON; absent optional fields are left out.

    With a ``keyring``, commands, command results and audit records carry a ``mac``
    (streams/common/signing.py).
    """
    if keyring:
        sealed = sealed_json(value, keyring)
        if sealed is not None:
            return sealed
    return value.model_dump_json(exclude_none=True).encode()


def encode_resident_update(update: ResidentUpdate) -> bytes:
    return _RESIDENT_UPDATE.dump_json(update)


def decode_resident_update(raw: bytes) -> ResidentUpdate:
    return _RESIDENT_UPDATE.validate_json(raw)


def encode_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
