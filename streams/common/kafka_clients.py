"""Kafka clients configured from settings: one place for bootstrap, TLS and SASL options.

Each library gets the same credentials under its own names: PLAIN or SCRAM's user and
password; a client certificate for mutual TLS (``ssl_certfile``, ``ssl_keyfile``); or, for
OAUTHBEARER, the process's :class:`~streams.common.oauth.TokenSource` wrapped as that library
expects (librdkafka's ``oauth_cb``, aiokafka's ``sasl_oauth_token_provider``).

librdkafka (confluent-kafka) is every process's client: administration here, every write
(streams/common/durable.py), the members of a group (streams/common/group_reading.py) and
the readers that are assigned their partitions (streams/common/reading.py). It does the work
in C, on threads of its own, outside the GIL: producing with ``acks=all`` costs the applier a
small fraction of the CPU per command that kafka-python's producer did. Only the worker's
Faust app, and its route stage's consumer, are on aiokafka, the library Faust is built on:
they get the same options through streams/worker/broker_credentials.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

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


# The longest an administrative request is waited for: a broker that has not answered by then
# is a failed request, not a hang.
ADMIN_SECONDS = 30.0


def admin_client(kafka: KafkaSettings, *, client_id: str = "vmstream-admin") -> AdminClient:
    """librdkafka's administration client. It has nothing to close: it goes with its last
    reference, and cancels the requests still waited for then — hold it until their answers."""
    return AdminClient({**librdkafka_options(kafka), "client.id": client_id}, logger=LIBRDKAFKA_LOG)


# Compression for producers whose messages can be large (whole Kubernetes objects): gzip, the
# codec every client reads with the standard library alone (aiokafka, for Faust, too); lz4,
# snappy and zstd need native packages there.
COMPRESSION = "gzip"


def consumer(kafka: KafkaSettings, *, client_id: str = "vmstream-cli", group_id: str | None = None,
             config: dict[str, Any] | None = None) -> Consumer:
    """A consumer that is assigned partitions and commits nothing (streams/common/reading.py);
    the members of a group are streams/common/group_reading.py's. It reports the end of each
    partition it reaches (``enable.partition.eof``), and reads only committed transactions.

    librdkafka wants a group id even for a consumer that never joins one, and looks for its
    coordinator: a process that is a member of a group names that one (``group_id``), which
    its principal may describe; the group is neither joined nor committed to.

    Where librdkafka cannot start at the offset asked for (out of range; or the query for
    the first offset failed, as it does while a new topic's leader moves) it starts at the
    first record there is, not at the end: a reader reading to the end would take a
    partition started at its end as read, its records skipped."""
    return Consumer({
        **librdkafka_options(kafka),
        "group.id": group_id or client_id,
        "client.id": client_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        **(config or {}),  # librdkafka's own names
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
