"""The route stage's consumer group (streams/worker/routing.py): it routes nothing twice and
skips nothing, across an upgrade from the worker that routed in its Faust group and across
a graceful stop.

What was routed is counted by the test's own reader of the routed topic (each record names
its origin in ``vmstream-source``), and the offsets from the broker's own record of the
groups, never from the worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from harness.localkafka import LocalKafka
from harness.running import Deployment, Outputs, WorkerProcess
from streams.common.group_reading import Partition
from streams.common.topics import ROUTED, SOURCE_HEADER, route_group
from tests.support.kafka_broker import commit
from tests.support.kafka_broker import committed as group_offsets
from tests.support.kafka_broker import end_offsets as topic_ends
from tests.support.kafka_io import Record, TopicReader
from tests.support.kafka_io import publish as write

pytestmark = pytest.mark.kafka


def intent(ident: str) -> tuple[str, dict[str, Any]]:
    """A ``restart_vm`` of a VM that does not exist: decided (refused) without any cluster."""
    name = f"vm-{ident}"
    return f"vm/ns/{name}", {"intent_id": ident, "type": "restart_vm", "requested_by": "alice@example.com",
                             "project": "proj-a", "spec": {"namespace": "ns", "name": name}}


def publish(deployment: Deployment, idents: list[str]) -> None:
    """One intent per id, spread over every partition of the intents topic."""
    kafka = deployment.kafka
    records = []
    for n, ident in enumerate(idents):
        key, value = intent(ident)
        records.append(Record(kafka.topic("intents"), key.encode(), json.dumps(value).encode(),
                              partition=n % kafka.partitions))
    write(kafka, records)


def intents_partitions(deployment: Deployment) -> list[Partition]:
    kafka = deployment.kafka
    return [Partition(kafka.topic("intents"), p) for p in range(kafka.partitions)]


def end_offsets(deployment: Deployment, partitions: list[Partition]) -> dict[Partition, int]:
    found: dict[Partition, int] = {}
    for topic in {tp.topic for tp in partitions}:
        found.update(topic_ends(deployment.kafka, topic))
    return {tp: found[tp] for tp in partitions}


def committed(deployment: Deployment, group: str, partitions: list[Partition]) -> dict[Partition, int]:
    found = group_offsets(deployment.kafka, group)
    return {tp: found[tp] for tp in partitions if tp in found}


def routed_origins(deployment: Deployment) -> list[tuple[str, int, int]]:
    """(topic, partition, offset) of every intent or event on the routed topic, to its end."""
    kafka = deployment.kafka
    reader = TopicReader(kafka, [kafka.topic(ROUTED)], partitions=kafka.partitions)
    origins = []
    try:
        for record in reader.read_to_end():
            source = dict(record.headers).get(SOURCE_HEADER)
            if source is not None:
                origin = json.loads(source)
                origins.append((origin["topic"], origin["partition"], origin["offset"]))
    finally:
        reader.close()
    return origins


def test_an_upgraded_worker_routes_from_where_its_faust_group_left_off(deployment: Deployment) -> None:
    """Intents the worker routed in its Faust group (before the route stage had a group of its
    own) are not routed again; those after are routed once each."""
    old = [f"old-{n}" for n in range(12)]
    new = [f"new-{n}" for n in range(12)]
    publish(deployment, old)
    partitions = intents_partitions(deployment)
    handed = end_offsets(deployment, partitions)
    assert all(handed[tp] > 0 for tp in partitions)  # every partition has some of the old ones
    # The older worker's group, as it left the intents: committed past the old ones.
    commit(deployment.kafka, deployment.app_id, handed)
    publish(deployment, new)

    outputs = Outputs(deployment)
    worker = WorkerProcess(deployment, "w1").start()
    try:
        outputs.wait_for(lambda o: set(new) <= {a["input"]["ref"] for a in o.seen["audit"]},
                         what="the new intents decided")
        intents = deployment.kafka.topic("intents")
        ends = end_offsets(deployment, partitions)
        outputs.wait_for(lambda o: committed(deployment, route_group(deployment.app_id),
                                             partitions) == ends, what="the route group to commit every intent")
        worker.check_running()
    finally:
        outputs.close()
        assert worker.stop() == 0, worker.tail()
    routed = sorted((p, offset) for topic, p, offset in routed_origins(deployment) if topic == intents)
    expected = sorted((tp.partition, offset) for tp in partitions for offset in range(handed[tp], ends[tp]))
    assert routed == expected  # the new ones, once each; none of the old
    assert not {a["input"]["ref"] for a in outputs.seen["audit"]} & set(old)


def test_a_stopped_worker_has_committed_all_it_routed_and_its_successor_routes_none_again(
    deployment: Deployment
) -> None:
    """Intents routed just before a graceful stop are committed by the stop: the worker started
    next routes only what came after, each once."""
    partitions = intents_partitions(deployment)
    outputs = Outputs(deployment)
    first = [f"a-{n}" for n in range(12)]
    second = [f"b-{n}" for n in range(12)]
    worker = WorkerProcess(deployment, "w1").start()
    try:
        # Two bursts back to back: the second lands within the commit interval of the first's
        # commit, so only the stop commits it.
        publish(deployment, first)
        outputs.wait_for(lambda o: set(first) <= {a["input"]["ref"] for a in o.seen["audit"]}, what="the first burst")
        publish(deployment, second)
        outputs.wait_for(lambda o: set(second) <= {a["input"]["ref"] for a in o.seen["audit"]},
                         what="the second burst")
    finally:
        assert worker.stop() == 0, worker.tail()
    ends = end_offsets(deployment, partitions)
    assert committed(deployment, route_group(deployment.app_id), partitions) == ends

    third = [f"c-{n}" for n in range(6)]
    successor = WorkerProcess(deployment, "w1").start()
    try:
        publish(deployment, third)
        outputs.wait_for(lambda o: set(third) <= {a["input"]["ref"] for a in o.seen["audit"]}, what="the third burst")
        successor.check_running()
    finally:
        outputs.close()
        assert successor.stop() == 0, successor.tail()
    intents = deployment.kafka.topic("intents")
    routed = [(p, offset) for topic, p, offset in routed_origins(deployment) if topic == intents]
    assert len(routed) == len(set(routed)) == len(first) + len(second) + len(third)  # each once
    audited = [a["input"]["ref"] for a in outputs.seen["audit"]]
    assert sorted(audited) == sorted(first + second + third)  # one decision each, no duplicate


# The route stage's first group requests, in a process of its own: a crash is an exit code.
_INHERIT = """
import sys
from streams.common.settings import KafkaSettings
from streams.worker.routing import GroupOffsets, inherit_offsets_patiently

kafka = KafkaSettings(bootstrap_servers=sys.argv[1])
print(inherit_offsets_patiently(GroupOffsets(kafka, "app-route-inherit"), "app-route", "app", ["intents"]))
"""


def test_the_route_group_inherits_offsets_on_a_broker_just_started() -> None:
    """A broker just started answers the first group requests that its coordinator is still
    loading: the route stage asks again (through aiokafka: librdkafka 2.16's admin client
    crashes the process there) and finds nothing to inherit."""
    with LocalKafka() as kafka:
        done = subprocess.run([sys.executable, "-c", _INHERIT, kafka.bootstrap_servers],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "{}"
