"""Hostile publishers on a real broker, against a real ``vmstream worker`` verifying
credentials (``auth: jwt``, a JWKS file), and the worker's pages seen from outside.

Anyone who can write to ``vmstream.intents`` can put anything there: a forged requester, a
forged project, a VM for another project's or a system namespace, a credential stolen from
another intent or expired. Each is refused and audited, and nothing reaches
``vmstream.commands``; this test counts with a consumer of its own.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from streams.cli import requesting
from streams.common.credentials import SigningKey, jwks, sign_intent, signed
from harness.running import Deployment, WorkerProcess
from harness.scenarios import START, cluster
from samples.cluster import iso
from tests.support.kafka_io import TopicReader

pytestmark = pytest.mark.kafka

ALICE, BOB, OPS = "alice@example.com", "bob@example.com", "ops@example.com"
OPERATOR = "vmstream-operator"
TOKEN = "pages-token-for-this-test"
READ_DEADLINE = 60.0


class Reader:
    """The deployment's audit and commands topics, read from the beginning as they grow."""

    def __init__(self, deployment: Deployment) -> None:
        kafka = deployment.kafka
        self.names = {kafka.topic("audit"): "audit", kafka.topic("commands"): "commands"}
        self.reader = TopicReader(kafka, self.names, partitions=kafka.partitions)
        self.seen: dict[str, list[dict[str, Any]]] = {"audit": [], "commands": []}

    def until(self, condition: Any, what: str) -> None:
        deadline = time.monotonic() + READ_DEADLINE
        while not condition():
            assert time.monotonic() < deadline, f"not seen within {READ_DEADLINE}s: {what}"
            for record in self.reader.poll(0.2):
                self.seen[self.names[record.topic]].append(json.loads(record.value or b""))

    def audits(self, ref: str) -> list[dict[str, Any]]:
        return [a for a in self.seen["audit"] if a["input"]["ref"] == ref]

    def close(self) -> None:
        self.reader.close()


@pytest.fixture
def signer(tmp_path: Path) -> tuple[SigningKey, Path]:
    key = SigningKey.generate("upstream-1")
    keys = tmp_path / "jwks.json"
    keys.write_text(json.dumps(jwks(key)))
    return key, keys


@pytest.fixture
def worker(kafka_bootstrap: str, tmp_path: Path, signer: tuple[SigningKey, Path]) -> Iterator[tuple[Deployment, WorkerProcess]]:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    deployment.create_topics()
    process = WorkerProcess(deployment, "w1", env={
        "VMSTREAM_AUTH__MODE": "jwt",
        "VMSTREAM_AUTH__JWKS_FILE": str(signer[1]),
        "VMSTREAM_WORKER__WEB_TOKEN": TOKEN,
    }).start()
    try:
        yield deployment, process
    finally:
        assert process.stop() == 0, process.tail()


def intent(intent_id: str, type_: str, by: str, spec: dict[str, Any], project: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"intent_id": intent_id, "type": type_, "requested_by": by, "spec": spec}
    if project is not None:
        body["project"] = project
    return body


def key_of(body: dict[str, Any]) -> str:
    spec = body["spec"]
    return f"node/{spec['node']}" if "node" in spec else f"vm/{spec['namespace']}/{spec['name']}"


def create(namespace: str) -> dict[str, Any]:
    return {"namespace": namespace, "name": "intruder", "cores": 2, "memory_gib": 4,
            "image": "registry.example.com/ubuntu:24.04", "run_strategy": "Always"}


def namespace_event(name: str, project: str | None) -> str:
    """A Namespace as the watch bridge shows it, with the project label if any."""
    labels = {"kubernetes.io/metadata.name": name} | ({"superphenix.net/projectID": project} if project else {})
    value = {"event_id": f"ns-{name}", "type": "ADDED", "kind": "Namespace",
             "object": {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}},
             "observed_at": iso(START)}  # the cluster's scenario time: publishing moves it to now
    return json.dumps({"topic": "vmstream.k8s-events", "key": f"Namespace/{name}", "value": value})


