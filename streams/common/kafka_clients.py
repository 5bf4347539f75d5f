"""Kafka clients configured from settings: one place for bootstrap, TLS and SASL options.

Each library gets the same credentials under its own names: PLAIN or SCRAM's user and
password; a client certificate for mutual TLS (``ssl_certfile``, ``ssl_keyfile``); or, for
OAUTHBEARER, the process's :class:`~streams.common.oauth.TokenSource` wrapped as that library
expects (kafka-python's and aiokafka's ``sasl_oauth_token_provider``, librdkafka's ``oauth_cb``).

kafka-python serves administration and the CLI's producers and consumers, librdkafka the
applier's and the worker's writes (streams/common/durable.py) and the group readers of the
applier and notify (streams/common/group_reading.py); the worker's Faust app gets the same
options through streams/worker/broker_credentials.py.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.net.sasl.oauth import AbstractTokenProvider as KafkaPythonTokenProvider

from streams.common.oauth import TokenError, TokenSource, token_source
from streams.common.settings import KafkaSettings

# librdkafka's own lines (confluent-kafka's clients: durable.py, group_reading.py), as JSON lines
# held to a rate with the other Kafka clients' (streams/common/logs.py).
LIBRDKAFKA_LOG = logging.getLogger("kafka.librdkafka")


def _credentials(kafka: KafkaSettings, mechanism: str, username: str, password: str) -> dict[str, Any]:
    """The SASL settings of PLAIN and SCRAM under a client's own names for them."""
    if not kafka.sasl or not kafka.sasl_mechanism:
        return {}
    options: dict[str, Any] = {mechanism: kafka.sasl_mechanism}
    if kafka.sasl_mechanism != "OAUTHBEARER":
        options[username] = kafka.sasl_username
        options[password] = kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
    return options


def oauth(kafka: KafkaSettings) -> TokenSource | None:
    """The process's token source where the clients authenticate with OAUTHBEARER."""
    return token_source(kafka.oauth) if kafka.sasl and kafka.sasl_mechanism == "OAUTHBEARER" else None


class KafkaPythonTokens(KafkaPythonTokenProvider):  # type: ignore[misc]
    """kafka-python's ``sasl_oauth_token_provider``: called, in its own thread, at each
    connection's authentication."""

    def __init__(self, source: TokenSource) -> None:
        super().__init__()
        self.source = source

    def token(self) -> str:
        return self.source.token().value


@lru_cache(maxsize=1)
def _aiokafka_tokens() -> type[Any]:
    """aiokafka's (and so Faust's) ``sasl_oauth_token_provider`` class, made on first use: the
    command-line tools, which use kafka-python alone, do not import aiokafka."""
    from aiokafka.abc import AbstractTokenProvider

    class AiokafkaTokens(AbstractTokenProvider):  # type: ignore[misc]
        """Awaited at each connection's authentication; a token to fetch is fetched in a
        thread, off the event loop."""

        def __init__(self, source: TokenSource) -> None:
            self.source = source

        async def token(self) -> str:
            token = await asyncio.get_running_loop().run_in_executor(None, self.source.token)
            return token.value

    return AiokafkaTokens


def aiokafka_token_provider(source: TokenSource) -> Any:
    """An ``aiokafka.abc.AbstractTokenProvider`` handing out ``source``'s token."""
    return _aiokafka_tokens()(source)


def librdkafka_tokens(source: TokenSource) -> Callable[[str | None], tuple[str, float, str, dict[str, str]]]:
    """confluent-kafka's ``oauth_cb``: librdkafka calls it (on its background thread) for a
    first token and again before the one it has expires; the principal is the token's subject."""

    def refresh(_config: str | None) -> tuple[str, float, str, dict[str, str]]:
        try:
            token = source.token()
        except TokenError as error:  # librdkafka tries again in a while; the reason would be lost
            LIBRDKAFKA_LOG.error("OAUTHBEARER: no token: %s", error)
            raise
        return token.value, token.expires_at, token.principal, {}

    return refresh


