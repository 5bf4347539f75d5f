"""Faust's ``broker_credentials``, from the same Kafka settings every other client reads
(streams/common/kafka_clients.py): here because only the worker imports Faust."""

from __future__ import annotations

import ssl
from typing import Any

import faust

from streams.common.settings import KafkaSettings


def faust_credentials(kafka: KafkaSettings) -> Any:
    """Faust's ``broker_credentials`` for the configured security protocol, or None."""
    context = None
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=kafka.ssl_cafile)
    if kafka.sasl_mechanism:
        return faust.SASLCredentials(
            username=kafka.sasl_username,
            password=kafka.sasl_password.get_secret_value() if kafka.sasl_password else None,
            mechanism=kafka.sasl_mechanism,
            ssl_context=context,
        )
    if context is not None:
        return faust.SSLCredentials(context)
    return None
