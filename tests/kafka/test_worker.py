"""The worker on a real broker: the same decisions as ``simulate``, through Kafka.

Each test deploys its own topics and consumer group on the session's broker and runs
real ``vmstream worker`` processes.
"""

from __future__ import annotations

import io
import json
import os
import signal
from contextlib import contextmanager
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from harness.scenarios import cluster, cordon_landed
from harness.running import Deployment, Outputs, WorkerProcess, capacity_after

pytestmark = pytest.mark.kafka

FAULTS = Path(__file__).resolve().parent.parent / "support" / "crashpoints"  # sitecustomize.py

CLUSTER = list(cluster().jsonl())
SET_GPU = {"intent_id": "it-gpu-1", "type": "set_gpu", "requested_by": "bob@example.com", "project": "proj-b",
           "spec": {"namespace": "spx-proj-b", "name": "dev-1", "gpu_class": "nvidia-rtx-pro-6000-bse"}}


def intent_line(value: Mapping[str, object], key: str) -> str:
    return json.dumps({"topic": "vmstream.intents", "key": key, "value": value})


def observed(outputs: Outputs, count: int) -> bool:
    return len(outputs.audits(input__topic=outputs_topic(outputs, "k8s-events"))) >= count


def outputs_topic(outputs: Outputs, name: str) -> str:
    prefix = next(iter(outputs.topics)).rsplit(".", 1)[0]
    return f"{prefix}.{name}"


