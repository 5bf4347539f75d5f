"""The applier on a real kube-apiserver and a real broker: commands in, the cluster changed,
exactly one result (plus its audit record, and on failure a notification) out.

One ``vmstream apply`` process serves the module, on its own topics (a
:class:`~harness.running.Deployment`), talking to the API server and — for start, stop and
restart — to KubeVirt's own virt-api through it, by way of a proxy that can fail or hold
answers (``--subresource-url``, ``tests/support/api_proxy.py``). Commands are what the
handlers decide (the test harness drives the real engine) or built the same way. VMIs come
and go as KubeVirt's virt-controller makes them, with the node agent playing the nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
from confluent_kafka import ConsumerGroupState
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families

from handlers.contracts import ids
from handlers.contracts.messages import Command, CommandType, GPUMutation, ObjectRef
from handlers.core.cluster import OWNER_ANNOTATION
from handlers.core.decisions import subject_key
from handlers.core.state import tracking_of
from harness.processes import free_ports
from harness.publishing import publish as publish_records
from harness.running import CONFIG, Deployment
from samples.cluster import A100, PROJECT_LABEL, RTX
from samples.cluster import node as node_object
from streams.common.codecs import encode_message
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client
from streams.common.settings import load_settings
from streams.kube.applying import Applier, KubeApplier
from tests.support.harness import START, Harness, config
from tests.support.kafka_broker import committed, end_offsets
from tests.support.kafka_io import TopicReader, murmur2_partition
from tests.support.kube_apiserver import Kube, minimal_vm, reconciled_vm
from tests.support.kubevirt_schema import validate_vm
from tests.support.api_proxy import ApiProxy
from tests.support.waiting import eventually, stop

pytestmark = [pytest.mark.kube, pytest.mark.kafka]

KUBEVIRT = ("kubevirt.io", "v1")
DEADLINE = 60.0
HANDOVER_WATCH_SECONDS = 5.0  # how long a rebalance is watched for ending too early (a few ms when it does)
OWNER = "alice@example.com"
OPERATOR = "ops@example.com"
IMAGE = "quay.io/containerdisks/ubuntu:24.04"

T = TypeVar("T")



# ------------------------------------------------------------------------- fixtures


class Published:
    """What the applier published — results, audit records, notifications — read as it comes."""

    TOPICS = ("command-results", "audit", "notifications", "dlq")

    def __init__(self, deployment: Deployment) -> None:
        kafka = deployment.kafka
        self.names = {kafka.topic(name): name for name in self.TOPICS}
        self.reader = TopicReader(kafka, self.names, partitions=kafka.partitions)
        self.seen: dict[str, list[tuple[str, dict[str, Any]]]] = {name: [] for name in self.TOPICS}

    def poll(self) -> None:
        for record in self.reader.poll(0.2):
            key = record.key.decode() if record.key else ""
            self.seen[self.names[record.topic]].append((key, json.loads(record.value or b"")))

    def results(self, command_id: str) -> list[dict[str, Any]]:
        self.poll()
        return [value for _, value in self.seen["command-results"] if value["command_id"] == command_id]

    def result(self, command: Command, timeout: float = DEADLINE) -> dict[str, Any]:
        """The (one) result of ``command``, once it is there."""
        [result] = eventually(lambda: self.results(command.command_id), f"the result of {command.type}", timeout)
        return result

    def keys(self, command_id: str) -> list[str]:
        return [key for key, value in self.seen["command-results"] if value["command_id"] == command_id]

    def audits(self, command_id: str) -> list[dict[str, Any]]:
        return [value for _, value in self.seen["audit"] if value["input"]["ref"] == command_id]

    def notifications(self, command_id: str) -> list[dict[str, Any]]:
        return [value for _, value in self.seen["notifications"]
                if value.get("details", {}).get("command_id") == command_id]

    def close(self) -> None:
        self.reader.close()


@pytest.fixture(scope="module")
def deployment(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    deployed = Deployment(kafka_bootstrap, tmp_path_factory.mktemp("applier"))
    deployed.create_topics()
    return deployed


@pytest.fixture(scope="module")
def api_proxy(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProxy]:
    """The API server behind a proxy that can fail or hold answers: KubeVirt's subresources
    (virt-api's start, stop and restart) are reached through it."""
    if kube.local is None or kube.local.workdir is None:
        pytest.skip("the proxy is made with the local control plane's CA")
    pki = kube.local.workdir / "pki"
    with ApiProxy(kube.local.server, pki, pki / "admin.crt", pki / "admin.key",
                  tmp_path_factory.mktemp("api-proxy")) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def probe_url() -> str:
    """Where the module's applier serves /health, /ready and /metrics."""
    [port] = free_ports(1)
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def applier(deployment: Deployment, kube: Kube, api_proxy: ApiProxy,
            probe_url: str) -> Iterator[subprocess.Popen[bytes]]:
    """``vmstream apply`` as its own process, ready once it has read the results ledger."""
    log_path = deployment.workdir / "applier.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "streams.kube.applying", "apply", "--config", str(CONFIG),
             "--kubeconfig", str(kube.kubeconfig), "--subresource-url", api_proxy.url,
             "--probe-port", probe_url.rsplit(":", 1)[1]],
            env={**deployment.env(0), "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT,
        )

    def tail() -> str:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the applier exited {process.returncode}:\n{tail()}")
        return "applier ready" in log_path.read_text(errors="replace")

    try:
        eventually(ready, "the applier to start", timeout=120)
        yield process
    finally:
        stop(process)
        if os.environ.get("VMSTREAM_SHOW_APPLIER_LOG"):
            print(tail())


