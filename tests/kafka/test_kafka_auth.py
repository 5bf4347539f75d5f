"""The Kafka authentication Strimzi runs, each on a local broker that requires it
(harness/localkafka.py): mutual TLS (``Tls``: an ``SSL`` listener with
``ssl.client.auth=required``, a Strimzi ``type: tls`` KafkaUser's certificate) and SASL
OAUTHBEARER (``OAuthBearer``: Kafka's JWT validator against the JWKS of
harness/localoauth.py's token endpoint, which grants tokens by the client credentials grant,
as a Strimzi ``type: oauth`` listener) over SASL_PLAINTEXT and over SASL_SSL.

For each, every client library vmstream uses produces and consumes through vmstream's own
factories (streams/common/kafka_clients.py): librdkafka (the durable producer, the readers
and the group reader) and the worker's aiokafka; Faust through a real ``vmstream worker``;
``vmstream tail`` as a real process. A client without credentials, or with credentials the broker does not trust,
is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition as AsyncTopicPartition
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import NewTopic

from harness.localkafka import LocalKafka, OAuthBearer, Tls
from harness.localoauth import TokenEndpoint
from harness.processes import free_ports
from streams.common.durable import Delivered, DurableProducer, Record
from streams.common.group_reading import GroupReader
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client, consumer, librdkafka_options
from streams.common.reading import partitions_of, read_to_end
from streams.common.settings import KafkaSettings
from streams.common.topics import ensure_topics
from streams.worker.broker_credentials import aiokafka_options
from tests.support.waiting import audit_of_intent, stop

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
MODES = ("mtls", "oauth", "oauth-ssl")
DEADLINE = 60.0


@dataclass
class Secured:
    """A broker that requires one kind of authentication, and how a principal reaches it."""

    mode: str
    broker: LocalKafka
    tls: Tls | None
    idp: TokenEndpoint | None
    prefix: str

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap_servers

    def settings(self, principal: str, **oauth: Any) -> KafkaSettings:
        """A vmstream process's ``kafka`` settings as ``principal``: its client certificate,
        or its OAuth client (registered at the token endpoint; ``oauth`` overrides)."""
        common: dict[str, Any] = {"bootstrap_servers": self.bootstrap, "topic_prefix": self.prefix, "partitions": 1}
        if self.mode == "mtls":
            assert self.tls is not None
            user = self.tls.client(principal)
            return KafkaSettings(**common, security_protocol="SSL", ssl_cafile=str(user.cafile),
                                 ssl_certfile=str(user.certfile), ssl_keyfile=str(user.keyfile))
        assert self.idp is not None
        secret = self.idp.register(principal)
        section = {"token_endpoint_uri": self.idp.token_url, "client_id": principal, "client_secret": secret, **oauth}
        if self.tls is not None:
            return KafkaSettings(**common, security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER",
                                 ssl_cafile=str(self.tls.cafile), oauth=section)
        return KafkaSettings(**common, security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER", oauth=section)

    def environment(self, kafka: KafkaSettings) -> dict[str, str]:
        """``kafka`` as the VMSTREAM_KAFKA__* variables a Deployment sets."""
        env = {"VMSTREAM_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
               "VMSTREAM_KAFKA__TOPIC_PREFIX": kafka.topic_prefix, "VMSTREAM_KAFKA__PARTITIONS": "1",
               "VMSTREAM_KAFKA__SECURITY_PROTOCOL": kafka.security_protocol}
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "sasl_mechanism"):
            if getattr(kafka, name):
                env[f"VMSTREAM_KAFKA__{name.upper()}"] = getattr(kafka, name)
        oauth = kafka.oauth
        for name in ("token_endpoint_uri", "client_id", "token_file"):
            if getattr(oauth, name):
                env[f"VMSTREAM_KAFKA__OAUTH__{name.upper()}"] = getattr(oauth, name)
        if oauth.client_secret:
            env["VMSTREAM_KAFKA__OAUTH__CLIENT_SECRET"] = oauth.client_secret.get_secret_value()
        return env

    def topic(self, kafka: KafkaSettings) -> str:
        """A new topic of one partition, made with vmstream's admin client as ``kafka``."""
        name = f"{self.prefix}auth-{uuid.uuid4().hex[:8]}"
        admin = admin_client(kafka)
        admin.create_topics([NewTopic(name, 1, 1)], operation_timeout=ADMIN_SECONDS)[name].result()
        return name


