"""The watch bridge on a real kube-apiserver and a real broker: what happens in the API
server arrives on ``k8s-events`` — relisted, live, after a 410 and across a network cut.

Each test has its own topics (a :class:`~harness.running.Deployment`) and reads them back
with a consumer, polling until a condition holds or a deadline passes.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import ipaddress
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from kubernetes import client, config

from handlers.decide.engine import Result, Source
from handlers.rules.capacity import capacity
from tests.support.harness import EVENTS_TOPIC
from handlers.contracts.ids import watch_event_id
from handlers.contracts.messages import ORIGINAL_PREFIX_BYTES, DeadLetter, WatchEvent, object_key
from handlers.contracts.tracing import ce_time, derived_trace
from handlers.core.tables import VMS
from streams.common import metrics
from streams.common.durable import DurableProducer
from harness.localkubevirt import vm_subresource
from harness.processes import free_ports
from harness.running import Deployment, VmstreamProcess
from samples.cluster import RTX, instancetype_revision, node, vm
from streams.common.settings import KafkaSettings
from streams.kube.watching import (
    DLQ_TOPIC,
    REDUCED_HEADER,
    TOPIC,
    Bridge,
    Publisher,
    Watcher,
    load_limits,
    message_limit,
    select_kinds,
)
from tests.support.harness import Harness
from tests.support.kafka_broker import set_topic_config
from tests.support.kafka_io import TopicReader, stored_bytes
from tests.support.kube_apiserver import Kube, as_others_write_it, minimal_vm, reconciled_vm

pytestmark = [pytest.mark.kube, pytest.mark.kafka]

KUBEVIRT = ("kubevirt.io", "v1")
NM = ("nodemaintenance.medik8s.io", "v1beta1", "nodemaintenances")
DEADLINE = 60.0
ALICE, OPS = "alice@example.com", "ops@example.com"


# ------------------------------------------------------------------------- helpers


def own_annotations(obj: dict[str, Any]) -> dict[str, str]:
    """The object's annotations less KubeVirt's own."""
    return {k: v for k, v in (obj["metadata"].get("annotations") or {}).items() if "kubevirt.io/" not in k}


def _as_the_test_wrote_it(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The object less what KubeVirt writes, and less the mark of a deletion under way."""
    written = as_others_write_it(obj)
    if written is not None:
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            written["metadata"].pop(key, None)
    return written


class Events:
    """Everything on the deployment's k8s-events topic (or ``topic``), in arrival order (per
    key: in order).

    ``of``, ``types`` and ``headers_of`` leave out KubeVirt's own writes: virt-controller
    writes every VM it sees (its finalizer, annotations and status), and a MODIFIED event that
    changed nothing but those is not one of the test's changes. ``seen`` has every event.
    """

    def __init__(self, kafka: KafkaSettings, topic: str = TOPIC) -> None:
        self.reader = TopicReader(kafka, [kafka.topic(topic)], partitions=kafka.partitions)
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.headers: list[dict[str, bytes]] = []  # each seen event's headers, in the same order

    def poll(self) -> None:
        for record in self.reader.poll(0.2):
            self.seen.append(((record.key or b"").decode(), json.loads(record.value or b"")))
            self.headers.append(dict(record.headers))

    def read_to_end(self, timeout: float = DEADLINE) -> None:
        """Poll until every record on the topic now is read."""
        ends = self.reader.ends()
        deadline = time.monotonic() + timeout
        while not self.reader.caught_up(ends):
            if time.monotonic() > deadline:
                raise AssertionError("timed out reading the topic to its end")
            self.poll()

    def _changes(self, key: str) -> list[int]:
        """Where the key's events are in ``seen``, less KubeVirt's own writes."""
        kept: list[int] = []
        previous: tuple[Any, Any] = (None, None)  # (resourceVersion, the object as the test wrote it)
        for index, (k, value) in enumerate(self.seen):
            if k != key:
                continue
            obj = value.get("object") or {}  # a dead letter has none
            current = ((obj.get("metadata") or {}).get("resourceVersion"), _as_the_test_wrote_it(obj) if obj else None)
            # A new version with nothing of the test's changed: KubeVirt's. (A version published
            # again is the same event, and kept.)
            if not (value.get("type") == "MODIFIED" and current[0] != previous[0] and current[1] == previous[1]):
                kept.append(index)
            previous = current
        return kept

    def headers_of(self, key: str) -> list[dict[str, bytes]]:
        return [self.headers[index] for index in self._changes(key)]

    def of(self, key: str) -> list[dict[str, Any]]:
        return [self.seen[index][1] for index in self._changes(key)]

    def types(self, key: str) -> list[str]:
        return [value["type"] for value in self.of(key)]

    def wait_for(self, condition: Callable[[Events], object], what: str, timeout: float = DEADLINE) -> None:
        """Poll until ``condition`` holds: true, or what it looks for found."""
        deadline = time.monotonic() + timeout
        while not condition(self):
            if time.monotonic() > deadline:
                summary: dict[str, list[str]] = {}
                for key, value in self.seen:
                    summary.setdefault(key, []).append(value["type"])
                raise AssertionError(f"timed out waiting for {what}; seen {summary}")
            self.poll()

    def close(self) -> None:
        self.reader.close()


CE_HEADERS = {"ce_specversion", "ce_id", "ce_type", "ce_source", "ce_time", "content-type", "traceparent"}


def assert_envelope(event: dict[str, Any], headers: dict[str, bytes], source: str = "/vmstream/watch/vmstream") -> None:
    """A watch event's CloudEvents headers: named by its event_id, in a trace derived from it."""
    assert CE_HEADERS <= set(headers), headers
    event_id = event["event_id"]
    assert headers["ce_specversion"] == b"1.0" and headers["content-type"] == b"application/json"
    assert headers["ce_id"].decode() == event_id
    assert headers["ce_type"].decode() == f"io.vmstream.watch-event.{event['kind'].lower()}.{event['type'].lower()}"
    assert headers["ce_source"].decode() == source
    assert headers["traceparent"].decode() == derived_trace(event_id).child(event_id)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling interval


