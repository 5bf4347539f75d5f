"""Intents' credentials: signing them (upstream services, the CLI, the demo, the tests)
and loading the public keys the worker verifies them with.

    signer's private key ──sign_intent──► intent["credential"] ──► vmstream.intents
    JWKS file / URL ──KeySource──► KeySet ──► handlers/rules/auth.verify_intent

What a credential must say is in docs/auth.md; the verification itself is pure and lives
in ``handlers/rules/auth.py``. Keys rotate by ``kid``: publish the new public key in the JWKS
(the worker re-reads a changed file at once and refetches a URL every
``auth.jwks_refresh_seconds``), then sign with it, and remove the old key once no
credential signed with it can still be read (replays included).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from handlers.contracts.config import AuthPolicy
from handlers.contracts.topics import INTENTS
from handlers.rules.auth import CREDENTIAL_FIELD, DIGEST_CLAIM, INTENT_ID_CLAIM, KeySet, body_digest
from streams.common.settings import KafkaSettings

log = logging.getLogger(__name__)

PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
DEFAULT_LIFETIME = timedelta(minutes=5)


@dataclass(frozen=True)
class SigningKey:
    """A private key with the ``kid`` its public half is published under."""

    kid: str
    key: PrivateKey

    @property
    def algorithm(self) -> str:
        if isinstance(self.key, ed25519.Ed25519PrivateKey):
            return "EdDSA"
        if isinstance(self.key, ec.EllipticCurvePrivateKey):
            if self.key.curve.name != "secp256r1":
                raise ValueError("EC keys must be on P-256 (ES256)")
            return "ES256"
        return "RS256"

    def public_jwk(self) -> dict[str, Any]:
        public = self.key.public_key()
        if isinstance(public, ed25519.Ed25519PublicKey):
            jwk = OKPAlgorithm.to_jwk(public, as_dict=True)
        elif isinstance(public, ec.EllipticCurvePublicKey):
            jwk = ECAlgorithm.to_jwk(public, as_dict=True)
        else:
            jwk = RSAAlgorithm.to_jwk(public, as_dict=True)
        return {**jwk, "kid": self.kid, "alg": self.algorithm, "use": "sig"}

    def private_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())

    @classmethod
    def generate(cls, kid: str, algorithm: str = "EdDSA") -> SigningKey:
        key: PrivateKey
        if algorithm == "EdDSA":
            key = ed25519.Ed25519PrivateKey.generate()
        elif algorithm == "ES256":
            key = ec.generate_private_key(ec.SECP256R1())
        elif algorithm == "RS256":
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        else:
            raise ValueError(f"unsupported algorithm {algorithm}")
        return cls(kid, key)

    @classmethod
    def from_pem(cls, kid: str, pem: bytes) -> SigningKey:
        key = serialization.load_pem_private_key(pem, password=None)
        if not isinstance(key, (ed25519.Ed25519PrivateKey, ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
            raise ValueError("the key must be Ed25519, EC P-256 or RSA")
        return cls(kid, key)

    @classmethod
    def from_file(cls, kid: str, path: str | Path) -> SigningKey:
        return cls.from_pem(kid, Path(path).read_bytes())


def jwks(*keys: SigningKey) -> dict[str, Any]:
    """The public JWKS document of ``keys``."""
    return {"keys": [key.public_jwk() for key in keys]}


def sign_intent(
    body: Mapping[str, Any],
    key: SigningKey,
    *,
    subject: str | None = None,
    projects: Sequence[str] = (),
    roles: Sequence[str] = (),
    issuer: str | None = None,
    audience: str = "vmstream",
    now: datetime | None = None,
    lifetime: timedelta = DEFAULT_LIFETIME,
) -> str:
    """A credential for exactly this intent body (its ``credential`` field, if any, aside).

    ``subject`` defaults to the body's ``requested_by``; what a signer vouches for is its
    own business: an identity provider issues it only after authenticating the person.
    """
    issued = now or datetime.now(UTC)
    claims: dict[str, Any] = {
        "sub": subject if subject is not None else body["requested_by"],
        "aud": audience,
        "iat": int(issued.timestamp()),
        "exp": int((issued + lifetime).timestamp()),
        INTENT_ID_CLAIM: body["intent_id"],
        DIGEST_CLAIM: body_digest(body),
        "projects": list(projects),
        "roles": list(roles),
    }
    if issuer is not None:
        claims["iss"] = issuer
    return jwt.encode(claims, key.key, algorithm=key.algorithm, headers={"kid": key.kid})


def signed(body: Mapping[str, Any], key: SigningKey, **claims: Any) -> dict[str, Any]:
    """``body`` with its ``credential`` (see :func:`sign_intent` for the claims)."""
    unsigned = {k: v for k, v in body.items() if k != CREDENTIAL_FIELD}
    return {**unsigned, CREDENTIAL_FIELD: sign_intent(unsigned, key, **claims)}


# --------------------------------------------------------------------- verifying side


NO_KEY_SET = ("auth.mode is jwt but neither auth.jwks_file nor auth.jwks_url is set "
              "(docs/auth.md; auth: none only for local development)")


def read_jwks(text: str | bytes, origin: str, *, warn: bool = True) -> KeySet:
    """The key set of a JWKS document; a ValueError for one that is empty, not JSON, not a
    JWKS, or whose keys are all unusable. ``{"keys": []}`` is a key set, empty on purpose
    (keys published later: the file is read again when it changes)."""
    if not text.strip():
        raise ValueError(f"{origin}: empty, not a JWKS")
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{origin}: not JSON: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError(f"{origin}: not a JWKS (a JSON object with a list 'keys')")
    keys = KeySet.from_jwks(document)
    if not keys and keys.problems:
        raise ValueError(f"{origin}: no usable key ({len(keys.problems)} skipped; {keys.problems[0]})")
    for problem in keys.problems if warn else ():
        log.warning("key skipped", extra={"origin": origin, "problem": problem})
    return keys


def check_key_set(policy: AuthPolicy) -> None:
    """What :func:`key_source` refuses, found at start without fetching anything: ``jwt``
    mode without a key set, or a JWKS file that is missing, unreadable, empty or not a JWKS.
    A ValueError whose text names the setting."""
    if policy.mode == "none":
        return
    if not policy.jwks_file and not policy.jwks_url:
        raise ValueError(NO_KEY_SET)
    if policy.jwks_file:
        path = Path(policy.jwks_file)
        try:
            read_jwks(path.read_bytes(), str(path), warn=False)  # the process reads it again, and warns
        except OSError as exc:
            raise ValueError(f"auth.jwks_file: {path}: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise ValueError(f"auth.jwks_file: {exc}") from exc


class KeySource:
    """The worker's key set: a JWKS file (re-read when it changes) and/or a JWKS URL
    (fetched at start, then every ``jwks_refresh_seconds`` on a thread of its own, the
    last good copy kept when a fetch fails). Called once per intent: it never blocks."""

    def __init__(self, policy: AuthPolicy, *, recheck_seconds: float = 1.0) -> None:
        self.policy = policy
        self.recheck_seconds = recheck_seconds  # how often the file's stamp is looked at
        self._file_stamp: tuple[int, int, int] | None = None
        self._file_keys = KeySet()
        self._url_keys = KeySet()
        self._merged = KeySet()
        self._checked = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if policy.jwks_file:
            self._read_file()
        if policy.jwks_url:
            self._fetch()
            threading.Thread(target=self._refresh, name="jwks-refresh", daemon=True).start()

    def __call__(self) -> KeySet:
        if self.policy.jwks_file and time.monotonic() - self._checked >= self.recheck_seconds:
            self._read_file()
        return self._merged

    def refresh(self) -> None:
        """Fetch the URL now (the refresh thread does this every ``jwks_refresh_seconds``)."""
        if self.policy.jwks_url:
            self._fetch()

    def close(self) -> None:
        self._stop.set()

    def _read_file(self) -> None:
        assert self.policy.jwks_file
        self._checked = time.monotonic()
        path = Path(self.policy.jwks_file)
        try:
            stat = path.stat()
            stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)  # a ConfigMap swaps in a new file
            if stamp == self._file_stamp:
                return
            keys = read_jwks(path.read_bytes(), str(path))
        except (OSError, ValueError) as exc:
            if self._file_stamp is None:
                why = f"{path}: {exc.strerror or exc}" if isinstance(exc, OSError) else exc
                raise ValueError(f"auth.jwks_file: {why}") from exc
            log.warning("JWKS file unreadable: keeping the last keys", extra={"error": str(exc)})
            return
        self._file_stamp, self._file_keys = stamp, keys
        self._merge()

    def _fetch(self) -> None:
        assert self.policy.jwks_url
        try:
            with urllib.request.urlopen(self.policy.jwks_url, timeout=10) as response:  # noqa: S310
                keys = read_jwks(response.read(1 << 20), self.policy.jwks_url)
        except (OSError, ValueError) as exc:
            log.warning("JWKS fetch failed: keeping the last keys", extra={"error": str(exc)})
            return
        self._url_keys = keys
        self._merge()

    def _refresh(self) -> None:
        while not self._stop.wait(self.policy.jwks_refresh_seconds):
            self.refresh()

    def _merge(self) -> None:
        with self._lock:
            self._merged = KeySet({**self._url_keys.keys, **self._file_keys.keys})


def key_source(policy: AuthPolicy) -> KeySource | None:
    """What the engine verifies with; None under ``auth: none``. Refuses to start in
    ``jwt`` mode without a key set: nothing could ever be accepted."""
    if policy.mode == "none":
        return None
    if not policy.jwks_file and not policy.jwks_url:
        raise ValueError(NO_KEY_SET)
    return KeySource(policy)


def environment_key(env: Mapping[str, str] = os.environ) -> SigningKey | None:
    """A signing key from ``VMSTREAM_INTENT_KEY`` (a PEM file) and ``VMSTREAM_INTENT_KID``."""
    path, kid = env.get("VMSTREAM_INTENT_KEY"), env.get("VMSTREAM_INTENT_KID")
    if not path or not kid:
        return None
    return SigningKey.from_file(kid, path)


Record = tuple[str, str | None, bytes, int]  # (topic, key, value, timestamp ms): harness/publishing.py


class DevSigner:
    """A throwaway upstream service for the demo and the tests: a key generated now, its JWKS
    in ``workdir``, and the environment that makes a worker verify with it. It vouches
    for whatever an intent says: its requester, its project, and the operator role for
    ``operators``."""

    def __init__(self, workdir: Path, *, operators: Sequence[str] = (), kid: str = "dev-1") -> None:
        self.key = SigningKey.generate(kid)
        self.operators = tuple(operators)
        self.jwks_file = workdir / "jwks.json"
        self.jwks_file.write_text(json.dumps(jwks(self.key)), encoding="utf-8")

    def worker_env(self) -> dict[str, str]:
        return {"VMSTREAM_AUTH__MODE": "jwt", "VMSTREAM_AUTH__JWKS_FILE": str(self.jwks_file)}

    def sign(self, body: Mapping[str, Any], now: datetime | None = None) -> dict[str, Any]:
        project = body.get("project")
        return signed(body, self.key, projects=[project] if isinstance(project, str) else [],
                      roles=[AuthPolicy().operator_role] if body.get("requested_by") in self.operators else [],
                      now=now)

    def sign_records(self, records: Sequence[Record], intents_topic: str | None = None) -> list[Record]:
        """Each intent of ``records`` (on ``intents_topic``, by default the default name of the intents
        topic, as scenario files name it) signed as of its own timestamp (after any time shift)."""
        if intents_topic is None:
            intents_topic = KafkaSettings().topic(INTENTS)
        out = []
        for topic, key, value, timestamp_ms in records:
            if topic == intents_topic:
                at = datetime.fromtimestamp(timestamp_ms / 1000, UTC)
                value = json.dumps(self.sign(json.loads(value), at)).encode()
            out.append((topic, key, value, timestamp_ms))
        return out