@pytest.fixture(scope="module")
def idp() -> Iterator[TokenEndpoint]:
    with TokenEndpoint() as endpoint:
        yield endpoint


@pytest.fixture(scope="module", params=MODES)
def secured(request: pytest.FixtureRequest, idp: TokenEndpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    mode: str = request.param
    tls = Tls.create(tmp_path_factory.mktemp(f"tls-{mode}")) if mode in ("mtls", "oauth-ssl") else None
    oauth = None
    if mode.startswith("oauth"):
        broker_client = f"kafka-broker-{mode}"
        oauth = OAuthBearer(token_url=idp.token_url, jwks_url=idp.jwks_url, issuer=idp.issuer,
                            audience=idp.audience, client_id=broker_client, client_secret=idp.register(broker_client))
    with LocalKafka(tls=tls, oauth=oauth) as broker:
        yield Secured(mode, broker, tls, idp if oauth else None, f"t{uuid.uuid4().hex[:6]}.")


def only(*modes: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("secured", modes, indirect=True)


# ----------------------------------------------------------------- each client library


def test_a_reader_reads_what_the_durable_producer_wrote(secured: Secured) -> None:
    kafka = secured.settings("vmstream-watch")
    topic = secured.topic(kafka)
    [written] = send(kafka, Record(topic, b"k", secured.mode.encode()))
    reader = consumer(kafka, client_id="auth-test")
    try:
        [record] = read_to_end(reader, partitions_of(reader, [topic]), stall=DEADLINE)
    finally:
        reader.close()
    assert (record.offset, record.key, record.value) == (written.offset, b"k", secured.mode.encode())


def send(kafka: KafkaSettings, *records: Record) -> list[Delivered]:
    writer = DurableProducer(kafka, client_id="auth-test", timeout=30)
    try:
        return writer.send_all(records)
    finally:
        writer.close()


async def test_aiokafka_produces_and_consumes(secured: Secured) -> None:
    kafka = secured.settings("vmstream-api")
    topic = await asyncio.to_thread(secured.topic, kafka)
    writer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all", enable_idempotence=True,
                              **aiokafka_options(kafka))
    await writer.start()
    try:
        await writer.send_and_wait(topic, key=b"k", value=b"from aiokafka")
    finally:
        await writer.stop()
    reader = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id=None, enable_auto_commit=False,
                              **aiokafka_options(kafka))
    await reader.start()
    try:
        partition = AsyncTopicPartition(topic, 0)
        reader.assign([partition])
        await reader.seek_to_beginning(partition)
        record = await asyncio.wait_for(reader.getone(), DEADLINE)
    finally:
        await reader.stop()
    assert (record.key, record.value) == (b"k", b"from aiokafka")


def test_librdkafka_produces_and_consumes(secured: Secured) -> None:
    """The applier's and the worker's durable producer, the applier's and notify's group reader."""
    kafka = secured.settings("vmstream-apply")
    topic = secured.topic(kafka)
    writer = DurableProducer(kafka, client_id="auth-test", timeout=DEADLINE)
    try:
        [delivered] = writer.send_all([Record(topic=topic, key=b"k", value=b"from librdkafka")])
    finally:
        writer.close()
    reader = GroupReader(kafka, group_id=f"auth-{uuid.uuid4().hex[:6]}", client_id="auth-test", topic=topic)
    try:
        deadline = time.monotonic() + DEADLINE
        received: list[Any] = []
        while not received:
            assert time.monotonic() < deadline, "nothing read back"
            received = [r for records in reader.poll(1.0, 10).values() for r in records]
    finally:
        reader.close()
    assert [(r.offset, r.key, r.value) for r in received] == [(delivered.offset, b"k", b"from librdkafka")]
    if secured.idp is not None:  # the principal asked for its own token
        assert "vmstream-apply" in secured.idp.granted


