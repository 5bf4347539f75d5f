"""The worker's consumer lag: ``vmstream_consumer_lag{topic,partition}`` is set for every input
partition it consumes (intents, k8s-events, the routed topic) and falls to 0 once all is
decided. (It used to be never set: the position it read did not exist, and an ``except``
hid that.) The applier's lag is tested with it in tests/kube/test_applying.py."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.running import Deployment, Outputs, WorkerProcess
from harness.scenarios import cluster
from streams.common.topics import ROUTED

pytestmark = pytest.mark.kafka

CLUSTER = list(cluster().jsonl())



def lag(worker: WorkerProcess) -> dict[tuple[str, str], float]:
    """The worker's lag gauge by (topic, partition), from its own /metrics page."""
    request = urllib.request.Request(f"http://127.0.0.1:{worker.web_port}/metrics",
                                     headers={"Authorization": f"Bearer {worker.deployment.web_token}"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        text = answer.read().decode()
    return {(sample.labels["topic"], sample.labels["partition"]): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "vmstream_consumer_lag"}


def test_the_worker_reports_its_lag_on_every_input_partition(deployment: Deployment) -> None:
    outputs = Outputs(deployment)
    worker = WorkerProcess(deployment, "w1").start()
    try:
        deployment.publish_lines(CLUSTER)
        outputs.wait_for(lambda o: len(o.seen["audit"]) >= len(CLUSTER), what="the cluster's events decided")
        kafka = deployment.kafka
        inputs = {(kafka.topic(name), str(p)) for name in ("intents", "k8s-events", ROUTED)
                  for p in range(kafka.partitions)}
        deadline = time.monotonic() + 30
        while True:
            seen = lag(worker)
            if inputs <= seen.keys() and all(seen[key] == 0 for key in inputs):
                break
            assert time.monotonic() < deadline, (
                f"lag never reported as 0 on every input partition: missing "
                f"{sorted(inputs - seen.keys())}, nonzero {sorted((k, v) for k, v in seen.items() if v)}")
            time.sleep(0.2)  # polling interval; the gauge is refreshed every tick
        assert not any(topic.endswith("-changelog") for topic, _ in seen), "changelogs are not inputs"
    finally:
        outputs.close()
        assert worker.stop() == 0, worker.tail()