@pytest.fixture
def published(deployment: Deployment, applier: subprocess.Popen[bytes]) -> Iterator[Published]:
    reader = Published(deployment)
    yield reader
    reader.close()


@pytest.fixture
def kube_namespace(kube_namespace: str, api: client.ApiClient) -> str:
    """The test's namespace as a project's (proj-a): the applier writes nowhere else."""
    client.CoreV1Api(api).patch_namespace(kube_namespace, {"metadata": {"labels": {PROJECT_LABEL: "proj-a"}}})
    return kube_namespace


@pytest.fixture
def make_node(api: client.ApiClient) -> Iterator[Callable[..., str]]:
    """``make_node(gpus={device: n})`` → the name of a fresh Ready node, deleted afterwards."""
    core = client.CoreV1Api(api)
    made: list[str] = []

    def make(*, gpus: dict[str, int] | None = None) -> str:
        name = f"node-{uuid.uuid4().hex[:8]}"
        obj = node_object(name, gpus=gpus)
        for field in ("uid", "resourceVersion"):
            del obj["metadata"][field]
        core.create_node(obj)
        made.append(name)
        return name

    yield make
    for name in made:
        core.delete_node(name)


# -------------------------------------------------------------------------- helpers


def publish(deployment: Deployment, command: Command) -> None:
    """As the deployment's worker publishes it: sealed with its key."""
    deployment.publish_raw("commands", subject_key(command.target),
                           encode_message(command, keyring=deployment.signing.keyring()))


def command(type_: CommandType, target: ObjectRef, **fields: Any) -> Command:
    """A command built as the handlers build them (deterministic id from a fresh cause)."""
    cause = f"test-{uuid.uuid4().hex[:12]}"
    return Command(command_id=ids.command_id(cause, type_, subject_key(target)), type=type_, target=target,
                   cause=cause, issued_at=START, requested_by=fields.pop("requested_by", OWNER), **fields)


def vm_ref(namespace: str, name: str) -> ObjectRef:
    return ObjectRef(kind="VirtualMachine", namespace=namespace, name=name)


def vmi_ref(namespace: str, name: str) -> ObjectRef:
    return ObjectRef(kind="VirtualMachineInstance", namespace=namespace, name=name)


def create_vm_command(namespace: str, name: str, **spec: Any) -> Command:
    """What the engine decides for a ``create_vm`` intent of proj-a, whose namespace this is."""
    harness = Harness(config(namespaces={"projects": {namespace: "proj-a"}}))
    body = {"namespace": namespace, "name": name, "cores": 2, "memory_gib": 8, "image": IMAGE, **spec}
    decided = harness.intent("create_vm", body, by=OWNER, intent_id=f"it-{uuid.uuid4().hex[:12]}")
    [created] = decided.decision.commands
    return created


