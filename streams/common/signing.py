"""Commands, their results and audit records sealed with a shared key: the worker vouches for
a command, the applier for a result, either for its audit records (docs/security.md).

    worker:  Command       → encode_message(…, keyring) → {…, "mac": {"alg", "kid", "value"}}
    applier: commands topic → verify(raw, "command")    → the command, or why it is refused
    applier: CommandResult → encode_message(…, keyring) → sealed result
    ledger:  command-results → verify(raw, "command-result") → counted, or ignored
    both:    AuditRecord   → encode_message(…, keyring) → sealed audit record
    readers: audit         → verify(raw, "audit")       → read (``intent --wait``, replay), or ignored

The MAC is HMAC-SHA256 over ``vmstream/v1`` + the purpose + the canonical JSON of the
message without its ``mac`` field (keys sorted, no spaces, UTF-8, absent optional fields
left out) — the message as parsed, so what is verified is what is acted on. The purpose
keeps a sealed command from passing for a result or an audit record, and the other way round. Keys are named
(``kid``): the signer seals with one, the verifier accepts any it holds, which is how a key
is rotated.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import pydantic_core
import yaml
from pydantic import BaseModel, ValidationError

from handlers.contracts.messages import AuditRecord, Command, CommandResult

MAC_FIELD = "mac"
ALGORITHM = "HS256"
DOMAIN = b"vmstream/v1\n"
MIN_SECRET_LENGTH = 32
Purpose = Literal["command", "command-result", "audit"]
M = TypeVar("M", bound=BaseModel)


class KeyringError(ValueError):
    """The configured keys cannot be used (missing, too short, the active one unknown)."""


def canonical(value: BaseModel) -> bytes:
    """The bytes a MAC covers: the message as data, without its ``mac``, in one spelling."""
    return _canonical_body(value.model_dump(mode="json", exclude_none=True))


def _canonical_body(body: Mapping[str, Any]) -> bytes:
    unsealed = {key: item for key, item in body.items() if key != MAC_FIELD}
    return json.dumps(unsealed, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@dataclass(frozen=True, slots=True)
class Keyring:
    """Named HMAC keys; ``active`` is the one new messages are sealed with."""

    keys: Mapping[str, bytes] = field(repr=False)
    active: str | None = None

    def __post_init__(self) -> None:
        for kid, secret in self.keys.items():
            if len(secret) < MIN_SECRET_LENGTH:
                raise KeyringError(f"signing key {kid!r} is {len(secret)} bytes; at least {MIN_SECRET_LENGTH} are needed")
        if self.active is not None and self.active not in self.keys:
            raise KeyringError(f"the active signing key {self.active!r} is not among the keys {sorted(self.keys)}")

    def __bool__(self) -> bool:
        return bool(self.keys)

    def mac(self, purpose: Purpose, value: BaseModel, kid: str) -> str:
        return self._mac(purpose, canonical(value), kid)

    def _mac(self, purpose: Purpose, covered: bytes, kid: str) -> str:
        digest = hmac.new(self.keys[kid], DOMAIN + purpose.encode() + b"\n" + covered, hashlib.sha256)
        return _b64(digest.digest())

    def seal(self, purpose: Purpose, value: BaseModel) -> dict[str, str]:
        """The ``mac`` field for ``value``, with the active key."""
        return self.seal_body(purpose, value.model_dump(mode="json", exclude_none=True))

    def seal_body(self, purpose: Purpose, body: Mapping[str, Any]) -> dict[str, str]:
        """The ``mac`` field for a message already dumped as data (``model_dump(mode="json",
        exclude_none=True)``): a message is sealed and written from one dump, not two."""
        if self.active is None:
            raise KeyringError("no active signing key")
        return {"alg": ALGORITHM, "kid": self.active, "value": self._mac(purpose, _canonical_body(body), self.active)}

    def problem(self, purpose: Purpose, value: BaseModel) -> str | None:
        """Why ``value``'s ``mac`` does not vouch for it; None when it does."""
        extra = value.model_extra or {}
        sealed = extra.get(MAC_FIELD)
        if sealed is None:
            return "it carries no MAC"
        if not isinstance(sealed, dict) or not all(isinstance(sealed.get(k), str) for k in ("alg", "kid", "value")):
            return "its MAC is not an object with alg, kid and value"
        if sealed["alg"] != ALGORITHM:
            return f"its MAC algorithm {sealed['alg']!r} is not {ALGORITHM}"
        if sealed["kid"] not in self.keys:
            return f"its MAC key {sealed['kid'][:64]!r} is unknown"
        # A MAC is base64url: anything else does not match (compare_digest raises on non-ASCII).
        if not sealed["value"].isascii() or not hmac.compare_digest(sealed["value"], self.mac(purpose, value, sealed["kid"])):
            return "its MAC does not match"
        return None


def purpose_of(value: BaseModel) -> Purpose | None:
    """Which messages are sealed: commands, command results and audit records."""
    if isinstance(value, Command):
        return "command"
    if isinstance(value, CommandResult):
        return "command-result"
    if isinstance(value, AuditRecord):
        return "audit"
    return None


def sealed_json(value: BaseModel, keyring: Keyring) -> bytes | None:
    """``value`` as compact JSON with its ``mac``; None for messages that are not sealed.

    Written by pydantic-core: the bytes ``json.dumps`` writes with the same separators and
    UTF-8 as it is (tests/rules/test_policy.py). A float may be spelled otherwise (``1e-7``, not
    ``1e-07``): the same number, and the MAC covers the canonical form, not these bytes.
    """
    purpose = purpose_of(value)
    if purpose is None or not keyring:
        return None
    body = value.model_dump(mode="json", exclude_none=True)
    body[MAC_FIELD] = keyring.seal_body(purpose, body)
    return pydantic_core.to_json(body)


def open_sealed(model: type[M], raw: bytes, purpose: Purpose, keyring: Keyring) -> tuple[M | None, str | None]:
    """Parse ``raw`` and check its MAC: (message, None) when it holds, else (message or None, why)."""
    try:
        value = model.model_validate_json(raw)
    except ValidationError as exc:
        return None, f"not a {model.__name__}: {exc.error_count()} validation error(s)"
    return value, keyring.problem(purpose, value)


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what, and where."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"{error.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(error).split())


def _secret(text: str) -> bytes:
    return text.strip().encode()


def read_keys(path: str | Path) -> dict[str, bytes]:
    """Keys from a directory (one file per key, named by its id: a mounted Secret) or a YAML
    mapping of key id → secret."""
    where = Path(path)
    if where.is_dir():
        return {entry.name: _secret(entry.read_text(encoding="utf-8"))
                for entry in sorted(where.iterdir()) if entry.is_file() and not entry.name.startswith(".")}
    try:
        loaded: Any = yaml.safe_load(where.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise KeyringError(f"{path}: not YAML ({yaml_problem(exc)})") from exc
    if not isinstance(loaded, dict):
        raise KeyringError(f"{path}: signing keys must be a mapping of key id → secret")
    return {str(kid): _secret(str(secret)) for kid, secret in loaded.items()}


def keyring_from(*, keys: Mapping[str, str], keys_file: str | None, key_id: str | None) -> Keyring:
    """The keyring the settings describe: ``keys_file``'s keys plus ``keys``; the active key is
    ``key_id``, or the only key there is."""
    found = read_keys(keys_file) if keys_file else {}
    found.update({kid: _secret(secret) for kid, secret in keys.items()})
    active = key_id if key_id is not None else (next(iter(found)) if len(found) == 1 else None)
    return Keyring(found, active)
