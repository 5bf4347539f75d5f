"""The fault suite's own tools: a workload whose answers are known, and a reader of its own.

What is counted is read here with a plain consumer of the suite's own, never with the
worker's: :class:`Ledger` reads the commands, notifications and audit records from the start
of their topics and keeps every distinct content seen under each id. An intent is *lost*
when no audit record names it; an id has *two contents* when two records carry it with
different bytes (a repeat with the same bytes is what consumers drop).

:class:`Workload` is an AZ of many VMs and set_gpu intents that each VM's sequence never
repeats (RTX, then A100, then none), with GPU VMIs arriving on nodes (resident updates
forwarded to the node's partition) and drains with a short notice (deadline ticks) mixed
in. Without faults every id in it has exactly one content, so any second content is a
fault's doing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from harness.localkafka import probe
from harness.running import Deployment
from samples.cluster import A100, RTX, kubevirt_cr, node, vm, vmi
from streams.common.durable import Delivered, DurableProducer
from streams.common.durable import Record as Outgoing
from tests.support.kafka_io import TopicReader

# The directory whose sitecustomize.py arms the crash points in a worker it is put in front of.
FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crashpoints")
ALICE, OPS = "alice@example.com", "ops@example.com"
IDS = {"commands": "command_id", "notifications": "notification_id", "audit": "audit_id"}

Record = tuple[str, str, dict[str, Any]]  # logical topic, key, value


def worker_env(**extra: str) -> dict[str, str]:
    """A worker that notices a killed predecessor in seconds, not in Faust's 60 s, and takes
    intents at their word (no credentials in this workload)."""
    return {"BROKER_SESSION_TIMEOUT": "6", "BROKER_HEARTBEAT_INTERVAL": "1",
            "VMSTREAM_AUTH__MODE": "none", **extra}


def with_faults(**extra: str) -> dict[str, str]:
    """A worker with ``tests/support/crashpoints/sitecustomize.py`` loaded, the fault chosen by ``extra``."""
    path = os.pathsep.join(filter(None, [FAULTS, os.environ.get("PYTHONPATH")]))
    return worker_env(PYTHONPATH=path, **extra)


def _event(type_: str, obj: dict[str, Any], number: int) -> Record:
    metadata = obj["metadata"]
    key = "/".join(p for p in (obj["kind"], metadata.get("namespace"), metadata["name"]) if p)
    value = {"event_id": f"chaos-ev-{number:06d}", "type": type_, "kind": obj["kind"], "object": obj,
             "observed_at": "2026-12-01T00:00:00Z"}
    return "k8s-events", key, value


@dataclass
class Workload:
    """``vms`` VMs that take three set_gpu intents each, and ``drains`` GPU nodes drained."""

    vms: int
    drains: int = 2
    notice_seconds: int = 3
    tag: str = "chaos"
    intent_ids: list[str] = field(default_factory=list)
    _events: int = 0

    def _next_event(self, type_: str, obj: dict[str, Any]) -> Record:
        self._events += 1
        return _event(type_, obj, self._events)

    def setup(self) -> list[Record]:
        """The AZ: CPU VMs to change, and two GPU VMs per drained node."""
        records = [self._next_event("ADDED", kubevirt_cr()),
                   self._next_event("ADDED", node("cpu-node-1")),
                   self._next_event("ADDED", node("gpu-spare", gpus={RTX: 512, A100: 512}))]
        for d in range(self.drains):
            records.append(self._next_event("ADDED", node(f"gpu-node-{d}", gpus={RTX: 4})))
        for i in range(self.vms):
            records.append(self._next_event("ADDED", vm("spx-proj-a", f"vm-{i}", project="proj-a", owner=ALICE)))
            records.append(self._next_event("ADDED", vmi("spx-proj-a", f"vm-{i}", node_name="cpu-node-1")))
        for d in range(self.drains):
            for g in range(2):
                records.append(self._next_event("ADDED", vm("spx-proj-a", f"gpu-{d}-{g}", project="proj-a",
                                                            owner=ALICE, gpu=RTX)))
        return records

    def stream(self) -> list[Record]:
        """Three rounds of set_gpu over every VM; GPU VMIs arrive and nodes are drained meanwhile."""
        records: list[Record] = []
        rounds = ("nvidia-rtx-pro-6000-bse", "nvidia-a100", None)
        total = len(rounds) * self.vms
        arrivals = {total * (d + 1) // (self.drains + 2): d for d in range(self.drains)}
        drains = {total * (d + 2) // (self.drains + 2): d for d in range(self.drains)}
        n = 0
        for r, gpu_class in enumerate(rounds):
            for i in range(self.vms):
                if n in arrivals:  # a node's GPU VMIs start: resident updates to the node
                    d = arrivals[n]
                    for g in range(2):
                        records.append(self._next_event("ADDED", vmi("spx-proj-a", f"gpu-{d}-{g}",
                                                                     node_name=f"gpu-node-{d}", gpu=RTX,
                                                                     cpu_model="host-passthrough")))
                if n in drains:  # its drain: announcements now, stops at the deadline (a tick)
                    d = drains[n]
                    records.append(self._intent(f"{self.tag}-drain-{d}", "drain_node", OPS, None,
                                                {"node": f"gpu-node-{d}", "reason": "chaos",
                                                 "notice_seconds": self.notice_seconds}))
                records.append(self._intent(f"{self.tag}-{r}-{i}", "set_gpu", ALICE, "proj-a",
                                            {"namespace": "spx-proj-a", "name": f"vm-{i}", "gpu_class": gpu_class}))
                n += 1
        return records

    def _intent(self, intent_id: str, type_: str, by: str, project: str | None, spec: dict[str, Any]) -> Record:
        self.intent_ids.append(intent_id)
        key = f"node/{spec['node']}" if "node" in spec else f"vm/{spec['namespace']}/{spec['name']}"
        value: dict[str, Any] = {"intent_id": intent_id, "type": type_, "requested_by": by, "spec": spec}
        if project:
            value["project"] = project
        return "intents", key, value


class Publisher:
    """Publishes records (``acks=all``, retried until delivered or two minutes are up),
    optionally paced, optionally on a thread."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.producer = DurableProducer(deployment.kafka, client_id="vmstream-chaos-publisher", linger_ms=5)
        self.sent = 0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def publish(self, records: Iterable[Record], *, per_second: float | None = None) -> None:
        started = time.monotonic()
        sent: list[Future[Delivered]] = []
        for topic, key, value in records:
            sent.append(self.producer.send(Outgoing(self.deployment.kafka.topic(topic), key.encode(),
                                                    json.dumps(value).encode())))
            self.sent += 1
            if per_second:
                ahead = started + self.sent / per_second - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)  # pacing the load, not waiting for an outcome
        for future in sent:  # every record acknowledged, or the first failure raised
            future.result()

    def start(self, records: Sequence[Record], *, per_second: float) -> None:
        def run() -> None:
            try:
                self.publish(records, per_second=per_second)
            except BaseException as error:  # reported by join()
                self.error = error

        self._thread = threading.Thread(target=run, name="chaos-publisher", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            assert not self._thread.is_alive(), "the publisher did not finish"
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.producer.close()


class Ledger:
    """Every command, notification and audit record of a deployment, by id and content."""

    def __init__(self, deployment: Deployment) -> None:
        kafka = deployment.kafka
        self.topics = {kafka.topic(name): name for name in IDS}
        self.reader = TopicReader(kafka, self.topics, partitions=kafka.partitions,
                                  config={"reconnect.backoff.max.ms": 1000})
        self.contents: dict[str, set[bytes]] = {}  # id → every distinct content seen
        self.records = 0
        self.audited: dict[str, set[str]] = {}  # input ref → audit outcomes
        self.event_audits = 0  # distinct audit ids of watch events
        self.named: set[str] = set()  # ids of the commands and notifications audit records name

    def poll(self, timeout_ms: int = 200) -> None:
        for record in self.reader.poll(timeout_ms / 1000):
            name = self.topics[record.topic]
            raw = record.value or b""
            value = json.loads(raw)
            ident = value[IDS[name]]
            first = ident not in self.contents
            self.contents.setdefault(ident, set()).add(raw)
            self.records += 1
            if name == "audit":
                self.audited.setdefault(value["input"]["ref"], set()).add(value["outcome"])
                self.named.update([*(value.get("commands") or ()), *(value.get("notifications") or ())])
                if first and value["input"]["topic"].endswith("k8s-events"):
                    self.event_audits += 1

    def wait_until(self, condition: Callable[[Ledger], bool], *, timeout: float, what: str,
                   while_waiting: Callable[[], None] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; {self.summary()}")
            if while_waiting is not None:
                while_waiting()
            self.poll()

    def read_to_end(self, timeout: float = 60.0) -> None:
        """Read everything the topics hold now (every partition up to its end offset, asked
        once) and every command and notification an audit record names. The worker sends
        a decision's audit record and its messages in one batch, but Kafka makes no two
        partitions' records visible at once: the audits can all be in while a message they
        name is not yet. A named message that never comes fails the test here."""
        ends = self.reader.ends()
        deadline = time.monotonic() + timeout
        while not self.reader.caught_up(ends) or self.unseen():
            if time.monotonic() > deadline:
                raise AssertionError(f"not read to the end in {timeout:.0f}s: {len(self.unseen())} messages named "
                                     f"by audit records never seen; {self.summary()}")
            self.poll()

    def unseen(self) -> set[str]:
        """The ids of commands and notifications named by audit records but not read."""
        return self.named - self.contents.keys()

    def missing(self, intent_ids: Iterable[str]) -> list[str]:
        return [i for i in intent_ids if i not in self.audited]

    def two_contents(self) -> dict[str, list[str]]:
        """Ids seen with more than one content, each with its contents (as text)."""
        return {ident: sorted(v.decode() for v in values)
                for ident, values in self.contents.items() if len(values) > 1}

    def summary(self) -> str:
        return (f"{self.records} records, {len(self.contents)} ids, {len(self.audited)} inputs audited, "
                f"{len(self.two_contents())} ids with two contents")

    def close(self) -> None:
        self.reader.close()


def broker_answers(bootstrap: str) -> bool:
    return probe(bootstrap, timeout=1.0)