def create_vm(api: client.ApiClient, namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    """A VM as vmstream would create it, written straight to the API server."""
    manifest = create_vm_command(namespace, name, **spec).manifest
    assert manifest is not None
    vm: dict[str, Any] = client.CustomObjectsApi(api).create_namespaced_custom_object(
        *KUBEVIRT, namespace, "virtualmachines", manifest)
    return vm


def get(api: client.ApiClient, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        obj: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
            *KUBEVIRT, namespace, plural, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return obj


def stopped_for_good(api: client.ApiClient, namespace: str, name: str) -> None:
    """virt-controller has reconciled the VM without a VMI (printableStatus Stopped, written after
    it decided not to start one) and none came back."""
    eventually(lambda: ((get(api, "virtualmachines", namespace, name) or {}).get("status") or {})
               .get("printableStatus") == "Stopped", f"VM {name} Stopped")
    assert get(api, "virtualmachineinstances", namespace, name) is None


def running_vmi(api: client.ApiClient, namespace: str, name: str, *, other_than: str | None = None) -> dict[str, Any]:
    """Wait for a Running VMI of the VM (a new one, when ``other_than`` names the old uid)."""

    def probe() -> dict[str, Any] | None:
        vmi = get(api, "virtualmachineinstances", namespace, name)
        if vmi and (vmi.get("status") or {}).get("phase") == "Running" and vmi["metadata"]["uid"] != other_than:
            return vmi
        return None

    return eventually(probe, f"a running VMI {namespace}/{name}")


def domain(vm: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = vm["spec"]["template"]["spec"]["domain"]
    return result


def unschedulable(api: client.ApiClient, node: str) -> bool:
    return bool(client.CoreV1Api(api).read_node(node).spec.unschedulable)


def node_dict(api: client.ApiClient, node: str) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(client.CoreV1Api(api).read_node(node, _preload_content=False).data)
    return raw


# ---------------------------------------------------------------------------- tests


def test_create_vm_then_patch_vm_gives_a_valid_gpu_vm(
    api: client.ApiClient, kube_namespace: str, deployment: Deployment, published: Published
) -> None:
    harness = Harness()
    created = create_vm_command(kube_namespace, "vm-1")
    publish(deployment, created)
    assert published.result(created)["outcome"] == "applied"
    # Planned on the VM as virt-controller leaves it: a version its first writes would make stale.
    vm = reconciled_vm(api, kube_namespace, "vm-1")
    assert vm["metadata"]["annotations"][OWNER_ANNOTATION] == OWNER

    # The same request decided again (another intent): the VM it asks for is there.
    again = create_vm_command(kube_namespace, "vm-1")
    publish(deployment, again)
    assert published.result(again)["outcome"] == "noop"

    harness.observe(vm)
    [patch] = harness.intent("set_gpu", {"namespace": kube_namespace, "name": "vm-1", "gpu_class": "nvidia-a100"},
                             by=OWNER).decision.commands
    assert patch.type == "patch_vm" and patch.base_resource_version == vm["metadata"]["resourceVersion"]
    publish(deployment, patch)
    result = published.result(patch)
    assert result["outcome"] == "applied"

    stored = get(api, "virtualmachines", kube_namespace, "vm-1")
    assert stored is not None and result["resource_version"] == stored["metadata"]["resourceVersion"]
    validate_vm(stored)  # KubeVirt's schema, strictly: nothing of ours was pruned
    got = domain(stored)
    assert got["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": A100}]
    assert got["cpu"]["model"] == "host-passthrough"
    assert got["resources"]["requests"]["memory"] == got["memory"]["guest"] == "8Gi"
    assert stored["spec"]["template"]["spec"]["evictionStrategy"] == "External"
    [audit] = published.audits(patch.command_id)
    assert audit["outcome"] == "applied" and audit["commands"] == [patch.command_id]
    assert published.keys(patch.command_id) == [f"vm/{kube_namespace}/vm-1"]
    assert published.notifications(patch.command_id) == []


def test_a_vm_changed_meanwhile_is_planned_again_without_losing_the_change(
    api: client.ApiClient, kube_namespace: str, deployment: Deployment, published: Published
) -> None:
    vm = create_vm(api, kube_namespace, "vm-2")
    harness = Harness()
    harness.observe(vm)
    intent = {"namespace": kube_namespace, "name": "vm-2", "gpu_class": "nvidia-a100"}
    [patch] = harness.intent("set_gpu", intent, by=OWNER).decision.commands

    # Another writer gets there first: the command's resourceVersion is stale now.
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        *KUBEVIRT, kube_namespace, "virtualmachines", "vm-2", {"metadata": {"labels": {"team": "blue"}}})
    publish(deployment, patch)
    assert published.result(patch)["outcome"] == "conflict_retried"

    stored = get(api, "virtualmachines", kube_namespace, "vm-2")
    assert stored is not None
    assert stored["metadata"]["labels"]["team"] == "blue"
    assert stored["metadata"]["labels"][PROJECT_LABEL] == "proj-a"
    assert domain(stored)["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": A100}]
    assert domain(stored)["cpu"]["model"] == "host-passthrough"

    # Planned against the old VM too, but already true of the live one: nothing to do.
    [late] = harness.intent("set_gpu", intent, by=OWNER).decision.commands
    publish(deployment, late)
    assert published.result(late)["outcome"] == "noop"
    after = get(api, "virtualmachines", kube_namespace, "vm-2")
    assert after is not None and after["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]


def test_commands_of_different_vms_are_applied_at_once(
    api: client.ApiClient, kube_namespace: str, deployment: Deployment, published: Published,
    api_proxy: ApiProxy,
) -> None:
    """The answer to the stop of one VM is held until the start of another has been answered:
    an applier that waited for one command before sending the next would let the hold run out."""
    for name, strategy in (("vm-held", "Always"), ("vm-other", "Halted")):
        create_vm(api, kube_namespace, name, run_strategy=strategy)
        reconciled_vm(api, kube_namespace, name)
    entered, arrived = threading.Event(), threading.Event()
    held: list[bool] = []

    def hold() -> None:
        entered.set()
        held.append(arrived.wait(10))  # well within the applier's read timeout (30 s)

    api_proxy.before_answering("/vm-held/stop", hold)
    api_proxy.before_answering("/vm-other/start", arrived.set)
    stop = command("stop_vm", vm_ref(kube_namespace, "vm-held"))
    publish(deployment, stop)
    assert entered.wait(DEADLINE), "the stop never reached virt-api"
    start = command("start_vm", vm_ref(kube_namespace, "vm-other"))  # published while the stop is held
    publish(deployment, start)
    assert published.result(start)["outcome"] == "applied", published.result(start)
    assert held == [True], "the start reached virt-api only after the stop was answered"
    assert published.result(stop)["outcome"] == "applied"
    assert (get(api, "virtualmachines", kube_namespace, "vm-held") or {})["spec"]["runStrategy"] == "Halted"
    assert (get(api, "virtualmachines", kube_namespace, "vm-other") or {})["spec"]["runStrategy"] == "Always"


def test_commands_of_one_vm_are_applied_in_the_order_issued(
    api: client.ApiClient, kube_namespace: str, deployment: Deployment, published: Published
) -> None:
    """Eight GPU changes to one VM, published at once: applied one after the other as issued,
    each on what the one before left, their results in the same order."""
    create_vm(api, kube_namespace, "vm-seq")
    devices = [A100, RTX, None, RTX, A100, None, A100, RTX]
    issued = [command("patch_vm", vm_ref(kube_namespace, "vm-seq"),
                      mutation=GPUMutation(device_name=device, eviction_strategy="External"))
              for device in devices]
    keyring, now = deployment.signing.keyring(), int(time.time() * 1000)
    publish_records(deployment.kafka, [(deployment.kafka.topic("commands"), subject_key(each.target),
                                       encode_message(each, keyring=keyring), now) for each in issued])  # one batch
    results = [published.result(each) for each in issued]
    assert [result["outcome"] for result in results] == ["conflict_retried"] * len(devices)  # each one changed the VM
    ids = {each.command_id for each in issued}
    assert [value["command_id"] for _, value in published.seen["command-results"] if value["command_id"] in ids] \
        == [each.command_id for each in issued]
    versions = [int(result["resource_version"]) for result in results]
    assert versions == sorted(versions) and len(set(versions)) == len(versions), "applied in another order"
    stored = get(api, "virtualmachines", kube_namespace, "vm-seq")
    assert stored is not None and stored["metadata"]["resourceVersion"] == results[-1]["resource_version"]
    assert domain(stored)["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": RTX}]


