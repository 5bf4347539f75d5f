"""Decisions do not depend on the producer's partitioner, nor on which replica is asked.

Two workers share one consumer group. The cluster's state is published first; then intents
are written to partitions murmur2 would not pick for their key — as a Go (sarama, FNV-1a) or
librdkafka (CRC32) producer places them. Each must still be decided on its VM's state: the
worker re-keys intents onto a topic it partitions itself. The test counts the outcomes with
a consumer of its own, and asks both workers' ``/pending``: a console asks one
replica behind a Service, and either must give the whole cluster's list.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupState

from streams.common.kafka_clients import ADMIN_SECONDS, admin_client
from harness.running import Deployment, WorkerProcess, capacity_after, simulated
from harness.scenarios import cluster
from tests.support.kafka_io import Record, TopicReader, murmur2_partition, publish

pytestmark = pytest.mark.kafka

CLUSTER = list(cluster().jsonl())
VMS = [("spx-proj-a", name, "proj-a", "alice@example.com") for name in ("train-1", "batch-1", "web-1")] + [
    ("spx-proj-b", name, "proj-b", "bob@example.com") for name in ("infer-1", "dev-1", "legacy-1")]


def intents() -> list[tuple[str, dict[str, Any]]]:
    """Two GPU changes per VM of the scenario, in order: GPU off, then an RTX PRO 6000."""
    return [(f"vm/{ns}/{name}", {"intent_id": f"it-{name}-{i}", "type": "set_gpu", "requested_by": by,
                                 "project": project,
                                 "spec": {"namespace": ns, "name": name, "gpu_class": gpu_class}})
            for ns, name, project, by in VMS for i, gpu_class in enumerate([None, "nvidia-rtx-pro-6000-bse"])]


def expected_pending() -> list[str]:
    """The VMs whose GPU change waits for a restart after the scenario and the intents, as
    ``simulate`` decides them: one process, state in memory, no partitions at all."""
    lines = CLUSTER + [json.dumps({"topic": "vmstream.intents", "key": key, "value": value})
                       for key, value in intents()]
    simulation = simulated(lines)
    return sorted(key for key, tracking in simulation.state.tables["tracking"].items() if tracking.pending_episode)


class Audit:
    """The deployment's audit records, read by the test itself."""

    def __init__(self, deployment: Deployment) -> None:
        kafka = deployment.kafka
        # Committed records only: a batch a worker aborted (a rebalance) and decided again
        # would otherwise count twice.
        self.reader = TopicReader(kafka, [kafka.topic("audit")], partitions=kafka.partitions, committed_only=True)
        self.records: list[dict[str, Any]] = []

    def wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.records):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {len(self.records)} audit records")
            self.records += [json.loads(record.value or b"") for record in self.reader.poll(0.2)]

    def close(self) -> None:
        self.reader.close()


def wait_for_two_members(deployment: Deployment, timeout: float = 90.0) -> None:
    """Both workers are members of the group, each assigned partitions of the routed topic."""
    admin = admin_client(deployment.kafka)
    routed = deployment.kafka.topic("worker-routed")
    holding: list[bool] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        group = admin.describe_consumer_groups([deployment.app_id],
                                               request_timeout=ADMIN_SECONDS)[deployment.app_id].result()
        holding = [any(tp.topic == routed for tp in member.assignment.topic_partitions or ())
                   for member in group.members or ()] if group.state == ConsumerGroupState.STABLE else []
        if len(holding) == 2 and all(holding):
            return
        time.sleep(0.2)  # polling interval
    raise AssertionError(f"the group never had two members holding routed partitions: {holding}")


def test_misplaced_intents_are_decided_on_their_vms_state_and_pending_is_cluster_wide(
    deployment: Deployment
) -> None:
    kafka = deployment.kafka
    audit = Audit(deployment)
    workers = [WorkerProcess(deployment, "w1"), WorkerProcess(deployment, "w2")]
    try:
        for worker in workers:
            worker.start()
        wait_for_two_members(deployment)
        deployment.publish_lines(CLUSTER)
        events = kafka.topic("k8s-events")
        audit.wait_for(lambda rs: sum(r["input"]["topic"] == events for r in rs) >= len(CLUSTER), 90,
                       "the cluster's events decided")
        # Usage is a global table: every GPU node's cards and VMIs seen by both workers, or an
        # intent's worker could find no card of its class in the AZ.
        for worker in workers:
            worker.wait_for_capacity(capacity_after(CLUSTER), 90)

        placed = {}
        for key, value in intents():
            right = murmur2_partition(key.encode(), kafka.partitions)
            wrong = (right + 1 + len(key) % (kafka.partitions - 1)) % kafka.partitions  # never murmur2's
            assert wrong != right
            [metadata] = publish(kafka, [Record(kafka.topic("intents"), key.encode(), json.dumps(value).encode(),
                                                partition=wrong)])
            assert metadata.partition == wrong
            placed[value["intent_id"]] = wrong

        audit.wait_for(lambda rs: set(placed) <= {r["input"]["ref"] for r in rs}, 90, "every intent audited")
        decided = {r["input"]["ref"]: r for r in audit.records if r["input"]["ref"] in placed}
        refused = {ref: r.get("reason") for ref, r in decided.items() if r["outcome"] != "accepted"}
        assert refused == {}, refused  # none met "does not exist": each was decided on its VM's state
        counted = [r["input"]["ref"] for r in audit.records if r["input"]["ref"] in placed]
        assert sorted(counted) == sorted(placed)  # one decision each
        # The audit names the record as the producer placed it, not the routed copy.
        assert {ref: (r["input"]["topic"], r["input"]["key"]) for ref, r in decided.items()} == {
            value["intent_id"]: (kafka.topic("intents"), key) for key, value in intents()}

        expected = expected_pending()
        assert expected  # VMs of more than one partition wait for a restart
        for worker in workers:
            pending = worker.wait_until("/pending", lambda body: sorted(p["vm"] for p in body) == expected, 60)
            assert all(p["episode"] for p in pending)
        assert workers[0].page("/pending") == workers[1].page("/pending")
        for worker in workers:
            worker.check_running()
    finally:
        audit.close()
        for worker in workers:
            worker.stop()
