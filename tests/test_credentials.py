"""The worker's key set (streams/common/credentials.py): a JWKS file re-read when it changes, a
JWKS URL fetched and kept when a later fetch fails, rotation by kid."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from handlers.config import AuthPolicy
from streams.common.credentials import KeySource, SigningKey, jwks, key_source


class JWKSServer:
    """A JWKS endpoint on loopback whose document the test changes."""

    def __init__(self) -> None:
        self.document: dict[str, object] = {"keys": []}
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = json.dumps(owner.document).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/jwks.json"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[JWKSServer]:
    server = JWKSServer()
    yield server
    server.close()


def test_a_changed_file_is_read_again_and_keys_rotate_by_kid(tmp_path: Path) -> None:
    old, new = SigningKey.generate("2026-10"), SigningKey.generate("2026-11")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(jwks(old)))
    source = KeySource(AuthPolicy(jwks_file=str(path)), recheck_seconds=0)
    assert list(source().keys) == ["2026-10"]
    path.write_text(json.dumps(jwks(old, new)))
    assert sorted(source().keys) == ["2026-10", "2026-11"]
    path.write_text(json.dumps(jwks(new)))
    assert list(source().keys) == ["2026-11"]
    path.write_text("{not json")
    assert list(source().keys) == ["2026-11"]  # a broken file keeps the last good keys


def test_a_url_is_fetched_and_its_last_good_copy_kept(endpoint: JWKSServer) -> None:
    first, second = SigningKey.generate("idp-1"), SigningKey.generate("idp-2")
    endpoint.document = jwks(first)
    source = KeySource(AuthPolicy(jwks_url=endpoint.url, jwks_refresh_seconds=3600))
    try:
        assert list(source().keys) == ["idp-1"]
        endpoint.document = jwks(first, second)
        source.refresh()
        assert sorted(source().keys) == ["idp-1", "idp-2"]
        endpoint.close()
        source.refresh()
        assert sorted(source().keys) == ["idp-1", "idp-2"]
    finally:
        source.close()


def test_jwt_mode_needs_a_key_set_and_none_mode_none() -> None:
    with pytest.raises(ValueError, match="neither auth.jwks_file nor auth.jwks_url"):
        key_source(AuthPolicy())
    assert key_source(AuthPolicy(mode="none")) is None


def test_an_unreadable_file_at_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="auth.jwks_file"):
        KeySource(AuthPolicy(jwks_file=str(tmp_path / "missing.json")))