# ----------------------------------------------------------------- refused


def _librdkafka_refused(secured: Secured, options: dict[str, Any], topic: str) -> str:
    """The first error librdkafka reports: the connection refused (nothing waits for the
    message's own timeout)."""
    failures: list[Any] = []
    writer = Producer({"bootstrap.servers": secured.bootstrap, "message.timeout.ms": 5000, **options,
                       "error_cb": failures.append, "logger": _Discard()})
    writer.produce(topic, b"anonymous")
    deadline = time.monotonic() + DEADLINE
    while not failures:
        assert time.monotonic() < deadline, "librdkafka neither wrote nor was refused"
        writer.poll(0.1)
    writer.purge()
    writer.flush(5)
    return str(failures[0])


class _Discard:
    """A logger for librdkafka's complaints about the refused connections (expected here)."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass


def _end_offset(kafka: KafkaSettings, topic: str) -> int:
    reader = consumer(kafka, client_id="auth-test")
    try:
        _, end = reader.get_watermark_offsets(TopicPartition(topic, 0), timeout=DEADLINE)
        return int(end)
    finally:
        reader.close()


async def _aiokafka_refused(kafka: KafkaSettings, options: dict[str, Any]) -> None:
    writer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, request_timeout_ms=10000, **options)
    with pytest.raises(Exception):  # noqa: B017, PT011 (a TLS alert or an authentication error)
        try:
            await writer.start()
        finally:
            await writer.stop()


def test_a_client_without_credentials_is_refused(secured: Secured) -> None:
    kafka = secured.settings("vmstream-notify")
    topic = secured.topic(kafka)
    before = _end_offset(kafka, topic)
    if secured.mode == "mtls":
        assert secured.tls is not None
        # TLS and the CA, no certificate of its own.
        assert "certificate" in _librdkafka_refused(
            secured, {"security.protocol": "ssl", "ssl.ca.location": str(secured.tls.cafile)}, topic)
        anonymous = kafka.model_copy(update={"ssl_certfile": None, "ssl_keyfile": None})
    else:
        # No SASL at all, on the listener that wants it.
        protocol = "SSL" if secured.tls else "PLAINTEXT"
        _librdkafka_refused(secured, {"security.protocol": protocol.lower(),
                                      **({"ssl.ca.location": str(secured.tls.cafile)} if secured.tls else {})}, topic)
        anonymous = kafka.model_copy(update={"security_protocol": protocol, "sasl_mechanism": None,
                                             "oauth": type(kafka.oauth)()})
    asyncio.run(_aiokafka_refused(anonymous, aiokafka_options(anonymous)))
    assert _end_offset(kafka, topic) == before


@only("mtls")
def test_a_certificate_of_another_ca_is_refused(secured: Secured, tmp_path: Path) -> None:
    kafka = secured.settings("vmstream-worker")
    topic = secured.topic(kafka)
    stranger = Tls.create(tmp_path / "elsewhere").client("vmstream-worker")  # same name, another CA
    assert secured.tls is not None
    assert "certificate" in _librdkafka_refused(
        secured, {"security.protocol": "ssl", "ssl.ca.location": str(secured.tls.cafile),
                  "ssl.certificate.location": str(stranger.certfile), "ssl.key.location": str(stranger.keyfile)},
        topic)


@only("oauth")
def test_a_token_the_broker_did_not_issue_is_refused(secured: Secured, tmp_path: Path) -> None:
    """A token file: one minted by the token endpoint is taken; one signed by another key,
    or for another audience, is refused by the broker's validator."""
    assert secured.idp is not None
    kafka = secured.settings("vmstream-watch")
    topic = secured.topic(kafka)
    good, forged, elsewhere = tmp_path / "good", tmp_path / "forged", tmp_path / "elsewhere"
    good.write_text(secured.idp.mint("vmstream-watch"))
    with TokenEndpoint() as other:
        forged.write_text(other.mint("vmstream-watch"))
    elsewhere.write_text(secured.idp.mint("vmstream-watch", audience="not-kafka"))

    def from_file(path: Path) -> KafkaSettings:
        return kafka.model_copy(update={"oauth": type(kafka.oauth)(token_file=str(path))})

    send(from_file(good), Record(topic, None, b"with a token file"))
    before = _end_offset(kafka, topic)
    for path in (forged, elsewhere):
        refusal = _librdkafka_refused(secured, librdkafka_options(from_file(path)), topic)
        assert "SASL authentication error" in refusal, refusal
    assert _end_offset(kafka, topic) == before


