"""The applier publishes what settled at most every ``apply.release_seconds`` while commands
keep coming, and at once when its in-flight bound is reached or it stops (real broker, real
API server).

Each release is two produce requests (notifications and audit records, then the results),
and a broker pays for a request more than for the records in it: commands arriving one by
one used to cost two requests each. The commands here are not sealed by the worker, so the
applier refuses them without an API call: what is counted is the releasing alone. The
results are read by the test's own consumer, the committed offset by the group's.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from handlers.contracts import ids
from handlers.contracts.messages import Command, ObjectRef
from handlers.core.decisions import subject_key
from harness.running import CONFIG, Deployment
from streams.common.codecs import encode_message
from streams.common.durable import Delivered, DurableProducer, Record
from streams.common.settings import KafkaSettings, Settings, load_settings
from streams.common.topics import ensure_topics
from streams.kube.applying import Applier, KubeApplier
from streams.common.group_reading import Partition
from tests.support.kafka_broker import committed as group_offsets
from tests.support.kafka_io import TopicReader

pytestmark = [pytest.mark.kube, pytest.mark.kafka]

NEVER = 60.0  # the longest interval the settings allow: longer than any of these tests waits


def unsealed(number: int) -> Command:
    target = ObjectRef(kind="Node", name=f"node-{uuid.uuid4().hex[:8]}")
    cause = f"release-{number}"
    return Command(command_id=ids.command_id(cause, "cordon_node", subject_key(target)), type="cordon_node",
                   target=target, cause=cause, issued_at=datetime.now(UTC), requested_by="ops@example.com")


def settings_for(deployment: Deployment, **apply: Any) -> Settings:
    kafka = deployment.kafka.model_copy(update={"partitions": 1})
    ensure_topics(kafka)
    settings = load_settings(CONFIG)
    return settings.model_copy(update={"kafka": kafka, "signing": deployment.signing,
                                       "apply": settings.apply.model_copy(update=apply)})


def results_of(bootstrap: str, topic: str, count: int, timeout: float = 60.0) -> list[bytes]:
    """The first ``count`` records of ``topic``, read by a consumer of the test's own."""
    reader = TopicReader(bootstrap, [topic], partitions=1)
    try:
        values: list[bytes] = []
        last = time.monotonic()  # the last record's arrival: ``timeout`` without one ends the read
        while len(values) < count and time.monotonic() - last < timeout:
            for record in reader.poll(min(0.2, timeout)):
                values.append(record.value or b"")
                last = time.monotonic()
                if len(values) == count:
                    break
        return values
    finally:
        reader.close()


def committed(bootstrap: str, group: str, topic: str) -> int | None:
    return group_offsets(KafkaSettings(bootstrap_servers=bootstrap), group).get(Partition(topic, 0))


class Counting:
    """The applier's ``DurableProducer.send_all`` counted: one call per produce round trip.
    The test publishes its commands through the same producer class, from its own thread:
    those are not counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[str]] = []
        real = DurableProducer.send_all

        def send_all(producer: DurableProducer, records: Sequence[Record]) -> list[Delivered]:
            if threading.current_thread() is not threading.main_thread():
                self.calls.append([record.topic for record in records])
            return real(producer, records)

        monkeypatch.setattr(DurableProducer, "send_all", send_all)


def start(applier: Applier) -> tuple[threading.Thread, threading.Event, list[BaseException]]:
    stop, failure = threading.Event(), []

    def run() -> None:
        try:
            applier.run(stop)
        except BaseException as error:  # reported by the test
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert applier.ready.wait(60), "the applier was not ready"
    return thread, stop, failure


def test_commands_arriving_one_by_one_are_released_together(
        kafka_bootstrap: str, tmp_path: Path, api: client.ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    settings = settings_for(deployment, release_seconds=NEVER)
    sends = Counting(monkeypatch)
    admitted = threading.Semaphore(0)
    real_admit = Applier._admit

    def admit(self: Applier, *args: Any) -> None:
        real_admit(self, *args)
        admitted.release()

    monkeypatch.setattr(Applier, "_admit", admit)
    group = f"{deployment.app_id}-applier"
    thread, stop, failure = start(Applier(settings, KubeApplier(api), group_id=group))
    commands = [unsealed(number) for number in range(6)]
    for command in commands:  # each one read before the next is published: one poll each
        deployment.publish_raw("commands", subject_key(command.target), encode_message(command))
        assert admitted.acquire(timeout=60), f"command {command.cause} was never read"
    stop.set()
    thread.join(60)
    assert not thread.is_alive() and not failure, failure

    results_topic = settings.kafka.topic("command-results")
    # The first settled command is released at once (the first release is never held), the
    # five after it together when the applier stops: two round trips each.
    assert [results_topic in topics for topics in sends.calls] == [False, True, False, True], sends.calls
    assert [len(topics) for topics in sends.calls] == [1, 1, 5, 5], sends.calls
    results = results_of(kafka_bootstrap, results_topic, len(commands))
    assert [any(command.command_id.encode() in value for value in results) for command in commands] == [True] * 6
    assert committed(kafka_bootstrap, group, settings.kafka.topic("commands")) == len(commands)


def test_the_in_flight_bound_releases_without_waiting_for_the_interval(
        kafka_bootstrap: str, tmp_path: Path, api: client.ApiClient) -> None:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    settings = settings_for(deployment, release_seconds=NEVER, max_in_flight=2)
    commands = [unsealed(number) for number in range(8)]  # four pairs: each one fills the bound
    for command in commands:
        deployment.publish_raw("commands", subject_key(command.target), encode_message(command))
    thread, stop, failure = start(Applier(settings, KubeApplier(api), group_id=f"{deployment.app_id}-applier"))
    try:
        # All eight while it runs: each pair read fills the bound, and is released at once.
        results = results_of(kafka_bootstrap, settings.kafka.topic("command-results"), len(commands),
                             timeout=NEVER / 2)
    finally:
        stop.set()
        thread.join(60)
    assert not failure, failure
    assert len(results) == len(commands), f"{len(results)} of {len(commands)} results while the applier ran"