def test_delete_vmi_brings_back_only_an_always_vm(
    api: client.ApiClient, kube_namespace: str, deployment: Deployment, published: Published,
    make_node: Callable[..., str], api_proxy: ApiProxy,
) -> None:
    make_node(gpus={A100: 2})
    create_vm(api, kube_namespace, "always", run_strategy="Always", gpu_class="nvidia-a100")
    create_vm(api, kube_namespace, "manual", run_strategy="Manual", gpu_class="nvidia-a100")
    first = running_vmi(api, kube_namespace, "always")
    assert first["spec"]["domain"]["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": A100}]
    stopped_for_good(api, kube_namespace, "manual")  # Manual: created stopped

    start = command("start_vm", vm_ref(kube_namespace, "manual"))
    publish(deployment, start)  # virt-api's start: a Start request virt-controller acts on
    assert published.result(start)["outcome"] == "applied"
    running_vmi(api, kube_namespace, "manual")

    deletes = [command("delete_vmi", vmi_ref(kube_namespace, name)) for name in ("manual", "always")]
    for delete in deletes:
        publish(deployment, delete)
    assert [published.result(d)["outcome"] for d in deletes] == ["applied", "applied"]

    running_vmi(api, kube_namespace, "always", other_than=first["metadata"]["uid"])
    stopped_for_good(api, kube_namespace, "manual")

    again = command("delete_vmi", vmi_ref(kube_namespace, "manual"))
    publish(deployment, again)
    assert published.result(again)["outcome"] == "noop"


def test_delete_vmi_of_a_uid_leaves_another_vmi_of_that_name_alone(
    api: client.ApiClient, kube_namespace: str, deployment: Deployment, published: Published,
    make_node: Callable[..., str],
) -> None:
    """A drain's stop names the VMI it was told of by uid: the VMI KubeVirt made since under
    that name (the VM restarted, or deleted and made again) is not stopped with it."""
    make_node(gpus={A100: 2})
    create_vm(api, kube_namespace, "always", run_strategy="Always", gpu_class="nvidia-a100")
    first = running_vmi(api, kube_namespace, "always")
    delete = command("delete_vmi", ObjectRef(kind="VirtualMachineInstance", namespace=kube_namespace,
                                             name="always", uid=first["metadata"]["uid"]))
    publish(deployment, delete)
    assert published.result(delete)["outcome"] == "applied"
    second = running_vmi(api, kube_namespace, "always", other_than=first["metadata"]["uid"])

    stale = command("delete_vmi", ObjectRef(kind="VirtualMachineInstance", namespace=kube_namespace,
                                            name="always", uid=first["metadata"]["uid"]))
    publish(deployment, stale)
    assert published.result(stale)["outcome"] == "noop"
    assert running_vmi(api, kube_namespace, "always")["metadata"]["uid"] == second["metadata"]["uid"]


