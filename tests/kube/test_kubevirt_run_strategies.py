"""KubeVirt's own virt-controller as the oracle for what vmstream tells owners.

A drain deletes a GPU VM's VMI and tells the owner whether it comes back by itself
(``handlers.rules.drains.RESTARTS_AFTER_DELETION``); a VMI that ends (the guest crashed, or shut
itself down) is replaced or not as docs/kubevirt.md's table says. Both are checked here
against the real virt-controller and virt-api of the session's control plane, with the node
agent playing the scheduler, the kubelet and virt-handler.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from handlers.rules.drains import RESTARTS_AFTER_DELETION, restarts_by_itself
from harness.localkubevirt import vm_subresource
from harness.node_agent import NodeAgent
from samples.cluster import node as node_object
from tests.support.kube_apiserver import Kube, minimal_vm
from tests.support.waiting import eventually

pytestmark = [pytest.mark.kube]

KUBEVIRT = ("kubevirt.io", "v1")


@pytest.fixture
def agent(kube: Kube) -> NodeAgent:
    if kube.agent is None:
        pytest.skip("VMIs run only where the node agent plays the nodes (the local control plane)")
    return kube.agent


@pytest.fixture
def node(api: client.ApiClient) -> Iterator[str]:
    """A Ready node for this test's VMIs, deleted afterwards."""
    name = f"node-{uuid.uuid4().hex[:8]}"
    obj = node_object(name)
    for field in ("uid", "resourceVersion"):
        del obj["metadata"][field]
    client.CoreV1Api(api).create_node(obj)
    yield name
    client.CoreV1Api(api).delete_node(name)


class VMs:
    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.custom = client.CustomObjectsApi(api)

    def create(self, name: str, strategy: str) -> None:
        manifest = minimal_vm(name)
        manifest["spec"]["runStrategy"] = strategy
        self.custom.create_namespaced_custom_object(*KUBEVIRT, self.namespace, "virtualmachines", manifest)

    def get(self, plural: str, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self.custom.get_namespaced_custom_object(*KUBEVIRT, self.namespace, plural, name)
            return found
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def running(self, name: str, *, other_than: str | None = None) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            vmi = self.get("virtualmachineinstances", name)
            if vmi is None or vmi["metadata"]["uid"] == other_than:
                return None
            return vmi if (vmi.get("status") or {}).get("phase") == "Running" else None
        return eventually(probe, f"VMI {name} running")

    def subresource(self, name: str, action: str) -> None:
        vm_subresource(self.api, self.namespace, name, action)

    def delete_vmi(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(*KUBEVIRT, self.namespace, "virtualmachineinstances", name)

    def printable(self, name: str) -> str | None:
        return ((self.get("virtualmachines", name) or {}).get("status") or {}).get("printableStatus")

    def settles(self, name: str, *, comes_back: bool, gone: str) -> None:
        """Either a VMI other than ``gone`` appears, or virt-controller writes the VM Stopped
        (after it decided not to start one) and none has appeared."""
        if comes_back:
            eventually(lambda: (self.get("virtualmachineinstances", name) or {"metadata": {"uid": gone}})
                       ["metadata"]["uid"] != gone, f"a new VMI for {name}")
            return
        eventually(lambda: self.printable(name) == "Stopped" and self.get("virtualmachineinstances", name) is None,
                   f"{name} Stopped without a VMI")


@pytest.fixture
def vms(api: client.ApiClient, kube_namespace: str) -> VMs:
    return VMs(api, kube_namespace)


@pytest.mark.parametrize("strategy", ["Always", "Once", "RerunOnFailure", "Manual"])
def test_a_deleted_vmi_comes_back_exactly_when_the_drain_rules_say(
    strategy: str, vms: VMs, node: str, agent: NodeAgent
) -> None:
    """What a drain does (it deletes the VMI) and what its notice promises, for each strategy
    a VM can run under: virt-controller's syncRunStrategy decides."""
    vms.create("v", strategy)
    if strategy == "Manual":
        vms.subresource("v", "start")  # Manual VMs are created stopped
    first = vms.running("v")
    vms.delete_vmi("v")
    vms.settles("v", comes_back=restarts_by_itself(strategy), gone=first["metadata"]["uid"])


def test_a_halted_vm_never_runs_and_the_rules_expect_no_return(vms: VMs, node: str, agent: NodeAgent) -> None:
    assert RESTARTS_AFTER_DELETION["Halted"] is False
    vms.create("h", "Halted")
    eventually(lambda: vms.printable("h") == "Stopped", "h Stopped")
    assert vms.get("virtualmachineinstances", "h") is None


@pytest.mark.parametrize(("strategy", "ended", "replaced"), [
    ("Always", "Failed", True),
    ("Always", "Succeeded", True),
    ("RerunOnFailure", "Failed", True),
    ("RerunOnFailure", "Succeeded", False),
    ("Once", "Failed", False),
    ("Once", "Succeeded", False),
    ("Manual", "Succeeded", False),
])
def test_an_ended_vmi_is_replaced_as_docs_kubevirt_says(
    strategy: str, ended: str, replaced: bool, vms: VMs, node: str, agent: NodeAgent
) -> None:
    """docs/kubevirt.md, "VMI ended, still there": the guest crashed (Failed) or shut itself
    down (Succeeded) — virt-handler reports it, virt-controller decides."""
    vms.create("e", strategy)
    if strategy == "Manual":
        vms.subresource("e", "start")
    first = vms.running("e")
    end: Callable[[str, str], None] = agent.fail if ended == "Failed" else agent.finish
    end(vms.namespace, "e")
    if replaced:
        vms.running("e", other_than=first["metadata"]["uid"])
        return
    eventually(lambda: vms.printable("e") in ("Stopped", "Succeeded", "Failed"), f"e {ended}, told by virt-controller")
    now = vms.get("virtualmachineinstances", "e")
    assert now is None or now["metadata"]["uid"] == first["metadata"]["uid"], "replaced, against the table"