@contextlib.contextmanager
def running(bridge: Bridge) -> Iterator[threading.Thread]:
    """Run the bridge on a thread for the block; stop it and wait for it afterwards."""
    stop = threading.Event()
    thread = threading.Thread(target=bridge.run, args=(stop,), name="bridge")
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "the bridge did not stop"


def synced(bridge: Bridge) -> bool:
    """Every watcher has listed and had its list acknowledged by Kafka."""
    return all(watcher.resource_version is not None for watcher in bridge.watchers.values())


def kube_configuration(kube: Kube, via: int | None = None) -> client.Configuration:
    """The bridge's configuration; ``via`` a loopback port that relays to the API server."""
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kube.kubeconfig), client_configuration=configuration)
    if via is not None:
        server = urlsplit(configuration.host).hostname or ""
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(server)
            server = ""
        if server:  # a named server (KUBECONFIG): its certificate names it, not the relay
            configuration.tls_server_name = server
        configuration.host = f"https://127.0.0.1:{via}"
    return configuration


def uid() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def deployment(kafka_bootstrap: str, tmp_path: Path) -> Deployment:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    deployment.create_topics()
    return deployment


@pytest.fixture
def events(deployment: Deployment) -> Iterator[Events]:
    reader = Events(deployment.kafka)
    yield reader
    reader.close()


