"""A GPU VM made with kubectl, brought under the GPU rules through the real API server.

The engine (tests/support/harness.py) observes the VM as the API server serves it; the applier's
:class:`~streams.kube.applying.KubeApplier` sends the command it decides. The stored VM must pass
KubeVirt's schema, follow the rules, name ``vmstream`` as the manager of the fields it set
(managedFields: what Argo CD and Flux read, docs/gitops.md), and — observed again — lead to
nothing more. A set_gpu that lands first is never undone by the enforcement planned before it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from handlers.rules.enforcement import FIELD_MANAGER
from handlers.rules.gpus import gpu_devices, rule_gaps
from samples.cluster import A100, PROJECT_LABEL, RTX, vm
from streams.kube.applying import KUBEVIRT, KubeApplier
from tests.support.harness import Harness
from tests.support.kube_apiserver import Kube, reconciled_vm
from tests.support.kubevirt_schema import validate_vm

pytestmark = pytest.mark.kube

ALICE = "alice@example.com"


@pytest.fixture
def project_namespace(kube_namespace: str, api: client.ApiClient) -> str:
    client.CoreV1Api(api).patch_namespace(kube_namespace, {"metadata": {"labels": {PROJECT_LABEL: "proj-a"}}})
    return kube_namespace


def kubectl_create(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """The VM as kubectl creates it, once virt-controller has made its own first writes (a
    Halted VM, so that they end): the version the worker would plan on."""
    obj = vm(namespace, name, project="proj-a", owner=ALICE, gpu=RTX, gpu_rules=False, run_strategy="Halted")
    for field in ("uid", "resourceVersion", "generation"):
        del obj["metadata"][field]
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        *KUBEVIRT, namespace, "virtualmachines", obj, field_manager="kubectl-create")
    return reconciled_vm(api, namespace, name)


def stored(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        *KUBEVIRT, namespace, "virtualmachines", name)
    return found


def managed_by(obj: dict[str, Any], manager: str) -> str:
    """The fields ``manager`` owns on ``obj``, as the JSON of its managedFields entries."""
    return json.dumps([entry.get("fieldsV1") for entry in obj["metadata"].get("managedFields") or ()
                       if entry.get("manager") == manager])


def test_a_kubectl_gpu_vm_is_patched_once_under_the_vmstream_field_manager(
        kube: Kube, api: client.ApiClient, project_namespace: str) -> None:
    created = kubectl_create(api, project_namespace, "hand-1")
    h = Harness()
    [command] = h.observe(created).decision.commands
    assert command.type == "patch_vm" and command.mutation is not None and command.mutation.enforce
    applied = KubeApplier(api).apply(command)
    assert applied.outcome == "applied", applied.error

    after = stored(api, project_namespace, "hand-1")
    validate_vm(after)  # KubeVirt's schema, strictly: nothing of ours was pruned
    assert rule_gaps(after, eviction_strategy="External") == []
    mine = managed_by(after, FIELD_MANAGER)
    for field in ('"f:evictionStrategy"', '"f:model"', '"f:requests"', '"f:vmstream.io/pre-gpu"'):
        assert field in mine, f"{field} is not managed by {FIELD_MANAGER}: {mine}"
    assert '"f:gpus"' in managed_by(after, "kubectl-create")  # the GPU stays kubectl's

    # The event the patch causes: the VM as now stored, observed — nothing more to do.
    result = h.observe(after, "MODIFIED")
    assert result.decision.commands == [] and result.decision.notifications == []


def test_an_enforcement_planned_before_a_set_gpu_never_undoes_it(
        kube: Kube, api: client.ApiClient, project_namespace: str) -> None:
    created = kubectl_create(api, project_namespace, "hand-2")
    h = Harness()
    [enforce] = h.observe(created).decision.commands
    [change] = h.intent("set_gpu", {"namespace": project_namespace, "name": "hand-2", "gpu_class": "nvidia-a100"},
                        by=ALICE).decision.commands
    applier = KubeApplier(api)
    assert applier.apply(change).outcome == "applied"
    # The enforcement's base resourceVersion is stale: the applier plans it again, and an
    # enforce mutation leaves a VM alone that no longer has that GPU.
    late = applier.apply(enforce)
    assert late.outcome == "noop", late.error
    after = stored(api, project_namespace, "hand-2")
    assert gpu_devices(after) == [A100] and rule_gaps(after, eviction_strategy="External") == []
