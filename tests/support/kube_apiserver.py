"""Pytest plugin: a real Kubernetes API server for tests (``-p tests.support.kube_apiserver``).

With ``KUBECONFIG`` set, tests run against that cluster (which must already run KubeVirt and
have medik8s' CRDs). Otherwise a local etcd + kube-apiserver with those CRDs and KubeVirt's
own virt-api and virt-controller is started once per session
(``harness.localkube.LocalKube(kubevirt=True)``), with the node agent
(``harness.node_agent``) playing the scheduler, the kubelet and virt-handler: objects
are validated by the same schemas and webhooks a KubeVirt cluster applies, and VMIs come and
go as KubeVirt makes them. Tests isolate themselves by namespace.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from harness.localkube import LocalKube
from harness.localkubevirt import HANDLER_USER, SERVICE_ACCOUNT_GROUPS
from harness.node_agent import NodeAgent
from tests.support.waiting import eventually


@dataclass(frozen=True)
class Kube:
    """How a test reaches the API server; ``local`` and ``agent`` are None for a cluster given
    by KUBECONFIG (its nodes are real)."""

    kubeconfig: Path
    local: LocalKube | None = None
    agent: NodeAgent | None = None

    def api_client(self) -> client.ApiClient:
        """A new admin client; close it (``with kube.api_client() as api:``)."""
        return config.new_client_from_config(config_file=str(self.kubeconfig))


def minimal_vm(name: str) -> dict[str, Any]:
    """The smallest VirtualMachine KubeVirt's schema accepts: halted, 128Mi, no devices."""
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {
            "runStrategy": "Halted",
            "template": {"spec": {"domain": {"devices": {}, "memory": {"guest": "128Mi"}}}},
        },
    }


def reconciled_vm(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """The VM once virt-controller has first reconciled it: its finalizer set, its status
    written, its instance type's and preference's revisions stored and, last, its Ready
    condition (five writes in KubeVirt 1.7 for a new VM): a version a plan can be based on without KubeVirt's first writes making it stale
    a moment later. A VM that runs changes with its VMI still."""
    custom = client.CustomObjectsApi(api)

    def probe() -> dict[str, Any] | None:
        vm: dict[str, Any] = custom.get_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines", name)
        status, metadata = vm.get("status") or {}, vm["metadata"]
        spec = vm.get("spec") or {}
        done = ("kubevirt.io/virtualMachineControllerFinalize" in (metadata.get("finalizers") or [])
                and status.get("printableStatus")
                and any(c.get("type") == "Ready" for c in status.get("conditions") or [])  # its last first write
                # the revisions of its instance type and preference, stored once found
                and all(status.get(f"{kind}Ref") for kind in ("instancetype", "preference") if spec.get(kind)))
        return vm if done else None

    return eventually(probe, f"virt-controller to reconcile VM {namespace}/{name}")


def as_others_write_it(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    """An object less what KubeVirt writes on its own: its status, finalizers, versions and
    managed fields, and its ``kubevirt.io`` labels and annotations. Two reads of an object
    nobody else touched compare equal this way, whatever virt-controller did meanwhile."""
    if obj is None:
        return None
    metadata = obj.get("metadata") or {}
    kept = {key: value for key, value in metadata.items()
            if key not in ("resourceVersion", "managedFields", "generation", "finalizers", "labels", "annotations")}
    for key in ("labels", "annotations"):
        kept[key] = {k: v for k, v in (metadata.get(key) or {}).items() if "kubevirt.io/" not in k}
    return {**{k: v for k, v in obj.items() if k not in ("status", "metadata")}, "metadata": kept}


@pytest.fixture(scope="session")
def kube() -> Iterator[Kube]:
    env = os.environ.get("KUBECONFIG")
    if env:
        yield Kube(Path(env))
        return
    with LocalKube(kubevirt=True) as local, local.api_client() as admin:
        handler_kubeconfig = local.client_cert(HANDLER_USER, SERVICE_ACCOUNT_GROUPS)
        with config.new_client_from_config(config_file=str(handler_kubeconfig)) as handler, \
                NodeAgent(admin, handler) as agent:
            yield Kube(local.kubeconfig, local, agent)


@pytest.fixture
def kube_namespace(kube: Kube) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards. Without a namespace controller locally it
    stays Terminating (its name is unique, so that does no harm) and nothing in it is deleted
    with it: its VMs and VMIs are deleted first, and KubeVirt's launcher pods awaited, so that
    no VM of this test takes a card on a later test's node."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        try:
            yield name
        finally:
            empty_of_kubevirt(api, name)
            core.delete_namespace(name)


def empty_of_kubevirt(api: client.ApiClient, namespace: str) -> None:
    """Delete the namespace's VMs and VMIs and wait for their launcher pods to be gone."""
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    for plural in ("virtualmachines", "virtualmachineinstances"):
        for item in custom.list_namespaced_custom_object("kubevirt.io", "v1", namespace, plural)["items"]:
            with contextlib.suppress(ApiException):
                custom.delete_namespaced_custom_object("kubevirt.io", "v1", namespace, plural, item["metadata"]["name"])
    eventually(lambda: not core.list_namespaced_pod(namespace, label_selector="kubevirt.io=virt-launcher").items,
               f"KubeVirt to remove the launcher pods of {namespace}")
