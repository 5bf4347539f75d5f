"""The worker's aiokafka clients — Faust's, and the route stage's own consumer — configured
from the same Kafka settings every other client reads (streams/common/kafka_clients.py):
here because only the worker runs on aiokafka, the library Faust is built on."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import faust
from aiokafka.abc import AbstractTokenProvider

from streams.common.kafka_clients import oauth, sasl_credentials
from streams.common.oauth import TokenSource
from streams.common.settings import KafkaSettings


class AiokafkaTokens(AbstractTokenProvider):  # type: ignore[misc]
    """aiokafka's (and so Faust's) ``sasl_oauth_token_provider``: awaited at each connection's
    authentication; a token to fetch is fetched in a thread, off the event loop."""

    def __init__(self, source: TokenSource) -> None:
        self.source = source

    async def token(self) -> str:
        token = await asyncio.get_running_loop().run_in_executor(None, self.source.token)
        return token.value


def ssl_context(kafka: KafkaSettings) -> ssl.SSLContext | None:
    """The TLS context of the asyncio clients (aiokafka, Faust): the brokers verified with
    ``ssl_cafile`` (else the system's CAs), and the client certificate presented if set."""
    if not kafka.tls:
        return None
    context = ssl.create_default_context(cafile=kafka.ssl_cafile)
    if kafka.ssl_certfile:
        context.load_cert_chain(kafka.ssl_certfile, kafka.ssl_keyfile,
                                kafka.ssl_key_password.get_secret_value() if kafka.ssl_key_password else None)
    return context


def aiokafka_options(kafka: KafkaSettings) -> dict[str, Any]:
    """The options of an aiokafka client of the worker's own (not made by Faust)."""
    options: dict[str, Any] = {"security_protocol": kafka.security_protocol,
                               **sasl_credentials(kafka, "sasl_mechanism", "sasl_plain_username", "sasl_plain_password")}
    context = ssl_context(kafka)
    if context is not None:
        options["ssl_context"] = context
    source = oauth(kafka)
    if source is not None:
        options["sasl_oauth_token_provider"] = AiokafkaTokens(source)
    return options


def pace_fetches(consumer: Any, *, min_bytes: int, max_wait_ms: int) -> None:
    """Set an aiokafka consumer's next fetches' ``fetch_min_bytes`` and ``fetch_max_wait_ms``:
    its fetcher reads both for each fetch it builds (aiokafka 0.14), so the pace can follow
    what the consumer is doing (the worker's, streams/worker/faustfixes.py and routing.py)."""
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is not None:
        fetcher._fetch_min_bytes = min_bytes
        fetcher._fetch_max_wait_ms = max_wait_ms


def faust_credentials(kafka: KafkaSettings) -> Any:
    """Faust's ``broker_credentials`` for the configured security protocol, or None: SCRAM or
    PLAIN's user and password, OAUTHBEARER's token provider, a TLS context (with the client
    certificate for mutual TLS)."""
    context = ssl_context(kafka)
    source = oauth(kafka)
    if source is not None:
        return faust.OAuthCredentials(oauth_cb=AiokafkaTokens(source), ssl_context=context)
    if kafka.sasl and kafka.sasl_mechanism:
        return faust.SASLCredentials(
            username=kafka.sasl_username,
            password=kafka.sasl_password.get_secret_value() if kafka.sasl_password else None,
            mechanism=kafka.sasl_mechanism,
            ssl_context=context,
        )
    if context is not None:
        return faust.SSLCredentials(context)
    return None
