"""Kafka itself enforces who may write what: a broker of its own with SASL/SCRAM-SHA-512 and
KRaft's StandardAuthorizer (harness/localkafka.py, ``Sasl``), the ACLs of
streams/common/principals.py granted, and each principal trying every topic.

The produce and fetch outcomes are read from the broker's answers by this module, and the
Strimzi ``KafkaUser`` resources of deploy/components/strimzi are checked to grant the same.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from enum import Enum
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import OFFSET_BEGINNING, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import (
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)
from kubernetes import client

from handlers.contracts.messages import Command, ObjectRef
from handlers.core.state import TABLES
from harness.localkafka import LocalKafka, Sasl, sasl_options
from harness.processes import free_ports
from streams.common.codecs import encode_message
from streams.common.durable import DurableProducer, NotDelivered, Record
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client, consumer
from streams.common.principals import PRINCIPALS, acls
from streams.common.reading import poll_records
from streams.common.settings import KafkaSettings
from streams.common.signing import Keyring
from streams.common.topics import TOPICS as TOPIC_SPECS
from streams.common.topics import changelog_topic, ensure_topics
from tests.support.kube_apiserver import Kube
from tests.support.waiting import audit_of_intent, stop

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
APP_ID = "vmstream"
TOPICS = tuple(spec.name for spec in TOPIC_SPECS)  # every topic vmstream creates
STRANGER = "stranger"  # authenticated, no ACL at all
# The worker's Faust tables (streams/worker/app.py): one per rule table, and its journal.
CHANGELOGS = tuple(changelog_topic(APP_ID, f"state-{name}") for name in (*TABLES, "journal"))
SCRATCH = f"{APP_ID}-acl-scratch"  # a topic under the worker's prefix that no table reads


class SecuredBroker:
    """A broker of this module's own: SCRAM users for every principal, ACLs as specified."""

    def __init__(self, broker: LocalKafka, sasl: Sasl, prefix: str) -> None:
        self.broker = broker
        self.sasl = sasl
        self.prefix = prefix

    def settings(self, user: str, password: str | None = None) -> KafkaSettings:
        """How a process configured as ``user`` reaches the broker (kafka.sasl_* settings)."""
        secret = password if password is not None else (
            self.sasl.admin_password if user == self.sasl.admin else self.sasl.users[user])
        return KafkaSettings(bootstrap_servers=self.broker.bootstrap_servers, topic_prefix=self.prefix,
                             partitions=1, security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
                             sasl_username=user, sasl_password=secret)


@pytest.fixture(scope="module")
def secured() -> Iterator[SecuredBroker]:
    users = {name: secrets.token_urlsafe(16) for name in (*PRINCIPALS, STRANGER)}
    sasl = Sasl(admin_password=secrets.token_urlsafe(16), users=users)
    with LocalKafka(sasl=sasl) as broker:
        secured = SecuredBroker(broker, sasl, f"t{uuid.uuid4().hex[:8]}.")
        admin_settings = secured.settings(sasl.admin)
        ensure_topics(admin_settings, changelogs=(SCRATCH,))
        admin = admin_client(admin_settings)
        wanted = [acl for name, grants in PRINCIPALS.items()
                  for acl in acls(name, grants, admin_settings, app_id=APP_ID)]
        for created in admin.create_acls(wanted, request_timeout=ADMIN_SECONDS).values():
            created.result()
        # Granted once the broker lists them (one node: its authorizer has them then).
        deadline = time.monotonic() + 30
        # None matches any name, principal and host: librdkafka's filters take it, its stubs say str.
        everything = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None,  # type: ignore[arg-type]
                                      AclOperation.ANY, AclPermissionType.ANY)
        while len(admin.describe_acls(everything, request_timeout=ADMIN_SECONDS).result()) < len(wanted):
            assert time.monotonic() < deadline, "the ACLs were never listed"
            time.sleep(0.1)  # polling interval
        yield secured


def _produce(settings: KafkaSettings, topics: tuple[str, ...]) -> dict[str, bool]:
    """Whether ``settings``' principal can write a record to each topic."""
    outcome: dict[str, bool] = {}
    for topic in topics:  # a producer each: a record refused for good ends its producer
        try:
            _send(settings, Record(settings.topic(topic), b"k", b"{}"))
            outcome[topic] = True
        except NotDelivered as refused:
            assert "authorization" in str(refused).lower(), refused
            outcome[topic] = False
    return outcome