class Cluster:
    """Writes to the API server directly (never through the bridge's connection)."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.cleanup: list[Callable[[], object]] = []

    def create_vm(self, name: str) -> dict[str, Any]:
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(
            *KUBEVIRT, self.namespace, "virtualmachines", minimal_vm(name)
        )
        return created

    def annotate_vm(self, name: str, value: str) -> dict[str, Any]:
        patched: dict[str, Any] = self.custom.patch_namespaced_custom_object(
            *KUBEVIRT, self.namespace, "virtualmachines", name,
            {"metadata": {"annotations": {"test/touched": value}}},
        )
        return patched

    def delete_vm(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(*KUBEVIRT, self.namespace, "virtualmachines", name)

    def create_node(self, name: str) -> None:
        self.core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))
        self.cleanup.append(lambda: self.core.delete_node(name))

    def create_node_maintenance(self, name: str, node: str) -> None:
        body = {
            "apiVersion": f"{NM[0]}/{NM[1]}",
            "kind": "NodeMaintenance",
            "metadata": {"name": name},
            "spec": {"nodeName": node, "reason": "replace a GPU"},
        }
        self.custom.create_cluster_custom_object(*NM, body)
        self.cleanup.append(lambda: self.custom.delete_cluster_custom_object(*NM, name))

    def close(self) -> None:
        for undo in reversed(self.cleanup):
            with contextlib.suppress(client.ApiException):  # already deleted by the test
                undo()


@pytest.fixture
def cluster(api: client.ApiClient, kube_namespace: str) -> Iterator[Cluster]:
    writer = Cluster(api, kube_namespace)
    yield writer
    writer.close()


# ------------------------------------------------------------------------- a relist


def test_existing_objects_are_published_as_relisted_with_contract_keys(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    ns, suffix = cluster.namespace, uid()
    created_vm = cluster.create_vm("vm-a")
    cluster.custom.create_namespaced_custom_object(
        *KUBEVIRT, ns, "virtualmachineinstances",
        {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "vmi-a"},
         "spec": {"domain": {"devices": {}, "memory": {"guest": "128Mi"}}}},
    )
    kubevirt = cluster.custom.create_namespaced_custom_object(
        *KUBEVIRT, ns, "kubevirts",
        {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {"name": "kubevirt"}, "spec": {}},
    )
    cluster.create_node(f"node-{suffix}")
    cluster.create_node_maintenance(f"nm-{suffix}", f"node-{suffix}")
    assert created_vm["metadata"]["managedFields"], "the API server records field managers"
    keys = {
        f"VirtualMachine/{ns}/vm-a": "VirtualMachine",
        f"VirtualMachineInstance/{ns}/vmi-a": "VirtualMachineInstance",  # apart: a VM adopts its namesake
        f"KubeVirt/{ns}/kubevirt": "KubeVirt",
        f"Node/node-{suffix}": "Node",
        f"NodeMaintenance/nm-{suffix}": "NodeMaintenance",
        f"Namespace/{ns}": "Namespace",  # its project label says where VMs may be created
    }

    bridge = Bridge(deployment.kafka, kube_configuration(kube), app_id="az1")
    with running(bridge):
        events.wait_for(lambda e: all(e.types(key) for key in keys), "a RELISTED event for each object")

    for key, kind in keys.items():
        assert events.types(key) == ["RELISTED"], key
        event = WatchEvent.model_validate(events.of(key)[0])
        assert event.kind == kind
        assert event.object["kind"] == kind  # core lists leave it out; the bridge puts it back
        metadata = event.object["metadata"]
        assert "managedFields" not in metadata
        assert object_key(kind, metadata.get("namespace"), metadata["name"]) == key
        assert event.event_id == watch_event_id(
            kind, metadata.get("namespace"), metadata["name"], metadata["resourceVersion"], "RELISTED"
        )
    vm_event = events.of(f"VirtualMachine/{ns}/vm-a")[0]
    assert vm_event["object"]["spec"] == created_vm["spec"]
    assert vm_event["observed_at"].endswith("Z")
    for (_, value), headers in zip(events.seen, events.headers, strict=True):  # others' objects included
        WatchEvent.model_validate(value)
        assert "managedFields" not in value["object"]["metadata"]
        assert_envelope(value, headers, source="/vmstream/watch/az1")
    # Its time is the object's last write as the API server recorded it, not when it was seen.
    # The KubeVirt object's: nobody writes it after its creation here, while virt-controller
    # may write the VM's status a second after it was created.
    written = max(entry["time"] for entry in kubevirt["metadata"]["managedFields"])
    [kubevirt_headers] = events.headers_of(f"KubeVirt/{ns}/kubevirt")
    assert kubevirt_headers["ce_time"].decode() == ce_time(datetime.fromisoformat(written))


def test_only_the_instance_types_kubevirt_stored_for_vms_are_watched_among_controller_revisions(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    """ControllerRevisions are every StatefulSet's and DaemonSet's too: the bridge lists and
    watches only those labelled with an instance type's kind (WATCHED_KINDS' label selector)."""
    ns = cluster.namespace
    apps = client.AppsV1Api(cluster.custom.api_client)
    stored = instancetype_revision(ns, "vm-a", "vm-a-u1-gpu-1", instancetype="u1-gpu", gpus=[RTX])
    for field in ("uid", "resourceVersion"):
        del stored["metadata"][field]
    stored["metadata"]["ownerReferences"] = []
    apps.create_namespaced_controller_revision(ns, stored)
    apps.create_namespaced_controller_revision(ns, {"apiVersion": "apps/v1", "kind": "ControllerRevision",
                                                    "metadata": {"name": "web-5d8f", "labels": {"app": "web"}},
                                                    "data": {"spec": {}}, "revision": 1})
    bridge = Bridge(deployment.kafka, kube_configuration(kube), app_id="az1")
    with running(bridge):
        events.wait_for(lambda e: e.types(f"ControllerRevision/{ns}/vm-a-u1-gpu-1"), "the instance type's revision")
        apps.create_namespaced_controller_revision(ns, {**stored, "metadata": {**stored["metadata"],
                                                                               "name": "vm-a-u1-gpu-2"}})
        events.wait_for(lambda e: e.types(f"ControllerRevision/{ns}/vm-a-u1-gpu-2"), "a new one, watched")
    assert events.types(f"ControllerRevision/{ns}/vm-a-u1-gpu-1") == ["RELISTED"]
    assert events.types(f"ControllerRevision/{ns}/vm-a-u1-gpu-2") == ["ADDED"]
    assert events.of(f"ControllerRevision/{ns}/vm-a-u1-gpu-1")[0]["object"]["data"]["spec"]["gpus"] == [
        {"name": "gpu-0", "deviceName": RTX}]
    assert events.types(f"ControllerRevision/{ns}/web-5d8f") == []


# ------------------------------------------------------------------------- live changes


def test_changes_while_running_arrive_in_order_per_key(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    ns, suffix = cluster.namespace, uid()
    node, maintenance = f"node-{suffix}", f"nm-{suffix}"
    bridge = Bridge(deployment.kafka, kube_configuration(kube),
                    kinds=select_kinds("VirtualMachine,Node,NodeMaintenance"))
    with running(bridge):
        wait_until(lambda: synced(bridge), "the first lists")

        cluster.create_vm("vm-b")
        cluster.annotate_vm("vm-b", "1")
        cluster.delete_vm("vm-b")
        cluster.create_node(node)
        cluster.core.patch_node(node, {"spec": {"unschedulable": True}})  # cordon
        cluster.core.delete_node(node)
        cluster.create_node_maintenance(maintenance, node)
        cluster.custom.patch_cluster_custom_object(*NM, maintenance, {"metadata": {"labels": {"x": "y"}}})
        cluster.custom.delete_cluster_custom_object(*NM, maintenance)

        keys = [f"VirtualMachine/{ns}/vm-b", f"Node/{node}", f"NodeMaintenance/{maintenance}"]
        events.wait_for(lambda e: all("DELETED" in e.types(key) for key in keys), "the three deletions")

    for key in keys:
        assert events.types(key) == ["ADDED", "MODIFIED", "DELETED"], key
        versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events.of(key)]
        assert versions == sorted(versions), key
        assert len({e["event_id"] for e in events.of(key)}) == 3
    assert own_annotations(events.of(f"VirtualMachine/{ns}/vm-b")[1]["object"]) == {"test/touched": "1"}
    assert events.of(f"Node/{node}")[1]["object"]["spec"]["unschedulable"] is True
    assert events.of(f"NodeMaintenance/{maintenance}")[1]["object"]["metadata"]["labels"] == {"x": "y"}


def test_a_bookmark_only_moves_the_resume_point(deployment: Deployment, events: Events) -> None:
    """The API server sends bookmarks about once a minute, too rarely to wait for here: the
    watcher is fed a stream's events directly, and publishes to the real broker."""
    watcher = Watcher(select_kinds("VirtualMachine")[0])
    watcher.resource_version = "100"
    obj = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
           "metadata": {"name": "vm-c", "namespace": "ns", "resourceVersion": "101"}}
    kafka_producer = DurableProducer(deployment.kafka, client_id="watch-test")
    try:
        publisher = Publisher(kafka_producer, deployment.kafka.topic(TOPIC))
        watcher._on_event({"type": "MODIFIED", "object": obj}, publisher)
        watcher._on_event({"type": "BOOKMARK", "object": {"kind": "VirtualMachine",
                                                          "metadata": {"resourceVersion": "150"}}}, publisher)
        assert watcher.resource_version == "100"  # nothing applies before Kafka has it
        watcher._settle(block=True)
    finally:
        kafka_producer.close()

    assert watcher.resource_version == "150"
    assert watcher.stats.bookmarks == 1
    assert dict(watcher.stats.published) == {"MODIFIED": 1}
    assert list(watcher.known) == ["VirtualMachine/ns/vm-c"]
    events.wait_for(lambda e: bool(e.seen), "the one event")
    assert [(key, value["type"]) for key, value in events.seen] == [("VirtualMachine/ns/vm-c", "MODIFIED")]


