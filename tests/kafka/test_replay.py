"""``vmstream replay`` is exact on a clean stream and catches any tampered record.

Two workers and an applier (against a real kube-apiserver, where the scenario's VMs do not
exist: its commands fail there, which is a result like any other) run one stream: the
cluster's events, GPU changes (intents on partitions murmur2 would not pick among them), a
malformed intent, a drain whose deadline fires. ``vmstream replay`` then runs over it as an
operator would: exit 0 on the untouched stream — which holds, as after an ordinary restart
of the watch bridge, events published again (the same event ids, later), each decided again
under its audit id. Then records of the worker and of the applier are dropped
(``DeleteRecords``), forged and altered (a second record under an id, with other content:
Kafka keeps what was written) one after the other, and after each the replay exits 1 and
names the record; an unsealed one is named as such and never taken for the decision.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from handlers.contracts.messages import AuditRecord
from harness.running import CONFIG, Deployment, VmstreamProcess, WorkerProcess, capacity_after
from harness.scenarios import cluster, cordon_landed
from streams.common.codecs import encode_message
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client
from streams.common.settings import KafkaSettings
from streams.common.topics import KIND_HEADER, SOURCE_HEADER
from tests.support.kafka_io import Record as Sent
from tests.support.kafka_io import TopicReader, murmur2, publish
from tests.support.kube_apiserver import Kube

pytestmark = pytest.mark.kafka

CLUSTER = list(cluster().jsonl())
REPLAYED = ("intents", "k8s-events", "worker-routed", "audit", "commands", "notifications", "dlq", "command-results")
REPUBLISHED = 5  # events a restarted watch bridge publishes again in this stream
VMS = [("spx-proj-a", "train-1", "proj-a", "alice@example.com"), ("spx-proj-a", "web-1", "proj-a", "alice@example.com"),
       ("spx-proj-b", "dev-1", "proj-b", "bob@example.com"), ("spx-proj-b", "legacy-1", "proj-b", "bob@example.com")]


@dataclass
class Record:
    topic: str  # logical name
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int
    headers: list[tuple[str, bytes]]

    def json(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.value or b"")
        return value


def read_all(kafka: KafkaSettings) -> list[Record]:
    """Every record of the replayed topics, read to their end offsets by the test itself."""
    reader = TopicReader(kafka, [kafka.topic(name) for name in REPLAYED], partitions=kafka.partitions)
    try:
        names = {kafka.topic(name): name for name in REPLAYED}
        records = [Record(names[r.topic], r.partition, r.offset, r.key, r.value, r.timestamp, list(r.headers))
                   for r in reader.read_to_end(stall=60)]
        return sorted(records, key=lambda r: (r.topic, r.partition, r.offset))
    finally:
        reader.close()


def run_replay(deployment: Deployment) -> subprocess.CompletedProcess[str]:
    env = deployment.env(0)
    return subprocess.run([sys.executable, "-m", "streams.cli.main", "replay", "--config", str(CONFIG)],
                          env=env, capture_output=True, text=True, timeout=300)


def intent(key: str, value: dict[str, Any]) -> tuple[str, bytes]:
    return key, json.dumps(value).encode()


@pytest.fixture(scope="module")
def stream(kafka_bootstrap: str, kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, list[Record]]]:
    """The recorded stream of two workers and an applier, once for the module."""
    deployment = Deployment(kafka_bootstrap, tmp_path_factory.mktemp("replay"))
    deployment.create_topics()
    kafka = deployment.kafka
    workers = [WorkerProcess(deployment, "w1"), WorkerProcess(deployment, "w2")]
    applier = VmstreamProcess(deployment, "apply", ["apply", "--config", str(CONFIG), "--kubeconfig",
                                                    str(kube.kubeconfig)])
    try:
        for worker in workers:
            worker.start()
        applier.start()
        deployment.publish_lines(CLUSTER)
        # Every GPU fact of the cluster decided and seen by both workers before any intent:
        # both GPU nodes' cards (total) and the GPU VMIs on them (free). Free cards alone were
        # reached by gpu-node-1 before its VMIs were known, and a drain decided before
        # gpu-node-2 was seen counted 0 cards where replay, in record time order, counted 2.
        for worker in workers:
            worker.wait_for_capacity(capacity_after(CLUSTER), 90)
        sent = []
        for i, (ns, name, project, by) in enumerate(VMS):
            key = f"vm/{ns}/{name}"
            value = {"intent_id": f"it-{name}", "type": "set_gpu", "requested_by": by, "project": project,
                     "spec": {"namespace": ns, "name": name, "gpu_class": None if i % 2 else "nvidia-a100"}}
            wrong = ((murmur2(key.encode()) & 0x7FFFFFFF) + 1 + i) % kafka.partitions
            sent.append(Sent(kafka.topic("intents"), key.encode(), json.dumps(value).encode(), partition=wrong))
        sent.append(Sent(kafka.topic("intents"), b"vm/spx-proj-a/web-1", b"{not json"))
        drain = {"intent_id": "it-drain-1", "type": "drain_node", "requested_by": "ops@example.com",
                 "spec": {"node": "gpu-node-1", "reason": "firmware upgrade", "notice_seconds": 2}}
        sent.append(Sent(kafka.topic("intents"), b"node/gpu-node-1", json.dumps(drain).encode()))
        publish(kafka, sent)
        deployment.publish_lines(cordon_landed())  # no watch bridge here: the applier's cordon, as watched

        def unsettled() -> list[str]:
            """What the stream still lacks: nothing once it has settled."""
            records = read_all(kafka)
            commands = {r.json()["command_id"] for r in records if r.topic == "commands"}
            results = {r.json()["command_id"] for r in records if r.topic == "command-results"}
            stops = [r for r in records if r.topic == "commands" and r.json()["type"] == "delete_vmi"]
            audited = {r.json()["input"]["ref"] for r in records if r.topic == "audit"}
            lacking = {
                f"the drain's stops ({len(stops)} of 2)": len(stops) >= 2,
                f"results of {sorted(commands - results)}": commands <= results,
                f"audits of {sorted({f'it-{n}' for _, n, _, _ in VMS} - audited)}":
                    {f"it-{n}" for _, n, _, _ in VMS} <= audited,
                "the dead letter": any(r.topic == "dlq" for r in records),
            }
            return [what for what, there in lacking.items() if not there]

        deadline = time.monotonic() + 120
        while lacking := unsettled():
            assert time.monotonic() < deadline, f"the stream never settled: it lacks {'; '.join(lacking)}"
            time.sleep(0.5)  # polling interval
        republish_as_a_restarted_watch_bridge(kafka)
        for process in (*workers, applier):
            process.check_running()
    finally:
        for process in (applier, *workers):
            process.stop()
    records = read_all(kafka)
    yield deployment, records
    deployment.delete_topics()


def republish_as_a_restarted_watch_bridge(kafka: KafkaSettings) -> None:
    """What a watch bridge started again does to a stream: the objects' current states
    published once more, as they were (the same values, event ids and headers), later; and
    each decided again — wait for their audit records."""
    records = read_all(kafka)
    latest = {r.key: r for r in records if r.topic == "k8s-events"}  # each object's current state
    again = [latest[key] for key in sorted(latest, key=lambda key: key or b"")][:REPUBLISHED]
    audited = sum(r.topic == "audit" for r in records)
    time.sleep(1.1)  # a restart takes a while: their times differ from the first decisions' by seconds
    publish(kafka, [Sent(kafka.topic("k8s-events"), record.key, record.value, record.headers) for record in again])
    deadline = time.monotonic() + 60
    while sum(r.topic == "audit" for r in read_all(kafka)) < audited + len(again):
        assert time.monotonic() < deadline, "the events published again were not decided"
        time.sleep(0.5)  # polling interval


def test_a_clean_stream_of_two_workers_and_an_applier_replays_with_no_difference(
    stream: tuple[Deployment, list[Record]]
) -> None:
    deployment, records = stream
    routed_kinds = {dict(r.headers).get(KIND_HEADER) for r in records if r.topic == "worker-routed"}
    assert {b"intent", b"event", b"tick"} <= routed_kinds  # routed intents, events and a deadline
    assert any(r.topic == "command-results" for r in records)
    # The events published again were decided again under their first decisions' ids, later.
    times: dict[str, set[str]] = {}
    for record in records:
        if record.topic == "audit":
            times.setdefault(record.json()["audit_id"], set()).add(record.json()["at"])
    assert sum(len(at) > 1 for at in times.values()) >= REPUBLISHED
    assert all(record.json().get("mac") for record in records if record.topic == "audit")  # all sealed
    replayed = run_replay(deployment)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert " 0 different, 0 missing from the audit stream, 0 recorded but not reproduced, 0 other" in replayed.stdout
    commands = {r.json()["command_id"] for r in records if r.topic == "commands"}
    assert f"{len(commands)} commands' results checked" in replayed.stdout


def first(records: list[Record], topic: str, match: Callable[[dict[str, Any]], bool] = lambda _: True) -> Record:
    return next(r for r in records if r.topic == topic and match(r.json()))


def altered(record: Record, **changes: Any) -> bytes:
    return json.dumps({**record.json(), **changes}).encode()


def test_a_record_dropped_forged_or_altered_is_reported_and_exits_1(stream: tuple[Deployment, list[Record]]) -> None:
    deployment, _ = stream
    kafka = deployment.kafka
    admin = admin_client(kafka, client_id="vmstream-tests")

    def drop(topic: str, match: Callable[[Record], bool] = lambda _: True) -> Record:
        """Drop the first record of a partition (of those that match): DeleteRecords."""
        records = [r for r in read_all(kafka) if r.topic == topic]
        heads = [r for r in records if r is next(x for x in records if x.partition == r.partition)]
        record = next(r for r in heads if match(r))
        deleted = admin.delete_records([TopicPartition(kafka.topic(topic), record.partition, record.offset + 1)],
                                       request_timeout=ADMIN_SECONDS)
        for answer in deleted.values():
            answer.result()
        return record

    def write(topic: str, key: bytes | None, value: bytes) -> None:
        publish(kafka, [Sent(kafka.topic(topic), key, value)])

    keyring = deployment.signing.keyring()

    def sealed(value: bytes) -> bytes:
        """An audit record sealed with the deployment's key, as only the worker and the applier can."""
        return encode_message(AuditRecord.model_validate_json(value), keyring=keyring)

    def reported(named: str) -> None:
        replayed = run_replay(deployment)
        assert replayed.returncode == 1, replayed.stdout + replayed.stderr
        assert named in replayed.stdout, replayed.stdout

    clean = run_replay(deployment)
    assert clean.returncode == 0, clean.stdout + clean.stderr

    # Dropped: a notification of the worker, a result of the applier.
    notice = drop("notifications", lambda r: r.json()["type"] != "command_failed").json()
    reported(f"notifications {notice['notification_id']}: decided again, but not recorded")
    unapplied = drop("command-results").json()["command_id"]
    reported(f"command {unapplied}: no result")

    records = read_all(kafka)
    # Forged: a command the worker never decided, a second result for a command.
    command = first(records, "commands")
    write("commands", command.key, altered(command, command_id="cmd-forged", cause="nobody"))
    reported("commands cmd-forged: recorded, but decided by nobody")
    result = first(records, "command-results")
    twice = result.json()["command_id"]
    write("command-results", result.key, altered(result, outcome="noop", error=None))
    reported(f"command {twice}: 2 different results")

    # Forged: a "rejected" beside an accepted intent's record, unsealed as anyone could write
    # it: named as unsealed, and not taken for the decision (which is not "different").
    audit = first(records, "audit", lambda a: a["input"]["ref"] == "it-train-1")
    where = f"{kafka.topic('intents')} vm/spx-proj-a/train-1 it-train-1"
    forged = {k: v for k, v in json.loads(altered(audit, outcome="rejected", reason="forged")).items() if k != "mac"}
    write("audit", audit.key, json.dumps(forged).encode())
    replayed = run_replay(deployment)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert (f"audit {audit.json()['audit_id']} [{where}]: not sealed by the worker or an applier "
            "(it carries no MAC): ignored") in replayed.stdout, replayed.stdout
    assert " 0 different, " in replayed.stdout and "1 unsealed audit records ignored" in replayed.stdout

    # Altered by a holder of the key (sealed): a difference, its line naming the input.
    write("audit", audit.key, sealed(altered(audit, outcome="rejected", reason="forged")))
    reported(f"{audit.json()['audit_id']} [{where}] outcome: replayed 'accepted', recorded 'rejected'")
    # Altered: a command's target, an audit record of the applier.
    stop = first(records, "commands", lambda c: c["type"] == "delete_vmi")
    write("commands", stop.key, altered(stop, target={**stop.json()["target"], "name": "someone-else"}))
    reported(f"commands {stop.json()['command_id']}: recorded otherwise (target)")
    applied = first(records, "audit", lambda a: a["input"]["topic"] == kafka.topic("commands")
                    and a["input"]["ref"] not in (unapplied, twice))
    write("audit", applied.key, sealed(altered(applied, reason="all went well")))
    reported(f"audit {applied.json()['audit_id']}: not the record of command {applied.json()['input']['ref']}")

    # The routed copy of an input dropped: that input was never routed.
    routed = drop("worker-routed", lambda r: dict(r.headers).get(KIND_HEADER) in (b"event", b"intent"))
    origin = json.loads(dict(routed.headers)[SOURCE_HEADER])
    reported(f"input {origin['topic']}:{origin['partition']}:{origin['offset']} was never routed")