def client_options(kafka: KafkaSettings) -> dict[str, Any]:
    """The options of a kafka-python client."""
    options: dict[str, Any] = {"bootstrap_servers": kafka.bootstrap_servers.split(","),
                               "security_protocol": kafka.security_protocol,
                               **_credentials(kafka, "sasl_mechanism", "sasl_plain_username", "sasl_plain_password")}
    if kafka.tls:
        options.update({"ssl_cafile": kafka.ssl_cafile, "ssl_certfile": kafka.ssl_certfile,
                        "ssl_keyfile": kafka.ssl_keyfile,
                        "ssl_password": kafka.ssl_key_password.get_secret_value() if kafka.ssl_key_password else None})
    source = oauth(kafka)
    if source is not None:
        options["sasl_oauth_token_provider"] = KafkaPythonTokens(source)
    return {key: value for key, value in options.items() if value is not None}


def admin_client(kafka: KafkaSettings) -> KafkaAdminClient:
    return KafkaAdminClient(client_id="vmstream-admin", **client_options(kafka))


# Compression for producers whose messages can be large (whole Kubernetes objects): gzip is
# the codec both kafka-python and aiokafka (Faust's ``producer_compression_type``) support
# with the standard library alone; lz4, snappy and zstd need native packages.
COMPRESSION = "gzip"


def producer(
    kafka: KafkaSettings, *, client_id: str = "vmstream-cli", compression: str | None = None, **extra: Any
) -> KafkaProducer:
    """An idempotent producer: a retried send never writes a message twice.

    ``compression`` (e.g. :data:`COMPRESSION`) compresses each batch; the broker's size limit
    then applies to the compressed batch.
    """
    return KafkaProducer(
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        compression_type=compression,
        **client_options(kafka),
        **extra,
    )


def consumer(kafka: KafkaSettings, *topics: str, **extra: Any) -> KafkaConsumer:
    return KafkaConsumer(*topics, **client_options(kafka), **extra)


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
    """The same options for an aiokafka client of the worker's own (not made by Faust)."""
    options: dict[str, Any] = {"security_protocol": kafka.security_protocol,
                               **_credentials(kafka, "sasl_mechanism", "sasl_plain_username", "sasl_plain_password")}
    context = ssl_context(kafka)
    if context is not None:
        options["ssl_context"] = context
    source = oauth(kafka)
    if source is not None:
        options["sasl_oauth_token_provider"] = aiokafka_token_provider(source)
    return options


def pace_fetches(consumer: Any, *, min_bytes: int, max_wait_ms: int) -> None:
    """Set an aiokafka consumer's next fetches' ``fetch_min_bytes`` and ``fetch_max_wait_ms``:
    its fetcher reads both for each fetch it builds (aiokafka 0.14), so the pace can follow
    what the consumer is doing (the worker's, streams/worker/faustfixes.py and routing.py)."""
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is not None:
        fetcher._fetch_min_bytes = min_bytes
        fetcher._fetch_max_wait_ms = max_wait_ms


def librdkafka_options(kafka: KafkaSettings) -> dict[str, Any]:
    """The same options for a librdkafka client (confluent-kafka: streams/common/durable.py)."""
    options: dict[str, Any] = {"bootstrap.servers": kafka.bootstrap_servers,
                               "security.protocol": kafka.security_protocol.lower(),
                               **_credentials(kafka, "sasl.mechanism", "sasl.username", "sasl.password")}
    if kafka.tls:
        options.update({"ssl.ca.location": kafka.ssl_cafile, "ssl.certificate.location": kafka.ssl_certfile,
                        "ssl.key.location": kafka.ssl_keyfile,
                        "ssl.key.password": kafka.ssl_key_password.get_secret_value() if kafka.ssl_key_password
                        else None})
    source = oauth(kafka)
    if source is not None:
        options["oauth_cb"] = librdkafka_tokens(source)
    return {key: value for key, value in options.items() if value is not None}