def test_cordon_and_uncordon(
    api: client.ApiClient, deployment: Deployment, published: Published, make_node: Callable[..., str]
) -> None:
    node = make_node(gpus={A100: 1})
    harness = Harness()
    harness.observe(node_dict(api, node))
    decided = harness.intent("drain_node", {"node": node, "reason": "firmware"}, by=OPERATOR, project=None)
    [cordon] = [c for c in decided.decision.commands if c.type == "cordon_node"]
    publish(deployment, cordon)
    assert published.result(cordon)["outcome"] == "applied"
    assert unschedulable(api, node)

    twice = command("cordon_node", ObjectRef(kind="Node", name=node), requested_by=OPERATOR)
    publish(deployment, twice)
    assert published.result(twice)["outcome"] == "noop"

    harness.observe(node_dict(api, node), "MODIFIED")
    [uncordon] = harness.intent("undrain_node", {"node": node}, by=OPERATOR, project=None).decision.commands
    assert uncordon.type == "uncordon_node"
    publish(deployment, uncordon)
    assert published.result(uncordon)["outcome"] == "applied"
    assert not unschedulable(api, node)


def test_restart_through_virt_api_applies_a_pending_gpu_change(
    api: client.ApiClient, kube_namespace: str, deployment: Deployment, published: Published,
    make_node: Callable[..., str], api_proxy: ApiProxy,
) -> None:
    make_node(gpus={A100: 1})
    create_vm(api, kube_namespace, "vm-r", run_strategy="Always")
    create_vm(api, kube_namespace, "halted", run_strategy="Halted")
    first = running_vmi(api, kube_namespace, "vm-r")
    harness = Harness()
    harness.now = datetime.now(UTC)  # the restart must be issued before the VMI it replaces
    harness.observe(eventually(lambda: get(api, "virtualmachines", kube_namespace, "vm-r"), "the VM"))
    harness.observe(first)
    [patch] = harness.intent("set_gpu", {"namespace": kube_namespace, "name": "vm-r", "gpu_class": "nvidia-a100"},
                             by=OWNER).decision.commands
    publish(deployment, patch)
    # virt-controller writes the VM's status meanwhile: a conflict is possible, and fine.
    assert published.result(patch)["outcome"] in ("applied", "conflict_retried")

    def restart_required() -> dict[str, Any] | None:
        vm = get(api, "virtualmachines", kube_namespace, "vm-r") or {}
        conditions = (vm.get("status") or {}).get("conditions") or []
        return vm if any(c["type"] == "RestartRequired" for c in conditions) else None

    harness.observe(eventually(restart_required, "RestartRequired"), "MODIFIED")
    pending = f"vm/{kube_namespace}/vm-r"
    assert tracking_of(harness.state, pending).pending_episode is not None
    assert len(harness.notifications("gpu_change_pending_restart")) == 1
    [restart] = harness.intent("restart_vm", {"namespace": kube_namespace, "name": "vm-r"},
                               by=OWNER).decision.commands
    api_proxy.unavailable(times=2)  # virt-api is away for a moment: retried with backoff
    publish(deployment, restart)
    assert published.result(restart)["outcome"] == "applied"
    assert api_proxy.statuses(f"/{kube_namespace}/virtualmachines/vm-r/restart") == [503, 503, 202]

    second = running_vmi(api, kube_namespace, "vm-r", other_than=first["metadata"]["uid"])
    assert second["spec"]["domain"]["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": A100}]
    assert second["spec"]["domain"]["cpu"]["model"] == "host-passthrough"
    # The new VMI ends the pending restart, whatever the VM's RestartRequired says by then.
    # KubeVirt 1.7.0 removes that condition only when it starts or stops a VMI
    # (cleanupRestartRequired, pkg/virt-controller/watch/vm/vm.go); set again after the start,
    # it stays (docs/kubevirt.md, "RestartRequired and the GPU notice").
    harness.observe(second)
    harness.observe(eventually(lambda: get(api, "virtualmachines", kube_namespace, "vm-r"), "the VM"), "MODIFIED")
    assert tracking_of(harness.state, pending).pending_episode is None
    assert len(harness.notifications("gpu_change_pending_restart")) == 1

    # Applied again (a crash before its result was recorded): the VMI created since the
    # command was issued is the restart; there is no second one.
    again = restart.model_copy(update={"command_id": f"{restart.command_id}-again"})
    publish(deployment, again)
    assert published.result(again)["outcome"] == "noop"
    assert running_vmi(api, kube_namespace, "vm-r", other_than=first["metadata"]["uid"])["metadata"]["uid"] \
        == second["metadata"]["uid"]

    # virt-api refuses to restart a Halted VM (409): a failure, told to whoever asked.
    refused = command("restart_vm", vm_ref(kube_namespace, "halted"), requested_by="bob@example.com")
    publish(deployment, refused)
    result = published.result(refused)
    assert result["outcome"] == "failed"
    assert "Halted does not support manual restart requests" in result["error"]
    [notice] = published.notifications(refused.command_id)
    assert notice["type"] == "command_failed" and notice["recipients"] == sorted(["bob@example.com", OWNER])
    # A refusal is an answer, not an outage: asked once, never retried.
    assert api_proxy.statuses(f"/{kube_namespace}/virtualmachines/halted/restart") == [409]