# ----------------------------------------------------------------- vmstream processes


def _run(env: dict[str, str], *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streams.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **env})


def test_vmstream_tail_reads_as_its_principal(secured: Secured) -> None:
    kafka = secured.settings("vmstream-tail")
    topic = secured.topic(kafka)
    send(kafka, Record(topic, b"k", json.dumps({"mode": secured.mode}).encode()))
    tailed = _run(secured.environment(kafka), "tail", topic, "--from-beginning", "--json", "--timeout", "60")
    assert tailed.returncode == 0, tailed.stderr[-3000:]
    [line] = tailed.stdout.splitlines()
    assert json.loads(line)["value"] == {"mode": secured.mode}


def test_vmstream_tail_without_credentials_exits_4(secured: Secured, tmp_path: Path) -> None:
    kafka = secured.settings("vmstream-tail")
    env = secured.environment(kafka)
    if secured.mode == "mtls":
        del env["VMSTREAM_KAFKA__SSL_CERTFILE"], env["VMSTREAM_KAFKA__SSL_KEYFILE"]
        expected = "no Kafka broker answers"
    else:
        env["VMSTREAM_KAFKA__OAUTH__CLIENT_SECRET"] = "wrong"
        expected = "refused client 'vmstream-tail': 401 invalid_client"
    tailed = _run(env, "tail", "audit", "--timeout", "10")
    assert tailed.returncode == 4, (tailed.stdout, tailed.stderr[-3000:])
    assert expected in tailed.stderr and len(tailed.stderr.strip().splitlines()) == 1, tailed.stderr


@only("mtls", "oauth")
def test_the_worker_does_its_job_as_its_principal(secured: Secured, tmp_path: Path) -> None:
    """``vmstream worker`` (Faust and aiokafka, librdkafka's durable producer and admin
    client) with only its own credentials: it creates its topics, reads an intent and
    writes its audit record."""
    kafka = secured.settings("vmstream-worker")
    app_id = f"auth-{uuid.uuid4().hex[:6]}"
    [web_port] = free_ports(1)
    env = {
        **os.environ, "PYTHONUNBUFFERED": "1", **secured.environment(kafka),
        "VMSTREAM_WORKER__APP_ID": app_id,
        "VMSTREAM_WORKER__WEB_PORT": str(web_port),
        "VMSTREAM_AUTH__MODE": "none",  # intents at their word: this test is about Kafka
    }
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "streams.cli.main", "worker", "--config", str(ROOT / "examples/config.yaml")],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        portal_settings = secured.settings("upstream-portal")
        ensure_topics(portal_settings)  # the intents topic, as the platform would have it
        intent_id = f"it-auth-{uuid.uuid4().hex[:8]}"
        intent = {"intent_id": intent_id, "type": "set_gpu", "requested_by": "alice@example.com",
                  "project": "proj-a", "spec": {"namespace": "spx-proj-a", "name": "nowhere",
                                                "gpu_class": "nvidia-a100"}}
        send(portal_settings, Record(kafka.topic("intents"), b"vm/spx-proj-a/nowhere", json.dumps(intent).encode()))
        reader = consumer(secured.settings("auditor"), client_id="auth-test")
        audits = audit_of_intent(reader, kafka.topic("audit"), intent_id, process, log_path)
        assert audits[0]["outcome"] in ("accepted", "rejected"), audits
    finally:
        stop(process, grace=60)
    assert process.returncode == 0, log_path.read_text(errors="replace")[-4000:]
    if secured.idp is not None:
        assert "vmstream-worker" in secured.idp.granted
