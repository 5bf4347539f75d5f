"""permittedHostDevices on KubeVirt's own control plane: why vmstream refuses up front.

KubeVirt checks a GPU against ``permittedHostDevices`` only when virt-controller renders the
launcher pod (``validatePermittedHostDevices``, pkg/virt-controller/services/renderresources.go),
not at admission: the VM is accepted and its VMI never starts. vmstream's rules refuse such a
``set_gpu`` before anything is written (handlers/rules/admission.py, tests/rules/test_refused_up_front.py);
here the same KubeVirt CR, as the API server serves it, leads the rules to that refusal while
the real virt-controller shows what would have happened without it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from harness.localkubevirt import NAMESPACE as KUBEVIRT_NAMESPACE
from samples.cluster import A100, PROJECT_LABEL, RTX, vm
from tests.support.harness import Harness, config
from tests.support.kube_apiserver import Kube
from tests.support.waiting import eventually

pytestmark = [pytest.mark.kube]

KUBEVIRT = ("kubevirt.io", "v1")
A100_ONLY = {"pciHostDevices": [{"pciVendorSelector": "10DE:20F1", "resourceName": A100,
                                 "externalResourceProvider": True}]}


@pytest.fixture
def a100_only(kube: Kube, api: client.ApiClient) -> Iterator[dict[str, Any]]:
    """The session's KubeVirt CR permitting A100 cards alone; as it was again afterwards."""
    if kube.local is None:
        pytest.skip("changes the KubeVirt CR: only on the local control plane")
    custom = client.CustomObjectsApi(api)

    def configure(permitted: dict[str, Any] | None) -> dict[str, Any]:
        patched: dict[str, Any] = custom.patch_namespaced_custom_object(
            *KUBEVIRT, KUBEVIRT_NAMESPACE, "kubevirts", "kubevirt",
            {"spec": {"configuration": {"permittedHostDevices": permitted}}})
        return patched

    try:
        yield configure(A100_ONLY)
    finally:
        configure(None)


def _vmi(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = custom.get_namespaced_custom_object(*KUBEVIRT, namespace, "virtualmachineinstances",
                                                                     name)
        return found
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_a_gpu_not_permitted_is_admitted_and_its_vmi_never_starts_so_vmstream_refuses_it_first(
    api: client.ApiClient, kube_namespace: str, a100_only: dict[str, Any]
) -> None:
    custom = client.CustomObjectsApi(api)
    name = f"rtx-{uuid.uuid4().hex[:6]}"
    body = vm(kube_namespace, name, project="proj-a", owner="alice@example.com", gpu=RTX)
    for field in ("uid", "resourceVersion", "generation"):
        del body["metadata"][field]
    custom.create_namespaced_custom_object(*KUBEVIRT, kube_namespace, "virtualmachines", body)  # admitted

    def refused_at_rendering() -> str | None:
        conditions = ((_vmi(custom, kube_namespace, name) or {}).get("status") or {}).get("conditions") or []
        return next((c["message"] for c in conditions if c.get("type") == "Synchronized"
                     and c.get("reason") == "FailedCreate"), None)

    message = eventually(refused_at_rendering, "virt-controller to fail rendering the launcher pod")
    assert f"GPU {RTX} is not permitted in permittedHostDevices" in message
    assert client.CoreV1Api(api).list_namespaced_pod(kube_namespace).items == []  # it never starts

    # vmstream, given the same CR as the API server serves it, refuses that GPU up front.
    h = Harness(config(namespaces={"projects": {kube_namespace: "proj-a"}}))
    h.observe(a100_only)
    other = vm(kube_namespace, "web-1", project="proj-a", owner="alice@example.com")
    other["metadata"]["labels"][PROJECT_LABEL] = "proj-a"
    h.observe(other)
    refused = h.intent("set_gpu", {"namespace": kube_namespace, "name": "web-1",
                                   "gpu_class": "nvidia-rtx-pro-6000-bse"}, by="alice@example.com")
    audit = refused.decision.audit
    assert audit is not None and audit.outcome == "rejected" and refused.decision.commands == []
    assert "permittedHostDevices" in (audit.reason or ""), audit.reason
    allowed = h.intent("set_gpu", {"namespace": kube_namespace, "name": "web-1", "gpu_class": "nvidia-a100"},
                       by="alice@example.com")
    assert [c.type for c in allowed.decision.commands] == ["patch_vm"]
