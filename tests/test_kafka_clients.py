"""The broker settings reach every client under that client's own names: kafka-python's and
librdkafka's (the applier's outputs). librdkafka checks its configuration when a client is
made, so an option it does not know, or a value it does not take, fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import Producer
from pydantic import SecretStr

from harness.pki import CertificateAuthority
from streams.common.kafka_clients import client_options, librdkafka_options
from streams.common.settings import KafkaSettings



@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"])
def test_librdkafka_takes_every_security_setting(protocol: str, tmp_path: Path) -> None:
    CertificateAuthority.create(tmp_path)  # a CA file librdkafka can read: it loads it at once
    cafile = tmp_path / "ca.crt"
    sasl = protocol.startswith("SASL")
    settings = KafkaSettings(bootstrap_servers="broker-0:9093,broker-1:9093", security_protocol=protocol,  # type: ignore[arg-type]
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
    kafka_python = client_options(settings)  # the same settings, kafka-python's names
    assert kafka_python.get("sasl_plain_password") == expected.get("sasl.password")
    assert kafka_python.get("ssl_cafile") == options.get("ssl.ca.location")