def test_hostile_intents_are_refused_audited_and_command_nothing(
    worker: tuple[Deployment, WorkerProcess], signer: tuple[SigningKey, Path]
) -> None:
    deployment, _ = worker
    key, _ = signer
    reader = Reader(deployment)
    try:
        # Namespaces as observed: lab-a is proj-a's by its label (the template would not say
        # so), spx-proj-z matches the template but carries no project label.
        lines = [*cluster().jsonl(), namespace_event("lab-a", "proj-a"), namespace_event("spx-proj-z", None)]
        deployment.publish_lines(lines)
        reader.until(lambda: sum(a["input"]["topic"].endswith("k8s-events") for a in reader.seen["audit"])
                     >= len(lines), "the cluster's events decided")

        drain = intent("h-requester", "drain_node", OPS, {"node": "gpu-node-1", "reason": "mine now"})
        unsigned_drain = intent("h-unsigned", "drain_node", OPS, {"node": "gpu-node-1", "reason": "mine now"})
        gpu_on_bobs = intent("h-project", "set_gpu", ALICE,
                             {"namespace": "spx-proj-b", "name": "dev-1", "gpu_class": "nvidia-a100"}, "proj-b")
        into_bobs = intent("h-other-ns", "create_vm", ALICE, create("spx-proj-b"), "proj-a")
        into_system = intent("h-system-ns", "create_vm", ALICE, create("kube-system"), "proj-a")
        into_unlabelled = intent("h-unlabelled-ns", "create_vm", "zed@example.com", create("spx-proj-z"), "proj-z")
        # A credential issued for one of bob's intents, put on another.
        bobs = intent("bob-1", "restart_vm", BOB, {"namespace": "spx-proj-b", "name": "dev-1"}, "proj-b")
        stolen = intent("h-replayed", "set_gpu", BOB,
                        {"namespace": "spx-proj-b", "name": "dev-1", "gpu_class": "nvidia-a100"}, "proj-b")
        stolen["credential"] = sign_intent(bobs, key, projects=["proj-b"])
        expired = intent("h-expired", "restart_vm", BOB, {"namespace": "spx-proj-b", "name": "dev-1"}, "proj-b")

        now = datetime.now(UTC)
        hostile = {
            # mallory signs for herself and writes ops@ as the requester
            "h-requester": signed(drain, key, subject="mallory@example.com"),
            "h-unsigned": unsigned_drain,
            # alice is in proj-a only, and claims proj-b
            "h-project": signed(gpu_on_bobs, key, projects=["proj-a"]),
            "h-other-ns": signed(into_bobs, key, projects=["proj-a"]),
            "h-system-ns": signed(into_system, key, projects=["proj-a"]),
            "h-unlabelled-ns": signed(into_unlabelled, key, projects=["proj-z"]),
            "h-replayed": stolen,
            "h-expired": signed(expired, key, projects=["proj-b"], now=now - timedelta(hours=2),
                                lifetime=timedelta(minutes=5)),
        }
        for body in hostile.values():
            deployment.publish_raw("intents", key_of(body), json.dumps(body).encode())
        reader.until(lambda: all(reader.audits(ref) for ref in hostile), "every hostile intent's audit")

        why = {ref: reader.audits(ref)[0] for ref in hostile}
        # Refused for who asks: their own outcome; asked by a proven requester, but wrong: rejected.
        unproven = ("h-requester", "h-unsigned", "h-project", "h-replayed", "h-expired")
        assert {ref: a["outcome"] for ref, a in why.items()} == {
            ref: "unauthenticated" if ref in unproven else "rejected" for ref in hostile}
        assert "not the credential's subject 'mallory@example.com'" in why["h-requester"]["reason"]
        assert "no credential" in why["h-unsigned"]["reason"]
        assert "alice@example.com is not a member of project 'proj-b'" in why["h-project"]["reason"]
        assert why["h-other-ns"]["reason"] == "namespace spx-proj-b does not belong to project 'proj-a'"
        assert why["h-system-ns"]["reason"].startswith("namespace kube-system is a system namespace")
        assert why["h-unlabelled-ns"]["reason"] == "namespace spx-proj-z is not known to belong to a project"
        assert "issued for intent 'bob-1', not 'h-replayed'" in why["h-replayed"]["reason"]
        assert "credential expired at" in why["h-expired"]["reason"]
        assert all(not a["commands"] for a in why.values())

        # A signed request after them: once its command is read, theirs would have been too.
        # Into lab-a, which only its observed label makes proj-a's.
        valid = signed(intent("ok-1", "create_vm", ALICE, create("lab-a"), "proj-a"), key, projects=["proj-a"])
        deployment.publish_raw("intents", key_of(valid), json.dumps(valid).encode())
        reader.until(lambda: reader.audits("ok-1") and reader.seen["commands"], "the signed intent's command")
        assert reader.audits("ok-1")[0]["outcome"] == "accepted"
        assert [(c["cause"], c["type"]) for c in reader.seen["commands"]] == [("ok-1", "create_vm")]
    finally:
        reader.close()