def test_a_republished_event_has_the_very_headers_it_had(deployment: Deployment, events: Events) -> None:
    """A watch resumed before an unacknowledged event publishes it again: same id, same headers."""
    obj = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
           "metadata": {"name": "vm-r", "namespace": "ns", "resourceVersion": "7",
                        "creationTimestamp": "2026-11-30T06:00:00Z",
                        "managedFields": [{"manager": "a", "time": "2026-11-30T06:10:00Z"},
                                          {"manager": "b", "time": "2026-11-30T06:20:05Z"}]}}
    kafka_producer = DurableProducer(deployment.kafka, client_id="watch-test")
    try:
        publisher = Publisher(kafka_producer, deployment.kafka.topic(TOPIC), source="/vmstream/watch/az9")
        for _ in range(2):
            publisher.send(select_kinds("VirtualMachine")[0], "MODIFIED", json.loads(json.dumps(obj))).future.result(30)
    finally:
        kafka_producer.close()

    events.wait_for(lambda e: len(e.seen) == 2, "both copies")
    first, second = events.headers_of("VirtualMachine/ns/vm-r")
    assert first == second
    event = events.of("VirtualMachine/ns/vm-r")[0]
    assert_envelope(event, first, source="/vmstream/watch/az9")
    assert first["ce_type"] == b"io.vmstream.watch-event.virtualmachine.modified"
    assert first["ce_time"] == b"2026-11-30T06:20:05Z"  # its last write, not when it was observed


# ------------------------------------------------------------------------- 410 Gone


