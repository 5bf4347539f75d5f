"""The whole loop against real parts: API server + KubeVirt + Kafka + watch bridge + worker + applier.

KubeVirt is its own virt-controller and virt-api (the session's control plane,
``tests/support/kube_apiserver.py``); only the scheduler, the kubelet and virt-handler are
played, by the node agent (``harness/node_agent.py``). Everything else is vmstream as it
ships, each part in its own process, talking through a real broker to a real kube-apiserver.
Each test starts from a cluster without Nodes, VMs or NodeMaintenances and leaves it so.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from harness.node_agent import LAUNCHER_SELECTOR, NodeAgent
from harness.running import CONFIG, Deployment, Outputs, VmstreamProcess, WorkerProcess
from samples.cluster import PROJECT_LABEL, RTX
from samples.cluster import node as node_object
from streams.common.credentials import DevSigner
from tests.support.kubevirt_schema import validate_vm
from tests.support.kube_apiserver import Kube
from tests.support.waiting import eventually

pytestmark = [pytest.mark.kube, pytest.mark.kafka]

NAMESPACE = "spx-proj-a"
ALICE, OPS = "alice@example.com", "ops@example.com"
KUBEVIRT = ("kubevirt.io", "v1")
T = TypeVar("T")
NOTICE_SECONDS = 3
LOOP_DEADLINE = 90.0  # a whole loop: worker, applier, API server, KubeVirt and the node agent


@dataclass
class Loop:
    api: client.ApiClient
    deployment: Deployment
    outputs: Outputs
    worker: WorkerProcess
    applier: VmstreamProcess
    agent: NodeAgent
    signer: DevSigner  # the upstream service: the worker verifies what it signs (docs/auth.md)
    bridge: VmstreamProcess | None = None  # the watch bridge, for a test that stops it a while

    # ------------------------------------------------------------ the cluster

    def node(self, name: str, *, gpus: dict[str, int]) -> None:
        obj = node_object(name, gpus=gpus)
        for field in ("uid", "resourceVersion"):
            del obj["metadata"][field]
        client.CoreV1Api(self.api).create_node(obj)

    def vm(self, name: str, *, run_strategy: str, gpu: str | None = None,
           eviction_strategy: str | None = "External", owner: str = ALICE,
           annotations: dict[str, str] | None = None) -> None:
        """A VM; with ``gpu``, the device and ``host-passthrough``, and (by default) the
        eviction strategy vmstream's GPU rules give it."""
        domain: dict[str, Any] = {
            "cpu": {"sockets": 1, "cores": 2, "threads": 1},
            "memory": {"guest": "4Gi"},
            "devices": {"disks": [{"name": "containerdisk", "disk": {"bus": "virtio"}}]},
        }
        template: dict[str, Any] = {"domain": domain, "volumes": [
            {"name": "containerdisk", "containerDisk": {"image": "quay.io/containerdisks/ubuntu:24.04"}}]}
        if gpu:  # as vmstream's GPU rules make it
            domain["devices"]["gpus"] = [{"name": "gpu-0", "deviceName": gpu}]
            domain["cpu"]["model"] = "host-passthrough"
            if eviction_strategy:
                template["evictionStrategy"] = eviction_strategy
        body = {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {PROJECT_LABEL: "proj-a"},
                         "annotations": {"vmstream.io/owner": owner, **(annotations or {})}},
            "spec": {"runStrategy": run_strategy, "template": {"spec": template}},
        }
        client.CustomObjectsApi(self.api).create_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachines", body)

    def get(self, plural: str, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                *KUBEVIRT, NAMESPACE, plural, name)
            return found
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def running_vmi(self, name: str, *, not_on: str | None = None, other_than: str | None = None) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            vmi = self.get("virtualmachineinstances", name)
            status = (vmi or {}).get("status") or {}
            if vmi is None or status.get("phase") != "Running" or status.get("nodeName") == not_on:
                return None
            return None if vmi["metadata"]["uid"] == other_than else vmi
        return eventually(probe, f"VMI {name} running", timeout=LOOP_DEADLINE)

    def evict(self, name: str) -> ApiException:
        """Ask the Eviction API to evict the VM's launcher pod, as ``kubectl drain`` does; returns
        the refusal (virt-api's webhook refuses the eviction of a VMI with ``evictionStrategy: External``)."""
        core = client.CoreV1Api(self.api)
        [pod] = core.list_namespaced_pod(NAMESPACE, label_selector=f"{LAUNCHER_SELECTOR},vm.kubevirt.io/name={name}").items
        try:
            core.create_namespaced_pod_eviction(pod.metadata.name, NAMESPACE, client.V1Eviction(
                metadata=client.V1ObjectMeta(name=pod.metadata.name, namespace=NAMESPACE)))
        except ApiException as exc:
            return exc
        raise AssertionError(f"the launcher pod of {name} was evicted")

    def stopped_for_good(self, name: str) -> None:
        """virt-controller has reconciled the VM without its VMI (printableStatus Stopped, written
        after it decided not to start one) and no VMI came back."""
        eventually(lambda: ((self.get("virtualmachines", name) or {}).get("status") or {}).get("printableStatus")
                   == "Stopped", f"VM {name} Stopped", timeout=LOOP_DEADLINE)
        assert self.get("virtualmachineinstances", name) is None

    def cordoned(self, node: str) -> bool:
        return bool(client.CoreV1Api(self.api).read_node(node).spec.unschedulable)

    # ---------------------------------------------------------------- vmstream

    def intent(self, type_: str, spec: dict[str, Any], *, by: str, project: str | None = None) -> str:
        intent_id = f"it-{uuid.uuid4().hex[:10]}"
        if "plan" in spec:  # a maintenance plan's intents are decided under the plan
            key = f"maintenance/{spec['plan']}"
        else:
            key = f"node/{spec['node']}" if "node" in spec else f"vm/{spec['namespace']}/{spec['name']}"
        value: dict[str, Any] = {"intent_id": intent_id, "type": type_, "requested_by": by, "spec": spec}
        if project:
            value["project"] = project
        self.deployment.publish_raw("intents", key, json.dumps(self.signer.sign(value)).encode())
        return intent_id

    def seen_by_worker(self, name: str) -> None:
        """The worker has decided watch events showing the VM and its VMI running: the VM's
        and the VMI's watches and partitions are apart, and a drain's outcome for the VM
        reads both (its run strategy, where its VMI runs)."""
        keys = {f"VirtualMachine/{NAMESPACE}/{name}", f"VirtualMachineInstance/{NAMESPACE}/{name}"}
        self.outputs.wait_for(lambda o: keys <= {a["input"]["key"] for a in o.seen["audit"]},
                              timeout=90, what=f"the worker to observe {sorted(keys)}")

    def result_of(self, intent_id: str) -> list[dict[str, Any]]:
        """The results of every command the intent caused, once all have one."""
        def done(o: Outputs) -> bool:
            audits = o.audits(input__ref=intent_id)
            ids = [c for a in audits for c in a["commands"]]
            return bool(audits) and all(any(r["command_id"] == c for r in o.seen["command-results"]) for c in ids)
        self.outputs.wait_for(done, timeout=90, what=f"the results of {intent_id}")
        [audit] = self.outputs.audits(input__ref=intent_id)
        return [r for r in self.outputs.seen["command-results"] if r["command_id"] in audit["commands"]]


