"""Kafka clients configured from settings: one place for bootstrap, TLS and SASL options.

kafka-python serves administration and the CLI's producers and consumers, librdkafka the
applier's and the worker's writes (streams/common/durable.py) and the group readers of the
applier and notify (streams/common/group_reading.py); the worker's Faust app gets the same
options through streams/worker/broker_credentials.py.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from streams.common.settings import KafkaSettings

# librdkafka's own lines (confluent-kafka's clients: durable.py, group_reading.py), as JSON lines
# held to a rate with the other Kafka clients' (streams/common/logs.py).
LIBRDKAFKA_LOG = logging.getLogger("kafka.librdkafka")


def _credentials(kafka: KafkaSettings, mechanism: str, username: str, password: str,
                 cafile: str | None) -> dict[str, Any]:
    """The SASL and TLS settings under a client's own names for them (``cafile`` None: the
    client takes its CA another way)."""
    options: dict[str, Any] = {}
    if kafka.sasl_mechanism:
        options[mechanism] = kafka.sasl_mechanism
        options[username] = kafka.sasl_username
        options[password] = kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
    if kafka.ssl_cafile and cafile is not None:
        options[cafile] = kafka.ssl_cafile
    return options


def client_options(kafka: KafkaSettings) -> dict[str, Any]:
    """The options of a kafka-python client."""
    return {"bootstrap_servers": kafka.bootstrap_servers.split(","), "security_protocol": kafka.security_protocol,
            **_credentials(kafka, "sasl_mechanism", "sasl_plain_username", "sasl_plain_password", "ssl_cafile")}


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


def aiokafka_options(kafka: KafkaSettings) -> dict[str, Any]:
    """The same options for an aiokafka client of the worker's own (not made by Faust)."""
    options: dict[str, Any] = {"security_protocol": kafka.security_protocol,
                               **_credentials(kafka, "sasl_mechanism", "sasl_plain_username", "sasl_plain_password", None)}
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = ssl.create_default_context(cafile=kafka.ssl_cafile)
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
    return {"bootstrap.servers": kafka.bootstrap_servers, "security.protocol": kafka.security_protocol.lower(),
            **_credentials(kafka, "sasl.mechanism", "sasl.username", "sasl.password", "ssl.ca.location")}