def test_an_invalid_manifest_fails_with_the_api_message_and_tells_the_requester(
    api: client.ApiClient, kube_namespace: str, deployment: Deployment, published: Published
) -> None:
    valid = create_vm_command(kube_namespace, "bad-1")
    manifest = json.loads(json.dumps(valid.manifest))
    manifest["spec"]["template"]["spec"]["domain"]["cpu"]["cores"] = "eight"
    invalid = command("create_vm", valid.target, manifest=manifest, requested_by="carol@example.com")
    publish(deployment, invalid)

    result = published.result(invalid)
    assert result["outcome"] == "failed"
    assert "spec.template.spec.domain.cpu.cores" in result["error"]
    assert "must be of type integer" in result["error"]
    [notice] = published.notifications(invalid.command_id)
    assert notice["type"] == "command_failed" and notice["severity"] == "critical"
    # The requester, and the owner the manifest records (alice, for whom it was decided).
    assert notice["recipients"] == sorted(["carol@example.com", OWNER])
    [audit] = published.audits(invalid.command_id)
    assert audit["outcome"] == "failed" and audit["reason"] == result["error"]
    assert audit["notifications"] == [notice["notification_id"]]
    assert get(api, "virtualmachines", kube_namespace, "bad-1") is None


def test_a_malformed_command_is_a_dead_letter_and_blocks_nothing(
    api: client.ApiClient, deployment: Deployment, published: Published, make_node: Callable[..., str]
) -> None:
    node = make_node()
    deployment.publish_raw("commands", f"node/{node}", b'{"command_id": "half-a-command"')
    cordon = command("cordon_node", ObjectRef(kind="Node", name=node), requested_by=OPERATOR)
    publish(deployment, cordon)  # same key, same partition: behind the malformed one
    assert published.result(cordon)["outcome"] == "applied"
    [letter] = [value for key, value in published.seen["dlq"] if key == f"node/{node}"]
    assert letter["original"] == '{"command_id": "half-a-command"'
    assert letter["source"]["topic"] == deployment.kafka.topic("commands") and letter["source"]["offset"] >= 0
    assert published.results("half-a-command") == []


def test_a_command_published_twice_is_applied_once(
    api: client.ApiClient, kube: Kube, deployment: Deployment, published: Published,
    make_node: Callable[..., str],
) -> None:
    node = make_node()
    target = ObjectRef(kind="Node", name=node)
    cordon = command("cordon_node", target, requested_by=OPERATOR)
    publish(deployment, cordon)
    assert published.result(cordon)["outcome"] == "applied"

    # Someone uncordons by hand; a second delivery of the cordon must not cordon again.
    client.CoreV1Api(api).patch_node(node, {"spec": {"unschedulable": None}},
                                     _content_type="application/merge-patch+json")
    publish(deployment, cordon)
    later = command("uncordon_node", target, requested_by=OPERATOR)  # same key: same partition, after it
    publish(deployment, later)
    assert published.result(later)["outcome"] == "noop"
    assert not unschedulable(api, node)
    assert len(published.results(cordon.command_id)) == 1
    assert len(published.audits(cordon.command_id)) == 1

    # A fresh applier in a new group reads every command from the start; it learns from the
    # results topic that each one is done and applies none of them again.
    settings = load_settings(CONFIG).model_copy(update={"kafka": deployment.kafka, "signing": deployment.signing})
    group = f"{deployment.app_id}-second"
    stop = threading.Event()
    with kube.api_client() as second_api:
        second = Applier(settings, KubeApplier(second_api), group_id=group)
        thread = threading.Thread(target=second.run, args=(stop,), daemon=True)
        thread.start()
        # The group's committed offsets, asked of the broker; nothing joins the group.
        try:
            ends = end_offsets(deployment.kafka, deployment.kafka.topic("commands"))

            def caught_up() -> bool:
                done = committed(deployment.kafka, group)
                return all(end == 0 or done.get(tp, 0) >= end for tp, end in ends.items())

            eventually(caught_up, "the second applier to go through every command")
        finally:
            stop.set()
            thread.join(30)
    published.poll()
    counts: dict[str, int] = {}
    for _, value in published.seen["command-results"]:
        counts[value["command_id"]] = counts.get(value["command_id"], 0) + 1
    assert counts and set(counts.values()) == {1}
    assert not unschedulable(api, node)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _samples(probe_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, body = _get(f"{probe_url}/metrics")
    assert status == 200
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(body.decode()) for sample in family.samples}