def test_after_410_gone_the_relist_publishes_deletions_that_happened_while_away(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    ns = cluster.namespace
    keep, gone = f"VirtualMachine/{ns}/vm-keep", f"VirtualMachine/{ns}/vm-gone"
    cluster.create_vm("vm-keep")
    cluster.create_vm("vm-gone")
    bridge = Bridge(deployment.kafka, kube_configuration(kube), kinds=select_kinds("VirtualMachine"))
    watcher = bridge.watchers["VirtualMachine"]
    with running(bridge):
        events.wait_for(lambda e: bool(e.types(keep) and e.types(gone)), "the first relist")
        wait_until(lambda: synced(bridge), "the first relist acknowledged")
    last_seen = events.of(gone)[0]["object"]

    # While the bridge is away: a deletion, a change, a creation...
    cluster.delete_vm("vm-gone")
    cluster.annotate_vm("vm-keep", "while-away")
    cluster.create_vm("vm-new")
    # ...and its resourceVersion is too old to resume from: the API server answers 410.
    watcher.resource_version = "1"

    with running(bridge):
        events.wait_for(lambda e: "DELETED" in e.types(gone), "the deletion seen by the relist")
        events.wait_for(lambda e: len(e.types(keep)) == 2 and bool(e.types(f"VirtualMachine/{ns}/vm-new")),
                        "the relisted state")

    assert watcher.stats.gone == 1
    assert watcher.stats.relists == 2
    assert events.types(gone) == ["RELISTED", "DELETED"]
    deleted = events.of(gone)[1]
    assert deleted["object"] == last_seen  # the last object the bridge knew
    assert deleted["event_id"] == watch_event_id(
        "VirtualMachine", ns, "vm-gone", last_seen["metadata"]["resourceVersion"], "DELETED"
    )
    assert events.types(keep) == ["RELISTED", "RELISTED"]
    assert own_annotations(events.of(keep)[1]["object"]) == {"test/touched": "while-away"}
    assert events.types(f"VirtualMachine/{ns}/vm-new") == ["RELISTED"]
    assert set(watcher.known) >= {keep, f"VirtualMachine/{ns}/vm-new"}
    assert gone not in watcher.known


# ------------------------------------------------------------------------- a network cut


class TcpProxy:
    """A loopback TCP relay to the API server that can be cut (connections reset, new ones
    refused) and restored on the same port: a network outage, seen from the bridge."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        probe = socket.create_server(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.accepted = 0
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    def open(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def cut(self) -> None:
        """Stop listening and reset every relayed connection."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            doomed, self._sockets = self._sockets, set()
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                downstream, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                downstream.close()
                continue
            with self._lock:
                self.accepted += 1
                self._sockets |= {downstream, upstream}
            for source, sink in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets -= {source, sink}
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


@pytest.fixture
def proxy(kube: Kube) -> Iterator[TcpProxy]:
    server = urlsplit(kube_configuration(kube).host)
    relay = TcpProxy((server.hostname or "127.0.0.1", server.port or 443))
    relay.open()
    yield relay
    relay.cut()


def test_the_bridge_survives_a_network_cut_and_resumes_without_losing_events(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster, proxy: TcpProxy
) -> None:
    ns = cluster.namespace
    before, live, during = (f"VirtualMachine/{ns}/{name}" for name in ("vm-before", "vm-live", "vm-during"))
    cluster.create_vm("vm-before")
    bridge = Bridge(deployment.kafka, kube_configuration(kube, via=proxy.port),
                    kinds=select_kinds("VirtualMachine"))
    watcher = bridge.watchers["VirtualMachine"]
    api_errors = {"kind": "VirtualMachine", "source": "api"}
    errors_before = metrics.registry("watch").get_sample_value("vmstream_watch_errors_total", api_errors) or 0.0
    with running(bridge) as thread:
        events.wait_for(lambda e: bool(e.types(before)), "the first relist")
        cluster.create_vm("vm-live")
        events.wait_for(lambda e: bool(e.types(live)), "an event through the established watch")

        proxy.cut()
        wait_until(lambda: watcher.stats.failures >= 2, "the bridge failing to reconnect")
        cluster.annotate_vm("vm-live", "during-the-cut")
        cluster.create_vm("vm-during")
        cluster.delete_vm("vm-before")
        assert thread.is_alive()
        proxy.open()

        events.wait_for(lambda e: "DELETED" in e.types(before), "the changes made during the cut")
        events.wait_for(lambda e: bool(e.types(during)) and len(e.types(live)) == 2, "every change")

    assert events.types(before) == ["RELISTED", "DELETED"]
    assert events.types(live) == ["ADDED", "MODIFIED"]
    assert events.types(during) == ["ADDED"]
    assert own_annotations(events.of(live)[1]["object"]) == {"test/touched": "during-the-cut"}
    # It resumed the watch where Kafka had acknowledged it, not with a relist.
    assert watcher.stats.relists == 1
    assert watcher.stats.gone == 0
    assert proxy.accepted >= 2
    # Each failed attempt is an API error on /metrics.
    errors = (metrics.registry("watch").get_sample_value("vmstream_watch_errors_total", api_errors) or 0.0) - errors_before
    assert errors == watcher.stats.failures >= 2


# ------------------------------------------------------------------------- oversized objects


def blob(size: int, *, compressible: bool) -> str:
    """``size`` characters: a long cloud-init script, or (incompressible) base64 data."""
    if compressible:
        line = "  - echo 'provisioning step' >> /var/log/provision.log\n"
        body = line * (size // len(line) + 1)
    else:
        body = base64.b64encode(os.urandom(size)).decode()
    return ("#cloud-config\nruncmd:\n" + body)[:size]


def vm_with_blob(name: str, data: str) -> dict[str, Any]:
    """A VM made large by an annotation of its template (no rule reads it). Not cloud-init:
    virt-api refuses inline cloud-init user data over 2 KiB (vmi-create-admitter.go,
    cloudInitUserMaxLen); the template's annotations it takes at any size."""
    obj = minimal_vm(name)
    obj["spec"]["template"]["metadata"] = {"annotations": {"example.com/blob": data}}
    return obj


def topic_bytes(kafka: KafkaSettings, topic: str) -> int:
    """What the broker stores of ``topic`` (its log segments' size): batches as compressed."""
    return stored_bytes(kafka, kafka.topic(topic))


def test_a_vm_over_a_megabyte_is_published_reduced_and_the_other_events_keep_flowing(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    ns = cluster.namespace
    big, over, packed, after = (f"VirtualMachine/{ns}/{name}"
                                for name in ("vm-big", "vm-over", "vm-packed", "vm-after"))
    created = cluster.custom.create_namespaced_custom_object(
        *KUBEVIRT, ns, "virtualmachines", vm_with_blob("vm-big", blob(1_450_000, compressible=False))
    )
    assert len(json.dumps(created)) > 1_400_000  # the API server takes it whole
    bridge = Bridge(deployment.kafka, kube_configuration(kube), kinds=select_kinds("VirtualMachine"))
    watcher = bridge.watchers["VirtualMachine"]
    with running(bridge):
        events.wait_for(lambda e: bool(e.types(big)), "the big VM, relisted")
        wait_until(lambda: synced(bridge), "the list acknowledged")
        stored_before = topic_bytes(deployment.kafka, TOPIC)
        packed_script = blob(400_000, compressible=True)  # under the worker's 512 KiB
        cluster.custom.create_namespaced_custom_object(
            *KUBEVIRT, ns, "virtualmachines", vm_with_blob("vm-packed", packed_script))
        events.wait_for(lambda e: bool(e.types(packed)), "the packed VM")
        stored_after = topic_bytes(deployment.kafka, TOPIC)
        # Over the worker's limit, though the broker would take it.
        cluster.custom.create_namespaced_custom_object(
            *KUBEVIRT, ns, "virtualmachines", vm_with_blob("vm-over", blob(600_000, compressible=True)))
        for name in ("vm-packed", "vm-over"):  # less for the next tests' lists
            cluster.cleanup.append(functools.partial(cluster.delete_vm, name))
        cluster.annotate_vm("vm-big", "1")
        cluster.create_vm("vm-after")
        cluster.delete_vm("vm-big")
        cluster.annotate_vm("vm-after", "2")
        events.wait_for(lambda e: "DELETED" in e.types(big) and len(e.types(after)) == 2 and bool(e.types(over)),
                        "every change, the big VM's deletion included")

    assert events.types(big) == ["RELISTED", "MODIFIED", "DELETED"]
    for event, headers in zip(events.of(big), events.headers_of(big), strict=True):
        WatchEvent.model_validate(event)
        assert int(headers[REDUCED_HEADER]) > 1_400_000  # the whole event's size
        obj = event["object"]
        assert "metadata" not in obj["spec"]["template"]
        assert obj["spec"]["template"]["spec"]["domain"] == created["spec"]["template"]["spec"]["domain"]
        assert obj["spec"]["runStrategy"] == "Halted"
        assert obj["metadata"]["uid"] == created["metadata"]["uid"]
        assert len(json.dumps(event)) < 10_000
    assert own_annotations(events.of(big)[1]["object"]) == {"test/touched": "1"}
    assert events.types(over) == ["ADDED"] and int(events.headers_of(over)[0][REDUCED_HEADER]) > 600_000
    # Under the limit: published whole, and stored compressed.
    assert events.types(packed) == ["ADDED"]
    assert REDUCED_HEADER not in events.headers_of(packed)[0]
    packed_template = events.of(packed)[0]["object"]["spec"]["template"]
    assert packed_template["metadata"]["annotations"]["example.com/blob"] == packed_script
    assert 0 < stored_after - stored_before < 40_000
    assert events.types(after) == ["ADDED", "MODIFIED"]
    # Counted over every VM in the API server: other tests leave theirs.
    assert watcher.stats.oversized["reduced"] >= 4 and watcher.stats.oversized["dead_letter"] == 0

    # The worker takes every one of these events as it is on Kafka: none is dead-lettered.
    harness = Harness()
    mine = [(key, value) for key, value in events.seen if key in (big, over, packed, after)]
    for key, value in mine:
        raw = json.dumps(value, separators=(",", ":")).encode()
        result = harness.engine.on_event(harness.state, raw, Source(EVENTS_TOPIC, key, 0, 0), harness.now)
        assert result.dead_letters == [] and result.decision.audit is not None, key
        assert result.decision.audit.outcome == "accepted", (key, result.decision.audit.reason)
        harness._keep(result)
    assert harness.state.get(VMS, f"vm/{ns}/vm-big") is None  # deleted
    for name in ("vm-over", "vm-packed", "vm-after"):
        assert harness.state.get(VMS, f"vm/{ns}/{name}") is not None, name


def test_a_topic_that_takes_less_than_the_worker_gets_reduced_events_not_refused_ones(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    """A broker whose limit is below the worker's: the bridge reads it and stays under it."""
    ns = cluster.namespace
    topic = deployment.kafka.topic(TOPIC)
    set_topic_config(deployment.kafka, topic, "max.message.bytes", "50000")
    wait_until(lambda: message_limit(deployment.kafka, topic) == 50_000, "the topic's new limit")
    cloud, small = f"VirtualMachine/{ns}/vm-cloud", f"VirtualMachine/{ns}/vm-small"
    cluster.custom.create_namespaced_custom_object(  # 100 KB: under the worker's 512 KiB, over the topic's
        *KUBEVIRT, ns, "virtualmachines", vm_with_blob("vm-cloud", blob(100_000, compressible=False)))
    bridge = Bridge(deployment.kafka, kube_configuration(kube), kinds=select_kinds("VirtualMachine"))
    with running(bridge):
        events.wait_for(lambda e: bool(e.types(cloud)), "the VM, relisted")
        cluster.create_vm("vm-small")
        events.wait_for(lambda e: bool(e.types(small)), "the next VM")
    assert REDUCED_HEADER in events.headers_of(cloud)[0]
    assert "metadata" not in events.of(cloud)[0]["object"]["spec"]["template"]
    assert events.types(small) == ["ADDED"] and REDUCED_HEADER not in events.headers_of(small)[0]
    for event, headers in zip(events.of(cloud) + events.of(small), events.headers_of(cloud) + events.headers_of(small),
                              strict=True):
        assert_envelope(event, headers)  # reduced or whole
    assert bridge.watchers["VirtualMachine"].stats.failures == 0  # nothing refused, nothing retried


def test_an_event_too_large_even_reduced_is_dead_lettered_and_the_others_keep_flowing(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    """A small limit stands in for the broker's, so that a rule view can exceed it (the
    annotations are kept in a view, and the API server allows 256 KiB of them)."""
    ns = cluster.namespace
    small, cloud, noisy, later = (f"VirtualMachine/{ns}/{name}"
                                  for name in ("vm-small", "vm-cloud", "vm-noisy", "vm-later"))
    cluster.create_vm("vm-small")
    cluster.custom.create_namespaced_custom_object(
        *KUBEVIRT, ns, "virtualmachines", vm_with_blob("vm-cloud", blob(30_000, compressible=False)))
    noisy_vm = minimal_vm("vm-noisy")
    noisy_vm["metadata"]["annotations"] = {"example.com/blob": blob(40_000, compressible=False)}
    cluster.custom.create_namespaced_custom_object(*KUBEVIRT, ns, "virtualmachines", noisy_vm)
    # KubeVirt's first writes to it done before the bridge lists it: one event, one dead letter
    # (a write after the list would be a second event, too large as well).
    reconciled_vm(cluster.custom.api_client, ns, "vm-noisy")
    letters = Events(deployment.kafka, topic=DLQ_TOPIC)
    bridge = Bridge(deployment.kafka, kube_configuration(kube), kinds=select_kinds("VirtualMachine"),
                    max_event_bytes=20_000)
    watcher = bridge.watchers["VirtualMachine"]
    try:
        with running(bridge):
            letters.wait_for(lambda e: bool(e.of(noisy)), "the dead letter")
            cluster.create_vm("vm-later")
            events.wait_for(lambda e: bool(e.types(small) and e.types(cloud) and e.types(later)),
                            "the other VMs")
        assert [key for key, _ in letters.seen] == [noisy]
    finally:
        letters.close()

    letter = DeadLetter.model_validate(letters.of(noisy)[0])
    assert letter.source.topic == deployment.kafka.topic(TOPIC)
    assert f"RELISTED {noisy}" in letter.error and "too large" in letter.error
    assert letter.original.startswith('{"event_id":"evt-') and len(letter.original) <= ORIGINAL_PREFIX_BYTES
    assert letter.original_truncated is True and letter.original_size is not None
    assert letter.original_size > 40_000 and letter.original_sha256 is not None
    assert events.types(noisy) == []
    assert events.types(small) == ["RELISTED"] and REDUCED_HEADER not in events.headers_of(small)[0]
    # The dead letter: CloudEvents headers of its own, in the trace of the event it stands for.
    [letter_headers] = letters.headers_of(noisy)
    noisy_id = json.loads(letter.original.split(',"type"', 1)[0] + "}")["event_id"]
    assert CE_HEADERS <= set(letter_headers)
    assert letter_headers["ce_type"] == b"io.vmstream.dead-letter"
    assert letter_headers["ce_source"] == b"/vmstream/watch/vmstream"
    assert letter_headers["traceparent"].decode().split("-")[1] == derived_trace(noisy_id).trace_id
    assert events.types(cloud) == ["RELISTED"] and REDUCED_HEADER in events.headers_of(cloud)[0]
    assert events.types(later) == ["ADDED"]
    assert watcher.stats.oversized["dead_letter"] == 1 and watcher.stats.oversized["reduced"] >= 1


# ------------------------------------------------------------------------- deletions while away


def created(obj: dict[str, Any]) -> dict[str, Any]:
    """A scenario object as a client creates it: the server assigns uid and resourceVersion."""
    metadata = {k: v for k, v in obj["metadata"].items() if k not in ("uid", "resourceVersion", "generation")}
    return {**obj, "metadata": metadata}


def test_deletions_while_the_bridge_is_stopped_are_published_after_its_restart_and_the_rules_follow(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    ns, node_name = cluster.namespace, f"gpu-{uid()}"
    cluster.core.create_node(created(node(node_name, gpus={RTX: 4})))
    cluster.cleanup.append(lambda: cluster.core.delete_node(node_name))
    names = [f"vm-{i}" for i in range(1, 7)]
    # KubeVirt starts vm-1 and vm-2 (Always, an RTX card each); vm-6 (Manual, no GPU) is
    # started by hand, so that once its VMI is deleted it stays without one; the rest are Halted.
    with_vmi = {"vm-1": RTX, "vm-2": RTX, "vm-6": None}
    strategies = {"vm-1": "Always", "vm-2": "Always", "vm-6": "Manual"}
    for name in names:
        cluster.custom.create_namespaced_custom_object(*KUBEVIRT, ns, "virtualmachines", created(
            vm(ns, name, project="proj-a", owner=ALICE, gpu=with_vmi.get(name),
               run_strategy=strategies.get(name, "Halted"))))
    vm_subresource(cluster.custom.api_client, ns, "vm-6", "start")
    for name in with_vmi:
        wait_until(functools.partial(running_now, cluster, name), f"KubeVirt to run {name}")
    mine = {f"Node/{node_name}"} | {f"{kind}/{ns}/{name}" for kind in ("VirtualMachine",) for name in names}
    mine |= {f"VirtualMachineInstance/{ns}/{name}" for name in with_vmi}
    kinds = select_kinds("VirtualMachine,VirtualMachineInstance,Node")

    first = Bridge(deployment.kafka, kube_configuration(kube), kinds=kinds)
    with running(first):
        wait_until(lambda: synced(first), "the first lists on Kafka")
    events.wait_for(lambda e: all(e.types(key) for key in mine), "my objects, relisted")
    before = len(events.seen)
    last_seen = {key: events.of(key)[-1]["object"] for key in mine}

    # While no bridge runs: 5 VMs, 3 VMIs and the GPU node are deleted; vm-6 stays, VMI-less.
    for name in names[:5]:
        cluster.delete_vm(name)
    for name in with_vmi:
        cluster.custom.delete_namespaced_custom_object(*KUBEVIRT, ns, "virtualmachineinstances", name)
    wait_until(lambda: not cluster.custom.list_namespaced_custom_object(
        *KUBEVIRT, ns, "virtualmachineinstances")["items"], "KubeVirt to remove the VMIs")
    cluster.core.delete_node(node_name)
    deleted = {f"VirtualMachine/{ns}/{name}" for name in names[:5]} | {f"Node/{node_name}"}
    deleted |= {f"VirtualMachineInstance/{ns}/{name}" for name in with_vmi}

    second = Bridge(deployment.kafka, kube_configuration(kube), kinds=kinds)  # a new process
    with running(second):
        wait_until(lambda: synced(second), "the lists after the restart")
    events.read_to_end()  # everything the second bridge published (it flushed when it stopped)
    since = events.seen[before:]
    deletions = sorted(key for key, value in since if value["type"] == "DELETED")
    assert deletions == sorted(deleted)  # exactly those, once each, and no other
    assert {value["type"] for _, value in since} == {"RELISTED", "DELETED"}
    assert f"VirtualMachine/{ns}/vm-6" in {key for key, value in since if value["type"] == "RELISTED"}
    for key in deleted:
        event = next(value for k, value in since if k == key)
        assert event["object"] == last_seen[key]  # the last object the first bridge published
        metadata = event["object"]["metadata"]
        assert event["event_id"] == watch_event_id(
            event["kind"], metadata.get("namespace"), metadata["name"], metadata["resourceVersion"], "DELETED")
    assert sum(w.stats.deleted_while_away for w in second.watchers.values()) == len(deleted)

    # A third start finds nothing more to delete: what it read back already says DELETED.
    third = Bridge(deployment.kafka, kube_configuration(kube), kinds=kinds)
    with running(third):
        wait_until(lambda: synced(third), "the lists of the third start")
    assert sum(w.stats.deleted_while_away for w in third.watchers.values()) == 0

    # The rules on what the worker reads: the node's cards leave the capacity, the deleted
    # VM cannot get a GPU, the VM whose VMI is gone cannot be restarted.
    harness = Harness()

    def fold(seen: list[tuple[str, dict[str, Any]]]) -> None:
        order = {"Node": 0, "VirtualMachine": 1, "VirtualMachineInstance": 2}
        for key, value in sorted((kv for kv in seen if kv[0] in mine), key=lambda kv: order[kv[1]["kind"]]):
            harness.tick()
            harness._keep(harness.engine.on_event(harness.state, value, Source(EVENTS_TOPIC, key), harness.now))

    fold(events.seen[:before])
    rtx = capacity(harness.state, RTX)
    assert (rtx.total, rtx.used) == (4, 2)  # only my node has RTX cards in this state
    assert harness.intent("set_gpu", {"namespace": ns, "name": "vm-3", "gpu_class": "nvidia-a100"}
                          ).decision.commands, "accepted while vm-3 exists"
    assert harness.intent("restart_vm", {"namespace": ns, "name": "vm-6"}).decision.commands
    drain = harness.intent("drain_node", {"node": node_name, "reason": "firmware"}, by=OPS, project=None)
    assert [c.type for c in drain.decision.commands] == ["cordon_node"]
    assert len(harness.notifications("drain_will_stop_gpu_vm")) == 2  # vm-1 and vm-2 hold its cards
    fold(since)
    rtx = capacity(harness.state, RTX)
    assert (rtx.total, rtx.used, rtx.free) == (0, 0, 0)
    assert harness.state.get(VMS, f"vm/{ns}/vm-3") is None
    refused(harness.intent("set_gpu", {"namespace": ns, "name": "vm-3", "gpu_class": "nvidia-a100"}),
            "does not exist")
    refused(harness.intent("restart_vm", {"namespace": ns, "name": "vm-6"}), "not running")
    refused(harness.intent("restart_vm", {"namespace": ns, "name": "vm-1"}), "does not exist")
    # The drain's deadline passes: its VMIs are gone, nothing is left to stop.
    assert [c for r in harness.wait(3600).tick() for c in r.decision.commands] == []
    assert harness.commands("delete_vmi") == []
    refused(harness.intent("drain_node", {"node": node_name, "reason": "again"}, by=OPS, project=None), "unknown")


def running_now(cluster: Cluster, name: str) -> bool:
    return _phase(cluster, name) == "Running"


def _phase(cluster: Cluster, name: str) -> str | None:
    found = cluster.custom.list_namespaced_custom_object(*KUBEVIRT, cluster.namespace, "virtualmachineinstances",
                                                         field_selector=f"metadata.name={name}")["items"]
    return (found[0].get("status") or {}).get("phase") if found else None


def refused(result: Result, why: str) -> None:
    audit = result.decision.audit
    assert audit is not None and audit.outcome == "rejected", audit
    assert why in (audit.reason or "") and result.decision.commands == []


# ------------------------------------------------------------------------- probes


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_bridge_answers_health_ready_and_metrics(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    ns = cluster.namespace
    cluster.create_vm("vm-probed")
    bridge = Bridge(deployment.kafka, kube_configuration(kube), kinds=select_kinds("VirtualMachine,Node"))
    with bridge.probes(port=0) as probes:
        assert probes.host == "127.0.0.1"  # loopback unless told otherwise
        assert _get(probes.url + "/health")[0] == 200
        status, body = _get(probes.url + "/ready")
        assert status == 503 and json.loads(body)["kinds"]["VirtualMachine"]["listed"] is False
        metrics_before = _get(probes.url + "/metrics")[1]
        with running(bridge):
            wait_until(lambda: _get(probes.url + "/ready")[0] == 200, "ready")
            events.wait_for(lambda e: bool(e.types(f"VirtualMachine/{ns}/vm-probed")), "the relisted VM")
            status, body = _get(probes.url + "/ready")
            metrics = _get(probes.url + "/metrics")[1]
        assert json.loads(body)["kinds"]["Node"]["listed"] is True
    for name, labels, at_least in (
        ("vmstream_watch_relists_total", {"kind": "VirtualMachine"}, 1),
        ("vmstream_watch_relists_total", {"kind": "Node"}, 1),
        ("vmstream_watch_events_total", {"kind": "VirtualMachine", "type": "RELISTED"}, 1),
    ):
        assert _sample(metrics, name, **labels) - _sample(metrics_before, name, **labels) >= at_least, name
    assert _sample(metrics, "vmstream_watch_listed", kind="VirtualMachine") == 1
    for series in ('vmstream_watch_errors_total{kind="Node",source="api"}',
                   'vmstream_watch_oversized_total{kind="VirtualMachine",outcome="reduced"}',
                   'vmstream_watch_deleted_while_away_total{kind="VirtualMachine"}'):
        assert f"\n{series} " in metrics, series


def test_the_bridge_takes_the_workers_input_limit_from_the_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("az: az1\nlimits:\n  max_input_bytes: 300000\n", encoding="utf-8")
    assert load_limits(str(path)).max_input_bytes == 300_000
    assert load_limits(None).max_input_bytes == 512 * 1024  # the worker's default
    monkeypatch.setenv("VMSTREAM_LIMITS__MAX_INPUT_BYTES", "200000")
    assert load_limits(str(path)).max_input_bytes == 200_000  # the environment first, as for the worker


# ------------------------------------------------------------------------- the command


def _answers(url: str) -> int | None:
    """The page's status, or None while nothing listens there."""
    try:
        return _get(url)[0]
    except urllib.error.URLError:
        return None


def test_vmstream_watch_killed_then_restarted_publishes_what_was_deleted_meanwhile(
    kube: Kube, deployment: Deployment, events: Events, cluster: Cluster
) -> None:
    """The command itself, killed with SIGKILL: nothing flushed at exit, nothing in memory
    survives; what it published on Kafka is all the next one has."""
    ns = cluster.namespace
    a, b, c = (f"VirtualMachine/{ns}/{name}" for name in ("vm-a", "vm-b", "vm-c"))
    for name in ("vm-a", "vm-b", "vm-c"):
        cluster.create_vm(name)
    port = free_ports(1)[0]
    command = ["watch", "--kubeconfig", str(kube.kubeconfig), "--kinds", "VirtualMachine",
               "--probe-port", str(port)]
    url = f"http://127.0.0.1:{port}"

    first = VmstreamProcess(deployment, "watch-1", command).start()
    try:
        wait_until(lambda: _answers(url + "/ready") == 200, "the first bridge ready")
        events.wait_for(lambda e: all(e.types(key) for key in (a, b, c)), "the three VMs, relisted")
    finally:
        first.stop(signal.SIGKILL)
    cluster.delete_vm("vm-a")
    cluster.delete_vm("vm-b")

    second = VmstreamProcess(deployment, "watch-2", command).start()
    try:
        wait_until(lambda: _answers(url + "/ready") == 200, "the second bridge ready", timeout=120)
        metrics = _get(url + "/metrics")[1]
    finally:
        second.stop()
    events.read_to_end()
    assert events.types(a) == ["RELISTED", "DELETED"]
    assert events.types(b) == ["RELISTED", "DELETED"]
    assert events.types(c) == ["RELISTED", "RELISTED"]
    # Ready only once the deletions it found were on Kafka; counted by this process.
    assert _sample(metrics, "vmstream_watch_deleted_while_away_total", kind="VirtualMachine") == 2
