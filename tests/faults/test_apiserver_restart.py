"""An API server restart while vmstream's Kubernetes edge runs: ``vmstream watch`` and
``vmstream apply`` as processes, on a control plane of the test's own whose kube-apiserver is
stopped for a few seconds and started again on the same port and etcd.

VMs are created and deleted through the API server before and after the outage (never
during it); sealed patch_vm commands are published while it is down. Afterwards every change
is on k8s-events, each deletion exactly once; each command has exactly one result,
``applied``, and the VM its patch; both processes still run and are ready.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from handlers.contracts.messages import Command
from handlers.core.decisions import subject_key
from streams.common.codecs import encode_message
from harness.localkube import LocalKube
from harness.processes import free_ports
from harness.running import CONFIG, Deployment, VmstreamProcess
from samples.cluster import A100, PROJECT_LABEL
from streams.kube.watching import TOPIC
from tests.support.harness import Harness, config as harness_config
from tests.support.kafka_io import TopicReader
from tests.support.kube_apiserver import minimal_vm

pytestmark = [pytest.mark.kube, pytest.mark.kafka]

KUBEVIRT = ("kubevirt.io", "v1")
DEADLINE = 90.0
OUTAGE = 5.0  # seconds the API server stays down
OWNER = "alice@example.com"
IMAGE = "quay.io/containerdisks/ubuntu:24.04"


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)  # polling interval


def answers(url: str) -> int | None:
    """The page's status, or None while nothing listens there."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


class Reader:
    """Every record of some of the deployment's topics, in arrival order."""

    def __init__(self, deployment: Deployment, *topics: str) -> None:
        kafka = deployment.kafka
        self.names = {kafka.topic(name): name for name in topics}
        self.reader = TopicReader(kafka, self.names, partitions=kafka.partitions)
        self.seen: dict[str, list[tuple[str, dict[str, Any]]]] = {name: [] for name in topics}

    def poll(self) -> None:
        for record in self.reader.poll(0.2):
            key = record.key.decode() if record.key else ""
            self.seen[self.names[record.topic]].append((key, json.loads(record.value or b"")))

    def read_to_end(self, timeout: float = DEADLINE) -> None:
        ends = self.reader.ends()
        deadline = time.monotonic() + timeout
        while not self.reader.caught_up(ends):
            if time.monotonic() > deadline:
                raise AssertionError("timed out reading the topics to their end")
            self.poll()

    def events(self, key: str) -> list[dict[str, Any]]:
        return [value for k, value in self.seen[TOPIC] if k == key]

    def results(self, command_id: str) -> list[dict[str, Any]]:
        return [value for _, value in self.seen["command-results"] if value["command_id"] == command_id]

    def close(self) -> None:
        self.reader.close()


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[LocalKube]:
    """A control plane of the test's own: its API server is the one stopped and started."""
    with LocalKube(tmp_path / "kube") as local:
        yield local


@pytest.fixture
def deployment(kafka_bootstrap: str, tmp_path: Path) -> Deployment:
    deployed = Deployment(kafka_bootstrap, tmp_path / "deployment")
    deployed.create_topics()
    return deployed


