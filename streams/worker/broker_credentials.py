"""Faust's ``broker_credentials``, from the same Kafka settings every other client reads
(streams/common/kafka_clients.py): here because only the worker imports Faust."""

from __future__ import annotations

from typing import Any

import faust

from streams.common.kafka_clients import aiokafka_token_provider, oauth, ssl_context
from streams.common.settings import KafkaSettings


def faust_credentials(kafka: KafkaSettings) -> Any:
    """Faust's ``broker_credentials`` for the configured security protocol, or None: SCRAM or
    PLAIN's user and password, OAUTHBEARER's token provider, a TLS context (with the client
    certificate for mutual TLS)."""
    context = ssl_context(kafka)
    source = oauth(kafka)
    if source is not None:
        return faust.OAuthCredentials(oauth_cb=aiokafka_token_provider(source), ssl_context=context)
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
