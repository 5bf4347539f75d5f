"""OAuth 2 access tokens for SASL OAUTHBEARER (``kafka.sasl_mechanism: OAUTHBEARER``).

A :class:`TokenSource` asks the token endpoint for a token with the client credentials grant
(RFC 6749, 4.4: the client's id and secret in HTTP Basic authentication, as Strimzi's own
clients and Keycloak expect), or reads one from ``kafka.oauth.token_file``; it keeps the
token until four fifths of its life have passed and hands it to every Kafka client of the
process that asks: librdkafka and aiokafka (and Faust through it) each wrap it
in the form that library takes (streams/common/kafka_clients.py). The broker checks the token
(its signature, issuer, audience, expiry) and takes its subject as the principal.
"""

from __future__ import annotations

import base64
import binascii
import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from streams.common.settings import KafkaOAuthSettings

# A token without an expiry of its own (an opaque token from a file, an endpoint that says
# no expires_in) is taken as valid this long; a token file is read again after FILE_SECONDS.
DEFAULT_LIFETIME = 3600.0
FILE_SECONDS = 60.0
REFRESH_FRACTION = 0.8  # of a token's life, after which it is asked for again
MARGIN_SECONDS = 5.0  # a token this close to its expiry is not handed out


class TokenError(RuntimeError):
    """No token: the endpoint refused the client or did not answer, or the file is unreadable."""


@dataclass(frozen=True)
class Token:
    """An access token, when it expires (seconds since the epoch) and whose it is."""

    value: str
    expires_at: float
    principal: str
    fetched_at: float

    def fresh(self, now: float, *, renew_after: float | None = None) -> bool:
        """Whether it is still the one to hand out (``renew_after``: the most seconds since
        it was fetched, a file's)."""
        if now >= self.expires_at - MARGIN_SECONDS:
            return False
        if renew_after is not None and now - self.fetched_at >= renew_after:
            return False
        return now < self.fetched_at + REFRESH_FRACTION * (self.expires_at - self.fetched_at)


def jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (the broker verifies them), or {} if it is not one."""
    parts = token.split(".")
    if len(parts) != 3:
        return {}
    try:
        payload = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
        claims = json.loads(payload)
    except (ValueError, binascii.Error):
        return {}
    return claims if isinstance(claims, dict) else {}


def token_of(value: str, *, now: float, expires_in: float | None = None, client_id: str | None = None) -> Token:
    """A :class:`Token` of ``value``: its expiry from ``expires_in``, else its ``exp`` claim,
    else :data:`DEFAULT_LIFETIME`; its principal its ``sub`` claim, else the client id."""
    claims = jwt_claims(value)
    if expires_in is not None:
        expires_at = now + expires_in
    elif isinstance(claims.get("exp"), int | float):
        expires_at = float(claims["exp"])
    else:
        expires_at = now + DEFAULT_LIFETIME
    subject = claims.get("sub")
    principal = subject if isinstance(subject, str) and subject else (client_id or "vmstream")
    return Token(value=value, expires_at=expires_at, principal=principal, fetched_at=now)


def request_body(oauth: KafkaOAuthSettings) -> bytes:
    """The client credentials grant's form: the grant type, and the scope and audience if set."""
    form = {"grant_type": "client_credentials"}
    if oauth.scope:
        form["scope"] = oauth.scope
    if oauth.audience:
        form["audience"] = oauth.audience
    return urllib.parse.urlencode(form).encode("ascii")


def basic_authorization(client_id: str, secret: str) -> str:
    """RFC 6749, 2.3.1: the id and secret form-encoded, then joined and base64-encoded."""
    pair = f"{urllib.parse.quote_plus(client_id)}:{urllib.parse.quote_plus(secret)}"
    return "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")


class TokenSource:
    """The process's token, fetched when none is fresh; safe to call from any thread."""

    def __init__(self, oauth: KafkaOAuthSettings, *, clock: Callable[[], float] = time.time) -> None:
        self.oauth = oauth
        self._clock = clock
        self._lock = threading.Lock()
        self._token: Token | None = None
        self._context = ssl.create_default_context(cafile=oauth.ssl_cafile) if oauth.token_endpoint_uri else None

    def token(self) -> Token:
        """A token valid for a while yet (raises :class:`TokenError` when none can be had)."""
        with self._lock:
            now = self._clock()
            renew_after = FILE_SECONDS if self.oauth.token_file else None
            if self._token is None or not self._token.fresh(now, renew_after=renew_after):
                self._token = self._read(now) if self.oauth.token_file else self._fetch(now)
            return self._token

    def _read(self, now: float) -> Token:
        path = self.oauth.token_file
        assert path is not None
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except OSError as error:
            raise TokenError(f"kafka.oauth.token_file: {path}: {error.strerror or error}") from error
        if not value:
            raise TokenError(f"kafka.oauth.token_file: {path} is empty")
        return token_of(value, now=now, client_id=self.oauth.client_id)

    def _fetch(self, now: float) -> Token:
        oauth = self.oauth
        uri, client_id = oauth.token_endpoint_uri, oauth.client_id
        assert uri is not None and client_id is not None and oauth.client_secret is not None
        request = urllib.request.Request(uri, data=request_body(oauth), method="POST", headers={
            "Authorization": basic_authorization(client_id, oauth.client_secret.get_secret_value()),
            "Content-Type": "application/x-www-form-urlencoded",
            "Accept": "application/json",
        })
        try:
            with urllib.request.urlopen(request, timeout=oauth.timeout_seconds, context=self._context) as answer:
                body = answer.read()
        except urllib.error.HTTPError as error:
            raise TokenError(f"the token endpoint {uri} refused client {client_id!r}: "
                             f"{error.code} {_oauth_error(error.read())}") from error
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise TokenError(f"the token endpoint {uri} does not answer: {reason}") from error
        try:
            answered = json.loads(body)
            value = answered["access_token"]
            expires_in = answered.get("expires_in")
            if not isinstance(value, str) or not value:
                raise ValueError("no access_token")
        except (ValueError, KeyError, TypeError) as error:
            raise TokenError(f"the token endpoint {uri} answered no access token ({error})") from error
        lifetime = float(expires_in) if isinstance(expires_in, int | float) and expires_in > 0 else None
        return token_of(value, now=now, expires_in=lifetime, client_id=client_id)


def _oauth_error(body: bytes) -> str:
    """The ``error`` and ``error_description`` of an OAuth 2 error answer, or its start."""
    try:
        answered = json.loads(body)
        return " ".join(str(answered[key]) for key in ("error", "error_description") if answered.get(key))
    except (ValueError, TypeError, AttributeError):
        return body[:200].decode("utf-8", "replace")


@lru_cache(maxsize=8)
def token_source(oauth: KafkaOAuthSettings) -> TokenSource:
    """One source per configuration in a process: its clients share one token."""
    return TokenSource(oauth)