def start_applier(deployment: Deployment, kube: LocalKube, port: int) -> subprocess.Popen[bytes]:
    log_path = deployment.workdir / "applier.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "streams.kube.applying", "apply", "--config", str(CONFIG),
             "--kubeconfig", str(kube.kubeconfig), "--probe-port", str(port)],
            env={**deployment.env(0), "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT,
        )
    return process


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def test_an_api_server_restart_loses_no_event_and_no_command(
    kube: LocalKube, deployment: Deployment
) -> None:
    api = config.new_client_from_config(config_file=str(kube.kubeconfig))
    custom = client.CustomObjectsApi(api)
    ns = f"t-{uuid.uuid4().hex[:10]}"
    client.CoreV1Api(api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=ns, labels={PROJECT_LABEL: "proj-a"})))

    def create(name: str, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        created: dict[str, Any] = custom.create_namespaced_custom_object(
            *KUBEVIRT, ns, "virtualmachines", manifest or minimal_vm(name))
        return created

    def delete(name: str) -> None:
        custom.delete_namespaced_custom_object(*KUBEVIRT, ns, "virtualmachines", name)

    def vmstream_vm(name: str) -> dict[str, Any]:
        """A VM as vmstream creates it (its owner annotated), so its owner may patch it."""
        harness = Harness(harness_config(namespaces={"projects": {ns: "proj-a"}}))
        body = {"namespace": ns, "name": name, "cores": 2, "memory_gib": 8, "image": IMAGE}
        [created] = harness.intent("create_vm", body, by=OWNER,
                                   intent_id=f"it-{uuid.uuid4().hex[:12]}").decision.commands
        assert created.manifest is not None
        return create(name, created.manifest)

    watch_port, apply_port = free_ports(2)
    watch = VmstreamProcess(deployment, "watch", [
        "watch", "--kubeconfig", str(kube.kubeconfig), "--kinds", "VirtualMachine",
        "--probe-port", str(watch_port)])
    applier_log = deployment.workdir / "applier.log"
    reader = Reader(deployment, TOPIC, "command-results")
    applier: subprocess.Popen[bytes] | None = None
    try:
        # Before the outage: VMs to delete, VMs to patch, then the edge starts.
        doomed_early = create("vm-doomed-early")
        doomed_late = create("vm-doomed-late")
        patched = {name: vmstream_vm(name) for name in ("vm-p1", "vm-p2", "vm-p3")}
        watch.start()
        applier = start_applier(deployment, kube, apply_port)
        running = applier

        def ready() -> bool:
            watch.check_running()
            if running.poll() is not None:
                raise AssertionError(f"the applier exited {running.returncode}:\n{log_tail(applier_log)}")
            return (answers(f"http://127.0.0.1:{watch_port}/ready") == 200
                    and answers(f"http://127.0.0.1:{apply_port}/ready") == 200)

        wait_until(ready, "both processes ready", timeout=120)
        fresh_early = create("vm-fresh-early")
        delete("vm-doomed-early")

        # The outage: the API server is down; commands are published meanwhile.
        kube.stop_apiserver()
        assert answers(f"{kube.server}/readyz") is None  # nothing listens there now
        commands: list[Command] = []
        harness = Harness()
        for name, vm in patched.items():
            harness.observe(vm)
            [patch] = harness.intent("set_gpu", {"namespace": ns, "name": name, "gpu_class": "nvidia-a100"},
                                     by=OWNER).decision.commands
            assert patch.type == "patch_vm"
            commands.append(patch)
            deployment.publish_raw("commands", subject_key(patch.target),
                                   encode_message(patch, keyring=deployment.signing.keyring()))
        down_until = time.monotonic() + OUTAGE
        while time.monotonic() < down_until:  # the outage lasts; both processes live through it
            watch.check_running()
            assert running.poll() is None, f"the applier exited:\n{log_tail(applier_log)}"
            reader.poll()
        assert all(reader.results(c.command_id) == [] for c in commands), "applied with no API server"
        kube.start_apiserver()

        # After the outage.
        fresh_late = create("vm-fresh-late")
        delete("vm-doomed-late")

        keys = {name: f"VirtualMachine/{ns}/{name}" for name in
                ("vm-doomed-early", "vm-doomed-late", "vm-fresh-early", "vm-fresh-late", *patched)}

        def deleted_once(name: str) -> bool:
            return [e["type"] for e in reader.events(keys[name])].count("DELETED") >= 1

        def present(name: str, obj: dict[str, Any]) -> bool:
            version = obj["metadata"]["resourceVersion"]
            return any(e["object"]["metadata"]["resourceVersion"] == version for e in reader.events(keys[name]))

        def stored(name: str) -> dict[str, Any]:
            got: dict[str, Any] = custom.get_namespaced_custom_object(*KUBEVIRT, ns, "virtualmachines", name)
            return got

        def settled() -> bool:
            reader.poll()
            return (all(reader.results(c.command_id) for c in commands)
                    and deleted_once("vm-doomed-early") and deleted_once("vm-doomed-late")
                    and present("vm-fresh-early", fresh_early) and present("vm-fresh-late", fresh_late)
                    and all(present(name, stored(name)) for name in patched))

        wait_until(settled, "every result and every change on k8s-events")
        # (3) Nothing crashed for good: both processes run and are ready again.
        wait_until(ready, "both processes ready after the outage")
        reader.read_to_end()

        # (1) Every change made before and after the outage is on k8s-events; each deletion once.
        for name, obj in (("vm-doomed-early", doomed_early), ("vm-doomed-late", doomed_late)):
            types = [e["type"] for e in reader.events(keys[name])]
            assert types.count("DELETED") == 1, (name, types)
            assert types[-1] == "DELETED", (name, types)
            assert reader.events(keys[name])[0]["object"]["metadata"]["uid"] == obj["metadata"]["uid"]
        assert present("vm-fresh-early", fresh_early) and present("vm-fresh-late", fresh_late)
        # (2) Exactly one result per command published during the outage, applied; the patch is there.
        for patch in commands:
            results = reader.results(patch.command_id)
            assert [r["outcome"] for r in results] == ["applied"], results
            vm = stored(patch.target.name)
            assert results[0]["resource_version"] == vm["metadata"]["resourceVersion"]
            gpus = vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"]
            assert gpus == [{"name": "gpu-0", "deviceName": A100}], gpus
            assert present(patch.target.name, vm)
        watch.check_running()
        assert running.poll() is None
    finally:
        reader.close()
        watch.stop()
        if applier is not None:
            applier.send_signal(signal.SIGTERM)
            try:
                applier.wait(30)
            except subprocess.TimeoutExpired:
                applier.kill()
                applier.wait()
        api.close()
