"""Kafka credentials that cannot work are said at start, in one line, with exit 2: a client
certificate or key file that is missing, a certificate and a key that are not a pair, a CA
or token file that is missing, OAUTHBEARER without a way to a token, credentials that do not
fit the protocol. No broker is needed: the check comes before any connection."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from harness.pki import CertificateAuthority
from streams.common.errors import EXIT_USAGE, ConfigError
from streams.common.startup import load_config, load_kafka_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and two client certificates, as two Strimzi KafkaUsers' Secrets would hold them."""
    directory = tmp_path_factory.mktemp("pki")
    authority = CertificateAuthority.create(directory)
    authority.issue(directory, "alice", "alice")
    authority.issue(directory, "bob", "bob")
    return directory


def write(tmp_path: Path, kafka: Mapping[str, object]) -> Path:
    """examples/config.yaml with this ``kafka`` section."""
    example = yaml.safe_load((ROOT / "examples" / "config.yaml").read_text(encoding="utf-8"))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**example, "kafka": kafka}))
    return path


def mtls(pki: Path, **changes: object) -> dict[str, object]:
    return {"security_protocol": "SSL", "ssl_cafile": str(pki / "ca.crt"), "ssl_certfile": str(pki / "alice.crt"),
            "ssl_keyfile": str(pki / "alice.key"), **changes}


def oauth(**changes: object) -> dict[str, object]:
    return {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER",
            "oauth": {"token_endpoint_uri": "https://sso.example.com/token", "client_id": "vmstream-worker",
                      "client_secret": "s3cret", **changes}}


def refused(path: Path) -> str:
    """The line of both loaders (the processes' and the clients'), which must agree."""
    lines = []
    for load in (load_config, load_kafka_config):
        with pytest.raises(ConfigError) as raised:
            load(argparse.Namespace(config=str(path)))
        assert raised.value.exit_code == EXIT_USAGE
        lines.append(raised.value.line("worker"))
    assert lines[0] == lines[1]
    return lines[0]


def test_good_credentials_load(pki: Path, tmp_path: Path) -> None:
    for kafka in (mtls(pki), oauth(), {**oauth(), "ssl_cafile": str(pki / "ca.crt")}):
        loaded = load_config(argparse.Namespace(config=str(write(tmp_path, kafka)))).kafka
        assert loaded.security_protocol == kafka["security_protocol"]


@pytest.mark.parametrize(("setting", "file"), [("ssl_certfile", "gone.crt"), ("ssl_keyfile", "gone.key"),
                                               ("ssl_cafile", "gone-ca.crt")])
def test_a_missing_file_is_named(pki: Path, tmp_path: Path, setting: str, file: str) -> None:
    line = refused(write(tmp_path, mtls(pki, **{setting: str(tmp_path / file)})))
    assert f"kafka.{setting}: {tmp_path / file}: No such file or directory" in line


def test_a_certificate_and_a_key_that_are_not_a_pair(pki: Path, tmp_path: Path) -> None:
    line = refused(write(tmp_path, mtls(pki, ssl_keyfile=str(pki / "bob.key"))))
    assert "are not a certificate and its key" in line and "user.crt and user.key" in line


def test_a_key_that_is_not_pem(pki: Path, tmp_path: Path) -> None:
    junk = tmp_path / "user.key"
    junk.write_text("not a key\n")
    assert "are not a certificate and its key" in refused(write(tmp_path, mtls(pki, ssl_keyfile=str(junk))))


@pytest.mark.parametrize(("kafka", "says"), [
    ({"security_protocol": "PLAINTEXT", "ssl_certfile": "/x/user.crt", "ssl_keyfile": "/x/user.key"},
     "kafka: a client certificate (ssl_certfile, ssl_keyfile) needs security_protocol SSL or SASL_SSL, not PLAINTEXT"),
    ({"security_protocol": "SSL", "ssl_certfile": "/x/user.crt"},
     "kafka: ssl_certfile is set but ssl_keyfile is not: a client certificate needs both"),
    (oauth(client_secret=None), "oauth.client_secret not set"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"},
     "oauth.token_endpoint_uri, oauth.client_id, oauth.client_secret not set"),
    (oauth(token_file="/run/token"), "oauth.token_file and oauth.token_endpoint_uri are both set"),
    ({**oauth(), "sasl_mechanism": "SCRAM-SHA-512"}, "oauth is set but sasl_mechanism is SCRAM-SHA-512"),
], ids=["cert-without-tls", "cert-without-key", "no-secret", "no-oauth", "file-and-endpoint", "oauth-not-chosen"])
def test_credentials_that_do_not_fit(tmp_path: Path, kafka: Mapping[str, object], says: str) -> None:
    line = refused(write(tmp_path, kafka))
    assert says in line, line
    assert "s3cret" not in line  # the section's values are not repeated


def test_a_missing_token_file(tmp_path: Path) -> None:
    kafka = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "OAUTHBEARER",
             "oauth": {"token_file": str(tmp_path / "token")}}
    assert f"kafka.oauth.token_file: {tmp_path / 'token'}: No such file or directory" in refused(write(tmp_path, kafka))


def test_sasl_settings_are_not_read_without_sasl(pki: Path, tmp_path: Path) -> None:
    """A Deployment switched to mutual TLS by its variables keeps the file's SCRAM keys: unread."""
    kafka = {**mtls(pki), "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "vmstream-worker"}
    assert load_kafka_config(argparse.Namespace(config=str(write(tmp_path, kafka)))).sasl_mechanism


@pytest.mark.parametrize("command", [["worker"], ["apply"], ["watch"], ["tail", "audit"]])
def test_each_process_says_it_in_one_line_and_exits_2(pki: Path, tmp_path: Path, command: list[str]) -> None:
    path = write(tmp_path, mtls(pki, ssl_certfile=str(tmp_path / "user.crt")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMSTREAM_")}
    ran = subprocess.run([sys.executable, "-m", "streams.cli.main", *command, "--config", str(path)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False)
    assert ran.returncode == EXIT_USAGE, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert lines == [f"vmstream {command[0]}: kafka.ssl_certfile: {tmp_path / 'user.crt'}: No such file or "
                     "directory — fix the file or value the configuration names"], ran.stderr
