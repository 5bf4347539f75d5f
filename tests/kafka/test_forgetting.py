"""The worker forgets intent ids past the dedup window, in the changelog that holds them.

``processed`` would otherwise grow by a row per intent for ever (docs/scaling.md). The
forgetting is decided like any input: a tick on the routed partition whose changelog holds
the row, so that the row's tombstone lands where the row is and a worker recovering from
the changelog no longer has it. The intent is published on a partition murmur2 would not
pick, as another producer's partitioner would; what the changelog holds is counted with a
consumer of this test's own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from handlers.core.tables import PROCESSED
from harness.running import Deployment, Outputs, WorkerProcess
from harness.scenarios import cluster
from streams.common.topics import changelog_topic
from tests.support.kafka_io import Record, TopicReader, murmur2_partition, publish
from tests.support.waiting import eventually

pytestmark = pytest.mark.kafka

WINDOW = 3  # seconds: the ids are past it soon after they are decided
KEY = "vm/spx-proj-b/dev-1"
SET_GPU = {"intent_id": "it-forget-1", "type": "set_gpu", "requested_by": "bob@example.com", "project": "proj-b",
           "spec": {"namespace": "spx-proj-b", "name": "dev-1", "gpu_class": "nvidia-rtx-pro-6000-bse"}}


class Changelog:
    """The ``processed`` changelog as this test reads it: (partition, intent id, value) in order."""

    def __init__(self, deployment: Deployment) -> None:
        self.topic = changelog_topic(deployment.app_id, PROCESSED.stored_as)
        self.reader = TopicReader(deployment.bootstrap, [self.topic], missing_ok=True)
        self.records: list[tuple[int, str, bytes | None]] = []

    def poll(self) -> list[tuple[int, str, bytes | None]]:
        if not self.reader.assigned():
            return self.records  # the worker has not made it yet
        self.records += [(r.partition, json.loads(r.key or b""), r.value) for r in self.reader.poll(0.2)]
        return self.records

    def of(self, intent_id: str) -> list[tuple[int, bool]]:
        """(partition, whether it is a row rather than a tombstone) of each record of ``intent_id``."""
        return [(partition, value is not None) for partition, key, value in self.poll() if key == intent_id]

    def close(self) -> None:
        self.reader.close()


def publish_misplaced(deployment: Deployment, value: Mapping[str, object]) -> None:
    kafka = deployment.kafka
    wrong = (murmur2_partition(KEY.encode(), kafka.partitions) + 1) % kafka.partitions  # never murmur2's
    [written] = publish(kafka, [Record(kafka.topic("intents"), KEY.encode(), json.dumps(value).encode(),
                                       partition=wrong)])
    assert written.partition == wrong


def test_an_intent_id_past_the_window_is_tombstoned_where_its_row_is_and_is_decided_anew(
    deployment: Deployment
) -> None:
    env = {"VMSTREAM_INTENTS__DEDUP_WINDOW_SECONDS": str(WINDOW)}
    outputs, changelog = Outputs(deployment), Changelog(deployment)
    events = deployment.kafka.topic("k8s-events")
    lines = list(cluster().jsonl())
    try:
        first = WorkerProcess(deployment, "w1", env=env).start()
        try:
            deployment.publish_lines(lines)
            outputs.wait_for(lambda o: len(o.audits(input__topic=events)) >= len(lines), what="the cluster decided")
            publish_misplaced(deployment, SET_GPU)
            outputs.wait_for(lambda o: o.audits(input__ref="it-forget-1"), what="the intent's audit")
            [row, tombstone] = eventually(lambda: (records := changelog.of("it-forget-1"))[1:] and records,
                                          "the row and its tombstone in the changelog", timeout=60)
            assert row[1] and not tombstone[1]
            assert tombstone[0] == row[0]  # in the partition that holds the row
            first.check_running()
        finally:
            assert first.stop() == 0, first.tail()

        second = WorkerProcess(deployment, "w2", env=env).start()  # recovers the tables from their changelogs
        try:
            publish_misplaced(deployment, SET_GPU)
            outputs.wait_for(lambda o: len(o.audits(input__ref="it-forget-1")) == 2, what="the second audit")
            outcomes = [audit["outcome"] for audit in outputs.audits(input__ref="it-forget-1")]
            assert outcomes == ["accepted", "accepted"], outcomes  # forgotten: decided anew, not a duplicate
        finally:
            assert second.stop() == 0, second.tail()
        assert len(changelog.of("it-forget-1")) >= 3  # the new decision's row
    finally:
        changelog.close()
        outputs.close()
