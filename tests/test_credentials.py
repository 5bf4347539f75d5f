"""The worker's key set (streams/common/credentials.py): a JWKS file re-read when it changes, a
JWKS URL fetched and kept when a later fetch fails, rotation by kid."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from handlers.contracts.config import AuthPolicy
from streams.common.credentials import KeySource, SigningKey, check_key_set, jwks, key_source


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


def test_a_file_changed_into_no_key_set_keeps_the_last_good_keys_an_empty_set_does_not(tmp_path: Path) -> None:
    key = SigningKey.generate("2026-11")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(jwks(key)))
    source = KeySource(AuthPolicy(jwks_file=str(path)), recheck_seconds=0)
    for broken in ("", "{}", '{"keys": [{"kid": "x", "kty": "oct", "k": "c2VjcmV0"}]}'):
        path.write_text(broken)
        assert list(source().keys) == ["2026-11"], broken
    path.write_text('{"keys": []}')  # emptied on purpose: nothing is accepted any more
    assert not source()


@pytest.mark.parametrize(("content", "says"), [
    (None, "No such file or directory"), ("", "empty, not a JWKS"), ("{not json", "not JSON"),
    ("[]", "not a JWKS"), ('{"keys": [{"kty": "OKP"}]}', "no usable key"),
])
def test_check_key_set_names_the_setting_and_the_file(tmp_path: Path, content: str | None, says: str) -> None:
    path = tmp_path / "jwks.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as caught:
        check_key_set(AuthPolicy(jwks_file=str(path)))
    assert str(caught.value).startswith(f"auth.jwks_file: {path}: ") and says in str(caught.value)
    with pytest.raises(ValueError, match="neither auth.jwks_file nor auth.jwks_url"):
        check_key_set(AuthPolicy())
    check_key_set(AuthPolicy(mode="none", jwks_file=str(path)))  # not read: auth: none verifies nothing
