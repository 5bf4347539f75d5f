"""Who asks: an intent's credential, verified before any rule reads the intent.

    intent (with ``credential``) → :func:`verify_intent` → :class:`Principal` → rules

An intent carries, in its ``credential`` field, a compact JWS (a JWT) signed by the
upstream service or identity provider that vouches for the requester (docs/auth.md). It
is bound to this one intent: its ``intent_id`` claim names the intent and its
``intent_sha256`` claim is the digest of the intent's canonical body without the
credential (:func:`body_digest`), so it cannot be replayed onto another intent. Its
expiry is checked against the input's own time (the Kafka timestamp the engine decides
at), so a replay decides the same.

Pure: a function of (token, intent body, key set, policy, now). The shell loads the key
set (a JWKS file or URL, ``streams/keysets.py``) and hands it in.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import jwt
from jwt.exceptions import InvalidTokenError, PyJWKError

from handlers.contracts.config import AuthPolicy
from handlers.contracts.messages import principal_problem

CREDENTIAL_FIELD = "credential"
TOKEN_MAX = 8192  # a credential is a few hundred characters; verifying costs per character
# Asymmetric only: a key that verifies must not be able to sign.
ALGORITHMS = ("EdDSA", "ES256", "RS256")
# The claims vmstream reads, beside the registered ones (sub, aud, iss, exp, iat, nbf).
INTENT_ID_CLAIM = "intent_id"
DIGEST_CLAIM = "intent_sha256"
PROJECTS_CLAIM = "projects"
ROLES_CLAIM = "roles"


@dataclass(frozen=True, slots=True)
class Principal:
    """The requester as the credential proves them (or, with ``auth: none``, as claimed)."""

    name: str
    projects: frozenset[str]
    operator: bool
    verified: bool = True


@dataclass(frozen=True, slots=True)
class Unauthenticated:
    """Why an intent's credential is refused. ``signer`` is set only when the signature
    itself held (a valid credential that disagrees with the body): only then is there an
    address vmstream may tell."""

    reason: str
    signer: str | None = None


Verification = Principal | Unauthenticated


@dataclass(frozen=True)
class KeySet:
    """Public keys by ``kid``, from a JWKS document (RFC 7517)."""

    keys: Mapping[str, jwt.PyJWK] = field(default_factory=dict)
    problems: tuple[str, ...] = ()  # keys of the document that were skipped, and why

    @classmethod
    def from_jwks(cls, document: Mapping[str, Any]) -> KeySet:
        keys: dict[str, jwt.PyJWK] = {}
        problems = []
        entries = document.get("keys")
        if not isinstance(entries, list):
            return cls({}, ("a JWKS document needs a list 'keys'",))
        for index, entry in enumerate(entries):
            kid = entry.get("kid") if isinstance(entry, dict) else None
            if not isinstance(kid, str) or not kid:
                problems.append(f"keys[{index}]: no kid")
                continue
            if entry.get("use", "sig") != "sig":
                problems.append(f"key {kid}: use is not 'sig'")
                continue
            if any(part in entry for part in ("d", "p", "q", "k")):
                problems.append(f"key {kid}: a private or symmetric key has no place in a key set")
                continue
            try:
                key = jwt.PyJWK(entry)
            except PyJWKError as exc:
                problems.append(f"key {kid}: {exc}")
                continue
            if key.algorithm_name not in ALGORITHMS:
                problems.append(f"key {kid}: algorithm {key.algorithm_name} is not one of {', '.join(ALGORITHMS)}")
                continue
            if kid in keys:
                problems.append(f"key {kid}: kid appears twice")
                continue
            keys[kid] = key
        return cls(keys, tuple(problems))

    def __bool__(self) -> bool:
        return bool(self.keys)


def canonical_body(body: Mapping[str, Any]) -> bytes:
    """The intent as signed: its JSON object without ``credential``, keys sorted, no
    insignificant whitespace, UTF-8 (RFC 8785 for the values intents hold)."""
    unsigned = {key: value for key, value in body.items() if key != CREDENTIAL_FIELD}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def body_digest(body: Mapping[str, Any]) -> str:
    """The ``intent_sha256`` claim: lower-case hex SHA-256 of :func:`canonical_body`."""
    return hashlib.sha256(canonical_body(body)).hexdigest()


def _when(seconds: Any) -> datetime:
    return datetime.fromtimestamp(float(seconds), UTC)


def _strings(claims: Mapping[str, Any], name: str) -> list[str] | None:
    value = claims.get(name, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        return None
    return value


def _header(token: str) -> dict[str, Any] | None:
    """The JWS header, to pick the key (PyJWT checks it again, in full, while verifying)."""
    if token.count(".") != 2:
        return None
    segment = token.split(".", 1)[0]
    try:
        header = json.loads(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
    except (ValueError, binascii.Error, RecursionError):  # nested deeper than the parser goes
        return None
    return header if isinstance(header, dict) else None


def verify_intent(
    token: Any, body: Mapping[str, Any], keys: KeySet, policy: AuthPolicy, now: datetime
) -> Verification:
    """The requester proven by ``token`` for the intent ``body``, or why not.

    ``now`` is the input's time; expiry, not-before and issue time are checked against it
    with ``policy.leeway_seconds``, and a credential may live at most
    ``policy.max_lifetime_seconds``.
    """
    if token is None:
        return Unauthenticated(f"no credential: an intent must carry a signed credential in {CREDENTIAL_FIELD!r}")
    if not isinstance(token, str):
        return Unauthenticated(f"{CREDENTIAL_FIELD}: must be a compact JWS string")
    if len(token) > TOKEN_MAX:
        return Unauthenticated(f"{CREDENTIAL_FIELD}: longer than {TOKEN_MAX} characters")
    header = _header(token)
    if header is None:
        return Unauthenticated(f"{CREDENTIAL_FIELD}: not a compact JWS")
    algorithm, kid = header.get("alg"), header.get("kid")
    if algorithm not in ALGORITHMS:
        return Unauthenticated(f"credential: algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    if not isinstance(kid, str) or not kid:
        return Unauthenticated("credential: no key id (kid) in its header")
    key = keys.keys.get(kid)
    if key is None:
        return Unauthenticated(f"credential: unknown key id {kid!r}")
    if key.algorithm_name != algorithm:
        return Unauthenticated(f"credential: key {kid!r} is for {key.algorithm_name}, not {algorithm}")
    try:
        claims = jwt.decode(
            token,
            key.key,
            algorithms=[algorithm],
            audience=policy.audience,
            issuer=list(policy.issuers) or None,
            # Time is the input's, checked below; PyJWT would use the wall clock.
            options={"require": ["sub", "aud", "exp", "iat", INTENT_ID_CLAIM, DIGEST_CLAIM],
                     "verify_exp": False, "verify_nbf": False, "verify_iat": False},
        )
    except InvalidTokenError as exc:
        return Unauthenticated(f"credential: {exc}")
    return _check_claims(claims, body, policy, now)


def _check_claims(claims: Mapping[str, Any], body: Mapping[str, Any], policy: AuthPolicy,
                  now: datetime) -> Verification:
    """The signature holds: the claims must be well-formed, current and about this intent."""
    subject = claims["sub"]
    if not isinstance(subject, str) or (problem := principal_problem(subject)):
        return Unauthenticated(f"credential: sub is not a valid principal ({problem or 'not a string'})")
    try:
        expires, issued = _when(claims["exp"]), _when(claims["iat"])
        not_before = _when(claims["nbf"]) if "nbf" in claims else None
    except (TypeError, ValueError, OverflowError):
        return Unauthenticated("credential: exp, iat and nbf must be numeric dates", subject)
    leeway = timedelta(seconds=policy.leeway_seconds)
    if now > expires + leeway:
        return Unauthenticated(f"credential expired at {expires:%Y-%m-%d %H:%M:%S} UTC", subject)
    if issued > now + leeway or (not_before is not None and not_before > now + leeway):
        return Unauthenticated("credential is not valid yet", subject)
    if expires - issued > timedelta(seconds=policy.max_lifetime_seconds):
        return Unauthenticated(
            f"credential lives longer than {policy.max_lifetime_seconds} s (exp - iat)", subject)
    if claims[INTENT_ID_CLAIM] != body.get("intent_id"):
        return Unauthenticated(f"credential was issued for intent {claims[INTENT_ID_CLAIM]!r}, "
                               f"not {body.get('intent_id')!r}", subject)
    if claims[DIGEST_CLAIM] != body_digest(body):
        return Unauthenticated("credential was issued for another body of this intent "
                               f"({DIGEST_CLAIM} does not match)", subject)
    projects, roles = _strings(claims, PROJECTS_CLAIM), _strings(claims, ROLES_CLAIM)
    if projects is None or roles is None:
        return Unauthenticated(f"credential: {PROJECTS_CLAIM} and {ROLES_CLAIM} must be lists of strings", subject)
    return Principal(subject, frozenset(projects), policy.operator_role in roles)


def claimed_principal(requested_by: str, project: str | None, operators: list[str]) -> Principal:
    """``auth: none`` (local development only): the body is taken at its word."""
    return Principal(requested_by, frozenset([project]) if project else frozenset(),
                     requested_by in operators, verified=False)


def agreement_problem(principal: Principal, requested_by: str, project: str | None) -> str | None:
    """The body's ``requested_by`` and ``project`` must be what the credential proves."""
    if requested_by != principal.name:
        return f"requested_by {requested_by!r} is not the credential's subject {principal.name!r}"
    if project is not None and project not in principal.projects:
        return f"{principal.name} is not a member of project {project!r}"
    return None