@pytest.fixture
def loop(kube: Kube, kafka_bootstrap: str, tmp_path: Path) -> Iterator[Loop]:
    if kube.agent is None:
        pytest.skip("the loop plays nodes: it needs the local control plane, not a cluster given by KUBECONFIG")
    api = kube.api_client()
    _clean(api)
    core = client.CoreV1Api(api)
    try:
        core.create_namespace({"metadata": {"name": NAMESPACE, "labels": {PROJECT_LABEL: "proj-a"}}})
    except ApiException as exc:
        if exc.status != 409:
            raise
    deployment = Deployment(kafka_bootstrap, tmp_path)
    deployment.create_topics()
    kubeconfig = str(kube.kubeconfig)
    signer = DevSigner(tmp_path, operators=["ops@example.com"])
    # Evictions and NodeMaintenances are announced with the configured notice: seconds here.
    worker = WorkerProcess(deployment, "worker", env={**signer.worker_env(),
                                                       "VMSTREAM_DRAIN__NOTICE_SECONDS": str(NOTICE_SECONDS)}).start()
    bridge = VmstreamProcess(deployment, "watch", ["watch", "--config", str(CONFIG), "--kubeconfig", kubeconfig])
    applier = VmstreamProcess(deployment, "apply", ["apply", "--config", str(CONFIG), "--kubeconfig", kubeconfig])
    outputs = Outputs(deployment)
    history_before = len(kube.agent.history)
    try:
        bridge.start()
        applier.start()
        yield Loop(api, deployment, outputs, worker, applier, kube.agent, signer, bridge)
    finally:
        print(_timeline(outputs, kube.agent.history[history_before:]))  # shown only when the test fails
        outputs.close()
        for process in (bridge, applier, worker):
            process.stop()
        _clean(api)
        api.close()