def test_the_cli_signs_with_a_key_file(
    worker: tuple[Deployment, WorkerProcess], signer: tuple[SigningKey, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deployment, _ = worker
    key, _ = signer
    pem = tmp_path / "upstream-1.pem"
    pem.write_bytes(key.private_pem())
    monkeypatch.setenv("VMSTREAM_KAFKA__BOOTSTRAP_SERVERS", deployment.bootstrap)
    monkeypatch.setenv("VMSTREAM_KAFKA__TOPIC_PREFIX", deployment.kafka.topic_prefix)
    lines = list(cluster().jsonl())
    deployment.publish_lines(lines)
    drain = ["drain", "--by", OPS, "--node", "gpu-node-2", "--reason", "firmware", "--wait=decided", "--timeout", "60"]
    parser = argparse.ArgumentParser(prog="vmstream")
    requesting.add_parser(parser.add_subparsers(dest="command", required=True))

    def run(*argv: str) -> int:
        args = parser.parse_args(["intent", *argv])
        code: int = args.handler(args)
        return code

    assert run(*drain, "--id", "cli-unsigned") == requesting.EXIT_NOT_ACCEPTED
    assert run(*drain, "--id", "cli-not-operator", "--key", str(pem), "--kid", key.kid) == requesting.EXIT_NOT_ACCEPTED
    assert run(*drain, "--id", "cli-operator", "--key", str(pem), "--kid", key.kid, "--operator") == (
        requesting.EXIT_ACCEPTED)


def non_loopback_address() -> str:
    """An address of this machine other than loopback (the route to a documentation net)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # UDP: nothing is sent
        address: str = probe.getsockname()[0]
    assert not address.startswith("127."), "this machine has no non-loopback address to test with"
    return address


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_pages_are_private_and_on_loopback_only(worker: tuple[Deployment, WorkerProcess]) -> None:
    _, process = worker
    base = f"http://127.0.0.1:{process.web_port}"
    assert get(f"{base}/health")[0] == 200 and get(f"{base}/ready")[0] == 200
    for path in ("/pending", "/capacity", "/metrics", "/", "/router/", "/table/state-vms/"):
        assert get(f"{base}{path}")[0] == 401, path
        assert get(f"{base}{path}", "wrong-token")[0] == 401, path
    status, body = get(f"{base}/pending", TOKEN)
    assert status == 200 and json.loads(body) == []
    assert get(f"{base}/capacity", TOKEN)[0] == 200
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((non_loopback_address(), process.web_port), timeout=5).close()
