"""Kafka clients configured from settings: one place for bootstrap, TLS and SASL options.

Each library gets the same credentials under its own names: PLAIN or SCRAM's user and
password; a client certificate for mutual TLS (``ssl_certfile``, ``ssl_keyfile``); or, for
OAUTHBEARER, the process's :class:`~streams.common.oauth.TokenSource` wrapped as that library
expects (kafka-python's ``sasl_oauth_token_provider``, librdkafka's ``oauth_cb``).

kafka-python serves administration and the CLI's producers and consumers, librdkafka the
applier's and the worker's writes (streams/common/durable.py), the group readers of the
applier and notify (streams/common/group_reading.py) and the followers of the cluster-wide
view and the read API (streams/common/reading.py); the worker's Faust app and its own aiokafka
consumer get the same options through streams/worker/broker_credentials.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient
from kafka import KafkaProducer
from kafka.net.sasl.oauth import AbstractTokenProvider as KafkaPythonTokenProvider

from streams.common.oauth import TokenError, TokenSource, token_source
from streams.common.settings import KafkaSettings

# librdkafka's own lines (confluent-kafka's clients: durable.py, group_reading.py), as JSON lines
# held to a rate with the other Kafka clients' (streams/common/logs.py).
LIBRDKAFKA_LOG = logging.getLogger("kafka.librdkafka")


def sasl_credentials(kafka: KafkaSettings, mechanism: str, username: str, password: str) -> dict[str, Any]:
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
                               **sasl_credentials(kafka, "sasl_mechanism", "sasl_plain_username", "sasl_plain_password")}
    if kafka.tls:
        options.update({"ssl_cafile": kafka.ssl_cafile, "ssl_certfile": kafka.ssl_certfile,
                        "ssl_keyfile": kafka.ssl_keyfile,
                        "ssl_password": kafka.ssl_key_password.get_secret_value() if kafka.ssl_key_password else None})
    source = oauth(kafka)
    if source is not None:
        options["sasl_oauth_token_provider"] = KafkaPythonTokens(source)
    return {key: value for key, value in options.items() if value is not None}


# The longest an administrative request is waited for: a broker that has not answered by then
# is a failed request, not a hang.
ADMIN_SECONDS = 30.0


def admin_client(kafka: KafkaSettings, *, client_id: str = "vmstream-admin") -> AdminClient:
    """librdkafka's administration client. It has nothing to close: it goes with its last
    reference, and cancels the requests still waited for then — hold it until their answers."""
    return AdminClient({**librdkafka_options(kafka), "client.id": client_id}, logger=LIBRDKAFKA_LOG)


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


def consumer(kafka: KafkaSettings, *, client_id: str = "vmstream-cli", **extra: Any) -> Consumer:
    """A consumer that is assigned partitions and commits nothing (streams/common/reading.py);
    the members of a group are streams/common/group_reading.py's. It reports the end of each
    partition it reaches (``enable.partition.eof``), and reads only committed transactions."""
    return Consumer({
        **librdkafka_options(kafka),
        # librdkafka wants a group id even for a consumer that never joins one: it commits nothing.
        "group.id": client_id,
        "client.id": client_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "isolation.level": "read_committed",
        **extra,
    }, logger=LIBRDKAFKA_LOG)


def librdkafka_options(kafka: KafkaSettings) -> dict[str, Any]:
    """The same options for a librdkafka client (confluent-kafka: streams/common/durable.py)."""
    options: dict[str, Any] = {"bootstrap.servers": kafka.bootstrap_servers,
                               "security.protocol": kafka.security_protocol.lower(),
                               **sasl_credentials(kafka, "sasl.mechanism", "sasl.username", "sasl.password")}
    if kafka.tls:
        options.update({"ssl.ca.location": kafka.ssl_cafile, "ssl.certificate.location": kafka.ssl_certfile,
                        "ssl.key.location": kafka.ssl_keyfile,
                        "ssl.key.password": kafka.ssl_key_password.get_secret_value() if kafka.ssl_key_password
                        else None})
    source = oauth(kafka)
    if source is not None:
        options["oauth_cb"] = librdkafka_tokens(source)
    return {key: value for key, value in options.items() if value is not None}