def test_the_applier_answers_its_probes_and_measures_what_it_applies(
    deployment: Deployment, published: Published, make_node: Callable[..., str], probe_url: str
) -> None:
    assert _get(f"{probe_url}/health")[0] == 200
    status, body = _get(f"{probe_url}/ready")
    assert status == 200 and json.loads(body)["ready"] is True

    node = make_node()
    cordon = command("cordon_node", ObjectRef(kind="Node", name=node), requested_by=OPERATOR)
    missing = command("cordon_node", ObjectRef(kind="Node", name=f"gone-{uuid.uuid4().hex[:8]}"),
                      requested_by=OPERATOR)
    before = _samples(probe_url)
    for each in (cordon, missing):
        publish(deployment, each)
    assert published.result(cordon)["outcome"] == "applied"
    assert published.result(missing)["outcome"] == "failed"

    topic = deployment.kafka.topic("commands")
    lag_labels = [frozenset({("topic", topic), ("partition", str(p))}) for p in range(deployment.kafka.partitions)]

    def measured() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        now = _samples(probe_url)

        def grew(name: str, labels: dict[str, str], by: float) -> bool:
            key = (name, frozenset(labels.items()))
            return now.get(key, 0.0) - before.get(key, 0.0) >= by

        lag_known = all(("vmstream_consumer_lag", labels) in now for labels in lag_labels)
        caught_up = lag_known and sum(now["vmstream_consumer_lag", labels] for labels in lag_labels) == 0
        if (grew("vmstream_apply_results_total", {"type": "cordon_node", "outcome": "applied"}, 1)
                and grew("vmstream_apply_results_total", {"type": "cordon_node", "outcome": "failed"}, 1)
                and grew("vmstream_apply_seconds_count", {"type": "cordon_node"}, 2)
                and grew("vmstream_kube_api_errors_total", {"status": "404"}, 1)
                and caught_up):
            return now
        return None

    eventually(measured, "the results, the latency, the API error and a lag of 0 on every commands partition")


