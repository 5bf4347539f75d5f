"""pytest plugin: one real Kafka broker per test session, and unique topics per test.

The broker comes from the first source that exists: ``KAFKA_BOOTSTRAP_SERVERS`` (CI or a
developer's own broker), else a testcontainers ``apache/kafka`` container when a Docker
engine actually answers, else ``harness.localkafka.LocalKafka`` (Kafka's jars run with
Java, no Docker). Register with ``pytest_plugins = ["tests.support.kafka_broker"]``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions
from confluent_kafka import TopicPartition as Offset
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    OffsetSpec,
    ResourceType,
)

from harness.localkafka import KAFKA_VERSION, SINGLE_NODE_SETTINGS, LocalKafka, free_ports, probe
from harness.running import Deployment
from streams.common.group_reading import Partition
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client, consumer
from streams.common.settings import KafkaSettings

log = logging.getLogger(__name__)

BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"
CONTAINER_IMAGE = f"apache/kafka:{KAFKA_VERSION}"
CONTAINER_START_TIMEOUT = 120.0

TopicFactory = Callable[..., str]


def _docker_answers(timeout: float = 2.0) -> bool:
    """Whether a Docker engine responds to a ping (a client binary alone is not enough)."""
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        return False
    try:
        import docker  # imported only when an engine may exist

        client = docker.from_env(timeout=int(timeout))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception as error:  # any failure means "no usable engine", never a test error
        log.debug("no Docker engine: %s", error)
        return False


@contextlib.contextmanager
def _kafka_container() -> Iterator[str]:
    """An ``apache/kafka`` container configured like LocalKafka, on a fixed host port.

    The port is fixed (not mapped at random) because the broker must advertise the address
    clients reach it at, and that has to be known before the container starts.
    """
    from testcontainers.core.container import DockerContainer

    port = free_ports(1)[0]
    container = DockerContainer(CONTAINER_IMAGE).with_bind_ports(9092, port)
    host = container.get_docker_client().host()
    settings = {
        "node.id": "1",
        "process.roles": "broker,controller",
        "listeners": "PLAINTEXT://:9092,CONTROLLER://:9093",
        "advertised.listeners": f"PLAINTEXT://{host}:{port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "controller.quorum.voters": "1@localhost:9093",
        **SINGLE_NODE_SETTINGS,
    }
    for key, value in settings.items():
        container.with_env("KAFKA_" + key.upper().replace(".", "_"), value)
    container.start()
    try:
        bootstrap = f"{host}:{port}"
        deadline = time.monotonic() + CONTAINER_START_TIMEOUT
        while not probe(bootstrap, timeout=1.0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{CONTAINER_IMAGE} did not answer at {bootstrap}")
            time.sleep(0.2)
        yield bootstrap
    finally:
        container.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """Bootstrap servers of a real broker, shared by the whole session."""
    external = os.environ.get(BOOTSTRAP_ENV)
    if external:
        log.info("Kafka from %s: %s", BOOTSTRAP_ENV, external)
        yield external
        return
    if _docker_answers():
        log.info("Kafka from testcontainers (%s)", CONTAINER_IMAGE)
        with _kafka_container() as bootstrap:
            yield bootstrap
        return
    with LocalKafka() as kafka:
        yield kafka.bootstrap_servers


@pytest.fixture(scope="session")
def kafka_admin(kafka_bootstrap: str) -> AdminClient:
    """vmstream's admin client on the session's broker."""
    return admin_client(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_id="vmstream-tests")


def committed(kafka: KafkaSettings, group: str) -> dict[Partition, int]:
    """The offsets ``group`` has committed, by partition (none: not there)."""
    asked = [ConsumerGroupTopicPartitions(group)]
    admin = admin_client(kafka)
    listed = admin.list_consumer_group_offsets(asked, request_timeout=ADMIN_SECONDS)[group].result()
    return {Partition(tp.topic, tp.partition): tp.offset for tp in listed.topic_partitions or ()
            if tp.error is None and tp.offset >= 0}


def commit(kafka: KafkaSettings, group: str, offsets: dict[Partition, int]) -> None:
    """Commit ``offsets`` (the next offset to read of each partition) for ``group``, as a
    former member that never joins it again would: where an earlier process left off. The
    consumer finds the group's coordinator first (a broker just started may not have one yet)."""
    former = consumer(kafka, client_id="vmstream-tests", group_id=group)
    try:
        listed = [Offset(tp.topic, tp.partition, offset) for tp, offset in offsets.items()]
        for tp in former.commit(offsets=listed, asynchronous=False) or ():
            if tp.error is not None:
                raise RuntimeError(f"{group}: {tp.topic}[{tp.partition}] not committed: {tp.error}")
    finally:
        former.close()


def end_offsets(kafka: KafkaSettings, topic: str) -> dict[Partition, int]:
    """Each partition of ``topic``: the offset its next record will take."""
    admin = admin_client(kafka)
    partitions = admin.list_topics(topic, timeout=ADMIN_SECONDS).topics[topic].partitions
    asked = {Offset(topic, p): OffsetSpec.latest() for p in partitions}  # type: ignore[no-untyped-call]  # unannotated in confluent-kafka
    return {Partition(tp.topic, tp.partition): answer.result().offset
            for tp, answer in admin.list_offsets(asked, request_timeout=ADMIN_SECONDS).items()}


def set_topic_config(kafka: KafkaSettings, topic: str, name: str, value: str) -> None:
    """Set one of ``topic``'s configs, the others left as they are."""
    resource = ConfigResource(ResourceType.TOPIC, topic,
                              incremental_configs=[ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)])
    admin = admin_client(kafka)
    for altered in admin.incremental_alter_configs([resource], request_timeout=ADMIN_SECONDS).values():
        altered.result()


def delete_topics(kafka: KafkaSettings, topics: list[str]) -> None:
    if topics:
        admin = admin_client(kafka)
        for deleted in admin.delete_topics(topics, request_timeout=ADMIN_SECONDS).values():
            deleted.result()


@pytest.fixture
def kafka_topic_factory(
    kafka_admin: AdminClient, request: pytest.FixtureRequest
) -> Iterator[TopicFactory]:
    """``make(suffix="", *, partitions=1, configs=None) -> name``: a fresh topic per call.

    Names carry the test's name and a random part, so tests (and parallel sessions on one
    broker) never share a topic; the topics are deleted when the test ends.
    """
    created: list[str] = []
    stem = re.sub(r"[^a-zA-Z0-9._-]+", "-", request.node.name)[:120]

    def make(
        suffix: str = "", *, partitions: int = 1, configs: dict[str, str] | None = None
    ) -> str:
        name = "-".join(part for part in (stem, suffix, uuid.uuid4().hex[:8]) if part)
        topic = NewTopic(name, num_partitions=partitions, replication_factor=1, config=configs or {})
        kafka_admin.create_topics([topic], operation_timeout=ADMIN_SECONDS)[name].result()
        created.append(name)
        return name

    yield make
    for deleted in kafka_admin.delete_topics(created).values() if created else ():
        deleted.result()


@pytest.fixture
def deployment(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Deployment]:
    """One isolated vmstream on the session's broker: its own topics and app id, removed after."""
    deployed = Deployment(kafka_bootstrap, tmp_path)
    deployed.create_topics()
    yield deployed
    deployed.delete_topics()