@pytest.fixture
def deployment(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    deployment.create_topics()
    yield deployment


@pytest.fixture
def outputs(deployment: Deployment) -> Iterator[Outputs]:
    reader = Outputs(deployment)
    yield reader
    reader.close()


def start_cluster(deployment: Deployment, outputs: Outputs) -> None:
    deployment.publish_lines(CLUSTER)
    outputs.wait_for(lambda o: observed(o, len(CLUSTER)), what="the cluster's events decided")


def test_intents_become_commands_notifications_and_audit(deployment: Deployment, outputs: Outputs) -> None:
    worker = WorkerProcess(deployment, "w1").start()
    try:
        start_cluster(deployment, outputs)
        deployment.publish_lines([intent_line(SET_GPU, "vm/spx-proj-b/dev-1")])
        outputs.wait_for(lambda o: o.audits(input__ref="it-gpu-1"), what="the intent's audit")
        [audit] = outputs.audits(input__ref="it-gpu-1")
        outputs.wait_for(lambda o: len(o.seen["commands"]) >= 1 and o.notifications("gpu_change_pending_restart"))
        [command] = outputs.commands("patch_vm")
        [told] = outputs.notifications("gpu_change_pending_restart")
        assert audit["outcome"] == "accepted"
        assert audit["commands"] == [command["command_id"]] and audit["notifications"] == [told["notification_id"]]
        assert command["target"] == {"kind": "VirtualMachine", "namespace": "spx-proj-b", "name": "dev-1"}
        assert outputs.keys["commands"] == ["vm/spx-proj-b/dev-1"]
        assert told["recipients"] == ["project:proj-b"]
    finally:
        assert worker.stop() == 0, worker.tail()


def test_malformed_input_is_dead_lettered_with_its_offset_and_the_line_goes_on(
    deployment: Deployment, outputs: Outputs
) -> None:
    worker = WorkerProcess(deployment, "w1").start()
    try:
        start_cluster(deployment, outputs)
        deployment.publish_raw("intents", "vm/spx-proj-b/dev-1", b"{not json")
        deployment.publish_lines([intent_line(SET_GPU, "vm/spx-proj-b/dev-1")])
        outputs.wait_for(lambda o: o.seen["dlq"] and o.audits(input__ref="it-gpu-1"), what="dead letter and audit")
        [letter] = outputs.seen["dlq"]
        assert letter["original"] == "{not json" and letter["error"].startswith("not JSON")
        assert letter["source"]["topic"] == deployment.kafka.topic("intents")
        assert isinstance(letter["source"]["partition"], int) and letter["source"]["offset"] == 0
        assert outputs.keys["dlq"] == ["vm/spx-proj-b/dev-1"]
        assert outputs.audits(input__ref="it-gpu-1")[0]["outcome"] == "accepted"
    finally:
        worker.stop()


def test_the_same_intent_twice_has_one_effect(deployment: Deployment, outputs: Outputs) -> None:
    worker = WorkerProcess(deployment, "w1").start()
    try:
        start_cluster(deployment, outputs)
        deployment.publish_lines([intent_line(SET_GPU, "vm/spx-proj-b/dev-1")] * 2)
        # The audit records and the command are on partitions of their own, read in any order.
        outputs.wait_for(lambda o: len(o.audits(input__ref="it-gpu-1")) == 2 and o.commands("patch_vm"),
                         what="both audits and the command")
        assert sorted(a["outcome"] for a in outputs.audits(input__ref="it-gpu-1")) == ["accepted", "duplicate"]
        assert len(outputs.commands("patch_vm")) == 1
    finally:
        worker.stop()


@pytest.mark.parametrize("store", ["memory://", "rocksdb://"])
def test_state_survives_a_restart(deployment: Deployment, outputs: Outputs, store: str) -> None:
    """A new worker (in another directory) recovers the tables from their changelogs."""
    env = {"VMSTREAM_WORKER__STORE": store}
    first = WorkerProcess(deployment, "w1", env=env).start()
    try:
        start_cluster(deployment, outputs)
    finally:
        assert first.stop() == 0, first.tail()
    second = WorkerProcess(deployment, "w2", env=env).start()
    try:
        deployment.publish_lines([intent_line(SET_GPU, "vm/spx-proj-b/dev-1")])
        outputs.wait_for(lambda o: o.audits(input__ref="it-gpu-1"), what="the intent's audit")
        [audit] = outputs.audits(input__ref="it-gpu-1")
        assert audit["outcome"] == "accepted", audit  # the VM is known: recovered, not re-read
        # One transaction, two partitions: the reader may see either first.
        outputs.wait_for(lambda o: o.notifications("gpu_change_pending_restart") and o.commands("patch_vm"),
                         what="pending notice and the patch")
        [command] = outputs.commands("patch_vm")
        assert command["base_resource_version"] == "1"
    finally:
        second.stop()


@contextmanager
def two_workers(deployment: Deployment, outputs: Outputs) -> Iterator[None]:
    """Two instances of one group, the cluster published and seen by both: usage is a global
    table, so each must see the other's nodes before deciding."""
    workers = [WorkerProcess(deployment, "w1"), WorkerProcess(deployment, "w2")]
    try:
        for worker in workers:
            worker.start()
        start_cluster(deployment, outputs)
        for worker in workers:
            worker.wait_for_capacity(capacity_after(CLUSTER))
        yield
    finally:
        for worker in workers:
            worker.stop(signal.SIGTERM)


def test_two_instances_decide_a_drain(deployment: Deployment, outputs: Outputs) -> None:
    """Whichever instance owns the node, it sees the node's GPU VMs and the AZ's free cards."""
    with two_workers(deployment, outputs):
        drain = {"intent_id": "it-drain-1", "type": "drain_node", "requested_by": "ops@example.com",
                 "spec": {"node": "gpu-node-1", "reason": "firmware upgrade", "notice_seconds": 2}}
        deployment.publish_lines([intent_line(drain, "node/gpu-node-1")])
        # No applier here: the cluster's cordon, as watched, once the drain asked for it (the
        # route stage reads intents and events apart: published at once, the cordon could be
        # decided first, and the drain would find the node cordoned already).
        outputs.wait_for(lambda o: o.commands("cordon_node"), what="the drain's cordon command")
        deployment.publish_lines(cordon_landed())
        outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) >= 2, what="announcements")
        fates = {n["subject"]["name"]: n["details"]["outcome"] for n in outputs.notifications("drain_will_stop_gpu_vm")}
        assert fates == {"train-1": "returns_automatically", "batch-1": "needs_manual_start"}
        outputs.wait_for(lambda o: len(o.commands("delete_vmi")) >= 2, what="the deadline's stops")
        assert sorted(c["target"]["name"] for c in outputs.commands("delete_vmi")) == ["batch-1", "train-1"]
        assert [c["type"] for c in outputs.commands("cordon_node")] == ["cordon_node"]


def test_a_maintenance_plan_s_slot_drains_its_node_through_the_routed_topic(
        deployment: Deployment, outputs: Outputs) -> None:
    """The timer's tick under ``maintenance/<plan>``, then the plan's ``go`` step to the node's
    key: whichever instances own the two keys, the node is cordoned and, the cordon seen, its
    GPU VMs are stopped; the owners were told by the plan, not by the drain."""
    with two_workers(deployment, outputs):
        start = datetime.now(UTC) + timedelta(seconds=5)
        plan = {"intent_id": "it-plan-1", "type": "plan_maintenance", "requested_by": "ops@example.com",
                "spec": {"plan": "fw", "nodes": ["gpu-node-1"], "earliest_start": start.isoformat(),
                         "latest_end": (start + timedelta(hours=2)).isoformat(), "node_duration_seconds": 3600,
                         "notice_seconds": 0, "reason": "firmware upgrade"}}
        deployment.publish_lines([intent_line(plan, "maintenance/fw")])
        outputs.wait_for(lambda o: len(o.notifications("maintenance_planned")) >= 2, what="the owners told")
        assert sorted(n["subject"]["name"] for n in outputs.notifications("maintenance_planned")) == [
            "batch-1", "train-1"]
        outputs.wait_for(lambda o: o.commands("cordon_node"), what="the slot's cordon")
        deployment.publish_lines(cordon_landed())
        outputs.wait_for(lambda o: len(o.commands("delete_vmi")) >= 2, what="the slot's stops")
        assert sorted(c["target"]["name"] for c in outputs.commands("delete_vmi")) == ["batch-1", "train-1"]
        assert outputs.notifications("drain_will_stop_gpu_vm") == []


