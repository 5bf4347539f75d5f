"""The broker settings reach every client under that client's own names: librdkafka's (every
process's) and aiokafka's (the worker's, Faust's). librdkafka checks its configuration when a client is
made, so an option it does not know, or a value it does not take, fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import Producer
from pydantic import SecretStr

from harness.pki import CertificateAuthority
from streams.common.kafka_clients import librdkafka_options
from streams.common.settings import KafkaSettings



@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"])
def test_librdkafka_takes_every_security_setting(protocol: str, tmp_path: Path) -> None:
    CertificateAuthority.create(tmp_path)  # a CA file librdkafka can read: it loads it at once
    cafile = tmp_path / "ca.crt"
    sasl = protocol.startswith("SASL")
    settings = KafkaSettings(bootstrap_servers="broker-0:9093,broker-1:9093", security_protocol=protocol,
                             sasl_mechanism="SCRAM-SHA-512" if sasl else None,
                             sasl_username="vmstream-apply" if sasl else None,
                             sasl_password=SecretStr("s3cret") if sasl else None,
                             ssl_cafile=str(cafile) if "SSL" in protocol else None)
    options = librdkafka_options(settings)
    Producer(options)  # raises KafkaException on an unknown option or value
    assert options["bootstrap.servers"] == "broker-0:9093,broker-1:9093"
    assert options["security.protocol"] == protocol.lower()
    expected = ({"sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "vmstream-apply", "sasl.password": "s3cret"}
                if sasl else {})
    assert {k: v for k, v in options.items() if k.startswith("sasl.")} == expected
    assert options.get("ssl.ca.location") == (str(cafile) if "SSL" in protocol else None)


@pytest.mark.parametrize("protocol", ["SSL", "SASL_SSL"])
def test_every_library_presents_the_client_certificate(protocol: str, tmp_path: Path) -> None:
    """Mutual TLS: a Strimzi ``type: tls`` KafkaUser's user.crt and user.key, under each
    library's names (librdkafka loads both when the client is made: a pair that does not
    match fails here)."""
    import faust

    from streams.worker.broker_credentials import aiokafka_options, faust_credentials

    authority = CertificateAuthority.create(tmp_path)
    certfile, keyfile = authority.issue(tmp_path, "user", "vmstream-apply")
    sasl = protocol == "SASL_SSL"
    settings = KafkaSettings(bootstrap_servers="broker-0:9093", security_protocol=protocol,
                             ssl_cafile=str(tmp_path / "ca.crt"), ssl_certfile=str(certfile), ssl_keyfile=str(keyfile),
                             sasl_mechanism="SCRAM-SHA-512" if sasl else None, sasl_username="vmstream-apply",
                             sasl_password=SecretStr("s3cret"))
    options = librdkafka_options(settings)
    Producer(options)
    assert (options["ssl.certificate.location"], options["ssl.key.location"]) == (str(certfile), str(keyfile))
    assert ("sasl.username" in options) is sasl  # read only where SASL is the protocol
    assert options["ssl.ca.location"] == str(tmp_path / "ca.crt")
    assert aiokafka_options(settings)["ssl_context"] is not None  # the pair loaded into it
    credentials = faust_credentials(settings)
    assert isinstance(credentials, faust.SASLCredentials if sasl else faust.SSLCredentials)
