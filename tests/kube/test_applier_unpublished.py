"""An applier whose outputs cannot be published commits nothing past them (real broker, real
API server).

The broker refuses the result of the first command of a partition while a second command,
of another key, is still being applied. The applier stops; on its way out its consumer,
closing, calls the revoke callback, which used to release the second command and commit the
partition past both: the first command was then applied, had no result, and
would never be read again. The committed offset is read by the test's own consumer.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest
from kubernetes import client

from handlers.contracts import ids
from handlers.contracts.messages import Command, ObjectRef
from handlers.core.decisions import subject_key
from handlers.rules.results import RetryLater, Tries
from harness.running import CONFIG, Deployment
from samples.cluster import node as node_object
from streams.common.codecs import encode_message
from streams.common.durable import Delivered, DurableProducer, NotDelivered, Record
from streams.common.settings import load_settings
from streams.common.topics import ensure_topics
from streams.kube.applying import Applied, Applier, KubeApplier
from streams.common.group_reading import Partition
from tests.support.kafka_broker import committed as group_offsets

pytestmark = [pytest.mark.kube, pytest.mark.kafka]


@pytest.fixture
def nodes(api: client.ApiClient) -> Iterator[list[str]]:
    core = client.CoreV1Api(api)
    names = [f"node-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for name in names:
        obj = node_object(name)
        for field in ("uid", "resourceVersion"):
            del obj["metadata"][field]
        core.create_node(obj)
    yield names
    for name in names:
        core.delete_node(name)


def cordon(node: str) -> Command:
    target = ObjectRef(kind="Node", name=node)
    return Command(command_id=ids.command_id(f"drain-{node}", "cordon_node", subject_key(target)), type="cordon_node",
                   target=target, cause=f"drain-{node}", issued_at=datetime.now(UTC), requested_by="ops@example.com")


def test_a_result_not_published_stops_every_later_commit(
        kafka_bootstrap: str, tmp_path: Path, api: client.ApiClient, nodes: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    kafka = deployment.kafka.model_copy(update={"partitions": 1})  # both commands on one partition
    ensure_topics(kafka)
    settings = load_settings(CONFIG).model_copy(update={"kafka": kafka, "signing": deployment.signing})
    first, second = cordon(nodes[0]), cordon(nodes[1])
    results_topic = kafka.topic("command-results")
    first_failed = threading.Event()

    real_send_all = DurableProducer.send_all

    def refusing_send_all(self: DurableProducer, records: Sequence[Record]) -> list[Delivered]:
        if any(r.topic == results_topic and first.command_id.encode() in (r.value or b"") for r in records):
            first_failed.set()
            raise NotDelivered("the broker refused the first command's result (the test's fault)")
        return real_send_all(self, records)

    real_try = KubeApplier.try_once

    def held_try(self: KubeApplier, command: Command, tries: Tries = Tries()) -> Applied | RetryLater:
        if command.command_id == second.command_id:  # still in flight when the first one fails
            assert first_failed.wait(60), "the first command's result was never sent"
        return real_try(self, command, tries)

    monkeypatch.setattr(DurableProducer, "send_all", refusing_send_all)
    monkeypatch.setattr(KubeApplier, "try_once", held_try)
    keyring = deployment.signing.keyring()
    for command in (first, second):
        deployment.publish_raw("commands", subject_key(command.target), encode_message(command, keyring=keyring))

    group = f"{deployment.app_id}-applier"
    applier = Applier(settings, KubeApplier(api), group_id=group)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            applier.run(threading.Event())
        except BaseException as error:  # what stopped it
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the applier did not stop on a result it could not publish"
    assert [type(error) for error in failure] == [NotDelivered]

    committed = group_offsets(kafka, group).get(Partition(kafka.topic("commands"), 0))
    assert committed is None, f"committed past the command whose result was never written: {committed}"
