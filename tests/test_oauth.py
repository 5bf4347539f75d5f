"""OAUTHBEARER's token source (streams/common/oauth.py) against harness/localoauth.py's token
endpoint over real HTTP, and with a token file: one request for many clients, a new token
after four fifths of its life, refusals said with the endpoint's own words. Each client
library takes the source in the form it expects (streams/common/kafka_clients.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import faust
import pytest
from aiokafka.abc import AbstractTokenProvider as AiokafkaTokenProvider
from confluent_kafka import Producer

from harness.pki import CertificateAuthority
from harness.localoauth import TokenEndpoint
from harness.processes import free_ports
from streams.common.kafka_clients import librdkafka_options
from streams.common.oauth import DEFAULT_LIFETIME, TokenError, TokenSource, jwt_claims
from streams.common.settings import KafkaOAuthSettings, KafkaSettings
from streams.worker.broker_credentials import aiokafka_options, faust_credentials


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def idp() -> Iterator[TokenEndpoint]:
    with TokenEndpoint(lifetime=300) as endpoint:
        yield endpoint


def source(idp: TokenEndpoint, client_id: str, secret: str, **more: object) -> tuple[TokenSource, Clock]:
    oauth = KafkaOAuthSettings(token_endpoint_uri=idp.token_url, client_id=client_id, client_secret=secret, **more)
    clock = Clock(1_900_000_000.0)
    return TokenSource(oauth, clock=clock), clock


def test_a_token_by_the_client_credentials_grant_kept_and_renewed(idp: TokenEndpoint) -> None:
    tokens, clock = source(idp, "vmstream-worker", idp.register("vmstream-worker"), scope="kafka")
    first = tokens.token()
    claims = jwt_claims(first.value)
    assert (claims["sub"], claims["aud"], claims["iss"], claims["scope"]) == (
        "vmstream-worker", "kafka", idp.issuer, "kafka")
    assert (first.principal, first.expires_at) == ("vmstream-worker", clock.now + 300)
    clock.now += 239  # under four fifths of 300 s: the same token, no request
    assert tokens.token() is first
    assert idp.granted.count("vmstream-worker") == 1
    clock.now += 2
    assert tokens.token() is not first
    assert idp.granted.count("vmstream-worker") == 2


def test_a_secret_with_reserved_characters(idp: TokenEndpoint) -> None:
    """RFC 6749, 2.3.1: id and secret form-encoded inside HTTP Basic, so ':' and '+' survive."""
    secret = "a:b+c/d=e f%"
    tokens, _ = source(idp, "upstream:portal", idp.register("upstream:portal", secret))
    assert tokens.token().principal == "upstream:portal"


def test_a_wrong_secret_is_said_with_the_endpoints_words(idp: TokenEndpoint) -> None:
    idp.register("vmstream-apply")
    tokens, _ = source(idp, "vmstream-apply", "wrong")
    with pytest.raises(TokenError, match=r"refused client 'vmstream-apply': 401 invalid_client unknown client"):
        tokens.token()


def test_an_endpoint_that_does_not_answer() -> None:
    [port] = free_ports(1)
    oauth = KafkaOAuthSettings(token_endpoint_uri=f"http://127.0.0.1:{port}/token", client_id="c",
                               client_secret="s", timeout_seconds=2)
    with pytest.raises(TokenError, match="does not answer"):
        TokenSource(oauth).token()


def test_a_token_file_read_again_after_a_minute(idp: TokenEndpoint, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(idp.mint("vmstream-watch", lifetime=3600) + "\n")
    clock = Clock(time.time())  # the token's own expiry is an hour from now
    tokens = TokenSource(KafkaOAuthSettings(token_file=str(path)), clock=clock)
    first = tokens.token()
    assert first.principal == "vmstream-watch" and first.value == path.read_text().strip()
    assert first.expires_at == jwt_claims(first.value)["exp"]
    path.write_text(idp.mint("vmstream-watch", lifetime=3600))  # rotated
    clock.now += 59
    assert tokens.token() is first
    clock.now += 2
    assert tokens.token().value == path.read_text()


def test_an_opaque_token_file_and_an_empty_one(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("opaque-token")
    clock = Clock(1_900_000_000.0)
    token = TokenSource(KafkaOAuthSettings(token_file=str(path), client_id="vmstream-api"), clock=clock).token()
    assert (token.value, token.expires_at, token.principal) == ("opaque-token", clock.now + DEFAULT_LIFETIME,
                                                                 "vmstream-api")
    path.write_text("\n")
    with pytest.raises(TokenError, match="is empty"):
        TokenSource(KafkaOAuthSettings(token_file=str(path))).token()


def test_jwt_claims_of_what_is_not_a_jwt() -> None:
    assert jwt_claims("opaque") == {}
    assert jwt_claims("a.!!!.c") == {}
    assert jwt_claims("a." + base64.urlsafe_b64encode(b"[1]").decode().rstrip("=") + ".c") == {}
    assert jwt_claims("a." + base64.urlsafe_b64encode(json.dumps({"sub": "x"}).encode()).decode() + ".c") == {"sub": "x"}


def test_each_library_takes_the_token_as_it_expects(idp: TokenEndpoint, tmp_path: Path) -> None:
    CertificateAuthority.create(tmp_path)
    kafka = KafkaSettings(bootstrap_servers="broker-0:9093", security_protocol="SASL_SSL",
                          sasl_mechanism="OAUTHBEARER", ssl_cafile=str(tmp_path / "ca.crt"),
                          oauth=KafkaOAuthSettings(token_endpoint_uri=idp.token_url, client_id="vmstream-notify",
                                                   client_secret=idp.register("vmstream-notify")))
    librdkafka = librdkafka_options(kafka)
    assert librdkafka["sasl.mechanism"] == "OAUTHBEARER" and "sasl.username" not in librdkafka
    value, _, principal, _ = librdkafka["oauth_cb"](None)
    assert jwt_claims(value)["sub"] == principal == "vmstream-notify"
    Producer(librdkafka)  # librdkafka takes every option

    aiokafka = aiokafka_options(kafka)
    assert isinstance(aiokafka["sasl_oauth_token_provider"], AiokafkaTokenProvider)
    assert asyncio.run(aiokafka["sasl_oauth_token_provider"].token()) == value  # one token per process

    credentials = faust_credentials(kafka)
    assert isinstance(credentials, faust.OAuthCredentials)
    assert isinstance(credentials.oauth_cb, AiokafkaTokenProvider) and credentials.ssl_context is not None
    assert idp.granted.count("vmstream-notify") == 1