def test_replay_reproduces_the_audit_stream_and_catches_an_altered_record(
    deployment: Deployment, outputs: Outputs
) -> None:
    from handlers.decide.engine import Engine
    from streams.cli.replaying import replay
    from harness.running import CONFIG
    from streams.common.settings import load_settings

    worker = WorkerProcess(deployment, "w1").start()
    try:
        start_cluster(deployment, outputs)
        deployment.publish_lines([intent_line(SET_GPU, "vm/spx-proj-b/dev-1")])
        deployment.publish_raw("intents", "vm/x/y", b"{not json")
        outputs.wait_for(lambda o: o.audits(input__ref="it-gpu-1") and o.seen["dlq"], what="decisions")
    finally:
        worker.stop()
    engine = Engine(load_settings(CONFIG).rules())
    clean = replay(engine, deployment.kafka, io.StringIO())
    assert clean.clean, clean
    assert clean.matched == len(CLUSTER) + 2

    [audit] = outputs.audits(input__ref="it-gpu-1")
    forged = {**audit, "outcome": "rejected", "reason": "forged"}
    deployment.publish_raw("audit", audit["input"]["key"], json.dumps(forged).encode())
    altered = replay(engine, deployment.kafka, io.StringIO())
    assert [audit_id for audit_id, _ in altered.different] == [audit["audit_id"]]
    assert altered.different[0][1]["outcome"] == ("accepted", "rejected")


def test_a_backlog_waiting_at_start_up_is_decided_in_full(deployment: Deployment, outputs: Outputs) -> None:
    """Every intent published before the worker starts is decided, none skipped."""
    count = 3000
    intents = [{"intent_id": f"backlog-{i}", "type": "set_gpu", "requested_by": "alice@example.com",
                "project": "proj-a", "spec": {"namespace": "spx-proj-a", "name": f"vm-{i}", "gpu_class": None}}
               for i in range(count)]
    deployment.publish_lines(intent_line(value, f"vm/spx-proj-a/vm-{i}") for i, value in enumerate(intents))
    worker = WorkerProcess(deployment, "w1").start()
    try:
        outputs.wait_for(lambda o: len(o.seen["audit"]) >= count, timeout=120, what="every intent audited")
        assert {a["input"]["ref"] for a in outputs.seen["audit"]} == {i["intent_id"] for i in intents}
    finally:
        worker.stop()


def test_a_restarted_worker_decides_its_whole_backlog(deployment: Deployment, outputs: Outputs) -> None:
    """A worker restarted over a backlog decides every waiting intent (streams/worker/faustfixes.py).

    Its tables have rows to recover, and its seek to the committed offsets is slowed down
    (tests/support/crashpoints/), as on a busy broker: the batches fetched meanwhile are
    decided too. Each fix alone is held to its order in tests/test_faustfixes.py.
    """
    first = WorkerProcess(deployment, "w1").start()
    try:
        start_cluster(deployment, outputs)
    finally:
        first.stop()
    count, vms = 5000, ("train-1", "batch-1", "web-1")  # GPU changes on observed VMs: real decisions
    intents = [{"intent_id": f"waiting-{i}", "type": "set_gpu", "requested_by": "alice@example.com",
                "project": "proj-a", "spec": {"namespace": "spx-proj-a", "name": vms[i % len(vms)],
                                              "gpu_class": None if i % 2 else "nvidia-a100"}}
               for i in range(count)]
    deployment.publish_lines(intent_line(value, f"vm/spx-proj-a/{vms[i % len(vms)]}")
                             for i, value in enumerate(intents))
    slow_seek = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])),
                 "VMSTREAM_TEST_SEEK_DELAY": "1.5"}
    second = WorkerProcess(deployment, "w2", env=slow_seek).start()
    try:
        def waiting_decided(o: Outputs) -> set[str]:
            return {a["input"]["ref"] for a in o.seen["audit"] if a["input"]["ref"].startswith("waiting-")}

        outputs.wait_for(lambda o: len(waiting_decided(o)) >= count, timeout=60, what="every waiting intent audited")
        assert waiting_decided(outputs) == {i["intent_id"] for i in intents}
    finally:
        second.stop()
