"""An OAuth 2 authorization server of the tests' own, on loopback: enough of one for SASL
OAUTHBEARER (harness/localkafka.py, ``OAuthBearer``).

``/token`` grants tokens to registered clients with the client credentials grant (RFC 6749,
4.4; the client's id and secret in HTTP Basic authentication or in the form), ``/jwks``
publishes the key they are signed with (RS256, as Keycloak signs by default). The broker
verifies each token against that key set, its issuer and audience, and takes its subject —
the client id — as the principal. ``mint`` signs a token without a request (a token file).
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

AUDIENCE = "kafka"
LIFETIME_SECONDS = 300.0


class TokenEndpoint:
    """``with TokenEndpoint() as idp: idp.register("vmstream-worker") ...``: serves until stopped."""

    def __init__(self, *, audience: str = AUDIENCE, lifetime: float = LIFETIME_SECONDS) -> None:
        self.audience = audience
        self.lifetime = lifetime
        self.kid = f"local-{uuid.uuid4().hex[:8]}"
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self._clients: dict[str, str] = {}
        self._lock = threading.Lock()
        self.granted: list[str] = []  # the clients granted a token by /token, in order
        self.refused: list[str] = []  # the client ids (or "") refused by /token
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("TokenEndpoint is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def token_url(self) -> str:
        return f"{self.url}/token"

    @property
    def jwks_url(self) -> str:
        return f"{self.url}/jwks"

    @property
    def issuer(self) -> str:
        return self.url

    # ------------------------------------------------------------------ clients and tokens

    def register(self, client_id: str, secret: str | None = None) -> str:
        """Add a client; returns its secret."""
        secret = secret or uuid.uuid4().hex
        with self._lock:
            self._clients[client_id] = secret
        return secret

    def mint(self, subject: str, *, lifetime: float | None = None, audience: str | None = None,
             scope: str | None = None) -> str:
        """A signed token for ``subject``, as /token grants it."""
        now = int(time.time())
        claims: dict[str, Any] = {"iss": self.issuer, "sub": subject, "aud": audience or self.audience,
                                  "iat": now, "nbf": now - 5, "exp": now + int(lifetime or self.lifetime),
                                  "jti": uuid.uuid4().hex, "azp": subject}
        if scope:
            claims["scope"] = scope
        return jwt.encode(claims, self._key, algorithm="RS256", headers={"kid": self.kid})

    def jwks(self) -> dict[str, Any]:
        key = RSAAlgorithm.to_jwk(self._key.public_key(), as_dict=True)
        return {"keys": [{**key, "kid": self.kid, "use": "sig", "alg": "RS256"}]}

    def grant(self, headers: Any, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        """The answer to a token request: (status, JSON body)."""
        if form.get("grant_type") != "client_credentials":
            return 400, {"error": "unsupported_grant_type"}
        client_id, secret = form.get("client_id", ""), form.get("client_secret", "")
        authorization = headers.get("Authorization", "")
        if authorization.startswith("Basic "):
            try:
                pair = base64.b64decode(authorization[6:], validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                pair = ""
            encoded_id, _, encoded_secret = pair.partition(":")
            client_id, secret = urllib.parse.unquote_plus(encoded_id), urllib.parse.unquote_plus(encoded_secret)
        with self._lock:
            known = self._clients.get(client_id)
            if known is None or secret != known:
                self.refused.append(client_id)
                return 401, {"error": "invalid_client", "error_description": "unknown client or wrong secret"}
            self.granted.append(client_id)
        return 200, {"access_token": self.mint(client_id, scope=form.get("scope")), "token_type": "Bearer",
                     "expires_in": int(self.lifetime)}

    # ------------------------------------------------------------------ the server

    def start(self) -> TokenEndpoint:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/jwks":
                    self._answer(200, endpoint.jwks())
                else:
                    self._answer(404, {"error": "not_found"})

            def do_POST(self) -> None:
                if self.path != "/token":
                    self._answer(404, {"error": "not_found"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                form = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode("utf-8")))
                self._answer(*endpoint.grant(self.headers, form))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="token-endpoint", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> TokenEndpoint:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
