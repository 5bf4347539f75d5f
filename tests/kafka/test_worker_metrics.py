"""The worker's gauges of its tables, from real workers' /metrics: each counts the partitions
it owns, so summed by class over the workers they are the AZ's cards, the same figures as
``/capacity`` (which every worker gives for the whole AZ); an open drain shows once, with its
deadline and the GPU VMs it still has. docs/operators.md, "Metrics and alerts"."""

from __future__ import annotations

import time
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.running import Deployment, Outputs, WorkerProcess, capacity_after
from harness.scenarios import OPS, cluster

pytestmark = pytest.mark.kafka

NOTICE = 3600  # the drain stays open for the whole test


def scenario() -> list[str]:
    script = cluster().wait(60)
    script.intent("it-drain-metrics", "drain_node", {"node": "gpu-node-1", "reason": "firmware upgrade",
                                                     "notice_seconds": NOTICE}, by=OPS)
    return list(script.jsonl())


def samples(worker: WorkerProcess) -> list[tuple[str, dict[str, str], float]]:
    request = urllib.request.Request(f"http://127.0.0.1:{worker.web_port}/metrics",
                                     headers={"Authorization": f"Bearer {worker.deployment.web_token}"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        text = answer.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def summed(workers: list[WorkerProcess], name: str, by: str) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for worker in workers:
        for sample, labels, value in samples(worker):
            if sample == name:
                total[labels.get(by, "")] += value
    return dict(total)


def test_summed_over_the_workers_the_gauges_are_the_az_s(deployment: Deployment) -> None:
    lines = scenario()
    expected = capacity_after(lines)  # class → (total, free), decided in one process
    outputs = Outputs(deployment)
    workers = [WorkerProcess(deployment, "w1").start(), WorkerProcess(deployment, "w2").start()]
    try:
        deployment.publish_lines(lines[:-1])  # the cluster first: a drain of a node not seen yet is refused
        outputs.wait_for(lambda o: len(o.seen["audit"]) >= len(lines) - 1, what="the cluster decided")
        deployment.publish_lines(lines[-1:])
        outputs.wait_for(lambda o: len(o.seen["audit"]) >= len(lines), what="the drain decided")
        for worker in workers:
            worker.wait_for_capacity(expected)
        deadline = time.monotonic() + 60
        while True:  # a rebalance may still move partitions: the sums settle
            totals = summed(workers, "vmstream_gpus_total", "class")
            free = summed(workers, "vmstream_gpus_free", "class")
            drains = summed(workers, "vmstream_drains_open", "")
            if ({c: (totals.get(c), free.get(c)) for c in expected} == expected and drains == {"": 1.0}):
                break
            assert time.monotonic() < deadline, (totals, free, drains, expected)
            time.sleep(0.5)
        capacity = workers[0].page("/capacity")
        used = summed(workers, "vmstream_gpus_used", "class")
        assert {c: used[c] for c in expected} == {c: capacity[c]["used"] for c in expected}
        [(labels, left)] = [(labels, value) for worker in workers for name, labels, value in samples(worker)
                            if name == "vmstream_drain_vms_left"]
        assert labels == {"node": "gpu-node-1", "source": "intent", "scope": "node"} and left >= 1
        [deadline_at] = [value for worker in workers for name, labels, value in samples(worker)
                         if name == "vmstream_drain_deadline_timestamp_seconds"]
        assert time.time() < deadline_at <= time.time() + NOTICE
        assert sum(value for worker in workers for name, _, value in samples(worker)
                   if name == "vmstream_build_info") == 2
    finally:
        outputs.close()
        for worker in workers:
            assert worker.stop() == 0, worker.tail()