def _timeline(outputs: Outputs, agent_history: list[str]) -> str:
    """What vmstream wrote and what the node agent did, in the order seen."""
    lines = list(agent_history)
    for at, topic, value in outputs.arrivals:
        if topic == "audit":
            what = f"{value['input']['key']} {value['outcome']} commands={value['commands']}"
        elif topic == "commands":
            what = f"{value['command_id']} {value['type']} {value['target'].get('name')}"
        elif topic == "command-results":
            what = f"{value['command_id']} {value['outcome']}"
        elif topic == "notifications":
            what = f"{value['type']} {value['subject'].get('name')}"
        else:
            what = json.dumps(value)[:200]
        lines.append(f"{at.isoformat(timespec='milliseconds')} {topic}: {what}")
    return "\n".join(["timeline:", *sorted(lines)])


def _clean(api: client.ApiClient) -> None:
    """A cluster without the loop's VMs, any NodeMaintenance or any Node: VMs go first, and
    KubeVirt removes their VMIs and launcher pods (with the node agent) before the Nodes go."""
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    for plural in ("virtualmachines", "virtualmachineinstances"):
        for item in custom.list_namespaced_custom_object(*KUBEVIRT, NAMESPACE, plural)["items"]:
            with contextlib.suppress(ApiException):
                custom.delete_namespaced_custom_object(*KUBEVIRT, NAMESPACE, plural, item["metadata"]["name"])
    eventually(lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=LAUNCHER_SELECTOR).items
               and not custom.list_namespaced_custom_object(*KUBEVIRT, NAMESPACE, "virtualmachineinstances")["items"],
               f"KubeVirt to remove the VMIs and launcher pods of {NAMESPACE}", timeout=LOOP_DEADLINE)
    for item in custom.list_cluster_custom_object("nodemaintenance.medik8s.io", "v1beta1", "nodemaintenances")["items"]:
        custom.delete_cluster_custom_object("nodemaintenance.medik8s.io", "v1beta1", "nodemaintenances",
                                            item["metadata"]["name"])
    for node in core.list_node().items:
        core.delete_node(node.metadata.name)


def test_a_gpu_change_lands_in_kubernetes_waits_for_a_restart_and_the_restart_applies_it(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 2})
    loop.vm("dev-1", run_strategy="Always")
    first = loop.running_vmi("dev-1")
    loop.seen_by_worker("dev-1")

    set_gpu = loop.intent("set_gpu", {"namespace": NAMESPACE, "name": "dev-1",
                                      "gpu_class": "nvidia-rtx-pro-6000-bse"}, by=ALICE, project="proj-a")
    [result] = loop.result_of(set_gpu)
    assert result["outcome"] in ("applied", "conflict_retried"), result
    vm = loop.get("virtualmachines", "dev-1")
    assert vm is not None
    validate_vm({k: v for k, v in vm.items() if k != "status"}, allow_unknown_fields=True)
    template = vm["spec"]["template"]["spec"]
    assert template["domain"]["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": RTX}]
    assert template["domain"]["cpu"]["model"] == "host-passthrough"
    assert template["domain"]["resources"]["requests"]["memory"] == "4Gi"
    assert template["evictionStrategy"] == "External"
    [told] = loop.outputs.notifications("gpu_change_pending_restart")
    assert told["recipients"] == [ALICE]
    loop.worker.wait_until("/pending", lambda pending: [p["vm"] for p in pending] == [f"vm/{NAMESPACE}/dev-1"])

    restart = loop.intent("restart_vm", {"namespace": NAMESPACE, "name": "dev-1"}, by=ALICE, project="proj-a")
    assert [r["outcome"] for r in loop.result_of(restart)] == ["applied"]
    second = loop.running_vmi("dev-1", other_than=first["metadata"]["uid"])
    assert second["spec"]["domain"]["devices"]["gpus"] == [{"name": "gpu-0", "deviceName": RTX}]
    # The new VMI observed, its card counted: the old one's deletion alone clears /pending too.
    loop.worker.wait_for_capacity({"nvidia-rtx-pro-6000-bse": (2, 1)}, timeout=90)
    loop.worker.wait_until("/pending", lambda pending: pending == [])