def _send(settings: KafkaSettings, *records: Record) -> None:
    producer = DurableProducer(settings, client_id="acl-test", timeout=15)
    try:
        producer.send_all(records)
    finally:
        producer.close()


def _end_offset(settings: KafkaSettings, topic: str) -> int:
    reader = consumer(settings, client_id="acl-test")
    try:
        _, end = reader.get_watermark_offsets(TopicPartition(settings.topic(topic), 0), timeout=15)
        return int(end)
    finally:
        reader.close()


def _fetch(settings: KafkaSettings, topic: str) -> bool:
    """Whether ``settings``' principal can read ``topic`` (group-less, from the start).

    Refused: the fetch answers TOPIC_AUTHORIZATION_FAILED, or — without even DESCRIBE —
    the broker's metadata does not show the topic to this principal at all.
    """
    reader = consumer(settings, client_id="acl-test")
    try:
        listed = reader.list_topics(settings.topic(topic), timeout=15).topics.get(settings.topic(topic))
        if listed is None or listed.error is not None:
            return False
        reader.assign([TopicPartition(settings.topic(topic), 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            message = reader.poll(0.5)
            if message is None:
                continue
            error = message.error()
            if error is None:
                return True
            if error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                return False
        raise AssertionError(f"nothing read from {topic} and no refusal either")
    finally:
        reader.close()


# ------------------------------------------------------------------------------ writes


@pytest.mark.parametrize("principal", [*PRINCIPALS, STRANGER])
def test_each_principal_writes_exactly_its_topics(secured: SecuredBroker, principal: str) -> None:
    wrote = _produce(secured.settings(principal), TOPICS)
    expected = set(PRINCIPALS[principal].write) if principal in PRINCIPALS else set()
    assert {topic for topic, ok in wrote.items() if ok} == expected
    assert len(wrote) == len(TOPICS)


def test_the_worker_writes_commands_the_applier_and_others_cannot(secured: SecuredBroker) -> None:
    assert _produce(secured.settings("vmstream-worker"), ("commands",)) == {"commands": True}
    for principal in ("vmstream-apply", "vmstream-watch", "vmstream-notify", "upstream-portal", STRANGER):
        assert _produce(secured.settings(principal), ("commands",)) == {"commands": False}, principal
    # ...and only the applier writes results: a forged result needs the applier's credential.
    assert _produce(secured.settings("vmstream-worker"), ("command-results",)) == {"command-results": False}
    assert _produce(secured.settings("vmstream-apply"), ("command-results",)) == {"command-results": True}


def test_only_upstream_services_write_intents(secured: SecuredBroker) -> None:
    assert _produce(secured.settings("upstream-portal"), ("intents",)) == {"intents": True}
    for principal in ("vmstream-notify", "vmstream-apply", "vmstream-watch", STRANGER):
        assert _produce(secured.settings(principal), ("intents",)) == {"intents": False}, principal


def test_a_wrong_password_is_not_a_principal_at_all(secured: SecuredBroker) -> None:
    admin = secured.settings(secured.sasl.admin)
    before = _end_offset(admin, "intents")
    failures: list[Any] = []
    forger = Producer({"bootstrap.servers": admin.bootstrap_servers, "message.timeout.ms": 10_000,
                       **sasl_options("upstream-portal", "wrong"), "error_cb": failures.append})
    forger.produce(admin.topic("intents"), b"forged")
    deadline = time.monotonic() + 60
    while not failures:
        assert time.monotonic() < deadline, "the wrong password was neither refused nor taken"
        forger.poll(0.1)
    forger.purge()
    forger.flush(5)
    assert "authentication" in str(failures[0]).lower(), failures
    assert _end_offset(admin, "intents") == before


# ------------------------------------------------------------------------------ reads


def test_reads_follow_the_table(secured: SecuredBroker) -> None:
    _produce(secured.settings(secured.sasl.admin), TOPICS)  # something to read everywhere
    assert _fetch(secured.settings("vmstream-apply"), "commands")
    assert _fetch(secured.settings("vmstream-apply"), "command-results")
    assert _fetch(secured.settings("vmstream-notify"), "notifications")
    assert _fetch(secured.settings("vmstream-worker"), "intents")
    assert not _fetch(secured.settings("vmstream-notify"), "commands")
    assert not _fetch(secured.settings("upstream-portal"), "audit")
    assert not _fetch(secured.settings(STRANGER), "intents")
    assert not _fetch(secured.settings("vmstream-watch"), "commands")
    # It writes them, so it sees them — but may not read them.
    assert not _fetch(secured.settings("vmstream-worker"), "commands")
    assert not _fetch(secured.settings("upstream-portal"), "intents")


def test_the_worker_owns_its_changelogs(secured: SecuredBroker) -> None:
    changelog = KafkaSettings(**{**secured.settings("vmstream-worker").model_dump(), "topic_prefix": ""})
    assert _produce(changelog, (SCRATCH,)) == {SCRATCH: True}
    other = KafkaSettings(**{**secured.settings("vmstream-apply").model_dump(), "topic_prefix": ""})
    assert _produce(other, (SCRATCH,)) == {SCRATCH: False}


# ------------------------------------------------------------------------------ Strimzi


def _strimzi_acls(user: dict[str, Any]) -> set[tuple[str, str, str, str]]:
    """(operation, resource type, name, pattern) of a KafkaUser, names with the default prefix."""
    found = set()
    for rule in user["spec"]["authorization"]["acls"]:
        resource = rule["resource"]
        for operation in rule["operations"]:  # kafka.strimzi.io/v1 knows no singular operation
            pattern = {"literal": "LITERAL", "prefix": "PREFIXED"}[resource.get("patternType", "literal")]
            found.add((operation.upper(), resource["type"].upper(), resource["name"], pattern))
    return found


def test_the_strimzi_users_grant_the_same(secured: SecuredBroker) -> None:
    documents = [d for d in yaml.safe_load_all((ROOT / "deploy/components/strimzi/kafkausers.yaml").read_text()) if d]
    users = {d["metadata"]["name"]: d for d in documents if d["kind"] == "KafkaUser"}
    assert set(users) == set(PRINCIPALS)
    kafka = KafkaSettings()  # the default prefix, vmstream.
    for name, grants in PRINCIPALS.items():
        assert users[name]["spec"]["authentication"]["type"] == "scram-sha-512", name
        expected = {(_name(a.operation), _name(a.restype).replace("TRANSACTIONAL_ID", "TRANSACTIONALID"),
                     a.name, _name(a.resource_pattern_type))
                    for a in acls(name, grants, kafka, app_id=APP_ID)}
        assert _strimzi_acls(users[name]) == expected, name


def test_the_strimzi_topics_are_every_topic_the_processes_use() -> None:
    """By the topic's name in Kafka: spec.topicName where the KafkaTopic's own name differs
    (Faust's assignor topic, whose underscores no Kubernetes name may hold)."""
    documents = [d for d in yaml.safe_load_all((ROOT / "deploy/components/strimzi/kafkatopics.yaml").read_text()) if d]
    kafka_topics = [d for d in documents if d["kind"] == "KafkaTopic"]
    topics = {d["spec"].get("topicName", d["metadata"]["name"]): d["spec"] for d in kafka_topics}
    assert len(topics) == len(kafka_topics)  # no topic twice
    kafka = KafkaSettings()
    changelogs = set(CHANGELOGS)
    assignor = f"{APP_ID}-__assignor-__leader"
    assert set(topics) == {kafka.topic(spec.name) for spec in TOPIC_SPECS} | changelogs | {assignor}
    for spec in TOPIC_SPECS:
        assert topics[kafka.topic(spec.name)]["config"] == spec.configs, spec.name
    assert all(topics[name]["config"] == {"cleanup.policy": "compact"} for name in changelogs)
    assert {spec["partitions"] for name, spec in topics.items() if name != assignor} == {kafka.partitions}
    assert topics[assignor]["partitions"] == 1
    # spec.topicName only where it must be: Strimzi names the topic after the KafkaTopic otherwise.
    for document in kafka_topics:
        if "topicName" in document["spec"]:
            assert document["spec"]["topicName"] != document["metadata"]["name"]


# ------------------------------------------------------------------------------ a process on its ACLs


@pytest.mark.kube
def test_the_applier_does_its_job_on_its_own_acls(secured: SecuredBroker, kube: Kube, tmp_path: Path) -> None:
    """``vmstream apply`` as ``vmstream-apply``, nothing more: it reads commands and the
    ledger, writes results and audit records, joins its group — the table suffices."""
    key = secrets.token_urlsafe(32)
    keyring = Keyring({"k1": key.encode()}, "k1")
    node = f"acl-node-{uuid.uuid4().hex[:8]}"
    with kube.api_client() as api:
        client.CoreV1Api(api).create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        own = secured.settings("vmstream-apply")
        env = {
            **os.environ, "PYTHONUNBUFFERED": "1",
            "VMSTREAM_KAFKA__BOOTSTRAP_SERVERS": own.bootstrap_servers,
            "VMSTREAM_KAFKA__TOPIC_PREFIX": own.topic_prefix,
            "VMSTREAM_KAFKA__PARTITIONS": "1",
            "VMSTREAM_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "VMSTREAM_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
            "VMSTREAM_KAFKA__SASL_USERNAME": "vmstream-apply",
            "VMSTREAM_KAFKA__SASL_PASSWORD": secured.sasl.users["vmstream-apply"],
            "VMSTREAM_KAFKA__CREATE_TOPICS": "false",
            "VMSTREAM_WORKER__APP_ID": APP_ID,
            "VMSTREAM_SIGNING__KEYS": json.dumps({"k1": key}),
            "VMSTREAM_SIGNING__KEY_ID": "k1",  # beside the example key of examples/config.yaml
        }
        log_path = tmp_path / "applier.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "streams.kube.applying", "apply", "--config", str(ROOT / "examples/config.yaml"),
                 "--kubeconfig", str(kube.kubeconfig), "--probe-port", "0"],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while "applier ready" not in log_path.read_text(errors="replace"):
                assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "the applier never got ready"
                time.sleep(0.2)  # polling interval
            cordon = Command(command_id=f"cmd-acl-{node}", type="cordon_node", target=ObjectRef(kind="Node", name=node),
                             cause="acl-test", issued_at=datetime.now(UTC), requested_by="ops@example.com")
            _send(secured.settings("vmstream-worker"),
                  Record(own.topic("commands"), f"node/{node}".encode(), encode_message(cordon, keyring=keyring)))
            reader = consumer(secured.settings(secured.sasl.admin), client_id="acl-test")
            try:
                reader.assign([TopicPartition(own.topic(topic), 0, OFFSET_BEGINNING)
                               for topic in ("command-results", "audit")])
                seen: dict[str, list[dict[str, Any]]] = {"command-results": [], "audit": []}
                while not seen["command-results"] or not seen["audit"]:
                    assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
                    assert time.monotonic() < deadline + 60, f"no result: {log_path.read_text(errors='replace')[-3000:]}"
                    for record in poll_records(reader, 0.5):
                        value = json.loads(record.value or b"{}")
                        if value.get("command_id") == cordon.command_id or \
                                (value.get("input") or {}).get("ref") == cordon.command_id:
                            seen[record.topic.removeprefix(own.topic_prefix)].append(value)
            finally:
                reader.close()
            assert [r["outcome"] for r in seen["command-results"]] == ["applied"]
            assert client.CoreV1Api(api).read_node(node).spec.unschedulable
            assert "uthoriz" not in log_path.read_text(errors="replace")  # no refusal on the way
        finally:
            stop(process)
            client.CoreV1Api(api).delete_node(node)


def test_the_worker_does_its_job_on_its_own_acls(secured: SecuredBroker, tmp_path: Path) -> None:
    """``vmstream worker`` as ``vmstream-worker``, topics made by the platform (here: the
    admin) and ``kafka.create_topics: false``: it reads an intent written by an upstream
    service, keeps its tables and writes its audit record."""
    own = secured.settings("vmstream-worker")
    leader = f"{APP_ID}-__assignor-__leader"
    admin = admin_client(secured.settings(secured.sasl.admin))
    admin.create_topics([NewTopic(leader, 1, 1)], operation_timeout=ADMIN_SECONDS)[leader].result()
    ensure_topics(secured.settings(secured.sasl.admin), changelogs=CHANGELOGS)
    [web_port] = free_ports(1)
    env = {
        **os.environ, "PYTHONUNBUFFERED": "1",
        "VMSTREAM_KAFKA__BOOTSTRAP_SERVERS": own.bootstrap_servers,
        "VMSTREAM_KAFKA__TOPIC_PREFIX": own.topic_prefix,
        "VMSTREAM_KAFKA__PARTITIONS": "1",
        "VMSTREAM_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "VMSTREAM_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
        "VMSTREAM_KAFKA__SASL_USERNAME": "vmstream-worker",
        "VMSTREAM_KAFKA__SASL_PASSWORD": secured.sasl.users["vmstream-worker"],
        "VMSTREAM_KAFKA__CREATE_TOPICS": "false",
        "VMSTREAM_WORKER__APP_ID": APP_ID,
        "VMSTREAM_WORKER__WEB_PORT": str(web_port),
        "VMSTREAM_AUTH__MODE": "none",  # intents at their word: this test is about Kafka
    }
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "streams.cli.main", "worker", "--config", str(ROOT / "examples/config.yaml")],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        intent_id = f"it-acl-{uuid.uuid4().hex[:8]}"
        intent = {"intent_id": intent_id, "type": "set_gpu", "requested_by": "alice@example.com",
                  "project": "proj-a", "spec": {"namespace": "spx-proj-a", "name": "nowhere",
                                                "gpu_class": "nvidia-a100"}}
        _send(secured.settings("upstream-portal"),
              Record(own.topic("intents"), b"vm/spx-proj-a/nowhere", json.dumps(intent).encode()))
        reader = consumer(secured.settings(secured.sasl.admin), client_id="acl-test")
        audits = audit_of_intent(reader, own.topic("audit"), intent_id, process, log_path)
        assert audits[0]["outcome"] in ("accepted", "rejected"), audits
        assert "AuthorizationFailed" not in log_path.read_text(errors="replace")
    finally:
        stop(process, grace=60)


def test_notify_does_its_job_on_its_own_acls(secured: SecuredBroker, tmp_path: Path) -> None:
    """``vmstream notify`` as ``vmstream-notify``, topics made by the platform: it reads its
    ledger back, takes a notification the worker wrote, delivers it to a webhook (recorded in
    the ledger) and dead-letters the recipient it cannot resolve."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from handlers.contracts.messages import Notification

    own = secured.settings("vmstream-notify")
    ensure_topics(secured.settings(secured.sasl.admin))
    received: list[dict[str, Any]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return

    hook = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    Thread(target=hook.serve_forever, daemon=True).start()
    [probe_port] = free_ports(1)
    env = {
        **os.environ, "PYTHONUNBUFFERED": "1",
        "VMSTREAM_KAFKA__BOOTSTRAP_SERVERS": own.bootstrap_servers,
        "VMSTREAM_KAFKA__TOPIC_PREFIX": own.topic_prefix,
        "VMSTREAM_KAFKA__PARTITIONS": "1",
        "VMSTREAM_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "VMSTREAM_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
        "VMSTREAM_KAFKA__SASL_USERNAME": "vmstream-notify",
        "VMSTREAM_KAFKA__SASL_PASSWORD": secured.sasl.users["vmstream-notify"],
        "VMSTREAM_KAFKA__CREATE_TOPICS": "false",
        "VMSTREAM_NOTIFY__ENDPOINTS": json.dumps({"hooks": {"url": f"http://127.0.0.1:{hook.server_address[1]}/"}}),
    }
    log_path = tmp_path / "notify.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "streams.cli.main", "notify", "--config", str(ROOT / "examples/config.yaml"),
             "--probe-port", str(probe_port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        notice = Notification(
            notification_id=f"ntf-acl-{uuid.uuid4().hex[:8]}", type="drain_will_stop_gpu_vm",
            recipients=["webhook:hooks", "nobody"], subject=ObjectRef(kind="Node", name="gpu-node-1"),
            severity="warning", message="Node gpu-node-1 is being drained.", at=datetime.now(UTC))
        _send(secured.settings("vmstream-worker"),
              Record(own.topic("notifications"), b"node/gpu-node-1", encode_message(notice)))
        deadline = time.monotonic() + 180
        while not received or _end_offset(own, "deliveries") < 2 or _end_offset(own, "dlq") < 1:
            assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, f"not delivered: {log_path.read_text(errors='replace')[-4000:]}"
            time.sleep(0.2)  # polling interval
        assert [event["id"] for event in received] == [notice.notification_id]
        assert "AuthorizationFailed" not in log_path.read_text(errors="replace")
    finally:
        stop(process, grace=60)
        hook.shutdown()
        hook.server_close()


def _name(value: object) -> str:
    """An ACL field's name: librdkafka's bindings hold its enums, their stubs allow str and int too."""
    return value.name if isinstance(value, Enum) else str(value)