def spawn_applier(deployment: Deployment, kube: Kube, api_proxy: ApiProxy, name: str,
                  env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Another ``vmstream apply`` of ``deployment`` (same consumer group), ready once it has
    read the results ledger; its output in ``<workdir>/<name>.log``."""
    log_path = deployment.workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "streams.kube.applying", "apply", "--config", str(CONFIG),
             "--kubeconfig", str(kube.kubeconfig), "--subresource-url", api_proxy.url, "--probe-port", "0"],
            env={**deployment.env(0), "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=log,
            stderr=subprocess.STDOUT,
        )

    def ready() -> bool:
        text = log_path.read_text(errors="replace")
        assert process.poll() is None, f"{name} exited {process.returncode}:\n{text[-3000:]}"
        return "applier ready" in text

    eventually(ready, f"{name} to start", timeout=120)
    return process


def test_a_restart_is_sent_once_across_an_applier_crash(
    api: client.ApiClient, kube: Kube, kube_namespace: str, kafka_bootstrap: str,
    tmp_path_factory: pytest.TempPathFactory, make_node: Callable[..., str], api_proxy: ApiProxy,
) -> None:
    """The applier dies after virt-api took the restart and before the result is published;
    KubeVirt goes on replacing the VMI. The applier that takes over gets the command again,
    whatever KubeVirt has done by then: it must not restart the VM a second time."""
    make_node()
    manifest = minimal_vm("vm-c")
    manifest["spec"]["runStrategy"] = "Always"
    client.CustomObjectsApi(api).create_namespaced_custom_object(*KUBEVIRT, kube_namespace, "virtualmachines", manifest)
    first = running_vmi(api, kube_namespace, "vm-c")
    own = Deployment(kafka_bootstrap, tmp_path_factory.mktemp("crash"))  # its own topics and group
    own.create_topics()
    results = Published(own)
    crashing = spawn_applier(own, kube, api_proxy, "applier-1")
    takeover: subprocess.Popen[bytes] | None = None
    try:
        api_proxy.before_answering("/vm-c/restart", crashing.kill)  # SIGKILL: the request took effect, unanswered
        restart = command("restart_vm", vm_ref(kube_namespace, "vm-c")).model_copy(
            update={"issued_at": datetime.now(UTC)})
        publish(own, restart)
        eventually(lambda: crashing.poll() is not None, "the applier to be killed")
        assert results.results(restart.command_id) == []

        takeover = spawn_applier(own, kube, api_proxy, "applier-2")
        assert results.result(restart)["outcome"] == "applied"
        puts = api_proxy.statuses(f"/{kube_namespace}/virtualmachines/vm-c/restart")
        assert puts == [202], "one restart reached virt-api, and only one"
        running_vmi(api, kube_namespace, "vm-c", other_than=first["metadata"]["uid"])
        assert len(results.results(restart.command_id)) == 1
    finally:
        for process in (crashing, takeover):
            stop(process)
        results.close()
        own.delete_topics()


def test_a_killed_applier_restarted_at_once_applies_again_within_its_session(
    api: client.ApiClient, kube: Kube, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory,
    make_node: Callable[..., str], api_proxy: ApiProxy,
) -> None:
    """kill -9 of the applier, started again at once (as a kubelet restarts a container):
    with static group membership it applies again well before its predecessor's session
    (60 s here, so nothing else can bring it back in time) has ended. The bound is loose on
    purpose; ``benchmarks/recovery.py`` measures the figure."""
    bound = 30.0
    static = {"VMSTREAM_WORKER__GROUP_INSTANCE_ID": "apply-0", "VMSTREAM_WORKER__SESSION_TIMEOUT_SECONDS": "60"}
    own = Deployment(kafka_bootstrap, tmp_path_factory.mktemp("recovery"))  # its own topics and group
    own.create_topics()
    results = Published(own)
    node = make_node(gpus={A100: 1})
    target = ObjectRef(kind="Node", name=node)
    processes = [spawn_applier(own, kube, api_proxy, "applier-1", env=static)]
    try:
        cordon = command("cordon_node", target, requested_by=OPERATOR)
        publish(own, cordon)
        assert results.result(cordon)["outcome"] == "applied"  # the first one consumes: it is in the group

        processes[0].kill()
        killed = time.monotonic()
        processes[0].wait()
        processes.append(spawn_applier(own, kube, api_proxy, "applier-2", env=static))
        uncordon = command("uncordon_node", target, requested_by=OPERATOR)
        publish(own, uncordon)
        assert results.result(uncordon, timeout=max(0.0, bound - (time.monotonic() - killed)))["outcome"] == "applied"
        assert not unschedulable(api, node)
    finally:
        for process in processes:
            stop(process)
        results.close()
        own.delete_topics()


def test_partitions_taken_away_while_a_command_is_in_flight_leave_the_applier_applying(
    api: client.ApiClient, kube: Kube, kube_namespace: str, kafka_bootstrap: str,
    tmp_path_factory: pytest.TempPathFactory, make_node: Callable[..., str], api_proxy: ApiProxy,
) -> None:
    """A second applier joins while the first one's restart is held at virt-api, and the
    restart's partition goes to it: the first finishes what it read before it gives the
    partition up (its revoke callback waits for the restart, publishes the result and commits),
    so the second starts past the restart and applies it no second time; afterwards both go
    on applying — every command gets one result.

    The members are static, ``apply-a`` and ``apply-b``: the range assignor hands out
    partitions in the order of the member ids, which begin with the instance ids, so the
    last partition is the second member's. The VM is named so that its key lands there."""
    own = Deployment(kafka_bootstrap, tmp_path_factory.mktemp("handover"))  # its own topics and group
    partitions = own.kafka.partitions
    name = next(f"vm-r{i}" for i in range(10_000)
                if murmur2_partition(subject_key(vm_ref(kube_namespace, f"vm-r{i}")).encode(), partitions)
                == partitions - 1)
    make_node()
    manifest = minimal_vm(name)
    manifest["spec"]["runStrategy"] = "Always"
    client.CustomObjectsApi(api).create_namespaced_custom_object(*KUBEVIRT, kube_namespace, "virtualmachines", manifest)
    running_vmi(api, kube_namespace, name)
    own.create_topics()
    results = Published(own)
    admin = admin_client(own.kafka, client_id="vmstream-tests")
    group = f"{own.app_id}-applier"
    arrived, held = threading.Event(), threading.Event()

    def hold() -> None:  # the restart took effect; its answer waits (under the client's 30 s read timeout)
        arrived.set()
        held.wait(DEADLINE)

    def member(instance: str) -> dict[str, str]:
        return {"VMSTREAM_WORKER__GROUP_INSTANCE_ID": instance}

    processes = [spawn_applier(own, kube, api_proxy, "applier-1", env=member("apply-a"))]
    try:
        api_proxy.before_answering(f"/{name}/restart", hold)
        restart = command("restart_vm", vm_ref(kube_namespace, name)).model_copy(update={"issued_at": datetime.now(UTC)})
        publish(own, restart)
        assert arrived.wait(DEADLINE), "the restart never reached virt-api"
        processes.append(spawn_applier(own, kube, api_proxy, "applier-2", env=member("apply-b")))

        def state() -> ConsumerGroupState:
            described = admin.describe_consumer_groups([group], request_timeout=ADMIN_SECONDS)[group].result()
            return described.state  # type: ignore[no-any-return]  # unannotated in confluent-kafka

        rebalancing = (ConsumerGroupState.PREPARING_REBALANCING, ConsumerGroupState.COMPLETING_REBALANCING)
        eventually(lambda: state() in rebalancing,
                   "the group to rebalance while the restart is held", timeout=DEADLINE)
        # The broker's view, for a while: the rebalance cannot end while the first applier
        # is still finishing the restart in its revoke callback.
        watched_until = time.monotonic() + HANDOVER_WATCH_SECONDS
        seen = {state()}
        while ConsumerGroupState.STABLE not in seen and time.monotonic() < watched_until:
            time.sleep(0.05)
            seen.add(state())
        assert ConsumerGroupState.STABLE not in seen, "the partitions were handed over while a command read from them was in flight"
        held.set()
        assert results.result(restart)["outcome"] == "applied"

        nodes = [make_node() for _ in range(6)]  # keys over the partitions of both appliers
        cordons = [command("cordon_node", ObjectRef(kind="Node", name=n), requested_by=OPERATOR) for n in nodes]
        for cordon in cordons:
            publish(own, cordon)
        assert [results.result(c)["outcome"] for c in cordons] == ["applied"] * len(cordons)
        assert all(unschedulable(api, n) for n in nodes)
        assert len(results.results(restart.command_id)) == 1
        restarts = api_proxy.statuses(f"/{kube_namespace}/virtualmachines/{name}/restart")
        assert restarts == [202], "one restart reached virt-api, and only one"
    finally:
        held.set()
        for process in processes:
            stop(process)
        results.close()
        own.delete_topics()