def test_a_drain_tells_owners_cordons_stops_and_reports(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 2})
    loop.vm("train-1", run_strategy="Always", gpu=RTX)
    loop.vm("batch-1", run_strategy="RerunOnFailure", gpu=RTX)
    train, batch = loop.running_vmi("train-1"), loop.running_vmi("batch-1")
    assert train["status"]["nodeName"] == batch["status"]["nodeName"] == "gpu-node-1"
    loop.node("gpu-node-2", gpus={RTX: 1})
    loop.seen_by_worker("train-1")
    loop.seen_by_worker("batch-1")
    # Both nodes' cards and both VMIs on gpu-node-1: one free card alone is also what
    # gpu-node-1 shows with one of its VMIs counted before gpu-node-2 is seen.
    loop.worker.wait_until("/capacity", lambda c: (c["nvidia-rtx-pro-6000-bse"]["total"],
                                                   c["nvidia-rtx-pro-6000-bse"]["free"]) == (3, 1))

    loop.intent("drain_node", {"node": "gpu-node-1", "reason": "firmware upgrade", "notice_seconds": 3}, by=OPS)
    loop.outputs.wait_for(lambda o: len(o.notifications("drain_will_stop_gpu_vm")) == 2, what="announcements")
    fates = {n["subject"]["name"]: (n["details"]["outcome"], n["recipients"], n["deadline"])
             for n in loop.outputs.notifications("drain_will_stop_gpu_vm")}
    assert {name: fate[0] for name, fate in fates.items()} == {
        "train-1": "returns_automatically", "batch-1": "needs_manual_start"}
    assert all(fate[1] == [ALICE] and fate[2] for fate in fates.values())
    eventually(lambda: loop.cordoned("gpu-node-1"), "gpu-node-1 cordoned in the API server", timeout=LOOP_DEADLINE)

    # At the deadline the GPU VMIs go; the Always VM comes back on the other node.
    back = loop.running_vmi("train-1", not_on="gpu-node-1")
    assert back["status"]["nodeName"] == "gpu-node-2"
    eventually(lambda: loop.get("virtualmachineinstances", "batch-1") is None, "batch-1's VMI gone", timeout=LOOP_DEADLINE)
    loop.stopped_for_good("batch-1")  # RerunOnFailure stays off
    loop.outputs.wait_for(lambda o: o.notifications("drain_completed"), what="drain_completed")
    [done] = loop.outputs.notifications("drain_completed")
    assert done["recipients"] == [OPS] and done["details"]["gpu_vms"] == 2
    assert sorted(done["details"]["stopped_at_deadline"]) == [f"vm/{NAMESPACE}/batch-1", f"vm/{NAMESPACE}/train-1"]


def test_a_node_maintenance_created_directly_starts_the_same_announcements(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 1})
    loop.vm("train-1", run_strategy="Always", gpu=RTX)
    loop.running_vmi("train-1")
    loop.seen_by_worker("train-1")
    client.CustomObjectsApi(loop.api).create_cluster_custom_object(
        "nodemaintenance.medik8s.io", "v1beta1", "nodemaintenances",
        {"apiVersion": "nodemaintenance.medik8s.io/v1beta1", "kind": "NodeMaintenance",
         "metadata": {"name": "nm-gpu-node-1"}, "spec": {"nodeName": "gpu-node-1", "reason": "PSU replacement"}})
    loop.outputs.wait_for(lambda o: o.notifications("drain_will_stop_gpu_vm"), what="the announcement")
    [told] = loop.outputs.notifications("drain_will_stop_gpu_vm")
    assert told["subject"]["name"] == "train-1" and told["details"]["drain_source"] == "maintenance"
    assert "PSU replacement" in told["message"] and told["details"]["outcome"] == "waits_for_gpu"
    eventually(lambda: loop.cordoned("gpu-node-1"), "gpu-node-1 cordoned in the API server", timeout=LOOP_DEADLINE)


def test_a_vm_changed_while_its_command_waits_is_planned_again(loop: Loop) -> None:
    loop.node("gpu-node-1", gpus={RTX: 1})
    loop.vm("dev-2", run_strategy="Manual")
    loop.outputs.wait_for(lambda o: any(a["input"]["key"] == f"VirtualMachine/{NAMESPACE}/dev-2"
                                        for a in o.seen["audit"]), what="the worker to observe dev-2")
    loop.applier.stop()
    set_gpu = loop.intent("set_gpu", {"namespace": NAMESPACE, "name": "dev-2", "gpu_class": "nvidia-rtx-pro-6000-bse"},
                          by=ALICE, project="proj-a")
    loop.outputs.wait_for(lambda o: o.commands("patch_vm"), what="the patch command")
    # Someone else changes the VM before the applier gets to the command.
    client.CustomObjectsApi(loop.api).patch_namespaced_custom_object(
        *KUBEVIRT, NAMESPACE, "virtualmachines", "dev-2", {"metadata": {"labels": {"team": "ml"}}})
    loop.applier.start()
    [result] = loop.result_of(set_gpu)
    assert result["outcome"] == "conflict_retried"
    vm = loop.get("virtualmachines", "dev-2")
    assert vm is not None and vm["metadata"]["labels"]["team"] == "ml"
    assert vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"][0]["deviceName"] == RTX
